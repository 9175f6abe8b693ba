"""The lab's lowest layer: network namespaces by name, commands inside them, and finding what a lab left behind.

Every name the lab makes starts with ``PREFIX`` followed by its owner's pid and a counter
(``shlab-<pid>-<n>``): its namespaces (``shlab-<pid>-<n>-<host>``, and ``shlab-<pid>-<n>--sw`` for the switch),
its working directory (``<tmp>/shlab-<pid>-<n>``, where its mounts, logs, proxies' sockets and clock files live).
A sweep removes what belongs to labs whose owner is gone (or, asked to, every lab's): processes inside their
namespaces, mounts and loop devices under their directories, the namespaces, the directories. It never touches
anything without the prefix.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Iterable, Optional, Sequence

PREFIX = "shlab-"
NETNS_DIR = pathlib.Path("/run/netns")
CLONE_NEWNET = 0x40000000
_LAB = re.compile(r"^shlab-(\d+)-(\d+)")
_PROBE = re.compile(r"^shlab-probe-(\d+)$")  # ``why_unavailable``'s namespace, there for a moment


class LabUnavailable(RuntimeError):
    """This machine cannot host a lab (not root, no ``ip``/``nft``/``nsenter``, namespaces refused): the reason."""


def why_unavailable() -> Optional[str]:
    """Why no lab can be made here, or None when one can (root, the tools, and a namespace really made)."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, nftables, mounts)"
    missing = [t for t in ("ip", "nft", "nsenter", "tc") if shutil.which(t) is None]
    if missing:
        return f"the lab needs {', '.join(missing)} (Debian: iproute2, nftables, util-linux)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"network namespaces cannot be made here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*argv: str, input: Optional[str] = None, check: bool = True, timeout: float = 30) -> str:
    """Run a command (no shell); its stdout. A failure raises with the command and its stderr."""
    r = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def in_ns(netns: str, *argv: str, **kw) -> str:
    """``sh`` inside namespace ``netns``."""
    return sh("ip", "netns", "exec", netns, *argv, **kw)


def wrap(netns: str) -> list[str]:
    """The argv prefix that runs a command inside ``netns`` (``nsenter`` execs it: the pid is the command's)."""
    return ["nsenter", f"--net={NETNS_DIR / netns}", "--"]


def enter(netns: str) -> None:
    """Move the calling thread into ``netns``; threads it starts afterwards (gRPC's, ZeroMQ's) follow it. Call it
    first thing in a fresh process (``Lab.call``), before any socket or networking thread exists."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def ns_inode(netns: str) -> Optional[int]:
    try:
        return os.stat(NETNS_DIR / netns).st_ino
    except OSError:
        return None


def pids_in(inodes: Iterable[int]) -> list[int]:
    """Processes whose network namespace is one of ``inodes``."""
    want, out = set(inodes), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.stat(f"/proc/{d}/ns/net").st_ino in want:
                out.append(int(d))
        except OSError:
            continue
    return out


def kill_all(pids: Sequence[int], timeout: float = 5.0) -> None:
    """SIGKILL ``pids`` and wait (briefly) until they are gone."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for p in pids:
        while time.monotonic() < deadline and os.path.exists(f"/proc/{p}") and not _zombie(p):
            time.sleep(0.02)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def start_time(pid: int) -> Optional[str]:
    """A process's start time in clock ticks since boot (with its pid: who it is, pid reuse aside)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def lab_root() -> pathlib.Path:
    return pathlib.Path(tempfile.gettempdir())


def _owner_alive(workdir: pathlib.Path, pid: int) -> bool:
    try:
        owner_pid, owner_start = (workdir / "owner").read_text().split()
    except (OSError, ValueError):
        return start_time(pid) is not None  # no record (being made, or half gone): the pid alone decides
    return start_time(int(owner_pid)) == owner_start


def leftovers(everything: bool = False) -> dict[str, list[str]]:
    """What labs left behind: {"netns": [...], "dirs": [...], "mounts": [...]} (of labs whose owner is gone; with
    ``everything``, of every lab, running or not)."""
    listed = [n for n in (os.listdir(NETNS_DIR) if NETNS_DIR.exists() else []) if n.startswith(PREFIX)]
    # Another process's capability probe may be there this moment (one pytest worker sweeps while another probes):
    # left behind only when its process is gone.
    probes = [n for n in listed if (m := _PROBE.match(n)) and (everything or start_time(int(m.group(1))) is None)]
    netns = {n: m.group(0) for n in listed if (m := _LAB.match(n))}  # each lab's namespace -> that lab
    dirs = {str(p): m.group(0) for p in lab_root().glob(PREFIX + "*") if p.is_dir() and (m := _LAB.match(p.name))}
    dead = {lab for lab in {*netns.values(), *dirs.values()}
            if everything or not _owner_alive(lab_root() / lab, int(lab.split("-")[1]))}  # (shlab-<pid>-<n>)
    mounts = [mp for mp in _mounts() if any(f"/{lab}/" in mp + "/" for lab in dead)]
    return {"netns": [n for n, lab in netns.items() if lab in dead] + probes,
            "dirs": [d for d, lab in dirs.items() if lab in dead],
            "mounts": mounts}


def _mounts() -> list[str]:
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            mp = line.split()[1].replace("\\040", " ")
            if PREFIX in mp:
                out.append(mp)
    return out


def _loops_under(dirs: Sequence[str]) -> list[str]:
    if not dirs or shutil.which("losetup") is None:
        return []
    out = []
    for line in sh("losetup", "-n", "-l", "-O", "NAME,BACK-FILE", check=False).splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and any(parts[1].strip().startswith(d + "/") for d in dirs):
            out.append(parts[0])
    return out


def remove(netns: Sequence[str], dirs: Sequence[str], mounts: Sequence[str]) -> None:
    """Remove one lab's (or a sweep's) namespaces, with every process in them, its mounts, loop devices and
    directories. Best effort: what cannot go now is left for the next sweep, and said in the exception."""
    errors = []
    inodes = [i for i in (ns_inode(n) for n in netns) if i is not None]
    kill_all(pids_in(inodes))
    for mp in sorted(mounts, key=len, reverse=True):  # deepest first
        sh("fsfreeze", "--unfreeze", mp, check=False)  # a frozen file system cannot be unmounted
        r = subprocess.run(["umount", "-l", mp], capture_output=True, text=True)
        if r.returncode != 0:
            errors.append(f"umount {mp}: {r.stderr.strip()}")
    for dev in _loops_under(dirs):
        sh("losetup", "-d", dev, check=False)
    for n in netns:
        r = subprocess.run(["ip", "netns", "del", n], capture_output=True, text=True)
        if r.returncode != 0 and ns_inode(n) is not None:
            errors.append(f"ip netns del {n}: {r.stderr.strip()}")
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    if errors:
        raise RuntimeError("the lab could not remove everything: " + "; ".join(errors))


def sweep(everything: bool = False) -> dict[str, list[str]]:
    """Remove the leftovers of labs whose owner is gone (``everything``: of every lab); what was removed."""
    found = leftovers(everything)
    remove(found["netns"], found["dirs"], found["mounts"])
    return found
