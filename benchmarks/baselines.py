"""The alternatives a user would otherwise pick, written sparse like the seeds' designs.

- ``torch.distributed.rpc`` parameter server: each server holds its partition
  of the table as a tensor; pulls are ``index_select``, pushes ``index_add_``
  (SGD), called with ``rpc_sync`` / ``rpc_async``.
- Ray actor parameter server: the same partition and ops inside Ray actors.
- In process: the same gather and scatter with no transport (the ceiling).

Ids are partitioned by ``id % servers``; a server's local row is ``id // servers``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

# ---- torch.distributed.rpc -------------------------------------------------------------

_TABLE: Optional[torch.Tensor] = None
_LR = 0.01


def rpc_init_table(rows: int, dim: int) -> None:
    global _TABLE
    _TABLE = torch.zeros(rows, dim)


def rpc_pull(local_ids: torch.Tensor) -> torch.Tensor:
    assert _TABLE is not None
    return _TABLE.index_select(0, local_ids)


def rpc_push(local_ids: torch.Tensor, grads: torch.Tensor) -> None:
    assert _TABLE is not None
    _TABLE.index_add_(0, local_ids, grads, alpha=-_LR)


def rpc_pid() -> int:
    return os.getpid()


def rpc_server_main(rank: int, world: int, master: str, rows: int, dim: int, servers: int, where=None) -> None:
    """A server process: hold a partition, serve until every trainer called shutdown. ``master``: the rendezvous
    host:port; ``where``: the hosts (``benchmarks.placement.Where``) when it runs on a lab host of its own (or its
    TCP transport alone, on this host)."""
    from torch.distributed import rpc

    from benchmarks.placement import rpc_backend_options

    if where is not None and where.shards:
        from tests.lab import enter

        enter(where.shards[rank][1])
    torch.set_num_threads(1)
    rpc_init_table(-(-rows // servers), dim)
    opts = rpc_backend_options(where, f"tcp://{master}")
    rpc.init_rpc(f"ps{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    rpc.shutdown()


class RpcClient:
    """A trainer's view of the rpc parameter servers (inside an initialised rpc world)."""

    def __init__(self, servers: int) -> None:
        self.servers = servers

    def _split(self, ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        owner = ids % self.servers
        out = []
        for s in range(self.servers):
            pos = (owner == s).nonzero().squeeze(1)
            out.append((s, pos, ids[pos] // self.servers))
        return out

    def pull(self, ids: torch.Tensor, dim: int) -> torch.Tensor:
        from torch.distributed import rpc

        parts = self._split(ids)
        futs = [rpc.rpc_async(f"ps{s}", rpc_pull, args=(local,)) for s, _, local in parts]
        out = torch.empty(len(ids), dim)
        for (_, pos, _), f in zip(parts, futs):
            out[pos] = f.wait()
        return out

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> list:
        from torch.distributed import rpc

        return [rpc.rpc_async(f"ps{s}", rpc_push, args=(local, grads[pos])) for s, pos, local in self._split(ids)]


# ---- Ray -------------------------------------------------------------------------------------


def make_ray_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class RayParameterServer:
        def __init__(self, rows: int, dim: int) -> None:
            torch.set_num_threads(1)
            self.table = torch.zeros(rows, dim)

        def pull(self, local_ids: torch.Tensor) -> torch.Tensor:
            return self.table.index_select(0, local_ids)

        def push(self, local_ids: torch.Tensor, grads: torch.Tensor) -> None:
            self.table.index_add_(0, local_ids, grads, alpha=-_LR)

        def pid(self) -> int:
            return os.getpid()

    return RayParameterServer


class RayClient:
    def __init__(self, actors: list) -> None:
        self.actors = actors
        self.servers = len(actors)

    def pull(self, ids: torch.Tensor, dim: int) -> torch.Tensor:
        import ray

        owner = ids % self.servers
        parts = [(owner == s).nonzero().squeeze(1) for s in range(self.servers)]
        refs = [a.pull.remote(ids[p] // self.servers) for a, p in zip(self.actors, parts)]
        out = torch.empty(len(ids), dim)
        for p, rows in zip(parts, ray.get(refs)):
            out[p] = rows
        return out

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> list:
        owner = ids % self.servers
        refs = []
        for s, a in enumerate(self.actors):
            p = (owner == s).nonzero().squeeze(1)
            refs.append(a.push.remote(ids[p] // self.servers, grads[p]))
        return refs


# ---- in process ------------------------------------------------------------------------------


class InProcess:
    """The same gather and scatter on one tensor, no transport."""

    def __init__(self, rows: int, dim: int) -> None:
        self.table = torch.zeros(rows, dim)

    def pull(self, ids: torch.Tensor, dim: int) -> torch.Tensor:
        return self.table.index_select(0, ids)

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> list:
        self.table.index_add_(0, ids, grads, alpha=-_LR)
        return []
