"""The trainer-side row cache (Client.cache_table) against real shards.

The reference for what the shards end up holding is torch.optim.SGD applied to
the same gradients: SGD's update of a summed gradient equals that of the
separate pushes, so after ``flush()`` a cached table must hold what an uncached
one holds (up to float32 summation order).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from shardps_client import Client, InvalidArgumentError, Prefetcher

from shardps.core.optim import SGD
from shardps.core.specs import Initializer, SyncPolicy

DIM = 4


def _table(c: Client, name: str, lr: float = 1.0) -> None:
    c.create_table(name, dim=DIM, num_embeddings=1000, optimizer=SGD(lr=lr), initializer=Initializer(seed=3))


def _grad(step: int, n: int) -> torch.Tensor:
    return torch.arange(n * DIM, dtype=torch.float32).reshape(n, DIM) * 0.01 + step


def test_rows_are_served_for_k_steps_and_their_gradients_pushed_summed(client2: Client) -> None:
    _table(client2, "c")
    _table(client2, "ref")
    k = 3
    client2.cache_table("c", steps=k, max_rows=100)
    ids = torch.tensor([5, 7, 11])
    first = client2.pull("ref", ids)
    reference = torch.nn.Parameter(first.clone())
    sgd = torch.optim.SGD([reference], lr=1.0)
    applied = first.clone()  # what the shards hold after the pushes sent so far
    for step in range(1, 8):
        served = client2.pull("c", ids)
        # Pulled at steps 1, 4, 7; in between, the rows of the last pull are served.
        torch.testing.assert_close(served, applied, rtol=1e-6, atol=1e-5)
        g = _grad(step, 3)
        client2.push("c", ids, g)
        client2.push("ref", ids, g)
        sgd.zero_grad()
        reference.grad = g.clone()
        sgd.step()
        if step % k == 0:  # the next pull starts by pushing the k summed gradients
            applied = reference.detach().clone()
    client2.flush()
    stats = client2.cache_stats("c")
    assert (stats.hits, stats.misses, stats.pushed) == (4 * 3, 3 * 3, 3 * 3)
    assert stats.absorbed == 7 * 3 and stats.rows == 0  # flush drained the cache
    torch.testing.assert_close(client2.pull("c", ids), reference.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(client2.pull("c", ids), client2.pull("ref", ids), rtol=0, atol=1e-5)


def test_k0_turns_the_cache_off_and_pushes_what_it_held(client2: Client) -> None:
    _table(client2, "c")
    client2.cache_table("c", steps=4)
    ids = torch.tensor([1, 2])
    before = client2.pull("c", ids)
    client2.push("c", ids, torch.ones(2, DIM))
    client2.cache_table("c", steps=0)  # off: the summed gradient goes out now
    client2.flush()
    torch.testing.assert_close(client2.pull("c", ids), before - 1.0)
    client2.push("c", ids, torch.ones(2, DIM))  # no cache: straight to the shards
    torch.testing.assert_close(client2.pull("c", ids), before - 2.0)
    assert client2.cache_stats("c") is None


def test_a_full_cache_passes_rows_through(client2: Client) -> None:
    _table(client2, "c")
    client2.cache_table("c", steps=10, max_rows=2)
    ids = torch.tensor([1, 2, 3, 4])
    before = client2.pull("c", ids)  # rows 1 and 2 are cached, 3 and 4 are not
    client2.push("c", ids, torch.ones(4, DIM))
    client2.pushes.wait("c")
    with Client(client2.addresses, timeout=10) as other:  # what the shards hold now
        now = other.pull("c", ids)
    torch.testing.assert_close(now[:2], before[:2])  # summed locally, not pushed yet
    torch.testing.assert_close(now[2:], before[2:] - 1.0)
    stats = client2.cache_stats("c")
    assert (stats.rows, stats.not_cached, stats.absorbed) == (2, 2, 2)
    client2.flush()
    torch.testing.assert_close(client2.pull("c", ids), before - 1.0)


def test_prefetched_cached_steps_need_no_pull_of_their_own_and_lose_no_update(client2: Client) -> None:
    """With Prefetcher and a cache, every step's rows come from the cache or the prefetch (no pull waits),
    and after flush() the shards hold every gradient applied once (torch.optim.SGD on the summed gradients)."""
    _table(client2, "c", lr=0.5)
    client2.cache_table("c", steps=3, max_rows=1000)
    rng = np.random.default_rng(0)
    batches = [torch.from_numpy(rng.integers(0, 40, 30)) for _ in range(12)]
    grads = [torch.from_numpy(rng.standard_normal((30, DIM)).astype(np.float32)) for _ in batches]
    start = client2.pull("c", torch.arange(40))
    client2.flush()  # (the pull above made a generation; start clean)
    waited = []
    real = client2._pulls._pull_unique_many

    def counting(items, wire_code):  # type: ignore[no-untyped-def]
        if threading.current_thread() is threading.main_thread():
            waited.append(sum(u.shape[0] for _, u in items))
        return real(items, wire_code)

    client2._pulls._pull_unique_many = counting  # type: ignore[method-assign]
    total = torch.zeros(40, DIM)
    for ids, g in zip(Prefetcher(batches, client2, lambda b: {"c": b}, depth=1), grads):
        client2.pull("c", ids)
        client2.push("c", ids, g)
        total.index_add_(0, ids, g)
    assert sum(waited) == 0, waited
    client2.flush()
    reference = torch.nn.Parameter(start.clone())
    reference.grad = total
    torch.optim.SGD([reference], lr=0.5).step()
    torch.testing.assert_close(client2.pull("c", torch.arange(40)), reference.detach(), rtol=1e-5, atol=1e-5)
    assert client2.cache_stats("c").hits > 0


def test_bad_cache_settings_are_refused(client2: Client) -> None:
    _table(client2, "c")
    client2.create_table("s", dim=DIM, num_embeddings=10, sync=SyncPolicy(workers=1))
    with pytest.raises(InvalidArgumentError, match="s: a synchronous table cannot be cached"):
        client2.cache_table("s", steps=2)
    with pytest.raises(InvalidArgumentError, match="cache steps must be an int >= 0, got -1"):
        client2.cache_table("c", steps=-1)
    with pytest.raises(InvalidArgumentError, match="cache max_rows must be an int >= 1, got 0"):
        client2.cache_table("c", steps=2, max_rows=0)
