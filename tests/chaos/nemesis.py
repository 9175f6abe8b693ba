"""Faults by name on a campaign's cluster, each recorded with its time (``events``), and ``heal`` for all of them.

Network faults are the lab's (nftables cuts in the hosts' namespaces, the fault proxy on a link); process faults
are signals (SIGKILL, SIGSTOP/SIGCONT) to a member's process; clock faults rewrite the clock file of a member started
with a clock; disk faults the member's own small ext4 disk (full, blocked, slow, failing) and libfiu's fsync
points in its process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from tests.chaos.cluster import ChaosCluster, Member
from tests.lab import Clock


@dataclass
class Event:
    t: float  # time.monotonic()
    name: str
    target: str
    of_primary: bool  # a fault of a group's primary: the clients' stall after it is measured
    group: int = 0
    wall: float = field(default_factory=time.time)  # (to read beside the members' logs)


@dataclass
class Nemesis:
    cluster: ChaosCluster
    events: list[Event] = field(default_factory=list)
    _paused: set[str] = field(default_factory=set)
    _linked: set[tuple[str, str]] = field(default_factory=set)
    _fsync: set[str] = field(default_factory=set)
    _killed_etcd: set[int] = field(default_factory=set)

    @property
    def lab(self):
        return self.cluster.lab

    def _event(self, name: str, m: Optional[Member], of_primary: bool = False, target: str = "") -> None:
        self.events.append(Event(time.monotonic(), name, target or (m.name if m else ""), of_primary,
                                 m.group if m else 0))

    def primary(self, g: int = 0, timeout: float = 30.0) -> Member:
        deadline = time.monotonic() + timeout
        while True:
            p = self.cluster.primary(g)
            if p is not None:
                return p
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {g} has no primary")
            time.sleep(0.1)

    def backups(self, g: int, primary: Member) -> list[Member]:
        return [m for m in self.cluster.group(g) if m is not primary]

    def etcd_hosts(self) -> list[str]:
        return [e.host for e in self.cluster.etcd]

    # ---- processes ---------------------------------------------------------------------------------------------

    def kill(self, m: Member, of_primary: bool = False) -> None:
        self._event("kill -9", m, of_primary)
        self.cluster.kill(m)

    def restart(self, m: Member, clock: Optional[Clock] = None) -> None:
        self._event("restart", m)
        self.cluster.restart(m, clock)

    def pause(self, m: Member, of_primary: bool = False) -> None:
        self._event("SIGSTOP", m, of_primary)
        self.cluster.pause(m)
        self._paused.add(m.name)

    def resume(self, m: Member) -> None:
        self._event("SIGCONT", m)
        self.cluster.resume(m)
        self._paused.discard(m.name)

    # ---- network -----------------------------------------------------------------------------------------------

    def cut_from_etcd_and_group(self, m: Member, of_primary: bool = False) -> None:
        """``m`` hears neither etcd nor its group; the clients still reach it."""
        self._event("cut from etcd and its group", m, of_primary)
        others = [x.host for x in self.cluster.group(m.group) if x is not m]
        self.lab.partition([m.host], [*self.etcd_hosts(), *others])

    def cut_from_clients(self, m: Member, of_primary: bool = False) -> None:
        self._event("cut from the clients", m, of_primary)
        self.lab.partition([m.host], ["ctl"])

    def blackhole(self, m: Member, of_primary: bool = False) -> None:
        self._event("blackhole (isolated)", m, of_primary)
        self.lab.isolate(m.host)

    def cut_from_etcd(self, m: Member, of_primary: bool = False) -> None:
        """A bridge: ``m`` hears its group and the clients, not etcd."""
        self._event("cut from etcd only", m, of_primary)
        self.lab.partition([m.host], self.etcd_hosts())

    def one_way_to_etcd(self, m: Member, of_primary: bool = False) -> None:
        """``m``'s packets to etcd are lost (etcd's to it arrive)."""
        self._event("one-way: its packets to etcd lost", m, of_primary)
        for e in self.etcd_hosts():
            self.lab.drop(m.host, e)

    def slow_link(self, src: Member, dst: Member, delay_ms: float, jitter_ms: float = 0.0, loss: float = 0.0) -> None:
        """The connections ``src`` opens to ``dst`` (a backup's replication stream to its primary) delayed/lossy."""
        self._event(f"link {src.name}->{dst.name}: {delay_ms:g} ms, loss {loss:g}", src, target=f"{src.name}->{dst.name}")
        proxy = self.lab.link(src.host, dst.host)
        self._linked.add((src.host, dst.host))
        proxy.set("both", delay_ms=delay_ms, jitter_ms=jitter_ms, loss=loss)

    def stall_link(self, src: Member, dst: Member) -> None:
        """What ``dst`` sends on the connections ``src`` opened to it is held back (a backup's replication stream goes
        silent, neither end told)."""
        self._event(f"link {src.name}->{dst.name}: answers held", src, target=f"{src.name}->{dst.name}")
        proxy = self.lab.link(src.host, dst.host)
        self._linked.add((src.host, dst.host))
        proxy.blackhole("down")

    def drop_answers(self, m: Member) -> None:
        """The clients' requests reach ``m``; its answers to them are lost on the way back."""
        self._event("answers to the clients dropped", m, target=m.name)
        proxy = self.lab.link("ctl", m.host)
        self._linked.add(("ctl", m.host))
        proxy.blackhole("down")

    def kill_etcd_leader(self) -> None:
        leader = self.cluster.etcd_leader()
        if leader is None:
            return
        self.events.append(Event(time.monotonic(), "kill -9 etcd leader", leader.host, False))
        assert leader.proc is not None
        leader.proc.stop(9)
        self._killed_etcd.add(leader.index)

    # ---- clocks ------------------------------------------------------------------------------------------------

    def jump_clock(self, m: Member, seconds: float) -> None:
        assert m.clock is not None, "the member was not started with a clock (Spec(clocks=True))"
        self._event(f"clock {seconds:+g} s", m)
        m.clock.jump(seconds)

    # ---- disks -------------------------------------------------------------------------------------------------

    def fill_disk(self, m: Member, of_primary: bool = False) -> None:
        assert m.disk is not None
        self._event("disk full", m, of_primary)
        m.disk.fill()

    def fsync_errors(self, m: Member, of_primary: bool = False) -> None:
        assert m.proc is not None and m.proc.failpoints is not None
        self._event("fsync fails (EIO)", m, of_primary)
        m.proc.failpoints.fsync_errors(True)
        self._fsync.add(m.name)

    def freeze_disk(self, m: Member, of_primary: bool = False) -> None:
        assert m.disk is not None
        self._event("disk blocked", m, of_primary)
        m.disk.freeze()

    def slow_disk(self, m: Member, of_primary: bool = False) -> None:
        assert m.disk is not None
        self._event("disk slow (stalls 200 of every 250 ms)", m, of_primary)
        m.disk.slow(200, 250)

    def fail_disk(self, m: Member, of_primary: bool = False) -> None:
        assert m.disk is not None
        self._event("disk fails (EIO)", m, of_primary)
        m.disk.fail()
        m.failed_disk = True  # type: ignore[attr-defined]

    def replace_disk(self, m: Member) -> None:
        """A failed disk replaced by an empty one: the member starts over and rejoins with a whole copy."""
        self._event("disk replaced, member restarted empty", m)
        self.cluster.kill(m)
        if m.disk is not None:
            m.disk.close()
            self.cluster.lab._disks.remove(m.disk)
        m.disk = self.lab.disk(m.host, size_mb=96)
        m.data_dir = m.disk.path / "data"
        m.failed_disk = False  # type: ignore[attr-defined]
        self.cluster.restart(m)

    # ---- healing -----------------------------------------------------------------------------------------------

    def heal(self) -> None:
        """Lift every fault: cuts, proxies, paused processes, disks, fsync points, clocks, dead members and etcd."""
        self.events.append(Event(time.monotonic(), "heal", "", False))
        self.lab.heal()
        for src, dst in list(self._linked):
            self.lab.unlink(src, dst)
        self._linked.clear()
        for m in self.cluster.members:
            if m.name in self._paused:
                self.cluster.resume(m)
            if m.disk is not None:
                m.disk.thaw()
                m.disk.unfill()
            if m.name in self._fsync and m.proc is not None and m.proc.alive():
                m.proc.failpoints.fsync_errors(False)  # type: ignore[union-attr]
            if m.clock is not None and (m.clock.offset_s or m.clock.rate != 1.0):
                m.clock.reset()
        self._paused.clear()
        self._fsync.clear()
        for i in sorted(self._killed_etcd):
            self.cluster.restart_etcd(self.cluster.etcd[i])
        self._killed_etcd.clear()
        for m in self.cluster.members:
            if getattr(m, "failed_disk", False):
                self.replace_disk(m)
            elif m.clock is not None and m.clock.rate != 1.0:
                self.cluster.restart(m, Clock())
            elif m.proc is None or not m.proc.alive():
                self.cluster.restart(m)
