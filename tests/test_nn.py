"""RemoteEmbedding / RemoteEmbeddingBag / ShardedOptimizer against torch's own modules and optimizers."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
import torch.nn.functional as F
from shardps_client import (
    SGD,
    Adagrad,
    Adam,
    Client,
    Prefetcher,
    RemoteEmbedding,
    RemoteEmbeddingBag,
    ShardedOptimizer,
    Staleness,
    StaleUpdateError,
    SyncPolicy,
    planner,
)
from torch import nn

from shardps.core.specs import Initializer
from shardps.server.ops.launcher import LocalCluster
from tests.conftest import running_cluster
from tests.procs import freeze

ROWS, DIM = 40, 6


@pytest.fixture
def table(client2):
    client2.create_table("t", dim=DIM, num_embeddings=ROWS, optimizer=SGD(lr=1.0), initializer=Initializer(seed=5))
    return client2


def _reference(c: Client, cls, **kwargs):
    ref = cls(ROWS, DIM, **kwargs)
    with torch.no_grad():
        ref.weight.copy_(c.pull("t", torch.arange(ROWS)))
    return ref


def _pushed_grad(c: Client, before: torch.Tensor) -> torch.Tensor:
    c.flush()
    return before - c.pull("t", torch.arange(ROWS))  # SGD lr=1: the change is the gradient


EMB_INPUTS = [
    dict(input=torch.tensor([3, 7, 3, 39, 0])),
    dict(input=torch.tensor([[1, 2, 2], [5, 5, 5]])),
    dict(input=torch.tensor([[1, 2, 2], [5, 0, 5]]), padding_idx=5),
    dict(input=torch.tensor([4, 39, 39]), padding_idx=-1),
]


@pytest.mark.parametrize("case", EMB_INPUTS, ids=range(len(EMB_INPUTS)))
def test_remote_embedding_matches_nn_embedding(table, case):
    c = table
    kwargs = {k: v for k, v in case.items() if k != "input"}
    ref = _reference(c, nn.Embedding, **kwargs)
    mod = RemoteEmbedding(c, "t", **kwargs)
    before = c.pull("t", torch.arange(ROWS))
    upstream = torch.randn(case["input"].shape + (DIM,))
    out = mod(case["input"])
    expected = ref(case["input"])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(_pushed_grad(c, before), ref.weight.grad, rtol=1e-6, atol=1e-6)


BAG_CASES = [
    dict(mode="sum", input=torch.tensor([[1, 2, 3], [4, 4, 9]])),
    dict(mode="mean", input=torch.tensor([[1, 2, 3], [4, 4, 9]])),
    dict(mode="max", input=torch.tensor([[1, 2, 3], [4, 4, 9]])),
    dict(mode="sum", input=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), offsets=torch.tensor([0, 4])),
    dict(mode="mean", input=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), offsets=torch.tensor([0, 2, 2, 5])),  # an empty bag
    dict(mode="max", input=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), offsets=torch.tensor([0, 3, 8]), include_last_offset=True),
    dict(mode="sum", input=torch.tensor([1, 2, 4, 5, 4]), offsets=torch.tensor([0, 2]),
         per_sample_weights=torch.tensor([0.5, -1.0, 2.0, 0.1, 3.0])),
    dict(mode="mean", input=torch.tensor([[1, 2, 7], [7, 7, 9]]), padding_idx=7),
    dict(mode="sum", input=torch.tensor([1, 7, 4, 7]), offsets=torch.tensor([0, 1]), padding_idx=7),
]


@pytest.mark.parametrize("case", BAG_CASES, ids=range(len(BAG_CASES)))
def test_remote_embedding_bag_matches_nn_embedding_bag(table, case):
    c = table
    ctor = {k: case[k] for k in ("mode", "padding_idx", "include_last_offset") if k in case}
    call = {k: case[k] for k in ("offsets", "per_sample_weights") if k in case}
    ref = _reference(c, nn.EmbeddingBag, **ctor)
    mod = RemoteEmbeddingBag(c, "t", **ctor)
    before = c.pull("t", torch.arange(ROWS))
    out = mod(case["input"], **call)
    expected = ref(case["input"], **call)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    upstream = torch.randn(expected.shape)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(_pushed_grad(c, before), ref.weight.grad, rtol=1e-5, atol=1e-6)


def test_include_last_offset_short_of_the_ids_is_refused_and_pushes_nothing(table):
    """With include_last_offset the last offset must be the number of ids (torch's CSR form): torch does not check,
    and its backward gave ids past it, in no bag, gradients of uninitialised memory, which the push applied to the
    shared rows (1e33 seen; mode="max" crashed the process). Refused naming the offsets; nothing pushed."""
    c = table
    before = c.pull("t", torch.arange(ROWS))
    for mode in ("sum", "mean", "max"):
        bag = RemoteEmbeddingBag(c, "t", mode=mode, include_last_offset=True)
        for offsets in (torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([], dtype=torch.int64)):
            with pytest.raises(ValueError, match=r"t: with include_last_offset the last offset must be the number "
                                                 r"of ids \(3\)"):
                bag(torch.tensor([1, 2, 3]), offsets)
        bag(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])).sum().backward()  # (the CSR form: trains)
    c.flush()
    changed = (c.pull("t", torch.arange(ROWS)) != before).any(1).nonzero().flatten().tolist()
    assert changed == [1, 2, 3]


def test_arguments_torch_refuses_are_refused(table):
    """A padding_idx of True (read as row 1) or 2.0, and ShardedOptimizer given parameters without their names (a
    TypeError about concatenating str and Tensor): refused, saying what is wanted, as torch refuses the first."""
    c = table
    for bad in (True, 2.0):
        with pytest.raises((TypeError, IndexError)):  # the reference refuses it too (at its first forward)
            nn.Embedding(ROWS, DIM, padding_idx=bad)(torch.tensor([1, 2]))
        with pytest.raises(TypeError, match="padding_idx must be an int"):
            RemoteEmbedding(c, "t", padding_idx=bad)
    assert RemoteEmbedding(c, "t", padding_idx=torch.tensor(3).item()).padding_idx == 3
    model = TinyModel(RemoteEmbedding(c, "t"))
    with pytest.raises(TypeError, match="takes the module, or its named_parameters"):
        ShardedOptimizer(c, model.parameters())


def test_no_grad_forward_pushes_nothing(table):
    c = table
    with torch.no_grad():
        RemoteEmbedding(c, "t")(torch.tensor([1, 2]))
    c.flush()
    assert all(i.stats.pushes == 0 for i in c.shard_info())


class TinyModel(nn.Module):
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb
        self.fc1 = nn.Linear(DIM, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids).mean(1))))


OPTIMIZERS = [
    (SGD(lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), dict(rtol=0, atol=0)),
    (Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1), dict(rtol=1e-5, atol=1e-6)),
    (Adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01), dict(rtol=1e-5, atol=1e-6)),
]


def _train_alongside(batches: list, sharded: ShardedOptimizer, model: nn.Module, ref_opt: torch.optim.Optimizer,
                     ref: nn.Module) -> None:
    """Train ``model`` through the shards and ``ref`` with torch.optim on the same batches; end on a zero_grad()."""
    for ids, y in batches:
        sharded.zero_grad()
        F.cross_entropy(model(ids), y).backward()
        sharded.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(ids), y).backward()
        ref_opt.step()
    sharded.zero_grad()


@pytest.mark.parametrize("opt,make_ref,tol", OPTIMIZERS, ids=["sgd", "adagrad", "adam"])
def test_one_sync_worker_equals_local_torch_training(opt, make_ref, tol):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    # Every batch touches every row, so lazy sparse updates equal torch's dense ones.
    batches = [(torch.cat([torch.arange(ROWS), torch.randint(0, ROWS, (8,), generator=gen)]).view(8, 6),
                torch.randint(0, 3, (8,), generator=gen)) for _ in range(6)]
    with running_cluster(2) as servers, Client([s.address for s in servers], rank=0, world_size=1) as c:
        sync = SyncPolicy(workers=1)
        c.create_table("t", dim=DIM, num_embeddings=ROWS, optimizer=opt, initializer=Initializer(seed=9), sync=sync)
        local = TinyModel(nn.Embedding(ROWS, DIM))
        with torch.no_grad():
            local.emb.weight.copy_(c.pull("t", torch.arange(ROWS)))
        remote = TinyModel(RemoteEmbedding(c, "t"))
        remote.load_state_dict({k: v for k, v in local.state_dict().items() if not k.startswith("emb.")}, strict=False)
        sharded = ShardedOptimizer(c, remote, optimizer=opt, prefix="tiny.", sync=sync)
        ref_opt = make_ref(local.parameters())
        _train_alongside(batches, sharded, remote, ref_opt, local)
        torch.testing.assert_close(c.pull("t", torch.arange(ROWS)), local.emb.weight.detach(), **tol)
        for name, p in local.named_parameters():
            if not name.startswith("emb."):
                torch.testing.assert_close(dict(remote.named_parameters())[name], p.detach(), **tol)


def test_two_sync_workers_with_modules_equal_one_worker_on_both_batches():
    gen = torch.Generator().manual_seed(3)
    batches = [[(torch.randint(0, ROWS, (4, 5), generator=gen), torch.randint(0, 3, (4,), generator=gen))
                for _ in range(2)] for _ in range(4)]
    torch.manual_seed(0)
    init_model = TinyModel(nn.Embedding(ROWS, DIM))
    with running_cluster(2) as servers:
        addresses = [s.address for s in servers]
        sync = SyncPolicy(workers=2, aggregator="mean")
        with Client(addresses) as c:
            c.create_table("t", dim=DIM, num_embeddings=ROWS, optimizer=SGD(lr=0.5), initializer=Initializer(seed=2), sync=sync)
            with torch.no_grad():
                init_model.emb.weight.copy_(c.pull("t", torch.arange(ROWS)))
        errors = []

        def worker(rank: int) -> None:
            try:
                with Client(addresses, rank=rank, world_size=2) as c:
                    model = TinyModel(RemoteEmbedding(c, "t"))
                    model.load_state_dict({k: v for k, v in init_model.state_dict().items() if not k.startswith("emb.")},
                                          strict=False)
                    opt = ShardedOptimizer(c, model, optimizer=SGD(lr=0.5), prefix="m.", sync=sync)
                    for step in range(4):
                        ids, y = batches[step][rank]
                        opt.zero_grad()
                        F.cross_entropy(model(ids), y).backward()
                        opt.step()
                    opt.flush()
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        opt = torch.optim.SGD(init_model.parameters(), lr=0.5)
        for step in range(4):
            ids = torch.cat([batches[step][r][0] for r in range(2)])
            y = torch.cat([batches[step][r][1] for r in range(2)])
            opt.zero_grad()
            F.cross_entropy(init_model(ids), y).backward()
            opt.step()
        with Client(addresses) as c:
            torch.testing.assert_close(c.pull("t", torch.arange(ROWS)), init_model.emb.weight.detach(), rtol=1e-5, atol=1e-6)
            fresh = TinyModel(RemoteEmbedding(c, "t"))
            ShardedOptimizer(c, fresh, optimizer=SGD(lr=0.5), prefix="m.", sync=sync)  # registered: pulls the shards' values
            torch.testing.assert_close(fresh.fc2.weight.detach(), init_model.fc2.weight.detach(), rtol=1e-5, atol=1e-6)


def test_buckets_train_exactly_as_one_tensor_per_parameter(caplog):
    """Small parameters share flat tensors on the shards; elementwise optimizers make that exact."""
    torch.manual_seed(0)
    init = TinyModel(nn.Embedding(ROWS, DIM))
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, ROWS, (8, 3), generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(5)]
    results = {}
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        c.create_table("b", dim=DIM, num_embeddings=ROWS, optimizer=SGD(lr=0.1), initializer=Initializer(seed=4))
        for bucket_bytes in (0, 448):
            model = TinyModel(nn.Embedding(ROWS, DIM))
            model.load_state_dict(init.state_dict())
            model.emb.requires_grad_(False)
            opt = ShardedOptimizer(c, model, optimizer=Adam(lr=0.05), prefix=f"k{bucket_bytes}.", bucket_bytes=bucket_bytes)
            assert len(opt.tensors) == (4 if bucket_bytes == 0 else 2)  # fc1.weight + fc1.bias (448 B) | fc2.*
            for step, (ids, y) in enumerate(batches):
                opt.zero_grad()
                h = model.emb(ids).mean(1)
                # The last step leaves fc1.bias out: in a bucket with gradients it gets zeros (and a warning).
                out = model.fc2(torch.relu(F.linear(h, model.fc1.weight) if step == 4 else model.fc1(h)))
                F.cross_entropy(out, y).backward()
                opt.step()
            opt.flush()
            opt.zero_grad()
            results[bucket_bytes] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert any("got no gradient this step" in r.message for r in caplog.records)
    for name in ("fc1.weight", "fc2.weight", "fc2.bias"):
        torch.testing.assert_close(results[448][name], results[0][name], rtol=0, atol=0)
    # fc1.bias was skipped at the last step when alone; in its bucket it took a zero-gradient Adam step.
    assert not torch.equal(results[448]["fc1.bias"], results[0]["fc1.bias"])


def test_zero_grad_loads_the_values_that_came_back_with_the_step(monkeypatch):
    """After step(), zero_grad() makes no pull: each shard sent the new values back with its pushes."""
    torch.manual_seed(0)
    model = TinyModel(nn.Embedding(ROWS, DIM))
    model.emb.requires_grad_(False)
    ref = TinyModel(nn.Embedding(ROWS, DIM))
    ref.load_state_dict(model.state_dict())
    ref.emb.requires_grad_(False)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(6)
    batches = [(torch.randint(0, ROWS, (8, 3), generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(4)]
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        opt = ShardedOptimizer(c, model, optimizer=SGD(lr=0.1, momentum=0.9), prefix="back.", chunk_bytes=256,
                               bucket_bytes=0)
        assert len({s for name in opt.tensors for s, _, _ in planner.dense_pieces(c.dense_spec(name), c._session.slots, c.max_message_bytes, 1)}) == 2
        pulls: list[list[str]] = []
        real_pull = c.pull_dense_many
        monkeypatch.setattr(c, "pull_dense_many", lambda names, *a: pulls.append(list(names)) or real_pull(names, *a))
        _train_alongside(batches, opt, model, ref_opt, ref)
        assert pulls == [list(opt.tensors)]  # the first zero_grad only: no step had sent pushes yet
        for name, p in ref.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(dict(model.named_parameters())[name], p.detach(), rtol=1e-6, atol=1e-6)


def test_zero_grad_pulls_when_the_pushes_carrying_the_values_fail():
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        model = nn.Linear(3, 2)
        opt = ShardedOptimizer(c, model, optimizer=SGD(lr=1.0), prefix="stale.", staleness=Staleness(max_staleness=0))
        c.create_table("other", dim=2, num_embeddings=100, initializer=Initializer("zeros"))
        with Client([s.address for s in servers]) as other:  # another worker moves every shard's version
            other.push("other", torch.arange(100), torch.ones(100, 2), wait=True)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(torch.ones(1, 3)).sum().backward()
        opt.step()  # refused: pulled at an older version than max_staleness=0 allows
        opt.zero_grad()  # pulls instead
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)
        with pytest.raises(StaleUpdateError, match="stale"):
            opt.flush()


def test_dense_lag_goes_on_with_the_previous_steps_values_while_the_last_are_on_their_way():
    with LocalCluster(1) as cluster, Client(cluster.addresses, timeout=30) as c:
        model = nn.Linear(3, 2, bias=False)
        w0 = model.weight.detach().clone()
        opt = ShardedOptimizer(c, model, optimizer=SGD(lr=1.0), prefix="lag.", dense_lag=1)

        def forward_backward() -> None:
            model(torch.ones(1, 3)).sum().backward()  # gradient: ones

        opt.zero_grad()
        forward_backward()
        opt.step()
        c.flush()  # step 1's values are back
        shard = cluster.procs[0].popen.pid
        freeze(shard)  # the shard answers nothing until SIGCONT
        try:
            def two_steps() -> None:
                opt.zero_grad()  # step 1's values, already back
                forward_backward()
                opt.step()  # step 2: sent, not answered
                opt.zero_grad()  # step 2's values are not back: goes on with step 1's (lag 1)

            t = threading.Thread(target=two_steps, daemon=True)
            t.start()
            t.join(10)
            assert not t.is_alive()
            torch.testing.assert_close(model.weight.detach(), w0 - 1)
        finally:
            os.kill(shard, signal.SIGCONT)
        forward_backward()
        opt.step()
        c.flush()
        opt.zero_grad()  # steps 2 and 3 are back: the newest are loaded
        torch.testing.assert_close(model.weight.detach(), w0 - 3)
        with pytest.raises(ValueError, match="asynchronous"):
            ShardedOptimizer(c, model, prefix="lag2.", sync=SyncPolicy(workers=1), dense_lag=1)


def test_prefetcher_hides_pulls_and_gives_the_same_rows(table):
    c = table
    batches = [torch.randint(0, ROWS, (16,), generator=torch.Generator().manual_seed(i)) for i in range(5)]
    mod = RemoteEmbedding(c, "t")
    pulls_before = sum(i.stats.pulls for i in c.shard_info())
    seen = []
    for ids in Prefetcher(batches, c, lambda b: {"t": b}):
        with torch.no_grad():
            out = mod(ids)
        seen.append(ids)
        torch.testing.assert_close(out, c.pull("t", ids))  # same rows (no pushes in between)
    assert [s.tolist() for s in seen] == [b.tolist() for b in batches]
    pulls = sum(i.stats.pulls for i in c.shard_info()) - pulls_before
    # Forward took prefetched rows: only the prefetches and the explicit check pulls reached the (2) shards.
    assert pulls == 2 * 2 * len(batches)


def test_rank_and_world_size_from_torchrun_environment(client2, monkeypatch, cluster2):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with Client([s.address for s in cluster2]) as c:
        assert (c.rank, c.world_size) == (1, 3)
        _, live, _ = cluster2[0].shard.membership.status()
        assert live == [0, 1, 2]  # rank 1 heard from; ranks 0 and 2 not yet gone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_and_gradients_match_cpu(table):
    c = table
    ids = torch.tensor([[1, 2, 2], [5, 7, 9]])
    cpu_bag = RemoteEmbeddingBag(c, "t", mode="mean")
    gpu_bag = RemoteEmbeddingBag(c, "t", mode="mean", device="cuda")
    before = c.pull("t", torch.arange(ROWS))
    out_gpu = gpu_bag(ids.cuda())
    assert out_gpu.device.type == "cuda"
    torch.testing.assert_close(out_gpu.cpu(), cpu_bag(ids), rtol=1e-6, atol=1e-6)
    upstream = torch.randn(out_gpu.shape)
    (out_gpu * upstream.cuda()).sum().backward()
    ref = _reference(c, nn.EmbeddingBag, mode="mean")
    (ref(ids) * upstream).sum().backward()
    torch.testing.assert_close(_pushed_grad(c, before), ref.weight.grad, rtol=1e-5, atol=1e-6)


def test_prefetching_many_tables_at_once_does_not_deadlock(client2):
    """More prefetches than the client has pool threads (each fans out to every shard)."""
    c = client2
    for i in range(12):
        c.create_table(f"p{i}", dim=4, num_embeddings=100)
    batches = [torch.arange(i, i + 20) for i in range(3)]
    for ids in Prefetcher(batches, c, lambda b: {f"p{i}": b for i in range(12)}):
        rows = [c.pull(f"p{i}", ids) for i in range(12)]
        assert all(r.shape == (20, 4) for r in rows)


@pytest.mark.parametrize("optimizer, reference", [
    (Adagrad(lr=0.5), lambda p: torch.optim.Adagrad(p, lr=0.5)),
    (Adam(lr=0.1), lambda p: torch.optim.Adam(p, lr=0.1)),
])
def test_a_module_called_twice_in_a_step_steps_once_with_the_summed_gradient(client2, optimizer, reference):
    """A shared embedding (one module called on two id sets in one forward, a row in both): torch.optim takes one
    step with the gradient autograd summed; the step's two pushes were applied as two steps, which Adagrad and Adam
    tell apart (row 2 off by 0.5). A held step pushes each table once, its rows' gradients summed: the reference's
    rows to float32 rounding. The same for a collection called on two batches in one loss."""
    from shardps_client import EmbeddingBagConfig, KeyedJaggedTensor, RemoteEmbeddingBagCollection

    c = client2
    c.create_table("t", dim=DIM, num_embeddings=ROWS, optimizer=optimizer, initializer=Initializer(seed=5))
    ref = nn.Embedding(ROWS, DIM)
    with torch.no_grad():
        ref.weight.copy_(c.pull("t", torch.arange(ROWS)))
    ref_opt = reference(ref.parameters())
    model = nn.Module()
    model.emb = RemoteEmbedding(c, "t")
    opt = ShardedOptimizer(c, model)
    up = torch.randn(2, DIM, generator=torch.Generator().manual_seed(0))
    a, b = torch.tensor([1, 2]), torch.tensor([2, 3])
    for _ in range(3):
        opt.zero_grad()
        ((model.emb(a) * up).sum() + (model.emb(b) * up).sum()).backward()
        opt.step()
        ref_opt.zero_grad()
        ((ref(a) * up).sum() + (ref(b) * up).sum()).backward()
        ref_opt.step()
    opt.flush()
    torch.testing.assert_close(c.pull("t", torch.arange(ROWS)), ref.weight.detach(), rtol=1e-5, atol=1e-6)

    cfg = [EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="tc", feature_names=["f"])]
    c.create_table("tc", dim=DIM, num_embeddings=ROWS, optimizer=optimizer, initializer=Initializer(seed=5))
    ebc = RemoteEmbeddingBagCollection(cfg, c, create=False)
    bag = nn.EmbeddingBag(ROWS, DIM, mode="sum")
    with torch.no_grad():
        bag.weight.copy_(c.pull("tc", torch.arange(ROWS)))
    bag_opt = reference(bag.parameters())
    holder = nn.Module()
    holder.ebc = ebc
    opt = ShardedOptimizer(c, holder)
    k1 = KeyedJaggedTensor(["f"], a, lengths=torch.tensor([2]))
    k2 = KeyedJaggedTensor(["f"], b, lengths=torch.tensor([2]))
    for _ in range(3):
        opt.zero_grad()
        (ebc(k1).values() * up[0]).sum().add((ebc(k2).values() * up[1]).sum()).backward()
        opt.step()
        bag_opt.zero_grad()
        ((bag(a, torch.tensor([0])) * up[0]).sum() + (bag(b, torch.tensor([0])) * up[1]).sum()).backward()
        bag_opt.step()
    opt.flush()
    torch.testing.assert_close(c.pull("tc", torch.arange(ROWS)), bag.weight.detach(), rtol=1e-5, atol=1e-6)


def test_a_step_holds_a_copy_of_what_was_pushed(client2):
    """A step hold keeps its row pushes unplanned until the step is sent: it keeps copies, so the caller may change
    its ids and gradients after the push (as after any push) without changing what the step sends."""
    c = client2
    c.create_table("t", dim=DIM, num_embeddings=ROWS, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    opt = ShardedOptimizer(c, [])
    ids, g = torch.tensor([1, 2]), torch.ones(2, DIM)
    c.push("t", ids, g)
    ids.fill_(5)
    g.mul_(7)
    opt.step()
    opt.flush()
    got = c.pull("t", torch.tensor([1, 2, 5]))
    assert torch.equal(got, torch.tensor([[-1.0] * DIM, [-1.0] * DIM, [0.0] * DIM]))


def test_a_push_that_waits_goes_after_the_rows_a_step_holds(client2):
    """A push with wait=True is sent at once, past any hold: the rows a step hold keeps unplanned go first, as the
    pushes a hold queues always did (a client's pushes reach each shard in the order they were made)."""
    c = client2
    c.create_table("t", dim=DIM, num_embeddings=ROWS, optimizer=Adagrad(lr=1.0), initializer=Initializer("zeros"))
    ref = nn.Parameter(torch.zeros(ROWS, DIM))
    ref_opt = torch.optim.Adagrad([ref], lr=1.0)
    opt = ShardedOptimizer(c, [])
    ids = torch.tensor([3])
    for g, wait in ((1.0, False), (3.0, True)):  # (Adagrad's steps do not commute: the order shows)
        c.push("t", ids, torch.full((1, DIM), g), wait=wait)
        ref.grad = torch.zeros(ROWS, DIM)
        ref.grad[3] = g
        ref_opt.step()
    opt.step()
    opt.flush()
    torch.testing.assert_close(c.pull("t", ids), ref.detach()[ids], rtol=1e-6, atol=1e-6)
