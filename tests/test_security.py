"""TLS, mutual TLS and bearer tokens with roles, against real shard processes over loopback."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shardps_client import TLS, AuthenticationError, Client, PermissionDeniedError, ShardUnavailableError

from shardps.core import codec
from shardps.core.specs import dense_spec_to_pb, table_spec_to_pb
from shardps.server.ops import certs
from shardps.v1 import shardps_pb2 as pb
from shardps.v1 import shardps_pb2_grpc as pb_grpc
from tests.procs import start_shard
from tests.test_data_plane import data_plane_call

TOKENS = {"reader": "r" * 20 + "-reader-token", "trainer": "t" * 20 + "-trainer-token", "admin": "a" * 20 + "-admin"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with server and client certificates, another CA, and an expired client certificate."""
    d = tmp_path_factory.mktemp("pki")
    dev = certs.make_dev_certs(str(d / "good"))
    other = certs.make_dev_certs(str(d / "other"))
    ca_key, ca_cert = _load_ca(d / "good")
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    expired = certs.write_pair(d, "expired", *certs.issue(ca_key, ca_cert, "old client", client=True, days=1,
                                                          not_before=past))
    return {"dev": dev, "other": other, "expired": expired}


def _load_ca(directory):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    return key, x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())


def _ids(*values: int) -> pb.Tensor:
    return codec.encode(np.asarray(values, dtype=np.int64))


# ---- TLS and mutual TLS -----------------------------------------------------------------------

def _works(address: str, **kw) -> None:
    with Client([address], retry_timeout=2, timeout=10, **kw) as c:
        c.create_table("e", dim=4, num_embeddings=100)
        c.push("e", torch.arange(10), torch.ones(10, 4), wait=True)
        assert c.pull("e", torch.arange(10)).shape == (10, 4)


def _refused(address: str, **kw) -> None:
    with pytest.raises(ShardUnavailableError):
        Client([address], retry_timeout=1, timeout=5, **kw)


def test_tls_serves_only_clients_that_trust_its_ca(tmp_path, pki):
    dev, other = pki["dev"], pki["other"]
    shard = start_shard(0, 1, tmp_path, extra=["--tls-cert", dev.server_cert, "--tls-key", dev.server_key])
    try:
        _works(shard.address, tls=TLS(ca=dev.ca))
        _refused(shard.address)  # plaintext to a TLS port
        _refused(shard.address, tls=TLS(ca=other.ca))  # a CA that did not sign the shard's certificate
        out = subprocess.run([sys.executable, "-m", "shardps.probe", shard.address, "--tls-ca", dev.ca],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "SERVING" in out.stdout
    finally:
        shard.terminate()


def test_mutual_tls_wants_a_client_certificate_of_its_ca_that_has_not_expired(tmp_path, pki):
    dev, other = pki["dev"], pki["other"]
    shard = start_shard(0, 1, tmp_path, extra=["--tls-cert", dev.server_cert, "--tls-key", dev.server_key,
                                               "--tls-client-ca", dev.ca])
    try:
        _works(shard.address, tls=TLS(ca=dev.ca, cert=dev.client_cert, key=dev.client_key))
        _refused(shard.address, tls=TLS(ca=dev.ca))  # no client certificate
        _refused(shard.address, tls=TLS(ca=dev.ca, cert=other.client_cert, key=other.client_key))  # another CA's
        cert, key = pki["expired"]
        _refused(shard.address, tls=TLS(ca=dev.ca, cert=cert, key=key))
    finally:
        shard.terminate()


def test_cluster_command_with_mutual_tls_needs_no_setup(tmp_path):
    cluster_file = tmp_path / "cluster.json"
    proc = subprocess.Popen([sys.executable, "-m", "shardps", "cluster", "--shards", "2", "--tls", "mtls",
                             "--cluster-file", str(cluster_file), "--data-dir", str(tmp_path / "data")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not cluster_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.05)
        info = json.loads(cluster_file.read_text())
        assert set(info["tls"]) == {"ca", "cert", "key"}
        with Client.from_file(str(cluster_file)) as c:
            c.create_table("e", dim=2, num_embeddings=10)
            assert c.pull("e", torch.arange(10)).shape == (10, 2)
        for cmd in (["health"], ["stats", "--interval", "0", "--json"]):
            out = subprocess.run([sys.executable, "-m", "shardps", *cmd, "--cluster-file", str(cluster_file)],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
        _refused(info["addresses"][0], tls=TLS(ca=info["tls"]["ca"]))  # mutual: no client certificate
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert proc.returncode == 0


# ---- tokens and roles -------------------------------------------------------------------------

OK, UNAUTH, DENIED = grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
# Written out by hand, not derived from shardps.server.rpc.auth: (no or wrong token, reader, trainer, admin).
EXPECTED = {
    "Pull":                 (UNAUTH, OK, OK, OK),
    "PullDense":            (UNAUTH, OK, OK, OK),
    "PullBatch":            (UNAUTH, OK, OK, OK),
    "DescribeTable":        (UNAUTH, OK, OK, OK),
    "ShardInfo":            (UNAUTH, OK, OK, OK),
    "Push":                 (UNAUTH, DENIED, OK, OK),
    "PushDense":            (UNAUTH, DENIED, OK, OK),
    "PushBatch":            (UNAUTH, DENIED, OK, OK),
    "Heartbeat":            (UNAUTH, DENIED, OK, OK),
    "CreateTable (same)":   (UNAUTH, DENIED, OK, OK),
    "CreateTable (new)":    (UNAUTH, DENIED, DENIED, OK),
    "RegisterDense (same)": (UNAUTH, DENIED, OK, OK),
    "RegisterDense (new)":  (UNAUTH, DENIED, DENIED, OK),
    "DropTable":            (UNAUTH, DENIED, DENIED, OK),
    "Checkpoint":           (UNAUTH, DENIED, DENIED, OK),
    "Stream: pull":         (UNAUTH, OK, OK, OK),
    "Stream: push":         (UNAUTH, DENIED, OK, OK),
    "Data plane: pull":     (UNAUTH, OK, OK, OK),
    "Data plane: push":     (UNAUTH, DENIED, OK, OK),
}


@pytest.fixture(scope="module")
def token_shard(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    tokens_file = d / "tokens"
    tokens_file.write_text("# role token\n" + "".join(f"{role} {t}\n" for role, t in TOKENS.items()))
    shard = start_shard(0, 1, d, str(d / "data"), extra=["--tokens-file", str(tokens_file)])
    with Client([shard.address], token=TOKENS["admin"]) as c:
        c.create_table("t", dim=2, num_embeddings=100)
        c.register_dense("d", torch.zeros(4, 2))
        specs = {"t": table_spec_to_pb(c.table_spec("t")), "d": dense_spec_to_pb(c.dense_spec("d"))}
        specs["data_port"] = c.shard_info()[0].data_ports[0]
    yield shard, specs
    shard.terminate()


def _calls(specs: dict, role: str) -> dict:
    """One valid request per row of EXPECTED (names made unique per role, so each call's effect is its own)."""
    m = pb.ShardMap(shard_index=0, num_shards=1)
    pull = pb.PullRequest(table="t", ids=_ids(1, 2), shard_map=m)
    push = pb.PushRequest(table="t", ids=_ids(1, 2), grads=codec.encode(np.ones((2, 2), np.float32)), shard_map=m)
    new_table, new_dense = pb.TableSpec(), pb.DenseSpec()
    new_table.CopyFrom(specs["t"])
    new_table.name = f"new-{role}"
    new_dense.CopyFrom(specs["d"])
    new_dense.name = f"new-dense-{role}"
    return {
        "Pull": ("Pull", pull),
        "PullDense": ("PullDense", pb.PullDenseRequest(name="d", row_start=0, row_end=4, shard_map=m)),
        "PullBatch": ("PullBatch", pb.PullBatchRequest(pulls=[pull])),
        "DescribeTable": ("DescribeTable", pb.DescribeTableRequest(name="t")),
        "ShardInfo": ("ShardInfo", pb.ShardInfoRequest()),
        "Push": ("Push", push),
        "PushDense": ("PushDense", pb.PushDenseRequest(name="d", row_start=0, shard_map=m,
                                                       grads=codec.encode(np.ones((4, 2), np.float32)))),
        "PushBatch": ("PushBatch", pb.PushBatchRequest(pushes=[push])),
        "Heartbeat": ("Heartbeat", pb.HeartbeatRequest(rank=0, world_size=1, clock=1)),
        "CreateTable (same)": ("CreateTable", pb.CreateTableRequest(spec=specs["t"], shard_map=m)),
        "CreateTable (new)": ("CreateTable", pb.CreateTableRequest(spec=new_table, shard_map=m)),
        "RegisterDense (same)": ("RegisterDense", pb.RegisterDenseRequest(spec=specs["d"], shard_map=m)),
        "RegisterDense (new)": ("RegisterDense", pb.RegisterDenseRequest(spec=new_dense, shard_map=m)),
        "DropTable": ("DropTable", pb.DropTableRequest(name=f"absent-{role}")),
        "Checkpoint": ("Checkpoint", pb.CheckpointRequest(checkpoint_id=f"by-{role}")),
        "Stream: pull": ("Stream", pb.StreamRequest(pull=pull)),
        "Stream: push": ("Stream", pb.StreamRequest(push=push)),
        "Data plane: pull": ("Data", (specs["data_port"], pb.StreamRequest(pull=pull))),
        "Data plane: push": ("Data", (specs["data_port"], pb.StreamRequest(push=push))),
    }


def _code(stub: pb_grpc.ShardStub, method: str, request, metadata) -> grpc.StatusCode:
    if method == "Data":  # the data plane (ZeroMQ): the token in the connection's hello, then the frame
        port, frame = request
        token = dict(metadata or ()).get("authorization", "").removeprefix("Bearer ")
        reply = data_plane_call(port, frame.SerializeToString(), token=token)
        return grpc.StatusCode.OK if not reply.HasField("error") else {
            c.value[0]: c for c in grpc.StatusCode}[reply.error.code]
    try:
        if method != "Stream":
            getattr(stub, method)(request, timeout=10, metadata=metadata)
            return OK
        (reply,) = list(stub.Stream(iter([request]), timeout=10, metadata=metadata))
        return grpc.StatusCode.OK if not reply.HasField("error") else {
            c.value[0]: c for c in grpc.StatusCode}[reply.error.code]
    except grpc.RpcError as e:
        return e.code()


@pytest.mark.parametrize("who", ["none", "wrong", "reader", "trainer", "admin"])
def test_every_role_against_every_method(token_shard, who):
    shard, specs = token_shard
    column = {"none": 0, "wrong": 0, "reader": 1, "trainer": 2, "admin": 3}[who]
    token = {"none": None, "wrong": "w" * 30}.get(who, TOKENS.get(who))
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(shard.address) as ch:
        stub = pb_grpc.ShardStub(ch)
        got = {name: _code(stub, method, request, metadata) for name, (method, request) in _calls(specs, who).items()}
        # The gRPC health service stays open to everyone (orchestrators probe it with no token).
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert got == {name: codes[column] for name, codes in EXPECTED.items()}


def test_client_errors_name_the_refusal(token_shard, monkeypatch):
    shard, _ = token_shard
    with pytest.raises(AuthenticationError, match="token"):
        Client([shard.address], token="x" * 20)
    with Client([shard.address], token=TOKENS["reader"]) as c:
        assert c.pull("t", torch.arange(3)).shape == (3, 2)
        with pytest.raises(PermissionDeniedError, match="reader may not call Push"):
            c.push("t", torch.arange(3), torch.ones(3, 2), wait=True)
        with pytest.raises(PermissionDeniedError):
            c.drop_table("t")
    monkeypatch.setenv("SHARDPS_TOKEN", TOKENS["trainer"])  # the token from the environment
    with Client([shard.address]) as c:
        c.push("t", torch.arange(3), torch.ones(3, 2), wait=True)
        with pytest.raises(PermissionDeniedError, match="only an admin"):
            c.create_table("brand-new", dim=2)


def test_bad_tokens_files_are_refused_at_start(tmp_path):
    for text, message in (("reader short\n", "shorter than"), ("root " + "x" * 20 + "\n", "unknown role"),
                          ("reader " + "x" * 20 + " extra\n", "unknown option 'extra'"),
                          ("reader " + "x" * 20 + " max_calls=0\n", "max_calls must be positive"),
                          ("reader " + "x" * 20 + " weight=lots\n", "weight must be a number"),
                          ("reader\n", "expected '<role> <token>"), ("# nothing\n", "no tokens")):
        path = tmp_path / "tokens"
        path.write_text(text)
        out = subprocess.run([sys.executable, "-m", "shardps", "serve", "--shard-index", "0", "--num-shards", "1",
                              "--tokens-file", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and message in out.stderr, out.stderr
