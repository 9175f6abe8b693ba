"""An optimizer-shaped wrapper for training through the shards.

``ShardedOptimizer`` keeps a model's dense parameters on the shards: it
registers them (the first worker's values win), pushes the gradients at
``step()`` and loads the latest values into the module at ``zero_grad()``
(they come back with the step's pushes: no pull call of their own). Sparse
rows of ``RemoteEmbedding`` modules are pushed by their own backward hooks,
so one training loop covers both::

    opt = ShardedOptimizer(client, model, optimizer=Adam(lr=1e-3))
    for x, y in loader:
        opt.zero_grad()                 # latest dense values loaded into model
        loss = loss_fn(model(x), y)
        loss.backward()                 # embedding rows pushed here
        opt.step()                      # dense gradients pushed; SSP clock advanced
"""

from __future__ import annotations

import collections
import logging
import zlib
from typing import Iterable, Optional, Union

import torch
from torch import nn

from shardps.core.optim import SGD, Optimizer
from shardps.core.specs import Staleness, SyncPolicy
from shardps_client.client import Client, DensePull, MiB, Versions
from shardps_client.collection_optim import is_table_slot
from shardps_client.errors import ShardpsError

log = logging.getLogger(__name__)


class ShardedOptimizer:
    """Dense parameters on the shards, with ``zero_grad()`` / ``step()`` like ``torch.optim``.

    Small parameters travel in buckets, as DistributedDataParallel buckets its
    gradients: in order, parameters of up to ``bucket_bytes`` together are kept on
    the shards as one flat tensor, pulled and pushed as one. Every optimizer here is
    elementwise, so a bucket steps exactly as its parameters would one by one; it
    saves a message entry, an encode and a decode per parameter per step (the
    DLRM example's 8 MLP tensors went from 8 to 1 entry). A parameter that gets
    no gradient in a step while others in its bucket do is sent a zero gradient
    (with momentum or Adam it still moves; torch.optim would skip it): a warning
    says so once; ``bucket_bytes=0`` keeps every parameter apart.

    Args:
        client: a connected ``Client``.
        params: a module (its named parameters) or an iterable of (name, parameter).
        optimizer: the server-side optimizer of every dense tensor.
        prefix: prepended to parameter names to form tensor names on the shards.
        staleness: staleness policy of the dense tensors.
        sync: synchronous training policy (None: asynchronous).
        chunk_bytes: tensors larger than this are split across shards.
        bucket_bytes: parameters up to this size share flat tensors of up to this size
            (0: one tensor per parameter).
        dense_lag: steps the dense values may lag behind. 0 (the default): ``zero_grad()``
            waits for the values the last step's pushes bring back. 1: when those have
            not arrived yet, it goes on with the ones the step before brought, one step
            staler, as ``Prefetcher``'s rows are (asynchronous training only).
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
        bucket_bytes: int = 256 * 1024,
        dense_lag: int = 0,
    ) -> None:
        if dense_lag < 0:
            raise ValueError(f"dense_lag must be >= 0, got {dense_lag}")
        if dense_lag and (sync is not None or client.ssp_bound is not None):
            raise ValueError("dense_lag needs asynchronous training: synchronous steps and ssp_bound "
                             "bound staleness themselves")
        self.client = client
        self.dense_lag = dense_lag
        # Pushes of a step (embedding rows from backward hooks, dense gradients) go out
        # together at step(): one PushBatch per shard instead of one call per tensor.
        self._pushes = client.hold_pushes(step=True)  # (a table pushed twice in a step: one step of the sum)
        named = list(params.named_parameters() if isinstance(params, nn.Module) else params)
        if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in named):
            raise TypeError("ShardedOptimizer takes the module, or its named_parameters() (the names key the dense "
                            "tensors on the shards), not parameters alone")
        # (a collection's table placeholders hold no values: the tables are the shards' already)
        self.params = {prefix + name: p for name, p in named if p.requires_grad and not is_table_slot(p)}
        #: tensor name on the shards -> the parameters it holds (one, or a bucket's in order).
        self.tensors = _buckets(self.params, prefix, bucket_bytes)
        self._versions: dict[str, Versions] = {}
        self._warned_partial = False
        self._steps = 0  # step() calls so far
        self._stepped = False  # a step() since the last zero_grad()
        self._loaded = 0  # the values in the parameters include the pushes of steps 1.._loaded
        # (step, values coming back with its pushes), oldest first, not yet loaded.
        self._returning: collections.deque[tuple[int, DensePull]] = collections.deque()
        for name, members in self.tensors.items():
            value = _flat([self.params[m] for m in members]) if _is_bucket(name) else self.params[name].detach()
            client.register_dense(name, value, optimizer=optimizer or SGD(), staleness=staleness, sync=sync,
                                  chunk_bytes=chunk_bytes)
        self.pull()

    def pull(self) -> None:
        """Copy the shards' current values into the parameters."""
        self._returning.clear()
        self._load(self.client.pull_dense_many(list(self.tensors)))
        self._loaded = self._steps

    def _load(self, values: dict[str, tuple[torch.Tensor, Versions]]) -> None:
        with torch.no_grad():
            for name, (value, versions) in values.items():
                self._versions[name] = versions
                flat = value.reshape(-1)
                offset = 0
                for member in self.tensors[name]:
                    p = self.params[member]
                    n = p.numel()
                    p.copy_(flat[offset : offset + n].to(p.device).view_as(p))
                    offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and load the latest dense values (start of a step).

        After a ``step()`` the values come back with its pushes, read by each
        shard once they were applied (with ``dense_lag``, the newest of those
        already back may do); otherwise, and if those pushes failed, they are
        pulled.
        """
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        if not self._stepped:  # no step since the last zero_grad(): nothing came back, pull
            self.pull()
            return
        self._stepped = False
        try:
            back = [k for k, (_, r) in enumerate(self._returning) if r.done()]
            if back:  # the newest values already back (older ones are superseded)
                for _ in range(back[-1]):
                    self._returning.popleft()
                self._load_returned()
            need = self._steps - self.dense_lag  # the values must include the pushes of this step
            while self._returning and self._loaded < need:
                if self._returning[0][0] < need:
                    self._returning.popleft()  # too old to do
                else:
                    self._load_returned()  # waits for them
        except ShardpsError as e:  # the push's own error is raised by flush()
            log.debug("dense values did not come back with the pushes (%s); pulling them", e)
            self.pull()
        if self._loaded < self._steps - self.dense_lag:
            self.pull()

    def _load_returned(self) -> None:
        step, returning = self._returning.popleft()
        self._load(returning.result())
        self._loaded = step

    def step(self) -> None:
        """Send this step's gradients (asynchronously, one batch per shard) and advance the clock. In a loop fed by a
        ``Prefetcher`` the batch waits for the prefetch that follows, whose pulls travel with it
        (``PushPipeline.park``): one call a shard a step."""
        for name, members in self.tensors.items():
            grads = [self.params[m].grad for m in members]
            if all(g is None for g in grads):
                continue
            if not _is_bucket(name):
                assert grads[0] is not None  # the only member, and not all are None
                self.client.push_dense(name, grads[0], versions=self._versions.get(name))
                continue
            missing = [m for m, g in zip(members, grads) if g is None]
            if missing and not self._warned_partial:
                self._warned_partial = True
                log.warning("%s got no gradient this step while others in their bucket did: they are sent zeros "
                            "(with momentum or Adam they still move); bucket_bytes=0 keeps parameters apart", missing)
            flat = _flat([g if g is not None else torch.zeros_like(self.params[m])
                          for m, g in zip(members, grads)])
            self.client.push_dense(name, flat, versions=self._versions.get(name))
        # The new values come back with the pushes, for the next zero_grad(); under bounded
        # staleness (ssp_bound) that pull must wait for slow workers first, so it stays a pull.
        names = list(self.tensors) if self.client.ssp_bound is None else []
        # Parked: a prefetch of the next batch (``Prefetcher``) carries them in the same call per shard; else they
        # go at the next zero_grad() (whose values come back with them), pull, push or flush(). Not under bounded
        # staleness, where the clock this step advances tells other workers its pushes are out.
        returning = self._pushes.send(pull_dense=names, park=self.client.ssp_bound is None)
        self._steps += 1
        self._stepped = True
        if returning is not None:
            self._returning.append((self._steps, returning))
        self.client.advance_clock()

    def flush(self) -> None:
        self.client.flush()


_BUCKET = ":bucket"  # parameter names hold no ":"


def _is_bucket(name: str) -> bool:
    return _BUCKET in name


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def _buckets(params: dict[str, nn.Parameter], prefix: str, bucket_bytes: int) -> dict[str, list[str]]:
    """Shard tensor names -> parameter names: small parameters grouped in order, large ones alone.

    A bucket's name carries a checksum of its layout (names and shapes), so a model
    that changed never reads another layout's values.
    """
    out: dict[str, list[str]] = {}
    group: list[str] = []
    size = 0

    def close() -> None:
        nonlocal group, size
        if len(group) == 1:
            out[group[0]] = group
        elif group:
            layout = ";".join(f"{m}:{tuple(params[m].shape)}" for m in group).encode()
            out[f"{prefix}{_BUCKET}{len(out)}.{zlib.crc32(layout):08x}"] = group
        group, size = [], 0

    for name, p in params.items():
        nbytes = p.numel() * 4
        if nbytes > bucket_bytes:
            close()
            out[name] = [name]
            continue
        if size + nbytes > bucket_bytes:
            close()
        group.append(name)
        size += nbytes
    close()
    return out
