"""An optimizer-shaped wrapper for training through the shards.

``ShardedOptimizer`` keeps a model's dense parameters on the shards: it
registers them (the first worker's values win), pulls the latest values into
the module at ``zero_grad()``, and pushes the gradients at ``step()``. Sparse
rows of ``RemoteEmbedding`` modules are pushed by their own backward hooks,
so one training loop covers both::

    opt = ShardedOptimizer(client, model, optimizer=Adam(lr=1e-3))
    for x, y in loader:
        opt.zero_grad()                 # latest dense values pulled into model
        loss = loss_fn(model(x), y)
        loss.backward()                 # embedding rows pushed here
        opt.step()                      # dense gradients pushed; SSP clock advanced
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch import nn

from shardps.optim import SGD, Optimizer
from shardps.specs import Staleness, SyncPolicy
from shardps_client.client import Client, MiB, Versions


class ShardedOptimizer:
    """Dense parameters on the shards, with ``zero_grad()`` / ``step()`` like ``torch.optim``.

    Args:
        client: a connected ``Client``.
        params: a module (its named parameters) or an iterable of (name, parameter).
        optimizer: the server-side optimizer of every dense tensor.
        prefix: prepended to parameter names to form tensor names on the shards.
        staleness: staleness policy of the dense tensors.
        sync: synchronous training policy (None: asynchronous).
        chunk_bytes: tensors larger than this are split across shards.
    """

    def __init__(
        self,
        client: Client,
        params: Union[nn.Module, Iterable[tuple[str, nn.Parameter]]],
        optimizer: Optional[Optimizer] = None,
        prefix: str = "",
        staleness: Optional[Staleness] = None,
        sync: Optional[SyncPolicy] = None,
        chunk_bytes: int = 1 * MiB,
    ) -> None:
        self.client = client
        # Pushes of a step (embedding rows from backward hooks, dense gradients) go out
        # together at step(): one PushBatch per shard instead of one call per tensor.
        client.defer_pushes = True
        named = list(params.named_parameters() if isinstance(params, nn.Module) else params)
        self.params = {prefix + name: p for name, p in named if p.requires_grad}
        self._versions: dict[str, Versions] = {}
        for name, p in self.params.items():
            client.register_dense(name, p.detach(), optimizer=optimizer or SGD(), staleness=staleness, sync=sync,
                                  chunk_bytes=chunk_bytes)
        self.pull()

    def pull(self) -> None:
        """Copy the shards' current values into the parameters."""
        values = self.client.pull_dense_many(list(self.params))
        with torch.no_grad():
            for name, (value, versions) in values.items():
                p = self.params[name]
                p.copy_(value.to(p.device).view_as(p))
                self._versions[name] = versions

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and pull the latest dense values (start of a step)."""
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.pull()

    def step(self) -> None:
        """Send this step's gradients (asynchronously, one batch per shard) and advance the clock."""
        for name, p in self.params.items():
            if p.grad is not None:
                self.client.push_dense(name, p.grad, versions=self._versions.get(name))
        self.client.send_pushes()
        self.client.advance_clock()

    def flush(self) -> None:
        self.client.flush()
