"""Example 2: a DLRM-style click-through model trained through the shards.

8 sparse features, each an embedding table of --rows ids (1,000,000 by
default), plus 13 dense features through a bottom MLP, pairwise dot-product
interactions and a top MLP. The tables are one RemoteEmbeddingBagCollection
fed a KeyedJaggedTensor, TorchRec's shape (--embeddings tables: one
RemoteEmbedding per table instead). The click log is synthetic with a planted ground
truth (each id has a true effect), so the best achievable AUC is known. The
same model trained locally with torch.optim runs afterwards for comparison.

    python -m clients.examples.dlrm                       # local cluster, 2 async workers, pipelined
    python -m clients.examples.dlrm --mode sync --prefetch-depth 0   # each batch pulled just before its step
    python -m clients.examples.dlrm --dense ddp           # MLPs by DistributedDataParallel, embeddings on the shards
    python -m clients.examples.dlrm --model torchrec      # TorchRec's own DLRM over the collection (shardps[torchrec])
    torchrun --nproc-per-node 2 -m clients.examples.dlrm --cluster-file shardps-cluster.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Iterator, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from shardps_client import (
    Adagrad,
    Adam,
    Client,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    PoolingType,
    Prefetcher,
    RemoteEmbedding,
    RemoteEmbeddingBagCollection,
    ShardedOptimizer,
    SyncPolicy,
)
from shardps_client.collection_optim import is_table_slot
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from clients.examples.common import (
    Progress,
    add_cluster_args,
    cluster,
    ddp_backend,
    run_workers,
    total_cpu_seconds,
    worker_addresses,
    worker_device,
    worker_identity,
    worker_threads,
)
from shardps.core.specs import Initializer
from shardps.server.ops.launcher import free_port

NUM_SPARSE, NUM_DENSE = 8, 13


# ---- synthetic click log with a planted ground truth ------------------------------------


def true_effects(feature: int, ids: np.ndarray, seed: int) -> np.ndarray:
    """The planted effect of each id of a feature: a fixed N(0, 1) draw per (feature, id)."""
    return Initializer("normal", std=1.0, seed=1000 * seed + feature).rows(ids, 1)[:, 0]


def click_log(n: int, rows: int, seed: int, stream: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sparse ids [n, 8], dense [n, 13], labels [n], true click probabilities [n]) for one data stream."""
    rng = np.random.default_rng([seed, stream])
    ranks = rng.zipf(1.15, size=(n, NUM_SPARSE)).astype(np.int64) % rows
    # Spread popular ids over the table (a fixed permutation-like scramble per feature).
    ids = (ranks * 2_654_435_761 + np.arange(NUM_SPARSE) * 40_503) % rows
    dense = rng.standard_normal((n, NUM_DENSE)).astype(np.float32)
    v = np.random.default_rng([seed, 99]).standard_normal(NUM_DENSE).astype(np.float32) * 0.3
    logit = -1.0 + dense @ v + 0.5 * dense[:, 0] * dense[:, 1]
    for f in range(NUM_SPARSE):
        logit += 0.6 * true_effects(f, ids[:, f], seed)
    p = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < p).astype(np.float32)
    return ids, dense, labels, p.astype(np.float32)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties averaged)."""
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    _, first, counts = np.unique(s, return_index=True, return_counts=True)
    avg_rank = first + (counts + 1) / 2.0
    ranks = np.repeat(avg_rank, counts)
    pos = labels[order] > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))


def batches(ids: np.ndarray, dense: np.ndarray, labels: np.ndarray, batch: int,
            device: torch.device = torch.device("cpu")) -> Iterator[tuple[torch.Tensor, ...]]:
    """(sparse ids, dense features, labels) per step; ids stay on the CPU (RemoteEmbedding pulls them there)."""
    for i in range(0, len(labels), batch):
        yield (torch.from_numpy(ids[i : i + batch]), torch.from_numpy(dense[i : i + batch]).to(device),
               torch.from_numpy(labels[i : i + batch]).to(device))


# ---- model ----------------------------------------------------------------------------------


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


FEATURES = [f"C{f}" for f in range(NUM_SPARSE)]


def sparse_kjt(sparse: torch.Tensor) -> KeyedJaggedTensor:
    """The sparse ids of a batch [B, 8] as a KeyedJaggedTensor: one id per bag, feature after feature."""
    b = sparse.shape[0]
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, sparse.t().reshape(-1),
                                               torch.ones(b * NUM_SPARSE, dtype=torch.int64), stride=b)


class DLRM(nn.Module):
    """Bottom MLP over dense features, embeddings of sparse ones, dot interactions, top MLP.

    ``embeddings``: a collection taking a KeyedJaggedTensor of the 8 features (one module for all
    tables), or one module per feature taking that feature's ids."""

    def __init__(self, embeddings: Union[nn.Module, list[nn.Module]], dim: int) -> None:
        super().__init__()
        self.emb = nn.ModuleList(embeddings) if isinstance(embeddings, list) else embeddings
        self.dim = dim
        self.bottom = mlp([NUM_DENSE, 64, dim])
        n = NUM_SPARSE + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1), persistent=False)
        self.top = mlp([dim + n * (n - 1) // 2, 64, 1])

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        if isinstance(self.emb, nn.ModuleList):
            t = torch.stack([x] + [emb(sparse[:, f]) for f, emb in enumerate(self.emb)], dim=1)
        else:  # the collection: one pass for all tables; its KeyedTensor's columns are the features' rows
            pooled = self.emb(sparse_kjt(sparse)).values().view(-1, NUM_SPARSE, self.dim)
            t = torch.cat([x.unsqueeze(1), pooled.to(x.device)], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)


class TorchRecDLRM(nn.Module):
    """TorchRec's own model (``torchrec.models.dlrm.DLRM``) over the collection, fed TorchRec's own
    ``KeyedJaggedTensor``: a TorchRec user's model with its tables on the shards. Same widths as ``DLRM`` above
    (TorchRec's dense arch ends in a ReLU, its over arch in a Linear)."""

    def __init__(self, ebc: RemoteEmbeddingBagCollection, dim: int) -> None:
        super().__init__()
        try:
            from torchrec.models.dlrm import DLRM as TorchRecModel
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchRecKJT
        except Exception as e:  # noqa: BLE001 - said, with the fix
            raise SystemExit(f"--model torchrec: torchrec cannot be imported ({type(e).__name__}: {e}); install "
                             "pip install 'shardps[torchrec]' and pip install --no-deps torchrec==1.8.0 "
                             "(docs/client.md#torchrec)") from e
        self.kjt = TorchRecKJT
        self.dlrm = TorchRecModel(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                                  dense_arch_layer_sizes=[64, dim], over_arch_layer_sizes=[64, 1])

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        b = sparse.shape[0]
        kjt = self.kjt.from_lengths_sync(FEATURES, sparse.t().reshape(-1),
                                         torch.ones(b * NUM_SPARSE, dtype=torch.int64), stride=b)
        return self.dlrm(dense, kjt).squeeze(1)


def table_name(f: int) -> str:
    return f"dlrm.C{f}"


# ---- training ---------------------------------------------------------------------------------


class StepClock:
    """Wall time of a training loop and where its CPU went: the main thread's CPU in forward + backward (the
    trainer's own work: Python and torch ops, not waits, nor the client's gRPC threads), the process's CPU
    in forward + backward and over the whole loop (every thread: intra-op threads, the client's I/O), and the
    shards' CPU over the same loop (``SHARDPS_SHARD_PIDS``: the processes of a cluster this run started), so a
    sample's cost counts the training loop on both sides, as local training's does: not the tables' creation, nor
    rank 0's evaluation after it."""

    def __init__(self) -> None:
        self.shard_pids = [int(p) for p in os.environ.get("SHARDPS_SHARD_PIDS", "").split(",") if p]
        self.shards0 = (time.monotonic(), total_cpu_seconds(self.shard_pids))
        self.shards1 = self.shards0
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        self.fb_thread = self.fb_process = 0.0
        self.elapsed = self.cpu = 0.0

    @contextlib.contextmanager
    def forward_backward(self) -> Iterator[None]:
        t, p = time.thread_time(), time.process_time()
        yield
        self.fb_thread += time.thread_time() - t
        self.fb_process += time.process_time() - p

    def stop(self) -> float:
        self.elapsed, self.cpu = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        self.shards1 = (time.monotonic(), total_cpu_seconds(self.shard_pids))
        return self.elapsed

    def report(self, steps: int, samples: int) -> dict:
        return {"fwd_bwd_thread_ms": self.fb_thread / steps * 1e3, "fwd_bwd_process_ms": self.fb_process / steps * 1e3,
                "trainer_cpu_s_per_1k": self.cpu / samples * 1e3, "shards_cpu_at": [self.shards0, self.shards1]}


def shards_cpu_of_loops(ranks: list[dict], whole_run: float) -> float:
    """The shards' CPU seconds from the first rank's loop start to the last one's end (readings of the same
    counters, on the machine's monotonic clock); ``whole_run`` (the workers' whole run) where no rank read them."""
    readings = [r["shards_cpu_at"] for r in ranks if r.get("shards_cpu_at")]
    if not readings or not any(end[1] for _, end in readings):
        return whole_run
    start = min((start for start, _ in readings), key=lambda x: x[0])
    end = max((end for _, end in readings), key=lambda x: x[0])
    return end[1] - start[1]


def create_tables(args: argparse.Namespace, client: Client, world: int) -> Optional[SyncPolicy]:
    sync = SyncPolicy(workers=world, timeout_s=60, on_timeout="proceed") if args.mode == "sync" else None
    for f in range(NUM_SPARSE):
        client.create_table(table_name(f) + f".{args.mode}", dim=args.dim, num_embeddings=args.rows,
                            optimizer=Adagrad(lr=args.sparse_lr),
                            initializer=Initializer("normal", std=0.05, seed=f), sync=sync)
    return sync


def evaluate(model: nn.Module, ids: np.ndarray, dense: np.ndarray, labels: np.ndarray,
             device: torch.device = torch.device("cpu")) -> float:
    model.eval()
    scores = []
    with torch.no_grad():
        for s, d, _ in batches(ids, dense, labels, 8192, device):
            scores.append(torch.sigmoid(model(s, d)).cpu().numpy())
    model.train()
    return auc(np.concatenate(scores), labels)


def mlp_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters other than embedding tables (the bottom and top MLPs; a collection's per-table
    placeholders, where optimizers are chosen the TorchRec way, hold no rows and are left out)."""
    return [p for n, p in model.named_parameters()
            if not n.startswith("emb.") and not is_table_slot(p)]


def dense_fingerprint(model: nn.Module) -> float:
    """A sum over the MLPs' parameters: equal on every rank when DDP kept them in step."""
    return float(sum(p.detach().double().sum().item() for p in mlp_parameters(model)))


def worker(args: argparse.Namespace, addresses: list[str], rank: int, world: int) -> int:
    torch.manual_seed(args.seed)
    torch.set_num_threads(worker_threads(addresses, world))
    device = worker_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and CUDA's default stream on this worker's GPU, not GPU 0
    ids, dense, labels, _ = click_log(args.train // world, args.rows, args.seed, stream=1 + rank)
    ssp = args.ssp_bound if args.mode == "ssp" else None
    ddp = args.dense == "ddp"
    if ddp:  # MASTER_ADDR/MASTER_PORT come from torchrun, or from main() below
        dist.init_process_group(ddp_backend(device, world), rank=rank, world_size=world)
    with Client(addresses, rank=rank, world_size=world, ssp_bound=ssp) as client:
        sync = create_tables(args, client, world)
        if args.cache_steps:
            for f in range(NUM_SPARSE):
                client.cache_table(table_name(f) + f".{args.mode}", steps=args.cache_steps, max_rows=args.cache_rows)
        names = [table_name(f) + f".{args.mode}" for f in range(NUM_SPARSE)]
        if args.embeddings == "collection":
            configs = [EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=args.dim, name=name,
                                          feature_names=[feature], pooling=PoolingType.SUM)
                       for name, feature in zip(names, FEATURES)]
            ebc = RemoteEmbeddingBagCollection(configs, client, device=device, create=False)  # tables made above
            model = (TorchRecDLRM if args.model == "torchrec" else DLRM)(ebc, args.dim).to(device)

            def ids_fn(b: tuple) -> dict[str, torch.Tensor]:
                return ebc.ids_of(sparse_kjt(b[0]))
        else:
            model = DLRM([RemoteEmbedding(client, name, device=device) for name in names], args.dim).to(device)

            def ids_fn(b: tuple) -> dict[str, torch.Tensor]:
                return {name: b[0][:, f] for f, name in enumerate(names)}
        if ddp:
            # The hybrid: the MLPs are replicated and their gradients all-reduced by DDP (its constructor
            # gives every rank rank 0's values), a local torch.optim.Adam steps them; the embedding rows
            # live on the shards, whose Adagrad steps them. ShardedOptimizer over no dense parameters only
            # gathers a step's row pushes into one batch per shard (and advances the SSP clock).
            net: nn.Module = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
            dense_opt: Optional[torch.optim.Optimizer] = torch.optim.Adam(mlp_parameters(model), lr=args.dense_lr)
            opt = ShardedOptimizer(client, [], prefix=f"dlrm.{args.mode}.", sync=sync)
        else:
            net, dense_opt = model, None
            opt = ShardedOptimizer(client, model, optimizer=Adam(lr=args.dense_lr), prefix=f"dlrm.{args.mode}.",
                                   sync=sync, dense_lag=args.dense_lag)
        # All 8 tables' rows of a batch are pulled in one round trip per shard, while the previous batch trains
        # (--prefetch-depth 1, the default: TrainPipeline's way, written out here to time forward + backward).
        data = Prefetcher(batches(ids, dense, labels, args.batch_size, device), client, ids_fn,
                          depth=args.prefetch_depth)
        steps = (len(labels) + args.batch_size - 1) // args.batch_size
        progress = Progress(steps, f"shardps rank {rank}", enabled=rank == 0)
        clock = StepClock()
        for step, (s, d, y) in enumerate(data, 1):
            opt.zero_grad()
            if dense_opt is not None:
                dense_opt.zero_grad()
            with clock.forward_backward():
                loss = F.binary_cross_entropy_with_logits(net(s, d), y)
                loss.backward()
            opt.step()
            if dense_opt is not None:
                dense_opt.step()
            progress.update(step, len(y), loss=loss.item())
        opt.flush()
        elapsed = clock.stop()
        client.barrier()
        result = {"rank": rank, "samples": len(labels), "seconds": elapsed, "samples_per_s": len(labels) / elapsed,
                  **clock.report(steps, len(labels))}
        if ddp:
            result["dense_fingerprint"] = dense_fingerprint(model)
        if rank == 0:
            opt.pull()
            test_ids, test_dense, test_labels, _ = click_log(args.test, args.rows, args.seed, stream=0)
            result["auc"] = evaluate(model, test_ids, test_dense, test_labels, device)
            print(f"shardps: test AUC {result['auc']:.4f} after {elapsed:.1f}s", flush=True)
        if os.environ.get("SHARDPS_RESULTS_DIR"):
            with open(os.path.join(os.environ["SHARDPS_RESULTS_DIR"], f"rank{rank}.json"), "w") as f:
                json.dump(result, f)
    if ddp:
        dist.destroy_process_group()
    return 0


def train_local(args: argparse.Namespace, threads: int = 0) -> dict:
    """The same model and data, one process, torch.optim (the baseline); ``threads``: torch's intra-op threads
    (0: one per core)."""
    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch's sparse Adagrad, harmless
    torch.manual_seed(args.seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        return _train_local(args)
    finally:
        torch.set_num_threads(before)


def _train_local(args: argparse.Namespace) -> dict:
    embs = [nn.Embedding(args.rows, args.dim, sparse=True) for _ in range(NUM_SPARSE)]
    for e in embs:
        nn.init.normal_(e.weight, std=0.05)
    model = DLRM(embs, args.dim)
    sparse_opt = torch.optim.Adagrad([e.weight for e in embs], lr=args.sparse_lr)
    dense_opt = torch.optim.Adam(mlp_parameters(model), lr=args.dense_lr)
    parts = [click_log(args.train // args.workers, args.rows, args.seed, stream=1 + r) for r in range(args.workers)]
    ids, dense, labels = (np.concatenate([p[i] for p in parts]) for i in range(3))
    steps = (len(labels) + args.batch_size - 1) // args.batch_size
    progress = Progress(steps, "local torch.optim")
    clock = StepClock()
    for step, (s, d, y) in enumerate(batches(ids, dense, labels, args.batch_size), 1):
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        with clock.forward_backward():
            loss = F.binary_cross_entropy_with_logits(model(s, d), y)
            loss.backward()
        sparse_opt.step()
        dense_opt.step()
        progress.update(step, len(y), loss=loss.item())
    elapsed = clock.stop()
    test_ids, test_dense, test_labels, _ = click_log(args.test, args.rows, args.seed, stream=0)
    return {"auc": evaluate(model, test_ids, test_dense, test_labels), "samples_per_s": len(labels) / elapsed,
            **clock.report(steps, len(labels))}


def build_parser() -> argparse.ArgumentParser:
    """The example's command line (the deployment tests parse the Compose and Kubernetes commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_args(p, workers=2)
    p.add_argument("--rows", type=int, default=1_000_000, help="ids per sparse feature (rows per table)")
    p.add_argument("--dim", type=int, default=16, help="embedding width")
    p.add_argument("--train", type=int, default=400_000, help="training samples (split over workers)")
    p.add_argument("--test", type=int, default=100_000, help="test samples")
    p.add_argument("--batch-size", type=int, default=1024, help="samples per step per worker")
    p.add_argument("--sparse-lr", type=float, default=0.05, help="Adagrad learning rate of the embeddings")
    p.add_argument("--dense-lr", type=float, default=2e-3, help="Adam learning rate of the MLPs")
    p.add_argument("--embeddings", choices=("collection", "tables"), default="collection",
                   help="the tables as one RemoteEmbeddingBagCollection (one pass for all tables per step) or "
                        "one RemoteEmbedding module per table")
    p.add_argument("--model", choices=("ours", "torchrec"), default="ours",
                   help="the model over the collection: this example's DLRM, or TorchRec's own "
                        "torchrec.models.dlrm.DLRM fed TorchRec's KeyedJaggedTensor (pip install 'shardps[torchrec]')")
    p.add_argument("--prefetch-depth", type=int, default=1,
                   help="batches whose rows are pulled ahead while the current one trains (default 1: pipelined; 0: "
                        "each batch's rows pulled just before its step, after the last step's pushes)")
    p.add_argument("--prefetch", action="store_const", const=1, dest="prefetch_depth",
                   help="the same as --prefetch-depth 1, the default (kept for older commands)")
    p.add_argument("--dense-lag", type=int, default=0,
                   help="steps the MLP's values may lag behind (async mode): 1 lets a step start before the last "
                        "step's new values are back")
    p.add_argument("--cache-steps", type=int, default=0,
                   help="serve each pulled row from the trainer for this many steps, pushing its summed gradients "
                        "then (Client.cache_table; 0: no cache, async mode only)")
    p.add_argument("--cache-rows", type=int, default=500_000, help="rows the cache may hold per table")
    p.add_argument("--dense", choices=("shards", "ddp"), default="shards",
                   help="where the MLPs train: on the shards (ShardedOptimizer) or replicated by "
                        "DistributedDataParallel (gloo on CPU, nccl on CUDA) with a local Adam")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model computes (rows are pulled to it)")
    p.add_argument("--no-local", action="store_true", help="skip the local torch.optim baseline")
    p.add_argument("--local-threads", type=int, default=0,
                   help="torch's threads for the local baseline (default 0: one per core)")
    p.add_argument("--local-one-thread", action="store_true",
                   help="also train locally with one torch thread: a trainer's like for like in forward + backward "
                        "CPU (a worker beside local shards gets one thread)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    return p


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    if args.dense_lag and args.mode != "async":
        p.error("--dense-lag needs --mode async (synchronous and SSP steps bound staleness themselves)")
    if args.dense_lag and args.dense == "ddp":
        p.error("--dense-lag applies to --dense shards (DDP's all-reduce keeps the replicas in step)")
    if args.model == "torchrec" and args.embeddings != "collection":
        p.error("--model torchrec takes the tables as one collection (--embeddings collection)")
    if args.cache_steps and args.mode == "sync":
        p.error("--cache-steps needs --mode async or ssp (a synchronous step takes every worker's gradients)")
    ident = worker_identity()
    if ident is not None:  # one worker (under torchrun or started below)
        return worker(args, worker_addresses(args), *ident)
    print(f"{'TorchRec DLRM' if args.model == 'torchrec' else 'DLRM'}: {NUM_SPARSE} sparse features x {args.rows:,} rows (dim {args.dim}, {args.embeddings}) + "
          f"{NUM_DENSE} dense; "
          f"{args.train:,} training samples, {args.workers} worker(s), mode {args.mode}"
          f"{f', prefetch depth {args.prefetch_depth}' if args.prefetch_depth else ', no prefetch'}{f', cache {args.cache_steps} steps' if args.cache_steps else ''}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="shardps-dlrm-") as results_dir:  # each worker's figures, then gone
        os.environ["SHARDPS_RESULTS_DIR"] = results_dir
        with cluster(args) as addresses:
            shards_cpu = total_cpu_seconds(addresses.pids)
            env = {"MASTER_PORT": str(free_port()), "SHARDPS_SHARD_PIDS": ",".join(map(str, addresses.pids))}
            code = run_workers(args, addresses, __spec__.name, env)
            shards_cpu = total_cpu_seconds(addresses.pids) - shards_cpu  # (0 for a cluster this run did not start)
        if code != 0:
            return code
        ranks = []
        for r in range(args.workers):
            with open(os.path.join(results_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    test_ids, test_dense, test_labels, test_p = click_log(args.test, args.rows, args.seed, stream=0)
    samples = sum(r["samples"] for r in ranks)
    results = {
        "best_auc": auc(test_p, test_labels),
        "shardps": {"auc": ranks[0]["auc"], "samples_per_s": sum(r["samples_per_s"] for r in ranks),
                    **{k: statistics.mean(r[k] for r in ranks) for k in ("fwd_bwd_thread_ms", "fwd_bwd_process_ms")},
                    "trainer_cpu_s_per_1k": sum(r["trainer_cpu_s_per_1k"] * r["samples"] for r in ranks) / samples,
                    "shards_cpu_s_per_1k": shards_cpu_of_loops(ranks, shards_cpu) / samples * 1e3,
                    "shards_cpu_s_per_1k_whole_run": shards_cpu / samples * 1e3},
    }
    if not args.no_local:
        results["local"] = train_local(args, threads=args.local_threads)
        if args.local_one_thread:
            results["local_one_thread"] = train_local(args, threads=1)
    if args.dense == "ddp":
        results["shardps"]["dense_fingerprints"] = [r["dense_fingerprint"] for r in ranks]
    label = f"shardps ({'TorchRec DLRM, ' if args.model == 'torchrec' else ''}{args.workers} workers, {args.mode}{', DDP dense' if args.dense == 'ddp' else ''})"
    lines = [("best achievable (planted truth)", results["best_auc"], None),
             (label, results["shardps"]["auc"], results["shardps"]["samples_per_s"])]
    if "local" in results:
        lines.append(("local torch.optim (1 process)", results["local"]["auc"], results["local"]["samples_per_s"]))
    width = max(len(name) for name, _, _ in lines) + 2
    print(f"\n{'':<{width}}{'test AUC':>9}{'samples/s':>12}")
    for name, a, rate in lines:
        print(f"{name:<{width}}{a:>9.4f}{'-' if rate is None else f'{rate:,.0f}':>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
