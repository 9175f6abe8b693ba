"""A model's tables as one module: RemoteEmbeddingBagCollection against one RemoteEmbeddingBag per table, and
against the same tables trained locally, at 8 and 26 tables (the Criteo feature count).

Each step: a batch of --batch samples, one bag of --bag ids per feature (Zipf 1.1 over --rows rows per table),
pooled by sum, a loss over the pooled columns, backward, and the rows' SGD update (on the shards, pushed as
one batch per shard through ShardedOptimizer; locally, torch.optim.SGD over sparse nn.EmbeddingBag gradients).
Reported per configuration: samples/s, and the trainer's CPU per step spent in forward + backward (the process's
CPU time, gRPC's threads included, which waits do not add to), as ratios of local training's from the same round.

    python -m benchmarks.bench_collection [--quick] [--repeat 3]
Writes benchmarks/results/collection.json and collection.png.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np
import torch
from shardps_client import (
    SGD,
    Client,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    RemoteEmbeddingBag,
    RemoteEmbeddingBagCollection,
    ShardedOptimizer,
)
from torch import nn

from benchmarks.common import RESULTS, Progress, median_and_range, plot, table, write_outputs, zipf_ids
from shardps.core.specs import Initializer
from shardps.server.ops.launcher import LocalCluster

DIM = 16


def batches(tables: int, args: argparse.Namespace, seed: int) -> list[KeyedJaggedTensor]:
    rng = np.random.default_rng(seed)
    keys = [f"f{t}" for t in range(tables)]
    out = []
    for _ in range(args.steps):
        ids = zipf_ids(rng, tables * args.batch * args.bag, args.rows, 1.1)
        lengths = torch.full((tables * args.batch,), args.bag, dtype=torch.int64)
        out.append(KeyedJaggedTensor.from_lengths_sync(keys, torch.from_numpy(ids), lengths, stride=args.batch))
    return out


class Separate(nn.Module):
    """One module per table, each given its feature's bags (what a model without a collection does)."""

    def __init__(self, modules: list[nn.Module], keys: list[str]) -> None:
        super().__init__()
        self.mods = nn.ModuleList(modules)
        self.keys = keys

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return torch.cat([m(kjt[k].values(), kjt[k].offsets()[:-1]) for m, k in zip(self.mods, self.keys)], dim=1)


def timed(step_fn, data: list[KeyedJaggedTensor], warmup: int) -> tuple[float, float]:
    """(samples/s, CPU seconds per step in forward + backward) over ``data`` after ``warmup`` steps."""
    for kjt in data[:warmup]:
        step_fn(kjt)
    cpu = 0.0
    t0 = time.perf_counter()
    for kjt in data[warmup:]:
        c0 = time.process_time()
        step_fn(kjt)
        cpu += time.process_time() - c0
    n = len(data) - warmup
    return n * data[0].stride() / (time.perf_counter() - t0), cpu / n


def run_local(tables: int, data: list[KeyedJaggedTensor], args: argparse.Namespace) -> tuple[float, float, str]:
    mods = [nn.EmbeddingBag(args.rows, DIM, mode="sum", sparse=True) for _ in range(tables)]
    model = Separate(mods, [f"f{t}" for t in range(tables)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(kjt: KeyedJaggedTensor) -> None:
        opt.zero_grad()
        model(kjt).square().mean().backward()
        opt.step()

    return (*timed(step, data, args.warmup), "EmbeddingBag")


PREFIX = {"collection": "c", "separate modules": "s"}  # of the remote kinds' table names


def run_remote(kind: str, tables: int, data: list[KeyedJaggedTensor], addresses: list[str],
               args: argparse.Namespace) -> tuple[float, float, str]:
    """(samples/s, CPU per step, the class of the module that ran) of ``kind``: "collection" or "separate
    modules"."""
    prefix = PREFIX[kind]
    with Client(addresses) as c:
        configs = [EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=DIM, name=f"{prefix}{tables}.t{t}",
                                      feature_names=[f"f{t}"], optimizer=SGD(lr=0.01),
                                      initializer=Initializer("normal", std=0.05, seed=t)) for t in range(tables)]
        if kind == "collection":
            model: nn.Module = RemoteEmbeddingBagCollection(configs, c)

            def forward(kjt: KeyedJaggedTensor) -> torch.Tensor:
                return model(kjt).values()
        else:
            for cfg in configs:
                c.create_table(cfg.name, DIM, args.rows, optimizer=cfg.optimizer, initializer=cfg.initializer)
            model = Separate([RemoteEmbeddingBag(c, cfg.name, mode="sum") for cfg in configs],
                             [f"f{t}" for t in range(tables)])
            forward = model
        opt = ShardedOptimizer(c, [])  # gathers a step's row pushes into one batch per shard

        def step(kjt: KeyedJaggedTensor) -> None:
            opt.zero_grad()
            forward(kjt).square().mean().backward()
            opt.step()

        out = timed(step, data, args.warmup)
        opt.flush()
        ran = type(model).__name__ if kind == "collection" else type(model.mods[0]).__name__
        return (*out, ran)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, nargs="+", default=[8, 26], help="table counts (one feature each)")
    p.add_argument("--rows", type=int, default=100_000, help="rows per table")
    p.add_argument("--batch", type=int, default=1024, help="samples per step")
    p.add_argument("--bag", type=int, default=1, help="ids per bag")
    p.add_argument("--steps", type=int, default=60, help="steps per run (warm-up included)")
    p.add_argument("--warmup", type=int, default=10, help="steps before timing")
    p.add_argument("--shards", type=int, default=2, help="shards of the local cluster")
    p.add_argument("--repeat", type=int, default=1, help="interleaved rounds (medians and ranges)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.quick:
        args.tables, args.rows, args.batch, args.steps, args.warmup = [4], 5_000, 128, 6, 2
    torch.set_num_threads(1)  # the shards share the host (an idle torch thread spins)
    kinds = ["local", "collection", "separate modules"]
    progress = Progress(args.repeat * len(args.tables) * len(kinds), "collection")
    runs: dict[tuple[int, str], list[tuple[float, float, str]]] = {}
    with LocalCluster(args.shards) as cl:
        for rep in range(args.repeat):
            for tables in args.tables:
                data = batches(tables, args, seed=rep)
                for kind in kinds:
                    if kind == "local":
                        r = run_local(tables, data, args)
                    else:
                        r = run_remote(kind, tables, data, cl.addresses, args)
                        for t in range(tables):  # drop the round's tables: the next round starts alike
                            with Client(cl.addresses) as c:
                                c.drop_table(f"{PREFIX[kind]}{tables}.t{t}")
                    runs.setdefault((tables, kind), []).append(r)
                    progress.step(f"{tables} tables, {kind}")
    rows = []
    for (tables, kind), rs in runs.items():
        local = runs[(tables, "local")]
        x_rate, rate_range = median_and_range([r[0] / lc[0] for r, lc in zip(rs, local)])
        x_cpu, cpu_range = median_and_range([r[1] / lc[1] for r, lc in zip(rs, local)])
        rows.append({"tables": tables, "module": kind, "ran": rs[0][2],
                     "samples_per_s": float(np.median([r[0] for r in rs])),
                     "x_local": x_rate, "x_local_range": rate_range,
                     "cpu_ms_per_step": float(np.median([r[1] for r in rs])) * 1e3,
                     "cpu_x_local": x_cpu, "cpu_x_local_range": cpu_range})
    print()
    print(table(rows, [("tables", "tables", "d"), ("module", "module", ""), ("samples_per_s", "samples/s", ",.0f"),
                       ("x_local", "x local", ".2f"), ("x_local_range", "range", ""),
                       ("cpu_ms_per_step", "trainer CPU ms/step", ".2f"), ("cpu_x_local", "CPU x local", ".2f")]))
    out = pathlib.Path(args.out)
    write_outputs("collection", {"args": vars(args)}, rows, out)
    plot(out / "collection.png", [("samples/s by module", "tables", {
        kind: ([r["tables"] for r in rows if r["module"] == kind], [r["samples_per_s"] for r in rows if r["module"] == kind])
        for kind in kinds})], "samples/s")
    print(f"wrote {out / 'collection.json'} and {out / 'collection.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
