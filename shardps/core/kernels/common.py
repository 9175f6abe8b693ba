"""What the kernel modules (``loops``, ``disk_loops``, ``id_loops``) share: the compile options, and the id-mixing
hash."""

from __future__ import annotations

import numba
import numpy as np

from shardps.core.kernels.constants import SPLITMIX_GOLDEN as _GOLDEN
from shardps.core.kernels.constants import SPLITMIX_M1 as _M1
from shardps.core.kernels.constants import SPLITMIX_M2 as _M2


def kernel(fn):  # type: ignore[no-untyped-def]
    """A kernel: compiled by numba, cached on disk, the GIL released, numpy's error model."""
    return numba.njit(cache=True, nogil=True, error_model="numpy")(fn)


# ---- hashing (the same splitmix64 as routing.mix64) -----------------------------------

_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@kernel
def mix(x: np.uint64, seed: np.uint64) -> np.uint64:
    z = x ^ seed
    z = z + _GOLDEN
    z = z ^ (z >> _S30)
    z = z * _M1
    z = z ^ (z >> _S27)
    z = z * _M2
    return z ^ (z >> _S31)
