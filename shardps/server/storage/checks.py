"""A request's ids and gradients checked against a table before anything is read or applied: shape,
range, ownership, finiteness. Plain functions; the errors name the table and the offending value."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from shardps.core.codec import all_finite
from shardps.core.errors import InvalidArgument, OutOfRange, WrongShard


def ids(table: str, what: str, num_embeddings: Optional[int], owns: Callable[[np.ndarray], np.ndarray],
        values: np.ndarray) -> None:
    """Raise unless ``values`` is a non-empty 1-D int64 array of ids (``what``: "ids", or "rows" of a dense
    tensor) in [0, num_embeddings) (when bounded) that this shard ``owns``."""
    if values.ndim != 1:
        raise InvalidArgument(f"{table}: {what} must be 1-D, got shape {list(values.shape)}")
    if values.shape[0] == 0:
        raise InvalidArgument(f"{table}: request has no {what}")
    all_in = getattr(owns, "all_in", None)  # the common case in one compiled pass (``shard.slots.Owns``)
    if all_in is not None and all_in(values, num_embeddings):
        return
    if num_embeddings is not None:
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= num_embeddings:
            raise OutOfRange(f"{table}: id {lo if lo < 0 else hi} out of range [0, {num_embeddings})")
    owned = owns(values)
    if not owned.all():
        refuse = getattr(owns, "refuse", None)  # the shard's slot ownership names the owner (``shard.slots.Owns``)
        if refuse is not None:
            raise refuse(values)
        raise WrongShard(f"{table}: id {int(values[np.argmin(owned)])} is not owned by this shard")


def grads(table: str, dim: int, allow_nonfinite: bool, ids: np.ndarray, values: np.ndarray) -> None:
    """Raise unless ``values`` has shape [len(ids), dim] and, unless ``allow_nonfinite``, no NaN or Inf."""
    if values.shape != (ids.shape[0], dim):
        raise InvalidArgument(
            f"{table}: grads must have shape [{ids.shape[0]}, {dim}] (ids x dim), got {list(values.shape)}"
        )
    if not allow_nonfinite and not all_finite(values):
        raise InvalidArgument(f"{table}: gradient contains NaN or Inf; push rejected")
