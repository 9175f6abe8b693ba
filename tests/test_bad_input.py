"""Every kind of bad input gets a clear error naming the problem, and changes nothing.

Each case is checked at the client (which validates before sending) and, with
a raw gRPC stub, at the shard itself (which must not trust clients).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from shardps_client import (
    SGD,
    Client,
    IdOutOfRangeError,
    InvalidArgumentError,
    RequestTooLargeError,
    ShardMapError,
    TableExistsError,
    TableNotFoundError,
)

from shardps.core import codec
from shardps.core.routing import shard_of_ids
from shardps.core.specs import Initializer
from shardps.v1 import shardps_pb2 as pb
from shardps.v1 import shardps_pb2_grpc as pb_grpc
from tests.conftest import running_cluster


@pytest.fixture
def setup(cluster2):
    addresses = [s.address for s in cluster2]
    c = Client(addresses, timeout=10, retry_timeout=1)
    c.create_table("t", dim=4, num_embeddings=100, optimizer=SGD(lr=1.0), initializer=Initializer("uniform", seed=1))
    c.register_dense("d", torch.ones(3, 2))
    before = c.pull("t", torch.arange(100))
    stubs = [pb_grpc.ShardStub(grpc.insecure_channel(a)) for a in addresses]
    yield c, stubs, before
    # Whatever happened, the shards still serve and nothing was half-applied.
    torch.testing.assert_close(c.pull("t", torch.arange(100)), before, rtol=0, atol=0)
    torch.testing.assert_close(c.pull_dense("d")[0], torch.ones(3, 2), rtol=0, atol=0)
    assert all(i.version == 0 for i in c.shard_info())
    c.close()


def _owned(shard: int, n: int = 100) -> np.ndarray:
    ids = np.arange(n)
    return ids[shard_of_ids(ids, 2) == shard]


def _expect(stub_call, code: grpc.StatusCode, match: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub_call()
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details(), info.value.details()


def _push_req(ids, grads, table="t", shard=0):
    return pb.PushRequest(table=table, ids=codec.encode(np.asarray(ids, np.int64)), grads=codec.encode(grads),
                          shard_map=pb.ShardMap(shard_index=shard, num_shards=2))


def test_unknown_table(setup):
    c, stubs, _ = setup
    with pytest.raises(TableNotFoundError, match="unknown table or dense tensor 'nope' on shard 0"):
        c.pull("nope", torch.tensor([1]))
    _expect(lambda: stubs[0].Push(_push_req(_owned(0)[:1], np.ones((1, 4), np.float32), table="nope")),
            grpc.StatusCode.NOT_FOUND, "unknown table 'nope'")
    with pytest.raises(InvalidArgumentError, match="'d' is a dense tensor, not a table"):
        c.pull("d", torch.tensor([0]))


def test_wrong_dim_and_shape(setup):
    c, stubs, _ = setup
    with pytest.raises(InvalidArgumentError, match=r"grads must have shape \[2, 4\] \(ids.shape \+ \(dim,\)\), got \[2, 5\]"):
        c.push("t", torch.tensor([1, 2]), torch.ones(2, 5))
    ids = _owned(0)[:2]
    _expect(lambda: stubs[0].Push(_push_req(ids, np.ones((2, 5), np.float32))),
            grpc.StatusCode.INVALID_ARGUMENT, "grads must have shape [2, 4]")
    _expect(lambda: stubs[0].Push(_push_req(ids, np.ones((3, 4), np.float32))),
            grpc.StatusCode.INVALID_ARGUMENT, "grads must have shape [2, 4]")
    with pytest.raises(InvalidArgumentError, match=r"grad must have shape \[3, 2\], got \[2, 3\]"):
        c.push_dense("d", torch.ones(2, 3))


def test_wrong_dtypes(setup):
    c, stubs, _ = setup
    with pytest.raises(InvalidArgumentError, match="ids must be an integer tensor"):
        c.pull("t", torch.tensor([1.0, 2.0]))
    with pytest.raises(InvalidArgumentError, match="grads must be a floating-point tensor"):
        c.push("t", torch.tensor([1]), torch.ones(1, 4, dtype=torch.int32))
    ids = _owned(0)[:1]
    bad_ids = pb.PullRequest(table="t", ids=codec.encode(ids.astype(np.float32)), shard_map=pb.ShardMap(shard_index=0, num_shards=2))
    _expect(lambda: stubs[0].Pull(bad_ids), grpc.StatusCode.INVALID_ARGUMENT, "ids must be int64, got float32")
    req = _push_req(ids, np.ones((1, 4), np.float32))
    req.grads.CopyFrom(codec.encode(np.ones((1, 4), np.int64)))
    _expect(lambda: stubs[0].Push(req), grpc.StatusCode.INVALID_ARGUMENT, "grads must be float32, float16 or bfloat16")
    req.grads.CopyFrom(pb.Tensor(dtype=pb.FLOAT32, shape=[1, 4], data=b"\0" * 15))
    _expect(lambda: stubs[0].Push(req), grpc.StatusCode.INVALID_ARGUMENT, "15 bytes do not match shape [1, 4]")


def test_ids_out_of_range_or_negative(setup):
    c, stubs, _ = setup
    with pytest.raises(IdOutOfRangeError, match=r"id 100 out of range \[0, 100\)"):
        c.pull("t", torch.tensor([5, 100]))
    with pytest.raises(IdOutOfRangeError, match=r"id -1 out of range"):
        c.push("t", torch.tensor([-1]), torch.ones(1, 4))
    neg = np.array([-3])
    owner = int(shard_of_ids(neg, 2)[0])
    _expect(lambda: stubs[owner].Push(_push_req(neg, np.ones((1, 4), np.float32), shard=owner)),
            grpc.StatusCode.OUT_OF_RANGE, "id -3 out of range [0, 100)")


def test_nan_and_inf_gradients_rejected(setup):
    c, stubs, _ = setup
    for bad in (float("nan"), float("inf")):
        g = torch.ones(2, 4)
        g[1, 2] = bad
        with pytest.raises(InvalidArgumentError, match="gradient contains NaN or Inf"):
            c.push("t", torch.tensor([1, 2]), g)
        with pytest.raises(InvalidArgumentError, match="gradient contains NaN or Inf"):
            c.push_dense("d", torch.full((3, 2), bad))
        g_np = np.ones((2, 4), np.float32)
        g_np[0, 0] = bad
        _expect(lambda g_np=g_np: stubs[0].Push(_push_req(_owned(0)[:2], g_np)),
                grpc.StatusCode.INVALID_ARGUMENT, "gradient contains NaN or Inf")


def test_empty_requests(setup):
    c, stubs, _ = setup
    with pytest.raises(InvalidArgumentError, match="request has no ids"):
        c.pull("t", torch.tensor([], dtype=torch.int64))
    with pytest.raises(InvalidArgumentError, match="request has no ids"):
        c.push("t", torch.tensor([], dtype=torch.int64), torch.ones(0, 4))
    _expect(lambda: stubs[0].Push(_push_req(np.zeros(0), np.zeros((0, 4), np.float32))),
            grpc.StatusCode.INVALID_ARGUMENT, "request has no ids")


def test_oversized_requests(setup, cluster2):
    c, stubs, _ = setup
    big = _owned(0, 1_000_000)[:200_000]  # 1.6 MB of ids, 3.2 MB of grads: 4.8 MB > 4 MiB
    _expect(lambda: stubs[0].Push(_push_req(big, np.ones((big.size, 4), np.float32))),
            grpc.StatusCode.RESOURCE_EXHAUSTED, "")
    c.create_table("wide", dim=256, initializer=Initializer("zeros"))
    ids = torch.arange(20_000)  # 20 MB of rows, about 10 MB per shard
    # A client whose split size exceeds the shards' 4 MiB limit gets an error naming the shard.
    with Client([s.address for s in cluster2], max_message_bytes=16 << 20) as greedy:
        with pytest.raises(RequestTooLargeError, match=f"shard at ({cluster2[0].address}|{cluster2[1].address})"):
            greedy.pull("wide", ids)
    # The default client splits the same request below the limit and it goes through.
    assert c.pull("wide", ids).shape == (20_000, 256)


def test_conflicting_table_spec(setup):
    c, _, _ = setup
    with pytest.raises(TableExistsError, match="table 't' exists with a different spec"):
        c.create_table("t", dim=4, num_embeddings=100, optimizer=SGD(lr=0.5))
    with pytest.raises(TableExistsError, match="dense tensor 'd' exists with a different spec"):
        c.register_dense("d", torch.ones(3, 3))
    # A table and a dense tensor never share a name: each is told which the name is (it was INTERNAL for a table).
    with pytest.raises(TableExistsError, match="'d' is a dense tensor on shard .: an embedding table cannot take"):
        c.create_table("d", dim=3, num_embeddings=3)
    with pytest.raises(TableExistsError, match="'t' is an embedding table on shard .: a dense tensor cannot take"):
        c.register_dense("t", torch.ones(3, 3))
    with pytest.raises(InvalidArgumentError, match="invalid table name"):
        c.create_table("bad name!", dim=4)
    with pytest.raises(InvalidArgumentError, match="dim must be in"):
        c.create_table("z", dim=0)


def test_mismatched_shard_map(setup, cluster2):
    c, stubs, _ = setup
    a = [s.address for s in cluster2]
    with pytest.raises(ShardMapError, match=r"position 0 \(.*\) is shard 1 of 2"):
        Client([a[1], a[0]])
    with pytest.raises(ShardMapError, match="client was given 1 addresses"):
        Client([a[0]])
    with pytest.raises(ShardMapError, match="client was given 3 addresses"):
        Client([a[0], a[1], a[1]])
    # A request carrying another shard map, and ids owned by the other shard.
    req = _push_req(_owned(0)[:1], np.ones((1, 4), np.float32), shard=0)
    req.shard_map.num_shards = 3
    _expect(lambda: stubs[0].Push(req), grpc.StatusCode.FAILED_PRECONDITION, "expected shard map: index 0, 2 shards")
    _expect(lambda: stubs[1].Push(_push_req(_owned(0)[:1], np.ones((1, 4), np.float32), shard=1)),
            grpc.StatusCode.FAILED_PRECONDITION, "is not owned by this shard")


def test_dead_shard_is_named():
    from shardps_client import ShardUnavailableError

    with running_cluster(2) as servers:
        # The live shard answers within the timeout however busy the machine (2 s was missed under load); the dead one
        # is named once retry_timeout passes.
        c = Client([s.address for s in servers], timeout=30, retry_timeout=0.5)
        c.create_table("t", dim=2, num_embeddings=10)
        dead = servers[1].address
        servers[1].stop(checkpoint=False)
        with pytest.raises(ShardUnavailableError, match=f"shard at {dead}"):
            c.pull("t", torch.arange(10))
        c.close()


def test_creates_of_one_name_at_once_leave_one_spec_on_every_shard(cluster2):
    """Two clients create one name with different specs at the same moment: the lowest shard decides, and a create it
    refuses goes no further (each shard used to keep whichever create reached it first: dim 4 on one, 8 on the
    other, in 17 of 40 tries)."""
    import threading

    addresses = [s.address for s in cluster2]
    with Client(addresses, timeout=10, retry_timeout=1) as a, Client(addresses, timeout=10, retry_timeout=1) as b:
        outcomes: dict[str, int] = {}
        for i in range(30):
            name = f"race{i}"
            go = threading.Barrier(2)

            def create(c: Client, dim: int, name: str = name, go: threading.Barrier = go) -> None:
                go.wait()
                try:
                    c.create_table(name, dim=dim, num_embeddings=10)
                    outcomes[f"{name} {dim}"] = dim
                except TableExistsError:
                    pass

            threads = [threading.Thread(target=create, args=(c, dim)) for c, dim in ((a, 4), (b, 8))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            dims = {info.spec.dim for info in a.describe_table(name)}
            assert len(dims) == 1, (name, dims)
            winners = [d for key, d in outcomes.items() if key.startswith(f"{name} ")]
            assert winners == [dims.pop()], (name, winners)  # exactly one create succeeded: the spec kept


def test_a_table_made_again_with_another_spec_is_an_error_not_wrong_rows(cluster2):
    """A client's cached spec of a table another client dropped and made again with another dim: its pull raises
    TableChangedError (numpy used to broadcast the one column into four, silently), and its next pull reads the new
    spec. The same for a dense tensor."""
    from shardps_client import TableChangedError

    addresses = [s.address for s in cluster2]
    with Client(addresses, timeout=10, retry_timeout=1) as a, Client(addresses, timeout=10, retry_timeout=1) as b:
        a.create_table("x", dim=4, num_embeddings=10)
        a.register_dense("w", torch.ones(3, 2))
        assert a.pull("x", torch.arange(3)).shape == (3, 4) and a.pull_dense("w")[0].shape == (3, 2)
        b.drop_table("x")
        b.create_table("x", dim=1, num_embeddings=10)
        b.drop_table("w")
        b.register_dense("w", torch.tensor([[1.0], [2.0], [3.0]]))
        with pytest.raises(TableChangedError, match="'x' changed under this client: shard .* 1 column where its spec "
                                                    "here has 4") as info:
            a.pull("x", torch.arange(3))
        assert info.value.table == "x"
        with pytest.raises(TableChangedError, match="'w' changed under this client"):
            a.pull_dense("w")
        torch.testing.assert_close(a.pull("x", torch.arange(3)), b.pull("x", torch.arange(3)))  # the new spec
        torch.testing.assert_close(a.pull_dense("w")[0], torch.tensor([[1.0], [2.0], [3.0]]))


def test_a_dense_tensor_that_cannot_be_sent_is_refused_before_any_shard_has_it(cluster2):
    """A row wider than a message, or more chunks than a shard takes: refused by the client, naming why, before a
    call (the first left the tensor on one shard only; the second sent 70,000 calls each refused)."""
    addresses = [s.address for s in cluster2]
    with Client(addresses, timeout=10, retry_timeout=1) as c:
        with pytest.raises(InvalidArgumentError, match="a row of 2,000,000 values .* does not fit in a message of "
                                                       "max_message_bytes="):
            c.register_dense("wide", torch.ones(1, 2_000_000))
        with pytest.raises(InvalidArgumentError, match="chunk_rows 1 makes more than 65,536 chunks of its 70,000 "
                                                       r"rows \(chunk_bytes=1\)"):
            c.register_dense("many", torch.ones(70_000, 1), chunk_bytes=1)
        with pytest.raises(InvalidArgumentError, match="every dimension must be >= 1"):
            c.register_dense("empty", torch.ones(0, 3))
        for name in ("wide", "many", "empty"):
            with pytest.raises(TableNotFoundError):
                c.describe_table(name)


def test_gradients_a_narrow_wire_or_a_sum_would_make_inf_are_refused_before_any_shard_applies_a_part(setup):
    """Finite float32 gradients that would reach the shards as inf (past float16's or bfloat16's range on the wire,
    or a repeated id's gradients summing past float32's): refused by the client naming why, nothing sent. (One of
    the shards used to refuse its part as NaN/Inf after the other had applied its own.) The fixture checks that
    nothing changed."""
    c, _, _ = setup
    ids = torch.arange(10)
    g = torch.zeros(10, 4)
    g[3, 0] = 65520.0  # the smallest float32 that float16 carries as inf (65519 rounds down to 65504)
    with pytest.raises(InvalidArgumentError, match="past float16's range: wire_dtype='float16' would send it as inf"):
        c.push("t", ids, g, wire_dtype="float16", wait=True)
    g[3, 0] = 3.3962e38
    with pytest.raises(InvalidArgumentError, match="past bfloat16's range"):
        c.push("t", ids, g, wire_dtype="bfloat16", wait=True)
    with pytest.raises(InvalidArgumentError, match="the gradients of a repeated id sum past float32's range"):
        c.push("t", torch.tensor([5, 5]), torch.full((2, 4), 3e38), wait=True)
    with pytest.raises(InvalidArgumentError, match="d: a gradient of 70000 is past float16's range"):
        c.push_dense("d", torch.full((3, 2), 7e4), wire_dtype="float16", wait=True)
    with pytest.raises(InvalidArgumentError, match="past float16's range"):
        c.push_stacked(["t"], [ids], g, wire_dtype="float16")


def test_the_largest_gradients_a_narrow_wire_carries_finite_are_sent(cluster2):
    with Client([s.address for s in cluster2], timeout=10) as c:
        c.create_table("n", dim=2, num_embeddings=4, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
        c.push("n", torch.tensor([0]), torch.tensor([[65519.0, -65519.0]]), wire_dtype="float16", wait=True)
        c.push("n", torch.tensor([1]), torch.tensor([[3.396e38, 0.0]]), wire_dtype="bfloat16", wait=True)
        got = c.pull("n", torch.tensor([0, 1]))
        assert got[0].tolist() == [-65504.0, 65504.0] and torch.isfinite(got).all()


def test_hyperparameters_past_float32_are_refused(setup):
    """An lr, or an initializer's mean, std or a, that float32 holds as inf made every row it touched inf (1e300 was
    accepted as finite in float64): refused when the optimizer or initializer is made, and by the shard."""
    from shardps.core.optim import Adam

    _, stubs, _ = setup
    for make in (lambda: SGD(lr=1e300), lambda: Adam(eps=3.5e38), lambda: Initializer(std=float("inf")),
                 lambda: Initializer("uniform", a=float("inf")), lambda: Initializer(mean=1e300),
                 lambda: Initializer(std=1e38)):
        with pytest.raises(ValueError, match="finite in float32"):
            make()
    assert Initializer(std=1e37).rows(np.arange(4), 8).max() < np.inf and SGD(lr=3e38).lr == 3e38
    spec = pb.TableSpec(name="big", dim=4, optimizer=pb.OptimizerSpec(sgd=pb.SGDSpec(lr=1e300)))
    _expect(lambda: stubs[0].CreateTable(pb.CreateTableRequest(spec=spec)), grpc.StatusCode.INVALID_ARGUMENT,
            "SGD lr must be finite in float32")


def test_client_options_that_would_misbehave_later_are_refused_at_once(cluster2, tmp_path):
    """A string of addresses (read one character an address: 25 s of UNAVAILABLE), a timeout that is not a positive
    number of seconds (inf: every call failed at once with DEADLINE_EXCEEDED), no pushes in flight (the first push
    waited forever), a heartbeat of 0 (a busy loop, 2 s of CPU a second): refused when the client is made, naming the
    option; and a cut's hold of nan or below 0 (an export's, a checkpoint's), which ended the hold at once, refused
    by the shard."""
    address = cluster2[0].address
    for kwargs, match in (({"addresses": address}, "addresses must be a list of 'host:port' strings"),
                          ({"timeout": float("inf")}, "timeout must be a finite number of seconds, > 0"),
                          ({"timeout": 0}, "timeout must be"), ({"retry_timeout": float("nan")}, "retry_timeout must"),
                          ({"max_inflight_pushes": 0}, "max_inflight_pushes must be an int >= 1"),
                          ({"max_message_bytes": 2**40}, r"max_message_bytes must be an int in \[1, 2\*\*31\)"),
                          ({"heartbeat_s": 0, "rank": 0, "world_size": 1}, "heartbeat_s must be")):
        with pytest.raises(InvalidArgumentError, match=match):
            Client(**{"addresses": [s.address for s in cluster2], **kwargs})
    from shardps_client import SyncPolicy

    with pytest.raises(ValueError, match=r"sync workers must be in \[1, 2\*\*31\), got 1099511627776"):
        SyncPolicy(workers=2**40)  # (protobuf's "Value out of range" before)
    with Client([s.address for s in cluster2], timeout=10, retry_timeout=0) as c:  # (0: no retries)
        for hold in (float("nan"), -1.0):
            with pytest.raises(InvalidArgumentError, match="hold_s must be >= 0 seconds"):
                c.export(tmp_path / "out", hold_s=hold)


def test_a_closed_client_refuses_every_call_saying_so_and_drops_no_push_silently(cluster2):
    """After ``close()`` a push was queued and never sent, with no error (it was lost); a table's create and a dense
    pull raised gRPC's "Cannot invoke RPC on closed channel" ValueError. Now every call raises a ShardpsError saying
    the client is closed, before anything is queued; closing again is harmless, and the shards hold what the client
    sent before."""
    from shardps_client import ShardpsError

    addresses = [s.address for s in cluster2]
    c = Client(addresses, timeout=10, retry_timeout=1)
    c.create_table("closed.t", dim=4, num_embeddings=100, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    c.register_dense("closed.d", torch.zeros(3, 2))
    c.push("closed.t", torch.arange(4), torch.ones(4, 4))  # (sent by close(): it flushes)
    c.close()
    calls = {"pull": lambda: c.pull("closed.t", torch.arange(4)),
             "push": lambda: c.push("closed.t", torch.arange(4), torch.ones(4, 4)),
             "push_dense": lambda: c.push_dense("closed.d", torch.ones(3, 2)),
             "pull_dense": lambda: c.pull_dense("closed.d"),
             "create_table": lambda: c.create_table("closed.u", dim=4, num_embeddings=10),
             "shard_info": lambda: c.shard_info()}
    for what, call in calls.items():
        with pytest.raises(ShardpsError, match="this client is closed") as info:
            call()
        assert type(info.value) is ShardpsError, what
    c.close()
    c.flush()  # (nothing pending: the push above was refused, not queued)
    with Client(addresses, timeout=10) as fresh:
        torch.testing.assert_close(fresh.pull("closed.t", torch.arange(4)), -torch.ones(4, 4), rtol=0, atol=0)
        torch.testing.assert_close(fresh.pull_dense("closed.d")[0], torch.zeros(3, 2), rtol=0, atol=0)


def test_arguments_of_the_wrong_kind_are_named(setup, tmp_path):
    """A float dim, an optimizer by name, a string where a list of names goes (read one character a name), an empty
    export path (written into the working directory), negative or fractional sizes: each refused naming the
    argument, where numpy, protobuf or a lookup of 'b' used to answer."""
    c, _, _ = setup
    for call, match in ((lambda: c.create_table("f", dim=4.5), "dim must be an int, got 4.5"),
                        (lambda: c.create_table("f", dim=4, optimizer="sgd"), "unsupported optimizer 'sgd'"),
                        (lambda: c.export(tmp_path / "e", tables="t"), "tables must be a list of names, got the "),
                        (lambda: c.export(""), "export needs a directory"),
                        (lambda: c.pull_dense_many("d"), "names must be a list of names"),
                        (lambda: c.push_stacked("t", [torch.arange(2)], torch.zeros(2, 4)), "tables must be a list"),
                        (lambda: c.register_dense("e", torch.ones(2, 2), chunk_bytes=-1), "chunk_bytes must be an int"),
                        (lambda: c.cache_table("t", steps=1.5), "cache steps must be an int >= 0, got 1.5"),
                        (lambda: c.load_state_dict("t", {"weight": torch.full((100, 4), float("nan"))}),
                         "t: weight contains NaN or Inf; nothing loaded")):
        with pytest.raises(InvalidArgumentError, match=match):
            call()
    with pytest.raises(TableNotFoundError):
        c.describe_table("f")
    assert not (tmp_path / "e").exists()


def test_command_line_values_out_of_range_are_one_line_errors_and_leave_nothing_running(tmp_path):
    """``shardps serve`` with a port of -1 or 70000 (bound as 65535 or 4464), --workers 0 (served), --max-message-mb
    0 or a data dir that is a file (tracebacks), a certificate that is not one (\"could not bind\"); ``shardps
    cluster`` whose cluster file cannot be written (a traceback, its shard left running): each a one-line error and
    exit code 1, nothing left behind."""
    import subprocess
    import sys

    serve = [sys.executable, "-m", "shardps", "serve", "--host", "127.0.0.1", "--shard-index", "0", "--num-shards", "1"]
    (tmp_path / "afile").write_text("")
    (tmp_path / "junk.pem").write_text("not a certificate")
    junk = str(tmp_path / "junk.pem")
    for extra, match in ((["--port", "-1"], "--port must be in [0, 65535], got -1"),
                         (["--tls-cert", junk, "--tls-key", junk], "not a PEM certificate chain and its private key"),
                         (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
                         (["--workers", "0"], "--workers must be in [1, inf), got 0"),
                         (["--max-message-mb", "0"], "--max-message-mb must be in [1, inf)"),
                         (["--fsync-interval", "nan"], "--fsync-interval must be in [0, inf), got nan"),
                         (["--data-dir", str(tmp_path / "afile")], "is a file, not a directory")):
        r = subprocess.run(serve + extra, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and match in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr[-500:])
    logs = tmp_path / "logs"
    (tmp_path / "dir.json").mkdir()  # a cluster file that is a directory: found only once the shards run
    for where, match in ((tmp_path / "no" / "c.json", "the cluster file's directory"),
                         (tmp_path / "dir.json", "cannot write")):
        r = subprocess.run([sys.executable, "-m", "shardps", "cluster", "--host", "127.0.0.1", "--shards", "1",
                            "--log-dir", str(logs), "--cluster-file", str(where)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 1 and match in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]
        left = subprocess.run(["pgrep", "-f", str(logs)], capture_output=True, text=True).stdout.split()
        assert not left, f"shards left running: {left}"
