"""Training pipelined by default, in TorchRec's shape: ``TrainPipeline(model, optimizer).progress(batches)`` runs one
step (zero_grad, forward, backward, step) on the next batch while the rows of the batch after it are pulled.

TorchRec users wrap their model in ``TrainPipelineSparseDist`` and call ``progress(dataloader_iter)`` once per step;
the same loop works here. The rows of batch i+1 are asked for (one round trip per shard, every table at once) when
batch i starts, so the step never waits for a pull that could have been sent earlier. Those rows were read before
batch i's pushes: one step staler, as the shards see through the versions (``Prefetcher``). ``depth=0`` is the exact
mode: each batch's rows are pulled just before its step, after the previous step's pushes (read your writes; bit for
bit what local SGD gives, which the tests check).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from shardps_client.client import Client
from shardps_client.prefetch import Prefetcher

IdsFn = Callable[[Any], Mapping[str, torch.Tensor]]


def _is_kjt(x: Any) -> bool:
    return all(callable(getattr(x, name, None)) for name in ("keys", "values", "lengths")) and not isinstance(x, dict)


def _kjts(batch: Any) -> list[Any]:
    """The KeyedJaggedTensors a batch holds (itself, or in a tuple, list or dict, one level down)."""
    if _is_kjt(batch):
        return [batch]
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    return [x for x in items if _is_kjt(x)]


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class TrainPipeline:
    """One training step per ``progress`` call, the next batch's rows pulled meanwhile.

    Args:
        model: called on a batch (``model(*batch)`` for a tuple, ``model(**batch)`` for a dict, ``model(batch)``
            otherwise, or ``forward(model, batch)``); returns the loss, or a tuple whose first item is the loss
            (TorchRec's ``DLRMTrain`` shape), or outputs that ``loss_fn(outputs, batch)`` turns into the loss.
        optimizer: a ``ShardedOptimizer``, a ``torch.optim`` optimizer, or several (each is zeroed and stepped).
        client: the client (default: the one the model's shardps modules use).
        ids_fn: ``batch -> {table: ids}``, the rows the step will look up. Default: a model holding one
            ``RemoteEmbeddingBagCollection`` (or ``RemoteEmbeddingCollection``) reads them off the batch's
            ``KeyedJaggedTensor`` (``ids_of``, whose plan the forward then reuses). Models of ``RemoteEmbedding``
            modules give it.
        depth: batches pulled ahead (1 by default; 0: exact, each batch pulled just before its step).
        loss_fn: ``(outputs, batch) -> loss`` when the model does not return its loss.
        forward: ``(model, batch) -> outputs`` when the model is called another way.
    """

    def __init__(self, model: nn.Module, optimizer: Union[Any, Sequence[Any]], client: Optional[Client] = None,
                 ids_fn: Optional[IdsFn] = None, depth: int = 1,
                 loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                 forward: Optional[Callable[[nn.Module, Any], Any]] = None) -> None:
        self.model = model
        self.optimizers: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        collections = [m for m in model.modules() if callable(getattr(m, "ids_of", None))]
        remote = [c for m in model.modules() if isinstance(c := getattr(m, "client", None), Client)]
        found = client if client is not None else (remote[0] if remote else None)
        if found is None:
            raise ValueError("TrainPipeline: give client= (the model holds no shardps module to take it from)")
        self.client: Client = found
        if ids_fn is None:
            if len(collections) != 1:
                raise ValueError(f"TrainPipeline: the model holds {len(collections)} shardps collections; give "
                                 "ids_fn=lambda batch: {table: ids} (the rows a step looks up) to pull them ahead")
            ids_fn = self._collection_ids(collections[0])
        self.ids_fn = ids_fn
        self.depth = max(0, depth)
        self.loss_fn = loss_fn
        self.forward = forward or _call
        self._source: Optional[Iterable] = None
        self._feed: Optional[Iterator[Any]] = None
        self.steps = 0

    @staticmethod
    def _collection_ids(collection: Any) -> IdsFn:
        def ids(batch: Any) -> Mapping[str, torch.Tensor]:
            found = _kjts(batch)
            if len(found) != 1:
                raise ValueError(f"TrainPipeline: a batch holds {len(found)} KeyedJaggedTensors; give ids_fn= to say "
                                 "which rows a step looks up")
            return collection.ids_of(found[0])
        return ids

    def progress(self, batches: Iterable) -> Any:
        """One step on the next batch of ``batches`` (the same iterator every call, as TorchRec's); what the model
        returned. StopIteration once they are all trained on."""
        if self._feed is None or batches is not self._source:
            self._source = batches
            self._feed = iter(Prefetcher(batches, self.client, self.ids_fn, depth=self.depth))
        try:
            batch = next(self._feed)
        except StopIteration:
            raise
        except Exception:  # the loader failed (its batches read ahead came first): a next call goes on after it
            self._feed = None
            raise
        for opt in self.optimizers:
            opt.zero_grad()
        out = self.forward(self.model, batch)
        loss = self.loss_fn(out, batch) if self.loss_fn is not None else (out[0] if isinstance(out, tuple) else out)
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        self.steps += 1
        return out

    def run(self, batches: Iterable) -> Iterator[Any]:
        """Every batch of ``batches`` trained on in turn; what the model returned for each."""
        it = iter(batches)
        while True:
            try:
                yield self.progress(it)
            except StopIteration:
                return

    def flush(self) -> None:
        """Wait for every push the steps made (each optimizer's ``flush`` where it has one)."""
        for opt in self.optimizers:
            if callable(getattr(opt, "flush", None)):
                opt.flush()
