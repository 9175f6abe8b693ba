"""The raw protobuf wire format: varints, fields (and how to mis-encode them), parsing and serializing."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

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


def all_varints(data: bytes) -> Optional[list[int]]:
    out, pos = [], 0
    while pos < len(data):
        r = _read_varint(data, pos)
        if r is None:
            return None
        v, pos = r
        out.append(v)
    return out
