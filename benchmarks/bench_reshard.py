"""Live resharding: a 2 -> 4 shard grow while a trainer runs the standard loop, against the offline way (stop the
cluster, ``shardps reshard --from --to``, start 4 shards) from the same run.

- The table: the standard workload's 1M x 64 float32 with SGD, every row written once before timing (so every slot
  moved carries its rows), plus a 4 MB dense tensor.
- One trainer (default client settings) pulls a batch's unique Zipf(1.1) ids (8,192 drawn) and pushes their SGD
  gradients, step after step; each step's latency is recorded.
- Live: --phase seconds of training on 2 shards, then ``shardps reshard``'s driver (``Resharder``) moves half of
  the 16,384 hash slots to two joined shards while training goes on, then --phase seconds on 4 shards. Reported:
  rows moved per second, each batch's writes-held time (handover to commit), the trainer's rows/s before, during
  and after, its worst step during the move against its p99 before (the client-visible pause).
- Offline: the same cluster and table, then SIGTERM (a final checkpoint), the offline rewrite of 2 data dirs into
  4, and 4 shards started on them: the seconds training cannot run, end to end.

    python -m benchmarks.bench_reshard [--quick] [--repeat 3]
Writes benchmarks/results/reshard.json and reshard.png.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import threading
import time
from typing import Any, Optional

import numpy as np
import torch
from shardps_client import SGD, Client, Initializer

from benchmarks.common import RESULTS, Progress, median_and_range, plot, table, unique_batches, write_outputs
from shardps.server.ops.launcher import LocalCluster
from shardps.server.ops.reshard import reshard
from shardps.server.ops.resharding import Journal, Resharder, ShardCalls

DIM = 64


class Trainer:
    """The standard loop on one client until stopped: (end time, seconds, rows) per step."""

    def __init__(self, addresses: list[str], rows: int) -> None:
        self.batches = [torch.from_numpy(b) for b in unique_batches(11, 24, 8192, rows, 1.1)]
        self.steps: list[tuple[float, float, int]] = []
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(addresses,), daemon=True)
        self.thread.start()

    def _run(self, addresses: list[str]) -> None:
        try:
            with Client(addresses) as c:
                i = 0
                while not self.stop.is_set():
                    ids = self.batches[i % len(self.batches)]
                    t0 = time.perf_counter()
                    rows = c.pull("emb", ids)
                    c.push("emb", ids, rows * 0.001)
                    t1 = time.perf_counter()
                    self.steps.append((t1, t1 - t0, int(ids.shape[0])))
                    i += 1
                c.flush()
        except BaseException as e:  # noqa: BLE001 - reported by the run
            self.errors.append(e)

    def window(self, t0: float, t1: float) -> tuple[float, list[float]]:
        """Rows/s of the steps that ended in [t0, t1), and their latencies."""
        steps = [s for s in self.steps if t0 <= s[0] < t1]
        return sum(s[2] for s in steps) / max(t1 - t0, 1e-9), [s[1] for s in steps]

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(120)
        if self.errors:
            raise self.errors[0]


def _fill(addresses: list[str], rows: int) -> None:
    with Client(addresses) as c:
        c.create_table("emb", dim=DIM, num_embeddings=rows, optimizer=SGD(lr=0.01),
                       initializer=Initializer("normal", std=0.01))
        c.register_dense("mlp", torch.zeros(1024, 1024), optimizer=SGD(lr=0.01))
        for lo in range(0, rows, 65536):
            ids = torch.arange(lo, min(rows, lo + 65536))
            c.push("emb", ids, torch.zeros(ids.shape[0], DIM))
        c.flush()


def live(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    with LocalCluster(2, data_dir=f"{tmp}/live", log_dir=tmp) as cluster:
        two = list(cluster.addresses)
        _fill(two, args.rows)
        trainer = Trainer(two, args.rows)
        try:
            time.sleep(args.warmup)
            t_before = time.perf_counter()
            time.sleep(args.phase)
            t_start = time.perf_counter()
            cluster.add_shards(2)
            calls = ShardCalls(cluster.addresses)
            driver = Resharder(calls, Journal(pathlib.Path(tmp) / "journal.json", batch_slots=args.batch_slots))
            driver.ensure_lineage()
            progress = driver.run([0, 1, 2, 3])
            calls.close()
            t_end = time.perf_counter()
            time.sleep(args.phase)
            t_after = time.perf_counter()
        finally:
            trainer.finish()
        before, lat_before = trainer.window(t_before, t_start)
        during, lat_during = trainer.window(t_start, t_end)
        after, _ = trainer.window(t_end, t_after)
        p = progress.as_dict()
        return {"rows_moved": p["rows"], "slots": p["slots"], "moves": p["moves"], "migration_s": p["seconds"],
                "migration_rows_per_s": p["rows_per_s"], "handover_ms_median": p["handover_s_median"] * 1e3,
                "handover_ms_max": p["handover_s_max"] * 1e3, "train_before": before, "train_during": during,
                "train_after": after, "step_ms_p99_before": float(np.percentile(lat_before, 99) * 1e3),
                "step_ms_max_during": float(max(lat_during) * 1e3) if lat_during else 0.0,
                "step_ms_p50_during": float(np.median(lat_during) * 1e3) if lat_during else 0.0}


def offline(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """Stop, rewrite, restart: the seconds from the stop to the first step on 4 shards."""
    cluster = LocalCluster(2, data_dir=f"{tmp}/off", log_dir=tmp)
    with cluster:
        _fill(cluster.addresses, args.rows)
        t0 = time.perf_counter()
    t_stopped = time.perf_counter()
    summary = reshard(pathlib.Path(f"{tmp}/off"), pathlib.Path(f"{tmp}/off4"), 4)
    t_rewritten = time.perf_counter()
    with LocalCluster(4, data_dir=f"{tmp}/off4", log_dir=tmp) as four:
        trainer = Trainer(four.addresses, args.rows)
        while not trainer.steps and not trainer.errors:
            time.sleep(0.005)
        t_first = trainer.steps[0][0] if trainer.steps else time.perf_counter()
        trainer.finish()
    return {"offline_pause_s": t_first - t0, "offline_stop_s": t_stopped - t0,
            "offline_rewrite_s": t_rewritten - t_stopped, "offline_start_s": t_first - t_rewritten,
            "offline_rows": int(summary.get("rows", 0)) if isinstance(summary, dict) else 0}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--phase", type=float, default=6.0, help="seconds of training measured before and after the move")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--batch-slots", type=int, default=256, help="hash slots per move (shardps reshard's default)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of live and offline, interleaved")
    p.add_argument("--quick", action="store_true", help="a smoke run: 50k rows, short phases, one round")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS, help="directory for reshard.json and reshard.png")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.phase, args.warmup, args.repeat, args.batch_slots = 50_000, 1.0, 0.3, 1, 2048
    progress = Progress(2 * args.repeat, "reshard")
    rounds = []
    for r in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="shardps-reshard-") as tmp:
            lv = live(args, tmp)
            progress.step(f"live {r + 1}: {lv['migration_rows_per_s']:,.0f} rows/s moved")
            off = offline(args, tmp)
            progress.step(f"offline {r + 1}: {off['offline_pause_s']:.1f} s paused")
        rounds.append({**lv, **off})
    med = {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]}

    def ratio(key: str, base: str) -> tuple[float, str]:
        return median_and_range([r[key] / r[base] for r in rounds])

    rows = [
        {"what": "training rows/s, 2 shards (before)", "value": med["train_before"], "x": 1.0, "range": "-"},
        {"what": "training rows/s during the 2 -> 4 move", "value": med["train_during"],
         "x": ratio("train_during", "train_before")[0], "range": ratio("train_during", "train_before")[1]},
        {"what": "training rows/s, 4 shards (after)", "value": med["train_after"],
         "x": ratio("train_after", "train_before")[0], "range": ratio("train_after", "train_before")[1]},
        {"what": "rows moved per second", "value": med["migration_rows_per_s"], "x": "", "range": "-"},
        {"what": "writes held per batch, median ms", "value": med["handover_ms_median"], "x": "", "range": "-"},
        {"what": "writes held per batch, max ms", "value": med["handover_ms_max"], "x": "", "range": "-"},
        {"what": "trainer step p99 before, ms", "value": med["step_ms_p99_before"], "x": 1.0, "range": "-"},
        {"what": "trainer's worst step during the move, ms", "value": med["step_ms_max_during"],
         "x": ratio("step_ms_max_during", "step_ms_p99_before")[0],
         "range": ratio("step_ms_max_during", "step_ms_p99_before")[1]},
        {"what": "offline 2 -> 4 (stop, rewrite, start): training paused, ms", "value": med["offline_pause_s"] * 1e3,
         "x": ratio("offline_pause_s", "step_ms_max_during")[0] * 1e3,
         "range": "x the live worst step"},
    ]
    print(table(rows, [("what", "", ""), ("value", "value", ",.1f"), ("x", "ratio", ".2f"), ("range", "range", "")]))
    print(f"\nlive: {med['rows_moved']:,.0f} rows in {med['slots']:.0f} slots, {med['moves']:.0f} moves, "
          f"{med['migration_s']:.2f} s; offline: stop {med['offline_stop_s']:.2f} s, rewrite "
          f"{med['offline_rewrite_s']:.2f} s, start to the first step {med['offline_start_s']:.2f} s")
    out = write_outputs("reshard", {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds}, rows,
                        args.out)
    plot(out / "reshard.png", [
        ("training rows/s", "phase", {"live": ([0, 1, 2], [med["train_before"], med["train_during"],
                                                           med["train_after"]])}),
        ("pause (ms)", "", {"live worst step": ([0], [med["step_ms_max_during"]]),
                            "offline": ([0], [med["offline_pause_s"] * 1e3])}),
    ], "rows/s | ms")
    print(f"\nwrote {out / 'reshard.json'} and {out / 'reshard.png'}")


if __name__ == "__main__":
    main()
