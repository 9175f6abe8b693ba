"""``WakePipe``: how other threads wake a thread that owns ZeroMQ sockets (a socket belongs to one thread).

The owner polls ``fd`` beside its sockets (``zmq.Poller`` takes file descriptors) and ``drain``s it when it
is readable; any thread ``wake``s it. Both ends are non-blocking, so a wake never blocks (a full pipe is
already readable). After ``close`` a wake or drain does nothing: the descriptor numbers may belong to
another file by then. Used by the shard's data plane and by the client's data-plane lanes.
"""

from __future__ import annotations

import os
import select
import threading


class WakePipe:
    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._w, b"x")
            except BlockingIOError:
                pass  # full: already readable

    def drain(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                while os.read(self.fd, 4096):
                    pass
            except BlockingIOError:
                pass

    def wait(self) -> None:
        """Block until woken (or closed), then drain."""
        with self._lock:
            if self._closed:
                return
        select.select([self.fd], [], [])
        self.drain()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.fd)
                os.close(self._w)
