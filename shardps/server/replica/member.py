"""One member of a replica group: its role, the election, fencing, and the two ends of replication.

- **Election** (a thread, every ``poll_s``): the primary is whoever holds the group's key in etcd. When there is
  none, every live member publishes where its log ends; after ``election_wait_s`` the member with the newest log
  (the epoch of its last record, then its length; ties by member id) creates the key. Its etcd revision is the new
  epoch. Members that lose follow the winner. etcd unreachable: nothing changes (no election can happen either).
- **Fencing**: a write is accepted only by the primary (``check_writable``, the shard's validator calls it), and
  acknowledged only while its lease is believed (``ReplicatedLog.fence``: a process frozen past its lease refuses
  until etcd answers again, then steps down when its key is gone). A backup stores only records of the epoch of the
  primary it follows, which it learned from etcd, so a deposed primary cannot gather a quorum.
- **Backups** follow the primary (``connect``, the gRPC client of ``shardps.server.rpc.replication``): the records
  go into their own log, are acknowledged, then applied through the replay path; a backup whose log is not a prefix
  of the primary's (a deposed primary's unacknowledged records), or that fell behind what the primary keeps, gets a
  whole copy (a checkpoint of the primary) first, installed as its newest checkpoint.
- **The primary** serves each backup's stream (``serve``): records from its log's kept tail, or the copy.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional

from shardps.core.errors import InvalidArgument, NotPrimary, Unavailable
from shardps.server.durability import modes as durability
from shardps.server.durability.replication import ReplicatedLog, Shipped
from shardps.server.replica.coordination import Coordinator, EtcdUnavailable, Primary
from shardps.server.replica.copies import IncomingCopy, install
from shardps.server.replica.frames import Connect, Hello, Stream
from shardps.server.shard.facade import Shard
from shardps.server.shard.recovery import replay

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ReplicaConfig:
    """How a shard process takes part in its replica group.

    Args:
        cluster: the cluster's name (its keys in etcd; followers of another cluster are refused).
        member: this member's id in its group (unique in the group).
        etcd: etcd's client URL.
        lease_ttl: seconds of the member's etcd lease: a primary silent this long is replaced.
        election_wait_s: seconds candidates wait for each other to say where their logs end.
        poll_s: seconds between looks at the primary's key.
    """

    cluster: str
    member: str
    etcd: str
    lease_ttl: int = 2
    election_wait_s: float = 0.3
    poll_s: float = 0.1


class ReplicaMember:
    """This process's part in its replica group (see the module docstring).

    Args:
        shard: the shard (its durability a ``ReplicatedLog``).
        config: the group's settings.
        address: the address clients and backups reach this member at ("host:port").
        connect: opens a stream to a primary (the rpc layer's gRPC client).
        coordinator: etcd (default: made from the config).
    """

    def __init__(self, shard: Shard, config: ReplicaConfig, address: str, connect: Connect,
                 coordinator: Optional[Coordinator] = None) -> None:
        if not isinstance(shard.durability, ReplicatedLog):
            raise InvalidArgument("a replica group's member needs a shard started with replicas > 1")
        self.shard = shard
        self.log: ReplicatedLog = shard.durability
        self.config = config
        self.address = address
        self.connect = connect
        self.coord = coordinator or Coordinator(config.etcd, config.cluster, shard.index, config.member,
                                                config.lease_ttl)
        self.role = "candidate"
        self.primary: Optional[Primary] = None  # the primary this member writes as or follows
        self.lock = threading.RLock()
        self._stop = threading.Event()
        self._stream: Optional[Stream] = None
        self._following = 0  # the epoch of the primary the follow thread follows (0: none)
        self._threads: list[threading.Thread] = []
        self._applying = threading.local()  # set while this thread applies the primary's records
        self.log.originates = False
        self.log.fence = self.fence
        shard.check.guard = self.check_writable

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> ReplicaMember:
        self.coord.start()
        self._publish()
        for target, name in ((self._elect_loop, "replica-election"), (self._follow_loop, "replica-follow")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Leave the group: a primary gives its key back at once (its backups elect without waiting out the lease)."""
        self._stop.set()
        with self.lock:
            primary, self.role = self.role == "primary" and self.primary, "candidate"
            if self._stream is not None:
                self._stream.close()
        if primary:
            try:
                self.coord.resign(primary.epoch)
            except EtcdUnavailable:
                pass
        self.coord.stop(revoke=True)
        for t in self._threads:
            t.join(5)

    @property
    def is_primary(self) -> bool:
        return self.role == "primary"

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # ---- fencing ------------------------------------------------------------------------------

    def check_writable(self, what: str) -> None:
        """Refuse a change unless this member is the primary (with the primary's address to go to), or it is one of
        the primary's records being applied here."""
        if getattr(self._applying, "on", False):
            return
        with self.lock:
            if self.role == "primary":
                return
            where = self.primary.address if self.primary is not None and self.primary.member != self.config.member \
                else ""
        raise NotPrimary(f"{what} refused: member {self.config.member} is a {self.role}, not the primary"
                         + (f" (the primary is {where})" if where else " (an election is under way)"), where)

    def fence(self) -> None:
        """Before a write is acknowledged: still the primary, with a lease believed held."""
        if self.role != "primary" or not self.coord.fresh():
            raise NotPrimary(f"member {self.config.member} cannot confirm it is still the primary (its etcd lease "
                             "is unconfirmed); the write is not acknowledged: retry", "")

    # ---- the election -------------------------------------------------------------------------

    def _publish(self) -> None:
        try:
            self.coord.publish({"address": self.address, "lsn": self.log.lsn, "last_epoch": self.log.last_epoch(),
                                "role": self.role})
        except EtcdUnavailable:
            pass

    def _elect_loop(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            try:
                self._elect_once()
            except EtcdUnavailable as e:
                log.debug("shard %d member %s: %s", self.shard.index, self.config.member, e)
            except Exception:  # noqa: BLE001 - the election goes on
                log.exception("shard %d member %s: election", self.shard.index, self.config.member)

    def _elect_once(self) -> None:
        if self.coord.lease_lost:  # frozen past the lease, or etcd forgot it: keys gone; start over
            self.step_down(None, "its etcd lease expired")
            self.coord.new_lease()
            self._publish()
        current = self.coord.primary()
        if current is None:
            self.step_down(None, "the primary's key is gone")
            self._campaign()
        elif current.member == self.config.member:
            if current.lease != self.coord.lease_id:  # the key of this member's previous process: let it go
                self.coord.resign(current.epoch)
            elif self.role != "primary":
                self._become_primary(current)
        elif self.primary is None or self.primary.epoch != current.epoch or self.role == "primary":
            self.step_down(current, f"member {current.member} is the primary (epoch {current.epoch})")

    def _campaign(self) -> None:
        """Say where this member's log ends; after the wait, the newest log's member creates the key."""
        self._publish()
        if self._stop.wait(self.config.election_wait_s):
            return
        mine = (self.log.last_epoch(), self.log.lsn, self.config.member)
        best = max([(int(m.get("last_epoch", 0)), int(m.get("lsn", 0)), name)
                    for name, m in self.coord.members().items()] + [mine])
        if best != mine:
            return  # the newest log's member campaigns; if it cannot, its key vanishes and this runs again
        epoch = self.coord.campaign(self.address)
        if epoch is not None:
            current = self.coord.primary()
            if current is not None and current.epoch == epoch:
                self._become_primary(current)

    def _become_primary(self, current: Primary) -> None:
        with self.lock:
            if self._stream is not None:
                self._stream.close()
            self._following = 0
            self.log.begin_epoch(current.epoch)
            self.primary = current
            self.log.originates = True
            self.role = "primary"
        log.info("shard %d member %s: primary, epoch %d, log at record %d", self.shard.index, self.config.member,
                 current.epoch, self.log.lsn)
        self._publish()

    def step_down(self, current: Optional[Primary], why: str) -> None:
        with self.lock:
            was = self.role
            self.log.originates = False
            self.role = "backup" if current is not None else "candidate"
            self.primary = current
            if self._stream is not None and (current is None or current.epoch != self._following):
                self._stream.close()
        if was == "primary":
            log.warning("shard %d member %s: no longer the primary: %s", self.shard.index, self.config.member, why)

    # ---- a backup -----------------------------------------------------------------------------

    def _follow_loop(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                target = self.primary if self.role == "backup" else None
            if target is None:
                self._stop.wait(self.config.poll_s)
                continue
            try:
                self._follow(target)
            except Exception as e:  # noqa: BLE001 - reconnect after a pause; the election decides whom to follow
                if not self._stop.is_set():
                    log.warning("shard %d member %s: following %s: %s", self.shard.index, self.config.member,
                                target.address, e)
            self._stop.wait(self.config.poll_s)

    def _follow(self, target: Primary) -> None:
        hello = Hello(self.config.cluster, self.shard.index, self.shard.num_shards, self.config.member,
                      self.log.lsn, self.log.last_epoch(), target.epoch)
        stream = self.connect(target.address, hello)
        with self.lock:
            if self.primary is None or self.primary.epoch != target.epoch or self.role != "backup":
                stream.close()
                return
            self._stream, self._following = stream, target.epoch
        copy: Optional[IncomingCopy] = None
        try:
            for frame in stream.frames():
                if frame.epoch != target.epoch:
                    raise Unavailable(f"frame of epoch {frame.epoch} on a stream of epoch {target.epoch}")
                if frame.file is not None:
                    copy = copy or IncomingCopy()
                    copy.add(*frame.file)
                if frame.copied:
                    assert copy is not None, "a copy's end without its files"
                    self._applying.on = True
                    try:
                        install(self.shard, self.log, self.config.member, copy, frame.copied, frame.history)
                    finally:
                        self._applying.on = False
                    copy.close()
                    copy = None
                    stream.ack(self.log.lsn)
                if frame.records:
                    self._store(frame.records, stream)
        finally:
            if copy is not None:
                copy.close()
            with self.lock:
                if self._stream is stream:
                    self._stream, self._following = None, 0
            stream.close()

    def _store(self, records: list[Shipped], stream: Stream) -> None:
        """Records from the primary: into this member's log, acknowledged, then applied by the replay path."""
        for rec in records:
            with self.lock:
                if self.role != "backup" or self.primary is None or rec.epoch > self.primary.epoch:
                    raise Unavailable("no longer following this primary")
            ticket = self.log.store(rec)
            self.log.wait_stored(ticket, durable=rec.kind in durability.SCHEMA_KINDS)
        stream.ack(records[-1].lsn)
        self._applying.on = True
        try:
            for rec in records:
                replay(self.shard, durability.read_record(rec.kind, rec.payload))
        finally:
            self._applying.on = False

    # ---- what ShardInfo tells -----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        with self.lock:
            primary = self.primary.address if self.primary is not None else ""
            epoch = self.primary.epoch if self.primary is not None else self.log.epoch
            return {"member": self.config.member, "role": self.role, "epoch": epoch, "lsn": self.log.lsn,
                    "primary": primary, "group": self.log.group, "ack": self.log.ack,
                    "backups": self.log.acked() if self.role == "primary" else {},
                    "etcd_age_s": self.coord.answered_s()}
