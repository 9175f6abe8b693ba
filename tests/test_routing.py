import numpy as np
import pytest

from shardps.core.routing import dense_row_ranges, dense_rows_owned, mix64, name_hash, shard_of_ids, split_by_shard


def test_hash_is_fixed_forever():
    # Literal values recorded when the hash was introduced: changing the hash
    # would silently move every row of every deployed table.
    assert [int(x) for x in mix64(np.array([0, 1, 2**62], dtype=np.int64))] == [
        11923484680937837080,
        8156552441160240561,
        9706890270161476539,
    ]
    assert shard_of_ids(np.arange(8), 3).tolist() == [1, 1, 0, 0, 1, 0, 1, 2]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_balanced_and_in_range(n):
    owner = shard_of_ids(np.arange(200_000), n)
    counts = np.bincount(owner, minlength=n)
    assert owner.min() >= 0 and owner.max() < n
    assert counts.min() > 0.95 * 200_000 / n


def test_negative_and_huge_ids_route():
    ids = np.array([-1, -(2**63), 2**63 - 1], dtype=np.int64)
    owner = shard_of_ids(ids, 5)
    assert ((owner >= 0) & (owner < 5)).all()


def test_vectorised_matches_scalar():
    ids = np.random.default_rng(0).integers(-(2**40), 2**40, 1000)
    vec = shard_of_ids(ids, 6)
    assert all(vec[i] == shard_of_ids(np.array([ids[i]]), 6)[0] for i in range(0, 1000, 37))


def test_split_by_shard_groups_every_id_once():
    ids = np.random.default_rng(1).integers(0, 10**9, 5000)
    order, bounds = split_by_shard(ids, 3)
    owner = shard_of_ids(ids, 3)
    assert sorted(order.tolist()) == list(range(5000))
    for s in range(3):
        assert (owner[order[bounds[s] : bounds[s + 1]]] == s).all()


def test_dense_chunks_cover_rows_once():
    ranges = dense_row_ranges("mlp.weight", 1000, 64, 3)
    covered = np.zeros(1000, dtype=int)
    for _, a, b in ranges:
        covered[a:b] += 1
    assert (covered == 1).all()
    assert len({s for s, _, _ in ranges}) == 3
    masks = [dense_rows_owned("mlp.weight", 1000, 64, 3, s) for s in range(3)]
    assert (sum(m.astype(int) for m in masks) == 1).all()


def test_small_dense_tensor_on_one_shard_by_name():
    assert dense_row_ranges("bias", 10, 0, 4) == [(name_hash("bias") % 4, 0, 10)]
    assert name_hash("bias") == name_hash("bias") != name_hash("bias2")
