"""A misbehaving client next to a well-behaved one: the shard neither crashes nor stalls the good one.

The good client is the obvious training loop with a default ``Client``; the bad one (tests/misbehaving.py)
sends malformed, oversized or refused requests, holds streams or waiting heartbeats open, or floods the
shard with unknown tokens. Both are processes of their own, talking to a shard started with ``shardps
serve``. The bad processes start, and are ready, before the first window; then each in turn runs for
SHARDPS_FAIR_WINDOW_S beside the good client (SHARDPS_FAIR_PAIRS of them; `make fairness` runs more). In
each such window the good client must make progress (at least MIN_STEPS steps, however long the machine
takes: up to STALL_S) and none of its calls may fail; the shard must stay up and answer afterwards.

How fast the good client runs beside a bad one (its speed against its speed alone) is a measurement,
not a test: ``python -m benchmarks.bench_fairness``. Before the fair shares of shardps.server.rpc.fair
it gave 0.52 (malformed), 0.56 (refused pulls) and 0 (waiting heartbeats: every handler thread held, the
good client could not connect); this test catches the last kind, a stall.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time

import grpc
import pytest
from shardps_client import SGD, Client

from shardps.core.tokens import bearer
from shardps.server.rpc.fair import FairScheduler, release
from shardps.v1 import shardps_pb2 as pb
from tests import misbehaving
from tests.procs import start_shard

WINDOW_S = float(os.environ.get("SHARDPS_FAIR_WINDOW_S", "1.2"))
PAIRS = int(os.environ.get("SHARDPS_FAIR_PAIRS", "1"))
RAMP_S = 1.0  # the bad client runs this long before its window (refusals slow down over about a second)
MIN_STEPS = 3  # the good client's steps in each window beside a bad client: progress, not a speed
STALL_S = 30.0  # how long a window may stretch while the good client makes them (a busy machine included)
TOKENS = {"good": "g" * 24, "bad": "b" * 24, "admin": "a" * 24}


def _progress_in(counter, seconds: float) -> tuple[int, float]:
    """(steps, seconds) of a window of ``seconds``, stretched up to STALL_S until MIN_STEPS steps were made."""
    start, t0 = counter.value, time.monotonic()
    time.sleep(seconds)
    while counter.value - start < MIN_STEPS and time.monotonic() - t0 < STALL_S:
        time.sleep(0.05)
    return counter.value - start, time.monotonic() - t0


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A shard without tokens (connections are the callers) and one with tokens (tokens are)."""
    wd = tmp_path_factory.mktemp("fair")
    tokens = wd / "tokens"
    tokens.write_text("".join(f"{'admin' if k == 'admin' else 'trainer'} {v}\n" for k, v in TOKENS.items()))
    plain = start_shard(0, 1, wd)
    with_tokens = start_shard(0, 1, wd, extra=["--tokens-file", str(tokens)])
    for shard, token in ((plain, None), (with_tokens, TOKENS["admin"])):
        with Client([shard.address], token=token) as c:
            c.create_table(misbehaving.TABLE, dim=misbehaving.DIM, num_embeddings=misbehaving.ROWS, optimizer=SGD(lr=0.01))
    yield {"plain": plain, "tokens": with_tokens}
    for shard in (plain, with_tokens):
        shard.terminate()


CASES = [("malformed", "plain", 4), ("oversize", "plain", 2), ("refused_pull", "plain", 4),
         ("streams", "plain", 64), ("waiting", "plain", 100), ("bad_token", "tokens", 4)]


@pytest.mark.parametrize("kind, shard, threads", CASES, ids=[c[0] for c in CASES])
@pytest.mark.timeout(int(150 + PAIRS * (RAMP_S + WINDOW_S + STALL_S + 10)))
def test_a_misbehaving_client_neither_stalls_a_good_one_nor_crashes_the_shard(shards, kind, shard, threads):
    shard = shards[shard]
    token = TOKENS["good"] if shard is shards["tokens"] else None
    bad_token = TOKENS["bad"] if token else None
    ctx = mp.get_context("spawn")
    steps, errors = ctx.Value("q", 0), ctx.Value("q", 0)
    good = ctx.Process(target=misbehaving.train, args=(shard.address, steps, errors, token), daemon=True)
    good.start()
    attacks = []
    try:
        deadline = time.monotonic() + 60
        while steps.value < 20:
            assert good.is_alive() and time.monotonic() < deadline, "the good client did not start"
            time.sleep(0.1)
        # Every bad process starts (and is ready) before the first window: no start-up inside a window.
        for _ in range(PAIRS):
            ready, go = ctx.Event(), ctx.Event()
            bad = ctx.Process(target=misbehaving.attack, args=(shard.address, kind, threads, ready, go, bad_token),
                              daemon=True)
            bad.start()
            attacks.append((bad, ready, go))
        for _bad, ready, _ in attacks:
            assert ready.wait(60), "the misbehaving client did not start"
        windows = []
        for bad, _, go in attacks:
            go.set()
            time.sleep(RAMP_S)
            made, seconds = _progress_in(steps, WINDOW_S)
            windows.append(made)
            assert made >= MIN_STEPS, f"{kind}: the good client made {made} steps in {seconds:.0f}s beside the bad one"
            assert bad.is_alive(), f"{kind}: the misbehaving client stopped before the end of its window"
            bad.terminate()
            bad.join(10)
        print(f"{kind}: the good client's steps in each window beside the bad one: {windows}")
        assert shard.proc.poll() is None, f"the shard died: {shard.log()[-2000:]}"
        assert errors.value == 0, f"the good client's calls failed {errors.value} times"
    finally:
        for bad, _, _ in attacks:  # those left after a failed window
            bad.terminate()
        good.terminate()
        good.join(10)
    with Client([shard.address], token=TOKENS["admin"] if token else None) as c:  # still answers
        assert c.pull(misbehaving.TABLE, [1, 2, 3]).shape == (3, misbehaving.DIM)


def test_per_token_limits_refuse_calls_and_streams_over_them(tmp_path):
    trainer = "t" * 24
    path = tmp_path / "tokens"
    path.write_text(f"admin {'a' * 24}\ntrainer {trainer} max_calls=2 max_streams=1 max_waiting=5 weight=2\n")
    shard = start_shard(0, 1, tmp_path, extra=["--tokens-file", str(path)])
    try:
        channel = grpc.insecure_channel(shard.address)
        heartbeat = channel.unary_unary("/shardps.v1.Shard/Heartbeat",
                                        request_serializer=pb.HeartbeatRequest.SerializeToString,
                                        response_deserializer=pb.HeartbeatResponse.FromString)
        # Two calls held open (each waits 6 s for a clock that never comes); a third is refused once both are in.
        # Asked until then: nothing tells the test when they reached the shard.
        wait = pb.HeartbeatRequest(rank=0, world_size=2, clock=0, wait_min_clock=1 << 40, wait_s=6)
        held = [heartbeat.future(wait, metadata=bearer(trainer), timeout=30) for _ in range(2)]

        def refused_once_full(call) -> grpc.RpcError:
            deadline = time.monotonic() + 30
            while True:
                try:
                    call()
                except grpc.RpcError as e:
                    return e
                assert time.monotonic() < deadline, "the token's limit never refused a call"
                time.sleep(0.02)

        refused = refused_once_full(lambda: heartbeat(pb.HeartbeatRequest(rank=0, world_size=2),
                                                      metadata=bearer(trainer), timeout=10))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "token 2 (trainer) has 2 calls open" in refused.details()
        # another token is not held back by this one's limit
        heartbeat(pb.HeartbeatRequest(rank=1, world_size=2), metadata=bearer("a" * 24), timeout=10)
        for f in held:
            f.result()
        stream = channel.stream_stream("/shardps.v1.Shard/Stream")
        frames: queue.Queue = queue.Queue()
        first = stream(iter(frames.get, None), metadata=bearer(trainer), timeout=30)
        refused = refused_once_full(lambda: list(stream(iter([]), metadata=bearer(trainer), timeout=10)))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "streams open" in refused.details()
        frames.put(None)
        first.cancel()
        channel.close()
    finally:
        shard.terminate()


def test_fair_scheduler_starts_the_light_caller_before_a_heavy_callers_queue():
    """Start-time fair queuing: with one slot held and a heavy caller's calls queued, a light caller's
    call starts next, and the heavy caller's calls keep their own order."""
    sched = FairScheduler(slots=1)
    started: list[str] = []
    lock = threading.Lock()
    sched.acquire("holder")

    def call(name: str, caller: str) -> None:
        sched.acquire(caller)
        with lock:
            started.append(name)
        release()

    def queued(n: int) -> None:  # each call waits in the scheduler before the next starts: queued in this order
        deadline = time.monotonic() + 30
        while sched.waited < n:
            assert time.monotonic() < deadline, f"{sched.waited} calls waiting, expected {n}"
            time.sleep(0.005)

    threads = []
    for i, (name, caller) in enumerate([("heavy-0", "heavy"), ("heavy-1", "heavy"), ("heavy-2", "heavy"),
                                        ("light", "light")]):
        threads.append(threading.Thread(target=call, args=(name, caller)))
        threads[-1].start()
        queued(i + 1)
    assert sched.waited == 4
    release()  # the holder's slot goes to the earliest start tag
    for t in threads:
        t.join(5)
    assert started.index("light") <= 1, started  # after at most one of the calls queued before it
    assert [s for s in started if s.startswith("heavy")] == ["heavy-0", "heavy-1", "heavy-2"]
