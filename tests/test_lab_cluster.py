"""Clusters across the lab's hosts: ``shardps cluster --netns`` puts each shard on a host of its own, the data plane
crosses real interfaces (TCP between namespaces: no Unix socket, no shared memory, read from the shards' own
stats), with mutual TLS and tokens; and the DLRM example trains across 4 hosts (2 shards, 1 trainer, the launcher
on a control host). Skips where no lab can be made, failing instead under SHARDPS_REQUIRE_LAB=1 (CI)."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import pytest

from tests.lab import Lab
from tests.test_lab import require_lab

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _start_cluster(lab: Lab, shards: list[str], cluster_file: pathlib.Path, *extra: str):
    """``shardps cluster`` on the control host, its shards on ``shards``, its logs beside ``cluster_file`` (the lab
    stops it with the rest of its processes, before it could remove a directory of its own); waits for its cluster
    file."""
    netns = [lab.host(h).netns for h in shards]
    proc = lab.spawn("ctl", [sys.executable, "-m", "shardps", "cluster", "--shards", str(len(shards)),
                             "--netns", *netns, "--cluster-file", str(cluster_file),
                             "--log-dir", str(cluster_file.parent / "logs"), *extra], cwd=str(ROOT))
    deadline = time.monotonic() + 90
    while not (cluster_file.exists() and "healthy" in proc.log()):
        assert proc.alive(), proc.log()
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.1)
    return proc


def _train_and_report(cluster_file: str, admin: str, trainer: str) -> dict:
    """On the control host: create a table (admin token), pull and push it (trainer token), read the shards'
    stats (what ``shardps stats`` shows)."""
    import numpy as np
    import torch
    from shardps_client import SGD, Client

    from shardps.core.specs import Initializer
    from shardps.server.ops.report import collect

    data = json.loads(pathlib.Path(cluster_file).read_text())
    threads = [torch.get_num_threads()]  # torch's default here, then as the client left it (torch_threads="auto")
    with Client.from_file(cluster_file, token=admin) as c:
        threads.append(torch.get_num_threads())
        c.create_table("t", num_embeddings=10_000, dim=8, optimizer=SGD(lr=0.5),
                       initializer=Initializer("zeros"))
    ids = torch.arange(0, 10_000, 7)
    with Client.from_file(cluster_file, token=trainer) as c:
        for step in range(4):
            c.pull("t", ids)
            c.push("t", ids, torch.full((len(ids), 8), float(step + 1)))
        c.flush()
        rows = c.pull("t", ids).numpy()
    os.environ["SHARDPS_TOKEN"] = admin
    stats = collect(data["addresses"], interval=0, tls=data["tls"])
    return {"addresses": data["addresses"], "rows_ok": bool(np.allclose(rows, -0.5 * (1 + 2 + 3 + 4))), "threads": threads,
            "clients": [s["clients"] for s in stats], "tables": [s["tables"] for s in stats]}


def test_shards_on_hosts_of_their_own_serve_over_tcp_with_mutual_tls_and_tokens(tmp_path):
    require_lab()
    with Lab(["ctl", "s0", "s1"]) as lab:
        tokens = tmp_path / "tokens"
        tokens.write_text("admin admin-secret-0123456789\ntrainer trainer-secret-0123456789\n")
        cluster_file = tmp_path / "cluster.json"
        _start_cluster(lab, ["s0", "s1"], cluster_file, "--tls", "mtls", "--tokens-file", str(tokens),
                       "--data-dir", str(tmp_path / "data"))
        r = lab.call("ctl", _train_and_report, str(cluster_file), "admin-secret-0123456789",
                     "trainer-secret-0123456789", timeout=120)
        assert [a.rsplit(":", 1)[0] for a in r["addresses"]] == [lab.address("s0"), lab.address("s1")]
        assert r["rows_ok"]
        # The shards are on hosts of their own, yet under this machine's kernel (their ShardInfo says so): they share
        # its cores, so the client gave torch one thread per core they leave free, as beside shards on loopback.
        default, after = r["threads"]
        assert after == min(default, max(1, (os.cpu_count() or 1) - 2)), r["threads"]
        for clients in r["clients"]:  # the trainer's data-plane connections, as each shard saw them
            assert clients, r
            for c in clients:
                assert c["transport"] == "zmq", c  # TCP: not zmq-ipc (a Unix socket), not zmq-shm (shared memory)
                assert c["peer"].startswith(f"ipv4:{lab.address('ctl')}"), c


def test_dlrm_example_trains_across_four_hosts(tmp_path):
    require_lab()
    with Lab(["ctl", "s0", "s1", "t0"]) as lab:
        cluster_file = tmp_path / "cluster.json"
        _start_cluster(lab, ["s0", "s1"], cluster_file)
        result = tmp_path / "dlrm.json"
        trainer = lab.spawn("t0", [sys.executable, "-m", "clients.examples.dlrm", "--cluster-file", str(cluster_file),
                                   "--workers", "1", "--rows", "100000", "--train", "80000", "--test", "20000",
                                   "--no-local", "--json", str(result)], cwd=str(ROOT),
                            env={"OMP_NUM_THREADS": "1"})
        assert trainer.popen.wait(240) == 0, trainer.log()[-3000:]
        r = json.loads(result.read_text())
        assert r["shardps"]["auc"] > 0.7, r  # learned the planted signal across the network
        stats = lab.call("ctl", _stats, str(cluster_file))
        for clients in stats:
            assert any(c["peer"].startswith(f"ipv4:{lab.address('t0')}") and c["transport"] == "zmq"
                       for c in clients), stats


def _stats(cluster_file: str) -> list:
    from shardps.server.ops.report import collect

    data = json.loads(pathlib.Path(cluster_file).read_text())
    return [s["clients"] for s in collect(data["addresses"], interval=0)]


def test_a_shard_whose_handshake_takes_longer_than_a_second_is_still_reached(tmp_path):
    """gRPC reads grpc.min_reconnect_backoff_ms as the least time a connection attempt gets (protocol.py): at 100 ms
    (attempts then lasting at most the 1 s backoff), a shard whose HTTP/2 SETTINGS came back later than that was never
    reached, as happened to `shardps stats` against a busy shard in the suite. Here its answers cross a link that
    holds them 1.3 s: `shardps stats` still connects and gets its answer (with 100 ms it failed, checked). (The data
    plane is another matter: ZeroMQ's handshake takes two such trips, past its 2 s send timeout.)"""
    require_lab()
    with Lab(["ctl", "s0"]) as lab:
        cluster_file = tmp_path / "cluster.json"
        _start_cluster(lab, ["s0"], cluster_file)
        lab.link("ctl", "s0").delay(1300, direction="down")
        t0 = time.monotonic()
        stats = lab.run("ctl", [sys.executable, "-m", "shardps", "stats", "--cluster-file", str(cluster_file),
                                "--interval", "0", "--timeout", "30"], timeout=90, check=False)
        assert stats.returncode == 0 and "total: 1 shards" in stats.stdout, stats.stdout + stats.stderr
        assert time.monotonic() - t0 > 1.3  # the answer did cross the slow link
