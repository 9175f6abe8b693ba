"""Who may call what: the shard's TLS credentials and its bearer tokens with roles.

Tokens travel in the ``authorization`` metadata of every call (``Bearer <token>``). They are read
from a file (``--tokens-file``; the flag names the file, never a token: command lines are visible to
every user in ``ps``), one ``<role> <token>`` per line, ``#`` comments. The shard keeps only their
SHA-256 digests and compares a call's digest with every one of them in constant time (no early
exit), before the request is decoded. Roles:

- ``reader``: pulls (rows and dense tensors), DescribeTable, ShardInfo: serving and inference.
- ``trainer``: a reader's calls, pushes, assignments (a loaded state dict), heartbeats, and CreateTable / RegisterDense of what exists
  already with the same spec (a job restarting); creating anything new is an admin's.
- ``admin``: every call (create and drop tables, checkpoints, exports, a backup following its primary, slot
  migrations).

A call without a known token gets UNAUTHENTICATED, one whose role may not make it
PERMISSION_DENIED. The gRPC health service stays open (orchestrators probe it with no token).
Without a tokens file, every call is allowed, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import pathlib
import ssl
from dataclasses import dataclass, fields
from typing import Any, Iterable, Optional

from shardps.core.errors import PermissionDenied, Unauthenticated
from shardps.core.tokens import token_of

READER = frozenset({"Pull", "PullDense", "PullBatch", "DescribeTable", "ShardInfo"})
TRAINER = READER | {"Push", "PushDense", "PushBatch", "Heartbeat", "CreateTable", "RegisterDense", "Assign"}
ADMIN = TRAINER | {"DropTable", "Checkpoint", "Export", "Replicate", "Migrate"}
ALLOWED: dict[str, frozenset[str]] = {"reader": READER, "trainer": TRAINER, "admin": ADMIN}
# A trainer may call these only for what exists already with the same spec.
CREATE = frozenset({"CreateTable", "RegisterDense"})
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class TokenLimits:
    """What all holders of one token may have on a shard at once (None: no limit of its own)."""

    max_calls: Optional[int] = None
    max_streams: Optional[int] = None
    max_waiting: Optional[int] = None
    weight: float = 1.0

    @classmethod
    def parse(cls, options: Iterable[str]) -> TokenLimits:
        """``name=value`` options of a tokens-file line."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for option in options:
            name, sep, raw = option.partition("=")
            if not sep or name not in known:
                raise ValueError(f"unknown option {option!r}: use name=value with a name among {', '.join(known)}")
            try:
                value = float(raw) if name == "weight" else int(raw)
            except ValueError:
                raise ValueError(f"{name} must be a number, got {raw!r}") from None
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be positive, got {raw!r}")
            values[name] = value
        return cls(**values)


@dataclass(frozen=True)
class Grant:
    """A call's token, once checked: its role, which token it is (``key``) and the token's limits."""

    role: str
    key: str
    limits: TokenLimits


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Tokens:
    """The shard's known tokens (as digests) and their roles."""

    def __init__(self, entries: Iterable[tuple[str, str]], limits: Optional[list[TokenLimits]] = None) -> None:
        self._digests: list[tuple[bytes, Grant]] = []
        seen: set[bytes] = set()
        for i, (role, token) in enumerate(entries):
            if role not in ALLOWED:
                raise ValueError(f"unknown role {role!r}: use one of {', '.join(ALLOWED)}")
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(f"a {role} token is shorter than {MIN_TOKEN_CHARS} characters")
            d = _digest(token)
            if d in seen:
                raise ValueError("the same token is listed twice")
            seen.add(d)
            self._digests.append((d, Grant(role, f"token {i + 1} ({role})", limits[i] if limits else TokenLimits())))
        if not self._digests:
            raise ValueError("no tokens")

    @classmethod
    def load(cls, path: str) -> Tokens:
        """Read ``<role> <token> [limit=value ...]`` lines (``#`` starts a comment)."""
        entries, limits = [], []
        for n, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) < 2:
                raise ValueError(f"{path}:{n}: expected '<role> <token> [limit=value ...]'")
            entries.append((parts[0], parts[1]))
            try:
                limits.append(TokenLimits.parse(parts[2:]))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
        try:
            return cls(entries, limits)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def grant(self, metadata: Optional[Iterable[tuple[str, Any]]]) -> Optional[Grant]:
        """The grant of the call's bearer token; None when it has none or an unknown one."""
        token = token_of(metadata)
        if token is None:
            return None
        d = _digest(token[:4096])
        found: Optional[Grant] = None
        for known, grant in self._digests:  # every digest compared, whichever matches
            if hmac.compare_digest(known, d):
                found = grant
        return found

    def check(self, metadata: Optional[Iterable[tuple[str, Any]]], method: str) -> Grant:
        """The caller's grant, if it may call ``method``; raises Unauthenticated / PermissionDenied."""
        grant = self.grant(metadata)
        if grant is None:
            raise Unauthenticated("no valid token: this shard wants 'authorization: Bearer <token>'")
        if method not in ALLOWED[grant.role]:
            raise PermissionDenied(f"role {grant.role} may not call {method}")
        return grant


@dataclass(frozen=True)
class TLSFiles:
    """The shard's certificate chain and key (PEM files); with ``client_ca``, mutual TLS: clients must
    present a certificate signed by that CA."""

    cert: str
    key: str
    client_ca: Optional[str] = None

    def read(self) -> tuple[bytes, bytes, Optional[bytes]]:
        """(certificate chain, key, client CA or None), read now: a missing file fails at start, and so do files
        that are not a certificate and its key (gRPC's bind failed on them with only \"could not bind\")."""
        chain, key = pathlib.Path(self.cert).read_bytes(), pathlib.Path(self.key).read_bytes()
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert, self.key, password=lambda: b"")
            if self.client_ca:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(self.client_ca)
        except ssl.SSLError as e:
            raise ValueError(f"--tls-cert {self.cert} / --tls-key {self.key}"
                             f"{f' / --tls-client-ca {self.client_ca}' if self.client_ca else ''}: not a PEM "
                             f"certificate chain and its private key (and CA): {e.reason or e}") from None
        return chain, key, pathlib.Path(self.client_ca).read_bytes() if self.client_ca else None
