"""Training to serving: export throughput, delta size and time at an update rate, and a serving shard
applying a 1M-row delta while it answers pulls; each beside what a user would otherwise do.

1. Export: ``Client.export`` (a consistent cut, safetensors files, checksums) against the obvious
   alternative, ``Client.state_dict`` + ``torch.save`` of the same table (no cut across tables,
   no deltas), on a table of --rows rows x --dim.
2. Deltas: a trainer pushes at full speed for --interval seconds, then ``export_delta``: rows,
   bytes and seconds, against a full base written at the same moment.
3. Apply: every row changes (``load_state_dict``), ``export_delta`` writes a delta of all --rows
   rows; a serving shard applies it while a reader pulls 512 random rows in a loop. Pull latency
   idle and during the apply; apply time against a restart from a base of the same state (the
   refresh without deltas: a new serving process loading the export).

One shard trains and one serves (the per-shard figures; shards work in parallel).

    python -m benchmarks.bench_serving            # 1M rows x 64
    python -m benchmarks.bench_serving --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch
from shardps_client import SGD, Client, Initializer

from benchmarks.common import RESULTS, Progress, percentile_ms, table, write_outputs
from shardps.core.exports import compact
from shardps.server.ops.launcher import LocalCluster


def fill(c: Client, rows: int, dim: int) -> None:
    """Every row of the table materialised with a value of its own."""
    step = 65_536
    for start in range(0, rows, step):
        ids = np.arange(start, min(start + step, rows))
        c.push("emb", ids, np.random.default_rng(start).standard_normal((ids.size, dim)).astype(np.float32))
    c.flush()


def served_generation(c: Client) -> int:
    return int(c.shard_info()[0].serving.delta)


def reader(addresses: list[str], rows: int, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """Pull 512 random rows in a loop: (end time, latency) of each."""
    rng = np.random.default_rng(1)
    with Client(addresses) as c:
        while not stop.is_set():
            ids = torch.from_numpy(rng.integers(0, rows, 512))
            t0 = time.perf_counter()
            c.pull("emb", ids)
            t1 = time.perf_counter()
            out.append((t1, t1 - t0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--interval", type=float, default=5.0, help="seconds of training before a delta")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.quick:
        args.rows, args.dim, args.interval = 20_000, 16, 0.5
    progress = Progress(6, "serving")
    work = pathlib.Path(tempfile.mkdtemp(prefix="shardps-bench-serving-"))
    export_dir = work / "export"
    results: list[dict[str, Any]] = []
    mb = args.rows * args.dim * 4 / 2**20
    try:
        with LocalCluster(1) as trainers, Client(trainers.addresses, timeout=120) as c:
            c.create_table("emb", dim=args.dim, num_embeddings=args.rows, optimizer=SGD(lr=0.1),
                           initializer=Initializer("normal", std=0.1, seed=1))
            fill(c, args.rows, args.dim)
            progress.step("filled")
            # 1. export against state_dict + torch.save
            base = c.export(export_dir)
            t0 = time.perf_counter()
            torch.save(c.state_dict("emb"), work / "emb.pt")
            saved = time.perf_counter() - t0
            results.append({"part": "export", "what": "shardps export (base)", "rows": base.rows,
                            "seconds": base.seconds, "rows_per_s": base.rows / base.seconds,
                            "mb_per_s": base.bytes / 2**20 / base.seconds, "x_baseline": saved / base.seconds,
                            "pause_ms": base.pause_s * 1e3})
            results.append({"part": "export", "what": "state_dict + torch.save", "rows": args.rows, "seconds": saved,
                            "rows_per_s": args.rows / saved, "mb_per_s": mb / saved, "x_baseline": 1.0})
            progress.step("export")
            # 2. a delta after --interval seconds of training
            rng = np.random.default_rng(2)
            pushed = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.interval:
                ids = np.unique(np.minimum(rng.zipf(1.1, 4096) - 1, args.rows - 1))
                c.push("emb", ids, rng.standard_normal((ids.size, args.dim)).astype(np.float32))
                pushed += ids.size
            c.flush()
            rate = pushed / (time.perf_counter() - t0)
            d = c.export_delta(export_dir)
            full = c.export(work / "full")
            results.append({"part": "delta", "what": f"delta after {args.interval:g}s", "rows": d.rows,
                            "seconds": d.seconds, "mb": d.bytes / 2**20, "rows_pushed_per_s": rate,
                            "x_baseline": full.seconds / d.seconds, "size_x_base": d.bytes / full.bytes})
            results.append({"part": "delta", "what": "a new base instead", "rows": full.rows, "seconds": full.seconds,
                            "mb": full.bytes / 2**20, "rows_pushed_per_s": rate, "x_baseline": 1.0,
                            "size_x_base": 1.0})
            shutil.rmtree(work / "full")
            progress.step("delta")
            # 3. a serving shard applies a delta of every row while pulls go on
            with LocalCluster(1, serve_args=["--serve-from", str(export_dir), "--delta-poll", "0.05"]) as servers, \
                    Client(servers.addresses, timeout=120) as sc:
                stop, samples = threading.Event(), []
                t = threading.Thread(target=reader, args=(servers.addresses, args.rows, stop, samples))
                t.start()
                time.sleep(2.0 if not args.quick else 0.3)
                idle = [lat for _, lat in samples]
                c.load_state_dict("emb", {"weight": torch.full((args.rows, args.dim), 0.5)})
                big = c.export_delta(export_dir)
                seen = served_generation(sc)
                while seen != big.seq:
                    time.sleep(0.01)
                    seen = served_generation(sc)
                applied_at = time.perf_counter()
                apply_s = float(sc.shard_info()[0].serving.last_apply_s)
                time.sleep(0.5 if not args.quick else 0.1)
                stop.set()
                t.join(60)
                during = [lat for end, lat in samples if applied_at - apply_s - 0.05 <= end <= applied_at + 0.05]
                assert torch.equal(sc.pull("emb", torch.arange(5)), torch.full((5, args.dim), 0.5))
            progress.step("apply")
            compact(export_dir, work / "compacted")
            t0 = time.perf_counter()
            with LocalCluster(1, serve_args=["--serve-from", str(work / "compacted")]):
                restart = time.perf_counter() - t0
            progress.step("restart")
            results.append({"part": "apply", "what": f"apply a delta of {big.rows:,} rows", "rows": big.rows,
                            "seconds": apply_s, "mb": big.bytes / 2**20, "x_baseline": restart / apply_s,
                            "pull_p50_ms": percentile_ms(during, 50), "pull_p99_ms": percentile_ms(during, 99),
                            "pull_max_ms": max(during) * 1e3 if during else float("nan"), "pulls": len(during)})
            results.append({"part": "apply", "what": "restart a serving shard on a base", "rows": args.rows,
                            "seconds": restart, "x_baseline": 1.0, "pull_p50_ms": percentile_ms(idle, 50),
                            "pull_p99_ms": percentile_ms(idle, 99), "pull_max_ms": max(idle) * 1e3 if idle else 0,
                            "pulls": len(idle)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress.step("done")
    print(f"\n1. export of {args.rows:,} rows x {args.dim} ({mb:,.0f} MiB of values), 1 shard")
    print(table([r for r in results if r["part"] == "export"],
                [("what", "", ""), ("rows_per_s", "rows/s", ",.0f"), ("mb_per_s", "MiB/s", ",.0f"),
                 ("seconds", "s", ".2f"), ("x_baseline", "x torch.save", ".2f"), ("pause_ms", "pushes held ms", ".1f")]))
    print(f"\n2. a delta after {args.interval:g} s of pushes (Zipf 1.1 ids, 4,096 a push)")
    print(table([r for r in results if r["part"] == "delta"],
                [("what", "", ""), ("rows_pushed_per_s", "rows pushed/s", ",.0f"), ("rows", "rows", ",d"),
                 ("mb", "MiB", ".1f"), ("seconds", "s", ".3f"), ("size_x_base", "size x base", ".3f"),
                 ("x_baseline", "x faster than base", ".1f")]))
    print("\n3. a serving shard applies a delta of every row while a reader pulls 512 random rows in a loop")
    print(table([r for r in results if r["part"] == "apply"],
                [("what", "", ""), ("seconds", "s", ".2f"), ("x_baseline", "x faster than restart", ".1f"),
                 ("pull_p50_ms", "pull p50 ms", ".1f"), ("pull_p99_ms", "p99 ms", ".1f"),
                 ("pull_max_ms", "max ms", ".1f"), ("pulls", "pulls", ",d")]))
    print("pull latency: during the apply (first row) and idle before it (second row)")
    out = pathlib.Path(args.out)
    write_outputs("serving", {"args": vars(args)}, results, out)
    _plot(out / "serving.png", results)
    print(f"wrote {out / 'serving.json'} and {out / 'serving.png'}")
    return 0


def _plot(path: pathlib.Path, results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, part, key, label in ((axes[0], "export", "rows_per_s", "rows/s"), (axes[1], "delta", "seconds", "seconds"),
                                 (axes[2], "apply", "seconds", "seconds")):
        rows = [r for r in results if r["part"] == part]
        ax.barh([r["what"] for r in rows], [r[key] for r in rows])
        ax.set_xlabel(label)
        ax.set_title(part)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
