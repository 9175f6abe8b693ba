"""The client's planner, without a network: requests split by owner and size, and put back together."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from shardps_client import planner

from shardps.core import codec, pushread, wire
from shardps.core.optim import SGD
from shardps.core.routing import shard_of_ids
from shardps.core.slots import SlotMap
from shardps.core.specs import DenseSpec, Initializer, SyncPolicy, TableSpec
from shardps.v1 import shardps_pb2 as pb

F32 = pb.FLOAT32


def _spec(dim: int = 8, sync: SyncPolicy | None = None) -> TableSpec:
    return TableSpec(name="t", dim=dim, num_embeddings=None, optimizer=SGD(), initializer=Initializer(), sync=sync)


@pytest.mark.parametrize("num_shards,max_bytes", [(1, 4 << 20), (3, 4 << 20), (4, 700)])
def test_pull_plan_sends_each_id_once_to_its_owner_within_the_size_limit(num_shards, max_bytes):
    uniq = np.unique(np.random.default_rng(0).integers(0, 1 << 40, 500))
    spec = _spec()
    per_shard = planner.pull_plan([(spec, uniq)], SlotMap.uniform(num_shards), F32, max_bytes)
    seen = []
    for s, entries in enumerate(per_shard):
        for key, part, raw, nbytes in entries:
            req = pb.PullRequest.FromString(raw)
            ids = codec.decode(req.ids, "ids")
            assert key == 0 and np.array_equal(ids, uniq[part])
            assert (shard_of_ids(ids, num_shards) == s).all()
            assert (req.shard_map.shard_index, req.shard_map.num_shards) == (s, num_shards)
            assert nbytes == len(ids) * (spec.dim * 4 + 8) <= max(max_bytes, spec.dim * 4 + 8)
            seen.append(part)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(uniq.shape[0]))


def test_pull_batches_group_below_the_limit_and_assemble_puts_rows_back_in_order():
    uniq = np.arange(0, 3000, 7, dtype=np.int64)
    spec = _spec(dim=4)
    max_bytes = 2000
    per_shard = planner.pull_plan([(spec, uniq)], SlotMap.uniform(2), F32, max_bytes)
    calls, metas = planner.pull_batches(per_shard, "Pull", planner.pull_batch, max_bytes)
    assert {m for _, m, _ in calls} == {"PullBatch"}  # several requests per shard: batched
    replies = []
    for s, _, raw in calls:
        batch = pb.PullBatchRequest.FromString(raw)
        assert sum(len(r.SerializeToString()) for r in batch.pulls) < 2 * max_bytes
        # a shard's answer: each row is its id repeated, at version 10 + shard
        blocks = [wire.encode_pull_response(np.repeat(codec.decode(r.ids, "ids")[:, None], 4, 1).astype(np.float32), F32, 10 + s)
                  for r in batch.pulls]
        replies.append(wire.decode_repeated(wire.encode_repeated([(pb.PullBatchResponse.PULLS_FIELD_NUMBER, blocks)])))
    blocks = planner.pulled_blocks(calls, metas, replies, pb.PullBatchResponse.PULLS_FIELD_NUMBER)
    [(rows, versions)] = planner.assemble_rows([(spec, uniq)], blocks)
    assert np.array_equal(rows, np.repeat(uniq[:, None], 4, 1).astype(np.float32))
    assert versions == {0: 10, 1: 11}


def test_push_plan_sums_nothing_itself_and_a_sync_worker_sends_every_shard_a_part():
    uniq = np.array([5], dtype=np.int64)  # one id: one shard owns it
    grads = np.ones((1, 8), np.float32)
    seqs = itertools.count(1)
    calls = planner.push_plan(_spec(sync=SyncPolicy(workers=2)), uniq, grads, SlotMap.uniform(3), F32, 1 << 20, None, "c",
                              lambda s: next(seqs), sync_step=4, rank=1)
    assert sorted(s for s, _, _ in calls) == [0, 1, 2]
    for s, method, framed in calls:
        assert method == "Push"
        d = pushread.decode_push(wire.unframe(framed)[1], dense=False)
        owned = d.ids.size > 0
        assert owned == (int(shard_of_ids(uniq, 3)[0]) == s)
        assert (d.sync.step, d.sync.rank, d.sync.part, d.sync.parts) == (4, 1, 0, 1)
    assert sorted(pushread.decode_push(wire.unframe(c[2])[1], dense=False).seq for c in calls) == [1, 2, 3]


@pytest.mark.parametrize("max_bytes", [64 << 20, 100_000])
def test_push_plans_send_each_ids_gradient_to_its_owner_once(max_bytes):
    """``push_plan`` and ``push_plan_many``, with messages large enough to gather their rows in place and small ones
    (a narrow table, and pieces cut by the size limit): every id's gradient row reaches its owner once, as given."""
    rng = np.random.default_rng(3)
    slots = SlotMap.uniform(2)
    uniq = [np.unique(rng.integers(0, 10**6, n)) for n in (3000, 40, 900)]  # ~190 KB, 5 KB, 58 KB of 32-wide rows
    grads = rng.standard_normal((sum(u.shape[0] for u in uniq), 32)).astype(np.float32)
    starts = np.cumsum([0] + [u.shape[0] for u in uniq])
    want = {(f"t{t}", int(i)): grads[starts[t] + k] for t, u in enumerate(uniq) for k, i in enumerate(u)}
    seqs = itertools.count(1)
    encoders: dict = {}

    def encoder(table: str, shard: int) -> wire.PushEncoder:
        return encoders.setdefault((table, shard), wire.PushEncoder(table, "c", planner.shard_map(shard, slots),
                                                                    frame=1))

    many = planner.push_plan_many([f"t{t}" for t in range(3)], uniq, grads, slots, F32, max_bytes, [None] * 3,
                                  encoder, lambda s: next(seqs))
    one = [(f"t{t}", planner.push_plan(TableSpec(name=f"t{t}", dim=32, optimizer=SGD()), u, grads[starts[t]:starts[t + 1]],
                                       slots, F32, max_bytes, None, "c", lambda s: next(seqs)))
           for t, u in enumerate(uniq)]
    for plan in (many, one):
        got: dict = {}
        for table, calls in plan:
            for s, method, framed in calls:
                d = pushread.decode_push(wire.unframe(framed)[1], dense=False)
                assert method == "Push" and d.name == table and len(framed) <= max_bytes + 64
                assert (slots.owner_of(d.ids) == s).all()
                for i, row in zip(d.ids.tolist(), d.grads):
                    assert (table, i) not in got
                    got[(table, i)] = row
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_dense_pieces_cover_every_row_once():
    spec = DenseSpec(name="w", shape=(1000, 16), optimizer=SGD(), chunk_rows=64)
    rows = []
    for s, a, b in planner.dense_pieces(spec, SlotMap.uniform(3), 16 * 4 * 20, F32):
        assert 0 < b - a <= 20 and 0 <= s < 3
        rows.extend(range(a, b))
    assert sorted(rows) == list(range(1000))


def test_push_batches_keep_order_split_below_the_limit_and_carry_dense_pulls_last():
    calls = [(0, "Push", wire.frame(1, bytes(100))) for _ in range(10)]
    deferred = [("a", calls[:5]), ("b", calls[5:])]
    pulls = [[wire.frame(pb.PushBatchRequest.PULL_DENSE_FIELD_NUMBER, bytes(50))], []]
    work, carries = planner.push_batches(deferred, 2, 450, pulls)
    assert [keys for keys, _ in work] == [["a"] * 3, ["a", "a", "b"], ["b"] * 3, ["b"]]
    assert all(call[1] == "PushBatch" and len(call[2]) <= 450 + 16 for _, call in work)
    assert carries == {0: 3}


def test_push_batches_carry_row_pulls_after_the_dense_pulls_in_each_shards_last_batch():
    pushes = [(s, "Push", wire.frame(pb.PushBatchRequest.PUSHES_FIELD_NUMBER, bytes([s]) * 100)) for s in (0, 0, 1)]
    dense = [[wire.frame(pb.PushBatchRequest.PULL_DENSE_FIELD_NUMBER, b"d" * 50)], [], []]
    rows = [[wire.frame(pb.PushBatchRequest.PULLS_FIELD_NUMBER, b"r" * 40)],
            [wire.frame(pb.PushBatchRequest.PULLS_FIELD_NUMBER, b"s" * 40)],
            [wire.frame(pb.PushBatchRequest.PULLS_FIELD_NUMBER, b"t" * 40)]]
    work, carries = planner.push_batches([("a", pushes)], 3, 1 << 20, dense, rows)
    # shard 0: its pushes, then its dense pull, then its row pull; shard 1: its push and row pull (one PushBatch, not
    # a plain Push); shard 2: the row pull alone
    assert [(call[0], call[1], keys) for keys, call in work] == [(0, "PushBatch", ["a", "a"]),
                                                                (1, "PushBatch", ["a"]), (2, "PushBatch", [])]
    assert carries == {0: 0, 1: 1, 2: 2}
    body = wire.decode_repeated(wire.unframe(work[0][1][2])[1])
    assert [bytes(v) for v in body[pb.PushBatchRequest.PULL_DENSE_FIELD_NUMBER]] == [b"d" * 50]
    assert [bytes(v) for v in body[pb.PushBatchRequest.PULLS_FIELD_NUMBER]] == [b"r" * 40]
    body = wire.decode_repeated(wire.unframe(work[1][1][2])[1])
    assert [bytes(v) for v in body[pb.PushBatchRequest.PUSHES_FIELD_NUMBER]] == [bytes([1]) * 100]
    assert [bytes(v) for v in body[pb.PushBatchRequest.PULLS_FIELD_NUMBER]] == [b"s" * 40]
