"""Pure functions that plan the client's calls: split requests by shard and by message size,
group them into batches, and reassemble the replies. No network, no state; tested on their own.

A *plan* is a list of calls ``(shard, method, request)``. Rows of a table are split
by the shard that owns each id under the client's slot map (``core.slots.SlotMap.split``),
rows of a dense tensor by the row chunks each shard owns (``SlotMap.dense_ranges``); both
are then cut into pieces of at most ``rows_per_message`` rows. Every request names the
slot map it was planned by (``shard_map``).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from shardps.core import kernels, protocol, pushread, wire
from shardps.core.slots import SlotMap
from shardps.core.specs import DenseSpec, TableSpec
from shardps.v1 import shardps_pb2 as pb
from shardps_client.errors import TableChangedError

WIRE: dict[str, int] = {"float32": pb.FLOAT32, "float16": pb.FLOAT16, "bfloat16": pb.BFLOAT16}
WIRE_BYTES: dict[int, int] = {pb.FLOAT32: 4, pb.FLOAT16: 2, pb.BFLOAT16: 2}

Call = tuple[int, str, Any]  # (shard, method, request)


def shard_map(shard: int, slots: SlotMap) -> pb.ShardMap:
    """The shard map a request to ``shard`` names: its index, and the slot map it was planned by."""
    return pb.ShardMap(shard_index=shard, num_shards=slots.num_shards, map_epoch=slots.epoch, map_id=slots.map_id)


def rows_per_message(max_bytes: int, dim: int, wire_code: int) -> int:
    """Rows (of ``dim`` values and an id) that fit in one message of ``max_bytes``."""
    return max(1, max_bytes // (dim * WIRE_BYTES[wire_code] + 8))


def groups(entries: list, size_of: Callable[[Any], int], limit: int) -> Iterator[list]:
    """Consecutive runs of ``entries`` whose sizes add up to at most ``limit`` (a larger entry goes alone)."""
    group: list = []
    size = 0
    for entry in entries:
        n = size_of(entry)
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append(entry)
        size += n
    if group:
        yield group


# ---- where rows go ---------------------------------------------------------------------


def id_pieces(uniq: np.ndarray, slots: SlotMap, step: int) -> Iterator[tuple[int, np.ndarray]]:
    """(shard, positions in ``uniq``) of at most ``step`` ids each, shard by shard."""
    order, bounds = slots.split(uniq)
    for s in range(slots.num_shards):
        idx = order[bounds[s] : bounds[s + 1]]
        for start in range(0, idx.shape[0], step):
            yield s, idx[start : start + step]


def dense_pieces(spec: DenseSpec, slots: SlotMap, max_bytes: int, wire_code: int) -> Iterator[tuple[int, int, int]]:
    """(shard, row_start, row_end) pieces of a dense tensor, each fitting one message."""
    step = rows_per_message(max_bytes, spec.cols, wire_code)
    for s, start, end in slots.dense_ranges(spec.name, spec.rows, spec.chunk_rows):
        for a in range(start, end, step):
            yield s, a, min(a + step, end)


# ---- pulls -----------------------------------------------------------------------------


def found_in(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Mask of ``ids`` present in the sorted array ``sorted_ids``."""
    if not sorted_ids.shape[0]:
        return np.zeros(ids.shape[0], dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_ids, ids), sorted_ids.shape[0] - 1)
    return sorted_ids[pos] == ids

PerShard = list[list[tuple[Any, Any, Any, int]]]  # per shard: (key, part, request, reply bytes)


def pull_plan(items: list[tuple[TableSpec, np.ndarray]], slots: SlotMap, wire_code: int, max_bytes: int) -> PerShard:
    """Each shard's PullRequests (serialized) for rows of sorted unique ids of several tables (key: the item's
    index); ``pull_batch`` makes a batch of them."""
    per_shard: PerShard = [[] for _ in range(slots.num_shards)]
    maps = [wire.message_field(pb.PullRequest.SHARD_MAP_FIELD_NUMBER, shard_map(s, slots))
            for s in range(slots.num_shards)]
    for k, (spec, uniq) in enumerate(items):
        for s, part in id_pieces(uniq, slots, rows_per_message(max_bytes, spec.dim, wire_code)):
            req = wire.encode_pull(spec.name, uniq[part], wire_code, maps[s])  # (serialized: no protobuf objects)
            per_shard[s].append((k, part, req, len(part) * (spec.dim * WIRE_BYTES[wire_code] + 8)))
    return per_shard


def pull_batch(requests: list[bytes]) -> wire.Buffer:
    """A serialized PullBatchRequest of serialized PullRequests (``pull_plan``'s)."""
    return wire.encode_repeated([(pb.PullBatchRequest.PULLS_FIELD_NUMBER, requests)])


def dense_pull_requests(specs: dict[str, DenseSpec], slots: SlotMap, wire_code: int,
                        max_bytes: int) -> Iterator[tuple[int, str, int, int, pb.PullDenseRequest, int]]:
    """The PullDenseRequests reading ``specs`` whole: (shard, name, row_start, row_end, request, reply bytes)."""
    for name, spec in specs.items():
        for s, a, b in dense_pieces(spec, slots, max_bytes, wire_code):
            req = pb.PullDenseRequest(name=name, row_start=a, row_end=b, wire_dtype=wire_code,  # type: ignore[arg-type]
                                      shard_map=shard_map(s, slots))
            yield s, name, a, b, req, (b - a) * spec.cols * WIRE_BYTES[wire_code]


def dense_pull_plan(specs: dict[str, DenseSpec], slots: SlotMap, wire_code: int, max_bytes: int) -> PerShard:
    """Each shard's PullDenseRequests for ``specs`` (key: the name; part: (row_start, row_end))."""
    per_shard: PerShard = [[] for _ in range(slots.num_shards)]
    for s, name, a, b, req, nbytes in dense_pull_requests(specs, slots, wire_code, max_bytes):
        per_shard[s].append((name, (a, b), req, nbytes))
    return per_shard


def pull_batches(per_shard: PerShard, single: str, make_batch: Callable[[list], Any],
                 max_bytes: int) -> tuple[list[Call], list[list[tuple[Any, Any]]]]:
    """Group each shard's requests into calls below the message limit.

    A shard with one request gets the plain RPC (``single``); more go in
    PullBatch calls. Returns the calls and, per call, the (key, part) of each entry.
    """
    calls: list[Call] = []
    metas: list[list[tuple[Any, Any]]] = []
    for s, entries in enumerate(per_shard):
        if len(entries) == 1:
            k, part, req, _ = entries[0]
            calls.append((s, single, req))
            metas.append([(k, part)])
            continue
        for group in groups(entries, lambda e: e[3], max_bytes):
            calls.append((s, "PullBatch", make_batch([e[2] for e in group])))
            metas.append([(e[0], e[1]) for e in group])
    return calls, metas


def pulled_blocks(calls: list[Call], metas: list[list[tuple[Any, Any]]], replies: list[Any],
                  batch_field: int) -> Iterator[tuple[int, Any, Any, np.ndarray, int]]:
    """(shard, key, part, rows, version) per request, from the replies to ``pull_batches``' calls
    (``batch_field``: the PullBatchResponse field that holds this kind of reply)."""
    for (s, method, _), meta, reply in zip(calls, metas, replies):
        blocks = [reply] if method != "PullBatch" else [wire.decode_pull_response(v) for v in reply.get(batch_field, [])]
        for (key, part), (rows, version) in zip(meta, blocks):
            yield s, key, part, rows, version


def changed(name: str, shard: int, shape: tuple[int, ...], cols: int, count: int) -> TableChangedError:
    """The error of rows that came back in another shape than this client's spec: the table was made again."""
    whole = len(shape) == 2 and shape[0] == count
    got = f"{shape[1]} column{'s' * (shape[1] != 1)}" if whole else f"shape {list(shape)}"
    return TableChangedError(f"{name!r} changed under this client: shard {shard} answered rows of {got} where its spec "
                             f"here has {cols} (dropped and made again with another spec?). The spec is forgotten: the "
                             "next call reads the new one, which a model made for the old one cannot use", name)


def assemble_rows(items: list[tuple[TableSpec, np.ndarray]],
                  blocks: Iterable[tuple[int, int, np.ndarray, np.ndarray, int]]) -> list[tuple[np.ndarray, dict[int, int]]]:
    """Rows of each item's unique ids, in their order, and the lowest version read per shard."""
    outs = [np.empty((u.shape[0], spec.dim), dtype=np.float32) for spec, u in items]
    versions: list[dict[int, int]] = [{} for _ in items]
    jit = kernels.jit()
    for s, k, part, rows, version in blocks:
        out = outs[k]
        if rows.shape != (part.shape[0], out.shape[1]):  # (numpy would broadcast one column into all)
            raise changed(items[k][0].name, s, rows.shape, out.shape[1], part.shape[0])
        if jit is not None and rows.dtype == np.float32 and rows.flags.c_contiguous:
            jit.scatter_rows(out, part, rows)  # (the same as below, in one pass without numpy's set-up)
        else:
            out[part] = rows
        versions[k][s] = min(version, versions[k].get(s, version))
    return list(zip(outs, versions))


def assemble_dense(specs: dict[str, DenseSpec],
                   blocks: Iterable[tuple[int, str, int, int, np.ndarray, int]]) -> dict[str, tuple[torch.Tensor, dict[int, int]]]:
    """Whole dense tensors from (shard, name, row_start, row_end, rows, version) blocks:
    ``{name: (value in its registered shape, lowest version read per shard)}``."""
    outs = {name: np.empty((spec.rows, spec.cols), dtype=np.float32) for name, spec in specs.items()}
    versions: dict[str, dict[int, int]] = {name: {} for name in specs}
    for s, name, a, b, rows, version in blocks:
        if rows.shape != (b - a, specs[name].cols):
            raise changed(name, s, rows.shape, specs[name].cols, b - a)
        outs[name][a:b] = rows
        v = versions[name]
        v[s] = min(version, v.get(s, version))
    return {name: (torch.from_numpy(outs[name].reshape(spec.shape)), versions[name]) for name, spec in specs.items()}


# ---- pushes ----------------------------------------------------------------------------


def push_plan(spec: TableSpec, uniq: np.ndarray, summed: np.ndarray, slots: SlotMap, wire_code: int,
              max_bytes: int, pulled: Optional[dict[int, int]], client_id: str, next_seq: Callable[[int], int],
              sync_step: int = 0, rank: int = 0, origins: tuple[tuple[int, int], ...] = (),
              into: Optional[Callable[[int, int], Optional[memoryview]]] = None) -> list[Call]:
    """Framed Push calls for the summed gradients of sorted unique ids (``origins``: a push planned again's).

    A synchronous worker (``sync_step``) sends every shard its part of the step, even an empty one. ``into(shard,
    size)``: a buffer to build a call to ``shard`` in (a request slot of its lane's shared-memory region), or None.
    """
    step = rows_per_message(max_bytes, spec.dim, wire_code)
    summed = summed.reshape(-1, spec.dim)
    by_shard: list[list[np.ndarray]] = [[] for _ in range(slots.num_shards)]
    for s, part in id_pieces(uniq, slots, step):
        by_shard[s].append(part)
    calls = []
    for s, parts in enumerate(by_shard):
        if not parts and sync_step:
            parts = [np.zeros(0, np.int64)]
        for k, part in enumerate(parts):
            req = wire.encode_push(
                spec.name, summed, wire_code, ids=uniq[part], rows=part,
                pulled_version=pulled.get(s) if pulled is not None else None, client_id=client_id,
                seq=next_seq(s), shard_map=shard_map(s, slots),
                sync=pb.SyncPart(step=sync_step, rank=rank, part=k, parts=len(parts)) if sync_step else None,
                frame=protocol.stream_field("Push"), origins=origins,
                into=None if into is None else functools.partial(into, s),
            )
            calls.append((s, "Push", req))
    return calls


def push_plan_many(names: list[str], uniq: list[np.ndarray], grads: np.ndarray, slots: SlotMap, wire_code: int,
                   max_bytes: int, pulled: list[Optional[dict[int, int]]],
                   encoder: Callable[[str, int], wire.PushEncoder],
                   next_seq: Callable[[int], int]) -> list[tuple[str, list[Call]]]:
    """``push_plan`` of several tables of one width at once (no synchronous step): ``uniq`` the sorted unique
    ids of each table, ``grads`` their summed gradients stacked in the same order. The ids of every table are
    split by shard in one pass; then one framed Push per table and shard (more above the size limit), made by
    ``encoder(table, shard)``: a large one gathers its rows straight into its message, small ones take slices of
    their shard's rows gathered in one copy."""
    counts = np.fromiter((u.shape[0] for u in uniq), dtype=np.int64, count=len(uniq))
    ids = np.concatenate(uniq) if uniq else np.zeros(0, np.int64)
    table_of = np.repeat(np.arange(len(uniq), dtype=np.int64), counts)
    order, bounds = slots.split(ids)  # (each shard's ids in their order: table after table)
    step = rows_per_message(max_bytes, grads.shape[1] if grads.ndim == 2 else 1, wire_code)
    row_bytes = (grads.shape[1] if grads.ndim == 2 else 1) * 4
    calls: list[list[Call]] = [[] for _ in uniq]
    for s in range(slots.num_shards):
        idx = order[bounds[s] : bounds[s + 1]]
        if not idx.shape[0]:
            continue
        ids_s, grads_s = ids[idx], None
        cuts = np.searchsorted(table_of[idx], np.arange(len(uniq) + 1)).tolist()
        for t in range(len(uniq)):
            for a in range(cuts[t], cuts[t + 1], step):
                b = min(a + step, cuts[t + 1])
                v = pulled[t]
                version = v.get(s) if v is not None else None
                if (b - a) * row_bytes >= wire.ROWS_IN_PLACE_BYTES:  # gathered straight into the message
                    req = encoder(names[t], s).encode(ids_s[a:b], grads, wire_code, version, next_seq(s),
                                                      rows=idx[a:b])
                else:  # small: the shard's rows gathered once, each table's a slice of them
                    if grads_s is None:
                        grads_s = grads[idx]
                    req = encoder(names[t], s).encode(ids_s[a:b], grads_s[a:b], wire_code, version, next_seq(s))
                calls[t].append((s, "Push", req))
    return [(name, c) for name, c in zip(names, calls) if c]


def dense_push_plan(spec: DenseSpec, grad: np.ndarray, slots: SlotMap, wire_code: int, max_bytes: int,
                    pulled: Optional[dict[int, int]], client_id: str, next_seq: Callable[[int], int],
                    sync_step: int = 0, rank: int = 0) -> list[Call]:
    """Framed PushDense calls for the gradient ``grad`` ([rows, cols]) of a whole dense tensor."""
    pieces = list(dense_pieces(spec, slots, max_bytes, wire_code))
    per_shard = collections.Counter(s for s, _, _ in pieces)
    seen: collections.Counter = collections.Counter()
    calls = []
    for s, a, b in pieces:
        req = wire.encode_push(
            spec.name, grad[a:b], wire_code, row_start=a,
            pulled_version=pulled.get(s) if pulled is not None else None, client_id=client_id,
            seq=next_seq(s), shard_map=shard_map(s, slots),
            sync=pb.SyncPart(step=sync_step, rank=rank, part=seen[s], parts=per_shard[s]) if sync_step else None,
            frame=protocol.stream_field("PushDense"),
        )
        seen[s] += 1
        calls.append((s, "PushDense", req))
    return calls


def push_batches(deferred: list[tuple[str, list[Call]]], num_shards: int, max_bytes: int,
                 returning: Optional[list[list[bytes]]] = None,
                 carried: Optional[list[list[bytes]]] = None) -> tuple[list[tuple[list[str], Call]], dict[int, int]]:
    """Queued pushes as one PushBatch per shard (or a few, below the size limit).

    ``deferred``: (key, framed push calls) in the order they were made. ``returning``:
    per shard, framed PullDense entries to carry in that shard's last batch; ``carried``:
    per shard, framed row pulls (PushBatchRequest.pulls) to carry there after them. Returns
    the calls, each with the keys of its entries in order, and per shard the index of
    the call that carries its pulls.
    """
    per_shard: list[list[tuple[str, str, bytes]]] = [[] for _ in range(num_shards)]
    for key, calls in deferred:
        for s, method, req in calls:
            per_shard[s].append((key, method, req))
    work: list[tuple[list[str], Call]] = []
    carries: dict[int, int] = {}
    for s, entries in enumerate(per_shard):
        pulls = (returning[s] if returning is not None else []) + (carried[s] if carried is not None else [])
        if len(entries) == 1 and not pulls:
            key, method, req = entries[0]
            work.append(([key], (s, method, req)))
            continue
        room = max_bytes - sum(len(p) for p in pulls)
        batches = list(groups(entries, lambda e: len(e[2]), room)) or [[]]
        for k, group in enumerate(batches):
            tail = pulls if k == len(batches) - 1 else []
            if not group and not tail:
                continue
            rows = [g for g in group if g[1] == "Push"]
            dense = [g for g in group if g[1] == "PushDense"]
            # Framed pushes are PushBatchRequest entries as they are (same field numbers).
            body = wire.frame(protocol.stream_field("PushBatch"), *[g[2] for g in rows + dense], *tail)
            if tail:
                carries[s] = len(work)
            work.append(([g[0] for g in rows + dense], (s, "PushBatch", body)))
    return work, carries



# ---- pushes a shard refused because their slots moved -------------------------------------


def pushes_of(call: Call) -> list[tuple[bool, pushread.DecodedPush]]:
    """The pushes a framed push call carries: (dense, decoded push) each (a PushBatch's dense pulls left out)."""
    _, method, framed = call
    _, view = wire.unframe(framed)
    if method == "Push":
        return [(False, pushread.decode_push(view, dense=False))]
    if method == "PushDense":
        return [(True, pushread.decode_push(view, dense=True))]
    groups_ = wire.decode_repeated(view, (pb.PushBatchRequest.PUSHES_FIELD_NUMBER,
                                          pb.PushBatchRequest.DENSE_FIELD_NUMBER))
    return ([(False, pushread.decode_push(v, dense=False)) for v in groups_.get(pb.PushBatchRequest.PUSHES_FIELD_NUMBER, [])]
            + [(True, pushread.decode_push(v, dense=True)) for v in groups_.get(pb.PushBatchRequest.DENSE_FIELD_NUMBER, [])])


def replan_push(d: pushread.DecodedPush, spec: TableSpec | DenseSpec, slots: SlotMap, max_bytes: int,
                next_seq: Callable[[int], int], origins: tuple[tuple[int, int], ...] = ()) -> list[Call]:
    """A push a shard refused (its slots moved) planned again by ``slots``: the same gradients (float32 on the
    wire), new sequence numbers on the shards they now go to, and no pulled version (its staleness is not
    measured: the version it carried was another shard's). A row push's ids are sorted and unique: planned as
    ``push_plan`` plans any; a dense push's rows are a piece of the tensor, cut by the chunks' owners now."""
    assert d.grads is not None
    grads = np.asarray(d.grads, dtype=np.float32)
    if isinstance(spec, TableSpec):
        assert d.ids is not None
        return push_plan(spec, d.ids, grads, slots, pb.FLOAT32, max_bytes, None, d.client_id, next_seq,
                         origins=origins)
    calls: list[Call] = []
    lo, hi = d.row_start, d.row_start + grads.shape[0]
    for s, a, b in dense_pieces(spec, slots, max_bytes, pb.FLOAT32):
        a, b = max(a, lo), min(b, hi)
        if a < b:
            calls.append((s, "PushDense", wire.encode_push(d.name, grads[a - lo:b - lo], pb.FLOAT32, row_start=a,
                                                           client_id=d.client_id, seq=next_seq(s),
                                                           shard_map=shard_map(s, slots),
                                                           frame=protocol.stream_field("PushDense"),
                                                           origins=origins)))
    return calls
