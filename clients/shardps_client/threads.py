"""torch's intra-op threads when shards share this host (``Client(torch_threads=...)``)."""

from __future__ import annotations

import logging
import os
from typing import Sequence, Union

import torch

from shardps_client.errors import InvalidArgumentError

log = logging.getLogger(__name__)

_TORCH_DEFAULT_THREADS = torch.get_num_threads()  # at import: a later change is the user's choice
_LOOPBACK = ("127.", "localhost:", "[::1]:", "::1")


def set_torch_threads(setting: Union[int, str, None], addresses: Sequence[str]) -> None:
    """Apply ``Client(torch_threads=...)`` (see its docstring)."""
    if setting is None:
        return
    if isinstance(setting, bool) or not (setting == "auto" or isinstance(setting, int)):
        raise InvalidArgumentError(f"torch_threads must be 'auto', a positive int or None, got {setting!r}")
    if isinstance(setting, int):
        if setting < 1:
            raise InvalidArgumentError(f"torch_threads must be >= 1, got {setting}")
        torch.set_num_threads(setting)
        return
    local = sum(1 for a in addresses if a.startswith(_LOOPBACK))
    current = torch.get_num_threads()
    if not local or os.environ.get("OMP_NUM_THREADS") or current != _TORCH_DEFAULT_THREADS:
        return
    threads = max(1, (os.cpu_count() or 1) - local)
    if threads < current:
        torch.set_num_threads(threads)
        log.info("%d shard(s) run on this host: torch uses %d intra-op thread(s), not %d, so its idle threads "
                 "do not spin on the shards' cores (Client(torch_threads=None) leaves torch alone)",
                 local, threads, current)
