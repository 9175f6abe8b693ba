"""A model's tables as one module, in TorchRec's shape: ``RemoteEmbeddingBagCollection`` (pooled bags, TorchRec's
``EmbeddingBagCollection``) and ``RemoteEmbeddingCollection`` (one embedding per id, TorchRec's
``EmbeddingCollection``), fed a ``KeyedJaggedTensor`` (TorchRec's, or ``shardps_client.sparse``'s).

One pass for all tables per step: the ids of every feature are checked and deduplicated per table in one
vectorised step (ids packed with their table's index, one radix sort: ``ids.unique_inverse``); every table's
unique rows are pulled in one round trip per shard (``Client.pull_many``: a prefetch or a row cache serves its
part); tables of the same width and pooling share one local weight and one ``F.embedding_bag`` (``F.embedding``)
call; one backward hook per such weight hands every table's coalesced row gradients to the client, sent as one
push per shard (queued for ``ShardedOptimizer.step`` when it holds the pushes).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shardps.core.ids import unique_inverse
from shardps.core.optim import Optimizer
from shardps.core.specs import Initializer
from shardps_client.client import Client, Versions
from shardps_client.collection_layout import Layout as _Layout
from shardps_client.collection_layout import Step as _Step
from shardps_client.collection_optim import TableSlot, choose, in_backward, slot_key, warn_default
from shardps_client.sparse import JaggedTensor, KeyedTensor

PLANS_KEPT = 4  # plans ids_of made that a forward may take (a Prefetcher's depth ahead)


class PoolingType(enum.Enum):
    """How a bag's rows become one vector (TorchRec's ``PoolingType``)."""

    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


@dataclass
class EmbeddingBagConfig:
    """One table of a collection, with TorchRec's field names.

    Args:
        num_embeddings: rows of the table (ids in [0, num_embeddings)).
        embedding_dim: width of a row.
        name: the table's name on the shards.
        feature_names: the features (keys of the input) looked up in this table; several features may share it.
        pooling: ``PoolingType.SUM`` or ``MEAN`` (or "sum" / "mean"); ignored by ``RemoteEmbeddingCollection``.
        optimizer: the table's server-side optimizer when the collection creates it (None: the client's default).
        initializer: how new rows start (None: normal(0, 1), as ``torch.nn.Embedding``).
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    feature_names: list[str] = field(default_factory=list)
    pooling: Union[PoolingType, str] = PoolingType.SUM
    optimizer: Optional[Optimizer] = None
    initializer: Optional[Initializer] = None


@dataclass
class EmbeddingConfig(EmbeddingBagConfig):
    """A table of a ``RemoteEmbeddingCollection`` (unpooled: TorchRec's ``EmbeddingConfig``)."""

    pooling: Union[PoolingType, str] = PoolingType.NONE


def _containers(features: Any) -> tuple[Any, Any]:
    """The output containers (KeyedTensor, JaggedTensor) of the input's library: TorchRec's own for TorchRec's
    KeyedJaggedTensor (its methods all there for TorchRec's models), ``shardps_client.sparse``'s otherwise."""
    if type(features).__module__.startswith("torchrec."):
        import sys

        jagged = sys.modules.get("torchrec.sparse.jagged_tensor")
        if jagged is not None:
            return jagged.KeyedTensor, jagged.JaggedTensor
    return KeyedTensor, JaggedTensor


class _RemoteCollection(nn.Module):
    def __init__(self, tables: list[Any], client: Client, device: Any, create: bool, wire_dtype: Optional[str],
                 pooled: bool, optimizer: Optional[Optimizer] = None) -> None:
        super().__init__()
        self.client = client
        self.device = torch.device(device) if device is not None else None
        self.wire_dtype = wire_dtype
        self._configs = list(tables)
        self.layout = _Layout(self._configs, pooled)
        self._optimizer = optimizer
        # One placeholder per table where TorchRec's modules keep their tables (``embedding_bags`` of an
        # EmbeddingBagCollection, ``embeddings`` of an EmbeddingCollection): what apply_optimizer_in_backward marks.
        self._slots_name = "embedding_bags" if pooled else "embeddings"
        keys = {slot_key(c.name): c.name for c in self._configs}
        if len(keys) < len(self._configs):
            raise ValueError("table names that differ only in '.' against '_' cannot share a collection: "
                             f"{sorted(c.name for c in self._configs)}")
        setattr(self, self._slots_name, nn.ModuleDict({slot_key(c.name): TableSlot(c.embedding_dim)
                                                       for c in self._configs}))
        self._created = False
        self._said: dict[str, int] = {}  # table -> in-backward optimizers seen on its slot (checked when it grows)
        if not create:
            self._created = True
            self._check_specs()
        elif all(choose(c, optimizer, self.slot(c.name))[0] is not None for c in self._configs):
            self.create_tables()  # every optimizer known now; else at the first forward (collection_optim)
        self.last_versions: dict[str, Versions] = {}
        self._open: Optional[_StepPushes] = None  # the last step's pushes, until every gradient arrived
        self._planned: list[tuple[tuple, torch.Tensor, torch.Tensor, _Step]] = []  # ids_of's plans, for forward

    # ---- the tables and their optimizers ---------------------------------------------------

    @property
    def slots(self) -> nn.ModuleDict:
        """Each table's placeholder (``collection_optim.TableSlot``), by ``slot_key`` of its name."""
        return getattr(self, self._slots_name)

    def slot(self, table: str) -> TableSlot:
        """The placeholder of ``table``."""
        return cast(TableSlot, self.slots[slot_key(table)])

    def create_tables(self) -> None:
        """Create the tables on the shards (an existing one must have the same spec), each with the optimizer its
        config, the collection or ``apply_optimizer_in_backward`` gave it (``collection_optim``)."""
        for c in self._configs:
            optimizer, _ = choose(c, self._optimizer, self.slot(c.name))
            if optimizer is None:
                warn_default(c.name)
            self.client.create_table(c.name, c.embedding_dim, c.num_embeddings, optimizer=optimizer,
                                     initializer=getattr(c, "initializer", None))
            self._said[c.name] = len(getattr(self.slot(c.name).weight, "_optimizer_classes", ()))
        self._created = True
        self._check_specs()

    def _check_specs(self) -> None:
        for c in self._configs:
            spec = self.client.table_spec(c.name)
            if (spec.dim, spec.num_embeddings) != (c.embedding_dim, c.num_embeddings):
                raise ValueError(f"table {c.name!r} on the shards is {spec.num_embeddings} x {spec.dim}, the config "
                                 f"says {c.num_embeddings} x {c.embedding_dim}")

    def _ready(self) -> None:
        """Before a step: the tables made (with an optimizer applied in backward since construction), and an
        optimizer applied in backward after they were made checked against theirs."""
        if not self._created:
            self.create_tables()
        for c in self._configs:
            slot = self.slot(c.name)
            n = len(getattr(slot.weight, "_optimizer_classes", ()))
            if n == self._said.get(c.name, 0):
                continue
            self._said[c.name] = n
            wanted = in_backward(slot, c.name)
            have = self.client.table_spec(c.name).optimizer
            if wanted is not None and wanted != have:
                raise ValueError(f"table {c.name!r} trains with {have!r} on the shards, but apply_optimizer_in_backward "
                                 f"asks for {wanted!r}: a table's optimizer is fixed when it is created (apply it "
                                 "before the collection's first forward, or give the collection optimizer=)")

    def _placeholders(self, g: int) -> list[torch.Tensor]:
        """The placeholders of group ``g``'s tables (``TableSlot.weight``)."""
        a, b = self.layout.groups[g]
        return [self.slot(t).weight for t in self.layout.tables[a:b]]

    # ---- the plan of a step (numpy; every check before anything is pulled) ----------------

    def plan(self, features: Any) -> _Step:
        """Check ``features`` (a KeyedJaggedTensor) and deduplicate its ids per table, all tables at once (or
        take the plan ``ids_of`` made for the same input, as a ``Prefetcher`` asks for it a step ahead)."""
        self._ready()
        keys = tuple(features.keys())
        values, lengths = features.values(), features.lengths()
        for i, (k, v, n, step) in enumerate(self._planned):
            if k == keys and v.shape == values.shape and n.shape == lengths.shape and v.dtype == values.dtype:
                if values.device != v.device or lengths.device != n.device:
                    # the input moved to the GPU after ids_of planned it (DistributedDataParallel moves a
                    # module's inputs to its device): compared on the CPU, where planning reads ids anyway
                    values, lengths = values.detach().cpu(), lengths.detach().cpu()
                if torch.equal(v, values) and torch.equal(n, lengths):
                    del self._planned[i]
                    return step
        return self._plan(features)

    def _plan(self, features: Any) -> _Step:
        lay = self.layout
        keys = list(features.keys())
        unknown = [k for k in keys if k not in lay.table_of]
        if unknown:
            raise KeyError(f"feature {unknown[0]!r} is not read by any table of this collection "
                           f"(features: {lay.features})")
        if len(set(keys)) != len(keys):
            raise ValueError(f"feature keys repeat: {keys}")
        if not keys:
            raise ValueError("a batch with no features (a KeyedJaggedTensor of no keys)")
        values, lengths = features.values(), features.lengths()
        if values.dim() != 1 or lengths.dim() != 1:  # (TorchRec refuses them; they were flattened)
            raise ValueError(f"values and lengths must be 1-D, got shapes {list(values.shape)} and "
                             f"{list(lengths.shape)}")
        if values.dtype not in (torch.int64, torch.int32) or lengths.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"ids and lengths must be int64 or int32, got {values.dtype} and {lengths.dtype}")
        ids = values.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        lens = lengths.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        stride = lens.shape[0] // len(keys) if keys else 0
        if lens.shape[0] != stride * len(keys):
            raise ValueError(f"{lens.shape[0]} lengths for {len(keys)} features: not a whole number of bags each")
        if callable(getattr(features, "stride", None)) and features.stride() != stride:
            raise ValueError(f"the batch says {features.stride()} bags a feature (stride), its lengths give {stride}")
        if (lens < 0).any():
            k = int(np.argmax(lens < 0)) // max(stride, 1)
            raise ValueError(f"feature {keys[k]!r}: negative bag length {int(lens[lens < 0][0])}")
        if int(lens.sum()) != ids.shape[0]:
            raise ValueError(f"the lengths add up to {int(lens.sum())} ids, but there are {ids.shape[0]} values")
        lengths2 = lens.reshape(len(keys), stride)
        table_of_key = np.array([lay.table_of[k] for k in keys], dtype=np.int64)
        table_of_value = np.repeat(table_of_key, lengths2.sum(1))
        bad = (ids < 0) | (ids >= lay.rows[table_of_value])
        if bad.any():
            i = int(np.argmax(bad))
            t = int(table_of_value[i])
            key = keys[int(np.searchsorted(np.cumsum(lengths2.sum(1)), i, side="right"))]
            raise IndexError(f"feature {key!r}: id {int(ids[i])} out of range [0, {int(lay.rows[t])}) of table "
                             f"{lay.tables[t]!r}")
        packed = ids + lay.base[table_of_value]
        uniq, inverse = unique_inverse(packed)
        bounds = np.searchsorted(uniq, np.append(lay.base, np.int64(2**62)))
        per_table = [uniq[bounds[t] : bounds[t + 1]] - lay.base[t] for t in range(len(lay.tables))]
        group_of_value = lay.group_of_table[table_of_value]
        group_start = bounds[[a for a, _ in lay.groups]]
        local = inverse.reshape(-1) - group_start[group_of_value]
        return _Step(per_table, local, group_of_value, {k: i for i, k in enumerate(keys)}, lengths2, stride)

    def ids_of(self, features: Any) -> dict[str, torch.Tensor]:
        """``{table: unique ids}`` a forward of ``features`` pulls: the ``ids_fn`` of a ``Prefetcher``."""
        self._ready()
        step = self._plan(features)
        values, lengths = features.values(), features.lengths()
        if values.device.type == "cpu" and lengths.device.type == "cpu":  # (kept for forward: the prefetch's depth)
            self._planned.append((tuple(features.keys()), values.detach().clone(), lengths.detach().clone(), step))
            del self._planned[:-PLANS_KEPT]
        return {t: torch.from_numpy(u) for t, u in zip(self.layout.tables, step.uniq) if u.shape[0]}  # (empty: none)

    # ---- pulling and the local weights ------------------------------------------------------

    def _weights(self, step: _Step, device: Any) -> list[Optional[torch.Tensor]]:
        """One local weight per group the input reads (None for the others): every table's unique rows, pulled
        in one round trip per shard."""
        lay = self.layout
        if self._open is not None:  # a group's gradient never came (its output unused): send what did
            self._open.finish()
        wanted: dict[str, Any] = {t: u for t, u in zip(lay.tables, step.uniq) if u.shape[0]}
        pulled = self.client.pull_many(wanted, device=device, wire_dtype=self.wire_dtype) if wanted else {}
        self.last_versions = {t: v for t, (_, v) in pulled.items()}
        used = set(lay.group_of_table[[lay.table_of[k] for k in step.feature_pos]].tolist())
        pushes = _StepPushes(self, step, pulled, len(used)) if torch.is_grad_enabled() else None
        self._open = pushes
        weights: list[Optional[torch.Tensor]] = []
        for g, (a, b) in enumerate(lay.groups):
            if g not in used:
                weights.append(None)
                continue
            parts = [pulled[t][0] for t in lay.tables[a:b] if t in pulled]
            w = torch.cat(parts) if parts else torch.zeros(0, int(lay.dims[a]), device=device)
            if pushes is not None:
                w.requires_grad_(True)
                w.register_hook(pushes.hook(g))
                w = _Used.apply(w, *self._placeholders(g))
            weights.append(w)
        return weights


class _StepPushes:
    """The backward side of one forward: each used group's hook hands its tables' coalesced row gradients to
    the client; the step's pushes go out as one push per shard when the last group's gradient has arrived
    (or with ``ShardedOptimizer.step`` when it holds the client's pushes)."""

    def __init__(self, module: _RemoteCollection, step: _Step, pulled: dict[str, Any], groups: int) -> None:
        self.module = module
        self.step = step
        self.pulled = pulled
        self.left = groups
        self.hold: Any = None
        self.started = False

    def hook(self, g: int):
        def push(grad: torch.Tensor) -> None:
            self.push_group(g, grad)

        return push

    def push_group(self, g: int, grad: torch.Tensor) -> None:
        client, lay = self.module.client, self.module.layout
        if not self.started:  # the first gradient of the step: hold its pushes, unless a ShardedOptimizer does
            self.started = True
            self.hold = None if client.defer_pushes else client.hold_pushes(step=True)
        a, b = lay.groups[g]
        try:  # every table of the group in one plan (sorted unique ids: no dedup, no per-table Python)
            client.push_stacked(lay.tables[a:b], self.step.uniq[a:b], grad,
                                [self.pulled[t][1] if t in self.pulled else None for t in lay.tables[a:b]],
                                wire_dtype=self.module.wire_dtype)
        finally:
            self.left -= 1
            if self.left == 0:
                self.finish()

    def finish(self) -> None:
        """Send the step's held pushes and stop holding (once)."""
        hold, self.hold = self.hold, None
        if self.module._open is self:
            self.module._open = None
        if hold is not None:
            try:
                hold.send()
            finally:
                hold.release()


class _Used(torch.autograd.Function):
    """A group's local weight as it is, with its tables' placeholders as inputs: each placeholder gets a (zero-size)
    gradient at every backward, as DistributedDataParallel and in-backward optimizers expect of every parameter. One
    node, no copy of the weight: 85 us a DLRM step, where adding 0 summed through the placeholders took 145."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, *placeholders: torch.Tensor) -> torch.Tensor:
        ctx.like = [(p.shape, p.dtype, p.device) for p in placeholders]
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like))


class _SumBags(torch.autograd.Function):
    """``F.embedding_bag(idx, w, offsets, mode="sum", include_last_offset=True)`` on CPU with a cheaper backward:
    each value's bag gradient added into its row by one ``index_add_``, in the values' order (0.2 ms for 8,192
    ids here), where aten's dense backward sorts ``idx`` first and adds in that order (2.3 ms). The sums are the
    same up to the order of floating-point additions: a row's gradients are added in the order its ids came, a
    defined order, where aten's follows an unstable sort of the whole batch (so a collection's shared weight and
    one ``nn.EmbeddingBag`` per table differ in the last bits there too, on batches whose ids repeat often).
    ``bag_of``: the bag of each value (None: one value per bag, in order)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, idx: torch.Tensor, offsets: torch.Tensor,
                bag_of: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(idx, bag_of)
        ctx.rows = w.shape[0]
        return F.embedding_bag(idx, w, offsets, mode="sum", include_last_offset=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        idx, bag_of = ctx.saved_tensors
        rows = grad if bag_of is None else grad.index_select(0, bag_of)
        return grad.new_zeros(ctx.rows, grad.shape[1]).index_add_(0, idx, rows), None, None, None


class RemoteEmbeddingBagCollection(_RemoteCollection):
    """TorchRec's ``EmbeddingBagCollection`` over shardps tables: ``forward(KeyedJaggedTensor) -> KeyedTensor``.

    Outputs and gradients are those of a collection of ``torch.nn.EmbeddingBag`` holding the same rows (the
    gradients up to the order of floating-point additions: ``_SumBags``); the rows' updates happen on the shards
    (the tables' optimizers), pushed during backward.

    Args:
        tables: one ``EmbeddingBagConfig`` per table (TorchRec's own configs are read the same way).
        client: a connected ``Client``.
        is_weighted: inputs carry a weight per id (per-sample weights; SUM pooling).
        device: where outputs live (default: the input's device); CPU or CUDA.
        create: create the tables on the shards (an existing table must have the same spec), or only check
            that they exist with the configured shape. A table without an optimizer (below) is created at the first
            forward, so TorchRec's ``apply_optimizer_in_backward`` on the collection's parameters (one placeholder per
            table in ``embedding_bags``) can give it one (``shardps_client.collection_optim``).
        wire_dtype: "float32" (default of the client), "float16" or "bfloat16" for pulls and pushes.
        optimizer: the shards' optimizer of every table whose config names none (TorchRec's configs name none).
    """

    def __init__(self, tables: list[Any], client: Client, is_weighted: bool = False, device: Any = None,
                 create: bool = True, wire_dtype: Optional[str] = None, optimizer: Optional[Optimizer] = None) -> None:
        super().__init__(tables, client, device, create, wire_dtype, pooled=True, optimizer=optimizer)
        self._is_weighted = is_weighted
        self._column_maps: dict[tuple[str, ...], torch.Tensor] = {}
        if is_weighted and "mean" in self.layout.pools:
            raise ValueError("weighted bags pool by SUM (torch.nn.EmbeddingBag takes per-sample weights with sum)")

    def embedding_bag_configs(self) -> list[Any]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: Any) -> KeyedTensor:
        step = self.plan(features)
        weights = features.weights_or_none()
        if self._is_weighted and weights is None:
            raise ValueError("this collection is weighted: the input needs a weight per id")
        if weights is not None and weights.numel() != step.local.shape[0]:
            raise ValueError(f"{weights.numel()} weights for {step.local.shape[0]} ids")
        device = self.device if self.device is not None else features.values().device
        ws = self._weights(step, device)
        lay, B = self.layout, step.stride
        if B == 0:  # no bags: TorchRec's shape, no rows of every feature's columns
            empty = torch.zeros(0, int(lay.feature_starts[-1]), device=device)
            return _containers(features)[0](lay.features, lay.feature_dims, empty)
        bag_lengths = torch.from_numpy(step.lengths)
        keys = list(step.feature_pos)
        group_of_key = lay.group_of_table[[lay.table_of[k] for k in keys]] if keys else np.zeros(0, np.int64)
        blocks: list[torch.Tensor] = []  # per group: [B, its features' columns], features in input order
        columns: list[str] = []
        for g, (a, _) in enumerate(lay.groups):
            in_group = np.flatnonzero(group_of_key == g)
            if not in_group.size:
                continue
            mask = step.group_of_value == g
            idx = torch.from_numpy(step.local[mask]).to(device)
            lens = bag_lengths[in_group].reshape(-1)
            offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
            torch.cumsum(lens, 0, out=offsets[1:])
            psw = weights.reshape(-1)[torch.from_numpy(mask).to(weights.device)].to(device) \
                if weights is not None and self._is_weighted else None
            w = ws[g]
            assert w is not None
            if lay.pools[a] == "sum" and psw is None and w.device.type == "cpu" and w.requires_grad:
                bag_of = None if idx.shape[0] == lens.numel() and bool((lens == 1).all()) else \
                    torch.repeat_interleave(torch.arange(lens.numel()), lens)
                pooled = _SumBags.apply(w, idx, offsets, bag_of)
            else:
                pooled = F.embedding_bag(idx, w, offsets.to(device), mode=lay.pools[a], per_sample_weights=psw,
                                         include_last_offset=True)
            # [features, B, dim] -> [B, features * dim]: one copy (backward too), not a slice per feature
            blocks.append(pooled.reshape(in_group.size, B, -1).transpose(0, 1).reshape(B, -1))
            columns += [keys[k] for k in in_group.tolist()]
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        if columns != lay.features:  # columns in the configs' feature order; an absent feature reads as zeros
            where = self._columns(tuple(columns)).to(device)
            if len(columns) == len(lay.features):
                out = out.index_select(1, where)
            else:
                out = torch.zeros(B, int(lay.feature_starts[-1]), device=device, dtype=out.dtype).index_copy(1, where, out)
        kt = _containers(features)[0](lay.features, lay.feature_dims, out)
        kt.shardps_versions = self.last_versions  # type: ignore[attr-defined]
        return kt


    def _columns(self, columns: tuple[str, ...]) -> torch.Tensor:
        """Where the columns of features in the order ``columns`` go in the output: with every feature, the
        output's columns in the order they read them; with some absent, each given column's place."""
        got = self._column_maps.get(columns)
        if got is None:
            lay = self.layout
            start = {f: int(lay.feature_starts[i]) for i, f in enumerate(lay.features)}
            places = np.concatenate([np.arange(start[f], start[f] + lay.feature_dims[lay.features.index(f)])
                                     for f in columns])
            if len(columns) == len(lay.features):
                places = np.argsort(places)  # output column j reads input column places[j]
            got = self._column_maps[columns] = torch.from_numpy(places.astype(np.int64))
        return got


class RemoteEmbeddingCollection(_RemoteCollection):
    """TorchRec's ``EmbeddingCollection`` over shardps tables: ``forward(KeyedJaggedTensor) ->
    {feature: JaggedTensor}`` of one row per id (outputs and gradients of ``torch.nn.Embedding``).

    Args: as ``RemoteEmbeddingBagCollection`` (``tables`` of ``EmbeddingConfig``), without ``is_weighted``.
    """

    def __init__(self, tables: list[Any], client: Client, device: Any = None, create: bool = True,
                 wire_dtype: Optional[str] = None, optimizer: Optional[Optimizer] = None) -> None:
        super().__init__(tables, client, device, create, wire_dtype, pooled=False, optimizer=optimizer)

    def embedding_configs(self) -> list[Any]:
        return self._configs

    def forward(self, features: Any) -> dict[str, JaggedTensor]:
        step = self.plan(features)
        device = self.device if self.device is not None else features.values().device
        ws = self._weights(step, device)
        lay = self.layout
        keys = list(step.feature_pos)
        rows = {}
        for g in range(len(lay.groups)):
            mask = step.group_of_value == g
            w = ws[g]
            if mask.any() and w is not None:
                rows[g] = (np.flatnonzero(mask), F.embedding(torch.from_numpy(step.local[mask]).to(device), w))
        per_key = step.lengths.sum(1)
        starts = np.concatenate([[0], np.cumsum(per_key)])
        jagged = _containers(features)[1]
        out = {}
        for i, k in enumerate(keys):
            g = int(lay.group_of_table[lay.table_of[k]])
            where, emb = rows.get(g, (np.zeros(0, np.int64), None))
            lo, hi = np.searchsorted(where, [starts[i], starts[i + 1]])
            values = emb[lo:hi] if emb is not None else torch.zeros(0, int(lay.dims[lay.table_of[k]]), device=device)
            out[k] = jagged(values, lengths=torch.from_numpy(step.lengths[i].copy()))
        return out
