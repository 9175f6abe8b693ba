"""User inputs (tensors, arrays, lists) as checked numpy arrays, and the wire dtype by name."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from shardps.core.codec import all_finite
from shardps.core.ids import is_sorted_unique
from shardps.core.specs import TableSpec
from shardps_client import planner
from shardps_client.errors import IdOutOfRangeError, InvalidArgumentError

MiB = 1 << 20
# The smallest float32 magnitude a narrow wire dtype carries as inf (the cast rounds to nearest): 65520 for float16;
# 0x7F7F8000 as float32 bits (about 3.3962e38) for bfloat16.
WIRE_INF = {planner.WIRE["float16"]: 65520.0,
            planner.WIRE["bfloat16"]: float(np.array([0x7F7F8000], np.uint32).view(np.float32)[0])}
IdsLike = Union[torch.Tensor, np.ndarray, Sequence[int]]


def wire_code(wire_dtype: str) -> int:
    """The wire dtype code of ``wire_dtype`` ("float32", "float16" or "bfloat16")."""
    if wire_dtype not in planner.WIRE:
        raise InvalidArgumentError(f"wire_dtype must be one of {sorted(planner.WIRE)}, got {wire_dtype!r}")
    return planner.WIRE[wire_dtype]


def check_sent(values: np.ndarray, name: str, wire: int, allow_nonfinite: bool, summed: bool = False) -> None:
    """Refuse gradients, finite as given, that would reach the shards non-finite: past float32's range once the
    gradients of duplicate ids are ``summed``, or past a narrow ``wire`` dtype's (sent as inf). The shards would
    refuse them only after the others applied their parts of the push."""
    if allow_nonfinite or not values.size:
        return
    if summed and not all_finite(values):
        raise InvalidArgumentError(f"{name}: the gradients of a repeated id sum past float32's range (to inf); push "
                                   "rejected, nothing sent")
    inf = WIRE_INF.get(wire)
    if inf is not None:
        top = float(np.abs(values).max())  # (a pass over the gradients, for a narrow wire dtype only)
        if not top < inf:
            dtype = next(n for n, code in planner.WIRE.items() if code == wire)
            raise InvalidArgumentError(f"{name}: a gradient of {top:.5g} is past {dtype}'s range: "
                                       f"wire_dtype={dtype!r} would send it as inf; push rejected, nothing sent "
                                       "(push it as float32)")


def check_client_options(addresses: Any, timeout: float, retry_timeout: float, max_message_bytes: int,
                         max_inflight_pushes: int, heartbeat_s: float) -> None:
    """Refuse ``Client`` options that would misbehave later rather than fail now: a string of addresses (read one
    character an address), a timeout that is not a positive number of seconds (inf or 0: every call failed at once),
    no pushes in flight (the first push waited forever), a heartbeat of 0 (a busy loop)."""
    if isinstance(addresses, (str, bytes)):
        raise InvalidArgumentError(f"addresses must be a list of 'host:port' strings, got the string {addresses!r} "
                                   f"(Client([{addresses!r}]) for one shard)")
    for what, value, zero in (("timeout", timeout, False), ("retry_timeout", retry_timeout, True),
                              ("heartbeat_s", heartbeat_s, False)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 or zero and value == 0)):
            raise InvalidArgumentError(f"{what} must be a finite number of seconds, {'>= 0' if zero else '> 0'}, "
                                       f"got {value!r}")
    if not (isinstance(max_message_bytes, int) and 1 <= max_message_bytes < 2**31):  # (gRPC's sizes are 32 bits)
        raise InvalidArgumentError(f"max_message_bytes must be an int in [1, 2**31), got {max_message_bytes!r}")
    if not (isinstance(max_inflight_pushes, int) and max_inflight_pushes >= 1):
        raise InvalidArgumentError(f"max_inflight_pushes must be an int >= 1, got {max_inflight_pushes!r}")


def names(value: Any, what: str) -> list[str]:
    """A list of table or tensor names from ``value`` (any sequence of names; a lone string is refused, not read one
    character a name)."""
    if isinstance(value, (str, bytes)):
        raise InvalidArgumentError(f"{what} must be a list of names, got the string {value!r} ([{value!r}] for one)")
    return list(value)


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
        raise InvalidArgumentError(f"{name}: gradient contains NaN or Inf; push rejected" if noun != "weight" else
                                   f"{name}: weight contains NaN or Inf; nothing loaded")
