"""The Migrate call (``shardps reshard`` moving slots: ``shardps.server.shard.migration``), the slot map in
ShardInfo, and a target's question to its source after a move stayed prepared (the driver stopped between the
source's commit and the target's activation, or the target restarted in between).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable

import grpc
import numpy as np

from shardps.core import codec, protocol
from shardps.core.errors import InvalidArgument
from shardps.core.slots import SlotMap
from shardps.server.rpc import convert, outbound
from shardps.server.shard.facade import Shard
from shardps.server.shard.migration import Move
from shardps.v1 import shardps_pb2 as pb

log = logging.getLogger(__name__)

MAX_PAGE_IDS = 1 << 20


def _move(request: pb.MigrateRequest) -> Move:
    try:
        move = Move.from_json(json.loads(request.move_json))
    except (ValueError, TypeError) as e:
        raise InvalidArgument(f"Migrate {request.op}: move_json is not a migration: {e}") from None
    if move.id != request.move_id:
        raise InvalidArgument(f"Migrate {request.op}: move_json is migration {move.id}, not {request.move_id}")
    return move


def _applied(text: str) -> dict:
    """in_prepare's records of applied pushes (MigrateRequest.applied_json), checked: {shard index: {client id:
    [low, [seqs above]]}} ("" for none)."""
    if not text:
        return {}
    try:
        records = json.loads(text)
        ok = isinstance(records, dict) and all(
            str(shard).isdigit() and isinstance(seen, dict) and all(
                isinstance(c, str) and isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
                and isinstance(v[1], list) and all(isinstance(x, int) for x in v[1]) for c, v in seen.items())
            for shard, seen in records.items())
    except ValueError:
        ok = False
    if not ok:
        raise InvalidArgument("Migrate in_prepare: applied_json is not records of applied pushes "
                              "({shard: {client id: [low, [seqs]]}})")
    return records


# Integer arrays travel as int64 (the wire's one integer type); a row keeps them narrower.
_NARROW = {"steps": np.int32, "meta.last_time": np.uint32, "meta.touches": np.int32}


def _arrays(request: pb.MigrateRequest) -> dict[str, np.ndarray]:
    out = {}
    for k, v in request.arrays.items():
        a = codec.decode(v, k)
        narrow = _NARROW.get(k)
        if narrow is not None and a.dtype == np.int64:
            info = np.iinfo(narrow)
            if a.size and (a.min() < info.min or a.max() > info.max):
                raise InvalidArgument(f"Migrate {request.op}: {k} holds values outside {np.dtype(narrow).name}")
            a = a.astype(narrow)
        out[k] = a
    return out


def handle(shard: Shard, request: pb.MigrateRequest) -> pb.MigrateResponse:
    """One step of a migration on ``shard`` (see ``pb.MigrateRequest``)."""
    m, op, mid = shard.migrations, request.op, request.move_id
    if op not in ("install", "announce") and (not mid or len(mid) > 64):
        raise InvalidArgument(f"Migrate {op}: a move id of 1 to 64 characters is required")
    # Every step, the reads (status, out_ids, out_rows) too, on a replica group's primary only: a move in flight on
    # a source lives in its primary's memory, so a backup would answer "unknown" of one handing over (the driver
    # then rolled back a target and left the source's copy holding its slots for good).
    shard.check.writable(f"slot migration step {op!r}")
    out = pb.MigrateResponse()
    if op == "out_begin":
        out.version = m.out_begin(_move(request))
    elif op == "out_ids":
        limit = min(int(request.limit) or MAX_PAGE_IDS, MAX_PAGE_IDS)
        ids, total = m.out_ids(mid, request.table, int(request.since), int(request.offset), limit)
        out.ids.CopyFrom(codec.encode(ids))
        out.total = total
    elif op == "out_rows":
        ids, arrays = m.out_rows(mid, request.table, convert.ids(request.ids))
        out.ids.CopyFrom(codec.encode(ids))
        for k, v in arrays.items():
            out.arrays[k].CopyFrom(codec.encode(np.ascontiguousarray(v)))
    elif op == "out_handover":
        version, applied = m.out_handover(mid)
        out.version, out.applied_json = version, json.dumps(applied)
    elif op == "out_commit":
        m.out_commit(mid)
    elif op == "out_abort":
        m.out_abort(mid)
    elif op == "in_begin":
        m.in_begin(_move(request))
    elif op == "in_rows":
        m.in_rows(mid, request.table, convert.ids(request.ids), _arrays(request))
    elif op == "in_drop":
        m.in_drop(mid, request.table, convert.ids(request.ids))
    elif op == "in_prepare":
        m.in_prepare(mid, _applied(request.applied_json))
    elif op == "in_activate":
        m.in_activate(mid)
    elif op == "in_abort":
        m.in_abort(mid)
    elif op == "status":
        out.state = m.status(mid)
    elif op == "install":
        try:
            new = SlotMap.from_json(json.loads(request.map_json))
        except ValueError as e:
            raise InvalidArgument(f"Migrate install: {e}") from None
        m.install(new)
    elif op == "announce":
        m.announce(int(request.epoch))
    else:
        raise InvalidArgument(f"Migrate: unknown op {op!r}")
    return out


def slots_info(shard: Shard) -> pb.SlotsInfo:
    """What ShardInfo tells of the shard's slot map and migrations."""
    info = pb.SlotsInfo(map_json=json.dumps(shard.slots.map.to_json(), separators=(",", ":")),
                        accept_epoch=shard.slots.accept_epoch)
    for mv in shard.migrations.in_flight():
        info.moves.add(**mv)
    return info


class ArrivalResolver:
    """Asks the source of every move prepared on this shard for longer than ``after_s`` how it ended, and
    activates (the source committed) or drops it (the source gave it up, or never knew it): the pair settles
    without the driver."""

    def __init__(self, shard: Shard, acting: Callable[[], bool] = lambda: True, after_s: float = 1.0,
                 every_s: float = 0.5, ask: Callable[[str, str], str] | None = None) -> None:
        self.shard = shard
        self.acting = acting  # False on a replica group's backup: its primary settles moves
        self.after_s = after_s
        self.every_s = every_s
        self._ask = ask or _ask_status
        self._seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardps-arrivals-{shard.index}", daemon=True)

    def start(self) -> ArrivalResolver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import time

        while not self._stop.wait(self.every_s):
            if not self.acting():
                continue
            try:
                now = time.monotonic()
                pending = self.shard.migrations.pending()
                self._seen = {mv.id: self._seen.get(mv.id, now) for mv in pending}
                for mv in pending:
                    if now - self._seen[mv.id] >= self.after_s:
                        self.resolve(mv)
            except Exception:  # noqa: BLE001 - next round
                log.exception("shard %d: resolving prepared migrations failed", self.shard.index)

    def resolve(self, move: Move) -> None:
        address = move.new_map.addresses[move.source] if move.source < len(move.new_map.addresses) else ""
        if not address:
            return
        state = self._ask(address, move.id)
        m = self.shard.migrations
        if state == "committed":
            log.info("shard %d: migration %s: its source committed; activating", self.shard.index, move.id)
            m.in_activate(move.id)
        elif state in ("aborted", "unknown", "copying"):
            log.warning("shard %d: migration %s: its source says %s; dropping what it brought", self.shard.index,
                        move.id, state)
            m.in_abort(move.id)


def _ask_status(address: str, move_id: str) -> str:
    """The source's state of ``move_id``, from its replica group's primary (a backup refuses: it holds none of the
    source's moves in flight); empty when it cannot be asked now."""
    for member in protocol.group_members(address):
        ch = outbound.channel(member)
        try:
            call: Any = ch.unary_unary(protocol.METHODS["Migrate"].path,
                                       request_serializer=pb.MigrateRequest.SerializeToString,
                                       response_deserializer=pb.MigrateResponse.FromString)
            return str(call(pb.MigrateRequest(op="status", move_id=move_id), timeout=5,
                            metadata=outbound.metadata()).state)
        except grpc.RpcError:
            continue
        finally:
            ch.close()
    return ""
