"""PyTorch modules whose weights live on the shards.

``RemoteEmbedding`` and ``RemoteEmbeddingBag`` take exactly the inputs of
``torch.nn.Embedding`` / ``torch.nn.EmbeddingBag`` and compute the same outputs
and gradients as those modules holding the same weights. Forward pulls each
unique id once into a small local weight (on the module's device) and runs the
stock ``F.embedding`` / ``F.embedding_bag`` on it; a hook on that weight pushes
the coalesced row gradients to the shards during backward, asynchronously (a
fused optimizer: the server applies the update). ``client.flush()`` waits.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shardps_client.client import Client, Versions
from shardps_client.collection import (  # noqa: F401 - the collection modules are part of this module's API
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    RemoteEmbeddingBagCollection,
    RemoteEmbeddingCollection,
)


class _RemoteRows(nn.Module):
    def __init__(self, client: Client, table: str, device: Any, padding_idx: Optional[int], wire_dtype: Optional[str]) -> None:
        super().__init__()
        spec = client.table_spec(table)
        self.client = client
        self.table = table
        self.num_embeddings = spec.num_embeddings
        self.embedding_dim = spec.dim
        self.device = torch.device(device) if device is not None else None
        self.wire_dtype = wire_dtype
        if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral)):
            raise TypeError(f"padding_idx must be an int, got {padding_idx!r}")  # (as torch's modules refuse it)
        padding_idx = int(padding_idx) if padding_idx is not None else None
        if padding_idx is not None and padding_idx < 0:
            if self.num_embeddings is None:
                raise ValueError("a negative padding_idx needs a table with num_embeddings")
            padding_idx += self.num_embeddings
        if padding_idx is not None and self.num_embeddings is not None and not 0 <= padding_idx < self.num_embeddings:
            raise ValueError(f"padding_idx must be within num_embeddings {self.num_embeddings}, got {padding_idx}")
        self.padding_idx = padding_idx
        self.last_versions: Optional[Versions] = None

    def _local(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[int]]:
        """Pull the unique rows of ``input``: (local weight, local indices shaped like input, local padding idx)."""
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{type(self).__name__} expects an int64 or int32 input, got {input.dtype}")
        device = self.device if self.device is not None else input.device
        if input.numel() == 0:
            weight = torch.zeros(0, self.embedding_dim, device=device)
            return weight, input.to(device), None
        uniq, inverse = torch.unique(input.detach().reshape(-1).cpu(), sorted=True, return_inverse=True)
        rows, versions = self.client.pull_with_version(self.table, uniq, device=device, wire_dtype=self.wire_dtype)
        self.last_versions = versions
        local_pad = None
        if self.padding_idx is not None:
            hit = (uniq == self.padding_idx).nonzero()
            local_pad = int(hit[0, 0]) if hit.numel() else None
        weight = rows
        if torch.is_grad_enabled():
            weight.requires_grad_(True)
            weight.register_hook(self._pusher(uniq, versions, local_pad))
        return weight, inverse.reshape(input.shape).to(device), local_pad

    def _pusher(self, uniq: torch.Tensor, versions: Versions, local_pad: Optional[int]):
        def push(grad: torch.Tensor) -> None:
            ids, g = uniq, grad
            if local_pad is not None:  # as torch's sparse gradients: the padding row gets none
                keep = torch.ones(uniq.numel(), dtype=torch.bool)
                keep[local_pad] = False
                ids, g = uniq[keep], grad[keep.to(grad.device)]
            if ids.numel():
                self.client.push(self.table, ids, g, versions=versions, wire_dtype=self.wire_dtype)
            elif self.client.table_spec(self.table).sync is not None:
                self.client.push(self.table, ids, g, versions=versions, wire_dtype=self.wire_dtype)

        return push

    def extra_repr(self) -> str:
        return f"table={self.table!r}, num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class RemoteEmbedding(_RemoteRows):
    """``torch.nn.Embedding`` over a shardps table.

    Args:
        client: a connected ``Client``.
        table: name of an existing table (create it with ``client.create_table``).
        device: where outputs live (default: the input's device); CPU or CUDA.
        padding_idx: as in ``torch.nn.Embedding``: that row receives no gradient.
        wire_dtype: "float32" (default of the client), "float16" or "bfloat16" for pulls and pushes.
    """

    def __init__(self, client: Client, table: str, device: Any = None, padding_idx: Optional[int] = None,
                 wire_dtype: Optional[str] = None) -> None:
        super().__init__(client, table, device, padding_idx, wire_dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, local, local_pad = self._local(input)
        out = F.embedding(local, weight, padding_idx=local_pad)
        out.shardps_versions = self.last_versions  # type: ignore[attr-defined]
        return out


class RemoteEmbeddingBag(_RemoteRows):
    """``torch.nn.EmbeddingBag`` over a shardps table.

    Args:
        client: a connected ``Client``.
        table: name of an existing table.
        mode: "sum", "mean" or "max".
        device: where outputs live (default: the input's device).
        padding_idx: entries equal to it are excluded from bags and get no gradient.
        include_last_offset: as in ``torch.nn.EmbeddingBag``.
        wire_dtype: "float32", "float16" or "bfloat16" for pulls and pushes.
    """

    def __init__(self, client: Client, table: str, mode: str = "mean", device: Any = None,
                 padding_idx: Optional[int] = None, include_last_offset: bool = False,
                 wire_dtype: Optional[str] = None) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be sum, mean or max, got {mode!r}")
        super().__init__(client, table, device, padding_idx, wire_dtype)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.include_last_offset and offsets is not None and input.dim() == 1 and (
                offsets.numel() == 0 or int(offsets[-1]) != input.numel()):  # (torch does not check; see below)
            raise ValueError(f"{self.table}: with include_last_offset the last offset must be the number of ids "
                             f"({input.numel()}), got {offsets[-1:].tolist()}: ids past it are in no bag, and torch's "
                             "backward gives them gradients of uninitialised memory (which a push would apply)")
        weight, local, local_pad = self._local(input)
        device = weight.device
        out = F.embedding_bag(
            local, weight, offsets.to(device) if offsets is not None else None, mode=self.mode,
            per_sample_weights=per_sample_weights.to(device) if per_sample_weights is not None else None,
            include_last_offset=self.include_last_offset, padding_idx=local_pad,
        )
        out.shardps_versions = self.last_versions  # type: ignore[attr-defined]
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"
