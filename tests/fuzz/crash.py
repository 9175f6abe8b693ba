"""Crash consistency: pushes (valid, mutated or the exact regressions) to a shard with ``--durability log``,
kill -9, and a restart on the same data dir that must hold exactly the state it acknowledged."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional, Sequence, Union

import grpc
from hypothesis import strategies as st

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.driver import ShardDriver, State
from tests.fuzz.generators import serialized
from tests.fuzz.mutations import mutated
from tests.fuzz.oracle import CODE_OF, exception_line, push_entries, replay_suspect
from tests.fuzz.target import STREAMING
from tests.fuzz.values import weighted

Call = tuple[str, Union[bytes, list[bytes]]]  # method, request bytes (a list of frames for Stream)


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


@dataclasses.dataclass
class _Answers:
    """What the live shard answered to the calls, before the kill."""

    outcomes: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)
    applied: int = 0
    acked: list[tuple[bool, bytes]] = dataclasses.field(default_factory=list)


def _count(responses: Sequence[pb.PushResponse]) -> int:
    return sum(not r.duplicate for r in responses)


def _send_stream(d: ShardDriver, method: str, frames: list[bytes], out: _Answers) -> None:
    code, answers, _ = d.stream(list(frames))
    names_ = [code.name] if code != grpc.StatusCode.OK else []
    for frame, a in zip(frames, answers):
        resp = pb.StreamResponse.FromString(a)
        which = resp.WhichOneof("result")
        names_.append(CODE_OF[resp.error.code].name if which == "error" else "OK")
        if which in ("push", "push_dense", "push_batch"):
            out.acked += push_entries("Stream", frame)
        if which in ("push", "push_dense"):
            out.applied += _count([getattr(resp, which)])
        elif which == "push_batch":
            out.applied += _count([*resp.push_batch.pushes, *resp.push_batch.dense])
    out.outcomes.append((method, names_))


def _send_unary(d: ShardDriver, method: str, payload: bytes, out: _Answers) -> None:
    code, reply, _ = d.unary(method, payload)
    out.outcomes.append((method, [code.name]))
    if code == grpc.StatusCode.OK:
        out.acked += push_entries(method, payload)
    if code == grpc.StatusCode.OK and method in ("Push", "PushDense"):
        out.applied += _count([pb.PushResponse.FromString(reply or b"")])
    elif code == grpc.StatusCode.OK and method == "PushBatch":
        batch = pb.PushBatchResponse.FromString(reply or b"")
        out.applied += _count([*batch.pushes, *batch.dense])


def crash_roundtrip(
    workdir: pathlib.Path,
    calls: Sequence[Call],
    deadline: float = 10.0,
    env: Optional[dict] = None,
) -> CrashResult:
    """Fresh shard with ``--durability log``; t and d; ``calls`` as raw bytes; kill -9; restart on the same
    data dir. The result holds the live answers and the full state (version, all 1000 rows of t, d) just
    before the kill and after the restart."""
    d = ShardDriver(pathlib.Path(workdir), deadline=deadline, env=env)
    data_dir = pathlib.Path(workdir) / "crash-data"
    out = _Answers()
    try:
        d.start(data_dir)
        for method, payload in calls:
            if method in STREAMING:
                _send_stream(d, method, payload, out)  # type: ignore[arg-type]
            else:
                _send_unary(d, method, payload, out)  # type: ignore[arg-type]
        before = d.state(full=True)
    finally:
        d.stop()  # SIGKILL
    try:
        d.start(data_dir, setup=False)
    except Exception as e:  # noqa: BLE001
        d.stop()
        error = f"{exception_line(str(e))}\n{str(e)[-2500:]}"
        return CrashResult(out.outcomes, out.applied, before, None, error, out.acked)
    try:
        after = d.state(full=True)
    finally:
        d.stop()
    return CrashResult(out.outcomes, out.applied, before, after, acked=out.acked)


def crash_calls() -> st.SearchStrategy[list[Call]]:
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
