"""A local etcd for a replica group on one machine: ``shardps cluster --replicas R`` and the tests start one on
loopback with its data in a directory of their own (Debian's ``etcd-server`` package: the ``etcd`` binary)."""

from __future__ import annotations

import logging
import pathlib
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from typing import Optional, Sequence

log = logging.getLogger(__name__)

INSTALL = ("etcd is not installed: install Debian's etcd-server package (apt-get install etcd-server), or point "
           "--etcd at a running etcd")


def etcd_binary() -> Optional[str]:
    return shutil.which("etcd")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalEtcd:
    """One etcd process on ``host`` (free ports unless given), data in ``data_dir``; stop() (or SIGKILL by kill())
    ends it, start() again restarts it on the same ports and data. ``prefix``: the argv prefix that runs it on
    another host (a network namespace: ``shardps.server.ops.launcher.Placement``), whose ports are then picked
    free here (a host of its own has every port free)."""

    def __init__(self, data_dir: str, host: str = "127.0.0.1", client_port: int = 0, peer_port: int = 0,
                 log_path: Optional[str] = None, prefix: Sequence[str] = ()) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError(INSTALL)
        self.binary = binary
        self.data_dir = pathlib.Path(data_dir)
        self.host = host
        self.prefix = list(prefix)
        here = "127.0.0.1" if self.prefix else host
        self.client_port = client_port or free_port(here)
        self.peer_port = peer_port or free_port(here)
        self.log_path = pathlib.Path(log_path) if log_path else self.data_dir.parent / "etcd.log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def start(self, timeout: float = 30.0) -> LocalEtcd:
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [*self.prefix, self.binary, "--name", "shardps", "--data-dir", str(self.data_dir),
               "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"shardps={peer}", "--initial-cluster-state", "new",
               "--heartbeat-interval", "50", "--election-timeout", "500", "--logger", "zap", "--log-level", "warn"]
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"etcd did not become healthy in {timeout}s; log: {self.log_path}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
