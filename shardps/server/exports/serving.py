"""A serving shard: an export's base loaded read-only, its deltas applied as they appear.

``shardps serve --serve-from DIR`` makes the shard read-only (``Shard.read_only``: pushes,
table changes, checkpoints and exports are refused with FAILED_PRECONDITION) and starts a
``Follower``. The follower loads the newest valid base of DIR and the deltas after it,
then polls for the next generation. Each delta is read and verified (checksums, shapes,
ownership, sequence) before anything changes; it is then applied with the registry lock
and every table lock held, so a pull sees the state before or after a delta, never half
of one. A delta that is truncated, corrupt or out of sequence is refused (the error
names the file and shows in ``shardps stats``) and the shard goes on serving the last
good state; a newer base (a compaction, or a fresh export) replaces everything at once,
which is also how a replica that fell behind a pruned delta catches up.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from shardps.core.errors import ShardError
from shardps.core.exports import CorruptExport, generations, load_shard_file, read_manifest, spec_from_entry
from shardps.core.slots import SlotMap
from shardps.server.storage.table import Table
from shardps.v1 import shardps_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class ServingState:
    """What a serving shard serves (``shardps stats`` shows it)."""

    directory: str
    base: int = 0
    delta: int = 0
    versions: list[int] = field(default_factory=list)
    applied_at: float = 0.0  # time.monotonic() of the last base or delta applied
    error: str = ""
    deltas_applied: int = 0
    last_apply_s: float = 0.0

    def to_pb(self) -> pb.ServingInfo:
        return pb.ServingInfo(directory=self.directory, base=self.base, delta=self.delta,
                              applied_age_s=time.monotonic() - self.applied_at, error=self.error,
                              deltas_applied=self.deltas_applied, last_apply_s=self.last_apply_s)


class ServeMismatch(Exception):
    """The export was written for another shard map (reshard it with ``shardps compact --shards``)."""


@dataclass
class _Change:
    """One table's part of a verified generation, ready to apply."""

    name: str
    table: Optional[Table] = None  # a whole new table (base, or a table copied whole)
    tombstones: Optional[np.ndarray] = None
    ids: Optional[np.ndarray] = None
    values: Optional[np.ndarray] = None


class Follower:
    """Loads an export into a read-only shard and follows its deltas (see the module docstring)."""

    def __init__(self, shard: Any, root: pathlib.Path) -> None:
        self.shard = shard
        self.root = root
        self.state = ServingState(str(root))
        self.current = -1  # the generation served
        self._lock = threading.Lock()  # one poll at a time
        shard.serving = self.state

    # ---- reading ---------------------------------------------------------------------------

    def _check_map(self, m: dict[str, Any], path: pathlib.Path) -> None:
        n, s = m["num_shards"], self.shard
        if n != s.num_shards:
            raise ServeMismatch(
                f"{path} was written by a cluster of {n} shards, but this shard is {s.index} of {s.num_shards}: serve "
                f"it with {n} shards, or reshard it first: shardps compact {self.root} --to NEW_DIR --shards {s.num_shards}")
        if m.get("slot_map"):  # written by a cluster that moved slots: its rows lie where that map put them
            try:
                cut_map = SlotMap.from_json(m["slot_map"])
            except ValueError as e:
                raise CorruptExport(f"{path}: {e}") from None
            if cut_map.key() != s.slots.map.key():
                s.slots.set_map(cut_map)

    def _table(self, entry: dict[str, Any], arrays: dict[str, np.ndarray], path: str, seq: int) -> Table:
        spec = spec_from_entry(entry)
        owns, expected = self.shard.ownership(spec)
        t = self.shard.registry.build(spec, owns, max(expected if entry["kind"] == "dense" else 0, arrays["ids"].shape[0]),
                                      tier_key=f"{spec.name}@{seq}")
        t.read_only = True
        self._verify(t, arrays["ids"], arrays["values"], path)
        if arrays["ids"].size:
            t.assign_rows(arrays["ids"], arrays["values"], 0, 0, evict=False)
        return t

    def _owned(self, t: Table, ids: np.ndarray, path: str) -> None:
        if ids.size:
            try:
                t.check_ids(ids)
            except ShardError as e:
                raise CorruptExport(f"{path}: {e}") from None

    def _verify(self, t: Table, ids: np.ndarray, values: np.ndarray, path: str) -> None:
        """Rows a file gives ``t``: every id this shard's, every value finite."""
        self._owned(t, ids, path)
        if not np.isfinite(values).all():
            raise CorruptExport(f"{path}: values contain NaN or Inf")

    def _read(self, seq: int, kind: str, path: pathlib.Path) -> tuple[dict[str, Any], list[_Change]]:
        """A generation read and verified for this shard, nothing applied yet."""
        m = read_manifest(path)
        if m["seq"] != seq or m["kind"] != kind:
            raise CorruptExport(f"{path}: its manifest says {m['kind']} {m['seq']}")
        self._check_map(m, path)
        i = self.shard.index
        if kind == "delta":
            if m["previous"] != self.current:
                raise CorruptExport(f"{path}: delta {seq} follows generation {m['previous']}, but this shard serves "
                                    f"generation {self.current}: out of sequence, refused")
            if m["since"] is None or int(m["since"][i]) != self.state.versions[i]:
                raise CorruptExport(f"{path}: delta {seq} starts at version {m['since'] and m['since'][i]} of shard "
                                    f"{i}, but the state served is at version {self.state.versions[i]}: out of sequence, "
                                    f"refused")
        changes = [_Change(name) for name in m.get("dropped", [])]
        for entry in m["tables"]:
            arrays = load_shard_file(self.root, entry, i)
            part = entry["shards"][i]
            where = str(self.root / part["file"])
            existing = self.shard.registry.lookup(entry["name"])
            if kind == "base" or part.get("full", entry["full"]) or existing is None:
                changes.append(_Change(entry["name"], table=self._table(entry, arrays, where, seq)))
                continue
            spec = spec_from_entry(entry)
            if existing.spec != spec:
                raise CorruptExport(f"{where}: table {spec.name!r} changed its spec without being copied whole")
            tomb = arrays.get("tombstones", np.zeros(0, np.int64))
            self._owned(existing, tomb, where)
            self._verify(existing, arrays["ids"], arrays["values"], where)
            changes.append(_Change(entry["name"], tombstones=np.unique(tomb), ids=arrays["ids"],
                                   values=arrays["values"]))
        return m, changes

    # ---- applying --------------------------------------------------------------------------

    def _apply(self, m: dict[str, Any], changes: list[_Change], whole: bool) -> None:
        """Apply a verified generation at once: every affected table locked (``whole``: replace everything)."""
        registry = self.shard.registry
        with registry.lock:
            old = registry.tables() if whole else [registry.lookup(c.name) for c in changes]
            held = [t for t in old if t is not None]
            for t in held:
                t.lock.acquire()
            try:
                if whole:
                    registry._tables.clear()
                for c in changes:
                    if c.table is not None:
                        registry.put(c.table)
                    elif c.ids is None:
                        registry.pop(c.name)
                    else:
                        t = registry.lookup(c.name)
                        assert t is not None and c.tombstones is not None and c.values is not None
                        present = c.tombstones[t.index.lookup(c.tombstones) >= 0]
                        t.remove(present, 0)
                        if c.ids.size:
                            t.assign_rows(c.ids, c.values, 0, 0, evict=False)
                self.shard.updates.version = int(m["versions"][self.shard.index]) if m["versions"] else 0
                for t in held:  # replaced or dropped tables give their memory back
                    if registry.lookup(t.spec.name) is not t:
                        t.release()
            finally:
                for t in held:
                    t.lock.release()
        self.current = m["seq"]
        st = self.state
        st.versions = [int(v) for v in m["versions"]]
        if m["kind"] == "base":
            st.base = st.delta = m["seq"]
        else:
            st.delta = m["seq"]
            st.deltas_applied += 1
        st.applied_at = time.monotonic()
        st.error = ""

    def load(self) -> None:
        """Start: the newest valid base and every delta after it (CorruptExport, ServeMismatch: no start)."""
        bases = [g for g in generations(self.root) if g[1] == "base"]
        if not bases:
            raise CorruptExport(f"{self.root}: no base to serve (export one with `shardps export --out {self.root}`)")
        errors = []
        for seq, kind, path in reversed(bases):
            try:
                m, changes = self._read(seq, kind, path)
            except CorruptExport as e:
                errors.append(str(e))
                log.error("shard %d: skipping base %s: %s", self.shard.index, path.name, e)
                continue
            self._apply(m, changes, whole=True)
            break
        else:
            raise CorruptExport(f"{self.root}: no valid base: " + "; ".join(errors))
        while self.poll():
            pass
        log.info("shard %d: serving %s base %d delta %d (version %d)", self.shard.index, self.root, self.state.base,
                 self.state.delta, self.shard.version)

    def poll(self) -> bool:
        """Apply the next generation if there is one; True if something was applied. A refused generation is
        recorded in ``state.error`` (logged once) and the state served stays as it was."""
        with self._lock:
            try:
                return self._poll()
            except (CorruptExport, ServeMismatch, ShardError, OSError) as e:
                message = str(e)
                if message != self.state.error:
                    log.error("shard %d: %s (serving generation %d still)", self.shard.index, message, self.current)
                self.state.error = message
                return False

    def _poll(self) -> bool:
        later = [g for g in generations(self.root) if g[0] > self.current]
        if not later:
            return False
        t0 = time.perf_counter()
        nxt = later[0]
        bases = [g for g in later if g[1] == "base"]
        if nxt[0] != self.current + 1 or nxt[1] == "base":
            if not bases:
                raise CorruptExport(f"{nxt[2]}: generation {nxt[0]} out of sequence: generation {self.current + 1} "
                                    f"is missing (serving {self.current}), and no newer base to reload from")
            seq, kind, path = bases[-1]
            m, changes = self._read(seq, kind, path)
            self._apply(m, changes, whole=True)
        else:
            m, changes = self._read(*nxt)
            self._apply(m, changes, whole=False)
        self.state.last_apply_s = time.perf_counter() - t0
        log.info("shard %d: applied %s %d in %.3fs (version %d)", self.shard.index, m["kind"], m["seq"],
                 self.state.last_apply_s, self.shard.version)
        return True
