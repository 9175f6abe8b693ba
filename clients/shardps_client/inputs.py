"""User inputs (tensors, arrays, lists) as checked numpy arrays, and the wire dtype by name."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch

from shardps.core.codec import all_finite
from shardps.core.ids import is_sorted_unique
from shardps.core.specs import TableSpec
from shardps_client import planner
from shardps_client.errors import IdOutOfRangeError, InvalidArgumentError

MiB = 1 << 20
IdsLike = Union[torch.Tensor, np.ndarray, Sequence[int]]


def wire_code(wire_dtype: str) -> int:
    """The wire dtype code of ``wire_dtype`` ("float32", "float16" or "bfloat16")."""
    if wire_dtype not in planner.WIRE:
        raise InvalidArgumentError(f"wire_dtype must be one of {sorted(planner.WIRE)}, got {wire_dtype!r}")
    return planner.WIRE[wire_dtype]


def ids_to_numpy(ids: IdsLike) -> np.ndarray:
    """Ids as an int64 array (integer tensors and arrays only)."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(f"ids must be an integer tensor (int64 or int32), got {ids.dtype}")
        return ids.detach().to("cpu", torch.int64).numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"ids must be integers, got {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 2**63:
        raise IdOutOfRangeError("ids must fit in int64")
    return arr.astype(np.int64, copy=False)


def checked_ids(spec: TableSpec, ids: IdsLike) -> np.ndarray:
    """Ids of a request to table ``spec``: not empty, and within num_embeddings when the table has one."""
    return checked_ids_in_order(spec, ids)[0]


def checked_ids_in_order(spec: TableSpec, ids: IdsLike) -> tuple[np.ndarray, bool]:
    """``checked_ids``, and whether the ids (flattened) are sorted and unique (a collection's, a prefetch's): their
    range is then read off their ends, and they need no deduplication."""
    ids_np = ids_to_numpy(ids)
    if ids_np.size == 0:
        raise InvalidArgumentError(f"{spec.name}: request has no ids")
    flat = ids_np.reshape(-1)
    ordered = is_sorted_unique(flat)
    if spec.num_embeddings is not None:
        lo, hi = (int(flat[0]), int(flat[-1])) if ordered else (int(flat.min()), int(flat.max()))
        if lo < 0 or hi >= spec.num_embeddings:
            raise IdOutOfRangeError(
                f"{spec.name}: id {lo if lo < 0 else hi} out of range [0, {spec.num_embeddings})"
            )
    return ids_np, ordered


def grads_to_numpy(g: Union[torch.Tensor, np.ndarray], what: str) -> np.ndarray:
    """Gradients (or values) as a float32 array (floating-point tensors and arrays only)."""
    if isinstance(g, torch.Tensor):
        if not g.is_floating_point():
            raise InvalidArgumentError(f"{what} must be a floating-point tensor, got {g.dtype}")
        return g.detach().to("cpu", torch.float32).numpy()
    arr = np.asarray(g)
    if arr.dtype.kind != "f":
        raise InvalidArgumentError(f"{what} must be floating point, got {arr.dtype}")
    return arr.astype(np.float32, copy=False)


def check_grads(arr: np.ndarray, name: str, noun: str, shape: tuple, shape_words: Optional[str],
                allow_nonfinite: bool) -> None:
    """Refuse gradients not of ``shape``, or not finite unless the table allows it."""
    if tuple(arr.shape) != tuple(shape):
        words = f" ({shape_words})" if shape_words else ""
        raise InvalidArgumentError(f"{name}: {noun} must have shape {list(shape)}{words}, got {list(arr.shape)}")
    if not allow_nonfinite and not all_finite(arr):
        raise InvalidArgumentError(f"{name}: gradient contains NaN or Inf; push rejected")
