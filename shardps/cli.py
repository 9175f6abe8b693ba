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
from typing import Callable, Optional, Sequence

from shardps.server import ServerConfig, serve
from shardps.shard import DURABILITY_LEVELS, ShardConfig


def _env_default(flag: str, default: object, cast: Callable[[str], object] = str) -> object:
    """Default of ``--flag`` from SHARDPS_FLAG, else ``default``."""
    raw = os.environ.get("SHARDPS_" + flag.upper().replace("-", "_"))
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise SystemExit(f"shardps: environment variable SHARDPS_{flag.upper().replace('-', '_')}={raw!r} is not valid")


# (flag, type, default, help) of `shardps serve`; the single list the README's table mirrors.
SERVE_FLAGS: list[tuple[str, Callable[[str], object], object, str]] = [
    ("host", str, "127.0.0.1", "address to bind (0.0.0.0 inside containers)"),
    ("port", int, 0, "port to bind; 0 picks a free port (printed on start)"),
    ("shard-index", int, None, "this shard's index in [0, num-shards) (required)"),
    ("num-shards", int, None, "number of shards in the cluster (required)"),
    ("data-dir", str, None, "directory for checkpoints; restored on start (default: memory only)"),
    ("durability", str, "checkpoint", f"one of {', '.join(DURABILITY_LEVELS)}"),
    ("checkpoint-interval", float, 0.0, "seconds between periodic checkpoints (0: only on request and SIGTERM)"),
    ("worker-timeout", float, 10.0, "seconds of silence after which a training worker counts as gone"),
    ("workers", int, 8, "gRPC handler threads"),
    ("max-message-mb", int, 4, "largest request or reply in MiB"),
    ("grace", float, 5.0, "seconds in-flight calls get on shutdown"),
    ("ready-file", str, None, "write the bound address to this file once serving"),
    ("log-level", str, "INFO", "DEBUG, INFO, WARNING or ERROR"),
]


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run one shard server")
    for flag, cast, default, help_ in SERVE_FLAGS:
        env = "SHARDPS_" + flag.upper().replace("-", "_")
        p.add_argument(f"--{flag}", type=cast, default=_env_default(flag, default, cast), help=f"{help_} [env {env}]")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardps", description="Sharded embedding-table parameter server.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    p = sub.add_parser("reshard", help="turn the data of N shards into M shards (offline)")
    p.add_argument("--from", dest="src", required=True, help="cluster data dir holding shard-0 .. shard-(N-1)")
    p.add_argument("--to", dest="dst", required=True, help="new cluster data dir (shard-0 .. shard-(M-1) are written)")
    p.add_argument("--shards", type=int, required=True, help="new number of shards M")
    p.add_argument("--log-level", default="INFO")
    return parser


def run_reshard(args: argparse.Namespace) -> int:
    import json
    import pathlib

    from shardps.reshard import reshard
    from shardps.shard import ShardMapMismatch

    try:
        summary = reshard(pathlib.Path(args.src), pathlib.Path(args.dst), args.shards)
    except (ValueError, ShardMapMismatch) as e:
        raise SystemExit(f"shardps reshard: {e}")
    print(json.dumps(summary, indent=2))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    if args.shard_index is None or args.num_shards is None:
        raise SystemExit("shardps serve: --shard-index and --num-shards are required (or SHARDPS_SHARD_INDEX / SHARDPS_NUM_SHARDS)")
    try:
        shard_config = ShardConfig(
            shard_index=args.shard_index, num_shards=args.num_shards, data_dir=args.data_dir,
            durability=args.durability, worker_timeout_s=args.worker_timeout,
        )
        server_config = ServerConfig(
            host=args.host, port=args.port, workers=args.workers, max_message_mb=args.max_message_mb,
            checkpoint_interval_s=args.checkpoint_interval, grace_s=args.grace,
        )
    except ValueError as e:
        raise SystemExit(f"shardps serve: {e}")
    from shardps.shard import ShardMapMismatch

    try:
        return serve(shard_config, server_config, ready_file=args.ready_file)
    except ShardMapMismatch as e:
        raise SystemExit(f"shardps serve: {e}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO) if hasattr(args, "log_level") else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handlers = {"serve": run_serve, "reshard": run_reshard}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
