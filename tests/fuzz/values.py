"""Strategies of primitive field values (ordinary and extreme), weighted choice, and setting a field."""

from __future__ import annotations

import functools
import math
import string
from typing import Any, Optional, Sequence

from hypothesis import strategies as st

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.target import KNOWN_NAMES

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


def set_field(msg: Any, field: str, value: Any) -> None:
    if value is None:
        return
    target = getattr(msg, field)
    if isinstance(value, (pb.Tensor, pb.ShardMap, pb.SyncPart)) or hasattr(value, "DESCRIPTOR"):
        target.CopyFrom(value)
    else:
        setattr(msg, field, value)
