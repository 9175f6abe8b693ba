"""Shared-memory regions on the data plane (``shardps.core.region``) against real shard processes: a client on the
shard's machine moves large pushes and pull answers through its connection's region and gets what local math gives;
answer slots stay the caller's while a view of them lives; hostile descriptors and slot contents are refused and
change nothing; a region taken back from an idle connection makes its client connect again and lose nothing."""

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


def _spy(monkeypatch) -> dict[str, int]:
    """Counts of the slots the client's regions hand out (the real code, counted)."""
    seen = {"requests": 0, "answers": 0}
    place, answer = region.ClientRegion.place, region.ClientRegion.answer

    def counted_place(self, request, want):
        placed = place(self, request, want)
        if placed is not None:
            seen["requests"] += placed[2] != region.NO_SLOT
        return placed

    def counted_answer(self, ans, described):
        seen["answers"] += 1
        return answer(self, ans, described)

    monkeypatch.setattr(region.ClientRegion, "place", counted_place)
    monkeypatch.setattr(region.ClientRegion, "answer", counted_answer)
    return seen


def test_large_pulls_and_pushes_go_through_shared_memory_and_match_local_sgd(tmp_path, monkeypatch):
    seen = _spy(monkeypatch)
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
                ids = torch.from_numpy(np.unique(rng.integers(0, rows, 6000)))  # ~1.3 MB of rows a shard each way
                got = c.pull("t", ids)
                torch.testing.assert_close(got, want[ids], rtol=0, atol=0)
                grads = torch.from_numpy(rng.standard_normal((len(ids), dim)).astype(np.float32))
                c.push("t", ids, grads, wait=step % 2 == 0)
                want[ids] -= lr * grads
            torch.testing.assert_close(c.pull("t", torch.arange(rows)), want, rtol=0, atol=1e-6)
            assert c.transport.data_planes() == ["zmq-shm", "zmq-shm"]
            assert sorted({p.transport for info in c.shard_info() for p in info.data_clients}) == ["zmq-shm"]
            assert all(info.data_regions for info in c.shard_info())
        assert seen["requests"] >= 12 and seen["answers"] >= 12, seen  # the rows really went through the slots
        small = seen.copy()
        with Client([s.address for s in shards]) as c:  # small calls stay in their messages
            c.pull("t", torch.arange(10))
            c.push("t", torch.arange(10), torch.zeros(10, dim), wait=True)
        assert seen == small  # (the pull was offered an answer slot; its small answer came in its message)
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
    assert region.open_offer(offer.replace(shard.nonce.hex().encode(), b"0" * 32)) is None  # not the shard's: untouched
    client = region.open_offer(offer)  # (this process may open its own descriptors)
    assert client is not None
    frame, ans, target = shard.request(region.REQUEST.pack(region.NO_SLOT, 0, 1), b"x")
    assert (bytes(frame), ans) == (b"x", 1)
    target[:5] = b"hello"
    first, second = client.place(b"y" * 10, answer=True), client.place(b"y" * 10, answer=True)
    assert first is not None and second is not None
    assert first[0] == b"y" * 10 and (first[2], first[3], second[3]) == (region.NO_SLOT, 0, 1)  # small: inline
    assert client.place(b"z", answer=True) is None  # no answer slot left, and a small request takes none
    view = client.answer(1, region.ANSWER.pack(1, 5))  # the second call's answer, in its slot
    client.release(region.NO_SLOT, region.NO_SLOT)  # (its call keeps no slot: the view holds it)
    client.release(first[2], first[3])  # the first call's answer came in its message: its slot is free
    assert bytes(view) == b"hello"
    rows = np.frombuffer(view, np.uint8)  # a view of the view keeps the slot too
    del view
    assert list(client._answers) == [0]
    del rows
    assert sorted(client._answers) == [0, 1]  # freed with its last view
    with pytest.raises(ValueError):
        client.answer(0, region.ANSWER.pack(1, 5))  # an answer in a slot the call was not given
    assert region.open_offer(b"1 0 " + b"0" * 32 + b" 65536 2") is None  # pid 1's stdin: not a shardps memfd


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


def test_hostile_descriptors_and_slot_contents_are_refused_and_change_nothing(tmp_path):
    """Raw region traffic, as any local process could send it: slots out of range, lengths past a slot, a request
    both inline and in a slot, descriptors of the wrong size, garbage and truncated pushes in a slot, a descriptor
    on a connection without a region, and 200 random ones (bounded). Each is answered with an error a client may
    get, no row changes, and the shard serves a good push through its slot afterwards."""
    shard = start_shard(0, 1, tmp_path)
    try:
        rows, dim = 64, 512
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
        good = _push_frame("t", np.arange(rows, dtype=np.int64), np.ones((rows, dim), np.float32))
        start = region.HEADER_BYTES  # request slot 0
        bad = [
            (b"", region.REQUEST.pack(shm.slots, 10, region.NO_SLOT)),  # request slot out of range
            (b"", region.REQUEST.pack(0, shm.slot_bytes + 1, region.NO_SLOT)),  # past the slot
            (good[:10], region.REQUEST.pack(0, 10, region.NO_SLOT)),  # both inline and in a slot
            (good, region.REQUEST.pack(region.NO_SLOT, 5, region.NO_SLOT)),  # a length with no slot
            (good, region.REQUEST.pack(region.NO_SLOT, 0, shm.slots)),  # answer slot out of range
            (good, b"\x00" * 11),  # a descriptor of the wrong size
        ]
        for k, (inline, descriptor) in enumerate(bad):
            rid = b"b%07d" % k
            sock.send_multipart([rid, inline, descriptor])
            assert _answer(sock, rid).error.code == 3, k  # INVALID_ARGUMENT
        shm._mm[start:start + len(good)] = good
        for k, n in enumerate((len(good) - 7, 3)):  # truncated pushes in the slot
            rid = b"t%07d" % k
            sock.send_multipart([rid, b"", region.REQUEST.pack(0, n, region.NO_SLOT)])
            assert _answer(sock, rid).error.code == 3
        rng = np.random.default_rng(11)
        for k in range(200):
            req = int(rng.choice([0, 1, region.NO_SLOT, int(rng.integers(0, 2**32))]))
            ans = int(rng.choice([0, region.NO_SLOT, int(rng.integers(0, 2**32))]))
            n = int(rng.integers(0, 4096))
            shm._mm[start:start + n] = rng.bytes(n)
            inline = rng.bytes(int(rng.integers(0, 64))) if rng.random() < 0.3 else b""
            rid = b"r%07d" % k
            sock.send_multipart([rid, inline, region.REQUEST.pack(req, n, ans)])
            resp = _answer(sock, rid, shm, ans)
            assert resp.WhichOneof("result") != "error" or resp.error.code not in (2, 13), resp.error  # not INTERNAL
        tcp = dealer(info.data_ports[0])  # over TCP: no region (it cannot be shared with another machine)
        tcp.send_multipart([b"", b"hello", b"", region.ASK])
        assert tcp.recv_multipart() == [b"", b"ok"]
        tcp.send_multipart([b"n" * 8, b"", region.REQUEST.pack(0, 10, region.NO_SLOT)])
        assert _answer(tcp, b"n" * 8).error.code == 3  # a region this connection was not given
        tcp.send_multipart([b"", b"hello", b"", b"shared please"])
        assert tcp.recv_multipart()[1] == b"error"
        tcp.close(0)
        with Client([shard.address]) as c:
            torch.testing.assert_close(c.pull("t", torch.arange(rows)), before, rtol=0, atol=0)  # nothing changed
        shm._mm[start:start + len(good)] = good  # and a good push through the slot is applied
        sock.send_multipart([b"g" * 8, b"", region.REQUEST.pack(0, len(good), region.NO_SLOT)])
        assert _answer(sock, b"g" * 8).WhichOneof("result") == "push"
        sock.close(0)
        with Client([shard.address]) as c:
            torch.testing.assert_close(c.pull("t", torch.arange(rows)), before - 0.5, rtol=0, atol=1e-6)
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
