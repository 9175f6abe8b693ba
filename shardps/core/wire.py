"""Hand-written protobuf wire encoding of the hot messages, without extra copies.

The bulk of pulls and pushes is one ``bytes`` field holding an array. Going
through protobuf objects copies it several times (array -> bytes -> message ->
serialized string on one side, string -> message -> bytes on the other).
These functions write the same wire format directly around the array's
buffer (one copy, into the message) and read it back as a ``numpy.frombuffer``
view of the received message (no copy). The output is byte-identical to
``SerializeToString`` of the generated classes, which the tests check, so any
protobuf implementation can talk to the shards.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
from google.protobuf.message import DecodeError

from shardps.core import codec, kernels, zmsg
from shardps.core.errors import InvalidArgument
from shardps.v1 import shardps_pb2 as pb

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
Buffer = Union[bytes, bytearray, memoryview]


# Field numbers, from the generated code. PushRequest and PushDenseRequest share theirs (field 2 is the ids
# of one and the row_start of the other); tests/test_wire.py checks that they agree.
_T_DTYPE, _T_SHAPE, _T_DATA = (pb.Tensor.DTYPE_FIELD_NUMBER, pb.Tensor.SHAPE_FIELD_NUMBER,
                               pb.Tensor.DATA_FIELD_NUMBER)
_R_ROWS, _R_VERSION = pb.PullResponse.ROWS_FIELD_NUMBER, pb.PullResponse.VERSION_FIELD_NUMBER
_P_NAME = pb.PushRequest.TABLE_FIELD_NUMBER
_P_IDS = _P_ROW_START = pb.PushRequest.IDS_FIELD_NUMBER
_P_GRADS = pb.PushRequest.GRADS_FIELD_NUMBER
_P_PULLED_VERSION = pb.PushRequest.PULLED_VERSION_FIELD_NUMBER
_P_CLIENT_ID = pb.PushRequest.CLIENT_ID_FIELD_NUMBER
_P_SEQ = pb.PushRequest.SEQ_FIELD_NUMBER
_P_SHARD_MAP = pb.PushRequest.SHARD_MAP_FIELD_NUMBER
_P_SYNC = pb.PushRequest.SYNC_FIELD_NUMBER
_P_ORIGINS = pb.PushRequest.ORIGINS_FIELD_NUMBER
_Q_TABLE, _Q_IDS, _Q_WIRE_DTYPE = (pb.PullRequest.TABLE_FIELD_NUMBER, pb.PullRequest.IDS_FIELD_NUMBER,
                                   pb.PullRequest.WIRE_DTYPE_FIELD_NUMBER)


def _encode_varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# Tags, dtypes, shape entries, lengths and sequence numbers are mostly small: look them up.
_SMALL_VARINTS = tuple(_encode_varint(n) for n in range(1 << 14))


def _varint(n: int) -> bytes:
    return _SMALL_VARINTS[n] if 0 <= n < 16384 else _encode_varint(n)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _len_field(field: int, parts: list) -> list:
    # Every part is bytes or a 1-D byte view (format "B"), so len() is its size in bytes.
    return [_tag(field, _LEN), _varint(sum(map(len, parts))), *parts]


def _tensor_parts(array: np.ndarray, dtype: int) -> list:
    """Fields of a Tensor message (dtype, packed shape, data) around the array's own buffer."""
    data = codec.wire_elements(array, dtype)
    return _tensor_fields(dtype, array.shape, memoryview(data.reshape(-1)).cast("B"))


def _tensor_fields(dtype: int, shape: Sequence[int], data: Any) -> list:
    """Fields of a Tensor message: ``data`` is its bytes (a byte view, or ``_Rows`` gathered into the message)."""
    parts: list = []
    if dtype:
        parts += [_tag(_T_DTYPE, _VARINT), _varint(dtype)]
    if shape:
        packed = b"".join(_varint(int(s)) for s in shape)
        parts += [_tag(_T_SHAPE, _LEN), _varint(len(packed)), packed]
    if len(data):
        parts += [_tag(_T_DATA, _LEN), _varint(len(data)), data]
    return parts


class _Rows:
    """Rows ``src[idx]`` of a float32 array as the data of a float32 Tensor in a message being encoded: gathered
    straight into the message's buffer (``_join``) instead of copied out first and then joined."""

    __slots__ = ("src", "idx", "nbytes")

    def __init__(self, src: np.ndarray, idx: np.ndarray) -> None:
        if idx.shape[0] and (int(idx.min()) < 0 or int(idx.max()) >= src.shape[0]):  # (the kernel reads unchecked)
            raise IndexError(f"rows {int(idx.min())}..{int(idx.max())} of an array of {src.shape[0]}")
        self.src, self.idx = src, idx
        self.nbytes = idx.shape[0] * src.shape[1] * 4

    def __len__(self) -> int:
        return self.nbytes

    def write(self, buf: np.ndarray) -> None:
        """Into ``buf`` (uint8, ``nbytes`` long, at any offset of the message)."""
        dst = buf.view(np.float32).reshape(self.idx.shape[0], self.src.shape[1])
        k = kernels.jit()
        if k is not None:
            k.gather_rows(self.src, self.idx, dst)
        else:
            np.take(self.src, self.idx, axis=0, out=dst)


def _join(parts: list, outgoing: bool = False, reply: bool = False,
          into: Optional[Callable[[int], Optional[memoryview]]] = None) -> Buffer:
    """``b"".join(parts)``, with a ``_Rows`` part (at most one) gathered into the result (a bytearray then); with
    ``outgoing``, a message of ``zmsg.MIN_BYTES`` or more is built in a libzmq message (a writable memoryview of
    it, sent without a copy on the data plane) where it can be; a ``reply`` (a shard's whole answer) in the
    shared-memory slot its call offered, when there is one (``zmsg.answer_into``); with ``into``, in the buffer
    ``into(size)`` gives when it gives one (a request slot of a shared-memory region, ``shardps.core.region``)."""
    rows = next((i for i, p in enumerate(parts) if type(p) is _Rows), None)
    if rows is None and not outgoing:
        return b"".join(parts)
    n = sum(map(len, parts))
    out: Optional[Union[bytearray, memoryview]] = into(n) if into is not None else None
    if out is None and outgoing:
        out = zmsg.outgoing(n, reply)
    if out is None:
        if rows is None:
            return b"".join(parts)
        out = bytearray(n)
    pos = 0
    for p in parts:
        size = len(p)
        if type(p) is _Rows:
            p.write(np.frombuffer(out, np.uint8, size, pos))
        else:
            out[pos : pos + size] = p
        pos += size
    return out


def _answer(parts: list, frame: int) -> Buffer:
    """A reply's ``parts`` joined, as field ``frame`` of an enclosing message when given: a whole StreamResponse then,
    built in a libzmq message on a shard's data-plane thread (``zmsg.answer_in_place``)."""
    if frame:
        return _join(_len_field(frame, parts), _in_place(frame), reply=True)
    return b"".join(parts)


def _in_place(frame: int) -> bool:
    """Whether a reply (``frame``: its field, 0: none) is a whole StreamResponse built in a libzmq message or an
    answer slot: on a shard's data-plane thread (``zmsg.answer_in_place``); gRPC sends only bytes."""
    return bool(frame) and zmsg.answering_here()


# Rows gathered straight into a message from this size on; below it numpy's gather and a join cost less than the
# set-up of the compiled one (a collection's pushes of a few hundred 16-wide rows: 197 against 358 us a step).
ROWS_IN_PLACE_BYTES = 64 << 10


def _rows_parts(src: np.ndarray, idx: np.ndarray, dtype: int) -> list:
    """``_tensor_parts(src[idx], dtype)``, the rows gathered into the message when they go as float32."""
    if (dtype != pb.FLOAT32 or src.dtype != np.float32 or src.ndim != 2 or not src.flags.c_contiguous
            or idx.shape[0] * src.shape[1] * 4 < ROWS_IN_PLACE_BYTES):
        return _tensor_parts(src[idx], dtype)
    return _tensor_fields(dtype, (idx.shape[0], src.shape[1]), _Rows(src, idx))


def encode_pull_response(rows: np.ndarray, wire_dtype: int, version: int, frame: int = 0,
                         at: Optional[np.ndarray] = None) -> Buffer:
    """A serialized PullResponse{rows, version} (``frame``: as that field of an enclosing message); with ``at``, the
    rows are ``rows[at]``, gathered straight into the message when it is a data-plane answer built in place
    (``zmsg.answer_in_place``) and they go as float32 (else taken first: gRPC sends only bytes)."""
    if at is not None and not _in_place(frame):
        rows, at = np.take(rows, at, axis=0), None
    parts = _len_field(_R_ROWS, _tensor_parts(rows, wire_dtype) if at is None else _rows_parts(rows, at, wire_dtype))
    if version:
        parts += [_tag(_R_VERSION, _VARINT), _varint(version)]
    return _answer(parts, frame)


def frame(field: int, *messages: Buffer) -> bytes:
    """``messages``, concatenated, as field ``field`` of an enclosing message (tag, length, bytes).

    Several already framed fields concatenate to one message: framed pushes make a
    PushBatchRequest that way.
    """
    return b"".join(_len_field(field, [m.cast("B") if isinstance(m, memoryview) else m for m in messages]))


def unframe(buf: Buffer) -> tuple[int, memoryview]:
    """The one length-delimited field a message holds (a oneof): (field number, view of its bytes).

    Anything else (no field, another wire type, a second field, which protobuf would
    merge or prefer) is refused.
    """
    fields = _fields(_view(buf))
    if len(fields) != 1:
        raise InvalidArgument(f"malformed message: expected exactly one field, got {len(fields)}")
    field, wt, value = fields[0]
    if wt != _LEN:
        raise InvalidArgument(f"malformed message: expected a length-delimited field, got wire type {wt}")
    return field, value  # type: ignore[return-value]


def _string_field(field: int, s: str) -> list:
    return _len_field(field, [s.encode()]) if s else []


def _msg_field(field: int, msg: Optional[object]) -> list:
    if msg is None:
        return []
    return _len_field(field, [msg.SerializeToString()])  # type: ignore[attr-defined]


def message_field(field: int, msg: Optional[object]) -> bytes:
    """``msg`` (a generated message, or None: nothing) serialized as field ``field`` of an enclosing message."""
    return b"".join(_msg_field(field, msg))


def encode_pull(name: str, ids: np.ndarray, wire_dtype: int, shard_map: bytes = b"") -> bytes:
    """A serialized PullRequest{table, ids, wire_dtype, shard_map}, byte-identical to the generated class's
    ``SerializeToString`` without building its objects; ``shard_map``: that field already encoded
    (``message_field(PullRequest.SHARD_MAP_FIELD_NUMBER, ...)``, the same for every request to one shard)."""
    parts = _string_field(_Q_TABLE, name) + _len_field(_Q_IDS, _tensor_parts(ids, pb.INT64))
    if wire_dtype:
        parts += [_tag(_Q_WIRE_DTYPE, _VARINT), _varint(wire_dtype)]
    parts.append(shard_map)
    return b"".join(parts)


def encode_push(
    name: str, grads: np.ndarray, wire_dtype: int, *, ids: Optional[np.ndarray] = None, row_start: int = 0,
    pulled_version: Optional[int] = None, client_id: str = "", seq: int = 0,
    shard_map: Optional[pb.ShardMap] = None, sync: Optional[pb.SyncPart] = None, frame: int = 0,
    origins: Sequence[tuple[int, int]] = (), rows: Optional[np.ndarray] = None,
    into: Optional[Callable[[int], Optional[memoryview]]] = None,
) -> Buffer:
    """A serialized PushRequest (with ``ids``) or PushDenseRequest (with ``row_start``); ``origins``: the (shard,
    seq) pairs of a push planned again (PushRequest.origins).

    With ``frame``, the message is field ``frame`` of an enclosing message (built in
    the same pass, no extra copy): field 1 or 2 frames it both as a StreamRequest and
    as an entry of a PushBatchRequest. With ``rows`` (positions in ``grads``), the gradients are
    ``grads[rows]``, gathered straight into the message (a bytearray then) when they go as float32. ``into``: as
    ``_join`` takes it.
    """
    parts = _string_field(_P_NAME, name)
    if ids is not None:
        parts += _len_field(_P_IDS, _tensor_parts(ids, pb.INT64))
    elif row_start:
        parts += [_tag(_P_ROW_START, _VARINT), _varint(row_start)]
    parts += _len_field(_P_GRADS, _tensor_parts(grads, wire_dtype) if rows is None else
                        _rows_parts(grads, rows, wire_dtype))
    if pulled_version is not None:
        parts += [_tag(_P_PULLED_VERSION, _VARINT), _varint(pulled_version)]
    parts += _string_field(_P_CLIENT_ID, client_id)
    if seq:
        parts += [_tag(_P_SEQ, _VARINT), _varint(seq)]
    parts += _msg_field(_P_SHARD_MAP, shard_map)
    parts += _msg_field(_P_SYNC, sync)
    for shard, origin_seq in origins:
        parts += _msg_field(_P_ORIGINS, pb.PushOrigin(shard=shard, seq=origin_seq))
    return _join(_len_field(frame, parts) if frame else parts, outgoing=True, into=into)


class PushEncoder:
    """``encode_push`` for the pushes of one table to one shard (rows by id, no synchronous step): the fields
    that never change (table, client id, shard map) are encoded once. Byte-identical to ``encode_push``."""

    def __init__(self, name: str, client_id: str, shard_map: Optional[pb.ShardMap], frame: int = 0) -> None:
        self._head = b"".join(_string_field(_P_NAME, name))
        self._client_id = b"".join(_string_field(_P_CLIENT_ID, client_id))
        self._tail = b"".join(_msg_field(_P_SHARD_MAP, shard_map))
        self._frame = _tag(frame, _LEN) if frame else b""

    def encode(self, ids: np.ndarray, grads: np.ndarray, wire_dtype: int, pulled_version: Optional[int],
               seq: int, rows: Optional[np.ndarray] = None) -> Buffer:
        """``rows``: as ``encode_push`` takes it."""
        parts = [self._head, *_len_field(_P_IDS, _tensor_parts(ids, pb.INT64)),
                 *_len_field(_P_GRADS, _tensor_parts(grads, wire_dtype) if rows is None else
                             _rows_parts(grads, rows, wire_dtype))]
        if pulled_version is not None:
            parts += [_tag(_P_PULLED_VERSION, _VARINT), _varint(pulled_version)]
        parts.append(self._client_id)
        if seq:
            parts += [_tag(_P_SEQ, _VARINT), _varint(seq)]
        parts.append(self._tail)
        if self._frame:
            parts[:0] = [self._frame, _varint(sum(map(len, parts)))]
        return _join(parts, outgoing=True)


# ---- decoding -------------------------------------------------------------------------------


def _view(buf: Buffer) -> memoryview:
    """``buf`` as unsigned bytes: a buffer of signed chars (pyarrow's, ctypes') would read bytes
    above 0x7f as negative numbers."""
    view = memoryview(buf)
    return view if view.format == "B" else view.cast("B")


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """One varint, in its shortest form only: anything protobuf could read another way is refused."""
    if pos < len(buf) and buf[pos] < 0x80:  # one byte: most tags, dtypes and small numbers
        return buf[pos], pos + 1
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise InvalidArgument("malformed message: truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if b == 0:  # a trailing zero byte: a longer encoding than the value needs
                raise InvalidArgument("malformed message: overlong varint (not in its shortest form)")
            if result >> 64:
                raise InvalidArgument("malformed message: varint above 2^64 - 1")
            return result, pos
        shift += 7
        if shift > 63:
            raise InvalidArgument("malformed message: varint longer than 10 bytes")


_MAX_FIELD = (1 << 29) - 1


def _fields(buf: memoryview) -> list[tuple[int, int, Union[int, memoryview]]]:
    """(field number, wire type, value) of every field; LEN values are views into ``buf``.

    Strict: field number 0 or above 2^29 - 1, groups (wire types 3 and 4), varints
    not in their shortest form or above 2^64 - 1, and fields running past the end
    are refused, so that whatever this accepts, protobuf's parser accepts too.
    """
    out: list[tuple[int, int, Union[int, memoryview]]] = []
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wt = key >> 3, key & 7
        if not 1 <= field <= _MAX_FIELD:
            raise InvalidArgument(f"malformed message: field number {field} out of range")
        value: Union[int, memoryview]
        if wt == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wt == _LEN:
            n, pos = _read_varint(buf, pos)
            if n > end - pos:
                raise InvalidArgument("malformed message: field runs past the end")
            value, pos = buf[pos : pos + n], pos + n
        elif wt in (_I64, _I32):
            size = 8 if wt == _I64 else 4
            if size > end - pos:
                raise InvalidArgument("malformed message: field runs past the end")
            value, pos = int.from_bytes(buf[pos : pos + size], "little"), pos + size
        else:
            raise InvalidArgument(f"malformed message: wire type {wt} (groups are not used by this protocol)")
        out.append((field, wt, value))
    return out


def _singular(fields: list, schema: dict[int, int], what: str) -> dict[int, Union[int, memoryview]]:
    """The known fields of a message by number, each at most once and with its declared wire type.

    Protobuf merges a repeated sub-message and keeps the last of a repeated scalar:
    rather than follow it there, a known field that appears twice or with another
    wire type is refused. Unknown fields are skipped, as protobuf does.
    """
    out: dict[int, Union[int, memoryview]] = {}
    for field, wt, value in fields:
        want = schema.get(field)
        if want is None:
            continue
        if wt != want:
            raise InvalidArgument(f"malformed message: {what} field {field} has wire type {wt}, expected {want}")
        if field in out:
            raise InvalidArgument(f"malformed message: {what} field {field} appears more than once")
        out[field] = value
    return out


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


_TENSOR_SINGULAR = {_T_DTYPE: _VARINT, _T_DATA: _LEN}


def decode_tensor(buf: memoryview, what: str, as_float32: bool = True, allowed: Optional[tuple] = None) -> np.ndarray:
    """A Tensor message as a numpy view of ``buf`` (float16/bfloat16 widened to float32).

    ``allowed``: the dtypes accepted; another one is refused naming ``what``.
    """
    fields = _fields(buf)
    f = _singular(fields, _TENSOR_SINGULAR, what)
    dtype = int(f.get(_T_DTYPE, 0))  # type: ignore[arg-type]
    data = f.get(_T_DATA, memoryview(b""))
    shape: list[int] = []  # repeated: packed and unpacked runs concatenate, in order
    for field, wt, value in fields:
        if field == _T_SHAPE and wt == _LEN:
            pos = 0
            while pos < len(value):  # type: ignore[arg-type]
                v, pos = _read_varint(value, pos)  # type: ignore[arg-type]
                shape.append(_signed64(v))
        elif field == _T_SHAPE and wt == _VARINT:
            shape.append(_signed64(value))  # type: ignore[arg-type]
    return _tensor(dtype, shape, data, what, as_float32, allowed)  # type: ignore[arg-type]


def _tensor(dtype: int, shape: list, data: Any, what: str, as_float32: bool = True,
            allowed: Optional[tuple] = None) -> np.ndarray:
    if allowed is not None and dtype not in allowed:
        names = [codec.DTYPE_NAMES[d] for d in allowed]
        expected = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise InvalidArgument(f"{what} must be {expected}, got {codec.dtype_name(dtype)}")
    return codec.decode_raw(dtype, shape, data, what, as_float32)


_PULL_RESPONSE = {_R_ROWS: _LEN, _R_VERSION: _VARINT}


def decode_pull_response(buf: Buffer) -> tuple[np.ndarray, int]:
    """(rows, version) of a serialized PullResponse; rows are float32 (a view when sent as float32)."""
    f = _singular(_fields(_view(buf)), _PULL_RESPONSE, "PullResponse")
    rows = decode_tensor(f[_R_ROWS], "rows") if _R_ROWS in f else np.zeros((0,), np.float32)  # type: ignore[arg-type]
    return rows, int(f.get(_R_VERSION, 0))  # type: ignore[arg-type]


def parse(cls: Any, buf: Buffer, what: str = "") -> Any:
    """A message of generated class ``cls`` parsed by protobuf; bytes it cannot parse are the
    caller's error (InvalidArgument naming ``what``, by default the message type)."""
    try:
        return cls.FromString(bytes(buf))
    except DecodeError:
        raise InvalidArgument(f"malformed {what or cls.DESCRIPTOR.name}: cannot be parsed") from None


def encode_repeated(groups: Sequence[tuple[int, Sequence[Buffer]]], frame: int = 0, head: bytes = b"") -> Buffer:
    """A message of repeated length-delimited fields: [(field, [serialized message, ...]), ...], after ``head``
    (fields already encoded).

    With ``frame``, the message is field ``frame`` of an enclosing message.
    """
    parts: list = [head] if head else []
    for field, items in groups:
        for item in items:
            parts += _len_field(field, [item])
    return _answer(parts, frame)


def decode_repeated(buf: Buffer, fields: Optional[tuple[int, ...]] = None) -> dict[int, list[memoryview]]:
    """Views of the repeated message fields ``fields`` of a message, by field number (in order).

    One of ``fields`` with another wire type than length-delimited is refused;
    other fields are skipped. Without ``fields``: every length-delimited field.
    """
    out: dict[int, list[memoryview]] = {}
    for field, wt, value in _fields(_view(buf)):
        if fields is None and wt == _LEN or fields is not None and field in fields:
            if wt != _LEN:
                raise InvalidArgument(f"malformed message: field {field} has wire type {wt}, expected {_LEN}")
            out.setdefault(field, []).append(value)  # type: ignore[arg-type]
    return out
