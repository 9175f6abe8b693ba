"""Calls a shard makes to another shard (a backup following its primary, a target asking its source how a slot
migration ended): a channel authenticated as every client-side tool is, with TLS from ``SHARDPS_TLS_CA`` /
``SHARDPS_TLS_CLIENT_CERT`` / ``SHARDPS_TLS_CLIENT_KEY`` and the admin token in ``SHARDPS_TOKEN_FILE`` or
``SHARDPS_TOKEN`` (a tokens file keeps only digests: a shard cannot use the tokens it checks)."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Optional

import grpc

from shardps.core.tokens import bearer, token_from_environment

MAX_MESSAGE = 64 << 20


def channel(address: str, max_message: int = MAX_MESSAGE) -> grpc.Channel:
    """A channel to another shard at ``address``."""
    options = [("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", max_message)]
    ca = os.environ.get("SHARDPS_TLS_CA")
    if not ca:
        return grpc.insecure_channel(address, options=options)
    read = lambda v: pathlib.Path(os.environ[v]).read_bytes() if os.environ.get(v) else None  # noqa: E731
    creds = grpc.ssl_channel_credentials(pathlib.Path(ca).read_bytes(), read("SHARDPS_TLS_CLIENT_KEY"),
                                         read("SHARDPS_TLS_CLIENT_CERT"))
    return grpc.secure_channel(address, creds, options=options)


def metadata() -> Optional[Any]:
    """The call metadata of an outbound call: the token, when there is one."""
    token = token_from_environment()
    return bearer(token) if token else None
