"""torch's intra-op threads when shards share this machine (``Client(torch_threads=...)``)."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence, Union

import torch

from shardps.core import protocol
from shardps_client.errors import InvalidArgumentError

log = logging.getLogger(__name__)

_TORCH_DEFAULT_THREADS = torch.get_num_threads()  # at import: a later change is the user's choice
_LOOPBACK = ("127.", "localhost:", "[::1]:", "::1")


def check_setting(setting: Union[int, str, None]) -> None:
    """Refuse a ``Client(torch_threads=...)`` that is not "auto", a positive int or None (before any call)."""
    if setting is None:
        return
    if isinstance(setting, bool) or not (setting == "auto" or isinstance(setting, int)):
        raise InvalidArgumentError(f"torch_threads must be 'auto', a positive int or None, got {setting!r}")
    if isinstance(setting, int) and setting < 1:
        raise InvalidArgumentError(f"torch_threads must be >= 1, got {setting}")


def set_torch_threads(setting: Union[int, str, None], addresses: Sequence[str],
                      infos: Sequence[Optional[Any]] = ()) -> None:
    """Apply ``Client(torch_threads=...)`` (see its docstring; ``check_setting`` passed it); ``infos``: the shards'
    ``ShardInfo`` where the client asked for them (``local_shards``)."""
    if setting is None:
        return
    if isinstance(setting, int):
        torch.set_num_threads(setting)
        return
    local = local_shards(addresses, infos)
    current = torch.get_num_threads()
    if not local or os.environ.get("OMP_NUM_THREADS") or current != _TORCH_DEFAULT_THREADS:
        return
    threads = max(1, (os.cpu_count() or 1) - local)
    if threads < current:
        torch.set_num_threads(threads)
        log.info("%d shard(s) run on this machine: torch uses %d intra-op thread(s), not %d, so its idle threads "
                 "do not spin on the shards' cores (Client(torch_threads=None) leaves torch alone)",
                 local, threads, current)


def local_shards(addresses: Sequence[str], infos: Sequence[Optional[Any]] = ()) -> int:
    """How many shards run on this machine: at a loopback address, or (their ``ShardInfo.local_scope``) under
    this machine's kernel (the same boot id) in another network namespace or container, where they share its
    cores all the same. A shard on a machine of its own does not count."""
    boot = protocol.local_scope().split("/", 1)[0]
    count = 0
    for i, address in enumerate(addresses):
        info = infos[i] if i < len(infos) else None
        scope = getattr(info, "local_scope", "") if info is not None else ""
        if address.startswith(_LOOPBACK) or (boot and scope.split("/", 1)[0] == boot):
            count += 1
    return count
