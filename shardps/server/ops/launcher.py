"""Run a cluster of shard processes on this machine: the embedded default.

``LocalCluster`` starts N processes with exactly the command the Compose file
runs (``python -m shardps serve ...``), waits until each answers the gRPC
health check, writes a cluster file that ``Client.from_file`` reads, restarts
(or reports) shards that die, and stops them with SIGTERM so each writes its
final checkpoint. ``Placement`` puts each process (and a replica group's etcd)
on a host of its own: another network namespace, as ``shardps cluster --netns``
and the test lab do.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from shardps.probe import PORT_IN_USE_EXIT, wait_for_port
from shardps.probe import check as check_health
from shardps.server.ops.certs import DevCerts, make_dev_certs
from shardps.server.ops.etcd import LocalEtcd

log = logging.getLogger(__name__)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc): a shard's, say, for the benchmarks and
    the examples' reports."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: a rendezvous for processes started on this machine
    (torch.distributed's MASTER_PORT, say)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Placement:
    """Where one of the cluster's processes runs: the address it binds and is reached at, and the argv prefix that
    runs a command there (``nsenter --net=/run/netns/NAME --`` for another network namespace; none: here)."""

    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()

    @classmethod
    def netns(cls, name: str, address: Optional[str] = None) -> Placement:
        """Network namespace ``name`` (``ip netns``), at ``address`` (default: its first global IPv4 address)."""
        if not (pathlib.Path("/run/netns") / name).exists():
            raise ValueError(f"no network namespace {name!r} (ip netns list)")
        if address is None:
            out = subprocess.run(["ip", "-n", name, "-4", "-o", "addr", "show", "scope", "global"],
                                 capture_output=True, text=True).stdout.split()
            if "inet" not in out:
                raise ValueError(f"network namespace {name!r} has no global IPv4 address")
            address = out[out.index("inet") + 1].split("/")[0]
        return cls(address, ("nsenter", f"--net=/run/netns/{name}", "--"))


@dataclass
class _Proc:
    index: int  # the shard index
    popen: subprocess.Popen
    ready_file: pathlib.Path
    log_path: pathlib.Path
    address: str = ""
    restarts: int = 0
    member: int = 0  # its member id in the shard's replica group


@dataclass
class LocalCluster:
    """N shard processes on one host.

    Args:
        num_shards: number of shards.
        base_port: shard i listens on base_port + i; 0 lets each pick a free port
            (kept across restarts).
        data_dir: cluster data dir; shard i uses data_dir/shard-i (None: memory only).
        host: address to bind.
        serve_args: extra ``shardps serve`` flags for every shard (e.g. durability).
        log_dir: where shard logs go (default: a temporary directory, which also holds the throwaway TLS files and a
            local etcd's data when there is no ``data_dir``; leaving the ``with`` block removes it, unless an error
            is on its way out: then it stays, and the log says where).
        tls: None (plaintext), "tls" or "mtls" (mutual TLS): throwaway certificates are made in
            ``<data_dir or log_dir>/tls`` (``shardps.server.ops.certs``) and the cluster file carries their paths.
        replicas: members of each shard's replica group (1: none); with more, every shard index runs as that many
            processes (data in ``shard-<i>/member-<m>``), coordinated by etcd: ``etcd``'s URL, or a local etcd
            started here (``shardps.server.ops.etcd``, its data in ``<data_dir or log_dir>/etcd``).
        cluster_name: the cluster's name in etcd.
        placements: where the processes run, in order (shard 0's members, then shard 1's, ...), repeated as needed;
            none: all here on ``host``. The launcher must reach each placement's address (run it on a host that
            does: the lab's control host, say).
        etcd_placement: where the local etcd runs (default: with the first process).
    """

    num_shards: int
    base_port: int = 0
    data_dir: Optional[str] = None
    host: str = "127.0.0.1"
    serve_args: Sequence[str] = ()
    log_dir: Optional[str] = None
    tls: Optional[str] = None
    replicas: int = 1
    etcd: Optional[str] = None
    cluster_name: str = "shardps"
    procs: list[_Proc] = field(default_factory=list)
    certs: Optional[DevCerts] = None
    local_etcd: Optional[LocalEtcd] = None
    joined: set[int] = field(default_factory=set)  # shards added while running (``shardps reshard --add``)
    retired: set[int] = field(default_factory=set)  # shards removed (``shardps reshard --remove``): stopped
    serves_requests: bool = False  # a ``shardps cluster`` process that adds and retires shards on request
    placements: Sequence[Placement] = ()
    etcd_placement: Optional[Placement] = None
    made_log_dir: bool = field(default=False, init=False)  # log_dir is a temporary one made here (``__exit__``)

    def placement(self, index: int, member: int = 0) -> Placement:
        """Where member ``member`` of shard ``index`` runs."""
        if not self.placements:
            return Placement(self.host)
        return self.placements[(index * self.replicas + member) % len(self.placements)]

    def command(self, index: int, port: int, ready_file: str, member: int = 0) -> list[str]:
        """The command that runs shard ``index`` (member ``member`` of its replica group; the same flags the Compose
        file passes)."""
        count = index + 1 if index in self.joined else self.num_shards - len(self.joined)
        where = self.placement(index, member)
        cmd = [*where.prefix, sys.executable, "-m", "shardps", "serve", "--host", where.host, "--port", str(port),
               "--shard-index", str(index), "--num-shards", str(count), "--ready-file", ready_file]
        if index in self.joined:
            cmd.append("--join")
        if self.data_dir:
            d = pathlib.Path(self.data_dir) / f"shard-{index}"
            cmd += ["--data-dir", str(d / f"member-{member}" if self.replicas > 1 else d)]
        if self.replicas > 1:
            assert self.etcd is not None
            cmd += ["--replicas", str(self.replicas), "--member", f"m{member}", "--etcd", self.etcd,
                    "--cluster-name", self.cluster_name]
        if self.certs is not None:
            cmd += ["--tls-cert", self.certs.server_cert, "--tls-key", self.certs.server_key]
            if self.tls == "mtls":
                cmd += ["--tls-client-ca", self.certs.ca]
        return cmd + list(self.serve_args)

    @property
    def tls_files(self) -> Optional[dict[str, str]]:
        """What a client needs to reach the shards (``Client(tls=TLS(**files))``), or None without TLS."""
        if self.certs is None:
            return None
        return {"ca": self.certs.ca, "cert": self.certs.client_cert, "key": self.certs.client_key}

    def _logs(self) -> pathlib.Path:
        """The log directory (made now: a temporary one, when none was given)."""
        if self.log_dir is None:
            self.log_dir, self.made_log_dir = tempfile.mkdtemp(prefix="shardps-logs-"), True
        logs = pathlib.Path(self.log_dir)
        logs.mkdir(parents=True, exist_ok=True)
        return logs

    def _spawn(self, index: int, port: int, member: int = 0) -> _Proc:
        logs = self._logs()
        name = f"shard-{index}" + (f"-m{member}" if self.replicas > 1 else "")
        ready = logs / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log_path = logs / f"{name}.log"
        env = dict(os.environ)
        if self.tls_files is not None:  # a backup's calls to its primary present the client certificate
            env.update(SHARDPS_TLS_CA=self.tls_files["ca"], SHARDPS_TLS_CLIENT_CERT=self.tls_files["cert"],
                       SHARDPS_TLS_CLIENT_KEY=self.tls_files["key"])
        with open(log_path, "a") as out:
            popen = subprocess.Popen(self.command(index, port, str(ready), member), stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)
        return _Proc(index, popen, ready, log_path, member=member)

    def _await_ready(self, proc: _Proc, deadline: float) -> None:
        ready = proc.ready_file
        while not (ready.exists() and ready.read_text()):
            if proc.popen.poll() is not None:
                raise RuntimeError(f"shard {proc.index} exited with code {proc.popen.returncode}; "
                                   f"last log lines:\n{_tail(proc.log_path)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard {proc.index} did not start in time; log: {proc.log_path}")
            time.sleep(0.05)
        proc.address = ready.read_text()
        tls = self.tls_files or {}
        while check_health(proc.address, ca=tls.get("ca"), cert=tls.get("cert"), key=tls.get("key")) != "SERVING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard {proc.index} at {proc.address} never became healthy")
            time.sleep(0.05)

    def start(self, timeout: float = 60.0) -> LocalCluster:
        """Start every shard and wait until all are healthy."""
        deadline = time.monotonic() + timeout
        if self.tls not in (None, "tls", "mtls"):
            raise ValueError(f"tls must be None, 'tls' or 'mtls', got {self.tls!r}")
        if self.tls and self.certs is None:
            home = self.data_dir or str(self._logs())
            hosts = sorted({self.host, "localhost", "127.0.0.1", *(p.host for p in self.placements)})
            self.certs = make_dev_certs(str(pathlib.Path(home) / "tls"), hosts=tuple(hosts))
        try:
            if self.replicas > 1 and self.etcd is None:
                etcd_home = pathlib.Path(self.data_dir) if self.data_dir else self._logs()
                where = self.etcd_placement or self.placement(0)
                self.local_etcd = LocalEtcd(str(etcd_home / "etcd"), host=where.host, prefix=where.prefix).start()
                self.etcd = self.local_etcd.url
            r = self.replicas
            self.procs = [self._spawn(i, self.base_port + i * r + m if self.base_port else 0, m)
                          for i in range(self.num_shards) for m in range(r)]
            for p in self.procs:
                self._await_ready(p, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def addresses(self) -> list[str]:
        """Each shard's address, or with replicas its group's members joined by "|" (what ``Client`` takes)."""
        return ["|".join(g) for g in self.groups]

    @property
    def groups(self) -> list[list[str]]:
        """Each shard's members' addresses (none for a retired shard)."""
        return [[p.address for p in self.procs if p.index == i] for i in range(self.num_shards)]

    def add_shards(self, count: int, timeout: float = 60.0) -> list[int]:
        """Start ``count`` more shards (each a replica group with replicas) that join the running cluster, owning no
        slot until ``shardps reshard`` moves some to them; their indices."""
        first = self.num_shards
        new = list(range(first, first + count))
        self.joined.update(new)
        self.num_shards += count
        procs = [self._spawn(i, 0, m) for i in new for m in range(self.replicas)]
        self.procs += procs
        deadline = time.monotonic() + timeout
        for p in procs:
            self._await_ready(p, deadline)
        return new

    def retire(self, index: int, timeout: float = 30.0) -> None:
        """Stop shard ``index`` for good (it owns nothing any more: ``shardps reshard --remove``)."""
        for p in [p for p in self.procs if p.index == index]:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
                try:
                    p.popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()
            self.procs.remove(p)
        self.retired.add(index)

    def write_cluster_file(self, path: str, **extra: Any) -> None:
        """Write the JSON file ``Client.from_file`` reads (``extra``: more keys)."""
        data: dict[str, Any] = {"addresses": self.addresses, "num_shards": self.num_shards, "data_dir": self.data_dir,
                                "pids": [p.popen.pid for p in self.procs], "logs": self.log_dir,
                                "retired": sorted(self.retired), **extra}
        if self.serves_requests:
            data["launcher_pid"] = os.getpid()
        if self.replicas > 1:
            data.update(groups=self.groups, etcd=self.etcd, cluster_name=self.cluster_name)
        if self.tls_files is not None:
            data["tls"] = self.tls_files
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)

    def dead(self) -> list[tuple[int, int]]:
        """(position in ``procs``, exit code) of the shard processes that are not running."""
        return [(i, p.popen.returncode) for i, p in enumerate(self.procs) if p.popen.poll() is not None]

    def restart(self, index: int, timeout: float = 60.0) -> None:
        """Start process ``index`` of ``procs`` (shard ``index`` without replicas) again on its address and data dir."""
        old = self.procs[index]
        if old.popen.poll() is None:
            old.popen.kill()
            old.popen.wait()
        port = int(old.address.rsplit(":", 1)[1])
        deadline = time.monotonic() + timeout
        where = self.placement(old.index, old.member)
        while True:
            # The port went back to the system with the process: until the new one listens, another socket (an
            # outgoing connection's end, given the same ephemeral port) may hold it for a while. (Elsewhere, in another
            # namespace, it cannot be looked at from here: a start that finds it taken is tried again below.)
            if not where.prefix:
                wait_for_port(where.host, port, deadline)
            new = self._spawn(old.index, port, old.member)
            new.restarts = old.restarts + 1
            self.procs[index] = new
            try:
                self._await_ready(new, deadline)
                return
            except RuntimeError:
                if new.popen.returncode != PORT_IN_USE_EXIT or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                log.info("shard %d: port %d taken again before it listened; trying again", old.index, port)

    def kill(self, index: int) -> None:
        """kill -9 one shard (for fault drills)."""
        self.procs[index].popen.kill()
        self.procs[index].popen.wait()

    def stop(self, timeout: float = 30.0) -> list[int]:
        """SIGTERM every shard (each checkpoints and exits), then kill stragglers; returns exit codes."""
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        codes = []
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                codes.append(p.popen.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                log.error("shard %d did not stop in %.0fs; killing it", p.index, timeout)
                p.popen.kill()
                codes.append(p.popen.wait())
        if self.local_etcd is not None:
            self.local_etcd.stop()
        return codes

    def __enter__(self) -> LocalCluster:
        return self.start() if not self.procs else self

    def close(self, keep_logs: bool = False) -> list[int]:
        """``stop``, then remove the temporary log directory this cluster made (none given), unless ``keep_logs``
        (something failed: the logs are for the post-mortem); exit codes."""
        codes = self.stop()
        if self.made_log_dir and self.log_dir is not None and not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return codes

    def __exit__(self, exc_type: Optional[type], *exc: object) -> None:
        self.close(keep_logs=exc_type is not None)
        if exc_type is not None and self.made_log_dir:
            log.warning("local cluster failed (%s): its shard logs are kept in %s", exc_type.__name__, self.log_dir)


def handle_request(cluster: LocalCluster, cluster_file: str) -> Optional[str]:
    """A request ``shardps reshard`` left for the running ``shardps cluster`` (``<cluster file>.request``: shards to
    add or to retire), carried out; the cluster file then says it was (``request_done``) or why not
    (``request_error``). What was done, for the log (None: no request)."""
    path = pathlib.Path(cluster_file + ".request")
    if not path.exists():
        return None
    try:
        req = json.loads(path.read_text())
        rid = str(req["id"])
    except (OSError, ValueError, KeyError):
        return None  # still being written
    path.unlink(missing_ok=True)
    done = ""
    try:
        if int(req.get("add", 0)) > 0:
            new = cluster.add_shards(int(req["add"]))
            done = f"added shards {new}"
        for index in req.get("retire", []):
            cluster.retire(int(index))
            done += f"{'; ' if done else ''}retired shard {index}"
        cluster.write_cluster_file(cluster_file, request_done=rid)
    except Exception as e:  # noqa: BLE001 - told to the requester
        cluster.write_cluster_file(cluster_file, request_error=f"{rid}: {e}")
        done = f"request {rid} failed: {e}"
    return done


def request(cluster_file: str, timeout: float = 120.0, **what: Any) -> dict[str, Any]:
    """Ask the ``shardps cluster`` that wrote ``cluster_file`` to add or retire shards (``add=K``, ``retire=[i]``);
    the cluster file once it did."""
    import uuid

    rid = uuid.uuid4().hex[:12]
    tmp = pathlib.Path(cluster_file + ".request.tmp")
    tmp.write_text(json.dumps({"id": rid, **what}))
    os.replace(tmp, cluster_file + ".request")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = json.loads(pathlib.Path(cluster_file).read_text())
        except (OSError, ValueError):
            data = {}
        if data.get("request_done") == rid:
            return data
        err = str(data.get("request_error", ""))
        if err.startswith(rid + ":"):
            raise RuntimeError(f"shardps cluster could not do it: {err[len(rid) + 1:].strip()}")
        time.sleep(0.1)
    raise TimeoutError(f"shardps cluster did not answer the request in {cluster_file}.request within {timeout:.0f} s "
                       "(is it running?)")


def _tail(path: pathlib.Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-lines:])
    except OSError:
        return "(no log)"
