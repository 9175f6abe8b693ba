"""How fast a well-behaved client trains beside a misbehaving one, against its speed alone.

- One shard (``shardps serve``); the good client is the obvious training loop of tests/misbehaving.py
  (pull, then push a gradient, of 8,192 Zipf(1.1) ids x 64 float32 over a 1M-row table) in a process of
  its own, counting its steps.
- Each kind of bad client (tests/misbehaving.py: malformed, oversized or refused requests, valid heavy
  pushes, held streams or waiting heartbeats, unknown tokens) runs in processes of its own, one per
  window beside the good client; all of them start, and are ready, before the first window.
- Windows alternate (alone, beside, alone, beside, ..., alone): each window beside a bad client is
  compared with the mean of its two neighbours alone, and the median of those ratios is reported with
  their range. bad_token runs against a shard with a tokens file (tokens are the callers), the others
  against one without (connections are).

tests/test_fairness.py checks that the good client makes progress and the shard survives; the speed is
measured here. Before the fair shares of shardps.server.rpc.fair the ratios were 0.52 (malformed), 0.56
(refused_pull) and 0 (waiting).

    python -m benchmarks.bench_fairness [--quick]
Writes benchmarks/results/fairness.json and fairness.png.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pathlib
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np
from shardps_client import SGD, Client

from benchmarks.common import RESULTS, Progress, median_and_range, plot, table, write_outputs
from shardps.server.ops.launcher import LocalCluster
from tests import misbehaving

# Threads of each kind of bad client (the fairness test's numbers; heavy_push: two pushes at the limit).
THREADS = {"malformed": 4, "oversize": 2, "refused_pull": 4, "heavy_push": 2, "streams": 64, "waiting": 100,
           "bad_token": 4}
TOKENS = {"good": "g" * 24, "bad": "b" * 24, "admin": "a" * 24}
WARMUP_STEPS = 20  # the good client's steps before the first window (connections made, caches warm)


def steps_per_s(counter: Any, seconds: float) -> float:
    start = counter.value
    time.sleep(seconds)
    return (counter.value - start) / seconds


def _start_attacks(ctx: Any, address: str, kind: str, threads: int, count: int,
                   token: Optional[str]) -> list[tuple[Any, Any]]:
    """``count`` bad processes of ``kind``, each ready (connected, requests built) and waiting for its go."""
    attacks = []
    for _ in range(count):
        ready, go = ctx.Event(), ctx.Event()
        bad = ctx.Process(target=misbehaving.attack, args=(address, kind, threads, ready, go, token), daemon=True)
        bad.start()
        attacks.append((bad, ready, go))
    if not all(ready.wait(60) for _, ready, _ in attacks):
        raise RuntimeError("a misbehaving client did not start in 60 s")
    return [(bad, go) for bad, _, go in attacks]


def measure(address: str, kind: str, threads: int, args: argparse.Namespace, token: Optional[str]) -> dict:
    """The good client's steps/s alone and beside ``kind``, window by window, and the ratios."""
    row: dict[str, Any] = {"kind": kind, "threads": threads}
    ctx = mp.get_context("spawn")
    steps, errors = ctx.Value("q", 0), ctx.Value("q", 0)
    good = ctx.Process(target=misbehaving.train, args=(address, steps, errors, token), daemon=True)
    good.start()
    attacks: list[tuple[Any, Any]] = []
    try:
        deadline = time.monotonic() + 60
        while steps.value < WARMUP_STEPS and good.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if steps.value < WARMUP_STEPS:
            return {**row, "error": f"the good client made {steps.value} steps in 60 s alone"}
        attacks = _start_attacks(ctx, address, kind, threads, args.pairs, TOKENS["bad"] if token else None)
        alone, besides, ratios = [steps_per_s(steps, args.window_s)], [], []
        for bad, go in attacks:
            go.set()
            time.sleep(args.ramp_s)
            besides.append(steps_per_s(steps, args.window_s))
            bad.terminate()
            bad.join(10)
            alone.append(steps_per_s(steps, args.window_s))
            ratios.append(besides[-1] / max(1e-9, (alone[-2] + alone[-1]) / 2))
    except RuntimeError as e:
        return {**row, "error": str(e)}
    finally:
        for bad, _ in attacks:
            bad.terminate()
        good.terminate()
        good.join(10)
    x_alone, x_range = median_and_range(ratios)
    return {**row, "alone_steps_per_s": float(np.median(alone)), "beside_steps_per_s": float(np.median(besides)),
            "x_alone": x_alone, "x_alone_range": x_range, "pairs_x_alone": ratios, "good_errors": errors.value}


def _shard_answers(address: str, token: Optional[str]) -> bool:
    try:
        with Client([address], token=token, timeout=10, retry_timeout=5) as c:
            return tuple(c.pull(misbehaving.TABLE, [1, 2, 3]).shape) == (3, misbehaving.DIM)
    except Exception:  # noqa: BLE001 - reported in the table, not raised
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", choices=sorted(misbehaving.KINDS), default=list(misbehaving.KINDS),
                   help="kinds of bad client (tests/misbehaving.py)")
    p.add_argument("--pairs", type=int, default=4, help="windows beside each kind of bad client (count)")
    p.add_argument("--window-s", type=float, default=3.0, help="seconds per window, alone or beside")
    p.add_argument("--ramp-s", type=float, default=1.0, help="seconds a bad client runs before its window")
    p.add_argument("--quick", action="store_true", help="1 pair of 1 s windows per kind")
    p.add_argument("--out", default=str(RESULTS), help="directory for fairness.json and fairness.png")
    args = p.parse_args()
    if args.quick:
        args.pairs, args.window_s, args.ramp_s = 1, 1.0, 0.5
    rows = []
    progress = Progress(len(args.kinds), "fairness")
    with tempfile.TemporaryDirectory() as d:
        tokens = pathlib.Path(d) / "tokens"
        tokens.write_text("".join(f"{'admin' if k == 'admin' else 'trainer'} {v}\n" for k, v in TOKENS.items()))
        with LocalCluster(1) as plain, LocalCluster(1, serve_args=["--tokens-file", str(tokens)]) as with_tokens:
            for cluster, token in ((plain, None), (with_tokens, TOKENS["admin"])):
                with Client(cluster.addresses, token=token) as c:
                    c.create_table(misbehaving.TABLE, dim=misbehaving.DIM, num_embeddings=misbehaving.ROWS,
                                   optimizer=SGD(lr=0.01))
            for kind in args.kinds:
                cluster, shard = (with_tokens, "tokens") if kind == "bad_token" else (plain, "plain")
                token = TOKENS["good"] if shard == "tokens" else None
                row = {"shard": shard, **measure(cluster.addresses[0], kind, THREADS[kind], args, token)}
                row["shard_answers"] = _shard_answers(cluster.addresses[0], TOKENS["admin"] if token else None)
                rows.append(row)
                progress.step(kind)
    print()
    print(table(rows, [("kind", "bad client", ""), ("shard", "shard", ""), ("threads", "threads", "d"),
                       ("alone_steps_per_s", "steps/s alone", ".1f"), ("beside_steps_per_s", "steps/s beside", ".1f"),
                       ("x_alone", "x alone", ".2f"), ("x_alone_range", "range", ""), ("good_errors", "errors", "d"),
                       ("shard_answers", "shard answers", ""), ("error", "error", "")]))
    out = pathlib.Path(args.out)
    write_outputs("fairness", {"args": vars(args), "threads": THREADS}, rows, out)
    plot(out / "fairness.png", [("good client beside a bad one, pair by pair", "pair", {
        r["kind"]: (list(range(1, len(r["pairs_x_alone"]) + 1)), r["pairs_x_alone"]) for r in rows if "error" not in r
    })], "x its speed alone")
    print(f"wrote {out / 'fairness.json'} and {out / 'fairness.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
