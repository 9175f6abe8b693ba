"""The compiled kernels against their plain-numpy references, bit for bit.

Each test runs the same public operation (routing, the hash index, a table's
pushes, the initializer, coalescing) with the numba kernels, with the same
kernels compiled ahead of time (``kernels.aot``, where built) and with
``kernels.jit`` returning None (the references), and compares the results with
``np.array_equal`` on the raw float32 bits.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator

import numpy as np
import pytest

from shardps.core import codec, kernels
from shardps.core.ids import coalesce
from shardps.core.kernels import aot, loops
from shardps.core.optim import SGD, Adagrad, Adam
from shardps.core.routing import shard_of_ids, split_by_shard
from shardps.core.specs import Eviction, Initializer, TableSpec
from shardps.server.storage.index import HashIndex
from shardps.server.storage.table import Table

AOT, AOT_MISSING = aot.load(lambda: loops)


class _NoFallback:
    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the ahead-of-time module handed {name} to numba: the callers' types drifted from "
                             "kernels.aot.EXPORTS")


# The module's kernels as the operations below call them, refusing to hand any call to numba (which would pass
# every comparison without running the module).
STRICT = aot.Kernels(AOT.compiled, lambda: _NoFallback()) if AOT is not None else None
COMPILED = [loops] + ([STRICT] if STRICT is not None else [])


@contextlib.contextmanager
def _kernels(k: object) -> Iterator[None]:
    saved = kernels.jit
    kernels.jit = lambda: k  # type: ignore[assignment]
    try:
        yield
    finally:
        kernels.jit = saved  # type: ignore[assignment]


def both(fn: Callable[[], object]) -> tuple[object, object]:
    """(the compiled kernels' result, the references'); the numba kernels' and the ahead-of-time module's results
    are checked equal first."""
    results = []
    for k in COMPILED:
        with _kernels(k):
            results.append(fn())
    for other in results[1:]:
        bits_equal(results[0], other)
    with _kernels(None):
        b = fn()
    return results[0], b


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


@pytest.mark.parametrize("num_shards", [1, 2, 3, 9])
def test_a_requests_ids_checked_for_range_and_owner_in_one_pass(num_shards: int) -> None:
    """``SlotMap.all_owned`` (a shard's check of a request's ids) against its reference: ids of every owner, a map
    with split slots (3 and 9 shards) and one that moved slots, each bound, and one id at a time made wrong."""
    from shardps.core.slots import SlotMap

    rng = np.random.default_rng(num_shards)
    uniform = SlotMap.uniform(num_shards)
    owners = uniform.owners.copy()
    owners[rng.integers(0, owners.shape[0], 500)] = num_shards - 1
    moved = SlotMap(1, owners, uniform.base, num_shards)
    pool = np.arange(5000, dtype=np.int64)
    for m in (uniform, moved):
        for n in (1, 7, 300):
            ids = rng.integers(0, 5000, 40 * n * num_shards, dtype=np.int64)
            for shard in range(num_shards):
                mine = ids[m.owner_of(ids) == shard][:n]
                assert mine.size == n
                top = int(mine.max())
                for limit in (None, 5000, top + 1, top):  # the last leaves the largest id out of range
                    ok = both(lambda m=m, ids=mine, s=shard, lim=limit: m.all_owned(ids, s, lim))
                    assert ok[0] == ok[1] and ok[0] is (limit != top)
                    for bad in (-1, 5000, 2**62, int(pool[m.owner_of(pool) != shard][0]) if num_shards > 1 else -7):
                        wrong = mine.copy()
                        wrong[rng.integers(0, n)] = bad
                        got = both(lambda m=m, ids=wrong, s=shard, lim=limit: m.all_owned(ids, s, lim))
                        assert got[0] == got[1]
                        rest_ok = limit is None or limit > int(np.delete(wrong, wrong == bad).max(initial=-1))
                        bad_ok = (limit is None or 0 <= bad < limit) and m.owner_of(np.array([bad]))[0] == shard
                        assert got[0] is (rest_ok and bool(bad_ok))


def test_hash_index_lookups_agree_whichever_side_built_the_table() -> None:
    rng = np.random.default_rng(1)
    present = np.unique(_ids(rng, 30000))
    absent = np.setdiff1d(_ids(rng, 5000), present)
    indexes = []
    for k in [*COMPILED, None]:
        with _kernels(k):
            idx = HashIndex(16)
            start = 0
            for part in np.array_split(rng.permutation(present), 7):  # several inserts, several rehashes
                idx.insert(part, np.arange(start, start + part.shape[0]))
                start += part.shape[0]
            indexes.append(idx)
    for idx in indexes:
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


def test_sorted_unique_ids_found_in_one_pass() -> None:
    """``is_sorted_unique`` (no dedup needed) against its reference: increasing ids, one repeat or one step back
    anywhere, extremes, a strided view (the reference's), and two ids or fewer."""
    from shardps.core.ids import is_sorted_unique

    rng = np.random.default_rng(6)
    base = np.unique(_ids(rng, 3000))
    cases = [base, base[:2], base[:1], base[:0], base[::2], np.array([-(2**63), 2**63 - 1], np.int64)]
    for at in (1, 2, 1500, base.shape[0] - 1):
        repeat, back = base.copy(), base.copy()
        repeat[at] = repeat[at - 1]
        back[at - 1], back[at] = back[at], back[at - 1]
        cases += [repeat, back]
    for ids in cases:
        got = both(lambda ids=ids: is_sorted_unique(ids))
        values = ids.tolist()
        assert got[0] is got[1] is all(a < b for a, b in zip(values, values[1:]))


def test_unique_ids_and_where_each_went_by_a_radix_sort() -> None:
    """``unique_inverse`` (a collection's plan, a pull's dedup) against ``np.unique(return_inverse=True)``: ids of
    every span (one radix pass to six, the whole int64 range), repeats, negative ids, a step's packed table ids, and
    one id or none; a strided view takes the reference."""
    from shardps.core.ids import unique_inverse

    rng = np.random.default_rng(7)
    zipf = (rng.zipf(1.15, 8192) % 1_000_000 + np.repeat(np.arange(8) * 1_000_000, 1024)).astype(np.int64)
    cases = [zipf, _ids(rng, 5000), np.full(300, -5, np.int64), np.array([2**63 - 1, -(2**63), 0, 2**63 - 1]),
             np.zeros(0, np.int64), np.array([42], np.int64), zipf[::3]]
    for span in (1, 2, 4095, 4096, 2**12 + 1, 2**24, 2**24 + 1, 2**40, 2**62):
        cases.append(rng.integers(-span, span, 3000, dtype=np.int64))
    for ids in cases:
        got = both(lambda ids=ids: unique_inverse(ids))
        bits_equal(*got)
        uniq, inverse = np.unique(ids, return_inverse=True)
        bits_equal(got[0], (uniq, inverse.reshape(-1)))


@pytest.mark.parametrize("index", ["hash", "flat"])
@pytest.mark.parametrize("policy", ["clock", "lru", "lfu"])
def test_tiered_table_pushes(tmp_path, policy: str, index: str) -> None:
    """A table with a disk tier holding about a tenth (a quarter with a flat index) of its rows in memory, Adam pushes
    of Zipf ids: victims chosen by sampling, written back into records and read back (``sample_victims``,
    ``gather_words``, ``scatter_words``, ``pread_records``; the references sample in Python, copy with numpy and
    gather from the mappings) leave the same rows in memory and the same records on disk, bit for bit. The hot set's
    index is a hash index at 1 MiB, a flat map at 1.5 (the map's 160 KB then within an eighth of it)."""
    from shardps.core.policies import DiskTier
    from shardps.server.storage.budget import MemoryBudget
    from shardps.server.storage.disk import DiskTiers
    from shardps.server.storage.index import DirectIndex

    runs = iter(range(10))

    def run() -> dict[str, np.ndarray]:
        rng = np.random.default_rng(10)
        spec = TableSpec(name="t", dim=8, num_embeddings=40_000, optimizer=Adam(lr=0.01),
                         initializer=Initializer("normal", seed=3),
                         disk=DiskTier(memory_mb=1 if index == "hash" else 1.5, policy=policy))
        tiers = DiskTiers(tmp_path / str(next(runs)), 0, 1, 0)
        t = Table(spec, lambda ids: np.ones(ids.shape, bool), budget=MemoryBudget(1 << 40), tiers=tiers)
        assert t.hot is not None and t.hot.rows._direct == (index == "flat")
        assert isinstance(t.hot.store.segments.index, DirectIndex) == (index == "flat")
        for step in range(25):
            ids = np.unique((rng.zipf(1.1, 2000) - 1) % 40_000).astype(np.int64)
            with t.lock:
                t.read(ids, step)
                t.apply(ids, rng.standard_normal((ids.shape[0], 8)).astype(np.float32), version=step,
                        stamp=step + 1, now=0)
        with t.lock:
            hot = t.store.snapshot()
            order = np.argsort(hot["ids"])
            out = {k: v[order] for k, v in hot.items()}
            found, records = t.hot.store.get(np.arange(40_000, dtype=np.int64))
            out["on disk"] = found
            out["records"] = records.view(np.uint8)
            assert 0 < out["ids"].shape[0] < (5000 if index == "hash" else 12_000) and found.sum() > 5000
            assert t.hot.counts.written_back > 0
        tiers.close()
        return out

    bits_equal(*both(run))


@pytest.mark.parametrize("lfu", [False, True], ids=["lru", "lfu"])
def test_sampled_victims(lfu: bool) -> None:
    """Sampled eviction (``bounded.sampled_victims``, the compiled ``sample_victims``): the same victims, draw for
    draw, over a table's strided metadata; distinct, none of the protected version, and old ones: each the best of
    8 draws, so their mean rank is near 1/9 of the rows, not the half a random pick gives; too few when nearly
    every row is protected (the caller then chooses exactly). Protected: the rows of a version and newer ones."""
    from shardps.server.storage.bounded import sampled_victims
    from shardps.server.storage.rows import META

    rng = np.random.default_rng(8)
    n = 5000
    meta = np.zeros(n, META)
    meta["last_version"] = rng.permutation(n)
    meta["touches"] = rng.integers(0, 3, n) if lfu else 0
    rank = np.empty(n)
    rank[np.lexsort((meta["last_version"], meta["touches"]))] = np.arange(n) / n
    versions = meta["last_version"].copy()
    for protected_share, count in ((0.0, 300), (0.5, 200), (0.995, 40), (0.0, 1)):
        last = versions.copy()
        protected = n + 7
        last[rng.permutation(n)[:int(protected_share * n)]] = protected + rng.integers(0, 3)
        lv = meta["last_version"]
        lv[:] = last
        want = sampled_victims(lv, meta["touches"], count, 8, 11, protected, lfu)
        for k in COMPILED:
            got = k.sample_victims(lv, meta["touches"], count, 8, np.uint64(11), np.uint64(0x9E3779B97F4A7C15),
                                   protected, lfu)
            bits_equal(got, want)
        assert np.unique(want).shape == want.shape and not (lv[want] >= protected).any()
        if protected_share < 0.9:
            assert want.shape[0] == count
            if count > 100 and protected_share == 0.0:
                assert rank[want].mean() < 0.16, rank[want].mean()
        else:
            assert want.shape[0] < count


def test_clock_victims() -> None:
    """A disk tier's clock hand (``bounded.clock_victims_numpy``, the compiled ``clock_victims``): the same victims
    and the same hand and round after, call after call, over rows whose uses move between calls; distinct, none of
    the protected requests', and in a round only rows not used since it began (a row used since is passed over);
    each row looked at once at most per call (fewer victims than asked when too few qualify)."""
    from shardps.server.storage.bounded import clock_victims_numpy

    rng = np.random.default_rng(12)
    n = 5000
    last = rng.integers(0, 50, n).astype(np.int64)
    states = [np.zeros(2, np.int64) for _ in range(len(COMPILED) + 1)]
    for now in range(50, 90):
        protected = now - 3
        count = int(rng.choice([0, 1, 37, 400, 2500, 6000]))
        before = states[-1].copy()
        want = clock_victims_numpy(last, count, protected, now, states[-1])
        for k, state in zip(COMPILED, states):
            bits_equal(k.clock_victims(last, count, protected, now, state), want)
            bits_equal(state, states[-1])
        assert np.unique(want).shape == want.shape and want.shape[0] <= min(max(count, 0), n)
        assert not (last[want] >= protected).any()
        hand, lap = (int(before[0]), int(before[1])) if before[0] < n else (0, now)
        in_round = want[want >= hand] if count else want
        assert not (last[in_round] >= lap).any()  # this round's victims: none used since it began
        if 0 < count and want.shape[0] < count:  # too few: the hand went once round, back where it started
            assert (int(states[-1][0]), int(states[-1][1])) == (hand, now)
        # the requests in between use some rows (the victims left and came back as other rows: new uses)
        last[rng.integers(0, n, 600)] = now
        last[want] = now


def test_record_columns_into_and_out_of_records() -> None:
    """A tiered table's rows into records and back (``records.gather_columns`` and ``scatter_columns``: the
    compiled ``gather_words`` and ``scatter_words``) as numpy's slices, with a strided source (numba's loop)."""
    from shardps.server.storage.records import as_words, gather_columns, scatter_columns

    rng = np.random.default_rng(9)
    rows = rng.standard_normal((60, 5)).astype(np.float32)
    meta = rng.integers(0, 1 << 30, (60, 6), dtype=np.int64).astype(np.uint32)
    slots = rng.permutation(60)[:23].astype(np.int64)
    cols = [(as_words(rows), 0, 5, 1), (meta, 2, 3, 7)]
    results = []
    for k in COMPILED + [None]:
        with _kernels(k):
            out = np.zeros((23, 11), np.uint32)
            gather_columns(out, cols, slots)
            back_rows, back_meta = np.zeros_like(rows), np.zeros_like(meta)
            scatter_columns(out, [(as_words(back_rows), 0, 5, 1), (back_meta, 2, 3, 7)], slots)
            results.append((out, back_rows, back_meta))
    for r in results[1:]:
        bits_equal(r, results[0])
    out, back_rows, back_meta = results[0]
    bits_equal(out[:, 1:6].view(np.float32), rows[slots])
    bits_equal(back_meta[slots, 2:5], meta[slots, 2:5])
    assert not back_rows[np.setdiff1d(np.arange(60), slots)].any()
    strided = np.zeros((23, 22), np.uint32)[:, ::2]
    loops.gather_words(meta[:, ::2].copy(), 0, 3, slots, strided, 0)  # (numba's kernel on strided arrays)
    bits_equal(strided[:, :3], meta[slots][:, ::2])


def test_rows_into_and_out_of_messages() -> None:
    """Rows gathered into a push's message and scattered out of a pull's answer (``gather_rows``, ``scatter_rows``)
    as numpy's take and fancy assignment, also into and out of views at odd offsets of a buffer, read-only ones."""
    rng = np.random.default_rng(6)
    src = rng.standard_normal((50, 7)).astype(np.float32)
    src[3, 2] = np.nan
    idx = rng.permutation(50)[:31]
    for k in COMPILED:
        raw = np.zeros(31 * 7 * 4 + 3, np.uint8)
        for dst in (np.zeros((31, 7), np.float32), raw[3:].view(np.float32).reshape(31, 7),
                    raw[:-3].view(np.float32).reshape(31, 7)):
            k.gather_rows(src, idx, dst)
            bits_equal(dst, np.take(src, idx, axis=0))
            received = dst.view()
            received.setflags(write=False)
            out, want = np.zeros((50, 7), np.float32), np.zeros((50, 7), np.float32)
            k.scatter_rows(out, idx, received)
            want[idx] = dst
            bits_equal(out, want)


def test_all_finite_finds_every_nan_and_infinity() -> None:
    """``codec.all_finite`` (a push's check on client and shard) as numpy's ``isfinite().all()``: each kind of
    non-finite value in each position of a row, in the first and last rows, in views at odd offsets and strided."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal((40, 67)).astype(np.float32) * np.float32(1e38)
    cases = [values, values[:0], values[:, :0], np.full((3, 5), np.finfo(np.float32).max, np.float32)]
    for bad in (np.nan, np.inf, -np.inf, np.float32(np.nan) * -1):
        for i, j in ((0, 0), (39, 66), (17, 31), (5, 64)):
            v = values.copy()
            v[i, j] = bad
            cases += [v, v[:, ::2], v.T]
            raw = np.zeros(v.nbytes + 1, np.uint8)
            odd = raw[1:].view(np.float32).reshape(v.shape)  # a view of a received message at an odd offset
            odd[:] = v
            odd.setflags(write=False)
            cases.append(odd)
    cases.append(values.astype(np.float64))  # not float32: numpy's check
    for case in cases:
        want = bool(np.isfinite(case).all())
        for k in COMPILED + [None]:
            with _kernels(k):
                assert codec.all_finite(case) is want, (k, case.shape)


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
    out = _python(code, SHARDPS_KERNELS="auto")
    assert out.stdout.split()[:3] == ["True", "False", "compiled" if AOT is not None else "numba"], out.stderr
    out = _python("import shardps.core.kernels", SHARDPS_KERNELS="fast")
    assert out.returncode != 0 and "SHARDPS_KERNELS must be auto, aot, numba or numpy, got 'fast'" in out.stderr


# ---- the ahead-of-time module ----------------------------------------------------------------------------------------


needs_aot = pytest.mark.skipif(AOT is None and aot.compiler() is None,
                               reason=f"no C compiler to build the ahead-of-time kernels ({AOT_MISSING})")


@needs_aot
def test_the_ahead_of_time_module_is_built_and_current() -> None:
    """Where a C compiler is installed, ``make setup`` (``python -m shardps.core.kernels``) built it from these
    sources: the other tests here then run every operation through it too."""
    assert AOT is not None, f"{AOT_MISSING}: run python -m shardps.core.kernels"


@needs_aot
def test_a_shard_starts_without_importing_numba() -> None:
    """``shardps serve``'s start loads the ahead-of-time kernels alone: numba's import and cache (0.5 s of CPU a
    shard) are left out, and the kernels compute."""
    code = ("import sys, numpy as np; from shardps.core import kernels; kernels.without_scipy(); "
            "kernels.warm_up(client=False); "
            "order, bounds = kernels.jit().split_by_shard(np.arange(100, dtype=np.int64), 3, np.uint64(7)); "
            "print(sorted(order.tolist()) == list(range(100)), bounds.tolist()[-1], 'numba' in sys.modules, "
            "kernels.describe())")
    out = _python(code, SHARDPS_KERNELS="aot")
    assert out.stdout.split()[:4] == ["True", "100", "False", "compiled"], out.stderr


@needs_aot
def test_a_trainers_pulls_and_pushes_import_no_numba() -> None:
    """A client's pulls and pushes (split by shard, rows into a push's message and out of a pull's answer, at any
    offset of the message) run on the ahead-of-time module alone: a trainer does not pay numba's import either."""
    code = ("import sys, torch; from shardps_client import Client, SGD; from tests.conftest import running_cluster\n"
            "with running_cluster(2) as servers, Client([s.address for s in servers]) as c:\n"
            "    c.create_table('t', dim=64, num_embeddings=100000, optimizer=SGD(lr=0.1))\n"
            "    for step in range(3):\n"
            "        ids = torch.randint(0, 100000, (4096,))\n"
            "        c.push('t', ids, c.pull('t', ids) * 0.1, wait=True)\n"
            "print('numba' in sys.modules)")
    out = _python(code, SHARDPS_KERNELS="aot")
    assert out.stdout.split() == ["False"], out.stdout + out.stderr


class _Counting:
    """numba's kernels, counting the calls the ahead-of-time module hands them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        fn = getattr(loops, name)

        def call(*args: object) -> object:
            self.calls.append(name)
            return fn(*args)

        return call


@needs_aot
def test_ahead_of_time_calls_with_other_types_run_the_numba_kernels() -> None:
    """The compiled entry points trust their arguments' types: every call with types they were not compiled for
    (another dtype, a Fortran-ordered or read-only array the kernel writes into, a scalar numba types otherwise)
    goes to numba's kernel, with the same result; an array the kernel only reads is copied to C order instead."""
    assert AOT is not None
    numba_side = _Counting()
    k = aot.Kernels(AOT.compiled, lambda: numba_side)
    seed = np.uint64(7)
    ids = np.arange(40, dtype=np.int64) * 7919

    def same(name: str, *args: object, handed: bool) -> None:
        before = len(numba_side.calls)
        got = getattr(k, name)(*args)
        assert (len(numba_side.calls) > before) == handed, (name, handed)
        bits_equal(got, getattr(loops, name)(*args))

    same("shard_of_ids", ids, 3, seed, handed=False)
    same("shard_of_ids", ids[::2], 3, seed, handed=False)  # read only: copied to C order
    # Another descriptor object of the same dtype (numpy makes them; a trainer's arrays from torch had them).
    other = ids.view(np.dtype(np.int64, copy=True))
    assert other.dtype is not ids.dtype
    same("shard_of_ids", other, 3, seed, handed=False)
    same("shard_of_ids", ids.astype(np.int32), 3, seed, handed=True)
    same("shard_of_ids", ids, np.int32(3), seed, handed=True)
    same("shard_of_ids", ids, 3, 7, handed=True)  # a Python int seed: numba types it int64
    same("sum_runs", np.ones((6, 4), np.float64), np.arange(6), np.array([0, 2]), handed=True)

    slots = np.array([1, 3], np.int64)
    grads = np.ones((2, 4), np.float32)

    def adagrad(rows: np.ndarray, acc: np.ndarray, handed: bool) -> None:
        before = len(numba_side.calls)
        k.adagrad_apply(rows, acc, slots, np.full(2, 0.5, np.float32), grads, False, 0.0, np.float32(1e-10))
        assert (len(numba_side.calls) > before) == handed
        want, want_acc = np.zeros((5, 4), np.float32), np.zeros((5, 4), np.float32)
        loops.adagrad_apply(want, want_acc, slots, np.full(2, 0.5, np.float32), grads, False, 0.0, np.float32(1e-10))
        bits_equal(rows, want)
        bits_equal(acc, want_acc)

    # Rows and ids at an odd offset of a message's buffer: the arrays a kernel reads (and a push's message it writes
    # rows into) are compiled for any alignment; the arrays of a table it writes into are not.
    raw = np.zeros(2 * 4 * 4 + 1, np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(2, 4)
    assert not unaligned.flags.aligned
    same("gather_rows", grads, np.array([1, 0]), unaligned, handed=False)
    same("scatter_rows", np.zeros((3, 4), np.float32), np.array([2, 0]), unaligned, handed=False)
    same("sum_runs", unaligned, np.array([0, 1]), np.array([0]), handed=False)
    same("shard_of_ids", np.zeros(8 * 2 + 1, np.uint8)[1:].view(np.int64), 3, seed, handed=False)
    same("apply_moves", np.zeros(4 * 4 * 4 + 1, np.uint8)[1:].view(np.float32).reshape(4, 4),
         np.array([[3, 0]]), handed=True)

    adagrad(np.zeros((5, 4), np.float32), np.zeros((5, 4), np.float32), handed=False)
    adagrad(np.zeros((5, 4), np.float32, order="F"), np.zeros((5, 4), np.float32), handed=True)
    read_only = np.zeros((5, 4), np.float32)
    read_only.setflags(write=False)
    with pytest.raises(Exception, match="readonly|read-only"):  # numba refuses to write into it, as without the module
        k.adagrad_apply(read_only, np.zeros((5, 4), np.float32), slots, np.full(2, 0.5, np.float32), grads, False,
                        0.0, np.float32(1e-10))
    assert numba_side.calls[-1] == "adagrad_apply"


@needs_aot
def test_ahead_of_time_kernels_keep_numpys_error_model() -> None:
    """A float division by zero gives NaN or inf, as numba's kernels (``error_model="numpy"``) and numpy do, not
    Python's ZeroDivisionError: Adagrad with eps=0 on a zero row and a zero gradient divides 0 by 0."""
    assert AOT is not None
    slots = np.array([0, 2], np.int64)
    out = []
    for k in COMPILED:
        rows, acc = np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32)
        k.adagrad_apply(rows, acc, slots, np.ones(2, np.float32), np.zeros((2, 2), np.float32), False, 0.0,
                        np.float32(0.0))
        out.append(rows)
    assert np.isnan(out[1][[0, 2]]).all() and (out[1][1] == 0).all()
    bits_equal(out[0], out[1])


@needs_aot
def test_ahead_of_time_kernels_release_the_gil() -> None:
    """As numba's (``nogil``): inside a long compiled call in one thread, the others run Python. The call looks up
    absent ids in a hash table full but for one position, so each lookup walks about half of its 2^20 positions
    (about a second in all here, little memory). The main thread notes the time at each turn of a loop (half a
    millisecond's sleep, then Python); some turns must fall well inside the call. With the GIL held none can: the
    interpreter switches threads only between bytecodes, so at most within one switch interval of the call's start."""
    assert AOT is not None
    size = 1 << 20
    table = np.arange(size, dtype=np.int32)
    table[-1] = -1
    slot_ids = np.arange(size, dtype=np.int64) * 2  # even ids present
    absent = np.arange(1, 4001, 2, dtype=np.int64)  # odd ids absent
    window: list[float] = []

    def worker() -> None:
        window.append(time.perf_counter())
        found = AOT.compiled.hash_lookup__0(table, slot_ids, absent, np.uint64(5))  # the compiled entry itself
        window.append(time.perf_counter())
        assert (found == -1).all()

    turns: list[float] = []
    t = threading.Thread(target=worker)
    t.start()
    while t.is_alive():
        time.sleep(0.0005)  # then back to Python: it needs the GIL
        turns.append(time.perf_counter())
    t.join()
    start, end = window
    margin = 10 * sys.getswitchinterval()
    if end - start < 3 * margin:
        pytest.skip(f"the call took {end - start:.3f} s: too short to tell on this machine")
    assert any(start + margin < x < end for x in turns), (end - start, len(turns))
