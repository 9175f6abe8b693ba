"""Shared-memory regions on the data plane (``shardps.core.region``) against real shard processes: a client on the
shard's machine gets large pull answers through its connection's region, and sends pushes that trail a pull through
it, with what local math gives; slots stay the caller's while a view of them lives; hostile descriptors and slots
are refused and change nothing; a region taken back from an idle connection makes its client connect again and lose
nothing."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from shardps_client import SGD, Client, Initializer

from shardps.core import codec, region
from shardps.v1 import shardps_pb2 as pb
from tests.procs import start_shard
from tests.test_data_plane import dealer

pytestmark = pytest.mark.skipif(not hasattr(__import__("os"), "memfd_create"), reason="regions need Linux's memfd")


def _spy(monkeypatch) -> tuple[list[int], list[int]]:
    """The answers the client's regions hand back, and the requests sent from their slots (the real code, counted)."""
    seen: list[int] = []
    sent: list[int] = []
    answer, placed = region.ClientRegion.answer, region.ClientRegion.placed

    def counted(self, ans, described):
        seen.append(ans)
        return answer(self, ans, described)

    def counted_placed(self, request):
        found = placed(self, request)
        if found is not None:
            sent.append(found[0])
        return found

    monkeypatch.setattr(region.ClientRegion, "answer", counted)
    monkeypatch.setattr(region.ClientRegion, "placed", counted_placed)
    return seen, sent


def test_large_pull_answers_come_through_shared_memory_and_match_local_sgd(tmp_path, monkeypatch):
    seen, sent = _spy(monkeypatch)
    shards = [start_shard(i, 2, tmp_path) for i in range(2)]
    off = start_shard(0, 1, tmp_path, extra=["--data-regions", "0"])
    try:
        rows, dim, lr = 20_000, 64, 0.5
        rng = np.random.default_rng(3)
        init = rng.standard_normal((rows, dim)).astype(np.float32)
        want = torch.from_numpy(init.copy())
        with Client([s.address for s in shards], timeout=20) as c:
            c.create_table("t", dim=dim, num_embeddings=rows, optimizer=SGD(lr=lr), initializer=Initializer("zeros"))
            c.push("t", torch.arange(rows), torch.from_numpy(-init / lr), wait=True)  # rows := init
            for step in range(6):
                ids = torch.from_numpy(np.unique(rng.integers(0, rows, 6000)))  # ~0.7 MB of rows a shard
                got = c.pull("t", ids)
                torch.testing.assert_close(got, want[ids], rtol=0, atol=0)
                grads = torch.from_numpy(rng.standard_normal((len(ids), dim)).astype(np.float32))
                c.push("t", ids, grads, wait=step % 2 == 0)
                want[ids] -= lr * grads
            torch.testing.assert_close(c.pull("t", torch.arange(rows)), want, rtol=0, atol=1e-6)
            assert c.transport.data_planes() == ["zmq-shm", "zmq-shm"]
            assert sorted({p.transport for info in c.shard_info() for p in info.data_clients}) == ["zmq-shm"]
            assert all(info.data_regions for info in c.shard_info())
        assert len(seen) == 12, seen  # the rows really came through the slots (6 pulls, 2 shards; the whole table's
        # 2.6 MB a shard does not fit a slot: it came in its message)
        assert sent == []  # pushes that precede the next pull (read-your-writes) go in their messages
        with Client([s.address for s in shards], timeout=20, read_your_writes=False) as c:  # pushes trail pulls
            for _ in range(6):
                ids = torch.from_numpy(np.unique(rng.integers(0, rows, 6000)))
                c.pull("t", ids)  # (rows as of the pushes sent before it: the last one may trail it)
                grads = torch.from_numpy(rng.standard_normal((len(ids), dim)).astype(np.float32))
                c.push("t", ids, grads)
                want[ids] -= lr * grads
                grads.fill_(float("nan"))  # built into its slot when pushed: what the caller does after is not sent
            c.flush()
            torch.testing.assert_close(c.pull("t", torch.arange(rows)), want, rtol=0, atol=1e-5)
            assert [len(lane._region._requests) for lane in c.transport.lanes] == [region.SLOTS] * 2  # all let go
        assert len(sent) == 12, sent  # 6 pushes to 2 shards, each built in a request slot and sent from it
        small = list(seen)
        with Client([s.address for s in shards]) as c:  # small calls stay in their messages
            c.pull("t", torch.arange(10))
            c.push("t", torch.arange(10), torch.zeros(10, dim), wait=True)
        assert seen == small and len(sent) == 12  # (the pull was offered an answer slot; its small answer, and the
        # small push, came in their messages)
        assert set(seen) <= set(range(region.SLOTS))  # slots freed and handed out again
        with Client([off.address]) as c:  # a shard with no regions: the Unix socket alone
            c.create_table("t", dim=dim, num_embeddings=rows)
            c.pull("t", torch.arange(rows))
            assert c.transport.data_planes() == ["zmq-ipc"] and not c.shard_info()[0].data_regions
        monkeypatch.setenv("SHARDPS_DATA_REGIONS", "0")  # a client that does not ask
        with Client([shards[0].address, shards[1].address]) as c:
            torch.testing.assert_close(c.pull("t", torch.arange(rows)), want, rtol=0, atol=1e-6)
            assert c.transport.data_planes() == ["zmq-ipc", "zmq-ipc"]
    finally:
        for s in (*shards, off):
            s.terminate()


def test_an_answer_slot_stays_the_callers_while_a_view_of_it_lives():
    shard = region.ShardRegion(slot_bytes=1 << 16, slots=2)
    offer = shard.offer()
    assert region.open_offer(offer.replace(shard.nonce.hex().encode(), b"0" * 32)) is None  # not the shard's: unused
    client = region.open_offer(offer)  # (this process may open its own descriptors)
    assert client is not None
    first, second = client.offer(), client.offer()
    assert (first, second) == (0, 1)
    assert client.offer() is None  # both slots offered
    frame, ans, target = shard.request(region.REQUEST.pack(region.NO_SLOT, 0, second), b"frame")
    assert (bytes(frame), ans) == (b"frame", 1) and target is not None
    target[:5] = b"hello"
    view = client.answer(1, region.ANSWER.pack(1, 5))  # the second call's answer, in its slot
    client.release(first)  # the first call's answer came in its message: its slot is free
    assert bytes(view) == b"hello"
    rows = np.frombuffer(view, np.uint8)  # a view of the view keeps the slot too
    del view
    assert list(client._answers) == [0]
    del rows
    assert sorted(client._answers) == [0, 1]  # freed with its last view
    with pytest.raises(ValueError):
        client.answer(0, region.ANSWER.pack(1, 5))  # an answer in a slot the call was not given
    with pytest.raises(ValueError):
        client.answer(region.NO_SLOT, region.ANSWER.pack(region.NO_SLOT, 5))  # (a call given none)
    for descriptor in (region.REQUEST.pack(region.NO_SLOT, 0, 2), region.REQUEST.pack(2, 5, region.NO_SLOT),
                       region.REQUEST.pack(0, (1 << 16) + 1, region.NO_SLOT), region.REQUEST.pack(region.NO_SLOT, 5, 0),
                       b"\x00" * 4):
        with pytest.raises(region.RegionError):
            shard.request(descriptor, b"")
    with pytest.raises(region.RegionError):  # in its slot and in its message both
        shard.request(region.REQUEST.pack(0, 5, region.NO_SLOT), b"frame")
    assert region.open_offer(b"1 0 " + b"0" * 32 + b" 65536 2") is None  # pid 1's stdin: not a shardps memfd


def test_the_slot_freed_last_is_taken_first():
    """One call at a time keeps using one answer slot and one request slot (their pages made, likely in cache), not
    the next slot round."""
    shard = region.ShardRegion(slot_bytes=1 << 16, slots=4)
    client = region.open_offer(shard.offer())
    assert client is not None
    for _ in range(3):
        ans = client.offer()
        assert ans == 0
        client.release(ans)  # (answered through the socket)
    first, second = client.offer(), client.offer()
    view = client.answer(second, region.ANSWER.pack(second, 5))
    client.release(first)
    del view  # the second slot is freed after the first: taken first
    assert (client.offer(), client.offer()) == (second, first)
    for _ in range(3):
        req = client.reserve(region.MIN_SLOT_BYTES)
        assert req is not None and client.placed(req) == (0, region.MIN_SLOT_BYTES)
        del req


def test_a_request_slot_is_its_requests_until_the_last_view_goes_and_the_shard_reads_a_copy():
    shard = region.ShardRegion(slot_bytes=1 << 16, slots=2)
    client = region.open_offer(shard.offer())
    assert client is not None
    assert client.reserve(region.MIN_SLOT_BYTES - 1) is None and client.reserve((1 << 16) + 1) is None  # no slot
    one, two = client.reserve(1 << 16), client.reserve(region.MIN_SLOT_BYTES)
    assert one is not None and two is not None and client.reserve(1 << 16) is None  # both held
    one[:] = b"a" * (1 << 16)
    assert client.placed(one) == (0, 1 << 16) and client.placed(two) == (1, region.MIN_SLOT_BYTES)
    assert client.placed(one[1:]) is None and client.placed(bytes(one)) is None  # a part, a copy: not the slot's
    frame, ans, target = shard.request(region.REQUEST.pack(0, 1 << 16, region.NO_SLOT), b"")
    one[:1] = b"b"  # the client changes its slot after the shard read it: the shard's copy does not change
    assert bytes(frame) == b"a" * (1 << 16) and ans == region.NO_SLOT and target is None
    elsewhere = region.ShardRegion(slot_bytes=1 << 16, slots=2)
    other = region.open_offer(elsewhere.offer())
    assert other is not None and other.placed(one) is None  # another region's slot
    kept = np.frombuffer(one, np.uint8)
    del one
    assert list(client._requests) == []  # a view of it lives
    del kept, two
    assert sorted(client._requests) == [0, 1]


def _push_frame(table: str, ids: np.ndarray, grads: np.ndarray) -> bytes:
    return pb.StreamRequest(push=pb.PushRequest(table=table, ids=codec.encode(ids), grads=codec.encode(grads),
                                                shard_map=pb.ShardMap(num_shards=1))).SerializeToString()


def _answer(sock, rid: bytes, shm: region.ClientRegion | None = None, slot: int = region.NO_SLOT) -> pb.StreamResponse:
    parts = sock.recv_multipart()
    assert parts[0] == rid, parts[:1]
    if len(parts) == 3:
        assert shm is not None and parts[1] == b""
        return pb.StreamResponse.FromString(bytes(shm.answer(slot, parts[2])))
    return pb.StreamResponse.FromString(parts[1])


def test_hostile_descriptors_are_refused_and_change_nothing(tmp_path):
    """Raw region traffic, as any local process could send it: slots out of range, descriptors of the wrong size, a
    descriptor on a connection without a region, a hello asking for one with something else, and 200 random
    descriptors with random or truncated frames in the message or in a request slot (bounded). Each is answered with
    an error a client may get and no row changes; a good push from its slot afterwards is applied, and a good pull's
    answer comes through its slot."""
    shard = start_shard(0, 1, tmp_path)
    try:
        rows, dim = 256, 512
        with Client([shard.address], timeout=10) as c:
            c.create_table("t", dim=dim, num_embeddings=rows, optimizer=SGD(lr=0.5))
            before = c.pull("t", torch.arange(rows))
            info = c.shard_info()[0]
        sock = dealer(f"ipc://@{info.data_ipc[0]}")
        sock.send_multipart([b"", b"hello", b"", region.ASK])
        hello = sock.recv_multipart()
        assert hello[:2] == [b"", b"ok"] and len(hello) == 3, hello
        shm = region.open_offer(hello[2])
        assert shm is not None
        push = _push_frame("t", np.arange(rows, dtype=np.int64), np.ones((rows, dim), np.float32))
        held = shm.reserve(len(push))  # the push in request slot 0 (a client may write its slots at any time)
        assert held is not None and shm.placed(held) == (0, len(push))
        held[:] = push
        no = region.NO_SLOT
        for k, (descriptor, inline) in enumerate([
                (region.REQUEST.pack(no, 0, shm.slots), push), (region.REQUEST.pack(shm.slots, len(push), no), b""),
                (region.REQUEST.pack(0, shm.slot_bytes + 1, no), b""), (region.REQUEST.pack(no, len(push), no), b""),
                (region.REQUEST.pack(0, len(push), no), push), (region.REQUEST.pack(0, len(push), shm.slots), b""),
                (b"\x00" * 3, push), (b"\x00" * 13, push), (b"", push)]):
            rid = b"b%07d" % k
            sock.send_multipart([rid, descriptor, inline])
            assert _answer(sock, rid).error.code == 3, k  # INVALID_ARGUMENT, the push not read
        rng = np.random.default_rng(11)
        for k in range(200):
            req, ans = (int(rng.choice([0, 1, no, int(rng.integers(0, 2**32))])) for _ in range(2))
            frame = rng.bytes(int(rng.integers(0, 256))) if rng.random() < 0.7 else push[:int(rng.integers(0, len(push)))]
            n = len(frame)
            if req == 0:  # what the request slot holds now: random bytes, a truncated push
                held[:n] = frame
            elif rng.random() < 0.5:
                n = int(rng.integers(0, 2**32))
            rid = b"r%07d" % k
            sock.send_multipart([rid, region.REQUEST.pack(req, n if req != no else 0, ans), frame if req == no else b""])
            resp = _answer(sock, rid, shm, ans)
            assert resp.WhichOneof("result") != "error" or resp.error.code not in (2, 13), resp.error  # not INTERNAL
        tcp = dealer(info.data_ports[0])  # over TCP: no region (it cannot be shared with another machine)
        tcp.send_multipart([b"", b"hello", b"", region.ASK])
        assert tcp.recv_multipart() == [b"", b"ok"]
        tcp.send_multipart([b"n" * 8, region.REQUEST.pack(no, 0, 0), push])
        assert _answer(tcp, b"n" * 8).error.code == 3  # a region this connection was not given
        tcp.send_multipart([b"", b"hello", b"", b"shared please"])
        assert tcp.recv_multipart()[1] == b"error"
        tcp.close(0)
        with Client([shard.address]) as c:
            torch.testing.assert_close(c.pull("t", torch.arange(rows)), before, rtol=0, atol=0)  # nothing changed
        pull = pb.StreamRequest(pull=pb.PullRequest(table="t", ids=codec.encode(np.arange(rows, dtype=np.int64)),
                                                    shard_map=pb.ShardMap(num_shards=1))).SerializeToString()
        held[:] = push  # a good push from its request slot is applied
        sock.send_multipart([b"p" * 8, region.REQUEST.pack(0, len(push), no), b""])
        assert _answer(sock, b"p" * 8).WhichOneof("result") == "push"
        sock.send_multipart([b"g" * 8, region.REQUEST.pack(no, 0, 1), pull])
        parts = sock.recv_multipart()
        assert len(parts) == 3 and parts[1] == b"", parts[:2]  # 512 KB of rows: in the answer slot
        got = pb.StreamResponse.FromString(bytes(shm.answer(1, parts[2]))).pull
        torch.testing.assert_close(torch.from_numpy(codec.decode(got.rows, "rows").copy()), before - 0.5, rtol=0,
                                   atol=0)
        sock.close(0)
        assert shard.proc.poll() is None and "Traceback" not in shard.log()
    finally:
        shard.terminate()


def test_a_region_taken_back_from_an_idle_connection_makes_its_client_connect_again_and_lose_nothing(tmp_path):
    """One region per socket (``--data-regions 1``, one socket): a second client, once the first has been idle
    ``REGION_IDLE_S``, takes its region. The first client's next push through it is refused unread; it connects
    again, sends it again and it is applied once."""
    from shardps.server.rpc.data_plane import REGION_IDLE_S

    shard = start_shard(0, 1, tmp_path, extra=["--data-regions", "1", "--data-threads", "1"])
    try:
        rows, dim = 512, 256  # 512 KB pushes: through the slots
        with Client([shard.address], timeout=20) as a:
            a.create_table("t", dim=dim, num_embeddings=rows, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
            a.push("t", torch.arange(rows), torch.ones(rows, dim), wait=True)
            assert a.transport.data_planes() == ["zmq-shm"]
            time.sleep(REGION_IDLE_S + 0.5)
            with Client([shard.address]) as b:
                b.push("t", torch.arange(rows), torch.ones(rows, dim), wait=True)
                assert b.transport.data_planes() == ["zmq-shm"]
                a.push("t", torch.arange(rows), torch.ones(rows, dim), wait=True)  # refused, sent again: applied once
                assert a.transport.data_planes() == ["zmq-ipc"]  # b's region is in use: a goes through the socket
                got = a.pull("t", torch.arange(rows))
        torch.testing.assert_close(got, torch.full((rows, dim), -3.0), rtol=0, atol=0)
        assert "Traceback" not in shard.log()
    finally:
        shard.terminate()
