"""Exception types raised inside the shard and by spec validation; shardps.core.status maps each to its
gRPC code and client exception."""

from __future__ import annotations


class ShardError(Exception):
    """Base class of errors a shard reports to its caller."""


class InvalidArgument(ShardError, ValueError):
    """Malformed request or spec: wrong dtype, shape, dim, non-finite values, empty ids, a bad
    hyperparameter. The one validation error of specs and optimizers alike (a ValueError too)."""


class NotFound(ShardError):
    """Unknown table or dense tensor."""


class AlreadyExists(ShardError):
    """A table or dense tensor exists with a different spec."""


class OutOfRange(ShardError):
    """Ids outside [0, num_embeddings) or rows outside a dense tensor."""


class WrongShard(ShardError):
    """The request addresses ids, rows or a shard map this shard does not own."""


class Moved(WrongShard):
    """Ids or dense rows of a request lie in slots (chunks) another shard owns now: a migration moved them, and the
    caller's slot map is older. ``redirect`` is the owner's address (empty when this shard does not know it),
    ``epoch`` the slot map's epoch that says so: the caller refreshes its map and sends them there."""

    def __init__(self, message: str, redirect: str = "", epoch: int = 0) -> None:
        super().__init__(message)
        self.redirect = redirect
        self.epoch = epoch


class StaleUpdate(ShardError):
    """A push exceeded the table's max_staleness."""


class ResourceExhausted(ShardError):
    """The request is too large for this shard."""


class Unavailable(ShardError):
    """The shard is not ready (restoring, shutting down)."""


class NotPrimary(Unavailable):
    """This member of a replica group is not its primary (a backup, or an election is under way): writes go to
    ``redirect``, the primary's address (empty while unknown)."""

    def __init__(self, message: str, redirect: str = "") -> None:
        super().__init__(message)
        self.redirect = redirect


class LogFailed(Unavailable):
    """The shard's write-ahead log could not write or fsync a record (a full, failing or vanished disk): the write
    is not acknowledged, and the log refuses every later one: a failed fsync is never retried as if nothing
    happened (the kernel may have dropped what it could not write). A replica group's member then leaves its group
    and a backup takes over; a shard alone keeps serving reads until it is started again on a working disk."""


class SyncStepFailed(ShardError):
    """A synchronous step failed (its straggler policy is "fail")."""


class Unauthenticated(ShardError):
    """The call carries no token, or one the shard does not know."""


class RegionGone(Unavailable):
    """A data-plane request of a connection whose shared-memory region the shard took back (the connection was idle
    while others needed one, or it was forgotten among too many): nothing of it is read, nor anything the connection
    sends after it. The client connects again and sends its calls again, in order."""


class SessionUnknown(Unauthenticated):
    """A data-plane hello names a session this shard does not hold: never handed out, expired, used already, or
    handed out by the shard's previous process. The client connects again with a new one."""


class PermissionDenied(ShardError):
    """The call's token has a role that may not make this call."""


class ReadOnly(ShardError):
    """The shard serves a read-only export (``--serve-from``): it refuses changes."""


class ExportGap(ShardError):
    """A delta was asked since a cut this shard cannot follow (it restarted, or forgot its removals)."""


def clip(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters (names and values echoed in errors stay small)."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"
