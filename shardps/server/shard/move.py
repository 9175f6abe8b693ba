"""A slot migration's unit (``Move``: a batch of hash slots and dense chunks from one shard to another, with the
map once it commits), the checks a shard makes of one, and of the rows sent with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardps.core.errors import InvalidArgument
from shardps.core.routing import NUM_SLOTS
from shardps.core.slots import SlotMap
from shardps.core.specs import DenseSpec
from shardps.server.storage import moves
from shardps.server.storage.table import Table


@dataclass(frozen=True)
class Move:
    """A batch of hash slots (and dense chunks) moving from ``source`` to ``target``; ``new_map``: the slot map once
    it commits (its epoch is the move's)."""

    id: str
    source: int
    target: int
    slots: np.ndarray
    dense: tuple[tuple[str, int], ...]
    new_map: SlotMap

    @property
    def epoch(self) -> int:
        return self.new_map.epoch

    def mask(self) -> np.ndarray:
        m = np.zeros(NUM_SLOTS, bool)
        m[self.slots] = True
        return m

    def selection(self, t: Table) -> moves.Selection:
        """The rows of ``t`` the move takes."""
        rows = None
        if isinstance(t.spec, DenseSpec):
            spec = t.spec
            rows = np.zeros(spec.rows, bool)
            width = spec.chunk_rows if 0 < spec.chunk_rows < spec.rows else spec.rows
            for name, chunk in self.dense:
                if name == spec.name:
                    rows[chunk * width:(chunk + 1) * width] = True
        return moves.Selection(self.mask(), rows)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "target": self.target, "slots": self.slots.tolist(),
                "dense": [list(d) for d in self.dense], "map": self.new_map.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Move:
        try:
            slots = np.unique(np.asarray(d["slots"], np.int64))
            if slots.size and (slots[0] < 0 or slots[-1] >= NUM_SLOTS):
                raise ValueError(f"slots must lie in [0, {NUM_SLOTS})")
            return cls(str(d["id"]), int(d["source"]), int(d["target"]), slots,
                       tuple((str(n), int(c)) for n, c in d.get("dense", [])), SlotMap.from_json(d["map"]))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"not a slot migration: {e}") from None


def check_move(move: Move, side: str, cur: SlotMap, idx: int, tables: list[Table], moving: list[Move]) -> None:
    """Refuse a move this shard (``idx``, its map ``cur``) cannot take part in as ``side`` ("source" or
    "target"): another shard's, another lineage's, not the next epoch, a new map that is not the move applied to
    ``cur``; on the source, slots or chunks it does not own, a split slot going to a third shard, synchronous
    tables, slots ``moving`` already."""
    me, other = (move.source, move.target) if side == "source" else (move.target, move.source)
    if me != idx or other == idx:
        raise InvalidArgument(f"migration {move.id}: shard {idx} is not its {side} (it moves slots from shard "
                              f"{move.source} to {move.target})")
    if cur.map_id and move.new_map.map_id != cur.map_id:
        raise InvalidArgument(f"migration {move.id}: its map is of lineage {move.new_map.map_id!r}, this shard's "
                              f"{cur.map_id!r}")
    if move.epoch != cur.epoch + 1:
        raise InvalidArgument(f"migration {move.id} makes slot map epoch {move.epoch}, but shard {idx} is at "
                              f"epoch {cur.epoch}: install the current map first")
    expected = cur.moved(move.slots, move.target, move.dense, move.epoch)
    new = move.new_map
    if not (np.array_equal(expected.owners, new.owners) and expected.dense == new.dense
            and expected.dense_shards == new.dense_shards and expected.base == new.base):
        raise InvalidArgument(f"migration {move.id}: its new map is not shard {idx}'s map with the moved slots "
                              "given to the target")
    if side == "source":
        holds = cur.holds(idx)
        if not holds[move.slots].all():
            bad = int(move.slots[~holds[move.slots]][0])
            raise InvalidArgument(f"migration {move.id}: shard {idx} does not own slot {bad}")
        for slot in move.slots[cur.owners[move.slots] < 0].tolist():  # a split slot goes to its other owner
            if move.target not in cur.split_owners(slot):
                raise InvalidArgument(f"migration {move.id}: slot {slot} is split between shards "
                                      f"{cur.split_owners(slot)}; it moves whole to the other one first")
        for name, chunk in move.dense:
            if cur.dense_owner(name, chunk) != idx:
                raise InvalidArgument(f"migration {move.id}: shard {idx} does not own chunk {chunk} of {name!r}")
        if any(t.spec.sync is not None for t in tables):
            raise InvalidArgument(f"shard {idx} has synchronous tables: their steps cannot move while training "
                                  "runs; reshard them offline (`shardps reshard --from DIR --to DIR`)")
        busy = [m.id for m in moving if (m.mask() & move.mask()).any()]
        if busy:
            raise InvalidArgument(f"migration {move.id}: its slots are moving already ({busy[0]})")


def check_arrays(t: Table, ids: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
    """Rows sent for ``t``: unique int64 ids, and one entry per id of every array a row holds, of its dtype and
    width, finite values."""
    n = ids.shape[0] if ids.ndim == 1 else -1
    if ids.dtype != np.int64 or n < 0 or np.unique(ids).shape[0] != n:
        raise InvalidArgument(f"{t.spec.name}: moved rows need unique int64 ids")
    want = {"rows": (np.float32, (n, t.dim)), "steps": (np.int32, (n,)), "meta.last_time": (np.uint32, (n,)),
            "meta.touches": (np.int32, (n,))}
    want.update({"state." + k: (np.float32, (n, t.dim)) for k in t.store.state})
    if set(arrays) != set(want):
        raise InvalidArgument(f"{t.spec.name}: moved rows carry {sorted(arrays)}, expected {sorted(want)}")
    for k, (dtype, shape) in want.items():
        a = arrays[k]
        if a.dtype != dtype or a.shape != shape:
            raise InvalidArgument(f"{t.spec.name}: moved rows' {k} is {a.dtype}{list(a.shape)}, expected "
                                  f"{np.dtype(dtype)}{list(shape)}")
    if not np.isfinite(arrays["rows"]).all():
        raise InvalidArgument(f"{t.spec.name}: moved rows hold NaN or Inf")
    if t.num_embeddings is not None and n and (ids.min() < 0 or ids.max() >= t.num_embeddings):
        raise InvalidArgument(f"{t.spec.name}: moved row ids outside [0, {t.num_embeddings})")
