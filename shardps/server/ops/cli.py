"""The ``shardps`` command line.

Every ``serve`` flag can also come from an environment variable
``SHARDPS_<FLAG>`` (e.g. ``SHARDPS_SHARD_INDEX``); a flag given on the command
line wins over the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Mapping, Optional, Sequence

from shardps.probe import add_tls_args
from shardps.server.ops.online import add_reshard_parser, cluster_file, run_reshard
from shardps.server.ops.online import entries as cluster_entries
from shardps.server.replica.member import ReplicaConfig
from shardps.server.rpc.auth import TLSFiles, Tokens
from shardps.server.rpc.fair import FairConfig
from shardps.server.rpc.server import ServerConfig, serve
from shardps.server.shard.facade import DURABILITY_LEVELS, FSYNC_POLICIES, WAL_RECOVERY, ShardConfig
from shardps.server.shard.limits import Limits

_LIMITS = Limits()
_FAIR = FairConfig()

# (flag, type, default, help) of `shardps serve`: the one list; docs/configuration.md is generated from it.
SERVE_FLAGS: list[tuple[str, Any, object, str]] = [
    ("host", str, "127.0.0.1", "address to bind (0.0.0.0 inside containers)"),
    ("port", int, 0, "port to bind; 0 picks a free port (printed on start)"),
    ("shard-index", int, None, "this shard's index in [0, num-shards) (required)"),
    ("num-shards", int, None, "number of shards in the cluster (required)"),
    ("data-dir", str, None, "directory for the log and checkpoints; restored on start (default: memory only, "
                            "nothing survives a restart)"),
    ("durability", str, "log", f"one of {', '.join(DURABILITY_LEVELS)}: log (every change logged before it is "
                               "acknowledged), checkpoint (row updates since the last checkpoint are lost in a crash; "
                               "tables are logged all the same) or none; applies with --data-dir"),
    ("fsync", str, "interval", f"one of {', '.join(FSYNC_POLICIES)}: when the log is fsynced. interval: every "
                               "--fsync-interval seconds (a machine crash loses at most that; a process crash "
                               "nothing); always: before each acknowledgement; none: left to the OS"),
    ("fsync-interval", float, 1.0, "seconds between log fsyncs under --fsync interval"),
    ("checkpoint-interval", float, 0.0, "seconds between periodic checkpoints (0: by log size, on request and "
                                        "on SIGTERM)"),
    ("checkpoint-log-mb", int, 256, "checkpoint once this many MiB of log were written since the last "
                                    "checkpoint, bounding the replay on restart (0: never by size)"),
    ("checkpoint-log-ratio", float, 1.0, "and not before the log since the last checkpoint is this many times that "
                                         "checkpoint's size: a large table is not rewritten for every "
                                         "--checkpoint-log-mb of log (0: --checkpoint-log-mb alone)"),
    ("disk-dir", str, None, "where tables with a disk tier keep their cold rows (segment files; local disk; "
     "default: <data-dir>/disk, none without --data-dir)"),
    ("disk-min-free-mb", int, 256, "free space the disk tier keeps on its file system: a write back that would leave "
     "less is refused (the request, with nothing applied)"),
    ("replicas", int, 1, "members of this shard's replica group (one primary, the others backups); with more than "
     "one, --etcd and --member are needed"),
    ("member", str, None, "this process's member id in its replica group (unique in the group)"),
    ("etcd", str, None, "etcd's client URL (http://host:2379), or an etcd cluster's members' URLs joined by commas (each call goes "
     "to the member that answered last, then to the others): where a replica group elects its primary"),
    ("cluster-name", str, "shardps", "the cluster's name in etcd (the prefix of its keys)"),
    ("ack", str, "quorum", "with replicas, when a write is acknowledged: quorum (a majority of the group has it in its "
     "log) or primary (this member has it; a failover may lose the last writes)"),
    ("quorum-timeout", float, 10.0, "with --ack quorum, longest seconds a write waits for a majority of its group: "
     "then it is answered UNAVAILABLE (applied here, not acknowledged) and the client sends it again, answered once "
     "a quorum has it"),
    ("lease-ttl", int, 2, "seconds of a member's etcd lease: a primary silent this long is replaced"),
    ("advertise", str, None, "the address clients and the other members reach this shard at (host:port; default: the "
     "bound host and port, or the machine's name when bound to every interface)"),
    ("join", "switch", False, "this shard joins a running cluster (shardps reshard --add): it owns no hash slot until "
     "slots are moved to it; give it the next --shard-index and --num-shards of at least that index + 1"),
    ("handover-hold", float, 10.0, "longest a slot migration's handover holds writes to its slots (seconds) before it "
     "is given up and they go on here"),
    ("worker-timeout", float, 10.0, "seconds of silence after which a training worker counts as gone"),
    ("workers", int, 8, "gRPC handler threads"),
    ("max-streams", int, 64, "call streams open at once (one per client); each holds a handler thread"),
    ("max-message-mb", int, 4, "largest request or reply in MiB"),
    ("data-threads", int, 2, "sockets of the data plane (pulls and pushes over ZeroMQ), a thread each; 0: none, "
     "clients use gRPC streams"),
    ("data-port", int, 0, "the first data-plane port, the others following it (0: free ports, told to clients by "
     "ShardInfo; fix them where a firewall or container maps ports)"),
    ("no-data-ipc", "switch", False, "no Unix sockets on the data plane: clients on this machine use its TCP ports "
     "too (by default those in this network namespace connect over abstract Unix sockets, which skip the kernel's "
     "TCP work)"),
    ("data-regions", int, 16, "shared-memory regions per data-plane socket for its Unix-socket clients without TLS (a "
     "pull's answers and trailing pushes of 64 KiB to 2 MiB go through them: 16 MiB a region, touched as used); 0: none"),
    ("grace", float, 5.0, "seconds in-flight calls get on shutdown"),
    ("metrics-port", int, None, "serve Prometheus metrics on this port at /metrics (0: a free port; default: off)"),
    ("tls-cert", str, None, "serve TLS: the certificate chain (PEM file); with --tls-key"),
    ("tls-key", str, None, "the TLS private key (PEM file)"),
    ("tls-client-ca", str, None, "mutual TLS: clients must present a certificate signed by this CA (PEM file)"),
    ("tokens-file", str, None, "bearer tokens with roles, one '<role> <token> [limit=value ...]' per line "
     "(roles reader, trainer, admin; limits max_calls, max_streams, max_waiting, weight)"),
    ("fair-slots", int, _FAIR.slots, "pulls and pushes running at once; more take turns in fair order among callers"),
    ("max-calls-per-connection", int, _FAIR.calls_per_connection, "calls one connection may have open at once "
     "(more wait in the client)"),
    ("max-streams-per-connection", int, _FAIR.streams_per_connection, "call streams one connection may hold open"),
    ("max-waiting-per-connection", int, _FAIR.waiting_per_connection, "heartbeats one connection may have waiting "
     "for other workers"),
    ("max-memory-mb", int, 0, "memory budget of the shard's tables (rows, optimizer state, indexes) in MiB; "
     "0: half the machine's or container's memory"),
    ("max-tables", int, _LIMITS.max_tables, "tables and dense tensors on the shard"),
    ("max-table-rows", int, _LIMITS.max_table_rows, "rows one table may hold on the shard (at most 2^31 - 1)"),
    ("max-ids-per-request", int, _LIMITS.max_ids_per_request, "ids in one pull or push"),
    ("max-name-length", int, _LIMITS.max_name_length, "characters in a table or dense-tensor name"),
    ("max-dense-elements", int, _LIMITS.max_dense_elements, "elements of one dense tensor"),
    ("max-workers", int, _LIMITS.max_workers, "training workers: ranks, world size, workers of a synchronous table"),
    ("wal-recovery", str, "fail", f"one of {', '.join(WAL_RECOVERY)}: what a write-ahead log record that cannot "
     "be replayed does on start (truncate: set it and all later records aside, logged as lost, and start)"),
    ("serve-from", str, None, "serve this export directory read-only (shardps export), following its deltas; "
     "pushes and table changes are refused"),
    ("delta-poll", float, 1.0, "with --serve-from: seconds between looks for a new delta"),
    ("ready-file", str, None, "write the bound address to this file once serving"),
    ("log-level", str, "INFO", "DEBUG, INFO, WARNING or ERROR"),
]


def env_name(flag: str) -> str:
    return "SHARDPS_" + flag.upper().replace("-", "_")


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run one shard server")
    for flag, cast, default, help_ in SERVE_FLAGS:
        # default=None: resolve_env fills unset flags from the environment, then the built-in default.
        if cast == "switch":  # a flag without a value (its variable: 1 / true / yes)
            p.add_argument(f"--{flag}", action="store_const", const=True, default=None,
                           help=f"{help_} [env {env_name(flag)}=1]")
            continue
        p.add_argument(f"--{flag}", type=cast, default=None, help=f"{help_} [env {env_name(flag)}; default {default}]")
    return p


def resolve_env(args: argparse.Namespace, environ: Mapping[str, str]) -> argparse.Namespace:
    """Fill every serve flag not given on the command line from SHARDPS_* variables, else its default."""
    if args.command != "serve":
        return args
    for flag, cast, default, _ in SERVE_FLAGS:
        dest = flag.replace("-", "_")
        if getattr(args, dest) is not None:
            continue
        raw = environ.get(env_name(flag), "")
        if raw == "":
            setattr(args, dest, default)
            continue
        if cast == "switch":
            setattr(args, dest, raw.strip().lower() in ("1", "true", "yes", "on"))
            continue
        try:
            setattr(args, dest, cast(raw))
        except ValueError:
            raise SystemExit(f"shardps serve: environment variable {env_name(flag)}={raw!r} is not a valid {cast.__name__}") from None
    return args


def parse_args(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """Parse the command line, then the environment (read once, here)."""
    return resolve_env(build_parser().parse_args(argv), os.environ if environ is None else environ)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardps", description="Sharded embedding-table parameter server.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    p = sub.add_parser("cluster", help="run N shards as local processes (the embedded default)")
    p.add_argument("--shards", type=int, default=int(os.environ.get("SHARDPS_SHARDS", "2")), help="number of shards [env SHARDPS_SHARDS]")
    p.add_argument("--base-port", type=int, default=0, help="shard i listens on base-port + i (0: free ports)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--data-dir", default=None, help="cluster data dir; shard i uses DATA_DIR/shard-i")
    p.add_argument("--cluster-file", default="shardps-cluster.json", help="where to write the cluster file")
    p.add_argument("--log-dir", default=None, help="where the shards' logs go (default: a temporary directory, "
                   "removed when the cluster stops cleanly, kept and named when it does not)")
    p.add_argument("--durability", default="log", choices=DURABILITY_LEVELS, help="see shardps serve")
    p.add_argument("--fsync", default="interval", choices=FSYNC_POLICIES, help="see shardps serve")
    p.add_argument("--checkpoint-interval", type=float, default=0.0, help="seconds between periodic checkpoints")
    p.add_argument("--no-restart", action="store_true", help="exit when a shard dies instead of restarting it")
    p.add_argument("--tls", nargs="?", const="tls", choices=("tls", "mtls"),
                   help="serve TLS (mtls: mutual TLS) with throwaway certificates made in DATA_DIR/tls (no "
                        "--data-dir: in the log directory); "
                        "the cluster file carries their paths")
    p.add_argument("--tokens-file", help="bearer tokens with roles for every shard (see shardps serve)")
    p.add_argument("--replicas", type=int, default=1, help="members of each shard's replica group (one primary, the "
                   "others backups); with more than 1, a local etcd is started unless --etcd names one")
    p.add_argument("--etcd", default=None, help="etcd's client URL for the replica groups (default: start one here, "
                   "from Debian's etcd-server package)")
    p.add_argument("--ack", default="quorum", choices=("quorum", "primary"), help="see shardps serve")
    p.add_argument("--netns", nargs="+", default=None, metavar="NAME[=ADDRESS]",
                   help="run the shard processes in these network namespaces (ip netns), one after another and round "
                        "again (shard 0's members first), each bound to ADDRESS (default: the namespace's first global "
                        "IPv4 address): hosts of their own on one machine, as the test lab makes. This process must "
                        "reach those addresses (run it in a namespace that does)")
    p.add_argument("--etcd-netns", default=None, metavar="NAME[=ADDRESS]",
                   help="with --replicas and no --etcd: run the local etcd in this network namespace")
    p.add_argument("--log-level", default="INFO")
    for name, help_ in (("health", "check shards' gRPC health (exit code 0 if all serve)"),
                        ("stats", "per-shard version, tables, counters and rates")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("addresses", nargs="*", help="shard addresses host:port")
        p.add_argument("--cluster-file", help="read addresses from a cluster file")
        p.add_argument("--timeout", type=float, default=5.0, help="seconds per shard")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--log-level", default="WARNING")
        add_tls_args(p)
        if name == "stats":
            p.add_argument("--interval", type=float, default=1.0,
                           help="seconds between two samples for current rates (0: averages since start)")
    p = sub.add_parser("export", help="write a consistent snapshot of a cluster's tables (safetensors files, a "
                                      "manifest with checksums), then deltas")
    p.add_argument("addresses", nargs="*", help="shard addresses host:port, in index order")
    p.add_argument("--cluster-file", help="read addresses from a cluster file")
    p.add_argument("--out", required=True, help="export directory (a new base is numbered after what it holds)")
    p.add_argument("--tables", nargs="+", default=None, help="tables and dense tensors to export (default: all)")
    p.add_argument("--optimizer-state", action="store_true", help="include optimizer state and step counts")
    p.add_argument("--delta", action="store_true", help="write one delta (rows changed since the last cut, "
                   "tombstones) instead of a base")
    p.add_argument("--delta-interval", type=float, default=0.0,
                   help="keep running: a delta every this many seconds (a base first if --out has none, or when a "
                        "shard restarted), until SIGTERM")
    p.add_argument("--compact-every", type=int, default=0,
                   help="with --delta-interval: fold the chain into a new base after this many deltas (0: never)")
    p.add_argument("--keep-bases", type=int, default=2, help="bases kept by compaction (older ones and the deltas "
                   "before the oldest kept are deleted)")
    p.add_argument("--count", type=int, default=0, help="with --delta-interval: stop after this many deltas (0: run on)")
    p.add_argument("--hold", type=float, default=30.0, help="longest seconds shards hold pushes back for the cut")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per call")
    p.add_argument("--log-level", default="INFO")
    add_tls_args(p)
    p = sub.add_parser("compact", help="fold an export's base and deltas into one base (offline); --to and "
                                       "--shards reshard it")
    p.add_argument("directory", help="export directory")
    p.add_argument("--to", default=None, help="write the compacted base to this new directory instead of in place")
    p.add_argument("--shards", type=int, default=None, help="with --to: partition it for this many shards")
    p.add_argument("--keep-bases", type=int, default=2, help="in place: bases kept (older ones and their deltas go)")
    p.add_argument("--log-level", default="INFO")
    add_reshard_parser(sub)
    return parser


def _addresses(args: argparse.Namespace) -> list[str]:
    """The shards to ask, from the arguments and the cluster file (whose TLS files are used too)."""
    addresses = list(args.addresses)
    if args.cluster_file:
        data = cluster_file(args)
        addresses += [m for g in data["groups"] for m in g] if data.get("groups") else data["addresses"]
        addresses = [a for a in addresses if a]  # (a shard removed from the cluster has no address)
    if not addresses:
        raise SystemExit(f"shardps {args.command}: give shard addresses or --cluster-file") from None
    return addresses


def _entries(args: argparse.Namespace) -> list[str]:
    """Each shard's entry, in index order: its address, a replica group's members joined by "|", "" for a removed
    shard (from the cluster file; given addresses are one shard each)."""
    return cluster_entries(cluster_file(args)) if args.cluster_file else _addresses(args)


def run_health(args: argparse.Namespace) -> int:
    import json

    from shardps.probe import check as check_health

    addresses = _addresses(args)
    statuses = {a: check_health(a, args.timeout, "", args.tls_ca, args.tls_cert, args.tls_key) for a in addresses}
    if args.json:
        print(json.dumps(statuses))
    else:
        for a, st in statuses.items():
            print(f"{a}\t{st}")
    return 0 if all(st == "SERVING" for st in statuses.values()) else 1


def run_stats(args: argparse.Namespace) -> int:
    import json

    from shardps.server.ops.report import collect, render

    try:
        addresses = _addresses(args)
        rows = collect(addresses, args.timeout, args.interval,
                       {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key})
    except RuntimeError as e:
        raise SystemExit(f"shardps stats: {e}") from None
    print(json.dumps(rows, indent=2) if args.json else render(rows))
    return 0


def run_export(args: argparse.Namespace) -> int:
    import json
    import pathlib
    import signal
    import time

    from shardps.core.errors import ShardError
    from shardps.core.exporter import Exporter
    from shardps.core.exports import CorruptExport, compact, generations
    from shardps.server.ops.resharding import ShardCalls

    entries = _entries(args)
    calls = ShardCalls(entries, {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key}, args.timeout)
    exporter = Exporter(calls.call, len(entries), hold_s=args.hold, shards=[i for i, e in enumerate(entries) if e])
    try:
        if args.delta_interval <= 0:
            result = exporter.delta(args.out) if args.delta else exporter.base(args.out, args.tables,
                                                                                args.optimizer_state)
            print(json.dumps(_result(result)), flush=True)
            return 0
        stop = {"now": False}
        signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
        signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
        if not generations(pathlib.Path(args.out)):
            print(json.dumps(_result(exporter.base(args.out, args.tables, args.optimizer_state))), flush=True)
        written = since_compaction = 0
        next_at = time.monotonic() + args.delta_interval
        while not stop["now"] and not (args.count and written >= args.count):
            if time.monotonic() < next_at:
                time.sleep(min(0.1, next_at - time.monotonic()))
                continue
            next_at += args.delta_interval
            try:
                result = exporter.delta(args.out, fallback_base=True)
            except Exception as e:  # noqa: BLE001 - a shard unreachable for a while: try again next interval
                print(f"shardps export: delta failed, retrying next interval: {e}", file=sys.stderr, flush=True)
                continue
            if result.kind == "none":
                continue
            written += 1
            since_compaction = 0 if result.kind == "base" else since_compaction + 1
            print(json.dumps(_result(result)), flush=True)
            if args.compact_every and since_compaction >= args.compact_every:
                print(json.dumps(_result(compact(args.out, keep_bases=args.keep_bases))), flush=True)
                since_compaction = 0
        return 0
    except (ShardError, CorruptExport, ValueError) as e:
        raise SystemExit(f"shardps export: {e}") from None


def _result(r: object) -> dict:
    from dataclasses import asdict

    out = asdict(r)  # type: ignore[call-overload]
    out["path"] = str(out["path"]) if out["path"] else None
    out["seconds"] = round(out["seconds"], 4)
    out["pause_s"] = round(out["pause_s"], 4)
    return out


def run_compact(args: argparse.Namespace) -> int:
    import json

    from shardps.core.exports import CorruptExport, compact

    try:
        result = compact(args.directory, args.to, args.shards, keep_bases=args.keep_bases)
    except (CorruptExport, ValueError) as e:
        raise SystemExit(f"shardps compact: {e}") from None
    print(json.dumps(_result(result)))
    return 0


def _tls(args: argparse.Namespace) -> Optional[TLSFiles]:
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return TLSFiles(args.tls_cert, args.tls_key, args.tls_client_ca)


def _replica(args: argparse.Namespace) -> Optional[ReplicaConfig]:
    """A replica group's member, from --replicas, --member, --etcd, --cluster-name and --lease-ttl."""
    if args.replicas <= 1:
        return None
    if not args.etcd or not args.member:
        raise ValueError("--replicas needs --etcd (where the group elects its primary) and --member (this process's "
                         "id in the group)")
    return ReplicaConfig(args.cluster_name, args.member, args.etcd, lease_ttl=args.lease_ttl)


# Numeric serve flags that must be at least 1 (the others at least 0; none negative, none NaN), and the ports.
AT_LEAST_ONE = ("num-shards", "workers", "max-message-mb", "replicas", "lease-ttl")
PORTS = ("port", "data-port", "metrics-port")


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse a numeric serve flag out of its range (a port of -1 or 70000 was bound as 65535 or 4464; --workers 0
    served; --max-message-mb 0 failed in a traceback)."""
    for flag, cast, _, _ in SERVE_FLAGS:
        value = getattr(args, flag.replace("-", "_"))
        if cast not in (int, float) or value is None:
            continue
        low = 1 if flag in AT_LEAST_ONE else 0
        high, bound = (65535, f"[{low}, 65535]") if flag in PORTS else (float("inf"), f"[{low}, inf)")
        if not low <= value <= high:  # (NaN fails too)
            raise SystemExit(f"shardps serve: --{flag} must be in {bound}, got {value}")


def run_serve(args: argparse.Namespace) -> int:
    if args.shard_index is None or args.num_shards is None:
        raise SystemExit("shardps serve: --shard-index and --num-shards are required (or SHARDPS_SHARD_INDEX / SHARDPS_NUM_SHARDS)")
    check_numbers(args)
    if args.data_dir and os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
        raise SystemExit(f"shardps serve: --data-dir {args.data_dir} is a file, not a directory")
    try:
        shard_config = ShardConfig(
            shard_index=args.shard_index, num_shards=args.num_shards, data_dir=args.data_dir,
            durability=args.durability, fsync=args.fsync, fsync_interval_s=args.fsync_interval,
            worker_timeout_s=args.worker_timeout, wal_recovery=args.wal_recovery,
            serve_from=args.serve_from, disk_dir=args.disk_dir,
            disk_min_free_mb=args.disk_min_free_mb, replicas=args.replicas, ack=args.ack,
            quorum_timeout_s=args.quorum_timeout, join=bool(args.join), handover_hold_s=args.handover_hold,
            limits=Limits(
                max_memory_mb=args.max_memory_mb, max_tables=args.max_tables, max_table_rows=args.max_table_rows,
                max_ids_per_request=args.max_ids_per_request, max_name_length=args.max_name_length,
                max_dense_elements=args.max_dense_elements, max_workers=args.max_workers,
            ),
        )
        server_config = ServerConfig(
            host=args.host, port=args.port, workers=args.workers, max_streams=args.max_streams,
            max_message_mb=args.max_message_mb, data_threads=args.data_threads, data_port=args.data_port,
            data_ipc=not args.no_data_ipc, data_regions=args.data_regions,
            checkpoint_interval_s=args.checkpoint_interval, checkpoint_log_mb=args.checkpoint_log_mb,
            checkpoint_log_ratio=args.checkpoint_log_ratio,
            grace_s=args.grace, metrics_port=args.metrics_port,
            delta_poll_s=args.delta_poll, replica=_replica(args), advertise=args.advertise or "",
            tls=_tls(args), tokens=Tokens.load(args.tokens_file) if args.tokens_file else None,
            fairness=FairConfig(slots=args.fair_slots, calls_per_connection=args.max_calls_per_connection,
                                streams_per_connection=args.max_streams_per_connection,
                                waiting_per_connection=args.max_waiting_per_connection),
        )
        if server_config.tls is not None:
            server_config.tls.read()  # a missing or unreadable file is a clear error here, not a traceback later
    except (ValueError, OSError) as e:
        raise SystemExit(f"shardps serve: {e}") from None
    from shardps.core.exports import CorruptExport
    from shardps.server.exports.serving import ServeMismatch
    from shardps.server.shard.facade import LogReplayError, ShardMapMismatch
    from shardps.server.storage.disk import DiskTierError

    try:
        return serve(shard_config, server_config, ready_file=args.ready_file)
    except (ShardMapMismatch, LogReplayError, CorruptExport, ServeMismatch, DiskTierError) as e:
        raise SystemExit(f"shardps serve: {e}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO) if hasattr(args, "log_level") else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from shardps.server.ops.cluster_cmd import run_cluster

    handlers = {"serve": run_serve, "reshard": run_reshard, "cluster": run_cluster, "health": run_health,
                "stats": run_stats, "export": run_export, "compact": run_compact}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
