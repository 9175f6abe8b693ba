"""Replica groups: a primary and backups per shard index, failing over through a real etcd (Debian's etcd-server) on
loopback, with real ``shardps serve`` processes killed, frozen and restarted. Every test is bounded in time and
stops what it started. CI sets SHARDPS_REQUIRE_ETCD=1, so a missing etcd fails there instead of skipping."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from shardps_client import SGD, Client, Initializer, NotPrimaryError
from shardps_client.errors import InvalidArgumentError

from shardps.core.errors import InvalidArgument, NotPrimary
from shardps.server.durability.modes import NoDurability
from shardps.server.durability.replication import Diverged, ReplicatedLog, Shipped
from shardps.server.ops.etcd import LocalEtcd
from shardps.server.replica.coordination import Coordinator
from shardps.server.rpc.replication import frame_of
from shardps.v1 import shardps_pb2 as pb
from tests.procs import freeze, start_shard

ROWS = 2000
KILLS = int(os.environ.get("SHARDPS_REPLICA_KILLS", "3"))  # make failover runs 10


class Group:
    """R members of shard 0 of 1 as ``shardps serve`` processes, each with its data dir."""

    def __init__(self, tmp_path, etcd: LocalEtcd, replicas: int = 3, ack: str = "quorum",
                 extra: tuple[str, ...] = ()) -> None:
        self.tmp, self.etcd, self.replicas, self.ack, self.extra = tmp_path, etcd, replicas, ack, list(extra)
        self.procs = [self._start(m) for m in range(replicas)]

    def _start(self, m: int, port: str = "0"):
        return start_shard(0, 1, self.tmp, str(self.tmp / f"m{m}"), port=port, extra=[
            "--replicas", str(self.replicas), "--member", f"m{m}", "--etcd", self.etcd.url, "--cluster-name", "t",
            "--ack", self.ack, *self.extra])

    @property
    def addresses(self) -> str:
        return "|".join(p.address for p in self.procs)

    def info(self, m: int) -> pb.ReplicaInfo:
        stub = grpc.insecure_channel(self.procs[m].address).unary_unary(
            "/shardps.v1.Shard/ShardInfo", request_serializer=pb.ShardInfoRequest.SerializeToString,
            response_deserializer=pb.ShardInfoResponse.FromString)
        return stub(pb.ShardInfoRequest(), timeout=5).replica

    def primary(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m, p in enumerate(self.procs):
                try:
                    if p.proc.poll() is None and self.info(m).role == "primary":
                        return m
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise AssertionError("no primary elected in time")

    def restart(self, m: int) -> None:
        port = self.procs[m].address.rsplit(":", 1)[1]
        self.procs[m].kill()
        self.procs[m] = self._start(m, port)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.kill()


class Trainers:
    """Two clients in threads pushing +1s (SGD lr 1, zeros) to random rows, counting what was acknowledged."""

    def __init__(self, addresses: str, n: int = 2) -> None:
        self.counts = np.zeros(ROWS, np.int64)
        self.acked = [0] * n
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(addresses, k)) for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, addresses: str, k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            with Client([addresses], timeout=10, retry_timeout=60) as c:
                while not self.stop.is_set():
                    ids = rng.choice(ROWS, size=128, replace=False)
                    c.push("cnt", torch.from_numpy(ids), torch.ones(128, 2), wait=True)
                    with self._lock:
                        self.counts[ids] += 1
                        self.acked[k] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors.append(e)

    def progress(self, steps: int = 5, timeout: float = 60) -> float:
        """Wait until both clients had ``steps`` more pushes acknowledged (a generous bound, never a rate); the
        seconds it took."""
        t0 = time.monotonic()
        before = list(self.acked)
        while any(a < b + steps for a, b in zip(self.acked, before)):
            assert not self.errors, self.errors
            assert time.monotonic() - t0 < timeout, "training made no progress"
            time.sleep(0.01)
        return time.monotonic() - t0

    def first_write(self, timeout: float = 60) -> float:
        """Seconds until either client gets a push acknowledged."""
        t0, before = time.monotonic(), sum(self.acked)
        while sum(self.acked) == before:
            assert not self.errors, self.errors
            assert time.monotonic() - t0 < timeout, "no write acknowledged"
            time.sleep(0.005)
        return time.monotonic() - t0

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        assert not self.errors, self.errors


def _counter(addresses: str) -> None:
    with Client([addresses]) as c:
        # A replica group's lane connects at its first call, once a call found the primary: connected as the client
        # was made, it could reach a member a fresh group's election left behind (a push then met a table unknown
        # there: bench_replicas, once in four runs).
        time.sleep(0.5)
        assert c.transport.data_planes() == [""]
        c.create_table("cnt", dim=2, num_embeddings=ROWS, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))


def _exact(addresses: str, counts: np.ndarray) -> None:
    with Client([addresses]) as c:
        rows = c.pull("cnt", torch.arange(ROWS))
    torch.testing.assert_close(rows[:, 0], -torch.from_numpy(counts.astype(np.float32)), rtol=0, atol=0)


def test_primary_killed_again_and_again_under_two_clients_loses_nothing(tmp_path, etcd):
    """Three members, --ack quorum; two clients push +1s; the primary is killed with SIGKILL (then restarted, rejoining
    as a backup) again and again. Training goes on each time through a newly elected primary; the final table holds
    every acknowledged push exactly once. The time without a writable primary is printed per kill."""
    g = Group(tmp_path, etcd)
    try:
        g.primary()
        _counter(g.addresses)
        t = Trainers(g.addresses)
        gaps = []
        for _ in range(KILLS):
            t.progress()
            m = g.primary()
            g.procs[m].kill()
            gaps.append(t.first_write())
            t.progress()
            g.restart(m)
        t.finish()
        _exact(g.addresses, t.counts)
        print(f"\nseconds without a writable primary, {KILLS} kills: {[round(x, 2) for x in gaps]} "
              f"(median {np.median(gaps):.2f}, max {max(gaps):.2f})")
        assert sum(t.acked) >= 10 * KILLS
        deadline = time.monotonic() + 30  # the member restarted last may still be joining (a candidate)
        while True:
            infos = [g.info(m) for m in range(3)]
            if sorted(i.role for i in infos) == ["backup", "backup", "primary"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted(i.role for i in infos) == ["backup", "backup", "primary"]
        assert len({i.epoch for i in infos}) == 1 and infos[0].epoch > 0
    finally:
        g.kill_all()


def test_a_primary_frozen_past_its_lease_writes_nothing_with_its_old_epoch(tmp_path, etcd):
    """The primary is stopped with SIGSTOP past its lease while the clients train; another member is elected. Once it
    resumes, a push sent straight to it is refused (not acknowledged under its old epoch), it rejoins as a backup, and
    the table holds every acknowledged push exactly once."""
    g = Group(tmp_path, etcd)
    try:
        m = g.primary()
        _counter(g.addresses)
        t = Trainers(g.addresses)
        t.progress()
        old = g.procs[m]
        freeze(old.proc.pid)
        try:
            t.progress(timeout=90)  # through the new primary
            new = g.primary()
            assert new != m
        finally:
            old.proc.send_signal(signal.SIGCONT)
        with Client([old.address], timeout=10, retry_timeout=0.5, check_shard_map=False) as direct:
            with pytest.raises(NotPrimaryError):
                direct.push("cnt", torch.arange(8), torch.full((8, 2), 1000.0), wait=True)
        deadline = time.monotonic() + 30
        while g.info(m).role != "backup":
            assert time.monotonic() < deadline, "the old primary did not rejoin as a backup"
            time.sleep(0.1)
        t.progress()
        t.finish()
        _exact(g.addresses, t.counts)
    finally:
        g.kill_all()


def test_a_backup_that_cannot_apply_its_primarys_records_never_leads_with_a_state_missing_them(tmp_path, etcd):
    """Two members, --ack quorum; the backup started with --max-table-rows 100, so it cannot make the rows its
    primary's pushes create (a member set up unlike its group). It stores and acknowledges each record (its log
    holds them, so the pushes are acknowledged), but cannot apply them. It used to skip them silently and go on: its
    state lacked acknowledged pushes, and once the primary was killed it was elected and served the rows without
    them. Now it says which record it could not apply, asks for a whole copy (which it cannot install either), and
    when the primary is gone it leaves the group (exit 4) instead of leading. Started again as its group is, it
    replays its log: every acknowledged push is there."""
    g = Group(tmp_path, etcd, replicas=2)
    try:
        p = g.primary()
        b = 1 - p
        g.extra = ["--max-table-rows", "100"]
        g.restart(b)
        g.extra = []
        _counter(g.addresses)
        with Client([g.addresses], timeout=10, retry_timeout=30) as c:
            c.push("cnt", torch.arange(ROWS), torch.ones(ROWS, 2), wait=True)  # acknowledged: in both logs
        g.procs[p].kill()
        try:
            assert g.procs[b].proc.wait(30) == 4  # no primary to copy from: it leaves instead of leading
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the backup did not leave: {g.info(b)}") from None
        said = g.procs[b].log()
        assert "cannot apply record" in said and "--max-table-rows" in said and "asks its primary for a whole " \
            "copy" in said and "leaving the replica group (exit 4)" in said, said[-3000:]
        g.restart(b)  # as its group is started: it replays its log (and leads: the other member is gone)
        assert g.primary() == b
        _exact(g.procs[b].address, np.ones(ROWS, np.int64))
    finally:
        g.kill_all()


def test_training_goes_on_while_etcd_is_down_and_failover_works_again_once_it_is_back(tmp_path, etcd):
    g = Group(tmp_path, etcd)
    try:
        g.primary()
        _counter(g.addresses)
        t = Trainers(g.addresses)
        t.progress()
        etcd.kill()
        try:
            t.progress(steps=10)  # the primary and its quorum go on without etcd
        finally:
            etcd.start()
        t.progress()
        m = g.primary()
        g.procs[m].kill()
        t.progress(timeout=90)
        assert g.primary() != m
        t.finish()
        _exact(g.addresses, t.counts)
    finally:
        g.kill_all()


@pytest.mark.parametrize("data_plane", ["zmq", "grpc"])
def test_pushes_answered_unavailable_for_want_of_a_quorum_are_sent_again_and_applied_once(tmp_path, etcd, data_plane):
    """Two members, --ack quorum, the backup killed: the primary applies each push and logs it, but no quorum comes
    within --quorum-timeout, so it answers UNAVAILABLE. The client sends the same pushes again (same sequence numbers)
    for up to its retry_timeout; once the backup is back each is answered (as a duplicate: the primary had applied
    it), and each applied once. Before, the client raised the shard's UNAVAILABLE, and the shard had forgotten the
    applied pushes' sequence numbers (a resend would have been applied twice)."""
    g = Group(tmp_path, etcd, replicas=2, extra=("--quorum-timeout", "0.5"))
    try:
        m = g.primary()
        _counter(g.addresses)
        g.procs[1 - m].kill()
        outcome: list = []

        def train() -> None:
            try:
                with Client([g.addresses], timeout=10, retry_timeout=60, data_plane=data_plane) as c:
                    c.push("cnt", torch.arange(0, 16), torch.ones(16, 2), wait=True)
                    c.push("cnt", torch.arange(16, 32), torch.ones(16, 2))  # answered by flush()
                    c.flush()
                outcome.append("done")
            except BaseException as e:  # noqa: BLE001 - the test reports it
                outcome.append(e)

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        time.sleep(2.5)  # a few quorum timeouts: the first push was answered UNAVAILABLE and sent again
        assert not outcome, f"answered without a quorum: {outcome}"
        g.restart(1 - m)
        trainer.join(60)
        assert outcome == ["done"], outcome
        with Client([g.addresses]) as c:
            rows = c.pull("cnt", torch.arange(64))[:, 0]
            stats = c.shard_info()[0].stats
        expected = torch.cat([torch.full((32,), -1.0), torch.zeros(32)])
        torch.testing.assert_close(rows, expected, rtol=0, atol=0)  # each push applied once
        assert stats.duplicates >= 1, "no push was sent again"
    finally:
        g.kill_all()


def test_a_new_primary_answers_a_resend_of_a_push_it_holds_as_a_duplicate_with_no_new_write(tmp_path, etcd):
    """A push acknowledged by a quorum, then its primary killed: the resend of it (same client and sequence number)
    to the new primary is a duplicate, answered once a quorum holds what the new primary holds. Its caught-up backup
    has that already, but used to count towards a quorum only once a new record was shipped and acknowledged: with
    no other writer, the resend was answered UNAVAILABLE again and again (a client stalled for its whole
    retry_timeout after a failover)."""
    from shardps.core import wire

    g = Group(tmp_path, etcd, extra=("--quorum-timeout", "1"))
    try:
        m = g.primary()
        _counter(g.addresses)
        req = wire.encode_push("cnt", np.ones((4, 2), np.float32), pb.FLOAT32, ids=np.arange(4, dtype=np.int64),
                               client_id="resender", seq=1, shard_map=pb.ShardMap(shard_index=0, num_shards=1))

        def push(address: str) -> pb.PushResponse:
            """The push sent (again) until it is answered: UNAVAILABLE while no quorum holds what was logged."""
            deadline = time.monotonic() + 30
            while True:
                try:
                    with grpc.insecure_channel(address) as ch:
                        return ch.unary_unary("/shardps.v1.Shard/Push",
                                              response_deserializer=pb.PushResponse.FromString)(req, timeout=10)
                except grpc.RpcError as e:  # not the primary yet, or no quorum yet
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                    assert time.monotonic() < deadline, f"the push was never answered: {e.details()}"
                    time.sleep(0.2)

        push(g.procs[m].address)  # (a duplicate if a first try applied it before its backups were following)
        deadline = time.monotonic() + 30
        while len({g.info(k).lsn for k in range(3)}) > 1:  # every backup holds it: nothing left to ship them
            assert time.monotonic() < deadline, "the backups did not catch up"
            time.sleep(0.05)
        g.procs[m].kill()
        assert push(g.procs[g.primary()].address).duplicate
        with Client([g.procs[g.primary()].address]) as c:
            torch.testing.assert_close(c.pull("cnt", torch.arange(4))[:, 0], torch.full((4,), -1.0))
    finally:
        g.kill_all()


def _replicate(address: str, hello: pb.ReplicaHello | None, raw: bytes | None = None) -> grpc.RpcError:
    call = grpc.insecure_channel(address).stream_stream(
        "/shardps.v1.Shard/Replicate", request_serializer=lambda b: b, response_deserializer=pb.ReplicaFrame.FromString)
    request = raw if raw is not None else pb.ReplicaAck(hello=hello).SerializeToString()
    with pytest.raises(grpc.RpcError) as e:
        for _ in call(iter([request]), timeout=5):
            pass
    return e.value


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_whole_copies_left_by_killed_members_are_swept_and_only_theirs(tmp_path, monkeypatch):
    """A member killed mid-copy leaves its copy's directory in the temporary directory; the sweep a member makes as
    it starts removes those whose pid no process has, and those bearing its own pid that are not its copies in
    progress (a container's processes often get the same pid each time), and nothing else."""
    import tempfile

    from shardps.server.replica import copies

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the copies' directories made here
    dead, me, live = _dead_pid(), os.getpid(), os.getppid()
    mine = pathlib.Path(copies.scratch("in"))  # a copy of ours in progress
    assert mine.parent == tmp_path and copies.SCRATCH.match(mine.name).group(1) == str(me)
    names = [f"shardps-copy-in-{dead}-a", f"shardps-copy-out-{dead}-b", f"shardps-copy-in-{me}-stale",
             f"shardps-copy-in-{live}-c", "shardps-copy-in-x-d", "shardps-copy-d", f"other-{dead}"]
    for n in names:
        (tmp_path / n).mkdir()
        (tmp_path / n / "checkpoint").write_bytes(b"x" * 10)
    (tmp_path / f"shardps-copy-in-{dead}-file").write_bytes(b"not a directory")
    assert sorted(copies.sweep(str(tmp_path))) == sorted(str(tmp_path / n) for n in names[:3])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[3:] + [f"shardps-copy-in-{dead}-file", mine.name])
    copies.scratch_done(str(mine))  # its end: gone, and no longer ours
    assert not mine.exists() and mine.name not in copies._MINE


def test_bad_replication_streams_and_election_keys_are_refused_and_change_nothing(tmp_path, etcd):
    import tempfile

    left = pathlib.Path(tempfile.gettempdir()) / f"shardps-copy-in-{_dead_pid()}-test"  # a killed member's copy
    left.mkdir()
    g = Group(tmp_path, etcd)
    try:
        m = g.primary()
        assert not left.exists(), "the members' start did not sweep a whole copy a killed member left"
        _counter(g.addresses)
        with Client([g.addresses]) as c:
            c.push("cnt", torch.arange(10), torch.ones(10, 2), wait=True)
        info = g.info(m)
        primary = g.procs[m].address
        base = dict(cluster="t", shard_map=pb.ShardMap(shard_index=0, num_shards=1), member=f"m{(m + 1) % 3}",
                    lsn=info.lsn, last_epoch=info.epoch, epoch=info.epoch)
        cases = [
            (None, b"\xff\x00garbage", grpc.StatusCode.INVALID_ARGUMENT, "parse|Replica"),
            ({**base, "cluster": "other"}, None, grpc.StatusCode.INVALID_ARGUMENT, "cluster 'other'"),
            ({**base, "shard_map": pb.ShardMap(shard_index=1, num_shards=2)}, None, grpc.StatusCode.INVALID_ARGUMENT,
             "shard 1 of 2"),
            ({**base, "epoch": info.epoch + 1000}, None, grpc.StatusCode.UNAVAILABLE, "not the primary of epoch"),
            ({**base, "epoch": info.epoch - 1}, None, grpc.StatusCode.UNAVAILABLE, "not the primary of epoch"),
            ({**base, "member": "intruder"}, None, grpc.StatusCode.PERMISSION_DENIED, "not a live member"),
            ({**base, "member": f"m{m}"}, None, grpc.StatusCode.INVALID_ARGUMENT, "cannot follow itself"),
        ]
        for hello, raw, code, message in cases:
            err = _replicate(primary, pb.ReplicaHello(**hello) if hello else None, raw)
            assert err.code() == code and any(w in err.details() for w in message.split("|")), (hello, err)
        backup = g.procs[(m + 1) % 3].address  # a client posing as a primary's follower at a backup
        other = {**base, "member": f"m{(m + 2) % 3}"}
        assert _replicate(backup, pb.ReplicaHello(**other)).code() == grpc.StatusCode.UNAVAILABLE
        # A push to a backup is refused as not the primary's, naming it, also for a table the backup has not heard of
        # (a member left behind by an election may lack one): never NOT_FOUND, which a client does not retry.
        from shardps.core import status, wire

        def refused_push(table: str) -> grpc.RpcError:
            req = wire.encode_push(table, np.ones((2, 2), np.float32), pb.FLOAT32, ids=np.arange(2, dtype=np.int64),
                                   shard_map=pb.ShardMap(shard_index=0, num_shards=1))
            with grpc.insecure_channel(backup) as ch, pytest.raises(grpc.RpcError) as refused:
                ch.unary_unary("/shardps.v1.Shard/Push", response_deserializer=pb.PushResponse.FromString)(
                    bytes(req), timeout=10)
            return refused.value

        for table in ("cnt", "made-after"):
            err = refused_push(table)
            trailers = dict(err.trailing_metadata() or ())
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (table, err.details())
            assert trailers.get(status.KIND_METADATA) == "not_primary", (table, trailers)
            assert trailers.get(status.REDIRECT_METADATA) == primary, (table, trailers)
        err = refused_push("x" * 100_000)  # its name is not echoed
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.details()) < 300, err.details()[:300]
        # Election keys: a member key of garbage is ignored; a primary key of garbage is followed by nobody.
        coord = Coordinator(etcd.url, "t", 0, "tester")
        coord._post("/kv/put", {"key": _b64(coord.prefix + "members/junk"), "value": _b64("{not json")})
        assert "junk" not in coord.members()
        assert g.info(m).role == "primary" and g.info(m).epoch == info.epoch  # nothing changed
        with Client([g.addresses]) as c:
            torch.testing.assert_close(c.pull("cnt", torch.arange(10))[:, 0], torch.full((10,), -1.0))
            assert c.shard_info()[0].replica.lsn == info.lsn
        # A dense tensor registered on the primary without values: a backup sent its values refuses them before it
        # sets any row (it set them, then found it could record nothing: its rows and the primary's differed).
        from shardps.core.specs import DenseSpec, dense_spec_from_pb, dense_spec_to_pb

        spec = dense_spec_to_pb(DenseSpec("w", (4, 2)))
        shard_map = pb.ShardMap(shard_index=0, num_shards=1)

        def register(address: str, values: np.ndarray | None) -> pb.RegisterDenseResponse:
            req = pb.RegisterDenseRequest(spec=spec, shard_map=shard_map)
            if values is not None:
                req.values.CopyFrom(pb.Tensor(dtype=pb.FLOAT32, shape=list(values.shape), data=values.tobytes()))
            with grpc.insecure_channel(address) as ch:
                return ch.unary_unary("/shardps.v1.Shard/RegisterDense", request_serializer=pb.RegisterDenseRequest.
                                      SerializeToString, response_deserializer=pb.RegisterDenseResponse.FromString)(
                    req, timeout=10)

        assert register(primary, None).created and dense_spec_from_pb(spec).name == "w"
        deadline = time.monotonic() + 30
        while g.info((m + 1) % 3).lsn < g.info(m).lsn:  # the backup holds the tensor (no values yet)
            assert time.monotonic() < deadline, "the backup did not catch up"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as refused:
            register(backup, np.full((4, 2), 7.0, np.float32))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        with Client([backup], check_shard_map=False, timeout=10) as direct:
            with pytest.raises(InvalidArgumentError, match="not initialised"):  # still no values on the backup
                direct.pull_dense("w")
    finally:
        g.kill_all()
        if left.exists():
            left.rmdir()


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


def test_the_replicated_log_numbers_keeps_and_checks_records():
    """The log's rules, alone: LSNs follow one another, a backup's record must follow its log and not be of an
    older epoch, a quorum needs enough acknowledgements (never more than were sent), divergence is detected."""
    log = ReplicatedLog(NoDurability(), group=3, ack="quorum", quorum_timeout_s=0.2)
    log.open()
    log.begin_epoch(7)
    t1 = log.append((3, b"one"))
    t2 = log.append((3, b"two"))
    assert (t1, t2, log.lsn) == (1, 2, 2)
    with pytest.raises(Exception, match="reached 0 of the 1 backups"):
        log.wait(t2)
    log.ack_from("b", 2)
    log.wait(t2)
    assert [r.payload for r in log.read(0)] == [b"one", b"two"] and log.read(2, timeout=0) == []
    log.check_follower(1, 7)
    with pytest.raises(Diverged):
        log.check_follower(3, 7)  # longer than this log
    with pytest.raises(Diverged):
        log.check_follower(2, 9)  # an epoch this log never had
    backup = ReplicatedLog(NoDurability(), group=3)
    backup.open()
    backup.originates = False
    with pytest.raises(NotPrimary, match="not the primary"):  # a backup never originates records: refused
        backup.append((3, b"own"))
    with pytest.raises(NotPrimary, match="stepped down"), backup.origin():  # nor applies a change of its own
        pytest.fail("a backup applied a change of its own")
    backup.applying = lambda: True  # what its primary shipped, applied here: stored already, nothing appended
    assert backup.append((3, b"primary's")) == 0
    backup.applying = lambda: False
    assert backup.lsn == 0
    backup.store(Shipped(1, 7, 3, b"one"))
    with pytest.raises(Diverged):
        backup.store(Shipped(3, 7, 3, b"gap"))
    with pytest.raises(InvalidArgument):
        backup.store(Shipped(2, 6, 3, b"older epoch"))
    backup.store(Shipped(2, 8, 3, b"newer epoch begins"))
    assert backup.history == [(7, 1), (8, 2)] and backup.last_epoch() == 8
    bad = pb.ReplicaFrame(epoch=8, records=[pb.ReplicaRecord(lsn=5, epoch=8), pb.ReplicaRecord(lsn=7, epoch=8)])
    with pytest.raises(InvalidArgument, match="do not follow"):
        frame_of(bad)
    with pytest.raises(InvalidArgument, match="pairs"):
        frame_of(pb.ReplicaFrame(epoch=8, history=[1, 2, 3]))


def test_shardps_cluster_runs_replica_groups_with_a_local_etcd(tmp_path, etcd):
    """``shardps cluster --replicas 2`` (etcd given, as the launcher would start it): groups in the cluster file,
    the client finds each primary, ``shardps stats`` shows roles and epochs."""
    import subprocess
    import sys

    cluster_file = tmp_path / "c.json"
    proc = subprocess.Popen([sys.executable, "-m", "shardps", "cluster", "--shards", "2", "--replicas", "2", "--etcd",
                             etcd.url, "--data-dir", str(tmp_path / "data"), "--cluster-file", str(cluster_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not cluster_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        data = json.loads(cluster_file.read_text())
        assert [len(g) for g in data["groups"]] == [2, 2] and data["etcd"] == etcd.url
        with Client.from_file(str(cluster_file)) as c:
            c.create_table("t", dim=4, num_embeddings=100, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
            c.push("t", torch.arange(100), torch.ones(100, 4), wait=True)
        # Stale reads: pulls go to the backups, which answer once they have applied the push.
        with Client.from_file(str(cluster_file), stale_reads=True) as c:
            deadline = time.monotonic() + 30
            while not torch.equal(c.pull("t", torch.arange(100)), -torch.ones(100, 4)):
                assert time.monotonic() < deadline, "the backups never showed the acknowledged push"
                time.sleep(0.1)
        served = {}
        for member in [m for g in data["groups"] for m in g]:
            with grpc.insecure_channel(member) as ch:
                info = ch.unary_unary("/shardps.v1.Shard/ShardInfo", pb.ShardInfoRequest.SerializeToString,
                                      pb.ShardInfoResponse.FromString)(pb.ShardInfoRequest(), timeout=10)
            served[info.replica.role] = served.get(info.replica.role, 0) + info.stats.pulls
        assert served["backup"] >= 2 and served["primary"] == 0, served
        out = subprocess.run([sys.executable, "-m", "shardps", "stats", "--cluster-file", str(cluster_file)],
                             capture_output=True, text=True, timeout=60).stdout
        assert out.count(": primary, epoch") == 2 and out.count(": backup, epoch") == 2, out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
