"""``Lab``: N hosts on one machine, joined by a bridge, with faults by name.

Each host is a network namespace with one interface (``eth0``) and one address from ``SUBNET``
(198.18.0.0/15, set aside for network benchmarks by RFC 2544 and never routed; used only inside the namespaces a
lab made). The bridge joining them lives in a namespace of its own (the lab's switch), so the machine's own
network namespace gets no interface, no address, no route and no rule from the lab, and the firewall rules Docker
keeps there (its FORWARD policy drops bridged packets when ``br_netfilter`` is loaded) never see the lab's
traffic. Two labs never meet: each has its own switch.

Code that talks to the hosts runs inside one of them: ``spawn``/``run`` start a command there (``nsenter``), and
``call`` runs a Python function there in a fresh interpreter (``multiprocessing``'s spawn, the child entering the
namespace first), returning its result. A test's own driver (a launcher, the trainers, the checkers) typically
runs on a control host of its own (``Lab(["ctl", ...])``), as Jepsen's control node does.

Everything a lab makes goes away at ``close()``: on a normal exit, on an exception, on Ctrl-C and SIGTERM (the
owner's handler raises through the ``with``), and at interpreter exit; what a killed owner leaves, the next lab's
``sweep`` removes (only names starting with ``shlab-``).
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import multiprocessing
import os
import pathlib
import re
import signal
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from tests.lab import netns, network
from tests.lab.clock import Clock
from tests.lab.disk import Disk, Failpoints
from tests.lab.proxy import Proxy, binary

SUBNET = ipaddress.ip_network("198.18.0.0/15")
_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_COUNTER = itertools.count()
_PROXY_MARK = 0x5AB


@dataclass(frozen=True)
class Host:
    """One host of a lab: its name, its address and its namespace."""

    name: str
    address: str
    netns: str


class LabProcess:
    """A process the lab started in a host (killed with its process group at the lab's close)."""

    def __init__(self, host: Host, popen: subprocess.Popen, log: pathlib.Path, clock: Optional[Clock],
                 failpoints: Optional[Failpoints]) -> None:
        self.host, self.popen, self.log_path, self.clock, self.failpoints = host, popen, log, clock, failpoints

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> Optional[int]:
        """Send ``sig`` and wait for the exit (SIGKILL after ``timeout``); the exit code."""
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(sig)
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the process is frozen (its sockets stay open, nothing answers), every thread of it by the
        time this returns (``tests.procs.freeze``)."""
        from tests.procs import freeze

        freeze(self.pid)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def _in_host(netns_name: str, fn: Callable, args: tuple, kwargs: dict, conn: Any) -> None:
    try:
        netns.enter(netns_name)
        conn.send((True, fn(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - handed to the caller
        conn.send((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


class LabCallError(RuntimeError):
    """A function run in a host by ``Lab.call`` raised: its type, message and traceback."""


class Lab:
    """N hosts on one machine (see the module's docstring).

    Args:
        hosts: the hosts' names (lower-case letters and digits, at most 12), or how many (``h0``, ``h1``, ...).
        workdir: where the lab keeps logs, sockets, clock files and mounts (default: a new ``shlab-...``
            directory in the temp dir).
    """

    def __init__(self, hosts: Sequence[str] | int, workdir: Optional[str] = None) -> None:
        names = [f"h{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        bad = [n for n in names if not _NAME.match(n)]
        if bad or len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be unique, [a-z][a-z0-9]{{0,11}}: {names}")
        if len(names) > 250:
            raise ValueError("at most 250 hosts")
        self.id = f"{netns.PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self.dir = pathlib.Path(workdir) if workdir else netns.lab_root() / self.id
        addresses = list(itertools.islice(SUBNET.hosts(), len(names)))
        self.hosts = {n: Host(n, str(a), f"{self.id}-{n}") for n, a in zip(names, addresses)}
        self.switch = f"{self.id}--sw"
        self._procs: list[LabProcess] = []
        self._proxies: dict[tuple[str, str], Proxy] = {}
        self._proxy_ports: dict[tuple[str, str], str] = {}
        self._disks: list[Disk] = []
        self._grudges: dict[str, set[str]] = {n: set() for n in names}
        self._rates: dict[str, float] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._started = False
        self._old_term: Any = None

    # ---- life ----------------------------------------------------------------------------------------------------

    def start(self) -> Lab:
        """Make the switch and the hosts (sweeping what dead labs left first)."""
        reason = netns.why_unavailable()
        if reason:
            raise netns.LabUnavailable(reason)
        netns.sweep()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "owner").write_text(f"{os.getpid()} {netns.start_time(os.getpid())}\n")
        self._started = True
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            netns.sh("ip", "netns", "add", self.switch)
            netns.in_ns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            netns.in_ns(self.switch, "ip", "link", "set", "br0", "up")
            for i, h in enumerate(self.hosts.values()):
                netns.sh("ip", "netns", "add", h.netns)
                # the host's end is its eth0; the switch's end, port p<i>, joins the bridge
                netns.sh("ip", "-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0",
                         "netns", h.netns)
                netns.in_ns(self.switch, "ip", "link", "set", f"p{i}", "master", "br0", "up")
                netns.in_ns(h.netns, "ip", "addr", "add", f"{h.address}/{SUBNET.prefixlen}", "dev", "eth0")
                netns.in_ns(h.netns, "ip", "link", "set", "eth0", "up")
                netns.in_ns(h.netns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _on_term(self, signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through ``with Lab(...)``: close() runs

    def __enter__(self) -> Lab:
        return self.start() if not self._started else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove everything the lab made: processes, proxies, mounts, rules, links, namespaces, its directory."""
        with self._lock:
            if self._closed or not self._started:
                return
            self._closed = True
        atexit.unregister(self.close)
        if self._old_term is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_term)
        for p in self._procs:
            if p.alive():
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.popen.kill()
        for p in self._procs:
            try:
                p.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for d in self._disks:
            d.thaw()
        mounts = [str(d.path) for d in self._disks]
        names = [h.netns for h in self.hosts.values()] + [self.switch]
        netns.remove(names, [str(self.dir)], mounts)

    # ---- processes -----------------------------------------------------------------------------------------------

    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise KeyError(f"no host {name!r} in this lab (hosts: {', '.join(self.hosts)})") from None

    def address(self, name: str) -> str:
        return self.host(name).address

    def wrap(self, name: str) -> list[str]:
        """The argv prefix that runs a command on host ``name``."""
        return netns.wrap(self.host(name).netns)

    def spawn(self, name: str, argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
              clock: Optional[Clock] = None, failpoints: bool = False, log: Optional[str] = None,
              cwd: Optional[str] = None, pipes: bool = False) -> LabProcess:
        """Start ``argv`` on host ``name`` (its own process group; output to ``log``, by default a file in the lab's
        directory). ``clock``: its own clock (the clock shim, clock.py); ``failpoints``: libfiu preloaded (``.failpoints``);
        ``pipes``: its stdin and stdout are pipes (``.popen.stdin``/``.stdout``), stderr goes to the log."""
        h = self.host(name)
        full_env = dict(os.environ)
        full_env.update(env or {})
        preload: list[str] = []
        tag = f"{name}-{len(self._procs)}"
        if clock is not None:
            extra = clock.attach(self.dir / f"clock-{tag}")
            preload.append(extra.pop("LD_PRELOAD"))
            full_env.update(extra)
        fiu_prefix = self.dir / f"fiu-{tag}"
        if failpoints:
            extra = Failpoints.environment(fiu_prefix)
            preload.append(extra.pop("LD_PRELOAD"))
            full_env.update(extra)
        if preload:
            full_env["LD_PRELOAD"] = " ".join(preload + ([full_env["LD_PRELOAD"]] if "LD_PRELOAD" in (env or {})
                                                        else []))
        log_path = pathlib.Path(log) if log else self.dir / f"{tag}.log"
        with open(log_path, "ab") as out:
            popen = subprocess.Popen([*netns.wrap(h.netns), *argv], stdout=subprocess.PIPE if pipes else out,
                                     stderr=out if pipes else subprocess.STDOUT,
                                     stdin=subprocess.PIPE if pipes else subprocess.DEVNULL, env=full_env, cwd=cwd,
                                     start_new_session=True)
        proc = LabProcess(h, popen, log_path, clock, Failpoints(fiu_prefix, popen.pid) if failpoints else None)
        with self._lock:
            if self._closed:
                popen.kill()
                raise RuntimeError("the lab is closed")
            self._procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], timeout: float = 60.0, check: bool = True,
            input: Optional[str] = None) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``name`` to its end; its CompletedProcess (text)."""
        r = subprocess.run([*self.wrap(name), *argv], capture_output=True, text=True, timeout=timeout, input=input)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} on {name} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
        return r

    def call(self, name: str, fn: Callable, *args: Any, timeout: float = 300.0, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on host ``name`` in a fresh interpreter (``fn`` must be importable by name);
        its result. LabCallError when it raised, TimeoutError after ``timeout`` (the process is killed)."""
        ctx = multiprocessing.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        # not a daemon: the function may start processes of its own (a launcher's shards, a benchmark's trainers)
        proc = ctx.Process(target=_in_host, args=(self.host(name).netns, fn, args, kwargs, send))
        proc.start()
        send.close()
        try:
            if not recv.poll(timeout):
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {name} did not finish in {timeout:.0f} s")
            ok, value = recv.recv()
        except EOFError:
            proc.join(5)
            raise LabCallError(f"{getattr(fn, '__name__', fn)} on {name} died (exit code {proc.exitcode})") from None
        finally:
            if proc.is_alive():
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
            recv.close()
        if not ok:
            raise LabCallError(f"{getattr(fn, '__name__', fn)} on {name} raised {value}")
        return value

    # ---- network faults ------------------------------------------------------------------------------------------

    def _apply_grudges(self) -> None:
        for n, h in self.hosts.items():
            network.set_grudges(h.netns, [self.address(o) for o in sorted(self._grudges[n])])

    def cut(self, grudges: Mapping[str, Sequence[str]]) -> None:
        """Each host named drops every packet from the hosts listed for it (others keep what they had)."""
        with self._lock:
            for n, others in grudges.items():
                self.host(n)
                for o in others:
                    self.host(o)
                self._grudges[n] = set(others)
            self._apply_grudges()

    def partition(self, *groups: Sequence[str]) -> None:
        """Hosts in different groups cannot reach each other, in either direction; hosts in no group keep every
        link. Replaces any earlier cut."""
        for g in groups:
            for n in g:
                self.host(n)
        with self._lock:
            self._grudges = network.grudges_of([list(g) for g in groups], list(self.hosts))
            self._apply_grudges()

    def isolate(self, name: str) -> None:
        """``name`` reaches no other host and no host reaches it."""
        self.partition([name], [n for n in self.hosts if n != name])

    def drop(self, src: str, dst: str) -> None:
        """One way: packets from ``src`` to ``dst`` are dropped (``dst``'s packets to ``src`` still arrive), added
        to whatever cut there is."""
        with self._lock:
            self.host(src)
            self._grudges[self.host(dst).name].add(src)
            self._apply_grudges()

    def bridge(self, left: Sequence[str], middle: str, right: Sequence[str]) -> None:
        """Jepsen's bridge: ``left`` and ``right`` cannot reach each other, ``middle`` reaches both."""
        with self._lock:
            self._grudges = {n: set() for n in self.hosts}
            for a in left:
                self._grudges[a] |= set(right)
            for b in right:
                self._grudges[b] |= set(left)
            self._apply_grudges()

    def heal(self) -> None:
        """Remove every cut (rates and proxies' settings stay: ``unrate``, ``Proxy.heal``)."""
        with self._lock:
            self._grudges = {n: set() for n in self.hosts}
            self._apply_grudges()

    def rate(self, name: str, mbit: Optional[float]) -> None:
        """Cap host ``name``'s link at ``mbit`` Mbit/s in each direction (tbf on both ends of its veth; None:
        remove the cap)."""
        index = list(self.hosts).index(self.host(name).name)
        network.set_rate(self.host(name).netns, "eth0", mbit)
        network.set_rate(self.switch, f"p{index}", mbit)
        if mbit is None:
            self._rates.pop(name, None)
        else:
            self._rates[name] = mbit

    # ---- proxies -------------------------------------------------------------------------------------------------

    def link(self, src: str, dst: str, ports: Sequence[int] = ()) -> Proxy:
        """Route the TCP connections ``src`` opens to ``dst`` (to ``ports``, or to any port) through a fault proxy
        running on ``src``; the proxy (no fault until one is set). The same proxy for the same link."""
        with self._lock:
            if (src, dst) in self._proxies:
                return self._proxies[(src, dst)]
            s = self.host(src)
            self.host(dst)
            control = str(self.dir / f"proxy-{src}-{dst}.sock")
            p = self.spawn(src, [str(binary()), "--port", "0", "--mark", str(_PROXY_MARK), "--control", control,
                                 "--seed", str(len(self._proxies) + 1)])
            deadline = time.monotonic() + 10
            port = 0
            while time.monotonic() < deadline and not port:
                m = re.search(r"ready (\d+)", p.log())
                if m:
                    port = int(m.group(1))
                elif not p.alive():
                    raise RuntimeError(f"the proxy {src}->{dst} exited: {p.log()}")
                else:
                    time.sleep(0.01)
            if not port:
                raise TimeoutError(f"the proxy {src}->{dst} did not start: {p.log()}")
            proxy = Proxy(src, dst, control, port, p.popen)
            self._proxies[(src, dst)] = proxy
            self._proxy_ports[(src, dst)] = "{ " + ", ".join(str(x) for x in sorted(ports)) + " }" if ports else ""
            routes = {self.address(b): (q.port, _PROXY_MARK, self._proxy_ports[(a, b)])
                      for (a, b), q in self._proxies.items() if a == src}
            network.set_redirect(s.netns, routes)
            return proxy

    def unlink(self, src: str, dst: str) -> None:
        """Stop routing ``src``'s connections to ``dst`` through a proxy (the proxy stops; connections through it
        are reset)."""
        with self._lock:
            proxy = self._proxies.pop((src, dst), None)
            self._proxy_ports.pop((src, dst), None)
            if proxy is None:
                return
            routes = {self.address(b): (q.port, _PROXY_MARK, self._proxy_ports[(a, b)])
                      for (a, b), q in self._proxies.items() if a == src}
            network.set_redirect(self.host(src).netns, routes)
            proxy.popen.kill()
            proxy.popen.wait(10)

    def proxies(self) -> list[Proxy]:
        return list(self._proxies.values())

    # ---- clocks and disks ----------------------------------------------------------------------------------------

    def disk(self, name: str, size_mb: int = 64, kind: str = "ext4") -> Disk:
        """A small file system of its own for a host's data (``tests.lab.disk``): mounted under the lab's directory,
        removed with it."""
        self.host(name)
        d = Disk(self.dir / f"disk-{name}-{len(self._disks)}", size_mb, kind)
        with self._lock:
            self._disks.append(d)
        return d

    def heal_all(self) -> None:
        """Every fault lifted: cuts, rate caps, proxies' settings, frozen or slow disks (failed disks stay)."""
        self.heal()
        for name in list(self._rates):
            self.rate(name, None)
        for p in self._proxies.values():
            p.heal()
        for d in self._disks:
            d.thaw()
