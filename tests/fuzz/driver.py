"""The shard process under fuzzing: started (``tests/procs.py``) under a memory watch, raw calls to it
through a generic gRPC channel (bytes in, bytes out), and a probe of its state."""

from __future__ import annotations

import pathlib
from typing import Any, Optional

import grpc
import numpy as np

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.memory import GiB, RssWatch
from tests.fuzz.target import DENSE, DENSE_SHAPE, PROBE_IDS, SERVICE, TABLE, TABLE_ROWS, setup_tables
from tests.fuzz.tensors import int64_tensor
from tests.procs import ShardProcess, start_shard

State = tuple[int, bytes, bytes]  # version, serialized rows of t, serialized rows of d


class ProbeError(Exception):
    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        self.code = code


class ShardDriver:
    """One shard process at a time (``shardps serve``, killed with SIGKILL), its RSS watched, called raw."""

    def __init__(
        self,
        workdir: pathlib.Path,
        deadline: float = 10.0,
        rss_limit: int = int(1.5 * GiB),
        durability: str = "log",
        env: Optional[dict] = None,
    ) -> None:
        self.workdir = pathlib.Path(workdir)
        self.deadline, self.rss_limit, self.durability = deadline, rss_limit, durability
        self.env = env
        self.rss_peak = 0
        self.shard: Optional[ShardProcess] = None
        self.watch: Optional[RssWatch] = None
        self.channel: Optional[grpc.Channel] = None
        self.data_dir: Optional[pathlib.Path] = None
        self.baseline: Optional[State] = None  # the state last seen
        self._incarnation = 0
        self._calls: dict[str, Any] = {}
        self.data_port = 0

    # ---- process ----------------------------------------------------------------------

    def start(self, data_dir: Optional[pathlib.Path] = None, setup: bool = True) -> None:
        """A shard on ``data_dir`` (default: a new one), with t and d unless not ``setup``; probed."""
        self._incarnation += 1
        self.data_dir = data_dir or self.workdir / f"data-{self._incarnation}"
        extra = ["--durability", self.durability, "--worker-timeout", "1", "--log-level", "INFO"]
        self.shard = start_shard(0, 1, self.workdir, str(self.data_dir), extra=extra, env=self.env)
        self.watch = RssWatch(self.shard.proc, self.rss_limit)
        self.watch.start()
        self._connect()
        if setup:
            setup_tables(self.shard.address)
        self.baseline = self.state()
        code, info, _ = self.unary("ShardInfo", b"")
        assert code == grpc.StatusCode.OK and info is not None
        self.data_port = pb.ShardInfoResponse.FromString(info).data_ports[0]  # the data plane (fuzzed too)

    def _connect(self) -> None:
        if self.channel is not None:
            self.channel.close()
        assert self.shard is not None
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self.channel = grpc.insecure_channel(self.shard.address, options=opts)
        self._calls = {}

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.rss_peak = max(self.rss_peak, self.watch.peak)
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.shard is not None and self.shard.proc.poll() is None:
            self.shard.kill()

    def alive(self) -> bool:
        return self.shard is not None and self.shard.proc.poll() is None

    def _log_size(self) -> int:
        try:
            return self.shard.log_path.stat().st_size if self.shard else 0
        except OSError:
            return 0

    def _log_since(self, pos: int) -> str:
        if not self.shard:
            return ""
        with open(self.shard.log_path, "rb") as f:
            f.seek(pos)
            return f.read().decode(errors="replace")

    # ---- calls ------------------------------------------------------------------------

    def unary(
        self, method: str, data: bytes, timeout: Optional[float] = None
    ) -> tuple[grpc.StatusCode, Optional[bytes], str]:
        fn = self._calls.get(method)
        if fn is None:
            assert self.channel is not None
            fn = self._calls[method] = self.channel.unary_unary(
                f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=None
            )
        try:
            return grpc.StatusCode.OK, fn(data, timeout=timeout or self.deadline), ""
        except grpc.RpcError as e:
            return e.code(), None, e.details() or ""

    def stream(self, frames: list[bytes], method: str = "Stream") -> tuple[grpc.StatusCode, list[bytes], str]:
        """(status of the call, answers received, details)."""
        assert self.channel is not None
        fn = self.channel.stream_stream(f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=None)
        answers: list[bytes] = []
        try:
            for answer in fn(iter(frames), timeout=self.deadline):
                answers.append(answer)
        except grpc.RpcError as e:
            return e.code(), answers, e.details() or ""
        return grpc.StatusCode.OK, answers, ""

    def state(self, full: bool = False) -> State:
        """Version, rows of t (the probe ids, or all rows) and rows of d; raises if the shard cannot answer."""
        code, info, details = self.unary("ShardInfo", b"")
        if code != grpc.StatusCode.OK or info is None:
            raise ProbeError(f"ShardInfo: {code.name} {details}")
        ids = np.arange(TABLE_ROWS, dtype=np.int64) if full else PROBE_IDS
        code, rows, details = self.unary(
            "Pull", pb.PullRequest(table=TABLE, ids=int64_tensor(ids)).SerializeToString()
        )
        if code != grpc.StatusCode.OK or rows is None:
            raise ProbeError(f"Pull t: {code.name} {details}", code)
        req = pb.PullDenseRequest(name=DENSE, row_start=0, row_end=DENSE_SHAPE[0])
        code, dense, details = self.unary("PullDense", req.SerializeToString())
        if code != grpc.StatusCode.OK or dense is None:
            raise ProbeError(f"PullDense d: {code.name} {details}", code)
        return (
            pb.ShardInfoResponse.FromString(info).version,
            pb.PullResponse.FromString(rows).rows.SerializeToString(),
            pb.PullResponse.FromString(dense).rows.SerializeToString(),
        )
