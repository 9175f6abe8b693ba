"""Strategies of valid data-path requests: pushes, pulls, their batches, stream frames, assignments."""

from __future__ import annotations

import functools
from typing import Any

from hypothesis import strategies as st

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.target import DENSE, DENSE_SHAPE, FUZZ_DENSE, FUZZ_TABLES, TABLE, TABLE_DIM
from tests.fuzz.tensors import float_tensors, id_lists, int64_tensor, lying_tensors, weird_tensors
from tests.fuzz.values import enum_values, i64, names, set_field, shard_maps, sync_parts, u64, weighted


@st.composite
def push_requests(draw: Any, dense: bool = False, well_formed: bool = False, valid: bool = False) -> Any:
    """A PushRequest (or PushDenseRequest), mostly a valid push to t (or d).

    ``well_formed``: ids and grads are consistent tensors of accepted dtypes (what
    any correct decoder must accept); names and other fields are still arbitrary.
    ``valid``: a push to t (or d) the shard must accept.
    """
    msg = pb.PushDenseRequest() if dense else pb.PushRequest()
    clean = valid or well_formed or draw(st.integers(0, 9)) < 7
    if valid:
        name = DENSE if dense else TABLE
    else:
        name = draw(names(DENSE, *FUZZ_DENSE) if dense else names(TABLE, *FUZZ_TABLES))
    if well_formed and draw(st.booleans()):
        name = draw(st.text(max_size=300))
    if dense:
        msg.name = name
        rows = draw(st.integers(1, DENSE_SHAPE[0]))
        row_start = draw(weighted((6, st.integers(0, DENSE_SHAPE[0] - rows)), (0 if valid else 1, u64())))
        cols = (
            DENSE_SHAPE[1]
            if clean and not well_formed
            else draw(weighted((4, st.just(DENSE_SHAPE[1])), (1, st.integers(0, 9))))
        )
        if row_start:
            msg.row_start = row_start
    else:
        msg.table = name
        n = draw(weighted((8, st.integers(1, 64)), (0 if valid else 1, st.just(0)), (1, st.integers(65, 200))))
        if well_formed:
            ids = draw(st.lists(i64(), min_size=n, max_size=n)) if n <= 8 else draw(id_lists(n, in_range=False))
        else:
            ids = draw(id_lists(n, in_range=clean, edges=not valid))
        ids_t = int64_tensor(ids)
        if not clean and draw(st.integers(0, 3)) == 0:
            ids_t = draw(st.one_of(weird_tensors(), lying_tensors(ids_t)))
        if not (not clean and draw(st.integers(0, 9)) == 0):  # sometimes no ids at all
            msg.ids.CopyFrom(ids_t)
        rows = n
        cols = (
            TABLE_DIM if clean and not well_formed else draw(weighted((4, st.just(TABLE_DIM)), (1, st.integers(0, 17))))
        )
    grads = draw(float_tensors(rows, cols, nonfinite=not (well_formed or valid)))
    if not clean:
        grads = draw(weighted((2, st.just(grads)), (2, weird_tensors()), (2, lying_tensors(grads)), (1, st.none())))
    set_field(msg, "grads", grads)
    if draw(st.integers(0, 3)) == 0:
        msg.pulled_version = draw(u64())
    msg.client_id = draw(
        weighted((6, st.just("")), (2, st.sampled_from(["fuzz", "fuzz-2"])), (1, st.text(max_size=40)))
    )
    msg.seq = draw(u64(1000))
    if not valid:
        set_field(msg, "shard_map", draw(shard_maps()))
        set_field(msg, "sync", draw(sync_parts()))
    return msg


@st.composite
def pull_requests(draw: Any) -> pb.PullRequest:
    msg = pb.PullRequest(table=draw(names(TABLE, *FUZZ_TABLES)), wire_dtype=draw(_wire_dtypes()))
    n = draw(weighted((8, st.integers(1, 64)), (1, st.just(0)), (1, st.integers(65, 300))))
    ids = int64_tensor(draw(id_lists(n, in_range=draw(st.integers(0, 9)) > 0)))
    ids = draw(weighted((8, st.just(ids)), (1, weird_tensors()), (1, lying_tensors(ids)), (1, st.none())))
    set_field(msg, "ids", ids)
    set_field(msg, "shard_map", draw(shard_maps()))
    return msg


def _wire_dtypes() -> st.SearchStrategy[int]:
    return weighted((8, st.integers(0, 3)), (1, enum_values(4)))


@st.composite
def pull_dense_requests(draw: Any, primary: str = DENSE) -> pb.PullDenseRequest:
    if draw(st.integers(0, 3)):
        start = draw(st.integers(0, DENSE_SHAPE[0] - 1))
        end = draw(st.integers(start + 1, DENSE_SHAPE[0]))
    else:
        start, end = (
            draw(weighted((2, st.integers(0, DENSE_SHAPE[0])), (1, u64()))),
            draw(weighted((2, st.integers(0, 5)), (1, u64()))),
        )
    msg = pb.PullDenseRequest(
        name=draw(names(primary, *(n for n in (DENSE, *FUZZ_DENSE) if n != primary))),
        row_start=start,
        row_end=end,
        wire_dtype=draw(_wire_dtypes()),
    )
    set_field(msg, "shard_map", draw(shard_maps()))
    return msg


@functools.cache
def pull_batch_requests() -> st.SearchStrategy[pb.PullBatchRequest]:
    return st.builds(
        lambda p, d: pb.PullBatchRequest(pulls=p, dense=d),
        st.lists(pull_requests(), max_size=3),
        st.lists(pull_dense_requests(), max_size=3),
    )


@functools.cache
def push_batch_requests() -> st.SearchStrategy[pb.PushBatchRequest]:
    """Push batches: any entries (mostly refused as a whole, as one bad entry refuses the batch), or
    valid pushes (applied, so what follows them is exercised too)."""
    pushes = weighted((1, st.lists(push_requests(), max_size=3)), (1, st.lists(push_requests(valid=True), max_size=2)))
    dense = weighted(
        (1, st.lists(push_requests(dense=True), max_size=3)),
        (1, st.lists(push_requests(dense=True, valid=True), max_size=2)),
    )
    return st.builds(
        lambda p, d, q: pb.PushBatchRequest(pushes=p, dense=d, pull_dense=q),
        pushes,
        dense,
        # Reads of d, and of the fuzzer's own dense tensors (rows maybe never initialised).
        st.lists(st.one_of(pull_dense_requests(), pull_dense_requests(FUZZ_DENSE[0])), max_size=2),
    )


@functools.cache
def stream_requests() -> st.SearchStrategy[pb.StreamRequest]:
    return st.one_of(
        push_requests().map(lambda m: pb.StreamRequest(push=m)),
        push_requests(dense=True).map(lambda m: pb.StreamRequest(push_dense=m)),
        push_batch_requests().map(lambda m: pb.StreamRequest(push_batch=m)),
        pull_requests().map(lambda m: pb.StreamRequest(pull=m)),
        pull_dense_requests().map(lambda m: pb.StreamRequest(pull_dense=m)),
        pull_batch_requests().map(lambda m: pb.StreamRequest(pull_batch=m)),
        st.just(pb.StreamRequest()),
    )


@st.composite
def assign_requests(draw: Any) -> pb.AssignRequest:
    n = draw(weighted((8, st.integers(1, 16)), (1, st.just(0)), (1, st.integers(17, 300))))
    ids = draw(weighted((6, st.just(int64_tensor(draw(id_lists(n, in_range=draw(st.integers(0, 9)) > 0))))),
                        (1, weird_tensors()), (1, st.none())))
    msg = pb.AssignRequest(table=draw(names(TABLE, *FUZZ_TABLES)))
    set_field(msg, "ids", ids)
    set_field(msg, "values", draw(weighted((6, float_tensors(n, draw(weighted((6, st.just(TABLE_DIM)), (1, st.integers(0, 9)))))),
                                      (1, weird_tensors()), (1, st.none()))))
    set_field(msg, "shard_map", draw(shard_maps()))
    return msg
