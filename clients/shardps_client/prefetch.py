"""Prefetching rows of the next batch while the current one computes."""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from shardps_client.client import Client

IdsFn = Callable[[Any], Mapping[str, torch.Tensor]]


class Prefetcher:
    """Wrap a DataLoader (any iterable) so the rows of batch i+1 are pulled while batch i trains.

    Args:
        loader: yields batches.
        client: a connected ``Client``.
        ids_fn: maps a batch to ``{table: ids}``: the ids the model will look up.
        depth: batches pulled ahead (1 hides one step of pull latency; 0 pulls each
            batch's rows just before it is yielded, all tables in one round trip per shard).

    ``RemoteEmbedding`` modules then find their rows already pulled: the client
    hands out a prefetched pull when the same table and unique ids are asked for.
    Prefetched rows were read before the previous step's pushes, so they are one
    step staler (the shards see that staleness through the versions).
    """

    def __init__(self, loader: Iterable, client: Client, ids_fn: IdsFn, depth: int = 1) -> None:
        self.loader = loader
        self.client = client
        self.ids_fn = ids_fn
        self.depth = max(0, depth)

    def __iter__(self) -> Iterator[Any]:
        queue: list[Any] = []  # batches read ahead, not yet yielded
        issued: collections.deque = collections.deque(maxlen=self.depth + 2)  # the prefetches not surely taken
        loader = iter(self.loader)
        try:
            while True:
                try:
                    batch = next(loader)
                except StopIteration:
                    break
                except Exception:  # the loader failed: the batches read ahead first, as a plain loop had them
                    while queue:
                        yield queue.pop(0)
                    raise
                wanted = {t: ids for t, ids in dict(self.ids_fn(batch)).items() if len(ids)}  # (a table it reads none)
                pending = self.client.prefetch_many(wanted, steps_ahead=self.depth + 1) if wanted else None
                if pending is not None:
                    issued.append(pending)
                    if self.depth == 0:
                        pending.result()
                queue.append(batch)
                if len(queue) > self.depth:
                    yield queue.pop(0)
            while queue:
                yield queue.pop(0)
        finally:  # (also when the loop over it stopped early: a prefetch never taken must not serve a later pull)
            for pending in issued:
                pending.forget()
            if self.client.pushes.parked:  # the last step's pushes waited for a prefetch that will not come
                self.client.pushes.send()
