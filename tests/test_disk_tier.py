"""Tables larger than memory: hot rows in RAM over segment files on local disk (``DiskTier``). Real shard servers over
loopback; the reference is the same table kept wholly in RAM (itself checked against torch.optim elsewhere)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from shardps_client import (
    SGD,
    Adagrad,
    Client,
    DiskTier,
    Eviction,
    Initializer,
    InvalidArgumentError,
    RequestTooLargeError,
)

from shardps.core.exports import load_tables, read_safetensors
from shardps.server.ops.reshard import reshard
from shardps.server.rpc import ServerConfig, ShardServer
from shardps.server.shard.facade import ShardConfig
from shardps.server.storage.disk import MARKER, DiskTierError, DiskTiers, RecordCodec
from tests.procs import start_shard

DIM = 8


def _server(i: int, n: int, tmp: pathlib.Path, **kw: object) -> ShardServer:
    config = ShardConfig(i, n, data_dir=str(tmp / f"shard-{i}"), **kw)  # type: ignore[arg-type]
    return ShardServer(config, ServerConfig()).start()


def _pair(c: Client, rows: int, memory_mb: float = 4, optimizer=None, dim: int = DIM) -> None:
    """A table with a disk tier ("disk") and the same table in RAM ("ram"): same initializer, same optimizer."""
    for name, storage in (("disk", DiskTier(memory_mb=memory_mb)), ("ram", "memory")):
        c.create_table(name, dim=dim, num_embeddings=rows, optimizer=optimizer or SGD(lr=0.1),
                       initializer=Initializer(seed=11), storage=storage)


def _all(c: Client, name: str, rows: int, chunk: int = 20_000) -> torch.Tensor:
    return torch.cat([c.pull(name, torch.arange(lo, min(rows, lo + chunk))) for lo in range(0, rows, chunk)])


def test_records_round_trip():
    codec = RecordCodec(3, ["sum"])
    rng = np.random.default_rng(0)
    fields = {"rows": rng.standard_normal((5, 3)).astype(np.float32), "state.sum": rng.random((5, 3)).astype(np.float32),
              "steps": np.arange(5, dtype=np.int32), "last_version": np.arange(5, dtype=np.int64) << 40,
              "last_time": np.full(5, 7, np.uint32), "touches": np.arange(5, dtype=np.int32)}
    back = codec.pack(fields)
    assert back.dtype.itemsize == 3 * 4 * 2 + 20
    for k, v in fields.items():
        np.testing.assert_array_equal(back[k], v)


@pytest.mark.parametrize("reads", ["pread", "mapping"])
def test_segment_store_against_a_dict_through_overwrites_deletes_compactions_and_a_checkpoint(tmp_path, monkeypatch,
                                                                                            reads):
    """The segment store (tiny segments: many seals and compactions) against a dict of what was written last:
    every read, a scan by slots, and a checkpoint loaded back, with a checkpoint every fourth step (small sealed
    segments merged); read by the compiled pread loop, and by the mappings (the numpy references: their pages let go
    as reads go on)."""
    from shardps.core import kernels
    from shardps.core.routing import slot_of_ids
    from shardps.server.storage import segments

    if reads == "mapping":
        monkeypatch.setattr(kernels, "jit", lambda: None)
    elif kernels.jit() is None:
        pytest.skip("the compiled kernels do not serve here (SHARDPS_KERNELS=numpy or no numba)")

    codec = RecordCodec(4, ["s"])
    store = segments.SegmentStore(tmp_path / "live", codec, segment_bytes=4096)
    rng = np.random.default_rng(0)
    ref: dict[int, int] = {}

    def records(n: int, v: int) -> np.ndarray:
        return codec.pack({"rows": np.full((n, 4), v, np.float32), "state.s": np.full((n, 4), -v, np.float32),
                           "steps": np.full(n, v, np.int32), "last_version": np.arange(n, dtype=np.int64),
                           "last_time": np.zeros(n, np.uint32), "touches": np.zeros(n, np.int32)})

    for step in range(300):
        ids = np.unique(rng.integers(0, 2000, 100))
        if step % 7 == 3:
            store.delete(ids[:20])
            for i in ids[:20].tolist():
                ref.pop(i, None)
        else:
            store.put(ids, records(ids.shape[0], step))
            ref.update(dict.fromkeys(ids.tolist(), step))
        if step == 151:
            manifest, at_cut = store.checkpoint(tmp_path / "ckpt"), dict(ref)
        elif step % 4 == 1:  # a checkpoint seals the segment being written: small ones are merged, not kept
            store.checkpoint(tmp_path / f"c{step}")
    assert store.disk_bytes <= 2 * len(ref) * store.record.itemsize + 2 * 4096  # compacted: dead <= live + a segment
    small = [g for g in store.segments.values() if g.sealed and g.count < store.per_segment // 4]
    assert len(small) <= segments.MAX_SMALL + 1, len(small)
    every = np.arange(2000)
    for got, want in ((store, ref), (segments.SegmentStore.load(tmp_path / "ckpt", tmp_path / "back", codec, manifest),
                                     at_cut)):
        found, recs = got.get(every)
        assert got._gathered < segments.READ_CHUNK <= len(want)  # (mappings) dropped on the way
        assert every[found].tolist() == sorted(want)
        assert recs["steps"].tolist() == [want[i] for i in every[found].tolist()]
    part = np.concatenate([i for i, _ in store.scan(100, 30000, batch=50)])
    slots = slot_of_ids(np.array(sorted(ref), np.int64))
    assert sorted(part.tolist()) == [i for i, sl in zip(sorted(ref), slots) if 100 <= sl <= 30000]


@pytest.mark.parametrize("memory_mb,share", [(4, 10), (8, 2)], ids=["hash indexes", "flat maps"])
def test_table_ten_times_its_memory_trains_exactly_like_the_same_table_in_ram(tmp_path, memory_mb, share):
    """Two shards; a table whose memory holds a tenth of its rows trains with SGD and Adagrad, pulls and pushes
    of Zipf and uniform ids with repeats; every row equals the in-RAM table's, bit for bit, during and after,
    and across a checkpoint and restart of the shards. At 8 MiB the id maps (1 MB) are an eighth of memory_mb: the
    hot set and the rows on disk are indexed by flat maps, and under half the rows are in memory."""
    rows, n = 250_000, 2
    servers = [_server(i, n, tmp_path) for i in range(n)]
    try:
        with Client([s.address for s in servers]) as c:
            _pair(c, rows, memory_mb=memory_mb, optimizer=Adagrad(lr=0.05))
            rng = np.random.default_rng(1)
            for step in range(40):
                hot = (rng.zipf(1.2, 3000) - 1) % rows
                ids = torch.from_numpy(np.concatenate([hot, rng.integers(0, rows, 3000)]))
                a, b = c.pull("disk", ids), c.pull("ram", ids)
                assert torch.equal(a, b), step
                grads = a * 0.1 + torch.randn(a.shape)
                c.push("disk", ids, grads)
                c.push("ram", ids, grads)
            c.flush()
            assert torch.equal(_all(c, "disk", rows), _all(c, "ram", rows))
            info = c.describe_table("disk")
            for t in info:  # a tenth (or under half) of the rows in memory, the others on disk
                assert t.hot_rows < t.num_rows / share and t.written_back > 0 and t.promoted > 0
                assert t.tier_hits > 0 and t.tier_misses > 0 and t.disk_bytes > 0
            assert sum(t.num_rows for t in info) == rows == sum(t.num_rows for t in c.describe_table("ram"))
            c.checkpoint()
            for _ in range(3):  # after the checkpoint: replayed from the log on restart
                ids = torch.from_numpy(rng.integers(0, rows, 5000))
                g = torch.randn(5000, DIM)
                c.push("disk", ids, g)
                c.push("ram", ids, g)
            c.flush()
            expected = _all(c, "ram", rows)
        for s in servers:
            s.stop(checkpoint=False)
        servers = [_server(i, n, tmp_path) for i in range(n)]
        with Client([s.address for s in servers]) as c:
            assert torch.equal(_all(c, "disk", rows), expected)
    finally:
        for s in servers:
            s.stop(checkpoint=False)


def test_rows_prefetched_stay_in_memory_until_the_few_requests_after_them_are_served(tmp_path):
    """A pull brings a batch's cold rows in ahead of its push (a pipeline's prefetch); the next requests bring in
    other cold rows until the memory's older rows run short: the prefetched rows are not chosen (the hot set keeps
    the rows of its last few requests while it has others: ``PROTECT_REQUESTS``), so the batch's own pull and push
    find them all in memory. Without that, sampling took some of them (4 of the batch, measured)."""
    server = _server(0, 1, tmp_path)
    try:
        with Client([server.address]) as c:
            c.create_table("t", dim=DIM, num_embeddings=400_000, optimizer=SGD(lr=0.1),
                           initializer=Initializer("zeros"), storage=DiskTier(memory_mb=8))
            for lo in range(0, 160_000, 20_000):
                c.push("t", torch.arange(lo, lo + 20_000), torch.ones(20_000, DIM), wait=True)
            for lo in range(0, 160_000, 10_000):  # every row on disk: the memory at its size beside their index
                c.pull("t", torch.arange(lo, lo + 10_000))
            (info,) = c.describe_table("t")
            size = info.hot_rows // 18  # 8 requests of it fill less than half the memory
            cold = torch.from_numpy(np.random.default_rng(0).permutation(100_000)[:8 * size])  # all on disk
            batches = [torch.sort(cold[k * size:(k + 1) * size]).values for k in range(8)]
            c.pull("t", batches[0])  # the prefetch
            for b in batches[1:]:
                c.pull("t", b)
            (before,) = c.describe_table("t")
            c.push("t", batches[0], torch.ones(size, DIM), wait=True)
            (after,) = c.describe_table("t")
            assert before.tier_misses > 7 * size and after.tier_misses == before.tier_misses
            assert after.hot_rows < 3 * 8 * size  # (memory was short: rows left it all along)
    finally:
        server.stop(checkpoint=False)


def _rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# What a shard holds beyond its tables' budget, in MiB, as docs/storage.md states it: a client's pushes in flight (4
# here, of 4 MB) and their numpy temporaries, the C heap's free memory kept up to its trim threshold (16 MiB), and the
# segment mappings' pages between two drops (8 MiB at most). Measured: 29-33 MB with one push at a time.
TIER_OVERHEAD_MB = 64


@pytest.mark.parametrize("memory_mb", [64] + [pytest.param(mb, marks=pytest.mark.skipif(
    not os.environ.get("SHARDPS_TIER_BUDGET_LONG"), reason=f"{4 * mb // 1024} GB of rows: run by make tier-budget"))
    for mb in (512, 1024)])
def test_a_shards_rss_stays_within_the_tiers_memory_mb_through_a_fill_and_a_zipf_loop_at_four_times_it(tmp_path, memory_mb):
    """A shard process with a table four times its disk tier's memory_mb (64 MiB; 512 and 1024 in make tier-budget):
    from the tier's start on, its RSS (read from /proc) grows by at most memory_mb plus the stated overhead, at every
    quarter of a fill and through a Zipf(1.1) loop of pulls and pushes. The index of the rows on disk is inside memory_mb."""
    shard = start_shard(0, 1, tmp_path, str(tmp_path / "d"))
    try:
        with Client([shard.address], max_inflight_pushes=4) as c:
            c.create_table("warm", dim=4, num_embeddings=100, storage=DiskTier(memory_mb=1))  # the tier's code loaded
            for _ in range(3):
                c.push("warm", torch.arange(100), torch.ones(100, 4), wait=True)
            start = _rss_mb(shard.proc.pid)
            rows = int(4 * memory_mb * (1 << 20) / (64 * 4 + 58))  # a row in RAM: values, metadata, flags, index
            c.create_table("big", dim=64, num_embeddings=rows, optimizer=SGD(lr=0.1), initializer=Initializer("zeros"),
                           storage=DiskTier(memory_mb=memory_mb))
            grown, step = [], 16_384
            for lo in range(0, rows, step):
                ids = torch.arange(lo, min(rows, lo + step))
                c.push("big", ids, torch.ones(ids.shape[0], 64))
                if (lo // step) % max(1, rows // step // 4) == 0:
                    c.flush()
                    grown.append(_rss_mb(shard.proc.pid) - start)
            c.flush()
            rng = np.random.default_rng(0)
            for k in range(40):
                ids = torch.from_numpy(np.unique((rng.zipf(1.1, 8192) - 1) % rows))
                got = c.pull("big", ids)
                c.push("big", ids, torch.ones(ids.shape[0], 64))
                if k % 8 == 7:
                    c.flush()
                    grown.append(_rss_mb(shard.proc.pid) - start)
            (t,) = c.describe_table("big")
            assert t.num_rows == rows and t.hot_rows < rows / 3 and t.promoted > 0
            print(f"memory_mb {memory_mb}: RSS grew by {[round(g) for g in grown]} MB")
            assert max(grown) <= memory_mb + TIER_OVERHEAD_MB, f"RSS grew by {[round(g) for g in grown]} MB"
            got = c.pull("big", torch.arange(0, rows, 997))
            assert (got <= -0.1 + 1e-6).all()  # every row pushed at least once, none lost
    finally:
        shard.kill()


def test_kill9_mid_training_restarts_with_every_acknowledged_push(tmp_path):
    """Two shard processes with data dirs and tables ten times their memory; a trainer pushes +1s (SGD, zeros);
    each shard is killed with SIGKILL mid-training, once before and once after a checkpoint. Every row equals
    its count of acknowledged pushes: nothing lost, nothing applied twice."""
    n, rows = 2, 200_000
    shards = [start_shard(i, n, tmp_path, str(tmp_path / f"d{i}")) for i in range(n)]
    counts = np.zeros(rows, np.int64)
    acked = [0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def trainer() -> None:
        rng = np.random.default_rng(3)
        try:
            with Client([s.address for s in shards], timeout=10, retry_timeout=60) as c:
                while not stop.is_set():
                    ids = rng.choice(rows, size=4000, replace=False)
                    c.push("cnt", torch.from_numpy(ids), torch.ones(4000, 16), wait=True)
                    counts[ids] += 1
                    acked[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    try:
        with Client([s.address for s in shards]) as c:
            c.create_table("cnt", dim=16, num_embeddings=rows, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                           storage=DiskTier(memory_mb=4))
        thread = threading.Thread(target=trainer)
        thread.start()
        for kill in range(4):
            before, deadline = acked[0], time.monotonic() + 60
            while acked[0] < before + 8:  # progress between kills (a generous bound, never a rate)
                assert not errors, errors
                assert time.monotonic() < deadline, "training made no progress"
                time.sleep(0.02)
            if kill == 2:
                with Client([s.address for s in shards]) as c:
                    c.checkpoint()
            i = kill % n
            port = shards[i].address.rsplit(":", 1)[1]
            shards[i].kill()
            shards[i] = start_shard(i, n, tmp_path, str(tmp_path / f"d{i}"), port=port)
        stop.set()
        thread.join(120)
        assert not errors, errors
        with Client([s.address for s in shards]) as c:
            got = _all(c, "cnt", rows)[:, 0]
            assert sum(t.written_back for t in c.describe_table("cnt")) > 0
        torch.testing.assert_close(got, -torch.from_numpy(counts.astype(np.float32)), rtol=0, atol=0)
        assert "restored checkpoint" in shards[0].log() and acked[0] >= 32
    finally:
        stop.set()
        for s in shards:
            s.kill()


def _trained_shard(tmp_path: pathlib.Path, checkpoints: int) -> tuple[torch.Tensor, pathlib.Path]:
    """A shard process with a table on disk, ``checkpoints`` checkpoints and pushes after the last; stopped with
    SIGKILL. (every row, its data dir)."""
    data = tmp_path / "d"
    shard = start_shard(0, 1, tmp_path, str(data))
    try:
        with Client([shard.address]) as c:
            _pair(c, 60_000)
            for k in range(checkpoints + 1):
                ids = torch.arange(k * 1000, 60_000)
                c.push("disk", ids, torch.ones(ids.shape[0], DIM), wait=True)
                c.push("ram", ids, torch.ones(ids.shape[0], DIM), wait=True)
                if k < checkpoints:
                    c.checkpoint()
            expected = _all(c, "ram", 60_000)
    finally:
        shard.kill()
    return expected, data


def test_a_damaged_disk_tier_checkpoint_falls_back_or_stops_the_start_naming_it(tmp_path):
    expected, data = _trained_shard(tmp_path, checkpoints=2)
    newest = sorted((data / "disk" / "checkpoints").iterdir())[-1]
    for seg in newest.glob("t-*/seg-*.dat"):  # gone (hard links: those it shares live on in the older one)
        seg.unlink()
    shard = start_shard(0, 1, tmp_path, str(data))  # the previous checkpoint and the log behind it
    try:
        with Client([shard.address]) as c:
            assert torch.equal(_all(c, "disk", 60_000), expected)
        assert str(newest) in shard.log()
    finally:
        shard.kill()

    only = tmp_path / "only"
    only.mkdir()
    expected, data = _trained_shard(only, checkpoints=1)
    (tier,) = (data / "disk" / "checkpoints").iterdir()
    segs = sorted(tier.glob("t-*/seg-*.dat"))
    assert segs
    for seg in segs:  # as long as it was, its bytes damaged (the checksum finds it)
        seg.write_bytes(b"x" * seg.stat().st_size)
    with pytest.raises(RuntimeError, match=str(tier)):
        start_shard(0, 1, only, str(data)).kill()  # (one that starts anyway is stopped, and the test fails)


def test_a_disk_tier_written_for_another_spec_or_dir_stops_the_start_naming_the_file(tmp_path):
    _, data = _trained_shard(tmp_path, checkpoints=1)
    (tier,) = (data / "disk" / "checkpoints").iterdir()
    layouts = tier / "shardps-layouts.json"
    spec = json.loads(layouts.read_text())
    spec["disk"]["dim"] = DIM * 2
    layouts.write_text(json.dumps(spec))
    with pytest.raises(RuntimeError, match=f"{layouts}.*another table spec"):
        start_shard(0, 1, tmp_path, str(data)).kill()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("not ours")
    with pytest.raises(RuntimeError, match=f"{foreign}.*no {MARKER}"):
        start_shard(0, 1, tmp_path, None, extra=["--disk-dir", str(foreign)]).kill()
    assert (foreign / "precious.txt").read_text() == "not ours"
    with pytest.raises(RuntimeError, match="belongs to shard 0 of 1"):
        start_shard(1, 2, tmp_path, None, extra=["--disk-dir", str(data / "disk")]).kill()
    (tmp_path / "d2").mkdir()
    server = ShardServer(ShardConfig(0, 1, data_dir=str(tmp_path / "d2"))).start()  # <data-dir>/disk, foreign
    (tmp_path / "d2" / "disk").mkdir()
    (tmp_path / "d2" / "disk" / "notes.txt").write_text("not ours")
    try:
        with Client([server.address]) as c, pytest.raises(InvalidArgumentError, match=f"'t'.*{tmp_path / 'd2' / 'disk'}"):
            c.create_table("t", dim=4, storage="disk")
        assert (tmp_path / "d2" / "disk" / "notes.txt").read_text() == "not ours"
    finally:
        server.stop(checkpoint=False)


@pytest.fixture
def small_fs(tmp_path):
    """A 96 MiB tmpfs (a disk that fills up), unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN): the full-disk test cannot run here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_refuses_requests_and_loses_nothing_acknowledged(tmp_path, small_fs):
    """The disk tier on a 96 MiB file system filled with another file: pushes that need rows written back are
    refused naming the directory, with nothing applied; once space is freed training goes on, and every row equals
    its count of acknowledged pushes."""
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (72 << 20))
    config = ShardConfig(0, 1, data_dir=str(tmp_path / "d"), disk_dir=str(small_fs / "disk"), disk_min_free_mb=8)
    rows = 300_000
    counts = np.zeros(rows, np.int64)
    with ShardServer(config).start() as server, Client([server.address]) as c:
        c.create_table("cnt", dim=16, num_embeddings=rows, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                       storage=DiskTier(memory_mb=12))
        refused = None
        for lo in range(0, rows, 10_000):
            ids = np.arange(lo, lo + 10_000)
            try:
                c.push("cnt", torch.from_numpy(ids), torch.ones(10_000, 16), wait=True)
            except RequestTooLargeError as e:
                refused = e
                break
            counts[ids] += 1
        assert refused is not None and str(small_fs / "disk") in str(refused) and "free" in str(refused)
        with pytest.raises(RequestTooLargeError, match="free"):  # larger than memory: refused before any part
            # (one message: a push the client split in two could have its smaller part applied, unknown to this count)
            c.push("cnt", torch.arange(rows - 45_000, rows), torch.ones(45_000, 16), wait=True)
        filler.unlink()
        for lo in range(0, rows, 10_000):
            ids = np.arange(lo, lo + 10_000)
            c.push("cnt", torch.from_numpy(ids), torch.ones(10_000, 16), wait=True)
            counts[ids] += 1
        got = _all(c, "cnt", rows)[:, 0]
    torch.testing.assert_close(got, -torch.from_numpy(counts.astype(np.float32)), rtol=0, atol=0)


def test_export_serving_and_offline_reshard_carry_the_rows_on_disk(tmp_path):
    """An export (base and delta) of a table ten times its memory holds every row, read by safetensors' own
    library; a serving shard with a disk tier serves it; ``shardps reshard`` 2 -> 3 keeps every row and its
    Adagrad state (the next step equals the in-RAM table's)."""
    rows, n = 120_000, 2
    servers = [_server(i, n, tmp_path / "src") for i in range(n)]
    try:
        with Client([s.address for s in servers]) as c:
            _pair(c, rows, optimizer=Adagrad(lr=0.1))
            for k in range(2):
                ids = torch.arange(k, rows, 2)
                g = torch.randn(ids.shape[0], DIM)
                c.push("disk", ids, g)
                c.push("ram", ids, g)
                c.flush()
                (c.export if k == 0 else c.export_delta)(tmp_path / "exp")
            expected = _all(c, "ram", rows)
    finally:
        for s in servers:
            s.stop(checkpoint=True)
    _, state = load_tables(tmp_path / "exp")
    got = {int(i): v for s in state.values() for i, v in zip(s["disk"].ids, s["disk"].values)}
    assert len(got) == rows and all(torch.equal(torch.from_numpy(got[i]), expected[i]) for i in range(0, rows, 997))
    base = json.loads(next((tmp_path / "exp").glob("base-*.json")).read_text())
    part = next(e for e in base["tables"] if e["name"] == "disk")["shards"][0]
    from safetensors.numpy import load_file
    np.testing.assert_array_equal(load_file(tmp_path / "exp" / part["file"])["values"],
                                  read_safetensors(tmp_path / "exp" / part["file"])[0]["values"])

    serving = [ShardServer(ShardConfig(i, n, serve_from=str(tmp_path / "exp"), disk_dir=str(tmp_path / f"sv{i}"))).start()
               for i in range(n)]
    try:
        with Client([s.address for s in serving]) as c:
            assert torch.equal(_all(c, "disk", rows), expected)
    finally:
        for s in serving:
            s.stop(checkpoint=False)

    reshard(tmp_path / "src", tmp_path / "dst", 3)
    servers = [_server(i, 3, tmp_path / "dst") for i in range(3)]
    try:
        with Client([s.address for s in servers]) as c:
            assert torch.equal(_all(c, "disk", rows), expected)
            assert sum(t.disk_rows for t in c.describe_table("disk")) == rows
            ids, g = torch.arange(0, rows, 3), torch.ones(rows // 3, DIM)
            c.push("disk", ids, g)
            c.push("ram", ids, g)
            c.flush()
            assert torch.equal(_all(c, "disk", rows), _all(c, "ram", rows))  # Adagrad's state came along
    finally:
        for s in servers:
            s.stop(checkpoint=False)


def test_bad_disk_tier_specs_and_shards_without_a_disk_are_refused_clearly(tmp_path):
    with pytest.raises(Exception, match="memory_mb"):
        DiskTier(memory_mb=0)
    with pytest.raises(Exception, match="policy"):
        DiskTier(policy="fifo")
    assert DiskTier().policy == "clock"
    with pytest.raises(Exception, match="eviction policy must be one of"):  # a disk tier's policy only
        Eviction(max_rows=10, policy="clock")
    server = ShardServer(ShardConfig(0, 1)).start()  # no data dir, no disk dir
    try:
        with Client([server.address]) as c:
            with pytest.raises(InvalidArgumentError, match="no --disk-dir"):
                c.create_table("t", dim=4, storage="disk")
            with pytest.raises(InvalidArgumentError, match="'t2'.*disk tier keeps every row"):
                c.create_table("t2", dim=4, storage="disk", eviction=Eviction(max_rows=10))
            with pytest.raises(InvalidArgumentError, match="storage"):
                c.create_table("t3", dim=4, storage="ssd")
    finally:
        server.stop(checkpoint=False)
    with pytest.raises(DiskTierError):
        (tmp_path / "x").mkdir()
        (tmp_path / "x" / "f").write_text("")
        DiskTiers(tmp_path / "x", 0, 1).check_root()


def test_a_tables_disk_tier_policy_is_not_what_makes_it_another(tmp_path):
    """Creating an existing disk-tier table with another victim policy or sample finds it (it keeps its own): a table
    made with the default before "clock" ("lru") is found by today's ``DiskTier()``. Another ``memory_mb`` is
    another table, refused, naming the difference."""
    from shardps_client import TableExistsError

    server = _server(0, 1, tmp_path)
    try:
        with Client([server.address]) as c:
            assert c.create_table("t", dim=DIM, num_embeddings=1000, storage=DiskTier(memory_mb=8, policy="lru"))
            assert not c.create_table("t", dim=DIM, num_embeddings=1000, storage=DiskTier(memory_mb=8))
            assert not c.create_table("t", dim=DIM, num_embeddings=1000, storage=DiskTier(memory_mb=8, sample=4))
            with pytest.raises(TableExistsError, match="memory_mb=16"):
                c.create_table("t", dim=DIM, num_embeddings=1000, storage=DiskTier(memory_mb=16))
            with pytest.raises(TableExistsError):
                c.create_table("t", dim=DIM, num_embeddings=1000)  # in RAM: another table
            spec = server.shard.registry.lookup("t").spec
            assert spec.disk is not None and spec.disk.policy == "lru"
    finally:
        server.stop(checkpoint=False)


def test_tiered_stats_show_in_shardps_stats(tmp_path):
    server = _server(0, 1, tmp_path)
    try:
        with Client([server.address]) as c:
            _pair(c, 50_000)
            c.push("disk", torch.arange(50_000), torch.ones(50_000, DIM), wait=True)
        cluster = tmp_path / "c.json"
        cluster.write_text(json.dumps({"addresses": [server.address]}))
        out = subprocess.run([sys.executable, "-m", "shardps", "stats", "--cluster-file", str(cluster)],
                             capture_output=True, text=True, timeout=60).stdout
        assert "on disk" in out and "hit rate" in out and "written back" in out
    finally:
        server.stop(checkpoint=False)


@pytest.mark.parametrize("num_embeddings,flat", [(400_000, True), (4_000_000, False)], ids=["flat map", "hash index"])
def test_a_hot_sets_index_is_a_flat_map_when_cheap_and_its_rows_fill_memory_mb_at_most(num_embeddings, flat):
    """A hot set's index is a flat id -> slot map when the map (4 bytes an id) takes at most an eighth of memory_mb,
    else a hash index; either way its rows, flags and index, filled to the hot set's capacity, are charged at most
    memory_mb, the index finds every row, and rows leaving keep it exact."""
    from shardps.server.storage.tiered import hot_store

    limit = 16 << 20
    rows = hot_store("t", 16, {"acc": 0.0}, DiskTier(memory_mb=16), num_embeddings)
    assert rows._direct == flat
    rng = np.random.default_rng(3)
    ids = rng.choice(num_embeddings, rows.max_rows, replace=False).astype(np.int64)
    rows.append(ids, rng.standard_normal((ids.shape[0], 16)).astype(np.float32))
    assert rows.charged <= limit and rows.budget.used <= limit
    assert rows.max_rows * (rows.row_bytes + rows.index_row_bytes) > 0.9 * limit  # (and the room is used)
    np.testing.assert_array_equal(rows.index.lookup(ids), np.arange(ids.shape[0]))
    gone = ids[: ids.shape[0] // 3]
    rows.remove(gone)
    left = ids[ids.shape[0] // 3:]
    assert (rows.index.lookup(gone) == -1).all()
    np.testing.assert_array_equal(np.sort(rows.ids[rows.index.lookup(left)]), np.sort(left))
