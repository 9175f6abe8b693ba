"""What one shard accepts: size limits per request and per shard, and the shard's memory budget.

Every limit is checked before anything is allocated or changed, and a request over
one is refused with RESOURCE_EXHAUSTED (a quantity the shard will not hold) or
INVALID_ARGUMENT (a request that is malformed whatever the shard holds), naming
the limit and the ``shardps serve`` flag that raises it.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

from shardps.core.errors import ResourceExhausted

MIB = 1 << 20


def physical_memory_bytes() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit where lower (containers)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = pathlib.Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


def default_memory_mb() -> int:
    """Half of the memory this process may use (several shards often share a host)."""
    return physical_memory_bytes() // 2 // MIB


@dataclass(frozen=True)
class Limits:
    """Limits of one shard (``shardps serve`` flags in brackets).

    Args:
        max_memory_mb: budget for table rows, optimizer state and indexes, in MiB
            [--max-memory-mb; default: half the machine's or container's memory].
        max_tables: tables and dense tensors on the shard [--max-tables].
        max_table_rows: rows one table may hold on this shard [--max-table-rows]
            (at most 2^31 - 1: row slots are 32-bit).
        max_ids_per_request: ids in one pull or push [--max-ids-per-request].
        max_name_length: characters in a table or dense-tensor name [--max-name-length].
        max_dense_elements: elements of one dense tensor [--max-dense-elements].
        max_workers: training workers (ranks, world size, sync workers) [--max-workers].
        max_message_bytes: largest reply the shard builds (from --max-message-mb): a
            pull whose reply would be larger is refused before any row is read.
    """

    max_memory_mb: int = 0
    max_tables: int = 1024
    max_table_rows: int = 2**31 - 1
    max_ids_per_request: int = 1 << 20
    max_name_length: int = 128
    max_dense_elements: int = 1 << 28
    max_workers: int = 4096
    max_message_bytes: int = 4 * MIB

    def __post_init__(self) -> None:
        for name in ("max_tables", "max_table_rows", "max_ids_per_request", "max_name_length",
                     "max_dense_elements", "max_workers", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_memory_mb < 0:
            raise ValueError(f"max_memory_mb must be >= 0 (0: the default), got {self.max_memory_mb}")
        if self.max_table_rows > 2**31 - 1:
            raise ValueError(f"max_table_rows is at most 2^31 - 1 (row slots are 32-bit), got {self.max_table_rows}")

    @property
    def memory_bytes(self) -> int:
        return (self.max_memory_mb or default_memory_mb()) * MIB

    def check(self, what: str, value: int, limit_name: str) -> None:
        """Refuse ``value`` of ``what`` above the limit ``limit_name`` with RESOURCE_EXHAUSTED, naming its flag."""
        limit = getattr(self, limit_name)
        if value > limit:
            flag = "--" + limit_name.replace("_", "-")
            raise ResourceExhausted(f"{what}: {value:,} is over the shard's limit of {limit:,} ({flag})")
