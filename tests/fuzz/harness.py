"""The fuzz harness: one call at a time to a shard, checked. After every call the status must be one a
client may legitimately get (never INTERNAL or UNKNOWN), a refused call must have changed nothing
(version, a probe pull of t and of d), and the process must be alive, answering and below a memory
bound; a crashed or hung shard must restart on its data dir, and is then replaced by a fresh one."""

from __future__ import annotations

import collections
import pathlib
import time
from typing import Any, Callable, Optional, Union

import grpc

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.driver import ProbeError, ShardDriver
from tests.fuzz.memory import GiB
from tests.fuzz.oracle import CODE_OF, allowed_codes, exception_line, push_entries, replay_suspect
from tests.fuzz.report import Failure
from tests.fuzz.target import DATA_PLANE, PUSH_METHODS, STREAMING, setup_tables

# A call that ends with one of these may have been cut short by a crash or hang of the shard.
_CUT_SHORT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


class Harness(ShardDriver):
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
        super().__init__(workdir, deadline, rss_limit, durability, env)
        self.max_crashes_per_method = max_crashes_per_method
        self.log = log
        self.counts: collections.Counter = collections.Counter()
        self.failures: list[Failure] = []
        self.crashes: collections.Counter = collections.Counter()
        self.restarts = 0
        self._pending: list[tuple[grpc.StatusCode, Failure]] = []
        self._bricked: set[pathlib.Path] = set()
        self.acked: list[tuple[bool, bytes]] = []  # pushes acknowledged on the current data dir
        self.restart_checks = 0

    def start(self, data_dir: Optional[pathlib.Path] = None, setup: bool = True) -> None:
        if data_dir is None:
            self.acked = []
        super().start(data_dir, setup)

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
        if method == DATA_PLANE:
            codes, may_change = self._send_data_plane(list(payload), log_pos)  # type: ignore[arg-type]
        elif method in STREAMING:
            codes, may_change = self._send_stream(method, list(payload), log_pos)  # type: ignore[arg-type]
        else:
            codes, may_change = self._send_unary(method, payload, log_pos)  # type: ignore[arg-type]
        self._end_sessions(method)
        pending, self._pending = self._pending, []
        healthy = self._healthy(method, payload, codes, log_pos)
        for code, f in pending:  # a call cut short by a crash or hang is reported as that, not as its status
            if healthy or code not in _CUT_SHORT:
                self.failures.append(f)
                self.log(f"FAIL [{method}] status {f.detail[:200]} {f.cause}")
        if healthy:
            self._check_state(method, payload, codes, may_change)
        return codes

    def _send_unary(self, method: str, payload: bytes, log_pos: int) -> tuple[list[grpc.StatusCode], bool]:
        """One unary call: (its code, whether it may have changed the shard)."""
        code, _, details = self.unary(method, payload)
        self.counts[(method, code.name)] += 1
        if code not in allowed_codes(method):
            self._status_failure(method, code, details, payload, log_pos)
        may_change = False
        if method in PUSH_METHODS and (
            code == grpc.StatusCode.OK or (method == "PushBatch" and code == grpc.StatusCode.ABORTED)
        ):
            may_change = True
            self.acked += push_entries(method, payload)
        if method == "Assign" and code == grpc.StatusCode.OK:  # rows set: a new version, logged
            may_change = True
        return [code], may_change

    def _send_stream(self, method: str, frames: list[bytes], log_pos: int) -> tuple[list[grpc.StatusCode], bool]:
        """One stream of frames: (the call's code unless OK, then each answer's; whether it may have changed the shard)."""
        codes: list[grpc.StatusCode] = []
        may_change = False
        call_code, answers, details = self.stream(frames, method)
        self.counts[(f"{method}[call]", call_code.name)] += 1
        if call_code != grpc.StatusCode.OK:
            codes.append(call_code)
            if call_code not in allowed_codes(method):
                self._status_failure(method, call_code, details, frames, log_pos)
        if method != "Stream":  # Replicate: a shard in no replica group refuses the stream, frames unanswered
            if call_code == grpc.StatusCode.OK:
                self.fail(method, "stream", f"a shard in no replica group accepted a {method} stream", frames)
            return codes, False
        if call_code == grpc.StatusCode.OK and len(answers) != len(frames):
            self.fail(method, "stream", f"stream answered {len(answers)} of {len(frames)} frames", frames)
        for frame, answer in zip(frames, answers):
            code, changed = self._stream_answer(method, frames, frame, answer, log_pos)
            if code is None:
                continue
            may_change = may_change or changed
            self.counts[(method, code.name)] += 1
            codes.append(code)
        return codes, may_change

    def _send_data_plane(self, messages: list[bytes], log_pos: int) -> tuple[list[grpc.StatusCode], bool]:
        """Multipart messages on a fresh data-plane connection: (each answer's code; whether the shard may have
        changed). A message that expected an answer and got none within the deadline is a failure."""
        from tests.fuzz.data_plane import exchange

        codes: list[grpc.StatusCode] = []
        may_change = False
        results, _ = exchange(self.data_port, messages, self.deadline)
        for parts, answer in results:
            if answer is None:
                f = Failure(DATA_PLANE, "stream", f"no answer to a {len(parts)}-part message in {self.deadline}s",
                            messages)
                self._pending.append((grpc.StatusCode.DEADLINE_EXCEEDED, f))
                codes.append(grpc.StatusCode.DEADLINE_EXCEEDED)
                continue
            if not parts[0]:  # a control message: [b"", b"ok"] or [b"", b"error", StreamError]
                code = self._control_answer(messages, answer, log_pos)
            else:
                if len(answer) != 2:
                    self.fail(DATA_PLANE, "stream", f"an answer of {len(answer)} parts", messages)
                    continue
                code, changed = self._stream_answer(DATA_PLANE, messages, parts[1], answer[1], log_pos)
                may_change = may_change or changed
            if code is not None:
                self.counts[(DATA_PLANE, code.name)] += 1
                codes.append(code)
        return codes, may_change

    def _control_answer(self, messages: list[bytes], answer: list[bytes], log_pos: int) -> Optional[grpc.StatusCode]:
        if answer[1:] == [b"ok"]:
            return grpc.StatusCode.OK
        if len(answer) == 3 and answer[1] == b"error":
            return self._stream_answer(DATA_PLANE, messages, b"", answer[2], log_pos)[0]
        self.fail(DATA_PLANE, "stream", f"a control answer {[p[:32] for p in answer]}", messages)
        return None

    def _stream_answer(
        self, method: str, frames: list[bytes], frame: bytes, answer: bytes, log_pos: int
    ) -> tuple[Optional[grpc.StatusCode], bool]:
        """One answer on a stream: (its code, None if it is no answer; whether the shard may have changed)."""
        try:
            resp = pb.StreamResponse.FromString(answer)
        except Exception as e:  # noqa: BLE001
            self.fail(method, "stream", f"unparseable StreamResponse {answer[:64].hex()}: {e}", frames)
            return None, False
        which = resp.WhichOneof("result")
        if which != "error":
            if which in ("push", "push_dense", "push_batch"):
                self.acked += push_entries("Stream", frame)
                return grpc.StatusCode.OK, True
            return grpc.StatusCode.OK, False
        code = CODE_OF.get(resp.error.code)
        if code is None:
            self.fail(method, "stream", f"StreamError with unknown code {resp.error.code}", frames)
            return None, False
        if code not in allowed_codes(method):
            self._status_failure(method, code, resp.error.message, frames, log_pos)
        return code, code == grpc.StatusCode.ABORTED  # a push batch: its other entries were applied

    def _end_sessions(self, method: str) -> None:
        """A PREPARE would hold pushes back: always resume; likewise end exports, and free the copies."""
        if method == "Checkpoint":
            self.unary("Checkpoint", pb.CheckpointRequest(phase=pb.CheckpointRequest.ABORT).SerializeToString())
        if method == "Export":
            for phase in (pb.ExportRequest.ABORT, pb.ExportRequest.END):
                for eid in ("e1", "e2"):
                    self.unary("Export", pb.ExportRequest(phase=phase, export_id=eid).SerializeToString())
        if method == "Migrate":  # a move begun here would hold writes at its next step: given up
            for op in ("out_abort", "in_abort"):
                for mid in ("m1", "m2"):
                    self.unary("Migrate", pb.MigrateRequest(op=op, move_id=mid).SerializeToString())

    def _status_failure(self, method: str, code: grpc.StatusCode, details: str, payload: Any, log_pos: int) -> None:
        time.sleep(0.05)  # let the shard's log catch up
        cause = exception_line(self._log_since(log_pos))
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
                    exception_line(self._log_since(log_pos)),
                )
                self.crashes[method] += 1
                self.restart_fresh(method)
                return False
        if not self.alive():
            self._record_exit(method, payload, log_pos)
            self.crashes[method] += 1
            self.restart_fresh(method)
            return False
        self.rss_peak = max(self.rss_peak, watch.peak)
        return True

    def _record_exit(self, method: str, payload: Any, log_pos: int) -> None:
        """The shard is gone: killed by the memory watch, or crashed (with the tail of its log)."""
        assert self.watch is not None and self.shard is not None
        self.shard.proc.wait(10)
        time.sleep(0.05)
        if self.watch.exceeded:
            self.fail(
                method,
                "memory",
                f"RSS {self.watch.exceeded / GiB:.2f} GiB > limit {self.rss_limit / GiB:.2f} GiB "
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
                exception_line(tail),
            )

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
        self.fail(method, "restart", detail, payload, cause=exception_line(str(e)))

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
