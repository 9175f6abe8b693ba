"""The three layers stay apart: read every module's imports (no import is run).

- shardps.core: imports neither the server, the client nor torch.
- shardps.server: never imports torch or the client.
- shardps_client: imports only shardps.core and the generated code of shardps, and only its
  transport imports grpc.
- shardps.server: only the servicer, the gRPC server and the command line import grpc; only the
  servicer (and the storage formats: durability records, checkpoint headers) convert protobuf.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = {
    "core": ROOT / "shardps" / "core",
    "server": ROOT / "shardps" / "server",
    "client": ROOT / "clients" / "shardps_client",
}


def imports(path: pathlib.Path) -> list[str]:
    """Every module a file imports, absolute names (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}: relative import; write it absolute so its layer shows")
            assert node.module is not None
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def _files(layer: str) -> list[pathlib.Path]:
    return sorted(LAYERS[layer].rglob("*.py"))


def _offending(layer: str, allowed) -> list[str]:
    bad = []
    for path in _files(layer):
        for name in imports(path):
            if not allowed(name):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def _is(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("layer", list(LAYERS))
def test_layer_folders_hold_modules(layer):
    assert len(_files(layer)) >= 3, layer


def test_core_imports_neither_server_nor_client_nor_torch():
    assert _offending("core", lambda n: not _is(n, "shardps.server", "shardps_client", "torch")) == []
    # and nothing of shardps outside core and the generated code
    assert _offending("core", lambda n: not _is(n, "shardps") or _is(n, "shardps.core", "shardps.v1")) == []


def test_server_never_imports_torch_or_the_client():
    assert _offending("server", lambda n: not _is(n, "torch", "shardps_client")) == []


def test_client_imports_only_core_and_generated_code():
    assert _offending("client", lambda n: not _is(n, "shardps") or _is(n, "shardps.core", "shardps.v1")) == []


def test_only_the_transport_imports_grpc_in_the_client():
    transport = LAYERS["client"] / "transport.py"
    assert [p for p in _files("client") if p != transport and any(_is(n, "grpc") for n in imports(p))] == []
    assert any(_is(n, "grpc") for n in imports(transport))


def test_the_shard_and_its_parts_speak_plain_python():
    """Protobuf conversion of requests and replies lives in the servicer, not in the shard's parts."""
    parts = ["shard", "registry", "updates", "sync", "gate", "table", "index", "aggregate", "limits", "wal"]
    for name in parts:
        path = LAYERS["server"] / f"{name}.py"
        assert [n for n in imports(path) if _is(n, "grpc", "shardps.v1")] == [], path.name


def test_the_boundary_check_catches_a_violation(tmp_path):
    """A test that cannot fail is a bug: the reader does see a server import."""
    bad = tmp_path / "m.py"
    bad.write_text("import numpy\nfrom shardps.server.table import Table\n")
    assert "shardps.server.table" in imports(bad)


def test_implementations_satisfy_their_protocols():
    from shardps.core.optim import SGD, Adagrad, Adam, RowOptimizer
    from shardps.server import durability

    for opt in (SGD(), Adagrad(), Adam()):
        assert isinstance(opt, RowOptimizer)
    for impl in (durability.NoDurability, durability.CheckpointDurability, durability.LogDurability):
        missing = [m for m in ("open", "append", "wait", "cut", "checkpointed", "records", "close")
                   if not callable(getattr(impl, m, None))]
        assert missing == [] and impl.mode in durability.MODES and isinstance(impl.wants_records, bool), impl
