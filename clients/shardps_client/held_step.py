"""A held step's row pushes, kept as they were made and planned when the step's pushes are sent.

While a ``PushHold`` is held (``ShardedOptimizer``), a table pushed more than once in one step (a module called twice
in a forward, a collection over two batches in one loss) must take one optimizer step with the sum of its gradients,
as ``torch.optim`` takes the sum autograd accumulated: each push applied alone is a step of its own, which Adagrad,
Adam and momentum tell apart from one step of the sum. So the rows wait here, unplanned (no sequence number taken),
and ``Session.plan_held`` plans them before anything sends the held pushes or a pull must see them: a table pushed
once goes as it came (a collection's tables in one planned push, as ``push_stacked`` plans them), one pushed more
than once once, its rows' gradients summed.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from shardps.core.ids import coalesce
from shardps.core.specs import TableSpec
from shardps_client.versions import Versions


@dataclass
class Unit:
    """One push as it was made: tables of one width, their sorted unique ids, their gradients stacked in that order
    (``summed``), versions per table; ``stacked``: made by ``push_stacked`` (planned as one push of every table)."""

    specs: list[TableSpec]
    uniq: list[np.ndarray]
    summed: np.ndarray
    versions: list[Optional[Versions]]
    wire: int
    stacked: bool

    def part(self, i: int) -> slice:
        start = sum(u.shape[0] for u in self.uniq[:i])
        return slice(start, start + self.uniq[i].shape[0])


class HeldRows:
    """The row pushes of a held step, in the order they were made (any thread may add; ``take`` empties)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._units: list[Unit] = []

    def add(self, unit: Unit) -> None:
        with self._lock:
            self._units.append(unit)

    @property
    def pending(self) -> bool:
        return bool(self._units)

    def take(self) -> tuple[list[Unit], dict[str, list[tuple[TableSpec, np.ndarray, np.ndarray, Optional[Versions],
                                                                int]]]]:
        """The units to plan as they are (their tables pushed once this step), and per table pushed more than once
        its parts (spec, ids, gradients, versions, wire), to be summed."""
        with self._lock:
            units, self._units = self._units, []
        count = collections.Counter(s.name for u in units for s in u.specs)
        keep: list[Unit] = []
        again: dict[str, list] = collections.defaultdict(list)
        for u in units:
            once = [i for i, s in enumerate(u.specs) if count[s.name] == 1]
            for i, s in enumerate(u.specs):
                if count[s.name] > 1:
                    again[s.name].append((s, u.uniq[i], u.summed[u.part(i)], u.versions[i], u.wire))
            if len(once) == len(u.specs):
                keep.append(u)
            elif once:  # (only a collection's push shares some tables with other pushes of the step)
                rows = np.concatenate([np.arange(u.part(i).start, u.part(i).stop) for i in once])
                keep.append(Unit([u.specs[i] for i in once], [u.uniq[i] for i in once], u.summed[rows],
                                 [u.versions[i] for i in once], u.wire, u.stacked))
        return keep, again


def summed_parts(parts: list[tuple[TableSpec, np.ndarray, np.ndarray, Optional[Versions], int]]
                 ) -> tuple[np.ndarray, np.ndarray, Optional[Versions]]:
    """One table's pushes of a step as one: its ids, each row's gradients summed, the oldest versions read."""
    uniq, summed = coalesce(np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]))
    versions: Optional[Versions] = parts[0][3]
    for p in parts[1:]:
        versions = None if versions is None or p[3] is None else Versions.oldest(versions, p[3])
    return uniq, summed, versions
