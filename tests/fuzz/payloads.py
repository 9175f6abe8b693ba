"""What one fuzzed call sends: valid, mutated or random request bytes (a list of frames for a stream)."""

from __future__ import annotations

import functools
import math
from typing import Any

from hypothesis import strategies as st

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.generators import serialized
from tests.fuzz.mutations import mutated, random_value
from tests.fuzz.target import DATA_PLANE, INPUT_TYPES, STREAMING
from tests.fuzz.values import weighted
from tests.fuzz.wire import EGROUP, I32, I64, LEN, SGROUP, VARINT, Field, serialize


@st.composite
def field_soup(draw: Any) -> bytes:
    """Random fields with small numbers: plausible-looking garbage."""
    out = []
    for _ in range(draw(st.integers(0, 8))):
        wt = draw(st.sampled_from([VARINT, I64, LEN, I32, SGROUP, EGROUP]))
        out.append(Field(draw(st.integers(0, 12)), wt, random_value(draw, wt) if wt not in (SGROUP, EGROUP) else 0))
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
    """What one call of ``method`` sends: bytes, or for a streaming method a list of 1..4 frames (for the data
    plane, of 0..4 multipart messages, ``tests.fuzz.data_plane``)."""
    if method == DATA_PLANE:
        from tests.fuzz import data_plane

        return data_plane.payloads()
    one = request_bytes(INPUT_TYPES[method])
    return st.lists(one, min_size=1, max_size=4) if method in STREAMING else one
