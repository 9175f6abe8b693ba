"""Disk faults for a host's data directory: full, failing, blocked and slow disks, and fsync errors.

What works on this kernel, measured when the lab was written (``docs/lab.md`` has the figures):

- **Full**: a small tmpfs (``Disk(kind="tmpfs")``) or ext4 image; ``fill()`` leaves it with no free block, so
  writes fail with ENOSPC, as a real full disk's do.
- **Blocked and slow**: ext4 on a loop device (``kind="ext4"``); ``freeze()`` is fsfreeze's ioctl: every write and
  fsync to it blocks until ``thaw()`` (a disk that stopped answering; the process is not told, it waits);
  ``slow(stall_ms, period_ms)`` freezes it for ``stall_ms`` of every ``period_ms`` (a disk whose writes stall).
- **Failing**: ``fail()`` shuts the ext4 file system down (``EXT4_IOC_SHUTDOWN``): from then on every read, write
  and fsync on it returns EIO, as a dead disk's do.
- **fsync errors** in one process, while its writes succeed: libfiu (Debian's ``fiu-utils``) preloaded into it
  (``Lab.spawn(..., failpoints=True)``), its ``posix/io/sync/fsync`` and ``fdatasync`` points enabled by
  ``Failpoints.fsync_errors()``: the fsyncgate case (the kernel dropped the dirty pages; a retried fsync would
  succeed and lie). libfiu's ``write`` point is not offered: it fails every write(2) of the process, ZeroMQ's
  eventfd wake-ups and stderr included, which no disk does.
- Device-mapper (``dm-error``, ``dm-flakey``, ``dm-delay``) is not available in this kernel (no ``device-mapper``
  in /proc/devices), which is why blocked and slow disks are made with fsfreeze.
"""

from __future__ import annotations

import errno as errno_mod
import fcntl
import os
import pathlib
import shutil
import struct
import threading
import time
from typing import Optional

from tests.lab.netns import sh

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2
FIFREEZE, FITHAW = 0xC0045877, 0xC0045878  # _IOWR('X', 119, int), _IOWR('X', 120, int): what fsfreeze calls


def _ioctl(path: pathlib.Path, request: int, arg: bytes = struct.pack("i", 0), ok: tuple[int, ...] = ()) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, request, arg)
    except OSError as e:
        if e.errno not in ok:
            raise
    finally:
        os.close(fd)


class Disk:
    """A small file system mounted at ``path`` (under the lab's directory) for one host's data.

    Args:
        path: the mount point (made).
        size_mb: its size.
        kind: "tmpfs" (full disks) or "ext4" (on a loop device: full, blocked, slow, failing).
    """

    def __init__(self, path: pathlib.Path, size_mb: int, kind: str = "ext4") -> None:
        if kind not in ("tmpfs", "ext4"):
            raise ValueError(f"kind must be 'tmpfs' or 'ext4', got {kind!r}")
        self.path, self.size_mb, self.kind = path, size_mb, kind
        self._slow: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._frozen = False
        path.mkdir(parents=True)
        if kind == "tmpfs":
            sh("mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(path))
        else:
            image = path.with_name(path.name + ".img")
            with open(image, "wb") as f:
                f.truncate(size_mb << 20)
            sh("mkfs.ext4", "-q", "-F", "-E", "nodiscard", str(image))
            sh("mount", "-o", "loop", str(image), str(path))

    def fill(self) -> None:
        """Leave no free block: writes fail with ENOSPC until ``unfill``."""
        fd = os.open(self.path / ".lab-filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for size in (1 << 20, 65536, 4096, 512, 1):  # down to the last partial block
                block = b"\0" * size
                while True:
                    try:
                        os.write(fd, block)
                    except OSError as e:
                        if e.errno != errno_mod.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)

    def unfill(self) -> None:
        (self.path / ".lab-filler").unlink(missing_ok=True)

    def _ext4(self, what: str) -> None:
        if self.kind != "ext4":
            raise ValueError(f"{what} needs an ext4 disk (Disk(kind='ext4')), this one is {self.kind}")

    def freeze(self) -> None:
        """Block every write and fsync to the disk until ``thaw`` (fsfreeze)."""
        self._ext4("freeze")
        if not self._frozen:
            _ioctl(self.path, FIFREEZE)
            self._frozen = True

    def thaw(self) -> None:
        """Undo ``freeze`` and ``slow``."""
        self._stop.set()
        if self._slow is not None:
            self._slow.join()
            self._slow = None
        if self._frozen:
            _ioctl(self.path, FITHAW, ok=(errno_mod.EINVAL,))  # EINVAL: not frozen
            self._frozen = False

    def slow(self, stall_ms: float = 200.0, period_ms: float = 250.0) -> None:
        """Freeze the disk for ``stall_ms`` of every ``period_ms`` until ``thaw``: writes and fsyncs stall."""
        self._ext4("slow")
        if not 0 < stall_ms < period_ms:
            raise ValueError(f"need 0 < stall_ms < period_ms, got {stall_ms} and {period_ms}")
        self.thaw()
        self._stop.clear()

        def run() -> None:
            while not self._stop.is_set():
                _ioctl(self.path, FIFREEZE)
                self._frozen = True
                self._stop.wait(stall_ms / 1000)
                _ioctl(self.path, FITHAW, ok=(errno_mod.EINVAL,))
                self._frozen = False
                self._stop.wait((period_ms - stall_ms) / 1000)

        self._slow = threading.Thread(target=run, name=f"slow-disk-{self.path.name}", daemon=True)
        self._slow.start()

    def fail(self) -> None:
        """Shut the file system down: every later I/O on it returns EIO (until it is made again)."""
        self._ext4("fail")
        self.thaw()
        _ioctl(self.path, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))

    def close(self) -> None:
        self.thaw()
        sh("umount", "-l", str(self.path), check=False)
        image = self.path.with_name(self.path.name + ".img")
        image.unlink(missing_ok=True)
        shutil.rmtree(self.path, ignore_errors=True)


class Failpoints:
    """libfiu's failure points of one process started with them preloaded (``Lab.spawn(failpoints=True)``), over
    its control FIFOs (what ``fiu-ctrl`` writes)."""

    PRELOAD = ("/usr/lib/fiu/fiu_run_preload.so", "/usr/lib/fiu/fiu_posix_preload.so")

    def __init__(self, prefix: pathlib.Path, pid: int) -> None:
        self.prefix, self.pid = prefix, pid

    @classmethod
    def environment(cls, prefix: pathlib.Path) -> dict[str, str]:
        missing = [p for p in cls.PRELOAD if not os.path.exists(p)]
        if missing:
            raise RuntimeError("fsync faults need libfiu (Debian: apt-get install fiu-utils)")
        return {"LD_PRELOAD": " ".join(cls.PRELOAD), "FIU_CTRL_FIFO": str(prefix), "FIU_ENABLE": ""}

    def _command(self, line: str, timeout: float = 5.0) -> None:
        base = f"{self.prefix}-{self.pid}"
        deadline = time.monotonic() + timeout
        while not os.path.exists(base + ".in"):  # made by the preloaded library as the process starts
            if time.monotonic() > deadline:
                raise RuntimeError(f"process {self.pid} has no libfiu control FIFO {base}.in")
            time.sleep(0.02)
        with open(base + ".in", "w") as f:
            f.write(line + "\n")
        with open(base + ".out") as f:
            reply = f.readline().strip()
        if reply == "-1":
            raise RuntimeError(f"libfiu refused {line!r} in process {self.pid}")

    def enable(self, name: str, errno: int = errno_mod.EIO, probability: float = 1.0) -> None:
        """Fail ``name`` (e.g. ``posix/io/sync/fsync``) with ``errno``, always or with ``probability``."""
        if probability >= 1.0:
            self._command(f"enable name={name},failnum=1,failinfo={errno}")
        else:
            self._command(f"enable_random name={name},failnum=1,failinfo={errno},probability={probability}")

    def disable(self, name: str) -> None:
        self._command(f"disable name={name}")

    def fsync_errors(self, on: bool = True, probability: float = 1.0) -> None:
        """Every fsync and fdatasync of the process fails with EIO (with ``probability``), or none (``on=False``)."""
        for name in ("posix/io/sync/fsync", "posix/io/sync/fdatasync"):
            if on:
                self.enable(name, errno_mod.EIO, probability)
            else:
                self.disable(name)
