"""The ``shardps cluster`` command: a local cluster's processes (on this host, or each in a network namespace of
its own: ``--netns``), kept running, restarted when they die, grown or shrunk on ``shardps reshard``'s requests."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from shardps.server.ops.launcher import Placement


def run_cluster(args: argparse.Namespace) -> int:
    import pathlib
    import signal
    import time

    from shardps.server.ops.launcher import LocalCluster, handle_request

    if args.shards < 1 or args.replicas < 1 or not 0 <= args.base_port <= 65535:
        raise SystemExit(f"shardps cluster: --shards and --replicas must be >= 1 and --base-port in [0, 65535], got "
                         f"{args.shards}, {args.replicas} and {args.base_port}")
    if not pathlib.Path(args.cluster_file).absolute().parent.is_dir():  # (before a shard starts: none is left behind)
        raise SystemExit(f"shardps cluster: the cluster file's directory {pathlib.Path(args.cluster_file).parent} "
                         "does not exist")
    serve_args = ["--durability", args.durability, "--fsync", args.fsync,
                  "--checkpoint-interval", str(args.checkpoint_interval)]
    if args.tokens_file:
        serve_args += ["--tokens-file", args.tokens_file]
    if args.replicas > 1:
        from shardps.server.ops.etcd import INSTALL, etcd_binary

        if args.etcd is None and etcd_binary() is None:
            raise SystemExit(f"shardps cluster --replicas {args.replicas}: {INSTALL}")
        serve_args += ["--ack", args.ack]
    try:
        placements = [_placement(n) for n in args.netns or []]
        etcd_placement = _placement(args.etcd_netns) if args.etcd_netns else None
    except ValueError as e:
        raise SystemExit(f"shardps cluster: {e}") from None
    cluster = LocalCluster(args.shards, base_port=args.base_port, data_dir=args.data_dir, host=args.host,
                           serve_args=serve_args, log_dir=args.log_dir, tls=args.tls, replicas=args.replicas,
                           etcd=args.etcd, serves_requests=True, placements=placements, etcd_placement=etcd_placement)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as e:
        raise SystemExit(f"shardps cluster: {e}") from None
    try:
        cluster.write_cluster_file(args.cluster_file)
    except OSError as e:  # (the shards started: stopped, not left running)
        cluster.close()
        raise SystemExit(f"shardps cluster: cannot write {args.cluster_file}: {e.strerror or e}") from None
    group = f" of {args.replicas} members each (etcd at {cluster.etcd})" if args.replicas > 1 else ""
    print(f"shardps cluster: {args.shards} shards{group} healthy (logs in {cluster.log_dir})", flush=True)
    for i, members in enumerate(cluster.groups):
        for a in members:
            print(f"  shard {i}: {a}{_data_ports(a, cluster.tls_files)}", flush=True)
    print(f"cluster file: {args.cluster_file}   (Client.from_file({args.cluster_file!r}))", flush=True)
    code, clean = 0, False
    try:
        while not stop["now"]:
            time.sleep(0.5)
            done = handle_request(cluster, args.cluster_file)  # shardps reshard --add / --remove
            if done:
                print(f"shardps cluster: {done}", flush=True)
            for index, rc in cluster.dead():
                p = cluster.procs[index]
                print(f"shardps cluster: shard {p.index} ({p.address}) died with exit code {rc}",
                      file=sys.stderr, flush=True)
                if args.no_restart:
                    stop["now"], code = True, 1
                    break
                cluster.restart(index)
                cluster.write_cluster_file(args.cluster_file)
                print(f"shardps cluster: shard {cluster.procs[index].index} restarted on {cluster.procs[index].address}",
                      file=sys.stderr, flush=True)
        clean = code == 0
    finally:
        codes = cluster.close(keep_logs=not clean)  # a temporary log directory: gone after a clean stop, else named
        logs = f"; logs kept in {cluster.log_dir}" if cluster.made_log_dir and not clean else ""
        print(f"shardps cluster: stopped (exit codes {codes}){logs}", flush=True)
    return code


def _placement(spec: str) -> Placement:
    """``--netns NAME[=ADDRESS]``: a Placement in that network namespace."""
    name, _, address = spec.partition("=")
    return Placement.netns(name, address or None)


def _data_ports(address: str, tls: Optional[dict]) -> str:
    """How a shard's data plane is reached, as ``shardps cluster`` prints it (its health covers it)."""
    from shardps.server.ops.report import collect

    try:
        row = collect([address], interval=0, tls=tls)[0]
    except RuntimeError as e:
        return f" (data plane unknown: {e})"
    ports, unix = row["data_ports"], " (and Unix sockets, for clients on this machine)" if row["data_ipc"] else ""
    return f", data plane on port{'s' if len(ports) > 1 else ''} {', '.join(map(str, ports))}{unix}" if ports else ""
