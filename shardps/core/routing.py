"""Placement of ids and dense tensors on shards.

Client and server import these functions, so both sides agree on who owns
what. The hash is fixed forever: changing it would silently move every row.
"""

from __future__ import annotations

import numpy as np

from shardps.core import kernels
from shardps.core.kernels.constants import SPLITMIX_GOLDEN, SPLITMIX_M1, SPLITMIX_M2

# splitmix64 finaliser constants (Steele, Lea & Flood, 2014); the kernels and the initializer's reference
# mix with them too.
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
# Distinguishes routing from the other uses of the mixer (initialisers, index).
ROUTING_SEED = np.uint64(0x5A17D5EED0000001)


def mix64(x: np.ndarray, seed: np.uint64 = ROUTING_SEED) -> np.ndarray:
    """splitmix64 of ``x ^ seed`` as uint64, vectorised; ``x`` is any int64/uint64 array."""
    z = np.asarray(x).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= seed
        z += SPLITMIX_GOLDEN
        z ^= z >> _S30
        z *= SPLITMIX_M1
        z ^= z >> _S27
        z *= SPLITMIX_M2
        z ^= z >> _S31
    return z


def shard_of_ids(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Index of the shard that owns each id (int64 array of the same shape)."""
    k = kernels.jit()
    if k is not None and num_shards >= 1 and isinstance(ids, np.ndarray) and ids.dtype == np.int64:
        return k.shard_of_ids(ids.reshape(-1), num_shards, ROUTING_SEED).reshape(ids.shape)
    return shard_of_ids_numpy(ids, num_shards)


def shard_of_ids_numpy(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The reference of :func:`shard_of_ids` (and of its kernel)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards == 1:
        return np.zeros(np.shape(ids), dtype=np.int64)
    # Multiply-shift on the high 32 bits: uniform and cheaper than a 64-bit modulo.
    hi = mix64(ids) >> np.uint64(32)
    return ((hi * np.uint64(num_shards)) >> np.uint64(32)).astype(np.int64)


NUM_SLOTS = 1 << 14  # hash slots: the top 14 bits of an id's routing hash
_SLOT_SHIFT = np.uint64(64 - 14)


def slot_of_ids(ids: np.ndarray) -> np.ndarray:
    """The hash slot (in [0, NUM_SLOTS)) of each id: the top bits of the same hash that places ids on shards, so
    with a power-of-two shard count a shard owns whole slots (``shard = slot * num_shards // NUM_SLOTS``)."""
    return (mix64(ids) >> _SLOT_SHIFT).astype(np.int64)


def name_hash(name: str) -> int:
    """A stable 64-bit hash of a string (FNV-1a, then mixed)."""
    h = 0xCBF29CE484222325
    for byte in name.encode("utf-8"):
        h ^= byte
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return int(mix64(np.array([h], dtype=np.uint64))[0])


def dense_chunk_owner(name: str, chunk: int, num_shards: int) -> int:
    """The shard that owns chunk ``chunk`` of dense tensor ``name``."""
    return (name_hash(name) + chunk) % num_shards


def dense_row_ranges(
    name: str, num_rows: int, chunk_rows: int, num_shards: int
) -> list[tuple[int, int, int]]:
    """Split rows [0, num_rows) of a dense tensor into (shard, start, end) chunks.

    ``chunk_rows == 0`` keeps the whole tensor on one shard.
    """
    if chunk_rows <= 0 or chunk_rows >= num_rows:
        return [(dense_chunk_owner(name, 0, num_shards), 0, num_rows)]
    out = []
    for k, start in enumerate(range(0, num_rows, chunk_rows)):
        out.append((dense_chunk_owner(name, k, num_shards), start, min(start + chunk_rows, num_rows)))
    return out


def dense_rows_owned(
    name: str, num_rows: int, chunk_rows: int, num_shards: int, shard_index: int
) -> np.ndarray:
    """Boolean mask over rows [0, num_rows): True where ``shard_index`` owns the row."""
    mask = np.zeros(num_rows, dtype=bool)
    for shard, start, end in dense_row_ranges(name, num_rows, chunk_rows, num_shards):
        if shard == shard_index:
            mask[start:end] = True
    return mask


def split_by_shard(ids: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """Group a 1-D id array by owning shard.

    Returns ``(order, bounds)``: ``ids[order[bounds[s]:bounds[s+1]]]`` are the ids
    of shard ``s``, in their original relative order.
    """
    k = kernels.jit()
    if k is not None and num_shards >= 1 and ids.dtype == np.int64 and ids.ndim == 1:
        return k.split_by_shard(ids, num_shards, ROUTING_SEED)
    return split_by_shard_numpy(ids, num_shards)


def split_by_shard_numpy(ids: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference of :func:`split_by_shard` (and of its kernel)."""
    owner = shard_of_ids_numpy(ids, num_shards)
    if num_shards <= 8:  # a few linear scans beat a sort
        groups = [np.flatnonzero(owner == s) for s in range(num_shards)]
        bounds = np.zeros(num_shards + 1, dtype=np.int64)
        np.cumsum([len(g) for g in groups], out=bounds[1:])
        return np.concatenate(groups), bounds
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(num_shards + 1))
    return order, bounds
