"""The C heap and growable arrays: keep message buffers in the heap, give free memory back.

``tune_malloc``: glibc serves allocations above M_MMAP_THRESHOLD (128 KiB at
first) with fresh mmap'd pages and returns them on free, so every ~1 MB request
or reply costs hundreds of page faults when its buffers are touched. Measured
on a 2-core machine: a 4,400-row pull went from 5.7 ms to 2.2 ms with the
threshold at 32 MiB (glibc's maximum) and trimming at 16 MiB (so freed
temporaries do not pile up). Set SHARDPS_TUNE_MALLOC=0 to leave malloc alone.
Mappings of 16 MiB and up ask for transparent huge pages (``SHARDPS_HUGEPAGES=0``: not).

``zeros`` / ``full`` / ``grown`` / ``regrow``: a shard's long-lived arrays (rows, optimizer
state, ids, index) get pages of their own from ``mmap`` instead of the heap.
In the heap, a long-lived array allocated among message buffers keeps every
freed buffer around it resident; measured on a 1M-row unbounded table, the
halves-again growth of those arrays left 50 MB (0.2x of the rows) resident.
Their own mapping is untouched (so costs nothing) until written, and returned
whole when the array is freed. ``regrow`` enlarges such a mapping where it lies
(``mremap``: no row copied, no page touched) when nothing else holds the array.

``release_free_memory``: shards hand the heap's free pages back to the OS
(``malloc_trim``) when they fall idle after traffic; a no-op where the C
library has no such call.

``populate`` / ``in_background``: pages made before they are first written, by a thread of their own
(``RowStore`` makes a growing table's next rows' pages ahead of them; ``SHARDPS_PREFAULT=0``: not).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os
import sys
import threading
from typing import Any, Callable, MutableMapping, Optional, Union

import numpy as np

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def _libc() -> Optional[Any]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
_TRIM = getattr(_LIBC, "malloc_trim", None)
if _TRIM is not None:
    _TRIM.argtypes = [ctypes.c_size_t]
    _TRIM.restype = ctypes.c_int


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 16 << 20) -> bool:
    """Apply the settings once per process (Linux with glibc only); True if applied."""
    global _done
    if _done or os.environ.get("SHARDPS_TUNE_MALLOC", "1") == "0":
        return _done
    _done = True
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    log.debug("malloc tuning %s", "applied" if ok else "refused")
    return ok


def release_free_memory() -> None:
    """Return the C heap's free pages to the OS (glibc); otherwise do nothing."""
    if _TRIM is not None:
        _TRIM(0)


_OWN_PAGES = 1 << 20  # arrays from this size up get a mapping of their own
# Anonymous private mappings (Linux, macOS); elsewhere arrays come from numpy's allocator.
_MAP_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_CAN_MAP = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def zeros(shape: Union[int, tuple[int, ...]], dtype: Any) -> np.ndarray:
    """``np.zeros``, on pages of its own (from mmap) when 1 MiB or larger."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    if nbytes < _OWN_PAGES or not _CAN_MAP:
        return np.zeros(dims, dtype=dt)
    pages = mmap.mmap(-1, nbytes, flags=_MAP_FLAGS)
    _huge(pages)
    return np.frombuffer(pages, dtype=dt, count=nbytes // dt.itemsize).reshape(dims)


_HUGE_FROM = 16 << 20  # mappings from this size up ask for transparent huge pages
_HUGE = os.environ.get("SHARDPS_HUGEPAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def _huge(pages: mmap.mmap) -> None:
    """Ask for transparent huge pages (2 MiB) on a large mapping: a pull's rows and a push's optimizer steps land on
    random rows of a large table, and each row on a page of its own missed the TLB (measured in
    ``docs/performance.md``). Pages are still made only when written, so the rows a table has not reached cost
    nothing; at most the last 2 MiB an array has reached is not yet all used. ``SHARDPS_HUGEPAGES=0`` leaves the
    kernel's default (where transparent huge pages are ``madvise``-only, as on Debian, that is 4 KiB pages)."""
    if _HUGE and len(pages) >= _HUGE_FROM:
        try:
            pages.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            pass


_MADVISE = getattr(_LIBC, "madvise", None)
if _MADVISE is not None:
    _MADVISE.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _MADVISE.restype = ctypes.c_int
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def owns_pages(arr: np.ndarray) -> bool:
    """Whether ``arr`` covers a whole mapping of ``zeros``' own (whose pages ``populate`` may make)."""
    return _MADVISE is not None and _own_mapping(arr) is not None and arr.shape[0] > 0


def release_pages(arr: np.ndarray, first_row: int) -> None:
    """Give the whole pages of ``arr`` (C-contiguous, one of ``zeros``' own mappings) from row ``first_row`` on back
    to the OS: they read as zeros when touched again. Arrays on the heap, or without madvise, are left as they are."""
    if _MADVISE is None or arr.nbytes < _OWN_PAGES or not arr.flags.c_contiguous or first_row >= arr.shape[0]:
        return
    start = arr.ctypes.data + first_row * (arr.nbytes // arr.shape[0])
    end = arr.ctypes.data + arr.nbytes
    lo = -(-start // _PAGE) * _PAGE
    hi = end // _PAGE * _PAGE
    if hi > lo:
        _MADVISE(lo, hi - lo, _MADV_DONTNEED)


def full(shape: Union[int, tuple[int, ...]], value: Any, dtype: Any) -> np.ndarray:
    """``np.full``, on pages of its own when 1 MiB or larger."""
    out = zeros(shape, dtype)
    out.fill(value)
    return out


def grown(arr: np.ndarray, cap: int) -> np.ndarray:
    """A zeroed array of ``cap`` rows holding ``arr``'s rows first (pages past them stay untouched)."""
    out = zeros((cap,) + arr.shape[1:], arr.dtype)
    out[: arr.shape[0]] = arr
    return out


def _own_mapping(arr: np.ndarray) -> Optional[mmap.mmap]:
    """The mapping of ``zeros``' own that ``arr`` covers whole (C-contiguous, from its first byte), else None."""
    base: Any = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if not (isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)):
        return None
    pages = base.obj
    return pages if arr.flags.c_contiguous and arr.nbytes == len(pages) else None


def regrow(holder: Union[MutableMapping[str, Any], Any], key: str, cap: int) -> None:
    """``holder.key = grown(holder.key, cap)`` (``holder[key]`` for a mapping), in place where it can be: when the
    array is a whole mapping of ``zeros``' own and ``holder`` held its only reference, the kernel enlarges the
    mapping (``mremap``; pages move, nothing is copied or touched, the new rows read as zeros). Any other holder
    (a view taken by a reader, a kernel call under way) keeps the mapping from being resized, and the array is
    copied as ``grown`` does: nothing that holds the old array ever sees it move.

    Measured on row creation (a 64-float table grown from 64K to 424K rows by Zipf batches): growing took a third
    of a created row's CPU as a copy (0.25 s of 0.75), mostly the copy's page faults."""
    mapping = isinstance(holder, MutableMapping)
    put = holder.__setitem__ if mapping else functools.partial(setattr, holder)
    arr = holder[key] if mapping else getattr(holder, key)
    pages = _own_mapping(arr)
    if pages is None or cap <= arr.shape[0]:
        put(key, grown(arr, cap))
        return
    n, rest, dt = arr.shape[0], arr.shape[1:], arr.dtype
    row_items = int(np.prod(rest, dtype=np.int64))

    def rows(count: int) -> np.ndarray:
        return np.frombuffer(pages, dtype=dt, count=count * row_items).reshape((count,) + rest)

    # Drop every reference this call and ``holder`` have; the mapping can move only if none is left.
    put(key, None)
    del arr
    try:
        try:
            pages.resize(cap * row_items * dt.itemsize)
            _huge(pages)
            new = rows(cap)
        except (BufferError, OSError, SystemError, ValueError, TypeError):  # held elsewhere, or no mremap
            new = grown(rows(n), cap)
    except BaseException:  # (out of memory): the holder keeps its rows as they were
        put(key, rows(n))
        raise
    put(key, new)


# ---- pages made ahead -------------------------------------------------------------------

_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, as a write to each would, keeping what they hold
_populating = _MADVISE is not None and os.environ.get("SHARDPS_PREFAULT", "1") != "0"


def can_populate() -> bool:
    """Whether ``populate`` makes pages here (Linux 5.14 and later; not with ``SHARDPS_PREFAULT=0``)."""
    return _populating


def populate(address: int, nbytes: int) -> bool:
    """Make the pages of ``[address, address + nbytes)``, within one of ``zeros``' own mappings, as a write to each
    would (zeroed where none was made yet; nothing in them changes). A write that comes later finds its page made:
    no fault, no zeroing on its path. False where it did nothing (a kernel without ``MADV_POPULATE_WRITE`` turns it
    off for the process)."""
    global _populating
    if not _populating or nbytes <= 0:
        return False
    lo = address // _PAGE * _PAGE
    hi = -(-(address + nbytes) // _PAGE) * _PAGE
    if _MADVISE(lo, hi - lo, _MADV_POPULATE_WRITE) == 0:  # type: ignore[misc]
        return True
    if ctypes.get_errno() == errno.EINVAL:  # advice unknown to this kernel
        _populating = False
    return False


_jobs: collections.deque[Callable[[], bool]] = collections.deque()
_jobs_ready = threading.Condition()
_worker: Optional[threading.Thread] = None


def in_background(step: Callable[[], bool]) -> None:
    """Run ``step`` on the process's page-making thread (started on first use, a daemon) until it returns False: one
    step at a time, jobs in turn, so that one holds no lock of its caller for long."""
    global _worker
    with _jobs_ready:
        _jobs.append(step)
        if _worker is None:
            _worker = threading.Thread(target=_work, name="shardps-pages-ahead", daemon=True)
            _worker.start()
        _jobs_ready.notify()


def _work() -> None:
    while True:
        with _jobs_ready:
            while not _jobs:
                _jobs_ready.wait()
            step = _jobs.popleft()
        try:
            again = step()
        except Exception:  # noqa: BLE001 - making pages ahead is only ever an optimisation
            log.exception("making pages ahead failed")
            again = False
        if again:
            with _jobs_ready:
                _jobs.append(step)
