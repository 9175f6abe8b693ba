"""Running scenarios: a session is one lab and one cluster (of the scenarios' spec) with the clients' load running
throughout, its scenarios one after another (each healed and settled before the next), then the clients stopped,
every fault healed, the cluster settled, the rows and the members' states read back, the members killed and their
logs read, and every checker run. Each scenario's row of the table counts the operations invoked in its window."""

from __future__ import annotations

import json
import pathlib
import random
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from tests.chaos import checkers, history
from tests.chaos.cluster import ROOT, ChaosCluster
from tests.chaos.nemesis import Event, Nemesis
from tests.chaos.scenarios import Scale, Scenario
from tests.chaos.workload import SHARED
from tests.lab import Lab, LabProcess


@dataclass
class Result:
    scenario: str
    family: int
    operations: int = 0
    acknowledged: int = 0
    failed: int = 0
    unknown: int = 0
    lost: int = 0
    applied_twice: int = 0
    divergent: int = 0
    stall_p50_s: Optional[float] = None
    stall_max_s: Optional[float] = None
    faults: int = 0
    checks_failed: list[str] = field(default_factory=list)
    error: str = ""
    findings: list[dict[str, Any]] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)
    stall_by_fault: list[tuple[str, float]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.checks_failed and not self.error


class Workload:
    """The campaign's clients (``tests.chaos.workload``), each a process on the control host."""

    def __init__(self, cluster: ChaosCluster, clients: int, seed: int, gap_s: float = 0.0) -> None:
        self.cluster = cluster
        self.dir = cluster.lab.dir / "histories"
        self.dir.mkdir(exist_ok=True)
        self.stop_file = cluster.lab.dir / "stop-clients"
        self.procs: list[LabProcess] = []
        for i in range(clients):
            self.procs.append(cluster.lab.spawn("ctl", [
                sys.executable, "-m", "tests.chaos.workload", str(cluster.cluster_file), str(self.dir / f"c{i}.jsonl"),
                str(i), str(seed * 100 + i), str(self.stop_file), str(gap_s)], cwd=str(ROOT),
                log=str(cluster.lab.dir / f"client-{i}.log")))

    def stop(self, timeout: float = 120.0) -> None:
        """Let every client finish the operation it is in (its own retries included), then end."""
        self.stop_file.touch()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            while p.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            if p.alive():  # its open operation stays unknown
                p.stop(9)

    def acknowledged_since(self, t: float, timeout: float) -> bool:
        """Wait until every client has a push acknowledged after ``t`` (time.monotonic(), the clients' clock too): at
        the start each has imported torch and found its primaries (seconds on a busy machine), after a scenario each
        has come through its faults. A scenario begun before would find no operation to disturb, or count the last
        one's stall as its own."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            paths = self.files()
            if len(paths) == len(self.procs) and all(self._last_ok(p) > t for p in paths):
                return True
            if not all(p.alive() for p in self.procs):
                return False
            time.sleep(0.2)
        return False

    @staticmethod
    def _last_ok(path: pathlib.Path) -> float:
        for line in reversed(path.read_text().splitlines()):
            if '"type":"ok"' in line:
                try:
                    return float(json.loads(line)["t"])
                except (ValueError, KeyError):
                    continue
        return float("-inf")

    def files(self) -> list[pathlib.Path]:
        return sorted(self.dir.glob("c*.jsonl"))


def _stalls(events: list[Event], ops: list[history.Op], end: float, settle_s: float = 10.0) -> list[tuple[str, float]]:
    """Per fault of a primary and per client: (the fault's name, the longest the client went without an
    acknowledgment from the fault until ``settle_s`` after the heal that lifted it; the whole window when none
    came), among the client's operations on the faulted group. A client that asked nothing of that group in the
    window (none of its operations in flight at the fault or invoked before the window's end) has no stall there to
    measure: left out (a reshard's spare group before its first slots, a group that owns few)."""
    out = []
    clients = sorted({o.client for o in ops})
    for i, ev in enumerate(events):
        if not ev.of_primary:
            continue
        heal = next((e.t for e in events[i + 1:] if e.name == "heal"), end)
        after = next((e.t for e in events[i + 1:] if e.t >= heal and e.name not in ("heal", "restart", "SIGCONT")),
                     end)  # the next fault's stall is its own
        stop = min(end, heal + settle_s, after)
        for c in clients:
            mine = [o for o in ops if o.client == c and ev.group in (o.shards or [ev.group])]
            if not any(o.invoked <= stop and (o.completed is None or o.completed > ev.t) for o in mine):
                continue
            oks = sorted(o.completed for o in mine if o.outcome == "ok" and o.completed and ev.t < o.completed <= stop)
            if not oks:
                out.append((ev.name, stop - ev.t))
                continue
            gaps = [oks[0] - ev.t] + [b - a for a, b in zip(oks, oks[1:])]
            out.append((ev.name, max(gaps)))
    return out


def run_session(scenarios: list[Scenario], scale: Scale, seed: int, out: pathlib.Path) -> list[Result]:
    """One lab, one cluster, the scenarios in turn (see the module)."""
    spec = scenarios[0].spec
    results = [Result(s.name, s.family) for s in scenarios]
    windows: list[tuple[float, float]] = []
    with Lab(ChaosCluster.hosts(spec)) as lab:
        cluster = ChaosCluster(spec)
        try:
            cluster.start(lab)
        except Exception:
            for r in results:
                r.error = "the cluster did not start: " + traceback.format_exc()[-3000:]
            _keep_logs(lab, out, scenarios)
            return results
        nemesis = Nemesis(cluster)
        workload = Workload(cluster, spec.clients, seed, scale.op_gap_s)
        if not workload.acknowledged_since(float("-inf"), 120):
            for r in results:
                r.error = "the clients did not acknowledge a first push in 120 s"
            workload.stop()
            _keep_logs(lab, out, scenarios)
            return results
        for s, r in zip(scenarios, results):
            t0 = time.monotonic()
            first = len(nemesis.events)
            try:
                s.run(nemesis, random.Random(f"{seed}-{s.name}"), scale)
            except Exception:  # noqa: BLE001 - reported; the session goes on healed
                r.error = traceback.format_exc()[-3000:]
            try:
                nemesis.heal()
                if not cluster.settle(90, exact=False):
                    r.error = r.error or f"the cluster did not settle after the scenario: {cluster.info()}"
                elif not workload.acknowledged_since(time.monotonic(), 60):
                    r.error = r.error or "the clients made no progress within 60 s of the scenario's end"
            except Exception:  # noqa: BLE001
                r.error = r.error or "healing failed: " + traceback.format_exc()[-3000:]
            windows.append((t0, time.monotonic()))
            r.events = [asdict(e) for e in nemesis.events[first:]]
            r.faults = sum(1 for e in nemesis.events[first:] if e.name not in ("heal", "restart", "SIGCONT"))
        workload.stop()
        nemesis.heal()
        settled = cluster.settle(120)
        end = time.monotonic()
        ops = history.load(workload.files())
        findings, classes, divergent = _check(cluster, ops, settled)
        _keep_logs(lab, out, scenarios, data=not all(f.ok for f in findings))
    for i, r in enumerate(results):
        t0 = windows[i][0] if i else 0.0
        t1 = windows[i][1] if i + 1 < len(windows) else float("inf")
        mine = [o for o in ops if t0 <= o.invoked < t1]
        for k, v in history.summary(mine).items():
            setattr(r, k, v)
        keys = {(o.client, o.k) for o in mine}
        r.lost = sum((o.client, o.k) in keys for o in classes["lost"])
        r.applied_twice = sum((o.client, o.k) in keys for o in classes["twice"])
        r.divergent = divergent
        events = [Event(**e) for e in r.events]
        r.stall_by_fault = _stalls(events, ops, min(end, windows[i][1]))  # (the next scenario's faults are its own)
        r.stalls = [x for _, x in r.stall_by_fault]
        if r.stalls:
            r.stall_p50_s, r.stall_max_s = statistics.median(r.stalls), max(r.stalls)
        mine_findings = list(findings)
        if scenarios[i].loss_window_s and r.lost:  # --ack primary: a loss the mode allows, if within its bound
            mine_findings = _bounded_loss(mine_findings, [o for o in classes["lost"] if (o.client, o.k) in keys],
                                          events, scenarios[i].loss_window_s)
        r.findings = [asdict(f) for f in mine_findings]
        r.checks_failed = [f.checker for f in mine_findings if not f.ok]
    return results


def _bounded_loss(findings: list[checkers.Finding], lost: list[history.Op], events: list[Event],
                  window_s: float) -> list[checkers.Finding]:
    """Under --ack primary: the lost acknowledged operations pass if each was acknowledged within ``window_s`` before
    a fault of a primary (what the old primary had not shipped yet); the counter and exactly-once findings then
    stand for the rest (no operation applied twice or applied though failed)."""
    faults = [e.t for e in events if e.of_primary]
    outside = [o for o in lost if not any(f - window_s <= (o.completed or 0.0) <= f + 0.05 for f in faults)]
    out = []
    for f in findings:
        if f.checker in ("counter", "exactly once (rows)"):
            twice_or_false = f.data.get("twice") or f.data.get("false_fail")
            ok = not outside and not twice_or_false if f.checker != "counter" else not outside
            out.append(checkers.Finding(f.checker, ok, f.detail + f" ({len(lost)} lost, acknowledged within "
                                        f"{window_s:g} s before the primary died: allowed by --ack primary; "
                                        f"{len(outside)} outside that window)", f.data))
        else:
            out.append(f)
    return out


def _check(cluster: ChaosCluster, ops: list[history.Op], settled: bool) -> tuple[list[checkers.Finding], dict, int]:
    """Every checker over the session (see ``tests.chaos.checkers``)."""
    assert cluster.agent is not None
    ids = sorted({i for o in ops for i in o.ids} | set(range(SHARED)))
    read = cluster.agent.ask(cmd="read_cluster", cluster_file=str(cluster.cluster_file), ids=ids)
    findings: list[checkers.Finding] = []
    if "error" in read:
        findings.append(checkers.Finding("read back", False, read["error"]))
        values: dict[int, float] = {}
    else:
        values = {int(k): v for k, v in read["values"].items()}
    if values:
        findings.append(checkers.counter(ops, values, range(SHARED)))
        once, classes = checkers.exactly_once(ops, values)
        findings.append(once)
    else:  # nothing read back: nothing can be said of losses (the read-back finding fails the run)
        classes = {"lost": [], "twice": [], "false_fail": []}
    groups = list(range(cluster.spec.groups + cluster.spec.spare_groups))
    states = cluster.agent.ask(cmd="members", groups=[[m.address for m in cluster.group(g)] for g in groups], ids=ids)
    by_group = {g: {m.name: states.get(m.address) for m in cluster.group(g)} for g in groups}
    conv = checkers.converge(by_group)
    if not settled:
        conv.ok, conv.detail = False, "the cluster did not settle (no primary, or backups behind): " + conv.detail
    findings.append(conv)
    for m in cluster.members:  # the logs are read from the data dirs of stopped processes
        cluster.kill(m)
    logs = {g: [checkers.read_member_log(m.name, m.data_dir) for m in cluster.group(g)] for g in groups}
    flat = [m for ls in logs.values() for m in ls]
    if classes["lost"] or classes["twice"]:  # where the members' logs hold those operations' records, if anywhere
        for f in findings:
            if f.checker == "exactly once (rows)":
                f.data["in_logs"] = checkers.where_logged(classes["lost"] + classes["twice"], flat)
    findings.append(checkers.pushes_once_per_log(flat))
    findings.append(checkers.log_agreement(logs))
    claimed = cluster.epochs_claimed()
    twice = [f"group {g} epoch {e}: {sorted(ms)}" for g, es in claimed.items() for e, ms in es.items() if len(ms) > 1]
    findings.append(checkers.Finding("one primary per epoch (members' own words)", not twice, "; ".join(twice) or
                                     f"{sum(len(es) for es in claimed.values())} epoch(s), one primary each"))
    final = {g: max(ls, key=lambda m: (len(m.records) + m.first_lsn)) for g, ls in logs.items() if ls}
    shard_of_row = read.get("owners", {}) if isinstance(read, dict) else {}
    findings.append(checkers.realtime(ops, final, {int(k): v for k, v in shard_of_row.items()}))
    if cluster.spec.spare_groups:
        findings.append(checkers.slot_owners(logs))
    return findings, classes, int(conv.data.get("divergent", 0))


def _keep_logs(lab: Lab, out: pathlib.Path, scenarios: list[Scenario], data: bool = False) -> None:
    """The members', clients' and etcd's logs and the histories, kept beside the results (the lab goes); with
    ``data`` (a check failed) the members' data directories too (their logs and checkpoints, to read the records
    with ``shardps.server.durability.wal``)."""
    dest = out / "logs" / "+".join(s.name for s in scenarios)[:120]
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    for p in list(lab.dir.glob("*.log")) + list((lab.dir / "histories").glob("*.jsonl")):
        try:
            shutil.copy(p, dest / p.name)
        except OSError:
            pass
    if data and (lab.dir / "data").is_dir():
        shutil.copytree(lab.dir / "data", dest / "data", ignore_dangling_symlinks=True, dirs_exist_ok=True,
                        copy_function=_copy_quietly)


def _copy_quietly(src: str, dst: str) -> None:
    try:
        shutil.copy2(src, dst)
    except OSError:
        pass


COLUMNS = [("scenario", "scenario", ""), ("family", "#", "d"), ("operations", "ops", ",d"),
           ("acknowledged", "acked", ",d"), ("failed", "failed", ",d"), ("unknown", "unknown", ",d"),
           ("lost", "lost", "d"), ("applied_twice", "twice", "d"), ("divergent", "divergent", "d"),
           ("faults", "faults", "d"), ("stall_p50_s", "stall p50 s", ".2f"), ("stall_max_s", "stall max s", ".2f"),
           ("checks", "checks", "")]


def report(results: list[Result], out: pathlib.Path, meta: dict[str, Any]) -> str:
    from benchmarks.common import table

    rows = [{**asdict(r), "checks": "ok" if r.ok else ("ERROR" if r.error else "FAILED: " + ", ".join(r.checks_failed))}
            for r in results]
    text = table(rows, COLUMNS)
    by_fault: dict[str, list[float]] = {}
    for r in results:
        for name, stall in r.stall_by_fault:
            by_fault.setdefault(name, []).append(stall)
    if by_fault:
        stalls = [{"fault": name, "n": len(xs), "p50": statistics.median(xs), "max": max(xs)}
                  for name, xs in sorted(by_fault.items())]
        text += "\n\nclients' stall after each fault of a primary (longest gap between acknowledgements, per client)\n"
        text += table(stalls, [("fault", "fault", ""), ("n", "n", "d"), ("p50", "stall p50 s", ".2f"),
                               ("max", "stall max s", ".2f")])
        meta = {**meta, "stall_by_fault": stalls}
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2, default=str))
    (out / "chaos.txt").write_text(text + "\n")
    return text
