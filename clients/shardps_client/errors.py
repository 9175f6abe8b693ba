"""Exceptions raised by the client; each names the shard address involved.

Which exception a shard's status becomes is decided here, from the status table
(``shardps.core.status``): ``error_of`` takes a status's parts (code, details,
kind). This module knows nothing of the transport or of grpc; the transport
reads those parts off a ``grpc.RpcError`` or a StreamError
(``shardps_client.transport.from_rpc_error`` / ``from_status``).
"""

from __future__ import annotations

from typing import Any, Optional

from shardps.core import status


class ShardpsError(Exception):
    """Base class of client errors.

    Attributes:
        address: the shard's address, when one shard is involved.
        code: the gRPC status code, when the error came from a shard.
    """

    def __init__(self, message: str, address: Optional[str] = None, code: Optional[Any] = None) -> None:
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


class TableChangedError(ShardpsError):
    """A table's (or dense tensor's) rows came back in another shape than this client's spec of it: it was dropped
    and made again with another spec. The client forgets its spec (the next call reads the new one); a model made for
    the old one cannot use the new one. ``table``: its name."""

    def __init__(self, message: str, table: str, address: Optional[str] = None) -> None:
        super().__init__(message, address)
        self.table = table


class IdOutOfRangeError(ShardpsError, IndexError):
    """Ids outside [0, num_embeddings) of a fixed table, or negative."""


class ShardMapError(ShardpsError):
    """The address list does not match the shards' (index, count), or an id reached the wrong shard."""


class SlotMovedError(ShardMapError):
    """Ids of the request lie in hash slots another shard owns now (``shardps reshard`` moved them): ``owner`` is its
    address when the shard knew it. The client refreshes its slot map and sends them there by itself."""

    owner: str = ""


class StaleUpdateError(ShardpsError):
    """A push was staler than the table's max_staleness and was rejected."""


class SyncStepError(ShardpsError):
    """A synchronous step failed because workers were missing (straggler policy "fail")."""


class RequestTooLargeError(ShardpsError):
    """A request or reply exceeded a message size limit, or a shard's limit (memory budget, tables, rows,
    ids per request, workers: ``shardps serve --max-*``)."""


class ShardUnavailableError(ShardpsError):
    """A shard could not be reached within the retry window."""


def answered_unavailable(e: Optional[BaseException]) -> bool:
    """Whether a shard itself answered a call UNAVAILABLE (a quorum of its replica group not reached in time, a
    checkpoint holding the call back too long, shutting down), rather than the connection failing: the same call,
    sent again with the same sequence number, is applied or answered once the shard can (a push it applied before
    is answered as a duplicate)."""
    return type(e) is ShardUnavailableError and bool(getattr(e, "answered", False))


class ShardRemovedError(ShardUnavailableError):
    """The shard called is out of the cluster (``shardps reshard --remove`` moved every slot off it and stopped it):
    the client plans its calls again by the slot map, sending them where their rows are now."""


class NotPrimaryError(ShardUnavailableError):
    """The member of a replica group that was called is not its primary (a backup, or an election is under way);
    ``primary`` is the primary's address when the member knows it. The client follows it by itself."""

    primary: str = ""


class ShardTimeoutError(ShardpsError):
    """A call did not finish within its deadline."""


class AuthenticationError(ShardpsError):
    """The shard wants a token (``Client(token=...)``, SHARDPS_TOKEN_FILE) and got none, or a wrong one."""


class PermissionDeniedError(ShardpsError):
    """The client's token has a role that may not make this call (reader, trainer, admin)."""


class ReadOnlyError(ShardpsError):
    """The shard serves a read-only export (``shardps serve --serve-from``): pushes and table changes are refused."""


class ExportGapError(ShardpsError):
    """A delta cannot follow the export's last cut (a shard restarted or the shard map changed): write a new base."""


# Each kind of the status table (shardps.core.status), carried as data by the shard.
_BY_KIND: dict[str, type] = {s.kind: globals()[s.client_error] for s in status.TABLE}
# Without a kind (an older shard, or a status gRPC itself produced), by code name: the table's first
# kind of that code, and the codes only gRPC produces.
_BY_CODE: dict[str, type] = {"DEADLINE_EXCEEDED": ShardTimeoutError}
for _s in status.TABLE:
    _BY_CODE.setdefault(_s.code, _BY_KIND[_s.kind])


def error_of(code: Any, details: str, address: str, what: str, kind: str = "", redirect: str = "") -> ShardpsError:
    """The client exception of a status (``code``: a grpc.StatusCode) of call ``what`` to ``address``; ``redirect``:
    the primary a replica group's member named."""
    cls = _BY_KIND.get(kind) or _BY_CODE.get(code.name, ShardpsError)
    err = cls(f"{what} to shard at {address} failed ({code.name}): {details}", address=address, code=code)
    if isinstance(err, NotPrimaryError):
        err.primary = redirect
    elif isinstance(err, SlotMovedError):
        err.owner = redirect
    return err

