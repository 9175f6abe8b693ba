"""Dense tensors: registration, pulls (alone, or coming back with a step's pushes) and pushes.

A dense tensor larger than its chunk is split into row chunks spread over the
shards (``planner.dense_pieces``); pulls and pushes touch each shard's chunks.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from shardps.core import codec, wire
from shardps.core.errors import InvalidArgument as _ServerInvalidArgument
from shardps.core.optim import SGD, Optimizer
from shardps.core.slots import SlotMap
from shardps.core.specs import DenseSpec, Staleness, SyncPolicy, dense_spec_to_pb
from shardps.v1 import shardps_pb2 as pb
from shardps_client import planner
from shardps_client.admin import first_decides
from shardps_client.errors import InvalidArgumentError
from shardps_client.inputs import MiB, check_grads, check_sent, grads_to_numpy
from shardps_client.inputs import names as as_names
from shardps_client.pushes import DensePull
from shardps_client.session import Session
from shardps_client.versions import Versions

log = logging.getLogger(__name__)


class DenseTensors:
    """The dense tensors of one client's cluster (``Client.register_dense`` and friends)."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def spec(self, name: str) -> DenseSpec:
        """``Client.dense_spec``."""
        return self._session.catalog.dense(name)

    def register(self, name: str, value: Union[torch.Tensor, np.ndarray], optimizer: Optional[Optimizer],
                 staleness: Optional[Staleness], chunk_bytes: int, allow_nonfinite: bool,
                 sync: Optional[SyncPolicy]) -> bool:
        """``Client.register_dense``."""
        session = self._session
        if not isinstance(chunk_bytes, int) or chunk_bytes < 0:
            raise InvalidArgumentError(f"{name}: chunk_bytes must be an int >= 0, got {chunk_bytes!r}")
        arr = grads_to_numpy(value, f"{name}: value")
        if not np.isfinite(arr).all():
            raise InvalidArgumentError(f"{name}: initial value contains NaN or Inf")
        shape = tuple(arr.shape)
        cols = max(1, math.prod(shape[1:]) if arr.ndim >= 2 else math.prod(shape))
        chunk_rows = 0 if arr.size * 4 <= chunk_bytes else max(1, chunk_bytes // (cols * 4))
        try:
            spec = DenseSpec(
                name=name, shape=shape, optimizer=optimizer or SGD(), staleness=staleness or Staleness(),
                chunk_rows=chunk_rows, allow_nonfinite=allow_nonfinite, sync=sync,
            )
        except _ServerInvalidArgument as e:
            raise InvalidArgumentError(f"{e} (chunk_bytes={chunk_bytes:,})" if chunk_rows else str(e)) from None
        if session.max_message_bytes // (spec.cols * 4 + 8) == 0:  # (refused before any shard has a part of it)
            raise InvalidArgumentError(f"dense tensor {name!r}: a row of {spec.cols:,} values ({spec.cols * 4:,} "
                                       f"bytes) does not fit in a message of max_message_bytes="
                                       f"{session.max_message_bytes:,}")
        rows2d = arr.reshape(spec.rows, spec.cols)
        msg = dense_spec_to_pb(spec)

        def register(slots: SlotMap) -> list[Any]:
            calls = []
            for s, start, end in planner.dense_pieces(spec, slots, session.max_message_bytes, pb.FLOAT32):
                req = pb.RegisterDenseRequest(spec=msg, row_start=start, values=codec.encode(rows2d[start:end]),
                                              shard_map=planner.shard_map(s, slots))
                calls.append((s, "RegisterDense", req))
            # Every shard learns the spec (so any can describe it), also those owning no rows.
            for s in sorted(set(slots.active()) - {c[0] for c in calls}):
                calls.append((s, "RegisterDense", pb.RegisterDenseRequest(spec=msg,
                                                                         shard_map=planner.shard_map(s, slots))))
            return first_decides(session.transport, calls)

        results = session.routed(register)
        session.catalog.remember(spec)
        return any(r.created for r in results)

    def pull_many(self, names: Sequence[str], wire_dtype: Optional[str]) -> dict[str, tuple[torch.Tensor, Versions]]:
        """``Client.pull_dense_many``."""
        session = self._session
        wire_code = session.wire(wire_dtype)
        session.worker.ssp_wait()
        specs = {name: session.catalog.dense(name) for name in names}
        if session.read_your_writes:
            for name in names:
                session.see_own_pushes(name)

        def pull(slots: SlotMap) -> dict[str, tuple[torch.Tensor, Versions]]:
            per_shard = planner.dense_pull_plan(specs, slots, wire_code, session.max_message_bytes)
            calls, metas = planner.pull_batches(per_shard, "PullDense", lambda reqs: pb.PullBatchRequest(dense=reqs),
                                                session.max_message_bytes)
            replies = session.transport.read_calls(calls, then=session.pushes.send_trailing)
            pulled = planner.pulled_blocks(calls, metas, replies, pb.PullBatchResponse.DENSE_FIELD_NUMBER)
            values = planner.assemble_dense(specs, ((s, name, a, b, rows, v) for s, name, (a, b), rows, v in pulled))
            return {name: (value, Versions(v)) for name, (value, v) in values.items()}

        return session.routed(pull)

    def push(self, name: str, grad: Union[torch.Tensor, np.ndarray], versions: Optional[Versions], wait: bool,
             wire_dtype: Optional[str]) -> None:
        """``Client.push_dense``."""
        session = self._session
        spec = session.catalog.dense(name)
        g = grads_to_numpy(grad, f"{name}: grad")
        check_grads(g, name, "grad", spec.shape, None, spec.allow_nonfinite)
        wire_code = session.wire(wire_dtype)  # before the step number: a refused push must not use one up
        check_sent(g, name, wire_code, spec.allow_nonfinite)
        sync_step = session.worker.next_sync_step(name) if spec.sync is not None else 0
        calls = planner.dense_push_plan(spec, g.reshape(spec.rows, spec.cols), session.slots, wire_code,
                                        session.max_message_bytes, versions.by_shard if versions is not None else None,
                                        session.client_id, session.next_seq, sync_step, session.worker.rank or 0)
        session.pushes.dispatch(name, calls, wait, session.trails(spec))

    def returning(self, names: Sequence[str]) -> Optional[DensePull]:
        """The PullDenseRequests (framed as PushBatchRequest.pull_dense) that bring ``names`` back with a push."""
        session = self._session
        specs = {name: session.catalog.dense(name) for name in names}
        slots = session.slots
        out = DensePull(specs, slots.num_shards, Versions, again=lambda names: self.pull_many(names, None),
                        forget=self._session.catalog.forget)
        sizes = [0] * slots.num_shards
        for s, name, a, b, req, nbytes in planner.dense_pull_requests(specs, slots, session.wire_dtype,
                                                                       session.max_message_bytes):
            out.requests[s].append(wire.frame(pb.PushBatchRequest.PULL_DENSE_FIELD_NUMBER, req.SerializeToString()))
            out.pieces[s].append((name, a, b))
            sizes[s] += nbytes
        if max(sizes) > session.max_message_bytes // 2:
            return None
        return out


class DenseMethods:
    """``Client``'s dense-tensor methods, each handing the call to the client's ``DenseTensors`` (``_dense``)."""

    _dense: DenseTensors

    def register_dense(self, name: str, value: Union[torch.Tensor, np.ndarray], optimizer: Optional[Optimizer] = None,
                       staleness: Optional[Staleness] = None, chunk_bytes: int = 1 * MiB,
                       allow_nonfinite: bool = False, sync: Optional[SyncPolicy] = None) -> bool:
        """Register a dense tensor with its initial value; True if this call created it.

        A tensor larger than ``chunk_bytes`` is split into row chunks spread
        over the shards. If the tensor exists with the same spec, rows already
        initialised keep their (possibly trained) values: first writer wins.
        """
        return self._dense.register(name, value, optimizer, staleness, chunk_bytes, allow_nonfinite, sync)

    def dense_spec(self, name: str) -> DenseSpec:
        """The spec of a dense tensor (asked of shard 0 the first time, then cached)."""
        return self._dense.spec(name)

    def pull_dense(
        self, name: str, device: Any = None, wire_dtype: Optional[str] = None
    ) -> tuple[torch.Tensor, Versions]:
        """The current value of a dense tensor (its registered shape) and the versions read at."""
        value, versions = self.pull_dense_many([name], wire_dtype)[name]
        return (value.to(device) if device is not None else value), versions

    def pull_dense_many(
        self, names: Sequence[str], wire_dtype: Optional[str] = None
    ) -> dict[str, tuple[torch.Tensor, Versions]]:
        """Several dense tensors in one parallel fan-out: ``{name: (value, versions)}``."""
        return self._dense.pull_many(as_names(names, "pull_dense_many's names"), wire_dtype)

    def push_dense(self, name: str, grad: Union[torch.Tensor, np.ndarray], versions: Optional[Versions] = None,
                   wait: bool = False, wire_dtype: Optional[str] = None) -> None:
        """Send the gradient of a whole dense tensor (asynchronous, like ``push``)."""
        self._dense.push(name, grad, versions, wait, wire_dtype)
