"""Throughput of pulls and pushes: shardps against the alternatives, in one run.

The standard workload: a 1,000,000 x 64 float32 table; each step draws 8,192
ids from a Zipf distribution (a=1.1, ~4,400 unique), pulls their rows and
pushes one gradient row per unique id (SGD). Metric: rows per second (a unique
row pulled and pushed counts one), after warm-up, with the batches generated
before timing. ``shardps`` runs as tuned (zeros initializer, one torch thread,
read_your_writes=False); ``shardps_defaults`` is the loop a new user writes
(default Client and initializer, torch's default threads); ``shardps_tls``, ``shardps_tokens`` and
``shardps_mtls_tokens`` are the tuned path with TLS, bearer tokens, or mutual TLS and tokens
(``--backends shardps shardps_tls shardps_tokens shardps_mtls_tokens``: their cost, as "x shardps");
pulls and pushes travel over the data plane (ZeroMQ, the client's default); ``shardps_grpc`` and
``shardps_defaults_grpc`` are the same loops on gRPC streams (``Client(data_plane="grpc")``), ``shardps_tcp`` and
``shardps_defaults_tcp`` on the data plane's TCP ports instead of its Unix sockets (``data_plane="zmq-tcp"``, as
from another machine), ``shardps_ipc`` and ``shardps_defaults_ipc`` on its Unix sockets without shared-memory regions
(shards served with ``--data-regions 0``). Baselines (same run, same machine): a torch.distributed.rpc
parameter server (``torch_rpc_tcp``: restricted to its TCP transport, as across machines), a Ray actor parameter
server (if Ray is installed), and the same gather/scatter in one process (no transport).

``--placement lab lab-10g lab-delay`` runs the same configurations across the lab's hosts as well
(``benchmarks/placement.py``: each shard and each trainer on a host of its own, the rpc peer placed the same way;
as is, capped at 10 Gbit/s per host, or with 100 us of proxy delay each way on the trainer-shard links). Every
run also times its first pass over the batches (rows created lazily, where rpc's table is preallocated) beside
the steady state.

    python -m benchmarks.bench_throughput                 # full grid (a few minutes on 2 cores)
    python -m benchmarks.bench_throughput --quick         # smoke run
    python -m benchmarks.bench_throughput --quick --budget 3 --shards 2 --repeat 5   # the headline, 5 runs
    python -m benchmarks.bench_throughput --quick --budget 3 --shards 2 --repeat 3 \
        --backends shardps_defaults shardps shardps_defaults_tcp torch_rpc torch_rpc_tcp \
        --placement local lab lab-10g lab-delay                                       # same host and across hosts
Writes benchmarks/results/throughput.json and throughput.png.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import numpy as np
import torch

from benchmarks import baselines
from benchmarks.common import (
    RESULTS,
    Progress,
    cpu_seconds,
    median_and_range,
    percentile_ms,
    plot,
    table,
    unique_batches,
    write_outputs,
)
from benchmarks.placement import PLACEMENTS, LabHosts, Where, enter_trainer, rpc_backend_options
from shardps.server.ops.launcher import free_port

DIM = 64


@dataclass(frozen=True)
class Config:
    backend: str  # shardps | torch_rpc | ray | in_process
    shards: int = 2
    trainers: int = 1
    batch: int = 8192
    zipf: Optional[float] = 1.1  # None: uniform
    rows: int = 1_000_000
    wire: str = "float32"
    group: str = "standard"
    placement: str = "local"

    @property
    def label(self) -> str:
        dist = "uniform" if self.zipf is None else f"zipf{self.zipf}"
        return (f"{self.backend} s={self.shards} t={self.trainers} b={self.batch} {dist} "
                f"rows={self.rows:,} {self.wire} {self.placement}")


# ---- the trainer loop (runs in each trainer process) ----------------------------------------


def measure(pull, push, flush, batches: list[np.ndarray], budget_s: float, server_pids: list[int]) -> dict[str, Any]:
    """rows/s for pull+push, pull only, push only; then p50/p99 of single sync calls.

    Server CPU seconds are read from /proc around the pull+push phase. First the first pass: pull and push every
    batch once on the fresh table (rows are created as they are first pulled).
    """
    tensors = [torch.from_numpy(b) for b in batches]
    grads = [torch.full((len(b), DIM), 0.001) for b in batches]
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for k in range(len(tensors)):
        pull(tensors[k])
        push(tensors[k], grads[k])
    flush()
    out["first_pass_rows_per_s"] = sum(len(t) for t in tensors) / (time.perf_counter() - t0)
    for phase in ("both", "pull", "push"):
        for i in range(3):  # warm-up
            if phase != "push":
                pull(tensors[i])
            if phase != "pull":
                push(tensors[i], grads[i])
        flush()
        cpu0 = sum(cpu_seconds(p) for p in server_pids) if server_pids else 0.0
        own0 = cpu_seconds(os.getpid())
        rows, i, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < budget_s:
            k = i % len(tensors)
            if phase != "push":
                pull(tensors[k])
            if phase != "pull":
                push(tensors[k], grads[k])
            rows += len(tensors[k])
            i += 1
        flush()
        out[f"{phase}_rows_per_s"] = rows / (time.perf_counter() - t0)
        out[f"{phase}_rows"] = rows
        if phase == "both":
            out["client_cpu_s"] = cpu_seconds(os.getpid()) - own0
            if server_pids:
                out["server_cpu_s"] = sum(cpu_seconds(p) for p in server_pids) - cpu0
    pulls, pushes = [], []
    for i in range(min(40, len(tensors))):
        t = time.perf_counter()
        pull(tensors[i])
        pulls.append(time.perf_counter() - t)
        t = time.perf_counter()
        push(tensors[i], grads[i])
        flush()
        pushes.append(time.perf_counter() - t)
    out.update(pull_p50_ms=percentile_ms(pulls, 50), pull_p99_ms=percentile_ms(pulls, 99),
               push_p50_ms=percentile_ms(pushes, 50), push_p99_ms=percentile_ms(pushes, 99))
    return out


def shardps_trainer(cfg: Config, addresses: list[str], pids: list[int], rank: int, budget_s: float, queue,
                    defaults: bool = False, security: Optional[dict[str, Any]] = None,
                    where: Optional[Where] = None) -> None:
    """As tuned (one torch thread, read_your_writes=False), or with ``defaults`` the loop a new user
    writes: a default Client, torch's default threads, gradients computed by torch (``emb * 0.1``)."""
    try:
        enter_trainer(where, rank)
        from shardps_client import Client

        if not defaults:
            torch.set_num_threads(1)
        batches = unique_batches(100 + rank, 24, cfg.batch, cfg.rows, cfg.zipf)
        kwargs: dict[str, Any] = {} if defaults else {"wire_dtype": cfg.wire, "read_your_writes": False}
        if security:
            from shardps_client import TLS

            kwargs["token"] = security.get("token")
            kwargs["tls"] = TLS(**security["tls"]) if security.get("tls") else None
            if security.get("data_plane"):
                kwargs["data_plane"] = security["data_plane"]
        scale = 0.1 if defaults else None
        with Client(addresses, **kwargs) as c:
            assert c.table_spec("bench").dim == DIM
            result = measure(lambda ids: c.pull("bench", ids),
                             lambda ids, g: c.push("bench", ids, g if scale is None else g * scale), c.flush,
                             batches, budget_s, pids if rank == 0 else [])
        queue.put((rank, result))
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()}))


def rpc_trainer(cfg: Config, master: str, rank: int, budget_s: float, queue, where: Optional[Where] = None) -> None:
    try:
        enter_trainer(where, rank)
        from torch.distributed import rpc

        torch.set_num_threads(1)
        opts = rpc_backend_options(where, f"tcp://{master}")
        rpc.init_rpc(f"trainer{rank}", rank=cfg.shards + rank, world_size=cfg.shards + cfg.trainers,
                     rpc_backend_options=opts)
        client = baselines.RpcClient(cfg.shards)
        pending: list = []

        def push(ids, g):
            pending.extend(client.push(ids, g))

        def flush():
            for f in pending:
                f.wait()
            pending.clear()

        batches = unique_batches(100 + rank, 24, cfg.batch, cfg.rows, cfg.zipf)
        pids = [rpc.rpc_sync(f"ps{s}", baselines.rpc_pid) for s in range(cfg.shards)] if rank == 0 else []
        result = measure(lambda ids: client.pull(ids, DIM), push, flush, batches, budget_s, pids)
        rpc.shutdown()
        queue.put((rank, result))
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()}))


# ---- running one configuration ---------------------------------------------------------------


def _collect(queue, n: int, procs: list, timeout: float) -> list[dict]:
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < n and time.monotonic() < deadline:
        try:
            rank, r = queue.get(timeout=1.0)
            results[rank] = r
        except Exception:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return [results.get(r, {"error": "no result (timeout)"}) for r in range(n)]


# The security settings measured beside plain shardps (tuned path): (TLS: None, "tls" or "mtls"; tokens).
SECURITY = {"shardps_tls": ("tls", False), "shardps_tokens": (None, True), "shardps_mtls_tokens": ("mtls", True)}


def run_shardps(cfg: Config, budget_s: float, defaults: bool = False, where: Optional[Where] = None) -> dict[str, Any]:
    """shardps tuned as the benchmark always ran it (zeros initializer, one torch thread,
    read_your_writes=False), or with ``defaults`` as a new user runs it (``shardps_defaults``); the
    ``shardps_tls`` / ``shardps_tokens`` / ``shardps_mtls_tokens`` backends are the tuned path with TLS
    (certificates from ``shardps cluster --tls``), bearer tokens, or both and mutual TLS."""
    import tempfile

    from shardps_client import SGD, TLS, Client

    from shardps.core.specs import Initializer
    from shardps.server.ops.launcher import LocalCluster

    ctx = mp.get_context("spawn")
    tls, tokens = SECURITY.get(cfg.backend, (None, False))
    with tempfile.TemporaryDirectory(prefix="shardps-bench-") as tmp:
        suffix = cfg.backend[cfg.backend.rfind("_"):]
        serve_args: list[str] = ["--data-regions", "0"] if suffix == "_ipc" else []
        plane = {"_grpc": "grpc", "_tcp": "zmq-tcp"}.get(suffix)
        security: dict[str, Any] = {"data_plane": plane} if plane else {}
        admin = None
        if tokens:
            admin, trainer = "admin-" + os.urandom(16).hex(), "trainer-" + os.urandom(16).hex()
            path = os.path.join(tmp, "tokens")
            with open(path, "w") as f:
                f.write(f"admin {admin}\ntrainer {trainer}\n")
            serve_args += ["--tokens-file", path]
            security["token"] = trainer
        placements = where.shard_placements(cfg.shards) if where else ()
        with LocalCluster(cfg.shards, serve_args=serve_args, tls=tls, log_dir=tmp, placements=placements) as cluster:
            security["tls"] = cluster.tls_files
            with Client(cluster.addresses, token=admin,
                        tls=TLS(**security["tls"]) if security["tls"] else None) as c:
                c.create_table("bench", dim=DIM, num_embeddings=cfg.rows, optimizer=SGD(lr=0.01),
                               initializer=None if defaults else Initializer("zeros"))
            pids = [p.popen.pid for p in cluster.procs]
            queue = ctx.Queue()
            procs = [ctx.Process(target=shardps_trainer,
                                 args=(cfg, cluster.addresses, pids, r, budget_s, queue, defaults, security, where))
                     for r in range(cfg.trainers)]
            for p in procs:
                p.start()
            results = _collect(queue, cfg.trainers, procs, 120 + 6 * budget_s)
    return _merge(results)


def run_rpc(cfg: Config, budget_s: float, where: Optional[Where] = None) -> dict[str, Any]:
    """torch.distributed.rpc as it runs here (shared memory between processes of one machine), or restricted to its
    TCP transport (``torch_rpc_tcp``, and always across the lab's hosts)."""
    ctx = mp.get_context("spawn")
    if where is None and cfg.backend == "torch_rpc_tcp":
        where = Where((), (), "loopback")  # TensorPipe's uv transport on this host's own network
    master = f"{where.shards[0][0]}:{free_port()}" if where is not None and where.shards else f"127.0.0.1:{free_port()}"
    world = cfg.shards + cfg.trainers
    servers = [ctx.Process(target=baselines.rpc_server_main, args=(i, world, master, cfg.rows, DIM, cfg.shards, where))
               for i in range(cfg.shards)]
    for p in servers:
        p.start()
    queue = ctx.Queue()
    procs = [ctx.Process(target=rpc_trainer, args=(cfg, master, r, budget_s, queue, where))
             for r in range(cfg.trainers)]
    for p in procs:
        p.start()
    results = _collect(queue, cfg.trainers, procs + servers, 180 + 6 * budget_s)
    for p in servers:
        p.join(30)
        if p.is_alive():
            p.kill()
    return _merge(results)


_RAY: dict[str, Any] = {}


def run_ray(cfg: Config, budget_s: float) -> dict[str, Any]:
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, configure_logging=False)
        _RAY["cls"] = baselines.make_ray_actor_class()
    torch.set_num_threads(1)
    actors = [_RAY["cls"].remote(-(-cfg.rows // cfg.shards), DIM) for _ in range(cfg.shards)]
    pids = ray.get([a.pid.remote() for a in actors])
    client = baselines.RayClient(actors)
    pending: list = []

    def push(ids, g):
        pending.extend(client.push(ids, g))

    def flush():
        ray.get(pending)
        pending.clear()

    batches = unique_batches(100, 24, cfg.batch, cfg.rows, cfg.zipf)
    result = measure(lambda ids: client.pull(ids, DIM), push, flush, batches, budget_s, pids)
    for a in actors:
        ray.kill(a)
    return _merge([result])


def run_in_process(cfg: Config, budget_s: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    ps = baselines.InProcess(cfg.rows, DIM)
    batches = unique_batches(100, 24, cfg.batch, cfg.rows, cfg.zipf)
    result = measure(lambda ids: ps.pull(ids, DIM), ps.push, lambda: None, batches, budget_s, [os.getpid()])
    return _merge([result])


def _merge(results: list[dict]) -> dict[str, Any]:
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    out: dict[str, Any] = {}
    for key in ("both_rows_per_s", "pull_rows_per_s", "push_rows_per_s", "first_pass_rows_per_s"):
        out[key] = sum(r[key] for r in results)
    for key in ("pull_p50_ms", "pull_p99_ms", "push_p50_ms", "push_p99_ms"):
        out[key] = results[0][key]
    out["both_rows"] = sum(r["both_rows"] for r in results)
    cpu = results[0].get("server_cpu_s")
    out["server_cpu_s_per_M_rows"] = cpu / sum(r["both_rows"] for r in results) * 1e6 if cpu is not None else None
    out["client_cpu_s_per_M_rows"] = sum(r["client_cpu_s"] for r in results) / sum(r["both_rows"] for r in results) * 1e6
    return out


def run_shardps_defaults(cfg: Config, budget_s: float, where: Optional[Where] = None) -> dict[str, Any]:
    return run_shardps(cfg, budget_s, defaults=True, where=where)


def run_placed(cfg: Config, budget_s: float, where: Where) -> dict[str, Any]:
    """One configuration across the lab's hosts (runs on its control host)."""
    try:
        return RUNNERS[cfg.backend](cfg, budget_s, where=where)
    except Exception:
        return {"error": traceback.format_exc()}


# Backends with no network to place on another host: measured locally only.
UNPLACED = ("ray", "in_process")

RUNNERS = {"shardps": run_shardps, "shardps_defaults": run_shardps_defaults, "torch_rpc": run_rpc,
           "torch_rpc_tcp": run_rpc, "ray": run_ray,
           "in_process": run_in_process, **{name: run_shardps for name in SECURITY},
           # The same loops with pulls and pushes on gRPC streams instead of the data plane (ZeroMQ).
           "shardps_grpc": run_shardps, "shardps_defaults_grpc": run_shardps_defaults,
           "shardps_tcp": run_shardps, "shardps_defaults_tcp": run_shardps_defaults,
           "shardps_ipc": run_shardps, "shardps_defaults_ipc": run_shardps_defaults}


GROUPS = ("standard", "trainers", "batch", "distribution", "table", "wire")


def grid(args: argparse.Namespace, backends: list[str]) -> list[Config]:
    std = Config("shardps")
    compare = [b for b in backends if b in ("shardps", "torch_rpc")]
    configs: list[Config] = []
    for b in backends:  # headline: the standard workload against every alternative, over shard counts
        for s in ([1] if b == "in_process" else args.shards):
            configs.append(replace(std, backend=b, shards=s, group="standard"))
    if args.quick:
        return configs
    for b in compare:
        configs += [replace(std, backend=b, trainers=t, group="trainers") for t in (2, 4)]
        configs += [replace(std, backend=b, batch=n, group="batch") for n in (1024, 4096, 16384, 65536)]
        configs += [replace(std, backend=b, zipf=z, group="distribution") for z in (None, 1.05, 1.2)]
        configs += [replace(std, backend=b, rows=10_000_000, group="table")]
    configs += [replace(std, wire="float16", group="wire")]
    return [c for c in configs if not args.groups or c.group in args.groups]


def placed(args: argparse.Namespace, configs: list[Config]) -> list[Config]:
    """Every configuration at every placement asked for (backends with nothing to place: locally only)."""
    return [replace(c, placement=pl) for pl in args.placement for c in configs
            if pl == "local" or c.backend not in UNPLACED]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=None,
                   help="seconds measured per phase (pull+push, pull, push); default 1.5, or 0.3 with --quick")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="shard counts of the headline comparison")
    p.add_argument("--backends", nargs="+", default=["shardps", "shardps_defaults", "torch_rpc", "ray", "in_process"],
                   choices=list(RUNNERS),
                   help="systems to measure (ray is skipped when not installed)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of every configuration, interleaved (all configurations, then again); the table shows "
                        "medians, and each ratio's range over the runs paired by order")
    p.add_argument("--groups", nargs="+", choices=GROUPS, default=None,
                   help="only these parts of the grid (standard: the headline over --shards; trainers: 2 and 4 "
                        "trainers; default: all)")
    p.add_argument("--quick", action="store_true", help="headline only, short budget unless --budget is given (smoke run)")
    p.add_argument("--placement", nargs="+", choices=PLACEMENTS, default=["local"],
                   help="where shards and trainers run: local (this host), or each on a lab host of its own: lab, "
                        "lab-10g (links capped at 10 Gbit/s), lab-delay (100 us each way on trainer-shard links); "
                        "benchmarks/placement.py. The lab needs root")
    p.add_argument("--out", default=str(RESULTS), help="directory for throughput.json and throughput.png")
    args = p.parse_args()
    if args.budget is None:
        args.budget = 0.3 if args.quick else 1.5
    backends = list(args.backends)
    if "ray" in backends:
        try:
            import ray  # noqa: F401
        except ImportError:
            print("ray is not installed (pip install 'shardps[bench]'): skipping the Ray baseline", file=sys.stderr)
            backends.remove("ray")
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    configs = placed(args, grid(args, backends))
    progress = Progress(len(configs) * args.repeat, "throughput")
    runs: dict[Config, list[dict[str, Any]]] = {cfg: [] for cfg in configs}
    lab = None
    if any(c.placement != "local" for c in configs):
        lab = LabHosts(max(c.shards for c in configs), max(c.trainers for c in configs))
    try:
        for rep in range(args.repeat):  # interleaved: a slow minute of the machine hits every system alike
            for cfg in configs:
                r = _run_one(cfg, args.budget, lab)
                if "error" in r:
                    print(f"\n{cfg.label}: FAILED\n{r['error']}", file=sys.stderr)
                runs[cfg].append(r)
                progress.step(cfg.label + (f" (run {rep + 1}/{args.repeat})" if args.repeat > 1 else ""))
    finally:
        if lab is not None:
            lab.close()
    rows = []
    for cfg in configs:
        r = summarize(runs[cfg])
        if "error" not in r:
            r["unique_per_batch"] = float(np.mean([len(b) for b in unique_batches(100, 8, cfg.batch, cfg.rows, cfg.zipf)]))
        rows.append({**asdict(cfg), **r})
    report(rows, args)
    return 0


def _run_one(cfg: Config, budget_s: float, lab: Optional[LabHosts]) -> dict[str, Any]:
    """One run of one configuration, here or on the lab's control host; the proxies' CPU per M rows with it."""
    try:
        if cfg.placement == "local":
            return RUNNERS[cfg.backend](cfg, budget_s)
        assert lab is not None
        where = lab.use(cfg.placement)
        proxy0 = lab.proxy_cpu_s()
        r = lab.call(run_placed, cfg, budget_s, where)
        if "error" not in r and lab.lab.proxies():
            r["proxy_cpu_s_per_M_rows"] = (lab.proxy_cpu_s() - proxy0) / r["both_rows"] * 1e6
        return r
    except Exception:
        return {"error": traceback.format_exc()}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs: the median of every figure, and each run's pull+push rows/s in order."""
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        out[key] = float(np.median(values)) if all(isinstance(v, (int, float)) for v in values) else value
    out["runs_rows_per_s"] = [r["both_rows_per_s"] for r in runs]
    out["runs_first_pass_rows_per_s"] = [r["first_pass_rows_per_s"] for r in runs]
    return out


def ratio(ours: dict[str, Any], base: Optional[dict[str, Any]],
          key: str = "runs_rows_per_s") -> tuple[Optional[float], Optional[str]]:
    """Median and range of our pull+push rows/s (or ``key``'s runs: the first pass's) over the baseline's, run by
    run (runs paired by order)."""
    if base is None:
        return None, None
    return median_and_range([a / b for a, b in zip(ours[key], base[key])])


def _find(results: list[dict], **kv: Any) -> Optional[dict]:
    for r in results:
        if all(r.get(k) == v for k, v in kv.items()) and "error" not in r:
            return r
    return None


def report(rows: list[dict], args: argparse.Namespace) -> None:
    import pathlib

    out = pathlib.Path(args.out)
    for r in rows:  # ratios to the baselines of the same configuration and placement
        if not r["backend"].startswith("shardps") or "error" in r:
            continue
        key = {k: r[k] for k in ("shards", "trainers", "batch", "zipf", "placement")}
        rpc = "torch_rpc_tcp" if r["backend"].endswith("_tcp") else "torch_rpc"
        for base in (rpc, "ray"):
            name = "torch_rpc" if base == rpc else base
            found = _find(rows, backend=base, **key, rows=r["rows"], wire="float32")
            r[f"x_{name}"], r[f"x_{name}_range"] = ratio(r, found)
            if found is not None and name == "torch_rpc":  # (paired run by run too: it moves more between runs)
                r["x_torch_rpc_first_pass"], r["x_torch_rpc_first_pass_range"] = ratio(
                    r, found, "runs_first_pass_rows_per_s")
        r["x_in_process"], _ = ratio(r, _find(rows, backend="in_process", batch=r["batch"], zipf=r["zipf"], rows=r["rows"]))
        if r["backend"] != "shardps":  # what the defaults, TLS or tokens cost against the tuned path
            r["x_shardps"], r["x_shardps_range"] = ratio(r, _find(rows, backend="shardps", **key, rows=r["rows"],
                                                                  wire=r["wire"]))
    for r in rows:  # across hosts against the same loop over this host's own TCP loopback: the network's cost
        if r["placement"] == "local" or "error" in r:
            continue
        same = {"shardps": "shardps_tcp", "shardps_defaults": "shardps_defaults_tcp", "torch_rpc": "torch_rpc_tcp"}
        if r["backend"] in same:
            r["x_loopback"], _ = ratio(r, _find(rows, backend=same[r["backend"]], placement="local",
                                                **{k: r[k] for k in ("shards", "trainers", "batch", "zipf", "rows",
                                                                     "wire")}))
    cols = [("backend", "backend", ""), ("placement", "placement", ""), ("group", "group", ""),
            ("shards", "shards", "d"), ("trainers", "trainers", "d"),
            ("batch", "batch", "d"), ("zipf", "zipf", ""), ("rows", "table rows", ",d"), ("wire", "wire", ""),
            ("both_rows_per_s", "pull+push rows/s", ",.0f"), ("first_pass_rows_per_s", "first pass rows/s", ",.0f"),
            ("pull_rows_per_s", "pull rows/s", ",.0f"),
            ("push_rows_per_s", "push rows/s", ",.0f"), ("pull_p50_ms", "pull p50 ms", ".2f"),
            ("pull_p99_ms", "pull p99 ms", ".2f"), ("push_p50_ms", "push p50 ms", ".2f"),
            ("push_p99_ms", "push p99 ms", ".2f"), ("server_cpu_s_per_M_rows", "srv CPU s/M rows", ".2f"),
            ("client_cpu_s_per_M_rows", "client CPU s/M rows", ".2f"),
            ("proxy_cpu_s_per_M_rows", "proxy CPU s/M rows", ".2f"),
            ("x_torch_rpc", "x rpc", ".2f"), ("x_torch_rpc_first_pass", "x rpc 1st pass", ".2f"), ("x_ray", "x ray", ".2f"),
            ("x_in_process", "x in-proc", ".3f"),
            ("x_shardps", "x shardps", ".2f"), ("x_loopback", "x same-host TCP", ".2f")]
    if args.repeat > 1:
        cols.append(("x_shardps_range", "x shardps range", ""))
        cols.insert(cols.index(("x_torch_rpc", "x rpc", ".2f")) + 1, ("x_torch_rpc_range", "x rpc range", ""))
        cols.insert(cols.index(("x_torch_rpc_first_pass", "x rpc 1st pass", ".2f")) + 1,
                    ("x_torch_rpc_first_pass_range", "x rpc 1st pass range", ""))
        cols.insert(cols.index(("x_ray", "x ray", ".2f")) + 1, ("x_ray_range", "x ray range", ""))
    print()
    print(table([r for r in rows if "error" not in r], cols))
    write_outputs("throughput", {"args": vars(args), "dim": DIM}, rows, out)
    panels = []
    std = [r for r in rows if r["group"] == "standard" and "error" not in r]
    local = [r for r in std if r["placement"] == "local"]
    panels.append(("standard workload vs shards (this host)", "shards", {
        b: ([r["shards"] for r in local if r["backend"] == b], [r["both_rows_per_s"] for r in local if r["backend"] == b])
        for b in sorted({r["backend"] for r in local})}))
    if len({r["placement"] for r in std}) > 1:  # the same loops where their processes ran
        order = [pl for pl in PLACEMENTS if any(r["placement"] == pl for r in std)]
        shards = min(r["shards"] for r in std)
        series = {}
        for b in sorted({r["backend"] for r in std}):
            pts = sorted([r for r in std if r["backend"] == b and r["shards"] == shards],
                         key=lambda r: order.index(r["placement"]))
            if len(pts) > 1:
                series[b] = ([r["placement"] for r in pts], [r["both_rows_per_s"] for r in pts])
        panels.append((f"{shards} shard(s): this host and across the lab's hosts", "placement", series))
    for group, key, xlabel in (("trainers", "trainers", "trainer processes"), ("batch", "batch", "batch size (ids)")):
        series = {}
        for b in ("shardps", "torch_rpc"):
            pts = sorted([r for r in rows if "error" not in r and r["backend"] == b and
                          (r["group"] == group or (r["group"] == "standard" and r["shards"] == 2))], key=lambda r: r[key])
            if len(pts) > 1:
                series[b] = ([r[key] for r in pts], [r["both_rows_per_s"] for r in pts])
        if series:
            panels.append((f"2 shards, vs {xlabel}", xlabel, series))
    plot(out / "throughput.png", panels, "pull+push rows/s")
    print(f"\nwrote {out / 'throughput.json'} and {out / 'throughput.png'}")


if __name__ == "__main__":
    sys.exit(main())
