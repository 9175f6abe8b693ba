"""Example 3: a small LSTM language model with its embedding and softmax on the shards.

A character-level model trained on the source text of Python's standard
library (on every machine, no download). The input embedding and the output
softmax weights are shardps tables (pulled through RemoteEmbedding: the
softmax pulls its whole vocabulary each step); the LSTM and the softmax bias
are dense tensors on the shards. Prints perplexity on held-out text.

    python -m clients.examples.lstm_lm --workers 2
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time

import torch
import torch.nn.functional as F
from shardps_client import Adam, Client, RemoteEmbedding, ShardedOptimizer, SyncPolicy
from torch import nn

from clients.examples.common import Progress, add_cluster_args, launch, worker_threads
from shardps.core.specs import Initializer

MODULES = ["argparse", "collections", "json", "logging", "pathlib", "subprocess", "threading", "typing", "unittest.case"]


def corpus() -> str:
    import importlib

    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)


class CharLM(nn.Module):
    def __init__(self, client: Client, prefix: str, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = RemoteEmbedding(client, prefix + "embed")
        self.softmax_w = RemoteEmbedding(client, prefix + "softmax")  # vocab x hidden output weights
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        w = self.softmax_w(torch.arange(self.vocab))
        return h @ w.T + self.bias


def worker(args: argparse.Namespace, addresses: list[str], rank: int, world: int) -> int:
    torch.manual_seed(args.seed)
    torch.set_num_threads(worker_threads(addresses, world))
    text = corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.int64)
    cut = int(0.95 * len(data))
    train, valid = data[:cut], data[cut:]
    prefix = f"lm.{args.mode}."
    sync = SyncPolicy(workers=world, timeout_s=60, on_timeout="proceed") if args.mode == "sync" else None
    ssp = args.ssp_bound if args.mode == "ssp" else None
    with Client(addresses, rank=rank, world_size=world, ssp_bound=ssp) as client:
        for name in ("embed", "softmax"):
            client.create_table(prefix + name, dim=args.hidden, num_embeddings=len(chars), optimizer=Adam(lr=args.lr),
                                initializer=Initializer("uniform", a=0.1, seed=len(name)), sync=sync)
        model = CharLM(client, prefix, len(chars), args.hidden)
        opt = ShardedOptimizer(client, model, optimizer=Adam(lr=args.lr), prefix=prefix, sync=sync)
        gen = torch.Generator().manual_seed(args.seed + rank)
        progress = Progress(args.steps, f"rank {rank}", unit="chars", enabled=rank == 0)
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch_size,), generator=gen)
            x = torch.stack([train[s : s + args.seq_len] for s in starts])
            y = torch.stack([train[s + 1 : s + args.seq_len + 1] for s in starts])
            opt.zero_grad()
            loss = F.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
            loss.backward()
            opt.step()
            progress.update(step, x.numel(), loss=loss.item())
        opt.flush()
        client.barrier()
        opt.pull()
        with torch.no_grad():
            n = (len(valid) - 1) // args.seq_len * args.seq_len
            vx = valid[:n].view(-1, args.seq_len)
            vy = valid[1 : n + 1].view(-1, args.seq_len)
            val_loss = F.cross_entropy(model(vx).reshape(-1, len(chars)), vy.reshape(-1)).item()
        if rank == 0:
            print(f"char LSTM: held-out perplexity {math.exp(val_loss):.2f} (uniform would be {len(chars)}), "
                  f"{args.steps} steps x {world} workers, {time.perf_counter() - t0:.1f}s", flush=True)
    return 0 if math.exp(val_loss) <= args.max_perplexity else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_args(p, workers=2)
    p.add_argument("--steps", type=int, default=300, help="training steps per worker")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--hidden", type=int, default=128, help="embedding and LSTM width")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (applied on the shards)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-perplexity", type=float, default=float("inf"), help="exit 1 if perplexity ends above this")
    args = p.parse_args()
    return launch(args, __spec__.name, lambda a, r, w: worker(args, a, r, w))


if __name__ == "__main__":
    sys.exit(main())
