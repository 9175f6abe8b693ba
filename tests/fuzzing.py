"""Fuzzing the shard's wire surface: request generators, a harness, a crash check, a report.

Generators (Hypothesis strategies of raw request bytes) cover every method of
``shardps.v1.Shard``: valid messages built from the generated classes with
ordinary and extreme field values, mutations of valid serialized messages at
the protobuf wire level (duplicated fields, non-minimal and oversized varints,
unknown fields, wrong wire types, groups, lengths past the end, packed and
unpacked repeated fields, at any depth with the enclosing lengths fixed up) and
at the byte level (truncation, bit flips, inserted and deleted bytes), and
random bytes.

The harness sends those bytes to a real shard process (``tests/procs.py``)
through a generic gRPC channel (bytes in, bytes out) and checks after every
call that the status is one a client may legitimately get (never INTERNAL or
UNKNOWN), that a refused call changed nothing (shard version, a probe pull of
table ``t`` and of dense tensor ``d``), that the process is alive and below a
memory bound. ``crash_roundtrip`` sends pushes to a shard with ``--durability
log``, kills it with SIGKILL and checks that it restarts holding exactly the
state it acknowledged.

Report mode::

    python -m tests.fuzzing --examples 400 --seed 1     # or SHARDPS_FUZZ_EXAMPLES / SHARDPS_FUZZ_SEED

starts a shard, runs the examples of every method, prints a table of method x
status code and the peak RSS, and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import string
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

import grpc
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from shardps.core.optim import SGD as _SGD
from shardps.core.specs import DenseSpec, Initializer, TableSpec, dense_spec_to_pb, table_spec_to_pb
from shardps.v1 import shardps_pb2 as pb
from tests.procs import ShardProcess, start_shard

SERVICE = "shardps.v1.Shard"
_METHODS = list(pb.DESCRIPTOR.services_by_name["Shard"].methods)
METHOD_NAMES: list[str] = [m.name for m in _METHODS]
INPUT_TYPES: dict[str, type] = {m.name: getattr(pb, m.input_type.name) for m in _METHODS}
STREAMING: set[str] = {m.name for m in _METHODS if m.client_streaming}
# Methods that may legitimately change the shard's version or the values of t and d.
PUSH_METHODS = {"Push", "PushDense", "PushBatch", "Stream"}

# The tables the setup creates; generated requests mostly target them.
TABLE, DENSE = "t", "d"
TABLE_ROWS, TABLE_DIM = 1000, 8
DENSE_SHAPE = (4, 3)
LR = 0.1
FUZZ_TABLES = ("fz0", "fz1", "fz2")
FUZZ_DENSE = ("fz3", "fz4")
KNOWN_NAMES = (TABLE, DENSE, "nope", *FUZZ_TABLES, *FUZZ_DENSE)
TABLE_SPEC = TableSpec(
    name=TABLE,
    dim=TABLE_DIM,
    num_embeddings=TABLE_ROWS,
    optimizer=_SGD(lr=LR),
    initializer=Initializer("uniform", a=0.5, seed=1),
)
DENSE_INIT = (np.arange(12, dtype=np.float32).reshape(DENSE_SHAPE) - 6) / 8
DENSE_SPEC = DenseSpec(name=DENSE, shape=DENSE_SHAPE, optimizer=_SGD(lr=LR))
TABLE_SPEC_PB = table_spec_to_pb(TABLE_SPEC)
DENSE_SPEC_PB = dense_spec_to_pb(DENSE_SPEC)
PROBE_IDS = np.arange(0, TABLE_ROWS, TABLE_ROWS // 64, dtype=np.int64)[:64]

GiB = 1 << 30
CODE_OF: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# The few codes only some methods may answer: a two-phase COMMIT that was not prepared is
# UNAVAILABLE; a heartbeat may legitimately wait (wait_s is capped at 1 s here).
ALLOWED_FOR = {"Checkpoint": {grpc.StatusCode.UNAVAILABLE}, "Heartbeat": {grpc.StatusCode.DEADLINE_EXCEEDED}}


def allowed_codes(method: str) -> set:
    return ALLOWED | ALLOWED_FOR.get(method, set())


# ==== raw protobuf wire format ===============================================================

VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5


def varint(n: int, pad: int = 0) -> bytes:
    """``n`` as a varint (negatives as 64-bit two's complement; values >= 2**64 keep their high bits),
    with ``pad`` redundant continuation bytes: varint(10, 5) == 8a 80 80 80 80 00."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            break
    if pad:
        out[-1] |= 0x80
        out += b"\x80" * (pad - 1) + b"\x00"
    return bytes(out)


@dataclasses.dataclass
class Field:
    """One field of a message as it travels: number, wire type, value, and how to mis-encode it."""

    number: int
    wt: int
    value: Union[int, bytes] = 0
    key_pad: int = 0  # redundant continuation bytes in the key
    len_pad: int = 0  # ... in the length of a LEN field
    val_pad: int = 0  # ... in a VARINT value
    len_delta: int = 0  # declared length minus actual length

    def encode(self) -> bytes:
        key = varint((self.number << 3) | self.wt, self.key_pad)
        if self.wt == VARINT:
            return key + varint(int(self.value), self.val_pad)
        if self.wt == I64:
            return key + (int(self.value) % (1 << 64)).to_bytes(8, "little")
        if self.wt == LEN:
            data = bytes(self.value) if not isinstance(self.value, int) else b""
            return key + varint(max(0, len(data) + self.len_delta), self.len_pad) + data
        if self.wt == I32:
            return key + (int(self.value) % (1 << 32)).to_bytes(4, "little")
        return key  # group start/end markers (and wire types 6/7) carry nothing


def _read_varint(buf: bytes, pos: int) -> Optional[tuple[int, int]]:
    result = shift = 0
    for i in range(10):
        if pos + i >= len(buf):
            return None
        b = buf[pos + i]
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos + i + 1
        shift += 7
    return None


def parse_fields(buf: bytes) -> Optional[list[Field]]:
    """The fields of a message, or None if ``buf`` is not a well-formed field sequence."""
    out: list[Field] = []
    pos = 0
    buf = bytes(buf)
    while pos < len(buf):
        r = _read_varint(buf, pos)
        if r is None:
            return None
        key, pos = r
        number, wt = key >> 3, key & 7
        value: Union[int, bytes] = 0
        if wt == VARINT:
            r = _read_varint(buf, pos)
            if r is None:
                return None
            value, pos = r
        elif wt in (I64, I32):
            size = 8 if wt == I64 else 4
            if pos + size > len(buf):
                return None
            value, pos = int.from_bytes(buf[pos : pos + size], "little"), pos + size
        elif wt == LEN:
            r = _read_varint(buf, pos)
            if r is None or r[1] + r[0] > len(buf):
                return None
            n, pos = r
            value, pos = buf[pos : pos + n], pos + n
        elif wt not in (SGROUP, EGROUP):
            return None
        out.append(Field(number, wt, value))
    return out


def serialize(fields: Sequence[Field]) -> bytes:
    return b"".join(f.encode() for f in fields)


def _all_varints(data: bytes) -> Optional[list[int]]:
    out, pos = [], 0
    while pos < len(data):
        r = _read_varint(data, pos)
        if r is None:
            return None
        v, pos = r
        out.append(v)
    return out


# ==== primitive values =======================================================================

U32_EDGES = (0, 1, 2, 3, 7, 8, 9, 127, 128, 255, 1000, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1)
U64_EDGES = U32_EDGES + (2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1)
I64_EDGES = (
    0,
    1,
    2,
    3,
    4,
    8,
    999,
    1000,
    -1,
    -2,
    -1000,
    2**31 - 1,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    -(2**63),
    6148914691236517206,
)
# Shapes whose element count overflows int64 (to 0, 1, 2 or negative) or has too many dimensions.
OVERFLOWING_SHAPES = (
    [2**32, 2**32],
    [2**32, 2**32, 8],
    [2**62, 4],
    [2**62, 8],
    [3, 6148914691236517206],
    [2**63 - 1, 2**63 - 1],
    [2**63 - 1, 2],
    [-1, -1],
    [-(2**63), 2],
    [2**31, 2**31, 4],
    [1] * 65,
    [1] * 70,
    [2**16] * 4,
    [2**32 + 1, 2**32 - 1],
)
SPECIAL_FLOATS = (0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 1e-300, 65504.0, 65536.0)
NAME_CHARS = string.ascii_letters + string.digits + "_.:/-"


@st.composite
def _weighted_pick(draw: Any, pairs: tuple, total: int) -> Any:
    k = draw(st.integers(0, total - 1))
    for w, strategy in pairs:
        if k < w:
            return draw(strategy)
        k -= w
    raise AssertionError("unreachable")


def weighted(*pairs: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """``one_of`` with integer weights (shrinks towards the first branch)."""
    return _weighted_pick(tuple(pairs), sum(w for w, _ in pairs))


@functools.cache
def u32(small: int = 16) -> st.SearchStrategy[int]:
    return weighted((3, st.integers(0, small)), (2, st.sampled_from(U32_EDGES)), (1, st.integers(0, 2**32 - 1)))


@functools.cache
def u64(small: int = 16) -> st.SearchStrategy[int]:
    return weighted((3, st.integers(0, small)), (2, st.sampled_from(U64_EDGES)), (1, st.integers(0, 2**64 - 1)))


@functools.cache
def i64() -> st.SearchStrategy[int]:
    return weighted((3, st.integers(0, 16)), (2, st.sampled_from(I64_EDGES)), (1, st.integers(-(2**63), 2**63 - 1)))


@functools.cache
def enum_values(known: int) -> st.SearchStrategy[int]:
    """An open proto3 enum: mostly defined values, sometimes out of range (negative included)."""
    return weighted(
        (5, st.integers(0, known - 1)),
        (1, st.sampled_from([known, known + 1, 100, -1, -2, -(2**31), 2**31 - 1])),
        (1, st.integers(-(2**31), 2**31 - 1)),
    )


@functools.cache
def doubles(lo: float = -10.0, hi: float = 10.0) -> st.SearchStrategy[float]:
    return weighted((4, st.floats(lo, hi)), (1, st.sampled_from(SPECIAL_FLOATS)), (1, st.floats()))


@functools.cache
def names(primary: str, *secondary: str, avoid: Sequence[str] = ()) -> st.SearchStrategy[str]:
    """Mostly ``primary``; sometimes one of ``secondary``, another known name, a well-formed unknown
    one, any text of 0..300 characters, non-ASCII text."""
    s = weighted(
        (14, st.just(primary)),
        (3 if secondary else 0, st.sampled_from(secondary or (primary,))),
        (1, st.sampled_from(KNOWN_NAMES)),
        (1, st.text(NAME_CHARS, min_size=1, max_size=130)),
        (1, st.text(max_size=300)),
        (1, st.text(st.characters(min_codepoint=0x80, exclude_categories=("Cs",)), max_size=40)),
    )
    return s.filter(lambda n: n not in avoid) if avoid else s


@functools.cache
def shard_maps() -> st.SearchStrategy[Optional[pb.ShardMap]]:
    return weighted(
        (12, st.none()),
        (6, st.just(pb.ShardMap(shard_index=0, num_shards=1))),
        (1, st.just(pb.ShardMap())),
        (1, st.builds(lambda i, n: pb.ShardMap(shard_index=i, num_shards=n), u32(3), u32(3))),
    )


@functools.cache
def sync_parts() -> st.SearchStrategy[Optional[pb.SyncPart]]:
    return weighted(
        (20, st.none()),
        (
            1,
            st.builds(
                lambda s, r, p, n: pb.SyncPart(step=s, rank=r, part=p, parts=n),
                st.integers(1, 3),
                st.integers(0, 2),
                st.integers(0, 1),
                st.integers(1, 2),
            ),
        ),
        (1, st.builds(lambda s, r, p, n: pb.SyncPart(step=s, rank=r, part=p, parts=n), u64(4), u32(4), u32(2), u32(2))),
    )


# ==== tensors ================================================================================


def _float_bytes(values: np.ndarray, dtype: int) -> bytes:
    with np.errstate(all="ignore"):
        if dtype == pb.FLOAT16:
            return values.astype("<f2").tobytes()
        f32 = values.astype("<f4")
        if dtype == pb.BFLOAT16:
            return (f32.view("<u4") >> np.uint32(16)).astype("<u2").tobytes()
        return f32.tobytes()


@st.composite
def float_tensors(
    draw: Any,
    rows: int,
    cols: int,
    nonfinite: bool = True,
    dtypes: Sequence[int] = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16),
) -> pb.Tensor:
    """A consistent float Tensor of shape [rows, cols]; sometimes holding NaN or Inf."""
    dtype = draw(st.sampled_from(dtypes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = rng.uniform(-2, 2, rows * cols)
    if nonfinite and values.size and draw(st.integers(0, 9)) == 0:
        values[draw(st.integers(0, values.size - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e6]))
    return pb.Tensor(dtype=dtype, shape=[rows, cols], data=_float_bytes(values, dtype))


def _int64_tensor(ids: Sequence[int], shape: Optional[Sequence[int]] = None) -> pb.Tensor:
    data = np.asarray(ids, dtype=np.int64).astype("<i8").tobytes()
    return pb.Tensor(dtype=pb.INT64, shape=list(shape) if shape is not None else [len(ids)], data=data)


@st.composite
def id_lists(draw: Any, n: int, hi: int = TABLE_ROWS, in_range: bool = True, edges: bool = True) -> list[int]:
    """``n`` ids in [0, hi); unless ``in_range``, one is an edge value (negative, hi, 2^63 - 1, ...),
    and with ``edges`` sometimes anyway."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = [int(x) for x in rng.integers(0, hi, n)]
    if ids and (not in_range or (edges and draw(st.integers(0, 7)) == 0)):
        ids[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, hi, hi - 1, 2**63 - 1, -(2**63), 2**40, 0]))
    return ids


@st.composite
def weird_tensors(draw: Any) -> pb.Tensor:
    """Whatever: any dtype, up to 70 shape entries of any int64, any payload."""
    shape = draw(
        weighted(
            (3, st.lists(st.integers(0, 9), max_size=4)),
            (2, st.lists(i64(), max_size=6)),
            (1, st.lists(st.sampled_from([0, 1, 2, -1, 2**32, 2**63 - 1]), min_size=30, max_size=70)),
            (1, st.lists(st.just(1), min_size=33, max_size=70)),
            (2, st.sampled_from(OVERFLOWING_SHAPES)),
        )
    )
    data = draw(
        weighted(
            (3, st.binary(max_size=64)),
            (2, st.just(b"")),
            (1, st.integers(0, 64).map(lambda k: b"\0" * (8 * k))),
            (1, st.sampled_from([b"\0" * 4, b"\0" * 8, b"\0" * 16])),
        )
    )
    return pb.Tensor(dtype=draw(enum_values(5)), shape=shape, data=data)


@st.composite
def lying_tensors(draw: Any, base: pb.Tensor) -> pb.Tensor:
    """``base`` with one thing wrong: dtype, shape, or payload length."""
    t = pb.Tensor()
    t.CopyFrom(base)
    how = draw(st.integers(0, 4))
    if how == 0:
        t.dtype = draw(enum_values(5))
    elif how == 1:
        t.ClearField("shape")
        t.shape.extend(draw(st.lists(i64(), max_size=4)))
    elif how == 2:
        t.data = t.data[: draw(st.integers(0, max(0, len(t.data) - 1)))]
    elif how == 3:
        t.data = t.data + draw(st.binary(min_size=1, max_size=9))
    else:  # consistent element count, many dimensions
        count = int(np.prod(list(t.shape))) if len(t.shape) else 1
        extra = draw(st.integers(1, 66))
        t.ClearField("shape")
        t.shape.extend([1] * extra + [count])
    return t


# ==== valid messages =========================================================================


def _set(msg: Any, field: str, value: Any) -> None:
    if value is None:
        return
    target = getattr(msg, field)
    if isinstance(value, (pb.Tensor, pb.ShardMap, pb.SyncPart)) or hasattr(value, "DESCRIPTOR"):
        target.CopyFrom(value)
    else:
        setattr(msg, field, value)


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
        ids_t = _int64_tensor(ids)
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
    _set(msg, "grads", grads)
    if draw(st.integers(0, 3)) == 0:
        msg.pulled_version = draw(u64())
    msg.client_id = draw(
        weighted((6, st.just("")), (2, st.sampled_from(["fuzz", "fuzz-2"])), (1, st.text(max_size=40)))
    )
    msg.seq = draw(u64(1000))
    if not valid:
        _set(msg, "shard_map", draw(shard_maps()))
        _set(msg, "sync", draw(sync_parts()))
    return msg


@st.composite
def pull_requests(draw: Any) -> pb.PullRequest:
    msg = pb.PullRequest(table=draw(names(TABLE, *FUZZ_TABLES)), wire_dtype=draw(_wire_dtypes()))
    n = draw(weighted((8, st.integers(1, 64)), (1, st.just(0)), (1, st.integers(65, 300))))
    ids = _int64_tensor(draw(id_lists(n, in_range=draw(st.integers(0, 9)) > 0)))
    ids = draw(weighted((8, st.just(ids)), (1, weird_tensors()), (1, lying_tensors(ids)), (1, st.none())))
    _set(msg, "ids", ids)
    _set(msg, "shard_map", draw(shard_maps()))
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
    _set(msg, "shard_map", draw(shard_maps()))
    return msg


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
        _set(spec, "sync", draw(sync_policies(plain)))
    msg = pb.CreateTableRequest(spec=spec)
    _set(msg, "shard_map", draw(shard_maps()))
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
        _set(spec, "sync", draw(sync_policies(plain)))
        small = all(0 < s <= 64 for s in shape) and len(shape) <= 3
        rows = (shape[0] if len(shape) >= 2 else 1) if small else 1
        cols = int(np.prod(shape[1:] if len(shape) >= 2 else shape)) if small else 1
    msg = pb.RegisterDenseRequest(spec=spec, row_start=draw(weighted((6, st.integers(0, 3)), (1, u64()))))
    take = draw(st.integers(0, min(rows, 8)))
    values = draw(weighted((4, float_tensors(take, cols, dtypes=(pb.FLOAT32,))), (1, weird_tensors()), (2, st.none())))
    _set(msg, "values", values)
    _set(msg, "shard_map", draw(shard_maps()))
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
    _set(msg, "shard_map", draw(shard_maps()))
    return msg


@st.composite
def assign_requests(draw: Any) -> pb.AssignRequest:
    n = draw(weighted((8, st.integers(1, 16)), (1, st.just(0)), (1, st.integers(17, 300))))
    ids = draw(weighted((6, st.just(_int64_tensor(draw(id_lists(n, in_range=draw(st.integers(0, 9)) > 0))))),
                        (1, weird_tensors()), (1, st.none())))
    msg = pb.AssignRequest(table=draw(names(TABLE, *FUZZ_TABLES)))
    _set(msg, "ids", ids)
    _set(msg, "values", draw(weighted((6, float_tensors(n, draw(weighted((6, st.just(TABLE_DIM)), (1, st.integers(0, 9)))))),
                                      (1, weird_tensors()), (1, st.none()))))
    _set(msg, "shard_map", draw(shard_maps()))
    return msg


VALID: dict[type, st.SearchStrategy] = {
    pb.CreateTableRequest: create_table_requests(),
    pb.DescribeTableRequest: st.builds(lambda n: pb.DescribeTableRequest(name=n), names(TABLE, DENSE, *FUZZ_TABLES)),
    pb.DropTableRequest: st.builds(
        lambda n: pb.DropTableRequest(name=n), names("nope", *FUZZ_TABLES, *FUZZ_DENSE, avoid=(TABLE, DENSE))
    ),
    pb.PullRequest: pull_requests(),
    pb.PushRequest: push_requests(),
    pb.RegisterDenseRequest: register_dense_requests(),
    pb.PullDenseRequest: pull_dense_requests(),
    pb.PushDenseRequest: push_requests(dense=True),
    pb.PullBatchRequest: pull_batch_requests(),
    pb.PushBatchRequest: push_batch_requests(),
    pb.StreamRequest: stream_requests(),
    pb.ShardInfoRequest: st.just(pb.ShardInfoRequest()),
    pb.CheckpointRequest: checkpoint_requests(),
    pb.HeartbeatRequest: heartbeat_requests(),
    pb.ExportRequest: export_requests(),
    pb.AssignRequest: assign_requests(),
}
_missing = set(INPUT_TYPES.values()) - set(VALID)
assert not _missing, f"no generator for {_missing}"


def messages(cls: type) -> st.SearchStrategy:
    """Valid (well-typed) messages of ``cls``, with sensible and extreme field values."""
    return VALID[cls]


@functools.cache
def serialized(cls: type) -> st.SearchStrategy[bytes]:
    """``messages(cls)``, serialized: canonical encodings."""
    return VALID[cls].map(lambda m: m.SerializeToString())


# ==== mutations ==============================================================================


def _pick(draw: Any, fields: list[Field], pred: Callable[[Field], bool] = lambda f: True) -> Optional[int]:
    idx = [i for i, f in enumerate(fields) if pred(f)]
    return draw(st.sampled_from(idx)) if idx else None


def _random_value(draw: Any, wt: int) -> Union[int, bytes]:
    if wt == VARINT:
        return draw(u64())
    if wt == LEN:
        return draw(st.binary(max_size=24))
    if wt == I64:
        return draw(st.integers(0, 2**64 - 1))
    return draw(st.integers(0, 2**32 - 1))


def _op_dup(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    i = _pick(draw, fields)
    if i is None:
        return _op_unknown(draw, fields, depth)
    copy = dataclasses.replace(fields[i])
    if draw(st.booleans()):  # the copy differs: another value, or a changed sub-message
        if copy.wt == VARINT:
            copy.value = draw(u64())
        elif copy.wt == LEN:
            sub = parse_fields(bytes(copy.value))  # type: ignore[arg-type]
            copy.value = serialize(_mutate_fields(draw, sub, depth + 1)) if sub else draw(st.binary(max_size=16))
    where = draw(st.sampled_from(["end", "after", "start"]))
    pos = len(fields) if where == "end" else (i + 1 if where == "after" else 0)
    return fields[:pos] + [copy] + fields[pos:]


def _op_overlong_key(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    i = _pick(draw, fields)
    if i is not None:
        fields[i].key_pad = draw(weighted((3, st.integers(1, 4)), (1, st.integers(5, 11))))
    return fields


def _op_overlong_len(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    i = _pick(draw, fields, lambda f: f.wt == LEN)
    if i is not None:
        fields[i].len_pad = draw(weighted((3, st.integers(1, 4)), (1, st.integers(5, 11))))
    return fields


def _op_overlong_value(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    i = _pick(draw, fields, lambda f: f.wt == VARINT)
    if i is not None:
        fields[i].val_pad = draw(st.integers(1, 11))
    return fields


def _op_huge_varint(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    """A varint value of 10 bytes with bits above 2**64, or of 11 bytes."""
    i = _pick(draw, fields, lambda f: f.wt == VARINT)
    value = draw(
        st.one_of(
            st.integers(2**64, 2**70 - 1), st.integers(2**70, 2**77 - 1), st.sampled_from([2**64, 2**64 + 1, 2**70 - 1])
        )
    )
    if i is None:
        number = draw(st.sampled_from(sorted({f.number for f in fields}) or [1]))
        return fields + [Field(number, VARINT, value)]
    fields[i].value = value
    return fields


def _op_negative_varint(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    """A varint field (an existing field's number: e.g. an unpacked negative shape entry) holding a negative int64."""
    value = (1 << 64) - draw(st.one_of(st.integers(1, 16), st.integers(1, 2**63)))
    number = draw(st.sampled_from(sorted({f.number for f in fields}) or [2]))
    pos = draw(st.integers(0, len(fields)))
    return fields[:pos] + [Field(number, VARINT, value)] + fields[pos:]


def _op_unknown(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    wt = draw(st.sampled_from([VARINT, I64, LEN, I32]))
    number = draw(
        weighted(
            (3, st.integers(9, 40)),
            (1, st.sampled_from([15, 16, 2047, 2048, 2**29 - 1])),
            (1, st.integers(9, 2**29 - 1)),
        )
    )
    pos = draw(st.integers(0, len(fields)))
    return fields[:pos] + [Field(number, wt, _random_value(draw, wt))] + fields[pos:]


def _op_field_zero(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    wt = draw(st.sampled_from([VARINT, I64, LEN, I32]))
    pos = draw(st.integers(0, len(fields)))
    return fields[:pos] + [Field(0, wt, _random_value(draw, wt))] + fields[pos:]


def _op_wrong_wire_type(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    i = _pick(draw, fields)
    if i is None:
        return _op_unknown(draw, fields, depth)
    f = fields[i]
    wt = draw(st.sampled_from([w for w in (VARINT, I64, LEN, I32) if w != f.wt]))
    if wt == LEN:
        value: Union[int, bytes] = varint(f.value) if isinstance(f.value, int) else bytes(f.value)
    elif isinstance(f.value, int):
        value = f.value
    else:
        value = len(f.value)
    fields[i] = Field(f.number, wt, value)
    return fields


def _op_group(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    """Group markers (wire types 3 and 4): matched around some fields, or unmatched."""
    number = draw(st.sampled_from(sorted({f.number for f in fields} | {1, 2, 3, 9, 100})))
    a = draw(st.integers(0, len(fields)))
    b = draw(st.integers(a, len(fields)))
    kind = draw(st.sampled_from(["matched", "matched", "start", "end", "mismatched"]))
    start, end = Field(number, SGROUP), Field(number if kind != "mismatched" else number + 1, EGROUP)
    if kind == "start":
        return fields[:a] + [start] + fields[a:]
    if kind == "end":
        return fields[:a] + [end] + fields[a:]
    return fields[:a] + [start] + fields[a:b] + [end] + fields[b:]


def _op_length_off(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    """A LEN field whose declared length is past its end (or short of it)."""
    i = _pick(draw, fields, lambda f: f.wt == LEN)
    if i is not None:
        n = len(fields[i].value) if not isinstance(fields[i].value, int) else 0
        fields[i].len_delta = draw(
            weighted(
                (3, st.integers(1, 16)),
                (1, st.integers(-n, -1) if n else st.just(1)),
                (1, st.sampled_from([2**31, 2**32 - 1, 2**63])),
            )
        )
    return fields


def _op_drop(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    i = _pick(draw, fields)
    return fields if i is None else fields[:i] + fields[i + 1 :]


def _op_swap(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    if len(fields) >= 2:
        i, j = draw(st.integers(0, len(fields) - 1)), draw(st.integers(0, len(fields) - 1))
        fields[i], fields[j] = fields[j], fields[i]
    return fields


def _op_unpack(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    """A packed repeated field (e.g. Tensor.shape) written unpacked, or half packed and half not."""
    i = _pick(draw, fields, lambda f: f.wt == LEN and bool(f.value) and _all_varints(bytes(f.value)) is not None)  # type: ignore[arg-type]
    if i is None:
        return _op_pack(draw, fields, depth)
    f = fields[i]
    values = _all_varints(bytes(f.value))  # type: ignore[arg-type]
    assert values is not None
    k = draw(st.integers(0, len(values)))
    packed = [Field(f.number, LEN, b"".join(varint(v) for v in values[:k]))] if k else []
    unpacked = [Field(f.number, VARINT, v) for v in values[k:]]
    middle = unpacked + packed if draw(st.booleans()) else packed + unpacked
    return fields[:i] + middle + fields[i + 1 :]


def _op_pack(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    """A varint field written packed (LEN holding varints)."""
    i = _pick(draw, fields, lambda f: f.wt == VARINT)
    if i is None:
        return fields
    fields[i] = Field(fields[i].number, LEN, varint(int(fields[i].value)))
    return fields


def _op_append_message(draw: Any, fields: list[Field], depth: int, cls: Optional[type] = None) -> list[Field]:
    """Another whole message concatenated (protobuf merges them; a oneof keeps the last)."""
    if cls is None or depth:
        return _op_dup(draw, fields, depth)
    other = parse_fields(draw(serialized(cls))) or []
    return fields + other


STRUCTURAL_OPS = [
    _op_dup,
    _op_dup,
    _op_overlong_key,
    _op_overlong_len,
    _op_overlong_value,
    _op_huge_varint,
    _op_negative_varint,
    _op_unknown,
    _op_field_zero,
    _op_wrong_wire_type,
    _op_group,
    _op_length_off,
    _op_drop,
    _op_swap,
    _op_unpack,
    _op_pack,
]


def _mutate_fields(draw: Any, fields: Optional[list[Field]], depth: int, cls: Optional[type] = None) -> list[Field]:
    fields = [dataclasses.replace(f) for f in (fields or [])]
    nested = [
        i
        for i, f in enumerate(fields)
        if f.wt == LEN and f.value and not isinstance(f.value, int) and parse_fields(bytes(f.value))
    ]
    if nested and depth < 3 and draw(st.booleans()):  # descend into a sub-message; its length is fixed up
        i = draw(st.sampled_from(nested))
        fields[i].value = serialize(_mutate_fields(draw, parse_fields(bytes(fields[i].value)), depth + 1))  # type: ignore[arg-type]
        return fields
    if cls is not None and depth == 0 and draw(st.integers(0, 9)) == 0:
        return _op_append_message(draw, fields, depth, cls)
    op = draw(st.sampled_from(STRUCTURAL_OPS))
    return op(draw, fields, depth)


def _byte_mutation(draw: Any, buf: bytes) -> bytes:
    how = draw(st.sampled_from(["truncate", "flip", "insert", "delete", "overwrite"]))
    if not buf:
        return draw(st.binary(min_size=1, max_size=8))
    i = draw(st.integers(0, len(buf) - 1))
    if how == "truncate":
        return buf[:i]
    if how == "flip":
        return buf[:i] + bytes([buf[i] ^ (1 << draw(st.integers(0, 7)))]) + buf[i + 1 :]
    if how == "insert":
        return buf[:i] + draw(st.binary(min_size=1, max_size=12)) + buf[i:]
    if how == "delete":
        return buf[:i] + buf[i + draw(st.integers(1, 12)) :]
    return buf[:i] + bytes([draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF, 0x0A, 0x12]))]) + buf[i + 1 :]


@st.composite
def _mutated(draw: Any, base: st.SearchStrategy[bytes], cls: Optional[type], byte_level: bool, max_ops: int) -> bytes:
    buf = draw(base)
    for _ in range(draw(st.integers(1, max_ops))):
        fields = parse_fields(buf)
        if byte_level and (fields is None or draw(st.integers(0, 3)) == 0):
            buf = _byte_mutation(draw, buf)
        elif fields is not None:
            buf = serialize(_mutate_fields(draw, fields, 0, cls))
    return buf


def mutated(
    base: st.SearchStrategy[bytes], cls: Optional[type] = None, byte_level: bool = True, max_ops: int = 3
) -> st.SearchStrategy[bytes]:
    """Messages from ``base`` with 1..max_ops mutations: structural ones (at any depth, enclosing
    lengths fixed up) and, with ``byte_level``, raw byte ones (truncation, bit flips, ...)."""
    return _mutated(base, cls, byte_level, max_ops)


@st.composite
def field_soup(draw: Any) -> bytes:
    """Random fields with small numbers: plausible-looking garbage."""
    out = []
    for _ in range(draw(st.integers(0, 8))):
        wt = draw(st.sampled_from([VARINT, I64, LEN, I32, SGROUP, EGROUP]))
        out.append(Field(draw(st.integers(0, 12)), wt, _random_value(draw, wt) if wt not in (SGROUP, EGROUP) else 0))
    return serialize(out)


def _short_wait(buf: bytes) -> bool:
    """Heartbeats may wait up to wait_s for a clock: keep that at 1 s (a long wait is a legitimate slow answer)."""
    try:
        msg = pb.HeartbeatRequest.FromString(buf)
    except Exception:  # noqa: BLE001 - not parseable: answered at once
        return True
    return not (msg.HasField("wait_min_clock") and not msg.wait_s <= 1.0 and not math.isnan(msg.wait_s))


@functools.cache
def request_bytes(cls: type) -> st.SearchStrategy[bytes]:
    """Raw request bytes for messages of ``cls``: valid, mutated valid, or random."""
    valid = serialized(cls)
    s = weighted((5, valid), (4, mutated(valid, cls)), (1, st.binary(max_size=400)), (1, field_soup()))
    return s.filter(_short_wait) if cls is pb.HeartbeatRequest else s


@functools.cache
def method_payloads(method: str) -> st.SearchStrategy:
    """What one call of ``method`` sends: bytes, or for a streaming method a list of 1..4 frames."""
    one = request_bytes(INPUT_TYPES[method])
    return st.lists(one, min_size=1, max_size=4) if method in STREAMING else one


# ==== the two exact regressions ==============================================================


def valid_push_bytes(ids: Sequence[int] = (1, 2), value: float = 1.0) -> bytes:
    grads = np.full((len(ids), TABLE_DIM), value, np.float32)
    return pb.PushRequest(
        table=TABLE,
        ids=_int64_tensor(ids),
        grads=pb.Tensor(dtype=pb.FLOAT32, shape=list(grads.shape), data=grads.tobytes()),
    ).SerializeToString()


def overlong_tag_push() -> bytes:
    """A valid push whose first tag (0x0a: field 1, LEN) is written as the 6-byte varint 8a 80 80 80 80 00."""
    buf = valid_push_bytes((3, 4), 0.5)
    assert buf[0] == 0x0A
    return bytes.fromhex("8a8080808000") + buf[1:]


def duplicated_grads_push() -> bytes:
    """A valid push with its grads field (3) appended a second time."""
    buf = valid_push_bytes((5, 6), 0.25)
    fields = parse_fields(buf)
    assert fields is not None
    grads = [f for f in fields if f.number == 3]
    return buf + grads[0].encode()


REGRESSIONS = {"overlong tag": overlong_tag_push, "duplicated grads": duplicated_grads_push}


# ==== the harness ============================================================================


def read_rss(pid: int) -> Optional[int]:
    """Resident set size of a process in bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssWatch(threading.Thread):
    """Polls a process's RSS; kills it (SIGKILL) past ``limit`` bytes so a runaway never takes the machine down."""

    def __init__(self, proc: subprocess.Popen, limit: int, interval: float = 0.02) -> None:
        super().__init__(daemon=True, name="rss-watch")
        self.proc, self.limit, self.interval = proc, limit, interval
        self.peak = 0
        self.exceeded: Optional[int] = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            rss = read_rss(self.proc.pid)
            if rss is None or self.proc.poll() is not None:
                return
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                self.exceeded = rss
                self.proc.kill()
                return

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


@dataclasses.dataclass
class Failure:
    method: str
    kind: str  # "status", "state", "crash", "memory", "unresponsive", "stream", "restart", "harness"
    detail: str
    payload: Union[bytes, list, None] = None
    cause: str = ""

    def key(self) -> tuple:
        return (self.method, self.kind, re.sub(r"\d+", "N", self.cause or self.detail.split("\n")[0])[:160])

    def size(self) -> int:
        if isinstance(self.payload, list):
            return sum(len(p) for p in self.payload)
        return len(self.payload or b"")

    def payload_hex(self, limit: int = 4096) -> str:
        def h(b: bytes) -> str:
            return b.hex() if len(b) <= limit else f"{b[:limit].hex()}... ({len(b)} bytes)"

        if isinstance(self.payload, list):
            return " | ".join(h(p) for p in self.payload)
        return h(self.payload or b"")


State = tuple[int, bytes, bytes]  # version, serialized rows of t, serialized rows of d


def _exception_line(text: str) -> str:
    """The exception line (``ValueError: ...``) of the last traceback in a shard log."""
    start = text.rfind("Traceback (most recent call last):")
    if start >= 0:
        for line in text[start:].splitlines()[1:]:
            if line and not line[0].isspace() and re.match(r"^[A-Za-z_][\w.]*(: |$)", line):
                return line[:300]
    hits = [ln.strip() for ln in text.splitlines() if re.match(r"^\s*[\w.]+(Error|Exception)\b", ln)]
    return hits[-1][:300] if hits else ""


def compare_push(d: Any, msg: Any, dense: bool) -> list[str]:
    """Where a push decoded by shardps.core.wire (``d``) and protobuf's parse of the same bytes (``msg``) differ."""
    from shardps.core import codec

    problems: list[str] = []

    def tensor(t: pb.Tensor, what: str) -> Optional[np.ndarray]:
        try:
            return codec.decode(t, what)
        except Exception as e:  # noqa: BLE001 - any failure to decode what wire decoded is a disagreement
            problems.append(f"{what}: wire decoded it, but protobuf's Tensor does not decode ({type(e).__name__}: {e})")
            return None

    def same(what: str, got: Optional[np.ndarray], ref: Optional[np.ndarray]) -> None:
        if ref is None:
            return
        if got is None:
            problems.append(f"{what}: wire has none, protobuf has shape {list(ref.shape)}")
        elif got.dtype != ref.dtype or got.shape != ref.shape or got.tobytes() != ref.tobytes():
            problems.append(
                f"{what}: wire {got.dtype} {list(got.shape)} {got.tobytes()[:32].hex()}... != "
                f"protobuf {ref.dtype} {list(ref.shape)} {ref.tobytes()[:32].hex()}..."
            )

    name = msg.name if dense else msg.table
    if d.name != name:
        problems.append(f"name: wire {d.name!r} != protobuf {name!r}")
    if dense:
        if d.row_start != msg.row_start:
            problems.append(f"row_start: wire {d.row_start} != protobuf {msg.row_start}")
    elif msg.HasField("ids"):
        if msg.ids.dtype != pb.INT64:
            problems.append(f"ids: wire accepted them, protobuf reads dtype {msg.ids.dtype}")
        same("ids", d.ids, tensor(msg.ids, "ids"))
    elif d.ids is None or d.ids.size:
        problems.append(f"ids: protobuf has none, wire has {None if d.ids is None else list(d.ids.shape)}")
    if not msg.HasField("grads"):
        problems.append("grads: wire has grads, protobuf has none")
    else:
        same("grads", d.grads, tensor(msg.grads, "grads"))
    pulled = msg.pulled_version if msg.HasField("pulled_version") else None
    if d.pulled_version != pulled:
        problems.append(f"pulled_version: wire {d.pulled_version} != protobuf {pulled}")
    if d.client_id != msg.client_id:
        problems.append(f"client_id: wire {d.client_id!r} != protobuf {msg.client_id!r}")
    if d.seq != msg.seq:
        problems.append(f"seq: wire {d.seq} != protobuf {msg.seq}")
    for field in ("shard_map", "sync"):
        ref_msg = getattr(msg, field) if msg.HasField(field) else None
        got = getattr(d, field)
        if (got is None) != (ref_msg is None) or (got is not None and got != ref_msg):
            problems.append(f"{field}: wire {got!r} != protobuf {ref_msg!r}".replace("\n", " "))
    return problems


def replay_suspect(dense: bool, buf: bytes) -> Optional[str]:
    """Why an acknowledged push might not replay from the log: protobuf cannot parse it, or parses it
    to something else than the live decoder did. None if it looks fine."""
    from google.protobuf.message import DecodeError

    from shardps.core import wire

    cls = pb.PushDenseRequest if dense else pb.PushRequest
    try:
        msg = cls.FromString(buf)
    except DecodeError as e:
        return f"protobuf cannot parse it ({e})"
    try:
        d = wire.decode_push(buf, dense=dense)
    except Exception:  # noqa: BLE001 - refused live: not what was acknowledged
        return None
    problems = compare_push(d, msg, dense)
    return "; ".join(problems) if problems else None


def push_entries(method: str, payload: bytes) -> list[tuple[bool, bytes]]:
    """The pushes inside an acknowledged call or stream frame: (dense, serialized push)."""
    if method == "Push":
        return [(False, payload)]
    if method == "PushDense":
        return [(True, payload)]
    fields = parse_fields(payload) or []
    if method == "PushBatch":
        return [(f.number == 2, bytes(f.value)) for f in fields if f.wt == LEN and f.number in (1, 2)]  # type: ignore[arg-type]
    out: list[tuple[bool, bytes]] = []  # a Stream frame
    for f in fields:
        if f.wt == LEN and f.number in (1, 2):
            out.append((f.number == 2, bytes(f.value)))  # type: ignore[arg-type]
        elif f.wt == LEN and f.number == 3:
            out += push_entries("PushBatch", bytes(f.value))  # type: ignore[arg-type]
    return out


class Harness:
    """A shard process under fuzzing: raw calls, status and state checks, memory watch, restarts."""

    def __init__(
        self,
        workdir: pathlib.Path,
        deadline: float = 10.0,
        rss_limit: int = int(1.5 * GiB),
        durability: str = "log",
        max_crashes_per_method: int = 3,
        env: Optional[dict] = None,
        log: Callable[[str], None] = lambda s: None,
    ) -> None:
        self.workdir = pathlib.Path(workdir)
        self.deadline, self.rss_limit, self.durability = deadline, rss_limit, durability
        self.max_crashes_per_method = max_crashes_per_method
        self.env = env
        self.log = log
        self.counts: collections.Counter = collections.Counter()
        self.failures: list[Failure] = []
        self.crashes: collections.Counter = collections.Counter()
        self.restarts = 0
        self.rss_peak = 0
        self.shard: Optional[ShardProcess] = None
        self.watch: Optional[RssWatch] = None
        self.channel: Optional[grpc.Channel] = None
        self.data_dir: Optional[pathlib.Path] = None
        self.baseline: Optional[State] = None
        self._incarnation = 0
        self._calls: dict[str, Any] = {}
        self._pending: list[tuple[grpc.StatusCode, Failure]] = []
        self._bricked: set[pathlib.Path] = set()
        self.acked: list[tuple[bool, bytes]] = []  # pushes acknowledged on the current data dir
        self.restart_checks = 0

    # ---- process ----------------------------------------------------------------------

    def start(self, data_dir: Optional[pathlib.Path] = None, setup: bool = True) -> None:
        if data_dir is None:
            self.acked = []
        self._incarnation += 1
        self.data_dir = data_dir or self.workdir / f"data-{self._incarnation}"
        extra = ["--durability", self.durability, "--worker-timeout", "1", "--log-level", "INFO"]
        self.shard = start_shard(0, 1, self.workdir, str(self.data_dir), extra=extra, env=self.env)
        self.watch = RssWatch(self.shard.proc, self.rss_limit)
        self.watch.start()
        self._connect()
        if setup:
            setup_tables(self.shard.address)
        self.baseline = self.state()

    def _connect(self) -> None:
        if self.channel is not None:
            self.channel.close()
        assert self.shard is not None
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self.channel = grpc.insecure_channel(self.shard.address, options=opts)
        self._calls = {}

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.rss_peak = max(self.rss_peak, self.watch.peak)
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.shard is not None and self.shard.proc.poll() is None:
            self.shard.kill()

    def restart_fresh(self, method: str = "") -> None:
        """After a crash or hang: the killed shard must restart on its data dir (holding the last state
        seen, unless the call that killed it was a push); then a new shard on a new data dir, set up again."""
        self.stop()
        self.restarts += 1
        last, data_dir = self.baseline, self.data_dir
        if self.durability == "log" and data_dir is not None and data_dir not in self._bricked:
            try:
                self.start(data_dir, setup=False)
            except Exception as e:  # noqa: BLE001
                self._bricked.add(data_dir)
                self._restart_failure(
                    method or "(restart)", "after a kill, the shard does not restart on its data dir", e
                )
            else:
                if method not in PUSH_METHODS and self.baseline != last:
                    self.fail(
                        method or "(restart)",
                        "restart",
                        "after a kill and a restart on the data dir, the state differs from the last one seen",
                    )
            self.stop()
        self.start()

    def alive(self) -> bool:
        return self.shard is not None and self.shard.proc.poll() is None

    def _log_size(self) -> int:
        try:
            return self.shard.log_path.stat().st_size if self.shard else 0
        except OSError:
            return 0

    def _log_since(self, pos: int) -> str:
        if not self.shard:
            return ""
        with open(self.shard.log_path, "rb") as f:
            f.seek(pos)
            return f.read().decode(errors="replace")

    # ---- calls ------------------------------------------------------------------------

    def unary(
        self, method: str, data: bytes, timeout: Optional[float] = None
    ) -> tuple[grpc.StatusCode, Optional[bytes], str]:
        fn = self._calls.get(method)
        if fn is None:
            assert self.channel is not None
            fn = self._calls[method] = self.channel.unary_unary(
                f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=None
            )
        try:
            return grpc.StatusCode.OK, fn(data, timeout=timeout or self.deadline), ""
        except grpc.RpcError as e:
            return e.code(), None, e.details() or ""

    def stream(self, frames: list[bytes]) -> tuple[grpc.StatusCode, list[bytes], str]:
        """(status of the call, answers received, details)."""
        assert self.channel is not None
        fn = self.channel.stream_stream(f"/{SERVICE}/Stream", request_serializer=None, response_deserializer=None)
        answers: list[bytes] = []
        try:
            for answer in fn(iter(frames), timeout=self.deadline):
                answers.append(answer)
        except grpc.RpcError as e:
            return e.code(), answers, e.details() or ""
        return grpc.StatusCode.OK, answers, ""

    def state(self, full: bool = False) -> State:
        """Version, rows of t (the probe ids, or all rows) and rows of d; raises if the shard cannot answer."""
        code, info, details = self.unary("ShardInfo", b"")
        if code != grpc.StatusCode.OK or info is None:
            raise ProbeError(f"ShardInfo: {code.name} {details}")
        ids = np.arange(TABLE_ROWS, dtype=np.int64) if full else PROBE_IDS
        code, rows, details = self.unary(
            "Pull", pb.PullRequest(table=TABLE, ids=_int64_tensor(ids)).SerializeToString()
        )
        if code != grpc.StatusCode.OK or rows is None:
            raise ProbeError(f"Pull t: {code.name} {details}", code)
        req = pb.PullDenseRequest(name=DENSE, row_start=0, row_end=DENSE_SHAPE[0])
        code, dense, details = self.unary("PullDense", req.SerializeToString())
        if code != grpc.StatusCode.OK or dense is None:
            raise ProbeError(f"PullDense d: {code.name} {details}", code)
        return (
            pb.ShardInfoResponse.FromString(info).version,
            pb.PullResponse.FromString(rows).rows.SerializeToString(),
            pb.PullResponse.FromString(dense).rows.SerializeToString(),
        )

    # ---- one fuzz example -------------------------------------------------------------

    def fail(self, method: str, kind: str, detail: str, payload: Any = None, cause: str = "") -> None:
        f = Failure(method, kind, detail, payload, cause)
        self.failures.append(f)
        self.log(f"FAIL [{method}] {kind}: {detail.splitlines()[0] if detail else ''} {cause}")

    def exercise(self, method: str, payload: Union[bytes, list[bytes]]) -> list[grpc.StatusCode]:
        """Send one call; check its status codes, the shard's state and health. Returns the codes seen."""
        if self.crashes[method] >= self.max_crashes_per_method:
            self.counts[(method, "SKIPPED")] += 1
            return []
        if not self.alive():
            self.restart_fresh()
        log_pos = self._log_size()
        codes: list[grpc.StatusCode] = []
        may_change = False
        if method in STREAMING:
            frames = list(payload)  # type: ignore[arg-type]
            call_code, answers, details = self.stream(frames)
            self.counts[(f"{method}[call]", call_code.name)] += 1
            if call_code != grpc.StatusCode.OK:
                codes.append(call_code)
                if call_code not in allowed_codes(method):
                    self._status_failure(method, call_code, details, payload, log_pos)
            elif len(answers) != len(frames):
                self.fail(method, "stream", f"stream answered {len(answers)} of {len(frames)} frames", payload)
            for frame, answer in zip(frames, answers):
                try:
                    resp = pb.StreamResponse.FromString(answer)
                except Exception as e:  # noqa: BLE001
                    self.fail(method, "stream", f"unparseable StreamResponse {answer[:64].hex()}: {e}", payload)
                    continue
                which = resp.WhichOneof("result")
                if which == "error":
                    code = CODE_OF.get(resp.error.code)
                    if code is None:
                        self.fail(method, "stream", f"StreamError with unknown code {resp.error.code}", payload)
                        continue
                    if code == grpc.StatusCode.ABORTED:
                        may_change = True  # a push batch: its other entries were applied
                    if code not in allowed_codes(method):
                        self._status_failure(method, code, resp.error.message, payload, log_pos)
                else:
                    code = grpc.StatusCode.OK
                    if which in ("push", "push_dense", "push_batch"):
                        may_change = True
                        self.acked += push_entries("Stream", frame)
                self.counts[(method, code.name)] += 1
                codes.append(code)
        else:
            code, _, details = self.unary(method, payload)  # type: ignore[arg-type]
            self.counts[(method, code.name)] += 1
            codes.append(code)
            if code not in allowed_codes(method):
                self._status_failure(method, code, details, payload, log_pos)
            if method in PUSH_METHODS and (
                code == grpc.StatusCode.OK or (method == "PushBatch" and code == grpc.StatusCode.ABORTED)
            ):
                may_change = True
                self.acked += push_entries(method, payload)  # type: ignore[arg-type]
            if method == "Assign" and code == grpc.StatusCode.OK:  # rows set: a new version, logged
                may_change = True
        if method == "Checkpoint":  # a PREPARE would hold pushes back: always resume
            self.unary("Checkpoint", pb.CheckpointRequest(phase=pb.CheckpointRequest.ABORT).SerializeToString())
        if method == "Export":  # likewise, and free the copies
            for phase in (pb.ExportRequest.ABORT, pb.ExportRequest.END):
                for eid in ("e1", "e2"):
                    self.unary("Export", pb.ExportRequest(phase=phase, export_id=eid).SerializeToString())
        pending, self._pending = self._pending, []
        healthy = self._healthy(method, payload, codes, log_pos)
        for code, f in pending:  # a call cut short by a crash or hang is reported as that, not as its status
            if healthy or code not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                self.failures.append(f)
                self.log(f"FAIL [{method}] status {f.detail[:200]} {f.cause}")
        if healthy:
            self._check_state(method, payload, codes, may_change)
        return codes

    def _status_failure(self, method: str, code: grpc.StatusCode, details: str, payload: Any, log_pos: int) -> None:
        time.sleep(0.05)  # let the shard's log catch up
        cause = _exception_line(self._log_since(log_pos))
        self._pending.append((code, Failure(method, "status", f"{code.name}: {details}", payload, cause)))

    def _healthy(self, method: str, payload: Any, codes: list, log_pos: int) -> bool:
        """Alive, below the memory bound, answering; otherwise recorded and restarted."""
        watch = self.watch
        assert watch is not None and self.shard is not None
        if grpc.StatusCode.DEADLINE_EXCEEDED in codes or grpc.StatusCode.UNAVAILABLE in codes:
            code, _, details = self.unary("ShardInfo", b"", timeout=self.deadline)
            if code != grpc.StatusCode.OK and self.alive():
                self.fail(
                    method,
                    "unresponsive",
                    f"no answer to ShardInfo after a {codes[-1].name} call: {code.name}",
                    payload,
                    _exception_line(self._log_since(log_pos)),
                )
                self.crashes[method] += 1
                self.restart_fresh(method)
                return False
        if not self.alive():
            self.shard.proc.wait(10)
            time.sleep(0.05)
            if watch.exceeded:
                self.fail(
                    method,
                    "memory",
                    f"RSS {watch.exceeded / GiB:.2f} GiB > limit {self.rss_limit / GiB:.2f} GiB "
                    "(killed by the harness)",
                    payload,
                )
            else:
                tail = self._log_since(log_pos)[-2000:]
                self.fail(
                    method,
                    "crash",
                    f"shard exited with {self.shard.proc.returncode}\n{tail}",
                    payload,
                    _exception_line(tail),
                )
            self.crashes[method] += 1
            self.restart_fresh(method)
            return False
        self.rss_peak = max(self.rss_peak, watch.peak)
        return True

    def _check_state(self, method: str, payload: Any, codes: list, may_change: bool) -> None:
        try:
            now = self.state()
        except ProbeError as e:
            if method == "DropTable" and e.code == grpc.StatusCode.NOT_FOUND:  # a mutated name dropped t or d
                self.counts[("(setup again)", "OK")] += 1
                setup_tables(self.shard.address)  # type: ignore[union-attr]
                self.baseline = self.state()
                return
            self.fail(method, "state", f"probe failed after the call: {e}", payload)
            self.crashes[method] += 1
            self.restart_fresh(method)
            return
        if not may_change and now != self.baseline:
            assert self.baseline is not None
            what = [n for n, a, b in zip(("version", "rows of t", "rows of d"), self.baseline, now) if a != b]
            codes_s = ",".join(c.name for c in codes)
            self.fail(
                method,
                "state",
                f"call answered {codes_s} but changed {', '.join(what)} (version {self.baseline[0]} -> {now[0]})",
                payload,
            )
        self.baseline = now

    def _restart_failure(self, method: str, what: str, e: Exception) -> None:
        """Record a shard that does not come back, naming the acknowledged pushes that may be why."""
        suspects = [(dense, buf, why) for dense, buf in self.acked if (why := replay_suspect(dense, buf))]
        detail = f"{what}: {str(e)[-2500:]}"
        payload = None
        if suspects:
            dense, payload, why = min(suspects, key=lambda x: len(x[1]))
            detail = (
                f"{what}; {len(suspects)} of {len(self.acked)} acknowledged pushes replay differently, smallest "
                f"({'PushDense' if dense else 'Push'}): {why}\n{detail}"
            )
        self.fail(method, "restart", detail, payload, cause=_exception_line(str(e)))

    # ---- end of a run -----------------------------------------------------------------

    def restart_check(self) -> bool:
        """Kill -9 the shard and restart it on its data dir: it must come up holding the same state."""
        if self.data_dir in self._bricked:  # already reported
            return False
        if not self.alive():
            self.fail("(restart)", "crash", "the shard is not alive before the kill -9 check")
            return False
        try:
            before = self.state(full=True)
        except ProbeError as e:
            self.fail("(restart)", "state", f"cannot read the state before the kill: {e}")
            return False
        assert self.data_dir is not None
        self.restart_checks += 1
        self.stop()
        try:
            self.start(self.data_dir, setup=False)
        except Exception as e:  # noqa: BLE001
            self._bricked.add(self.data_dir)
            self._restart_failure("(restart)", "shard does not restart on its data dir after kill -9", e)
            return False
        after = self.state(full=True)
        if after != before:
            what = [n for n, a, b in zip(("version", "rows of t", "rows of d"), before, after) if a != b]
            self.fail(
                "(restart)",
                "restart",
                f"after kill -9 and restart, {', '.join(what)} differ (version {before[0]} -> {after[0]})",
            )
            return False
        return True


class ProbeError(Exception):
    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        self.code = code


def setup_tables(address: str) -> None:
    """Table t (1000 x 8, SGD) and dense tensor d (4 x 3, SGD), through the real client."""
    from shardps_client import SGD, Client

    with Client([address], timeout=10, retry_timeout=5, rank=None, world_size=None) as c:
        c.create_table(
            TABLE, dim=TABLE_DIM, num_embeddings=TABLE_ROWS, optimizer=SGD(lr=LR), initializer=TABLE_SPEC.initializer
        )
        c.register_dense(DENSE, DENSE_INIT.copy(), optimizer=SGD(lr=LR))


# ==== running ================================================================================


def stateful_settings(examples: int, seed: int) -> Callable[[Any], Any]:
    """Hypothesis settings for fuzzing a live shard: ``examples`` generated examples from ``seed``, no
    shrinking or replay (the shard is stateful), no deadline or database."""

    def wrap(test: Any) -> Any:
        return hypothesis_seed(seed)(settings(max_examples=examples, deadline=None, database=None,
                                              phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                                              report_multiple_bugs=False)(test))

    return wrap


def fuzz_method(h: Harness, method: str, examples: int, seed: int) -> None:
    """``examples`` Hypothesis examples of ``method`` through the harness (no shrinking: the shard is stateful)."""

    @stateful_settings(examples, seed)
    @given(method_payloads(method))
    def run(payload: Any) -> None:
        try:
            h.exercise(method, payload)
        except Exception as e:  # noqa: BLE001 - a harness problem is a finding, not a reason to stop
            h.fail(method, "harness", f"{type(e).__name__}: {e}", payload)
            if not h.alive():
                h.restart_fresh()

    run()


@dataclasses.dataclass
class Report:
    counts: collections.Counter
    failures: list[Failure]
    rss_peak: int
    restarts: int
    elapsed: float
    examples: int
    seed: int
    server_code: str = ""
    restart_ok: Optional[bool] = None
    restart_checks: int = 0

    def format(self, max_groups: int = 60) -> str:
        methods = []
        for m, _ in self.counts:
            if m not in methods:
                methods.append(m)
        order = [c.name for c in grpc.StatusCode] + ["SKIPPED"]
        codes = [c for c in order if any(k[1] == c for k in self.counts)]
        width = max([len(m) for m in methods] + [12])
        lines = [
            f"server code: {self.server_code}" if self.server_code else "",
            f"examples per method: {self.examples}, seed {self.seed}, {self.elapsed:.1f}s, "
            f"shard restarts after failures: {self.restarts}",
            "method".ljust(width) + "".join(c.rjust(max(len(c), 6) + 2) for c in codes),
        ]
        for m in methods:
            lines.append(
                m.ljust(width) + "".join(str(self.counts.get((m, c), 0) or "").rjust(max(len(c), 6) + 2) for c in codes)
            )
        lines.append(f"RSS peak: {self.rss_peak / (1 << 20):.1f} MiB")
        if self.restart_ok is not None:
            lines.append(
                f"kill -9 + restart on the data dir ({self.restart_checks} checks: after each push method and "
                f"at the end): {'ok' if self.restart_ok else 'FAILED'}"
            )
        groups: dict[tuple, list[Failure]] = {}
        for f in self.failures:
            groups.setdefault(f.key(), []).append(f)
        lines.append(f"failures: {len(self.failures)} ({len(groups)} distinct)")
        for key, fs in list(groups.items())[:max_groups]:
            smallest = min(fs, key=Failure.size)
            lines.append(f"- [{key[0]}] {key[1]} x{len(fs)}: {smallest.detail.splitlines()[0][:300]}")
            if smallest.cause:
                lines.append(f"    cause: {smallest.cause}")
            if smallest.payload is not None:
                lines.append(f"    smallest input ({smallest.size()} bytes): {smallest.payload_hex()}")
            if fs[0] is not smallest and fs[0].payload is not None:  # a shard poisoned by an earlier call
                lines.append(f"    first input ({fs[0].size()} bytes): {fs[0].payload_hex()}")
        return "\n".join(ln for ln in lines if ln != "")


def server_code_path(env: Optional[dict] = None) -> str:
    """Where a child ``python -m shardps`` imports shardps from (the shard runs with this environment)."""
    out = subprocess.run(
        [sys.executable, "-c", "import shardps; print(shardps.__file__)"],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    return out.stdout.strip() or out.stderr.strip()


def run_fuzz(
    workdir: pathlib.Path,
    examples: int = 50,
    seed: int = 0,
    methods: Optional[Sequence[str]] = None,
    deadline: float = 10.0,
    rss_limit: int = int(1.5 * GiB),
    final_restart: bool = True,
    log: Callable[[str], None] = lambda s: None,
) -> Report:
    """Fuzz every method (setup tables first; DropTable last) against one shard process; a report."""
    t0 = time.monotonic()
    h = Harness(pathlib.Path(workdir), deadline=deadline, rss_limit=rss_limit, log=log)
    order = sorted(methods or METHOD_NAMES, key=lambda m: (m == "DropTable", METHOD_NAMES.index(m)))
    restart_ok: Optional[bool] = None
    try:
        h.start()
        for i, method in enumerate(order):
            t1 = time.monotonic()
            fuzz_method(h, method, examples, seed * 1000 + i)
            if final_restart and method in PUSH_METHODS:  # kill -9 + restart on the data dir after each push method
                restart_ok = h.restart_check() and restart_ok is not False
            log(f"{method}: {time.monotonic() - t1:.1f}s")
        if final_restart:
            restart_ok = h.restart_check() and restart_ok is not False
    finally:
        h.stop()
    return Report(
        h.counts,
        h.failures,
        h.rss_peak,
        h.restarts,
        time.monotonic() - t0,
        examples,
        seed,
        restart_ok=restart_ok,
        restart_checks=h.restart_checks,
    )


# ==== crash consistency ======================================================================


@dataclasses.dataclass
class CrashResult:
    outcomes: list[tuple[str, list[str]]]  # (method, status code names) per call, in order
    applied: int  # pushes acknowledged as applied (OK, not a duplicate), batch entries and stream frames included
    before: Optional[State]
    after: Optional[State]
    restart_error: str = ""
    acked: list[tuple[bool, bytes]] = dataclasses.field(default_factory=list)  # (dense, push) acknowledged

    @property
    def ok(self) -> bool:
        return not self.restart_error and self.before is not None and self.before == self.after

    def suspects(self) -> list[str]:
        """Acknowledged pushes that protobuf reads differently from the live decoder (what a replay may trip on)."""
        out = []
        for dense, buf in self.acked:
            why = replay_suspect(dense, buf)
            if why:
                out.append(f"{'PushDense' if dense else 'Push'} {buf.hex()}: {why}")
        return out

    def explain(self) -> str:
        if self.restart_error:
            text = f"shard does not restart after kill -9: {self.restart_error}"
        elif self.before != self.after and self.before and self.after:
            what = [n for n, a, b in zip(("version", "rows of t", "rows of d"), self.before, self.after) if a != b]
            text = f"state after restart differs in {', '.join(what)} (version {self.before[0]} -> {self.after[0]})"
        else:
            return "ok"
        suspects = self.suspects()
        if suspects:
            text += "\nacknowledged pushes protobuf reads differently:\n  " + "\n  ".join(suspects)
        return text


def crash_roundtrip(
    workdir: pathlib.Path,
    calls: Sequence[tuple[str, Union[bytes, list[bytes]]]],
    deadline: float = 10.0,
    env: Optional[dict] = None,
) -> CrashResult:
    """Fresh shard with ``--durability log``; t and d; ``calls`` as raw bytes; kill -9; restart on the same
    data dir. The result holds the live answers and the full state (version, all 1000 rows of t, d) just
    before the kill and after the restart."""
    h = Harness(pathlib.Path(workdir), deadline=deadline, env=env)
    data_dir = pathlib.Path(workdir) / "crash-data"
    outcomes: list[tuple[str, list[str]]] = []
    applied = 0
    acked: list[tuple[bool, bytes]] = []

    def count(responses: Sequence[pb.PushResponse]) -> int:
        return sum(not r.duplicate for r in responses)

    try:
        h.start(data_dir)
        for method, payload in calls:
            if method in STREAMING:
                code, answers, _ = h.stream(list(payload))  # type: ignore[arg-type]
                names_ = [code.name] if code != grpc.StatusCode.OK else []
                for frame, a in zip(payload, answers):
                    resp = pb.StreamResponse.FromString(a)
                    which = resp.WhichOneof("result")
                    names_.append(CODE_OF[resp.error.code].name if which == "error" else "OK")
                    if which in ("push", "push_dense", "push_batch"):
                        acked += push_entries("Stream", frame)  # type: ignore[arg-type]
                    if which in ("push", "push_dense"):
                        applied += count([getattr(resp, which)])
                    elif which == "push_batch":
                        applied += count([*resp.push_batch.pushes, *resp.push_batch.dense])
                outcomes.append((method, names_))
            else:
                code, reply, _ = h.unary(method, payload)  # type: ignore[arg-type]
                outcomes.append((method, [code.name]))
                if code == grpc.StatusCode.OK:
                    acked += push_entries(method, payload)  # type: ignore[arg-type]
                if code == grpc.StatusCode.OK and method in ("Push", "PushDense"):
                    applied += count([pb.PushResponse.FromString(reply or b"")])
                elif code == grpc.StatusCode.OK and method == "PushBatch":
                    batch = pb.PushBatchResponse.FromString(reply or b"")
                    applied += count([*batch.pushes, *batch.dense])
        before = h.state(full=True)
    finally:
        h.stop()  # SIGKILL
    try:
        h.start(data_dir, setup=False)
    except Exception as e:  # noqa: BLE001
        h.stop()
        return CrashResult(outcomes, applied, before, None, f"{_exception_line(str(e))}\n{str(e)[-2500:]}", acked)
    try:
        after = h.state(full=True)
    finally:
        h.stop()
    return CrashResult(outcomes, applied, before, after, acked=acked)


def crash_calls() -> st.SearchStrategy[list[tuple[str, Union[bytes, list[bytes]]]]]:
    """Pushes (Push, PushDense, PushBatch, Stream frames), valid or mutated, as raw bytes."""
    push = st.tuples(
        st.just("Push"),
        weighted((3, serialized(pb.PushRequest)), (2, mutated(serialized(pb.PushRequest), pb.PushRequest))),
    )
    dense = st.tuples(
        st.just("PushDense"),
        weighted(
            (3, serialized(pb.PushDenseRequest)), (2, mutated(serialized(pb.PushDenseRequest), pb.PushDenseRequest))
        ),
    )
    batch = st.tuples(
        st.just("PushBatch"),
        weighted(
            (2, serialized(pb.PushBatchRequest)), (1, mutated(serialized(pb.PushBatchRequest), pb.PushBatchRequest))
        ),
    )
    frames = st.lists(
        weighted((2, serialized(pb.StreamRequest)), (1, mutated(serialized(pb.StreamRequest), pb.StreamRequest))),
        min_size=1,
        max_size=3,
    )
    stream = st.tuples(st.just("Stream"), frames)
    return st.lists(weighted((4, push), (2, dense), (1, batch), (1, stream)), min_size=10, max_size=30)


def regression_calls() -> list[tuple[str, Union[bytes, list[bytes]]]]:
    """The two exact pushes that bricked a restarting shard, as Push, inside a PushBatch and on a Stream,
    between ordinary valid pushes."""
    calls: list[tuple[str, Union[bytes, list[bytes]]]] = [("Push", valid_push_bytes((7, 8), 1.0))]
    for make in REGRESSIONS.values():
        bad = make()
        calls.append(("Push", bad))
        calls.append(("PushBatch", Field(1, LEN, bad).encode()))
        calls.append(("Stream", [Field(1, LEN, bad).encode()]))
        calls.append(("Push", valid_push_bytes((9,), 2.0)))
    return calls


# ==== report mode ============================================================================


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzzing", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--examples",
        type=int,
        default=int(os.environ.get("SHARDPS_FUZZ_EXAMPLES", "100")),
        help="examples per method [env SHARDPS_FUZZ_EXAMPLES]",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=int(os.environ.get("SHARDPS_FUZZ_SEED", "0")),
        help="Hypothesis seed [env SHARDPS_FUZZ_SEED]",
    )
    p.add_argument("--methods", default="", help="comma-separated subset of methods (default: all)")
    p.add_argument("--deadline", type=float, default=10.0, help="seconds per call")
    p.add_argument("--rss-limit-mb", type=int, default=1536, help="the shard is killed (a failure) above this RSS")
    p.add_argument("--no-crash-test", action="store_true", help="skip the kill -9 regression round trip")
    p.add_argument("--workdir", default=None, help="keep shard logs and data here (default: a temp dir)")
    p.add_argument("-v", "--verbose", action="store_true", help="print failures as they happen")
    p.add_argument("--dump", default=None, help="write every failure with its whole input here (JSON lines)")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m] or None
    for m in methods or []:
        if m not in METHOD_NAMES:
            p.error(f"unknown method {m}; known: {', '.join(METHOD_NAMES)}")
    with tempfile.TemporaryDirectory(prefix="shardps-fuzz-") as tmp:
        workdir = pathlib.Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)
        (workdir / "fuzz").mkdir(exist_ok=True)
        report = run_fuzz(
            workdir / "fuzz", args.examples, args.seed, methods, args.deadline, args.rss_limit_mb << 20, log=log
        )
        report.server_code = server_code_path()
        print(report.format(), flush=True)
        if args.dump:
            with open(args.dump, "w") as f:
                for fail in report.failures:
                    payload = fail.payload if isinstance(fail.payload, list) else [fail.payload or b""]
                    f.write(
                        json.dumps(
                            {
                                "method": fail.method,
                                "kind": fail.kind,
                                "detail": fail.detail,
                                "cause": fail.cause,
                                "input_hex": [b.hex() for b in payload],
                            }
                        )
                        + "\n"
                    )
        bad = bool(report.failures) or report.restart_ok is False
        if not args.no_crash_test:
            (workdir / "crash").mkdir(exist_ok=True)
            result = crash_roundtrip(workdir / "crash", regression_calls(), args.deadline)
            print("crash round trip (overlong tag, duplicated grads; as Push, PushBatch, Stream):")
            for method, outcome in result.outcomes:
                print(f"  {method:10s} {','.join(outcome)}")
            print(f"  kill -9 + restart: {result.explain()}")
            bad = bad or not result.ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
