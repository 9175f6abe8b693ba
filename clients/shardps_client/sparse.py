"""TorchRec's sparse containers for installs without torchrec: ``JaggedTensor``,
``KeyedJaggedTensor`` (a batch of variable-length id lists per feature) and ``KeyedTensor`` (pooled
embeddings of several features side by side).

The names, constructors and methods are TorchRec's (``torchrec.sparse.jagged_tensor``), so code written
for one runs on the other, and the collection modules (``shardps_client.collection``) read either through
the same methods: ``keys()``, ``values()``, ``lengths()``, ``offsets()``, ``weights_or_none()``.

Layout, as TorchRec's: ``lengths`` holds ``stride`` bag lengths per key, key after key; ``values`` the
ids of those bags in the same order.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.reshape(-1), 0, out=out[1:])
    return out


class _Bags:
    """Values of bags end to end, a weight per value or none, and the bags' lengths (or offsets)."""

    def __init__(self, values: torch.Tensor, weights: Optional[torch.Tensor], lengths: Optional[torch.Tensor],
                 offsets: Optional[torch.Tensor]) -> None:
        if lengths is None and offsets is None:
            raise ValueError(f"{type(self).__name__} needs lengths or offsets")
        self._values = values
        self._weights = weights
        self._lengths = lengths if lengths is not None else torch.diff(offsets)  # type: ignore[arg-type]
        self._offsets = offsets

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError(f"this {type(self).__name__} has no weights")
        return self._weights

    def weights_or_none(self) -> Optional[torch.Tensor]:
        return self._weights

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = _offsets(self._lengths)
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device

    def _moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        """The constructor's tensor arguments, each moved by ``move``."""
        return dict(values=move(self._values), weights=move(self._weights) if self._weights is not None else None,
                    lengths=move(self._lengths), offsets=move(self._offsets) if self._offsets is not None else None)


class JaggedTensor(_Bags):
    """Bags of values for one feature: ``values`` of the bags end to end, ``lengths`` per bag."""

    def __init__(self, values: torch.Tensor, weights: Optional[torch.Tensor] = None,
                 lengths: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None) -> None:
        super().__init__(values, weights, lengths, offsets)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        """A copy on ``device`` (TorchRec's ``JaggedTensor.to``)."""
        return JaggedTensor(**self._moved(lambda t: t.to(device, non_blocking=non_blocking)))

    def to_dense(self) -> list[torch.Tensor]:
        """The bags as a list of tensors."""
        return list(torch.split(self._values, self._lengths.tolist()))

    def __repr__(self) -> str:
        return f"JaggedTensor(values={self._values}, lengths={self._lengths})"


class KeyedJaggedTensor(_Bags):
    """A batch of bags for several features (``keys``), ``stride`` bags per feature.

    Args:
        keys: the feature names.
        values: every bag's ids, feature after feature, bag after bag.
        weights: a weight per value (weighted bags), or None.
        lengths: bag lengths, ``stride`` per key (``len(keys) * stride`` in all).
        offsets: instead of ``lengths``: ``len(lengths) + 1`` cumulative positions.
        stride: bags per key (the batch size); taken from ``lengths`` when not given.
    """

    def __init__(self, keys: Sequence[str], values: torch.Tensor, weights: Optional[torch.Tensor] = None,
                 lengths: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None,
                 stride: Optional[int] = None) -> None:
        super().__init__(values, weights, lengths, offsets)
        self._keys = list(keys)
        n = self._lengths.numel()
        if stride is None:
            stride = n // len(self._keys) if self._keys else 0
        self._stride = stride

    @staticmethod
    def from_lengths_sync(keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor,
                          weights: Optional[torch.Tensor] = None, stride: Optional[int] = None) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths, stride=stride)

    @staticmethod
    def from_offsets_sync(keys: Sequence[str], values: torch.Tensor, offsets: torch.Tensor,
                          weights: Optional[torch.Tensor] = None, stride: Optional[int] = None) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys, values, weights=weights, offsets=offsets, stride=stride)

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """One KeyedJaggedTensor of per-feature JaggedTensors (all with the same number of bags)."""
        keys = list(jt_dict)
        jts = [jt_dict[k] for k in keys]
        weighted = [jt.weights_or_none() is not None for jt in jts]
        if any(weighted) and not all(weighted):
            raise ValueError("either every JaggedTensor has weights or none has")
        return KeyedJaggedTensor(
            keys, torch.cat([jt.values() for jt in jts]) if jts else torch.zeros(0, dtype=torch.int64),
            weights=torch.cat([jt.weights() for jt in jts]) if jts and all(weighted) else None,
            lengths=torch.cat([jt.lengths() for jt in jts]) if jts else torch.zeros(0, dtype=torch.int64),
        )

    def keys(self) -> list[str]:
        return self._keys

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        """A copy on ``device`` (TorchRec's ``KeyedJaggedTensor.to``): a loader's CPU batch moved to the GPU."""
        return KeyedJaggedTensor(self._keys, stride=self._stride,
                                 **self._moved(lambda t: t.to(device, non_blocking=non_blocking)))

    def pin_memory(self) -> KeyedJaggedTensor:
        """A copy in page-locked memory, for a ``to(cuda, non_blocking=True)`` that overlaps compute."""
        return KeyedJaggedTensor(self._keys, stride=self._stride, **self._moved(lambda t: t.pin_memory()))

    def stride(self) -> int:
        return self._stride

    def length_per_key(self) -> list[int]:
        """Values per key."""
        if not self._keys:
            return []
        return self._lengths.reshape(len(self._keys), -1).sum(1).tolist()

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> JaggedTensor:
        i = _index(self._keys, key)
        start, end = self.offset_per_key()[i : i + 2]
        w = self._weights[start:end] if self._weights is not None else None
        return JaggedTensor(self._values[start:end], w, lengths=self._lengths[i * self._stride : (i + 1) * self._stride])

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self._keys}

    def __repr__(self) -> str:
        return f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}, values={self._values.numel()})"


class KeyedTensor:
    """Pooled embeddings of several features side by side along ``key_dim`` (TorchRec's ``KeyedTensor``).

    Args:
        keys: the feature names, in the order of their columns.
        length_per_key: each key's width (its embedding dim).
        values: ``[batch, sum(length_per_key)]`` (for ``key_dim=1``).
        key_dim: the dimension the keys are laid along.
    """

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor,
                 key_dim: int = 1) -> None:
        self._keys = list(keys)
        self._length_per_key = list(length_per_key)
        self._values = values
        self._key_dim = key_dim

    @staticmethod
    def from_tensor_list(keys: Sequence[str], tensors: Sequence[torch.Tensor], key_dim: int = 1) -> KeyedTensor:
        return KeyedTensor(keys, [t.shape[key_dim] for t in tensors], torch.cat(list(tensors), dim=key_dim), key_dim)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        return KeyedTensor(self._keys, self._length_per_key, self._values.to(device, non_blocking=non_blocking),
                           self._key_dim)

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self._length_per_key:
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> torch.Tensor:
        i = _index(self._keys, key)
        start, end = self.offset_per_key()[i : i + 2]
        return self._values.narrow(self._key_dim, start, end - start)

    def to_dict(self) -> dict[str, torch.Tensor]:
        parts = torch.split(self._values, self._length_per_key, dim=self._key_dim)
        return dict(zip(self._keys, parts))

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key})"


def _index(keys: list[str], key: str) -> int:
    """Where ``key`` is among ``keys``: KeyError naming it when it is not (as TorchRec's containers raise)."""
    try:
        return keys.index(key)
    except ValueError:
        raise KeyError(f"{key!r} is not a key of this container (keys: {keys})") from None
