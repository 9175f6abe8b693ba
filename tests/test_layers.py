"""The three layers stay apart: read every module's imports (no import is run).

- shardps.core: imports neither the server, the client nor torch.
- shardps.server: never imports torch or the client.
- shardps_client: imports only shardps.core and the generated code of shardps, and only its
  transport imports grpc.
- shardps.server: only the servicer, the gRPC server and the command line import grpc; only the
  servicer (and the storage formats: durability records, checkpoint headers) convert protobuf.
X
- No import circles in shardps or shardps_client; no module over 500 lines, no class over 300.
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
    transport = LAYERS["client"] / "transport"
    assert [p for p in _files("client") if transport not in p.parents and any(_is(n, "grpc") for n in imports(p))] \
        == []
    assert any(_is(n, "grpc") for n in imports(transport / "lane.py"))


def test_the_shard_and_its_parts_speak_plain_python():
    """Protobuf conversion of requests and replies lives in the servicer, not in the shard's parts (the
    durability records and checkpoint headers are storage formats and may use it)."""
    parts = [*(LAYERS["server"] / "shard").glob("*.py"), *(LAYERS["server"] / "storage").glob("*.py"),
             LAYERS["server"] / "durability" / "wal.py", LAYERS["server"] / "durability" / "gate.py"]
    assert len(parts) >= 12
    for path in parts:
        assert [n for n in imports(path) if _is(n, "grpc", "shardps.v1")] == [], path.name


def test_the_boundary_check_catches_a_violation(tmp_path):
    """A test that cannot fail is a bug: the reader does see a server import."""
    bad = tmp_path / "m.py"
    bad.write_text("import numpy\nfrom shardps.server.storage.table import Table\n")
    assert "shardps.server.storage.table" in imports(bad)


def test_implementations_satisfy_their_protocols():
    from shardps.core.optim import SGD, Adagrad, Adam, RowOptimizer
    from shardps.server.durability import modes as durability

    for opt in (SGD(), Adagrad(), Adam()):
        assert isinstance(opt, RowOptimizer)
    for impl in (durability.NoDurability, durability.CheckpointDurability, durability.LogDurability):
        missing = [m for m in ("open", "append", "wait", "cut", "checkpointed", "records", "close")
                   if not callable(getattr(impl, m, None))]
        assert missing == [] and impl.mode in durability.MODES and isinstance(impl.wants_records, bool), impl


# ---- the server's sub-packages: each imports only those below it ------------------------------------

# Highest first: a module may import its own sub-package and any listed after it (then shardps.core).
SERVER_RANKS = ["ops", "rpc", "replica", "shard", "exports", "durability", "storage"]


def _server_package(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] != ["shardps", "server"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in SERVER_RANKS else "?"


def test_every_server_module_lives_in_a_sub_package():
    loose = [p.name for p in LAYERS["server"].glob("*.py") if p.name != "__init__.py"]
    assert loose == []
    assert sorted(p.name for p in LAYERS["server"].iterdir() if p.is_dir() and p.name != "__pycache__") == \
        sorted(SERVER_RANKS)
    for pkg in SERVER_RANKS:
        doc = ast.get_docstring(ast.parse((LAYERS["server"] / pkg / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"shardps/server/{pkg}/__init__.py must say its job"


def _upward(path: pathlib.Path, server: pathlib.Path = LAYERS["server"]) -> list[str]:
    """The imports of ``path`` (a module under ``server``'s sub-packages) that reach a higher sub-package."""
    rel = path.relative_to(server)
    own = rel.parts[0]
    bad = []
    for name in imports(path):
        pkg = _server_package(name)
        if pkg is None:
            continue
        if pkg == "?" or SERVER_RANKS.index(pkg) < SERVER_RANKS.index(own):
            bad.append(f"{rel} ({own}) imports {name}")
    return bad


def test_server_sub_packages_import_only_downward():
    files = [p for p in _files("server") if p.parent != LAYERS["server"]]
    assert [b for p in files for b in _upward(p)] == []


def test_the_layering_check_catches_an_upward_import(tmp_path):
    (tmp_path / "storage").mkdir()
    bad = tmp_path / "storage" / "probe.py"  # outside the tree, so no other test ever reads it
    bad.write_text("from shardps.server.rpc import fair\nfrom shardps.server.storage import table\n")
    assert _upward(bad, tmp_path) == ["storage/probe.py (storage) imports shardps.server.rpc",
                                      "storage/probe.py (storage) imports shardps.server.rpc.fair"]


# ---- no import circles anywhere -----------------------------------------------------------------------

PACKAGES = {"shardps": ROOT / "shardps", "shardps_client": ROOT / "clients" / "shardps_client"}


def _module_files() -> dict[str, pathlib.Path]:
    out = {}
    for top, base in PACKAGES.items():
        for p in base.rglob("*.py"):
            rel = p.relative_to(base).with_suffix("")
            parts = [top, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if "v1" not in parts:  # generated code
                out[".".join(parts)] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> modules of ours it imports (``from pkg import name`` counts as pkg.name when that is a module)."""
    mods = _module_files()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps = set()
        for name in imports(path):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps.add(name)
        graph[mod] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = import_graph()
    # a package's __init__ re-exporting its own modules is not a circle of knowledge
    for mod in graph:
        graph[mod] = {d for d in graph[mod] if not d.startswith(mod + ".")}
    assert circles(graph) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ---- small modules and classes --------------------------------------------------------------------------

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300


def _sized_files() -> list[pathlib.Path]:
    return [p for p in _module_files().values()]


def test_no_module_over_500_lines():
    big = [f"{p.relative_to(ROOT)}: {n}" for p in _sized_files()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert big == []


def test_no_class_over_300_lines():
    big = []
    for p in _sized_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    big.append(f"{p.relative_to(ROOT)}:{node.name}: {n}")
    assert big == []
