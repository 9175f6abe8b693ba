"""Fuzzing of the security paths: authentication metadata (and the data plane's hello), and TLS handshakes with bad certificates
and bytes that are no handshake at all, against real shard processes.

Same assertions as tests/test_fuzz.py: every call gets a status a client may legitimately get (here:
UNAUTHENTICATED for no valid token, PERMISSION_DENIED for a role that may not make the call, and what
the method may answer otherwise; never INTERNAL or UNKNOWN); a refused call changes nothing; the shard
stays alive, below 1.5 GiB RSS, and answers a good client afterwards; what it acknowledged is exactly
what it holds. ``SHARDPS_FUZZ_EXAMPLES`` / ``SHARDPS_FUZZ_SEED`` scale and vary the run (`make fuzz`).
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import ssl
import string
import time
from typing import Any, Optional

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from shardps_client import SGD, TLS, Client, ShardUnavailableError

from shardps.server.ops import certs
from shardps.v1 import shardps_pb2 as pb
from tests.fuzz import target
from tests.fuzz.memory import GiB, RssWatch
from tests.fuzz.oracle import CODE_OF, allowed_codes
from tests.fuzz.regressions import valid_push_bytes
from tests.fuzz.runner import stateful_settings
from tests.fuzz.tensors import int64_tensor
from tests.procs import start_shard
from tests.test_data_plane import data_plane_call

EXAMPLES = int(os.environ.get("SHARDPS_FUZZ_EXAMPLES", "35"))
SEED = int(os.environ.get("SHARDPS_FUZZ_SEED", "0"))
TOKENS = {"reader": "R" * 18 + "-reader", "trainer": "T" * 18 + "-trainer", "admin": "A" * 18 + "-admin"}
ALLOWED = {"reader": {"Pull", "PullDense", "PullBatch", "DescribeTable", "ShardInfo"}}
ALLOWED["trainer"] = ALLOWED["reader"] | {"Push", "PushDense", "PushBatch", "Heartbeat", "CreateTable", "RegisterDense"}
ALLOWED["admin"] = set(target.METHOD_NAMES)
PUSH_IDS = (1, 2)

# One valid request per method: what a caller with the right token may send. A Push (and the Stream's
# one frame) applies -lr * 1.0 to rows 1 and 2; every other call leaves t as it is.
REQUESTS: dict[str, Any] = {
    "CreateTable": pb.CreateTableRequest(spec=target.TABLE_SPEC_PB),
    "DescribeTable": pb.DescribeTableRequest(name=target.TABLE),
    "DropTable": pb.DropTableRequest(name="nope"),
    "Pull": pb.PullRequest(table=target.TABLE, ids=int64_tensor([1, 2, 3])),
    "Push": valid_push_bytes(PUSH_IDS),
    "RegisterDense": pb.RegisterDenseRequest(spec=target.DENSE_SPEC_PB),
    "PullDense": pb.PullDenseRequest(name=target.DENSE, row_start=0, row_end=2),
    "PushDense": pb.PushDenseRequest(name=target.DENSE, row_start=0, grads=pb.Tensor(
        dtype=pb.FLOAT32, shape=[1, 3], data=np.zeros((1, 3), np.float32).tobytes())),
    "PullBatch": pb.PullBatchRequest(),
    "PushBatch": pb.PushBatchRequest(),
    "ShardInfo": pb.ShardInfoRequest(),
    "Checkpoint": pb.CheckpointRequest(),
    "Heartbeat": pb.HeartbeatRequest(rank=0, world_size=1),
}
REQUESTS = {m: r if isinstance(r, bytes) else r.SerializeToString() for m, r in REQUESTS.items()}
STREAM_FRAME = pb.StreamRequest(push=pb.PushRequest.FromString(REQUESTS["Push"])).SerializeToString()


def _flip(token: str, draw: Any) -> str:
    i = draw(st.integers(0, len(token) - 1))
    return token[:i] + ("x" if token[i] != "x" else "y") + token[i + 1:]


@st.composite
def authorization_values(draw: Any) -> tuple[str, Optional[str]]:
    """(an ``authorization`` value, the role it is a valid bearer token of or None)."""
    role = draw(st.sampled_from(sorted(TOKENS)))
    token = TOKENS[role]
    printable = st.text(string.ascii_letters + string.digits + " -._~+/=!#$%&*", max_size=200)
    kind = draw(st.sampled_from(["valid"] * 6 + ["flipped", "prefix", "suffix", "case", "scheme", "no space",
                                 "two spaces", "trailing space", "text", "huge", "empty", "only scheme"]))
    value = {
        "valid": lambda: "Bearer " + token,
        "flipped": lambda: "Bearer " + _flip(token, draw),
        "prefix": lambda: "Bearer " + token[: draw(st.integers(0, len(token) - 1))],
        "suffix": lambda: "Bearer " + token + draw(st.text(string.ascii_letters, min_size=1, max_size=8)),
        "case": lambda: "bearer " + token,
        "scheme": lambda: draw(st.sampled_from(["Basic ", "Token ", "Bearer:", "BEARER "])) + token,
        "no space": lambda: "Bearer" + token,
        "two spaces": lambda: "Bearer  " + token,
        "trailing space": lambda: "Bearer " + token + " ",
        "text": lambda: draw(printable),
        "huge": lambda: "Bearer " + "z" * draw(st.integers(1000, 7000)),
        "empty": lambda: "",
        "only scheme": lambda: "Bearer ",
    }[kind]()
    return value, role if kind == "valid" else None


@st.composite
def metadata_sets(draw: Any) -> tuple[list[tuple[str, Any]], Optional[str]]:
    """Call metadata and the role the shard must see (the first authorization entry decides)."""
    entries: list[tuple[str, Any]] = []
    role: Optional[str] = None
    first = True
    for _ in range(draw(st.integers(0, 3))):
        what = draw(st.sampled_from(["authorization", "authorization", "binary", "other"]))
        if what == "authorization":
            value, valid = draw(authorization_values())
            if first:
                role, first = valid, False
            entries.append(("authorization", value))
        elif what == "binary":
            entries.append(("authorization-bin", draw(st.binary(max_size=300))))
        else:
            entries.append((draw(st.sampled_from(["x-token", "auth", "bearer", "token"])), "Bearer " + TOKENS["admin"]))
    return entries, role


class AuthHarness:
    """A shard with a tokens file and log durability; raw calls with fuzzed metadata."""

    def __init__(self, workdir: Any) -> None:
        tokens = workdir / "tokens"
        tokens.write_text("".join(f"{role} {token}\n" for role, token in TOKENS.items()))
        self.shard = start_shard(0, 1, workdir, str(workdir / "data"),
                                 extra=["--tokens-file", str(tokens), "--durability", "log"])
        with Client([self.shard.address], token=TOKENS["admin"], timeout=10) as c:
            c.create_table(target.TABLE, dim=target.TABLE_DIM, num_embeddings=target.TABLE_ROWS,
                           optimizer=SGD(lr=target.LR), initializer=target.TABLE_SPEC.initializer)
            c.register_dense(target.DENSE, target.DENSE_INIT.copy(), optimizer=SGD(lr=target.LR))
        self.channel = grpc.insecure_channel(self.shard.address)
        self.rss = RssWatch(self.shard.proc, int(1.5 * GiB))
        self.rss.start()
        self.initial = self.rows()
        self.version0 = self.version()
        raw = self.channel.unary_unary("/shardps.v1.Shard/ShardInfo")(b"", metadata=self.admin(), timeout=10)
        self.data_port = pb.ShardInfoResponse.FromString(raw).data_ports[0]
        self.applied = 0  # pushes to t acknowledged
        self.failures: list[str] = []
        self.counts: dict[tuple[str, str], int] = {}

    def admin(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", "Bearer " + TOKENS["admin"]),)

    def rows(self) -> np.ndarray:
        raw = self.channel.unary_unary("/shardps.v1.Shard/Pull")(
            pb.PullRequest(table=target.TABLE, ids=int64_tensor(list(range(8)))).SerializeToString(),
            metadata=self.admin(), timeout=10)
        reply = pb.PullResponse.FromString(raw)
        return np.frombuffer(reply.rows.data, np.float32).reshape(8, target.TABLE_DIM).copy()

    def version(self) -> int:
        raw = self.channel.unary_unary("/shardps.v1.Shard/ShardInfo")(b"", metadata=self.admin(), timeout=10)
        return pb.ShardInfoResponse.FromString(raw).version

    def call(self, method: str, metadata: list[tuple[str, Any]]) -> tuple[grpc.StatusCode, bytes]:
        """One call; for Stream, one Push frame (its answer's StreamError code, if any); for DataPlane, the Push
        frame on a fresh data-plane connection whose hello carries the first authorization value's token."""
        if method == "DataPlane":
            reply = data_plane_call(self.data_port, STREAM_FRAME, token=data_plane_token(metadata))
            if reply.HasField("error"):
                return CODE_OF[reply.error.code], reply.error.message.encode()
            return grpc.StatusCode.OK, b""
        try:
            if method == "Stream":
                frames: queue.Queue = queue.Queue()
                frames.put(STREAM_FRAME)
                frames.put(None)
                replies = list(self.channel.stream_stream("/shardps.v1.Shard/Stream")(
                    iter(frames.get, None), metadata=metadata, timeout=10))
                reply = pb.StreamResponse.FromString(replies[0])
                if reply.HasField("error"):
                    return CODE_OF[reply.error.code], b""
                return grpc.StatusCode.OK, replies[0]
            return grpc.StatusCode.OK, self.channel.unary_unary(f"/shardps.v1.Shard/{method}")(
                REQUESTS[method], metadata=metadata, timeout=10)
        except grpc.RpcError as e:
            return e.code(), (e.details() or "").encode()

    def exercise(self, method: str, metadata: list[tuple[str, Any]], role: Optional[str]) -> None:
        if method == "DataPlane":  # the hello's token alone decides
            role = next((r for r, t in TOKENS.items() if t == data_plane_token(metadata)), None)
        before_rows, before_version = self.rows(), self.version()
        code, detail = self.call(method, metadata)
        self.counts[(method, code.name)] = self.counts.get((method, code.name), 0) + 1
        if role is None:
            # No valid token: refused before anything is decoded. A metadata set over gRPC's 8 KiB limit
            # is refused by gRPC itself.
            allowed = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
        elif method not in ALLOWED[role] and method not in ("Stream", "DataPlane"):
            allowed = {grpc.StatusCode.PERMISSION_DENIED}
        elif method in ("Stream", "DataPlane") and "Push" not in ALLOWED[role]:
            allowed = {grpc.StatusCode.PERMISSION_DENIED}
        else:
            allowed = allowed_codes(method)
        if code not in allowed:
            self.failures.append(f"{method} with {role or 'no valid token'} ({_short(metadata)}): "
                                 f"{code.name} {detail[:200]!r}, expected one of {sorted(c.name for c in allowed)}")
        self.applied += code == grpc.StatusCode.OK and method in ("Push", "Stream", "DataPlane")
        after_rows, after_version = self.rows(), self.version()
        if code != grpc.StatusCode.OK and (after_version != before_version or not np.array_equal(after_rows, before_rows)):
            self.failures.append(f"{method} was refused ({code.name}) but changed the shard")

    def check_acknowledged(self) -> None:
        """t holds exactly the acknowledged pushes (SGD: -lr * 1.0 per push on rows 1 and 2)."""
        expected = self.initial.copy()
        for _ in range(self.applied):
            expected[list(PUSH_IDS)] = expected[list(PUSH_IDS)] - np.float32(target.LR) * np.float32(1.0)
        self.final = self.rows()
        if not np.array_equal(self.final, expected):
            self.failures.append(f"t does not hold exactly the {self.applied} acknowledged pushes")

    def stop(self) -> None:
        self.rss.stop()
        self.channel.close()
        self.shard.terminate()


def data_plane_token(metadata: list[tuple[str, Any]]) -> str:
    """The token a data-plane hello carries for ``metadata``: its first authorization value, less "Bearer "."""
    value = next((str(v) for k, v in metadata if k == "authorization"), "")
    return value[len("Bearer "):] if value.startswith("Bearer ") else value


def _short(metadata: list[tuple[str, Any]]) -> str:
    return ", ".join(f"{k}={str(v)[:40]!r}{'...' if len(str(v)) > 40 else ''}" for k, v in metadata) or "none"


@pytest.mark.slow
@pytest.mark.timeout(max(300, 8 * EXAMPLES))
def test_authentication_metadata_survives_fuzzing(tmp_path):
    h = AuthHarness(tmp_path)
    try:
        methods = [*REQUESTS, "Stream", "DataPlane"]

        turn = itertools.count()

        # Methods in turn (a drawn method favours the first ones: 100 examples once never reached Stream).
        @stateful_settings(max(EXAMPLES * 2, 2 * len(methods)), SEED)
        @given(metadata_sets())
        def run(meta: tuple[list[tuple[str, Any]], Optional[str]]) -> None:
            h.exercise(methods[next(turn) % len(methods)], *meta)

        run()
        assert h.shard.proc.poll() is None, f"the shard died:\n{h.shard.log()[-3000:]}"
        h.check_acknowledged()
        counts = "\n".join(f"  {m:14s} {c:18s} {n}" for (m, c), n in sorted(h.counts.items()))
        print(f"auth fuzz: {sum(h.counts.values())} calls, RSS peak {h.rss.peak / 2**20:.0f} MiB\n{counts}")
        assert not h.failures, "\n".join(h.failures[:20])
        assert not h.rss.exceeded, f"RSS over 1.5 GiB: {h.rss.peak / 2**20:.0f} MiB"
        # The fuzzing reached both sides: valid tokens were served, the others refused.
        assert any(c == "OK" for (m, c) in h.counts), h.counts
        assert any(c == "UNAUTHENTICATED" for (m, c) in h.counts), h.counts
        assert any(c == "PERMISSION_DENIED" for (m, c) in h.counts), h.counts
    finally:
        h.stop()
    # Restarted on its data dir (log durability), the shard holds what it acknowledged.
    again = start_shard(0, 1, tmp_path, str(tmp_path / "data"), extra=["--tokens-file", str(tmp_path / "tokens")])
    try:
        with Client([again.address], token=TOKENS["admin"], timeout=10) as c:
            rows = c.pull(target.TABLE, list(range(8))).numpy()
        assert np.array_equal(rows, h.final), "after a restart, t is not what the shard acknowledged"
    finally:
        again.terminate()


# ---- TLS handshakes --------------------------------------------------------------------------------


def _client_hello(server_name: str = "localhost") -> bytes:
    """A real TLS ClientHello, as Python's ssl module writes it."""
    ctx = ssl.create_default_context()
    ctx.set_alpn_protocols(["h2"])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    try:
        conn.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


@st.composite
def handshake_bytes(draw: Any, hello: bytes) -> bytes:
    """A ClientHello cut short, with bytes flipped, inserted or repeated, an HTTP/2 preface in clear
    text, or noise."""
    kind = draw(st.sampled_from(["truncated", "flipped", "inserted", "repeated", "plaintext", "noise", "huge record"]))
    if kind == "truncated":
        return hello[: draw(st.integers(0, len(hello) - 1))]
    if kind == "flipped":
        buf = bytearray(hello)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] = draw(st.integers(0, 255))
        return bytes(buf)
    if kind == "inserted":
        i = draw(st.integers(0, len(hello)))
        return hello[:i] + draw(st.binary(min_size=1, max_size=64)) + hello[i:]
    if kind == "repeated":
        return hello * draw(st.integers(2, 4))
    if kind == "plaintext":
        return b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + draw(st.binary(max_size=64))
    if kind == "huge record":  # a TLS record header announcing 16 KiB+ of handshake, then not sending it
        return b"\x16\x03\x01" + draw(st.integers(0x4000, 0xFFFF)).to_bytes(2, "big") + hello[5:]
    return draw(st.binary(min_size=1, max_size=512))


def _send_raw(address: str, data: bytes) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        s.settimeout(1.0)
        try:
            while s.recv(4096):
                pass
        except (TimeoutError, ConnectionResetError):
            pass


@pytest.mark.slow
@pytest.mark.timeout(max(300, 8 * EXAMPLES))
def test_tls_handshakes_with_bad_certificates_and_bad_bytes_survive_fuzzing(tmp_path):
    d = tmp_path / "pki"
    dev, other = certs.make_dev_certs(str(d / "good")), certs.make_dev_certs(str(d / "other"))
    shard = start_shard(0, 1, tmp_path, extra=["--tls-cert", dev.server_cert, "--tls-key", dev.server_key,
                                               "--tls-client-ca", dev.ca])
    rss = RssWatch(shard.proc, int(1.5 * GiB))
    rss.start()
    good = TLS(ca=dev.ca, cert=dev.client_cert, key=dev.client_key)
    try:
        with Client([shard.address], tls=good, timeout=30) as c:  # (a loaded suite once took over 10 s here)
            c.create_table("h", dim=4, num_embeddings=100)
            c.push("h", [1, 2], np.ones((2, 4), np.float32), wait=True)
            expected = c.pull("h", [1, 2]).numpy()
        hello = _client_hello()
        sent = 0

        @stateful_settings(EXAMPLES, SEED)
        @given(handshake_bytes(hello))
        def run(data: bytes) -> None:
            nonlocal sent
            _send_raw(shard.address, data)
            sent += 1

        run()
        # Bad certificates: each refused (UNAVAILABLE after the handshake fails), none served.
        for tls in (TLS(ca=other.ca, cert=dev.client_cert, key=dev.client_key),  # does not trust the shard
                    TLS(ca=dev.ca),  # no client certificate
                    TLS(ca=dev.ca, cert=other.client_cert, key=other.client_key),  # another CA's client
                    TLS(ca=dev.ca, cert=dev.server_cert, key=dev.server_key)):  # a server certificate as client
            with pytest.raises(ShardUnavailableError):
                Client([shard.address], tls=tls, retry_timeout=1, timeout=5)
        time.sleep(0.5)
        assert shard.proc.poll() is None, f"the shard died:\n{shard.log()[-3000:]}"
        assert not rss.exceeded, f"RSS over 1.5 GiB: {rss.peak / 2**20:.0f} MiB"
        with Client([shard.address], tls=good, timeout=30) as c:  # still serves, state intact
            assert np.array_equal(c.pull("h", [1, 2]).numpy(), expected)
        threads = len(os.listdir(f"/proc/{shard.proc.pid}/task"))
        assert threads < 200, f"{threads} threads after {sent} bad handshakes"
        print(f"TLS fuzz: {sent} bad handshakes, RSS peak {rss.peak / 2**20:.0f} MiB, {threads} threads")
    finally:
        rss.stop()
        shard.terminate()


@st.composite
def sealed_traffic(draw: Any) -> tuple[str, Any]:
    """What a data-plane connection to a TLS shard sends, forged: a hello with a made-up or a real session id
    and bytes not sealed with its key, or after a genuine hello a request changed on the way (a flipped bit, cut
    short, another counter, another request id, replayed, random bytes, plaintext)."""
    kind = draw(st.sampled_from(["flip", "cut", "counter", "request id", "replay", "random", "plaintext",
                                 "made-up", "real id"]))
    if kind == "made-up":
        return kind, [draw(st.binary(max_size=24)), draw(st.binary(max_size=12)), draw(st.binary(max_size=64))]
    if kind == "real id":
        return kind, [draw(st.binary(min_size=8, max_size=8)), draw(st.binary(max_size=64))]
    return kind, draw(st.integers(0, 2**16))


@pytest.mark.slow
@pytest.mark.timeout(max(120, 4 * EXAMPLES))
def test_forged_sealed_data_plane_traffic_is_refused_under_fuzzing(tmp_path):
    """With TLS, data-plane traffic that was not sealed with its connection's session key (forged hellos, changed
    or replayed requests) is refused UNAUTHENTICATED before it is decoded, and changes nothing."""

    from shardps.core.seal import TO_CLIENT, TO_SHARD, Seal
    from tests.test_data_plane import data_session, dealer, hello_answer, sealed_hello

    dev = certs.make_dev_certs(str(tmp_path / "pki"))
    shard = start_shard(0, 1, tmp_path, extra=["--tls-cert", dev.server_cert, "--tls-key", dev.server_key])
    tls = TLS(ca=dev.ca)
    push = STREAM_FRAME
    seen: dict[str, int] = {}
    try:
        with Client([shard.address], tls=tls, timeout=10) as c:
            c.create_table(target.TABLE, dim=target.TABLE_DIM, num_embeddings=100, optimizer=SGD(lr=target.LR))
            c.pull(target.TABLE, list(PUSH_IDS))
            expected = c.pull(target.TABLE, list(PUSH_IDS)).numpy()
            port = c.shard_info()[0].data_ports[0]

        @stateful_settings(EXAMPLES, SEED)
        @given(sealed_traffic())
        def run(example: tuple[str, Any]) -> None:
            kind, data = example
            sid, key = data_session(shard.address, tls)
            sealing = Seal(key, sending=TO_SHARD, receiving=TO_CLIENT)
            sock = dealer(port)
            try:
                if kind == "made-up":
                    sock.send_multipart([b"", b"hello", *data])
                elif kind == "real id":
                    sock.send_multipart([b"", b"hello", sid, *data])
                else:
                    sock.send_multipart(sealed_hello(sealing, sid))
                    assert hello_answer(sock.recv_multipart(), sealing) == (b"ok", b"")
                    rid = b"fz" + data.to_bytes(6, "big")
                    counter, sealed = sealing.seal(push, rid) if kind != "replay" else (b"", b"")
                    if kind == "replay":  # a genuine pull, answered, then sent again
                        pull = sealing.seal(pb.StreamRequest(pull=pb.PullRequest.FromString(REQUESTS["Pull"]))
                                            .SerializeToString(), rid)
                        sock.send_multipart([rid, *pull])
                        sock.recv_multipart()
                        parts = [rid, *pull]
                    elif kind == "flip":
                        changed = bytearray(sealed)
                        changed[data % len(changed)] ^= 1 << (data % 8)
                        parts = [rid, counter, bytes(changed)]
                    elif kind == "cut":
                        parts = [rid, counter, sealed[: data % len(sealed)]]
                    elif kind == "counter":
                        parts = [rid, (int.from_bytes(counter, "little") + 1 + data).to_bytes(8, "little"), sealed]
                    elif kind == "request id":
                        parts = [b"zf" + data.to_bytes(6, "big"), counter, sealed]
                    elif kind == "random":
                        parts = [rid, counter, np.random.default_rng(data).bytes(len(sealed))]
                    else:
                        parts = [rid, push]
                    sock.send_multipart(parts)
                answer = sock.recv_multipart()
                assert answer[:2] == [b"", b"error"], f"{kind}: answered {answer[:2]!r}"
                error = pb.StreamResponse.FromString(answer[2]).error
                assert error.code == 16, f"{kind}: {error}"
                seen[kind] = seen.get(kind, 0) + 1
            finally:
                sock.close(0)

        run()
        assert shard.proc.poll() is None, f"the shard died:\n{shard.log()[-3000:]}"
        with Client([shard.address], tls=tls, timeout=10) as c:  # nothing refused changed a row; still serves
            assert np.array_equal(c.pull(target.TABLE, list(PUSH_IDS)).numpy(), expected)
            assert c.shard_info()[0].stats.pushes == 0
        print(f"sealed data-plane fuzz: {sum(seen.values())} forged messages refused, by kind {seen}")
    finally:
        shard.terminate()
