"""Consistent cuts of one shard: holding pushes back (phase 1 of a cluster-wide checkpoint or export),
copying every table at one version, and writing checkpoints to the data dir.

Lock order: ``Checkpointer.lock`` -> registry.lock -> Table.lock -> the update path's version lock.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np

from shardps.core.errors import InvalidArgument, Unavailable
from shardps.server.durability import checkpoints
from shardps.server.durability.gate import CheckpointGate
from shardps.server.durability.modes import Durability
from shardps.server.durability.replication import ReplicatedLog
from shardps.server.shard.metrics import NullMetrics
from shardps.server.shard.registry import TableRegistry
from shardps.server.shard.updates import UpdatePath
from shardps.server.storage.table import Table

log = logging.getLogger(__name__)


@dataclass
class CheckpointFiles:
    """Which checkpoint files this shard wrote, and the durability cut the previous one covers."""

    seqno: int = 0
    last: str = ""
    previous_cut: int = 0
    bytes: int = 0  # what the last checkpoint written or restored holds: its file and the hot rows it spilled


class Checkpointer:
    """Holds, snapshots and checkpoints of one shard (``Shard`` delegates its checkpoint calls here)."""

    def __init__(self, shard_index: int, num_shards: int, data_dir: Optional[pathlib.Path], registry: TableRegistry,
                 updates: UpdatePath, durability: Durability, gate: CheckpointGate, hold_s: float, keep: int,
                 metrics: NullMetrics, check_writable: Callable[[str], None]) -> None:
        self.index = shard_index
        self.num_shards = num_shards
        self.data_dir = data_dir
        self.registry = registry
        self.updates = updates
        self.durability = durability
        self.gate = gate
        self.hold_s = hold_s
        self.keep = keep
        self.metrics = metrics
        self.check_writable = check_writable
        self.lock = threading.Lock()  # one cut at a time (checkpoints, exports)
        self.files = CheckpointFiles()
        self.migrations: Any = None  # the shard's slot migrations (``shard.migration``): a cut waits for a handover

    # ---- holding pushes back ---------------------------------------------------------

    def hold_pushes(self, hold_s: Optional[float] = None) -> None:
        """Hold new pushes back and let running ones finish: phase 1 of a cluster-wide cut (checkpoint or
        export), ended by phase 2, an abort, or after ``hold_s`` (at most the configured hold)."""
        self.check_writable("a checkpoint or export")
        if hold_s is not None and not hold_s >= 0:  # (nan too: the hold would end at once)
            raise InvalidArgument(f"shard {self.index}: hold_s must be >= 0 seconds (0: the shard's own hold), "
                                  f"got {hold_s}")
        hold = self.hold_s if not hold_s else min(hold_s, self.hold_s)
        with self.lock:
            handing = self.migrations.handing_over() if self.migrations is not None else ""
            if handing:  # its slots change hands any moment: a cluster-wide cut would miss or double them
                raise Unavailable(f"shard {self.index}: slot migration {handing} is handing over; retry the cut")
            self.gate.close()
            for t in self.registry.tables():  # pushes that passed the gate before it closed finish first
                with t.lock:
                    pass
            self.gate.hold(hold)

    def abort(self) -> None:
        with self.lock:
            self.gate.open()

    @contextmanager
    def phase_two(self, what: str, prepared: bool) -> Iterator[None]:
        """The copy of a cut (held by the caller's ``lock``): with ``prepared``, refused when phase 1 expired,
        and pushes resume once the copy is made, whatever happens."""
        if prepared and self.gate.is_open:
            raise Unavailable(f"shard {self.index}: {what} was not prepared or its hold expired")
        try:
            yield
        finally:
            if prepared:
                self.gate.open()

    # ---- consistent copies -----------------------------------------------------------

    @contextmanager
    def all_locked(self) -> Iterator[tuple[list[tuple[str, Table]], float]]:
        """Every (name, table) by name, with the registry lock and every table's lock held (one version), and
        when the table locks began to be taken (``time.perf_counter``: from then on pushes wait)."""
        with ExitStack() as stack:
            if self.migrations is not None:  # the slot map and the rows it decides are copied together
                stack.enter_context(self.migrations.lock)
            stack.enter_context(self.registry.lock)
            tables = self.registry.sorted_items()
            t0 = time.perf_counter()
            for _, t in tables:
                stack.enter_context(t.lock)
            yield tables, t0

    def snapshot(self, tier_name: str = "") -> tuple[dict[str, Any], dict[str, np.ndarray], float]:
        """Copy every table at one consistent version: (checkpoint header, arrays, seconds pushes waited). Tables with
        a disk tier give their hot rows; the rows on disk are in a checkpoint of the disk tier taken at the same
        cut, ``tier_name`` (default: a new name), which the header names as ``disk_tier``."""
        with self.all_locked() as (tables, t0):
            meta: dict[str, Any] = {
                "shard_index": self.index, "num_shards": self.num_shards, "version": self.updates.version,
                "seen": self.updates.seen.to_json(), "seen_elsewhere": self.updates.elsewhere.others_json(),
                "tables": [], "wal_segment": self.durability.cut(),
            }
            if isinstance(self.durability, ReplicatedLog):  # a replica group's member: where its log ends
                meta["lsn"], meta["epochs"] = self.durability.lsn, self.durability.history
            if self.migrations is not None:
                meta["slots"] = self.migrations.to_meta()
            tier_dir = None
            if self.registry.tiers is not None and self.registry.tiered():
                meta["disk_tier"] = tier_name or f"snapshot-{uuid.uuid4().hex[:12]}"
                tier_dir = self.registry.tiers.checkpoint(meta["disk_tier"])
            arrays: dict[str, np.ndarray] = {}
            for i, (_, t) in enumerate(tables):
                meta["tables"].append(checkpoints.spec_entry(t.spec))
                if t.hot is not None:
                    assert tier_dir is not None
                    t.hot.spill(tier_dir)
                for k, v in t.snapshot().items():
                    arrays[f"t{i}.{k}"] = v
            pause = time.perf_counter() - t0
        return meta, arrays, pause

    # ---- checkpoints -----------------------------------------------------------------

    def require_data_dir(self) -> pathlib.Path:
        self.check_writable("a checkpoint")
        if self.data_dir is None or self.durability.mode == "none":
            raise InvalidArgument(f"shard {self.index} has no data dir: start it with --data-dir to checkpoint")
        return self.data_dir

    def checkpoint(self, checkpoint_id: str = "", prepared: bool = False) -> tuple[str, int, int, float]:
        """Write a consistent snapshot to the data dir: (id, version, bytes, pause seconds).

        With ``prepared`` this is phase 2 of a cluster-wide checkpoint: pushes
        have been held since ``hold_pushes`` and resume once the state
        is copied in memory, before the file is written.
        """
        data_dir = self.require_data_dir()
        checkpoint_id = checkpoint_id or uuid.uuid4().hex[:12]
        if not all(c.isalnum() or c in "-_" for c in checkpoint_id) or len(checkpoint_id) > 64:
            raise InvalidArgument(f"invalid checkpoint id {checkpoint_id!r}: use up to 64 of [A-Za-z0-9_-]")
        started = time.perf_counter()
        with self.lock:
            name = checkpoints.file_name(self.files.seqno + 1, checkpoint_id)
            with self.phase_two(f"checkpoint {checkpoint_id}", prepared):
                meta, arrays, pause = self.snapshot(tier_name=name.removesuffix(checkpoints.SUFFIX))
            meta["checkpoint_id"] = checkpoint_id
            self.files.seqno += 1
            meta["seqno"] = self.files.seqno
            try:
                if "disk_tier" in meta:  # the tier's checkpoint durable before the file that names it
                    assert self.registry.tiers is not None
                    self.registry.tiers.sync_checkpoint(meta["disk_tier"])
                size = checkpoints.write(data_dir / name, meta, arrays)
            except BaseException:
                self._prune_tiers(data_dir)
                raise
            self.files.bytes = size + self._spilled_bytes(meta)
            checkpoints.prune(data_dir, self.keep)
            self._prune_tiers(data_dir)
            # Records are kept back to the previous checkpoint, the fallback if this one breaks.
            self.durability.checkpointed(self.files.previous_cut)
            self.files.previous_cut = meta["wal_segment"]
            self.files.last = checkpoint_id
        self.metrics.checkpoint(time.perf_counter() - started, pause)
        log.info("shard %d: checkpoint %s at version %d (%d bytes, pause %.3fs)",
                 self.index, checkpoint_id, meta["version"], size, pause)
        return checkpoint_id, meta["version"], size, pause

    def rebase(self, checkpoint_id: str) -> None:
        """Checkpoint the state as it is now and remove every older checkpoint and log record: they hold another
        history (a replica group's backup installed a whole copy of its primary)."""
        data_dir = self.require_data_dir()
        self.checkpoint(checkpoint_id)
        with self.lock:
            checkpoints.prune(data_dir, 1)
            self._prune_tiers(data_dir)
            self.durability.checkpointed(self.files.previous_cut)

    def _prune_tiers(self, data_dir: pathlib.Path) -> None:
        """Remove the disk tier's checkpoints that no checkpoint file names any more."""
        tiers = self.registry.tiers
        if tiers is None:
            return
        kept = {p.name.removesuffix(checkpoints.SUFFIX) for p in checkpoints.list_checkpoints(data_dir)}
        for name in tiers.checkpoints():
            if name.startswith("ckpt-") and name not in kept:
                tiers.remove_checkpoint(name)

    def _spilled_bytes(self, meta: dict[str, Any]) -> int:
        """Bytes of the hot rows the checkpoint of ``meta`` spilled into its disk tier checkpoint (its segment
        files are hard links of the live ones, written already)."""
        if "disk_tier" not in meta or self.registry.tiers is None:
            return 0
        return sum(p.stat().st_size for p in (self.registry.tiers.checkpoint_root / meta["disk_tier"]).glob("hot-*"))

    def restored(self, meta: dict[str, Any], size: int = 0) -> int:
        """A checkpoint (of ``size`` bytes) was loaded on start: continue its numbering; returns the log segment
        replay starts at."""
        self.files.seqno = int(meta["seqno"])
        self.files.bytes = size + self._spilled_bytes(meta)
        self.files.last = meta["checkpoint_id"]
        self.files.previous_cut = int(meta.get("wal_segment", 0))
        return self.files.previous_cut
