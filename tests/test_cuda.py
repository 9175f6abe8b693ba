"""The client on a CUDA device: rows pulled to the GPU, the model computing there, gradients pushed from it.

The reference is torch's own modules on the CPU holding the same rows (``torch.nn.EmbeddingBag`` /
``torch.nn.Embedding`` / ``torch.optim.SGD``). GPU and CPU kernels add in different orders, so values are
compared to float32 rounding, not bit for bit. Skipped without a CUDA device: CI has none; these run on a
lent GPU machine (docs/development.md says how).
"""

from __future__ import annotations

import json

import pytest
import torch
from shardps_client import (
    SGD,
    Client,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    Prefetcher,
    RemoteEmbeddingBagCollection,
    RemoteEmbeddingCollection,
    ShardedOptimizer,
)
from torch import nn

from shardps.core.specs import Initializer
from tests.conftest import running_cluster
from tests.test_collection import CASES, CONFIGS, EC_CONFIGS, _ec_kjt, _kjt, _ref_forward, _references, _rows
from tests.test_examples import EXAMPLES, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("input_on", ["cpu", "cuda"])
@pytest.mark.parametrize("case", ["every feature", "features absent"])
def test_bag_collection_on_cuda_matches_cpu_embedding_bags(case, input_on):
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(CONFIGS, c, device="cuda")
        refs = _references(c, CONFIGS)
        before = _rows(c, CONFIGS)
        kjt = _kjt(CASES[case])
        out = ebc(kjt.to(input_on))
        assert out.values().device.type == "cuda" and out.device().type == "cuda"
        expected = _ref_forward(refs, kjt, ["f1", "f2", "f3", "f4"], 2)
        torch.testing.assert_close(out.values().cpu(), expected, **TOL)
        upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
        (out.values() * upstream.cuda()).sum().backward()
        (expected * upstream).sum().backward()
        c.flush()
        after = _rows(c, CONFIGS)
        for cfg in CONFIGS:  # SGD lr=1: each row moved by its gradient
            grad = refs[cfg.name].weight.grad
            torch.testing.assert_close(before[cfg.name] - after[cfg.name],
                                       grad if grad is not None else torch.zeros_like(before[cfg.name]), **TOL)


def test_weighted_bags_on_cuda_match_per_sample_weights():
    configs = [CONFIGS[0], CONFIGS[2]]
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(configs, c, is_weighted=True, device="cuda")
        refs = _references(c, configs)
        before = _rows(c, configs)
        kjt = _kjt({"f1": [[1, 2], [3]], "f2": [[], [2, 2]], "f4": [[9, 1, 1], [0]]}, weights=True)
        out = ebc(kjt.to("cuda"))
        expected = _ref_forward(refs, kjt, ["f1", "f2", "f4"], 2)
        torch.testing.assert_close(out.values().cpu(), expected, **TOL)
        out.values().sum().backward()
        expected.sum().backward()
        c.flush()
        after = _rows(c, configs)
        for cfg in configs:
            torch.testing.assert_close(before[cfg.name] - after[cfg.name], refs[cfg.name].weight.grad, **TOL)


def test_embedding_collection_on_cuda_matches_nn_embedding():
    configs = EC_CONFIGS
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ec = RemoteEmbeddingCollection(configs, c, device="cuda")
        refs = _references(c, configs)
        before = _rows(c, configs)
        kjt = _ec_kjt()
        out = ec(kjt.to("cuda"))
        loss, ref_loss = torch.zeros((), device="cuda"), torch.zeros(())
        gen = torch.Generator().manual_seed(2)
        for f, table in (("f1", "ea"), ("f2", "ea"), ("f3", "eb")):
            expected = refs[table](kjt[f].values())
            assert out[f].values().device.type == "cuda"
            torch.testing.assert_close(out[f].values().cpu(), expected, rtol=0, atol=0)  # rows, copied
            w = torch.randn(expected.shape, generator=gen)
            loss = loss + (out[f].values() * w.cuda()).sum()
            ref_loss = ref_loss + (expected * w).sum()
        loss.backward()
        ref_loss.backward()
        c.flush()
        after = _rows(c, configs)
        for cfg in configs:
            torch.testing.assert_close(before[cfg.name] - after[cfg.name], refs[cfg.name].weight.grad, **TOL)


class _Model(nn.Module):
    def __init__(self, emb: nn.Module, width: int) -> None:
        super().__init__()
        self.emb = emb
        self.top = nn.Linear(width, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.top(self.emb(kjt).values()).squeeze(1)


def test_training_on_cuda_follows_local_cpu_training():
    """A collection and a dense layer on the GPU, trained through the shards (ShardedOptimizer, SGD on the
    shards), against the same model on the CPU with local nn.EmbeddingBags and torch.optim.SGD."""
    configs = [EmbeddingBagConfig(num_embeddings=25, embedding_dim=5, name=f"s{i}", feature_names=[f"g{i}"],
                                  pooling=pool, optimizer=SGD(lr=0.1), initializer=Initializer(seed=i))
               for i, pool in enumerate(["sum", "mean"])]
    gen = torch.Generator().manual_seed(0)
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        model = _Model(RemoteEmbeddingBagCollection(configs, c, device="cuda"), 10).cuda()
        opt = ShardedOptimizer(c, model, optimizer=SGD(lr=0.1), prefix="cuda.")
        refs = _references(c, configs)
        top = nn.Linear(10, 1)
        with torch.no_grad():
            top.load_state_dict({k: v.cpu() for k, v in model.top.state_dict().items()})
        ref_opt = torch.optim.SGD([*[r.weight for r in refs.values()], *top.parameters()], lr=0.1)
        for _ in range(6):
            ids = torch.randint(0, 25, (2, 8), generator=gen)
            lengths = torch.randint(0, 3, (2, 4), generator=gen)
            values = torch.cat([ids[k, : int(lengths[k].sum())] for k in range(2)])
            kjt = KeyedJaggedTensor.from_lengths_sync(["g0", "g1"], values, lengths.reshape(-1))
            y = torch.randn(4, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(kjt.to("cuda")), y.cuda()).backward()
            opt.step()
            ref_opt.zero_grad()
            local = torch.cat([refs[f"s{k}"](kjt[f"g{k}"].values(), kjt[f"g{k}"].offsets()[:-1]) for k in range(2)], 1)
            nn.functional.mse_loss(top(local).squeeze(1), y).backward()
            ref_opt.step()
        opt.flush()
        opt.pull()
        for cfg in configs:
            torch.testing.assert_close(c.pull(cfg.name, torch.arange(25)), refs[cfg.name].weight.detach(), **TOL)
        assert model.top.weight.device.type == "cuda"
        torch.testing.assert_close(model.top.weight.detach().cpu(), top.weight.detach(), **TOL)
        torch.testing.assert_close(model.top.bias.detach().cpu(), top.bias.detach(), **TOL)


@pytest.mark.parametrize("forward_gets", ["the batch", "the batch moved to cuda"])
def test_prefetched_collection_on_cuda_reads_the_rows_of_a_plain_forward(forward_gets):
    """ids_of plans a CPU batch a step ahead; the forward reads the plan when it gets the same batch, also when
    the batch was moved to the GPU in between (as DistributedDataParallel moves a module's inputs)."""
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(CONFIGS, c, device="cuda")
        batches = [_kjt(CASES["every feature"]), _kjt(CASES["keys in another order"])]

        def pulls() -> int:  # tables pulled, over all shards
            return sum(i.stats.pulls for i in c.shard_info())

        start = pulls()
        with torch.no_grad():
            plain = [ebc(b).values() for b in batches]
        middle = pulls()
        for batch, expected in zip(Prefetcher(batches, c, ids_fn=ebc.ids_of, depth=1), plain):
            with torch.no_grad():
                got = ebc(batch.to("cuda") if forward_gets != "the batch" else batch).values()
            assert got.device.type == "cuda"
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        # the prefetches pulled what the plain forwards pulled, and the forwards after them nothing more
        assert pulls() - middle == middle - start > 0


def test_cached_tables_on_cuda_push_every_gradient():
    """A trainer-side cache (Client.cache_table) under a collection on the GPU: with a loss linear in the rows,
    each step's row gradients do not depend on the rows, so after the cache drains every row has moved by the
    sum of the reference's gradients over all steps, however stale the rows it served were."""
    configs = [CONFIGS[0], CONFIGS[1]]
    gen = torch.Generator().manual_seed(3)
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(configs, c, device="cuda")
        for cfg in configs:
            c.cache_table(cfg.name, steps=3, max_rows=1000)
        refs = _references(c, configs)
        before = _rows(c, configs)
        for _ in range(7):
            bags = {f: [torch.randint(0, 20, (int(n),), generator=gen).tolist()
                        for n in torch.randint(0, 4, (3,), generator=gen)] for f in ("f1", "f2", "f3")}
            kjt = _kjt(bags)
            upstream = torch.randn(3, 12, generator=gen)
            (ebc(kjt.to("cuda")).values() * upstream.cuda()).sum().backward()
            (_ref_forward(refs, kjt, ["f1", "f2", "f3"], 3) * upstream).sum().backward()  # grads accumulate
        c.flush()
        after = _rows(c, configs)
        for cfg in configs:
            torch.testing.assert_close(before[cfg.name] - after[cfg.name], refs[cfg.name].weight.grad, **TOL)


def test_dlrm_example_on_one_gpu_with_ddp_dense(tmp_path):
    """The DLRM example with --device cuda and --dense ddp, two workers sharing the one GPU: they all-reduce
    over gloo (NCCL refuses two ranks on one device), keep their MLPs identical, and learn what local
    training learns."""
    result = tmp_path / "dlrm.json"
    _run(["-m", f"{EXAMPLES}.dlrm", "--workers", "2", "--rows", "200000", "--train", "120000", "--test", "30000",
          "--device", "cuda", "--dense", "ddp", "--dense-lr", "4e-3", "--json", str(result)])
    r = json.loads(result.read_text())
    prints = r["shardps"]["dense_fingerprints"]
    assert len(prints) == 2 and prints[0] == prints[1], prints
    ours, local = r["shardps"]["auc"], r["local"]["auc"]
    assert ours > 0.72 and abs(ours - local) < 0.03, r
