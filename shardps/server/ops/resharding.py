"""Live resharding: ``shardps reshard --add K | --remove SHARD | --rebalance | --resume`` moves hash slots between
running shards while training goes on (``shardps.server.shard.migration`` is one shard's side of a move).

The driver plans batches (``slot_plan``), and runs each as one ``Move`` through the steps the migration module
describes: copy while the source serves, a short handover holding writes to the batch's slots, the source's
commit, the target's activation; then it installs the new map on every other shard. Before a map epoch can be
seen by any client, every shard is told to accept it (``announce``).

A journal (next to the cluster file, or ``--journal``) records the plan's goal and the move in flight, written
(and fsynced) before every step that changes a shard. ``--resume`` reads it, asks both shards of the move how
far it went, finishes it (the source committed) or rolls it back (it did not), settles any other move a shard
still holds, and continues with the rest of the plan, recomputed from the maps the shards hold.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import grpc
import numpy as np

from shardps import probe
from shardps.core import codec, protocol, status
from shardps.core.errors import ShardError, Unavailable
from shardps.core.slots import SlotMap
from shardps.core.specs import DenseSpec, dense_spec_from_pb, dense_spec_to_pb, table_spec_from_pb, table_spec_to_pb
from shardps.core.tokens import bearer, token_from_environment
from shardps.server.ops import slot_plan
from shardps.server.shard.move import Move
from shardps.v1 import shardps_pb2 as pb

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 << 20
# Moves in a row that may fail before their commit (a replica group's primary failing over in the middle, say) and
# be rolled back before the driver stops: each time what is left is settled (as --resume does) and the plan made
# again. A move that fails once committing stops the driver at once (the source holds its writes meanwhile; the
# journal says what to resume).
MOVE_RETRIES = 5


class RolledBack(ShardError):
    """A move that failed before its commit, rolled back: nothing of it stands, so it can be planned again."""

    def __init__(self, cause: ShardError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class ShardCalls:
    """Calls to a cluster's shards by index; a shard run as a replica group is called at its primary (found again
    when it changes). ``entries``: each shard's address, or its members joined by "|" ("" for a removed one)."""

    def __init__(self, entries: list[str], tls: Optional[dict[str, Optional[str]]] = None, timeout: float = 60.0,
                 retry_s: float = 60.0) -> None:
        self.tls = tls or {}
        self.timeout = timeout
        self.retry_s = retry_s
        token = token_from_environment()
        self.metadata = bearer(token) if token else None
        self.entries: list[list[str]] = []
        self.primary: list[str] = []
        self._located: set[int] = set()  # replica groups whose primary was asked for (not taken as the first member)
        self._channels: dict[str, grpc.Channel] = {}
        self.add(entries)

    def add(self, entries: list[str]) -> None:
        for e in entries:
            members = protocol.group_members(e)
            self.entries.append(members)
            self.primary.append(members[0] if members else "")

    def __len__(self) -> int:
        return len(self.entries)

    def _method(self, address: str, method: str) -> Any:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = _channel(address, self.tls)
        m = protocol.METHODS[method]
        return ch.unary_unary(m.path, request_serializer=m.request.SerializeToString,
                              response_deserializer=m.response.FromString)

    def call(self, shard: int, method: str, request: Any, retry_s: Optional[float] = None) -> Any:
        """One call, retried (its replica group's primary found again) while the shard is unavailable."""
        if shard >= len(self.primary):
            raise ShardError(f"shard {shard} is in the slot map but not among the {len(self.primary)} shards given "
                             "(the cluster file or --addresses must list every shard, the added ones too)")
        if not self.primary[shard]:
            raise ShardError(f"shard {shard} was removed from the cluster: it has no address")
        deadline = time.monotonic() + (self.retry_s if retry_s is None else retry_s)
        delay = 0.1
        if shard not in self._located:  # a group's first member may be a backup: every call goes to its primary
            self._located.add(shard)
            self._find_primary(shard)
        while True:
            address = self.primary[shard]
            try:
                reply = self._method(address, method)(request, timeout=self.timeout, metadata=self.metadata)
                if method != "ShardInfo" or reply.replica.role in ("", "primary"):
                    return reply
                # ShardInfo answered by a backup (the primary moved since it was found): its moves in flight are
                # not the primary's; asked again of the primary
                if time.monotonic() + delay > deadline:
                    raise ShardError(f"shard {shard}: no primary of its replica group answered within "
                                     f"{self.retry_s if retry_s is None else retry_s:g} s (last: {address}, a "
                                     f"{reply.replica.role})")
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                self._find_primary(shard)
                continue
            except grpc.RpcError as e:
                kind = dict(e.trailing_metadata() or ()).get(status.KIND_METADATA, "")
                transient = e.code() == grpc.StatusCode.UNAVAILABLE or kind == "not_primary"
                if not transient or time.monotonic() + delay > deadline:
                    st = status.BY_KIND.get(kind)
                    message = f"shard {shard} at {address}: {method} {request_name(request)}: {e.details()}"
                    raise (st.shard_error(message) if st is not None else ShardError(message)) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                self._find_primary(shard)

    def _find_primary(self, shard: int) -> None:
        members = self.entries[shard]
        if len(members) < 2:
            return
        for m in members:
            try:
                info = self._method(m, "ShardInfo")(pb.ShardInfoRequest(), timeout=2, metadata=self.metadata)
            except grpc.RpcError:
                continue
            if info.replica.role == "primary":
                self.primary[shard] = m
                return

    def info(self, shard: int) -> pb.ShardInfoResponse:
        return self.call(shard, "ShardInfo", pb.ShardInfoRequest())

    def migrate(self, shard: int, op: str, retry_s: Optional[float] = None, **fields: Any) -> pb.MigrateResponse:
        return self.call(shard, "Migrate", pb.MigrateRequest(op=op, **fields), retry_s)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


def request_name(request: Any) -> str:
    op = getattr(request, "op", "")
    return f"{op} {getattr(request, 'move_id', '')}".strip() if op else ""


def _channel(address: str, tls: dict[str, Optional[str]]) -> grpc.Channel:
    return probe.channel(address, tls.get("ca"), tls.get("cert"), tls.get("key"),
                         [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)])


@dataclass
class Journal:
    """What a driver that stops can be resumed from: the goal (the shards that will own slots), the batch size,
    the move in flight and its phase; counts of what was moved."""

    path: pathlib.Path
    active: list[int] = field(default_factory=list)
    batch_slots: int = 256
    move: Optional[dict[str, Any]] = None
    phase: str = ""
    moved_slots: int = 0
    moved_rows: int = 0
    retire: list[int] = field(default_factory=list)

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"active": self.active, "batch_slots": self.batch_slots, "move": self.move,
                       "phase": self.phase, "moved_slots": self.moved_slots, "moved_rows": self.moved_rows,
                       "retire": self.retire}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, path: pathlib.Path) -> Journal:
        d = json.loads(path.read_text())
        return cls(path, [int(s) for s in d["active"]], int(d["batch_slots"]), d.get("move"), d.get("phase", ""),
                   int(d.get("moved_slots", 0)), int(d.get("moved_rows", 0)), [int(s) for s in d.get("retire", [])])

    def done(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass
class Progress:
    """What a run did, for the command's report and the benchmark."""

    moves: int = 0
    slots: int = 0
    chunks: int = 0
    rows: int = 0
    seconds: float = 0.0
    handovers_s: list[float] = field(default_factory=list)  # each batch's writes-held time (handover to commit)

    def as_dict(self) -> dict[str, Any]:
        held = sorted(self.handovers_s)
        return {"moves": self.moves, "slots": self.slots, "dense_chunks": self.chunks, "rows": self.rows,
                "seconds": round(self.seconds, 3), "rows_per_s": round(self.rows / self.seconds, 1) if self.seconds else 0,
                "handover_s_median": round(held[len(held) // 2], 4) if held else 0.0,
                "handover_s_max": round(held[-1], 4) if held else 0.0}


class Resharder:
    """Moves slots between the shards of ``calls`` (see the module docstring)."""

    def __init__(self, calls: ShardCalls, journal: Journal, page_bytes: int = 3 << 20,
                 on_step: Callable[[str], None] = lambda _: None,
                 at: Callable[[str, Move], None] = lambda phase, move: None) -> None:
        self.calls = calls
        self.journal = journal
        self.page_bytes = page_bytes
        self.on_step = on_step
        self.at = at  # called as a move reaches "copied", "handed_over", "prepared", "committed", "activated"
        self.progress = Progress()
        self.map = self.current_map()

    # ---- the cluster's map ---------------------------------------------------------------

    def reachable(self) -> list[int]:
        return [s for s in range(len(self.calls)) if self.calls.primary[s]]

    def current_map(self) -> SlotMap:
        """The newest map the shards hold (with every shard's address)."""
        maps = []
        for s in self.reachable():
            info = self.calls.info(s)
            if info.slots.map_json:
                maps.append(SlotMap.from_json(json.loads(info.slots.map_json)))
        if not maps:
            raise ShardError("no shard reports a slot map: the shards are older than live resharding")
        newest = max(maps, key=lambda m: (m.epoch, bool(m.map_id)))
        return newest.with_addresses(self._addresses(newest.num_shards))

    def _addresses(self, n: int) -> list[str]:
        return ["|".join(self.calls.entries[s]) if s < len(self.calls) else "" for s in range(max(n, len(self.calls)))]

    def publish(self, new: SlotMap, shards: Optional[list[int]] = None) -> None:
        """Make ``new`` the map of every reachable shard: announced first (every shard accepts its epoch), then
        installed."""
        shards = self.reachable() if shards is None else shards
        self.publish_epoch(new.epoch, shards)
        map_json = json.dumps(new.to_json())
        for s in shards:
            self.calls.migrate(s, "install", map_json=map_json)
        self.map = new

    def prepare(self, active: list[int]) -> None:
        """Before the first move: a lineage and every shard's address in the map, dense chunks pinned where they are
        (new dense tensors go to ``active``); published at the next epoch."""
        dense = self.dense_specs()
        new = slot_plan.pinned(self.map, {n: (d.rows, d.chunk_rows) for n, d in dense.items()}, active)
        new = new.with_addresses(self._addresses(self.map.num_shards))
        if new.key()[1:] != self.map.key()[1:] or not self.map.map_id or new.addresses != self.map.addresses:
            new = SlotMap(self.map.epoch + 1, new.owners, new.base, new.num_shards, new.dense, new.addresses,
                          self.map.map_id or uuid.uuid4().hex[:16], new.dense_shards)
            self.publish(new)

    # ---- tables ------------------------------------------------------------------------

    def _specs(self, shard: int) -> list[Any]:
        out = []
        for t in self.calls.info(shard).tables:
            out.append(dense_spec_from_pb(t.dense) if t.HasField("dense") else table_spec_from_pb(t.spec))
        return out

    def dense_specs(self) -> dict[str, DenseSpec]:
        active = self.map.active()
        return {s.name: s for s in self._specs(active[0]) if isinstance(s, DenseSpec)} if active else {}

    def ensure_lineage(self) -> None:
        """Give a map that never moved a slot its lineage (at the next epoch) before the cluster changes: from then on
        a client given more (or fewer) addresses than the map has shards routes by the map."""
        if not self.map.map_id:
            m = self.map
            self.publish(SlotMap(m.epoch + 1, m.owners, m.base, m.num_shards, m.dense, m.addresses,
                                 uuid.uuid4().hex[:16], m.dense_shards))

    def _ensure_tables(self, source: int, target: int) -> list[Any]:
        """The source's tables and dense tensors, made on the target where missing; the source's specs."""
        specs = self._specs(source)
        have = {s.name for s in self._specs(target)}
        for spec in specs:
            if spec.name in have:
                continue
            if isinstance(spec, DenseSpec):
                self.calls.call(target, "RegisterDense", pb.RegisterDenseRequest(spec=dense_spec_to_pb(spec)))
            else:
                self.calls.call(target, "CreateTable", pb.CreateTableRequest(spec=table_spec_to_pb(spec)))
        return specs

    # ---- one move ------------------------------------------------------------------------

    def run(self, active: list[int]) -> Progress:
        """Move slots until the map is balanced over ``active``."""
        t0 = time.monotonic()
        failures = 0  # moves in a row that failed
        self.journal.active = sorted(active)
        self.journal.save()
        self.prepare(active)
        while True:
            dense = {n: (d.rows, d.chunk_rows) for n, d in self.dense_specs().items()}
            steps = slot_plan.plan(self.map, active, self.journal.batch_slots, dense)
            if not steps:
                break
            total = len(steps)
            for k, step in enumerate(steps[:1]):
                self.on_step(f"move {self.progress.moves + 1} ({total - k} planned): {step.describe()}")
                try:
                    self.move(step)
                    failures = 0
                except RolledBack as e:  # a group's primary failed over before the commit, say: settled, planned again
                    failures += 1
                    if failures > MOVE_RETRIES:
                        raise e.cause from None
                    self.on_step(f"move failed ({e}); settling it and planning again ({failures} of "
                                 f"{MOVE_RETRIES})")
                    time.sleep(min(5.0, failures))
                    self.settle()
        self.progress.seconds += time.monotonic() - t0
        return self.progress

    def move(self, step: slot_plan.Step) -> None:
        new = self.map.moved(step.slots, step.target, step.chunks, epoch=self.map.epoch + 1)
        move = Move(uuid.uuid4().hex[:12], step.source, step.target, np.asarray(step.slots, np.int64),
                    tuple(step.chunks), new)
        body = json.dumps(move.to_json())
        S, T = step.source, step.target
        self.journal.move, self.journal.phase = move.to_json(), "copying"
        self.journal.save()
        since = int(self.calls.migrate(S, "out_begin", move_id=move.id, move_json=body).version)
        specs = self._ensure_tables(S, T)
        self.calls.migrate(T, "in_begin", move_id=move.id, move_json=body)
        try:
            sent = {spec.name: self._copy(move.id, S, T, spec, -1) for spec in specs}
            self.at("copied", move)
            self.publish_epoch(new.epoch)
            t_hold = time.monotonic()
            # (with the source's records of applied pushes: a push it applied whose answer its client never got
            # is then applied once where its rows go, docs/resharding.md#exactly-once-across-shards)
            applied = self.calls.migrate(S, "out_handover", move_id=move.id).applied_json
            self.at("handed_over", move)
            for spec in specs:
                self._copy(move.id, S, T, spec, since)
                present = self._ids(move.id, S, spec.name, -1)
                gone = np.setdiff1d(sent[spec.name], present, assume_unique=True)
                if gone.size:
                    self.calls.migrate(T, "in_drop", move_id=move.id, table=spec.name, ids=codec.encode(gone))
            self.calls.migrate(T, "in_prepare", move_id=move.id, applied_json=applied)
            self.at("prepared", move)
        except ShardError as e:
            self._roll_back(move)
            raise RolledBack(e) from e
        self.journal.phase = "committing"
        self.journal.save()
        self.calls.migrate(S, "out_commit", move_id=move.id)
        self.progress.handovers_s.append(time.monotonic() - t_hold)
        self.at("committed", move)
        self._finish(move)
        self.at("activated", move)
        self.progress.moves += 1
        self.progress.slots += len(step.slots)
        self.progress.chunks += len(step.chunks)
        self.progress.rows += sum(int(v.shape[0]) for v in sent.values())
        self.journal.moved_slots += len(step.slots)
        self.journal.moved_rows = self.progress.rows

    def publish_epoch(self, epoch: int, shards: Optional[list[int]] = None) -> None:
        """Every shard (of ``shards``, or every reachable one) accepts requests naming ``epoch`` from now on."""
        for s in self.reachable() if shards is None else shards:
            self.calls.migrate(s, "announce", epoch=epoch)

    def _finish(self, move: Move) -> None:
        """After the source's commit: the target activates (retried until it does), every other shard installs."""
        self.journal.phase = "activating"
        self.journal.save()
        self.calls.migrate(move.target, "in_activate", move_id=move.id, retry_s=600)
        self.map = move.new_map
        others = [s for s in self.reachable() if s not in (move.source, move.target)]
        map_json = json.dumps(move.new_map.to_json())
        for s in others:
            self.calls.migrate(s, "install", map_json=map_json)
        self.journal.move, self.journal.phase = None, ""
        self.journal.save()

    def _roll_back(self, move: Move) -> None:
        for shard, op in ((move.source, "out_abort"), (move.target, "in_abort")):
            try:
                self.calls.migrate(shard, op, move_id=move.id, retry_s=10)
            except ShardError as e:
                log.warning("migration %s: %s on shard %d failed: %s", move.id, op, shard, e)
        self.journal.move, self.journal.phase = None, ""
        self.journal.save()

    def _ids(self, move_id: str, source: int, table: str, since: int) -> np.ndarray:
        parts, total, offset = [], None, 0
        while total is None or offset < total:
            r = self.calls.migrate(source, "out_ids", move_id=move_id, table=table, since=since, offset=offset,
                                   limit=1 << 18)
            ids = codec.decode(r.ids, "ids")
            total = int(r.total)
            parts.append(ids)
            offset += ids.shape[0]
            if not ids.shape[0]:
                break
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _copy(self, move_id: str, source: int, target: int, spec: Any, since: int) -> np.ndarray:
        """The rows of ``spec``'s table in the move changed after ``since`` (-1: all), read from the source and
        written on the target, a page at a time; their ids."""
        ids = self._ids(move_id, source, spec.name, since)
        dim = spec.cols if isinstance(spec, DenseSpec) else spec.dim
        per_row = dim * 4 * (1 + len(spec.optimizer.state_names())) + 32
        page = max(1, self.page_bytes // per_row)
        for lo in range(0, ids.shape[0], page):
            r = self.calls.migrate(source, "out_rows", move_id=move_id, table=spec.name,
                                   ids=codec.encode(ids[lo:lo + page]))
            got = codec.decode(r.ids, "ids")
            if not got.shape[0]:
                continue
            req = pb.MigrateRequest(op="in_rows", move_id=move_id, table=spec.name, ids=r.ids)
            for k, v in r.arrays.items():
                req.arrays[k].CopyFrom(v)
            self.calls.call(target, "Migrate", req)
        return ids

    # ---- resuming ------------------------------------------------------------------------

    def settle(self) -> int:
        """Finish or roll back every move in flight (the journal's, and any a shard still holds), then make the
        newest map every shard's; how many moves were settled."""
        holders: dict[str, list[tuple[int, str, int]]] = {}  # move id -> (shard, role, peer)
        for shard in self.reachable():
            for m in self.calls.info(shard).slots.moves:
                holders.setdefault(m.id, []).append((shard, m.role, int(m.peer)))
        if self.journal.move:  # both sides, whichever of them listed it (a side that lost it aborts as never begun)
            mv = Move.from_json(self.journal.move)
            parts = holders.setdefault(mv.id, [])
            for side in ((mv.source, "source", mv.target), (mv.target, "target", mv.source)):
                if not any(s == side[0] and role == side[1] for s, role, _ in parts):
                    parts.append(side)
        for move_id, parts in holders.items():
            sources = [s for s, role, _ in parts if role == "source"]
            source = sources[0] if sources else next(peer for _, role, peer in parts if role == "target")
            state = self._state(source, move_id)
            if state == "committing":  # its commit record is logged, not yet known durable: it goes forward
                log.info("migration %s: its source was committing it: committing again", move_id)
                self.calls.migrate(source, "out_commit", move_id=move_id, retry_s=60)
                state = "committed"
            if state == "committed":
                log.info("migration %s: its source committed: activating it", move_id)
                for shard, role, _ in parts:
                    if role == "target":
                        self.calls.migrate(shard, "in_activate", move_id=move_id, retry_s=600)
            else:
                log.info("migration %s: its source says %r: rolling it back", move_id, state)
                for shard, role, _ in parts:
                    op = "out_abort" if role == "source" else "in_abort"
                    self.calls.migrate(shard, op, move_id=move_id, retry_s=60)
        self.journal.move, self.journal.phase = None, ""
        self.journal.save()
        self.map = self.current_map()
        self.publish(self.map)
        return len(holders)

    def _state(self, shard: int, move_id: str) -> str:
        try:
            return str(self.calls.migrate(shard, "status", move_id=move_id, retry_s=60).state)
        except ShardError as e:
            raise Unavailable(f"migration {move_id}: its source shard {shard} cannot be asked ({e}); start it and "
                              "resume again") from None
