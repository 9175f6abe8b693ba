"""The numba kernels behind ``shardps.core.kernels`` (imported on first use: importing numba costs 0.3-0.5 s).

Each function mirrors a plain-numpy reference named in ``kernels``; see there for the rules they keep. The disk
tier's are in ``disk_loops``, the sorting of ids in ``id_loops`` (both imported here).
"""

from __future__ import annotations

import math

import numpy as np

from shardps.core.kernels.common import kernel as _njit
from shardps.core.kernels.common import mix
from shardps.core.kernels.constants import ZIG_ATTEMPTS, ZIGGURAT_R
from shardps.core.kernels.disk_loops import (  # noqa: F401
    clock_victims,
    gather_words,
    pread_records,
    sample_victims,
    scatter_words,
)
from shardps.core.kernels.id_loops import unique_inverse  # noqa: F401

_S32 = np.uint64(32)


@_njit
def shard_of_ids(ids: np.ndarray, num_shards: int, seed: np.uint64) -> np.ndarray:
    """``routing.shard_of_ids`` for a 1-D int64 array."""
    n = np.uint64(num_shards)
    out = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        hi = mix(np.uint64(ids[i]), seed) >> _S32
        out[i] = np.int64((hi * n) >> _S32)
    return out


@_njit
def split_by_shard(ids: np.ndarray, num_shards: int, seed: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    """``routing.split_by_shard``: one hashing pass, then a stable counting sort by shard."""
    return group_by_owner(shard_of_ids(ids, num_shards, seed), num_shards)


_S50 = np.uint64(50)


@_njit
def owner_by_map(ids: np.ndarray, owners: np.ndarray, base: int, seed: np.uint64) -> np.ndarray:
    """``slots.SlotMap.owner_of``: the owner of each id's hash slot (top 14 bits); a slot split between two shards
    (owner -1) falls back to the multiply-shift of ``base`` shards on the high 32 bits."""
    n = np.uint64(base)
    out = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        z = mix(np.uint64(ids[i]), seed)
        o = np.int64(owners[np.int64(z >> _S50)])
        if o < 0:
            o = np.int64(((z >> _S32) * n) >> _S32)
        out[i] = o
    return out


@_njit
def all_owned(ids: np.ndarray, limit: int, owners: np.ndarray, base: int, seed: np.uint64, shard: int) -> bool:
    """``slots.SlotMap.all_owned``: whether every id is in [0, ``limit``) (``limit`` < 0: any id) and owned by
    ``shard`` under the map, in one pass that stops at the first that is not (no array of owners made)."""
    n = np.uint64(base)
    for i in range(ids.shape[0]):
        v = ids[i]
        if limit >= 0 and (v < 0 or v >= limit):
            return False
        z = mix(np.uint64(v), seed)
        o = np.int64(owners[np.int64(z >> _S50)])
        if o < 0:
            o = np.int64(((z >> _S32) * n) >> _S32)
        if o != shard:
            return False
    return True


@_njit
def strictly_increasing(ids: np.ndarray) -> bool:
    """``ids.is_sorted_unique``: whether each id is larger than the one before it."""
    for i in range(1, ids.shape[0]):
        if ids[i] <= ids[i - 1]:
            return False
    return True


@_njit
def split_by_map(ids: np.ndarray, owners: np.ndarray, base: int, num_shards: int,
                 seed: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    """``slots.SlotMap.split``: one hashing pass, then a stable counting sort by owner."""
    return group_by_owner(owner_by_map(ids, owners, base, seed), num_shards)


@_njit
def group_by_owner(owner: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, bounds) of a stable counting sort of positions by ``owner``."""
    bounds = np.zeros(num_shards + 1, np.int64)
    for i in range(owner.shape[0]):
        bounds[owner[i] + 1] += 1
    for s in range(num_shards):
        bounds[s + 1] += bounds[s]
    fill = bounds[:-1].copy()
    order = np.empty(owner.shape[0], np.int64)
    for i in range(owner.shape[0]):
        o = owner[i]
        order[fill[o]] = i
        fill[o] += 1
    return order, bounds


# ---- the hash index (server.index.HashIndex) ----------------------------------------


@_njit
def hash_lookup(table: np.ndarray, slot_ids: np.ndarray, ids: np.ndarray, seed: np.uint64) -> np.ndarray:
    """Slot of each id in a linear-probing table of int32 slots (-1: empty), -1 where absent."""
    mask = np.uint64(table.shape[0] - 1)
    out = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        x = ids[i]
        pos = mix(np.uint64(x), seed) & mask
        while True:
            s = table[pos]
            if s < 0:
                out[i] = -1
                break
            if slot_ids[s] == x:
                out[i] = s
                break
            pos = (pos + np.uint64(1)) & mask
    return out


@_njit
def hash_place(table: np.ndarray, ids: np.ndarray, values: np.ndarray, seed: np.uint64) -> None:
    """Write absent, unique ``ids`` as slots ``values`` at the first free position of their probe run."""
    mask = np.uint64(table.shape[0] - 1)
    for i in range(ids.shape[0]):
        pos = mix(np.uint64(ids[i]), seed) & mask
        while table[pos] >= 0:
            pos = (pos + np.uint64(1)) & mask
        table[pos] = np.int32(values[i])


@_njit
def hash_remove(table: np.ndarray, slot_ids: np.ndarray, count: int, ids: np.ndarray, seed: np.uint64) -> np.ndarray:
    """``HashIndex.remove_numpy``: delete present, unique ``ids`` one by one (backward-shift deletion, no
    tombstones), each time moving the last slot into the freed one. Returns the moves as rows of
    (from slot, to slot), in order; ``slot_ids`` is updated in place."""
    mask = np.uint64(table.shape[0] - 1)
    moves = np.empty((ids.shape[0], 2), np.int64)
    n = 0
    for i in range(ids.shape[0]):
        x = ids[i]
        pos = mix(np.uint64(x), seed) & mask
        while slot_ids[table[pos]] != x:  # present: its run reaches it before an empty position
            pos = (pos + np.uint64(1)) & mask
        victim = np.int64(table[pos])
        # Backward-shift: pull later entries of the run into the hole unless their home lies in (hole, j].
        hole = pos
        j = (pos + np.uint64(1)) & mask
        while table[j] >= 0:
            home = mix(np.uint64(slot_ids[table[j]]), seed) & mask
            if ((j - home) & mask) >= ((j - hole) & mask):
                table[hole] = table[j]
                hole = j
            j = (j + np.uint64(1)) & mask
        table[hole] = -1
        count -= 1
        if victim != count:  # the last slot takes the victim's place
            last = slot_ids[count]
            p = mix(np.uint64(last), seed) & mask
            while table[p] != count:
                p = (p + np.uint64(1)) & mask
            table[p] = np.int32(victim)
            slot_ids[victim] = last
            moves[n, 0] = count
            moves[n, 1] = victim
            n += 1
    return moves[:n]


@_njit
def direct_remove(flat: np.ndarray, slot_ids: np.ndarray, count: int, ids: np.ndarray) -> np.ndarray:
    """``DirectIndex.remove``: the same deletions and moves through the flat id -> slot map."""
    moves = np.empty((ids.shape[0], 2), np.int64)
    n = 0
    for i in range(ids.shape[0]):
        victim = np.int64(flat[ids[i]])
        flat[ids[i]] = -1
        count -= 1
        if victim != count:
            moved = slot_ids[count]
            slot_ids[victim] = moved
            flat[moved] = np.int32(victim)
            moves[n, 0] = count
            moves[n, 1] = victim
            n += 1
    return moves[:n]


@_njit
def apply_moves(arr: np.ndarray, moves: np.ndarray) -> None:
    """``Table.remove``'s composition of moves: row ``to`` takes row ``from``, one move after the other."""
    cols = arr.shape[1]
    for i in range(moves.shape[0]):
        src, dst = moves[i, 0], moves[i, 1]
        for j in range(cols):
            arr[dst, j] = arr[src, j]


@_njit
def touch_rows(words: np.ndarray, wide: np.ndarray, slots: np.ndarray, step: np.ndarray, stamp: int,
               now: int) -> None:
    """A push's metadata of rows ``slots`` (``table._step``): each row's step count set to ``step``, its last
    version to ``stamp``, its last push time to ``now`` (uint32 ticks) and its pushes counted, in one pass over the
    table's 24-byte records (``rows.META``) seen as 6 int32 words (``words``) and as 3 int64 words (``wide``)."""
    t = np.int32(np.uint32(now))
    for i in range(slots.shape[0]):
        s = slots[i]
        wide[s, 0] = stamp
        words[s, 2] = step[i]
        words[s, 3] = t
        words[s, 4] = np.int32(words[s, 4] + np.int32(1))


# ---- initial rows (core.specs.Initializer) -------------------------------------------


_U53 = 1.0 / 9007199254740992.0  # 2**-53
_MASK8 = np.uint64(0xFF)
_MASK52 = np.uint64(0x000FFFFFFFFFFFFF)
_ONE = np.uint64(1)
_S8 = np.uint64(8)
_S9 = np.uint64(9)
_S11 = np.uint64(11)
_S20 = np.uint64(20)


@_njit
def _draw(base: np.uint64, column: int, attempt: int, seed: np.uint64) -> np.uint64:
    """The attempt-th 64-bit word of the row's column: hash of (row hash, column, attempt)."""
    return mix(base + ((np.uint64(column) << _S20) | np.uint64(attempt)), seed)


@_njit
def _unit(word: np.uint64) -> float:
    return np.float64(word >> _S11) * _U53  # [0, 1)


@_njit
def normal_value(base: np.uint64, column: int, seed: np.uint64, zk: np.ndarray, zw: np.ndarray,
                 zf: np.ndarray) -> float:
    """One standard normal value of (row hash, column): the ziggurat's slow path (about 1% of values)."""
    attempt = 0
    while attempt < ZIG_ATTEMPTS:
        r = _draw(base, column, attempt, seed)
        attempt += 1
        idx = np.int64(r & _MASK8)
        negative = ((r >> _S8) & _ONE) == _ONE
        mag = (r >> _S9) & _MASK52
        x = np.float64(np.int64(mag)) * zw[idx]
        if mag < zk[idx]:
            return -x if negative else x
        if idx == 0:  # the tail beyond R, by Marsaglia's exponential method
            while attempt + 1 < ZIG_ATTEMPTS:
                xx = -math.log1p(-_unit(_draw(base, column, attempt, seed))) / ZIGGURAT_R
                yy = -math.log1p(-_unit(_draw(base, column, attempt + 1, seed)))
                attempt += 2
                if yy + yy > xx * xx:
                    return -(ZIGGURAT_R + xx) if negative else ZIGGURAT_R + xx
            return 0.0
        u = _unit(_draw(base, column, attempt, seed))
        attempt += 1
        if (zf[idx - 1] - zf[idx]) * u + zf[idx] < math.exp(-0.5 * x * x):
            return -x if negative else x
    return 0.0


@_njit
def normal_rows(ids: np.ndarray, dim: int, row_seed: np.uint64, draw_seed: np.uint64, mean: float, std: float,
                zk: np.ndarray, zw: np.ndarray, zf: np.ndarray) -> np.ndarray:
    """``Initializer.rows`` for kind "normal": float32(mean + std * z) per (row, column).

    A row in four loops: its columns' first draws (integer arithmetic only, which compiles to vector instructions:
    16-19 ns a 64-dim row with AVX-512), their layers' table entries (a lookup per value, alone in its loop), their
    ziggurat values (no branch nor lookup: vector instructions too), then the rare values the first draw does not
    give (1.5% of them), one by one. Measured a 64-dim row: 129 ns, against 156 with the lookups in the value loop
    (which kept it from being vectorized) and 180 with the slow path in it too; the slow path is about 60 of it."""
    out = np.empty((ids.shape[0], dim), np.float32)
    words = np.empty(dim, np.uint64)
    layer_w = np.empty(dim, np.float64)
    layer_k = np.empty(dim, np.uint64)
    for i in range(ids.shape[0]):
        base = mix(np.uint64(ids[i]), row_seed)
        for j in range(dim):
            words[j] = _draw(base, j, 0, draw_seed)
        for j in range(dim):
            idx = words[j] & _MASK8
            layer_w[j] = zw[idx]
            layer_k[j] = zk[idx]
        rejected = 0
        for j in range(dim):
            r = words[j]
            mag = (r >> _S9) & _MASK52
            z = np.float64(np.int64(mag)) * layer_w[j]
            z = -z if ((r >> _S8) & _ONE) == _ONE else z
            out[i, j] = np.float32(z * std + mean)
            rejected += mag >= layer_k[j]
        if rejected:
            for j in range(dim):
                r = words[j]
                if (r >> _S9) & _MASK52 >= zk[np.int64(r & _MASK8)]:
                    out[i, j] = np.float32(normal_value(base, j, draw_seed, zk, zw, zf) * std + mean)
    return out


# ---- optimizer steps over the rows of a table (core.optim) ---------------------------


@_njit
def _axpy(x: np.float32, a: float, y: np.float32) -> np.float32:
    """optim.axpy for one value: float32(x + a * y), one rounding (a is float32-valued)."""
    return np.float32(np.float64(y) * a + np.float64(x))


@_njit
def sgd_apply(rows: np.ndarray, buf: np.ndarray, slots: np.ndarray, first: np.ndarray, grads: np.ndarray,
              neg_lr: float, has_wd: bool, weight_decay: float, has_momentum: bool, momentum: float,
              momentum32: np.float32, one_minus_damp: float, nesterov: bool) -> None:
    """``SGD.step`` on rows ``slots`` of ``rows`` (and of ``buf`` with momentum), in place; ``first``: the
    row's first step. Hyper-parameters come rounded to float32 (``optim._f32``), as ``axpy`` uses them."""
    for i in range(slots.shape[0]):
        s = slots[i]
        for j in range(rows.shape[1]):
            p = rows[s, j]
            d = grads[i, j]
            if has_wd:
                d = _axpy(d, weight_decay, p)
            if has_momentum:
                if first[i]:
                    b = d
                else:
                    b = _axpy(momentum32 * buf[s, j], one_minus_damp, d)
                buf[s, j] = b
                d = _axpy(d, momentum, b) if nesterov else b
            rows[s, j] = _axpy(p, neg_lr, d)


@_njit
def adagrad_apply(rows: np.ndarray, acc: np.ndarray, slots: np.ndarray, clr: np.ndarray, grads: np.ndarray,
                  has_wd: bool, weight_decay: float, eps: np.float32) -> None:
    """``Adagrad.step`` on rows ``slots``; ``clr``: each row's float32 learning rate."""
    for i in range(slots.shape[0]):
        s = slots[i]
        c = clr[i]
        for j in range(rows.shape[1]):
            p = rows[s, j]
            g = grads[i, j]
            if has_wd:
                g = _axpy(g, weight_decay, p)
            a = acc[s, j] + g * g
            acc[s, j] = a
            rows[s, j] = p - c * (g / (np.sqrt(a) + eps))


@_njit
def adam_apply(rows: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, slots: np.ndarray,
               step_size: np.ndarray, bc2_sqrt: np.ndarray, grads: np.ndarray, has_wd: bool, weight_decay: float,
               one_minus_b1: np.float32, b2: np.float32, one_minus_b2: np.float32, eps: np.float32) -> None:
    """``Adam.step`` on rows ``slots``; ``step_size``, ``bc2_sqrt``: each row's float32 factors."""
    for i in range(slots.shape[0]):
        s = slots[i]
        lr = step_size[i]
        bc = bc2_sqrt[i]
        for j in range(rows.shape[1]):
            p = rows[s, j]
            g = grads[i, j]
            if has_wd:
                g = _axpy(g, weight_decay, p)
            m = exp_avg[s, j]
            m = m + one_minus_b1 * (g - m)
            v = exp_avg_sq[s, j] * b2
            v = v + one_minus_b2 * (g * g)
            exp_avg[s, j] = m
            exp_avg_sq[s, j] = v
            rows[s, j] = p - lr * (m / (np.sqrt(v) / bc + eps))


# ---- summing gradients of duplicate ids (core.ids.coalesce) --------------------------


@_njit
def _pairwise(grads: np.ndarray, order: np.ndarray, a: int, n: int, j: int) -> np.float32:
    """Column j of rows order[a:a+n] summed as numpy's float32 pairwise summation adds them (8 accumulators
    in blocks of up to 128, halves beyond)."""
    if n < 8:
        res = np.float32(-0.0)
        for i in range(n):
            res += grads[order[a + i], j]
        return res
    if n <= 128:
        r0 = grads[order[a], j]
        r1 = grads[order[a + 1], j]
        r2 = grads[order[a + 2], j]
        r3 = grads[order[a + 3], j]
        r4 = grads[order[a + 4], j]
        r5 = grads[order[a + 5], j]
        r6 = grads[order[a + 6], j]
        r7 = grads[order[a + 7], j]
        i = 8
        while i < n - (n % 8):
            r0 += grads[order[a + i], j]
            r1 += grads[order[a + i + 1], j]
            r2 += grads[order[a + i + 2], j]
            r3 += grads[order[a + i + 3], j]
            r4 += grads[order[a + i + 4], j]
            r5 += grads[order[a + i + 5], j]
            r6 += grads[order[a + i + 6], j]
            r7 += grads[order[a + i + 7], j]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += grads[order[a + i], j]
            i += 1
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise(grads, order, a, n2, j) + _pairwise(grads, order, a + n2, n - n2, j)


@_njit
def sum_runs(grads: np.ndarray, order: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Row k: the float32 sum of grads[order[starts[k]:starts[k+1]]] (the last run ends at the end), in
    ``np.add.reduceat``'s order: the run's first row plus the pairwise sum of the others."""
    n_out = starts.shape[0]
    out = np.empty((n_out, grads.shape[1]), np.float32)
    for k in range(n_out):
        a = starts[k]
        b = starts[k + 1] if k + 1 < n_out else order.shape[0]
        first = order[a]
        if b - a == 1:
            for j in range(grads.shape[1]):
                out[k, j] = grads[first, j]
        else:
            for j in range(grads.shape[1]):
                out[k, j] = grads[first, j] + _pairwise(grads, order, a + 1, b - a - 1, j)
    return out




# ---- moving rows between a message and a client's arrays (planner.assemble_rows, wire.encode_push) ---------------


@_njit
def gather_rows(src: np.ndarray, idx: np.ndarray, dst: np.ndarray) -> None:
    """``dst[i] = src[idx[i]]`` (numpy: ``np.take(src, idx, axis=0, out=dst)``) for 2-D float32 arrays; ``dst`` may
    be a view of a message's buffer at any offset."""
    for i in range(idx.shape[0]):
        r = idx[i]
        for j in range(src.shape[1]):
            dst[i, j] = src[r, j]


@_njit
def scatter_rows(dst: np.ndarray, idx: np.ndarray, src: np.ndarray) -> None:
    """``dst[idx[i]] = src[i]`` (numpy: ``dst[idx] = src``) for 2-D float32 arrays; ``src`` may be a view of a
    received message at any offset."""
    for i in range(idx.shape[0]):
        r = idx[i]
        for j in range(src.shape[1]):
            dst[r, j] = src[i, j]


# ---- checks of pushed values (inputs.check_grads on a client, storage.checks.grads on a shard) -------------------


@_njit
def all_finite(values: np.ndarray) -> bool:
    """Whether no value of a 2-D float32 array is NaN or infinite (numpy: ``np.isfinite(values).all()``), in one
    pass without numpy's temporary array of flags; it stops at the end of the first row holding one."""
    for i in range(values.shape[0]):
        ok = True
        for j in range(values.shape[1]):
            ok &= np.isfinite(values[i, j])
        if not ok:
            return False
    return True
