"""The campaign's cluster in the lab: etcd (1 or 3 members), replica groups whose members each have a host of
their own, the clients and an agent on the control host.

Hosts: ``ctl`` (clients, agent, the ``shardps reshard`` command), ``e0``.. (etcd), ``g<i>m<j>`` (member j of group
i, i.e. of shard index i). Every member runs ``shardps serve`` as a user runs it, with ``--replicas``, its data
dir (on a small ext4 disk of its own when the scenario needs disk faults), libfiu preloaded when it needs fsync
faults, the lab's clock shim when it needs its clock moved.
"""

from __future__ import annotations

import json
import pathlib
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from shardps.server.ops.etcd import etcd_binary
from shardps.server.ops.launcher import free_port
from tests.lab import Clock, Disk, Lab, LabProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclass
class Spec:
    """What a scenario needs of its cluster."""

    groups: int = 1
    replicas: int = 3
    etcd: int = 1
    ack: str = "quorum"
    clients: int = 2
    lease_ttl: int = 2
    disks: bool = False  # each member's data on an ext4 disk of its own (full, blocked, slow, failing)
    failpoints: bool = False  # libfiu in every member (fsync errors)
    clocks: bool = False  # the lab's clock shim in every member (clock jumps)
    spare_groups: int = 0  # groups started empty, for resharding onto (``shardps reshard --add-address``)
    extra: tuple[str, ...] = ()


@dataclass
class Member:
    group: int
    index: int
    host: str
    data_dir: pathlib.Path
    port: int = 0
    address: str = ""
    proc: Optional[LabProcess] = None
    clock: Optional[Clock] = None
    disk: Optional[Disk] = None
    starts: int = 0

    @property
    def name(self) -> str:
        return f"g{self.group}m{self.index}"


@dataclass
class EtcdMember:
    index: int
    host: str
    address: str
    client_port: int
    peer_port: int
    data_dir: pathlib.Path
    proc: Optional[LabProcess] = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.client_port}"


class Agent:
    """The control host's agent (``tests.chaos.agent``): questions as JSON lines."""

    def __init__(self, lab: Lab) -> None:
        self.proc = lab.spawn("ctl", [sys.executable, "-m", "tests.chaos.agent"], cwd=str(ROOT), pipes=True)

    def ask(self, **req: Any) -> Any:
        assert self.proc.popen.stdin is not None and self.proc.popen.stdout is not None
        self.proc.popen.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.popen.stdin.flush()
        line = self.proc.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"the agent died: {self.proc.log()[-2000:]}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"agent: {req['cmd']}: {out['error']}")
        return out["ok"]


@dataclass
class ChaosCluster:
    spec: Spec
    lab: Lab = field(init=False)
    members: list[Member] = field(default_factory=list)
    etcd: list[EtcdMember] = field(default_factory=list)
    agent: Optional[Agent] = None

    @staticmethod
    def hosts(spec: Spec) -> list[str]:
        return (["ctl"] + [f"e{i}" for i in range(spec.etcd)]
                + [f"g{g}m{m}" for g in range(spec.groups + spec.spare_groups) for m in range(spec.replicas)])

    def start(self, lab: Lab) -> ChaosCluster:
        if etcd_binary() is None:
            raise RuntimeError("the campaign needs etcd (Debian: apt-get install etcd-server)")
        self.lab = lab
        self.cluster_file = lab.dir / "cluster.json"
        self._start_etcd()
        total = self.spec.groups + self.spec.spare_groups
        for g in range(total):
            for m in range(self.spec.replicas):
                host = f"g{g}m{m}"
                member = Member(g, m, host, lab.dir / "data" / host)
                if self.spec.disks:
                    member.disk = lab.disk(host, size_mb=96)
                    member.data_dir = member.disk.path / "data"
                if self.spec.clocks:
                    member.clock = Clock()
                self.members.append(member)
        for member in self.members:
            self._spawn(member)
        for member in self.members:
            self._await(member)
        self.write_cluster_file()
        self.agent = Agent(lab)
        self.wait_primaries(60)
        self.agent.ask(cmd="create", cluster_file=str(self.cluster_file))
        return self

    # ---- etcd --------------------------------------------------------------------------------------------------

    def _start_etcd(self) -> None:
        cport, pport = free_port(), free_port()
        for i in range(self.spec.etcd):
            host = f"e{i}"
            self.etcd.append(EtcdMember(i, host, self.lab.address(host), cport, pport, self.lab.dir / "etcd" / host))
        for e in self.etcd:
            self._spawn_etcd(e, "new")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = self.lab.run("ctl", [sys.executable, "-c", "import sys, urllib.request\n"
                                     "try:\n    print(urllib.request.urlopen(sys.argv[1] + '/health', timeout=1).read())\n"
                                     "except OSError as e:\n    print(e)", self.etcd[0].url], check=False)
            if '"true"' in r.stdout:
                return
            time.sleep(0.2)
        raise TimeoutError("etcd did not become healthy: " + self.etcd[0].proc.log()[-2000:])  # type: ignore[union-attr]

    def _spawn_etcd(self, e: EtcdMember, state: str) -> None:
        peer = f"http://{e.address}:{e.peer_port}"
        initial = ",".join(f"e{x.index}=http://{x.address}:{x.peer_port}" for x in self.etcd)
        e.data_dir.parent.mkdir(parents=True, exist_ok=True)
        e.proc = self.lab.spawn(e.host, [etcd_binary() or "etcd", "--name", f"e{e.index}", "--data-dir", str(e.data_dir),
                                         "--listen-client-urls", e.url, "--advertise-client-urls", e.url,
                                         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                         "--initial-cluster", initial, "--initial-cluster-state", state,
                                         "--heartbeat-interval", "50", "--election-timeout", "500",
                                         "--logger", "zap", "--log-level", "warn"])

    @property
    def etcd_urls(self) -> str:
        return ",".join(e.url for e in self.etcd)

    def restart_etcd(self, e: EtcdMember) -> None:
        if e.proc is not None and e.proc.alive():
            e.proc.stop(signal.SIGKILL)
        self._spawn_etcd(e, "existing" if len(self.etcd) > 1 else "new")

    def etcd_leader(self) -> Optional[EtcdMember]:
        assert self.agent is not None
        status = self.agent.ask(cmd="etcd", endpoints=[e.url for e in self.etcd])
        ids = {url: s["member"] for url, s in status.items() if s}
        leaders = {s["leader"] for s in status.values() if s}
        for e in self.etcd:
            if ids.get(e.url) in leaders:
                return e
        return None

    # ---- members -----------------------------------------------------------------------------------------------

    def _spawn(self, m: Member) -> None:
        m.data_dir.mkdir(parents=True, exist_ok=True)
        ready = self.lab.dir / f"ready-{m.name}-{m.starts}"
        m.starts += 1
        argv = [sys.executable, "-m", "shardps", "serve", "--host", self.lab.address(m.host), "--port", str(m.port),
                "--shard-index", str(m.group), "--num-shards", str(self.spec.groups) if m.group < self.spec.groups
                else str(m.group + 1), "--ready-file", str(ready), "--data-dir", str(m.data_dir),
                "--replicas", str(self.spec.replicas), "--member", f"m{m.index}", "--etcd", self.etcd_urls,
                "--cluster-name", "chaos", "--ack", self.spec.ack, "--lease-ttl", str(self.spec.lease_ttl),
                *(["--join"] if m.group >= self.spec.groups else []), *self.spec.extra]
        m.proc = self.lab.spawn(m.host, argv, clock=m.clock, failpoints=self.spec.failpoints, cwd=str(ROOT),
                                log=str(self.lab.dir / f"{m.name}.log"))
        m.ready = ready  # type: ignore[attr-defined]

    def _await(self, m: Member, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        ready: pathlib.Path = m.ready  # type: ignore[attr-defined]
        while not (ready.exists() and ready.read_text()):
            assert m.proc is not None
            if not m.proc.alive():
                raise RuntimeError(f"member {m.name} exited: {m.proc.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"member {m.name} did not start: {m.proc.log()[-3000:]}")
            time.sleep(0.05)
        m.address = ready.read_text()
        m.port = int(m.address.rsplit(":", 1)[1])

    def write_cluster_file(self) -> None:
        groups = [[m.address for m in self.members if m.group == g] for g in range(self.spec.groups)]
        tmp = self.cluster_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"addresses": ["|".join(g) for g in groups], "groups": groups,
                                   "num_shards": self.spec.groups, "etcd": self.etcd_urls, "cluster_name": "chaos"}))
        tmp.replace(self.cluster_file)

    def group(self, g: int) -> list[Member]:
        return [m for m in self.members if m.group == g]

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def kill(self, m: Member) -> None:
        if m.proc is not None and m.proc.alive():
            m.proc.stop(signal.SIGKILL)

    def restart(self, m: Member, clock: Optional[Clock] = None, wait: bool = True) -> None:
        """Start a member again on its address (killing it first if it runs)."""
        self.kill(m)
        if clock is not None:
            m.clock = clock
        for _ in range(20):  # its port may be held a moment by the old process's sockets
            self._spawn(m)
            if not wait:
                return
            try:
                self._await(m)
                return
            except RuntimeError as e:
                if "Address already in use" not in str(e) and "port" not in str(e).lower():
                    raise
                time.sleep(0.5)
        raise RuntimeError(f"member {m.name} could not start again on its port")

    def pause(self, m: Member) -> None:
        assert m.proc is not None
        m.proc.pause()

    def resume(self, m: Member) -> None:
        assert m.proc is not None
        m.proc.resume()

    def info(self) -> dict[str, Optional[dict[str, Any]]]:
        """Each member's view (by name): role, epoch, LSN, version; None where it did not answer."""
        assert self.agent is not None
        by_address = self.agent.ask(cmd="info", addresses=[m.address for m in self.members])
        return {m.name: by_address.get(m.address) for m in self.members}

    def primary(self, g: int, info: Optional[dict] = None) -> Optional[Member]:
        """The member of group ``g`` that says it is the primary with the newest epoch (None: none answers so)."""
        info = info if info is not None else self.info()
        found = [(v["epoch"], m) for m in self.group(g) if (v := info.get(m.name)) and v["role"] == "primary"]
        return max(found, key=lambda x: x[0])[1] if found else None

    def wait_primaries(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.info()
            if all(self.primary(g, info) is not None for g in range(self.spec.groups)):
                return
            time.sleep(0.2)
        raise TimeoutError(f"no primary in some group: {self.info()}")

    def settle(self, timeout: float = 90.0, exact: bool = True) -> bool:
        """Wait until every member runs, every group has one primary and backups following its epoch that have
        caught up (``exact``: the same LSN, for a cluster nobody writes to; else within a second's writes); whether
        that happened in time."""
        for m in self.members:
            if m.proc is None or not m.proc.alive():
                self.restart(m)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.info()
            good = True
            for g in range(self.spec.groups + self.spec.spare_groups):
                views = [info.get(m.name) for m in self.group(g)]
                if any(v is None for v in views):
                    good = False
                    break
                roles = sorted(v["role"] for v in views)  # type: ignore[index]
                lsns = [v["lsn"] for v in views]  # type: ignore[index]
                caught_up = len(set(lsns)) == 1 if exact else max(lsns) - min(lsns) < 2000
                if roles != ["backup"] * (len(views) - 1) + ["primary"] or not caught_up \
                        or len({v["epoch"] for v in views}) != 1:  # type: ignore[index]
                    good = False
                    break
            if good:
                return True
            time.sleep(0.3)
        return False

    def logs(self) -> dict[str, str]:
        return {m.name: (m.proc.log() if m.proc else "") for m in self.members}

    def epochs_claimed(self) -> dict[int, dict[int, set[str]]]:
        """From the members' own logs: group -> epoch -> the members that said they became its primary."""
        out: dict[int, dict[int, set[str]]] = {}
        for m in self.members:
            text = pathlib.Path(self.lab.dir / f"{m.name}.log").read_text(errors="replace")
            for epoch in re.findall(r"member m\d+: primary, epoch (\d+)", text):
                out.setdefault(m.group, {}).setdefault(int(epoch), set()).add(m.name)
        return out
