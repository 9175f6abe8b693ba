"""RemoteEmbeddingBagCollection / RemoteEmbeddingCollection against torch's own nn.EmbeddingBag / nn.Embedding
holding the same rows, fed TorchRec-shaped KeyedJaggedTensors; one pull and one push per shard per step."""

from __future__ import annotations

import pytest
import torch
from shardps_client import (
    SGD,
    Client,
    EmbeddingBagConfig,
    EmbeddingConfig,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
    Prefetcher,
    RemoteEmbeddingBagCollection,
    RemoteEmbeddingCollection,
)
from torch import nn

from shardps.core.specs import Initializer
from tests.conftest import running_cluster
from tests.test_metrics import scrape, value

CONFIGS = [  # a shared table (f1, f2), a mean-pooled one, one of another width
    EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="ta", feature_names=["f1", "f2"],
                       pooling=PoolingType.SUM, optimizer=SGD(lr=1.0), initializer=Initializer(seed=1)),
    EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="tb", feature_names=["f3"],
                       pooling=PoolingType.MEAN, optimizer=SGD(lr=1.0), initializer=Initializer(seed=2)),
    EmbeddingBagConfig(num_embeddings=10, embedding_dim=3, name="tc", feature_names=["f4"], pooling="sum",
                       optimizer=SGD(lr=1.0), initializer=Initializer(seed=3)),
]
TABLE_OF = {f: c for c in CONFIGS for f in c.feature_names}


def _kjt(bags: dict[str, list[list[int]]], weights: bool = False) -> KeyedJaggedTensor:
    keys = list(bags)
    values = [i for k in keys for bag in bags[k] for i in bag]
    lengths = [len(bag) for k in keys for bag in bags[k]]
    w = torch.linspace(-1.0, 2.0, len(values)) if weights else None
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor(values, dtype=torch.int64),
                                               torch.tensor(lengths, dtype=torch.int64), weights=w)


def _references(c: Client, configs: list) -> dict[str, nn.Module]:
    refs = {}
    for cfg in configs:
        pooling = getattr(cfg.pooling, "name", cfg.pooling).lower()
        ref = nn.Embedding(cfg.num_embeddings, cfg.embedding_dim) if pooling == "none" else \
            nn.EmbeddingBag(cfg.num_embeddings, cfg.embedding_dim, mode=pooling)
        with torch.no_grad():
            ref.weight.copy_(c.pull(cfg.name, torch.arange(cfg.num_embeddings)))
        refs[cfg.name] = ref
    return refs


def _ref_forward(refs: dict, kjt: KeyedJaggedTensor, features: list[str], stride: int) -> torch.Tensor:
    parts = []
    present = kjt.to_dict()
    for f in features:
        cfg = TABLE_OF[f]
        if f not in present:
            parts.append(torch.zeros(stride, cfg.embedding_dim))
            continue
        jt = present[f]
        parts.append(refs[cfg.name](jt.values(), jt.offsets()[:-1], per_sample_weights=jt.weights_or_none()))
    return torch.cat(parts, dim=1)


CASES = {
    "every feature": {"f1": [[1, 2], [3]], "f2": [[2, 29], [0, 0, 5]], "f3": [[4, 4], [19]], "f4": [[9], [0, 1]]},
    "empty bags": {"f1": [[], [3]], "f2": [[2], []], "f3": [[], [1, 2]], "f4": [[], []]},
    "features absent": {"f2": [[7, 8], [8]], "f4": [[2], [2, 2]]},
    "keys in another order": {"f4": [[1], [2]], "f3": [[5], [6]], "f1": [[0], [1]], "f2": [[1], [0]]},
}


@pytest.mark.parametrize("case", list(CASES))
def test_bag_collection_matches_nn_embedding_bags_forward_and_backward(case):
    bags = CASES[case]
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(CONFIGS, c)
        refs = _references(c, CONFIGS)
        before = {cfg.name: c.pull(cfg.name, torch.arange(cfg.num_embeddings)) for cfg in CONFIGS}
        kjt = _kjt(bags)
        out = ebc(kjt)
        expected = _ref_forward(refs, kjt, ["f1", "f2", "f3", "f4"], 2)
        assert out.keys() == ["f1", "f2", "f3", "f4"] and out.length_per_key() == [4, 4, 4, 3]
        torch.testing.assert_close(out.values(), expected, rtol=1e-6, atol=1e-6)
        assert set(out.to_dict()) == {"f1", "f2", "f3", "f4"} and out.to_dict()["f4"].shape == (2, 3)
        upstream = torch.randn(expected.shape)
        (out.values() * upstream).sum().backward()
        (expected * upstream).sum().backward()
        c.flush()
        for cfg in CONFIGS:  # SGD lr=1: each row moved by its gradient
            moved = before[cfg.name] - c.pull(cfg.name, torch.arange(cfg.num_embeddings))
            grad = refs[cfg.name].weight.grad
            torch.testing.assert_close(moved, grad if grad is not None else torch.zeros_like(moved),
                                       rtol=1e-5, atol=1e-6)


def test_weighted_bags_match_per_sample_weights():
    configs = [CONFIGS[0], CONFIGS[2]]
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(configs, c, is_weighted=True)
        assert ebc.is_weighted() and ebc.embedding_bag_configs() == configs
        refs = _references(c, configs)
        before = {cfg.name: c.pull(cfg.name, torch.arange(cfg.num_embeddings)) for cfg in configs}
        kjt = _kjt({"f1": [[1, 2], [3]], "f2": [[], [2, 2]], "f4": [[9, 1, 1], [0]]}, weights=True)
        out = ebc(kjt)
        expected = _ref_forward(refs, kjt, ["f1", "f2", "f4"], 2)
        torch.testing.assert_close(out.values(), expected, rtol=1e-6, atol=1e-6)
        out.values().sum().backward()
        expected.sum().backward()
        c.flush()
        for cfg in configs:
            torch.testing.assert_close(before[cfg.name] - c.pull(cfg.name, torch.arange(cfg.num_embeddings)),
                                       refs[cfg.name].weight.grad, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="weight per id"):
            ebc(_kjt({"f1": [[1], [2]]}))


def test_sgd_steps_equal_local_training_bit_for_bit():
    """One table per feature, SGD on the shards against torch.optim.SGD on local nn.EmbeddingBags."""
    configs = [EmbeddingBagConfig(num_embeddings=25, embedding_dim=5, name=f"s{i}", feature_names=[f"g{i}"],
                                  pooling=pool, optimizer=SGD(lr=0.3), initializer=Initializer(seed=i))
               for i, pool in enumerate(["sum", "mean", "sum"])]
    gen = torch.Generator().manual_seed(0)
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(configs, c)
        refs = _references(c, configs)
        opt = torch.optim.SGD([r.weight for r in refs.values()], lr=0.3)
        for _ in range(5):
            ids = torch.randint(0, 25, (3, 8), generator=gen)
            lengths = torch.randint(0, 3, (3, 4), generator=gen)
            values = torch.cat([ids[k, : int(lengths[k].sum())] for k in range(3)])
            kjt = KeyedJaggedTensor.from_lengths_sync(["g0", "g1", "g2"], values, lengths.reshape(-1))
            target = torch.randn(4, 15, generator=gen)
            ((ebc(kjt).values() - target) ** 2).sum().backward()
            opt.zero_grad()
            local = torch.cat([refs[f"s{k}"](kjt[f"g{k}"].values(), kjt[f"g{k}"].offsets()[:-1])
                               for k in range(3)], dim=1)
            ((local - target) ** 2).sum().backward()
            opt.step()
            c.flush()
        for cfg in configs:
            torch.testing.assert_close(c.pull(cfg.name, torch.arange(25)), refs[cfg.name].weight.detach(),
                                       rtol=0, atol=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_sum_bags_backward_sums_each_rows_gradients_in_the_order_its_ids_came(threads):
    """The collection's CPU sum pooling (``_SumBags``) against ``F.embedding_bag`` on Zipf ids repeating thousands
    of times, empty bags and several widths: the same outputs, bit for bit; gradients equal to the sums in float64
    within float32 rounding, bit for bit those of adding each row's gradients in the order its ids came (and
    F.embedding_bag's own where no id repeats more than twice: then the order cannot show)."""
    import numpy as np
    import torch.nn.functional as F
    from shardps_client.collection import _SumBags

    rng = np.random.default_rng(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dim, max_len, zipf in [(1, 2, 1.1), (16, 2, 1.1), (16, 6, 1.1), (64, 3, 1.1), (16, 1, 0.0)]:
            lens = rng.integers(1 if max_len == 1 else 0, max_len + (max_len == 1), 3000)
            n = int(lens.sum())
            rows = int(rng.integers(n // 8, n // 4)) if zipf else 2 * n
            idx = (rng.zipf(zipf, n) % rows) if zipf else rng.permutation(2 * n)[:n] // 2 * 1
            idx = torch.from_numpy(idx.astype(np.int64))
            offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
            bag_of = torch.from_numpy(np.repeat(np.arange(lens.shape[0]), lens))
            gen = torch.Generator().manual_seed(1000 * threads + dim + max_len)  # (not torch's global stream)
            grad = torch.randn(lens.shape[0], dim, generator=gen)
            w = torch.randn(rows, dim, generator=gen).requires_grad_()
            expected = F.embedding_bag(idx, w, offsets, mode="sum", include_last_offset=True)
            expected.backward(grad)
            theirs, w.grad = w.grad, None
            got = _SumBags.apply(w, idx, offsets, None if max_len == 1 else bag_of)
            got.backward(grad)
            assert torch.equal(got, expected), (dim, max_len)
            in_order = torch.zeros(rows, dim)
            for k in range(n):  # each value's bag gradient, added in the order the values came
                in_order[idx[k]] += grad[bag_of[k]]
            assert torch.equal(w.grad, in_order), (dim, max_len)
            exact = torch.zeros(rows, dim, dtype=torch.float64).index_add_(0, idx, grad.double()[bag_of])
            # Float32 rounding of k additions in any order: at most gamma(k - 1) * (sum of |terms|) per row
            # (a Zipf id adds thousands of terms, so no fixed tolerance fits every draw).
            magnitude = torch.zeros(rows, dim, dtype=torch.float64).index_add_(0, idx, grad.double().abs()[bag_of])
            adds = torch.bincount(idx, minlength=rows).clamp(min=1).double().unsqueeze(1) - 1
            gamma = adds * 2.0**-24 / (1 - adds * 2.0**-24)
            assert ((w.grad.double() - exact).abs() <= gamma * magnitude).all(), (dim, max_len)
            if np.bincount(idx.numpy()).max() <= 2:
                assert torch.equal(w.grad, theirs), (dim, max_len)
    finally:
        torch.set_num_threads(before)


def test_push_stacked_equals_one_push_per_table_and_refuses_bad_input_naming_the_table():
    """Client.push_stacked (a collection's backward) against Client.push of each table (the reference): sorted
    unique ids planned together, unsorted ones through push's path; bad input refused, nothing applied."""
    from shardps_client.errors import IdOutOfRangeError, InvalidArgumentError

    gen = torch.Generator().manual_seed(3)
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        for prefix in ("a", "b"):
            for t in range(3):
                c.create_table(f"{prefix}{t}", 4, 50, optimizer=SGD(lr=0.5), initializer=Initializer(seed=t))
        ids = [torch.tensor([1, 7, 30, 49]), torch.tensor([9, 2, 9]), torch.tensor([], dtype=torch.int64)]
        grads = torch.randn(7, 4, generator=gen)
        c.push_stacked(["a0", "a1", "a2"], ids, grads)
        for t, part in enumerate(torch.split(grads, [4, 3, 0])):
            if part.shape[0]:
                c.push(f"b{t}", ids[t], part)
        c.flush()
        for t in range(3):
            torch.testing.assert_close(c.pull(f"a{t}", torch.arange(50)), c.pull(f"b{t}", torch.arange(50)),
                                       rtol=0, atol=0)
        before = [c.pull(f"a{t}", torch.arange(50)) for t in range(3)]
        nan = grads.clone()
        nan[5, 1] = float("nan")
        with pytest.raises(InvalidArgumentError, match="a1: gradient contains NaN"):
            c.push_stacked(["a0", "a1", "a2"], ids, nan)
        with pytest.raises(IdOutOfRangeError, match="a0: id 50 out of range"):
            c.push_stacked(["a0", "a1", "a2"], [torch.tensor([1, 50, 3, 4]), ids[1], ids[2]], grads)
        with pytest.raises(InvalidArgumentError, match=r"grads must have shape \[7, 4\]"):
            c.push_stacked(["a0", "a1", "a2"], ids, grads[:6])
        with pytest.raises(KeyError, match="nope"):
            c.push_stacked(["a0", "nope", "a2"], ids, grads)
        c.flush()
        for t in range(3):
            torch.testing.assert_close(c.pull(f"a{t}", torch.arange(50)), before[t], rtol=0, atol=0)


def test_one_pull_and_one_push_per_shard_per_step_for_the_whole_collection():
    with running_cluster(2, metrics_port=0) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(CONFIGS, c)
        urls = [f"http://127.0.0.1:{s.metrics_port}/metrics" for s in servers]
        kjt = _kjt(CASES["every feature"])
        for _ in range(2):  # the first step may meet tables' first rows; count the second alone
            before = [scrape(u) for u in urls]
            ebc(kjt).values().sum().backward()
            c.flush()
        for u, b in zip(urls, before):
            after = scrape(u)
            calls = {m: value(after, "shardps_requests_total", method=m) - value(b, "shardps_requests_total", method=m)
                     for m in ("Pull", "PullBatch", "Push", "PushBatch", "PullDense", "PushDense")}
            assert calls["Pull"] + calls["PullBatch"] == 1, calls
            assert calls["Push"] + calls["PushBatch"] == 1, calls
            assert calls["PullDense"] == calls["PushDense"] == 0


BAD = [
    ("unknown key", lambda: _kjt({"f1": [[1], [2]], "nope": [[1], [1]]}), KeyError, "feature 'nope'"),
    ("lengths do not sum to the values", lambda: KeyedJaggedTensor.from_lengths_sync(
        ["f1"], torch.tensor([1, 2, 3]), torch.tensor([1, 1])), ValueError, "add up to 2 ids, but there are 3"),
    ("negative length", lambda: KeyedJaggedTensor.from_lengths_sync(
        ["f1"], torch.tensor([1]), torch.tensor([2, -1])), ValueError, "feature 'f1': negative bag length -1"),
    ("id out of range", lambda: _kjt({"f1": [[1], [2]], "f3": [[20], [0]]}), IndexError,
     r"feature 'f3': id 20 out of range \[0, 20\) of table 'tb'"),
    ("float ids", lambda: KeyedJaggedTensor.from_lengths_sync(
        ["f1"], torch.tensor([1.0, 2.0]), torch.tensor([1, 1])), TypeError, "int64 or int32"),
    ("ragged keys", lambda: KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f2"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1])), ValueError, "not a whole number of bags"),
    # TorchRec refuses these three too (in its own words); they were flattened, or the stride ignored
    ("2-D values", lambda: KeyedJaggedTensor(["f1"], torch.tensor([[1, 2], [3, 4]]), lengths=torch.tensor([2, 2])),
     ValueError, r"values and lengths must be 1-D, got shapes \[2, 2\] and \[2\]"),
    ("a stride its lengths do not give", lambda: KeyedJaggedTensor(
        ["f1"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]), stride=3), ValueError,
     r"the batch says 3 bags a feature \(stride\), its lengths give 2"),
    ("no features", lambda: KeyedJaggedTensor([], torch.tensor([], dtype=torch.int64),
                                              lengths=torch.tensor([], dtype=torch.int64)), ValueError,
     "a batch with no features"),
]


def test_bad_input_is_refused_naming_the_feature_and_nothing_is_pulled_or_pushed():
    with running_cluster(1) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(CONFIGS, c)
        stats = c.shard_info()[0].stats
        for _, make, error, message in BAD:
            with pytest.raises(error, match=message):
                ebc(make())
        c.flush()
        after = c.shard_info()[0].stats
        assert (after.pulls, after.pushes) == (stats.pulls, stats.pushes)
        with pytest.raises(ValueError, match=r"table 'ta' on the shards is 30 x 4, the config says 31 x 4"):
            RemoteEmbeddingBagCollection([EmbeddingBagConfig(31, 4, "ta", ["f1"])], c, create=False)
        with pytest.raises(ValueError, match="a feature may read one table only"):
            RemoteEmbeddingBagCollection([EmbeddingBagConfig(30, 4, "ta", ["f1"]),
                                          EmbeddingBagConfig(20, 4, "tb", ["f1"])], c)


def test_a_batch_of_no_bags_gives_no_rows_of_every_column():
    """A batch of no bags (lengths empty): TorchRec's shape, [0, every feature's columns] (a reshape error before);
    and a container asked for a key it lacks raises KeyError naming it, as TorchRec's do."""
    with running_cluster(1) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(CONFIGS, c)
        none = torch.tensor([], dtype=torch.int64)
        empty = KeyedJaggedTensor(["f1"], none, lengths=none)
        out = ebc(empty)
        assert out.values().shape == (0, 4 + 4 + 4 + 3) and out.keys() == ["f1", "f2", "f3", "f4"]
        with pytest.raises(KeyError, match="'nope' is not a key"):
            _kjt({"f1": [[1], [2]]})["nope"]
        with pytest.raises(KeyError, match="'nope' is not a key"):
            out["nope"]


def test_a_prefetched_collection_reads_the_same_rows_without_a_pull_of_its_own():
    with running_cluster(2, metrics_port=0) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection(CONFIGS, c)
        batches = [_kjt(CASES["every feature"]), _kjt(CASES["keys in another order"])]
        with torch.no_grad():
            plain = [ebc(b).values() for b in batches]
        urls = [f"http://127.0.0.1:{s.metrics_port}/metrics" for s in servers]
        before = [scrape(u) for u in urls]
        for batch, expected in zip(Prefetcher(batches, c, ids_fn=ebc.ids_of, depth=1), plain):
            with torch.no_grad():
                torch.testing.assert_close(ebc(batch).values(), expected, rtol=0, atol=0)
        for u, b in zip(urls, before):  # one pull per batch and shard: the prefetches', none of the forwards' own
            after = scrape(u)
            assert sum(value(after, "shardps_requests_total", method=m) - value(b, "shardps_requests_total", method=m)
                       for m in ("Pull", "PullBatch")) == len(batches)
        # The plan ids_of made is reused by the forward of an equal input only: ids changed in place after
        # ids_of (a loader reusing its buffers) are planned again, and read the rows of the new ids.
        batch = _kjt(CASES["every feature"])
        ebc.ids_of(batch)
        batch.values()[:] = torch.tensor([i % 10 for i in range(batch.values().numel())])
        refs = _references(c, CONFIGS)
        with torch.no_grad():
            torch.testing.assert_close(ebc(batch).values(), _ref_forward(refs, batch, ["f1", "f2", "f3", "f4"], 2),
                                       rtol=0, atol=0)


EC_CONFIGS = [EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="ea", feature_names=["f1", "f2"],
                              optimizer=SGD(lr=1.0)),
              EmbeddingConfig(num_embeddings=10, embedding_dim=2, name="eb", feature_names=["f3"],
                              optimizer=SGD(lr=1.0))]


def _ec_kjt() -> KeyedJaggedTensor:
    """Unpooled lookups of EC_CONFIGS' features, keys out of the configs' order, one bag empty."""
    return KeyedJaggedTensor.from_lengths_sync(["f3", "f1", "f2"], torch.tensor([1, 9, 9, 3, 3, 29, 0]),
                                               torch.tensor([2, 1, 0, 2, 1, 1]))


def _rows(c: Client, configs: list) -> dict[str, torch.Tensor]:
    """Every row of each config's table, as the shards hold it now."""
    return {cfg.name: c.pull(cfg.name, torch.arange(cfg.num_embeddings)) for cfg in configs}


def test_embedding_collection_matches_nn_embedding_per_feature():
    configs = EC_CONFIGS
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ec = RemoteEmbeddingCollection(configs, c)
        refs = _references(c, configs)
        before = _rows(c, configs)
        kjt = _ec_kjt()
        out = ec(kjt)
        loss = torch.zeros(())
        ref_loss = torch.zeros(())
        for f, table in (("f1", "ea"), ("f2", "ea"), ("f3", "eb")):
            jt = kjt[f]
            expected = refs[table](jt.values())
            torch.testing.assert_close(out[f].values(), expected, rtol=0, atol=0)
            assert out[f].lengths().tolist() == jt.lengths().tolist()
            w = torch.randn(expected.shape)
            loss = loss + (out[f].values() * w).sum()
            ref_loss = ref_loss + (expected * w).sum()
        loss.backward()
        ref_loss.backward()
        c.flush()
        for cfg in configs:
            torch.testing.assert_close(before[cfg.name] - c.pull(cfg.name, torch.arange(cfg.num_embeddings)),
                                       refs[cfg.name].weight.grad, rtol=1e-5, atol=1e-6)


def test_kjt_and_keyed_tensor_follow_torchrec_layout():
    kjt = KeyedJaggedTensor.from_offsets_sync(["a", "b"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 2, 3, 5]))
    assert kjt.stride() == 2 and kjt.lengths().tolist() == [2, 0, 1, 2] and kjt.length_per_key() == [2, 3]
    assert kjt["b"].values().tolist() == [3, 4, 5] and kjt["b"].lengths().tolist() == [1, 2]
    assert [t.tolist() for t in kjt.to_dict()["a"].to_dense()] == [[1, 2], []]
    again = KeyedJaggedTensor.from_jt_dict(kjt.to_dict())
    assert again.values().tolist() == kjt.values().tolist() and again.lengths().tolist() == kjt.lengths().tolist()
    weighted = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([7, 8]), torch.tensor([2]),
                                                   weights=torch.tensor([0.5, 2.0]))
    moved = weighted.to("cpu")  # TorchRec's to(device): every tensor moved, keys and stride kept
    assert moved is not weighted and moved.keys() == ["a"] and moved.stride() == 1 and moved.device().type == "cpu"
    assert moved.weights().tolist() == [0.5, 2.0] and moved["a"].values().tolist() == [7, 8]
    kt = KeyedTensor.from_tensor_list(["x", "y"], [torch.ones(2, 3), torch.zeros(2, 1)])
    assert kt.to("cpu").length_per_key() == [3, 1] and kt.to("cpu").device().type == "cpu"
