"""The primary's side of its backups' Replicate streams: who may follow (the group's cluster and shard, a live member
in etcd, the epoch it means to follow), then the records of the primary's log from where the backup's ends, or first
a whole copy (``copies.send``) when its log diverged or fell behind what is kept; the backup's acknowledgements,
counted towards the quorum, never beyond what it was sent."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, Iterator

from shardps.core.errors import InvalidArgument, NotPrimary, PermissionDenied
from shardps.server.durability.replication import Diverged, ReplicatedLog
from shardps.server.replica.coordination import EtcdUnavailable
from shardps.server.replica.copies import send
from shardps.server.replica.frames import Frame, Hello

if TYPE_CHECKING:
    from shardps.server.replica.member import ReplicaMember

log = logging.getLogger(__name__)


def serve(member: ReplicaMember, hello: Hello, acks: Iterator[int], alive: Callable[[], bool]) -> Iterator[Frame]:
    """A backup's stream: check who follows, then send records (or a whole copy first) for as long as this
    member is the primary of the epoch the backup means to follow and ``alive()``; ``acks`` (read in a thread)
    are how far the backup's log reaches."""
    check_hello(member, hello)
    epoch = member.log.epoch
    sent = [hello.lsn]  # the backup cannot have more than it was sent: a larger ack counts as this
    threading.Thread(target=read_acks, args=(member.log, hello.member, acks, sent), daemon=True).start()
    at = hello.lsn
    try:
        member.log.check_follower(hello.lsn, hello.last_epoch)
        # Its log holds this one's up to hello.lsn: that counts towards a quorum now, not only once a new record is
        # shipped and acknowledged (a new primary's answer to a resend of what it holds waits for such a quorum).
        member.log.ack_from(hello.member, hello.lsn)
        if hello.copy:
            raise Diverged(f"its state lacks records of its log (to record {hello.lsn})")
        if member.log.read(at, 1, timeout=0) is None:
            raise Diverged(f"record {at + 1} is no longer kept")
        yield Frame(epoch, history=list(member.log.history))
    except Diverged as e:
        log.info("shard %d: member %s gets a whole copy: %s", member.shard.index, hello.member, e)
        at = yield from send(member.shard, member.log, epoch, sent)
    while alive() and member.role == "primary" and member.log.epoch == epoch and not member.stopping:
        records = member.log.read(at, 256, timeout=0.5, max_bytes=member.shard.limits.max_message_bytes // 2)
        if records is None:
            return  # fell behind what is kept: the backup reconnects and gets a copy
        if records:
            at = records[-1].lsn
            sent[0] = at  # before the frame leaves: its acknowledgement may come back before this generator resumes
            yield Frame(epoch, records=records)


def check_hello(member: ReplicaMember, hello: Hello) -> None:
    """Refuse a follower of another cluster or shard, not a live member, or that means to follow another epoch."""
    if hello.cluster != member.config.cluster or (hello.shard_index, hello.num_shards) != \
            (member.shard.index, member.shard.num_shards):
        raise InvalidArgument(f"a follower of cluster {hello.cluster!r}, shard {hello.shard_index} of "
                              f"{hello.num_shards}, reached cluster {member.config.cluster!r}, shard "
                              f"{member.shard.index} of {member.shard.num_shards}")
    if hello.member == member.config.member:
        raise InvalidArgument(f"member {hello.member} cannot follow itself")
    try:  # only a member of the group (its key in etcd, under its lease) counts towards a quorum
        known = hello.member in member.coord.members()
    except EtcdUnavailable:
        known = True  # etcd down: the members already following go on; no election can happen meanwhile
    if not known:
        raise PermissionDenied(f"member {hello.member!r} is not a live member of shard {member.shard.index}'s group "
                               "in etcd: refused")
    with member.lock:  # a newer epoch is learned from etcd alone, never from a caller's claim
        mine = member.log.epoch if member.role == "primary" else 0
    if member.role != "primary" or hello.epoch != mine:
        where = member.primary.address if member.primary is not None else ""
        raise NotPrimary(f"member {member.config.member} is not the primary of epoch {hello.epoch} (it is a "
                         f"{member.role}{f' of epoch {mine}' if mine else ''})", where)

def read_acks(log_: ReplicatedLog, name: str, acks: Iterator[int], sent: list[int]) -> None:
    """A backup's acknowledgements, as they come (in a thread), until its stream ends."""
    try:
        for lsn in acks:
            log_.ack_from(name, min(lsn, sent[0]))
    except Exception:  # noqa: BLE001 - the stream ended
        pass
    finally:
        log_.forget(name)
