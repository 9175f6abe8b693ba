"""Start shard servers as separate processes, exactly as users do (the ``shardps`` CLI)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from shardps.probe import PORT_IN_USE_EXIT, wait_for_port


@dataclass
class ShardProcess:
    proc: subprocess.Popen
    address: str
    log_path: pathlib.Path

    def terminate(self, timeout: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text()


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. The signal is not instant for a process of
    several threads: one of them takes it and then stops the others, and until that one runs (milliseconds on a
    busy machine) the others go on, so a message that arrives meanwhile is still served: a "push in flight when
    the shard goes" was applied and acknowledged before the stop in 1 of 13 runs beside 3 busy processes."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid}: its threads not all stopped {timeout:.0f} s after SIGSTOP")
        time.sleep(0.001)


def thread_states(pid: int) -> list[str]:
    """The state letter of each thread of ``pid`` (``/proc/PID/task/*/stat``: R, S, D, T, Z...); none when it is
    gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    states = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended
    return states


def _all_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped: every thread of it stopped (state T), or gone, or in the kernel on a disk (D: it
    stops on its way out, once one thread stopped the group); True for a process that is gone or dead."""
    states = thread_states(pid)
    if all(st in ("Z", "X") for st in states):
        return True  # gone, or dead (a zombie until its parent waits for it)
    return all(st in ("T", "t", "D", "Z", "X") for st in states) and ("T" in states or "t" in states)


def start_shard(
    index: int, num_shards: int, workdir: pathlib.Path, data_dir: Optional[str] = None,
    extra: Optional[list[str]] = None, env: Optional[dict] = None, timeout: float = 30, port: int | str = 0,
) -> ShardProcess:
    """Run ``shardps serve`` on 127.0.0.1 port 0 (``port``: a restarted shard's own) and wait until it reports its
    address. A shard restarted on its port waits for it, as ``LocalCluster.restart`` does: another socket may hold
    it for a while (``shardps serve`` exits with PORT_IN_USE_EXIT then)."""
    port = int(port)
    deadline = time.monotonic() + max(timeout, 60.0 if port else 0.0)
    while True:
        if port:
            wait_for_port("127.0.0.1", port, deadline)
        try:
            return _start(index, num_shards, workdir, data_dir, extra, env, deadline, port)
        except _PortTaken:
            if time.monotonic() > deadline:
                raise


class _PortTaken(RuntimeError):
    pass


def _start(index: int, num_shards: int, workdir: pathlib.Path, data_dir: Optional[str], extra: Optional[list[str]],
           env: Optional[dict], deadline: float, port: int) -> ShardProcess:
    ready = workdir / f"ready-{index}-{time.monotonic_ns()}"
    log_path = workdir / f"shard-{index}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "shardps", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--shard-index", str(index), "--num-shards", str(num_shards), "--ready-file", str(ready)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    cmd += extra or []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    while not (ready.exists() and ready.read_text()):
        if proc.poll() is not None:
            kind = _PortTaken if proc.returncode == PORT_IN_USE_EXIT else RuntimeError
            raise kind(f"shard {index} exited with {proc.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"shard {index} did not start in time:\n{log_path.read_text()}")
        time.sleep(0.05)
    return ShardProcess(proc, ready.read_text(), log_path)
