"""The compiled kernels against their plain-numpy references, bit for bit.

Each test runs the same public operation (routing, the hash index, a table's
pushes, the initializer, coalescing) twice, once with the numba kernels and
once with ``kernels.jit`` returning None (the references), and compares the
results with ``np.array_equal`` on the raw float32 bits.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Callable, Iterator

import numpy as np
import pytest

from shardps.core import kernels
from shardps.core.ids import coalesce
from shardps.core.kernels import loops
from shardps.core.optim import SGD, Adagrad, Adam
from shardps.core.routing import shard_of_ids, split_by_shard
from shardps.core.specs import Eviction, Initializer, TableSpec
from shardps.server.storage.index import HashIndex
from shardps.server.storage.table import Table


@contextlib.contextmanager
def _kernels(on: bool) -> Iterator[None]:
    saved = kernels.jit
    kernels.jit = (lambda: loops) if on else (lambda: None)  # type: ignore[assignment]
    try:
        yield
    finally:
        kernels.jit = saved  # type: ignore[assignment]


def both(fn: Callable[[], object]) -> tuple[object, object]:
    with _kernels(True):
        a = fn()
    with _kernels(False):
        b = fn()
    return a, b


def bits_equal(a: object, b: object) -> None:
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b)
        for x, y in zip(a, b):
            bits_equal(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            bits_equal(a[k], b[k])
    else:
        x, y = np.asarray(a), np.asarray(b)
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.dtype.kind == "f":  # the same bits: -0.0 against 0.0 and NaN payloads count
            x, y = x.view(np.dtype(f"u{x.itemsize}")), y.view(np.dtype(f"u{y.itemsize}"))
        np.testing.assert_array_equal(x, y)


def _ids(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.concatenate([rng.integers(-(2**63), 2**63 - 1, n // 2, dtype=np.int64),
                           rng.integers(0, 1000, n - n // 2, dtype=np.int64)])


@pytest.mark.parametrize("num_shards", [1, 2, 3, 8, 9, 17])
def test_routing(num_shards: int) -> None:
    ids = _ids(np.random.default_rng(num_shards), 5000)
    bits_equal(*both(lambda: shard_of_ids(ids, num_shards)))
    bits_equal(*both(lambda: shard_of_ids(ids.reshape(50, 100), num_shards)))
    bits_equal(*both(lambda: split_by_shard(ids, num_shards)))
    bits_equal(*both(lambda: split_by_shard(ids[:0], num_shards)))


def test_hash_index_lookups_agree_whichever_side_built_the_table() -> None:
    rng = np.random.default_rng(1)
    present = np.unique(_ids(rng, 30000))
    absent = np.setdiff1d(_ids(rng, 5000), present)
    indexes = {}
    for on in (True, False):
        with _kernels(on):
            idx = HashIndex(16)
            start = 0
            for part in np.array_split(rng.permutation(present), 7):  # several inserts, several rehashes
                idx.insert(part, np.arange(start, start + part.shape[0]))
                start += part.shape[0]
            indexes[on] = idx
    for built in (True, False):
        idx = indexes[built]
        probe = np.concatenate([present, absent, present[:100]])
        found, ref = both(lambda idx=idx, probe=probe: idx.lookup(probe))
        bits_equal(found, ref)
        assert (found[-100 - absent.shape[0] : -100] == -1).all()
        np.testing.assert_array_equal(idx.ids[found[: present.shape[0]]], present)


OPTIMIZERS = [
    SGD(lr=0.1),
    SGD(lr=0.05, momentum=0.9),
    SGD(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-4),
    Adagrad(lr=0.1),
    Adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.001, initial_accumulator_value=0.2),
    Adam(lr=0.01),
    Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: repr(o))
def test_table_pushes(opt: object) -> None:
    """Pushes with duplicate ids, new and old rows and staleness scales leave the same rows, state and steps."""

    def run() -> dict[str, np.ndarray]:
        rng = np.random.default_rng(7)
        spec = TableSpec(name="t", dim=5, num_embeddings=None, optimizer=opt,  # type: ignore[arg-type]
                         initializer=Initializer("normal", std=0.1, seed=3))
        t = Table(spec, lambda ids: np.ones(ids.shape, bool), 16)
        for step in range(12):
            ids = rng.zipf(1.3, 300).astype(np.int64) % 500
            grads = rng.standard_normal((300, 5)).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 2))
            with t.lock:
                t.apply(ids, grads, lr_scale=1.0 / (1 + step % 3), now=0)  # a fixed clock: snapshots agree
        with t.lock:
            return t.snapshot()

    bits_equal(*both(run))


@pytest.mark.parametrize("fixed", [None, 600], ids=["hash index", "direct index"])
def test_evicting_table_pushes(fixed: object) -> None:
    """Capacity eviction and TTL move rows, state and metadata through the index's swap moves: the compiled
    moves and the composed numpy ones leave the same table, bit for bit."""

    def run() -> dict[str, np.ndarray]:
        rng = np.random.default_rng(5)
        spec = TableSpec(name="t", dim=3, num_embeddings=fixed, optimizer=Adam(lr=0.01),  # type: ignore[arg-type]
                         initializer=Initializer("normal", seed=2), eviction=Eviction(max_rows=150, ttl_steps=4))
        t = Table(spec, lambda ids: np.ones(ids.shape, bool), 16)
        for step in range(30):
            ids = rng.zipf(1.2, 120).astype(np.int64) % 600
            with t.lock:
                t.apply(ids, rng.standard_normal((120, 3)).astype(np.float32), version=step, stamp=step + 1, now=0)
                t.sweep(step + 1, 50)
        with t.lock:
            return t.snapshot()

    bits_equal(*both(run))


@pytest.mark.parametrize("dim", [1, 3, 64, 129])
def test_normal_initializer(dim: int) -> None:
    ids = _ids(np.random.default_rng(dim), 4000 if dim < 100 else 1000)
    for init in (Initializer(), Initializer(mean=0.5, std=0.01, seed=2**64 - 1), Initializer(std=0.0, seed=9)):
        bits_equal(*both(lambda init=init: init.rows(ids, dim)))


def test_normal_initializer_covers_the_slow_paths_and_is_standard_normal() -> None:
    """Enough values that the ziggurat's wedges and its tail are taken (both checked bit for bit), and the
    values pass a Kolmogorov-Smirnov test against the standard normal, as torch.nn.Embedding's do."""
    from scipy import stats

    ids = np.arange(40000, dtype=np.int64)
    a, b = both(lambda: Initializer(seed=11).rows(ids, 32))
    bits_equal(a, b)
    z = np.asarray(a, dtype=np.float64).ravel()
    assert (np.abs(z) > kernels.ZIGGURAT_R).sum() > 50  # the tail was drawn (expected ~330)
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01


def test_coalesce() -> None:
    """Gradient sums of duplicate ids in numpy's pairwise order, for runs across its block sizes."""
    rng = np.random.default_rng(5)
    for run in (1, 2, 7, 8, 9, 128, 129, 300, 9000):
        ids = np.concatenate([np.full(run, 3, np.int64), rng.zipf(1.1, 2000).astype(np.int64)])
        rng.shuffle(ids)
        grads = rng.standard_normal((ids.shape[0], 6)).astype(np.float32)
        bits_equal(*both(lambda ids=ids, grads=grads: coalesce(ids, grads)))
        bits_equal(*both(lambda ids=ids, grads=grads: coalesce(ids, grads.astype(np.float64))))  # converted before summing
        bits_equal(*both(lambda ids=ids, grads=grads: coalesce(ids, grads[:, ::2])))  # not contiguous


def test_rows_into_and_out_of_messages() -> None:
    """Rows gathered into a push's message and scattered out of a pull's answer (``gather_rows``, ``scatter_rows``)
    as numpy's take and fancy assignment, also into and out of views at odd offsets of a buffer, read-only ones."""
    rng = np.random.default_rng(6)
    src = rng.standard_normal((50, 7)).astype(np.float32)
    src[3, 2] = np.nan
    idx = rng.permutation(50)[:31]
    raw = np.zeros(31 * 7 * 4 + 3, np.uint8)
    for dst in (np.zeros((31, 7), np.float32), raw[3:].view(np.float32).reshape(31, 7)):
        loops.gather_rows(src, idx, dst)
        bits_equal(dst, np.take(src, idx, axis=0))
        received = dst.view()
        received.setflags(write=False)
        out, want = np.zeros((50, 7), np.float32), np.zeros((50, 7), np.float32)
        loops.scatter_rows(out, idx, received)
        want[idx] = dst
        bits_equal(out, want)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)


def test_a_shard_loads_its_kernels_without_scipy() -> None:
    """``shardps serve``'s start (``without_scipy`` then ``warm_up``): the kernels load and compute without numba's
    BLAS probe importing scipy (0.26 s of each shard's start where scipy is installed)."""
    code = ("import sys, numpy as np; from shardps.core import kernels; kernels.without_scipy(); kernels.warm_up(client=False); "
            "order, bounds = kernels.jit().split_by_shard(np.arange(100, dtype=np.int64), 3, np.uint64(7)); "
            "print(sorted(order.tolist()) == list(range(100)), bounds.tolist()[-1], "
            "any(m.split('.')[0] == 'scipy' and sys.modules[m] is not None for m in sys.modules))")
    out = _python(code, SHARDPS_KERNELS="numba")
    assert out.stdout.split() == ["True", "100", "False"], out.stderr


def test_the_environment_picks_the_implementation() -> None:
    code = "from shardps.core import kernels; print(kernels.ENABLED, kernels.jit() is None, kernels.describe())"
    out = _python(code, SHARDPS_KERNELS="numpy")
    assert out.stdout.split()[:2] == ["False", "True"] and "SHARDPS_KERNELS=numpy" in out.stdout
    out = _python(code, SHARDPS_KERNELS="numba")
    assert out.stdout.split()[:3] == ["True", "False", "numba"], out.stderr
    out = _python("import shardps.core.kernels", SHARDPS_KERNELS="fast")
    assert out.returncode != 0 and "SHARDPS_KERNELS must be numba, numpy or auto, got 'fast'" in out.stderr


def test_command_line_tools_do_not_import_numba() -> None:
    """The health probe and the other command-line tools start without paying for numba's import."""
    out = _python("import sys, shardps.server.ops.cli, shardps.core.routing, shardps.core.specs; "
                  "print('numba' in sys.modules)")
    assert out.stdout.strip() == "False", out.stderr
