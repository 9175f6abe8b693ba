"""The two exact pushes that bricked a restarting shard, and the calls that send them."""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.target import TABLE, TABLE_DIM
from tests.fuzz.tensors import int64_tensor
from tests.fuzz.wire import LEN, Field, parse_fields


def valid_push_bytes(ids: Sequence[int] = (1, 2), value: float = 1.0) -> bytes:
    grads = np.full((len(ids), TABLE_DIM), value, np.float32)
    return pb.PushRequest(
        table=TABLE,
        ids=int64_tensor(ids),
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
