"""End to end: samples/s of the DLRM example trained through the shards against local training.

Runs clients/examples/dlrm.py (the same model, data and optimizers; its 8 tables as one
RemoteEmbeddingBagCollection) with 1 and 2 worker processes, without prefetch, with prefetch,
with prefetch and one RemoteEmbedding module per table instead of the collection, with prefetch and the
dense values lagging a step (--dense-lag 1), with prefetch and the MLPs trained
by DistributedDataParallel instead of on the shards (--dense ddp, the hybrid),
and with prefetch, lag 1 and the trainer's row cache for k = 2 and 8 steps
(--cache-steps), and the local torch.optim baseline, and reports samples/s and
test AUC side by side with ratios, and where the CPU went: the trainer's own CPU in forward + backward per step
(the main thread: Python and torch ops, not waits nor the client's I/O threads; locally every thread's), and
the CPU of trainers and shards together per 1,000 samples, against local training's (and the forward +
backward against local training's main thread alone, which leaves out what its other intra-op thread did, and
against local training run with one torch thread: the like for like, as a worker beside local shards gets one),
and that CPU by role (trainers, shards).

``--placement lab lab-10g lab-delay`` also runs every variant across the lab's hosts (``benchmarks/placement.py``:
each shard and each worker on a host of its own, the driver on a control host; as is, capped at 10 Gbit/s per
host, or with 100 us of proxy delay each way on the worker-shard links); local training is the same everywhere.

    python -m benchmarks.bench_e2e [--train 400000] [--repeat 3] [--quick] [--placement local lab]
Writes benchmarks/results/e2e.json and e2e.png.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import RESULTS, Progress, median_and_range, plot, table, write_outputs
from benchmarks.placement import PLACEMENTS, LabHosts

ROOT = pathlib.Path(__file__).resolve().parent.parent
DLRM = "clients.examples.dlrm"  # run as python -m from ROOT


# Variants of the shardps runs: (label, extra dlrm.py arguments); --cache-steps adds cached ones.
VARIANTS = [("no", ["--prefetch-depth", "0"]), ("yes", []), ("yes, dense lag 1", ["--dense-lag", "1"]),
            ("yes, DDP dense", ["--dense", "ddp"]),
            ("yes, per-table modules", ["--embeddings", "tables"])]


def cached(k: int) -> tuple[str, list[str]]:
    return f"yes, lag 1, cache {k}", ["--dense-lag", "1", "--cache-steps", str(k)]


def fwd_bwd(r: dict) -> float:
    """CPU ms per step in forward + backward: a shardps trainer's main thread (its own work), local training's
    every thread (its intra-op threads do part of its work)."""
    return r["fwd_bwd_process_ms"] if r.get("local") else r["fwd_bwd_thread_ms"]


def run(args: argparse.Namespace, workers: int, extra: list[str], local: bool, placement: str = "local",
        lab: LabHosts | None = None) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "r.json"
        cmd = [sys.executable, "-m", DLRM, "--workers", str(workers), "--train", str(args.train), "--test", str(args.test),
               "--rows", str(args.rows), "--batch-size", str(args.batch_size), "--shards", str(args.shards),
               "--json", str(out)] + extra + (["--local-one-thread"] if local else ["--no-local"])
        if placement != "local":
            assert lab is not None
            where = lab.use(placement)
            cmd = [*lab.lab.wrap("ctl"), *cmd, "--netns", *(ns for _, ns in where.shards[:args.shards]),
                   "--worker-netns", *(ns for _, ns in where.trainers[:workers])]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
        return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The example's own default (400K): a shorter run weighs the first pass's row creation more than the example does.
    p.add_argument("--train", type=int, default=400_000, help="training samples per run (the example's default)")
    p.add_argument("--test", type=int, default=50_000, help="test samples")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per sparse feature table")
    p.add_argument("--batch-size", type=int, default=1024, help="samples per step per worker")
    p.add_argument("--shards", type=int, default=2, help="shards of the local cluster")
    p.add_argument("--repeat", type=int, default=1,
                   help="passes over every run, the local baseline included (each ratio is to its own pass's local "
                        "run); the table shows medians and the ratio's range")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker process counts")
    p.add_argument("--cache-steps", type=int, nargs="*", default=[2, 8],
                   help="row-cache steps k of the cached variants (prefetch, dense lag 1, Client.cache_table)")
    p.add_argument("--skip-ddp", action="store_true",
                   help="leave out the DDP variant (the test suite's smoke run: the DDP example has its own test)")
    p.add_argument("--skip-lag", action="store_true",
                   help="leave out the dense-lag variant without a cache (the suite's smoke run: a cached one has the lag)")
    p.add_argument("--skip-tables", action="store_true",
                   help="leave out the per-table-modules variant (the test suite's smoke run)")
    p.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    p.add_argument("--placement", nargs="+", choices=PLACEMENTS, default=["local"],
                   help="where shards and workers run: local, or each on a lab host of its own (lab, lab-10g, "
                        "lab-delay: benchmarks/placement.py; needs root)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.quick:
        args.train, args.test, args.rows = 20_000, 5_000, 50_000
    variants = [v for v in VARIANTS if not (args.skip_ddp and "DDP" in v[0]) and not (args.skip_tables and "per-table" in v[0])
                and not (args.skip_lag and v[0] == "yes, dense lag 1")]
    variants += [cached(k) for k in args.cache_steps]
    configs = [(placement, workers, label, extra) for placement in args.placement for workers in args.workers
               for label, extra in variants]
    progress = Progress(len(configs) * args.repeat, "e2e")
    runs: dict[tuple[str, int, str, str], list[dict]] = {}  # (trainer, workers, prefetch, placement) -> per pass
    lab = LabHosts(args.shards, max(args.workers)) if any(pl != "local" for pl in args.placement) else None
    try:
        for rep in range(args.repeat):
            local = None
            for placement, workers, label, extra in configs:
                r = run(args, workers, extra, local is None, placement, lab)
                if local is None:  # the first run of a pass also trains locally: this pass's baseline
                    local = {**r["local"], "best_auc": r["best_auc"], "local": True}
                    local["x_local"] = 1.0
                    runs.setdefault(("local torch.optim", 1, "-", "-"), []).append(local)
                    one = {**r["local_one_thread"], "best_auc": r["best_auc"], "local": True}
                    one["x_local"] = one["samples_per_s"] / local["samples_per_s"]
                    runs.setdefault(("local torch.optim, 1 thread", 1, "-", "-"), []).append(one)
                runs.setdefault(("shardps", workers, label, placement), []).append(
                    {**r["shardps"], "best_auc": r["best_auc"],
                     "x_local": r["shardps"]["samples_per_s"] / local["samples_per_s"]})
                progress.step(f"{workers} worker(s), prefetch {label}, {placement}"
                              + (f" (pass {rep + 1}/{args.repeat})" if args.repeat > 1 else ""))
    finally:
        if lab is not None:
            lab.close()
    rows = []
    base = runs[("local torch.optim", 1, "-", "-")]
    one_thread = runs[("local torch.optim, 1 thread", 1, "-", "-")]
    for (trainer, workers, label, placement), results in runs.items():
        x_local, x_local_range = median_and_range([r["x_local"] for r in results])
        cpu = [r["trainer_cpu_s_per_1k"] + r.get("shards_cpu_s_per_1k", 0.0) for r in results]
        rows.append({"trainer": trainer, "workers": workers, "prefetch": label, "placement": placement,
                     "samples_per_s": statistics.median(r["samples_per_s"] for r in results),
                     "x_local": x_local, "x_local_range": x_local_range,
                     "fwd_bwd_ms": statistics.median(fwd_bwd(r) for r in results),
                     "fwd_bwd_x_local": statistics.median(fwd_bwd(r) / fwd_bwd(lc) for r, lc in zip(results, base)),
                     "fwd_bwd_x_local_main": statistics.median(r["fwd_bwd_thread_ms"] / lc["fwd_bwd_thread_ms"]
                                                               for r, lc in zip(results, base)),
                     "fwd_bwd_x_one_thread": statistics.median(
                         r["fwd_bwd_thread_ms"] / lc["fwd_bwd_thread_ms"] for r, lc in zip(results, one_thread)),
                     "cpu_ms_per_1k": statistics.median(cpu) * 1e3,
                     "trainer_cpu_ms_per_1k": statistics.median(r["trainer_cpu_s_per_1k"] for r in results) * 1e3,
                     "shards_cpu_ms_per_1k": statistics.median(r.get("shards_cpu_s_per_1k", 0.0) for r in results) * 1e3,
                     "cpu_x_local": statistics.median(c / lc["trainer_cpu_s_per_1k"] for c, lc in zip(cpu, base)),
                     "auc": statistics.median(r["auc"] for r in results), "best_auc": results[0]["best_auc"],
                     "runs_samples_per_s": [r["samples_per_s"] for r in results], "runs_auc": [r["auc"] for r in results]})
    cols = [("trainer", "trainer", ""), ("placement", "placement", ""), ("workers", "workers", "d"),
            ("prefetch", "prefetch", ""), ("samples_per_s", "samples/s", ",.0f"), ("x_local", "x local", ".2f"), ("auc", "test AUC", ".4f"),
            ("best_auc", "best AUC", ".4f"), ("fwd_bwd_ms", "fwd+bwd CPU ms", ".2f"),
            ("fwd_bwd_x_local", "x local", ".2f"), ("fwd_bwd_x_local_main", "x its main thread", ".2f"),
            ("fwd_bwd_x_one_thread", "x local 1 thread", ".2f"),
            ("cpu_ms_per_1k", "CPU ms/1k samples", ".1f"),
            ("cpu_x_local", "x local", ".2f"), ("trainer_cpu_ms_per_1k", "trainers ms/1k", ".1f"),
            ("shards_cpu_ms_per_1k", "shards ms/1k", ".1f")]
    if args.repeat > 1:
        cols.insert(6, ("x_local_range", "x local range", ""))
    print()
    print(table(rows, cols))
    local = rows[0]
    out = pathlib.Path(args.out)
    write_outputs("e2e", {"args": vars(args)}, rows, out)
    series = {}
    for placement in args.placement:
        for pf, _ in variants:
            pts = [r for r in rows if r["trainer"] == "shardps" and r["prefetch"] == pf and r["placement"] == placement]
            name = f"shardps, prefetch {pf}" + ("" if placement == "local" else f", {placement}")
            series[name] = ([r["workers"] for r in pts], [r["samples_per_s"] for r in pts])
    series["local torch.optim"] = (list(args.workers), [local["samples_per_s"]] * len(args.workers))
    plot(out / "e2e.png", [("DLRM samples/s", "worker processes", series)], "samples/s")
    print(f"\nwrote {out / 'e2e.json'} and {out / 'e2e.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
