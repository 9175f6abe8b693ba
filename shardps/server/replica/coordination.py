"""Coordination of a replica group through etcd (Debian's etcd 3.4, through ``etcd3gw``, its gRPC gateway's
maintained client): a lease per member, kept alive by a thread; the members' keys (where each one's log ends);
the primary's key, created only where absent and attached to the primary's lease, whose etcd revision is the
group's epoch (a fencing token: every later primary's is larger).

Keys, under ``/shardps/<cluster>/shard-<index>/``: ``primary`` (JSON: member, address, epoch) and
``members/<member>`` (JSON: address, lsn, last_epoch, role). Both vanish with their member's lease.

Every call has a deadline (``timeout``); etcd being unreachable raises ``EtcdUnavailable``, which callers treat as
"no news" (a primary keeps writing with its quorum; no election happens without etcd).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger(__name__)


class EtcdUnavailable(Exception):
    """etcd did not answer (down, or out of reach)."""


@dataclass(frozen=True)
class Primary:
    """The primary as etcd holds it."""

    member: str
    address: str
    epoch: int  # the key's create revision
    lease: int


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(b64: str) -> str:
    return base64.b64decode(b64).decode()


class Coordinator:
    """One member's view of etcd.

    Args:
        endpoint: etcd's client URL ("http://127.0.0.1:2379"), or an etcd cluster's members' URLs joined by commas:
            calls go to the member that answered last, and move on to the next when it does not.
        cluster: the cluster's name (keys are under it).
        shard_index: the group's shard index.
        member: this member's id.
        ttl: seconds of the member's lease: a member silent this long loses its keys (the primary's key too).
        timeout: seconds any etcd call may take.
    """

    def __init__(self, endpoint: str, cluster: str, shard_index: int, member: str, ttl: int = 2,
                 timeout: float = 1.0) -> None:
        from urllib.parse import urlparse

        import etcd3gw

        self.endpoint = endpoint
        self._clients = []
        for one in [e.strip() for e in endpoint.split(",") if e.strip()] or ["127.0.0.1:2379"]:
            url = urlparse(one if "://" in one else f"http://{one}")
            self._clients.append(etcd3gw.client(host=url.hostname or "127.0.0.1", port=url.port or 2379,
                                                protocol=url.scheme or "http", timeout=timeout))
        self._current = 0  # the member that answered last
        self.prefix = f"/shardps/{cluster}/shard-{shard_index}/"
        self.member = member
        self.ttl = ttl
        self.lease_id = 0
        self._lock = threading.Lock()
        self._last_answer = 0.0  # monotonic time etcd last answered a keepalive (0: never)
        self._last_attempt = 0.0  # monotonic time the last keepalive attempt ended, answered or not
        self.lease_lost = False  # etcd answered that the lease is gone: this member's keys are gone
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- calls -----------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call, at the member that answered last, then at each other one in turn (each with the deadline)."""
        first, error = self._current, None
        for step in range(len(self._clients)):
            i = (first + step) % len(self._clients)
            client = self._clients[i]
            try:
                out = client.post(client.get_url(path), json=body)
            except Exception as e:  # noqa: BLE001 - requests' and etcd3gw's errors alike: this member gave no answer
                error = e
                continue
            self._current = i
            return out  # type: ignore[no-any-return]
        raise EtcdUnavailable(f"etcd at {self.endpoint}: {error}") from error

    def _range(self, key: str, prefix: bool = False) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(key[:-1] + chr(ord(key[-1]) + 1))
        return self._post("/kv/range", body).get("kvs", [])  # type: ignore[no-any-return]

    # ---- the lease ---------------------------------------------------------------------------

    def start(self) -> None:
        """Take a lease and keep it alive (a thread refreshes it every third of its TTL)."""
        self.new_lease()
        self._thread = threading.Thread(target=self._keepalive, name="etcd-keepalive", daemon=True)
        self._thread.start()

    def new_lease(self) -> None:
        """A fresh lease (the start, or after the last one was lost)."""
        out = self._post("/lease/grant", {"TTL": self.ttl, "ID": 0})
        with self._lock:
            self.lease_id = int(out["ID"])
            self.lease_lost = False
            self._last_answer = self._last_attempt = time.monotonic()

    def _keepalive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            self.refresh()

    def refresh(self) -> None:
        """One keepalive of the lease: etcd's answer (alive, or gone) or none (etcd unreachable)."""
        try:
            out = self._post("/lease/keepalive", {"ID": self.lease_id})
            alive = int(out.get("result", {}).get("TTL", -1)) > 0
            with self._lock:
                self._last_answer = self._last_attempt = time.monotonic()
                if not alive and not self.lease_lost:
                    log.warning("etcd: the lease of member %s expired; its keys are gone", self.member)
                self.lease_lost = self.lease_lost or not alive
        except EtcdUnavailable as e:
            with self._lock:
                self._last_attempt = time.monotonic()
            log.debug("keepalive: %s", e)

    def fresh(self) -> bool:
        """Whether this member may believe its lease holds: not lost, and a keepalive attempt ended within the TTL
        (a process frozen past its lease, SIGSTOP say, finds the attempt old and believes nothing until the next
        one answers; etcd merely down leaves attempts recent)."""
        with self._lock:
            return not self.lease_lost and time.monotonic() - self._last_attempt < self.ttl

    def answered_s(self) -> float:
        """Seconds since etcd last answered a keepalive (-1: never)."""
        with self._lock:
            return time.monotonic() - self._last_answer if self._last_answer else -1.0

    def stop(self, revoke: bool = True) -> None:
        """Stop the keepalives; ``revoke``: give the lease back (this member's keys vanish at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.ttl)
        if revoke and self.lease_id:
            try:
                self._post("/kv/lease/revoke", {"ID": self.lease_id})
            except EtcdUnavailable:
                pass

    # ---- keys --------------------------------------------------------------------------------

    def publish(self, info: dict[str, Any]) -> None:
        """This member's key: where its log ends, its role (attached to its lease)."""
        self._post("/kv/put", {"key": _b64(self.prefix + "members/" + self.member), "value": _b64(json.dumps(info)),
                               "lease": self.lease_id})

    def members(self) -> dict[str, dict[str, Any]]:
        """Every live member's key (with ``"_revision"``: the etcd revision it was last written at)."""
        out = {}
        for kv in self._range(self.prefix + "members/", prefix=True):
            name = _text(kv["key"])[len(self.prefix + "members/"):]
            try:
                value = json.loads(_text(kv.get("value", "")))
                if not isinstance(value, dict):
                    raise ValueError("not an object")
                value["_revision"] = int(kv.get("mod_revision", 0))
                out[name] = value
            except ValueError:
                log.warning("etcd: member key %s holds no JSON; ignored", name)
        return out

    def primary(self) -> Optional[Primary]:
        """The primary's key, or None (none elected, or its lease expired)."""
        return self.primary_at()[0]

    def primary_at(self) -> tuple[Optional[Primary], int]:
        """The primary's key (or None) and etcd's revision when it was read: any key written later has a larger
        one (an election counts only reports written after it saw the primary's key gone)."""
        out = self._post("/kv/range", {"key": _b64(self.prefix + "primary")})
        revision = int(out.get("header", {}).get("revision", 0))
        kvs = out.get("kvs", [])
        if not kvs:
            return None, revision
        kv = kvs[0]
        try:
            value = json.loads(_text(kv.get("value", "")))
            return Primary(str(value["member"]), str(value["address"]), int(kv["create_revision"]),
                           int(kv.get("lease", 0))), revision
        except (ValueError, KeyError, TypeError):
            log.error("etcd: the primary key of %s holds no valid JSON: ignored", self.prefix)
            return None, revision

    def campaign(self, address: str) -> Optional[int]:
        """Create the primary's key for this member where there is none (one transaction); its epoch, or None when
        another member's key is there."""
        key = _b64(self.prefix + "primary")
        value = _b64(json.dumps({"member": self.member, "address": address}))
        out = self._post("/kv/txn", {
            "compare": [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": {"key": key, "value": value, "lease": self.lease_id}}],
            "failure": [],
        })
        if not out.get("succeeded"):
            return None
        return int(out["header"]["revision"])  # the put's revision: the key's create revision

    def resign(self, epoch: int) -> None:
        """Delete the primary's key if it is still this member's of ``epoch`` (a transaction)."""
        key = _b64(self.prefix + "primary")
        self._post("/kv/txn", {
            "compare": [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": epoch}],
            "success": [{"request_delete_range": {"key": key}}],
            "failure": [],
        })
