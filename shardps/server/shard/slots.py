"""What one shard owns: its slot map (``shardps.core.slots``), the slots and dense chunks it is handing over or
receiving, and the checks of every request against them.

The map a shard holds changes three ways, each one a durability record (so a restart and a replica group's
backups come back to the same map): its own migrations (``migration``: a handover committed on the source, the
arrival activated on the target) and the driver's broadcast of the new map to the others (``install``, which may
not change what this shard owns). ``announce`` raises the highest epoch a request may name before a change
commits, so that no client ever holds a map a shard would call "from the future".

A request names its client's map (epoch and lineage): a map of another lineage is refused, one from the future
too; an older one is served as long as this shard owns every id it names (ownership is decided here, never by
the client's map), else refused with ``Moved`` naming the new owner. Writes to slots being handed over wait
(``hold``) until the handover commits (then ``Moved``) or is given up; reads go on.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Union

import numpy as np

from shardps.core.errors import Moved, Unavailable, WrongShard
from shardps.core.routing import NUM_SLOTS, slot_of_ids
from shardps.core.slots import SlotMap
from shardps.core.specs import DenseSpec, TableSpec


class Owns:
    """A table's ownership test (``Table.check_ids``): which ids (or dense rows) of an array this shard owns, and
    the error for those it does not. Ids of slots arriving here wait for the arrival's outcome first."""

    def __init__(self, slots: SlotOwnership, spec: Union[TableSpec, DenseSpec]) -> None:
        self._slots = slots
        self._spec = spec

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        slots, spec = self._slots, self._spec
        mask = slots.owned(spec, ids)
        if not mask.all() and slots.arriving_any() and slots.blocked(spec, ids, write=False) == "wait":
            slots.wait_for(spec, ids, False, f"a request to {spec.name!r}")
            mask = slots.owned(spec, ids)
        return mask

    def all_in(self, ids: np.ndarray, limit: Optional[int]) -> bool:
        """Whether every id is in [0, ``limit``) (when given) and this shard's now: the common case's whole check.
        False says only that the full check must run (``storage.checks.ids``), which names what is wrong or waits
        for arriving slots."""
        return self._slots.all_owned(self._spec, ids, limit)

    def refuse(self, ids: np.ndarray) -> Exception:
        return self._slots.moved(self._spec, ids)


class SlotOwnership:
    """The slot map of shard ``index`` and the state of its migrations' slots (see the module docstring)."""

    def __init__(self, index: int, num_shards: int, join: bool = False,
                 before_wait: Callable[[], None] = lambda: None) -> None:
        self.index = index
        self.before_wait = before_wait  # called before a request waits here (the fair scheduler's hook)
        # A shard added to a running cluster (``join``) owns nothing until slots are moved to it.
        self.map = _owning_nothing(index, num_shards) if join else SlotMap.uniform(num_shards)
        self.accept_epoch = self.map.epoch  # the newest epoch a request may name (announced before a commit)
        self.cv = threading.Condition()
        # Slots (and dense chunks) being handed over: writes to them wait (``hold``).
        self.frozen = np.zeros(NUM_SLOTS, dtype=bool)
        self.frozen_dense: set[tuple[str, int]] = set()
        # Slots arriving (prepared on this shard, not yet its own): requests to them wait for the outcome.
        self.arriving = np.zeros(NUM_SLOTS, dtype=bool)
        self.arriving_dense: set[tuple[str, int]] = set()
        # Set once this process freezes or gives away slots: from then on every write and read re-checks
        # ownership under its table's lock (a request validated before a handover committed must not apply after).
        self.guarded = False
        self._dense_masks: dict[tuple[str, int, int, int], np.ndarray] = {}
        self.hold_s = 30.0  # longest a request waits for a handover (``hold``)

    # ---- the map ---------------------------------------------------------------------

    def set_map(self, new: SlotMap) -> None:
        """Adopt ``new`` (callers decided it may be adopted: a migration's record, an install, a restore)."""
        with self.cv:
            self.map = new
            self.accept_epoch = max(self.accept_epoch, new.epoch)
            self._dense_masks.clear()
            self.cv.notify_all()

    def check_install(self, new: SlotMap, dense: list[DenseSpec]) -> None:
        """Refuse a broadcast map that would change what this shard owns (only its migrations do: ``dense`` are
        its dense tensors), that belongs to another lineage, or that is older than the one it holds."""
        cur = self.map
        if cur.map_id and new.map_id != cur.map_id:
            raise WrongShard(f"shard {self.index}: a slot map of lineage {new.map_id!r} refused: this shard's is "
                             f"{cur.map_id!r} (another cluster?)")
        if new.epoch < cur.epoch:
            raise WrongShard(f"shard {self.index}: slot map epoch {new.epoch} is older than this shard's "
                             f"{cur.epoch}")
        gains, losses = cur.changes_of(new, self.index)
        if gains.size or losses.size or any(
                not np.array_equal(cur.dense_owned(d.name, d.rows, d.chunk_rows, self.index),
                                   new.dense_owned(d.name, d.rows, d.chunk_rows, self.index)) for d in dense):
            raise WrongShard(f"shard {self.index}: slot map epoch {new.epoch} would change what this shard owns "
                             f"({gains.size} slots gained, {losses.size} lost) outside a migration: refused")

    def announce(self, epoch: int) -> None:
        with self.cv:
            self.accept_epoch = max(self.accept_epoch, int(epoch))

    def check_request(self, index: int, num_shards: int, epoch: int, map_id: str) -> None:
        """A request's shard map: its index must be this shard's; its slot map not of another lineage nor from
        the future; a uniform map (epoch 0, no lineage) of another shard count is refused while this shard's map
        is uniform too (an address list of the wrong length)."""
        cur = self.map
        if index != self.index:
            raise WrongShard(f"request meant for shard {index} of {num_shards} reached shard {self.index} of "
                             f"{cur.num_shards}: the client's address list does not match the cluster (expected shard "
                             f"map: index {self.index}, {cur.num_shards} shards)")
        if map_id and cur.map_id and map_id != cur.map_id:
            raise WrongShard(f"request names slot map {map_id!r} (epoch {epoch}), but shard {self.index}'s map is "
                             f"{cur.map_id!r}: another cluster's map")
        if epoch > self.accept_epoch:
            raise WrongShard(f"request names slot map epoch {epoch}, but shard {self.index} knows epochs up to "
                             f"{self.accept_epoch} only: a map from the future (another cluster's, or made up)")
        if not map_id and epoch == 0 and not cur.map_id and num_shards and num_shards != cur.num_shards:
            raise WrongShard(
                f"request meant for shard {index} of {num_shards} reached shard {self.index} of {cur.num_shards}: the "
                f"client's address list does not match the cluster (expected shard map: index {self.index}, "
                f"{cur.num_shards} shards)")

    # ---- ownership ---------------------------------------------------------------------

    def owned(self, spec: Union[TableSpec, DenseSpec], ids: np.ndarray) -> np.ndarray:
        """Which ids of a table (rows of a dense tensor) this shard owns."""
        if isinstance(spec, DenseSpec):
            return self.dense_mask(spec)[ids]
        return self.map.owned(ids, self.index)

    def all_owned(self, spec: Union[TableSpec, DenseSpec], ids: np.ndarray, limit: Optional[int]) -> bool:
        """Whether every id of a table is in [0, ``limit``) (when given) and this shard's, in one compiled pass
        (``SlotMap.all_owned``); False for a dense tensor's rows, which ``owned`` checks."""
        return not isinstance(spec, DenseSpec) and self.map.all_owned(ids, self.index, limit)

    def dense_mask(self, spec: DenseSpec) -> np.ndarray:
        m = self.map
        key = (spec.name, spec.rows, spec.chunk_rows, m.epoch)
        mask = self._dense_masks.get(key)
        if mask is None:
            mask = self._dense_masks[key] = m.dense_owned(spec.name, spec.rows, spec.chunk_rows, self.index)
        return mask

    def expected_rows(self, spec: Union[TableSpec, DenseSpec]) -> int:
        """Rows this shard is expected to hold of a new table (sizes its arrays)."""
        if isinstance(spec, DenseSpec):
            return int(self.dense_mask(spec).sum())
        if spec.num_embeddings is None:
            return 1024
        share = max(1, int((self.map.owners == self.index).sum())) / NUM_SLOTS
        return int(spec.num_embeddings * share) + 1024

    def moved(self, spec: Union[TableSpec, DenseSpec], ids: np.ndarray) -> Exception:
        """The refusal of ``ids`` this shard does not own: ``Moved`` naming their owner when the map moved them."""
        m = self.map
        bad = ids[~self.owned(spec, ids)]
        first = int(bad[0]) if bad.size else -1
        if isinstance(spec, DenseSpec):
            owner = next((s for s, a, b in m.dense_ranges(spec.name, spec.rows, spec.chunk_rows) if a <= first < b), -1)
            what = f"row {first}"
        else:
            owner = int(m.owner_of(np.array([first], np.int64))[0])
            what = f"id {first} (hash slot {int(slot_of_ids(np.array([first], np.int64))[0])})"
        if m.epoch == 0 and not m.map_id:  # never resharded: a client with a wrong address list
            return WrongShard(f"{spec.name}: {what} is not owned by this shard (shard {self.index}; it belongs to "
                              f"shard {owner} of {m.num_shards})")
        address = m.addresses[owner] if 0 <= owner < len(m.addresses) else ""
        return Moved(f"{spec.name}: {what} is owned by shard {owner}{f' at {address}' if address else ''} as of slot "
                     f"map epoch {m.epoch}, not by shard {self.index}: refresh the slot map", address, m.epoch)

    # ---- handovers ---------------------------------------------------------------------

    def arriving_any(self) -> bool:
        return bool(self.arriving_dense) or bool(self.arriving.any())

    def blocked(self, spec: Union[TableSpec, DenseSpec], ids: np.ndarray, write: bool = True) -> str:
        """What a request on ``ids`` does now: "" go on; "wait" while a handover holds some of them (a write) or they
        are arriving here; "moved" when this shard does not own them all (and they are not arriving)."""
        owned = self.owned(spec, ids)
        held = self._in(spec, ids, self.frozen, self.frozen_dense) if write else np.zeros(ids.shape, bool)
        if not owned.all():
            arriving = self._in(spec, ids, self.arriving, self.arriving_dense)
            return "wait" if (owned | arriving).all() else "moved"
        return "wait" if held.any() else ""

    def _in(self, spec: Union[TableSpec, DenseSpec], ids: np.ndarray, slots: np.ndarray,
            chunks: set[tuple[str, int]]) -> np.ndarray:
        """Which ids lie in the marked ``slots`` (rows of a dense tensor: in the marked ``chunks``)."""
        if isinstance(spec, DenseSpec):
            if not chunks:
                return np.zeros(ids.shape, bool)
            width = spec.chunk_rows if 0 < spec.chunk_rows < spec.rows else spec.rows
            # A copy first (one C call under the GIL): handovers and arrivals change the set as pushes read it.
            marked = np.array([c for name, c in list(chunks) if name == spec.name], np.int64)
            return np.isin(ids // width, marked)
        if not slots.any():
            return np.zeros(ids.shape, bool)
        return slots[slot_of_ids(ids)]

    def wait_for(self, spec: Union[TableSpec, DenseSpec], ids: np.ndarray, write: bool, what: str) -> None:
        """Wait (no table lock held) while a handover or an arrival holds some of ``ids`` (``blocked`` says "wait");
        Unavailable after ``hold_s``."""
        self.before_wait()
        deadline = time.monotonic() + self.hold_s
        with self.cv:
            while self.blocked(spec, ids, write) == "wait":
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Unavailable(f"shard {self.index}: {what} waited {self.hold_s:.0f} s for a slot migration "
                                      "to finish; retry")
                self.cv.wait(min(left, 0.5))

    def changed(self) -> None:
        """Wake the requests a handover held (it committed, or was given up)."""
        with self.cv:
            self.cv.notify_all()


def _owning_nothing(index: int, num_shards: int) -> SlotMap:
    """The map a joining shard starts with: every slot elsewhere (shard 0's), until the driver installs the
    cluster's map; dense tensors spread over the others."""
    others = [s for s in range(num_shards) if s != index] or [0]
    return SlotMap(0, np.full(NUM_SLOTS, others[0], np.int16), 1, num_shards, dense_shards=others, map_id="")
