"""``Versions``: the shard versions rows were read at, handed back with pushes (staleness)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Versions:
    """The shard versions a pull read at: ``{shard index: version}``; pass it back to ``push``."""

    by_shard: dict[int, int]

    @staticmethod
    def oldest(a: Versions, b: Versions) -> Versions:
        """The older version of each shard (rows read at two times: staleness counts from the older)."""
        return Versions({s: min(v, b.by_shard.get(s, v)) for s, v in a.by_shard.items()} |
                        {s: v for s, v in b.by_shard.items() if s not in a.by_shard})


__all__ = ["Versions"]
