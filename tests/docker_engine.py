"""A Docker engine for the container test: the one the environment names, or one started here.

``engine(workdir)`` yields the environment (``DOCKER_HOST``) of a working engine: the one
``DOCKER_HOST`` or the default socket reaches when it answers, else a ``dockerd`` started here, as
root, with its data root, exec root and socket under ``workdir``, no default bridge and no outbound
NAT (the test's Compose networks reach nothing outside them). An engine started here is stopped at
the end, its mounts undone, its directories removed and the host's iptables rules put back as they
were (dockerd adds chains and sets FORWARD's policy to DROP; without its rules, a host whose bridged
traffic passes iptables would drop the traffic between containers).
``Unavailable`` says why there is none (not root, no dockerd, the daemon would not start), and the
test skips with that reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator, Optional


class Unavailable(Exception):
    """No Docker engine can be used or started here; the message says why."""


def _answers(env: dict[str, str]) -> bool:
    try:
        return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_command(env: dict[str, str]) -> list[str]:
    """Compose v2 (``docker compose``) where the plugin is installed, else docker-compose 1.x."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        if subprocess.run(["docker", "compose", "version"], env=env, capture_output=True, timeout=20).returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise Unavailable("neither `docker compose` nor docker-compose is installed (apt-get install docker-compose)")


def _unmount_under(path: Path) -> None:
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f]
    for m in sorted((m for m in mounts if m.startswith(str(path))), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)


def _iptables_save() -> Optional[str]:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        out = subprocess.run(["iptables-save"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            return out.stdout
    return None


@contextlib.contextmanager
def engine(workdir: Path, start_timeout: float = 60.0) -> Iterator[dict[str, str]]:
    env = dict(os.environ)
    if shutil.which("docker") is None:
        raise Unavailable("no docker CLI (apt-get install docker.io)")
    if _answers(env):
        yield env
        return
    if os.geteuid() != 0:
        raise Unavailable("no Docker engine answers and starting one needs root")
    dockerd = shutil.which("dockerd") or ("/usr/sbin/dockerd" if os.path.exists("/usr/sbin/dockerd") else None)
    if dockerd is None:
        raise Unavailable("no Docker engine answers and dockerd is not installed (apt-get install docker.io)")
    root = Path(workdir) / "engine"
    root.mkdir(parents=True, exist_ok=True)
    sock = root / "docker.sock"
    env["DOCKER_HOST"] = f"unix://{sock}"
    saved_rules = _iptables_save()
    log = open(root / "dockerd.log", "w")
    proc: Optional[subprocess.Popen] = subprocess.Popen(
        [dockerd, "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
         "--pidfile", str(root / "dockerd.pid"), "--host", env["DOCKER_HOST"],
         "--bridge", "none", "--ip-masq=false"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout
        while not _answers(env):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = (root / "dockerd.log").read_text()[-1500:]
                raise Unavailable(f"dockerd did not start (exit code {proc.poll()}): {tail}")
            time.sleep(0.5)
        yield env
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        log.close()
        if saved_rules is not None:
            subprocess.run(["iptables-restore"], input=saved_rules, capture_output=True, text=True)
        _unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)
