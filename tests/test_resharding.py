"""Live resharding: hash slots moved between running ``shardps serve`` processes while two clients push +1s with
SGD, through the real ``shardps cluster`` and ``shardps reshard`` commands and through the driver with processes
killed mid-move. The table must end equal to the exact push counts; a client with an old map is redirected; a
request naming a future or foreign slot map is refused. Every test is bounded and stops what it started."""

from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import subprocess
import sys
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
import torch
from shardps_client import SGD, Client, Initializer, SlotMovedError

from shardps.core import codec, pushread, wire
from shardps.core.slots import SlotMap
from shardps.core.specs import SyncPolicy
from shardps.server.ops.launcher import LocalCluster
from shardps.server.ops.resharding import Journal, Resharder, ShardCalls
from shardps.server.shard.move import Move
from shardps.v1 import shardps_pb2 as pb
from tests.procs import freeze

ROWS = 6000
DENSE = (64, 4)  # a dense tensor in 8 row chunks, moved chunk by chunk


class Trainers:
    """Two clients pushing +1 rows (and +1 to a dense tensor) with SGD(lr=1) until stopped; what they acknowledged."""

    def __init__(self, connect) -> None:
        self.counts = np.zeros(ROWS, np.int64)
        self.dense_pushes = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(connect, k), daemon=True) for k in range(2)]
        for t in self.threads:
            t.start()
        _running.append(self)

    def _run(self, connect, k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            with connect() as c:
                while not self.stop.is_set():
                    ids = rng.choice(ROWS, 256, replace=False)
                    c.push("t", torch.from_numpy(ids), torch.ones(256, 4))
                    c.push_dense("w", torch.ones(*DENSE))
                    with self.lock:
                        self.counts[ids] += 1
                        self.dense_pushes += 1
                c.flush()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.errors.append(e)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads), "a trainer did not stop within 120 s"
        assert not self.errors, self.errors

    def halt(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def check(self, c: Client) -> None:
        got = c.pull("t", torch.arange(ROWS))[:, 0].numpy()
        wrong = np.flatnonzero(got != -self.counts.astype(np.float32))
        assert not wrong.size, f"{wrong.size} rows off the exact counts, e.g. id {wrong[0]}: {got[wrong[0]]} vs " \
                               f"{-self.counts[wrong[0]]}"
        dense, _ = c.pull_dense("w")
        off = torch.nonzero((dense != -float(self.dense_pushes)).any(dim=1)).flatten().tolist()
        assert not off, f"dense rows {off} (chunks of 8 rows: {sorted({r // 8 for r in off})}) hold " \
                        f"{sorted(set(dense[off, 0].tolist()))}, not {-self.dense_pushes} pushes"


_running: list[Trainers] = []


@pytest.fixture(autouse=True)
def _stop_trainers():
    """A failed test stops its trainers too, before its cluster goes."""
    yield
    while _running:
        _running.pop().halt()


def _tables(c: Client) -> None:
    c.create_table("t", dim=4, num_embeddings=ROWS, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    c.register_dense("w", torch.zeros(*DENSE), optimizer=SGD(lr=1.0), chunk_bytes=8 * 4 * 4)


def _reshard(cluster_file: pathlib.Path, *args: str, timeout: float = 180) -> str:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "shardps", "reshard", "--cluster-file", str(cluster_file),
                        "--batch-slots", "2048", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"shardps reshard {' '.join(args)}: {time.monotonic() - t0:.1f} s")
    return r.stdout


def test_two_three_four_two_shards_under_two_training_clients_keep_exact_counts(tmp_path):
    """shardps cluster, then shardps reshard --add 1, --add 1, --remove 3, --remove 2 while two clients train."""
    cluster_file = tmp_path / "cluster.json"
    proc = subprocess.Popen([sys.executable, "-m", "shardps", "cluster", "--shards", "2", "--data-dir",
                             str(tmp_path / "data"), "--cluster-file", str(cluster_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not cluster_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "shardps cluster did not start"
            time.sleep(0.1)
        with Client.from_file(str(cluster_file)) as c:
            _tables(c)
        trainers = Trainers(lambda: Client.from_file(str(cluster_file)))
        time.sleep(1.0)
        out = _reshard(cluster_file, "--add", "1")
        assert "shards [2] joined" in out and "slots per shard [5462, 5461, 5461]" in out, out
        out = _reshard(cluster_file, "--add", "1")
        assert "slots per shard [4096, 4096, 4096, 4096]" in out, out
        # (30 s a shard: under a loaded suite a shard busy with two trainers answered stats after the default 5 s)
        stats = subprocess.run([sys.executable, "-m", "shardps", "stats", "--cluster-file", str(cluster_file),
                                "--interval", "0", "--timeout", "30"], capture_output=True, text=True, timeout=150)
        assert stats.stdout.count("owns 4096 of 16384 hash slots") == 4, stats.stdout + stats.stderr
        _reshard(cluster_file, "--remove", "3")
        out = _reshard(cluster_file, "--remove", "2", "--json")
        summary = json.loads(out[out.index("{"):])
        assert summary["active"] == [0, 1] and summary["slots_per_shard"][:2] == [8192, 8192], summary
        time.sleep(0.5)
        trainers.finish()
        data = json.loads(cluster_file.read_text())
        assert data["addresses"][2:] == ["", ""] and data["retired"] == [2, 3], data
        with Client.from_file(str(cluster_file)) as c:
            assert c.shard_info()[2:] == [None, None]
            trainers.check(c)
    finally:
        proc.terminate()
        proc.wait(60)


class DriverDied(Exception):
    """The driving command stopped here (a kill -9, as far as the shards can tell)."""


@pytest.mark.parametrize("victim,phase", [("source", "handed_over"), ("target", "prepared"),
                                          ("driver", "committed")])
def test_a_kill_mid_move_then_resume_keeps_exact_counts(tmp_path, victim, phase):
    """kill -9 of the source after its handover, of the target once prepared, of the driver right after the source
    committed: settled (rolled back or finished; the target asks its source by itself when the driver is gone) and
    resumed, the table holds every acknowledged push exactly once."""
    with LocalCluster(2, data_dir=str(tmp_path / "data"), log_dir=str(tmp_path / "logs")) as cluster:
        with Client(cluster.addresses) as c:
            _tables(c)
        two = list(cluster.addresses)  # what the trainers were given: the cluster before shard 2 joined
        trainers = Trainers(lambda: Client(two))
        cluster.add_shards(1)
        calls = ShardCalls(cluster.addresses, retry_s=30)
        killed = []

        def at(p: str, move: Move) -> None:
            if p != phase or killed:
                return
            killed.append(move.id)
            if victim == "driver":
                raise DriverDied(move.id)
            shard = move.source if victim == "source" else move.target
            cluster.kill(shard)
            cluster.restart(shard)
            calls.primary[shard] = cluster.procs[shard].address

        journal = Journal(tmp_path / "journal.json", batch_slots=2048)
        driver = Resharder(calls, journal, at=at)
        driver.ensure_lineage()
        try:
            driver.run([0, 1, 2])
            raise AssertionError("the driver went on through its kill")
        except (DriverDied, Exception) as e:  # noqa: BLE001
            assert killed, e
        if victim == "driver":  # the target asks its source, which committed: it activates by itself
            deadline = time.monotonic() + 30
            while calls.info(2).slots.moves:
                assert time.monotonic() < deadline, "the prepared target never settled with its source"
                time.sleep(0.2)
        resumed = Resharder(calls, Journal.load(journal.path))
        resumed.settle()
        resumed.run([0, 1, 2])
        assert resumed.map.slot_counts().tolist() == [5462, 5461, 5461]
        time.sleep(0.3)
        trainers.finish()
        with Client(cluster.addresses) as c:
            trainers.check(c)
        calls.close()


def test_kill9_of_the_reshard_command_then_resume(tmp_path):
    """shardps reshard killed with SIGKILL in the middle of its moves; shardps reshard --resume finishes. The cluster
    file lists each shard's members under "groups" too, as replica groups' do: the shard --add-address named must be
    listed there for --resume (it crashed with an IndexError when only "addresses" had it)."""
    cluster_file = tmp_path / "cluster.json"
    with LocalCluster(2, data_dir=str(tmp_path / "data"), log_dir=str(tmp_path / "logs")) as cluster:
        cluster.write_cluster_file(str(cluster_file))
        with Client(cluster.addresses) as c:
            _tables(c)
        two = list(cluster.addresses)
        trainers = Trainers(lambda: Client(two))
        cluster.add_shards(1)
        cluster.write_cluster_file(str(cluster_file))
        new = cluster.addresses[2]
        data = json.loads(cluster_file.read_text())
        data["addresses"] = data["addresses"][:2]  # as an operator would: the new shard named on the command line
        data["groups"] = [[a] for a in data["addresses"]]
        cluster_file.write_text(json.dumps(data))
        journal = pathlib.Path(str(cluster_file) + ".reshard.json")
        driver = subprocess.Popen([sys.executable, "-m", "shardps", "reshard", "--cluster-file", str(cluster_file),
                                   "--add-address", new, "--batch-slots", "256"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 60
            while True:  # kill it in the middle of a move (the journal names one), a few moves in
                state = json.loads(journal.read_text()) if journal.exists() else {}
                if state.get("move") and state.get("moved_slots", 0) >= 512:
                    freeze(driver.pid)  # frozen, it cannot finish the move before the kill lands
                    if json.loads(journal.read_text()).get("move"):  # (the journal is replaced whole: os.replace)
                        break
                    driver.send_signal(signal.SIGCONT)  # that move ended between the two reads: the next one
                assert driver.poll() is None and time.monotonic() < deadline, driver.stdout.read()
                time.sleep(0.005)
            driver.kill()
            driver.wait(10)
        finally:
            if driver.poll() is None:
                driver.kill()
        assert json.loads(journal.read_text())["move"], "the kill landed between moves"
        out = _reshard(cluster_file, "--resume")
        assert "settled 1 move(s) in flight" in out and "slots per shard [5462, 5461, 5461]" in out, out
        assert not journal.exists()
        assert json.loads(cluster_file.read_text())["groups"] == [[a] for a in cluster.addresses]
        time.sleep(0.3)
        trainers.finish()
        with Client(cluster.addresses) as c:
            trainers.check(c)


def _raw_push(address: str, ids: list[int], shard: int, epoch: int, map_id: str, num_shards: int) -> grpc.RpcError:
    req = wire.encode_push("t", np.ones((len(ids), 4), np.float32), pb.FLOAT32, ids=np.asarray(ids, np.int64),
                           shard_map=pb.ShardMap(shard_index=shard, num_shards=num_shards, map_epoch=epoch,
                                                 map_id=map_id))
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/shardps.v1.Shard/Push")(req, timeout=10)
    return e.value


def test_a_stale_client_is_redirected_and_future_or_foreign_maps_are_refused(tmp_path):
    with LocalCluster(2, data_dir=str(tmp_path / "data"), log_dir=str(tmp_path / "logs")) as cluster:
        with Client(cluster.addresses) as c:
            _tables(c)
            c.create_table("s", dim=2, sync=SyncPolicy(workers=1), optimizer=SGD(lr=1.0))
        stale = Client(cluster.addresses)  # routes by the 2-shard map of epoch 0 from here on
        old = stale._session.slots
        cluster.add_shards(1)
        calls = ShardCalls(cluster.addresses)
        driver = Resharder(calls, Journal(tmp_path / "journal.json", batch_slots=4096))
        driver.ensure_lineage()
        with pytest.raises(Exception, match="synchronous tables"):  # their steps do not move while training runs
            driver.run([0, 1, 2])
        with Client(cluster.addresses) as c:
            c.drop_table("s")
        driver = Resharder(calls, Journal(tmp_path / "journal.json", batch_slots=4096))
        driver.run([0, 1, 2])
        new = driver.map
        moved = np.flatnonzero(new.owner_of(np.arange(ROWS)) == 2)
        assert moved.size > 1000
        assert set(stale.shards_of(moved[:50]).tolist()) <= {0, 1}  # where its map still puts them
        # A push and a pull by the stale client land where the rows are now: it was redirected, once.
        ids = torch.from_numpy(moved[:50])
        stale.push("t", ids, torch.ones(50, 4), wait=True)
        assert stale._session.slots.epoch == new.epoch and stale.num_shards == 3
        assert (stale.shards_of(moved[:50]) == 2).all()  # its map now: the new shard's
        assert torch.equal(stale.pull("t", ids), -torch.ones(50, 4))
        stale.close()
        # A request routed by the old map to the old owner is refused with the new owner's address, not applied.
        src = int(old.owner_of(moved[:1])[0])
        before = calls.info(src).version
        e = _raw_push(cluster.addresses[src], [int(moved[0])], src, old.epoch, old.map_id, old.num_shards)
        kind = dict(e.trailing_metadata()).get("shardps-error-kind")
        redirect = dict(e.trailing_metadata()).get("shardps-redirect")
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and kind == "moved", e.details()
        assert redirect == cluster.addresses[2] and f"epoch {new.epoch}" in e.details(), (redirect, e.details())
        # A future epoch, another cluster's lineage: refused, nothing applied.
        owner = int(new.owner_of(moved[:1])[0])
        e = _raw_push(cluster.addresses[owner], [int(moved[0])], owner, new.epoch + 100, new.map_id, 3)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "from the future" in e.details(), e.details()
        e = _raw_push(cluster.addresses[owner], [int(moved[0])], owner, new.epoch, "another-cluster", 3)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "another cluster" in e.details(), e.details()
        assert calls.info(src).version == before
        with Client(cluster.addresses) as c:
            assert torch.equal(c.pull("t", ids), -torch.ones(50, 4))
        # Bad migration steps are refused, naming the problem; the map does not change.
        theirs = np.array([new.slots_of(2)[0]])  # shard 2's slot, which shard 0 cannot hand over
        fake = Move(uuid.uuid4().hex[:8], 0, 1, theirs, (), new.moved(theirs, 1))
        with pytest.raises(Exception, match="does not own slot"):
            calls.migrate(0, "out_begin", move_id=fake.id, move_json=json.dumps(fake.to_json()))
        with pytest.raises(Exception, match="would change what this shard owns"):
            calls.migrate(1, "install", map_json=json.dumps(new.moved(new.slots_of(1)[:3], 0).to_json()))
        with pytest.raises(Exception, match="not a slot map"):
            calls.migrate(1, "install", map_json='{"epoch": 9}')
        with pytest.raises(Exception, match="migration nope is unknown"):
            calls.migrate(0, "out_commit", move_id="nope")
        with pytest.raises(Exception, match="int64"):
            calls.migrate(2, "in_drop", move_id="nope", ids=codec.encode(np.zeros(2, np.float32)))
        assert SlotMap.from_json(json.loads(calls.info(1).slots.map_json)) == new
        calls.close()


def test_slot_moved_errors_reach_clients_that_cannot_reroute():
    """The client error a refusal of kind "moved" becomes names the owner (what a caller of raw RPCs gets)."""
    from shardps_client.errors import error_of

    err = error_of(grpc.StatusCode.FAILED_PRECONDITION, "id 3 is owned by shard 2", "a:1", "Push", "moved", "b:2")
    assert isinstance(err, SlotMovedError) and err.owner == "b:2"


@contextlib.contextmanager
def _two_shards_and_a_third_joining(tmp_path, *more_tables: str):
    """Two shards holding the test's tables (and ``more_tables``, like "t"), a third joined, and a driver to move
    slots to it: (cluster, the first two addresses, driver)."""
    with LocalCluster(2, data_dir=str(tmp_path / "data"), log_dir=str(tmp_path / "logs")) as cluster:
        two = list(cluster.addresses)
        with Client(two) as c:
            _tables(c)
            for name in more_tables:
                c.create_table(name, dim=4, num_embeddings=ROWS, optimizer=SGD(lr=1.0),
                               initializer=Initializer("zeros"))
        cluster.add_shards(1)
        calls = ShardCalls(cluster.addresses, retry_s=30)
        try:
            driver = Resharder(calls, Journal(tmp_path / "journal.json", batch_slots=4096))
            driver.ensure_lineage()
            yield cluster, two, driver
        finally:
            calls.close()


def test_a_push_batch_caught_by_a_handover_applies_each_push_exactly_once(tmp_path):
    """A PushBatch (deferred pushes, as ShardedOptimizer sends them) reaches the source during a handover: its first
    push (rows staying there) applies, its second (rows of the moving slots) waits, then is refused as moved. The
    batch's answer marks that push alone; the client sends it to the new owner. Each push applies once: a client
    that resent the whole batch would apply the first one twice."""
    with _two_shards_and_a_third_joining(tmp_path, "u") as (cluster, two, driver):
        client = Client(two)
        done: list[BaseException | None] = []

        def at(phase: str, move: Move) -> None:
            # Once: ``expected`` is set by the first call (``done`` only once the batch is answered, which on a busy
            # machine came after the plan's next handover, a dense chunk's with no slots).
            if phase != "handed_over" or expected or move.source != 0:
                return
            old = client._session.slots
            ids = np.arange(ROWS)
            on_source = ids[old.owner_of(ids) == 0]
            moving = on_source[np.isin(routing_slots(on_source), move.slots)]
            staying = on_source[~np.isin(routing_slots(on_source), move.slots)]
            assert moving.size and staying.size

            def send() -> None:
                try:
                    client.defer_pushes = True
                    client.push("t", torch.from_numpy(staying), torch.ones(staying.size, 4))
                    client.push("u", torch.from_numpy(moving), torch.ones(moving.size, 4))
                    client.defer_pushes = False
                    client.flush()
                    done.append(None)
                except BaseException as e:  # noqa: BLE001 - reported below
                    done.append(e)

            threading.Thread(target=send, daemon=True).start()
            time.sleep(0.6)  # the batch's first push applied, its second waiting at the handover
            expected.update(staying=staying, moving=moving)

        expected: dict[str, np.ndarray] = {}
        driver.at = at
        driver.run([0, 1, 2])
        deadline = time.monotonic() + 60
        while not done:
            assert time.monotonic() < deadline, "the batch was never answered"
            time.sleep(0.05)
        assert done[0] is None, done[0]
        client.close()
        with Client(cluster.addresses) as c:
            got_t = c.pull("t", torch.from_numpy(expected["staying"]))
            got_u = c.pull("u", torch.from_numpy(expected["moving"]))
        assert torch.equal(got_t, -torch.ones_like(got_t)), f"{int((got_t != -1).any(1).sum())} rows not pushed once"
        assert torch.equal(got_u, -torch.ones_like(got_u)), f"{int((got_u != -1).any(1).sum())} rows not pushed once"


def test_a_resend_of_a_push_waiting_at_a_handover_is_not_answered_as_a_duplicate(tmp_path):
    """A push (client id, seq) waits at the source during a handover; the same push comes again (a client that
    reconnected resends what was unanswered). The resend must not be answered as a duplicate while the first one
    waits: the first is then refused as moved, and a client told "duplicate" would never send it to the new
    owner. Both are answered as moved; resent there, the push applies once."""
    from shardps_client.planner import shard_map

    with _two_shards_and_a_third_joining(tmp_path) as (cluster, two, driver):
        client = Client(two)
        answers: dict[str, object] = {}
        sent: dict[str, np.ndarray] = {}

        def at(phase: str, move: Move) -> None:
            if phase != "handed_over" or sent or move.source != 0:
                return
            old = client._session.slots
            ids = np.arange(ROWS)
            moving = ids[(old.owner_of(ids) == 0) & np.isin(routing_slots(ids), move.slots)][:16]
            assert moving.size
            sent["ids"] = moving
            request = pb.PushRequest.FromString(wire.encode_push(
                "t", np.ones((moving.size, 4), np.float32), pb.FLOAT32, ids=moving, client_id="resender", seq=1,
                shard_map=shard_map(0, old)))
            channel = grpc.insecure_channel(two[0])
            push = channel.unary_unary("/shardps.v1.Shard/Push", request_serializer=pb.PushRequest.SerializeToString,
                                       response_deserializer=pb.PushResponse.FromString)

            def send(which: str) -> None:
                try:
                    answers[which] = push(request, timeout=60)
                except grpc.RpcError as e:
                    answers[which] = e

            first = threading.Thread(target=send, args=("first",), daemon=True)
            first.start()
            time.sleep(0.5)  # the first one waits at the handover
            second = threading.Thread(target=send, args=("resend",), daemon=True)
            second.start()
            time.sleep(0.5)
            assert "resend" not in answers, f"the resend was answered while its original waited: {answers['resend']}"

        driver.at = at
        driver.run([0, 1, 2])
        deadline = time.monotonic() + 60
        while len(answers) < 2:
            assert time.monotonic() < deadline, f"not both answered: {answers}"
            time.sleep(0.05)
        for which, answer in answers.items():
            assert isinstance(answer, grpc.RpcError), f"the {which} push was answered {answer}, not refused as moved"
            assert "refresh the slot map" in answer.details(), (which, answer.details())
        client.close()
        with Client(cluster.addresses) as c:  # nothing of it was applied anywhere: the client sends it again
            ids = torch.from_numpy(sent["ids"])
            assert torch.equal(c.pull("t", ids), torch.zeros(ids.shape[0], 4))
            c.push("t", ids, torch.ones(ids.shape[0], 4), wait=True)
            assert torch.equal(c.pull("t", ids), -torch.ones(ids.shape[0], 4))


def test_a_step_whose_dense_pull_moved_while_its_pushes_waited_applies_each_push_once(tmp_path):
    """A step's PushBatch (ShardedOptimizer's: pushes, and dense values asked back with them) reaches the source
    while a dense chunk it pushes to and reads is handed over: its row push applies, its dense push waits and is
    refused as moved (the client sends it to the new owner), then so is its dense read. The batch keeps the
    pushes' outcomes and leaves the pulls out; the step's dense values still come back (the client pulls them
    anew: it used to fail the step, "answered 0 of 4 dense pulls"), and each push applies once."""
    with _two_shards_and_a_third_joining(tmp_path) as (cluster, two, driver):
        client = Client(two)
        done: list = []
        expected: dict[str, np.ndarray] = {}

        def at(phase: str, move: Move) -> None:
            if phase != "handed_over" or expected or move.source != 0 or not any(n == "w" for n, _ in move.dense):
                return
            old = client._session.slots
            ids = np.arange(ROWS)
            on_source = ids[old.owner_of(ids) == 0]
            staying = on_source[~np.isin(routing_slots(on_source), move.slots)][:32]
            assert staying.size
            expected["staying"] = staying

            def send() -> None:
                try:
                    client.defer_pushes = True
                    client.push("t", torch.from_numpy(staying), torch.ones(staying.size, 4))
                    client.push_dense("w", torch.ones(*DENSE))  # its chunk that moves waits at the handover
                    pulled = client.send_pushes(pull_dense=["w"])
                    client.defer_pushes = False
                    assert pulled is not None
                    done.append(pulled.result())
                except BaseException as e:  # noqa: BLE001 - reported below
                    done.append(e)

            threading.Thread(target=send, daemon=True).start()
            time.sleep(0.6)  # the first push applied, the second waiting at the handover (the dense read after it)

        driver.at = at
        driver.run([0, 1, 2])
        assert expected, "no move of a dense chunk from shard 0"
        deadline = time.monotonic() + 60
        while not done:
            assert time.monotonic() < deadline, "the step was never answered"
            time.sleep(0.05)
        assert not isinstance(done[0], BaseException), done[0]
        assert done[0]["w"][0].shape == DENSE
        client.flush()
        client.close()
        with Client(cluster.addresses) as c:
            got = c.pull("t", torch.from_numpy(expected["staying"]))
            assert torch.equal(got, -torch.ones_like(got)), f"{int((got != -1).any(1).sum())} rows not pushed once"
            dense, _ = c.pull_dense("w")
            off = torch.nonzero((dense != -1).any(dim=1)).flatten().tolist()
            assert not off, f"dense rows {off} hold {sorted(set(dense[off, 0].tolist()))}, not one push"


def routing_slots(ids: np.ndarray) -> np.ndarray:
    from shardps.core.routing import slot_of_ids

    return slot_of_ids(ids).astype(np.int64)


def test_a_commit_whose_quorum_never_came_goes_forward_on_resume(tmp_path, etcd):
    """The source (a replica group, --ack quorum) logs a move's commit record, but its backup is dead: the wait for
    the quorum fails and the driver stops. The record is in the source's log and reaches the backup once it is
    back, so the move must go forward: --resume finds it committed and the target activates (rolling it back would
    leave the slots, once the backup replays the record, to a target that dropped their rows). Until the record
    reached a quorum, the source says nothing of the move (its status waits for the log): "committed" before then
    would let the target activate while a backup without the record could still take over the slots. Then the
    source's primary and the new shard's are killed with SIGKILL: each backup, promoted, agrees on the map and holds
    the rows the moves brought (they reached it through the replicated log), and the counts are exact."""
    with LocalCluster(2, data_dir=str(tmp_path / "data"), log_dir=str(tmp_path / "logs"), replicas=2,
                      etcd=etcd.url, serve_args=["--ack", "quorum", "--quorum-timeout", "2"]) as cluster:
        with Client(cluster.addresses) as c:
            _tables(c)
        two = list(cluster.addresses)
        trainers = Trainers(lambda: Client(two, retry_timeout=120))
        cluster.add_shards(1)
        calls = ShardCalls(cluster.addresses, retry_s=30)
        _find_primaries(calls, 3)
        calls.retry_s = 0  # the commit's failed quorum wait stops the driver at once
        killed: list[int] = []

        def at(phase: str, move: Move) -> None:
            if phase == "prepared" and not killed:
                calls.info(move.source)
                backup = next(k for k, p in enumerate(cluster.procs)
                              if p.index == move.source and p.address != calls.primary[move.source])
                cluster.kill(backup)
                killed.append(backup)

        journal = Journal(tmp_path / "journal.json", batch_slots=4096)
        driver = Resharder(calls, journal, at=at)
        driver.ensure_lineage()
        with pytest.raises(Exception, match="quorum"):
            driver.run([0, 1, 2])
        source = Move.from_json(journal.move).source
        with pytest.raises(Exception, match="quorum"):
            calls.migrate(source, "status", move_id=journal.move["id"])
        cluster.restart(killed[0])  # the backup is back: a quorum again
        calls.retry_s = 60
        assert calls.migrate(source, "status", move_id=journal.move["id"]).state == "committed"
        resumed = Resharder(calls, Journal.load(journal.path))
        resumed.settle()
        resumed.run([0, 1, 2])
        assert resumed.map.slot_counts().tolist() == [5462, 5461, 5461]
        for shard in (source, 2):  # each one's backup takes over: it has the moves' records (the rows moved in too)
            calls._find_primary(shard)
            primary = next(k for k, p in enumerate(cluster.procs) if p.address == calls.primary[shard])
            cluster.kill(primary)
            deadline = time.monotonic() + 30
            while True:
                calls.primary[shard] = next(p.address for k, p in enumerate(cluster.procs)
                                            if p.index == shard and k != primary)
                try:
                    info = calls.call(shard, "ShardInfo", pb.ShardInfoRequest(), retry_s=1)
                except Exception:  # noqa: BLE001 - not up yet
                    info = None
                if info is not None and info.replica.role == "primary":
                    break
                assert time.monotonic() < deadline, f"shard {shard}'s backup was never promoted"
                time.sleep(0.2)
            assert SlotMap.from_json(json.loads(info.slots.map_json)).slot_counts().tolist() == [5462, 5461, 5461]
            cluster.restart(primary)  # back as a backup: a quorum of 2 again
        time.sleep(0.5)
        trainers.finish()
        with Client(cluster.addresses) as c:
            trainers.check(c)
            for info in c.shard_info():
                assert SlotMap.from_json(json.loads(info.slots.map_json)).slot_counts().tolist() == [5462, 5461, 5461]
        calls.close()


def _find_primaries(calls: ShardCalls, shards: int, timeout: float = 30.0) -> None:
    """Point ``calls`` at every group's primary, waiting for any election still running (a new group's)."""
    deadline = time.monotonic() + timeout
    for s in range(shards):
        while calls.info(s).replica.role != "primary":
            assert time.monotonic() < deadline, f"shard {s} has no primary"
            time.sleep(0.2)
            calls._find_primary(s)


class _DriverKilled(Exception):
    """The driver stopping between two steps, as SIGKILL would stop it (no roll back)."""


def test_a_move_cut_short_while_copying_is_rolled_back_on_both_sides_when_a_backup_is_listed_first(tmp_path, etcd):
    """The campaign's reshard scenario (tests/chaos): the driver stopped while copying a move; the groups' cluster
    file lists a backup before the primary. Resuming, the driver must ask the source's primary how the move stands
    (a backup holds none of a source's moves in flight, it would say "unknown") and roll both sides back: it once
    rolled back the target only, and the source's copy held its slots for good ("its slots are moving already" at
    every resume after). Then the reshard finishes and every row keeps its value."""
    with LocalCluster(2, data_dir=str(tmp_path / "data"), log_dir=str(tmp_path / "logs"), replicas=2,
                      etcd=etcd.url, serve_args=["--ack", "quorum"]) as cluster:
        with Client(cluster.addresses) as c:
            _tables(c)
            ids = torch.arange(ROWS)
            c.push("t", ids, torch.ones(ROWS, 4))
            c.flush()
        cluster.add_shards(1)
        finder = ShardCalls(cluster.addresses, retry_s=30)
        _find_primaries(finder, 3)
        # each group listed backup first, as a cluster file written before a failover lists it
        backup_first = ["|".join(sorted(members, key=lambda a: a == finder.primary[s]))
                        for s, members in enumerate(finder.entries)]
        assert all(e.split("|")[0] != finder.primary[s] for s, e in enumerate(backup_first))
        finder.close()

        def at(phase: str, move: Move) -> None:
            if phase == "copied":
                raise _DriverKilled(move.id)

        calls = ShardCalls(backup_first, retry_s=30)
        journal = Journal(tmp_path / "journal.json", batch_slots=4096)
        driver = Resharder(calls, journal, at=at)
        driver.ensure_lineage()
        with pytest.raises(_DriverKilled):
            driver.run([0, 1, 2])
        cut = Move.from_json(journal.move)
        calls.close()

        calls = ShardCalls(backup_first, retry_s=30)  # the resumed command: a new process
        resumed = Resharder(calls, Journal.load(journal.path))
        assert resumed.settle() == 1
        for shard in (cut.source, cut.target):
            assert calls.migrate(shard, "status", move_id=cut.id).state == "aborted"
            assert not calls.info(shard).slots.moves, f"shard {shard} still holds a move in flight"
        resumed.run([0, 1, 2])
        assert resumed.map.slot_counts().tolist() == [5462, 5461, 5461]

        # The driver stopped right after a source (a group) committed: the target (a group) asks the source's
        # primary itself, and activates without any driver (ArrivalResolver; the source's address is its group's)
        def stop_after_commit(phase: str, move: Move) -> None:
            if phase == "committed":
                raise _DriverKilled(move.id)

        back = Resharder(calls, Journal(tmp_path / "back.json", batch_slots=4096), at=stop_after_commit)
        with pytest.raises(_DriverKilled) as stopped:
            back.run([0, 1])
        move_id = str(stopped.value)
        target = Move.from_json(back.journal.move).target
        deadline = time.monotonic() + 30
        while calls.migrate(target, "status", move_id=move_id).state != "active":
            assert time.monotonic() < deadline, "the target never activated a move its source committed"
            time.sleep(0.2)
        calls.close()
        with Client(cluster.addresses) as c:
            got = c.pull("t", ids)[:, 0].numpy()
            assert (got == -1).all(), f"{int((got != -1).sum())} rows lost their push"


@pytest.mark.parametrize("restart", ["replaying the log", "from a checkpoint"])
def test_a_push_a_leaving_shard_applied_unanswered_is_not_applied_again_where_its_rows_went(tmp_path, restart):
    """docs/resharding.md#exactly-once-across-shards: a push shard 2 applied, whose answer its client never got, is
    planned again by the client once shard 2 has left (its slots moved to shards 0 and 1), naming shard 2 and its
    seq there. The new owners got shard 2's records of applied pushes with the slots, kept them across a kill -9
    (through their log, or a checkpoint), and answer the push as a duplicate: its rows hold it once. Planned again
    without naming shard 2, the same push applies a second time (what the test would catch)."""
    from shardps_client import planner

    with _two_shards_and_a_third_joining(tmp_path) as (cluster, two, driver):
        driver.run([0, 1, 2])
        with Client(cluster.addresses, retry_timeout=60) as c:
            session = c._session
            ids = np.arange(ROWS)
            rows = ids[session.slots.owner_of(ids) == 2][:64]
            calls = planner.push_plan(session.catalog.table("t"), rows, np.ones((rows.size, 4), np.float32),
                                      session.slots, pb.FLOAT32, session.max_message_bytes, None, session.client_id,
                                      session.next_seq)
            assert [call[0] for call in calls] == [2]
            assert not session.transport.submit(*calls[0]).result(timeout=30).duplicate  # applied by shard 2 ...
            driver.run([0, 1])  # ... which then leaves, its answer (as far as the client knows) lost
            if restart == "from a checkpoint":
                c.checkpoint()
            for i in (0, 1):
                cluster.kill(i)
                cluster.restart(i)
            again = session.replan(calls[0], None, True)
            assert {call[0] for call in again} <= {0, 1} and again
            assert all(pushread.decode_push(wire.unframe(call[2])[1], dense=False).origins ==
                       ((2, pushread.decode_push(wire.unframe(calls[0][2])[1], dense=False).seq),) for call in again)
            answers = [session.transport.submit(*call).result(timeout=60) for call in again]
            assert all(a.duplicate for a in answers), answers
            assert torch.equal(c.pull("t", torch.from_numpy(rows)), -torch.ones(rows.size, 4))
            for call in session.replan(calls[0], None, False):  # without the origin: applied once more
                assert not session.transport.submit(*call).result(timeout=60).duplicate
            assert torch.equal(c.pull("t", torch.from_numpy(rows)), -2 * torch.ones(rows.size, 4))
        from shardps.core.errors import ShardError

        with pytest.raises(ShardError, match="applied_json is not records of applied pushes"):
            driver.calls.migrate(0, "in_prepare", move_id="m", applied_json='{"2": {"c": [1]}}')


def _member_reads(cluster: LocalCluster, member: int, ids: torch.Tensor) -> np.ndarray:
    """Rows of ``ids`` as ``member`` alone serves them for its group (the campaign's reading of each member)."""
    groups: dict[int, list[str]] = {}
    for p in cluster.procs:
        groups.setdefault(p.index, []).append(p.address)
    entries = ["|".join(groups[g]) for g in sorted(groups)]
    entries[cluster.procs[member].index] = cluster.procs[member].address
    with Client(entries, timeout=10, retry_timeout=5) as c:
        return c.pull("t", ids).numpy()


def test_a_target_primary_deposed_after_logging_an_activation_unacknowledged_follows_its_successor(tmp_path, etcd):
    """The campaign's reshard scenario (once in CI): the target's primary logs a move's activation, its quorum does
    not come (its backup is frozen), and it is deposed. The backup received the record, takes over and owns the
    slots. The old primary then follows it from where its log ends, past the activation, so its state must hold the
    activation: it made a step's change only once the record was acknowledged, and so never made this one; it
    waited 15 s at every push of its successor's to the slots (for an arrival nothing would settle), and at every
    read of them. Every change a move logs is now made as it is logged: the old primary applies its successor's
    push to the slots and serves the same rows."""
    with LocalCluster(2, data_dir=str(tmp_path / "data"), log_dir=str(tmp_path / "logs"), replicas=2,
                      etcd=etcd.url, serve_args=["--ack", "quorum", "--quorum-timeout", "1"]) as cluster:
        with Client(cluster.addresses) as c:
            _tables(c)
        cluster.add_shards(1)
        calls = ShardCalls(cluster.addresses, retry_s=30)
        _find_primaries(calls, 3)

        def at(phase: str, move: Move) -> None:
            if phase == "committed":
                raise _DriverKilled(move.id)

        driver = Resharder(calls, Journal(tmp_path / "journal.json", batch_slots=4096), at=at)
        driver.ensure_lineage()
        with pytest.raises(_DriverKilled):
            driver.run([0, 1, 2])
        move = Move.from_json(driver.journal.move)
        members = [k for k, p in enumerate(cluster.procs) if p.index == move.target]
        old = next(k for k in members if cluster.procs[k].address == calls.primary[move.target])
        new = next(k for k in members if k != old)

        def info(k: int) -> pb.ShardInfoResponse:
            return calls._method(cluster.procs[k].address, "ShardInfo")(pb.ShardInfoRequest(), timeout=5)

        freeze(cluster.procs[new].popen.pid)
        try:
            with pytest.raises(Exception, match="quorum"):
                calls.migrate(move.target, "in_activate", move_id=move.id, retry_s=0)
            logged = info(old).replica.lsn  # the activation's record is its last
            freeze(cluster.procs[old].popen.pid)
        finally:
            cluster.procs[new].popen.send_signal(signal.SIGCONT)
        try:
            deadline = time.monotonic() + 30
            while info(new).replica.lsn < logged or info(new).replica.role != "primary":
                assert time.monotonic() < deadline, "the backup did not store the activation and take over"
                time.sleep(0.1)
        finally:
            cluster.procs[old].popen.send_signal(signal.SIGCONT)
        ids = torch.from_numpy(np.flatnonzero(np.isin(routing_slots(np.arange(ROWS)), move.slots)))
        assert ids.numel() > 100
        with Client(cluster.addresses, retry_timeout=60) as c:
            c.push("t", ids, torch.ones(ids.numel(), 4), wait=True)  # acknowledged once the old primary stored it
        deadline = time.monotonic() + 30
        while (info(old).replica.role, info(old).replica.lsn) != ("backup", info(new).replica.lsn):
            assert time.monotonic() < deadline, f"the old primary did not catch up: {info(old).replica}"
            time.sleep(0.1)
        t0 = time.monotonic()
        rows = {k: _member_reads(cluster, k, ids) for k in (new, old)}
        assert time.monotonic() - t0 < 10, "a member's read of the moved slots waited for an arrival"
        assert (rows[new][:, 0] == -1).all()
        np.testing.assert_array_equal(rows[old], rows[new])
        calls.close()


def test_a_whole_copy_replaces_the_moves_a_member_had_in_flight_with_their_marks():
    """A deposed primary that gets a whole copy of its successor takes the copy's slot state for its own: moves it
    had in flight that the copy does not hold go, and so do their marks. They used to stay (the copy's moves were
    added to them): requests for a move's slots arriving here waited 15 s for an outcome that nothing here would
    ever settle, instead of being told where the slots are. The shards here are in this process (the state a copy
    replaces is not visible from outside until a request waits on it)."""
    from shardps.core.errors import Moved, WrongShard
    from shardps.core.optim import SGD as ServerSGD
    from shardps.core.specs import Initializer as Init
    from shardps.core.specs import TableSpec
    from shardps.server.shard.facade import Shard, ShardConfig

    successor, deposed = Shard(ShardConfig(1, 2)), Shard(ShardConfig(1, 2))
    for s in (successor, deposed):
        s.create_table(TableSpec("t", 4, ROWS, ServerSGD(lr=1.0), Init("zeros")))
    slots = np.arange(0, 64, dtype=np.int64) * 2  # shard 0's
    cur = deposed.slots.map
    assert (cur.owners[slots] == 0).all()
    move = Move("m", 0, 1, slots, (), cur.moved(slots, 1))
    deposed.migrations.in_begin(move)
    deposed.migrations.in_prepare("m")
    ids = np.flatnonzero(np.isin(routing_slots(np.arange(ROWS)), slots))
    assert deposed.slots.blocked(deposed.registry.find("t").spec, ids, write=False) == "wait"
    meta, arrays, _ = successor.snapshot()
    deposed.load_state(meta, arrays)
    assert deposed.migrations.status("m") == "unknown" and not deposed.slots.arriving_any()
    t0 = time.monotonic()
    with pytest.raises((Moved, WrongShard), match="shard 0"):  # told at once where the slots are
        deposed.pull("t", ids)
    assert time.monotonic() - t0 < 5
