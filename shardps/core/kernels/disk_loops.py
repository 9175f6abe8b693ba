"""The disk tier's kernels (``shardps.core.kernels.loops`` imports them, so ``EXPORTS`` and callers find them there):
reads of cold rows by ``pread``, sampled victims, and rows copied into and out of records by ``memcpy``."""

from __future__ import annotations

import numpy as np
from numba import types

from shardps.core.kernels.common import kernel as _njit
from shardps.core.kernels.common import mix
from shardps.core.kernels.constants import SPLITMIX_GOLDEN as _GOLDEN
from shardps.core.kernels.constants import VICTIM_DRAWS

_S32 = np.uint64(32)


# ---- the disk tier's reads ------------------------------------------------------------------

# libc's pread, by name: the compiled code calls the symbol the process (or the ahead-of-time module) links against.
_pread = types.ExternalFunction("pread", types.intp(types.intc, types.voidptr, types.uintp, types.int64))


@_njit
def pread_records(fds: np.ndarray, locs: np.ndarray, record: int, skip: int, size: int, out: np.ndarray) -> int:
    """``out[i * size:(i + 1) * size]`` = the ``size`` bytes at ``skip`` into record ``locs[i] & 0xFFFFFFFF`` (of
    ``record`` bytes) of the file ``fds[locs[i] >> 32]``, one pread each; how many were read in full (fewer: the
    first that was not). numpy: ``Segment.gather``'s gather from the file's mapping."""
    for i in range(locs.shape[0]):
        fd = fds[locs[i] >> 32]
        at = (locs[i] & 0xFFFFFFFF) * record + skip
        if _pread(fd, out[i * size:].ctypes.data, size, at) != size:  # type: ignore[call-overload]
            return i
    return locs.shape[0]


# ---- the disk tier's victims and records --------------------------------------------------------------------------


@_njit
def sample_victims(last: np.ndarray, touches: np.ndarray, count: int, sample: int, salt: np.uint64, seed: np.uint64,
                   protected_from: int, lfu: bool) -> np.ndarray:
    """``bounded.sampled_victims``: ``count`` victims among the ``last.shape[0]`` rows, each the best by (score,
    slot) of ``sample`` usable slots drawn by a hash of ``salt`` (of at most ``sample * VICTIM_DRAWS`` drawn; usable:
    ``last`` below ``protected_from``, not chosen already); fewer when a victim found none."""
    n = np.uint64(last.shape[0])
    base = salt << _S32
    bits = 4
    while (1 << bits) < 2 * count:
        bits += 1
    table = np.zeros(1 << bits, np.int64)  # chosen slots + 1, open addressing
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    out = np.empty(count, np.int64)
    d = np.uint64(0)
    got = 0
    for _ in range(count):
        best = np.int64(-1)
        best_key = np.int64(0)
        seen = 0
        for _draw in range(sample * VICTIM_DRAWS):
            c = np.int64(mix(d + base, seed) % n)
            d += np.uint64(1)
            lv = last[c]
            if lv >= protected_from:
                continue
            h = np.int64((np.uint64(c) * _GOLDEN) >> shift)
            while table[h] != 0 and table[h] != c + 1:
                h = (h + 1) & mask
            if table[h] != 0:
                continue
            key = lv
            if lfu:
                t = np.int64(min(touches[c], (1 << 22) - 1))
                key = (t << np.int64(40)) | (lv & np.int64((1 << 40) - 1))
            if best < 0 or key < best_key or (key == best_key and c < best):
                best, best_key = c, key
            seen += 1
            if seen == sample:
                break
        if best < 0:
            break
        h = np.int64((np.uint64(best) * _GOLDEN) >> shift)
        while table[h] != 0:
            h = (h + 1) & mask
        table[h] = best + 1
        out[got] = best
        got += 1
    return out[:got]


@_njit
def clock_victims(last: np.ndarray, count: int, protected_from: int, now: int, state: np.ndarray) -> np.ndarray:
    """``bounded.clock_victims_numpy``: up to ``count`` victims among the ``last.shape[0]`` rows by a hand going
    round them from ``state[0]``: a row is taken when its ``last`` use is below ``protected_from`` and below
    ``state[1]`` (the request at which the hand began its round; a new round begins at ``now``). Each row is
    looked at once at most; ``state`` is left at the hand's place and round."""
    n = last.shape[0]
    out = np.empty(max(count, 0), np.int64)
    if count <= 0:
        return out
    got = 0
    hand, lap = state[0], state[1]
    if hand >= n:
        hand, lap = 0, now
    start = hand
    while got < count:
        lv = last[hand]
        if lv < protected_from and lv < lap:
            out[got] = hand
            got += 1
        hand += 1
        if hand >= n:
            hand, lap = 0, now
        if hand == start:
            break
    state[0], state[1] = hand, lap
    return out[:got]


# libc's memcpy, by name as ``pread``: a row's words in one call ran 3x faster than numba's loop over them (a word
# at a time, not vectorised where source and destination might overlap).
_memcpy = types.ExternalFunction("memcpy", types.voidptr(types.voidptr, types.voidptr, types.uintp))


@_njit
def _c_words(a: np.ndarray) -> bool:
    """Whether a 2-D array of 4-byte words is in C order (numba's kernels take any layout; the ahead-of-time ones
    only this)."""
    return a.strides[1] == 4 and (a.shape[0] < 2 or a.strides[0] == a.shape[1] * 4)


@_njit
def gather_words(src: np.ndarray, first: int, width: int, idx: np.ndarray, dst: np.ndarray, at: int) -> None:
    """``dst[i, at:at + width] = src[idx[i], first:first + width]`` for 2-D uint32 arrays: a column of per-row
    arrays, viewed as 4-byte words, into records (``records.gather_columns``)."""
    if not (_c_words(src) and _c_words(dst)):
        for i in range(idx.shape[0]):
            dst[i, at:at + width] = src[idx[i], first:first + width]
        return
    sp, dp = src.ctypes.data, dst.ctypes.data  # type: ignore[attr-defined]
    s_row, d_row = src.shape[1] * 4, dst.shape[1] * 4
    for i in range(idx.shape[0]):
        _memcpy(dp + i * d_row + at * 4, sp + idx[i] * s_row + first * 4, width * 4)  # type: ignore[call-overload]


@_njit
def scatter_words(dst: np.ndarray, first: int, width: int, idx: np.ndarray, src: np.ndarray, at: int) -> None:
    """``dst[idx[i], first:first + width] = src[i, at:at + width]`` for 2-D uint32 arrays: a column of records into
    per-row arrays (``records.scatter_columns``)."""
    if not (_c_words(src) and _c_words(dst)):
        for i in range(idx.shape[0]):
            dst[idx[i], first:first + width] = src[i, at:at + width]
        return
    sp, dp = src.ctypes.data, dst.ctypes.data  # type: ignore[attr-defined]
    s_row, d_row = src.shape[1] * 4, dst.shape[1] * 4
    for i in range(idx.shape[0]):
        _memcpy(dp + idx[i] * d_row + first * 4, sp + i * s_row + at * 4, width * 4)  # type: ignore[call-overload]
