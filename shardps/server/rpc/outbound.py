"""Calls a shard makes to another shard (a backup following its primary, a target asking its source how a slot
migration ended): a channel authenticated as every client-side tool is, with TLS from ``SHARDPS_TLS_CA`` /
``SHARDPS_TLS_CLIENT_CERT`` / ``SHARDPS_TLS_CLIENT_KEY`` and the admin token in ``SHARDPS_TOKEN_FILE`` or
``SHARDPS_TOKEN`` (a tokens file keeps only digests: a shard cannot use the tokens it checks)."""

from __future__ import annotations

import os
from typing import Any, Optional

import grpc

from shardps import probe
from shardps.core.tokens import bearer, token_from_environment

MAX_MESSAGE = 64 << 20


def channel(address: str, max_message: int = MAX_MESSAGE) -> grpc.Channel:
    """A channel to another shard at ``address``."""
    return probe.channel(address, os.environ.get("SHARDPS_TLS_CA"), os.environ.get("SHARDPS_TLS_CLIENT_CERT"),
                         os.environ.get("SHARDPS_TLS_CLIENT_KEY"),
                         [("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", max_message)])


def metadata() -> Optional[Any]:
    """The call metadata of an outbound call: the token, when there is one."""
    token = token_from_environment()
    return bearer(token) if token else None
