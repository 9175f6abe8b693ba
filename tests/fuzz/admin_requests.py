"""Strategies of valid control-path requests: tables and dense tensors (with their optimizer, staleness and
sync policies), checkpoints, heartbeats, exports."""

from __future__ import annotations

import math
import string
from typing import Any, Optional

import numpy as np
from hypothesis import strategies as st

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.target import DENSE, DENSE_SHAPE, DENSE_SPEC_PB, FUZZ_DENSE, FUZZ_TABLES, TABLE, TABLE_SPEC_PB
from tests.fuzz.tensors import float_tensors, weird_tensors
from tests.fuzz.values import doubles, enum_values, i64, names, set_field, shard_maps, u32, u64, weighted


@st.composite
def optimizers(draw: Any, plain: bool = False) -> pb.OptimizerSpec:
    """An optimizer spec; ``plain``: ordinary hyperparameters (what a client sends), else anything."""
    if plain:
        opt = draw(
            st.sampled_from(
                [
                    pb.OptimizerSpec(sgd=pb.SGDSpec(lr=0.1)),
                    pb.OptimizerSpec(sgd=pb.SGDSpec(lr=0.05, momentum=0.9)),
                    pb.OptimizerSpec(adagrad=pb.AdagradSpec(lr=0.1, eps=1e-10)),
                    pb.OptimizerSpec(adam=pb.AdamSpec(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8)),
                ]
            )
        )
        return opt
    kind = draw(st.sampled_from(["sgd", "sgd", "adagrad", "adam", None]))
    if kind == "sgd":
        return pb.OptimizerSpec(
            sgd=pb.SGDSpec(
                lr=draw(doubles(0, 1)),
                momentum=draw(weighted((3, st.just(0.0)), (1, doubles(0, 1)))),
                dampening=draw(weighted((3, st.just(0.0)), (1, doubles(0, 1)))),
                weight_decay=draw(weighted((3, st.just(0.0)), (1, doubles(0, 1)))),
                nesterov=draw(st.booleans()),
            )
        )
    if kind == "adagrad":
        return pb.OptimizerSpec(
            adagrad=pb.AdagradSpec(
                lr=draw(doubles(0, 1)),
                lr_decay=draw(doubles(0, 1)),
                weight_decay=draw(doubles(0, 1)),
                initial_accumulator_value=draw(doubles(0, 1)),
                eps=draw(weighted((3, st.just(1e-10)), (1, doubles(0, 1)))),
            )
        )
    if kind == "adam":
        return pb.OptimizerSpec(
            adam=pb.AdamSpec(
                lr=draw(doubles(0, 1)),
                beta1=draw(doubles(0, 1)),
                beta2=draw(doubles(0, 1)),
                eps=draw(weighted((3, st.just(1e-8)), (1, doubles(0, 1)))),
                weight_decay=draw(doubles(0, 1)),
            )
        )
    return pb.OptimizerSpec()


@st.composite
def staleness_policies(draw: Any, plain: bool = False) -> pb.StalenessPolicy:
    if plain:
        msg = pb.StalenessPolicy(scaling=draw(st.integers(0, 2)), alpha=0.1)
        if draw(st.integers(0, 3)) == 0:
            msg.max_staleness = draw(st.integers(0, 3))
        return msg
    msg = pb.StalenessPolicy(scaling=draw(enum_values(3)), alpha=draw(doubles(0, 1)))
    if draw(st.integers(0, 3)) == 0:
        msg.max_staleness = draw(u64(3))
    return msg


@st.composite
def sync_policies(draw: Any, plain: bool = False) -> Optional[pb.SyncPolicy]:
    if draw(st.integers(0, 5)):
        return None
    if plain:
        return pb.SyncPolicy(
            workers=draw(st.integers(1, 3)),
            aggregator=draw(st.integers(0, 3)),
            trim_fraction=0.1,
            timeout_s=draw(st.floats(0.01, 0.5)),
            on_timeout=draw(st.integers(0, 2)),
        )
    return pb.SyncPolicy(
        workers=draw(weighted((4, st.integers(1, 3)), (1, u32()))),
        aggregator=draw(enum_values(4)),
        trim_fraction=draw(doubles(0, 0.5)),
        timeout_s=draw(weighted((4, st.floats(0.01, 1.0)), (1, doubles()))),
        on_timeout=draw(enum_values(3)),
    )


@st.composite
def create_table_requests(draw: Any) -> pb.CreateTableRequest:
    if draw(st.integers(0, 5)) == 0:
        spec = pb.TableSpec()
        spec.CopyFrom(TABLE_SPEC_PB)  # the existing t: a no-op
    else:
        plain = draw(st.booleans())
        if plain:
            init = pb.InitializerSpec(kind=draw(st.integers(0, 2)), std=1.0, a=0.1, seed=draw(u64()))
        else:
            init = pb.InitializerSpec(
                kind=draw(enum_values(3)),
                mean=draw(doubles()),
                std=draw(doubles(0, 2)),
                a=draw(doubles(0, 2)),
                seed=draw(u64()),
            )
        spec = pb.TableSpec(
            name=draw(names(FUZZ_TABLES[0], *FUZZ_TABLES[1:], TABLE)),
            dim=draw(st.integers(1, 16) if plain else weighted((5, st.integers(1, 16)), (1, u32()))),
            optimizer=draw(optimizers(plain)),
            initializer=init,
            staleness=draw(staleness_policies(plain)),
            allow_nonfinite=draw(st.booleans()),
        )
        if draw(st.integers(0, 3)):
            spec.num_embeddings = draw(
                st.integers(1, 5000) if plain else weighted((4, st.integers(1, 5000)), (1, i64()))
            )
        set_field(spec, "sync", draw(sync_policies(plain)))
    msg = pb.CreateTableRequest(spec=spec)
    set_field(msg, "shard_map", draw(shard_maps()))
    return msg


@st.composite
def register_dense_requests(draw: Any) -> pb.RegisterDenseRequest:
    if draw(st.integers(0, 2)) == 0:
        spec = pb.DenseSpec()
        spec.CopyFrom(DENSE_SPEC_PB)  # the existing d: first writer wins, values never change
        rows, cols = DENSE_SHAPE
    else:
        shape = draw(
            weighted(
                (6, st.lists(st.integers(1, 8), max_size=3)),
                (1, st.lists(i64(), max_size=4)),
                (1, st.lists(st.integers(0, 2), min_size=20, max_size=70)),
            )
        )
        plain = draw(st.booleans())
        spec = pb.DenseSpec(
            name=draw(names(FUZZ_DENSE[0], *FUZZ_DENSE[1:], DENSE)),
            shape=shape,
            optimizer=draw(optimizers(plain)),
            staleness=draw(staleness_policies(plain)),
            chunk_rows=draw(weighted((5, st.just(0)), (1, u64()))),
            allow_nonfinite=draw(st.booleans()),
        )
        set_field(spec, "sync", draw(sync_policies(plain)))
        small = all(0 < s <= 64 for s in shape) and len(shape) <= 3
        rows = (shape[0] if len(shape) >= 2 else 1) if small else 1
        cols = int(np.prod(shape[1:] if len(shape) >= 2 else shape)) if small else 1
    msg = pb.RegisterDenseRequest(spec=spec, row_start=draw(weighted((6, st.integers(0, 3)), (1, u64()))))
    take = draw(st.integers(0, min(rows, 8)))
    values = draw(weighted((4, float_tensors(take, cols, dtypes=(pb.FLOAT32,))), (1, weird_tensors()), (2, st.none())))
    set_field(msg, "values", values)
    set_field(msg, "shard_map", draw(shard_maps()))
    return msg


@st.composite
def checkpoint_requests(draw: Any) -> pb.CheckpointRequest:
    cid = draw(
        weighted(
            (3, st.just("")),
            (3, st.text(string.ascii_letters + string.digits + "-_", min_size=1, max_size=64)),
            (1, st.text(max_size=80)),
        )
    )
    return pb.CheckpointRequest(checkpoint_id=cid, phase=draw(enum_values(4)), hold_s=draw(doubles(-1, 1)))


@st.composite
def heartbeat_requests(draw: Any) -> pb.HeartbeatRequest:
    msg = pb.HeartbeatRequest(
        rank=draw(u32(3)),
        world_size=draw(u32(3)),
        clock=draw(u64()),
        leaving=draw(weighted((5, st.just(False)), (1, st.just(True)))),
        wait_s=draw(
            weighted((3, st.just(0.0)), (2, st.floats(0, 1.0)), (1, st.sampled_from([-1.0, -math.inf, math.nan, 1.0])))
        ),
    )
    if draw(st.integers(0, 2)) == 0:
        msg.wait_min_clock = draw(u64())
    return msg


@st.composite
def export_requests(draw: Any) -> pb.ExportRequest:
    """Every phase: holds (short), copies (mostly of t and d), pages of them, ends and aborts."""
    eid = draw(weighted((4, st.sampled_from(["e1", "e2"])), (1, st.text(string.ascii_letters + "-_", max_size=70)),
                        (1, st.text(max_size=20))))
    msg = pb.ExportRequest(
        phase=draw(weighted((6, st.integers(0, 4)), (1, enum_values(5)))), export_id=eid, hold_s=draw(doubles(-1, 1)),
        tables=draw(st.lists(names(TABLE, DENSE, *FUZZ_TABLES), max_size=2)), optimizer_state=draw(st.booleans()),
        delta=draw(st.booleans()), since_version=draw(u64()), table=draw(names(TABLE, DENSE)), offset=draw(u64()),
        max_rows=draw(u64()), read_tombstones=draw(st.booleans()),
    )
    set_field(msg, "shard_map", draw(shard_maps()))
    return msg
