"""``python -m shardps.core.kernels``: compile every kernel ahead of time. Builds the extension module of
``kernels.aot`` where a C compiler is installed (skipped when it is current, or with ``--no-aot``), then fills numba's
cache for the calls it was not compiled for (and for ``SHARDPS_KERNELS=numba``)."""

import argparse
import time

from shardps.core import kernels
from shardps.core.kernels import aot

parser = argparse.ArgumentParser(prog="python -m shardps.core.kernels", description=__doc__)
parser.add_argument("--no-aot", action="store_true", help="only fill numba's cache")
parser.add_argument("--if-stale", action="store_true",
                    help="do nothing when the ahead-of-time module is built and current (without importing numba)")
opts = parser.parse_args()
if not kernels.ENABLED:
    print(f"shardps kernels: {kernels.describe()}: nothing to compile")
    raise SystemExit(0)
t0 = time.perf_counter()
current = aot.load(kernels.numba_kernels)[0] is not None
if opts.if_stale and current:
    print(f"shardps kernels: {aot.path().name} is current")
    raise SystemExit(0)
if not opts.no_aot and not current:
    if aot.compiler() is None:
        print("shardps kernels: no C compiler (cc): not compiled ahead of time; numba's cache serves")
    else:
        try:
            print(f"shardps kernels: built {aot.build().name} in {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001 - pycc gone from numba, no Python.h, a read-only package: numba serves
            print(f"shardps kernels: not compiled ahead of time ({type(e).__name__}: {e}); numba's cache serves")
t1 = time.perf_counter()
kernels.warm_up(k=kernels.numba_kernels())
print(f"shardps kernels: numba's cache filled in {time.perf_counter() - t1:.1f} s")
