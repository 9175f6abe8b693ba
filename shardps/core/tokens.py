"""Where a client-side tool finds its bearer token: never on a command line (``ps`` shows those)."""

from __future__ import annotations

import os
import pathlib
from typing import Optional


def token_from_environment() -> Optional[str]:
    """The token in the file SHARDPS_TOKEN_FILE names, else SHARDPS_TOKEN, else None."""
    path = os.environ.get("SHARDPS_TOKEN_FILE")
    if path:
        return pathlib.Path(path).read_text().strip()
    return os.environ.get("SHARDPS_TOKEN") or None
