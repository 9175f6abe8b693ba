"""Replica groups: what replication costs, and how long a failover leaves a shard without a writable primary.

- Push throughput: one shard index run as a group of R members (R = 1: no replicas; 2 and 3 with --ack primary and
  --ack quorum), each with a data dir (the write-ahead log, fsync interval: the default), etcd on loopback; one
  trainer pushes the standard workload's batches (1M x 64 float32, Zipf(1.1) batches of 8,192 ids, SGD) for
  --budget seconds; rows/s as ratios of R = 1's from the same round (--repeat rounds, interleaved).
- Failover: R = 3, --ack quorum; a trainer pushes +1s with wait=True while the primary is killed with SIGKILL
  --kills times (restarted each time, rejoining as a backup); the seconds between the kill and the
  acknowledgement of the first push sent after it, and whether the table holds every acknowledged push exactly once.

    python -m benchmarks.bench_replicas [--quick] [--repeat 3] [--kills 10]
Writes benchmarks/results/replicas.json and replicas.png. Needs etcd (Debian's etcd-server).
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import threading
import time
from typing import Any, Optional

import numpy as np
import torch
from shardps_client import SGD, Client, Initializer

from benchmarks.common import RESULTS, Progress, median_and_range, plot, table, unique_batches, write_outputs
from shardps.server.ops.etcd import INSTALL, LocalEtcd, etcd_binary
from shardps.server.ops.launcher import LocalCluster

DIM = 64
CONFIGS = [(1, "-"), (2, "primary"), (2, "quorum"), (3, "primary"), (3, "quorum")]


def push_rate(addresses: list[str], budget: float) -> float:
    batches = [torch.from_numpy(b) for b in unique_batches(7, 16, 8192, 1_000_000, 1.1)]
    grads = [torch.full((len(b), DIM), 0.001) for b in batches]
    with Client(addresses, read_your_writes=False) as c:
        c.create_table("r", dim=DIM, num_embeddings=1_000_000, optimizer=SGD(lr=0.01), initializer=Initializer("zeros"))
        for i in range(3):
            c.push("r", batches[i], grads[i])
        c.flush()
        n, i, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < budget:
            k = i % len(batches)
            c.push("r", batches[k], grads[k])
            n += len(batches[k])
            i += 1
        c.flush()
        return n / (time.perf_counter() - t0)


def _cluster(tmp: str, replicas: int, ack: str, etcd: Optional[str]) -> LocalCluster:
    serve = ["--ack", ack] if replicas > 1 else []
    return LocalCluster(1, data_dir=tmp, serve_args=serve, replicas=replicas, etcd=etcd, log_dir=tmp)


def throughput(args: argparse.Namespace, etcd: LocalEtcd, progress: Progress) -> list[dict[str, Any]]:
    configs = [(1, "-"), (3, "quorum")] if args.quick else CONFIGS
    runs: dict[tuple[int, str], list[float]] = {c: [] for c in configs}
    for _ in range(args.repeat):
        for replicas, ack in configs:
            with tempfile.TemporaryDirectory(prefix="shardps-rep-") as tmp:
                with _cluster(tmp, replicas, ack if replicas > 1 else "quorum", etcd.url) as cluster:
                    runs[(replicas, ack)].append(push_rate(cluster.addresses, args.budget))
            progress.step(f"R={replicas} ack={ack}")
    out = []
    base = runs[(1, "-")]
    for (replicas, ack), rates in runs.items():
        ratio, spread = median_and_range([r / b for r, b in zip(rates, base)])
        out.append({"part": "throughput", "replicas": replicas, "ack": ack, "rows_per_s": float(np.median(rates)),
                    "runs_rows_per_s": rates, "x_r1": ratio, "x_r1_range": spread})
    return out


def failover(args: argparse.Namespace, etcd: LocalEtcd, progress: Progress) -> dict[str, Any]:
    rows = 4096
    counts = np.zeros(rows, np.int64)
    acked = [0]
    last_sent = [0.0]  # when the last acknowledged push was sent
    stop = threading.Event()
    errors: list[BaseException] = []
    with tempfile.TemporaryDirectory(prefix="shardps-failover-") as tmp:
        with _cluster(tmp, 3, "quorum", etcd.url) as cluster:
            addresses = cluster.addresses
            with Client(addresses) as c:
                c.create_table("cnt", dim=2, num_embeddings=rows, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))

            def train() -> None:
                rng = np.random.default_rng(0)
                try:
                    with Client(addresses, timeout=10, retry_timeout=60) as c:
                        while not stop.is_set():
                            ids = rng.choice(rows, 256, replace=False)
                            sent = time.monotonic()
                            c.push("cnt", torch.from_numpy(ids), torch.ones(256, 2), wait=True)
                            counts[ids] += 1
                            last_sent[0] = sent
                            acked[0] += 1
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            t = threading.Thread(target=train)
            t.start()
            gaps = []
            try:
                for _ in range(args.kills):
                    time.sleep(1.0)
                    primary = _primary(cluster)
                    t0 = time.monotonic()
                    cluster.kill(primary)
                    # until a push sent after the kill is acknowledged (one answered just before does not count)
                    while last_sent[0] < t0 and not errors and time.monotonic() - t0 < 60:
                        time.sleep(0.005)
                    gaps.append(time.monotonic() - t0)
                    cluster.restart(primary)
                    progress.step(f"kill {len(gaps)}: {gaps[-1]:.2f} s")
            finally:
                stop.set()
                t.join(120)
            with Client(addresses) as c:
                exact = bool(np.array_equal(c.pull("cnt", torch.arange(rows))[:, 0].numpy(),
                                            -counts.astype(np.float32)))
    return {"part": "failover", "kills": len(gaps), "gaps_s": gaps, "median_s": float(np.median(gaps)),
            "p90_s": float(np.percentile(gaps, 90)), "max_s": float(max(gaps)), "acknowledged_pushes": acked[0],
            "exact": exact, "errors": [repr(e) for e in errors]}


def _primary(cluster: LocalCluster) -> int:
    import grpc

    from shardps.v1 import shardps_pb2 as pb

    while True:
        for i, p in enumerate(cluster.procs):
            try:
                with grpc.insecure_channel(p.address) as channel:
                    info = channel.unary_unary(
                        "/shardps.v1.Shard/ShardInfo", request_serializer=pb.ShardInfoRequest.SerializeToString,
                        response_deserializer=pb.ShardInfoResponse.FromString)(pb.ShardInfoRequest(), timeout=2)
                if info.replica.role == "primary":
                    return i
            except grpc.RpcError:
                continue
        time.sleep(0.05)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, default=4.0, help="seconds of pushes per configuration")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every configuration, interleaved")
    p.add_argument("--kills", type=int, default=10, help="primaries killed in the failover part")
    p.add_argument("--quick", action="store_true", help="a smoke run: R = 1 and 3 (quorum), short budget, 1 kill")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS, help="directory for replicas.json and replicas.png")
    args = p.parse_args(argv)
    if etcd_binary() is None:
        raise SystemExit(f"bench_replicas: {INSTALL}")
    if args.quick:
        args.budget, args.kills, args.repeat = 1.0, 1, 1
    progress = Progress((2 if args.quick else len(CONFIGS)) * args.repeat + args.kills, "replicas")
    with tempfile.TemporaryDirectory(prefix="shardps-etcd-") as tmp, LocalEtcd(str(pathlib.Path(tmp) / "etcd")) as etcd:
        rows = throughput(args, etcd, progress)
        fo = failover(args, etcd, progress)
    print(table(rows, [("replicas", "members", "d"), ("ack", "ack", ""), ("rows_per_s", "push rows/s", ",.0f"),
                       ("x_r1", "x R=1", ".2f"), ("x_r1_range", "range", "")]))
    print(f"\nfailover, R=3 --ack quorum, {fo['kills']} kills of the primary: seconds without a writable primary "
          f"median {fo['median_s']:.2f}, p90 {fo['p90_s']:.2f}, max {fo['max_s']:.2f} "
          f"({', '.join(f'{g:.2f}' for g in fo['gaps_s'])}); every acknowledged push exactly once: {fo['exact']}")
    out = write_outputs("replicas", {"args": {k: str(v) for k, v in vars(args).items()}, "failover": fo},
                        rows + [fo], args.out)
    plot(out / "replicas.png", [
        ("push rows/s", "members", {ack: ([r["replicas"] for r in rows if r["ack"] in (ack, "-")],
                                          [r["rows_per_s"] for r in rows if r["ack"] in (ack, "-")])
                                    for ack in ("primary", "quorum")}),
        ("failover", "kill", {"seconds without a primary": (list(range(1, fo["kills"] + 1)), fo["gaps_s"])}),
    ], "rows/s | seconds")
    print(f"\nwrote {out / 'replicas.json'} and {out / 'replicas.png'}")


if __name__ == "__main__":
    main()
