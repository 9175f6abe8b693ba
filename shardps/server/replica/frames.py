"""What travels on a replica group's Replicate stream, as plain values (``shardps.server.rpc.replication`` turns
them into ``ReplicaAck`` / ``ReplicaFrame``): a backup's hello, the primary's frames, and the stream a backup holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol

from shardps.server.durability.replication import Shipped


@dataclass(frozen=True)
class Hello:
    """What a backup says first on its stream."""

    cluster: str
    shard_index: int
    num_shards: int
    member: str
    lsn: int
    last_epoch: int
    epoch: int
    copy: bool = False  # its state lacks records of its log: a whole copy, please


@dataclass
class Frame:
    """What a primary sends on a backup's stream (a plain form of ``ReplicaFrame``)."""

    epoch: int
    records: list[Shipped] = field(default_factory=list)
    file: Optional[tuple[str, int, bytes, bool]] = None  # (name, offset, data, last)
    copied: int = 0  # a whole copy is complete: its LSN
    history: list[tuple[int, int]] = field(default_factory=list)


class Stream(Protocol):
    """A backup's stream to its primary (``shardps.server.rpc.replication`` makes it)."""

    def frames(self) -> Iterator[Frame]: ...

    def ack(self, lsn: int) -> None: ...

    def close(self) -> None: ...


Connect = Callable[[str, Hello], Stream]
