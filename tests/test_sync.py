"""Synchronous steps (aggregators, stragglers, leaving workers) and bounded staleness."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from shardps_client import SGD, Client, SyncPolicy, SyncStepError, planner
from shardps_client.errors import InvalidArgumentError

from shardps.core.specs import Initializer
from tests.conftest import run_workers, running_cluster


def test_two_workers_mean_equals_one_worker_on_both_batches():
    with running_cluster(2) as servers:
        addresses = [s.address for s in servers]
        with Client(addresses) as c:
            c.create_table("e", dim=4, num_embeddings=100, optimizer=SGD(lr=0.5), initializer=Initializer("normal", seed=1),
                           sync=SyncPolicy(workers=2, aggregator="mean"))
            c.register_dense("w", torch.ones(3, 4), optimizer=SGD(lr=0.5), sync=SyncPolicy(workers=2))
            w0 = c.pull("e", torch.arange(100))
        gen = torch.Generator().manual_seed(0)
        batches = [[torch.randint(0, 100, (16,), generator=gen) for _ in range(2)] for _ in range(4)]

        def body(c: Client, rank: int) -> None:
            for step in range(4):
                ids = batches[step][rank]
                rows = c.pull("e", ids).requires_grad_()
                w = c.pull_dense("w")[0].requires_grad_()
                loss = ((rows @ w.T).tanh() ** 2).mean()  # per-worker mean loss
                loss.backward()
                c.push("e", ids, rows.grad)
                c.push_dense("w", w.grad)
                c.flush()

        assert not run_workers(addresses, 2, body)
        # Reference: one worker, both batches together, torch.optim.SGD.
        emb = torch.nn.Parameter(w0.clone())
        w = torch.nn.Parameter(torch.ones(3, 4))
        opt = torch.optim.SGD([emb, w], lr=0.5)
        for step in range(4):
            ids = torch.cat(batches[step])
            opt.zero_grad()
            ((emb[ids] @ w.T).tanh() ** 2).mean().backward()
            opt.step()
        # The mean of two 16-sample means against one 32-sample mean: the same math, summed in
        # another order; 4 steps through tanh drift by a few 1e-6 (seen once in 26 runs at 1e-6).
        with Client(addresses) as c:
            torch.testing.assert_close(c.pull("e", torch.arange(100)), emb.detach(), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(c.pull_dense("w")[0], w.detach(), rtol=1e-4, atol=1e-5)


def test_median_ignores_one_wild_worker():
    with running_cluster(2) as servers:
        addresses = [s.address for s in servers]
        with Client(addresses) as c:
            c.register_dense("m", torch.zeros(8), optimizer=SGD(lr=1.0), sync=SyncPolicy(workers=3, aggregator="median"))

        def body(c: Client, rank: int) -> None:
            for _ in range(5):
                honest = torch.full((8,), 1.0 + 0.1 * rank)
                c.push_dense("m", honest if rank < 2 else torch.full((8,), 1e6), wait=True)

        assert not run_workers(addresses, 3, body)
        with Client(addresses) as c:
            # median of {1.0, 1.1, 1e6} = 1.1 per step: the wild worker moved nothing.
            torch.testing.assert_close(c.pull_dense("m")[0], torch.full((8,), -5.5))


def test_trimmed_mean_drops_extremes():
    with running_cluster(1) as servers:
        addresses = [s.address for s in servers]
        with Client(addresses) as c:
            c.register_dense("t", torch.zeros(2), optimizer=SGD(lr=1.0),
                             sync=SyncPolicy(workers=4, aggregator="trimmed_mean", trim_fraction=0.25))
        values = [-100.0, 1.0, 3.0, 100.0]
        assert not run_workers(addresses, 4, lambda c, r: c.push_dense("t", torch.full((2,), values[r]), wait=True))
        with Client(addresses) as c:
            torch.testing.assert_close(c.pull_dense("t")[0], torch.full((2,), -2.0))


def test_straggler_proceed_reports_late_worker():
    with running_cluster(1) as servers:
        addresses = [s.address for s in servers]
        with Client(addresses) as c:
            c.register_dense("p", torch.zeros(2), optimizer=SGD(lr=1.0),
                             sync=SyncPolicy(workers=2, timeout_s=0.5, on_timeout="proceed"))
        reports = {}
        first_step_done = threading.Event()

        def body(c: Client, rank: int) -> None:
            if rank == 1:  # misses step 1: pushes once it went ahead without it
                assert first_step_done.wait(60), "rank 0's step never proceeded"
            c.push_dense("p", torch.full((2,), 1.0 + rank), wait=True)
            if rank == 0:
                first_step_done.set()
            reports[rank] = list(c.sync_reports)

        assert not run_workers(addresses, 2, body)
        assert reports[0] == [("p", [1], False)]  # step applied without rank 1
        assert reports[1] == [("p", [], True)]  # rank 1's push came late and was dropped
        with Client(addresses) as c:
            torch.testing.assert_close(c.pull_dense("p")[0], torch.full((2,), -1.0))


def test_straggler_fail_policy_fails_the_step():
    with running_cluster(1) as servers:
        addresses = [s.address for s in servers]
        with Client(addresses) as c:
            c.register_dense("f", torch.zeros(2), optimizer=SGD(lr=1.0),
                             sync=SyncPolicy(workers=2, timeout_s=0.3, on_timeout="fail"))
        with Client(addresses, rank=0, world_size=2) as c:
            with pytest.raises(SyncStepError, match=r"sync step 1 of f failed: no push from ranks \[1\]"):
                c.push_dense("f", torch.ones(2), wait=True)
            torch.testing.assert_close(c.pull_dense("f")[0], torch.zeros(2))


def test_worker_that_leaves_does_not_hang_the_others():
    with running_cluster(2) as servers:
        addresses = [s.address for s in servers]
        with Client(addresses) as c:
            c.create_table("l", dim=2, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                           sync=SyncPolicy(workers=2, timeout_s=60, on_timeout="wait"))

        def body(c: Client, rank: int) -> None:
            steps = 2 if rank == 1 else 5  # rank 1 leaves (closes its client) after 2 steps
            for _ in range(steps):
                c.push("l", torch.arange(10), torch.ones(10, 2), wait=True)

        t0 = time.monotonic()
        assert not run_workers(addresses, 2, body)
        assert time.monotonic() - t0 < 30  # far below the 60 s straggler timeout
        with Client(addresses) as c:
            torch.testing.assert_close(c.pull("l", torch.arange(10)), torch.full((10, 2), -5.0))


def test_silent_worker_counts_as_gone(tmp_path):
    from shardps.server.rpc import ServerConfig, ShardServer
    from shardps.server.shard.facade import ShardConfig

    with ShardServer(ShardConfig(0, 1, worker_timeout_s=1.0), ServerConfig()).start() as server:
        with Client([server.address]) as c:
            c.register_dense("s", torch.zeros(2), optimizer=SGD(lr=1.0), sync=SyncPolicy(workers=2, timeout_s=60))
        with Client([server.address], rank=0, world_size=2) as c:
            t0 = time.monotonic()
            c.push_dense("s", torch.ones(2), wait=True)  # rank 1 never shows up
            assert time.monotonic() - t0 < 10
            assert list(c.sync_reports) == [("s", [1], False)]


def test_ssp_never_lets_a_worker_run_more_than_k_ahead():
    k = 2
    with running_cluster(2) as servers:
        addresses = [s.address for s in servers]
        with Client(addresses) as c:
            c.create_table("ssp", dim=2, num_embeddings=10, optimizer=SGD(lr=0.1))
        clocks = [0, 0]
        lock = threading.Lock()
        worst = [0]

        def body(c: Client, rank: int) -> None:
            for _ in range(12):
                rows = c.pull("ssp", torch.arange(10))
                with lock:  # at every pull, compare with the other worker's completed steps
                    worst[0] = max(worst[0], c.clock - clocks[1 - rank])
                if rank == 1:
                    time.sleep(0.1)  # the slow worker
                c.push("ssp", torch.arange(10), torch.ones_like(rows))
                with lock:
                    clocks[rank] += 1
                c.advance_clock()

        assert not run_workers(addresses, 2, body, ssp_bound=k)
        assert 1 <= worst[0] <= k  # the fast worker did run ahead, but never by more than k


def test_a_worker_without_ssp_bound_reports_its_clock_at_a_bounded_rate_and_its_clock_still_arrives():
    """Under ssp_bound a step's clock goes to the shards at once (the test above); without it, the heartbeat thread
    reports it within ``CLOCK_REPORT_S`` (a heartbeat per shard per step was most of a DLRM shard's gRPC work),
    also after the last step: another worker's barrier on it returns, with liveness heartbeats too rare to carry
    it and the shard slow to declare a silent worker gone."""
    from shardps_client import worker

    from shardps.server.rpc import ServerConfig, ShardServer
    from shardps.server.shard.facade import ShardConfig
    from tests.test_metrics import scrape, value

    with ShardServer(ShardConfig(0, 1, worker_timeout_s=600.0), ServerConfig(metrics_port=0)).start() as server:
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with Client([server.address], rank=0, world_size=2, heartbeat_s=300) as a, \
                Client([server.address], rank=1, world_size=2, heartbeat_s=300) as b:
            steps = 300
            before = value(scrape(url), "shardps_requests_total", method="Heartbeat")
            t0 = time.monotonic()
            for _ in range(steps):
                a.advance_clock()
                b.advance_clock()
            a.barrier(timeout=60)  # b's last clock (300) reaches the shard by its heartbeat thread
            b.barrier(timeout=60)
            sent = value(scrape(url), "shardps_requests_total", method="Heartbeat") - before
            spent = time.monotonic() - t0
            # Per worker: a report per CLOCK_REPORT_S tick, the barrier's own calls (one, then one per wait of up
            # to 1 s), with room to spare; a report per step would be 600.
            bound = 2 * (3 + spent / worker.CLOCK_REPORT_S + 2 * (spent + 1))
            assert sent <= bound, (sent, bound, spent)


def test_a_step_split_into_several_parts_per_shard_completes_without_waiting_out_the_timeout():
    """Pushes over the message limit go in several parts per shard, in order on one stream:
    only a rank's last part may wait for the step, or its later parts never arrive."""
    dim, rows = 32, 4000
    with running_cluster(2) as servers:
        addresses = [s.address for s in servers]
        with Client(addresses) as c:
            c.create_table("big", dim=dim, num_embeddings=rows, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                           sync=SyncPolicy(workers=2, aggregator="sum", timeout_s=120, on_timeout="fail"))
        ids = torch.arange(rows)
        parts_seen: list[int] = []

        def body(c: Client, rank: int) -> None:
            parts_seen.append(-(-rows // 2 // planner.rows_per_message(c.max_message_bytes, dim, c.wire_dtype)))
            for _step in range(2):
                c.push("big", ids, torch.full((rows, dim), float(rank + 1)))
                c.flush()

        t0 = time.monotonic()
        # ~64 KB messages: each rank's 2,000 rows per shard go in 4 parts.
        assert not run_workers(addresses, 2, body, max_message_bytes=64 * 1024)
        assert min(parts_seen) >= 3
        assert time.monotonic() - t0 < 60, "a step waited for its straggler timeout"
        with Client(addresses) as c:
            # Two steps, each the sum of both ranks' gradients (1 + 2), at lr 1.
            torch.testing.assert_close(c.pull("big", ids), torch.full((rows, dim), -6.0))


def test_a_worker_started_again_in_its_rank_is_live_at_its_own_clock_and_the_old_ones_leaving_is_ignored():
    """A rank's leaving was for good: a worker started again in the rank (torchrun's restart) stayed gone, and its
    peers' barriers and SSP waits did not wait for it. Each client's heartbeats carry its incarnation: another
    incarnation is a new worker in the rank, live at its own clock; the old incarnation's late leaving is ignored."""
    import grpc

    from shardps.server.rpc import ServerConfig, ShardServer
    from shardps.server.shard.facade import ShardConfig
    from shardps.v1 import shardps_pb2 as pb
    from shardps.v1 import shardps_pb2_grpc as pb_grpc

    with ShardServer(ShardConfig(0, 1, worker_timeout_s=600.0), ServerConfig()).start() as server, \
            grpc.insecure_channel(server.address) as ch:
        beat = pb_grpc.ShardStub(ch).Heartbeat

        def view() -> tuple[int, list[int], list[int]]:  # as rank 1 sees the group (no incarnation: changes nothing)
            r = beat(pb.HeartbeatRequest(rank=1, world_size=2, clock=3), timeout=10)
            return r.min_clock, list(r.live_ranks), list(r.gone_ranks)

        with Client([server.address], rank=0, world_size=2, heartbeat_s=300) as first:
            for _ in range(5):
                first.advance_clock()
            first.worker.heartbeat()  # (its clock 5 on the shard now)
            old = first.worker.incarnation
        assert view() == (3, [1], [0])  # it left
        with Client([server.address], rank=0, world_size=2, heartbeat_s=300) as again:
            assert again.worker.incarnation != old
            assert view() == (0, [0, 1], [])  # live again, at its own clock (0), not the old one's 5
            # the old worker's leaving, arriving late, does not remove the new one
            beat(pb.HeartbeatRequest(rank=0, world_size=2, leaving=True, incarnation=old), timeout=10)
            assert view() == (0, [0, 1], [])
            again.advance_clock()
            again.worker.heartbeat()
            assert view() == (1, [0, 1], [])
            assert again.advance_clock(steps=9) == 10  # a worker resuming from a checkpoint resumes its clock
            again.worker.heartbeat()
            assert view() == (3, [0, 1], [])
            for bad in (-1, 1.5, True, "2"):
                with pytest.raises(InvalidArgumentError, match="steps"):
                    again.advance_clock(bad)
            assert again.advance_clock(0) == 10  # (a checkpoint of step 0)
            assert again.advance_clock(np.int64(2)) == again.advance_clock(torch.tensor(0)) == 12
        assert view() == (3, [1], [0])  # and its own leaving counts


@pytest.mark.parametrize("incarnations", [True, False])
def test_a_late_synchronous_push_of_a_worker_that_left_does_not_bring_its_rank_back(incarnations):
    """A synchronous push counts its rank live, and carries no incarnation: a late one of a worker that had left
    brought its rank back, and the others' steps and barriers waited for a worker that was gone. A client made again
    in the rank takes it with its first heartbeat, before any push, so a push to a rank whose client left under an
    incarnation is a late one now, and changes nothing. A rank whose heartbeats gave no incarnation (an older client,
    here raw heartbeats) is brought back by it as before."""
    import grpc

    from shardps.core import codec
    from shardps.server.rpc import ServerConfig, ShardServer
    from shardps.server.shard.facade import ShardConfig
    from shardps.v1 import shardps_pb2 as pb
    from shardps.v1 import shardps_pb2_grpc as pb_grpc

    with ShardServer(ShardConfig(0, 1, worker_timeout_s=600.0), ServerConfig()).start() as server, \
            grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.ShardStub(ch)
        beat, push = stub.Heartbeat, stub.Push

        def gone() -> list[int]:  # as rank 1 sees the group
            return list(beat(pb.HeartbeatRequest(rank=1, world_size=2), timeout=10).gone_ranks)

        with Client([server.address]) as c:
            c.create_table("s", dim=2, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                           sync=SyncPolicy(workers=2, timeout_s=60, on_timeout="proceed"))
        if incarnations:
            with Client([server.address], rank=0, world_size=2, heartbeat_s=300):
                pass
        else:
            beat(pb.HeartbeatRequest(rank=0, world_size=2), timeout=10)
            beat(pb.HeartbeatRequest(rank=0, world_size=2, leaving=True), timeout=10)
        assert gone() == [0]
        # a late push of rank 0's (the first of two parts: recorded, and answered at once)
        push(pb.PushRequest(table="s", ids=codec.encode(np.array([0], np.int64)),
                            grads=codec.encode(np.ones((1, 2), np.float32)), client_id="late", seq=1,
                            sync=pb.SyncPart(step=1, rank=0, part=0, parts=2)), timeout=10)
        assert gone() == ([0] if incarnations else [])  # (the old code: [] both times)
        if incarnations:
            with Client([server.address], rank=0, world_size=2, heartbeat_s=300):
                assert gone() == []  # a client made again in the rank takes it
            assert gone() == [0]


def test_a_second_client_in_a_live_workers_rank_changes_nothing_and_a_silent_ones_rank_passes_on():
    """Incarnations have no order: another client in a rank takes it only once the rank's client left or was silent
    for the shard's worker timeout. A second client of a live worker (an evaluation's, reading RANK as its trainer
    does) neither moves the rank's clock nor removes the rank when it closes; a worker started again after a crash
    (no leaving) takes the rank once the old one's heartbeats stopped for the timeout."""
    import grpc

    from shardps.server.rpc import ServerConfig, ShardServer
    from shardps.server.shard.facade import ShardConfig
    from shardps.v1 import shardps_pb2 as pb
    from shardps.v1 import shardps_pb2_grpc as pb_grpc

    timeout = 3.0  # (generous: the sends before the loop come within it of the trainer's, on a busy machine too)
    with ShardServer(ShardConfig(0, 1, worker_timeout_s=timeout), ServerConfig()).start() as server, \
            grpc.insecure_channel(server.address) as ch:
        beat = pb_grpc.ShardStub(ch).Heartbeat

        def send(incarnation: int, clock: int, leaving: bool = False) -> tuple[int, list[int], list[int]]:
            r = beat(pb.HeartbeatRequest(rank=0, world_size=1, clock=clock, leaving=leaving, incarnation=incarnation),
                     timeout=10)
            return r.min_clock, list(r.live_ranks), list(r.gone_ranks)

        assert send(11, 120) == (120, [0], [])  # the trainer
        assert send(22, 0) == (120, [0], [])  # a second client in its rank: the trainer's clock stands
        assert send(22, 0, leaving=True) == (120, [0], [])  # and its leaving does not remove the trainer
        assert send(11, 121) == (121, [0], [])
        deadline = time.monotonic() + 30
        while send(33, 0) != (0, [0], []):  # the trainer crashed (it sends nothing); started again as 33
            assert time.monotonic() < deadline, "the silent worker's rank never passed on"
            time.sleep(timeout / 4)
        assert send(11, 122) == (0, [0], [])  # the old one's late heartbeat changes nothing now
        assert send(11, 122, leaving=True) == (0, [0], [])
        assert send(33, 1, leaving=True) == (0, [], [0])  # the new one's own leaving counts (no live rank: 0)


def test_a_later_torchrun_generation_takes_a_rank_at_once_and_an_earlier_ones_heartbeats_change_nothing():
    """torchrun stops a whole group before it starts it again (``TORCHELASTIC_RESTART_COUNT`` one higher): a client of
    a later generation takes its rank at once, at its own clock, where one of the same generation waits for the
    rank's client to leave or time out (60 s here, never reached). The earlier generation's late heartbeats and
    leaving change nothing; a second client of the new generation's live worker changes nothing either."""
    import grpc

    from shardps.server.rpc import ServerConfig, ShardServer
    from shardps.server.shard.facade import ShardConfig
    from shardps.v1 import shardps_pb2 as pb
    from shardps.v1 import shardps_pb2_grpc as pb_grpc

    with ShardServer(ShardConfig(0, 1, worker_timeout_s=60), ServerConfig()).start() as server, \
            grpc.insecure_channel(server.address) as ch:
        beat = pb_grpc.ShardStub(ch).Heartbeat

        def send(incarnation: int, generation: int, clock: int,
                 leaving: bool = False) -> tuple[int, list[int], list[int]]:
            r = beat(pb.HeartbeatRequest(rank=0, world_size=1, clock=clock, leaving=leaving, incarnation=incarnation,
                                         generation=generation), timeout=10)
            return r.min_clock, list(r.live_ranks), list(r.gone_ranks)

        assert send(11, 0, 120) == (120, [0], [])  # the trainer
        assert send(22, 0, 0) == (120, [0], [])  # another client of the same generation: it waits
        assert send(33, 1, 0) == (0, [0], [])  # the group started again: the rank is the new client's at once
        assert send(11, 0, 122) == (0, [0], [])  # the old trainer's late heartbeat changes nothing
        assert send(11, 0, 122, leaving=True) == (0, [0], [])  # nor its leaving
        assert send(44, 1, 9) == (0, [0], [])  # a second client of the new worker changes nothing
        assert send(33, 1, 3) == (3, [0], [])
        assert send(33, 1, 3, leaving=True) == (0, [], [0])  # the new one's own leaving counts


def test_a_client_carries_torchruns_restart_count(monkeypatch):
    """A client's heartbeats carry ``TORCHELASTIC_RESTART_COUNT`` (0 without it); a value that is no count is
    refused, naming the variable."""
    from shardps_client.worker import WorkerClock

    def clock() -> WorkerClock:
        return WorkerClock(None, list, 0, 1, None, lambda f: f())  # type: ignore[arg-type]

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert clock().generation == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert clock().generation == 3
    for bad in ("-1", "x"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", bad)
        with pytest.raises(InvalidArgumentError, match="TORCHELASTIC_RESTART_COUNT"):
            clock()


def test_an_ssp_wait_has_a_deadline(monkeypatch):
    """A worker held back by bounded staleness behind a live worker that never advances
    gives up after the SSP wait's deadline, with ShardTimeoutError, instead of waiting for ever."""
    from shardps_client import ShardTimeoutError, worker

    monkeypatch.setattr(worker, "SSP_WAIT_S", 1.5)
    with running_cluster(1) as servers:
        addresses = [s.address for s in servers]
        with Client(addresses, rank=1, world_size=2, heartbeat_s=0.2), \
                Client(addresses, rank=0, world_size=2, ssp_bound=0, heartbeat_s=0.2) as fast:
            fast.create_table("t", dim=4, num_embeddings=10)
            fast.pull("t", [1])  # clock 0: not ahead
            fast.advance_clock()
            t0 = time.monotonic()
            with pytest.raises(ShardTimeoutError, match="ssp_bound 0"):
                fast.pull("t", [1])
            assert 1.4 <= time.monotonic() - t0 < 10


def test_a_refused_push_does_not_use_up_a_step_number():
    """A push the client refuses (an unknown wire dtype) leaves the worker's step count alone,
    so its next push still meets the other workers' pushes of the same step."""
    from shardps_client import InvalidArgumentError

    with running_cluster(1) as servers:
        addresses = [s.address for s in servers]
        with Client(addresses) as c:
            c.create_table("s", dim=4, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                           sync=SyncPolicy(workers=2, aggregator="sum", timeout_s=5, on_timeout="fail"))

        def body(c: Client, rank: int) -> None:
            if rank == 0:
                with pytest.raises(InvalidArgumentError, match="wire_dtype"):
                    c.push("s", [1], torch.ones(1, 4), wire_dtype="int8")
            c.push("s", [1], torch.ones(1, 4))
            c.flush()

        assert not run_workers(addresses, 2, body)
        with Client(addresses) as c:
            assert torch.equal(c.pull("s", [1]), torch.full((1, 4), -2.0))
