"""The campaign's scenarios: each a named, seeded, bounded sequence of faults on a running cluster under the
clients' load, with what it models. ``Scale`` sets how long: ``SHORT`` (CI: one round of each, faults held a few
seconds) or ``FULL`` (``make chaos``: several rounds, longer holds, minutes of mixed faults).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

from tests.chaos.cluster import Spec
from tests.chaos.nemesis import Nemesis
from tests.lab import Clock


@dataclass(frozen=True)
class Scale:
    rounds: int
    hold_s: float  # how long a fault of a primary is held (past the 2 s lease)
    gap_s: float  # calm between rounds
    mixed_s: float  # how long the mixed scenario runs
    op_gap_s: float = 0.0  # each client's pause between operations (the short run's: the suite's CPU)


SHORT = Scale(rounds=1, hold_s=2.5, gap_s=0.5, mixed_s=8.0, op_gap_s=0.02)
FULL = Scale(rounds=2, hold_s=5.0, gap_s=2.0, mixed_s=240.0)


@dataclass(frozen=True)
class Scenario:
    name: str
    family: int
    models: str
    spec: Spec
    run: Callable[[Nemesis, random.Random, Scale], None]
    # --ack primary: acknowledged writes the old primary had not shipped may be lost when it dies, but only those
    # acknowledged within this many seconds before a fault of a primary (the bound checked and published)
    loss_window_s: float = 0.0
    short: bool = True  # in the short run (CI: one of each family)


BASE = Spec(etcd=3, disks=True, failpoints=True, clocks=True)


def _round(n: Nemesis, scale: Scale, fault: Callable[[], None], hold: float = 0.0) -> None:
    """One fault, held, then healed, then calm until the group has a primary again."""
    fault()
    time.sleep(hold or scale.hold_s)
    n.heal()
    n.primary(0, timeout=60)
    time.sleep(scale.gap_s)


def isolate_from_etcd_and_group(n: Nemesis, rng: random.Random, scale: Scale) -> None:
    for _ in range(scale.rounds):
        p = n.primary()
        _round(n, scale, lambda: n.cut_from_etcd_and_group(p, of_primary=True))


def isolate_from_clients_then_blackhole(n: Nemesis, rng: random.Random, scale: Scale) -> None:
    for _ in range(scale.rounds):
        p = n.primary()
        _round(n, scale, lambda: n.cut_from_clients(p, of_primary=True))
        p = n.primary()
        _round(n, scale, lambda: n.blackhole(p, of_primary=True))


def one_way_and_bridge(n: Nemesis, rng: random.Random, scale: Scale) -> None:
    for _ in range(scale.rounds):
        p = n.primary()
        _round(n, scale, lambda: n.one_way_to_etcd(p, of_primary=True))
        p = n.primary()
        a, b = rng.sample(n.backups(0, p), 2)

        def bridge() -> None:  # a backup hears its group but not etcd; the other lags; the primary freezes
            n.stall_link(b, p)  # b's stream silent: what a quorum acknowledges now is on p and a alone
            n.cut_from_etcd(a)
            time.sleep(1.0)
            n.pause(p, of_primary=True)

        _round(n, scale, bridge, hold=scale.hold_s + 2)


def slow_replication_then_kill(n: Nemesis, rng: random.Random, scale: Scale) -> None:
    for _ in range(scale.rounds):
        p = n.primary()

        def fault() -> None:
            for b in n.backups(0, p):
                n.slow_link(b, p, delay_ms=rng.choice([20, 50, 100]), jitter_ms=10, loss=rng.choice([0.0, 0.05]))
            time.sleep(2.0)
            n.kill(p, of_primary=True)

        _round(n, scale, fault)


def answers_lost_during_failover(n: Nemesis, rng: random.Random, scale: Scale) -> None:
    for _ in range(scale.rounds):
        p = n.primary()

        def fault() -> None:
            n.drop_answers(p)
            time.sleep(1.0)
            (n.pause if rng.random() < 0.5 else n.kill)(p, of_primary=True)

        _round(n, scale, fault)


def freeze_and_lose_etcd_leader(n: Nemesis, rng: random.Random, scale: Scale) -> None:
    for _ in range(scale.rounds):
        p = n.primary()

        def fault() -> None:
            n.pause(p, of_primary=True)
            n.kill_etcd_leader()

        _round(n, scale, fault, hold=scale.hold_s + 2)


def clocks(n: Nemesis, rng: random.Random, scale: Scale) -> None:
    for _ in range(scale.rounds):
        p = n.primary()
        if scale.rounds > 1:  # (the short run: the backward jump, which makes a lease look longer, alone)
            _round(n, scale, lambda: n.jump_clock(p, +30))
            p = n.primary()
        _round(n, scale, lambda: n.jump_clock(p, -30))
        if scale.rounds == 1:  # the short run: the fast backup alone
            p = n.primary()
            b = rng.choice(n.backups(0, p))
            _round(n, scale, lambda: (n.restart(b, Clock(rate=2.0)), time.sleep(1.0), n.kill(p, of_primary=True)))
            return
        p = n.primary()
        b = rng.choice(n.backups(0, p))

        def fast_backup_then_kill() -> None:  # a member whose clock runs twice as fast, then the primary dies
            n.restart(b, Clock(rate=2.0))
            time.sleep(2.0)
            n.kill(p, of_primary=True)

        _round(n, scale, fast_backup_then_kill)
        p = n.primary()

        def fast_primary() -> None:  # the primary's own clock runs fast: its lease looks shorter to it
            n.restart(p, Clock(rate=2.0))

        _round(n, scale, fast_primary)


def disks(n: Nemesis, rng: random.Random, scale: Scale) -> None:
    faults = [("freeze", True), ("fsync", True), ("full", True), ("slow", True), ("fail", True),
              ("freeze", False), ("fsync", False), ("full", False), ("slow", False), ("fail", False)]
    if scale.rounds == 1:  # the short run: each fault once, on the primary or a backup
        faults = [("freeze", True), ("fsync", True), ("full", True), ("fail", False)]
    for kind, on_primary in faults:
        p = n.primary()
        m = p if on_primary else rng.choice(n.backups(0, p))
        fault = {"freeze": n.freeze_disk, "fsync": n.fsync_errors, "full": n.fill_disk, "slow": n.slow_disk,
                 "fail": n.fail_disk}[kind]
        _round(n, scale, lambda f=fault, m=m, op=on_primary: f(m, of_primary=op))


def reshard_under_faults(n: Nemesis, rng: random.Random, scale: Scale) -> None:
    from tests.chaos.reshard import ReshardRun

    run = ReshardRun(n.cluster)
    run.start()
    faults = ["kill-source", "partition-target", "kill-command"] * scale.rounds
    for fault in faults:
        if run.done():
            break
        time.sleep(rng.uniform(0.5, 1.5))
        if fault == "kill-source":
            p = n.primary(0)
            _round(n, scale, lambda p=p: n.kill(p, of_primary=True))
        elif fault == "partition-target":
            t = n.primary(n.cluster.spec.groups)
            _round(n, scale, lambda t=t: n.cut_from_etcd_and_group(t, of_primary=True))
        else:
            run.kill()
            time.sleep(0.5)
            run.start(resume=True)
    run.finish(timeout=240)


def mixed(n: Nemesis, rng: random.Random, scale: Scale) -> None:
    menu: list[Callable[[], None]] = []

    def primary_fault(f: Callable) -> Callable[[], None]:
        return lambda: f(n.primary(), of_primary=True)

    menu += [primary_fault(n.kill), primary_fault(n.pause), primary_fault(n.cut_from_etcd_and_group),
             primary_fault(n.cut_from_clients), primary_fault(n.blackhole), primary_fault(n.freeze_disk),
             primary_fault(n.fsync_errors), primary_fault(n.one_way_to_etcd)]

    def bridge() -> None:
        p = n.primary()
        n.cut_from_etcd(rng.choice(n.backups(0, p)))
        n.pause(p, of_primary=True)

    def slow() -> None:
        p = n.primary()
        for b in n.backups(0, p):
            n.slow_link(b, p, delay_ms=rng.choice([10, 50]), jitter_ms=5, loss=rng.choice([0.0, 0.02]))

    def kill_backup() -> None:
        p = n.primary()
        n.kill(rng.choice(n.backups(0, p)))

    menu += [bridge, slow, kill_backup, lambda: n.drop_answers(n.primary()), n.kill_etcd_leader,
             lambda: n.jump_clock(n.primary(), rng.choice([-30, 30]))]
    end = time.monotonic() + scale.mixed_s
    while time.monotonic() < end:
        fault = rng.choice(menu)
        _round(n, Scale(1, rng.uniform(1.0, 6.0), rng.uniform(1.0, 3.0), 0), fault)


SCENARIOS = [
    Scenario("isolate-primary-from-etcd-and-group", 1, "a primary cut off from etcd and its backups while the "
             "clients still reach it (a partition that splits the group, the clients on the old primary's side)",
             BASE, isolate_from_etcd_and_group),
    Scenario("isolate-primary-from-clients-then-blackhole", 2, "a primary the clients cannot reach (it still hears "
             "etcd and its group), then one that hears nobody: a dead switch port, nothing answers, nothing resets",
             BASE, isolate_from_clients_then_blackhole),
    Scenario("one-way-and-bridge", 3, "a primary whose packets to etcd are lost (one way); then a bridge: a backup "
             "hears its group but not etcd, the other's replication stream goes silent, and the primary freezes past its "
             "lease",
             BASE, one_way_and_bridge),
    Scenario("slow-replication-then-kill", 4, "backups behind slow, lossy links to their primary (proxy delay, "
             "jitter, retransmission stalls), then the primary killed (--ack quorum)", BASE,
             slow_replication_then_kill),
    Scenario("slow-replication-then-kill-ack-primary", 4, "the same under --ack primary: what the old primary had "
             "acknowledged but not shipped is lost (measured, bounded by the replication lag)",
             Spec(etcd=1, ack="primary"), slow_replication_then_kill, loss_window_s=1.0, short=False),
    Scenario("answers-lost-during-failover", 5, "the primary applies pushes whose answers are lost on the way back, "
             "then dies or freezes: the clients resend, outcomes unknown until the new primary answers",
             BASE, answers_lost_during_failover),
    Scenario("freeze-primary-and-lose-etcd-leader", 6, "the primary frozen (SIGSTOP) as etcd's leader dies (3 etcd "
             "members: the new leader refreshes every lease, so the frozen primary's outlives its TTL)",
             BASE, freeze_and_lose_etcd_leader),
    Scenario("clocks", 7, "the primary's clock jumps +30 s and -30 s (the lab's clock shim); a member's clock runs twice as "
             "fast, a backup's while the primary dies, then the primary's own", BASE, clocks),
    Scenario("disks", 8, "disks of the primary and of a backup: blocked (fsfreeze), fsync failing with EIO (libfiu), "
             "full, slow, dead (EIO on everything, then replaced)", BASE, disks),
    Scenario("reshard-under-faults", 9, "a live slot move onto a new group while the source's primary is killed, "
             "the target's cut off, and the shardps reshard command itself killed and resumed",
             Spec(etcd=1, groups=2, spare_groups=1), reshard_under_faults),
    Scenario("mixed", 10, "random faults from all of the above every few seconds", BASE, mixed),
]

BY_NAME = {s.name: s for s in SCENARIOS}
