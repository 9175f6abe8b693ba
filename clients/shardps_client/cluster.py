"""Cluster operations: tables (create, describe, drop), checkpoints, exports and state dicts.

Each operation that must see this client's pushes flushes first (``flush``: the
client's, which also pushes what row caches summed).
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from shardps.core import codec
from shardps.core.errors import ExportGap as _ServerExportGap
from shardps.core.errors import InvalidArgument as _ServerInvalidArgument
from shardps.core.exporter import Exporter
from shardps.core.exports import ExportResult
from shardps.core.optim import SGD, Optimizer
from shardps.core.policies import DiskTier
from shardps.core.routing import name_hash
from shardps.core.slots import SlotMap
from shardps.core.specs import Admission, Eviction, Initializer, Staleness, SyncPolicy, TableSpec, table_spec_to_pb
from shardps.v1 import shardps_pb2 as pb
from shardps_client import admin, planner
from shardps_client.admin import first_decides
from shardps_client.errors import ExportGapError, InvalidArgumentError
from shardps_client.inputs import check_grads, grads_to_numpy, ids_to_numpy, names
from shardps_client.session import Session

log = logging.getLogger(__name__)


class ClusterOps:
    """What one client does to the whole cluster (see the module docstring).

    Args:
        session: the client's shared state.
        flush: the client's ``flush``.
        pull: the client's ``pull`` (``state_dict`` reads the table through it).
    """

    def __init__(self, session: Session, flush: Callable[[], None], pull: Callable[[str, Any], torch.Tensor]) -> None:
        self._session = session
        self._flush = flush
        self._pull = pull

    def _everywhere(self, method: str, request: Any) -> list[Any]:
        """``method`` on every shard of the cluster (a shard removed from it, owning nothing, left out)."""
        return self._session.transport.fan_out([(s, method, request) for s in self._session.active_shards()])

    def create_table(self, name: str, dim: int, num_embeddings: Optional[int], optimizer: Optional[Optimizer],
                     initializer: Optional[Initializer], staleness: Optional[Staleness], allow_nonfinite: bool,
                     sync: Optional[SyncPolicy], admission: Optional[Admission], eviction: Optional[Eviction],
                     storage: Union[str, DiskTier] = "memory") -> bool:
        """``Client.create_table``."""
        try:
            if not isinstance(storage, DiskTier) and storage not in ("memory", "disk"):
                raise _ServerInvalidArgument(f"storage must be 'memory', 'disk' or a DiskTier, got {storage!r}")
            spec = TableSpec(
                name=name, dim=dim, num_embeddings=num_embeddings, optimizer=optimizer or SGD(),
                initializer=initializer or Initializer(kind="normal", std=1.0, seed=name_hash(name) >> 1),
                staleness=staleness or Staleness(), allow_nonfinite=allow_nonfinite, sync=sync,
                admission=admission, eviction=eviction,
                disk=storage if isinstance(storage, DiskTier) else DiskTier() if storage == "disk" else None,
            )
            msg = table_spec_to_pb(spec)  # (refuses what the spec holds but protobuf cannot: an optimizer by name)
        except _ServerInvalidArgument as e:
            raise InvalidArgumentError(str(e)) from None
        slots = self._session.slots
        results = first_decides(self._session.transport, [
            (s, "CreateTable", pb.CreateTableRequest(spec=msg, shard_map=planner.shard_map(s, slots)))
            for s in slots.active()
        ])
        self._session.catalog.remember(spec)
        return any(r.created for r in results)

    def shards_of(self, ids: Any) -> np.ndarray:
        """``Client.shards_of``."""
        return self._session.slots.owner_of(ids_to_numpy(ids))

    def describe_table(self, name: str) -> list[pb.TableInfo]:
        """``Client.describe_table``."""
        return self._everywhere("DescribeTable", pb.DescribeTableRequest(name=name))

    def drop_table(self, name: str) -> bool:
        """``Client.drop_table``."""
        self._flush()
        results = self._everywhere("DropTable", pb.DropTableRequest(name=name))
        self._session.catalog.forget(name)
        return any(r.dropped for r in results)

    def shard_info(self) -> list[Optional[pb.ShardInfoResponse]]:
        return admin.shard_info(self._session.transport)

    def check_shard_map(self) -> list[Optional[pb.ShardInfoResponse]]:
        infos, maps = admin.check_shard_map(self._session.transport)
        if maps:
            self._session.adopt_slots(maps)
        return infos

    def checkpoint(self, checkpoint_id: Optional[str], hold_s: float) -> str:
        """``Client.checkpoint``."""
        self._flush()
        return admin.checkpoint(self._session.transport, checkpoint_id, hold_s)

    def export(self, out: Union[str, os.PathLike], tables: Optional[Sequence[str]], optimizer_state: bool,
               hold_s: float) -> ExportResult:
        """``Client.export``."""
        self._flush()
        if not str(out):
            raise InvalidArgumentError("export needs a directory to write into, got an empty path")
        return self._exporter(hold_s).base(pathlib.Path(out), names(tables, "tables") if tables else None,
                                           optimizer_state)

    def export_delta(self, out: Union[str, os.PathLike], fallback_base: bool, hold_s: float) -> ExportResult:
        """``Client.export_delta``."""
        if not str(out):
            raise InvalidArgumentError("export_delta needs a directory to write into, got an empty path")
        self._flush()
        try:
            return self._exporter(hold_s).delta(pathlib.Path(out), fallback_base)
        except _ServerExportGap as e:
            raise ExportGapError(str(e)) from None

    def _exporter(self, hold_s: float) -> Exporter:
        transport = self._session.transport
        return Exporter(lambda s, method, request: transport.call(s, method, request), self._session.num_shards,
                        hold_s, self._session.active_shards())

    def state_dict(self, table: str) -> dict[str, torch.Tensor]:
        """``Client.state_dict``."""
        session = self._session
        spec = session.catalog.table(table)
        if spec.num_embeddings is None:
            raise InvalidArgumentError(f"{table}: a state dict needs num_embeddings (export a table without it)")
        self._flush()
        weight = torch.empty(spec.num_embeddings, spec.dim, dtype=torch.float32)
        step = max(1, planner.rows_per_message(session.max_message_bytes, spec.dim, pb.FLOAT32)
                   * len(session.active_shards()))
        for start in range(0, spec.num_embeddings, step):
            ids = torch.arange(start, min(start + step, spec.num_embeddings), dtype=torch.int64)
            weight[start:start + ids.numel()] = self._pull(table, ids)
        return {"weight": weight}

    def load_state_dict(self, table: str, state_dict: dict[str, Any]) -> None:
        """``Client.load_state_dict``."""
        session = self._session
        spec = session.catalog.table(table)
        unexpected = set(state_dict) - {"weight"}
        if "weight" not in state_dict or unexpected:
            raise InvalidArgumentError(f"{table}: a state dict of one key 'weight' expected, got {sorted(state_dict)}")
        w = grads_to_numpy(state_dict["weight"], f"{table}: weight")
        n = spec.num_embeddings if spec.num_embeddings is not None else w.shape[0]
        check_grads(w, table, "weight", (n, spec.dim), "num_embeddings x dim", False)
        self._flush()
        ids = np.arange(n, dtype=np.int64)

        def assign(slots: SlotMap) -> None:
            calls = []
            for s, idx in planner.id_pieces(ids, slots, planner.rows_per_message(
                    session.max_message_bytes, spec.dim, pb.FLOAT32)):
                calls.append((s, "Assign", pb.AssignRequest(table=table, ids=codec.encode(ids[idx]),
                                                            values=codec.encode(w[idx]),
                                                            shard_map=planner.shard_map(s, slots))))
            session.transport.fan_out(calls)  # flush() emptied any row cache of the table, so none serves old rows

        session.routed(assign)


class ClusterMethods:
    """``Client``'s cluster operations: its methods of the same names, each handing the call to the client's
    ``ClusterOps`` (``_cluster``)."""

    _cluster: ClusterOps

    def check_shard_map(self) -> list[Optional[pb.ShardInfoResponse]]:
        """Verify that shard i of the address list reports (index i, count len(addresses)); every shard's ShardInfo,
        None where a shard was removed from the cluster (``reshard`` to fewer shards)."""
        return self._cluster.check_shard_map()

    def shard_info(self) -> list[Optional[pb.ShardInfoResponse]]:
        """ShardInfo of every shard, in index order (None where a shard was removed from the cluster)."""
        return self._cluster.shard_info()

    def shards_of(self, ids: Any) -> np.ndarray:
        """The shard that holds each row id (of any table; a dense tensor's chunks are placed by name), by the slot
        map this client routes with now: the shards' own, adopted on connect and again when one answers that a slot
        moved (a live reshard)."""
        return self._cluster.shards_of(ids)

    def create_table(
        self, name: str, dim: int, num_embeddings: Optional[int] = None, optimizer: Optional[Optimizer] = None,
        initializer: Optional[Initializer] = None, staleness: Optional[Staleness] = None,
        allow_nonfinite: bool = False, sync: Optional[SyncPolicy] = None, admission: Optional[Admission] = None,
        eviction: Optional[Eviction] = None, storage: Union[str, DiskTier] = "memory",
    ) -> bool:
        """Create a table on every shard; True if created, False if an equal one existed.

        ``num_embeddings=None`` makes an unbounded table (any int64 id). The
        default initializer is normal(0, 1), like ``torch.nn.Embedding``, seeded
        from the table name. ``admission`` and ``eviction`` bound the table's
        memory by dropping rows (see ``Admission``, ``Eviction``); ``storage="disk"``
        (or a ``DiskTier(memory_mb=..., policy=...)``) keeps only the hot rows in
        memory and the others on the shards' local disk, losing none. A table of
        the same name with another spec (policies included) raises TableExistsError.
        """
        return self._cluster.create_table(name, dim, num_embeddings, optimizer, initializer, staleness,
                                          allow_nonfinite, sync, admission, eviction, storage)

    def describe_table(self, name: str) -> list[pb.TableInfo]:
        """What each shard holds of a table or dense tensor (rows, bytes)."""
        return self._cluster.describe_table(name)

    def drop_table(self, name: str) -> bool:
        """Drop a table or dense tensor on every shard."""
        return self._cluster.drop_table(name)

    # ---- checkpoints, exports, state dicts --------------------------------------------

    def checkpoint(self, checkpoint_id: Optional[str] = None, hold_s: float = 30.0) -> str:
        """Checkpoint every shard at one consistent point; returns the checkpoint id.

        Flushes this client's pushes, then runs a two-phase checkpoint: every
        shard holds new pushes back (PREPARE), then every shard copies its state
        and resumes (COMMIT) before writing its file. If any shard fails to
        prepare, the others are released (ABORT) and the error is raised.
        """
        return self._cluster.checkpoint(checkpoint_id, hold_s)

    def export(self, out: Union[str, os.PathLike], tables: Optional[Sequence[str]] = None,
               optimizer_state: bool = False, hold_s: float = 30.0) -> ExportResult:
        """Write a base of the cluster's tables and dense tensors (or of ``tables``) to the export directory
        ``out``: every shard at one cut (two-phase, like ``checkpoint``), safetensors files and a manifest
        with checksums (``shardps.core.exports``). Optimizer state only with ``optimizer_state``. Flushes
        this client's pushes first."""
        return self._cluster.export(out, tables, optimizer_state, hold_s)

    def export_delta(self, out: Union[str, os.PathLike], fallback_base: bool = False,
                     hold_s: float = 30.0) -> ExportResult:
        """Write the next delta of ``out``: rows changed since its last cut, tombstones of evicted ids, dropped
        tables. ExportGapError when the cluster cannot (a shard restarted, another shard map); with
        ``fallback_base`` a new base instead. Nothing changed: nothing written (``kind == "none"``)."""
        return self._cluster.export_delta(out, fallback_base, hold_s)

    def state_dict(self, table: str) -> dict[str, torch.Tensor]:
        """The table as a ``torch.nn.Embedding`` state dict: ``{"weight": [num_embeddings, dim]}`` (CPU float32),
        for a table with ``num_embeddings`` small enough to hold here. Rows never pushed read as their
        initializer's values (an unbounded table creates them, as a pull does)."""
        return self._cluster.state_dict(table)

    def load_state_dict(self, table: str, state_dict: dict[str, Any]) -> None:
        """Set every row of ``table`` from a ``torch.nn.Embedding`` state dict (``{"weight": [n, dim]}``; n is the
        table's num_embeddings, or any n for a table without one: ids 0..n-1). Optimizer state of existing rows
        is kept, as ``Module.load_state_dict`` leaves an optimizer's; each row counts as changed (the next
        export delta carries it)."""
        self._cluster.load_state_dict(table, state_dict)
