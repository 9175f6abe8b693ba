"""Optimizer math checked step by step against torch.optim (the reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardps.core.optim import SGD, Adagrad, Adam, optimizer_from_dict, optimizer_to_dict
from shardps.core.specs import Initializer, Staleness, TableSpec
from shardps.server.storage.table import Table

CASES = [
    (SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (SGD(lr=0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    (SGD(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    (SGD(lr=0.05, momentum=0.8, nesterov=True), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True)),
    (Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    (Adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.1, eps=1e-6),
     lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.1, eps=1e-6)),
    (Adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    (Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
     lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)),
]
IDS = [f"{type(o).__name__}-{i}" for i, (o, _) in enumerate(CASES)]


def _table(opt, rows: int, dim: int) -> Table:
    spec = TableSpec(name="t", dim=dim, num_embeddings=rows, optimizer=opt, initializer=Initializer("normal", seed=3))
    return Table(spec, owns=lambda ids: np.ones(ids.shape, dtype=bool), expected_rows=rows)


def _tol(opt) -> dict:
    # SGD is bit-exact (same fused float32 arithmetic as torch); Adagrad/Adam round sqrt/division differently.
    return dict(rtol=0, atol=0) if isinstance(opt, SGD) else dict(rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("opt,make_ref", CASES, ids=IDS)
def test_dense_steps_match_torch(opt, make_ref):
    rows, dim, steps = 6, 5, 25
    table = _table(opt, rows, dim)
    ids = np.arange(rows)
    with table.lock:
        start = table._slots(ids, create=True)
    ref = torch.nn.Parameter(torch.from_numpy(table.rows[start].copy()))
    ref_opt = make_ref([ref])
    rng = np.random.default_rng(0)
    for _ in range(steps):
        g = rng.standard_normal((rows, dim)).astype(np.float32)
        with table.lock:
            table.apply(ids, g, 1.0)
        ref.grad = torch.from_numpy(g.copy())
        ref_opt.step()
        np.testing.assert_allclose(table.rows[table.index.lookup(ids)], ref.detach().numpy(), **_tol(opt))


@pytest.mark.parametrize("opt,make_ref", CASES, ids=IDS)
def test_sparse_lazy_rows_match_per_row_torch(opt, make_ref):
    """Each row behaves as its own torch parameter, stepped only when it gets a gradient."""
    rows, dim, steps = 12, 4, 30
    table = _table(opt, rows, dim)
    all_ids = np.arange(rows)
    with table.lock:
        init = table.rows[table._slots(all_ids, create=True)].copy()
    params = [torch.nn.Parameter(torch.from_numpy(init[i].copy())) for i in range(rows)]
    ref_opt = make_ref(params)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        ids = rng.integers(0, rows, 7)  # duplicates on purpose
        g = rng.standard_normal((7, dim)).astype(np.float32)
        with table.lock:
            table.apply(ids, g, 1.0)
        for i, p in enumerate(params):
            mask = ids == i
            p.grad = torch.from_numpy(g[mask].sum(0)) if mask.any() else None
        ref_opt.step()
        got = table.rows[table.index.lookup(all_ids)]
        want = torch.stack([p.detach() for p in params]).numpy()
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_duplicate_ids_are_summed_before_the_update():
    # Adagrad is not linear in the gradient: applying duplicates one by one would differ.
    a, b = _table(Adagrad(lr=0.5), 4, 3), _table(Adagrad(lr=0.5), 4, 3)
    g = np.random.default_rng(2).standard_normal((3, 3)).astype(np.float32)
    with a.lock, b.lock:
        a.apply(np.array([1, 1, 2]), g, 1.0)
        b.apply(np.array([1, 2]), np.stack([g[0] + g[1], g[2]]), 1.0)
    np.testing.assert_array_equal(a.rows[a.index.lookup(np.array([1, 2]))], b.rows[b.index.lookup(np.array([1, 2]))])


@pytest.mark.parametrize("policy,s,scale", [
    (Staleness("none"), 5, 1.0),
    (Staleness("inverse"), 3, 0.25),
    (Staleness("linear", alpha=0.1), 5, 1 / 1.5),
])
def test_staleness_scaling(policy, s, scale):
    assert policy.lr_scale(s) == pytest.approx(scale)
    a, b = _table(SGD(lr=0.2), 2, 2), _table(SGD(lr=0.2 * scale), 2, 2)
    g = np.ones((1, 2), np.float32)
    with a.lock, b.lock:
        a.apply(np.array([0]), g, policy.lr_scale(s))
        b.apply(np.array([0]), g, 1.0)
    np.testing.assert_allclose(a.rows[:1], b.rows[:1], rtol=1e-6)


def test_bad_hyperparameters_are_named():
    with pytest.raises(ValueError, match="SGD lr must be >= 0"):
        SGD(lr=-1)
    with pytest.raises(ValueError, match="nesterov needs momentum"):
        SGD(nesterov=True)
    with pytest.raises(ValueError, match="Adam betas"):
        Adam(betas=(1.0, 0.9))


def test_optimizer_dict_roundtrip():
    for opt, _ in CASES:
        assert optimizer_from_dict(optimizer_to_dict(opt)) == opt
