"""Micro-benchmarks of a shard's parts, and shard memory per row against the raw payload.

- id -> row lookups per second: HashIndex (unbounded tables) with 10M ids, DirectIndex (fixed tables),
  against a Python dict (what a naive server would use);
- gather rows per second (numpy.take), against torch.index_select;
- optimizer apply rows per second (SGD, Adagrad, Adam on 64-dim rows), against torch.optim on the
  same rows as a dense parameter;
- shard memory: RSS growth of a real shard process after 10M rows of 64 float32 are touched
  (right after loading, at rest, and per row), against rows x dim x 4 plus optimizer state.

    python -m benchmarks.bench_parts [--quick]
Writes benchmarks/results/parts.json and parts.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import numpy as np
import torch

from benchmarks.common import RESULTS, Progress, plot, rss_bytes, table, write_outputs
from shardps.core.optim import SGD, Adagrad, Adam
from shardps.core.specs import Initializer, TableSpec
from shardps.server.storage.index import DirectIndex, HashIndex
from shardps.server.storage.table import Table


def rate(fn: Callable[[], object], items: int, budget: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget:
        fn()
        n += 1
    return n * items / (time.perf_counter() - t0)


def lookups(args: argparse.Namespace) -> list[dict]:
    rng = np.random.default_rng(0)
    n = args.index_rows
    keys = rng.integers(0, 2**62, n)
    h = HashIndex(n)
    h.insert(keys, np.arange(n))
    d = DirectIndex(n)
    d.insert(np.arange(n), np.arange(n))
    ref = {int(k): i for i, k in enumerate(keys[: min(n, 2_000_000)])}
    out = []
    for batch in (4096, 65536, 1_000_000):
        q = keys[rng.integers(0, n, batch)]
        qd = rng.integers(0, n, batch)
        qr = [int(x) for x in keys[rng.integers(0, len(ref), min(batch, 65536))]]
        out.append({"part": "lookup", "what": f"HashIndex {n:,} ids", "batch": batch,
                    "ours_per_s": rate(lambda: h.lookup(q), batch, args.budget),
                    "baseline": "python dict", "baseline_per_s": rate(lambda: [ref[x] for x in qr], len(qr), args.budget)})
        out.append({"part": "lookup", "what": f"DirectIndex {n:,} ids", "batch": batch,
                    "ours_per_s": rate(lambda: d.lookup(qd), batch, args.budget),
                    "baseline": "python dict", "baseline_per_s": out[-1]["baseline_per_s"]})
    return out


def gather_and_apply(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)
    rows, dim = 1_000_000, 64
    rng = np.random.default_rng(1)
    out = []
    spec = TableSpec("g", dim, rows, SGD(), Initializer("zeros"))
    t = Table(spec, lambda ids: np.ones(ids.shape, bool), rows)
    with t.lock:
        t._slots(np.arange(rows), create=True)
    tt = torch.zeros(rows, dim)
    for batch in (4400, 65536):
        ids = np.unique(rng.integers(0, rows, batch))
        ti = torch.from_numpy(ids)
        out.append({"part": "gather", "what": "numpy.take rows", "batch": len(ids),
                    "ours_per_s": rate(lambda: np.take(t.rows, ids, axis=0), len(ids), args.budget),
                    "baseline": "torch.index_select", "baseline_per_s": rate(lambda: tt.index_select(0, ti), len(ids), args.budget)})
    for opt, ref_cls, kw in ((SGD(lr=0.01), torch.optim.SGD, {"lr": 0.01}), (Adagrad(lr=0.01), torch.optim.Adagrad, {"lr": 0.01}),
                             (Adam(lr=0.001), torch.optim.Adam, {"lr": 0.001})):
        n = 4400
        tab = Table(TableSpec("o", dim, n, opt, Initializer("zeros")), lambda ids: np.ones(ids.shape, bool), n)
        ids = np.arange(n)
        g = np.full((n, dim), 0.01, np.float32)
        with tab.lock:
            tab._slots(ids, create=True)
        p = torch.nn.Parameter(torch.zeros(n, dim))
        ref = ref_cls([p], **kw)
        gt = torch.from_numpy(g)

        def torch_step() -> None:
            p.grad = gt
            ref.step()

        def ours() -> None:
            with tab.lock:
                tab.apply(ids, g, 1.0)

        out.append({"part": "apply", "what": f"{type(opt).__name__} step, {dim}-dim rows", "batch": n,
                    "ours_per_s": rate(ours, n, args.budget), "baseline": f"torch.optim.{ref_cls.__name__} (dense)",
                    "baseline_per_s": rate(torch_step, n, args.budget)})
    return out


def memory(args: argparse.Namespace) -> list[dict]:
    """RSS growth of a real shard holding ``memory_rows`` rows, against the raw payload.

    Measured three ways: right after the last push (message buffers still in the
    heap), at rest (the shard returns free heap pages once idle), and per row:
    the growth at rest between half and all of the rows, which leaves out what a
    shard spends once whatever its size (interpreter, gRPC, buffers).
    """
    from shardps_client import Client

    from shardps.server.ops.launcher import LocalCluster
    from shardps.server.rpc.server import IDLE_TRIM_S

    def load(c: Client, ids: torch.Tensor, dim: int) -> None:
        for part in torch.split(ids, 250_000):
            c.push("m", part, torch.full((len(part), dim), 0.01))
        c.flush()

    out = []
    rows, dim = args.memory_rows, 64
    configs = [(opt, state, fixed) for opt, state in ((SGD(lr=0.01), 0), (Adam(), 2)) for fixed in (True, False)]
    if args.quick:  # a smoke run: each optimizer and each kind of table once (every config idles 5 s)
        configs = [configs[0], configs[3]]
    for opt, state, fixed in configs:
        with LocalCluster(1) as cl, Client(cl.addresses) as c:
            pid = cl.procs[0].popen.pid
            before = rss_bytes(pid)
            c.create_table("m", dim=dim, num_embeddings=rows if fixed else None, optimizer=opt,
                           initializer=Initializer("zeros"))
            ids = torch.arange(rows) * (1 if fixed else 7919)
            load(c, ids[: rows // 2], dim)
            time.sleep(2.5 * IDLE_TRIM_S)
            half = rss_bytes(pid)
            load(c, ids[rows // 2 :], dim)
            loaded = rss_bytes(pid)
            time.sleep(2.5 * IDLE_TRIM_S)
            rest = rss_bytes(pid)
            info = c.describe_table("m")[0]
        payload = rows * dim * 4 * (1 + state)
        out.append({"part": "memory", "what": f"{type(opt).__name__}, {'fixed' if fixed else 'unbounded'} table",
                    "batch": rows, "payload_bytes": payload, "rss_loaded": loaded - before, "rss_rest": rest - before,
                    "reported_bytes": info.bytes, "ratio_loaded": (loaded - before) / payload,
                    "ratio_rest": (rest - before) / payload,
                    "ratio_per_row": (rest - half) / ((rows - rows // 2) * dim * 4 * (1 + state)),
                    "ratio_reported": info.bytes / payload})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=0.5, help="seconds per measurement")
    p.add_argument("--index-rows", type=int, default=10_000_000, help="ids in the lookup benchmark's index")
    p.add_argument("--memory-rows", type=int, default=10_000_000,
                   help="rows touched in the memory benchmark (10M: about 8 GB for the Adam tables)")
    p.add_argument("--quick", action="store_true", help="small sizes, short budget (smoke run)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.quick:
        args.budget, args.index_rows, args.memory_rows = 0.1, 200_000, 100_000
    progress = Progress(3, "parts")
    rows = lookups(args)
    progress.step("lookups")
    rows += gather_and_apply(args)
    progress.step("gather / apply")
    mem = memory(args)
    progress.step("memory")
    for r in rows:
        r["x_baseline"] = r["ours_per_s"] / r["baseline_per_s"]
    print()
    print(table(rows, [("part", "part", ""), ("what", "what", ""), ("batch", "batch", ",d"),
                       ("ours_per_s", "shardps /s", ",.0f"), ("baseline", "baseline", ""),
                       ("baseline_per_s", "baseline /s", ",.0f"), ("x_baseline", "x baseline", ".2f")]))
    print()
    print(table(mem, [("what", "shard memory", ""), ("batch", "rows", ",d"), ("payload_bytes", "raw payload B", ",d"),
                      ("rss_rest", "RSS growth B", ",d"), ("ratio_loaded", "x payload, loaded", ".3f"),
                      ("ratio_rest", "x payload, at rest", ".3f"), ("ratio_per_row", "x payload, per row", ".3f"),
                      ("ratio_reported", "x payload, reported", ".3f")]))
    import pathlib

    out = pathlib.Path(args.out)
    write_outputs("parts", {"args": vars(args)}, rows + mem, out)
    look = [r for r in rows if r["part"] == "lookup"]
    panels = [("id lookups vs batch", "batch", {
        w: ([r["batch"] for r in look if r["what"] == w], [r["ours_per_s"] for r in look if r["what"] == w])
        for w in sorted({r["what"] for r in look})} | {"python dict": (
            [r["batch"] for r in look if r["what"].startswith("Hash")], [r["baseline_per_s"] for r in look if r["what"].startswith("Hash")])})]
    plot(out / "parts.png", panels, "lookups/s")
    print(f"\nwrote {out / 'parts.json'} and {out / 'parts.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
