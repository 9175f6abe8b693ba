"""Shared plumbing of the example trainers: cluster, workers, progress.

- ``cluster(args)``: the cluster to train against: ``--cluster-file`` or
  ``--addresses`` if given, else a local cluster of ``--shards`` processes
  started for the run (the embedded default) and stopped at the end.
- ``run_workers(args, main)``: runs ``main(rank, world_size)`` once per worker.
  Under torchrun (RANK and WORLD_SIZE set) this process is one worker; otherwise
  ``--workers N`` re-runs this example N times (``python -m`` its module) with
  RANK/WORLD_SIZE set, exactly as torchrun would.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from shardps.server.ops.launcher import LocalCluster, Placement, cpu_seconds

if TYPE_CHECKING:
    import torch


def add_cluster_args(p: argparse.ArgumentParser, workers: int = 2) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--cluster-file", help="train against the shards listed in this file (shardps cluster writes it)")
    g.add_argument("--addresses", help="comma-separated shard addresses, in index order")
    g.add_argument("--shards", type=int, default=2, help="shards of the local cluster started when no cluster is given")
    g.add_argument("--workers", type=int, default=workers, help="worker processes (ignored under torchrun)")
    g.add_argument("--mode", choices=("async", "ssp", "sync"), default="async", help="training mode")
    g.add_argument("--ssp-bound", type=int, default=2, help="k of bounded staleness (--mode ssp)")
    g.add_argument("--netns", nargs="+", default=None, metavar="NAME",
                   help="run the local cluster's shards in these network namespaces (hosts of their own: "
                        "shardps cluster --netns)")
    g.add_argument("--worker-netns", nargs="+", default=None, metavar="NAME",
                   help="run worker r in network namespace NAME[r %% count] (a host of its own)")


class Addresses(list):
    """Shard addresses in index order; ``pids`` are the shard processes when this run started them."""

    pids: list[int] = []


@contextlib.contextmanager
def cluster(args: argparse.Namespace) -> Iterator[Addresses]:
    """Addresses of the cluster to use; starts (and stops) a local one if none was given."""
    if args.cluster_file:
        import json

        with open(args.cluster_file) as f:
            yield Addresses(json.load(f)["addresses"])
    elif args.addresses:
        yield Addresses(args.addresses.split(","))
    else:
        placements = [Placement.netns(n) for n in (getattr(args, "netns", None) or [])]
        with LocalCluster(args.shards, placements=placements) as local:
            print(f"started a local cluster of {args.shards} shards: {', '.join(local.addresses)}", flush=True)
            out = Addresses(local.addresses)
            out.pids = [p.popen.pid for p in local.procs]
            yield out


def total_cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes ``pids`` have used so far (Linux /proc; 0 elsewhere)."""
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except OSError:
            continue
    return total


def run_workers(args: argparse.Namespace, addresses: list[str], module: str, extra_env: Optional[dict] = None) -> int:
    """Start --workers copies of ``python -m module`` (the example's own ``__spec__.name``) with RANK/WORLD_SIZE
    and the cluster's addresses; wait for all."""
    hosts = [Placement.netns(n) for n in (getattr(args, "worker_netns", None) or [])]
    env_base = {**os.environ, **(extra_env or {}), "SHARDPS_ADDRESSES": ",".join(addresses),
                "WORLD_SIZE": str(args.workers), "MASTER_ADDR": hosts[0].host if hosts else "127.0.0.1"}
    if hosts:  # DDP's gloo group: the workers' own interface, not the address their host name resolves to
        env_base.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    argv = [a for a in sys.argv[1:]]
    procs = [
        subprocess.Popen([*(hosts[r % len(hosts)].prefix if hosts else ()), sys.executable, "-m", module, *argv],
                         env={**env_base, "RANK": str(r), "LOCAL_RANK": "0" if hosts else str(r),
                              **({"LOCAL_WORLD_SIZE": "1"} if hosts else {})})
        for r in range(args.workers)
    ]
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


def worker_identity() -> Optional[tuple[int, int]]:
    """(rank, world_size) when running as a worker (under torchrun or run_workers)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def worker_device(requested: str) -> torch.device:
    """The device a worker computes on. A bare ``cuda`` becomes ``cuda:LOCAL_RANK`` modulo the GPUs this machine
    has (torchrun's and run_workers' convention), so workers spread over the GPUs and share them when there are
    more workers than GPUs; anything else (``cpu``, ``cuda:1``) is taken as given."""
    import torch

    device = torch.device(requested)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1))
    return device


def ddp_backend(device: torch.device, world: int) -> str:
    """NCCL when every local worker has a GPU of its own; gloo on CPU and when workers share a GPU (NCCL refuses
    two ranks on one device; gloo all-reduces CUDA tensors too)."""
    import torch

    if device.type != "cuda":
        return "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return "nccl" if local_world <= torch.cuda.device_count() else "gloo"


def worker_threads(addresses: list[str], world: int) -> int:
    """torch threads for one worker: this host's cores shared among the workers, and among
    the shards too when they run here (loopback addresses). An idle torch thread spins for
    a while after each op, so more threads than free cores takes CPU from the shards: with
    2 threads on 2 cores beside 2 shards, a DLRM worker used twice the CPU per step."""
    local_shards = sum(a.startswith(("127.", "localhost", "[::1]")) for a in addresses)
    return max(1, (os.cpu_count() or 2) // (max(world, 1) + local_shards))


def worker_addresses(args: argparse.Namespace) -> list[str]:
    if os.environ.get("SHARDPS_ADDRESSES"):
        return os.environ["SHARDPS_ADDRESSES"].split(",")
    if args.cluster_file:
        import json

        with open(args.cluster_file) as f:
            return json.load(f)["addresses"]
    if args.addresses:
        return args.addresses.split(",")
    raise SystemExit("a worker started by torchrun needs --cluster-file or --addresses")


def launch(args: argparse.Namespace, module: str, worker: Callable[[list[str], int, int], int],
           coordinator: Optional[Callable[[list[str]], None]] = None) -> int:
    """Entry point of an example: be a worker, or set up a cluster and start workers.

    ``coordinator(addresses)`` runs once before the workers start (creating
    tables, say), in the launching process.
    """
    ident = worker_identity()
    if ident is not None:
        return worker(worker_addresses(args), *ident)
    with cluster(args) as addresses:
        if coordinator is not None:
            coordinator(addresses)
        if args.workers <= 1:
            return worker(addresses, 0, 1)
        return run_workers(args, addresses, module)


class Progress:
    """A one-line progress bar with throughput, redrawn at most every 0.2 s."""

    def __init__(self, total: int, label: str, unit: str = "samples", enabled: bool = True) -> None:
        self.total, self.label, self.unit, self.enabled = total, label, unit, enabled
        self.start = self.last = time.perf_counter()
        self.done_items = 0
        self.tty = sys.stdout.isatty()

    def update(self, step: int, items: int, **metrics: float) -> None:
        self.done_items += items
        now = time.perf_counter()
        if not self.enabled or (now - self.last < (0.2 if self.tty else 5.0) and step < self.total):
            return
        self.last = now
        frac = step / max(1, self.total)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        rate = self.done_items / max(now - self.start, 1e-9)
        extra = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        line = f"{self.label} [{bar}] {step}/{self.total}  {rate:,.0f} {self.unit}/s  {extra}"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)
        if self.tty and step >= self.total:
            print(flush=True)

    @property
    def rate(self) -> float:
        return self.done_items / max(time.perf_counter() - self.start, 1e-9)
