"""Compiled per-row kernels: the hot loops of shards and clients, compiled with numba.

Every kernel (in ``shardps.core.kernels.loops``) has a plain-numpy reference, the
readable definition, next to the code that calls it: ``routing.shard_of_ids``
and ``split_by_shard``, ``SlotMap.all_owned`` (a request's ids in range and this shard's),
``ids.is_sorted_unique``, ``HashIndex.lookup`` and ``insert``,
``Initializer.rows``, each optimizer's ``step``, ``ids.coalesce``, and the rows a client
moves into a push's message and out of a pull's answer (``wire._Rows.write``,
``planner.assemble_rows``: numpy's take and fancy assignment).
Constants both sides share are in ``constants``.
``tests/test_kernels.py`` checks that each pair agrees bit for bit. Callers
ask ``kernels.jit()`` for the compiled module, which is None when the
references serve.

- ``SHARDPS_KERNELS``: ``auto`` (the default: the kernels compiled ahead of
  time where ``python -m shardps.core.kernels`` built them, else numba's; the
  references when numba is missing), ``aot`` (the ahead-of-time module; an
  error when it is missing or stale), ``numba`` (numba's kernels, compiled or
  loaded from its cache at run time; an error if numba is missing) or ``numpy``
  (the references: no compiler, slower; useful to rule the kernels out).
- ``aot``: the same functions compiled ahead of time into an extension module,
  so a process (a shard) that runs them never imports numba: 0.5 s of CPU less
  at each start. Calls with types it was not compiled for run numba's kernel.
- The kernels (and numba, where its kernels serve) are loaded on first use,
  not at import, so the command-line tools (``shardps health``) start without
  them.
- Kernels release the GIL (``nogil``), so a shard's other gRPC threads decode
  and encode while one applies a push.
- Machine code is cached on disk (numba's ``cache=True``): in ``__pycache__``
  next to ``loops.py``, or under ``NUMBA_CACHE_DIR`` / the user's cache
  directory where that is read-only. ``python -m shardps.core.kernels``
  builds the ahead-of-time module (about 10 s) and fills that cache (the
  Docker images do at build time): about 6 s with an empty cache, 0.5 s of
  CPU to load the kernels from it in each process.
- Floating-point code keeps the reference's operation order and precision
  (float64 where the reference rounds once to float32, float32 elsewhere) and
  no fast-math, so results are the reference's to the bit.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from types import ModuleType
from typing import Any, Optional

import numpy as np

_MODE = os.environ.get("SHARDPS_KERNELS", "auto").strip().lower() or "auto"
if _MODE not in ("auto", "aot", "numba", "numpy"):
    raise ValueError(f"SHARDPS_KERNELS must be auto, aot, numba or numpy, got {_MODE!r}")
HAVE_NUMBA = importlib.util.find_spec("numba") is not None
if _MODE in ("aot", "numba") and not HAVE_NUMBA:
    raise ImportError(f"SHARDPS_KERNELS={_MODE}, but numba is not installed (pip install numba)")
ENABLED = HAVE_NUMBA and _MODE != "numpy"

_module: Optional[Any] = None
_numba: Optional[ModuleType] = None
_aot_missing = ""  # why the ahead-of-time module does not serve ("" when it does or was not asked for)
_lock = threading.RLock()  # re-entered: jit() holds it while it may call numba_kernels()


def numba_kernels() -> ModuleType:
    """numba's kernels (``shardps.core.kernels.loops``), imported on first call."""
    global _numba
    if _numba is None:
        with _lock:
            if _numba is None:
                from shardps.core.kernels import loops

                _numba = loops
    return _numba


def jit() -> Optional[Any]:
    """The compiled kernels, loaded on first call: the ahead-of-time module's (``aot.Kernels``) where it is built
    and current (unless ``SHARDPS_KERNELS=numba``), else numba's (``loops``); None when disabled."""
    global _module, _aot_missing
    if not ENABLED:
        return None
    if _module is None:
        with _lock:
            if _module is None:
                module: Optional[Any] = None
                if _MODE != "numba":
                    from shardps.core.kernels import aot

                    module, _aot_missing = aot.load(numba_kernels)
                    if module is None and _MODE == "aot":
                        raise ImportError(f"SHARDPS_KERNELS=aot, but {_aot_missing}")
                _module = module if module is not None else numba_kernels()
    return _module


def without_scipy() -> None:
    """For a process whose only compiled code is these kernels (a shard server): numba's first compile or cache
    load probes for a BLAS by importing ``scipy.linalg`` when scipy is installed, about 0.3 s of CPU, a fifth of a
    shard's start on 2 cores. The kernels call no BLAS and a shard uses no scipy: scipy is marked absent (unless
    something loaded it already), so the probe finds none at once."""
    if "scipy" not in sys.modules:
        sys.modules["scipy"] = None  # type: ignore[assignment]


def describe() -> str:
    """Which implementation serves, for logs."""
    if ENABLED:
        k = jit()
        if k is not _numba:
            return "compiled ahead of time (numba's pycc)"
        import numba

        return f"numba {numba.__version__}" + (f" ({_aot_missing})" if _aot_missing else "")
    return "numpy (SHARDPS_KERNELS=numpy)" if HAVE_NUMBA else "numpy (numba not installed)"


from shardps.core.kernels.constants import ZIG_ATTEMPTS, ZIG_F, ZIG_K, ZIG_W, ZIGGURAT_R  # noqa: E402, F401 (re-exported)

# ---- ahead-of-time compilation -------------------------------------------------------


def warm_up(client: bool = True, k: Optional[Any] = None) -> None:
    """Compile (or load from the cache) every kernel for the types the callers pass; without ``client``, those a
    shard uses (a shard's start leaves out the client's moves of rows into and out of messages). ``k``: the kernels
    to call (default ``jit()``; with the ahead-of-time module, nothing is compiled or loaded beyond it)."""
    k = jit() if k is None else k
    if k is None:
        return
    seed = np.uint64(1)
    ids = np.arange(4, dtype=np.int64)
    k.split_by_shard(ids, 2, seed)
    k.shard_of_ids(ids, 2, seed)
    owners = np.zeros(1 << 14, np.int16)
    k.owner_by_map(ids, owners, 2, seed)
    k.split_by_map(ids, owners, 2, 2, seed)
    k.all_owned(ids, 4, owners, 2, seed, 0)
    k.strictly_increasing(ids)
    k.unique_inverse(ids)
    table = np.full(16, -1, np.int32)
    k.hash_place(table, ids, ids, seed)
    k.hash_lookup(table, ids, ids, seed)
    k.hash_remove(table, ids.copy(), 4, ids[:1], seed)
    k.direct_remove(np.arange(4, dtype=np.int32), ids.copy(), 4, ids[:1])
    moves = np.array([[3, 0]], np.int64)
    for dtype in (np.float32, np.int32, np.int64, np.uint32, np.uint8):  # a table's per-row arrays (1-D: [n, 1])
        k.apply_moves(np.zeros((4, 3 if dtype == np.float32 else 1), dtype), moves)
    k.normal_rows(ids, 3, seed, seed, 0.0, 1.0, ZIG_K, ZIG_W, ZIG_F)
    rows = np.zeros((4, 3), np.float32)
    g = np.ones((4, 3), np.float32)
    f32 = np.float32(0.5)
    k.sgd_apply(rows, rows.copy(), ids, np.ones(4, np.bool_), g, -0.1, False, 0.0, False, 0.0, f32, 1.0, False)
    k.adagrad_apply(rows, rows.copy(), ids, np.ones(4, np.float32), g, False, 0.0, f32)
    k.adam_apply(rows, rows.copy(), rows.copy(), ids, np.ones(4, np.float32), np.ones(4, np.float32), g, False,
                 0.0, f32, f32, f32, f32)
    k.sum_runs(g, ids, np.array([0, 2], np.int64))
    k.all_finite(g)
    fd = os.open(os.devnull, os.O_RDONLY)  # (reads nothing: compiled all the same)
    try:
        k.pread_records(np.full(4, fd, np.int32), ids, 4, 0, 4, np.zeros(16, np.uint8))
    finally:
        os.close(fd)
    if not client:
        return
    # Rows into and out of messages: their views sit at any offset of a buffer (numba types those unaligned).
    raw = np.zeros(4 * 3 * 4 + 1, np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(4, 3)
    for view in (rows, unaligned):
        k.gather_rows(g, ids, view)
        k.scatter_rows(rows, ids, view)
        received = view.view()
        received.setflags(write=False)  # a view of a received message is read-only
        k.scatter_rows(rows, ids, received)
