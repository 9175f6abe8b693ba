"""The checkers run on a finished campaign: the clients' histories, the rows read back, the members' own logs.

- ``counter`` (Jepsen's counter): each shared row's value lies between the increments acknowledged and the
  increments attempted (acknowledged + unknown), and equals the acknowledged when no operation touching it is
  unknown.
- ``exactly_once``: every operation adds 1 to a row of its own, so its effect is read back directly: an
  acknowledged operation's row holds 1 (0: lost), a failed one's 0, an unknown one's 0 or 1; 2 or more is an
  operation applied twice. And from the members' logs of applied pushes (which do not trust the client): no
  (client, seq) appears twice in one member's log.
- ``converge``: every member of a group ends with the same rows (hashed), the same version and the same log
  position.
- ``log_agreement`` (one primary per epoch): for every (epoch, LSN) every member that holds a record there holds
  the same record; each member's epochs rise along its log.
- ``realtime``: the acknowledged operations' records lie in the final log in an order real time allows: if A was
  acknowledged before B was invoked, A's record comes before B's. A write acknowledged by a member in an epoch after
  a newer epoch began is either missing from the final log (lost) or out of this order.
- ``slot_owners`` (one owner per hash slot per map epoch): no two groups' logs install maps of one epoch that give a
  slot to different shards.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np

from tests.chaos.history import Op


@dataclass
class Finding:
    checker: str
    ok: bool
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


# ---- the clients' operations against the rows read back --------------------------------------------------------


def counter(ops: list[Op], values: dict[int, float], shared: Iterable[int]) -> Finding:
    """Jepsen's counter on the shared rows (``values``: row -> value read back)."""
    acked: Counter = Counter()
    maybe: Counter = Counter()
    for o in ops:
        for r in o.ids[1:]:
            if o.outcome == "ok":
                acked[r] += 1
            elif o.outcome == "info":
                maybe[r] += 1
    bad = []
    for r in shared:
        v = values.get(r, 0.0)
        low, high = acked[r], acked[r] + maybe[r]
        if not low <= v <= high or (maybe[r] == 0 and v != low):
            bad.append({"row": r, "value": v, "acknowledged": low, "attempted": high})
    return Finding("counter", not bad, f"{len(bad)} shared rows outside [acknowledged, attempted]" if bad else
                   f"{len(list(shared))} shared rows within bounds", {"violations": bad[:20]})


def exactly_once(ops: list[Op], values: dict[int, float]) -> tuple[Finding, dict[str, list[Op]]]:
    """Each operation's own row: lost, applied twice, or applied though it failed. The findings, and the
    operations in each class."""
    lost, twice, false_fail = [], [], []
    for o in ops:
        v = values.get(o.own_row, 0.0)
        if v >= 2:
            twice.append(o)
        elif o.outcome == "ok" and v != 1:
            lost.append(o)
        elif o.outcome == "fail" and v != 0:
            false_fail.append(o)
    ok = not (lost or twice or false_fail)
    detail = f"{len(lost)} lost, {len(twice)} applied twice, {len(false_fail)} failed yet applied"
    data = {"lost": [(o.client, o.k) for o in lost[:20]], "twice": [(o.client, o.k) for o in twice[:20]],
            "false_fail": [(o.client, o.k) for o in false_fail[:20]]}
    return Finding("exactly once (rows)", ok, detail, data), {"lost": lost, "twice": twice, "false_fail": false_fail}


# ---- the members' logs -------------------------------------------------------------------------------------------


@dataclass
class LogRecord:
    lsn: int
    epoch: int
    kind: int
    digest: str
    client_id: str = ""
    seq: int = 0
    ids: Optional[np.ndarray] = None
    slots: Optional[dict] = None


@dataclass
class MemberLog:
    """What one member's data dir holds: its records after its newest checkpoint, numbered and stamped."""

    name: str
    first_lsn: int  # the LSN of the first record here (the checkpoint's + 1)
    records: list[LogRecord]
    history: list[tuple[int, int]]
    error: str = ""


def read_member_log(name: str, data_dir: pathlib.Path) -> MemberLog:
    """A member's log read offline with the shard's own readers (``wal``, ``modes.read_record``)."""
    from shardps.server.durability import checkpoints, wal
    from shardps.server.durability import modes as durability

    lsn0, segment, epochs = 0, 0, []
    for loaded in checkpoints.load_newest(data_dir):
        lsn0 = int(loaded.meta.get("lsn", 0))
        segment = int(loaded.meta.get("wal_segment", 0))
        epochs = list(loaded.meta.get("epochs", []))
        break
    path = data_dir / "replica-epochs.json"
    if path.exists():
        epochs += json.loads(path.read_text())
    history = sorted({(int(e), int(s)) for e, s in epochs})
    out = MemberLog(name, lsn0 + 1, [], history)

    def epoch_of(lsn: int) -> int:
        e = 0
        for epoch, start in history:
            if start <= lsn:
                e = epoch
        return e

    lsn = lsn0
    try:
        for rec in wal.replay(data_dir, segment):
            lsn += 1
            payload = bytes(rec.payload)
            r = LogRecord(lsn, epoch_of(lsn), rec.kind, hashlib.sha256(bytes([rec.kind]) + payload).hexdigest()[:16])
            change = durability.read_record(rec.kind, payload)
            if isinstance(change, durability.Push) and not change.dense:
                r.client_id, r.seq, r.ids = change.push.client_id, change.push.seq, np.array(change.push.ids)
            elif isinstance(change, durability.Slots):
                r.slots = change.change
            out.records.append(r)
    except wal.CorruptLog as e:  # a torn tail (the member was killed mid-write): what came before stands
        out.error = f"torn log tail: {e}"
    return out


def where_logged(ops: list[Op], logs: list[MemberLog]) -> dict[str, list[tuple[str, int, int, str, int]]]:
    """For each operation (``client#k``): every (member, LSN, epoch, client id, seq) whose record holds its own row."""
    want = {o.own_row: f"{o.client}#{o.k}" for o in ops}
    out: dict[str, list[tuple[str, int, int, str, int]]] = {name: [] for name in want.values()}
    for m in logs:
        for r in m.records:
            if r.ids is None:
                continue
            for i in set(r.ids.tolist()) & want.keys():
                out[want[i]].append((m.name, r.lsn, r.epoch, r.client_id, r.seq))
    return out


def pushes_once_per_log(logs: list[MemberLog]) -> Finding:
    """No (client, seq) applied twice on any member (its log records every push it applied)."""
    dup = []
    for m in logs:
        seen = Counter((r.client_id, r.seq) for r in m.records if r.client_id)
        dup += [(m.name, c, s, n) for (c, s), n in seen.items() if n > 1]
    return Finding("exactly once (logs)", not dup,
                   f"{len(dup)} (client, seq) logged twice" if dup else
                   f"{sum(len(m.records) for m in logs)} records in {len(logs)} logs, no push twice",
                   {"duplicates": dup[:20]})


def log_agreement(groups: dict[int, list[MemberLog]]) -> Finding:
    """One record per (epoch, LSN) across a group's members; epochs rising along each log."""
    bad = []
    for g, logs in groups.items():
        at: dict[tuple[int, int], set[str]] = defaultdict(set)
        for m in logs:
            last = 0
            for r in m.records:
                at[(r.epoch, r.lsn)].add(r.digest)
                if r.epoch < last:
                    bad.append(f"group {g} member {m.name}: epoch falls from {last} to {r.epoch} at record {r.lsn}")
                last = r.epoch
        bad += [f"group {g}: {len(d)} different records at epoch {e}, LSN {n}" for (e, n), d in at.items() if len(d) > 1]
    return Finding("one primary per epoch", not bad, "; ".join(bad[:5]) if bad else
                   f"{len(groups)} group(s): every (epoch, LSN) holds one record", {"violations": bad[:20]})


def realtime(ops: list[Op], final: dict[int, MemberLog], shard_of_row: dict[int, int]) -> Finding:
    """Acknowledged operations appear in each shard's final log in an order real time allows (see the module)."""
    where: dict[tuple[str, int], tuple[int, int]] = {}
    for shard, m in final.items():
        own_rows = {}
        for r in m.records:
            if r.ids is not None and r.client_id:
                for i in r.ids.tolist():
                    own_rows.setdefault(i, r.lsn)
        for o in ops:
            if o.outcome == "ok" and shard_of_row.get(o.own_row) == shard and o.own_row in own_rows:
                where[(o.client, o.k)] = (shard, own_rows[o.own_row])
    bad = []
    for shard in final:
        acked = sorted((o for o in ops if (o.client, o.k) in where and where[(o.client, o.k)][0] == shard),
                       key=lambda o: o.invoked)
        # A before B in real time (A done before B began) needs lsn(A) < lsn(B): compare each B with the latest
        # LSN among operations completed before it began (a sweep over completion times).
        done = sorted(acked, key=lambda o: o.completed or 0.0)
        j, best, best_op = 0, -1, None
        for b in acked:
            while j < len(done) and (done[j].completed or 0.0) < b.invoked:
                lsn = where[(done[j].client, done[j].k)][1]
                if lsn > best:
                    best, best_op = lsn, done[j]
                j += 1
            if best >= 0 and where[(b.client, b.k)][1] < best:
                bad.append(f"shard {shard}: {b.client}#{b.k} (record {where[(b.client, b.k)][1]}) began after "
                           f"{best_op.client}#{best_op.k} (record {best}) was acknowledged")  # type: ignore[union-attr]
    covered = len(where)
    acked_total = sum(o.outcome == "ok" for o in ops)
    return Finding("real-time order", not bad, "; ".join(bad[:3]) if bad else
                   f"{covered} of {acked_total} acknowledged operations placed in the final logs, in real-time order",
                   {"violations": bad[:20], "covered": covered})


def slot_owners(groups: dict[int, list[MemberLog]]) -> Finding:
    """No two shards' logs install maps of one epoch that disagree about a slot's owner."""
    by_epoch: dict[int, dict[str, Any]] = {}
    bad = []
    for g, logs in groups.items():
        for m in logs:
            for r in m.records:
                change = r.slots or {}
                owners = change.get("owners") or (change.get("map") or {}).get("owners")
                epoch = change.get("epoch") or (change.get("map") or {}).get("epoch")
                if owners is None or epoch is None:
                    continue
                key = json.dumps(owners, sort_keys=True)
                prev = by_epoch.setdefault(int(epoch), {"owners": key, "from": f"group {g}/{m.name}"})
                if prev["owners"] != key:
                    bad.append(f"map epoch {epoch}: group {g}/{m.name} and {prev['from']} install different owners")
    return Finding("one owner per slot per map epoch", not bad, "; ".join(bad[:3]) if bad else
                   f"{len(by_epoch)} map epoch(s), one owner map each", {"violations": bad[:20]})


# ---- the members' final state ------------------------------------------------------------------------------------


def converge(states: dict[int, dict[str, dict[str, Any]]]) -> Finding:
    """``states``: group -> member -> {"rows": digest, "version", "lsn"} (None for a member that did not answer)."""
    bad = []
    divergent = 0
    for g, members in states.items():
        seen = {name: s for name, s in members.items() if s}
        missing = [name for name, s in members.items() if not s]
        if missing:
            bad.append(f"group {g}: {', '.join(missing)} did not answer")
            divergent += len(missing)
        keys = Counter((s["rows"], s["lsn"]) for s in seen.values())
        if len(keys) > 1:
            common = keys.most_common(1)[0][0]
            off = [name for name, s in seen.items() if (s["rows"], s["lsn"]) != common]
            divergent += len(off)
            bad.append(f"group {g}: {', '.join(off)} differ ({ {n: (s['lsn'], s['rows'][:8]) for n, s in seen.items()} })")
    return Finding("replicas converge", not bad, "; ".join(bad) if bad else
                   f"{sum(len(m) for m in states.values())} members in {len(states)} group(s) agree",
                   {"divergent": divergent})
