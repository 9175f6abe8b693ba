"""The two-phase checkpoint gate: holds updates back while a cluster-wide checkpoint is prepared.

Phase 1 (``close``) stops new updates from starting; updates already inside a
table lock finish first (the caller drains them), and the hold starts (``hold``). Phase 2 opens the gate once the
state is copied. A gate left closed by a coordinator that died opens by itself
after its hold, so training cannot stall on it.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

log = logging.getLogger(__name__)


class CheckpointGate:
    def __init__(self, name: str) -> None:
        self._name = name
        self._open = threading.Event()
        self._open.set()
        self._timer: Optional[threading.Timer] = None
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        """Stop new updates (then drain the running ones, then ``hold``)."""
        with self._lock:
            self._cancel_timer()
            self._open.clear()

    def hold(self, hold_s: float) -> None:
        """Keep the gate closed for at most ``hold_s`` seconds from now, unless opened before."""
        with self._lock:
            self._cancel_timer()
            if self._open.is_set():
                return
            self._timer = threading.Timer(hold_s, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def open(self) -> None:
        with self._lock:
            self._cancel_timer()
            self._open.set()

    def wait(self, timeout: float) -> bool:
        """Wait until the gate is open; False if it stayed closed for ``timeout`` seconds."""
        return self._open.wait(timeout)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        log.warning("%s: prepared checkpoint was neither committed nor aborted; resuming pushes", self._name)
        self._open.set()
