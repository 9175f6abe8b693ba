"""Tables larger than memory: a table with a disk tier against the same table all in RAM, in one run.

- Throughput: 2 shards hold a --rows x 64 float32 table (SGD), every row written once before timing; the
  standard loop (batches of 8,192 ids, unique rows pulled then pushed) under Zipf(1.1) and uniform ids,
  rows/s against the same table in RAM (its own cluster, up at the same time: the two measured in alternating
  windows, --rounds of each); then the pipelined loop under Zipf(1.1) (the next batch's rows prefetched before this
  batch's pull and push: what TrainPipeline does by default), which lets a shard bring cold rows in while the client
  works. The tiered shards run
  with --max-memory-mb --budget-mb; the table's tier takes --memory-mb of it.
- Memory and disk: each tiered shard's largest RSS as a multiple of its budget, disk bytes per row, the
  tier's hit rate.
- Restart: a tiered shard stopped with SIGTERM (it checkpoints: its hot rows, and its segments'
  hard links) and started again: seconds until it serves, against the RAM table's shard.
- CPU: the shards' CPU seconds over each measured loop, per row, and for the tiered table the CPU a miss costs above
  the RAM table's (its CPU per row less the RAM table's, over its misses per row).
- A miss's CPU by part: one shard's share of the table in a Table of its own (no server), the same loop, each part
  of the misses' work timed around its calls (``PARTS``), per miss.
- Stores (--stores): the cold stores the disk tier could use, measured on the same rows (--store-rows records of
  276 bytes, batches of the workload's unique Zipf ids): bulk load, a batch read, a batch write, and the RSS a
  process holds after reading: the tier's own segment files (``segments``), RocksDB as the tier used it before
  (rocksdict), RocksDB tuned for point reads (1 KiB blocks, no checksum checks on reads) and LMDB (lmdb, skipped
  when not installed).

    python -m benchmarks.bench_tiered                     # 20M rows, 1 GiB per shard (several minutes)
    python -m benchmarks.bench_tiered --quick             # smoke run
Writes benchmarks/results/tiered.json and tiered.png.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import pathlib
import shutil
import signal
import tempfile
import threading
import time
from typing import Any, Optional

import numpy as np
import torch
from shardps_client import SGD, Client, DiskTier

from benchmarks.common import RESULTS, Progress, plot, rss_bytes, table, unique_batches, write_outputs
from shardps.core.specs import Initializer
from shardps.probe import check as check_health
from shardps.server.ops.launcher import LocalCluster, cpu_seconds

DIM = 64
PIPELINED = "_pipelined"  # a workload's name ending so runs the pipelined loop
MIB = 1 << 20


class _RssWatch:
    """The largest RSS of some processes, sampled every 0.2 s in a thread until stopped."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peak = {p: 0 for p in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self.pids:
                try:
                    self.peak[p] = max(self.peak[p], rss_bytes(p))
                except OSError:
                    pass
            self._stop.wait(0.2)

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def _fill(c: Client, name: str, rows: int) -> float:
    """Write every row once (a push of zeros gradients makes the row; SGD leaves it at its initial value); rows/s."""
    t0 = time.perf_counter()
    step = 16_384
    for lo in range(0, rows, step):
        ids = torch.arange(lo, min(rows, lo + step))
        c.push(name, ids, torch.zeros(ids.shape[0], DIM))
    c.flush()
    return rows / (time.perf_counter() - t0)


def _loop(c: Client, name: str, batches: list[torch.Tensor], seconds: float, start: int = 0,
          pipelined: bool = False) -> tuple[float, int, int]:
    """The standard loop for ``seconds`` from batch ``start`` on: pull the unique rows, push a gradient per row;
    (unique rows/s, the next batch, rows). ``pipelined``: the loop ``TrainPipeline`` and ``Prefetcher`` run by
    default (depth 1): the next batch's rows prefetched before this batch's pull (which takes them) and push, so a
    shard brings the next batch's cold rows in while the client works on this one."""
    t0, n, i = time.perf_counter(), 0, start
    if pipelined:
        c.prefetch(name, batches[i % len(batches)])
    while time.perf_counter() - t0 < seconds:
        ids = batches[i % len(batches)]
        if pipelined:
            c.prefetch(name, batches[(i + 1) % len(batches)])
        rows = c.pull(name, ids)
        c.push(name, ids, rows * 0.01)
        n += ids.shape[0]
        i += 1
    if pipelined:  # the batch prefetched last, pulled and pushed too: no prefetch left over for the next window
        ids = batches[i % len(batches)]
        c.push(name, ids, c.pull(name, ids) * 0.01)
        n += ids.shape[0]
        i += 1
    c.flush()
    return n / (time.perf_counter() - t0), i, n


def _restart_s(cluster: LocalCluster, index: int) -> tuple[float, float]:
    """(seconds a SIGTERM takes, checkpoint included; seconds the restarted shard takes to serve again)."""
    p = cluster.procs[index]
    t0 = time.perf_counter()
    p.popen.send_signal(signal.SIGTERM)
    p.popen.wait(300)
    stopped = time.perf_counter() - t0
    t0 = time.perf_counter()
    cluster.restart(index, timeout=600)
    while check_health(cluster.procs[index].address) != "SERVING":
        time.sleep(0.05)
    return stopped, time.perf_counter() - t0


def run_tables(args: argparse.Namespace, batches: dict[str, list[torch.Tensor]],
               progress: Progress) -> list[dict[str, Any]]:
    """The table all in RAM and the same table with a disk tier, each in its own cluster, both up at once and
    measured in alternating windows (RAM, tier, tier, RAM, ...: ``--rounds`` of each per distribution), so the
    machine's drift over minutes moves both alike; then each one's restart. ``batches``: each workload's batches by
    its name (the pipelined loop's ends in ``PIPELINED``)."""
    setups: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        for tiered in (False, True):
            label = f"disk tier ({args.memory_mb:g} MiB hot)" if tiered else "all in RAM"
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="shardps-tiered-", dir=args.dir))
            serve = ["--max-memory-mb", str(args.budget_mb if tiered else 64 << 10)]
            cluster = stack.enter_context(LocalCluster(args.shards, data_dir=tmp, serve_args=serve))
            c = stack.enter_context(Client(cluster.addresses))
            storage = DiskTier(memory_mb=args.memory_mb) if tiered else "memory"
            c.create_table("t", dim=DIM, num_embeddings=args.rows, optimizer=SGD(lr=0.01),
                           initializer=Initializer("uniform", a=0.01), storage=storage)
            out: dict[str, Any] = {"table": label, "fill_rows_per_s": _fill(c, "t", args.rows)}
            progress.step(f"{label}: {args.rows:,} rows written")
            pids = [p.popen.pid for p in cluster.procs]
            setups.append({"tiered": tiered, "cluster": cluster, "client": c, "pids": pids, "out": out,
                           "watch": _RssWatch(pids)})
        for dist, bs in batches.items():
            piped = dist.endswith(PIPELINED)
            for s in setups:
                _, s["at"], _ = _loop(s["client"], "t", bs, args.warmup, pipelined=piped)
                s["before"] = s["client"].describe_table("t") if s["tiered"] else None
                s["rows"], s["seconds"], s["cpu"] = 0, 0.0, 0.0
            for r in range(args.rounds):
                for s in (setups if r % 2 == 0 else setups[::-1]):
                    cpu0 = sum(cpu_seconds(pid) for pid in s["pids"])
                    rate, s["at"], n = _loop(s["client"], "t", bs, args.seconds / args.rounds, s["at"], piped)
                    s["cpu"] += sum(cpu_seconds(pid) for pid in s["pids"]) - cpu0
                    s["rows"] += n
                    s["seconds"] += n / rate
            for s in setups:
                out = s["out"]
                out[f"{dist}_rows_per_s"] = s["rows"] / s["seconds"]
                out[f"{dist}_shard_us_per_row"] = s["cpu"] * 1e6 / s["rows"]
                out[f"{dist}_batches_reused"] = max(0, s["at"] - len(bs))
                if s["tiered"]:  # over the measured windows (and the other table's, when this one was idle)
                    after = s["client"].describe_table("t")
                    hits = sum(a.tier_hits - b.tier_hits for a, b in zip(after, s["before"]))
                    misses = sum(a.tier_misses - b.tier_misses for a, b in zip(after, s["before"]))
                    out[f"{dist}_hit_rate"] = hits / max(hits + misses, 1)
                    out[f"{dist}_misses_per_row"] = misses / s["rows"]  # a row pulled and pushed: 2 lookups
            progress.step(f"{dist}: {args.rounds} windows of each")
        for s in setups:
            out, info = s["out"], s["client"].describe_table("t")
            peak = s["watch"].stop()
            out["peak_rss_mib"] = max(peak.values()) / MIB
            out["rss_x_budget"] = max(peak.values()) / (args.budget_mb * MIB) if s["tiered"] else None
            out["mem_bytes_per_row"] = sum(t.bytes for t in info) / args.rows
            if s["tiered"]:
                out["disk_bytes_per_row"] = sum(t.disk_bytes for t in info) / args.rows
                out["hot_rows"] = sum(t.hot_rows for t in info)
            out["stop_s"], out["restart_s"] = _restart_s(s["cluster"], 0)
            progress.step(f"{out['table']}: restart")
    return [s["out"] for s in setups]


# ---- the stores, side by side --------------------------------------------------------------------


def _store_probe(kind: str, rows: int, batches: list[np.ndarray], path: str, queue: Any) -> None:
    """In a fresh process: load ``rows`` records, read and write ``batches``; rows/s, ms per batch, RSS growth."""
    rec = 64 * 4 + 20
    value = np.random.default_rng(1).integers(0, 255, rec, dtype=np.uint8).tobytes()

    def keys(ids: np.ndarray) -> list[bytes]:
        return ids.astype(">u8").view("V8").tolist()  # type: ignore[no-any-return]

    rss0 = rss_bytes(os.getpid())
    if kind == "segments":
        from shardps.server.storage.records import RecordCodec
        from shardps.server.storage.segments import SegmentStore

        codec = RecordCodec(64, [])
        store = SegmentStore(pathlib.Path(path), codec)
        one = np.frombuffer(value, codec.dtype)

        def put(ids: np.ndarray) -> None:
            store.put(ids.astype(np.int64), np.repeat(one, ids.shape[0]))

        def get(ids: np.ndarray) -> None:
            store.get(ids.astype(np.int64))
    elif kind.startswith("rocksdb"):
        import rocksdict

        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_compression_type(rocksdict.DBCompressionType.none())
        tab = rocksdict.BlockBasedOptions()
        tab.set_block_cache(rocksdict.Cache(32 * MIB))
        tab.set_bloom_filter(10, False)
        if kind == "rocksdb-tuned":  # point reads: a block per row's neighbourhood, checksums not checked on reads
            tab.set_block_size(1024)
        opts.set_block_based_table_factory(tab)
        db = rocksdict.Rdict(path, opts)
        wo = rocksdict.WriteOptions()
        wo.disable_wal = True  # type: ignore[method-assign,assignment]
        db.set_write_options(wo)
        ro = rocksdict.ReadOptions()
        ro.fill_cache(False)  # as the tier read: its rows go into the hot set
        if kind == "rocksdb-tuned":
            ro.set_verify_checksums(False)
        db.set_read_options(ro)

        def put(ids: np.ndarray) -> None:
            wb = rocksdict.WriteBatch(raw_mode=True)
            for k in keys(ids):
                wb.put(k, value)
            db.write(wb)

        def get(ids: np.ndarray) -> None:
            db.get(keys(ids))
    else:
        import lmdb

        env = lmdb.open(path, map_size=1 << 40, sync=False, metasync=False, readahead=False)

        def put(ids: np.ndarray) -> None:
            with env.begin(write=True) as txn, txn.cursor() as cur:
                cur.putmulti([(k, value) for k in keys(ids)])

        def get(ids: np.ndarray) -> None:
            with env.begin() as txn, txn.cursor() as cur:
                cur.getmulti(keys(ids))

    t0 = time.perf_counter()
    for lo in range(0, rows, 100_000):
        put(np.arange(lo, min(rows, lo + 100_000)))
    load = rows / (time.perf_counter() - t0)
    for b in batches[:5]:
        get(b)
    t0 = time.perf_counter()
    for b in batches:
        get(b)
    read_ms = (time.perf_counter() - t0) / len(batches) * 1e3
    t0 = time.perf_counter()
    for b in batches:
        put(b)
    write_ms = (time.perf_counter() - t0) / len(batches) * 1e3
    rng = np.random.default_rng(2)
    for _ in range(40):  # reads all over the store: what stays in the process's RSS
        get(np.unique(rng.integers(0, rows, 8192)))
    per_batch = float(np.mean([b.shape[0] for b in batches]))
    queue.put({"store": kind, "load_rows_per_s": load, "read_ms": read_ms, "write_ms": write_ms,
               "read_rows_per_s": per_batch / read_ms * 1e3, "write_rows_per_s": per_batch / write_ms * 1e3,
               "rss_growth_mib": (rss_bytes(os.getpid()) - rss0) / MIB})


def run_stores(args: argparse.Namespace, progress: Progress) -> list[dict[str, Any]]:
    import importlib.util

    batches = unique_batches(5, 40, 8192, args.store_rows, 1.1)
    out = []
    ctx = mp.get_context("spawn")
    for kind, module in (("segments", "numpy"), ("rocksdb", "rocksdict"), ("rocksdb-tuned", "rocksdict"),
                         ("lmdb", "lmdb")):
        if importlib.util.find_spec(module) is None:
            progress.step(f"{kind}: {module} not installed, skipped")
            continue
        path = tempfile.mkdtemp(prefix=f"shardps-{kind}-", dir=args.dir)
        try:
            queue = ctx.Queue()
            proc = ctx.Process(target=_store_probe, args=(kind, args.store_rows, batches, path, queue))
            proc.start()
            out.append(queue.get(timeout=1800))
            proc.join()
        finally:
            shutil.rmtree(path, ignore_errors=True)
        progress.step(kind)
    base = next((r for r in out if r["store"] == "rocksdb"), None)
    for r in out:
        for k in ("load_rows_per_s", "read_rows_per_s", "write_rows_per_s"):
            r["x_rocksdb_" + k.split("_")[0]] = r[k] / base[k] if base else None
    return out


# ---- where a miss's CPU goes -----------------------------------------------------------------------------------------

# (part, its function) of a miss's work in a tiered table, timed around each call; "a > b": b is inside a. A row
# that misses is located on disk, room is made (victims chosen, the changed ones written back, then removed), and it
# is read and brought in.
PARTS = [
    ("locate on disk", "shardps.server.storage.disk:TableStore.locate"),
    ("make room", "shardps.server.storage.tiered:HotSet._make_room"),
    ("make room > choose victims", "shardps.server.storage.tiered:Victims.choose"),
    ("make room > write back", "shardps.server.storage.tiered:HotSet.write_back"),
    ("write back > rows into records", "shardps.server.storage.disk:gather_columns"),
    ("write back > append, index", "shardps.server.storage.segments:SegmentStore.put_data"),
    ("make room > remove from memory", "shardps.server.storage.rows:RowStore.remove"),
    ("read from disk", "shardps.server.storage.disk:TableStore.read_at"),
    ("read from disk > preads", "kernels:pread_records"),  # (the compiled kernels' object, as the shard has it)
    ("bring in", "shardps.server.storage.tiered:HotSet._bring_in"),
]
TOP_PARTS = [name for name, _ in PARTS if ">" not in name]


def _parts_probe(rows: int, memory_mb: float, batches: list[np.ndarray], path: str, queue: Any) -> None:
    """In a fresh process: one shard's share of the table in a Table with the disk tier (no server around it),
    every row written, then the standard loop (read, then an SGD push) over ``batches``: the CPU of each part of
    the misses (``PARTS``), per miss, timed around each call (thread CPU time)."""
    import importlib

    from shardps.core.policies import DiskTier as Tier
    from shardps.core.specs import TableSpec
    from shardps.server.storage.budget import MemoryBudget
    from shardps.server.storage.disk import DiskTiers
    from shardps.server.storage.table import Table

    spent = {name: 0.0 for name, _ in PARTS}
    timing = [False]

    def timed(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if not timing[0]:
                return fn(*a, **k)
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.thread_time() - t0
        return call

    from shardps.core import kernels

    for name, where in PARTS:
        module, attr = where.split(":")
        owner: Any = kernels.jit() if module == "kernels" else importlib.import_module(module)
        if owner is None:  # (no compiled kernels: the numpy references read the mappings instead)
            continue
        *outer, last = attr.split(".")
        for o in outer:
            owner = getattr(owner, o)
        setattr(owner, last, timed(name, getattr(owner, last)))
    spec = TableSpec(name="t", num_embeddings=rows, dim=DIM, optimizer=SGD(lr=0.01),
                     disk=Tier(memory_mb=memory_mb))
    t = Table(spec, lambda ids: np.ones(ids.shape, bool), budget=MemoryBudget(1 << 50),
              tiers=DiskTiers(pathlib.Path(path), 0, 1, 0))
    assert t.hot is not None
    version = 0
    for lo in range(0, rows, 65536):
        ids = np.arange(lo, min(rows, lo + 65536), dtype=np.int64)
        with t.lock:
            t.apply(ids, np.zeros((ids.shape[0], DIM), np.float32), version=version, stamp=version + 1)
        version += 1

    def loop(part: list[np.ndarray]) -> float:
        nonlocal version
        t0 = time.thread_time()
        for ids in part:
            with t.lock:
                t.read(ids, version)
                t.apply(ids, np.full((ids.shape[0], DIM), 0.01, np.float32), version=version, stamp=version + 1)
            version += 1
        return time.thread_time() - t0

    warm = len(batches) // 3
    loop(batches[:warm])
    misses0 = t.hot.counts.misses
    timing[0] = True
    total = loop(batches[warm:])
    misses = t.hot.counts.misses - misses0
    looped = sum(b.shape[0] for b in batches[warm:])
    parts = [{"part": name, "us_per_miss": spent[name] / misses * 1e6} for name, _ in PARTS]
    parts.append({"part": "all the parts", "us_per_miss": sum(spent[name] for name in TOP_PARTS) / misses * 1e6})
    queue.put({"misses_per_row": misses / looped, "us_per_row": total / looped * 1e6, "parts": parts})


def run_parts(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    rows = args.rows // args.shards
    batches = unique_batches(9, max(60, args.batches // 4), 8192 // args.shards, rows, 1.1)
    path = tempfile.mkdtemp(prefix="shardps-parts-", dir=args.dir)
    try:
        queue = mp.get_context("spawn").Queue()
        proc = mp.get_context("spawn").Process(target=_parts_probe, args=(rows, args.memory_mb, batches, path, queue))
        proc.start()
        out: dict[str, Any] = queue.get(timeout=1800)
        proc.join()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    progress.step("a miss's parts")
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20_000_000, help="rows of the 64-wide table (default 20M: 5 GB)")
    p.add_argument("--shards", type=int, default=2, help="shard processes")
    p.add_argument("--budget-mb", type=int, default=1024, help="each tiered shard's --max-memory-mb, MiB")
    p.add_argument("--memory-mb", type=float, default=768, help="the table's disk tier memory_mb (per shard), MiB")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds measured per id distribution and table")
    p.add_argument("--rounds", type=int, default=4, help="windows each table's seconds are measured in, the two "
                   "tables' alternating")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds of the loop before each measurement")
    p.add_argument("--batches", type=int, default=3000, help="distinct batches of 8,192 ids per distribution (the loop "
                   "goes through them in order, warm-up included)")
    p.add_argument("--store-rows", type=int, default=1_000_000, help="records of the stores' comparison")
    p.add_argument("--no-stores", action="store_true", help="leave out the stores' comparison")
    p.add_argument("--no-parts", action="store_true", help="leave out the CPU of a miss by part")
    p.add_argument("--no-pipelined", action="store_true", help="leave out the pipelined loop (Zipf ids, the next "
                   "batch prefetched, as TrainPipeline runs by default)")
    p.add_argument("--dir", default=None, help="where the data dirs go (local disk; default: the temp dir)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 400k rows, a few seconds")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS, help="directory for tiered.json and tiered.png")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.budget_mb, args.memory_mb = 400_000, 256, 16
        args.seconds, args.warmup, args.store_rows, args.batches, args.rounds = 1.5, 0.5, 100_000, 64, 2
    # Batches are not reused within a run (a few thousand of each): a cycled handful would be a working set that
    # fits any memory, and measure a RAM cache instead of the disk tier.
    zipf = [torch.from_numpy(b) for b in unique_batches(7, args.batches, 8192, args.rows, 1.1)]
    uniform = [torch.from_numpy(b) for b in unique_batches(8, args.batches, 8192, args.rows, None)]
    batches = {"zipf": zipf, "uniform": uniform}
    if not args.no_pipelined:  # batches of their own (none looped twice in a run)
        batches["zipf" + PIPELINED] = [torch.from_numpy(b) for b in unique_batches(17, args.batches, 8192, args.rows,
                                                                                   1.1)]
    progress = Progress(4 + len(batches) + (0 if args.no_stores else 4) + (0 if args.no_parts else 1), "tiered")
    rows = run_tables(args, batches, progress)
    ram = rows[0]
    for r in rows:
        for dist in batches:
            r[f"x_ram_{dist}"] = r[f"{dist}_rows_per_s"] / ram[f"{dist}_rows_per_s"]
        r["x_ram_restart"] = r["restart_s"] / ram["restart_s"]
        for dist in batches:  # CPU a miss costs above a row in RAM
            if r.get(f"{dist}_misses_per_row"):
                r[f"{dist}_us_per_miss"] = ((r[f"{dist}_shard_us_per_row"] - ram[f"{dist}_shard_us_per_row"])
                                            / r[f"{dist}_misses_per_row"])
    stores = [] if args.no_stores else run_stores(args, progress)
    parts = None if args.no_parts else run_parts(args, progress)
    piped = [("zipf_pipelined_rows_per_s", "Zipf pipelined rows/s", ",.0f"), ("x_ram_zipf_pipelined", "x RAM", ".2f"),
             ("zipf_pipelined_us_per_miss", "us/miss", ".1f")] if not args.no_pipelined else []
    print(table(rows, [("table", "table", ""), ("zipf_rows_per_s", "Zipf rows/s", ",.0f"),
                       ("x_ram_zipf", "x RAM", ".2f"), ("uniform_rows_per_s", "uniform rows/s", ",.0f"),
                       ("x_ram_uniform", "x RAM", ".2f"), *piped, ("zipf_hit_rate", "Zipf hits", ".3f"),
                       ("uniform_hit_rate", "uniform hits", ".3f"),
                       ("zipf_shard_us_per_row", "Zipf shard us/row", ".2f"), ("zipf_us_per_miss", "us/miss", ".1f"),
                       ("uniform_shard_us_per_row", "uniform shard us/row", ".2f"),
                       ("uniform_us_per_miss", "us/miss", ".1f"),
                       ("peak_rss_mib", "peak RSS MiB", ",.0f"), ("rss_x_budget", "RSS x budget", ".2f"),
                       ("disk_bytes_per_row", "disk B/row", ".0f"), ("mem_bytes_per_row", "RAM B/row", ".1f"),
                       ("restart_s", "restart s", ".2f"), ("x_ram_restart", "x RAM", ".2f"),
                       ("fill_rows_per_s", "fill rows/s", ",.0f")]))
    if stores:
        print()
        print(table(stores, [("store", "store", ""), ("load_rows_per_s", "load rows/s", ",.0f"),
                             ("read_ms", "batch read ms", ".2f"), ("x_rocksdb_read", "x rocksdb", ".2f"),
                             ("write_ms", "batch write ms", ".2f"), ("x_rocksdb_write", "x rocksdb", ".2f"),
                             ("rss_growth_mib", "RSS after reads MiB", ",.0f")]))
    if parts:
        print(f"\nA miss's CPU by part: one shard's share ({args.rows // args.shards:,} rows, memory_mb "
              f"{args.memory_mb:g}) in a Table without a server, Zipf(1.1), {parts['misses_per_row']:.3f} misses a "
              f"row, {parts['us_per_row']:.2f} us a row in all")
        print(table(parts["parts"], [("part", "part", ""), ("us_per_miss", "us/miss", ".2f")]))
    meta = {"args": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
            "stores": stores, "parts": parts}
    out = write_outputs("tiered", meta, rows, args.out)
    plot(out / "tiered.png", [
        ("rows/s by id distribution", "distribution", {r["table"]: (list(batches), [r[f"{d}_rows_per_s"] for d in batches])
                                                       for r in rows}),
    ], "unique rows pulled+pushed / s")
    print(f"\nwrote {out / 'tiered.json'} and {out / 'tiered.png'}")


if __name__ == "__main__":
    main()
