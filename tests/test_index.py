"""One contract, checked for every index implementation against a dict."""

import numpy as np
import pytest

from shardps.index import DirectIndex, HashIndex

IMPLS = {
    "hash": lambda: HashIndex(capacity=16),
    "direct": lambda: DirectIndex(num_embeddings=10**6),
}


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_index_contract(impl):
    index = IMPLS[impl]()
    rng = np.random.default_rng(0)
    reference: dict[int, int] = {}
    next_slot = 0
    for _ in range(30):
        ids = rng.integers(0, 10**6, rng.integers(1, 3000))
        got = index.lookup(ids)
        want = np.array([reference.get(int(i), -1) for i in ids])
        np.testing.assert_array_equal(got, want)
        new = np.unique(ids[got < 0])
        slots = np.arange(next_slot, next_slot + len(new))
        index.insert(new, slots)
        reference.update(zip(new.tolist(), slots.tolist()))
        next_slot += len(new)
        assert len(index) == len(reference)
    all_ids = np.array(sorted(reference))
    np.testing.assert_array_equal(index.lookup(all_ids), [reference[i] for i in all_ids])


def test_hash_index_any_int64_and_colliding_ids():
    index = HashIndex(capacity=4)
    ids = np.array([-(2**63), 2**63 - 1, -1, 0, 1], dtype=np.int64)
    index.insert(ids, np.arange(5))
    np.testing.assert_array_equal(index.lookup(ids), np.arange(5))
    # Many ids, growth through several doublings, all still found.
    many = np.arange(100_000, dtype=np.int64) * 7919 - 10**9
    index.insert(many, np.arange(5, 100_005))
    np.testing.assert_array_equal(index.lookup(many[::997]), np.arange(5, 100_005)[::997])
    assert index.lookup(np.array([12345678901])).tolist() == [-1]
