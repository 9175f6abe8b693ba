"""What durability costs: push throughput per durability level, and the checkpoint pause.

- Standard workload (1M x 64 float32, Zipf 1.1 batches of 8,192 ids, SGD) pushed by 1 and 4
  concurrent trainers to 2 shards started with --durability none / checkpoint / log
  (log: every acknowledged push is fsynced first; concurrent pushes share fsyncs).
- Checkpoint pause: a two-phase checkpoint of 2 shards holding a fully touched table;
  pushes are held only while the state is copied in memory (pause), not while it is written.

    python -m benchmarks.bench_durability [--quick]
Writes benchmarks/results/durability.json and durability.png.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import threading
import time

import torch
from shardps_client import SGD, Client

from benchmarks.common import RESULTS, Progress, plot, table, unique_batches, write_outputs
from shardps.core.specs import Initializer
from shardps.server.ops.launcher import LocalCluster
from shardps.v1 import shardps_pb2 as pb

DIM = 64


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=3.0, help="seconds of pushing per measurement")
    p.add_argument("--checkpoint-rows", type=int, default=1_000_000, help="rows held (and checkpointed) by the table")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.quick:
        args.budget, args.checkpoint_rows = 0.3, 50_000
    levels = ("none", "checkpoint", "log")
    progress = Progress(len(levels) * 2 + 1, "durability")
    rows = []
    for level in levels:
        for trainers in (1, 4):
            with tempfile.TemporaryDirectory() as d:
                with LocalCluster(2, data_dir=None if level == "none" else d,
                                  serve_args=[] if level == "none" else ["--durability", level]) as cl:
                    with Client(cl.addresses) as c:
                        c.create_table("d", dim=DIM, num_embeddings=1_000_000, optimizer=SGD(lr=0.01),
                                       initializer=Initializer("zeros"))
                    rows.append({"durability": level, "trainers": trainers,
                                 "push_rows_per_s": push_rate(cl.addresses, trainers, args.budget)})
            progress.step(f"{level}, {trainers} trainer(s)")
    base = {r["trainers"]: r["push_rows_per_s"] for r in rows if r["durability"] == "none"}
    for r in rows:
        r["x_none"] = r["push_rows_per_s"] / base[r["trainers"]]
    with tempfile.TemporaryDirectory() as d, LocalCluster(2, data_dir=d) as cl, Client(cl.addresses) as c:
        c.create_table("d", dim=DIM, num_embeddings=args.checkpoint_rows, optimizer=SGD(lr=0.01), initializer=Initializer("zeros"))
        for part in torch.split(torch.arange(args.checkpoint_rows), 100_000):
            c.push("d", part, torch.full((len(part), DIM), 0.001))
        c.flush()
        phase = pb.CheckpointRequest.Phase
        t0 = time.perf_counter()
        c.transport.fan_out([(s, "Checkpoint", pb.CheckpointRequest(checkpoint_id="bench", phase=phase.PREPARE, hold_s=30))
                    for s in range(2)])
        replies = c.transport.fan_out([(s, "Checkpoint", pb.CheckpointRequest(checkpoint_id="bench", phase=phase.COMMIT))
                              for s in range(2)])
        total = time.perf_counter() - t0
    ckpt = {"rows": args.checkpoint_rows, "bytes": sum(r.bytes for r in replies),
            "pause_ms": max(r.pause_s for r in replies) * 1e3, "total_ms": total * 1e3}
    progress.step("checkpoint")
    print()
    print(table(rows, [("durability", "durability", ""), ("trainers", "trainers", "d"),
                       ("push_rows_per_s", "push rows/s", ",.0f"), ("x_none", "x none", ".2f")]))
    print(f"\ncheckpoint of {ckpt['rows']:,} rows x {DIM} ({ckpt['bytes'] / 1e6:,.0f} MB on 2 shards): pushes paused "
          f"{ckpt['pause_ms']:.0f} ms, checkpoint call {ckpt['total_ms']:.0f} ms")
    out = pathlib.Path(args.out)
    write_outputs("durability", {"args": vars(args), "checkpoint": ckpt}, rows, out)
    plot(out / "durability.png", [("push throughput by durability", "trainers", {
        lv: ([r["trainers"] for r in rows if r["durability"] == lv], [r["push_rows_per_s"] for r in rows if r["durability"] == lv])
        for lv in levels})], "push rows/s")
    print(f"wrote {out / 'durability.json'} and {out / 'durability.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
