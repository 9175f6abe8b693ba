"""Nothing acknowledged is lost by default: a shard started with a data dir and no other flag logs every
change (``--durability log --fsync interval``), logs and fsyncs schema changes in every mode, and
checkpoints by itself as the log grows. Real ``shardps serve`` processes, killed with SIGKILL."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch
from shardps_client import SGD, Adagrad, Client

from shardps.core.specs import Initializer
from shardps.server.rpc import ServerConfig, ShardServer
from shardps.server.shard.facade import ShardConfig
from tests.procs import start_shard

ROWS = 512


def _counter(c: Client, name: str = "cnt") -> None:
    c.create_table(name, dim=2, num_embeddings=ROWS, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))


def _restart(shards: list, i: int, n: int, tmp_path) -> None:
    port = shards[i].address.rsplit(":", 1)[1]
    shards[i] = start_shard(i, n, tmp_path, str(tmp_path / f"d{i}"), port=port)


def test_ten_kill9s_with_default_flags_lose_nothing_and_apply_nothing_twice(tmp_path):
    """Two shards started with a data dir and nothing else; two clients push +1s; ten kill -9s of a random
    shard. Every restart is healthy, the table is intact, and every row holds exactly its push count."""
    n = 2
    shards = [start_shard(i, n, tmp_path, str(tmp_path / f"d{i}")) for i in range(n)]
    counts = [np.zeros(ROWS, np.int64) for _ in range(2)]
    acked = [0, 0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def trainer(k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            with Client([s.address for s in shards], timeout=10, retry_timeout=60) as c:
                while not stop.is_set():
                    ids = rng.choice(ROWS, size=64, replace=False)
                    c.push("cnt", torch.from_numpy(ids), torch.ones(64, 2), wait=True)
                    counts[k][ids] += 1  # acknowledged: it must be there after any crash
                    acked[k] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    try:
        with Client([s.address for s in shards]) as c:
            _counter(c)
        threads = [threading.Thread(target=trainer, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        pick = random.Random(7)
        for _ in range(10):
            before = sum(acked)
            deadline = time.monotonic() + 60
            while sum(acked) < before + 5:  # progress between kills (a generous bound, never a rate)
                assert not errors, errors
                assert time.monotonic() < deadline, "training made no progress"
                time.sleep(0.02)
            i = pick.randrange(n)
            shards[i].kill()
            _restart(shards, i, n, tmp_path)
            assert "replayed" in shards[i].log() or "restored" in shards[i].log()
        stop.set()
        for t in threads:
            t.join(120)
        assert not errors, errors
        with Client([s.address for s in shards]) as c:
            assert all(info.spec.dim == 2 for info in c.describe_table("cnt"))  # the table survived every kill
            rows = c.pull("cnt", torch.arange(ROWS))
        expected = -torch.from_numpy((counts[0] + counts[1]).astype(np.float32))
        torch.testing.assert_close(rows[:, 0], expected, rtol=0, atol=0)  # 0 lost, 0 applied twice
        assert sum(acked) >= 50
    finally:
        stop.set()
        for s in shards:
            s.kill()


@pytest.mark.parametrize("policy", ["always", "interval", "none"])
def test_every_fsync_policy_replays_each_acknowledged_push_after_kill9(tmp_path, policy):
    """A record is in the file before its push is acknowledged, under every policy: a killed process loses
    nothing (only a machine crash can lose the last interval's records under ``interval`` and ``none``)."""
    data = str(tmp_path / "d")
    shard = start_shard(0, 1, tmp_path, data, extra=["--fsync", policy, "--fsync-interval", "30"])
    try:
        with Client([shard.address]) as c:
            _counter(c)
            for _ in range(25):
                c.push("cnt", torch.arange(ROWS), torch.ones(ROWS, 2), wait=True)
        shard.kill()  # at once: under interval, nothing was fsynced since the table was created
        shard = start_shard(0, 1, tmp_path, data)
        with Client([shard.address]) as c:
            torch.testing.assert_close(c.pull("cnt", torch.arange(ROWS)), torch.full((ROWS, 2), -25.0))
            assert c.shard_info()[0].version == 25
    finally:
        shard.kill()


def _log_counts(server: ShardServer) -> tuple[int, int]:
    d = server.shard.durability
    return d.fsyncs, d.logged  # type: ignore[attr-defined]


def test_interval_fsyncs_far_fewer_times_than_it_logs_records(tmp_path):
    """Counted, never timed: with a long interval, 200 pushes from two clients make no fsync of their own;
    a schema change is fsynced before its reply all the same; ``always`` leaves nothing unsynced."""
    config = ShardConfig(0, 1, data_dir=str(tmp_path / "interval"), fsync="interval", fsync_interval_s=3600)
    with ShardServer(config).start() as server:
        with Client([server.address]) as c:
            _counter(c)
        schema_fsyncs, _ = _log_counts(server)
        assert schema_fsyncs >= 1  # the table's record was fsynced before create_table returned

        def pushes() -> None:
            with Client([server.address]) as c:
                for _ in range(100):
                    c.push("cnt", torch.arange(64), torch.ones(64, 2), wait=True)

        threads = [threading.Thread(target=pushes) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        fsyncs, logged = _log_counts(server)
        assert logged >= 201 and fsyncs == schema_fsyncs  # 200 records, no fsync among them
        with Client([server.address]) as c:
            _counter(c, "another")
        assert _log_counts(server)[0] == fsyncs + 1  # a schema change: fsynced before the reply
    with ShardServer(replace_fsync(config, "interval", 0.05)).start() as server, Client([server.address]) as c:
        c.push("cnt", torch.arange(64), torch.ones(64, 2), wait=True)
        wal = server.shard.durability._wal  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while wal._durable < wal._written:  # the syncer catches up by itself (a generous bound)
            assert time.monotonic() < deadline, "no interval fsync"
            time.sleep(0.05)
    config = ShardConfig(0, 1, data_dir=str(tmp_path / "always"), fsync="always")
    with ShardServer(config).start() as server, Client([server.address]) as c:
        _counter(c)
        for _ in range(20):
            c.push("cnt", torch.arange(64), torch.ones(64, 2), wait=True)
        wal = server.shard.durability._wal  # type: ignore[attr-defined]
        assert wal._durable == wal.records >= 21 and 1 <= wal.fsyncs <= 21


def replace_fsync(config: ShardConfig, policy: str, interval: float) -> ShardConfig:
    from dataclasses import replace

    return replace(config, fsync=policy, fsync_interval_s=interval)


@pytest.mark.parametrize("flags", [[], ["--durability", "checkpoint"], ["--fsync", "none"]])
def test_a_table_created_just_before_a_kill9_is_there_after_restart(tmp_path, flags):
    """Schema changes are logged and fsynced before the reply in every mode that has a data dir: no push, no
    checkpoint, then kill -9, and the tables and the dense tensor come back with their specs and values."""
    data = str(tmp_path / "d")
    shard = start_shard(0, 1, tmp_path, data, extra=flags)
    try:
        with Client([shard.address]) as c:
            c.create_table("emb", dim=5, num_embeddings=1000, optimizer=Adagrad(lr=0.05),
                           initializer=Initializer("normal", std=0.1, seed=3))
            _counter(c, "gone")
            c.drop_table("gone")
            c.register_dense("w", torch.arange(12.0).reshape(4, 3), optimizer=SGD(lr=0.1))
            spec = c.describe_table("emb")[0].spec
            rows = c.pull("emb", torch.arange(10))
        shard.kill()
        shard = start_shard(0, 1, tmp_path, data, extra=flags)
        with Client([shard.address]) as c:
            assert c.describe_table("emb")[0].spec == spec
            torch.testing.assert_close(c.pull("emb", torch.arange(10)), rows, rtol=0, atol=0)
            torch.testing.assert_close(c.pull_dense("w")[0], torch.arange(12.0).reshape(4, 3))
            assert "gone" not in [t.spec.name for t in c.shard_info()[0].tables]
    finally:
        shard.kill()


def test_the_log_checkpoints_itself_as_it_grows(tmp_path):
    """A checkpoint follows once the log since the last one passes --checkpoint-log-mb, so a restart replays
    at most about that much; the shard starts with what it had."""
    config = ShardConfig(0, 1, data_dir=str(tmp_path))
    with ShardServer(config, ServerConfig(checkpoint_log_mb=1)).start() as server, Client([server.address]) as c:
        _counter(c)
        deadline = time.monotonic() + 60
        pushes = 0
        while not list(tmp_path.glob("*.ckpt")):  # each push logs about 5 KB
            assert time.monotonic() < deadline, "no checkpoint by log size"
            c.push("cnt", torch.arange(ROWS), torch.ones(ROWS, 2), wait=True)
            pushes += 1
        # The log since the checkpoint's cut holds the pushes made while its file was written (on a disk busy with
        # other tests' image builds, over 1 MiB of them: then a checkpoint by size follows); with no more pushes, it
        # ends under the bound.
        while server.shard.durability.log_bytes() >= 1 << 20:
            assert time.monotonic() < deadline + 60, f"{server.shard.durability.log_bytes()} bytes of log left"
            time.sleep(0.05)
    with ShardServer(config).start() as server, Client([server.address]) as c:
        assert c.pull("cnt", torch.tensor([0]))[0, 0].item() == -pushes


def test_a_large_shard_checkpoints_by_its_own_size_not_every_checkpoint_log_mb(tmp_path):
    """With --checkpoint-log-ratio R, the next automatic checkpoint waits for R times the last checkpoint's bytes
    of log (a shard of several GB is not rewritten for every 256 MiB of log), and still comes once they are
    there; a restart then has every push."""
    config = ShardConfig(0, 1, data_dir=str(tmp_path))
    rows, dim, batch = 30_000, 16, 3_000
    with ShardServer(config, ServerConfig(checkpoint_log_mb=1, checkpoint_log_ratio=2.0)).start() as server, \
            Client([server.address]) as c:
        c.create_table("big", dim=dim, num_embeddings=rows, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        c.push("big", torch.arange(rows), torch.zeros(rows, dim), wait=True)
        first = c.checkpoint()
        size = server.shard.last_checkpoint_bytes
        assert size > rows * dim * 4  # the rows' own bytes and more
        assert server.log_bytes_due() == 2 * size  # above --checkpoint-log-mb's 1 MiB
        pushes, ids = 0, torch.arange(batch)

        def push() -> None:
            nonlocal pushes
            c.push("big", ids, torch.ones(batch, dim), wait=True)
            pushes += 1

        while server.shard.durability.log_bytes() < (1 << 20) + (256 << 10):  # past --checkpoint-log-mb
            push()
        time.sleep(2.5)  # the checkpointer looks every second
        assert server.shard.last_checkpoint == first, "a checkpoint before the log reached 2x the last one"
        deadline = time.monotonic() + 60
        while server.shard.last_checkpoint == first:
            assert time.monotonic() < deadline, "no checkpoint once the log passed 2x the last one"
            if server.shard.durability.log_bytes() < 2 * size + (256 << 10):
                push()
            else:
                time.sleep(0.1)
    with ShardServer(config).start() as server, Client([server.address]) as c:
        assert c.pull("big", torch.tensor([0]))[0, 0].item() == -pushes


def test_the_start_line_says_what_a_crash_keeps(tmp_path):
    shard = start_shard(0, 1, tmp_path)
    try:
        assert "no data dir: nothing is kept" in shard.log()
    finally:
        shard.kill()
    shard = start_shard(0, 1, tmp_path, str(tmp_path / "d"))
    try:
        assert "durability log" in shard.log() and "fsync interval" in shard.log()
        assert "a process crash loses nothing acknowledged" in shard.log()
    finally:
        shard.kill()
