"""Admin calls and the spec cache: what the cluster holds, its shard map, and checkpoints."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, Optional

from shardps.core.slots import SlotMap
from shardps.core.specs import DenseSpec, TableSpec, dense_spec_from_pb, table_spec_from_pb
from shardps.v1 import shardps_pb2 as pb
from shardps_client.errors import InvalidArgumentError, ShardMapError, ShardpsError
from shardps_client.transport import Transport

log = logging.getLogger(__name__)


def first_decides(transport: Transport, calls: list[tuple[int, str, Any]]) -> list[Any]:
    """Calls that create a table or dense tensor on every shard: the lowest shard's first, the others' once it has
    answered. Of creates of one name with different specs made at once by different clients, that shard keeps one and
    refuses the others, which go no further: no two shards can keep different specs of one name."""
    first = min(s for s, _, _ in calls)
    head, tail = [c for c in calls if c[0] == first], [c for c in calls if c[0] != first]
    return transport.fan_out(head) + (transport.fan_out(tail) if tail else [])


class Catalog:
    """Specs of the tables and dense tensors this client uses: asked of shard 0 once, then cached."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._tables: dict[str, TableSpec] = {}
        self._dense: dict[str, DenseSpec] = {}

    def remember(self, spec: TableSpec | DenseSpec) -> None:
        with self._lock:
            if isinstance(spec, DenseSpec):
                self._dense[spec.name] = spec
            else:
                self._tables[spec.name] = spec

    def forget(self, name: str) -> None:
        with self._lock:
            self._tables.pop(name, None)
            self._dense.pop(name, None)

    def table(self, name: str) -> TableSpec:
        spec = self._tables.get(name) or self._describe(name, "spec")
        assert isinstance(spec, TableSpec)
        return spec

    def dense(self, name: str) -> DenseSpec:
        spec = self._dense.get(name) or self._describe(name, "dense")
        assert isinstance(spec, DenseSpec)
        return spec

    def _describe(self, name: str, field: str) -> TableSpec | DenseSpec:
        """Ask shard 0 for ``name``'s spec, expecting TableInfo field ``field`` ("spec" or "dense"); cache it."""
        info = self._transport.call(0, "DescribeTable", pb.DescribeTableRequest(name=name))
        if not info.HasField(field):
            kinds = ("a dense tensor", "a table") if field == "spec" else ("a table", "a dense tensor")
            raise InvalidArgumentError(f"{name!r} is {kinds[0]}, not {kinds[1]}")
        spec = table_spec_from_pb(info.spec) if field == "spec" else dense_spec_from_pb(info.dense)
        self.remember(spec)
        return spec

def maps_of(infos: list[Any]) -> list[SlotMap]:
    """The slot maps ShardInfo replies report (none from a shard too old to have one)."""
    out = []
    for info in infos:
        if info.HasField("slots") and info.slots.map_json:
            out.append(SlotMap.from_json(json.loads(info.slots.map_json)))
    return out


def shard_info(transport: Transport) -> list[Optional[pb.ShardInfoResponse]]:
    """ShardInfo of every shard, in index order (None for a shard removed from the cluster)."""
    there = [s for s, a in enumerate(transport.addresses) if a]
    got = dict(zip(there, transport.fan_out([(s, "ShardInfo", pb.ShardInfoRequest()) for s in there])))
    return [got.get(s) for s in range(len(transport.addresses))]


def check_shard_map(transport: Transport) -> tuple[list[Optional[pb.ShardInfoResponse]], list[SlotMap]]:
    """Verify that shard i of the address list is shard i; (every shard's ShardInfo, their slot maps).

    A cluster that never moved a slot must also report the count of the list; one that did (a slot map with a
    lineage) may have more shards than the client was given: the client adds them from its map."""
    infos = shard_info(transport)
    n = len(transport.addresses)
    maps = maps_of([i for i in infos if i is not None])
    lineages = {m.map_id for m in maps if m.map_id}
    if len(lineages) > 1:
        raise ShardMapError(f"the address list mixes shards of different clusters (slot maps {sorted(lineages)})")
    for i, info in enumerate(infos):
        if info is None:
            continue
        if info.shard_index != i or (not lineages and info.num_shards != n):
            raise ShardMapError(
                f"address list does not match the cluster: position {i} ({transport.addresses[i]}) is shard "
                f"{info.shard_index} of {info.num_shards}, but the client was given {n} "
                f"addresses (list the shards in index order 0..{info.num_shards - 1})",
                address=transport.addresses[i],
            )
    return infos, maps


def checkpoint(transport: Transport, checkpoint_id: Optional[str], hold_s: float) -> str:
    """Two-phase checkpoint of every shard (see ``Client.checkpoint``); returns its id."""
    cid = checkpoint_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    shards = range(len(transport.addresses))
    phase = pb.CheckpointRequest.Phase
    try:
        transport.fan_out([(s, "Checkpoint", pb.CheckpointRequest(checkpoint_id=cid, phase=phase.PREPARE, hold_s=hold_s))
                           for s in shards])
    except ShardpsError:
        for s in shards:
            try:
                transport.call(s, "Checkpoint", pb.CheckpointRequest(checkpoint_id=cid, phase=phase.ABORT), retry=False)
            except ShardpsError as e:
                log.warning("abort of checkpoint %s on %s failed: %s", cid, transport.addresses[s], e)
        raise
    transport.fan_out([(s, "Checkpoint", pb.CheckpointRequest(checkpoint_id=cid, phase=phase.COMMIT)) for s in shards])
    return cid
