"""Example 4: from training to serving, end to end, with the DLRM model of dlrm.py.

1. Train the DLRM through a local training cluster (embeddings and MLPs on the shards).
2. Export it (``Client.export``: one cut of every shard, safetensors files and a manifest).
3. Start a serving cluster from the export (``shardps serve --serve-from DIR``: read-only shards),
   build the same model against it and score the test set: the AUC equals the trainer's.
4. Keep training; after each round write a delta (``Client.export_delta``). The serving shards
   apply it without a restart, and their predictions move with it: they equal the trainer's
   at the delta's cut.

    python -m clients.examples.serving
    python -m clients.examples.serving --rows 100000 --deltas 5 --json serving.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from shardps_client import Adagrad, Adam, Client, RemoteEmbedding, ShardedOptimizer

from clients.examples.dlrm import DLRM, NUM_SPARSE, auc, batches, click_log, table_name
from shardps.core.specs import Initializer
from shardps.server.ops.launcher import LocalCluster

PREFIX = "dlrm.serving."


def build(client: Client, args: argparse.Namespace, create: bool) -> tuple[DLRM, ShardedOptimizer]:
    """The DLRM over a cluster's tables; ``create``: make the tables first (the trainer)."""
    names = [table_name(f) + ".serving" for f in range(NUM_SPARSE)]
    if create:
        for f, name in enumerate(names):
            client.create_table(name, dim=args.dim, num_embeddings=args.rows, optimizer=Adagrad(lr=args.sparse_lr),
                                initializer=Initializer("normal", std=0.05, seed=f))
    torch.manual_seed(args.seed)  # the same initial MLP, so the serving side's registration matches the spec
    model = DLRM([RemoteEmbedding(client, n) for n in names], args.dim)
    # On the serving cluster the dense tensors exist already: registering them again is a no-op.
    return model, ShardedOptimizer(client, model, optimizer=Adam(lr=args.dense_lr), prefix=PREFIX)


def scores(model: DLRM, opt: ShardedOptimizer, ids: np.ndarray, dense: np.ndarray, labels: np.ndarray) -> np.ndarray:
    opt.pull()  # the MLPs' current values from the shards
    model.eval()
    out = []
    with torch.no_grad():
        for s, d, _ in batches(ids, dense, labels, 4096):
            out.append(torch.sigmoid(model(s, d)).numpy())
    model.train()
    return np.concatenate(out)


def train(model: DLRM, opt: ShardedOptimizer, data: tuple, start: int, end: int, batch: int) -> None:
    ids, dense, labels = data
    for s, d, y in batches(ids[start:end], dense[start:end], labels[start:end], batch):
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(s, d), y).backward()
        opt.step()
    opt.flush()


def wait_for(client: Client, seq: int, timeout: float = 60.0) -> None:
    """Until every serving shard reports generation ``seq`` applied."""
    deadline = time.monotonic() + timeout
    while True:
        served = [info.serving.delta for info in client.shard_info()]
        if all(d == seq for d in served):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"serving shards at {served}, waiting for {seq}")
        time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--rows", type=int, default=100_000, help="ids per sparse feature")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--train", type=int, default=200_000, help="training samples before the export")
    p.add_argument("--test", type=int, default=50_000)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--sparse-lr", type=float, default=0.05)
    p.add_argument("--dense-lr", type=float, default=2e-3)
    p.add_argument("--deltas", type=int, default=3, help="rounds of training after the export, one delta each")
    p.add_argument("--round", type=int, default=0, help="training samples per round (default: --train / 4)")
    p.add_argument("--out", help="export directory (default: a temporary one, removed at the end)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    rnd = args.round or args.train // 4
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - args.shards))
    data = click_log(args.train + args.deltas * rnd, args.rows, args.seed, stream=1)[:3]
    test = click_log(args.test, args.rows, args.seed, stream=0)[:3]
    with contextlib.ExitStack() as stack:
        out = args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="shardps-export-"))
        return _run(args, out, rnd, data, test)


def _run(args: argparse.Namespace, out: str, rnd: int, data: tuple, test: tuple) -> int:
    """Train, export to ``out``, serve it beside the trainers, and follow ``args.deltas`` delta exports."""
    result: dict = {"deltas": []}
    with LocalCluster(args.shards) as trainers, Client(trainers.addresses) as c:
        model, opt = build(c, args, create=True)
        t0 = time.perf_counter()
        train(model, opt, data, 0, args.train, args.batch_size)
        print(f"trained on {args.train:,} samples in {time.perf_counter() - t0:.1f}s", flush=True)
        trainer = scores(model, opt, *test)
        result["trainer_auc"] = auc(trainer, test[2])
        base = c.export(out)
        result["export"] = {"rows": base.rows, "bytes": base.bytes, "seconds": base.seconds,
                            "rows_per_s": base.rows / max(base.seconds, 1e-9), "pause_s": base.pause_s}
        print(f"exported {base.rows:,} rows ({base.bytes / 2**20:.1f} MiB) to {out} in {base.seconds:.2f}s "
              f"(pushes held {base.pause_s * 1000:.0f} ms)", flush=True)
        with LocalCluster(args.shards, serve_args=["--serve-from", out, "--delta-poll", "0.2"]) as servers, \
                Client(servers.addresses) as sc:
            smodel, sopt = build(sc, args, create=False)
            served = scores(smodel, sopt, *test)
            result["served_auc"] = auc(served, test[2])
            result["max_score_diff"] = float(np.abs(served - trainer).max())
            print(f"test AUC: trainer {result['trainer_auc']:.4f}, serving cluster {result['served_auc']:.4f} "
                  f"(largest score difference {result['max_score_diff']:.2g})", flush=True)
            for k in range(args.deltas):
                start = args.train + k * rnd
                train(model, opt, data, start, start + rnd, args.batch_size)
                d = c.export_delta(out)
                t0 = time.perf_counter()
                wait_for(sc, d.seq)
                lag = time.perf_counter() - t0
                trainer = scores(model, opt, *test)
                before, served = served, scores(smodel, sopt, *test)
                ids = torch.from_numpy(np.unique(test[0][:, 0]))
                same = all(torch.equal(c.pull(table_name(f) + ".serving", ids), sc.pull(table_name(f) + ".serving", ids))
                           for f in range(NUM_SPARSE))
                entry = {"seq": d.seq, "rows": d.rows, "tombstones": d.tombstones, "bytes": d.bytes,
                         "write_s": d.seconds, "served_after_s": lag, "trainer_auc": auc(trainer, test[2]),
                         "served_auc": auc(served, test[2]), "max_score_diff": float(np.abs(served - trainer).max()),
                         "moved": float(np.abs(served - before).mean()), "served_equals_trainer": same}
                result["deltas"].append(entry)
                print(f"delta {d.seq}: {d.rows:,} rows ({d.bytes / 2**20:.1f} MiB) written in {d.seconds:.2f}s, served "
                      f"{lag:.2f}s later; AUC trainer {entry['trainer_auc']:.4f} serving {entry['served_auc']:.4f}; "
                      f"mean score moved {entry['moved']:.4f}; served rows equal the trainer's: {same}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
