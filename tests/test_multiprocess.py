"""Shards started as separate processes through the CLI, stopped with signals."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from shardps_client import Adam, Client

from shardps.core.specs import Initializer
from tests.procs import freeze, start_shard, thread_states


def test_cli_cluster_trains_and_survives_sigterm_restart(tmp_path):
    data = tmp_path / "data"
    shards = [start_shard(i, 2, tmp_path, str(data / f"shard-{i}")) for i in range(2)]
    try:
        ids = torch.arange(0, 1000, 3)
        with Client([s.address for s in shards]) as c:
            c.create_table("emb", dim=8, num_embeddings=1000, optimizer=Adam(lr=0.05), initializer=Initializer(seed=7))
            c.register_dense("w", torch.ones(4, 4), optimizer=Adam(lr=0.05))
            for step in range(3):
                c.push("emb", ids, torch.full((ids.numel(), 8), float(step + 1)))
                c.push_dense("w", torch.full((4, 4), float(step)))
            c.flush()
            rows, dense = c.pull("emb", ids), c.pull_dense("w")[0]
            versions = [i.version for i in c.shard_info()]
        # SIGTERM: graceful stop with a final checkpoint, exit code 0.
        assert [s.terminate() for s in shards] == [0, 0]
        assert all("checkpoint shutdown" in s.log() for s in shards)
        shards = [start_shard(i, 2, tmp_path, str(data / f"shard-{i}")) for i in range(2)]
        with Client([s.address for s in shards]) as c:
            torch.testing.assert_close(c.pull("emb", ids), rows, rtol=0, atol=0)
            torch.testing.assert_close(c.pull_dense("w")[0], dense, rtol=0, atol=0)
            assert [i.version for i in c.shard_info()] == versions
            # Optimizer state survived: the next Adam step equals torch's 4th step from the same history.
            ref = torch.nn.Parameter(torch.ones(4, 4))
            opt = torch.optim.Adam([ref], lr=0.05)
            for step in range(4):
                ref.grad = torch.full((4, 4), float(step))
                opt.step()
            c.push_dense("w", torch.full((4, 4), 3.0), wait=True)
            torch.testing.assert_close(c.pull_dense("w")[0], ref.detach(), rtol=2e-6, atol=2e-6)
    finally:
        for s in shards:
            if s.proc.poll() is None:
                s.kill()


def test_stats_of_a_stopped_shard_fails_within_its_timeout_naming_the_shard(tmp_path):
    """`shardps stats` tries a refused connection again until its --timeout (a busy shard may answer late), then
    fails with the shard's address and gRPC's reason, not a traceback."""
    import subprocess
    import sys
    import time

    shard = start_shard(0, 1, tmp_path, str(tmp_path / "data"))
    try:
        ok = subprocess.run([sys.executable, "-m", "shardps", "stats", shard.address, "--interval", "0"],
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and "total: 1 shards" in ok.stdout, ok.stdout + ok.stderr
    finally:
        assert shard.terminate() == 0
    t0 = time.monotonic()
    dead = subprocess.run([sys.executable, "-m", "shardps", "stats", shard.address, "--interval", "0", "--timeout", "2"],
                          capture_output=True, text=True, timeout=60)
    assert dead.returncode == 1 and "Traceback" not in dead.stderr, dead.stderr
    assert f"shard at {shard.address}: UNAVAILABLE" in dead.stderr and "Connection refused" in dead.stderr, dead.stderr
    assert time.monotonic() - t0 < 30  # bounded by its --timeout (generously: no rate is asserted)


def test_restart_waits_for_its_port_while_another_socket_holds_it(tmp_path, monkeypatch):
    """A shard restarts on its own address. Another socket may take the port while it is down (in a busy
    machine, an outgoing connection's ephemeral end): ``shardps serve`` then exits with PORT_IN_USE_EXIT naming
    the port, and the launcher waits for the port and starts it again instead of failing the restart."""
    import socket
    import subprocess
    import sys
    import threading
    import time

    from shardps.probe import PORT_IN_USE_EXIT
    from shardps.server.ops import launcher

    ids = torch.arange(10)
    with launcher.LocalCluster(1, data_dir=str(tmp_path / "data"), log_dir=str(tmp_path / "logs")) as cluster:
        with Client(cluster.addresses) as c:
            c.create_table("emb", dim=4, num_embeddings=100)
            c.push("emb", ids, torch.ones(10, 4), wait=True)
            rows = c.pull("emb", ids)
        address = cluster.addresses[0]
        port = int(address.rsplit(":", 1)[1])
        log = tmp_path / "logs" / "shard-0.log"
        held = f"another socket holds port {port}"
        waited: list[bool] = []
        for seen_free in (False, True):  # the launcher sees the port held; then it saw it free, and lost the race
            cluster.kill(0)
            holder = socket.socket()
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", port))
            holder.listen()
            if not seen_free:
                out = subprocess.run([sys.executable, "-m", "shardps", "serve", "--host", "127.0.0.1", "--port",
                                      str(port), "--shard-index", "0", "--num-shards", "1"],
                                     capture_output=True, text=True, timeout=120)
                assert out.returncode == PORT_IN_USE_EXIT and held in out.stderr

                def release(holder: socket.socket = holder, old: object = cluster.procs[0]) -> None:
                    waited.append(cluster.procs[0] is old)  # no shard started yet while the port was held
                    holder.close()

                threading.Timer(1.5, release).start()
            else:
                monkeypatch.setattr(launcher, "wait_for_port", lambda host, port, deadline: None)

                def release_once_refused(holder: socket.socket = holder) -> None:
                    deadline = time.monotonic() + 100
                    while held not in log.read_text() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    holder.close()

                threading.Thread(target=release_once_refused, daemon=True).start()
            cluster.restart(0, timeout=120)
            # Waiting on the probe, the launcher never started a shard on the held port; told it was free, it did,
            # saw it refused and started it again.
            assert (held in log.read_text()) if seen_free else waited == [True]
            assert cluster.addresses == [address] and cluster.procs[0].restarts == (2 if seen_free else 1)
            with Client(cluster.addresses) as c:
                torch.testing.assert_close(c.pull("emb", ids), rows, rtol=0, atol=0)


def test_cli_flags_from_environment(tmp_path):
    shard = start_shard(
        0, 1, tmp_path, extra=[], env={"SHARDPS_NUM_SHARDS": "1", "SHARDPS_WORKERS": "2"},
    )
    try:
        with Client([shard.address]) as c:
            assert c.shard_info()[0].num_shards == 1
    finally:
        assert shard.terminate() == 0


def test_cli_rejects_bad_configuration(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "shardps", "serve", "--shard-index", "3", "--num-shards", "2"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0 and "shard index 3 is not in [0, 2)" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "shardps", "serve", "--num-shards", "2"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode != 0 and "--shard-index and --num-shards are required" in out.stderr


def test_server_package_never_imports_torch():
    import subprocess
    import sys

    code = (
        "import sys, shardps.server, shardps.server.ops.cli, shardps.server.ops.launcher, shardps.server.ops.reshard, shardps.server.ops.report, shardps.core.wire; "
        "assert 'torch' not in sys.modules, 'the server imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_local_cluster_removes_the_log_directory_it_made_and_keeps_it_when_it_failed(tmp_path, caplog):
    """``with LocalCluster(...)`` leaves nothing in the temp dir after a clean exit (its shard logs and throwaway
    certificates included); after an error the logs stay for the post-mortem and a warning says where; a log_dir
    the caller gave is never removed."""
    import shutil

    from shardps.server.ops import launcher

    with launcher.LocalCluster(1, tls="tls") as cluster:
        logs = pathlib.Path(cluster.log_dir)
        assert logs.name.startswith("shardps-logs-") and (logs / "shard-0.log").exists() and (logs / "tls").is_dir()
    assert not logs.exists()

    failed = None
    try:
        with pytest.raises(RuntimeError, match="on purpose"):
            with launcher.LocalCluster(1) as cluster:
                failed = pathlib.Path(cluster.log_dir)
                raise RuntimeError("on purpose")
        assert (failed / "shard-0.log").exists()
        assert f"shard logs are kept in {failed}" in caplog.text
    finally:
        if failed is not None:
            shutil.rmtree(failed, ignore_errors=True)

    given = tmp_path / "logs"
    with launcher.LocalCluster(1, log_dir=str(given)):
        pass
    assert (given / "shard-0.log").exists()


def test_freeze_returns_once_no_thread_of_the_process_runs(tmp_path):
    """``tests.procs.freeze``, the tests' SIGSTOP: when it returns, no thread of the process runs (a counter four
    threads advance stays put) until SIGCONT; a SIGSTOP alone left the other threads running for a moment."""
    counter = tmp_path / "counter"
    counter.write_bytes(bytes(8))
    child = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys, threading, time\n"
        "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 8)\n"
        "def spin():\n"
        "    while True:\n"
        "        m[:8] = (int.from_bytes(m[:8], 'little') + 1).to_bytes(8, 'little')\n"
        "for _ in range(4): threading.Thread(target=spin, daemon=True).start()\n"
        "time.sleep(120)\n"), str(counter)])
    try:
        deadline = time.monotonic() + 60
        while int.from_bytes(counter.read_bytes(), "little") < 1000:
            assert time.monotonic() < deadline and child.poll() is None, "the threads never ran"
            time.sleep(0.01)
        freeze(child.pid)
        states = thread_states(child.pid)
        assert set(states) == {"T"}, states
        frozen = counter.read_bytes()
        time.sleep(0.2)
        assert counter.read_bytes() == frozen
        os.kill(child.pid, signal.SIGCONT)
        while counter.read_bytes() == frozen:
            assert time.monotonic() < deadline, "not running again after SIGCONT"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait(10)
