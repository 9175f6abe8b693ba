"""A process's own clock, shifted or sped up (``clockshim.c``, preloaded into it); never the machine's.

A process started with a ``Clock`` has the lab's clock shim preloaded, reading its settings from a small file of
its own that the lab keeps mapped: ``jump(+30)`` moves its wall clock 30 s on while it runs (a step, as NTP makes
one: the monotonic clock never jumps); ``rate=2`` (set when it starts) makes both its clocks run twice as fast, and
its timed waits follow (a broken clock source).

Debian's ``faketime`` (libfaketime 0.9.10) was tried first and cannot serve a Python process here: with the
monotonic clock faked, every timed wait of CPython 3.11's threading module (``Event.wait``, ``Lock.acquire`` with a
timeout: ``sem_clockwait``, which it does not wrap) hangs; with ``FAKETIME_DONT_FAKE_MONOTONIC`` every
``time.sleep`` fails with EINVAL. The shim wraps what CPython, gRPC and libzmq wait with (``clock_gettime``,
``clock_nanosleep``, ``nanosleep``, ``sem_clockwait``, ``sem_timedwait``, ``pthread_cond_timedwait`` and
``_clockwait``, ``poll``, ``ppoll``, ``select``, ``epoll_wait``, ``epoll_pwait``).
"""

from __future__ import annotations

import mmap
import pathlib
import struct
from dataclasses import dataclass, field
from typing import Optional

from tests.lab.cbuild import compiled

SOURCE = pathlib.Path(__file__).with_name("clockshim.c")
_LAYOUT = struct.Struct("<qdQ")  # offset_ns, rate, seq


def library() -> str:
    """The compiled shim (built with the C compiler on first use, kept per source hash in the temp dir)."""
    return str(compiled(SOURCE, "shardps-lab-clock", "the lab's clock shim", ("-shared", "-fPIC"),
                        ("-ldl", "-lpthread"), ".so"))


@dataclass
class Clock:
    """A process's clock: its wall clock ``offset_s`` ahead of the machine's (negative: behind); both its clocks
    running at ``rate`` from its start."""

    offset_s: float = 0.0
    rate: float = 1.0
    path: pathlib.Path = field(default=pathlib.Path("/nonexistent"))
    _map: Optional[mmap.mmap] = field(default=None, repr=False)
    _seq: int = 0

    def attach(self, path: pathlib.Path) -> dict[str, str]:
        """Write the clock's file at ``path``; the environment that preloads the shim reading it."""
        if not self.rate > 0:
            raise ValueError(f"a clock's rate must be positive, got {self.rate}")
        self.path = path
        path.write_bytes(_LAYOUT.pack(int(self.offset_s * 1e9), self.rate, 0).ljust(64, b"\0"))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 64)
        return {"LD_PRELOAD": library(), "SHARDPS_LAB_CLOCK": str(path)}

    def jump(self, seconds: float) -> None:
        """Move the wall clock ``seconds`` (negative: back) from where it is; the process sees it at once."""
        if self._map is None:
            raise RuntimeError("the clock is not attached to a process (Lab.spawn(..., clock=...))")
        self.offset_s += seconds
        self._seq += 1  # a seqlock: odd while written
        struct.pack_into("<Q", self._map, 16, self._seq)
        struct.pack_into("<q", self._map, 0, int(self.offset_s * 1e9))
        self._seq += 1
        struct.pack_into("<Q", self._map, 16, self._seq)

    def reset(self) -> None:
        """Back to the machine's wall time (the rate stays)."""
        if self.offset_s:
            self.jump(-self.offset_s)
