"""Bounded tables: memory under an endless stream, quality under drift, and what admission and eviction cost.

1. Memory: a drifting Zipf stream over 10^9 possible ids (batches of 8,192; the popular ids move
   along the id space) pushed to one shard, into an unbounded table and into one with
   ``Eviction(max_rows)`` (+ admission). The shard's RSS is sampled as the stream runs, until
   the stream has brought many times ``max_rows`` distinct ids. Bounded: RSS at the end over
   (RSS before the table + the table's bytes at capacity), which should stay within 1.2x.
2. Quality: a click task with planted per-id effects whose popular ids drift over time (the DLRM
   example's generator with a moving popularity window); test AUC on the latest traffic for
   local training (torch.optim, nn.Embedding), an unbounded table and bounded tables.
3. Cost: the standard workload (1M possible ids x 64, Zipf 1.1 batches of 8,192 unique ids,
   pull then push, 2 shards) on an unbounded table against admission, capacity eviction and TTL
   (sized to evict on every push) and per-row staleness, interleaved runs, as ratios. Plus the longest TTL sweep slice on a 1M-row table.

    python -m benchmarks.bench_bounded [--quick]
Writes benchmarks/results/bounded.json and bounded.png.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any, Optional

import numpy as np
import torch
from shardps_client import SGD, Adagrad, Admission, Client, Eviction, Staleness

from benchmarks.common import RESULTS, Progress, median_and_range, rss_bytes, table, unique_batches, write_outputs
from clients.examples.dlrm import auc  # the DLRM example's AUC, ties averaged
from shardps.core.specs import Initializer, TableSpec
from shardps.server.ops.launcher import LocalCluster
from shardps.server.storage.table import Table

SPACE = 10**9
DIM = 64


def drifting_batch(rng: np.random.Generator, step: int, batch: int, drift: int) -> np.ndarray:
    """Unique ids of one batch: Zipf(1.1) ranks around a popularity window that moves ``drift`` items
    per batch, scattered over 10^9 ids."""
    ranks = rng.zipf(1.1, batch).astype(np.int64) - 1
    items = ranks + step * drift
    return np.unique((items * 2_654_435_761 + 12345) % SPACE)


# ---- 1. memory under an endless stream ---------------------------------------------------


def memory_run(label: str, admission: Optional[Admission], eviction: Optional[Eviction], steps: int,
               drift: int) -> dict[str, Any]:
    with LocalCluster(1) as cl, Client(cl.addresses, read_your_writes=False) as c:
        pid = cl.procs[0].popen.pid
        rss0 = rss_bytes(pid)
        c.create_table("s", DIM, optimizer=Adagrad(lr=0.05), initializer=Initializer("uniform", a=0.01),
                       admission=admission, eviction=eviction)
        rng = np.random.default_rng(11)
        samples: list[tuple[int, float]] = []
        seen_total = 0
        pause = []
        at_capacity: Optional[int] = None
        t0 = time.perf_counter()
        for step in range(steps):
            ids = torch.from_numpy(drifting_batch(rng, step, 8192, drift))
            t = time.perf_counter()
            c.push("s", ids, torch.full((len(ids), DIM), 0.01), wait=True)
            pause.append(time.perf_counter() - t)
            seen_total += len(ids)
            if step % 10 == 0 or step == steps - 1:
                info = c.describe_table("s")[0]
                if eviction is not None and at_capacity is None and info.num_rows >= eviction.max_rows:
                    at_capacity = int(info.bytes)
                samples.append((step, rss_bytes(pid) / 2**20))
        info = c.describe_table("s")[0]
        elapsed = time.perf_counter() - t0
    rss_end = samples[-1][1] * 2**20
    row = {"table": label, "pushes": steps, "ids_pushed": seen_total, "rows_end": int(info.num_rows),
           "evicted": int(info.evicted_capacity + info.evicted_ttl), "rejected": int(info.rejected),
           "rss_start_mb": rss0 / 2**20, "rss_end_mb": rss_end / 2**20, "table_mb": info.bytes / 2**20,
           "push_ms_p50": float(np.percentile(pause, 50) * 1e3), "push_ms_p99": float(np.percentile(pause, 99) * 1e3),
           "push_ms_max": float(max(pause) * 1e3), "seconds": elapsed, "samples": samples}
    if eviction is not None and eviction.max_rows is not None:
        bound = rss0 + (at_capacity or info.bytes)
        row["x_bound"] = rss_end / bound
        row["max_rss_after_fill_mb"] = max(r for _, r in samples[len(samples) // 3:])
    return row


# ---- 2. quality under drift --------------------------------------------------------------

FEATURES, EDIM = 4, 8


def effect(f: int, ids: np.ndarray) -> np.ndarray:
    return Initializer("normal", std=1.0, seed=500 + f).rows(ids, 1)[:, 0]


def click_batch(rng: np.random.Generator, n: int, offset: int, space: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples at time ``offset``: item ``offset - rank`` (Zipf ranks), so the newest items are the most
    popular and each fades as newer ones arrive (news, new listings, trending queries)."""
    ranks = rng.zipf(1.2, size=(n, FEATURES)).astype(np.int64) - 1
    ids = ((offset - ranks) * 2_654_435_761 + np.arange(FEATURES) * 40_503) % space
    logit = -0.5 + sum(0.8 * effect(f, ids[:, f]) for f in range(FEATURES))
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return ids, labels


def quality_run(label: str, steps: int, drift: int, space: int, admission: Optional[Admission] = None,
                eviction: Optional[Eviction] = None, local: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    torch.manual_seed(0)
    head = torch.nn.Linear(FEATURES * EDIM, 1)
    opt = torch.optim.Adagrad(head.parameters(), lr=0.05)
    test_rng = np.random.default_rng(4)
    test_ids, test_labels = click_batch(test_rng, 20_000, steps * drift, space)
    cluster = client = None
    if local:
        embs = [torch.nn.Embedding(space, EDIM, sparse=True) for _ in range(FEATURES)]
        for e in embs:
            torch.nn.init.uniform_(e.weight, -0.01, 0.01)
        eopt = torch.optim.Adagrad([e.weight for e in embs], lr=0.1)  # sparse rows: the shards' lazy Adagrad
    else:
        from shardps_client import RemoteEmbedding
        cluster = LocalCluster(2).start()
        client = Client(cluster.addresses)
        for f in range(FEATURES):
            client.create_table(f"f{f}", EDIM, optimizer=Adagrad(lr=0.1), initializer=Initializer("uniform", a=0.01),
                                admission=admission, eviction=eviction)
        embs = [RemoteEmbedding(client, f"f{f}") for f in range(FEATURES)]
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            ids, labels = click_batch(rng, 256, step * drift, space)
            x = torch.cat([embs[f](torch.from_numpy(ids[:, f])) for f in range(FEATURES)], 1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(head(x)[:, 0], torch.from_numpy(labels))
            opt.zero_grad()
            if local:
                eopt.zero_grad()
            loss.backward()
            opt.step()
            if local:
                eopt.step()
        elapsed = time.perf_counter() - t0
        with torch.no_grad():
            scores = []
            for part in np.array_split(np.arange(len(test_labels)), 10):
                x = torch.cat([embs[f](torch.from_numpy(test_ids[part, f])) for f in range(FEATURES)], 1)
                scores.append(head(x)[:, 0].numpy())
        rows = sum(i.num_rows for f in range(FEATURES) for i in client.describe_table(f"f{f}")) if client else None
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
    return {"trainer": label, "auc": auc(np.concatenate(scores), test_labels), "rows_end": rows,
            "samples_per_s": steps * 256 / elapsed}


# ---- 3. cost on the standard workload ----------------------------------------------------


def cost_variants(rows_per_shard: int) -> dict[str, dict[str, Any]]:
    """``rows_per_shard``: the rows the workload touches on a shard; capacities are set below it."""
    most, half = int(rows_per_shard * 0.85), rows_per_shard // 2
    return {
        "unbounded": {},
        "admission (min_count 2)": {"admission": Admission(min_count=2)},
        "LRU, 85% of the rows": {"eviction": Eviction(max_rows=most)},
        "LRU, 50% of the rows": {"eviction": Eviction(max_rows=half)},
        "LFU, 50% of the rows": {"eviction": Eviction(max_rows=half, policy="lfu")},
        "TTL (8 versions)": {"eviction": Eviction(ttl_steps=8)},
        "admission + LRU 50% + TTL": {"admission": Admission(min_count=2),
                                      "eviction": Eviction(max_rows=half, ttl_steps=8)},
        "per-row staleness": {"staleness": Staleness(scaling="inverse", per_row=True)},
    }


def loop_rate(addresses: list[str], kwargs: dict[str, Any], batches: list[np.ndarray], budget: float) -> float:
    with Client(addresses) as c:
        name = f"w{time.monotonic_ns()}"
        c.create_table(name, DIM, num_embeddings=1_000_000, optimizer=SGD(lr=0.01), initializer=Initializer("zeros"),
                       **kwargs)
        tensors = [torch.from_numpy(b) for b in batches]
        for b in tensors[:3]:  # warm up
            rows, v = c.pull_with_version(name, b)
            c.push(name, b, torch.full_like(rows, 0.001), versions=v)
        c.flush()
        n, i, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < budget:
            b = tensors[i % len(tensors)]
            rows, v = c.pull_with_version(name, b)
            c.push(name, b, torch.full_like(rows, 0.001), versions=v)
            n += len(b)
            i += 1
        c.flush()
        rate = n / (time.perf_counter() - t0)
        c.drop_table(name)
    return rate


def sweep_pause(rows: int) -> dict[str, Any]:
    spec = TableSpec("t", DIM, optimizer=SGD(lr=0.01), initializer=Initializer("zeros"), eviction=Eviction(ttl_steps=1))
    t = Table(spec, lambda ids: np.ones(ids.shape, bool), rows)
    ids = np.arange(rows, dtype=np.int64) * 7
    with t.lock:
        for part in np.array_split(ids, max(1, rows // 100_000)):
            t.apply(part, np.zeros((len(part), DIM), np.float32), stamp=1, version=0)
    pauses = []
    while t.n:
        s = time.perf_counter()
        with t.lock:
            t.sweep(version=10, max_slots=65536)
        pauses.append(time.perf_counter() - s)
    return {"rows": rows, "slices": len(pauses), "max_ms": max(pauses) * 1e3, "total_ms": sum(pauses) * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--max-rows", type=int, default=200_000, help="max_rows of the memory run's bounded table")
    p.add_argument("--stream-pushes", type=int, default=400, help="pushes of 8,192 ids in the memory run")
    p.add_argument("--quality-steps", type=int, default=1500)
    p.add_argument("--budget", type=float, default=3.0, help="seconds per cost measurement")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.quick:
        args.max_rows, args.stream_pushes, args.quality_steps, args.budget, args.repeat = 5_000, 30, 60, 0.3, 1
    batches = unique_batches(7, 16, 8192, 1_000_000, 1.1)
    per_shard = len(np.unique(np.concatenate(batches))) // 2
    # Capacities under what the workload touches, and a TTL of 8 versions, evict on every push (eviction at its
    # busiest: the rows a push brings back were evicted a few pushes before), where the unbounded table is steady.
    variants = cost_variants(per_shard)
    if args.quick:  # a smoke run: one variant of each kind
        variants = {k: v for k, v in variants.items() if k in ("unbounded", "admission (min_count 2)",
                                                                "LRU, 50% of the rows", "per-row staleness")}
    progress = Progress(3 + (2 if args.quick else 4) + args.repeat * len(variants) + 1, "bounded")
    results: list[dict[str, Any]] = []

    # Cost first, on a fresh machine state (the other parts leave large heaps behind).
    rates: dict[str, list[float]] = {k: [] for k in variants}
    with LocalCluster(2) as cl:
        for _ in range(args.repeat):
            for label, kwargs in variants.items():
                rates[label].append(loop_rate(cl.addresses, kwargs, batches, args.budget))
                progress.step(f"cost: {label}")
    cost = []
    for label, rs in rates.items():
        ratios = [r / b for r, b in zip(rs, rates["unbounded"])]
        x, span = median_and_range(ratios)
        cost.append({"table": label, "rows_per_s": float(np.median(rs)), "x_unbounded": x, "x_range": span})

    memory = []
    bounded = (Admission(min_count=2), Eviction(max_rows=args.max_rows))
    drift = 64
    for label, adm, ev in (("unbounded", None, None), ("max_rows", None, Eviction(max_rows=args.max_rows)),
                           ("admission + max_rows", *bounded)):
        memory.append(memory_run(label, adm, ev, args.stream_pushes, drift))
        progress.step(f"memory: {label}")

    space, qdrift = 2_000_000, 4
    cap = 12_000 if not args.quick else 500
    quality = [quality_run("local torch.optim", args.quality_steps, qdrift, space, local=True)]
    progress.step("quality: local")
    trainers = (("unbounded", None, None), ("LRU max_rows", None, Eviction(max_rows=cap)),
                ("admission 2 + LRU + TTL 2000", Admission(min_count=2), Eviction(max_rows=cap, ttl_steps=2000)))
    for label, adm, ev in trainers[1:] if args.quick else trainers:  # a smoke run: one cluster, the LRU one
        quality.append(quality_run(label, args.quality_steps, qdrift, space, adm, ev))
        progress.step(f"quality: {label}")
    for r in quality:
        r["x_local_auc"] = r["auc"] / quality[0]["auc"]

    sweep = sweep_pause(1_000_000 if not args.quick else 100_000)
    progress.step("sweep pause")

    print("\n1. memory under a drifting stream over 10^9 ids "
          f"({args.stream_pushes} pushes of 8,192 ids, 1 shard, max_rows {args.max_rows:,})")
    print(table(memory, [("table", "table", ""), ("ids_pushed", "ids pushed", ",d"), ("rows_end", "rows", ",d"),
                         ("evicted", "evicted", ",d"), ("rejected", "rejected", ",d"),
                         ("rss_start_mb", "RSS start MB", ".0f"), ("rss_end_mb", "RSS end MB", ".0f"),
                         ("table_mb", "table MB", ".0f"), ("x_bound", "x bound", ".2f"),
                         ("push_ms_p50", "push p50 ms", ".1f"), ("push_ms_p99", "p99 ms", ".1f"),
                         ("push_ms_max", "max ms", ".1f")]))
    print("x bound: RSS at the end over (RSS before the table + the table's bytes at capacity)")
    print(f"\n2. AUC on the latest traffic, popular ids drifting ({args.quality_steps} steps of 256, "
          f"{FEATURES} features over {space:,} ids, bounded tables hold {cap:,} rows per shard)")
    print(table(quality, [("trainer", "trainer", ""), ("auc", "test AUC", ".4f"), ("x_local_auc", "x local", ".3f"),
                          ("rows_end", "rows held", ""), ("samples_per_s", "samples/s", ",.0f")]))
    print(f"\n3. cost on the standard workload (pull + push, 2 shards, {args.repeat} interleaved runs)")
    print(table(cost, [("table", "table", ""), ("rows_per_s", "rows/s", ",.0f"), ("x_unbounded", "x unbounded", ".2f"),
                       ("x_range", "range", "")]))
    print(f"\nTTL sweep of a {sweep['rows']:,}-row table: {sweep['slices']} slices of 65,536 rows, longest "
          f"{sweep['max_ms']:.1f} ms (the table lock's longest hold), {sweep['total_ms']:.0f} ms in all")
    for r in memory:
        r["part"] = "memory"
    for r in quality:
        r["part"] = "quality"
    for r in cost:
        r["part"] = "cost"
    results = memory + quality + cost
    out = pathlib.Path(args.out)
    write_outputs("bounded", {"args": vars(args), "sweep": sweep}, results, out)
    _plot(out / "bounded.png", memory, args.max_rows)
    print(f"wrote {out / 'bounded.json'} and {out / 'bounded.png'}")
    return 0


def _plot(path: pathlib.Path, memory: list[dict[str, Any]], max_rows: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in memory:
        xs = [s * 8192 / 1e6 for s, _ in r["samples"]]
        ax.plot(xs, [m for _, m in r["samples"]], label=r["table"])
    ax.set_xlabel("ids pushed (millions, drifting Zipf over 10^9 ids)")
    ax.set_ylabel("shard RSS (MiB)")
    ax.set_title(f"shard memory, unbounded vs max_rows={max_rows:,}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
