"""Strategies of the calls shards make of each other: a slot migration's steps (``Migrate``, as ``shardps reshard``
sends them) and a backup's stream to its primary (``Replicate``). The fuzzed shard is in no replica group and
moves no slots: every such call is refused, or answered without changing what it holds (``status``, an epoch
announced, a map that moves nothing)."""

from __future__ import annotations

import json
import string
from typing import Any

import numpy as np
from hypothesis import strategies as st

from shardps.core.slots import SlotMap
from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.target import DENSE, TABLE
from tests.fuzz.tensors import float_tensors, weird_tensors
from tests.fuzz.values import i64, names, set_field, shard_maps, u64, weighted

OPS = ["out_begin", "out_ids", "out_rows", "out_handover", "out_commit", "out_abort", "in_begin", "in_rows",
       "in_drop", "in_prepare", "in_activate", "in_abort", "status", "install", "announce"]
MOVE_IDS = ("m1", "m2")  # the harness gives up moves of these ids after every call


@st.composite
def slot_maps(draw: Any) -> dict[str, Any]:
    """A slot map as JSON: a uniform one of 1 to 3 shards, maybe with slots moved, maybe a lineage."""
    n = draw(st.integers(1, 3))
    m = SlotMap.uniform(n, [f"127.0.0.1:{p}" for p in range(1, n + 1)])
    if draw(st.booleans()) and m.num_shards > 1:
        slots = draw(st.lists(st.integers(0, 16383), min_size=1, max_size=4))
        m = m.moved(slots, draw(st.integers(0, m.num_shards - 1)), epoch=draw(st.integers(0, 3)))
    out = m.to_json()
    if draw(st.integers(0, 5)) == 0:  # damaged
        key = draw(st.sampled_from(sorted(out)))
        out[key] = draw(st.sampled_from([None, -1, "x", [], {}, [[0, 9]], 2**70]))
    return out


@st.composite
def moves(draw: Any) -> str:
    """A move as JSON: plausible (its id one of ``MOVE_IDS``) or not."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.text(max_size=40))
    source, target = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    n = max(source, target) + 1
    slots = draw(st.lists(st.integers(-2, 16390), max_size=5))
    try:
        m = SlotMap.uniform(1).with_addresses([f"127.0.0.1:{p}" for p in range(1, n + 1)])
        new = m.moved([s for s in slots if 0 <= s < 16384], target, epoch=draw(st.integers(0, 2))).to_json()
    except ValueError:
        new = draw(slot_maps())
    return json.dumps({"id": draw(st.sampled_from(MOVE_IDS)), "source": source, "target": target, "slots": slots,
                       "dense": draw(st.lists(st.tuples(names(DENSE), st.integers(-1, 3)), max_size=2)),
                       "map": new})


@st.composite
def migrate_requests(draw: Any) -> pb.MigrateRequest:
    msg = pb.MigrateRequest(
        op=draw(weighted((8, st.sampled_from(OPS)), (1, st.text(string.ascii_letters + "_", max_size=12)))),
        move_id=draw(weighted((6, st.sampled_from(MOVE_IDS)), (1, st.text(max_size=70)))),
        table=draw(names(TABLE, DENSE)), since=draw(i64()), offset=draw(u64()), limit=draw(u64()),
        epoch=draw(u64()),
    )
    if draw(st.booleans()):
        msg.move_json = draw(moves())
    if draw(st.integers(0, 3)) == 0:
        msg.map_json = json.dumps(draw(slot_maps()))
    if draw(st.booleans()):
        msg.ids.CopyFrom(draw(weighted((3, st.builds(lambda a: _i64(a), st.lists(st.integers(-5, 2000), max_size=8))),
                                       (1, weird_tensors()))))
    for key in draw(st.lists(st.sampled_from(["rows", "steps", "meta.last_time", "meta.touches", "state.x"]),
                             max_size=3, unique=True)):
        msg.arrays[key].CopyFrom(draw(weighted((2, float_tensors(draw(st.integers(0, 4)), 8)), (1, weird_tensors()))))
    return msg


def _i64(values: list[int]) -> pb.Tensor:
    a = np.asarray(values, "<i8")
    return pb.Tensor(dtype=pb.INT64, shape=[a.shape[0]], data=a.tobytes())


@st.composite
def replica_acks(draw: Any) -> pb.ReplicaAck:
    """A backup's hello (first) or acknowledgement."""
    if draw(st.booleans()):
        hello = pb.ReplicaHello(cluster=draw(st.text(max_size=12)), member=draw(st.text(max_size=12)),
                                lsn=draw(u64()), last_epoch=draw(u64()), epoch=draw(u64()))
        set_field(hello, "shard_map", draw(shard_maps()))
        return pb.ReplicaAck(hello=hello)
    return pb.ReplicaAck(lsn=draw(u64()))


