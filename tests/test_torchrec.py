"""TorchRec itself (torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0: the extra ``shardps[torchrec]``) against our collections:
TorchRec's DLRM (and DLRM_DCN) over a RemoteEmbeddingBagCollection against the same model over TorchRec's own
EmbeddingBagCollection holding the same rows (forward outputs, then several optimizer steps, SGD and Adagrad, the
rows and the dense layers equal after them); TorchRec's KeyedJaggedTensor (weighted too), KeyedTensor,
EmbeddingBagConfig, EmbeddingConfig and PoolingType taken wherever ours are; RemoteEmbeddingCollection against
TorchRec's EmbeddingCollection (JaggedTensor outputs); TorchRec's way of choosing the embedding optimizer
(``apply_optimizer_in_backward``) honoured, refused with a clear message where it cannot be, and a table made with
no optimizer said in a warning.

Skips where torchrec cannot be imported, saying why; ``SHARDPS_REQUIRE_TORCHREC=1`` (set by ``.ci/run``) fails
instead. Real shards (in-process gRPC servers on port 0)."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from shardps_client import SGD, Adagrad, Client, RemoteEmbeddingBagCollection, RemoteEmbeddingCollection

from tests.conftest import running_cluster

try:
    import torchrec
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

    WHY = ""
except Exception as e:  # noqa: BLE001 - the reason is the skip's
    WHY = f"torchrec cannot be imported ({type(e).__name__}: {e}); pip install 'shardps[torchrec]' (docs/client.md)"

pytestmark = pytest.mark.skipif(bool(WHY) and os.environ.get("SHARDPS_REQUIRE_TORCHREC") != "1", reason=WHY)

DIM, ROWS, DENSE, BATCH = 8, 40, 5, 16
FEATURES = ["f0", "f1", "f2"]


@pytest.fixture(autouse=True)
def _torchrec_loads():
    if WHY:
        pytest.fail(f"SHARDPS_REQUIRE_TORCHREC=1, but {WHY}")


def bag_configs(pooling=None) -> list:
    pool = pooling or torchrec.PoolingType.SUM
    return [torchrec.EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name=f"t{i}",
                                        feature_names=[f"f{i}"], pooling=pool) for i in range(3)]


def batch(gen: torch.Generator, weighted: bool = False) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(FEATURES) * BATCH,), generator=gen)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.shape, generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths, weights=weights)


def same_rows(ours, theirs, c: Client) -> None:
    """TorchRec's tables take the rows our tables hold on the shards."""
    with torch.no_grad():
        for name, module in theirs.embedding_bags.items() if hasattr(theirs, "embedding_bags") else \
                theirs.embeddings.items():
            module.weight.copy_(c.pull(name, torch.arange(ROWS)))


def assert_rows_equal(theirs, c: Client, atol: float = 1e-5) -> None:
    modules = theirs.embedding_bags if hasattr(theirs, "embedding_bags") else theirs.embeddings
    for name, module in modules.items():
        torch.testing.assert_close(c.pull(name, torch.arange(ROWS)), module.weight.detach(), rtol=1e-5, atol=atol)


def _dlrm(kind, ebc):
    torch.manual_seed(0)
    if kind == "DLRM":
        return DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE, dense_arch_layer_sizes=[16, DIM],
                    over_arch_layer_sizes=[16, 1])
    return DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=DENSE, dense_arch_layer_sizes=[16, DIM],
                    over_arch_layer_sizes=[16, 1], dcn_num_layers=2, dcn_low_rank_dim=4)


@pytest.mark.parametrize("kind,optim,how", [("DLRM", "SGD", "optimizer="), ("DLRM", "Adagrad", "in backward"),
                                            ("DLRM_DCN", "Adagrad", "optimizer=")])
def test_torchrec_dlrm_over_our_collection_trains_as_over_its_own(kind, optim, how):
    """Forward outputs equal, then 4 optimizer steps (sparse rows on the shards / in TorchRec's tables with the same
    optimizer applied in backward; dense layers by torch.optim.SGD on both): rows, dense weights and outputs equal."""
    torch_opt, ours_opt = {"SGD": (torch.optim.SGD, SGD), "Adagrad": (torch.optim.Adagrad, Adagrad)}[optim]
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        if how == "optimizer=":
            ours = RemoteEmbeddingBagCollection(bag_configs(), c, optimizer=ours_opt(lr=0.1))
        else:  # TorchRec's idiom, after construction: the tables are made at the first forward, with it
            ours = RemoteEmbeddingBagCollection(bag_configs(), c)
            apply_optimizer_in_backward(torch_opt, ours.parameters(), {"lr": 0.1})
        theirs = torchrec.EmbeddingBagCollection(tables=bag_configs(), device=torch.device("cpu"))
        apply_optimizer_in_backward(torch_opt, theirs.parameters(), {"lr": 0.1})
        model_ours, model_theirs = _dlrm(kind, ours), _dlrm(kind, theirs)
        gen = torch.Generator().manual_seed(7)
        first = batch(gen)
        ours.ids_of(first)  # the tables exist now (made with the in-backward optimizer, if that is how)
        same_rows(ours, theirs, c)
        dense_ours = [p for n, p in model_ours.named_parameters() if "embedding_bag_collection" not in n]
        dense_theirs = [p for n, p in model_theirs.named_parameters() if "embedding_bag_collection" not in n]
        with torch.no_grad():
            for a, b in zip(dense_ours, dense_theirs):
                b.copy_(a)
        opt_ours, opt_theirs = torch.optim.SGD(dense_ours, lr=0.1), torch.optim.SGD(dense_theirs, lr=0.1)
        for step in range(4):
            kjt = first if step == 0 else batch(gen)
            dense = torch.randn(BATCH, DENSE, generator=gen)
            labels = (torch.rand(BATCH, generator=gen) > 0.5).float()
            out_ours = model_ours(dense, kjt).squeeze(1)
            out_theirs = model_theirs(dense, kjt).squeeze(1)
            torch.testing.assert_close(out_ours, out_theirs, rtol=1e-5, atol=1e-5)
            for out, opt in ((out_ours, opt_ours), (out_theirs, opt_theirs)):
                opt.zero_grad()
                F.binary_cross_entropy_with_logits(out, labels).backward()
                opt.step()
            c.flush()
        assert_rows_equal(theirs, c)
        for a, b in zip(dense_ours, dense_theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert c.table_spec("t0").optimizer == ours_opt(lr=0.1)


def test_weighted_kjt_mean_pooling_and_torchrec_containers_are_taken_where_ours_are():
    """TorchRec's weighted KeyedJaggedTensor into a weighted collection, a MEAN-pooled one from TorchRec's configs:
    outputs equal TorchRec's EmbeddingBagCollection's, and come back as TorchRec's own KeyedTensor (regroup works)."""
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        gen = torch.Generator().manual_seed(3)
        for weighted, pooling in ((True, torchrec.PoolingType.SUM), (False, torchrec.PoolingType.MEAN)):
            configs = bag_configs(pooling)
            for cfg in configs:
                cfg.name += f"_{pooling.name}"
            ours = RemoteEmbeddingBagCollection(configs, c, is_weighted=weighted, optimizer=SGD(lr=1.0))
            theirs = torchrec.EmbeddingBagCollection(tables=copy.deepcopy(configs), is_weighted=weighted,
                                                     device=torch.device("cpu"))
            same_rows(ours, theirs, c)
            kjt = batch(gen, weighted=weighted)
            out_ours, out_theirs = ours(kjt), theirs(kjt)
            assert isinstance(out_ours, KeyedTensor) and out_ours.keys() == out_theirs.keys()
            torch.testing.assert_close(out_ours.values(), out_theirs.values(), rtol=1e-6, atol=1e-6)
            regrouped = KeyedTensor.regroup([out_ours], [["f2", "f0"]])[0]
            torch.testing.assert_close(regrouped, torch.cat([out_theirs["f2"], out_theirs["f0"]], dim=1))
            upstream = torch.randn(out_theirs.values().shape, generator=gen)
            (out_ours.values() * upstream).sum().backward()
            (out_theirs.values() * upstream).sum().backward()
            c.flush()
            with torch.no_grad():  # SGD lr 1 on both sides
                for m in theirs.embedding_bags.values():
                    m.weight -= m.weight.grad
            assert_rows_equal(theirs, c)


def test_embedding_collection_matches_torchrecs_with_jagged_outputs():
    configs = [torchrec.EmbeddingConfig(num_embeddings=ROWS, embedding_dim=DIM, name=f"e{i}", feature_names=[f"f{i}"])
               for i in range(3)]
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ours = RemoteEmbeddingCollection(configs, c, optimizer=SGD(lr=1.0))
        theirs = torchrec.EmbeddingCollection(tables=copy.deepcopy(configs), device=torch.device("cpu"))
        same_rows(ours, theirs, c)
        kjt = batch(torch.Generator().manual_seed(5))
        out_ours, out_theirs = ours(kjt), theirs(kjt)
        assert set(out_ours) == set(out_theirs) == set(FEATURES)
        loss_ours = loss_theirs = 0.0
        for f in FEATURES:
            assert isinstance(out_ours[f], JaggedTensor)
            torch.testing.assert_close(out_ours[f].values(), out_theirs[f].values())
            assert torch.equal(out_ours[f].lengths(), out_theirs[f].lengths())
            loss_ours = loss_ours + (out_ours[f].values() ** 2).sum()
            loss_theirs = loss_theirs + (out_theirs[f].values() ** 2).sum()
        loss_ours.backward()
        loss_theirs.backward()
        c.flush()
        with torch.no_grad():
            for m in theirs.embeddings.values():
                m.weight -= m.weight.grad
        assert_rows_equal(theirs, c)


def test_the_optimizer_is_chosen_the_torchrec_way_or_refused_with_a_clear_message(caplog):
    with running_cluster(1) as servers, Client([s.address for s in servers]) as c:
        kjt = batch(torch.Generator().manual_seed(1))
        # in backward, after construction, per table: each table gets its own
        ebc = RemoteEmbeddingBagCollection(bag_configs(), c)
        apply_optimizer_in_backward(torch.optim.Adagrad, ebc.embedding_bags["t0"].parameters(), {"lr": 0.05, "eps": 1e-8})
        apply_optimizer_in_backward(torch.optim.Adam, list(ebc.embedding_bags["t1"].parameters())
                                    + list(ebc.embedding_bags["t2"].parameters()), {"lr": 0.01, "betas": (0.8, 0.9)})
        ebc(kjt)
        assert c.table_spec("t0").optimizer == Adagrad(lr=0.05, eps=1e-8)
        assert c.table_spec("t1").optimizer == c.table_spec("t2").optimizer
        assert c.table_spec("t1").optimizer.betas == (0.8, 0.9)
        # an optimizer with no shardps equivalent: refused, naming the ones there are
        configs = bag_configs()
        for cfg in configs:
            cfg.name += "_rms"
        ebc = RemoteEmbeddingBagCollection(configs, c)
        apply_optimizer_in_backward(torch.optim.RMSprop, ebc.parameters(), {"lr": 0.01})
        with pytest.raises(ValueError, match="torch.optim.RMSprop has no shardps equivalent.*torch.optim.SGD"):
            ebc(kjt)
        # applied after the tables were made with another one: refused, saying when it must come
        ebc = RemoteEmbeddingBagCollection(bag_configs(), c, create=False)
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
        with pytest.raises(ValueError, match="a table's optimizer is fixed when it is created"):
            ebc(kjt)
        # none at all: the client's default, said
        configs = bag_configs()
        for cfg in configs:
            cfg.name += "_default"
        with caplog.at_level(logging.WARNING, logger="shardps_client.collection_optim"):
            RemoteEmbeddingBagCollection(configs, c)(kjt)
        assert "no optimizer given" in caplog.text and "t0_default" in caplog.text and "SGD(lr=0.001" in caplog.text
