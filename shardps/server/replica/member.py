"""One member of a replica group: its role, the election, fencing, and the two ends of replication.

- **Election** (a thread, every ``poll_s``): the primary is whoever holds the group's key in etcd. When there is
  none, every live member stops following, becomes a candidate and publishes where its log ends; after
  ``election_wait_s`` (under ``--ack quorum``: once enough have reported, at most that) the member with the newest
  log (the epoch of its last record, then its length; ties by member id) among the candidates' reports written since
  the key was seen gone creates the key, provided (under ``--ack quorum``) enough members reported to meet every
  quorum (2 of 3, 1 of 2, 3 of 5): every acknowledged record is in a quorum's logs, so the newest of them holds them
  all (a lone member of three that hears etcd but not the others never elects itself without what they hold). Its
  etcd revision is the new epoch. Members that lose follow the winner. etcd unreachable: nothing changes (no
  election can happen either).
- **Fencing**: a write is accepted only by the primary (``check_writable``, the shard's validator calls it), and
  acknowledged only while its lease is believed (``ReplicatedLog.fence``: a process frozen past its lease refuses
  until etcd answers again, then steps down when its key is gone; under ``--ack primary``, where no quorum guards
  the writes, only while etcd confirmed the lease within its TTL). A backup stores only records of the epoch of the
  primary it follows, which it learned from etcd, so a deposed primary cannot gather a quorum.
- **A disk that stops**: a primary whose log has waited on its disk for longer than the lease (a blocked or dying
  disk: fsync never returns) gives its key up, so a backup takes over instead of every client waiting on it; a
  member whose log failed (a write or fsync error: never retried, the kernel may have dropped what it could not
  write) leaves the group: it resigns and its process exits (``LOG_FAILED_EXIT``), as PostgreSQL panics since
  fsyncgate; what failed to persist was never acknowledged.
- **Backups** follow the primary (``connect``, the gRPC client of ``shardps.server.rpc.replication``): the records
  go into their own log, are acknowledged, then applied through the replay path; a backup whose log is not a prefix
  of the primary's (a deposed primary's unacknowledged records), or that fell behind what the primary keeps, gets a
  whole copy (a checkpoint of the primary) first, installed as its newest checkpoint. So does one that could not
  apply a record (``apply_shipped``): until then it stands in no election, and with no primary to copy from it
  leaves the group (``STATE_BEHIND_EXIT``) to start again from its own log.
- **The primary** serves each backup's stream (``serve``): records from its log's kept tail, or the copy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from shardps.core.errors import InvalidArgument, NotPrimary, Unavailable
from shardps.server.durability import modes as durability
from shardps.server.durability.replication import ReplicatedLog, Shipped
from shardps.server.replica import copies
from shardps.server.replica.coordination import Coordinator, EtcdUnavailable, Primary
from shardps.server.replica.copies import IncomingCopy, install
from shardps.server.replica.frames import Connect, Hello, Stream
from shardps.server.shard.facade import Shard
from shardps.server.shard.recovery import replay

log = logging.getLogger(__name__)

LOG_FAILED_EXIT = 3  # the exit code of a member whose write-ahead log failed
STATE_BEHIND_EXIT = 4  # of a member, with no primary to copy from, whose state lacks records of its log


def disk_trouble(log: ReplicatedLog, patience_s: float) -> str:
    """Why a member's log cannot be trusted to store records now ("": it can): it failed, or a write or fsync has
    waited on the disk for longer than ``patience_s``."""
    error = log.disk_error()
    if error is not None:
        return f"its write-ahead log failed ({error})"
    stalled = log.disk_stalled_s()
    if stalled > patience_s:
        return f"its write-ahead log has waited {stalled:.1f} s on its disk"
    return ""


ELECTION_POLL_S = 0.02  # how often a candidate reads the others' reports during the election's wait


def candidates_reporting(coord: Coordinator, since: int, me: str, enough: int, wait_s: float,
                         stop: threading.Event) -> Optional[dict[str, dict[str, Any]]]:
    """The candidates' reports written since etcd revision ``since``, read every ``ELECTION_POLL_S`` for ``wait_s``
    or until ``enough`` members (``me`` among them) have reported (0: the whole wait); None when ``stop`` is set."""
    deadline = time.monotonic() + wait_s
    while True:
        reports = {name: m for name, m in coord.members().items()
                   if m.get("role") == "candidate" and int(m.get("_revision", 0)) > since}
        left = deadline - time.monotonic()
        if (enough and len(set(reports) | {me}) >= enough) or left <= 0:
            return reports
        if stop.wait(min(ELECTION_POLL_S, left)):
            return None


@dataclass(frozen=True)
class ReplicaConfig:
    """How a shard process takes part in its replica group.

    Args:
        cluster: the cluster's name (its keys in etcd; followers of another cluster are refused).
        member: this member's id in its group (unique in the group).
        etcd: etcd's client URL.
        lease_ttl: seconds of the member's etcd lease: a primary silent this long is replaced.
        election_wait_s: seconds candidates wait for each other to say where their logs end (under --ack quorum, until
            enough reported to meet every quorum, at most this).
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
        self._vacant_since: Optional[int] = None  # etcd's revision when the primary's key was first seen gone
        self.exit: Any = None  # how a member leaves the group (``leave``; default: os._exit)
        self.unapplied = ""  # why this member's state lacks records its log holds (``apply_shipped``); "" if none
        self.log.originates = False
        self.log.fence = self.fence
        self.log.applying = lambda: bool(getattr(self._applying, "on", False))
        shard.check.guard = self.check_writable

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> ReplicaMember:
        copies.sweep()  # whole copies' files that members killed mid-copy left in the temporary directory
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
        """Before a write is acknowledged: still the primary, with a lease believed held (under ``--ack primary``:
        confirmed by etcd within its TTL)."""
        confirmed = self.log.ack != "primary" or 0 <= self.coord.answered_s() < self.config.lease_ttl
        if self.role != "primary" or not self.coord.fresh() or not confirmed:
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
                watch_disk(self)
                self._elect_once()
            except EtcdUnavailable as e:
                log.debug("shard %d member %s: %s", self.shard.index, self.config.member, e)
            except Exception:  # noqa: BLE001 - the election goes on
                log.exception("shard %d member %s: election", self.shard.index, self.config.member)

    def _disk_trouble(self) -> str:
        return disk_trouble(self.log, self.config.lease_ttl)

    def _elect_once(self) -> None:
        if self.coord.lease_lost:  # frozen past the lease, or etcd forgot it: keys gone; start over
            self.step_down(None, "its etcd lease expired")
            self.coord.new_lease()
            self._publish()
        current, revision = self.coord.primary_at()
        if current is None:
            if self._vacant_since is None:
                self._vacant_since = revision
            self.step_down(None, "the primary's key is gone")
            self._campaign(self._vacant_since)
            return
        self._vacant_since = None
        if current.member == self.config.member:
            if current.lease != self.coord.lease_id or self._disk_trouble():  # the key of this member's previous
                self.coord.resign(current.epoch)  # process, or a disk it cannot stand behind: let it go
            elif self.role != "primary":
                self._become_primary(current)
        elif self.primary is None or self.primary.epoch != current.epoch or self.role == "primary":
            self.step_down(current, f"member {current.member} is the primary (epoch {current.epoch})")

    def _campaign(self, since: int) -> None:
        """Say where this member's log ends; after the wait, the newest log's member among the candidates that
        reported since the key was seen gone (etcd revision ``since``) creates the key, if they are a majority of
        the group under ``--ack quorum``."""
        if self._disk_trouble() or self.log.originating() or not self._drained():
            return  # a member whose log cannot store records (or is still storing its own) does not lead
        if self.unapplied:  # nor one whose state lacks records of its log: it starts again, from its log
            return leave(self, f"its state lacks records of its log ({self.unapplied})", STATE_BEHIND_EXIT)
        self._publish()
        # every acknowledged record is in the logs of a quorum (n // 2 + 1 of the n members): reports from n minus
        # that plus one members meet every quorum, so the newest among them holds every acknowledged record; under
        # --ack quorum the count is decided as soon as they are in (waiting longer would only choose among
        # unacknowledged records, and the wait was 0.3 s of every failover's stall); under --ack primary nothing
        # meets every quorum, and the whole wait lets the newest log win (the least lost)
        n = self.log.group
        need = n - (n // 2 + 1) + 1 if self.log.ack == "quorum" else 1
        reports = candidates_reporting(self.coord, since, self.config.member, need if self.log.ack == "quorum" else 0,
                                       self.config.election_wait_s, self._stop)
        if reports is None:
            return
        mine = (self.log.last_epoch(), self.log.lsn, self.config.member)
        if len(set(reports) | {self.config.member}) < need:
            log.debug("shard %d member %s: %d of the %d candidates an election needs have reported", self.shard.index,
                      self.config.member, len(set(reports) | {self.config.member}), need)
            return  # too few members hear etcd to know the newest log: wait (no primary beats a lossy one)
        best = max([(int(m.get("last_epoch", 0)), int(m.get("lsn", 0)), name)
                    for name, m in reports.items()] + [mine])
        if best != mine:
            return  # the newest log's member campaigns; if it cannot, its key vanishes and this runs again
        epoch = self.coord.campaign(self.address)
        if epoch is not None:
            current = self.coord.primary()
            if current is not None and current.epoch == epoch:
                self._become_primary(current)

    def _drained(self, timeout: float = 5.0) -> bool:
        """Stop following (its stream closed) and wait until the follow thread has stored, acknowledged and applied
        the batch it had: a report of where this member's log ends, or its first write as primary, then comes after
        every record it acknowledged. False: still following after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._following and time.monotonic() < deadline and not self._stop.is_set():
            with self.lock:
                if self._stream is not None:
                    self._stream.close()
            time.sleep(0.01)
        return not self._following

    def _become_primary(self, current: Primary) -> None:
        self._drained(10.0)
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
        warned: tuple[int, float] = (0, 0.0)  # (epoch, when): a primary that does not answer is told every 5 s
        while not self._stop.is_set():
            with self.lock:
                target = self.primary if self.role == "backup" else None
            if target is None:
                self._stop.wait(self.config.poll_s)
                continue
            try:
                self._follow(target)
            except Exception as e:  # noqa: BLE001 - reconnect after a pause; the election decides whom to follow
                now = time.monotonic()
                if not self._stop.is_set() and (warned[0] != target.epoch or now - warned[1] > 5.0):
                    warned = (target.epoch, now)
                    log.warning("shard %d member %s: following %s: %s", self.shard.index, self.config.member,
                                target.address, e)
            self._stop.wait(self.config.poll_s)

    def _follow(self, target: Primary) -> None:
        if self.log.originating():  # its own records, from when it was primary, go into its log (and its count) first
            return
        hello = Hello(self.config.cluster, self.shard.index, self.shard.num_shards, self.config.member,
                      self.log.lsn, self.log.last_epoch(), target.epoch, copy=bool(self.unapplied))
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
                        self.unapplied = ""
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
        """Records from the primary: into this member's log, acknowledged, then applied by the replay path. Every
        record stored is applied, whatever happens after it is stored (the stream closing under the acknowledgement,
        this member stepping down mid-batch): its log, and the count its reports and elections read, hold it."""
        stored: list[Shipped] = []
        try:
            for rec in records:
                with self.lock:
                    if self.role != "backup" or self.primary is None or rec.epoch > self.primary.epoch:
                        raise Unavailable("no longer following this primary")
                ticket = self.log.store(rec)
                stored.append(rec)
                self.log.wait_stored(ticket, durable=rec.kind in durability.SCHEMA_KINDS)
            stream.ack(records[-1].lsn)
        finally:
            apply_shipped(self, stored)

    # ---- what ShardInfo tells -----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        with self.lock:
            primary = self.primary.address if self.primary is not None else ""
            epoch = self.primary.epoch if self.primary is not None else self.log.epoch
            return {"member": self.config.member, "role": self.role, "epoch": epoch, "lsn": self.log.lsn,
                    "primary": primary, "group": self.log.group, "ack": self.log.ack,
                    "backups": self.log.acked() if self.role == "primary" else {},
                    "etcd_age_s": self.coord.answered_s()}


def apply_shipped(member: ReplicaMember, stored: list[Shipped]) -> None:
    """Apply the records ``member`` stored from its primary, through the replay path. A record that cannot be
    applied (an error of this member's: its memory budget, a state that went wrong) leaves its state behind its log,
    and the records after it would apply to the wrong state: none of them is applied. The member says so
    (``unapplied``): its next stream asks for a whole copy, and it stands in no election until it has one."""
    if member.unapplied:
        return
    member._applying.on = True
    try:
        for rec in stored:
            try:
                replay(member.shard, durability.read_record(rec.kind, rec.payload))
            except Exception as e:  # noqa: BLE001 - any record: the state is behind the log from here
                member.unapplied = f"record {rec.lsn} of its primary's: {e}"
                log.error("shard %d member %s: cannot apply %s; it asks its primary for a whole copy, and stands in "
                          "no election until it has one", member.shard.index, member.config.member, member.unapplied)
                raise Unavailable(f"record {rec.lsn} not applied: {e}") from e
    finally:
        member._applying.on = False


def watch_disk(member: ReplicaMember) -> None:
    """A primary whose disk stopped answering gives its key up; a member whose log failed leaves the group."""
    why = member._disk_trouble()
    if not why:
        return
    with member.lock:
        primary = member.primary if member.role == "primary" else None
    if primary is not None:
        log.error("shard %d member %s: giving up the primary: %s", member.shard.index, member.config.member, why)
        member.step_down(None, why)
        try:
            member.coord.resign(primary.epoch)
        except EtcdUnavailable:
            pass  # its lease runs out instead: it renews nothing it cannot stand behind
    if member.log.disk_error() is not None and not member.stopping:
        leave(member, f"{why}; what failed to persist was never acknowledged; replace the disk and start the member "
              "again: it rejoins with a copy", LOG_FAILED_EXIT)


def leave(member: ReplicaMember, why: str, code: int) -> None:
    """Leave the replica group: give the member's keys back and exit the process with ``code``."""
    if member.stopping:
        return
    log.critical("shard %d member %s: leaving the replica group (exit %d): %s", member.shard.index,
                 member.config.member, code, why)
    member._stop.set()
    try:
        member.coord.stop(revoke=True)
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    (member.exit or os._exit)(code)
