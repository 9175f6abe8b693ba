"""Exceptions raised by the client; each names the shard address involved."""

from __future__ import annotations

from typing import Optional

import grpc

from shardps.core import status


class ShardpsError(Exception):
    """Base class of client errors.

    Attributes:
        address: the shard's address, when one shard is involved.
        code: the gRPC status code, when the error came from a shard.
    """

    def __init__(self, message: str, address: Optional[str] = None, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        self.address = address
        self.code = code


class InvalidArgumentError(ShardpsError, ValueError):
    """Wrong dims, dtypes or shapes, non-finite gradients, empty requests."""


class TableNotFoundError(ShardpsError, KeyError):
    """Unknown table or dense tensor."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class TableExistsError(ShardpsError):
    """A table or dense tensor exists with a different spec."""


class IdOutOfRangeError(ShardpsError, IndexError):
    """Ids outside [0, num_embeddings) of a fixed table, or negative."""


class ShardMapError(ShardpsError):
    """The address list does not match the shards' (index, count), or an id reached the wrong shard."""


class StaleUpdateError(ShardpsError):
    """A push was staler than the table's max_staleness and was rejected."""


class SyncStepError(ShardpsError):
    """A synchronous step failed because workers were missing (straggler policy "fail")."""


class RequestTooLargeError(ShardpsError):
    """A request or reply exceeded a message size limit, or a shard's limit (memory budget, tables, rows,
    ids per request, workers: ``shardps serve --max-*``)."""


class ShardUnavailableError(ShardpsError):
    """A shard could not be reached within the retry window."""


class ShardTimeoutError(ShardpsError):
    """A call did not finish within its deadline."""


# Each kind of the status table (shardps.core.status), carried as data by the shard.
_BY_KIND: dict[str, type] = {s.kind: globals()[s.client_error] for s in status.TABLE}
# Without a kind (an older shard, or a status gRPC itself produced), by code: the table's first kind of
# that code, and the codes only gRPC produces.
_BY_CODE: dict[grpc.StatusCode, type] = {grpc.StatusCode.DEADLINE_EXCEEDED: ShardTimeoutError}
for _s in status.TABLE:
    _BY_CODE.setdefault(grpc.StatusCode[_s.code], _BY_KIND[_s.kind])


def from_rpc_error(e: grpc.RpcError, address: str, what: str) -> ShardpsError:
    """Translate a gRPC error of call ``what`` to ``address`` into a client exception."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    kind = next((v for k, v in trailing or () if k == status.KIND_METADATA), "")
    return _error(code, details, address, what, kind)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def from_status(code: int, details: str, address: str, what: str, kind: str = "") -> ShardpsError:
    """The client exception of a status carried in a message (a StreamError of a call stream)."""
    return _error(_CODES.get(code, grpc.StatusCode.UNKNOWN), details, address, what, kind)


def _error(code: grpc.StatusCode, details: str, address: str, what: str, kind: str = "") -> ShardpsError:
    cls = _BY_KIND.get(kind) or _BY_CODE.get(code, ShardpsError)
    return cls(f"{what} to shard at {address} failed ({code.name}): {details}", address=address, code=code)
