"""Where a benchmark's processes run: all on this machine's own network (``local``), or each shard and each trainer
on a host of its own in the lab (``tests.lab``: network namespaces joined by a bridge, TCP between them), as is,
with every host's link capped at 10 Gbit/s (tbf), or with 100 us of proxy delay each way on every trainer-shard
link. The baselines are placed the same way, so a ratio compares like with like.

    local      shards and trainers as the benchmark always ran them (Unix sockets and shared memory for shardps,
               TensorPipe's shm transport and cma channel for torch.distributed.rpc)
    lab        a host each; TCP over veth + bridge (rpc: TensorPipe's uv transport and basic channel, as across
               machines)
    lab-10g    lab, every host's link capped at 10 Gbit/s each way
    lab-delay  lab, 100 us each way on every trainer -> shard link (the lab's fault proxy): what pipelining hides

The benchmark's driver runs on the lab's control host (``Lab.call``); a trainer enters its own host first thing
(``enter``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

PLACEMENTS = ("local", "lab", "lab-10g", "lab-delay")
CAP_MBIT = 10_000
DELAY_MS = 0.1


@dataclass(frozen=True)
class Where:
    """The hosts of one run: (address, network namespace) per shard and per trainer (picklable)."""

    shards: tuple[tuple[str, str], ...]
    trainers: tuple[tuple[str, str], ...]
    name: str = "lab"

    def shard_placements(self, n: int) -> list:
        from shardps.server.ops.launcher import Placement

        return [Placement(addr, ("nsenter", f"--net=/run/netns/{ns}", "--")) for addr, ns in self.shards[:n]]

    def trainer(self, rank: int) -> tuple[str, str]:
        return self.trainers[rank % len(self.trainers)]


def enter_trainer(where: Optional[Where], rank: int) -> None:
    """In a trainer process: move to its own host (no-op for ``local``)."""
    if where is not None and where.trainers:
        from tests.lab import enter

        enter(where.trainer(rank)[1])


def rpc_backend_options(where: Optional[Where], init_method: str, threads: int = 8) -> Any:
    """TensorPipe's options: as it picks them locally, or across the lab's hosts its TCP transport (uv) and basic
    channel only, on eth0 (locally it would move tensors through shared memory and cross-memory attach, which
    hosts of their own do not share)."""
    import os

    from torch.distributed import rpc

    if where is None:
        return rpc.TensorPipeRpcBackendOptions(init_method=init_method, num_worker_threads=threads)
    # TensorPipe and the Gloo group rpc's start-up uses pick their address from the host name (127.0.0.1 here)
    # unless told the interface: the host's eth0 in the lab, lo for the TCP transport on this host.
    os.environ["TP_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"] = "eth0" if where.shards else "lo"
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, num_worker_threads=threads,
                                           _transports=["uv"], _channels=["basic"])


class LabHosts:
    """The lab of a benchmark run: a control host, ``shards`` shard hosts, ``trainers`` trainer hosts; ``use``
    sets one placement's faults (lifting the others')."""

    def __init__(self, shards: int, trainers: int) -> None:
        from tests.lab import Lab

        self.shard_names = [f"s{i}" for i in range(shards)]
        self.trainer_names = [f"t{i}" for i in range(trainers)]
        self.lab = Lab(["ctl", *self.shard_names, *self.trainer_names]).start()
        self.current = "lab"

    def where(self, placement: str) -> Where:
        h = self.lab.hosts
        return Where(tuple((h[n].address, h[n].netns) for n in self.shard_names),
                     tuple((h[n].address, h[n].netns) for n in self.trainer_names), placement)

    def use(self, placement: str) -> Where:
        if placement not in PLACEMENTS[1:]:
            raise ValueError(f"not a lab placement: {placement}")
        lab = self.lab
        for name in lab.hosts:
            lab.rate(name, CAP_MBIT if placement == "lab-10g" else None)
        for t in self.trainer_names:
            for s in self.shard_names:
                if placement == "lab-delay":
                    lab.link(t, s).delay(DELAY_MS)
                else:
                    lab.unlink(t, s)
        self.current = placement
        return self.where(placement)

    def call(self, fn: Any, *args: Any, timeout: float = 1800.0) -> Any:
        """``fn(*args)`` on the control host."""
        return self.lab.call("ctl", fn, *args, timeout=timeout)

    def proxy_cpu_s(self) -> float:
        """CPU seconds the fault proxies used so far."""
        from shardps.server.ops.launcher import cpu_seconds

        total = 0.0
        for p in self.lab.proxies():
            try:
                total += cpu_seconds(p.popen.pid)
            except OSError:
                pass
        return total

    def close(self) -> None:
        self.lab.close()
