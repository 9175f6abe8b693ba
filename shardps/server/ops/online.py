"""``shardps reshard``: move hash slots between running shards (``--add K``, ``--add-address``, ``--remove SHARD``,
``--rebalance``, ``--resume``: ``resharding.Resharder``), or rewrite the data dirs of N shards as M (offline,
``--from/--to/--shards``: ``reshard.reshard``).

With a cluster file a running ``shardps cluster`` wrote, ``--add K`` asks it to start K shards (``--join``: they
own nothing yet) and ``--remove`` to stop a shard once it owns nothing; the cluster file then lists them (a removed
shard's address becomes ""). Shards deployed otherwise are started by their operator (``shardps serve --join
--shard-index N``) and named with ``--add-address``; a removed one is left for its operator to stop.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time
from typing import Any

from shardps.probe import add_tls_args

log = logging.getLogger(__name__)


def add_reshard_parser(sub: Any) -> None:
    p = sub.add_parser("reshard", help="move hash slots between running shards (--add, --remove, --rebalance, "
                                       "--resume), or turn the data dirs of N shards into M shards (offline: --from)")
    p.add_argument("--cluster-file", help="the running cluster (as shardps cluster writes it)")
    p.add_argument("--addresses", nargs="+", default=None, help="the running cluster's shard addresses, in index "
                   "order (a replica group: its members joined by '|')")
    p.add_argument("--add", type=int, default=0, help="start this many shards (a shardps cluster: it starts them) "
                   "and move slots to them")
    p.add_argument("--add-address", action="append", default=[], help="a shard already started with shardps serve "
                   "--join (the next index); repeat for more")
    p.add_argument("--remove", type=int, action="append", default=[], help="move every slot off this shard (then a "
                   "shardps cluster stops it); repeat for more")
    p.add_argument("--rebalance", action="store_true", help="even out the slots over the shards that own some")
    p.add_argument("--resume", action="store_true", help="finish or roll back a move a stopped reshard left, "
                   "then carry on with its plan")
    p.add_argument("--batch-slots", type=int, default=256, help="hash slots moved per batch (of 16,384): a batch's "
                   "writes wait during its handover")
    p.add_argument("--journal", default=None, help="where the plan and the move in flight are kept (default: "
                   "<cluster file>.reshard.json, or ./shardps-reshard.json)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per call")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_tls_args(p)
    p.add_argument("--from", dest="src", default=None, help="offline: cluster data dir holding shard-0 .. shard-(N-1)")
    p.add_argument("--to", dest="dst", default=None, help="offline: new cluster data dir (shard-0 .. shard-(M-1))")
    p.add_argument("--shards", type=int, default=None, help="offline: new number of shards M")
    p.add_argument("--log-level", default="INFO")


def run_reshard(args: argparse.Namespace) -> int:
    if args.src or args.dst:
        from shardps.server.ops.reshard import reshard
        from shardps.server.shard.facade import ShardMapMismatch

        if not (args.src and args.dst and args.shards):
            raise SystemExit("shardps reshard: offline resharding needs --from, --to and --shards")
        try:
            summary = reshard(pathlib.Path(args.src), pathlib.Path(args.dst), args.shards)
        except (ValueError, ShardMapMismatch) as e:
            raise SystemExit(f"shardps reshard: {e}") from None
        print(json.dumps(summary, indent=2))
        return 0
    try:
        return _online(args)
    except (RuntimeError, TimeoutError, ValueError) as e:
        raise SystemExit(f"shardps reshard: {e}") from None


def cluster_file(args: argparse.Namespace) -> dict[str, Any]:
    """The cluster file ``--cluster-file`` names (as ``shardps cluster`` writes it); its TLS files fill the TLS
    options not given."""
    try:
        data: dict[str, Any] = json.loads(pathlib.Path(args.cluster_file).read_text())
    except (OSError, ValueError) as e:  # (a one-line error, not a traceback)
        raise SystemExit(f"shardps: cannot read the cluster file {args.cluster_file}: "
                         f"{getattr(e, 'strerror', None) or e}") from None
    tls = data.get("tls") or {}
    args.tls_ca = args.tls_ca or tls.get("ca")
    args.tls_cert = args.tls_cert or tls.get("cert")
    args.tls_key = args.tls_key or tls.get("key")
    return data


def entries(data: dict[str, Any]) -> list[str]:
    """Each shard's entry of a cluster file, in index order: its address, a replica group's members joined by "|",
    "" for a shard removed from the cluster."""
    if data.get("groups"):
        return ["|".join(g) for g in data["groups"]]
    return [str(a) for a in data["addresses"]]


def _cluster_data(args: argparse.Namespace) -> dict[str, Any]:
    if args.cluster_file:
        return cluster_file(args)
    if args.addresses:
        return {"addresses": list(args.addresses)}
    raise SystemExit("shardps reshard: give --cluster-file (or --addresses) of the running cluster, or --from/--to "
                     "for offline resharding")


def _online(args: argparse.Namespace) -> int:
    from shardps.core.errors import ShardError
    from shardps.server.ops.resharding import Journal, Resharder, ShardCalls

    what = sum(bool(x) for x in (args.add, args.add_address, args.remove, args.rebalance, args.resume))
    if what != 1:
        raise SystemExit("shardps reshard: say one of --add K, --add-address ADDR, --remove SHARD, --rebalance or "
                         "--resume")
    data = _cluster_data(args)
    journal_path = pathlib.Path(args.journal or (f"{args.cluster_file}.reshard.json" if args.cluster_file
                                                 else "shardps-reshard.json"))
    tls = {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key}
    if journal_path.exists() and not args.resume:
        raise SystemExit(f"shardps reshard: {journal_path} holds an unfinished reshard: run shardps reshard --resume "
                         "first")
    if args.resume and not journal_path.exists():
        raise SystemExit(f"shardps reshard --resume: no journal at {journal_path}: nothing to resume")
    calls = ShardCalls(entries(data), tls, args.timeout)
    t0 = time.monotonic()
    try:
        journal = Journal.load(journal_path) if args.resume else Journal(journal_path, batch_slots=args.batch_slots)
        driver = Resharder(calls, journal, on_step=lambda line: print(f"shardps reshard: {line}", flush=True))
        if args.resume:
            settled = driver.settle()
            print(f"shardps reshard: settled {settled} move(s) in flight; slot map epoch {driver.map.epoch}",
                  flush=True)
            active = journal.active
        else:
            settled = driver.settle()  # a move a crashed driver left without a journal: settled first
            driver.ensure_lineage()
            active = driver.map.active()
            if args.add or args.add_address:
                active += _add(args, data, calls, driver)
            for s in args.remove:
                if s not in active:
                    raise SystemExit(f"shardps reshard --remove {s}: shard {s} owns no slots (active: {active})")
                active.remove(s)
                journal.retire.append(s)
        progress = driver.run(sorted(set(active)))
        for s in journal.retire:
            _retire(args, data, s)
        journal.done()
    except ShardError as e:
        raise SystemExit(f"shardps reshard: {e}; the journal {journal_path} keeps the move in flight: fix the cause, "
                         "then shardps reshard --resume") from None
    finally:
        calls.close()
    summary = {**progress.as_dict(), "slot_map_epoch": driver.map.epoch, "active": driver.map.active(),
               "slots_per_shard": driver.map.slot_counts().tolist(), "wall_s": round(time.monotonic() - t0, 3)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"shardps reshard: done: {summary['moves']} moves, {summary['slots']} slots, {summary['dense_chunks']} "
              f"dense chunks, {summary['rows']:,} rows in {summary['seconds']:.2f} s ({summary['rows_per_s']:,.0f} "
              f"rows/s); writes held per batch: median {summary['handover_s_median'] * 1000:.1f} ms, max "
              f"{summary['handover_s_max'] * 1000:.1f} ms; slot map epoch {summary['slot_map_epoch']}, slots per "
              f"shard {summary['slots_per_shard']}", flush=True)
    return 0


def _add(args: argparse.Namespace, data: dict[str, Any], calls: Any, driver: Any) -> list[int]:
    """Start (or take) the new shards; their indices."""
    from shardps.core.protocol import group_members
    from shardps.server.ops import launcher

    before = len(calls)
    if args.add:
        if not (args.cluster_file and data.get("launcher_pid")):
            raise SystemExit("shardps reshard --add K needs the cluster file of a running shardps cluster (it starts "
                             "the shards); elsewhere start them with shardps serve --join and give --add-address")
        data = launcher.request(args.cluster_file, add=args.add)
        calls.add(entries(data)[before:])
    else:
        calls.add(list(args.add_address))
        if args.cluster_file and not data.get("launcher_pid"):  # a cluster file of our own: list them there
            data["addresses"] = list(data["addresses"]) + list(args.add_address)
            if data.get("groups"):  # (what entries() reads: a --resume, and the clients, find them there)
                data["groups"] = list(data["groups"]) + [group_members(a) for a in args.add_address]
            if "num_shards" in data:
                data["num_shards"] = len(entries(data))
            tmp = pathlib.Path(f"{args.cluster_file}.tmp")
            tmp.write_text(json.dumps(data, indent=2))
            tmp.replace(args.cluster_file)
    new = list(range(before, len(calls)))
    for s in new:
        info = calls.info(s)
        if info.shard_index != s:
            raise SystemExit(f"shardps reshard: the shard at {calls.primary[s]} is shard {info.shard_index}, not {s}: "
                             f"start it with --shard-index {s} --join")
    print(f"shardps reshard: shards {new} joined", flush=True)
    driver.map = driver.current_map()
    return new


def _retire(args: argparse.Namespace, data: dict[str, Any], shard: int) -> None:
    from shardps.server.ops import launcher

    if args.cluster_file and data.get("launcher_pid"):
        launcher.request(args.cluster_file, retire=[shard])
        print(f"shardps reshard: shard {shard} owns nothing now; shardps cluster stopped it", flush=True)
    else:
        print(f"shardps reshard: shard {shard} owns nothing now; stop it (its process or container)",
              file=sys.stderr, flush=True)


