"""A misbehaving client and a well-behaved one, as separate processes (tests/test_fairness.py,
benchmarks/bench_fairness.py).

``attack`` sends one kind of bad traffic from several threads until it is stopped; ``train``
is the obvious training loop with a default ``Client`` and counts its steps.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Optional

import numpy as np

DIM = 64
ROWS = 1_000_000
TABLE = "fair"

# kind -> what it does (each from ``threads`` threads, as fast as the shard answers)
KINDS = {
    "malformed": "bytes that are no request, to Push",
    "oversize": "16 MiB pushes, over the 4 MiB message limit",
    "refused_pull": "pulls of 500,000 ids, whose 128 MB reply the shard refuses",
    "heavy_push": "valid pushes of 15,000 rows at the message limit (load, not abuse)",
    "streams": "call streams opened and never used",
    "waiting": "heartbeats waiting 60 s for a clock no worker reaches",
    "bad_token": "pulls with unknown tokens",
}


def batches(n: int = 16, size: int = 8192, seed: int = 0) -> list[np.ndarray]:
    """The standard workload's batches: Zipf(1.1) ids over ROWS."""
    rng = np.random.default_rng(seed)
    return [(np.minimum(rng.zipf(1.1, size), ROWS) - 1).astype(np.int64) for _ in range(n)]


def train(address: str, steps: Any, errors: Any, token: Optional[str] = None) -> None:
    """Pull, then push a gradient, for ever (until terminated), counting steps in ``steps``."""
    from shardps_client import Client

    data = batches()
    with Client([address], token=token) as c:
        n = 0
        while True:
            ids = data[n % len(data)]
            try:
                emb = c.pull(TABLE, ids)
                c.push(TABLE, ids, emb * 0.01)
            except Exception:  # noqa: BLE001 - counted; the test asserts there were none
                with errors.get_lock():
                    errors.value += 1
                continue
            n += 1
            with steps.get_lock():
                steps.value += 1


def attack(address: str, kind: str, threads: int, ready: Any, go: Any, token: Optional[str] = None) -> None:
    """Send ``kind`` of bad traffic (KINDS) once ``go`` is set, until the process is terminated."""
    import grpc

    from shardps.core.tokens import bearer
    from shardps.v1 import shardps_pb2 as pb

    big = 64 << 20
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", big),
                                                      ("grpc.max_receive_message_length", big),
                                                      ("grpc.use_local_subchannel_pool", 1)])
    metadata = bearer(token) if token else None

    def tensor(a: np.ndarray, dtype: int) -> pb.Tensor:
        return pb.Tensor(dtype=dtype, shape=list(a.shape), data=a.tobytes())

    ids = np.arange(15_000, dtype=np.int64) * 7 + 3
    heavy = pb.PushRequest(table=TABLE, ids=tensor(ids, pb.INT64),
                           grads=tensor(np.full((ids.size, DIM), 1e-6, np.float32), pb.FLOAT32)).SerializeToString()
    refused = pb.PullRequest(table=TABLE, ids=tensor(np.arange(500_000, dtype=np.int64), pb.INT64)).SerializeToString()
    small = pb.PullRequest(table=TABLE, ids=tensor(np.arange(100, dtype=np.int64), pb.INT64)).SerializeToString()
    junk, oversize = os.urandom(2000), os.urandom(16 << 20)
    push = channel.unary_unary("/shardps.v1.Shard/Push")
    pull = channel.unary_unary("/shardps.v1.Shard/Pull")
    heartbeat = channel.unary_unary("/shardps.v1.Shard/Heartbeat")
    wait = pb.HeartbeatRequest(rank=0, world_size=2, clock=0, wait_min_clock=1 << 40, wait_s=60).SerializeToString()
    calls = {
        "malformed": lambda: push(junk, timeout=10, metadata=metadata),
        "oversize": lambda: push(oversize, timeout=30, metadata=metadata),
        "refused_pull": lambda: pull(refused, timeout=30, metadata=metadata),
        "heavy_push": lambda: push(heavy, timeout=30, metadata=metadata),
        "waiting": lambda: heartbeat(wait, timeout=70, metadata=metadata),
        "bad_token": lambda: pull(small, timeout=10, metadata=bearer(os.urandom(24).hex())),
    }
    ready.set()
    go.wait()
    if kind == "streams":
        held: list[Any] = []
        for _ in range(threads):  # each stream's requests never come; the streams stay open
            q: queue.Queue = queue.Queue()
            held.append(channel.stream_stream("/shardps.v1.Shard/Stream")(iter(q.get, None), metadata=metadata))
        while True:
            time.sleep(1)
    call = calls[kind]

    def loop() -> None:
        while True:
            try:
                call()
            except grpc.RpcError:
                pass

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
