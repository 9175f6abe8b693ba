"""Which optimizer each table of a collection gets, said the ways a TorchRec user says it.

A collection's tables are trained on the shards, so the optimizer is the table's (``shardps.core.optim``). In order:

1. the table's config (``EmbeddingBagConfig(..., optimizer=Adagrad(lr=0.05))``, shardps' configs only);
2. the collection's ``optimizer=`` (every table);
3. TorchRec's idiom for an unsharded module, ``apply_optimizer_in_backward(torch.optim.Adagrad,
   ebc.parameters(), {"lr": 0.05})`` (``torchrec.optim.apply_optimizer_in_backward``, which calls
   ``torch.distributed.optim._apply_optimizer_in_backward``): the collection keeps one placeholder parameter per
   table (``embedding_bags[name].weight`` / ``embeddings[name].weight``, no rows: the rows live on the shards) on
   which it records the optimizer class and arguments; ``torch.optim.SGD``, ``Adagrad`` and ``Adam`` become the
   shards' ``SGD``, ``Adagrad`` and ``Adam`` with the same arguments (the same math, checked against
   ``torch.optim``); anything else is refused, naming what is accepted. (TorchRec's other idiom, ``fused_params``
   given to a sharder, configures ``DistributedModelParallel``'s sharded modules: it does not apply to an unsharded
   module, and a shardps collection is not sharded by TorchRec.)
4. the client's default (``SGD(lr=0.001)``), said in a warning naming the table.

A collection built without an optimizer for some table creates its tables at its first forward (or ``ids_of``, or
``create_tables()``), so the idiom, applied after construction as TorchRec users do, is honoured.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from shardps.core.optim import SGD, Adagrad, Adam, Optimizer

log = logging.getLogger(__name__)

# torch.optim classes and the shards' optimizers of the same math and the same argument names.
FROM_TORCH: dict[type, type] = {torch.optim.SGD: SGD, torch.optim.Adagrad: Adagrad, torch.optim.Adam: Adam}
# How torch runs a step, not what it computes: accepted and ignored.
HOW = frozenset({"foreach", "fused", "capturable", "differentiable"})
DEFAULT = SGD()  # the client's default (Client.create_table without an optimizer)


class TableSlot(nn.Module):
    """A table's place in the module tree, as TorchRec's ``nn.EmbeddingBag``: ``weight`` is a parameter with no
    rows (the rows live on the shards) on which TorchRec's ``apply_optimizer_in_backward`` records the table's
    optimizer. It takes part in every backward with a zero gradient, so ``DistributedDataParallel`` and in-backward
    optimizers see it used."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, dim))
        self.weight._shardps_table_slot = True  # type: ignore[attr-defined]  # (ShardedOptimizer leaves it out)


def is_table_slot(p: torch.Tensor) -> bool:
    """Whether ``p`` is a collection's table placeholder (no rows: the table lives on the shards), which dense
    optimizers and DDP's parameter lists leave out."""
    return bool(getattr(p, "_shardps_table_slot", False))


def slot_key(table: str) -> str:
    """A table's key among a collection's placeholders: its name, with '_' for '.' (a module's name has none;
    TorchRec's own tables have such names, so ``ebc.embedding_bags[name]`` reads as in TorchRec)."""
    return table.replace(".", "_")


def from_torch(cls: Any, kwargs: dict[str, Any], table: str) -> Optimizer:
    """The shards' optimizer for ``torch.optim`` class ``cls`` with ``kwargs`` (ValueError naming what is not)."""
    ours = FROM_TORCH.get(cls)
    if ours is None:
        accepted = ", ".join(f"torch.optim.{c.__name__}" for c in FROM_TORCH)
        name = getattr(cls, "__name__", repr(cls))
        where = "torch.optim" if getattr(torch.optim, name, None) is cls else getattr(cls, "__module__", "")
        raise ValueError(f"table {table!r}: {where}.{name} has no "
                         f"shardps equivalent (the shards apply the table's optimizer): use {accepted}, or give the "
                         "collection optimizer=")
    args = {}
    for key, value in kwargs.items():
        if key in HOW:
            continue
        if key in ("maximize", "amsgrad") and not value:
            continue
        if key not in ours.__dataclass_fields__:  # type: ignore[attr-defined]
            raise ValueError(f"table {table!r}: {cls.__name__}'s {key}={value!r} has no shardps equivalent "
                             f"({ours.__name__} takes {', '.join(ours.__dataclass_fields__)})")  # type: ignore[attr-defined]
        args[key] = tuple(value) if key == "betas" else value
    return ours(**args)


def in_backward(slot: TableSlot, table: str) -> Optional[Optimizer]:
    """The optimizer ``apply_optimizer_in_backward`` recorded on ``slot`` (the last one applied), or None."""
    classes = getattr(slot.weight, "_optimizer_classes", None)
    if not classes:
        return None
    return from_torch(classes[-1], dict(slot.weight._optimizer_kwargs[-1]), table)  # type: ignore[attr-defined]


def choose(config: Any, collection: Optional[Optimizer], slot: TableSlot) -> tuple[Optional[Optimizer], str]:
    """The optimizer of one table and where it came from ("config", "collection", "in backward"); (None, "") when
    none was said (the client's default then)."""
    if getattr(config, "optimizer", None) is not None:
        return config.optimizer, "config"
    if collection is not None:
        return collection, "collection"
    found = in_backward(slot, config.name)
    if found is not None:
        return found, "in backward"
    return None, ""


def warn_default(table: str) -> None:
    log.warning("table %r: no optimizer given (its config, the collection's optimizer=, or "
                "apply_optimizer_in_backward on its parameters before the first forward): created with the "
                "client's default %r", table, DEFAULT)
