"""The bugs the fault campaign (``tests/chaos``, docs/reliability.md) found in replica groups, each pinned by a test
that fails without its fix. Real etcd on loopback (Debian's etcd-server), real shards: processes started as users
start them, or in-process servers on port 0 where a member's own steps are driven one by one.

1. A client waited on a primary that answered nothing (frozen, cut off, stuck on its disk) for its whole call
   deadline, though the group had elected a new primary: now a call that waits asks the group and leaves.
2. An election counted whatever members' keys etcd held: a member that heard etcd but not the others elected itself
   without records a quorum of them held (lost acknowledged writes). Now the reports must meet every quorum.
3. A primary stepped down while its own record was still being written (a slow disk), followed the new primary and
   numbered the new primary's record as its own: the push the record held was applied twice, unseen.
4. A backup whose acknowledgement failed (its stream closing) never applied the records it had stored: once primary it
   served rows without them (lost acknowledged writes).
5. A shard whose log failed answered every write INTERNAL (the client gave up at once, unknown outcome); now it is
   UNAVAILABLE, kind ``log_failed``: the client retries, a group's member leaves, a backup takes over.
7. A push whose record could not be appended (a full disk) was applied in memory first; its client's resend was then
   answered as a duplicate, acknowledged though no log held it (lost at the next failover). Nothing is acknowledged
   once the log failed.
6. gRPC's reconnect backoff (to 120 s) kept a client from a member that had been unreachable once it became primary.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from shardps_client import SGD, Client, Initializer, ShardUnavailableError

from shardps.core import protocol
from shardps.core.errors import Unavailable
from shardps.server.durability import modes as durability
from shardps.server.durability.modes import NoDurability
from shardps.server.durability.replication import Diverged, ReplicatedLog, Shipped
from shardps.server.replica.coordination import Primary
from shardps.server.replica.member import ReplicaConfig
from shardps.server.rpc import ServerConfig, ShardServer
from shardps.server.shard.facade import ShardConfig
from shardps.v1 import shardps_pb2 as pb
from tests.procs import freeze, start_shard


def _member(tmp_path, etcd, m: int, group: int = 3) -> ShardServer:
    """Member ``m`` of shard 0's group, in this process (a real gRPC server on port 0, its own data dir)."""
    return ShardServer(ShardConfig(0, 1, data_dir=str(tmp_path / f"m{m}"), replicas=group, ack="quorum",
                                   quorum_timeout_s=2),
                       ServerConfig(port=0, data_threads=0,
                                    replica=ReplicaConfig("t", f"m{m}", etcd.url, lease_ttl=2))).start()


def _role(server: ShardServer) -> str:
    assert server.replica is not None
    return server.replica.role


def test_a_member_alone_in_etcd_never_elects_itself_without_what_the_others_hold(tmp_path, etcd):
    """Bug 2. Of a group of three, only m1 hears etcd: it must not become primary (the others' logs, which it cannot
    read, may hold acknowledged records it lacks). Once m0 reports too, the two elect one of them."""
    m1 = _member(tmp_path, etcd, 1)
    try:
        time.sleep(2.0)  # several election rounds (every 0.1 s; 0.3 s of waiting for reports)
        assert _role(m1) == "candidate"
        m0 = _member(tmp_path, etcd, 0)
        try:
            deadline = time.monotonic() + 30
            while "primary" not in (_role(m0), _role(m1)):
                assert time.monotonic() < deadline, "two members of three never elected a primary"
                time.sleep(0.05)
        finally:
            m0.stop(checkpoint=False)
    finally:
        m1.stop(checkpoint=False)


class _BlockingDisk(NoDurability):
    """A log whose append blocks until released (a disk that stopped answering)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def append(self, record):  # type: ignore[override]
        self.entered.set()
        self.release.wait(30)
        return 0


def test_a_deposed_primary_stores_no_record_of_its_new_primary_while_its_own_is_being_written():
    """Bug 3. A primary's own record blocks on its disk; it steps down and is sent the new primary's record for the
    same position: it must refuse it until its own is in its log (numbered), where its log then shows the divergence
    (a whole copy follows) instead of holding both records under one number."""
    disk = _BlockingDisk()
    log = ReplicatedLog(disk, group=3)
    log.open()
    log.begin_epoch(5)
    writer = threading.Thread(target=log.append, args=((3, b"its own push"),))
    writer.start()
    assert disk.entered.wait(10)
    log.originates = False  # it stepped down
    with pytest.raises(Unavailable, match="still storing"):
        log.store(Shipped(1, 9, 3, b"the new primary's push"))
    disk.release.set()
    writer.join(10)
    assert log.originating() == 0 and log.lsn == 1 and log.last_epoch() == 5  # its own record, numbered
    with pytest.raises(Diverged):  # its record 1 is of epoch 5, not the new primary's
        log.store(Shipped(1, 9, 3, b"the new primary's push"))


class _AckFails:
    """A replication stream whose acknowledgement fails (it closed as the member stepped down)."""

    def frames(self):  # pragma: no cover - not read here
        return iter(())

    def ack(self, lsn: int) -> None:
        raise Unavailable("the stream closed")

    def close(self) -> None:
        pass


def test_records_a_backup_stored_are_applied_even_when_its_acknowledgement_fails(tmp_path, etcd):
    """Bug 4. Records stored in a backup's log count in its LSN (what it reports, what elects it): they must be
    applied even when acknowledging them fails, or as primary it serves rows without them."""
    server = _member(tmp_path, etcd, 0)
    try:
        member, shard = server.replica, server.shard
        assert member is not None
        member.stop()  # no election thread: this test plays the member's steps
        with member.lock:
            member.role, member.primary = "backup", Primary("m9", "127.0.0.1:1", 7, 0)
        member.log.originates = False
        lsn = member.log.lsn
        ids = np.array([3, 5], np.int64)
        push = durability.with_staleness(durability.record_push("t", ids, -np.ones((2, 2), np.float32), "c", 1), 0)
        records = [Shipped(lsn + 1, 7, *durability.record_create_table(_spec())),
                   Shipped(lsn + 2, 7, push[0], bytes(push[1]))]
        with pytest.raises(Unavailable):
            member._store(records, _AckFails())
        assert member.log.lsn == lsn + 2
        rows, _ = shard.read_rows(shard.registry.get("t", dense=False), ids)
        assert np.array_equal(np.asarray(rows), np.ones((2, 2), np.float32)), rows  # applied: -1 * -1 added to zeros
    finally:
        server.stop(checkpoint=False)


def test_a_candidate_reports_where_its_log_ends_only_once_its_follow_thread_has_stored_its_batch(tmp_path, etcd):
    """Bug 10. A member that stepped down while its follow thread was storing a batch reported where its log ended
    without that batch (records it had acknowledged to the old primary): an election could then pick a log that
    lacks them. Its report must come after the batch is stored."""
    server = _member(tmp_path, etcd, 0)
    try:
        member = server.replica
        assert member is not None
        member.stop()  # no election thread: this test plays the member's steps
        reported: list[int] = []
        member._publish = lambda: reported.append(member.log.lsn)  # type: ignore[method-assign]
        with member.lock:
            member.role, member.primary = "candidate", None
            member._following = 7  # the follow thread holds a batch of the old primary's (epoch 7)
        lsn = member.log.lsn

        def store_the_batch() -> None:
            time.sleep(0.5)
            member.log.lsn = lsn + 3  # the batch's three records stored, acknowledged, applied
            member._following = 0

        follower = threading.Thread(target=store_the_batch)
        follower.start()
        member._stop.clear()
        member._campaign(since=0)
        follower.join(10)
        assert reported and reported[0] == lsn + 3, f"reported {reported}: before its batch ({lsn + 3}) was stored"
    finally:
        server.stop(checkpoint=False)


def test_a_push_that_waited_while_its_member_stepped_down_is_refused_not_applied(tmp_path, etcd):
    """Bug 11. A push reaches the primary and waits there (a checkpoint's hold here; in the campaign, slots arriving
    from a move); meanwhile the member steps down. When the wait ends, the push must be refused, not applied: a
    backup's log appended nothing of it and its wait checked nothing, so it was applied and acknowledged with no
    record behind it, and lost (the reshard scenario's lost acknowledgement)."""
    server = _member(tmp_path, etcd, 0)
    try:
        member, shard = server.replica, server.shard
        assert member is not None
        member.stop()  # no election thread: this test plays the member's steps
        member._applying.on = True  # the table comes as its primary's record would
        shard.create_table(_spec())
        member._applying.on = False
        with member.lock:
            member.role, member.primary = "primary", Primary("m0", server.address, 7, 0)
        member.log.begin_epoch(7)
        member.log.originates = True
        shard.gate.close()  # a checkpoint's hold: the push waits
        at_gate = threading.Event()
        gate_wait = shard.gate.wait

        def wait_at_gate(timeout):
            at_gate.set()
            return gate_wait(timeout)

        shard.gate.wait = wait_at_gate  # type: ignore[method-assign]
        outcome: list = []

        def push() -> None:
            try:
                with Client([server.address], timeout=20, retry_timeout=2) as c:
                    c.push("t", torch.tensor([3, 5]), -torch.ones(2, 2), wait=True)
                outcome.append("acknowledged")
            except Exception as e:  # noqa: BLE001 - the outcome
                outcome.append(e)

        pusher = threading.Thread(target=push)
        pusher.start()
        assert at_gate.wait(20), "the push never reached the gate"
        member.step_down(None, "the test")
        shard.gate.open()
        pusher.join(30)
        assert outcome and outcome[0] != "acknowledged", "a push applied by a member that stepped down was " \
                                                         "acknowledged"
        assert isinstance(outcome[0], ShardUnavailableError), outcome
        rows, _ = shard.read_rows(shard.registry.get("t", dense=False), np.array([3, 5], np.int64))
        assert np.array_equal(np.asarray(rows), np.zeros((2, 2), np.float32)), rows  # not applied
        assert member.log.lsn == 0 and member.log.originating() == 0  # nothing of its own logged
    finally:
        server.stop(checkpoint=False)


def _spec():
    from shardps.core.optim import SGD as ServerSGD
    from shardps.core.specs import Initializer as Init
    from shardps.core.specs import TableSpec

    return TableSpec("t", 2, 100, ServerSGD(lr=1.0), Init("zeros"))


class _Group:
    """Three ``shardps serve`` processes of shard 0, their data dirs apart."""

    def __init__(self, tmp_path, etcd, extra: tuple[str, ...] = ()) -> None:
        self.procs = [start_shard(0, 1, tmp_path, str(tmp_path / f"g{m}"), extra=[
            "--replicas", "3", "--member", f"m{m}", "--etcd", etcd.url, "--cluster-name", "f", *extra])
            for m in range(3)]

    @property
    def addresses(self) -> str:
        return "|".join(p.address for p in self.procs)

    def primary(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m, p in enumerate(self.procs):
                try:
                    with grpc.insecure_channel(p.address) as ch:
                        info = ch.unary_unary("/shardps.v1.Shard/ShardInfo",
                                              request_serializer=pb.ShardInfoRequest.SerializeToString,
                                              response_deserializer=pb.ShardInfoResponse.FromString)(
                            pb.ShardInfoRequest(), timeout=2)
                    if info.replica.role == "primary":
                        return m
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise AssertionError("no primary")

    def stop(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
                p.kill()


@pytest.mark.slow
@pytest.mark.parametrize("data_plane", ["grpc", "zmq"])
def test_training_goes_on_while_the_old_primary_is_still_frozen(tmp_path, etcd, data_plane):
    """Bug 1. The primary is frozen (SIGSTOP) and stays frozen: a client whose call deadline is a minute must get
    its pushes acknowledged by the new primary well before that (here within 40 s; the campaign measures a few)."""
    g = _Group(tmp_path, etcd)
    try:
        old = g.primary()
        with Client([g.addresses], timeout=60, retry_timeout=60, data_plane=data_plane) as c:
            c.create_table("t", num_embeddings=1000, dim=2, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
            c.push("t", torch.arange(10), -torch.ones(10, 2), wait=True)
            freeze(g.procs[old].proc.pid)
            t0 = time.monotonic()
            for _ in range(5):
                c.push("t", torch.arange(10), -torch.ones(10, 2), wait=True)
            waited = time.monotonic() - t0
            assert g.procs[old].proc.poll() is None  # still frozen, never answered
            assert waited < 40, waited
            assert torch.equal(c.pull("t", torch.arange(10)), torch.full((10, 2), 6.0))
    finally:
        g.stop()


def test_a_failed_log_answers_unavailable_not_internal(tmp_path):
    """Bug 5. The shard's fsync fails (libfiu in its process): the write is refused UNAVAILABLE (kind log_failed, the
    client's ShardUnavailableError naming the log), never INTERNAL, and every later write too (a failed fsync is not
    retried as if nothing happened); reads go on."""
    from tests.lab.disk import Failpoints

    try:
        env = Failpoints.environment(tmp_path / "fiu")
    except RuntimeError as e:
        (pytest.fail if os.environ.get("SHARDPS_REQUIRE_LAB") == "1" else pytest.skip)(str(e))
    shard = start_shard(0, 1, tmp_path, str(tmp_path / "data"), extra=["--fsync", "always"], env=env)
    try:
        with Client([shard.address], timeout=10, retry_timeout=1) as c:
            c.create_table("t", num_embeddings=100, dim=2, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
            c.push("t", torch.arange(4), -torch.ones(4, 2), wait=True)
            Failpoints(tmp_path / "fiu", shard.proc.pid).fsync_errors()
            for _ in range(2):
                with pytest.raises(ShardUnavailableError, match="write-ahead log"):
                    c.push("t", torch.arange(4), -torch.ones(4, 2), wait=True)
            assert torch.all(c.pull("t", torch.arange(4)) >= 1.0)  # reads go on
        assert "internal error" not in shard.log()
    finally:
        shard.kill()


def test_a_push_whose_record_did_not_fit_on_a_full_disk_is_never_acknowledged(tmp_path):
    """Bug 7. The shard's disk fills (a small tmpfs): the push whose record cannot be written is applied in memory,
    and its client sends it again with the same sequence number; the resend must not be answered as an applied
    duplicate. The push fails UNAVAILABLE (the log failed), and so does every later one."""
    from tests.lab import Lab, why_unavailable

    if why_unavailable():
        (pytest.fail if os.environ.get("SHARDPS_REQUIRE_LAB") == "1" else pytest.skip)(why_unavailable())
    with Lab(["h"]) as lab:
        disk = lab.disk("h", size_mb=16, kind="tmpfs")
        shard = start_shard(0, 1, tmp_path, str(disk.path / "data"))
        try:
            with Client([shard.address], timeout=10, retry_timeout=2) as c:
                c.create_table("t", num_embeddings=100, dim=64, optimizer=SGD(lr=1.0),
                               initializer=Initializer("zeros"))
                c.push("t", torch.arange(4), -torch.ones(4, 64), wait=True)
                disk.fill()
                for _ in range(2):
                    with pytest.raises(ShardUnavailableError, match="write-ahead log"):
                        c.push("t", torch.arange(100), -torch.ones(100, 64), wait=True)
        finally:
            shard.kill()


def test_every_channel_to_a_shard_reconnects_within_a_second():
    """Bug 6. A client's channels (and the tools' and the backups') reconnect within a second, not after gRPC's
    backoff of up to 120 s."""
    from shardps_client.transport.channels import Channels

    from shardps import probe

    opts = dict(protocol.RECONNECT_OPTIONS)
    assert opts["grpc.max_reconnect_backoff_ms"] <= 1000
    assert set(protocol.RECONNECT_OPTIONS) <= set(Channels(1 << 20, None, None)._options)
    seen = {}
    real = grpc.insecure_channel
    try:
        grpc.insecure_channel = lambda address, options=(): seen.setdefault("options", options) and real(address)  # type: ignore[assignment]
        probe.channel("127.0.0.1:1").close()
    finally:
        grpc.insecure_channel = real  # type: ignore[assignment]
    assert set(protocol.RECONNECT_OPTIONS) <= set(seen["options"])
