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


def start_shard(
    index: int, num_shards: int, workdir: pathlib.Path, data_dir: Optional[str] = None,
    extra: Optional[list[str]] = None, env: Optional[dict] = None, timeout: float = 30,
) -> ShardProcess:
    """Run ``shardps serve`` on 127.0.0.1 port 0 and wait until it reports its address."""
    ready = workdir / f"ready-{index}-{time.monotonic_ns()}"
    log_path = workdir / f"shard-{index}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "shardps", "serve", "--host", "127.0.0.1", "--port", "0",
           "--shard-index", str(index), "--num-shards", str(num_shards), "--ready-file", str(ready)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    cmd += extra or []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while not (ready.exists() and ready.read_text()):
        if proc.poll() is not None:
            raise RuntimeError(f"shard {index} exited with {proc.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"shard {index} did not start in {timeout}s:\n{log_path.read_text()}")
        time.sleep(0.05)
    return ShardProcess(proc, ready.read_text(), log_path)
