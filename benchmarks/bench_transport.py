"""The data path's transport: today's gRPC call streams against a prototype on Arrow Flight, same shards.

Both carry the same messages (StreamRequest / StreamResponse frames) to the same
shard code: every shard process here is a real ``ShardServer`` (gRPC, as
``shardps serve`` runs it) that also serves those frames over Flight's
``DoExchange``: each frame travels as the body of a one-row Arrow batch (one
``binary`` value), so gRPC's C++ core moves it without a Python copy, and the
handler reads and writes from one C++-managed thread per stream. On the client
a Flight lane writes each call from the caller's thread (no request iterator)
and one reader thread resolves the answers in order: one thread wake-up per
message on each side, where a gRPC Python stream has two (request iterator,
response thread) on the client and two on the shard.

The workload is ``bench_throughput``'s standard one (1M x 64 float32 table,
8,192 Zipf(1.1) ids per step, pull then SGD push), tuned as its ``shardps``
backend is (zeros initializer, one torch thread, read_your_writes=False), in
interleaved runs over the same shard processes. Also: round trips of a
64-byte and a 563 KB message (a pull reply of this workload) on each
transport, with the CPU both sides spend per round trip.

Needs pyarrow (``pip install pyarrow``), which shardps does not depend on.

    python -m benchmarks.bench_transport [--budget 3] [--repeat 3] [--shards 2] [--quick]
Writes benchmarks/results/transport.json and transport.png.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from benchmarks.bench_throughput import DIM, measure
from benchmarks.common import (
    RESULTS,
    Progress,
    cpu_seconds,
    median_and_range,
    plot,
    table,
    unique_batches,
    write_outputs,
)

ECHO = b"shardps-echo"  # a DoExchange command: answer each frame with itself (the round-trip probe)


def _flight():
    import pyarrow as pa
    import pyarrow.flight as fl

    return pa, fl


def _batch(pa, schema, buf) -> Any:
    """A one-row batch whose single binary value is ``buf``, without copying it."""
    data = pa.py_buffer(buf)
    offsets = pa.py_buffer(np.array([0, data.size], dtype=np.int32))
    return pa.RecordBatch.from_arrays([pa.Array.from_buffers(pa.binary(), 1, [None, offsets, data])], schema=schema)


def _value(chunk) -> memoryview:
    col = chunk.data.column(0)
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int32, count=2)
    return memoryview(col.buffers()[2])[offsets[0]:offsets[1]]


def shard_process(index: int, num_shards: int, queue) -> None:
    """A real ShardServer, with its frames also served over Flight DoExchange; runs until killed."""
    pa, fl = _flight()
    from shardps.core import kernels
    from shardps.server.rpc.server import ServerConfig, ShardServer
    from shardps.server.shard.facade import ShardConfig

    kernels.warm_up()
    server = ShardServer(ShardConfig(index, num_shards), ServerConfig()).start()
    servicer = server._servicer
    schema = pa.schema([("frame", pa.binary())])

    class FlightShard(fl.FlightServerBase):
        def do_exchange(self, context, descriptor, reader, writer):
            echo = descriptor.command == ECHO
            writer.begin(schema)
            for chunk in reader:
                frame = _value(chunk)
                writer.write_batch(_batch(pa, schema, frame if echo else servicer._stream_one(frame)))

    flight = FlightShard("grpc://127.0.0.1:0")
    queue.put((index, server.address, flight.port, os.getpid()))
    flight.serve()


class FlightLane:
    """The client's lane to one shard over Flight: calls written in order from the caller's
    thread, answers read in order by one thread. Same interface as ``transport.Lane``."""

    def __init__(self, address: str, port: int, command: bytes = b"shardps-stream") -> None:
        pa, fl = _flight()
        self._pa = pa
        self._echo = command == ECHO
        self.address = address
        self.streaming = True
        self._schema = pa.schema([("frame", pa.binary())])
        self._client = fl.FlightClient(f"grpc://127.0.0.1:{port}")
        self._writer, self._reader = self._client.do_exchange(fl.FlightDescriptor.for_command(command))
        self._writer.begin(self._schema)
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def submit(self, method: str, request: bytes, answer_slot: bool = False) -> Future:
        future: Future = Future()
        with self._lock:  # the answers come back in the order written
            self._pending.append(future)
            self._writer.write_batch(_batch(self._pa, self._schema, request))
        return future

    def _read(self) -> None:
        from shardps_client.transport.lane import _reply, from_status

        from shardps.core import protocol, wire
        from shardps.v1 import shardps_pb2 as pb

        for chunk in self._reader:
            future = self._pending.popleft()
            if self._echo:
                future.set_result(_value(chunk))
                continue
            try:
                field, view = wire.unframe(_value(chunk))
                if field == protocol.STREAM_ERROR_FIELD:
                    err = pb.StreamError.FromString(bytes(view))
                    future.set_exception(from_status(err.code, err.message, self.address, "Stream", err.kind))
                else:
                    future.set_result(_reply(field, view))
            except BaseException as e:  # noqa: BLE001
                future.set_exception(e)

    def close(self, timeout: float = 30.0) -> None:
        self._writer.done_writing()
        self._thread.join(timeout)
        self._client.close()


def _round_trips(lane_submit, payload: bytes, n: int) -> tuple[float, float]:
    for _ in range(20):
        lane_submit(payload).result()
    t, c = time.perf_counter(), cpu_seconds(os.getpid())
    for _ in range(n):
        lane_submit(payload).result()
    return (time.perf_counter() - t) / n, (cpu_seconds(os.getpid()) - c) / n


def probe(shard: tuple, echo: tuple[int, int], n: int) -> list[dict]:
    """Echo round trips of small and pull-sized frames on both transports (client and shard CPU per trip);
    ``echo``: (port, pid) of the gRPC echo server."""
    import grpc

    from shardps.core import wire

    _, address, port, pid = shard
    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    out = []
    for size in (64, 563_000):
        frame = wire.frame(1, b"x" * size)
        for transport in ("grpc stream", "flight"):
            # Both probes talk to a bare echo: Flight's in a shard process, gRPC's in a server of its own
            # (a shard has no gRPC echo method), each fed as the client's lanes feed it.
            if transport == "flight":
                lane = FlightLane(address, port, ECHO)
                s0 = cpu_seconds(pid)
                wall, cpu = _round_trips(lambda p: lane.submit("Echo", p), frame, n)
                shard_cpu = (cpu_seconds(pid) - s0) / (n + 20)
                lane.close()
            else:
                ch = grpc.insecure_channel(f"127.0.0.1:{echo[0]}", options=opts)
                wall, cpu, shard_cpu = _grpc_echo(ch, echo[1], frame, n)
                ch.close()
            out.append({"probe": f"echo {size:,} B", "transport": transport, "round_trip_us": wall * 1e6,
                        "client_cpu_us": cpu * 1e6, "server_cpu_us": shard_cpu * 1e6})
    return out


def _echo_process(queue) -> None:
    from concurrent import futures

    import grpc

    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    server = grpc.server(futures.ThreadPoolExecutor(8), options=opts)

    def echo(requests, context):
        yield from requests

    handler = grpc.method_handlers_generic_handler(
        "echo.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    queue.put((port, os.getpid()))
    server.wait_for_termination()


def _grpc_echo(channel, pid: int, frame: bytes, n: int) -> tuple[float, float, float]:
    """The same round trips on a gRPC Python stream, fed as the client's Lane feeds it (a request iterator)."""
    import queue as q

    requests: q.Queue = q.Queue()

    def iterate():
        while (m := requests.get()) is not None:
            yield m

    call = channel.stream_stream("/echo.Echo/Stream")(iterate())

    def submit(p: bytes) -> Future:
        f: Future = Future()
        requests.put(p)
        f.set_result(next(call))
        return f

    s0 = cpu_seconds(pid)
    wall, cpu = _round_trips(submit, frame, n)
    shard_cpu = (cpu_seconds(pid) - s0) / (n + 20)
    requests.put(None)
    call.cancel()
    return wall, cpu, shard_cpu


def trainer(addresses: list[str], flight_ports: list[int], pids: list[int], transport: str, budget_s: float,
            rank: int, queue) -> None:
    import torch
    from shardps_client import Client

    torch.set_num_threads(1)
    batches = unique_batches(100 + rank, 24, 8192, 1_000_000, 1.1)
    with Client(addresses, read_your_writes=False) as c:
        if transport == "flight":
            for lane in c.transport.lanes:
                lane.close()
            c.transport.lanes = [FlightLane(a, p) for a, p in zip(addresses, flight_ports)]
        result = measure(lambda ids: c.pull("bench", ids), lambda ids, g: c.push("bench", ids, g), c.flush,
                         batches, budget_s, pids)
        c.flush()
        # The rows this transport reads are the ones a plain gRPC client reads (the prototype carries real calls).
        ids = torch.from_numpy(batches[0])
        with Client(addresses) as plain:
            result["same_rows"] = bool(torch.equal(c.pull("bench", ids), plain.pull("bench", ids)))
    queue.put(result)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--budget", type=float, default=3.0, help="seconds per measured phase")
    p.add_argument("--repeat", type=int, default=3, help="interleaved runs of each transport")
    p.add_argument("--probes", type=int, default=2000, help="round trips per echo probe")
    p.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    try:
        _flight()
    except ImportError:
        print("bench_transport needs pyarrow (pip install pyarrow); skipped", file=sys.stderr)
        return 0
    if args.quick:
        args.budget, args.repeat, args.probes = 0.5, 1, 200
    from shardps_client import SGD, Client

    from shardps.core.specs import Initializer

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    shards = [ctx.Process(target=shard_process, args=(i, args.shards, queue), daemon=True) for i in range(args.shards)]
    echo = ctx.Process(target=_echo_process, args=(queue,), daemon=True)
    for proc in shards:
        proc.start()
    try:
        found = sorted(queue.get(timeout=120) for _ in shards)
        echo.start()
        echo_server = queue.get(timeout=60)
        addresses, ports, pids = [f[1] for f in found], [f[2] for f in found], [f[3] for f in found]
        with Client(addresses) as c:
            c.create_table("bench", dim=DIM, num_embeddings=1_000_000, optimizer=SGD(lr=0.01),
                           initializer=Initializer("zeros"))
        progress = Progress(2 * args.repeat + 1, "transport")
        rows = probe(found[0], echo_server, args.probes)
        progress.step("echo probes")
        runs: dict[str, list[dict]] = {"grpc stream": [], "flight": []}
        for rep in range(args.repeat):
            for transport in runs:
                proc = ctx.Process(target=trainer, args=(addresses, ports, pids, transport, args.budget, 0, queue))
                proc.start()
                runs[transport].append(queue.get(timeout=300))
                proc.join(30)
                progress.step(f"{transport} (pass {rep + 1}/{args.repeat})")
    finally:
        for proc in [*shards, echo]:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
    base = runs["grpc stream"]
    for transport, results in runs.items():
        ratios = [r["both_rows_per_s"] / b["both_rows_per_s"] for r, b in zip(results, base)]
        x, x_range = median_and_range(ratios)
        both = [r["both_rows"] for r in results]
        rows.append({
            "probe": "standard workload", "transport": transport,
            "rows_per_s": statistics.median(r["both_rows_per_s"] for r in results), "x_grpc": x, "x_grpc_range": x_range,
            "client_cpu_s_per_m_rows": statistics.median(r["client_cpu_s"] / n * 1e6 for r, n in zip(results, both)),
            "server_cpu_s_per_m_rows": statistics.median(r["server_cpu_s"] / n * 1e6 for r, n in zip(results, both)),
            "pull_p50_ms": statistics.median(r["pull_p50_ms"] for r in results),
            "runs_rows_per_s": [r["both_rows_per_s"] for r in results],
            "same_rows": all(r["same_rows"] for r in results),
        })
    cols = [("probe", "probe", ""), ("transport", "transport", ""), ("round_trip_us", "round trip us", ".0f"),
            ("client_cpu_us", "client CPU us", ".0f"), ("server_cpu_us", "server CPU us", ".0f"),
            ("rows_per_s", "rows/s", ",.0f"), ("x_grpc", "x grpc", ".2f"), ("x_grpc_range", "x grpc range", ""),
            ("client_cpu_s_per_m_rows", "client CPU s/M rows", ".2f"),
            ("server_cpu_s_per_m_rows", "shard CPU s/M rows", ".2f"), ("pull_p50_ms", "pull p50 ms", ".2f")]
    print()
    print(table(rows, cols))
    out = write_outputs("transport", {"args": vars(args)}, rows, __import__("pathlib").Path(args.out))
    std = [r for r in rows if r["probe"] == "standard workload"]
    plot(out / "transport.png", [("standard workload, 2 shards", "run",
                                  {r["transport"]: (list(range(1, len(r["runs_rows_per_s"]) + 1)), r["runs_rows_per_s"])
                                   for r in std})], "rows/s")
    print(f"\nwrote {out / 'transport.json'} and {out / 'transport.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
