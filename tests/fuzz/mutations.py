"""Mutations of serialized messages: structural ones at the protobuf wire level (at any depth, enclosing
lengths fixed up) and raw byte ones (truncation, bit flips, inserted and deleted bytes)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

from hypothesis import strategies as st

from tests.fuzz.generators import serialized
from tests.fuzz.values import u64, weighted
from tests.fuzz.wire import EGROUP, I32, I64, LEN, SGROUP, VARINT, Field, all_varints, parse_fields, serialize, varint


def _pick(draw: Any, fields: list[Field], pred: Callable[[Field], bool] = lambda f: True) -> Optional[int]:
    idx = [i for i, f in enumerate(fields) if pred(f)]
    return draw(st.sampled_from(idx)) if idx else None


def random_value(draw: Any, wt: int) -> Union[int, bytes]:
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
    return fields[:pos] + [Field(number, wt, random_value(draw, wt))] + fields[pos:]


def _op_field_zero(draw: Any, fields: list[Field], depth: int) -> list[Field]:
    wt = draw(st.sampled_from([VARINT, I64, LEN, I32]))
    pos = draw(st.integers(0, len(fields)))
    return fields[:pos] + [Field(0, wt, random_value(draw, wt))] + fields[pos:]


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
    i = _pick(draw, fields, lambda f: f.wt == LEN and bool(f.value) and all_varints(bytes(f.value)) is not None)  # type: ignore[arg-type]
    if i is None:
        return _op_pack(draw, fields, depth)
    f = fields[i]
    values = all_varints(bytes(f.value))  # type: ignore[arg-type]
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
