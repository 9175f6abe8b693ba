"""Constants the kernels and their numpy references share: the id-mixing hash's (SplitMix64's finalizer),
sampled eviction's and the normal initializer's ziggurat. A leaf module: it imports only numpy."""

from __future__ import annotations

import math

import numpy as np

# SplitMix64's increment and finalizer multipliers (the routing hash, ``routing.mix64``).
SPLITMIX_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SPLITMIX_M1 = np.uint64(0xBF58476D1CE4E5B9)
SPLITMIX_M2 = np.uint64(0x94D049BB133111EB)

# Sampled eviction (``bounded.sampled_victims``): draws per victim at most, in units of the sample (a victim drawn
# among rows mostly of the current request, or chosen already, draws on until ``sample`` usable ones are seen).
VICTIM_DRAWS = 16


# ---- the normal initializer's ziggurat (shared by the reference and the kernel) ------

ZIGGURAT_R = 3.6541528853610088  # where the base layer's tail starts
ZIG_ATTEMPTS = 1 << 20  # draws per value before giving up (the chance of getting there is nil)


def ziggurat_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 256-layer ziggurat for the standard normal (Marsaglia and Tsang, 2000), for 52-bit magnitudes.

    ``k[i]``: magnitudes below it are inside layer i's rectangle (accepted at
    once); ``w[i]``: magnitude -> x; ``f[i]``: the density at layer i's edge.
    Built once per process, in float64, for the reference and the kernel alike.
    """
    k = np.zeros(256, dtype=np.uint64)
    w = np.zeros(256, dtype=np.float64)
    f = np.zeros(256, dtype=np.float64)
    m = 2.0**52
    dn = tn = ZIGGURAT_R
    vn = 0.00492867323399
    q = vn / math.exp(-0.5 * dn * dn)
    k[0] = np.uint64((dn / q) * m)
    k[1] = 0
    w[0] = q / m
    w[255] = dn / m
    f[0] = 1.0
    f[255] = math.exp(-0.5 * dn * dn)
    for i in range(254, 0, -1):
        dn = math.sqrt(-2.0 * math.log(vn / dn + math.exp(-0.5 * dn * dn)))
        k[i + 1] = np.uint64((dn / tn) * m)
        tn = dn
        f[i] = math.exp(-0.5 * dn * dn)
        w[i] = dn / m
    return k, w, f


ZIG_K, ZIG_W, ZIG_F = ziggurat_tables()
