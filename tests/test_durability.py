"""Checkpoints, the write-ahead log, restarts, resharding and exactly-once pushes."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from shardps_client import SGD, Adagrad, Adam, Client

from shardps.core import codec
from shardps.core.routing import shard_of_ids
from shardps.core.specs import Initializer
from shardps.server.ops.reshard import reshard
from shardps.server.rpc import ServerConfig, ShardServer
from shardps.server.shard.facade import Shard, ShardConfig, ShardMapMismatch
from shardps.v1 import shardps_pb2 as pb
from shardps.v1 import shardps_pb2_grpc as pb_grpc
from tests.conftest import running_cluster
from tests.procs import start_shard

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _counter_table(c: Client, name: str = "cnt", rows: int = 64) -> None:
    c.create_table(name, dim=4, num_embeddings=rows, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))


def _two_checkpoints(config: ShardConfig, second: int = 64) -> None:
    """A counter table through a shard of ``config``: 64 rows pushed, checkpoint "first", the first ``second`` rows
    pushed again, checkpoint "second"; then the shard stops without another."""
    with ShardServer(config).start() as server, Client([server.address]) as c:
        _counter_table(c)
        c.push("cnt", torch.arange(64), torch.ones(64, 4))
        c.checkpoint("first")
        c.push("cnt", torch.arange(second), torch.ones(second, 4))
        c.checkpoint("second")
        server.stop(checkpoint=False)


def test_kill9_returns_to_last_checkpoint(tmp_path):
    shard = start_shard(0, 1, tmp_path, str(tmp_path / "d"), extra=["--durability", "checkpoint"])
    try:
        with Client([shard.address]) as c:
            _counter_table(c)
            for _ in range(3):
                c.push("cnt", torch.arange(64), torch.ones(64, 4))
            cid = c.checkpoint()
            for _ in range(2):  # acknowledged, but after the checkpoint
                c.push("cnt", torch.arange(64), torch.ones(64, 4), wait=True)
        shard.kill()
        shard = start_shard(0, 1, tmp_path, str(tmp_path / "d"))
        with Client([shard.address]) as c:
            torch.testing.assert_close(c.pull("cnt", torch.arange(64)), torch.full((64, 4), -3.0))
            info = c.shard_info()[0]
            assert info.last_checkpoint == cid and info.version == 3
    finally:
        shard.kill()


def test_kill9_with_log_loses_no_acknowledged_push(tmp_path):
    shard = start_shard(0, 1, tmp_path, str(tmp_path / "d"), extra=["--durability", "log"])
    acked = 0
    stop = threading.Event()

    def pusher() -> None:
        nonlocal acked
        with Client([shard.address], retry_timeout=0.5, timeout=5) as c:
            try:
                while not stop.is_set():
                    c.push("cnt", torch.arange(64), torch.ones(64, 4), wait=True)
                    acked += 1
            except Exception:
                pass  # the shard died under us

    with Client([shard.address]) as c:
        _counter_table(c)
        c.checkpoint()  # the log then holds the pushes after this checkpoint
    t = threading.Thread(target=pusher)
    t.start()
    deadline = time.monotonic() + 20
    while acked < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    shard.kill()  # kill -9 in the middle of a push stream
    stop.set()
    t.join(30)
    assert acked >= 30
    shard = start_shard(0, 1, tmp_path, str(tmp_path / "d"), extra=["--durability", "log"])
    try:
        with Client([shard.address]) as c:
            value = -c.pull("cnt", torch.tensor([0]))[0, 0].item()
            # Every acknowledged push survived; at most the one in flight may have too.
            assert acked <= value <= acked + 1
            assert "replayed" in shard.log()
    finally:
        shard.kill()


def test_log_replay_rebuilds_optimizer_state_and_dense_tensors(tmp_path):
    config = ShardConfig(0, 1, data_dir=str(tmp_path), durability="log")
    with ShardServer(config).start() as server, Client([server.address]) as c:
        c.create_table("e", dim=3, num_embeddings=50, optimizer=Adagrad(lr=0.1))
        c.register_dense("w", torch.ones(2, 3), optimizer=Adam(lr=0.1))
        for step in range(4):
            c.push("e", torch.tensor([1, 2, 2]), torch.full((3, 3), float(step)))
            c.push_dense("w", torch.full((2, 3), float(step + 1)))
        c.flush()
        rows, dense = c.pull("e", torch.arange(50)), c.pull_dense("w")[0]
        server.stop(checkpoint=False)  # no checkpoint at all: everything comes from the log
    assert not list(tmp_path.glob("*.ckpt"))
    with ShardServer(config).start() as server, Client([server.address]) as c:
        torch.testing.assert_close(c.pull("e", torch.arange(50)), rows, rtol=0, atol=0)
        torch.testing.assert_close(c.pull_dense("w")[0], dense, rtol=0, atol=0)
        assert c.shard_info()[0].version == 8


@pytest.mark.parametrize("durability,version", [("checkpoint", 1), ("log", 2)])
def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path, caplog, durability, version):
    """With checkpoints only, the previous checkpoint is what is left; with the log (the default), the records
    since the previous checkpoint are kept too and replayed on top of it: nothing is lost."""
    config = ShardConfig(0, 1, data_dir=str(tmp_path), durability=durability)
    _two_checkpoints(config)
    files = sorted(tmp_path.glob("*.ckpt"))
    assert [f.name.split("-", 2)[2] for f in files] == ["first.ckpt", "second.ckpt"]
    newest = files[-1]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip one bit in the middle
    newest.write_bytes(bytes(data))
    shard = Shard(config)
    assert shard.last_checkpoint == "first" and shard.version == version
    assert "checksum mismatch" in caplog.text
    rows, _ = shard.pull("cnt", np.arange(64))
    assert (rows == -float(version)).all()
    # A truncated newest file is detected the same way.
    newest.write_bytes(newest.read_bytes()[:100])
    assert Shard(config).last_checkpoint == "first"


def test_checkpoints_carry_a_crc32c_and_those_written_with_a_sha256_before_it_still_restore(tmp_path, caplog):
    """A checkpoint file ends in the CRC-32C of everything before it (google_crc32c, computed here on the file's
    bytes). The same file in the format written before (b"SHARDPS1", a SHA-256 of everything before it, made here
    with hashlib) restores the same state; damaged, it is skipped as any damaged checkpoint is."""
    import hashlib
    import struct

    import google_crc32c

    config = ShardConfig(0, 1, data_dir=str(tmp_path), durability="checkpoint")
    _two_checkpoints(config, second=32)
    first, second = sorted(tmp_path.glob("*.ckpt"))
    expected = np.full((64, 4), -1.0, np.float32)
    expected[:32] = -2.0
    for f in (first, second):
        data = f.read_bytes()
        assert data[:8] == b"SHARDPS2" and struct.unpack("<I", data[-4:])[0] == google_crc32c.value(data[:-4])
        body = b"SHARDPS1" + data[8:-4]
        f.write_bytes(body + hashlib.sha256(body).digest())
    shard = Shard(config)
    assert shard.last_checkpoint == "second" and shard.version == 2
    np.testing.assert_array_equal(shard.pull("cnt", np.arange(64))[0], expected)
    old = second.read_bytes()
    second.write_bytes(old[:-40] + bytes([old[-40] ^ 1]) + old[-39:])  # one bit of the old format's body
    shard = Shard(config)
    assert shard.last_checkpoint == "first" and "checksum mismatch" in caplog.text
    np.testing.assert_array_equal(shard.pull("cnt", np.arange(64))[0], np.full((64, 4), -1.0, np.float32))


def test_checkpoint_of_another_shard_map_is_refused(tmp_path):
    Shard(ShardConfig(0, 2, data_dir=str(tmp_path))).checkpoint("x")
    with pytest.raises(ShardMapMismatch, match="belongs to shard 0 of 2, but this shard is 0 of 3"):
        Shard(ShardConfig(0, 3, data_dir=str(tmp_path)))
    out = subprocess.run(
        [sys.executable, "-m", "shardps", "serve", "--shard-index", "1", "--num-shards", "2", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0 and "belongs to shard 0 of 2, but this shard is 1 of 2" in out.stderr


@pytest.mark.parametrize("old_n,new_n", [(2, 3), (3, 2)])
def test_reshard_keeps_every_row_and_optimizer_state(tmp_path, old_n, new_n):
    src, dst = tmp_path / "src", tmp_path / "dst"
    ids = torch.arange(0, 3000, 7)
    with running_cluster(old_n, data_dir=str(src)) as servers, Client([s.address for s in servers]) as c:
        c.create_table("emb", dim=5, num_embeddings=3000, optimizer=Adam(lr=0.05))
        c.create_table("free", dim=2, optimizer=Adagrad(lr=0.1))
        c.register_dense("mlp", torch.randn(100, 30), optimizer=Adam(lr=0.01), chunk_bytes=2048)
        for step in range(3):
            c.push("emb", ids[step::2], torch.randn(len(ids[step::2]), 5))
            c.push("free", torch.tensor([-5, 10**12]), torch.randn(2, 2))
            c.push_dense("mlp", torch.randn(100, 30))
        c.checkpoint("before")
    summary = reshard(src, dst, new_n)
    assert summary["tables"]["emb"]["rows"] == len(ids) and len(summary["tables"]["emb"]["per_shard"]) == new_n
    # The same next step on the old cluster and on the resharded one must agree: rows and optimizer state moved.
    results = []
    for root, n in ((src, old_n), (dst, new_n)):
        with running_cluster(n, data_dir=str(root)) as servers, Client([s.address for s in servers]) as c:
            before = c.pull("emb", ids), c.pull("free", torch.tensor([-5, 10**12])), c.pull_dense("mlp")[0]
            c.push("emb", ids, torch.ones(len(ids), 5))
            c.push("free", torch.tensor([-5, 10**12]), torch.ones(2, 2))
            c.push_dense("mlp", torch.ones(100, 30))
            after = c.pull("emb", ids), c.pull("free", torch.tensor([-5, 10**12])), c.pull_dense("mlp")[0]
            rows_total = sum(t.num_rows for info in c.shard_info() for t in info.tables if t.spec.name == "emb")
            results.append((before, after, rows_total))
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert results[0][2] == results[1][2] == len(ids)


def test_reshard_cli_refuses_nonempty_target(tmp_path):
    Shard(ShardConfig(0, 1, data_dir=str(tmp_path / "src" / "shard-0"))).checkpoint("x")
    (tmp_path / "dst" / "shard-0").mkdir(parents=True)
    (tmp_path / "dst" / "shard-0" / "junk").write_text("x")
    out = subprocess.run(
        [sys.executable, "-m", "shardps", "reshard", "--from", str(tmp_path / "src"), "--to", str(tmp_path / "dst"), "--shards", "2"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0 and "is not empty" in out.stderr


def test_duplicated_push_is_applied_once(tmp_path):
    config = ShardConfig(0, 1, data_dir=str(tmp_path), durability="log")
    with ShardServer(config).start() as server, Client([server.address]) as c:
        _counter_table(c)
        stub = pb_grpc.ShardStub(grpc.insecure_channel(server.address))
        req = pb.PushRequest(table="cnt", ids=codec.encode(np.arange(64)), grads=codec.encode(np.ones((64, 4), np.float32)),
                             client_id="trainer-7", seq=1, shard_map=pb.ShardMap(shard_index=0, num_shards=1))
        first, second = stub.Push(req), stub.Push(req)  # a retry after a lost acknowledgement
        assert not first.duplicate and second.duplicate
        torch.testing.assert_close(c.pull("cnt", torch.arange(64)), torch.full((64, 4), -1.0))
        server.stop(checkpoint=False)
    with ShardServer(config).start() as server:  # remembered across a restart, via the log
        stub = pb_grpc.ShardStub(grpc.insecure_channel(server.address))
        assert stub.Push(req).duplicate
        req.seq = 2
        assert not stub.Push(req).duplicate
        assert server.shard.version == 2


def test_a_push_held_back_by_a_checkpoint_is_not_in_the_checkpoints_exactly_once_record(tmp_path):
    """A push claimed (client id, seq) but held back at a prepared checkpoint's gate is not applied in the copy, so
    the copy must not remember it as applied: after a crash before it applies, its resend is applied, not taken
    for a duplicate (it was: one acknowledged push lost)."""
    config = ShardConfig(0, 1, data_dir=str(tmp_path), durability="log")
    with ShardServer(config).start() as server, Client([server.address]) as c:
        _counter_table(c)
        stub = pb_grpc.ShardStub(grpc.insecure_channel(server.address))
        req = pb.PushRequest(table="cnt", ids=codec.encode(np.arange(8)), grads=codec.encode(np.ones((8, 4), np.float32)),
                             client_id="trainer-9", seq=1, shard_map=pb.ShardMap(shard_index=0, num_shards=1))
        assert not stub.Push(req).duplicate
        shard = server.shard
        shard.prepare_checkpoint(hold_s=10)
        req.seq = 2
        held = stub.Push.future(req)
        deadline = time.monotonic() + 10
        while "trainer-9" not in shard.updates.seen._in_flight:  # claimed, waiting at the gate
            assert time.monotonic() < deadline
            time.sleep(0.01)
        meta, _, _ = shard.snapshot()
        assert meta["seen"]["trainer-9"] == [1, []]  # seq 2 is not in this copy
        shard.checkpoint("cut", prepared=True)
        assert not held.result().duplicate and shard.version == 2
        assert shard.snapshot()[0]["seen"]["trainer-9"] == [2, []]


def test_two_phase_checkpoint_holds_pushes_until_commit(tmp_path):
    with running_cluster(2, data_dir=str(tmp_path)) as servers, Client([s.address for s in servers]) as c:
        _counter_table(c)
        shard = servers[0].shard
        shard.prepare_checkpoint(hold_s=10)
        done = threading.Event()
        ids = torch.tensor([i for i in range(64) if shard_of_ids(np.array([i]), 2)[0] == 0])
        t = threading.Thread(target=lambda: (c.push("cnt", ids, torch.ones(len(ids), 4), wait=True), done.set()))
        t.start()
        assert not done.wait(0.5)  # held back while prepared
        shard.checkpoint("cut", prepared=True)
        assert done.wait(10)
        t.join()
        assert shard.version == 1
        # A prepared hold that is never committed expires by itself.
        shard.prepare_checkpoint(hold_s=0.3)
        c.push("cnt", ids, torch.ones(len(ids), 4), wait=True)
        assert shard.version == 2


def test_shard_killed_during_training_job_is_restarted_and_job_completes(tmp_path):
    data = tmp_path / "data"
    shards = [start_shard(i, 2, tmp_path, str(data / f"shard-{i}"), extra=["--durability", "log"]) for i in range(2)]
    progress = tmp_path / "progress"
    steps = 120
    job = subprocess.Popen(
        [sys.executable, "-m", "tests.trainer_job", ",".join(s.address for s in shards), str(steps), str(progress)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (progress.exists() and int(progress.read_text().split()[-1]) >= 20):
            assert job.poll() is None, job.stdout.read() if job.stdout else ""
            assert time.monotonic() < deadline, "job made no progress"
            time.sleep(0.05)
        port = shards[1].address.rsplit(":", 1)[1]
        shards[1].kill()
        time.sleep(0.5)  # the job now retries against a dead shard
        shards[1] = start_shard(1, 2, tmp_path, str(data / "shard-1"), extra=["--durability", "log"], port=port)
        out, _ = job.communicate(timeout=120)
        assert job.returncode == 0, out
        assert progress.read_text() == f"done {steps}"
        with Client([s.address for s in shards]) as c:
            total = -c.pull("job", torch.arange(10_000)).sum().item() / 8
        assert total == steps * 256  # every push of the job applied exactly once, none lost in the crash
    finally:
        job.kill()
        for s in shards:
            s.kill()


def test_killed_trainer_does_not_disturb_async_training_of_others(tmp_path):
    shard = start_shard(0, 1, tmp_path)
    try:
        jobs = [
            subprocess.Popen([sys.executable, "-m", "tests.trainer_job", shard.address, str(n), str(tmp_path / f"p{i}"), str(i)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i, n in enumerate((100_000, 60))
        ]
        deadline = time.monotonic() + 60
        while not (tmp_path / "p0").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        jobs[0].kill()
        out, _ = jobs[1].communicate(timeout=120)
        assert jobs[1].returncode == 0, out
        assert (tmp_path / "p1").read_text() == "done 60"
    finally:
        for j in jobs:
            j.kill()
        shard.kill()


def test_periodic_checkpoints_are_written(tmp_path):
    config = ShardConfig(0, 1, data_dir=str(tmp_path))
    with ShardServer(config, ServerConfig(checkpoint_interval_s=0.2)).start() as server, Client([server.address]) as c:
        _counter_table(c)
        c.push("cnt", torch.arange(64), torch.ones(64, 4), wait=True)
        deadline = time.monotonic() + 10
        while len(list(tmp_path.glob("*.ckpt"))) < 2:  # the newest and the previous one are kept
            assert time.monotonic() < deadline, "no periodic checkpoint"
            time.sleep(0.05)
    assert Shard(config).version >= 1


def test_the_log_reads_old_crc32_records_and_checks_new_crc32c_ones(tmp_path):
    """Records written before CRC-32C (zlib's CRC-32, no flag) still replay beside new ones; a flipped byte in a
    new record is caught by its CRC-32C."""
    import struct
    import zlib

    from shardps.server.durability import wal

    old = b"an old record"
    (tmp_path / "wal-000000000001.log").write_bytes(
        struct.pack("<IIB", len(old), zlib.crc32(old, wal.PUSH), wal.PUSH) + old)
    log = wal.WriteAheadLog(tmp_path, 2, fsync="always")
    log.wait(log.append(wal.DROP, b"a new record"), durable=True)
    log.wait(log.append(wal.PUSH, b"another new record"), durable=True)
    log.close()
    assert [(r.kind, r.payload) for r in wal.replay(tmp_path, 0)] == [
        (wal.PUSH, old), (wal.DROP, b"a new record"), (wal.PUSH, b"another new record")]
    seg = tmp_path / "wal-000000000002.log"
    data = bytearray(seg.read_bytes())
    assert data[8] == wal.DROP | wal.CRC32C_FLAG
    data[9 + 3] ^= 0x01  # inside the first new record, which the second follows
    seg.write_bytes(bytes(data))
    with pytest.raises(wal.CorruptLog, match="fails its checksum"):
        list(wal.replay(tmp_path, 0))


def test_a_failed_push_claim_is_forgotten_even_after_it_was_folded_into_the_low_mark():
    """A push claimed, then failed (e.g. held at a handover that gave its slots away): its retry with the same
    sequence number must apply, whether or not later pushes were claimed in between."""
    from shardps.server.shard.updates import SeenPushes

    seen = SeenPushes()
    for seq in (1, 2, 3):
        assert seen.begin("c", seq)
    seen.settle("c", 1)
    seen.settle("c", 3)
    seen.abort("c", 2)  # 1..3 were folded into the low mark: 2's gap reopens, 1 and 3 stay claimed
    assert not seen.contains("c", 2) and seen.contains("c", 1) and seen.contains("c", 3)
    assert seen.begin("c", 2)
    seen.settle("c", 2)
    assert not seen.begin("c", 2) and not seen.begin("c", 3)
    assert seen.begin("c", 5)
    seen.abort("c", 5)  # a claim above a gap
    assert seen.begin("c", 4) and seen.begin("c", 5)
    seen.settle("c", 4)
    seen.settle("c", 5)
    assert not any(seen.begin("c", s) for s in range(1, 6))
    seen.abort("c", 4)  # settled: applied (a failed wait for its record came after), so its resend is a duplicate
    assert seen.contains("c", 4) and not seen.begin("c", 4)


def test_records_of_pushes_applied_elsewhere_are_the_union_of_what_came_and_name_each_shard():
    """Records received with slots (docs/resharding.md#exactly-once-across-shards): merged per shard and client as
    the union of both (a low mark and the seqs above it); a push is found applied by the shard its origin names
    only; this shard's own records are its own, never overwritten by what comes back with slots."""
    from shardps.server.shard.updates import PushesAppliedElsewhere, SeenPushes

    own = SeenPushes()
    assert own.begin("c", 1)
    own.settle("c", 1)
    here = PushesAppliedElsewhere(own, index=0)
    here.merge({"2": {"c": [3, [7, 9]], "d": [0, [4]]}, "0": {"c": [50, []]}})
    here.merge({"2": {"c": [5, [6, 12]]}})  # a later handover of shard 2: more of its records
    assert here.applied("c", ((2, 3),)) and here.applied("c", ((2, 6),)) and here.applied("c", ((2, 12),))
    assert here.applied("c", ((2, 9),)) and not here.applied("c", ((2, 8),)) and not here.applied("c", ((2, 13),))
    assert here.applied("d", ((2, 4),)) and not here.applied("d", ((2, 3),))
    assert not here.applied("c", ((1, 3),)), "shard 1 handed nothing over"
    assert here.applied("c", ((1, 3), (2, 3))), "any shard named that applied it"
    assert here.applied("c", ((0, 1),)) and not here.applied("c", ((0, 2),)), "its own records, not the 50 sent back"
    assert here.to_json()["0"] == own.to_json() and here.others_json()["2"]["c"] == [7, [9, 12]]
    again = PushesAppliedElsewhere(SeenPushes(), index=0)
    again.load_others(here.others_json())  # a checkpoint's, restored
    assert again.applied("c", ((2, 12),)) and not again.applied("c", ((2, 8),))


def test_a_resend_of_a_claim_in_flight_waits_for_it_then_is_a_duplicate_or_applies():
    """A resend of a push still being applied (in flight) is neither a duplicate nor applied until the first one
    is settled (then a duplicate) or aborted (then claimed); past the wait it is refused as unavailable."""
    from shardps.core.errors import Unavailable
    from shardps.server.shard.updates import SeenPushes

    seen = SeenPushes(wait_s=0.3)
    assert seen.begin("c", 1) and seen.begin("c", 2)
    with pytest.raises(Unavailable, match="push 1 of client c is still being applied"):
        seen.contains("c", 1)
    with pytest.raises(Unavailable):
        seen.begin("c", 1)
    seen = SeenPushes(wait_s=30)
    assert seen.begin("c", 1) and seen.begin("c", 2)
    threading.Timer(0.2, seen.settle, args=("c", 1)).start()
    threading.Timer(0.2, seen.abort, args=("c", 2)).start()
    assert seen.contains("c", 1)  # applied: the resend is a duplicate
    assert seen.begin("c", 2)  # failed: the resend applies
