"""Server-side optimizer math: pure functions over row arrays with explicit state.

Each optimizer is a frozen dataclass holding its hyper-parameters (defaults as
in ``torch.optim``) and a ``step`` function that updates a block of rows in
place. Storage gathers the rows touched by a push, calls ``step`` on the
gathered copies and scatters them back; the math knows nothing of storage.

Sparse semantics are lazy: only rows present in a push change, and every row
carries its own step count, so a row's trajectory equals ``torch.optim``
applied to that row as a parameter of its own, stepped whenever it receives a
gradient (the reference used by the tests).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol, Union, runtime_checkable

import numpy as np

from shardps.core import kernels
from shardps.core.errors import InvalidArgument


@dataclass(frozen=True)
class SGD:
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    Args:
        lr: learning rate.
        momentum: momentum factor; 0 keeps no per-row buffer.
        dampening: dampening for momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum (needs momentum > 0 and dampening == 0).
    """

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_finite(self)
        _check(self.lr >= 0, f"SGD lr must be >= 0, got {self.lr}")
        _check(self.momentum >= 0, f"SGD momentum must be >= 0, got {self.momentum}")
        _check(self.weight_decay >= 0, f"SGD weight_decay must be >= 0, got {self.weight_decay}")
        _check(
            not self.nesterov or (self.momentum > 0 and self.dampening == 0),
            "SGD nesterov needs momentum > 0 and dampening == 0",
        )

    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def initial_state(self, name: str) -> float:
        return 0.0

    def step(
        self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: np.ndarray, lr_scale: float
    ) -> None:
        d_p = grad
        if self.weight_decay != 0:
            d_p = axpy(d_p, self.weight_decay, param)
        if self.momentum != 0:
            buf = state["momentum_buffer"]
            first = (step == 1)[:, None]
            updated = axpy(np.float32(self.momentum) * buf, 1 - self.dampening, d_p)
            buf[...] = np.where(first, d_p, updated)
            d_p = axpy(d_p, self.momentum, buf) if self.nesterov else buf
        param[...] = axpy(param, -self.lr * lr_scale, d_p)

    def apply(self, rows: np.ndarray, state: dict[str, np.ndarray], slots: np.ndarray, grad: np.ndarray,
              step: np.ndarray, lr_scale: float) -> None:
        k = kernels.jit()
        if k is None:
            return apply_numpy(self, rows, state, slots, grad, step, lr_scale)
        buf = state.get("momentum_buffer", rows)  # (rows stands in when there is no buffer; never written)
        k.sgd_apply(rows, buf, slots, step == 1, _c(grad), _f32(-self.lr * lr_scale), self.weight_decay != 0,
                    _f32(self.weight_decay), self.momentum != 0, _f32(self.momentum), np.float32(self.momentum),
                    _f32(1 - self.dampening), self.nesterov)


@dataclass(frozen=True)
class Adagrad:
    """Adagrad, as ``torch.optim.Adagrad``.

    Args:
        lr: learning rate.
        lr_decay: learning-rate decay per step of the row.
        weight_decay: L2 penalty added to the gradient.
        initial_accumulator_value: starting value of the squared-gradient sum.
        eps: added to the denominator.
    """

    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10

    def __post_init__(self) -> None:
        _check_finite(self)
        _check(self.lr >= 0, f"Adagrad lr must be >= 0, got {self.lr}")
        _check(self.lr_decay >= 0, f"Adagrad lr_decay must be >= 0, got {self.lr_decay}")
        _check(self.weight_decay >= 0, f"Adagrad weight_decay must be >= 0, got {self.weight_decay}")
        _check(
            self.initial_accumulator_value >= 0,
            f"Adagrad initial_accumulator_value must be >= 0, got {self.initial_accumulator_value}",
        )
        _check(self.eps >= 0, f"Adagrad eps must be >= 0, got {self.eps}")

    def state_names(self) -> tuple[str, ...]:
        return ("sum",)

    def initial_state(self, name: str) -> float:
        return self.initial_accumulator_value

    def step(
        self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: np.ndarray, lr_scale: float
    ) -> None:
        if self.weight_decay != 0:
            grad = axpy(grad, self.weight_decay, param)
        acc = state["sum"]
        acc += grad * grad
        std = np.sqrt(acc) + np.float32(self.eps)
        param -= self._clr(step, lr_scale)[:, None] * (grad / std)

    def _clr(self, step: np.ndarray, lr_scale: float) -> np.ndarray:
        """Each row's learning rate (float32), decayed by its own step count; without decay (the default) every row's
        is the same, the formula's value (x / 1.0 is x), without its five passes over the rows."""
        if self.lr_decay == 0:
            return np.full(step.shape, self.lr * lr_scale, dtype=np.float32)
        return ((self.lr * lr_scale) / (1 + (step.astype(np.float64) - 1) * self.lr_decay)).astype(np.float32)

    def apply(self, rows: np.ndarray, state: dict[str, np.ndarray], slots: np.ndarray, grad: np.ndarray,
              step: np.ndarray, lr_scale: float) -> None:
        k = kernels.jit()
        if k is None:
            return apply_numpy(self, rows, state, slots, grad, step, lr_scale)
        k.adagrad_apply(rows, state["sum"], slots, self._clr(step, lr_scale), _c(grad), self.weight_decay != 0,
                        _f32(self.weight_decay), np.float32(self.eps))


@dataclass(frozen=True)
class Adam:
    """Adam, as ``torch.optim.Adam`` (L2 weight decay, not AdamW), lazy per row.

    Args:
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradient.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        _check_finite(self)
        _check(self.lr >= 0, f"Adam lr must be >= 0, got {self.lr}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"Adam betas must be in [0, 1), got {self.betas}")
        _check(self.eps >= 0, f"Adam eps must be >= 0, got {self.eps}")
        _check(self.weight_decay >= 0, f"Adam weight_decay must be >= 0, got {self.weight_decay}")

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def initial_state(self, name: str) -> float:
        return 0.0

    def step(
        self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: np.ndarray, lr_scale: float
    ) -> None:
        beta1, beta2 = self.betas
        if self.weight_decay != 0:
            grad = axpy(grad, self.weight_decay, param)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m += np.float32(1 - beta1) * (grad - m)
        v *= np.float32(beta2)
        v += np.float32(1 - beta2) * (grad * grad)
        step_size, bc2_sqrt = self._factors(step, lr_scale)
        denom = np.sqrt(v) / bc2_sqrt[:, None] + np.float32(self.eps)
        param -= step_size[:, None] * (m / denom)

    def _factors(self, step: np.ndarray, lr_scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Each row's step size and square root of the second moment's bias correction (float32)."""
        beta1, beta2 = self.betas
        steps = step.astype(np.float64)
        step_size = (self.lr * lr_scale) / (1 - beta1**steps)
        bc2_sqrt = np.sqrt(1 - beta2**steps)
        return step_size.astype(np.float32), bc2_sqrt.astype(np.float32)

    def apply(self, rows: np.ndarray, state: dict[str, np.ndarray], slots: np.ndarray, grad: np.ndarray,
              step: np.ndarray, lr_scale: float) -> None:
        k = kernels.jit()
        if k is None:
            return apply_numpy(self, rows, state, slots, grad, step, lr_scale)
        beta1, beta2 = self.betas
        step_size, bc2_sqrt = self._factors(step, lr_scale)
        k.adam_apply(rows, state["exp_avg"], state["exp_avg_sq"], slots, step_size, bc2_sqrt, _c(grad),
                     self.weight_decay != 0, _f32(self.weight_decay), np.float32(1 - beta1), np.float32(beta2),
                     np.float32(1 - beta2), np.float32(self.eps))


Optimizer = Union[SGD, Adagrad, Adam]  # the optimizers a spec can name (and the wire can carry)


@runtime_checkable
class RowOptimizer(Protocol):
    """What storage asks of an optimizer: its per-row state arrays and an in-place step over gathered rows.

    A new optimizer implements these four methods (``apply`` may just call ``apply_numpy``) (and gets a message in the proto and a case in
    ``optimizer_to_dict``/``specs``); the tables never look at which one they hold.
    """

    def state_names(self) -> tuple[str, ...]:
        """Names of the per-row state arrays (each shaped like the rows)."""

    def initial_state(self, name: str) -> float:
        """The value a new row's state array ``name`` starts at."""

    def step(self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: np.ndarray,
             lr_scale: float) -> None:
        """Update gathered rows ``param`` in place from ``grad``; ``step``: each row's step count (from 1)."""

    def apply(self, rows: np.ndarray, state: dict[str, np.ndarray], slots: np.ndarray, grad: np.ndarray,
              step: np.ndarray, lr_scale: float) -> None:
        """``step`` on rows ``slots`` (unique) of a table's ``rows`` and ``state`` arrays, in place: a compiled
        kernel where there is one, else :func:`apply_numpy` (gather, ``step``, scatter)."""


def apply_numpy(opt: RowOptimizer, rows: np.ndarray, state: dict[str, np.ndarray], slots: np.ndarray,
                grad: np.ndarray, step: np.ndarray, lr_scale: float) -> None:
    """The reference of every ``apply``: gather the rows, ``step`` them, scatter them back."""
    param = np.take(rows, slots, axis=0)
    gathered = {k: np.take(v, slots, axis=0) for k, v in state.items()}
    opt.step(param, grad, gathered, step, lr_scale)
    rows[slots] = param
    for k, v in gathered.items():
        state[k][slots] = v


def _f32(x: float) -> float:
    """A hyper-parameter as the reference's ``axpy`` uses it: rounded to float32, carried as float64."""
    return float(np.float32(x))


def _c(grad: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(grad, dtype=np.float32)


def axpy(x: np.ndarray, a: float, y: np.ndarray) -> np.ndarray:
    """float32 ``x + a * y`` rounded once, as torch's fused ``x.add(y, alpha=a)`` computes it.

    The product of two float32 values is exact in float64, so one float64
    multiply-add and a final rounding to float32 reproduce the fused result.
    """
    out = y.astype(np.float64)
    out *= float(np.float32(a))
    out += x
    return out.astype(np.float32)


F32_MAX = 3.4028234663852886e38


def _check_finite(opt: object) -> None:
    """Every numeric hyperparameter must be finite in float32, where the kernels hold it: an lr of inf or nan (or of
    1e300, inf as float32) would wreck every row it touches."""
    for f in dataclasses.fields(opt):  # type: ignore[arg-type]
        value = getattr(opt, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            _check(isinstance(v, bool) or (math.isfinite(v) and abs(v) <= F32_MAX),
                   f"{type(opt).__name__} {f.name} must be finite in float32 (at most {F32_MAX:.4g}), got {value}")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidArgument(message)


def optimizer_to_dict(opt: Optimizer) -> dict:
    """A JSON-able description, e.g. ``{"type": "adam", "lr": 0.001, ...}``."""
    d = dataclasses.asdict(opt)
    d["type"] = type(opt).__name__.lower()
    if "betas" in d:
        d["betas"] = list(d["betas"])
    return d


def optimizer_from_dict(d: dict) -> Optimizer:
    """Inverse of :func:`optimizer_to_dict`."""
    d = dict(d)
    kind = d.pop("type")
    cls = {"sgd": SGD, "adagrad": Adagrad, "adam": Adam}.get(kind)
    if cls is None:
        raise ValueError(f"unknown optimizer type {kind!r}")
    if "betas" in d:
        d["betas"] = tuple(d["betas"])
    return cls(**d)
