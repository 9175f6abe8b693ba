"""One campaign client: a process on the lab's control host pushing +1s through a default ``Client`` (its retries,
failovers and exactly-once resends are what the campaign tests), one operation at a time, recording its history.

Operation k of client c adds 1 to its own row (``own_row``: no other operation touches it) and to ``SHARED_PER_OP``
rows drawn from ``shared`` hot rows, with SGD at lr 1 on a zeros table (a push of -1 adds exactly 1). It ends an
operation ``ok`` when the push is acknowledged, ``fail`` when the client's error says it was refused before
anything was applied (a bad request), ``info`` (unknown) on anything else: a timeout, a shard unavailable after
the client's retries, a primary that could not confirm it may acknowledge (it may have applied it).

    python -m tests.chaos.workload CLUSTER_FILE HISTORY CLIENT_INDEX SEED STOP_FILE [GAP_S]

GAP_S: seconds between operations (0: back to back; the short run's 0.02 keeps a stall measured to 20 ms at a
fraction of the CPU).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import numpy as np

TABLE = "chaos"
SHARED = 256  # the hot rows every operation adds to a few of
SHARED_PER_OP = 3
OPS_PER_CLIENT = 1 << 20  # own rows reserved per client
MAX_CLIENTS = 16
ROWS = SHARED + MAX_CLIENTS * OPS_PER_CLIENT


def own_row(client: int, k: int) -> int:
    return SHARED + client * OPS_PER_CLIENT + k


def shards_of(client, ids: list[int]) -> list[int]:
    """The shards the rows of ``ids`` live on by the client's slot map now (during a live reshard, a spare group
    that took slots: a hash over the groups the cluster started with would never name it)."""
    return sorted(set(client.shards_of(ids).tolist()))


def create_table(cluster_file: str) -> None:
    from shardps_client import SGD, Client, Initializer

    with Client.from_file(cluster_file) as c:
        c.create_table(TABLE, num_embeddings=ROWS, dim=1, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))


def main(argv: list[str]) -> int:
    cluster_file, history, index, seed, stop_file = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    gap_s = float(argv[5]) if len(argv) > 5 else 0.0
    import logging

    import torch
    from shardps_client import Client
    from shardps_client.errors import InvalidArgumentError, TableNotFoundError

    from tests.chaos.history import Recorder

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("shardps_client.transport").setLevel(logging.DEBUG)
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    name = f"c{index}"
    rec = Recorder(pathlib.Path(history), name)
    with Client.from_file(cluster_file, client_id=f"chaos-{name}-{os.getpid()}") as c:
        k = 0
        while not os.path.exists(stop_file) and k < OPS_PER_CLIENT:
            ids = [own_row(index, k), *rng.choice(SHARED, size=SHARED_PER_OP, replace=False).tolist()]
            rec.invoke(k, ids, shards_of(c, ids))
            outcome, error = "ok", ""
            try:
                c.push(TABLE, torch.tensor(ids), torch.full((len(ids), 1), -1.0), wait=True)
            except (InvalidArgumentError, TableNotFoundError) as e:  # refused before anything was applied
                outcome, error = "fail", f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - anything else may have been applied: unknown
                outcome, error = "info", f"{type(e).__name__}: {e}"
            rec.complete(k, outcome, error, shards_of(c, ids))
            k += 1
            if gap_s:
                time.sleep(gap_s)
    rec.close()
    return 0


if __name__ == "__main__":
    time.sleep(0)  # (a module run as a program: python -m tests.chaos.workload)
    sys.exit(main(sys.argv[1:]))
