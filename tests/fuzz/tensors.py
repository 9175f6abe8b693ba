"""Strategies of Tensor messages: consistent float tensors, id lists, and tensors that are wrong or lie."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
from hypothesis import strategies as st

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.target import TABLE_ROWS
from tests.fuzz.values import OVERFLOWING_SHAPES, enum_values, i64, weighted


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


def int64_tensor(ids: Sequence[int], shape: Optional[Sequence[int]] = None) -> pb.Tensor:
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
