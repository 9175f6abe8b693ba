"""Defaults a new user gets without asking: torch's intra-op threads when the shards share the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import running_cluster

PROBE = """
import json, sys, torch
from shardps_client import Client
default = torch.get_num_threads()
before = {before}
if before:
    torch.set_num_threads(before)
kwargs = json.loads(sys.argv[2])
with Client(json.loads(sys.argv[1]), **kwargs):
    print(json.dumps([default, torch.get_num_threads()]))
"""


def _threads(addresses: list[str], env_extra: dict | None = None, before: int = 0, **kwargs) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before), json.dumps(addresses), json.dumps(kwargs)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    default, after = json.loads(out.stdout.strip().splitlines()[-1])
    return default, after


def test_local_shards_get_the_cores_torch_would_spin_on():
    with running_cluster(1) as servers:
        addresses = [s.address for s in servers]
        default, after = _threads(addresses)
        assert after == min(default, max(1, (os.cpu_count() or 1) - 1))
        # the user's choices win: torch_threads=None, an explicit count, OMP_NUM_THREADS, set_num_threads before
        assert _threads(addresses, torch_threads=None) == (default, default)
        assert _threads(addresses, torch_threads=3)[1] == 3
        assert _threads(addresses, env_extra={"OMP_NUM_THREADS": "2"})[1] == 2
        assert _threads(addresses, before=3)[1] == 3


def test_remote_addresses_leave_torch_alone():
    """No shard on a loopback address: the cores are not the shards' (the probe makes no call)."""
    default, after = _threads(["shard-0.invalid:7000"], check_shard_map=False)
    assert after == default


@pytest.mark.parametrize("bad", [0, -1, "many", True])
def test_bad_torch_threads_is_refused(bad):
    from shardps_client import Client, InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="torch_threads"):
        Client(["127.0.0.1:1"], torch_threads=bad, check_shard_map=False)
