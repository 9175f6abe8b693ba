"""A shard's cuts as the facade offers them: two-phase checkpoints, snapshots and exports, each handed to the
collaborator whose job it is (``Checkpointer``, ``ExportSessions``, ``recovery.load_state``)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from shardps.server.shard.checkpointing import Checkpointer
from shardps.server.shard.export_sessions import ExportedCopy, ExportSessions
from shardps.server.shard.recovery import load_state


class ShardCuts:
    """The cut methods of ``Shard`` (a mixin: ``Shard`` has the ``checkpointer`` and ``exports`` they use)."""

    checkpointer: Checkpointer
    exports: ExportSessions

    def prepare_checkpoint(self, hold_s: Optional[float] = None) -> None:
        """Phase 1 of a cluster-wide checkpoint: hold new pushes back, let running ones finish.

        The hold ends with ``checkpoint`` (phase 2), ``abort_checkpoint``, or by
        itself after ``hold_s`` (default ``config.checkpoint_hold_s``) so a
        coordinator that died cannot stall training.
        """
        self.checkpointer.require_data_dir()
        self.checkpointer.hold_pushes(hold_s)

    def hold_pushes(self, hold_s: Optional[float] = None) -> None:
        self.checkpointer.hold_pushes(hold_s)

    def abort_checkpoint(self) -> None:
        self.checkpointer.abort()

    def checkpoint(self, checkpoint_id: str = "", prepared: bool = False) -> tuple[str, int, int, float]:
        return self.checkpointer.checkpoint(checkpoint_id, prepared)

    def snapshot(self) -> tuple[dict[str, Any], dict[str, np.ndarray], float]:
        return self.checkpointer.snapshot()

    def load_state(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Replace everything with a snapshot's contents (the rows must be owned by this shard)."""
        load_state(self, meta, arrays)  # type: ignore[arg-type]

    def delta_floor(self) -> int:
        return self.exports.delta_floor()

    def export_begin(self, export_id: str, names: list[str], optimizer_state: bool, since: Optional[int],
                     prepared: bool = False) -> tuple[int, dict[str, ExportedCopy]]:
        return self.exports.begin(export_id, names, optimizer_state, since, prepared)

    def export_read(self, export_id: str, name: str, offset: int, max_rows: int,
                    tombstones: bool = False) -> dict[str, np.ndarray]:
        return self.exports.read(export_id, name, offset, max_rows, tombstones)

    def export_end(self, export_id: str) -> None:
        self.exports.end(export_id)
