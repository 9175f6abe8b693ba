"""The shard's memory: its resident set size, watched, and a kill past a bound."""

from __future__ import annotations

import subprocess
import threading
from typing import Optional

GiB = 1 << 30

def read_rss(pid: int) -> Optional[int]:
    """Resident set size of a process in bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssWatch(threading.Thread):
    """Polls a process's RSS; kills it (SIGKILL) past ``limit`` bytes so a runaway never takes the machine down."""

    def __init__(self, proc: subprocess.Popen, limit: int, interval: float = 0.02) -> None:
        super().__init__(daemon=True, name="rss-watch")
        self.proc, self.limit, self.interval = proc, limit, interval
        self.peak = 0
        self.exceeded: Optional[int] = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            rss = read_rss(self.proc.pid)
            if rss is None or self.proc.poll() is not None:
                return
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                self.exceeded = rss
                self.proc.kill()
                return

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)
