"""The status table: every kind of error a shard reports, its gRPC code, its shard exception and the
client exception it becomes.

The kind travels as data, never recovered from message text: in the trailing
metadata ``KIND_METADATA`` of a refused unary call, and in ``StreamError.kind``
of a refused call on a stream. Two kinds may share a code (ABORTED is both a
stale push and a failed synchronous step); the kind tells them apart. Codes are
named, not imported from grpc, so the core needs no gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from shardps.core import errors

KIND_METADATA = "shardps-error-kind"
# A NotPrimary refusal's primary address, a Moved refusal's new owner (StreamError.redirect on streams).
REDIRECT_METADATA = "shardps-redirect"


@dataclass(frozen=True)
class Status:
    """One error kind.

    Args:
        kind: the name carried on the wire.
        code: the gRPC status code's name (grpc.StatusCode[code]).
        shard_error: the exception the shard raises.
        client_error: the name of the exception class in shardps_client.errors.
    """

    kind: str
    code: str
    shard_error: type
    client_error: str


TABLE: tuple[Status, ...] = (
    Status("invalid_argument", "INVALID_ARGUMENT", errors.InvalidArgument, "InvalidArgumentError"),
    Status("not_found", "NOT_FOUND", errors.NotFound, "TableNotFoundError"),
    Status("already_exists", "ALREADY_EXISTS", errors.AlreadyExists, "TableExistsError"),
    Status("out_of_range", "OUT_OF_RANGE", errors.OutOfRange, "IdOutOfRangeError"),
    Status("wrong_shard", "FAILED_PRECONDITION", errors.WrongShard, "ShardMapError"),
    Status("moved", "FAILED_PRECONDITION", errors.Moved, "SlotMovedError"),
    Status("stale_update", "ABORTED", errors.StaleUpdate, "StaleUpdateError"),
    Status("sync_step_failed", "ABORTED", errors.SyncStepFailed, "SyncStepError"),
    Status("resource_exhausted", "RESOURCE_EXHAUSTED", errors.ResourceExhausted, "RequestTooLargeError"),
    Status("unavailable", "UNAVAILABLE", errors.Unavailable, "ShardUnavailableError"),
    Status("not_primary", "UNAVAILABLE", errors.NotPrimary, "NotPrimaryError"),
    Status("data_region", "UNAVAILABLE", errors.RegionGone, "ShardUnavailableError"),
    Status("log_failed", "UNAVAILABLE", errors.LogFailed, "ShardUnavailableError"),
    Status("unauthenticated", "UNAUTHENTICATED", errors.Unauthenticated, "AuthenticationError"),
    Status("data_session", "UNAUTHENTICATED", errors.SessionUnknown, "AuthenticationError"),
    Status("permission_denied", "PERMISSION_DENIED", errors.PermissionDenied, "PermissionDeniedError"),
    Status("read_only", "FAILED_PRECONDITION", errors.ReadOnly, "ReadOnlyError"),
    Status("export_gap", "FAILED_PRECONDITION", errors.ExportGap, "ExportGapError"),
)

BY_KIND: dict[str, Status] = {s.kind: s for s in TABLE}
_BY_ERROR: dict[type, Status] = {s.shard_error: s for s in TABLE}


def of_error(e: BaseException) -> Optional[Status]:
    """The status of a shard exception (None: not a shard error, i.e. a bug: INTERNAL)."""
    for cls in type(e).__mro__:
        found = _BY_ERROR.get(cls)
        if found is not None:
            return found
    return None
