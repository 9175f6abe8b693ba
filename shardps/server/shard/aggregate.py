"""Combining the gradients of one synchronous step from several workers.

Each worker contributes (ids, grads) with unique ids. Rows a worker did not
push count as a zero gradient from that worker, so "mean" over W workers of
per-worker mean gradients equals the gradient of the mean loss over all their
samples (one worker training on all batches together).
"""

from __future__ import annotations

import numpy as np

from shardps.core.ids import unique_ids


def stack(contributions: list[tuple[np.ndarray, np.ndarray]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Union of ids (sorted) and a [workers, len(union), dim] array of zero-filled gradients."""
    nonempty = [ids for ids, _ in contributions if ids.size]
    union = unique_ids(np.concatenate(nonempty)) if nonempty else np.zeros(0, dtype=np.int64)
    out = np.zeros((len(contributions), union.shape[0], dim), dtype=np.float32)
    for w, (ids, grads) in enumerate(contributions):
        if ids.size:
            out[w, np.searchsorted(union, ids)] = grads
    return union, out


def combine(stacked: np.ndarray, aggregator: str, trim_fraction: float = 0.0) -> np.ndarray:
    """Coordinate-wise combination over axis 0 (the workers)."""
    if aggregator == "sum":
        return stacked.sum(axis=0)
    if aggregator == "mean":
        return stacked.mean(axis=0, dtype=np.float32)
    if aggregator == "median":
        return np.median(stacked, axis=0).astype(np.float32)
    if aggregator == "trimmed_mean":
        w = stacked.shape[0]
        k = int(np.floor(trim_fraction * w))
        if k == 0:
            return stacked.mean(axis=0, dtype=np.float32)
        return np.sort(stacked, axis=0)[k : w - k].mean(axis=0, dtype=np.float32)
    raise ValueError(f"unknown aggregator {aggregator!r}")
