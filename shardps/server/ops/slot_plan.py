"""What ``shardps reshard`` moves, as pure functions of the slot map: which slots and dense chunks go from which shard
to which, in batches, so that every shard of the new set owns an equal share and as little as possible moves.

- A split slot (a uniform map of a shard count that is not a power of two) moves whole to one of the two shards
  that share it first: to the one that stays, or the lower one.
- Then every shard of ``active`` gets ``NUM_SLOTS / len(active)`` slots (the first few one more): shards over
  their share, and shards leaving (not in ``active``), give their surplus to those under it, each shard's highest
  slots first.
- Dense tensors' row chunks go where the modulo placement over ``active`` puts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardps.core.routing import NUM_SLOTS, name_hash
from shardps.core.slots import SlotMap


@dataclass
class Step:
    """One batch: ``slots`` (and dense ``chunks``) from ``source`` to ``target``."""

    source: int
    target: int
    slots: list[int] = field(default_factory=list)
    chunks: list[tuple[str, int]] = field(default_factory=list)

    def describe(self) -> str:
        what = f"{len(self.slots)} slots" if self.slots else ""
        if self.chunks:
            what += (", " if what else "") + f"{len(self.chunks)} dense chunks"
        return f"{what} from shard {self.source} to shard {self.target}"


def quotas(active: list[int]) -> dict[int, int]:
    """Slots each shard of ``active`` owns when balanced."""
    a = sorted(active)
    base, extra = divmod(NUM_SLOTS, len(a))
    return {s: base + (1 if k < extra else 0) for k, s in enumerate(a)}


def plan(cur: SlotMap, active: list[int], batch_slots: int,
         dense: dict[str, tuple[int, int]]) -> list[Step]:
    """The batches that take ``cur`` to a balanced map over ``active`` (``dense``: name -> (rows, chunk_rows) of
    every dense tensor)."""
    if not active:
        raise ValueError("resharding needs at least one shard to own the slots")
    steps: list[Step] = []
    owners = cur.owners.astype(np.int64)
    # 1. split slots, whole to the part owner that stays (the lower one when both do, or neither)
    pairs: dict[tuple[int, int], list[int]] = {}
    for slot in cur.split_slots().tolist():
        lo, hi = cur.split_owners(slot)
        keep = hi if (lo not in active and hi in active) else lo
        give = hi if keep == lo else lo
        pairs.setdefault((give, keep), []).append(slot)
        owners[slot] = keep
    steps += _batched(pairs, batch_slots)
    # 2. balance whole slots
    want = quotas(active)
    held = {s: list(np.flatnonzero(owners == s)) for s in range(cur.num_shards)}
    surplus: list[tuple[int, int]] = []  # (slot, from)
    for s in range(cur.num_shards):
        keep = want.get(s, 0)
        mine = held.get(s, [])
        for slot in mine[keep:] if keep < len(mine) else []:
            surplus.append((int(slot), s))
    pairs = {}
    it = iter(surplus)
    for s in sorted(active):
        need = want[s] - len(held.get(s, []))
        for _ in range(max(0, need)):
            slot, src = next(it)
            pairs.setdefault((src, s), []).append(slot)
    steps += _batched(pairs, batch_slots)
    # 3. dense chunks
    a = sorted(active)
    chunk_pairs: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for name, (rows, chunk_rows) in sorted(dense.items()):
        n_chunks = 1 if chunk_rows <= 0 or chunk_rows >= rows else -(-rows // chunk_rows)
        h = name_hash(name)
        for k in range(n_chunks):
            now, then = cur.dense_owner(name, k, h), a[(h + k) % len(a)]
            if now != then:
                chunk_pairs.setdefault((now, then), []).append((name, k))
    for (src, dst), chunks in sorted(chunk_pairs.items()):
        for lo in range(0, len(chunks), max(1, batch_slots)):
            steps.append(Step(src, dst, [], chunks[lo:lo + max(1, batch_slots)]))
    return steps


def _batched(pairs: dict[tuple[int, int], list[int]], batch_slots: int) -> list[Step]:
    out = []
    for (src, dst), slots in sorted(pairs.items()):
        slots = sorted(slots)
        for lo in range(0, len(slots), max(1, batch_slots)):
            out.append(Step(src, dst, slots[lo:lo + max(1, batch_slots)]))
    return out


def pinned(cur: SlotMap, dense: dict[str, tuple[int, int]], active: list[int]) -> SlotMap:
    """``cur`` with every existing dense chunk's owner named (pinned where it is), and new dense tensors spread over
    ``active``: the same placement, so no move; dense chunks then move one by one."""
    moved = {k: dict(v) for k, v in cur.dense.items()}
    for name, (rows, chunk_rows) in dense.items():
        n_chunks = 1 if chunk_rows <= 0 or chunk_rows >= rows else -(-rows // chunk_rows)
        h = name_hash(name)
        moved[name] = {k: cur.dense_owner(name, k, h) for k in range(n_chunks)}
    return cur.with_dense(moved, sorted(active))
