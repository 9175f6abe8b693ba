"""A small training job run as its own process by the fault tests.

Usage: python -m tests.trainer_job ADDR,ADDR,... STEPS PROGRESS_FILE [SEED]

Pulls a batch of rows, pushes a gradient of ones (SGD, lr 1), STEPS times,
asynchronously with a flush every 5 steps, writing the step it reached to
PROGRESS_FILE. Exits 0 when all steps are applied.
"""

from __future__ import annotations

import os
import sys

import torch
from shardps_client import SGD, Client

from shardps.core.specs import Initializer


def main() -> int:
    addresses, steps, progress = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    gen = torch.Generator().manual_seed(seed)
    with Client(addresses, timeout=10, retry_timeout=60) as c:
        c.create_table("job", dim=8, num_embeddings=10_000, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        for step in range(1, steps + 1):
            ids = torch.randint(0, 10_000, (256,), generator=gen)
            rows = c.pull("job", ids)
            c.push("job", ids, torch.ones_like(rows))
            if step % 5 == 0:
                c.flush()
                _report(progress, str(step))
        c.flush()
    _report(progress, f"done {steps}")
    return 0


def _report(path: str, text: str) -> None:
    """Replace the progress file whole: a reader never sees it truncated, between an open for writing and the write
    (the test that polls it once read it empty there, and failed)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
