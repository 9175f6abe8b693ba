"""``TrainPipeline``: training pipelined by default, in TorchRec's shape (``progress(batches)``). The exact mode
(depth 0) trains bit for bit as local ``torch.optim.SGD`` over ``nn.EmbeddingBag`` (the reference); the default
(depth 1) asks for the next batch's rows before the current step's forward, and loses or doubles no update (a model
whose gradients do not depend on the rows read, so the end state is known whatever the staleness). Real shards
(in-process gRPC servers on port 0)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from shardps_client import (
    SGD,
    Client,
    EmbeddingBagConfig,
    Initializer,
    KeyedJaggedTensor,
    RemoteEmbeddingBag,
    RemoteEmbeddingBagCollection,
    ShardedOptimizer,
    TableNotFoundError,
    TrainPipeline,
)
from torch import nn

from tests.conftest import running_cluster

ROWS, DIM, BATCH, STEPS = 50, 4, 8, 12
FEATURES = ["f0", "f1"]


def kjt_batches(seed: int):
    """Batches whose ids repeat within a table, each at most twice a step: a row's gradients are then summed
    exactly in any order. (Three or more are summed in an order nn.EmbeddingBag's backward takes from an unstable
    sort, which differs by CPU: on an AVX-512 machine one row came out 1 ulp from the shards' sum in input order.)"""
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        lengths = torch.randint(1, 4, (len(FEATURES) * BATCH,), generator=g)
        values = []
        for n in lengths.view(len(FEATURES), BATCH).sum(1).tolist():
            once = torch.randperm(ROWS, generator=g)[:(n + 1) // 2]
            both = torch.cat([once, once[:n - once.numel()]])
            values.append(both[torch.randperm(n, generator=g)])
        yield (KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.cat(values), lengths, stride=BATCH),
               torch.rand(BATCH, generator=g))


class Model(nn.Module):
    """A collection and a linear head; returns its loss, as TorchRec's DLRMTrain does."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.head = nn.Linear(DIM * len(FEATURES), 1)

    def forward(self, kjt, labels):
        return F.binary_cross_entropy_with_logits(self.head(self.ebc(kjt).values()).squeeze(1), labels)


WEIGHTS = torch.arange(1, DIM + 1, dtype=torch.float32)


class WeightedBag(nn.Module):
    """Sum-bags of the table "items" times fixed ``WEIGHTS``: gradients that do not depend on the rows read, so the
    end state is known whatever rows a pipelined step read. ``on_rows`` sees each batch's bags; with ``dense``, a
    dense parameter on the shards too (pushed with each step, its gradient 0)."""

    def __init__(self, c: Client, on_rows, dense: bool = False) -> None:
        super().__init__()
        self.items = RemoteEmbeddingBag(c, "items", mode="sum")
        self.scale = nn.Parameter(torch.ones(1)) if dense else None
        self.on_rows = on_rows

    def forward(self, ids, offsets):
        rows = self.items(ids, offsets)
        self.on_rows(rows)
        loss = (rows * WEIGHTS).sum()
        return loss + 0 * self.scale.sum() if self.scale is not None else loss


def bag_batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS batches of BATCH bags of two random ids each: (ids, offsets)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, ROWS, (BATCH * 2,), generator=g), torch.arange(0, BATCH * 2, 2)) for _ in range(STEPS)]


def test_exact_mode_trains_as_local_sgd_bit_for_bit():
    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name=f"t{i}", feature_names=[f],
                                  optimizer=SGD(lr=0.5), initializer=Initializer("normal", std=0.3, seed=i))
               for i, f in enumerate(FEATURES)]
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        model = Model(RemoteEmbeddingBagCollection(configs, c))
        local_tables = [nn.EmbeddingBag(ROWS, DIM, mode="sum") for _ in FEATURES]
        with torch.no_grad():
            for i, t in enumerate(local_tables):
                t.weight.copy_(c.pull(f"t{i}", torch.arange(ROWS)))
        head = copy.deepcopy(model.head)
        opt = torch.optim.SGD(model.head.parameters(), lr=0.5)
        local_opt = torch.optim.SGD([*head.parameters(), *(t.weight for t in local_tables)], lr=0.5)
        pipeline = TrainPipeline(model, opt, depth=0)
        losses = list(pipeline.run(kjt_batches(1)))
        pipeline.flush()
        assert pipeline.steps == STEPS
        for step, (kjt, labels) in enumerate(kjt_batches(1)):
            local_opt.zero_grad()
            d = kjt.to_dict()
            pooled = torch.cat([t(d[f].values(), d[f].offsets()[:-1]) for t, f in zip(local_tables, FEATURES)], dim=1)
            loss = F.binary_cross_entropy_with_logits(head(pooled).squeeze(1), labels)
            loss.backward()
            local_opt.step()
            assert torch.equal(loss.detach(), losses[step].detach()), step
        for i, t in enumerate(local_tables):
            assert torch.equal(c.pull(f"t{i}", torch.arange(ROWS)), t.weight.detach()), f"t{i}"


def test_default_pulls_the_next_batch_during_the_step_and_loses_no_update():
    """Gradients that do not depend on the rows read (loss = sum of the rows times fixed weights): whatever rows a
    pipelined step read, the end state is known: each row moved by -lr x its count x the weight."""
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        c.create_table("items", num_embeddings=ROWS, dim=DIM, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        events: list[str] = []
        asked = c.prefetch_many

        def prefetch_many(requests, *args, **kwargs):
            events.append("prefetch")
            return asked(requests, *args, **kwargs)

        c.prefetch_many = prefetch_many  # type: ignore[method-assign]
        data = bag_batches(3)
        model = WeightedBag(c, lambda rows: events.append("forward"))
        pipeline = TrainPipeline(model, ShardedOptimizer(c, model), ids_fn=lambda b: {"items": b[0]})
        batches = iter(data)
        for _ in range(STEPS):
            pipeline.progress(batches)
        with pytest.raises(StopIteration):
            pipeline.progress(batches)
        pipeline.flush()
        # the rows of batch i+1 were asked for before batch i's forward (batch 0's and 1's before the first)
        assert events[:3] == ["prefetch", "prefetch", "forward"], events[:6]
        assert events.count("prefetch") == STEPS and events.count("forward") == STEPS
        counts = torch.bincount(torch.cat([ids for ids, _ in data]), minlength=ROWS).float()
        assert torch.equal(c.pull("items", torch.arange(ROWS)), -counts[:, None] * WEIGHTS[None, :])


def test_a_pipeline_needs_to_know_the_rows():
    with running_cluster(1) as servers, Client([s.address for s in servers]) as c:
        c.create_table("items", num_embeddings=ROWS, dim=DIM)
        model = nn.Sequential(RemoteEmbeddingBag(c, "items"))
        with pytest.raises(ValueError, match="ids_fn"):
            TrainPipeline(model, ShardedOptimizer(c, model), client=c)
        with pytest.raises(ValueError, match="client="):
            TrainPipeline(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_a_steps_pushes_travel_with_the_next_batchs_pulls():
    """Pipelined, a step's pushes (rows and dense gradients, with the dense values asked back) and the pulls of the
    batch after next go to each shard in one call: the rows read are those a pull right after the pushes reads
    (batch k+1's rows hold the pushes of steps up to k-1, as without the carrying), and nothing is lost."""
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        c.create_table("items", num_embeddings=ROWS, dim=DIM, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        seen: list[torch.Tensor] = []
        carried: list[bool] = []
        carry = c.pushes.carry

        def watched(pulls):
            calls = carry(pulls)
            carried.append(calls is not None and set(calls) == {0, 1})
            return calls

        c.pushes.carry = watched  # type: ignore[method-assign]
        data = bag_batches(5)
        model = WeightedBag(c, lambda rows: seen.append(rows.detach().clone()), dense=True)
        pipeline = TrainPipeline(model, ShardedOptimizer(c, model), ids_fn=lambda b: {"items": b[0]})
        for _ in pipeline.run(iter(data)):
            pass
        pipeline.flush()
        assert not c.pushes.parked  # the last step's pushes went when the batches ran out
        # Batches 0 and 1 are asked for before the first step; every later batch's pulls carried a step's pushes.
        assert carried == [True] * (STEPS - 2), carried
        for k, rows in enumerate(seen):  # batch k's rows hold the pushes of steps 0..k-2
            pushed = [torch.zeros(0, dtype=torch.int64)] + [ids for ids, _ in data[: max(0, k - 1)]]
            counts = torch.bincount(torch.cat(pushed), minlength=ROWS).float()
            ids, offsets = data[k]
            expect = torch.nn.functional.embedding_bag(ids, -counts[:, None] * WEIGHTS[None, :], offsets, mode="sum")
            assert torch.equal(rows, expect), k
        counts = torch.bincount(torch.cat([ids for ids, _ in data]), minlength=ROWS).float()
        assert torch.equal(c.pull("items", torch.arange(ROWS)), -counts[:, None] * WEIGHTS[None, :])


def test_a_loop_without_a_prefetcher_sends_each_steps_pushes_at_once():
    with running_cluster(1) as servers, Client([s.address for s in servers]) as c:
        c.create_table("items", num_embeddings=ROWS, dim=DIM, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        model = nn.Sequential(RemoteEmbeddingBag(c, "items", mode="sum"), nn.Linear(DIM, 1))
        opt = ShardedOptimizer(c, model)
        ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
        for step in range(3):
            opt.zero_grad()
            model[1](model[0](ids, offsets)).sum().backward()
            opt.step()
            # the first step waits for a prefetch that does not come (its zero_grad sends it); later ones go at once
            assert c.pushes.parked == (step == 0)
        opt.zero_grad()
        opt.flush()
        assert torch.count_nonzero(c.pull("items", torch.tensor([1, 2, 3, 4]))) > 0


def test_pulls_a_shard_could_not_serve_with_the_pushes_are_pulled_again():
    """Carried pulls a shard leaves out (a table dropped meanwhile, here) are pulled again when taken: the error is
    the pull's own, and the pushes they travelled with are applied."""
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c, \
            Client([s.address for s in servers]) as admin:
        c.create_table("items", num_embeddings=ROWS, dim=DIM, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        c.create_table("gone", num_embeddings=ROWS, dim=DIM)
        ids = torch.arange(ROWS)
        c.pull("gone", ids)  # (the client knows the table)
        model = nn.Sequential(RemoteEmbeddingBag(c, "items", mode="sum"))
        opt = ShardedOptimizer(c, model)
        opt.zero_grad()
        model[0](torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
        opt.step()
        assert c.pushes.parked
        admin.drop_table("gone")
        c.prefetch_many({"gone": ids}).result()  # carries the parked pushes: the shards leave the pulls out
        assert not c.pushes.parked
        with pytest.raises(TableNotFoundError, match="gone"):
            c.pull_many({"gone": ids})
        opt.flush()
        torch.testing.assert_close(c.pull("items", torch.tensor([1, 2])), -torch.ones(2, DIM))


def test_a_table_a_batch_reads_nothing_of_is_not_prefetched():
    """A batch in which every bag of one table's feature is empty (or the feature absent): the pipeline trains on
    it as a direct forward does (its prefetch of no ids used to raise "request has no ids", killing the trainer)."""
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        ebc = RemoteEmbeddingBagCollection([
            EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="ta", feature_names=["f1"]),
            EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="tb", feature_names=["f2"])],
            c, optimizer=SGD(lr=0.1))
        t = torch.tensor
        batches = [KeyedJaggedTensor(["f1", "f2"], t([1, 2, 3]), lengths=t([1, 1, 1, 0])),
                   KeyedJaggedTensor(["f1", "f2"], t([1, 2]), lengths=t([1, 1, 0, 0])),  # tb: no ids
                   KeyedJaggedTensor(["f1"], t([4, 5]), lengths=t([1, 1]))]  # f2 absent
        assert ebc.ids_of(batches[1]).keys() == {"ta"}
        model = nn.Sequential()
        model.ebc = ebc
        pipeline = TrainPipeline(model, ShardedOptimizer(c, model), forward=lambda m, b: m.ebc(b).values().sum())
        assert len(list(pipeline.run(batches))) == 3


def test_a_loop_that_stops_early_leaves_no_prefetched_rows_to_a_later_pull():
    """``for batch in Prefetcher(...): break`` left the next batch's prefetch behind: a pull of the same ids after
    later pushes was served the rows it read then (a push stale, with no bound). Closing the loop drops them."""
    from shardps_client import Prefetcher

    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        c.create_table("t", num_embeddings=ROWS, dim=DIM, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        batches = [torch.tensor([1, 2]), torch.tensor([5, 6]), torch.tensor([7])]
        for _ in Prefetcher(batches, c, lambda b: {"t": b}):
            break  # batch [5, 6] was prefetched, never taken
        c.push("t", torch.tensor([5, 6]), torch.ones(2, DIM), wait=True)
        assert torch.equal(c.pull("t", torch.tensor([5, 6])), -torch.ones(2, DIM))


def test_a_loader_that_fails_once_loses_no_batch():
    """The loader raises at one position: the step that asked for it hears the error, the batches read ahead of it
    were trained first, and the next ``progress`` on the same iterator goes on after it (it used to lose the batch
    read ahead, and every later call raised StopIteration)."""

    class Loader:  # yields [1], [2], raises once, then [3], [4], [5] (a loader that skips a bad record)
        def __init__(self) -> None:
            self.k, self.failed = 0, False

        def __iter__(self):
            return self

        def __next__(self):
            if self.k == 2 and not self.failed:
                self.failed = True
                raise RuntimeError("bad record")
            if self.k == 5:
                raise StopIteration
            self.k += 1
            return torch.tensor([self.k])

    with running_cluster(1) as servers, Client([s.address for s in servers]) as c:
        c.create_table("t", num_embeddings=ROWS, dim=DIM, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        seen: list[int] = []

        class Rows(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.rows = RemoteEmbeddingBag(c, "t", mode="sum")

            def forward(self, ids):
                seen.append(int(ids[0]))
                return self.rows(ids, torch.tensor([0])).sum()

        model = Rows()
        pipeline = TrainPipeline(model, ShardedOptimizer(c, model), ids_fn=lambda b: {"t": b})
        it = Loader()
        results = []
        for _ in range(8):
            try:
                pipeline.progress(it)
                results.append("ok")
            except StopIteration:
                break
            except RuntimeError as e:
                results.append(str(e))
        assert results == ["ok", "ok", "bad record", "ok", "ok", "ok"] and seen == [1, 2, 3, 4, 5], (results, seen)
        pipeline.flush()
        assert torch.equal(c.pull("t", torch.arange(1, 6)), -torch.ones(5, DIM))  # each batch's step, once
