"""The data plane (pulls and pushes over ZeroMQ) against real shard processes: the client's choice of transport,
credentials before any request is decoded, every message sealed with TLS (a wiretap, forged and replayed traffic,
the client's reconnects), malformed traffic, and the gRPC fallback. The behaviour tests of lanes (order,
read-your-writes, batches, errors) run over both transports through the ``client2`` fixture; kill -9s of shards
under a training client here."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Optional

import numpy as np
import pytest
import torch
import zmq
from shardps_client import SGD, TLS, Client, Initializer
from shardps_client.errors import ShardpsError

from shardps.core import codec, protocol
from shardps.core.seal import HELLO_AAD, TO_CLIENT, TO_SHARD, Seal
from shardps.server.ops import certs
from shardps.v1 import shardps_pb2 as pb
from tests.procs import freeze, start_shard

TOKEN = "t" * 24 + "-trainer"


def data_plane_call(port: int | str, frame: bytes, token: str = "", session: Optional[tuple[bytes, bytes]] = None,
                    hello: bool = True, timeout_ms: int = 10_000) -> pb.StreamResponse:
    """One request on a fresh data-plane connection (raw ZeroMQ, as any client could send it): the hello with
    ``token`` first when ``hello`` (sealed under ``session``, (id, key) from ShardInfo, when given; the request
    and its answer too), then ``frame``; the StreamResponse answering the frame (the refusal, when refused)."""
    sock = dealer(port, timeout_ms)
    sealing = None if session is None else Seal(session[1], sending=TO_SHARD, receiving=TO_CLIENT)
    try:
        if hello:
            if sealing is None:
                sock.send_multipart([b"", b"hello", token.encode()])
            else:
                sock.send_multipart(sealed_hello(sealing, session[0], token.encode()))
            what, body = hello_answer(sock.recv_multipart(), sealing)
            if what == b"error":
                return pb.StreamResponse.FromString(body)
            assert what == b"ok"
        rid = b"\x01" * 8
        sock.send_multipart([rid, frame] if sealing is None else [rid, *sealing.seal(frame, rid)])
        answer = sock.recv_multipart()
        if answer[0] == b"":  # the connection refused (a sealed request that did not open)
            return pb.StreamResponse.FromString(answer[2])
        assert answer[0] == rid
        return pb.StreamResponse.FromString(answer[1] if sealing is None else sealing.open(answer[1], answer[2], rid))
    finally:
        sock.close(0)


def dealer(port: int | str, timeout_ms: int = 10_000) -> zmq.Socket:
    """A raw DEALER connected to a data-plane port on 127.0.0.1 (or an endpoint: a Unix socket), as any client could
    open one."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(port if isinstance(port, str) else f"tcp://127.0.0.1:{port}")
    return sock


def sealed_hello(sealing: Seal, sid: bytes, token: bytes = b"") -> list[bytes]:
    """The hello of a sealed connection: the session's id, and the token sealed under its key."""
    return [b"", b"hello", sid, *sealing.seal(token, HELLO_AAD + sid)]


def hello_answer(answer: list[bytes], sealing: Optional[Seal]) -> tuple[bytes, bytes]:
    """(b"ok" or b"error", the refusal's StreamResponse) of a hello's answer; on a sealed connection the answer
    of a hello whose session opened is sealed too, and a refusal of one that did not open is not."""
    assert answer[0] == b"", answer
    if sealing is not None and len(answer) == 4:
        return answer[1], sealing.open(answer[2], answer[3], HELLO_AAD + answer[1])
    assert answer[1] == b"error" or sealing is None, answer  # unsealed: only refusals, with TLS
    return answer[1], answer[-1]


def data_session(address: str, tls: TLS, token: str = "") -> tuple[bytes, bytes]:
    """A data-plane session (id, key), from ShardInfo over TLS, as a client about to connect asks for one."""
    with Client([address], tls=tls, token=token or None, timeout=10) as c:
        info = c.transport.call(0, "ShardInfo", pb.ShardInfoRequest(data_session=True))
        return bytes(info.data_session_id), bytes(info.data_session_key)


def _pull_frame(n: int = 3) -> bytes:
    ids = codec.encode(np.arange(n, dtype=np.int64))
    return pb.StreamRequest(pull=pb.PullRequest(table="t", ids=ids, shard_map=pb.ShardMap(num_shards=1))
                            ).SerializeToString()


def test_a_client_connects_its_data_planes_once_its_shards_answered_not_at_its_first_call(tmp_path):
    """A client whose shards answered its shard-map check connects their data planes at once, in its lanes' threads:
    its first pull finds the connection made. Without the check a lane connects at its first call."""
    shard = start_shard(0, 1, tmp_path)
    try:
        with Client([shard.address], timeout=10) as c:
            deadline = time.monotonic() + 30
            while c.transport.data_planes() == [""] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert c.transport.data_planes() == ["zmq-shm"]
        with Client([shard.address], timeout=10, check_shard_map=False) as c:
            time.sleep(0.5)
            assert c.transport.data_planes() == [""]
            c.create_table("t", dim=2, num_embeddings=10)
            c.pull("t", torch.arange(3))
            assert c.transport.data_planes() == ["zmq-shm"]
    finally:
        shard.terminate()
    # A client refused once its lanes were opening (2 workers where the shard takes 1: its first heartbeat is refused)
    # leaves no thread behind (a lane's holds a connection and a region): the caller has no client to close.
    shard = start_shard(0, 1, tmp_path, extra=["--max-workers", "1"])
    try:
        before = set(threading.enumerate())  # (threads other tests of this worker left are not this client's)
        with pytest.raises(ShardpsError, match="workers"):
            Client([shard.address], timeout=10, retry_timeout=1, rank=1, world_size=2)
        deadline = time.monotonic() + 30
        while left := [t.name for t in set(threading.enumerate()) - before
                       if t.name.startswith(("shardps-data-", "shardps-client", "shardps-heartbeat"))]:
            assert time.monotonic() < deadline, left
            time.sleep(0.05)
    finally:
        shard.terminate()


def test_a_worker_refused_by_one_shard_leaves_the_others_at_once(tmp_path):
    """A client whose first heartbeat one shard refuses (a world size over its --max-workers) tells the shards that
    took it that the worker left: they count it gone at once, not live until it times out (10 s by default)."""
    import grpc

    takes = start_shard(0, 2, tmp_path)
    refuses = start_shard(1, 2, tmp_path, extra=["--max-workers", "1"])
    try:
        with pytest.raises(ShardpsError, match="workers"):
            Client([takes.address, refuses.address], timeout=10, retry_timeout=1, rank=1, world_size=2)
        with grpc.insecure_channel(takes.address) as ch:
            beat = ch.unary_unary("/shardps.v1.Shard/Heartbeat",
                                  request_serializer=pb.HeartbeatRequest.SerializeToString,
                                  response_deserializer=pb.HeartbeatResponse.FromString)
            reply = beat(pb.HeartbeatRequest(rank=0, world_size=2), timeout=10)
        assert list(reply.live_ranks) == [0] and list(reply.gone_ranks) == [1]
    finally:
        takes.terminate()
        refuses.terminate()


def test_clients_use_the_data_plane_by_default_and_grpc_streams_without_one(tmp_path, monkeypatch):
    with_plane = start_shard(0, 1, tmp_path)
    without = start_shard(0, 1, tmp_path, extra=["--data-threads", "0"])
    tcp_only = start_shard(0, 1, tmp_path, extra=["--no-data-ipc"])
    try:
        for shard, expected in ((with_plane, "zmq-shm"), (without, "grpc-stream"), (tcp_only, "zmq")):
            with Client([shard.address], timeout=10, retry_timeout=5, data_plane="zmq") as c:
                c.create_table("t", dim=2, num_embeddings=10)
                c.push("t", torch.arange(3), torch.ones(3, 2), wait=True)
                assert c.pull("t", torch.arange(3)).shape == (3, 2)
                assert c.transport.data_planes() == [expected]
                info = c.shard_info()[0]
                assert len(info.data_ports) == (0 if expected == "grpc-stream" else 2)
                assert len(info.data_ipc) == (2 if expected == "zmq-shm" else 0)
                # The shard tells the same: this connection's transport, as `shardps stats` shows it.
                assert [p.transport for p in info.data_clients] == [expected]
        with Client([with_plane.address]) as c:  # the default: the data plane, over its Unix socket on this machine
            c.pull("t", torch.arange(3))
            assert c.transport.data_planes() == ["zmq-shm"]
        with Client([with_plane.address], data_plane="zmq-tcp") as c:  # asked for TCP: as from another machine
            c.pull("t", torch.arange(3))
            assert c.transport.data_planes() == ["zmq"]
        with Client([with_plane.address], data_plane="grpc") as c:  # asked for gRPC streams
            c.pull("t", torch.arange(3))
            assert c.transport.data_planes() == ["grpc-stream"]
        monkeypatch.setenv("SHARDPS_DATA_PLANE", "grpc")  # the same, from the environment
        with Client([with_plane.address]) as c:
            c.pull("t", torch.arange(3))
            assert c.transport.data_planes() == ["grpc-stream"]
        monkeypatch.delenv("SHARDPS_DATA_PLANE")
        # A client elsewhere (another machine, another network namespace: another scope) connects over TCP.
        monkeypatch.setattr(protocol, "local_scope", lambda: "another-machine/1")
        with Client([with_plane.address]) as c:
            c.pull("t", torch.arange(3))
            assert c.transport.data_planes() == ["zmq"]
    finally:
        with_plane.terminate()
        without.terminate()
        tcp_only.terminate()


def test_with_tokens_a_connection_presents_one_before_any_request_is_decoded(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"trainer {TOKEN}\nreader {'r' * 24}\n")
    shard = start_shard(0, 1, tmp_path, extra=["--tokens-file", str(tokens)])
    try:
        with Client([shard.address], token=TOKEN) as c:
            info = c.shard_info()[0]
            with pytest.raises(Exception, match="only an admin"):
                c.create_table("t", dim=2, num_embeddings=10)
        # The TCP port and the Unix socket alike.
        for port in (info.data_ports[0], f"ipc://@{info.data_ipc[0]}"):
            # No hello: refused without being decoded (garbage gets the same answer as a valid frame).
            for frame in (_pull_frame(), os.urandom(64)):
                reply = data_plane_call(port, frame, hello=False)
                assert reply.error.code == 16 and "hello" in reply.error.message  # UNAUTHENTICATED
            assert data_plane_call(port, _pull_frame(), token="w" * 30).error.code == 16  # an unknown token
            reply = data_plane_call(port, _pull_frame(), token="r" * 24)  # a reader may pull (no such table here)
            assert reply.error.code == 5 and "t" in reply.error.message  # NOT_FOUND: past authentication
    finally:
        shard.terminate()


class _Wiretap:
    """A TCP relay on 127.0.0.1 between one client connection and ``port``, keeping every byte it passes both
    ways: what someone on the network would see. Bounded: it stops when either side closes, or at ``close``."""

    def __init__(self, port: int) -> None:
        self.seen = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(10)
        self.port = self._listener.getsockname()[1]
        self._target, self._socks = port, []
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        server = socket.create_connection(("127.0.0.1", self._target), timeout=10)
        self._socks = [client, server]
        pumps = [threading.Thread(target=self._pump, args=pair, daemon=True) for pair in ((client, server), (server, client))]
        for t in pumps:
            t.start()
        for t in pumps:
            t.join(30)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in self._socks:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pumps (a close would leave them in recv)
        self._thread.join(10)
        for sock in self._socks:
            sock.close()


def _push_frame(values: np.ndarray) -> bytes:
    return pb.StreamRequest(push=pb.PushRequest(
        table="t", ids=codec.encode(np.arange(len(values), dtype=np.int64)), grads=codec.encode(values),
        shard_map=pb.ShardMap(num_shards=1), client_id="tap", seq=1)).SerializeToString()


def test_with_tls_every_data_plane_message_is_sealed_under_a_session_handed_out_over_tls(tmp_path):
    dev = certs.make_dev_certs(str(tmp_path / "pki"))
    shard = start_shard(0, 1, tmp_path, extra=["--tls-cert", dev.server_cert, "--tls-key", dev.server_key])
    tls = TLS(ca=dev.ca)
    grads = np.full((3, 2), 1234.5678, np.float32)  # pushed with SGD lr 1 onto zeros: the rows are -grads
    try:
        with Client([shard.address], tls=tls, timeout=10, data_plane="zmq") as c:
            c.create_table("t", dim=2, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
            c.push("t", torch.arange(3), torch.ones(3, 2), wait=True)
            assert c.transport.data_planes() == ["zmq-ipc"]
            info = c.shard_info()[0]
            c.push("t", torch.arange(3), -torch.ones(3, 2), wait=True)  # back to zeros
        assert not info.data_session_id  # handed out only when asked for (a data-plane client about to connect)
        port = info.data_ports[0]

        # A wiretap sees neither what is pushed nor what is pulled (in plaintext, it sees both).
        tap = _Wiretap(port)
        try:
            session = data_session(shard.address, tls)
            assert len(session[0]) == 16 and len(session[1]) == 32
            assert not data_plane_call(tap.port, _push_frame(grads), session=session).HasField("error")
        finally:
            tap.close()
        tap = _Wiretap(port)
        try:
            reply = data_plane_call(tap.port, _pull_frame(), session=data_session(shard.address, tls))
        finally:
            tap.close()
        assert codec.decode(reply.pull.rows, "rows").tobytes() == (-grads).tobytes()
        assert len(tap.seen) > 2 * grads.nbytes
        assert grads.tobytes()[:8] not in tap.seen and (-grads).tobytes()[:8] not in tap.seen

        # A session serves one connection; a hello that does not open takes nothing from its client.
        session = data_session(shard.address, tls)
        forged = data_plane_call(port, _pull_frame(), session=(session[0], os.urandom(32)))
        assert forged.error.code == 16 and "does not open" in forged.error.message  # UNAUTHENTICATED
        assert not data_plane_call(port, _pull_frame(), session=session).HasField("error")
        again = data_plane_call(port, _pull_frame(), session=session)
        assert again.error.code == 16 and "used session" in again.error.message
        # No session, or a plaintext request on a sealed connection: refused before anything is decoded.
        plain = data_plane_call(port, _push_frame(grads))
        assert plain.error.code == 16 and "with TLS a hello is" in plain.error.message
        assert data_plane_call(port, _pull_frame(), hello=False).error.code == 16

        # Changed, replayed or plaintext requests on a sealed connection: refused, the connection forgotten.
        for bad in ("changed", "replayed", "plaintext", "after a lost one"):
            session = data_session(shard.address, tls)
            sealing = Seal(session[1], sending=TO_SHARD, receiving=TO_CLIENT)
            sock = dealer(port)
            try:
                sock.send_multipart(sealed_hello(sealing, session[0]))
                assert hello_answer(sock.recv_multipart(), sealing) == (b"ok", b"")
                rid = b"\x01" * 8
                counter, sealed = sealing.seal(_pull_frame(), rid)
                if bad == "replayed":
                    sock.send_multipart([rid, counter, sealed])
                    assert not pb.StreamResponse.FromString(sealing.open(*sock.recv_multipart()[1:], rid)).HasField("error")
                    parts = [rid, counter, sealed]
                elif bad == "changed":
                    counter, sealed = sealing.seal(_push_frame(grads), rid)
                    changed = bytearray(sealed)
                    changed[5] ^= 1
                    parts = [rid, counter, bytes(changed)]
                elif bad == "after a lost one":  # the network lost the first: the second must not overtake it
                    parts = [rid, *sealing.seal(_pull_frame(), rid)]
                else:
                    parts = [rid, _push_frame(grads)]
                sock.send_multipart(parts)
                answer = sock.recv_multipart()
                assert answer[:2] == [b"", b"error"], bad
                assert pb.StreamResponse.FromString(answer[2]).error.code == 16
                sock.send_multipart([rid, *sealing.seal(_push_frame(grads), rid)])  # then even a genuine one
                error = pb.StreamResponse.FromString(sock.recv_multipart()[-1]).error
                assert error.code == 16 and "has not presented its credentials" in error.message
            finally:
                sock.close(0)
        with Client([shard.address], tls=tls, timeout=10) as c:  # only the push through the tap changed rows
            torch.testing.assert_close(c.pull("t", torch.arange(3)), torch.from_numpy(-grads), rtol=0, atol=0)
    finally:
        shard.terminate()


def test_a_sealed_lane_connects_again_when_its_session_is_refused_or_an_answer_does_not_open(tmp_path):
    """The client's side of a sealed connection. A hello whose session the shard does not hold (its previous
    process handed it out, say: here, one used already) is sent again on a new connection with a new session.
    Answers that do not open (here: every one looks replayed, as if the client had already accepted later ones)
    end the connection; the lane takes a new session, resends the unanswered push, and the shard answers it as
    the duplicate it is: applied once."""
    dev = certs.make_dev_certs(str(tmp_path / "pki"))
    shard = start_shard(0, 1, tmp_path, extra=["--tls-cert", dev.server_cert, "--tls-key", dev.server_key])
    tls = TLS(ca=dev.ca)
    try:
        # (Without the shard-map check a client's lanes connect at its first call, not at once: the test swaps the
        # lane's discovery before it connects.)
        with Client([shard.address], tls=tls, timeout=10, data_plane="zmq", check_shard_map=False) as c:
            c.create_table("t", dim=2, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
            used = data_session(shard.address, tls)
            assert not data_plane_call(c.shard_info()[0].data_ports[0], _pull_frame(), session=used).HasField("error")
            lane = c.transport.lanes[0]
            discover, asked = lane.dialer._discover, []

            def stale_first() -> pb.ShardInfoResponse:
                info = discover()
                asked.append(bytes(info.data_session_id))
                if len(asked) == 1:
                    info.data_session_id, info.data_session_key = used
                return info

            lane.dialer._discover = stale_first
            c.push("t", torch.arange(3), torch.ones(3, 2), wait=True)
            assert len(asked) == 2 and lane._seal is not None

            with lane._io:  # the connection's next answers fail their counter check
                first = lane._seal
                first._received = 2**62
            c.push("t", torch.arange(3), torch.ones(3, 2), wait=True)
            assert lane._seal is not None and lane._seal is not first and len(asked) == 3  # a new session
            torch.testing.assert_close(c.pull("t", torch.arange(3)), -2 * torch.ones(3, 2), rtol=0, atol=0)
            assert c.shard_info()[0].stats.duplicates == 1  # the resend, answered without applying it again
            assert c.transport.data_planes() == ["zmq-ipc"]
        with Client([shard.address], tls=tls, timeout=10, data_plane="zmq", check_shard_map=False) as c:
            # A client on TLS whose ShardInfo hands out no session (a proxy that ends TLS in front of a plaintext
            # shard, say) does not send its token in clear on the data plane: it uses gRPC streams.
            lane = c.transport.lanes[0]
            discover = lane.dialer._discover

            def no_session() -> pb.ShardInfoResponse:
                info = discover()
                info.ClearField("data_session_id")
                return info

            lane.dialer._discover = no_session
            c.push("t", torch.arange(3), torch.ones(3, 2), wait=True)
            assert c.transport.data_planes() == ["grpc-stream"]
    finally:
        shard.terminate()


def test_malformed_traffic_changes_nothing_and_the_shard_keeps_serving(tmp_path):
    """Raw multipart messages (random bytes, truncated and oversized frames, wrong shapes): each is refused
    or dropped; the table is unchanged and clients are served throughout. Bounded: 300 messages."""
    shard = start_shard(0, 1, tmp_path, extra=["--max-message-mb", "1"])
    rng = np.random.default_rng(5)
    try:
        with Client([shard.address], timeout=10) as c:
            c.create_table("t", dim=2, num_embeddings=10)
            before = c.pull("t", torch.arange(10))
            port = c.shard_info()[0].data_ports[0]
            sock = dealer(port)

            def push(table: str, cols: int, n: int = 3) -> bytes:
                return pb.StreamRequest(push=pb.PushRequest(
                    table=table, ids=codec.encode(np.arange(n, dtype=np.int64)),
                    grads=codec.encode(np.ones((n, cols), np.float32)), shard_map=pb.ShardMap(num_shards=1)
                )).SerializeToString()

            good = push("t", 2)
            for k in range(300):
                kind = k % 5
                if kind == 0:
                    parts = [os.urandom(int(rng.integers(0, 40))) for _ in range(int(rng.integers(1, 5)))]
                elif kind == 1:
                    parts = [b"\x02" * 8, good[: int(rng.integers(0, len(good) - 1))]]  # truncated
                elif kind == 2:  # well-formed, refused: a wrong width, an unknown table, ids out of range
                    parts = [b"\x03" * 8, [push("t", 5), push("nope", 2), push("t", 2, n=11)][k % 3]]
                elif kind == 3:
                    parts = [b"", os.urandom(8)]  # a control message that is not a hello
                else:
                    parts = [b"\x04" * 8, os.urandom(2 << 20)] if k % 50 == 4 else [b"\x05" * 8, b""]  # oversized
                sock.send_multipart(parts)
            sock.close(0)
            assert not data_plane_call(port, _pull_frame()).HasField("error")  # still serving
            after = c.pull("t", torch.arange(10))
        torch.testing.assert_close(after, before, rtol=0, atol=0)  # nothing refused changed a row
        assert shard.proc.poll() is None and "Traceback" not in shard.log()
    finally:
        shard.terminate()


def test_kill9_of_shards_under_a_data_plane_client_loses_nothing_and_applies_nothing_twice(tmp_path):
    """A client pushes +1s over the data plane while shards are killed -9 and restarted (on new data ports,
    found again through ShardInfo): every acknowledged push is there once. The pushes (about 128 KB a shard) are built
    in libzmq messages (``zmsg``) and go through the connections' shared-memory slots (``region``): the calls resent on
    new connections (new regions) are sent again from those messages."""
    import threading

    from shardps_client import SGD

    from shardps.core.specs import Initializer

    n, rows, dim, batch = 2, 256, 1024, 64
    shards = [start_shard(i, n, tmp_path, str(tmp_path / f"d{i}")) for i in range(n)]
    counts = np.zeros(rows, np.int64)
    stop, errors, acked = threading.Event(), [], [0]

    def trainer() -> None:
        rng = np.random.default_rng(1)
        try:
            with Client([s.address for s in shards], timeout=10, retry_timeout=60, data_plane="zmq") as c:
                while not stop.is_set():
                    ids = rng.choice(rows, size=batch, replace=False)
                    c.push("cnt", torch.from_numpy(ids), torch.ones(batch, dim), wait=True)
                    counts[ids] += 1
                    acked[0] += 1
                assert c.transport.data_planes() == ["zmq-shm", "zmq-shm"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        with Client([s.address for s in shards]) as c:
            c.create_table("cnt", dim=dim, num_embeddings=rows, optimizer=SGD(lr=1.0),
                           initializer=Initializer("zeros"))
        t = threading.Thread(target=trainer)
        t.start()
        for k in range(3):
            before = acked[0]
            deadline = time.monotonic() + 60
            while acked[0] < before + 5:  # progress between kills (a generous bound, never a rate)
                assert not errors and time.monotonic() < deadline, errors or "no progress"
                time.sleep(0.02)
            i = k % n
            port = shards[i].address.rsplit(":", 1)[1]
            shards[i].kill()
            shards[i] = start_shard(i, n, tmp_path, str(tmp_path / f"d{i}"), port=port)
        stop.set()
        t.join(120)
        assert not errors, errors
        with Client([s.address for s in shards]) as c:
            got = c.pull("cnt", torch.arange(rows))
        want = -torch.from_numpy(counts.astype(np.float32))[:, None].expand(rows, dim)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        stop.set()
        for s in shards:
            s.kill()


def test_each_lost_connection_gets_its_own_retry_window(tmp_path):
    """retry_timeout bounds how long one loss is retried, not the time since the first loss: a connection lost,
    found again and used for longer than retry_timeout, then lost again, is retried again (it failed at once)."""
    from shardps_client import SGD

    from shardps.core.specs import Initializer

    data = str(tmp_path / "d")
    shard = start_shard(0, 1, tmp_path, data)
    try:
        # (retry_timeout: the time a busy machine may take to start the shard again, with room to spare)
        with Client([shard.address], timeout=10, retry_timeout=12, data_plane="zmq") as c:
            c.create_table("t", dim=2, num_embeddings=4, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
            for k in range(2):
                if k:
                    time.sleep(12.5)  # used past retry_timeout since the first loss
                freeze(shard.proc.pid)  # a push in flight when the shard goes
                c.push("t", torch.arange(4), torch.ones(4, 2))
                port = shard.address.rsplit(":", 1)[1]
                shard.kill()
                shard = start_shard(0, 1, tmp_path, data, port=port)
                c.flush()  # resent to the new process and answered (before the fix, the second loss failed it)
            assert c.transport.data_planes() == ["zmq-shm"]
            torch.testing.assert_close(c.pull("t", torch.arange(4)), -2 * torch.ones(4, 2), rtol=0, atol=0)
    finally:
        shard.kill()


def test_a_waiting_call_hands_its_socket_over_and_its_connection_keeps_order(tmp_path):
    """Three workers of a synchronous table on a shard with one data-plane socket: each worker's step waits
    for the others', so the socket's thread must not wait with it (it did: the step never completed). Worker
    0's pull, sent after its push, waits behind it on its connection and sees the step applied."""
    from shardps_client import SGD, SyncPolicy

    from shardps.core.specs import Initializer
    from tests.conftest import run_workers

    shard = start_shard(0, 1, tmp_path, extra=["--data-threads", "1"])
    ids = torch.arange(4)
    try:
        with Client([shard.address]) as c:
            c.create_table("s", dim=2, num_embeddings=4, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                           sync=SyncPolicy(workers=3, aggregator="sum", timeout_s=60, on_timeout="fail"))
        seen: dict[int, torch.Tensor] = {}

        def body(c: Client, rank: int) -> None:
            for step in range(3):
                c.push("s", ids, torch.full((4, 2), float(rank + 1)))  # not waited for
                seen[step] = c.pull("s", ids) if rank == 0 else seen.get(step)  # behind the push, on its lane
                c.flush()
            assert c.transport.data_planes() == ["zmq-shm"]

        assert not run_workers([shard.address], 3, body, timeout=30, retry_timeout=5)
        for step in range(3):  # each step subtracts the sum of the three workers' gradients (1 + 2 + 3)
            torch.testing.assert_close(seen[step], torch.full((4, 2), -6.0 * (step + 1)), rtol=0, atol=0)
        with Client([shard.address], data_plane="grpc") as c:
            info = c.shard_info()[0]
        assert info.data_plane_handoffs >= 3  # every step's completing pushes waited off the socket's thread
        assert sorted(d.transport for d in info.data_clients) == ["zmq-shm"] * 3
        from shardps.server.ops.report import collect, render

        rows = collect([shard.address], interval=0)  # shardps stats: each client's transport
        assert [c["transport"] for c in rows[0]["clients"]] == ["zmq-shm"] * 3
        assert "clients in the last minute: 3 over zmq-shm; data plane on port " in render(rows)
        assert render(rows).count(" and Unix sockets") == 1
        assert shard.proc.poll() is None and "Traceback" not in shard.log()
    finally:
        shard.terminate()


def test_a_call_waiting_off_the_socket_when_the_shard_stops_still_gets_its_answer(tmp_path):
    """A synchronous push waits off the socket's thread for a worker that never comes; the shard is stopped
    (SIGTERM) meanwhile. Its step times out and applies while the data plane stops: the answer, made after the
    socket's last leader stopped, still reaches the client (it was dropped: the push, applied, went unanswered)."""
    import signal

    from shardps_client import SGD, SyncPolicy

    from shardps.core.specs import Initializer

    shard = start_shard(0, 1, tmp_path, data_dir=str(tmp_path / "data"), extra=["--data-threads", "1"])
    ids = torch.arange(4)
    try:
        with Client([shard.address]) as c:
            c.create_table("s", dim=2, num_embeddings=4, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                           sync=SyncPolicy(workers=2, aggregator="sum", timeout_s=2, on_timeout="proceed"))
        outcome: list = []
        with Client([shard.address], rank=0, world_size=2, retry_timeout=1) as c:
            c.pull("s", ids)  # connects the data plane

            def push() -> None:
                try:
                    c.push("s", ids, torch.ones(4, 2), wait=True)  # waits for rank 1, which never pushes
                    outcome.append("answered")
                except BaseException as e:  # noqa: BLE001 - the test reports it
                    outcome.append(e)

            waiting = threading.Thread(target=push, daemon=True)
            waiting.start()
            with Client([shard.address]) as look:  # the push waits off the socket's thread (seen, not slept on)
                deadline = time.monotonic() + 30
                while not look.shard_info()[0].data_plane_handoffs:
                    assert time.monotonic() < deadline and not outcome, outcome or "the push never waited"
                    time.sleep(0.02)
            assert not outcome and c.transport.data_planes() == ["zmq-shm"]
            shard.proc.send_signal(signal.SIGTERM)
            waiting.join(30)
            assert outcome == ["answered"], f"{outcome}; the shard's log:\n{shard.log()[-3000:]}"
        assert shard.proc.wait(30) == 0
    finally:
        if shard.proc.poll() is None:
            shard.terminate()


def test_health_covers_the_data_plane():
    """A data-plane socket that no thread serves any more (here a failure injected into its thread) turns the
    shard's gRPC health NOT_SERVING, so the probes of Compose and Kubernetes restart it."""
    from shardps.probe import check
    from shardps.server.rpc import ServerConfig, ShardServer
    from shardps.server.shard.facade import ShardConfig

    server = ShardServer(ShardConfig(0, 1), ServerConfig()).start()
    try:
        assert check(server.address) == "SERVING" and server.data_plane.healthy() == ""

        def broken(st):
            raise RuntimeError("injected")

        server.data_plane._receive = broken
        with pytest.raises(zmq.Again):  # its thread fails on this request: no answer
            data_plane_call(server.data_plane.ports[0], _pull_frame(), hello=False, timeout_ms=1000)
        assert "injected" in server.data_plane.healthy()
        deadline = time.monotonic() + 20
        while check(server.address) == "SERVING":
            assert time.monotonic() < deadline, "still SERVING"
            time.sleep(0.1)
        assert check(server.address) == "NOT_SERVING"
    finally:
        server.stop()


def test_a_unix_socket_that_cannot_be_reached_means_tcp(tmp_path, monkeypatch, caplog):
    """A client in the shard's scope that cannot connect to the Unix socket it was given (a sandbox, say) tries it
    UNIX_MISSES times, then uses the TCP port, with nothing lost."""
    from shardps_client import data_plane

    real = data_plane.endpoint
    tried: list[str] = []

    def unreachable(info, host, pick, ipc):  # what the shard names, replaced by a socket nobody listens on
        e = real(info, host, pick, ipc)
        tried.append(e)
        return f"ipc://@shardps-nobody-{os.urandom(8).hex()}" if e.startswith("ipc:") else e

    monkeypatch.setattr(data_plane, "endpoint", unreachable)
    monkeypatch.setattr(data_plane, "SEND_TIMEOUT_MS", 200)  # each miss gives up sooner
    shard = start_shard(0, 1, tmp_path)
    try:
        with Client([shard.address], timeout=30, retry_timeout=30) as c:
            c.create_table("t", dim=2, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
            c.push("t", torch.arange(3), torch.ones(3, 2), wait=True)
            torch.testing.assert_close(c.pull("t", torch.arange(3)), -torch.ones(3, 2), rtol=0, atol=0)
            assert c.transport.data_planes() == ["zmq"]
        assert [e.split(":")[0] for e in tried] == ["ipc"] * data_plane.UNIX_MISSES + ["tcp"]
        assert "not reachable; using TCP" in caplog.text
    finally:
        shard.terminate()


def test_a_client_never_closed_is_closed_once_collected_and_its_pushes_are_applied(tmp_path):
    """A Client dropped without close() (a notebook's, a loop's): nothing of it kept it alive but its own threads
    (the heartbeats' closure held it), so its lanes, threads and sockets stayed until the process ended, and its
    pushes were never flushed. Now no thread holds it: once collected, a finalizer closes it as close() would, in a
    thread of its own: its pushes are applied and every thread it started ends."""
    import gc
    import weakref

    shard = start_shard(0, 1, tmp_path)
    try:
        with Client([shard.address]) as c:
            c.create_table("t", dim=4, num_embeddings=1000, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        before = set(threading.enumerate())
        c = Client([shard.address], rank=0, world_size=1, read_your_writes=False)  # a heartbeat thread too
        c.push("t", torch.arange(100), torch.ones(100, 4))  # asynchronous: left unflushed
        mine = [t for t in threading.enumerate() if t not in before]  # (another test's client collected below
        assert any(t.name == "shardps-heartbeat" for t in mine)  # may start threads of its own meanwhile)
        collected = weakref.ref(c)
        del c
        gc.collect()
        assert collected() is None, "a client without references was not collected"
        deadline = time.monotonic() + 30
        while running := [t.name for t in mine if t.is_alive()]:
            assert time.monotonic() < deadline, f"threads the client started are still running: {running}"
            time.sleep(0.05)
        with Client([shard.address]) as c:
            assert (c.pull("t", torch.arange(100)) == -1).all()
    finally:
        shard.kill()
