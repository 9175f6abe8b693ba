"""Bearer tokens on the wire (``authorization: Bearer <token>`` call metadata), and where a
client-side tool finds its token: never on a command line (``ps`` shows those)."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Iterable, Optional

AUTHORIZATION = "authorization"
_BEARER = "Bearer "


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token``."""
    return ((AUTHORIZATION, _BEARER + token),)


def token_of(metadata: Optional[Iterable[tuple[str, Any]]]) -> Optional[str]:
    """The bearer token of a call's metadata (None: none, or not a bearer token)."""
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            return value[len(_BEARER):] if value.startswith(_BEARER) else None
    return None


def token_from_environment() -> Optional[str]:
    """The token in the file SHARDPS_TOKEN_FILE names, else SHARDPS_TOKEN, else None."""
    path = os.environ.get("SHARDPS_TOKEN_FILE")
    if path:
        return pathlib.Path(path).read_text().strip()
    return os.environ.get("SHARDPS_TOKEN") or None
