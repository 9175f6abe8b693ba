"""Table, dense-tensor and initializer specs (a table's policies are in ``shardps.core.policies``), and
their protobuf forms."""

from __future__ import annotations

import base64
import math
import numbers
import re
from dataclasses import dataclass, field, replace
from typing import Optional, Union

import numpy as np

from shardps.core import kernels
from shardps.core.errors import InvalidArgument, clip
from shardps.core.optim import F32_MAX, SGD, Adagrad, Adam, Optimizer
from shardps.core.policies import Admission, DiskTier, Eviction, Staleness, SyncPolicy
from shardps.core.routing import SPLITMIX_GOLDEN, SPLITMIX_M1, SPLITMIX_M2, mix64
from shardps.v1 import shardps_pb2 as pb

NAME_RE = re.compile(r"^[A-Za-z0-9_.:/\-]+$")
MAX_NAME_LENGTH = 1024  # the format's ceiling; a shard's own limit (--max-name-length, default 128) is lower
MAX_DIM = 1 << 16
MAX_DENSE_NDIM = 8
MAX_DENSE_CHUNKS = 1 << 16  # a dense tensor's chunks (each its own shard's, by hash: chunk_rows)


def check_name(name: str, what: str = "table") -> None:
    if len(name or "") > MAX_NAME_LENGTH or not NAME_RE.match(name or ""):
        raise InvalidArgument(f"invalid {what} name {clip(repr(name))}: use 1-{MAX_NAME_LENGTH} characters "
                              "of [A-Za-z0-9_.:/-]")


@dataclass(frozen=True)
class Initializer:
    """How a row is initialised on first touch.

    Args:
        kind: "zeros", "normal" or "uniform".
        mean: mean of "normal".
        std: standard deviation of "normal".
        a: half-width of "uniform" (values in [-a, a)).
        seed: per-table seed; a row's initial value depends only on (seed, id).
    """

    kind: str = "normal"
    mean: float = 0.0
    std: float = 1.0
    a: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("zeros", "normal", "uniform"):
            raise InvalidArgument(f"initializer kind must be zeros, normal or uniform, got {self.kind!r}")
        if not (self.std >= 0 and self.a >= 0 and math.isfinite(self.mean)):
            raise InvalidArgument("initializer std and a must be >= 0 and mean finite")
        if not (abs(self.mean) + 8 * self.std <= F32_MAX and self.a <= F32_MAX):  # (inf and nan fail too)
            raise InvalidArgument(f"initializer values must stay finite in float32: |mean| + 8 std and a at most "
                                  f"{F32_MAX:.4g}, got mean {self.mean}, std {self.std}, a {self.a}")
        if not 0 <= self.seed < 2**64:
            raise InvalidArgument("initializer seed must fit in 64 unsigned bits")

    def rows(self, ids: np.ndarray, dim: int) -> np.ndarray:
        """Initial rows for ``ids`` (float32, shape [len(ids), dim]), deterministic per (seed, id).

        "normal": value j of a row is ``float32(mean + std * z)``, z drawn by a
        256-layer ziggurat from 64-bit hashes of (seed, id, j): no transcendental
        function for 98.5% of the values; compiled, 0.13-0.17 us of CPU per 64-dim row here, of which the rare slow
        path takes about 60 ns and the hashes 16-19 (``kernels.loops.normal_rows``).
        "uniform": each hash of (seed, id, column pair) gives two 24-bit uniforms.
        """
        n = len(ids)
        if self.kind == "zeros" or n == 0:
            return np.zeros((n, dim), dtype=np.float32)
        if self.kind == "normal":
            ids64 = np.ascontiguousarray(ids, dtype=np.int64)
            k = kernels.jit()
            if k is not None:
                return k.normal_rows(ids64, dim, self._row_seed(), _DRAW_SEED, float(self.mean), float(self.std),
                                     kernels.ZIG_K, kernels.ZIG_W, kernels.ZIG_F)
            return self.normal_rows_numpy(ids64, dim)
        pairs = (dim + 1) // 2
        counters = ids.astype(np.uint64)[:, None] * np.uint64(pairs) + np.arange(pairs, dtype=np.uint64)
        with np.errstate(over="ignore"):
            bits = mix64(counters, self._row_seed())
        scale = np.float32(1.0 / (1 << 24))
        u1 = (bits >> np.uint64(40)).astype(np.float32) * scale  # [0, 1)
        u2 = ((bits & np.uint64(0xFFFFFF)).astype(np.float32) + np.float32(0.5)) * scale  # (0, 1)
        out = np.empty((n, 2 * pairs), dtype=np.float32)
        a = np.float32(self.a)
        out[:, 0::2] = (u1 * 2 - 1) * a
        out[:, 1::2] = (u2 * 2 - 1) * a
        return out[:, :dim] if dim % 2 else out

    def _row_seed(self) -> np.uint64:
        """seed * 0xD1B54A32D192ED03 + 1 modulo 2**64 (Python's integers: no numpy overflow state to set)."""
        return np.uint64((int(self.seed) * 0xD1B54A32D192ED03 + 1) & 0xFFFFFFFFFFFFFFFF)

    def normal_rows_numpy(self, ids: np.ndarray, dim: int) -> np.ndarray:
        """The reference of the "normal" rows (and of their kernel): the ziggurat's first draw for every value
        at once, then the rare values it does not accept at once (about 1%) one by one."""
        base = mix64(ids, self._row_seed())
        with np.errstate(over="ignore"):
            words = mix64(base[:, None] + (np.arange(dim, dtype=np.uint64) << np.uint64(20)), _DRAW_SEED)
        idx = (words & np.uint64(0xFF)).astype(np.intp)
        mag = (words >> np.uint64(9)) & _MASK52
        z = mag.astype(np.float64) * kernels.ZIG_W[idx]
        z = np.where((words >> np.uint64(8)) & np.uint64(1) == 1, -z, z)
        for i, j in zip(*np.nonzero(mag >= kernels.ZIG_K[idx])):
            z[i, j] = _ziggurat_slow(int(base[i]), int(j))
        return (z * float(self.std) + float(self.mean)).astype(np.float32)


_DRAW_SEED = np.uint64(0x2545F4914F6CDD1D)  # the per-value hashes of the normal initializer
_MASK52 = np.uint64((1 << 52) - 1)
_M64 = (1 << 64) - 1


def _mix_int(x: int, seed: int) -> int:
    """splitmix64 (routing.mix64) of one Python int."""
    z = ((x ^ seed) + int(SPLITMIX_GOLDEN)) & _M64
    z = ((z ^ (z >> 30)) * int(SPLITMIX_M1)) & _M64
    z = ((z ^ (z >> 27)) * int(SPLITMIX_M2)) & _M64
    return z ^ (z >> 31)


def _ziggurat_slow(base: int, column: int) -> float:
    """A standard normal value by the ziggurat, drawing words (base, column, attempt) until one is accepted."""
    r_tail = kernels.ZIGGURAT_R
    zk, zw, zf = kernels.ZIG_K, kernels.ZIG_W, kernels.ZIG_F

    def draw(attempt: int) -> int:
        return _mix_int((base + ((column << 20) | attempt)) & _M64, int(_DRAW_SEED))

    def unit(word: int) -> float:
        return float(word >> 11) * (1.0 / 9007199254740992.0)

    attempt = 0
    while attempt < kernels.ZIG_ATTEMPTS:
        r = draw(attempt)
        attempt += 1
        idx, negative, mag = r & 0xFF, (r >> 8) & 1 == 1, (r >> 9) & ((1 << 52) - 1)
        x = float(mag) * float(zw[idx])
        if mag < int(zk[idx]):
            return -x if negative else x
        if idx == 0:  # the tail beyond R, by Marsaglia's exponential method
            while attempt + 1 < kernels.ZIG_ATTEMPTS:
                xx = -math.log1p(-unit(draw(attempt))) / r_tail
                yy = -math.log1p(-unit(draw(attempt + 1)))
                attempt += 2
                if yy + yy > xx * xx:
                    return -(r_tail + xx) if negative else r_tail + xx
            return 0.0
        u = unit(draw(attempt))
        attempt += 1
        if (float(zf[idx - 1]) - float(zf[idx])) * u + float(zf[idx]) < math.exp(-0.5 * x * x):
            return -x if negative else x
    return 0.0


@dataclass(frozen=True)
class TableSpec:
    """An embedding table.

    Args:
        name: table name.
        dim: row width.
        num_embeddings: ids in [0, num_embeddings); None for an unbounded table (any int64 id).
        optimizer: server-side optimizer.
        initializer: row initializer.
        staleness: staleness policy.
        allow_nonfinite: accept NaN/Inf gradients instead of rejecting the push.
        sync: synchronous training policy (None: asynchronous).
        admission: feature admission (None: every id gets a row on first touch).
        eviction: TTL and capacity eviction (None: rows stay until the table is dropped).
        disk: a disk tier (``DiskTier``: hot rows in RAM, the others on local disk); None: every row in RAM.

    A table with admission or eviction is *bounded*: pulls never create rows (an id
    without a row reads its initial value), and a row's last push (version, time) and
    push count decide what is evicted.
    """

    name: str
    dim: int
    num_embeddings: Optional[int] = None
    optimizer: Optimizer = field(default_factory=SGD)
    initializer: Initializer = field(default_factory=Initializer)
    staleness: Staleness = field(default_factory=Staleness)
    allow_nonfinite: bool = False
    sync: Optional[SyncPolicy] = None
    admission: Optional[Admission] = None
    eviction: Optional[Eviction] = None
    disk: Optional[DiskTier] = None

    @property
    def bounded(self) -> bool:
        return self.admission is not None or self.eviction is not None

    def __post_init__(self) -> None:
        check_name(self.name)
        for what in ("dim", "num_embeddings"):  # (an int: numpy's integers too, not a float nor a bool)
            value = getattr(self, what)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise InvalidArgument(f"table {self.name!r}: {what} must be an int, got {value!r}")
        if not 1 <= self.dim <= MAX_DIM:
            raise InvalidArgument(f"table {self.name!r}: dim must be in [1, {MAX_DIM}], got {self.dim}")
        if self.num_embeddings is not None and not 1 <= self.num_embeddings < 2**63:
            raise InvalidArgument(f"table {self.name!r}: num_embeddings must be >= 1, got {self.num_embeddings}")
        if self.disk is not None and self.bounded:
            raise InvalidArgument(f"table {self.name!r}: a disk tier keeps every row (the cold ones on disk); "
                                  "admission and eviction drop rows instead: choose one")


def same_table(existing: TableSpec, requested: TableSpec) -> bool:
    """Whether a create of ``requested`` finds ``existing`` (not a different table): equal specs, or specs that
    differ only in their disk tier's victim choice (``policy``, ``sample``: which hot rows leave memory first, never
    what a row holds), which the existing table keeps. A table made with ``DiskTier()`` under the default before
    "clock" ("lru") is then found by today's ``DiskTier()``."""
    if existing == requested:
        return True
    if existing.disk is None or requested.disk is None:
        return False
    disk = replace(requested.disk, policy=existing.disk.policy, sample=existing.disk.sample)
    return replace(requested, disk=disk) == existing


@dataclass(frozen=True)
class DenseSpec:
    """A dense tensor stored as rows of its 2-D view (shape[0] x prod(shape[1:])).

    Args:
        name: tensor name.
        shape: logical shape.
        optimizer: server-side optimizer.
        staleness: staleness policy.
        chunk_rows: rows per placement chunk (0: the whole tensor on one shard).
        allow_nonfinite: accept NaN/Inf gradients.
        sync: synchronous training policy (None: asynchronous).
    """

    name: str
    shape: tuple[int, ...]
    optimizer: Optimizer = field(default_factory=SGD)
    staleness: Staleness = field(default_factory=Staleness)
    chunk_rows: int = 0
    allow_nonfinite: bool = False
    sync: Optional[SyncPolicy] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        check_name(self.name, "dense tensor")
        if not 1 <= len(self.shape) <= MAX_DENSE_NDIM:
            raise InvalidArgument(f"dense tensor {self.name!r}: 1 to {MAX_DENSE_NDIM} dimensions, got {len(self.shape)}")
        if any(s < 1 for s in self.shape):
            raise InvalidArgument(f"dense tensor {self.name!r}: every dimension must be >= 1, got {self.shape}")
        if self.chunk_rows < 0:
            raise InvalidArgument(f"dense tensor {self.name!r}: chunk_rows must be >= 0")
        if self.chunk_rows and -(-self.rows // self.chunk_rows) > MAX_DENSE_CHUNKS:  # (checked before any call)
            raise InvalidArgument(f"dense tensor {self.name!r}: chunk_rows {self.chunk_rows} makes more than "
                                  f"{MAX_DENSE_CHUNKS:,} chunks of its {self.rows:,} rows")

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) >= 2 else 1

    @property
    def cols(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) >= 2 else math.prod(self.shape)


# ---- protobuf conversion -------------------------------------------------------------


def optimizer_to_pb(opt: Optimizer) -> pb.OptimizerSpec:
    if isinstance(opt, SGD):
        return pb.OptimizerSpec(
            sgd=pb.SGDSpec(
                lr=opt.lr, momentum=opt.momentum, dampening=opt.dampening,
                weight_decay=opt.weight_decay, nesterov=opt.nesterov,
            )
        )
    if isinstance(opt, Adagrad):
        return pb.OptimizerSpec(
            adagrad=pb.AdagradSpec(
                lr=opt.lr, lr_decay=opt.lr_decay, weight_decay=opt.weight_decay,
                initial_accumulator_value=opt.initial_accumulator_value, eps=opt.eps,
            )
        )
    if isinstance(opt, Adam):
        return pb.OptimizerSpec(
            adam=pb.AdamSpec(
                lr=opt.lr, beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps, weight_decay=opt.weight_decay
            )
        )
    raise InvalidArgument(f"unsupported optimizer {opt!r}")


def optimizer_from_pb(msg: pb.OptimizerSpec) -> Optimizer:
    kind = msg.WhichOneof("kind")
    if kind == "sgd":
        s = msg.sgd
        return SGD(lr=s.lr, momentum=s.momentum, dampening=s.dampening, weight_decay=s.weight_decay, nesterov=s.nesterov)
    if kind == "adagrad":
        a = msg.adagrad
        return Adagrad(
            lr=a.lr, lr_decay=a.lr_decay, weight_decay=a.weight_decay,
            initial_accumulator_value=a.initial_accumulator_value, eps=a.eps,
        )
    if kind == "adam":
        m = msg.adam
        return Adam(lr=m.lr, betas=(m.beta1, m.beta2), eps=m.eps, weight_decay=m.weight_decay)
    raise InvalidArgument("optimizer is not set: choose sgd, adagrad or adam")


_INIT_KINDS = {"zeros": pb.InitializerSpec.ZEROS, "normal": pb.InitializerSpec.NORMAL, "uniform": pb.InitializerSpec.UNIFORM}
_SCALINGS = {"none": pb.StalenessPolicy.NONE, "inverse": pb.StalenessPolicy.INVERSE, "linear": pb.StalenessPolicy.LINEAR}


def initializer_to_pb(init: Initializer) -> pb.InitializerSpec:
    return pb.InitializerSpec(kind=_INIT_KINDS[init.kind], mean=init.mean, std=init.std, a=init.a, seed=init.seed)


def initializer_from_pb(msg: pb.InitializerSpec) -> Initializer:
    kinds = {v: k for k, v in _INIT_KINDS.items()}
    if msg.kind not in kinds:
        raise InvalidArgument(f"unknown initializer kind {msg.kind}")
    return Initializer(kind=kinds[msg.kind], mean=msg.mean, std=msg.std, a=msg.a, seed=msg.seed)


def staleness_to_pb(s: Staleness) -> pb.StalenessPolicy:
    msg = pb.StalenessPolicy(scaling=_SCALINGS[s.scaling], alpha=s.alpha, per_row=s.per_row)
    if s.max_staleness is not None:
        msg.max_staleness = s.max_staleness
    return msg


def staleness_from_pb(msg: pb.StalenessPolicy) -> Staleness:
    names = {v: k for k, v in _SCALINGS.items()}
    if msg.scaling not in names:
        raise InvalidArgument(f"unknown staleness scaling {msg.scaling}")
    return Staleness(
        scaling=names[msg.scaling], alpha=msg.alpha,
        max_staleness=msg.max_staleness if msg.HasField("max_staleness") else None, per_row=msg.per_row,
    )


def admission_to_pb(a: Admission) -> pb.AdmissionPolicy:
    return pb.AdmissionPolicy(min_count=a.min_count, admit_probability=a.admit_probability,
                              sketch_width=a.sketch_width, sketch_depth=a.sketch_depth, seed=a.seed)


def admission_from_pb(msg: pb.AdmissionPolicy) -> Admission:
    return Admission(min_count=msg.min_count, admit_probability=msg.admit_probability,
                     sketch_width=msg.sketch_width, sketch_depth=msg.sketch_depth, seed=msg.seed)


_EVICT_PB = {"lru": pb.EvictionPolicy.LRU, "lfu": pb.EvictionPolicy.LFU, "clock": pb.EvictionPolicy.CLOCK}


def eviction_to_pb(e: Eviction) -> pb.EvictionPolicy:
    msg = pb.EvictionPolicy(policy=_EVICT_PB[e.policy], sample=e.sample)
    if e.max_rows is not None:
        msg.max_rows = e.max_rows
    if e.ttl_steps is not None:
        msg.ttl_steps = e.ttl_steps
    if e.ttl_seconds is not None:
        msg.ttl_seconds = e.ttl_seconds
    return msg


def eviction_from_pb(msg: pb.EvictionPolicy) -> Eviction:
    names = {v: k for k, v in _EVICT_PB.items()}
    if msg.policy not in names:
        raise InvalidArgument(f"unknown eviction policy {msg.policy}")
    return Eviction(
        max_rows=msg.max_rows if msg.HasField("max_rows") else None, policy=names[msg.policy],
        ttl_steps=msg.ttl_steps if msg.HasField("ttl_steps") else None,
        ttl_seconds=msg.ttl_seconds if msg.HasField("ttl_seconds") else None, sample=msg.sample,
    )


_AGG_PB = {"mean": pb.SyncPolicy.MEAN, "sum": pb.SyncPolicy.SUM, "median": pb.SyncPolicy.MEDIAN,
           "trimmed_mean": pb.SyncPolicy.TRIMMED_MEAN}
_TIMEOUT_PB = {"wait": pb.SyncPolicy.WAIT, "proceed": pb.SyncPolicy.PROCEED, "fail": pb.SyncPolicy.FAIL}


def disk_to_pb(d: DiskTier) -> pb.DiskTierPolicy:
    return pb.DiskTierPolicy(memory_mb=d.memory_mb, policy=_EVICT_PB[d.policy], sample=d.sample)


def disk_from_pb(msg: pb.DiskTierPolicy) -> DiskTier:
    names = {v: k for k, v in _EVICT_PB.items()}
    if msg.policy not in names:
        raise InvalidArgument(f"unknown disk tier policy {msg.policy}")
    return DiskTier(memory_mb=msg.memory_mb, policy=names[msg.policy], sample=msg.sample)


def sync_to_pb(p: SyncPolicy) -> pb.SyncPolicy:
    return pb.SyncPolicy(workers=p.workers, aggregator=_AGG_PB[p.aggregator], trim_fraction=p.trim_fraction,
                         timeout_s=p.timeout_s, on_timeout=_TIMEOUT_PB[p.on_timeout])


def sync_from_pb(msg: pb.SyncPolicy) -> SyncPolicy:
    aggs = {v: k for k, v in _AGG_PB.items()}
    timeouts = {v: k for k, v in _TIMEOUT_PB.items()}
    if msg.aggregator not in aggs or msg.on_timeout not in timeouts:
        raise InvalidArgument("unknown sync aggregator or on_timeout value")
    return SyncPolicy(workers=msg.workers, aggregator=aggs[msg.aggregator], trim_fraction=msg.trim_fraction,
                      timeout_s=msg.timeout_s, on_timeout=timeouts[msg.on_timeout])


def table_spec_to_pb(spec: TableSpec) -> pb.TableSpec:
    msg = pb.TableSpec(
        name=spec.name, dim=spec.dim, optimizer=optimizer_to_pb(spec.optimizer),
        initializer=initializer_to_pb(spec.initializer), staleness=staleness_to_pb(spec.staleness),
        allow_nonfinite=spec.allow_nonfinite,
    )
    if spec.num_embeddings is not None:
        msg.num_embeddings = spec.num_embeddings
    if spec.sync is not None:
        msg.sync.CopyFrom(sync_to_pb(spec.sync))
    if spec.admission is not None:
        msg.admission.CopyFrom(admission_to_pb(spec.admission))
    if spec.eviction is not None:
        msg.eviction.CopyFrom(eviction_to_pb(spec.eviction))
    if spec.disk is not None:
        msg.disk.CopyFrom(disk_to_pb(spec.disk))
    return msg


def table_spec_from_pb(msg: pb.TableSpec) -> TableSpec:
    return TableSpec(
        name=msg.name, dim=msg.dim,
        num_embeddings=msg.num_embeddings if msg.HasField("num_embeddings") else None,
        optimizer=optimizer_from_pb(msg.optimizer), initializer=initializer_from_pb(msg.initializer),
        staleness=staleness_from_pb(msg.staleness), allow_nonfinite=msg.allow_nonfinite,
        sync=sync_from_pb(msg.sync) if msg.HasField("sync") else None,
        admission=admission_from_pb(msg.admission) if msg.HasField("admission") else None,
        eviction=eviction_from_pb(msg.eviction) if msg.HasField("eviction") else None,
        disk=disk_from_pb(msg.disk) if msg.HasField("disk") else None,
    )


def dense_spec_to_pb(spec: DenseSpec) -> pb.DenseSpec:
    msg = pb.DenseSpec(
        name=spec.name, shape=list(spec.shape), optimizer=optimizer_to_pb(spec.optimizer),
        staleness=staleness_to_pb(spec.staleness), chunk_rows=spec.chunk_rows, allow_nonfinite=spec.allow_nonfinite,
    )
    if spec.sync is not None:
        msg.sync.CopyFrom(sync_to_pb(spec.sync))
    return msg


def dense_spec_from_pb(msg: pb.DenseSpec) -> DenseSpec:
    return DenseSpec(
        name=msg.name, shape=tuple(msg.shape), optimizer=optimizer_from_pb(msg.optimizer),
        staleness=staleness_from_pb(msg.staleness), chunk_rows=msg.chunk_rows, allow_nonfinite=msg.allow_nonfinite,
        sync=sync_from_pb(msg.sync) if msg.HasField("sync") else None,
    )


def spec_to_b64(spec: Union[TableSpec, DenseSpec]) -> str:
    """A table's or dense tensor's spec as base64 of its protobuf form (checkpoint headers, export manifests)."""
    msg = dense_spec_to_pb(spec) if isinstance(spec, DenseSpec) else table_spec_to_pb(spec)
    return base64.b64encode(msg.SerializeToString()).decode()


def spec_from_b64(text: str, dense: bool) -> Union[TableSpec, DenseSpec]:
    """The spec ``spec_to_b64`` wrote (``dense``: of a dense tensor)."""
    raw = base64.b64decode(text)
    return dense_spec_from_pb(pb.DenseSpec.FromString(raw)) if dense else table_spec_from_pb(pb.TableSpec.FromString(raw))
