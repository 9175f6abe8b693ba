"""A process's own clock, shifted or sped up with libfaketime (Debian's ``faketime``); never the machine's.

A process started with a ``Clock`` has libfaketime preloaded, reading its offset and rate from a file of its own
(``FAKETIME_TIMESTAMP_FILE``, re-read every second): ``jump(+30)`` moves its clock 30 s on while it runs. A rate
other than 1 (``rate=2``: the clock runs twice as fast, timers and sleeps included) is set when the process starts:
a broken clock source rather than a step.

A jump moves ``CLOCK_MONOTONIC`` with ``CLOCK_REALTIME``: libfaketime 0.9.10 (Debian 12) cannot leave the monotonic
clock alone here (with ``FAKETIME_DONT_FAKE_MONOTONIC`` every ``time.sleep`` of CPython 3.11 fails with EINVAL: its
``clock_nanosleep(TIMER_ABSTIME)`` wrapper mixes the two clocks). So a forward jump is also what a process sees
after a pause it did not notice (a VM stopped and resumed), and a backward one a process that missed time: its
timers and leases think less time went by than did, the harder case for anything that trusts a local clock.
"""

from __future__ import annotations

import glob
import pathlib
from dataclasses import dataclass, field

LIBRARY_GLOBS = ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                 "/usr/local/lib/faketime/libfaketime.so.1")


def library() -> str:
    """libfaketime's path; RuntimeError when it is not installed."""
    for pattern in LIBRARY_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    raise RuntimeError("clock faults need libfaketime (Debian: apt-get install faketime)")


@dataclass
class Clock:
    """A process's clock: ``offset_s`` ahead of the machine's (negative: behind), running at ``rate``."""

    offset_s: float = 0.0
    rate: float = 1.0
    path: pathlib.Path = field(default=pathlib.Path("/nonexistent"))

    def _spec(self) -> str:
        spec = f"{self.offset_s:+.3f}s"
        return spec + (f" x{self.rate:g}" if self.rate != 1.0 else "")

    def attach(self, path: pathlib.Path) -> dict[str, str]:
        """Write the clock's file at ``path``; the environment that preloads libfaketime reading it."""
        self.path = path
        path.write_text(self._spec() + "\n")
        env = {"LD_PRELOAD": library(), "FAKETIME_TIMESTAMP_FILE": str(path), "FAKETIME_CACHE_DURATION": "1",
               "FAKETIME_DONT_RESET": "1"}
        return env

    def jump(self, seconds: float) -> None:
        """Move the clock ``seconds`` (negative: back) from where it is; the process sees it within a second."""
        self.offset_s += seconds
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(self._spec() + "\n")
        tmp.replace(self.path)

    def reset(self) -> None:
        """Back to the machine's time (the rate stays)."""
        self.jump(-self.offset_s)
