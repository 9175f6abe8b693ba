"""``shardps stats``: per-shard version, tables, counters and rates, as a table or JSON."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional

import grpc

from shardps.core import status
from shardps.core.optim import optimizer_to_dict
from shardps.core.slots import SlotMap
from shardps.core.specs import dense_spec_from_pb, table_spec_from_pb
from shardps.core.tokens import bearer, token_from_environment
from shardps.probe import channel
from shardps.v1 import shardps_pb2 as pb
from shardps.v1 import shardps_pb2_grpc as pb_grpc


def _info(address: str, timeout: float, tls: Optional[dict[str, Optional[str]]],
          metadata: Optional[tuple[tuple[str, str], ...]]) -> pb.ShardInfoResponse:
    """The shard's ShardInfo within ``timeout`` seconds: a connection attempt that fails (a refused port, a host too
    busy to finish the handshake in time) is tried again until then, and the last error names the problem."""
    t = tls or {}
    deadline = time.monotonic() + timeout
    with channel(address, t.get("ca"), t.get("cert"), t.get("key")) as ch:
        while True:
            try:
                return pb_grpc.ShardStub(ch).ShardInfo(pb.ShardInfoRequest(), metadata=metadata,
                                                       timeout=max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + 0.2 >= deadline:
                    raise RuntimeError(f"shard at {address}: {e.code().name} {e.details()}") from None
            time.sleep(0.2)


def caller(addresses: list[str], timeout: float = 60.0, tls: Optional[dict[str, Optional[str]]] = None
           ) -> Callable[[int, str, Any], Any]:
    """``call(shard, method, request)`` over one channel per shard (TLS files as in ``collect``; the token from
    SHARDPS_TOKEN_FILE / SHARDPS_TOKEN). A refusal raises the shard's own error class (shardps.core.status)."""
    token = token_from_environment()
    metadata = bearer(token) if token else None
    t = tls or {}
    stubs = [pb_grpc.ShardStub(channel(a, t.get("ca"), t.get("cert"), t.get("key"))) for a in addresses]

    def call(shard: int, method: str, request: Any) -> Any:
        try:
            return getattr(stubs[shard], method)(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            kind = dict(e.trailing_metadata() or ()).get(status.KIND_METADATA, "")
            st = status.BY_KIND.get(kind)
            message = f"shard at {addresses[shard]}: {e.code().name} {e.details()}"
            raise (st.shard_error(message) if st is not None else RuntimeError(message)) from None

    return call


def collect(addresses: list[str], timeout: float = 5.0, interval: float = 1.0,
            tls: Optional[dict[str, Optional[str]]] = None) -> list[dict[str, Any]]:
    """One dict per shard; rates over ``interval`` seconds (0: averages since the shard started).
    ``tls``: {"ca", "cert", "key"} file paths; the token comes from SHARDPS_TOKEN_FILE / SHARDPS_TOKEN."""
    token = token_from_environment()
    metadata = bearer(token) if token else None
    first = [_info(a, timeout, tls, metadata) for a in addresses]
    t0 = time.monotonic()
    if interval > 0:
        time.sleep(interval)
        second = [_info(a, timeout, tls, metadata) for a in addresses]
        elapsed = time.monotonic() - t0
    else:
        second = first
    out = []
    for a, before, info in zip(addresses, first, second):
        span = elapsed if interval > 0 else max(info.uptime_s, 1e-9)
        base = before.stats if interval > 0 else pb.ShardStats()
        st = info.stats
        tables = []
        for t in info.tables:
            spec = dense_spec_from_pb(t.dense) if t.HasField("dense") else table_spec_from_pb(t.spec)
            entry = {
                "name": spec.name, "kind": "dense" if t.HasField("dense") else "table",
                "rows": t.num_rows, "bytes": t.bytes, "bytes_per_row": round(t.bytes_per_row, 1),
                "payload_bytes": t.payload_bytes, "optimizer": optimizer_to_dict(spec.optimizer)["type"],
                "mode": "sync" if spec.sync is not None else "async",
            }
            if getattr(spec, "bounded", False):
                entry.update(admitted=t.admitted, rejected=t.rejected, evicted_ttl=t.evicted_ttl,
                             evicted_capacity=t.evicted_capacity, sketch_bytes=t.sketch_bytes)
            if getattr(spec, "disk", None) is not None:
                looked = t.tier_hits + t.tier_misses
                entry.update(hot_rows=t.hot_rows, disk_rows=t.disk_rows, disk_bytes=t.disk_bytes,
                             hit_rate=round(t.tier_hits / looked, 4) if looked else None, promoted=t.promoted,
                             written_back=t.written_back)
            tables.append(entry)
        out.append({
            "address": a, "shard_index": info.shard_index, "num_shards": info.num_shards, "version": info.version,
            "uptime_s": round(info.uptime_s, 1), "durability": info.durability, "last_checkpoint": info.last_checkpoint,
            "pulls": st.pulls, "pushes": st.pushes, "rows_pulled": st.rows_pulled, "rows_pushed": st.rows_pushed,
            "pull_rate": (st.pulls - base.pulls) / span, "push_rate": (st.pushes - base.pushes) / span,
            "rows_pulled_rate": (st.rows_pulled - base.rows_pulled) / span,
            "rows_pushed_rate": (st.rows_pushed - base.rows_pushed) / span,
            "max_staleness": st.max_staleness, "mean_staleness": round(st.mean_staleness, 3),
            "stale_rejected": st.stale_rejected, "duplicates": st.duplicates, "errors": st.errors,
            "tables": tables, "server_version": info.server_version, "export_floor": info.export_floor,
            "data_ports": list(info.data_ports), "data_ipc": len(info.data_ipc), "data_plane_handoffs": info.data_plane_handoffs,
            "clients": [{"peer": c.peer, "transport": c.transport, "caller": c.caller, "calls": c.calls,
                         "bytes": c.bytes, "idle_s": round(c.idle_s, 1)} for c in info.data_clients],
        })
        if info.HasField("replica"):
            r = info.replica
            out[-1]["replica"] = {"member": r.member, "role": r.role, "epoch": r.epoch, "lsn": r.lsn,
                                  "primary": r.primary, "group": r.group, "ack": r.ack,
                                  "backups": {m: {"lsn": lsn, "lag": r.lsn - lsn} for m, lsn in sorted(r.backups.items())},
                                  "etcd_age_s": round(r.etcd_age_s, 1)}
        if info.HasField("slots") and info.slots.map_json:
            m = SlotMap.from_json(json.loads(info.slots.map_json))
            out[-1]["slots"] = {"epoch": m.epoch, "map_id": m.map_id, "owned": int(m.holds(info.shard_index).sum()),
                                "shards": m.num_shards, "accept_epoch": info.slots.accept_epoch,
                                "moves": [{"id": mv.id, "role": mv.role, "state": mv.state, "peer": mv.peer,
                                           "slots": mv.slots, "epoch": mv.epoch} for mv in info.slots.moves]}
        if info.HasField("serving"):
            sv = info.serving
            out[-1]["serving"] = {"directory": sv.directory, "base": sv.base, "delta": sv.delta,
                                  "applied_age_s": round(sv.applied_age_s, 1), "error": sv.error,
                                  "deltas_applied": sv.deltas_applied, "last_apply_s": round(sv.last_apply_s, 4)}
    return out


def _si(x: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(x) < 1000:
            return f"{x:.1f}{unit}" if unit or x != int(x) else f"{int(x)}"
        x /= 1000
    return f"{x:.1f}P"


def render(rows: list[dict[str, Any]]) -> str:
    """A readable table: one line per shard, then its tables."""
    head = f"{'shard':>5} {'address':<21} {'version':>9} {'pulls/s':>9} {'pushes/s':>9} {'rows in/s':>10} {'rows out/s':>10} {'stale max/mean':>15} {'uptime':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['shard_index']:>5} {r['address']:<21} {r['version']:>9} {_si(r['pull_rate']):>9} {_si(r['push_rate']):>9} "
            f"{_si(r['rows_pushed_rate']):>10} {_si(r['rows_pulled_rate']):>10} "
            f"{str(r['max_staleness']) + '/' + str(r['mean_staleness']):>15} {r['uptime_s']:>7.0f}s"
        )
        if r.get("clients") or r.get("data_ports"):
            by: dict[str, int] = {}
            for c in r["clients"]:
                by[c["transport"]] = by.get(c["transport"], 0) + 1
            using = ", ".join(f"{n} over {t}" for t, n in sorted(by.items())) or "none"
            plural = "s" if len(r["data_ports"]) > 1 else ""
            ports = (f"data plane on port{plural} {', '.join(map(str, r['data_ports']))}" if r["data_ports"]
                     else "no data plane") + (" and Unix sockets" if r.get("data_ipc") else "")
            lines.append(f"{'':>5}   clients in the last minute: {using}; {ports}")
        if "replica" in r:
            rp = r["replica"]
            lag = ", ".join(f"{m} {b['lag']} behind" for m, b in rp["backups"].items())
            lines.append(f"{'':>5}   member {rp['member']} of {rp['group']}: {rp['role']}, epoch {rp['epoch']}, log at "
                         f"record {rp['lsn']}" + (f"; backups: {lag}" if lag else "") +
                         (f"; primary {rp['primary']}" if rp["role"] != "primary" else "") + f"; --ack {rp['ack']}")
        if "slots" in r and (r["slots"]["epoch"] or r["slots"]["moves"]):
            sl = r["slots"]
            moving = "; ".join(f"{m['role']} of move {m['id']} ({m['slots']} slots, {m['state']}, shard {m['peer']}, "
                               f"to epoch {m['epoch']})" for m in sl["moves"])
            lines.append(f"{'':>5}   owns {sl['owned']} of 16384 hash slots (slot map epoch {sl['epoch']}, "
                         f"{sl['shards']} shards)" + (f"; {moving}" if moving else ""))
        if "serving" in r:
            sv = r["serving"]
            lines.append(f"{'':>5}   serving {sv['directory']}: base {sv['base']} + delta {sv['delta']} "
                         f"(applied {sv['applied_age_s']:.0f}s ago in {sv['last_apply_s']:.3f}s; "
                         f"{sv['deltas_applied']} deltas since start)")
            if sv["error"]:
                lines.append(f"{'':>5}   next delta refused: {sv['error']}")
        for t in r["tables"]:
            lines.append(
                f"{'':>5}   {t['kind']} {t['name']:<24} rows {_si(t['rows']):>7}  bytes {_si(t['bytes']):>7}B "
                f"({t['bytes_per_row']} B/row)  {t['optimizer']} {t['mode']}"
            )
            if "hot_rows" in t:
                rate = "-" if t["hit_rate"] is None else f"{100 * t['hit_rate']:.1f}%"
                lines.append(
                    f"{'':>5}     in memory {_si(t['hot_rows'])}  on disk {_si(t['disk_rows'])} "
                    f"({_si(t['disk_bytes'])}B)  hit rate {rate}  read back {_si(t['promoted'])}  "
                    f"written back {_si(t['written_back'])}"
                )
            if "admitted" in t:
                lines.append(
                    f"{'':>5}     admitted {_si(t['admitted'])}  rejected {_si(t['rejected'])}  evicted ttl "
                    f"{_si(t['evicted_ttl'])} capacity {_si(t['evicted_capacity'])}  sketch {_si(t['sketch_bytes'])}B"
                )
    total_rows = sum(t["rows"] for r in rows for t in r["tables"])
    total_bytes = sum(t["bytes"] for r in rows for t in r["tables"])
    lines.append(f"total: {len(rows)} shards, {_si(total_rows)} rows, {_si(total_bytes)}B")
    return "\n".join(lines)
