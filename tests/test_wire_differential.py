"""The hand-written decoder (shardps.core.wire) against protobuf's own parser, on valid and nearly valid bytes.

The shard decodes pushes with ``shardps.core.wire`` and writes the raw bytes to its
write-ahead log; anything else that reads those bytes (the log replay, another
protobuf implementation, a proxy) reads them with a real protobuf parser. So
whenever ``wire`` accepts a message, protobuf must parse it to the same fields;
when ``wire`` refuses one, it must say so with InvalidArgument (a clean
INVALID_ARGUMENT status), never another exception.

Inputs come from tests/fuzz/: canonical encodings of well-formed pushes and
their mutations (duplicated fields and sub-messages, non-minimal, 10- and
11-byte varints and varints above 2^64, field number 0, groups, unknown fields,
wrong wire types, unpacked and mixed packed/unpacked negative shape entries,
lengths past the end, truncation, bit flips). Every failure names the input in
hex. ``SHARDPS_WIRE_EXAMPLES`` (or 20 x ``SHARDPS_FUZZ_EXAMPLES``) scales the
number of examples (default 1000 per push type).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from shardps.core import pushread, wire
from shardps.core.errors import InvalidArgument
from shardps.v1 import shardps_pb2 as pb
from tests.fuzz import data_requests, generators, mutations, oracle, regressions, values
from tests.fuzz.wire import LEN, Field, parse_fields

# 1000 per push type by default; SHARDPS_WIRE_EXAMPLES sets it, else it follows SHARDPS_FUZZ_EXAMPLES (x20).
N = int(os.environ.get("SHARDPS_WIRE_EXAMPLES") or 20 * int(os.environ.get("SHARDPS_FUZZ_EXAMPLES", "35")))
pytestmark = pytest.mark.timeout(max(120, N // 10))


SEED = os.environ.get("SHARDPS_FUZZ_SEED")


def _settings(n: int, shrink: bool = True) -> Callable[[Any], Any]:
    """Deterministic (derandomized, or seeded by SHARDPS_FUZZ_SEED), no example database. Without
    ``shrink`` a failure reports the first failing input as generated (shrinking a whole PushBatch or
    Stream frame takes minutes; the push tests shrink)."""
    phases = tuple(Phase) if shrink else tuple(p for p in Phase if p not in (Phase.shrink, Phase.explain))
    config = settings(
        max_examples=max(1, n),
        deadline=None,
        database=None,
        derandomize=SEED is None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
    )

    def apply(test: Any) -> Any:
        test = config(test)
        return hypothesis_seed(int(SEED))(test) if SEED is not None else test

    return apply


def _hex(buf: Any) -> str:
    return bytes(buf).hex()


# ---- inputs -------------------------------------------------------------------------------


def canonical_pushes(dense: bool) -> st.SearchStrategy[bytes]:
    """SerializeToString of well-formed pushes (consistent tensors of accepted dtypes; other fields anything)."""
    return data_requests.push_requests(dense=dense, well_formed=True).map(lambda m: m.SerializeToString())


def near_valid_pushes(dense: bool) -> st.SearchStrategy[bytes]:
    cls = pb.PushDenseRequest if dense else pb.PushRequest
    canonical = canonical_pushes(dense)
    return values.weighted(
        (1, canonical),
        (5, mutations.mutated(canonical, cls, byte_level=False)),  # structural: lengths stay consistent
        (2, mutations.mutated(canonical, cls)),  # structural and raw bytes
        (
            1,
            mutations.mutated(generators.serialized(cls), cls, byte_level=False),
        ),  # from the fuzzer's pushes (bad tensors too)
    )


def _concatenated(cls: type) -> st.SearchStrategy[bytes]:
    s = generators.serialized(cls)
    return st.tuples(s, s).map(lambda ab: ab[0] + ab[1])


def near_valid(cls: type) -> st.SearchStrategy[bytes]:
    s = generators.serialized(cls)
    return values.weighted(
        (1, s), (4, mutations.mutated(s, cls, byte_level=False)), (1, mutations.mutated(s, cls)), (1, _concatenated(cls))
    )


# ---- the properties -----------------------------------------------------------------------


def _reading(read: Callable[[Any, bool], Any], buf: Any, dense: bool) -> Any:
    try:
        d = read(buf, dense)
    except InvalidArgument as e:
        return ("refused", str(e))
    if d is None:
        return None
    arrays = [(a.dtype.str, a.shape, a.tobytes()) if a is not None else None for a in (d.ids, d.grads)]
    return ("read", d.name, d.row_start, d.pulled_version, d.client_id, d.seq, d.shard_map, d.sync, d.origins, arrays)


def check_two_readers(buf: Any, dense: bool) -> None:
    """Where protobuf's parser reads a push (``pushread.canonical``), the strict reader reads the same push, or
    refuses it too (the words may differ: protobuf reads an enum of -1 as -1, the strict reader as 2^64 - 1)."""
    fast = _reading(pushread.canonical, buf, dense)
    if fast is not None:
        strict = _reading(pushread.read_fields, buf, dense)
        agree = fast == strict or fast[0] == strict[0] == "refused"
        assert agree, f"the two push readers differ: {fast!r:.300} against {strict!r:.300}; input {_hex(buf)}"


def check_push(buf: Any, dense: bool, canonical: bool = False) -> bool:
    """wire.decode_push accepts ``buf`` only if protobuf parses it to the same push; True if accepted."""
    kind = "PushDenseRequest" if dense else "PushRequest"
    check_two_readers(buf, dense)
    try:
        d = pushread.decode_push(buf, dense=dense)
    except InvalidArgument as e:
        assert not canonical, f"wire.decode_push refuses a canonical {kind} ({e}); input {_hex(buf)}"
        return False
    except Exception as e:  # noqa: BLE001
        raise AssertionError(
            f"pushread.decode_push(dense={dense}) raised {type(e).__name__}: {e} "
            f"(refusals must be InvalidArgument); input {_hex(buf)}"
        ) from e
    cls = pb.PushDenseRequest if dense else pb.PushRequest
    try:
        msg = cls.FromString(bytes(buf))
    except DecodeError as e:
        raise AssertionError(f"wire.decode_push accepts a {kind} protobuf refuses ({e}); input {_hex(buf)}") from None
    problems = oracle.compare_push(d, msg, dense)
    assert not problems, f"wire.decode_push and protobuf disagree on a {kind}: {'; '.join(problems)}; input {_hex(buf)}"
    return True


_BATCH = {1: pb.PushRequest, 2: pb.PushDenseRequest, 3: pb.PullDenseRequest, 4: pb.PullRequest}
_BATCH_NAMES = {1: "pushes", 2: "dense", 3: "pull_dense", 4: "pulls"}
_TAKES_FIELDS = "fields" in inspect.signature(wire.decode_repeated).parameters


def check_push_batch(buf: bytes, canonical: bool = False) -> None:
    """decode_repeated on a PushBatchRequest: the entries it finds are protobuf's, in order."""
    try:
        groups = wire.decode_repeated(buf, (1, 2, 3, 4)) if _TAKES_FIELDS else wire.decode_repeated(buf)
    except InvalidArgument as e:
        assert not canonical, f"wire.decode_repeated refuses a canonical PushBatchRequest ({e}); input {_hex(buf)}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(
            f"wire.decode_repeated raised {type(e).__name__}: {e} (refusals must be InvalidArgument); input {_hex(buf)}"
        ) from e
    entries: dict[int, list] = {}
    for field, cls in _BATCH.items():
        entries[field] = []
        for view in groups.get(field, []):
            if field in (1, 2):  # what the servicer does next with each entry
                check_push(view, dense=field == 2)
            try:
                entries[field].append(cls.FromString(bytes(view)))
            except DecodeError:
                entries[field].append(None)  # refused downstream (decode_push refuses it too, checked above)
    if any(e is None for es in entries.values() for e in es):
        return
    try:
        msg = pb.PushBatchRequest.FromString(bytes(buf))
    except DecodeError as e:
        raise AssertionError(
            f"wire.decode_repeated accepts a PushBatchRequest protobuf refuses ({e}) although each "
            f"entry parses; input {_hex(buf)}"
        ) from None
    for field, name in _BATCH_NAMES.items():
        ref = list(getattr(msg, name))
        assert entries[field] == ref, (
            f"PushBatchRequest.{name}: wire finds {len(entries[field])} entries, protobuf "
            f"{len(ref)} (or they differ); input {_hex(buf)}"
        )


_STREAM = {
    1: ("push", pb.PushRequest),
    2: ("push_dense", pb.PushDenseRequest),
    3: ("push_batch", pb.PushBatchRequest),
    4: ("pull", pb.PullRequest),
    5: ("pull_dense", pb.PullDenseRequest),
    6: ("pull_batch", pb.PullBatchRequest),
}


def check_unframe(buf: bytes, canonical: bool = False) -> None:
    """wire.unframe on a StreamRequest: the one field it returns is protobuf's oneof, and nothing follows it."""
    try:
        field, view = wire.unframe(buf)
    except InvalidArgument as e:
        assert not canonical, f"wire.unframe refuses a canonical StreamRequest ({e}); input {_hex(buf)}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(
            f"wire.unframe raised {type(e).__name__}: {e} (refusals must be InvalidArgument); input {_hex(buf)}"
        ) from e
    fields = parse_fields(buf)
    assert fields is not None and len(fields) == 1, (
        f"wire.unframe accepts a StreamRequest with data after its field {field} "
        f"({'unparseable' if fields is None else len(fields) - 1} more fields; protobuf would merge them or "
        f"keep the last); input {_hex(buf)}"
    )
    if field not in _STREAM:
        return  # the servicer refuses it: "not a call this shard knows"
    name, cls = _STREAM[field]
    if field in (1, 2):
        check_push(view, dense=field == 2)
    elif field == 3:
        check_push_batch(bytes(view))
    try:
        inner = cls.FromString(bytes(view))
    except DecodeError:
        inner = None
    try:
        msg = pb.StreamRequest.FromString(bytes(buf))
    except DecodeError as e:
        assert inner is None, f"wire.unframe accepts framing protobuf refuses ({e}); input {_hex(buf)}"
        return
    assert inner is not None, (
        f"protobuf parses this StreamRequest but not the field wire.unframe returns; input {_hex(buf)}"
    )
    assert msg.WhichOneof("body") == name, (
        f"wire.unframe returns field {field} ({name}), protobuf's oneof holds "
        f"{msg.WhichOneof('body')}; input {_hex(buf)}"
    )
    assert getattr(msg, name) == inner, f"wire.unframe's {name} differs from protobuf's; input {_hex(buf)}"


# ---- tests --------------------------------------------------------------------------------


@_settings(N)
@given(buf=near_valid_pushes(dense=False))
def test_push_request_agrees_with_protobuf(buf):
    check_push(buf, dense=False)


@_settings(N)
@given(buf=near_valid_pushes(dense=True))
def test_push_dense_request_agrees_with_protobuf(buf):
    check_push(buf, dense=True)


@_settings(N // 5)
@given(buf=canonical_pushes(dense=False))
def test_canonical_push_request_is_accepted(buf):
    check_push(buf, dense=False, canonical=True)


@_settings(N // 5)
@given(buf=canonical_pushes(dense=True))
def test_canonical_push_dense_request_is_accepted(buf):
    check_push(buf, dense=True, canonical=True)


@_settings(N // 3, shrink=False)
@given(buf=near_valid(pb.PushBatchRequest))
def test_push_batch_entries_agree_with_protobuf(buf):
    check_push_batch(buf)


@_settings(N // 10, shrink=False)
@given(msg=generators.messages(pb.PushBatchRequest))
def test_canonical_push_batch_is_accepted(msg):
    check_push_batch(msg.SerializeToString(), canonical=True)


@_settings(N // 3, shrink=False)
@given(buf=near_valid(pb.StreamRequest))
def test_stream_frame_agrees_with_protobuf(buf):
    check_unframe(buf)


@_settings(N // 10, shrink=False)
@given(msg=generators.messages(pb.StreamRequest).filter(lambda m: m.WhichOneof("body") is not None))
def test_canonical_stream_frame_is_accepted(msg):
    check_unframe(msg.SerializeToString(), canonical=True)


def test_the_two_regressions_are_refused_or_agree():
    """The exact bytes that bricked a restarting shard (overlong tag, grads twice)."""
    for make in regressions.REGRESSIONS.values():
        buf = make()
        check_push(buf, dense=False)
        check_unframe(Field(1, LEN, buf).encode())
        check_push_batch(Field(1, LEN, buf).encode())
