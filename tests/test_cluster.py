"""Client against in-process multi-shard clusters of real gRPC servers on loopback."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from shardps_client import SGD, Adagrad, Adam, Client, Staleness, StaleUpdateError

from shardps.core.routing import shard_of_ids
from shardps.core.specs import Initializer
from tests.conftest import running_cluster


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_pull_push_match_local_reference(num_shards):
    with running_cluster(num_shards) as servers, Client([s.address for s in servers]) as c:
        c.create_table("emb", dim=8, num_embeddings=500, optimizer=Adagrad(lr=0.3))
        ids = torch.tensor([[3, 7, 3], [499, 0, 7]])
        rows = c.pull("emb", ids)
        assert rows.shape == (2, 3, 8) and rows.dtype == torch.float32
        torch.testing.assert_close(rows[0, 0], rows[0, 2])  # same id, same row
        # Reference: torch.nn.Embedding holding the pulled rows, sparse grads, torch Adagrad.
        uniq = torch.unique(ids)
        ref = torch.nn.Embedding(500, 8, sparse=True)
        with torch.no_grad():
            ref.weight[uniq] = c.pull("emb", uniq)
        ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.3)
        for step in range(3):
            g = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(step))
            c.push("emb", ids, g)
            ref_opt.zero_grad()
            (ref(ids) * g).sum().backward()
            ref_opt.step()
            torch.testing.assert_close(c.pull("emb", uniq), ref.weight[uniq].detach(), rtol=2e-6, atol=2e-6)


def test_initial_rows_independent_of_shard_count():
    ids = torch.arange(0, 2000, 7)
    got = []
    for n in (1, 3):
        with running_cluster(n) as servers, Client([s.address for s in servers]) as c:
            c.create_table("t", dim=4, num_embeddings=2000, initializer=Initializer("uniform", a=0.5, seed=42))
            got.append(c.pull("t", ids))
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)
    assert got[0].abs().max() <= 0.5 and got[0].std() > 0.2


def test_default_initializer_is_standard_normal_like_nn_embedding(client2):
    client2.create_table("n", dim=32, num_embeddings=10_000)
    rows = client2.pull("n", torch.arange(10_000))
    assert abs(rows.mean().item()) < 0.02 and abs(rows.std().item() - 1.0) < 0.02


def test_unbounded_table_any_int64_id(client2):
    client2.create_table("u", dim=3, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    ids = torch.tensor([-(2**63), -5, 0, 2**40, 2**63 - 1])
    c = client2
    c.push("u", ids, torch.ones(5, 3), wait=True)
    torch.testing.assert_close(c.pull("u", ids), -torch.ones(5, 3))
    assert sum(i.num_rows for i in c.describe_table("u")) == 5


def test_million_row_pull_and_push_with_default_limits():
    with running_cluster(2, max_message_mb=4) as servers, Client([s.address for s in servers]) as c:
        c.create_table("big", dim=16, num_embeddings=1_000_000, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        ids = torch.arange(1_000_000)
        assert c.pull("big", ids).shape == (1_000_000, 16)  # 64 MB of rows through 4 MiB messages
        c.push("big", ids, torch.full((1_000_000, 16), 2.0))
        c.flush()
        got = c.pull("big", torch.tensor([0, 999_999, 123_456]))
        torch.testing.assert_close(got, torch.full((3, 16), -2.0))


def test_wire_dtypes_round_like_torch(client2):
    client2.create_table("w", dim=16, num_embeddings=100)
    ids = torch.arange(100)
    exact = client2.pull("w", ids)
    torch.testing.assert_close(client2.pull("w", ids, wire_dtype="float16"), exact.half().float(), rtol=0, atol=0)
    torch.testing.assert_close(client2.pull("w", ids, wire_dtype="bfloat16"), exact.bfloat16().float(), rtol=0, atol=0)


def test_dense_tensor_matches_torch_optim():
    with running_cluster(3) as servers, Client([s.address for s in servers]) as c:
        w0 = torch.randn(300, 40)
        # 48 KB with 8 KB chunks: spread over all three shards.
        assert c.register_dense("mlp.w", w0, optimizer=Adam(lr=0.01), chunk_bytes=8 * 1024)
        assert not c.register_dense("mlp.w", torch.zeros(300, 40), optimizer=Adam(lr=0.01), chunk_bytes=8 * 1024)
        owners = {sum(1 for t in info.tables if t.num_rows) for info in c.shard_info()}
        assert owners == {1}
        ref = torch.nn.Parameter(w0.clone())
        opt = torch.optim.Adam([ref], lr=0.01)
        for _ in range(5):
            g = torch.randn(300, 40)
            c.push_dense("mlp.w", g)
            ref.grad = g
            opt.step()
            value, _ = c.pull_dense("mlp.w")
            torch.testing.assert_close(value, ref.detach(), rtol=2e-6, atol=2e-6)


def test_versions_and_staleness_scaling(client2):
    c = client2
    c.create_table("s", dim=2, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                   staleness=Staleness("inverse"))
    ids = torch.tensor([1])
    _, v = c.pull_with_version("s", ids)
    owner = int(shard_of_ids(np.array([1]), 2)[0])
    for _ in range(3):  # three fresh pushes move the version on
        c.push("s", ids, torch.ones(1, 2), wait=True)
    c.push("s", ids, torch.ones(1, 2), versions=v, wait=True)  # staleness 3: lr / 4
    torch.testing.assert_close(c.pull("s", ids), torch.full((1, 2), -3.25))
    info = c.shard_info()[owner]
    assert info.version == 4 and info.stats.max_staleness == 3


def test_max_staleness_rejects_and_changes_nothing(client2):
    c = client2
    c.create_table("m", dim=2, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                   staleness=Staleness("linear", alpha=0.1, max_staleness=1))
    ids = torch.tensor([4])
    _, v = c.pull_with_version("m", ids)
    c.push("m", ids, torch.ones(1, 2), wait=True)
    c.push("m", ids, torch.ones(1, 2), wait=True)
    before = c.pull("m", ids)
    with pytest.raises(StaleUpdateError, match="2 versions stale, more than max_staleness 1"):
        c.push("m", ids, torch.ones(1, 2), versions=v, wait=True)
    c.flush()  # the error went to the waiting caller; flush has nothing left to report
    c.push("m", ids, torch.ones(1, 2), versions=v)  # asynchronous: the error surfaces at flush
    with pytest.raises(StaleUpdateError, match="max_staleness"):
        c.flush()
    torch.testing.assert_close(c.pull("m", ids), before)


def test_create_table_is_idempotent_and_conflicts_are_errors(client2):
    from shardps_client import TableExistsError

    assert client2.create_table("x", dim=4, num_embeddings=10)
    assert not client2.create_table("x", dim=4, num_embeddings=10)
    with pytest.raises(TableExistsError, match="exists with a different spec"):
        client2.create_table("x", dim=5, num_embeddings=10)
    assert client2.drop_table("x") and not client2.drop_table("x")


def test_concurrent_clients_lose_no_update(cluster2):
    """Several clients push to the same rows at once; every push is applied exactly once."""
    addresses = [s.address for s in cluster2]
    with Client(addresses) as setup:
        setup.create_table("c", dim=4, num_embeddings=64, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    ids = torch.arange(64)
    workers, pushes = 4, 25
    errors = []

    def work(seed: int) -> None:
        try:
            with Client(addresses, read_your_writes=False) as c:
                for _ in range(pushes):
                    c.push("c", ids, torch.ones(64, 4))
                    c.pull("c", ids[seed::4])  # reads interleave with writes
                c.flush()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    with Client(addresses) as c:
        torch.testing.assert_close(c.pull("c", ids), torch.full((64, 4), -float(workers * pushes)))
        assert sum(i.version for i in c.shard_info()) == 2 * workers * pushes  # each push touched both shards


def test_no_pull_sees_a_half_written_row(cluster2):
    """Rows are written whole: every pulled row has all columns equal while pushes run."""
    addresses = [s.address for s in cluster2]
    with Client(addresses) as c:
        c.create_table("h", dim=256, num_embeddings=8, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    stop = threading.Event()

    def pusher() -> None:
        with Client(addresses, read_your_writes=False) as c:
            while not stop.is_set():
                c.push("h", torch.arange(8), torch.ones(8, 256), wait=True)

    t = threading.Thread(target=pusher)
    t.start()
    try:
        with Client(addresses) as c:
            for _ in range(200):
                rows = c.pull("h", torch.arange(8))
                assert (rows == rows[:, :1]).all()
    finally:
        stop.set()
        t.join(30)


def test_async_pushes_of_one_client_apply_in_order(client2):
    """Adam is not commutative: 20 queued pushes must equal 20 sequential torch steps."""
    c = client2
    w0 = torch.randn(6, 5)
    c.register_dense("ordered", w0, optimizer=Adam(lr=0.1))
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Adam([ref], lr=0.1)
    for step in range(20):
        g = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        c.push_dense("ordered", g)  # no wait, no pull in between
        ref.grad = g
        opt.step()
    c.flush()
    torch.testing.assert_close(c.pull_dense("ordered")[0], ref.detach(), rtol=1e-5, atol=1e-5)
