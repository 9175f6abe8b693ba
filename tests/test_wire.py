"""The hand-written wire codec is byte-identical to protobuf and decodes what protobuf encodes."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from shardps.core import codec, pushread, wire, zmsg
from shardps.core.errors import InvalidArgument
from shardps.v1 import shardps_pb2 as pb

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("dtype", [pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16])
@pytest.mark.parametrize("shape,version", [((5, 3), 7), ((0, 4), 0), ((1, 1), 2**63 + 5), ((16383, 1), 16383), ((16384, 1), 16384)])
def test_pull_response_matches_protobuf(dtype, shape, version):
    rows = RNG.standard_normal(shape).astype(np.float32)
    ours = wire.encode_pull_response(rows, dtype, version)
    theirs = pb.PullResponse(rows=codec.encode(rows, dtype), version=version).SerializeToString()
    assert ours == theirs
    got, v = wire.decode_pull_response(ours)
    np.testing.assert_array_equal(got, codec.decode(pb.PullResponse.FromString(theirs).rows, "rows"))
    assert v == version
    table = RNG.standard_normal((shape[0] * 2 + 700, shape[1])).astype(np.float32)  # the rows at ``at`` of a table
    table[::2][: shape[0]] = rows
    at = np.arange(0, shape[0] * 2, 2, dtype=np.int64)
    framed = pb.StreamResponse(pull=pb.PullResponse.FromString(theirs)).SerializeToString()
    for frame, want in ((0, theirs), (4, framed)):  # bytes on a gRPC thread (it sends only bytes)
        got = wire.encode_pull_response(table, dtype, version, frame, at)
        assert type(got) is bytes and got == want
    built: list = []  # a shard's data-plane thread gathers the rows straight into its answer (large f32 ones)
    thread = threading.Thread(target=lambda: (zmsg.answer_in_place(), built.append(
        bytes(wire.encode_pull_response(table, dtype, version, 4, at)))))
    thread.start()
    thread.join()
    assert built == [framed]


@pytest.mark.parametrize("n", [0, 1, 5, 16384])
@pytest.mark.parametrize("wire_dtype", [0, pb.FLOAT32, pb.BFLOAT16])
@pytest.mark.parametrize("shard_map", [None, pb.ShardMap(), pb.ShardMap(shard_index=1, num_shards=3, map_epoch=2**40,
                                                                       map_id="m")])
def test_pull_requests_and_their_batch_match_protobuf(n, wire_dtype, shard_map):
    """A pull's requests are written without protobuf's objects (``wire.encode_pull``, ``planner.pull_batch``): the
    same bytes, down to an empty shard map (present, zero length), no ids, and a table name of any characters."""
    from shardps_client import planner

    ids = RNG.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    ours = wire.encode_pull("tablé", ids, wire_dtype, wire.message_field(pb.PullRequest.SHARD_MAP_FIELD_NUMBER,
                                                                         shard_map))
    msg = pb.PullRequest(table="tablé", ids=codec.encode(ids), wire_dtype=wire_dtype, shard_map=shard_map)
    assert ours == msg.SerializeToString()
    assert planner.pull_batch([ours, ours]) == pb.PullBatchRequest(pulls=[msg, msg]).SerializeToString()


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("with_optional", [False, True])
def test_push_requests_match_protobuf(dense, with_optional):
    grads = RNG.standard_normal((4, 6)).astype(np.float32)
    ids = np.array([-5, 0, 3, 2**62], dtype=np.int64)
    kw = dict(client_id="c-1", seq=99, shard_map=pb.ShardMap(shard_index=1, num_shards=3),
              sync=pb.SyncPart(step=4, rank=1, part=0, parts=2)) if with_optional else {}
    pv = 0 if with_optional else None  # an explicit zero must survive (field presence)
    if dense:
        ours = wire.encode_push("w", grads, pb.FLOAT16, row_start=12, pulled_version=pv, **kw)
        msg = pb.PushDenseRequest(name="w", row_start=12, grads=codec.encode(grads, pb.FLOAT16), **kw)
    else:
        ours = wire.encode_push("t", grads, pb.FLOAT32, ids=ids, pulled_version=pv, **kw)
        msg = pb.PushRequest(table="t", ids=codec.encode(ids), grads=codec.encode(grads), **kw)
    if pv is not None:
        msg.pulled_version = pv
    assert ours == msg.SerializeToString()
    d = pushread.decode_push(ours, dense)
    assert d.name == ("w" if dense else "t") and d.pulled_version == pv
    assert (d.client_id, d.seq) == (kw.get("client_id", ""), kw.get("seq", 0))
    np.testing.assert_array_equal(d.grads, codec.decode(msg.grads, "g"))
    if dense:
        assert d.row_start == 12
    else:
        np.testing.assert_array_equal(d.ids, ids)
    if with_optional:
        assert d.shard_map == kw["shard_map"] and d.sync == kw["sync"]


@pytest.mark.parametrize("dense", [False, True])
def test_origins_of_a_push_planned_again_match_protobuf_and_bad_ones_are_refused(dense):
    """PushRequest.origins (its one repeated field): written as protobuf writes it, read back in order; an entry
    with another wire type, or one protobuf cannot parse, is refused."""
    grads = RNG.standard_normal((2, 3)).astype(np.float32)
    origins = [(2, 41), (0, 2**40), (7, 1)]
    if dense:
        ours = wire.encode_push("w", grads, pb.FLOAT32, row_start=4, client_id="c", seq=3, origins=origins)
        msg = pb.PushDenseRequest(name="w", row_start=4, grads=codec.encode(grads), client_id="c", seq=3)
    else:
        ids = np.array([1, 5], np.int64)
        ours = wire.encode_push("t", grads, pb.FLOAT32, ids=ids, client_id="c", seq=3, origins=origins)
        msg = pb.PushRequest(table="t", ids=codec.encode(ids), grads=codec.encode(grads), client_id="c", seq=3)
    msg.origins.extend(pb.PushOrigin(shard=a, seq=b) for a, b in origins)
    assert ours == msg.SerializeToString()
    assert pushread.decode_push(ours, dense).origins == tuple(origins)
    assert pushread.decode_push(wire.encode_push("t", grads, pb.FLOAT32, ids=np.array([1, 5])), False).origins == ()
    with pytest.raises(InvalidArgument, match="field 9 has a wire type other than 2"):
        pushread.decode_push(ours + bytes([0x48, 0x01]), dense)  # field 9 as a varint
    with pytest.raises(InvalidArgument, match="malformed origins"):
        pushread.decode_push(ours + bytes([0x4A, 0x02, 0x08, 0x80]), dense)  # an entry cut inside its varint


def test_a_canonical_push_is_read_by_protobuf_and_any_other_field_by_field():
    """What a client writes goes the fast way (protobuf's parser); the same push written another way protobuf
    accepts (fields out of order, a shape unpacked, an unknown field, a large push) is read field by field, to the
    same push."""
    ids = np.array([3, 9, 12], np.int64)
    grads = RNG.standard_normal((3, 4)).astype(np.float32)
    smap = pb.ShardMap(shard_index=1, num_shards=2, map_epoch=5)
    ours = bytes(wire.encode_push("t", grads, pb.FLOAT32, ids=ids, pulled_version=0, client_id="c", seq=7,
                                  shard_map=smap, origins=[(0, 4)]))
    fast = pushread.canonical(ours, False)
    assert fast is not None and fast.pulled_version == 0 and fast.origins == ((0, 4),) and fast.shard_map == smap

    def same(d: pushread.DecodedPush) -> None:
        assert (d.name, d.client_id, d.seq, d.pulled_version, d.shard_map, d.origins) == \
            ("t", "c", 7, 0, smap, ((0, 4),))
        np.testing.assert_array_equal(d.ids, ids)
        np.testing.assert_array_equal(d.grads, grads)

    same(pushread.decode_push(ours, False))
    same(pushread.read_fields(ours, False))
    t = wire._tag
    name, rest = ours[:3], ours[3:]  # (field 1, "t") first
    unpacked_ids = b"".join([t(1, 0), bytes([pb.INT64]), t(2, 0), b"\x03", t(3, 2), bytes([24]), ids.tobytes()])
    others = [rest + name,  # fields out of order
              ours + t(15, 0) + b"\x01",  # an unknown field
              ours.replace(bytes([0x12]) + bytes([len(codec.encode(ids).SerializeToString())])
                           + codec.encode(ids).SerializeToString(),
                           bytes([0x12, len(unpacked_ids)]) + unpacked_ids)]  # ids' shape unpacked
    assert others[2] != ours
    for buf in others:
        read = pb.PushRequest.FromString(buf)
        read.DiscardUnknownFields()
        assert read == pb.PushRequest.FromString(ours)  # protobuf reads each the same
        assert pushread.canonical(buf, False) is None
        same(pushread.decode_push(buf, False))
    big = RNG.standard_normal((300, 64)).astype(np.float32)  # over CANONICAL_PARSE_BYTES: read field by field
    buf = bytes(wire.encode_push("t", big, pb.FLOAT32, ids=np.arange(300), client_id="c", seq=1))
    assert len(buf) >= pushread.CANONICAL_PARSE_BYTES
    assert not pushread.decode_push(buf, False).grads.flags.owndata  # a view of the message itself
    np.testing.assert_array_equal(pushread.decode_push(buf, False).grads, big)


@pytest.mark.parametrize("frame", [0, 1])
@pytest.mark.parametrize("wire_dtype", [pb.FLOAT32, pb.BFLOAT16])
def test_push_encoder_matches_protobuf(frame, wire_dtype):
    """The encoder of one table's pushes to one shard (fixed fields encoded once) writes what protobuf writes."""
    smap = pb.ShardMap(shard_index=1, num_shards=3)
    enc = wire.PushEncoder("t", "c-1", smap, frame=frame)
    for n, pv, seq in [(4, 7, 99), (1, None, 1), (0, 0, 20_000)]:
        ids = RNG.integers(0, 2**40, n).astype(np.int64)
        grads = RNG.standard_normal((n, 6)).astype(np.float32)
        msg = pb.PushRequest(table="t", ids=codec.encode(ids), grads=codec.encode(grads, wire_dtype), client_id="c-1",
                             seq=seq, shard_map=smap)
        if pv is not None:
            msg.pulled_version = pv
        want = msg.SerializeToString()
        if frame:
            want = pb.StreamRequest(push=msg).SerializeToString()
        assert enc.encode(ids, grads, wire_dtype, pv, seq) == want


@pytest.mark.parametrize("wire_dtype", [pb.FLOAT32, pb.FLOAT16])
def test_pushes_gathering_their_rows_into_the_message_match_protobuf(wire_dtype):
    """``rows=``: a push of ``grads[rows]``, gathered straight into its message when large (float32), writes what
    protobuf writes for the gathered array, also through the encoder, for small and no rows, and for gradients
    numpy must copy first."""
    grads = RNG.standard_normal((700, 32)).astype(np.float32)
    big = RNG.permutation(700)[:600]
    big[:3] = [699, 0, 0]
    assert big.shape[0] * 32 * 4 >= wire.ROWS_IN_PLACE_BYTES  # gathered into the message
    smap = pb.ShardMap(shard_index=0, num_shards=2)
    enc = wire.PushEncoder("t", "c-1", smap, frame=1)
    for rows, g in [(big, grads), (np.array([8, 0, 3, 3]), grads), (np.zeros(0, np.int64), grads),
                    (big, grads[:, ::2]), (big, grads.astype(np.float64))]:
        ids = np.arange(rows.shape[0], dtype=np.int64) * 7
        msg = pb.PushRequest(table="t", ids=codec.encode(ids), grads=codec.encode(g[rows], wire_dtype), client_id="c-1",
                             seq=5, shard_map=smap)
        got = wire.encode_push("t", g, wire_dtype, ids=ids, rows=rows, client_id="c-1", seq=5, shard_map=smap)
        assert bytes(got) == msg.SerializeToString()
        if zmsg.available():  # a message of 64 KB or more is built in libzmq's memory (sent from it, no copy)
            assert (zmsg.owner(got) is not None) == (len(got) >= zmsg.MIN_BYTES)
        framed = pb.StreamRequest(push=msg).SerializeToString()
        assert bytes(wire.encode_push("t", g, wire_dtype, ids=ids, rows=rows, client_id="c-1", seq=5, shard_map=smap,
                                      frame=1)) == framed
        assert bytes(enc.encode(ids, g, wire_dtype, None, 5, rows=rows)) == framed
        np.testing.assert_array_equal(pushread.decode_push(got, False).grads, codec.decode(msg.grads, "g"))
    for bad, value in ((0, 700), (5, -1)):  # rows the array does not have: refused, never read
        rows = big.copy()
        rows[bad] = value
        with pytest.raises(IndexError, match="of an array of 700"):
            wire.encode_push("t", grads, pb.FLOAT32, ids=np.arange(600), rows=rows)


@pytest.mark.skipif(not zmsg.available(), reason="libzmq's functions cannot be reached here")
def test_large_messages_live_in_libzmq_memory_until_their_last_view_goes():
    """``zmsg``: a large push is built in a libzmq message, sent from it twice (a call resent on a new connection)
    and arrives whole each time; where a send would block it is refused (``zmq.Again``) and stays sendable; it is
    freed once no view of it is left. A shard's data-plane thread (``answer_in_place``) builds its large pull answers
    there too; any other thread's are bytes (gRPC sends only bytes)."""
    import gc
    import threading
    import weakref

    import zmq

    grads = RNG.standard_normal((1000, 64)).astype(np.float32)
    rows = RNG.permutation(1000)[:900]
    msg = wire.encode_push("t", grads, pb.FLOAT32, ids=rows.astype(np.int64), rows=rows, client_id="c", seq=1,
                           frame=1)
    own = zmsg.owner(msg)
    assert own is not None and zmsg.owner(msg[1:]) is None and zmsg.owner(bytes(msg)) is None
    want = bytes(msg)
    ctx = zmq.Context()
    router, dealer, lonely = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        router.bind("inproc://zmsg-test")
        dealer.connect("inproc://zmsg-test")
        for _ in range(2):
            zmsg.send_multipart(dealer, [b"rid", msg])
            assert router.recv_multipart()[1:] == [b"rid", want]
        lonely.setsockopt(zmq.SNDHWM, 1)
        lonely.connect("inproc://zmsg-nobody")  # nobody binds it: the first message queues, the next would block
        zmsg.send_multipart(lonely, [msg], zmq.NOBLOCK)
        with pytest.raises(zmq.Again):
            zmsg.send_multipart(lonely, [msg], zmq.NOBLOCK)
        assert bytes(msg) == want
        push = pushread.decode_push(wire.unframe(msg)[1], False)  # views of the message keep it alive
        gone = weakref.ref(own)
        del own, msg
        gc.collect()
        assert gone() is not None
        np.testing.assert_array_equal(push.grads, grads[rows])
        del push
        gc.collect()
        assert gone() is None
    finally:
        for sock in (router, dealer, lonely):
            sock.close(0)
        ctx.term()

    pulled = RNG.standard_normal((600, 64)).astype(np.float32)
    PULL = pb.StreamResponse.PULL_FIELD_NUMBER
    expected = pb.StreamResponse(pull=pb.PullResponse(rows=codec.encode(pulled, pb.FLOAT32), version=9))
    here = wire.encode_pull_response(pulled, pb.FLOAT32, 9, frame=PULL)
    assert type(here) is bytes and here == expected.SerializeToString()
    answered: list = []

    def data_plane_thread() -> None:
        zmsg.answer_in_place()
        answered.append(wire.encode_pull_response(pulled, pb.FLOAT32, 9, frame=PULL))
        answered.append(wire.encode_pull_response(pulled[:3], pb.FLOAT32, 9, frame=PULL))  # small: bytes

    t = threading.Thread(target=data_plane_thread)
    t.start()
    t.join()
    assert zmsg.owner(answered[0]) is not None and bytes(answered[0]) == here
    assert type(answered[1]) is bytes
    off = subprocess.run([sys.executable, "-c", "from shardps.core import zmsg; print(zmsg.available())"],
                         env={**os.environ, "SHARDPS_ZMQ_IN_PLACE": "0"}, capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "False"  # SHARDPS_ZMQ_IN_PLACE=0: Python buffers, copied at each send


def test_decoding_skips_unknown_fields_and_rejects_garbage():
    msg = pb.PullResponse(rows=codec.encode(np.ones((2, 2), np.float32)), version=3).SerializeToString()
    extra = msg + bytes([0x78, 0x05])  # field 15, varint 5: unknown, skipped
    rows, v = wire.decode_pull_response(extra)
    assert v == 3 and rows.shape == (2, 2)
    with pytest.raises(InvalidArgument, match="malformed message"):
        wire.decode_pull_response(msg[:-3])
    bad = wire.encode_push("t", np.ones((1, 2), np.float32), pb.FLOAT32, ids=np.zeros(1, np.int64))
    with pytest.raises(InvalidArgument, match="malformed message"):
        pushread.decode_push(bad[:-2], dense=False)
    wrong = pb.PushRequest(table="t", ids=codec.encode(np.zeros(1, np.float32)), grads=codec.encode(np.ones((1, 2), np.float32)))
    with pytest.raises(InvalidArgument, match="ids must be int64, got float32"):
        pushread.decode_push(wrong.SerializeToString(), dense=False)


def test_push_and_dense_push_share_field_numbers():
    """wire.encode_push / decode_push write both messages with one set of field numbers."""
    push, dense = pb.PushRequest.DESCRIPTOR.fields, pb.PushDenseRequest.DESCRIPTOR.fields
    assert [f.number for f in push] == [f.number for f in dense]
    for a, b in zip(push, dense):
        assert a.name == b.name or (a.name, b.name) in {("table", "name"), ("ids", "row_start")}, (a.name, b.name)


def test_signed_byte_buffers_decode_as_bytes():
    """A buffer exporting signed chars (as pyarrow's and ctypes' do) is read as the same bytes:
    read as signed, the byte 0x96 of a varint would be a negative number."""
    import ctypes

    framed = wire.frame(3, b"\x96\x01" * 100)
    signed = (ctypes.c_byte * len(framed)).from_buffer_copy(framed)
    assert memoryview(signed).format == "<b"
    field, view = wire.unframe(signed)
    assert field == 3 and bytes(view) == b"\x96\x01" * 100
