"""Hash slots and the slot map: which shard owns each id and each dense row chunk.

An id's slot is the top 14 bits of its routing hash (``routing.slot_of_ids``): 16,384 slots, as Redis Cluster
has. A ``SlotMap`` gives each slot its owner and carries an epoch that grows with every change; shards move slots
between them while training runs (``shardps.server.shard.migration``, ``shardps reshard``), and clients route by
the newest map they know, refreshed when a shard answers that a slot moved.

The map of a cluster that never moved a slot is the *uniform* map of its shard count (epoch 0), which routes
exactly as ``routing.shard_of_ids`` always did: with a power-of-two count every slot lies within one shard; with
another count (3, 5, 6, ...) the few slots that straddle two shards' hash ranges are *split* (owner -1): their
ids go where the multiply-shift of ``base`` shards puts them. A migration moves a split slot whole, so old data
directories, checkpoints and cluster files keep their meaning. Dense tensors' row chunks keep their modulo
placement (``routing.dense_chunk_owner``: chunk k of a tensor on shard (hash(name) + k) mod n) over the map's
``dense_shards`` (at first: every shard), unless the map names another owner for a chunk.

Shard indices never change meaning: an added shard takes the next index, a removed one keeps its index and owns
nothing (``num_shards`` counts every index the map has had). ``map_id`` names the map's lineage (empty for a
uniform map never changed): a request naming another is refused.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from shardps.core import kernels
from shardps.core.routing import NUM_SLOTS, ROUTING_SEED, mix64, name_hash

MAX_SHARDS = 4096
_SPLIT = -1


def uniform_owners(n: int) -> np.ndarray:
    """Owner of each slot under ``routing.shard_of_ids`` with ``n`` shards; -1 where a slot straddles two."""
    slot = np.arange(NUM_SLOTS, dtype=np.uint64)
    first = ((slot << np.uint64(18)) * np.uint64(n)) >> np.uint64(32)
    last = ((((slot + np.uint64(1)) << np.uint64(18)) - np.uint64(1)) * np.uint64(n)) >> np.uint64(32)
    return np.where(first == last, first.astype(np.int64), _SPLIT).astype(np.int16)


class SlotMap:
    """The owner of every hash slot (and of moved dense chunks), with the map's epoch; immutable (``moved`` and
    ``with_addresses`` return new maps).

    Args:
        epoch: 0 for a uniform map never changed; +1 per committed move.
        owners: int16 [NUM_SLOTS]: the owning shard of each slot, -1 for a split one.
        base: the shard count split slots and unmoved dense chunks are placed by.
        num_shards: shard indices the map knows (owners lie in [0, num_shards)).
        dense: dense tensor name -> {chunk: owner} for chunks moved off their modulo place.
        dense_shards: the shards a dense tensor's chunks are spread over by default (None: shards 0..base-1).
        addresses: each shard index's address ("" where unknown; a replica group's members joined by "|").
        map_id: the map's lineage ("" until the first move).
    """

    __slots__ = ("epoch", "owners", "base", "num_shards", "dense", "dense_shards", "addresses", "map_id")

    def __init__(self, epoch: int, owners: np.ndarray, base: int, num_shards: int,
                 dense: Optional[dict[str, dict[int, int]]] = None, addresses: Sequence[str] = (),
                 map_id: str = "", dense_shards: Optional[Sequence[int]] = None) -> None:
        owners = np.ascontiguousarray(owners, dtype=np.int16)
        if owners.shape != (NUM_SLOTS,):
            raise ValueError(f"a slot map has {NUM_SLOTS} owners, got {owners.shape}")
        if not 1 <= base <= num_shards <= MAX_SHARDS:
            raise ValueError(f"a slot map needs 1 <= base ({base}) <= num_shards ({num_shards}) <= {MAX_SHARDS}")
        if owners.size and (int(owners.max()) >= num_shards or int(owners.min()) < _SPLIT):
            raise ValueError(f"slot owners must lie in [-1, {num_shards})")
        owners.setflags(write=False)
        self.epoch = int(epoch)
        self.owners = owners
        self.base = int(base)
        self.num_shards = int(num_shards)
        self.dense = {k: dict(v) for k, v in (dense or {}).items()}
        self.dense_shards = tuple(int(x) for x in (range(base) if dense_shards is None else dense_shards))
        if not self.dense_shards or any(not 0 <= x < num_shards for x in self.dense_shards):
            raise ValueError(f"dense_shards must be shards in [0, {num_shards}), got {list(self.dense_shards)}")
        self.addresses = tuple(addresses) + ("",) * (num_shards - len(addresses))
        self.map_id = map_id
        if len(self.addresses) != num_shards:
            raise ValueError(f"a slot map of {num_shards} shards got {len(addresses)} addresses")
        for name, chunks in self.dense.items():
            if any(not 0 <= o < num_shards for o in chunks.values()):
                raise ValueError(f"dense tensor {name!r}: chunk owners must lie in [0, {num_shards})")

    @classmethod
    def uniform(cls, n: int, addresses: Sequence[str] = ()) -> SlotMap:
        """The map of ``n`` shards that never moved a slot: ``routing.shard_of_ids``'s placement, epoch 0."""
        if not 1 <= n <= MAX_SHARDS:
            raise ValueError(f"num_shards must be in [1, {MAX_SHARDS}], got {n}")
        return cls(0, uniform_owners(n), n, n, addresses=addresses)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlotMap) and self.key() == other.key() and self.addresses == other.addresses

    def __repr__(self) -> str:
        counts = self.slot_counts()
        return (f"SlotMap(epoch={self.epoch}, shards={self.num_shards}, slots={counts.tolist()}, "
                f"split={int((self.owners == _SPLIT).sum())}, map_id={self.map_id!r})")

    def key(self) -> tuple:
        """What decides placement (not the addresses)."""
        return (self.epoch, self.owners.tobytes(), self.base, self.num_shards,
                tuple(sorted((k, tuple(sorted(v.items()))) for k, v in self.dense.items())), self.dense_shards,
                self.map_id)

    # ---- placement of ids -------------------------------------------------------------

    def owner_of(self, ids: np.ndarray) -> np.ndarray:
        """The owning shard of each id (int64, same shape)."""
        ids = np.asarray(ids)
        k = kernels.jit()
        if k is not None and ids.dtype == np.int64:
            return k.owner_by_map(ids.reshape(-1), self.owners, self.base, ROUTING_SEED).reshape(ids.shape)
        return self.owner_of_numpy(ids)

    def owner_of_numpy(self, ids: np.ndarray) -> np.ndarray:
        """The reference of ``owner_of`` (and of its kernel)."""
        z = mix64(ids)
        out = self.owners[(z >> np.uint64(50)).astype(np.int64)].astype(np.int64)
        split = out < 0
        if split.any():
            hi = z[split] >> np.uint64(32)
            out[split] = ((hi * np.uint64(self.base)) >> np.uint64(32)).astype(np.int64)
        return out

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Group a 1-D id array by owner: ``ids[order[bounds[s]:bounds[s+1]]]`` are shard ``s``'s, in order."""
        k = kernels.jit()
        if k is not None and ids.dtype == np.int64 and ids.ndim == 1:
            return k.split_by_map(ids, self.owners, self.base, self.num_shards, ROUTING_SEED)
        owner = self.owner_of_numpy(ids)
        order = np.argsort(owner, kind="stable")
        return order, np.searchsorted(owner[order], np.arange(self.num_shards + 1))

    def owned(self, ids: np.ndarray, shard: int) -> np.ndarray:
        """Which ids shard ``shard`` owns."""
        return self.owner_of(ids) == shard

    def all_owned(self, ids: np.ndarray, shard: int, limit: Optional[int] = None) -> bool:
        """Whether every id of a 1-D array is in [0, ``limit``) (when given) and owned by shard ``shard``: a
        request's ids checked in one compiled pass (the kernel stops at the first that is not), else by the
        reference below."""
        k = kernels.jit()
        if k is not None and ids.dtype == np.int64 and ids.ndim == 1:
            return bool(k.all_owned(ids, -1 if limit is None else limit, self.owners, self.base, ROUTING_SEED, shard))
        return self.all_owned_numpy(ids, shard, limit)

    def all_owned_numpy(self, ids: np.ndarray, shard: int, limit: Optional[int] = None) -> bool:
        """The reference of ``all_owned`` (and of its kernel)."""
        if limit is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            return False
        return bool(self.owned(ids, shard).all())

    def slot_counts(self) -> np.ndarray:
        """Whole slots each shard owns (split slots counted apart)."""
        whole = self.owners[self.owners >= 0]
        return np.bincount(whole.astype(np.int64), minlength=self.num_shards)

    def slots_of(self, shard: int) -> np.ndarray:
        """The slots shard ``shard`` owns whole."""
        return np.flatnonzero(self.owners == shard)

    def split_slots(self) -> np.ndarray:
        """Slots split between two shards (a uniform map of a count that is not a power of two)."""
        return np.flatnonzero(self.owners == _SPLIT)

    def split_owners(self, slot: int) -> tuple[int, int]:
        """The two shards a split slot's ids go to (the lower hashes', the higher hashes')."""
        lo = (slot << 18) * self.base >> 32
        hi = (((slot + 1) << 18) - 1) * self.base >> 32
        return lo, hi

    def active(self) -> list[int]:
        """Shards that own a slot (whole or split), take new dense chunks, or own a moved one."""
        have = set(np.unique(self.owners[self.owners >= 0]).tolist()) | set(self.dense_shards)
        for slot in self.split_slots().tolist():
            have.update(self.split_owners(slot))
        for chunks in self.dense.values():
            have.update(chunks.values())
        return sorted(have)

    # ---- placement of dense row chunks ----------------------------------------------------

    def dense_owner(self, name: str, chunk: int, _hash: Optional[int] = None) -> int:
        moved = self.dense.get(name)
        if moved is not None and chunk in moved:
            return moved[chunk]
        spread = self.dense_shards
        return spread[((name_hash(name) if _hash is None else _hash) + chunk) % len(spread)]

    def dense_ranges(self, name: str, num_rows: int, chunk_rows: int) -> list[tuple[int, int, int]]:
        """Rows [0, num_rows) of a dense tensor as (shard, start, end) chunks (``chunk_rows`` 0: one chunk)."""
        h = name_hash(name)
        if chunk_rows <= 0 or chunk_rows >= num_rows:
            return [(self.dense_owner(name, 0, h), 0, num_rows)]
        return [(self.dense_owner(name, k, h), start, min(start + chunk_rows, num_rows))
                for k, start in enumerate(range(0, num_rows, chunk_rows))]

    def dense_owned(self, name: str, num_rows: int, chunk_rows: int, shard: int) -> np.ndarray:
        """Boolean mask over rows [0, num_rows): True where ``shard`` owns the row."""
        mask = np.zeros(num_rows, dtype=bool)
        for s, start, end in self.dense_ranges(name, num_rows, chunk_rows):
            if s == shard:
                mask[start:end] = True
        return mask

    # ---- changes ----------------------------------------------------------------------

    def moved(self, slots: Iterable[int], target: int, dense: Iterable[tuple[str, int]] = (),
              epoch: Optional[int] = None) -> SlotMap:
        """This map with ``slots`` (and the dense chunks ``(name, chunk)``) owned by ``target``, at ``epoch``
        (default: the next)."""
        owners = self.owners.copy()
        owners[np.asarray(list(slots), dtype=np.int64)] = target
        moved = {k: dict(v) for k, v in self.dense.items()}
        for name, chunk in dense:
            moved.setdefault(name, {})[int(chunk)] = target
        return self._with(epoch=self.epoch + 1 if epoch is None else epoch, owners=owners, dense=moved,
                          map_id=self.map_id or uuid.uuid4().hex[:16])

    def with_addresses(self, addresses: Sequence[str]) -> SlotMap:
        """The same placement, with these addresses (more indices: the map grows, owning nothing there yet)."""
        return self._with(num_shards=max(self.num_shards, len(addresses)), addresses=tuple(addresses))

    def with_dense(self, dense: dict[str, dict[int, int]], dense_shards: Sequence[int]) -> SlotMap:
        """The same owners of every chunk named in ``dense`` (pinned where they are), new dense tensors spread over
        ``dense_shards``: placement of existing chunks unchanged, so no new epoch is needed."""
        return self._with(dense=dense, dense_shards=tuple(dense_shards))

    def _with(self, **changes: Any) -> SlotMap:
        fields: dict[str, Any] = dict(epoch=self.epoch, owners=self.owners, base=self.base, num_shards=self.num_shards,
                      dense=self.dense, addresses=self.addresses, map_id=self.map_id, dense_shards=self.dense_shards)
        fields.update(changes)
        return SlotMap(**fields)

    def holds(self, shard: int) -> np.ndarray:
        """Boolean mask over slots: where ``shard`` owns the slot, whole or the part of a split one."""
        mine = self.owners == shard
        for slot in self.split_slots().tolist():
            if shard in self.split_owners(slot):
                mine[slot] = True
        return mine

    def changes_of(self, other: SlotMap, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """(slots ``shard`` gains, slots it loses) from this map to ``other`` (part of a split slot counts)."""
        mine, theirs = self.holds(shard), other.holds(shard)
        return np.flatnonzero(theirs & ~mine), np.flatnonzero(mine & ~theirs)

    # ---- forms ------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "map_id": self.map_id, "base": self.base, "num_shards": self.num_shards,
                "owners": _runs(self.owners), "dense": {k: {str(c): o for c, o in v.items()}
                                                        for k, v in self.dense.items()},
                "dense_shards": list(self.dense_shards), "addresses": list(self.addresses)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SlotMap:
        try:
            return cls(int(d["epoch"]), _unruns(d["owners"]), int(d["base"]), int(d["num_shards"]),
                       {k: {int(c): int(o) for c, o in v.items()} for k, v in d.get("dense", {}).items()},
                       [str(a) for a in d.get("addresses", [])], str(d.get("map_id", "")),
                       d.get("dense_shards"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a slot map: {e}") from None


def _runs(owners: np.ndarray) -> list[list[int]]:
    """Owners as [first slot, owner] runs (a few dozen entries instead of 16,384)."""
    starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
    return [[int(s), int(owners[s])] for s in starts]


def _unruns(runs: list[list[int]]) -> np.ndarray:
    owners = np.empty(NUM_SLOTS, np.int16)
    starts = [int(r[0]) for r in runs]
    if not starts or starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= NUM_SLOTS:
        raise ValueError("owner runs must start at slot 0 and rise")
    for (start, owner), end in zip(runs, [*starts[1:], NUM_SLOTS]):
        owners[start:end] = int(owner)
    return owners
