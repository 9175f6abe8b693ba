"""``python -m shardps.core.kernels``: compile (or load from the cache) every kernel ahead of time."""

import time

from shardps.core.kernels import describe, warm_up

t0 = time.perf_counter()
warm_up()
print(f"shardps kernels: {describe()}, ready in {time.perf_counter() - t0:.1f} s")
