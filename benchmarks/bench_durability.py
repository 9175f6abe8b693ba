"""What durability costs: push throughput per durability setting, replay time per GB of log, restart time.

- Push rate: the standard workload (1M x 64 float32, Zipf 1.1 batches of 8,192 ids, SGD) pushed by 1 and
  4 concurrent trainers to 2 shards started with each setting: --durability none, checkpoint, and log
  with --fsync always / interval (the default with a data dir) / none. Runs are interleaved (--repeat);
  medians and ranges, as ratios of checkpoint's (the old default) from the same round.
- Replay: one shard's log grown to --replay-mb by pushes, the shard killed with SIGKILL (no checkpoint),
  restarted: seconds until it serves again, per GB of log replayed.
- Restart: a shard holding --restart-rows rows x 64 stopped with SIGTERM (it checkpoints), restarted:
  seconds until it serves again.
- Checkpoint pause: a two-phase checkpoint of 2 shards holding the table; pushes are held only while the
  state is copied in memory, not while it is written.

    python -m benchmarks.bench_durability [--quick] [--repeat 3]
Writes benchmarks/results/durability.json and durability.png.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile
import threading
import time

import numpy as np
import torch
from shardps_client import SGD, Client

from benchmarks.common import RESULTS, Progress, median_and_range, plot, table, unique_batches, write_outputs
from shardps.core.specs import Initializer
from shardps.server.ops.launcher import LocalCluster
from shardps.v1 import shardps_pb2 as pb

DIM = 64
# (label, durability, fsync); the label "log+interval" is the default with a data dir.
SETTINGS = [("none", "none", None), ("checkpoint", "checkpoint", None), ("log+always", "log", "always"),
            ("log+interval", "log", "interval"), ("log+none", "log", "none")]


def _serve_args(durability: str, fsync: str | None) -> list[str]:
    return ["--durability", durability] + (["--fsync", fsync] if fsync else [])


def _table(c: Client, rows: int = 1_000_000) -> None:
    c.create_table("d", dim=DIM, num_embeddings=rows, optimizer=SGD(lr=0.01), initializer=Initializer("zeros"))


def push_rate(addresses: list[str], trainers: int, budget: float) -> float:
    batches = [torch.from_numpy(b) for b in unique_batches(7, 16, 8192, 1_000_000, 1.1)]
    grads = [torch.full((len(b), DIM), 0.001) for b in batches]
    counts = [0] * trainers

    def run(rank: int) -> None:
        with Client(addresses, read_your_writes=False) as c:
            for i in range(3):
                c.push("d", batches[i], grads[i])
            c.flush()
            t0 = time.perf_counter()
            i = rank
            while time.perf_counter() - t0 < budget:
                k = i % len(batches)
                c.push("d", batches[k], grads[k])
                counts[rank] += len(batches[k])
                i += 1
            c.flush()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(trainers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def push_rates(repeat: int, budget: float, trainer_counts: list[int], shards: int, progress: Progress) -> list[dict]:
    runs: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeat):
        for label, durability, fsync in SETTINGS:
            for trainers in trainer_counts:
                with tempfile.TemporaryDirectory() as d:
                    data = None if durability == "none" else d
                    with LocalCluster(shards, data_dir=data, serve_args=_serve_args(durability, fsync)) as cl:
                        with Client(cl.addresses) as c:
                            _table(c)
                        runs.setdefault((label, trainers), []).append(push_rate(cl.addresses, trainers, budget))
                progress.step(f"{label}, {trainers} trainer(s)")
    rows = []
    for (label, trainers), rates in runs.items():
        base = runs[("checkpoint", trainers)]
        ratio, spread = median_and_range([r / b for r, b in zip(rates, base)])
        rows.append({"setting": label, "trainers": trainers, "push_rows_per_s": float(np.median(rates)),
                     "x_checkpoint": ratio, "range": spread, "runs": rates})
    return rows


def _until_serving(cl: LocalCluster, index: int) -> float:
    t0 = time.perf_counter()
    cl.restart(index, timeout=600)
    return time.perf_counter() - t0


def replay(log_mb: int, progress: Progress) -> dict:
    """Grow one shard's log to ``log_mb``, kill -9 it, time the restart that replays it."""
    with tempfile.TemporaryDirectory() as d:
        args = ["--fsync", "interval", "--checkpoint-log-mb", "0"]  # no checkpoint: the whole log replays
        with LocalCluster(1, data_dir=d, serve_args=args) as cl:
            with Client(cl.addresses, read_your_writes=False) as c:
                _table(c)
                batches = [torch.from_numpy(b) for b in unique_batches(3, 16, 8192, 1_000_000, 1.1)]
                i = 0
                while _log_bytes(pathlib.Path(d)) < log_mb << 20:
                    b = batches[i % len(batches)]
                    c.push("d", b, torch.full((len(b), DIM), 0.001))
                    i += 1
                    if i % 32 == 0:
                        c.flush()
                c.flush()
            nbytes = _log_bytes(pathlib.Path(d))
            cl.kill(0)
            seconds = _until_serving(cl, 0)
            records = _replayed(cl.procs[0].log_path.read_text())
        with LocalCluster(1, data_dir=None) as cl:  # the same start with nothing to replay
            cl.kill(0)
            empty = _until_serving(cl, 0)
    progress.step("replay")
    gb = nbytes / 1e9
    return {"log_bytes": nbytes, "records": records, "restart_s": seconds, "empty_start_s": empty,
            "replay_s_per_gb": (seconds - empty) / gb if gb else float("nan")}


def _log_bytes(data_dir: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in data_dir.rglob("wal-*.log"))


def _replayed(log_text: str) -> int:
    found = re.findall(r"replayed (\d+) write-ahead log records", log_text)
    return int(found[-1]) if found else 0


def restart(rows: int, progress: Progress) -> dict:
    """A shard of ``rows`` rows stopped with SIGTERM (a checkpoint), then started again."""
    with tempfile.TemporaryDirectory() as d, LocalCluster(1, data_dir=d) as cl:
        with Client(cl.addresses, read_your_writes=False) as c:
            _table(c, rows)
            for part in torch.split(torch.arange(rows), 100_000):
                c.push("d", part, torch.full((len(part), DIM), 0.001))
            c.flush()
        proc = cl.procs[0].popen
        proc.terminate()
        proc.wait(300)
        seconds = _until_serving(cl, 0)
        checkpoint_bytes = sum(p.stat().st_size for p in pathlib.Path(d).rglob("*.ckpt"))
    progress.step("restart")
    return {"rows": rows, "restart_s": seconds, "checkpoint_bytes": checkpoint_bytes}


def checkpoint_pause(rows: int, shards: int, progress: Progress) -> dict:
    with tempfile.TemporaryDirectory() as d, LocalCluster(shards, data_dir=d) as cl, Client(cl.addresses) as c:
        _table(c, rows)
        for part in torch.split(torch.arange(rows), 100_000):
            c.push("d", part, torch.full((len(part), DIM), 0.001))
        c.flush()
        phase = pb.CheckpointRequest.Phase
        t0 = time.perf_counter()
        c.transport.fan_out([(s, "Checkpoint", pb.CheckpointRequest(checkpoint_id="bench", phase=phase.PREPARE,
                                                                    hold_s=30)) for s in range(shards)])
        replies = c.transport.fan_out([(s, "Checkpoint", pb.CheckpointRequest(checkpoint_id="bench",
                                                                              phase=phase.COMMIT)) for s in range(shards)])
        total = time.perf_counter() - t0
    progress.step("checkpoint")
    return {"rows": rows, "bytes": sum(r.bytes for r in replies), "pause_ms": max(r.pause_s for r in replies) * 1e3,
            "total_ms": total * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=3.0, help="seconds of pushing per measurement")
    p.add_argument("--repeat", type=int, default=1, help="interleaved rounds of the push-rate runs")
    p.add_argument("--trainers", default="1,4", help="concurrent trainers of the push-rate runs (comma-separated)")
    p.add_argument("--shards", type=int, default=2, help="shards of the push-rate and checkpoint runs")
    p.add_argument("--checkpoint-rows", type=int, default=1_000_000, help="rows held (and checkpointed) by the table")
    p.add_argument("--restart-rows", type=int, default=1_000_000, help="rows of the shard restarted from a checkpoint")
    p.add_argument("--replay-mb", type=int, default=512, help="MiB of log replayed after a kill -9")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.quick:
        args.budget, args.checkpoint_rows, args.restart_rows, args.replay_mb, args.repeat = 0.3, 50_000, 50_000, 8, 1
        args.trainers, args.shards = "1", 1
    trainer_counts = [int(t) for t in args.trainers.split(",")]
    progress = Progress(args.repeat * len(SETTINGS) * len(trainer_counts) + 3, "durability")
    rows = push_rates(args.repeat, args.budget, trainer_counts, args.shards, progress)
    rep = replay(args.replay_mb, progress)
    rst = restart(args.restart_rows, progress)
    ckpt = checkpoint_pause(args.checkpoint_rows, args.shards, progress)
    print()
    print(table(rows, [("setting", "setting", ""), ("trainers", "trainers", "d"),
                       ("push_rows_per_s", "push rows/s", ",.0f"), ("x_checkpoint", "x checkpoint", ".2f"),
                       ("range", "range", "")]))
    print(f"\nreplay: {rep['log_bytes'] / 1e6:,.0f} MB of log ({rep['records']:,} records) after kill -9: serving again "
          f"in {rep['restart_s']:.1f} s (an empty start: {rep['empty_start_s']:.1f} s), "
          f"{rep['replay_s_per_gb']:.1f} s per GB of log")
    print(f"restart: a shard of {rst['rows']:,} rows x {DIM} ({rst['checkpoint_bytes'] / 1e6:,.0f} MB checkpoint) "
          f"serving again {rst['restart_s']:.1f} s after SIGTERM")
    print(f"checkpoint of {ckpt['rows']:,} rows x {DIM} ({ckpt['bytes'] / 1e6:,.0f} MB on {args.shards} shard(s)): pushes paused "
          f"{ckpt['pause_ms']:.0f} ms, checkpoint call {ckpt['total_ms']:.0f} ms")
    out = pathlib.Path(args.out)
    write_outputs("durability", {"args": vars(args), "replay": rep, "restart": rst, "checkpoint": ckpt}, rows, out)
    plot(out / "durability.png", [("push throughput by durability setting", "trainers", {
        label: ([r["trainers"] for r in rows if r["setting"] == label],
                [r["push_rows_per_s"] for r in rows if r["setting"] == label])
        for label, _, _ in SETTINGS})], "push rows/s")
    print(f"wrote {out / 'durability.json'} and {out / 'durability.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
