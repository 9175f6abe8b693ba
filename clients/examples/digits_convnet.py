"""Example 1: the seeds' MNIST-style ConvNet with its dense parameters on the shards.

Two workers train on scikit-learn's bundled handwritten digits (8x8, no
download), asynchronously or synchronously, each on its half of the training
set; rank 0 reports test accuracy (95%+ expected).

    python -m clients.examples.digits_convnet --workers 2 --mode async
    python -m clients.examples.digits_convnet --workers 2 --mode sync
    torchrun --nproc-per-node 2 -m clients.examples.digits_convnet --cluster-file shardps-cluster.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from shardps_client import Adam, Client, ShardedOptimizer, SyncPolicy
from torch import nn

from clients.examples.common import Progress, add_cluster_args, launch


class Net(nn.Module):
    """The MNIST ConvNet of the PyTorch examples, sized for 8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def load_digits_split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    x = (x - 0.3) / 0.4
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def worker(args: argparse.Namespace, addresses: list[str], rank: int, world: int) -> int:
    torch.manual_seed(args.seed)  # every worker builds the same initial model; the first registration wins
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    x_mine, y_mine = x_train[rank::world], y_train[rank::world]
    model = Net()
    sync = SyncPolicy(workers=world, aggregator="mean", timeout_s=60, on_timeout="proceed") if args.mode == "sync" else None
    ssp = args.ssp_bound if args.mode == "ssp" else None
    with Client(addresses, rank=rank, world_size=world, ssp_bound=ssp) as client:
        opt = ShardedOptimizer(client, model, optimizer=Adam(lr=args.lr), prefix=f"digits.{args.mode}.", sync=sync)
        steps_per_epoch = (len(y_mine) + args.batch_size - 1) // args.batch_size
        progress = Progress(args.epochs * steps_per_epoch, f"rank {rank}", enabled=rank == 0)
        gen = torch.Generator().manual_seed(args.seed + rank)
        step, t0 = 0, time.perf_counter()
        for _ in range(args.epochs):
            perm = torch.randperm(len(y_mine), generator=gen)
            for i in range(0, len(perm), args.batch_size):
                idx = perm[i : i + args.batch_size]
                opt.zero_grad()
                loss = F.nll_loss(model(x_mine[idx]), y_mine[idx])
                loss.backward()
                opt.step()
                step += 1
                progress.update(step, len(idx), loss=loss.item())
        opt.flush()
        client.barrier()  # every worker finished its steps
        opt.pull()
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        if rank == 0:
            print(f"digits ConvNet: test accuracy {100 * acc:.1f}% ({args.mode}, {world} workers, {args.epochs} epochs, "
                  f"{time.perf_counter() - t0:.1f}s, {progress.rate:,.0f} samples/s on rank 0)", flush=True)
    return 0 if acc >= args.min_accuracy else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_args(p, workers=2)
    p.add_argument("--epochs", type=int, default=12, help="passes over each worker's half of the training set")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step per worker")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (applied on the shards)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 if test accuracy ends below this (0-1)")
    args = p.parse_args()
    return launch(args, __spec__.name, lambda a, r, w: worker(args, a, r, w))


if __name__ == "__main__":
    sys.exit(main())
