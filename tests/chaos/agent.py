"""The campaign's eyes on the lab: a process on the control host answering questions about the cluster, one JSON
line in, one JSON line out (so the driver, outside every host, never talks to a shard itself and no question costs
an interpreter's start).

    {"cmd": "info", "addresses": [...]}            each member's role, epoch, LSN, version (null: no answer in 0.5 s)
    {"cmd": "etcd", "endpoints": [...]}            each etcd member's id, and the leader's
    {"cmd": "read_cluster", "cluster_file": "...", "ids": [...]}  the values as a client reads them, their owners
    {"cmd": "members", "groups": [[...]], "ids": [...]}  each member's rows of its group's ids (digest), LSN, version
    {"cmd": "create", "cluster_file": "..."}       the campaign's table
"""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional


def _shard_info(address: str, timeout: float) -> Any:
    """A member's ShardInfo answer (None: no answer within ``timeout``)."""
    import grpc
    from shardps_client.transport.channels import Stub

    from shardps.v1 import shardps_pb2 as pb

    try:
        with grpc.insecure_channel(address) as ch:
            return Stub(ch).ShardInfo(pb.ShardInfoRequest(), timeout=timeout)
    except grpc.RpcError:
        return None


def _info(address: str, timeout: float = 0.5) -> Optional[dict[str, Any]]:
    info = _shard_info(address, timeout)
    if info is None:
        return None
    r = info.replica
    return {"role": r.role, "epoch": r.epoch, "lsn": r.lsn, "primary": r.primary, "version": info.version,
            "member": r.member, "etcd_age_s": r.etcd_age_s}


def _etcd(endpoint: str) -> Optional[dict[str, Any]]:
    try:
        req = urllib.request.Request(f"{endpoint}/v3/maintenance/status", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=0.5) as r:
            out = json.loads(r.read())
        return {"member": out["header"]["member_id"], "leader": out["leader"]}
    except (OSError, ValueError, KeyError):
        return None


def _slot_map(addresses: list[str]) -> Any:
    """The cluster's newest slot map, as its members hold it (None: none answers)."""
    from shardps.core.slots import SlotMap

    best = None
    for a in addresses:
        info = _shard_info(a, 2.0)
        if info is not None and info.HasField("slots") and info.slots.map_json:
            m = SlotMap.from_json(json.loads(info.slots.map_json))
            if best is None or m.epoch > best.epoch:
                best = m
    return best


def _owners(addresses: list[str], ids: list[int], groups: int) -> Any:
    import numpy as np

    from shardps.core import routing

    arr = np.array(ids, np.int64)
    m = _slot_map(addresses)
    if m is None:
        return routing.shard_of_ids(arr, groups)
    return m.owners[routing.slot_of_ids(arr)]


def _read_cluster(cluster_file: str, ids: list[int]) -> dict[str, Any]:
    """The rows as a client of the whole cluster reads them (each from its owner's primary)."""
    import torch
    from shardps_client import Client

    data = json.loads(open(cluster_file).read())
    idx = torch.tensor(ids, dtype=torch.int64)
    try:
        with Client.from_file(cluster_file, timeout=15, retry_timeout=30) as c:
            rows = c.pull("chaos", idx).numpy().reshape(-1)
    except Exception as e:  # noqa: BLE001 - told
        return {"error": f"{type(e).__name__}: {e}"}
    members = [a for g in data["groups"] for a in g]
    owners = _owners(members, ids, len(data["groups"]))
    return {"values": dict(zip(ids, rows.tolist())), "owners": dict(zip(ids, owners.tolist()))}


def _members(groups: list[list[str]], ids: list[int]) -> dict[str, Any]:
    """Each member's rows of the ids its group owns (read from it alone), digested, with its LSN and version."""
    import numpy as np
    import torch
    from shardps_client import Client

    owners = _owners([a for g in groups for a in g], ids, len(groups))
    out: dict[str, Any] = {}
    for g, members in enumerate(groups):
        mine = torch.tensor(np.array(ids, np.int64)[owners == g])
        for m in members:
            info = _info(m, 2.0)
            if info is None:
                out[m] = None
                continue
            try:
                if len(mine):  # the cluster as a client knows it, but this member alone for its group
                    entries = ["|".join(grp) for grp in groups]
                    entries[g] = m
                    with Client(entries, timeout=10, retry_timeout=5) as c:
                        rows = c.pull("chaos", mine).numpy().reshape(-1)
                else:
                    rows = np.zeros(0, np.float32)
            except Exception as e:  # noqa: BLE001 - a member that cannot be read is told
                out[m] = None
                print(f"agent: reading {m}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                continue
            out[m] = {"rows": hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest(), "lsn": info["lsn"],
                      "version": info["version"], "role": info["role"]}
    return out


def handle(req: dict[str, Any]) -> Any:
    cmd = req["cmd"]
    if cmd == "info":
        with ThreadPoolExecutor(max(1, len(req["addresses"]))) as ex:
            return dict(zip(req["addresses"], ex.map(_info, req["addresses"])))
    if cmd == "etcd":
        with ThreadPoolExecutor(max(1, len(req["endpoints"]))) as ex:
            return dict(zip(req["endpoints"], ex.map(_etcd, req["endpoints"])))
    if cmd == "read_cluster":
        return _read_cluster(req["cluster_file"], req["ids"])
    if cmd == "members":
        return _members(req["groups"], req["ids"])
    if cmd == "create":
        from tests.chaos.workload import create_table

        create_table(req["cluster_file"])
        return True
    raise ValueError(f"unknown command {cmd!r}")


def main() -> int:
    import torch

    torch.set_num_threads(1)
    for line in sys.stdin:
        try:
            out = {"ok": handle(json.loads(line))}
        except Exception as e:  # noqa: BLE001 - answered
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
