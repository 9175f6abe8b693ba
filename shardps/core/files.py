"""File-system helpers shared by checkpoints (shards) and exports (shards, clients, tools)."""

from __future__ import annotations

import os
import pathlib


def fsync_dir(d: pathlib.Path) -> None:
    """Make a directory's entries (a file renamed into it) survive a crash."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
