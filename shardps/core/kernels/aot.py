"""The kernels compiled ahead of time into an extension module, so a process that runs them never imports numba.

Importing numba and loading the kernels from its cache costs a shard about 0.5 s of CPU at every start, half of its
start (``docs/performance.md``). ``build`` compiles the same functions (``loops``) with numba's ahead-of-time
compiler (``numba.pycc``) into ``_aot<extension suffix>`` beside this file, for the argument types listed in
``EXPORTS``; ``load`` imports it in under a millisecond. ``python -m shardps.core.kernels`` (``make setup``) builds it
where a C compiler is installed; elsewhere (the Docker images) the kernels run from numba's cache as before.

A compiled entry point trusts its arguments' types: handed an int32 array where it was compiled for int64, it reads
past the array. So each kernel here is a Python function that calls the compiled code only when every argument is
of an exported type (dtype, number of dimensions, C order, aligned and writeable where the kernel writes, scalars
of the type numba would infer), and otherwise the numba kernel, imported then (what ``SHARDPS_KERNELS=numba`` always
runs): the two agree for every input, to the bit. An array the kernel only reads is compiled for any alignment and,
unless ``EXPORTS`` gives it any strides (a field of a table's records), copied to C order first where it is not (the
same result, unless it were a strided view of an array the same call writes: no caller passes one).

The module is built with the kernels' own options: the GIL released during each call (``nogil``) and numpy's error
model (a float division by zero gives inf or NaN, not an exception), for this machine's CPU as numba compiles.
``fingerprint`` (a hash of the kernels' source, of ``EXPORTS``, of numpy's, numba's and llvmlite's versions and of
the CPU's model and flags)
is compiled into it, and ``load`` refuses a module built from other sources or for another CPU: edit a kernel
(or copy the environment to another machine) and numba's kernels serve until the next build.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import os
import pathlib
import platform
import shutil
import sysconfig
import tempfile
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
MODULE = "_aot"

# The argument types each kernel is compiled for (numba's type names; arrays C-ordered). These are the types the
# callers pass (``warm_up`` calls each once); a call with any other types runs the numba kernel instead. Arrays a
# kernel only reads are compiled for any alignment: ids and gradients are views at any offset of a received message,
# a push's rows gathered into one at any offset (``gather_rows``'s destination, which it writes, is the same).
_IDS, _ROWS = "int64[::1]", "float32[:, ::1]"
EXPORTS: dict[str, list[tuple[str, ...]]] = {
    "shard_of_ids": [(_IDS, "int64", "uint64")],
    "split_by_shard": [(_IDS, "int64", "uint64")],
    "owner_by_map": [(_IDS, "int16[::1]", "int64", "uint64")],
    "split_by_map": [(_IDS, "int16[::1]", "int64", "int64", "uint64")],
    "all_owned": [(_IDS, "int64", "int16[::1]", "int64", "uint64", "int64")],
    "strictly_increasing": [(_IDS,)],
    "unique_inverse": [(_IDS,)],
    "hash_lookup": [("int32[::1]", _IDS, _IDS, "uint64")],
    "hash_place": [("int32[::1]", _IDS, _IDS, "uint64")],
    "hash_remove": [("int32[::1]", _IDS, "int64", _IDS, "uint64")],
    "direct_remove": [("int32[::1]", _IDS, "int64", _IDS)],
    # A table's per-row arrays: rows, and 1-D ones (versions, slots, ids, eviction counts) as [n, 1].
    "apply_moves": [(f"{t}[:, ::1]", "int64[:, ::1]") for t in ("float32", "int32", "int64", "uint32", "uint8")],
    "touch_rows": [("int32[:, ::1]", "int64[:, ::1]", _IDS, "int32[::1]", "int64", "int64")],
    "normal_rows": [(_IDS, "int64", "uint64", "uint64", "float64", "float64", "uint64[::1]", "float64[::1]",
                     "float64[::1]")],
    "sgd_apply": [(_ROWS, _ROWS, _IDS, "boolean[::1]", _ROWS, "float64", "boolean", "float64", "boolean", "float64",
                   "float32", "float64", "boolean")],
    "adagrad_apply": [(_ROWS, _ROWS, _IDS, "float32[::1]", _ROWS, "boolean", "float64", "float32")],
    "adam_apply": [(_ROWS, _ROWS, _ROWS, _IDS, "float32[::1]", "float32[::1]", _ROWS, "boolean", "float64", "float32",
                    "float32", "float32", "float32")],
    "sum_runs": [(_ROWS, _IDS, _IDS)],
    "gather_rows": [(_ROWS, _IDS, _ROWS)],
    "scatter_rows": [(_ROWS, _IDS, _ROWS)],
    "all_finite": [(_ROWS,)],
    "pread_records": [("int32[::1]", _IDS, "int64", "int64", "int64", "uint8[::1]")],
    "sample_victims": [("int64[:]", "int32[:]", "int64", "int64", "uint64", "uint64", "int64", "boolean")],
    "clock_victims": [("int64[::1]", "int64", "int64", "int64", "int64[::1]")],
    "gather_words": [("uint32[:, ::1]", "int64", "int64", _IDS, "uint32[:, ::1]", "int64")],
    "scatter_words": [("uint32[:, ::1]", "int64", "int64", _IDS, "uint32[:, ::1]", "int64")],
}
# The arguments each kernel writes into (by position): these must be writeable and are never copied.
WRITES: dict[str, tuple[int, ...]] = {
    "hash_place": (0,), "hash_remove": (0, 1), "direct_remove": (0, 1), "apply_moves": (0,), "touch_rows": (0, 1),
    "sgd_apply": (0, 1),
    "adagrad_apply": (0, 1), "adam_apply": (0, 1, 2), "gather_rows": (2,), "scatter_rows": (0,),
    "pread_records": (5,), "clock_victims": (4,), "gather_words": (4,), "scatter_words": (0,),
}
# Of those, the ones that may sit at any alignment: a push's message, which ``gather_rows`` fills at any offset.
UNALIGNED_WRITES: dict[str, tuple[int, ...]] = {"gather_rows": (2,)}


def _cpu() -> bytes:
    """This machine's processor, as far as the compiled code depends on it: its model and instruction-set flags
    (the first processor's lines of /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = []
            for line in f:
                if not line.strip():
                    break
                if line.split(b":")[0].strip() in (b"vendor_id", b"model name", b"flags", b"Features", b"CPU part"):
                    lines.append(line)
            return b"".join(lines)
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def _unaligned(name: str, position: int) -> bool:
    """Whether the kernel's argument is compiled for any alignment: those it only reads, and a message's buffer."""
    return position not in WRITES.get(name, ()) or position in UNALIGNED_WRITES.get(name, ())


def fingerprint() -> int:
    """What the compiled module must have been built from and for: the kernels' source, ``EXPORTS``, numpy's, numba's
    and llvmlite's versions and this machine's processor (it is compiled for this CPU, as numba compiles)."""
    h = hashlib.sha256()
    for name in ("loops.py", "common.py", "disk_loops.py", "id_loops.py", "constants.py", "aot.py"):
        h.update((_HERE / name).read_bytes())
    h.update(np.__version__.encode())
    for dist in ("numba", "llvmlite"):  # the compiler (read from the installed metadata: numba is not imported)
        try:
            h.update(f"{dist} {importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            pass
    h.update(_cpu())
    return int(h.hexdigest()[:15], 16)


def path() -> pathlib.Path:
    return _HERE / (MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def compiler() -> Optional[str]:
    """The C compiler Python's build tools would use, when installed (the build links with it)."""
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def build() -> pathlib.Path:
    """Compile ``EXPORTS`` into the module beside this file (replaced in one rename, so a process that imports it
    meanwhile sees the old one or the new one). Needs numba and a C compiler; about 10 s."""
    if compiler() is None:
        raise RuntimeError("no C compiler (cc) found: the kernels run from numba's cache instead")
    stamp = fingerprint()  # before the kernels are imported: an edit in between fails safe (a stale stamp)
    from numba.core import codegen, sigutils, types
    from numba.pycc import CC
    from numba.pycc import compiler as pycc_compiler

    from shardps.core.kernels import loops

    def kernels_fingerprint() -> int:
        return stamp

    class KernelFlags(pycc_compiler.Flags):  # type: ignore[misc, name-defined]
        """The options ``loops._njit`` gives the kernels: the GIL released, numpy's error model."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.release_gil = True  # type: ignore[assignment]
            self.error_model = "numpy"  # type: ignore[assignment]

    with tempfile.TemporaryDirectory(dir=_HERE, prefix=".aot-build-") as tmp, _temporary_files_in(tmp):
        cc = CC(MODULE)
        cc.output_dir = tmp
        cc.verbose = False
        # This machine's CPU, as numba compiles: for the generic x86-64 target, SGD's push took 1.7x as long and the
        # normal initializer 2.6x. A module copied to another machine is refused there (its ``fingerprint``).
        cc.target_cpu = "host"
        for name, variants in EXPORTS.items():
            dispatcher = getattr(loops, name)
            for i, args in enumerate(variants):
                argtypes, _ = sigutils.normalize_signature(f"void({', '.join(args)})")
                argtypes = tuple(types.Array(t.dtype, t.ndim, t.layout, aligned=False)
                                 if isinstance(t, types.Array) and _unaligned(name, p) else t
                                 for p, t in enumerate(argtypes))
                dispatcher.compile(argtypes)  # the return type, as numba infers it
                sig = dispatcher.overloads[argtypes].signature
                cc.export(f"{name}__{i}", sig)(dispatcher.py_func)
        cc.export("fingerprint", "int64()")(kernels_fingerprint)
        saved = pycc_compiler.Flags, codegen.AOTCPUCodegen._customize_tm_features
        pycc_compiler.Flags = KernelFlags  # type: ignore[misc]
        # The host CPU's features as LLVM detects them, as numba's JIT uses: pycc names the CPU model only, which
        # implies features a virtual machine may hide (AVX-512 masked by a hypervisor: SIGILL, not an exception).
        codegen.AOTCPUCodegen._customize_tm_features = codegen.CPUCodegen._get_host_cpu_features  # type: ignore
        try:
            cc.compile()
        finally:
            pycc_compiler.Flags, codegen.AOTCPUCodegen._customize_tm_features = saved  # type: ignore[misc, method-assign]
        built = pathlib.Path(tmp) / path().name
        os.replace(built, path())
    return path()


@contextlib.contextmanager
def _temporary_files_in(directory: str) -> Iterator[None]:
    """Python's temporary files and directories made in ``directory`` meanwhile: the C compiler's probes (numba's
    pycc and distutils make ``temp.c`` and ``temp.o`` in directories of their own and leave them) go with the build."""
    saved, tempfile.tempdir = tempfile.tempdir, directory
    try:
        yield
    finally:
        tempfile.tempdir = saved


# ---- calling it ----------------------------------------------------------------------------------------------------


def _array_check(arg: str, code: str, written: bool, unaligned: bool) -> tuple[str, str]:
    """(condition, expression to pass) for one array argument of numba type ``code`` (like ``float32[:, ::1]``).
    dtypes compare with ``==``: numpy has more than one descriptor object of a dtype (torch's arrays bring theirs)."""
    dtype, dims = code.split("[", 1)
    ndim = dims.count(",") + 1
    cond = f"type({arg}) is _ndarray and {arg}.dtype == _dt_{dtype} and {arg}.ndim == {ndim}"
    if not unaligned:
        cond += f" and {arg}.flags.aligned"
    if written:
        return cond + f" and {arg}.flags.c_contiguous and {arg}.flags.writeable", arg
    if "::1" not in dims:  # compiled for any strides (a field of a table's records): passed as it is
        return cond, arg
    return cond, f"({arg} if {arg}.flags.c_contiguous else _copy_c({arg}))"


_SCALARS = {
    "int64": "(type({a}) is int and -9223372036854775808 <= {a} <= 9223372036854775807 or type({a}) is _np.int64)",
    "uint64": "type({a}) is _np.uint64",
    "float64": "(type({a}) is float or type({a}) is _np.float64)",
    "float32": "type({a}) is _np.float32",
    "boolean": "(type({a}) is bool or type({a}) is _np.bool_)",
}


def _dispatcher_source(name: str) -> str:
    """A Python function ``name(*args)`` calling the first exported variant whose types the arguments have, else
    the numba kernel."""
    variants = EXPORTS[name]
    n = len(variants[0])
    args = ", ".join(f"a{i}" for i in range(n))
    lines = [f"def {name}({args}):"]
    for v, types in enumerate(variants):
        conds, passed = [], []
        for i, code in enumerate(types):
            a = f"a{i}"
            if "[" in code:
                cond, expr = _array_check(a, code, i in WRITES.get(name, ()), _unaligned(name, i))
            else:
                cond, expr = _SCALARS[code].format(a=a), a
            conds.append(cond)
            passed.append(expr)
        lines.append(f"    if {' and '.join(conds)}:")
        lines.append(f"        return _compiled.{name}__{v}({', '.join(passed)})")
    lines.append(f"    return _numba().{name}({args})")
    return "\n".join(lines)


class Kernels:
    """The compiled module's kernels under the names ``loops`` has; any other name (and any call with other types)
    is the numba kernel's."""

    def __init__(self, compiled: ModuleType, numba: Callable[[], ModuleType]) -> None:
        self.compiled = compiled
        self._numba = numba
        space: dict[str, Any] = {"_compiled": compiled, "_numba": numba, "_ndarray": np.ndarray, "_np": np,
                                 "_copy_c": np.ascontiguousarray}
        for t in ("int16", "int32", "int64", "uint8", "uint32", "uint64", "float32", "float64"):
            space[f"_dt_{t}"] = np.dtype(t)
        space["_dt_boolean"] = np.dtype(np.bool_)
        for name in EXPORTS:
            exec(_dispatcher_source(name), space)  # noqa: S102 - source built above from EXPORTS, no input
            setattr(self, name, space[name])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._numba(), name)


def load(numba: Callable[[], ModuleType]) -> tuple[Optional[Kernels], str]:
    """(the kernels of the module beside this file, "") when it is there and was built from these sources; else
    (None, why not). ``numba()`` returns ``loops``, for the calls the module was not compiled for."""
    if not path().exists():
        return None, f"{path().name} not built"
    try:
        compiled = importlib.import_module(f"{__package__}.{MODULE}")
    except ImportError as e:
        return None, f"{path().name} does not load: {e}"
    if compiled.fingerprint() != fingerprint():
        return None, f"{path().name} was built from other sources (run python -m shardps.core.kernels)"
    return Kernels(compiled, numba), ""
