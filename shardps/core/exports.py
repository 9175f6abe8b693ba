"""Exports: a cluster's tables in files other tools read, with deltas that keep them fresh.

An export directory holds numbered *generations*. Generation 0 is a base (every row
at one cluster-wide cut); each later one is a delta (the rows changed since the
previous cut, and tombstones: ids evicted since) or a new base (a fresh export, or
a compaction of the chain before it)::

    base-000000.json                       manifest: tables, specs, dims, rows, shard map,
    base-000000/shard-0-of-2/000-emb.safetensors   the cut's versions, each file's sha256
    delta-000001.json
    delta-000001/shard-0-of-2/000-emb.safetensors
    ...

Files are safetensors (``ids`` int64 [n], ``values`` float32 [n, dim], and
``tombstones`` int64 [k] in deltas; ``steps`` and ``state.<name>`` with optimizer
state): ``safetensors.numpy.load_file`` / ``safetensors.torch.load_file`` read them
as they are, and the format is 8 bytes of header length, a JSON header and raw
little-endian arrays, so a reader needs no library at all. A generation's files are
written, fsynced and renamed into place first; its manifest last, so a manifest on
disk means a complete generation. Base + deltas 1..n reproduce every row the
cluster held at delta n's cut; absent ids read as their initializer's value, as on
the trainer.

``shardps.core.exporter.Exporter`` writes generations from a running cluster; ``compact``
folds a chain into one base; ``Chain``/``load_tables`` read it back (the serving shard,
``shardps.server.exports.serving``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

import numpy as np

from shardps.core.files import fsync_dir
from shardps.core.routing import dense_rows_owned, shard_of_ids
from shardps.core.specs import DenseSpec, TableSpec, spec_from_b64, spec_to_b64

log = logging.getLogger(__name__)

FORMAT = "shardps-export/1"
_NAME = re.compile(r"^(base|delta)-(\d{6,})\.json$")
_DTYPES = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
           "F16": np.dtype("<f2"), "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
_CODES = {v: k for k, v in _DTYPES.items()}
_CHUNK = 16 << 20

Spec = Union[TableSpec, DenseSpec]


class CorruptExport(Exception):
    """An export file or manifest is missing, truncated, or fails its checksum (the message names it)."""


# ---- safetensors ---------------------------------------------------------------------------


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> tuple[int, str]:
    """Write a safetensors file atomically (temporary name, fsync, rename); returns (bytes, sha256 hex)."""
    header: dict[str, Any] = {}
    arrays = []
    offset = 0
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": _CODES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    h = hashlib.sha256()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for part in (struct.pack("<Q", len(raw)), raw):
            f.write(part)
            h.update(part)
        for a in arrays:
            flat = memoryview(a.reshape(-1)).cast("B") if a.nbytes else memoryview(b"")
            for i in range(0, len(flat), _CHUNK):
                chunk = flat[i:i + _CHUNK]
                f.write(chunk)
                h.update(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return 8 + len(raw) + offset, h.hexdigest()


def read_safetensors(path: pathlib.Path, sha256: Optional[str] = None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors and metadata of a safetensors file, checked against ``sha256`` when given (CorruptExport
    names the file on any damage)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CorruptExport(f"{path}: cannot be read ({e.strerror or e})") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CorruptExport(f"{path}: checksum mismatch ({len(data):,} bytes): truncated or corrupted")
    try:
        (n,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8:8 + n])
        body = memoryview(data)[8 + n:]
        out = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            dt = _DTYPES[e["dtype"]]
            begin, end = e["data_offsets"]
            count = int(np.prod(e["shape"], dtype=np.int64))
            if not 0 <= begin <= end <= len(body) or end - begin != count * dt.itemsize:
                raise ValueError(f"tensor {name!r} lies outside the file")
            out[name] = np.frombuffer(body[begin:end], dtype=dt).reshape(e["shape"])
        return out, dict(header.get("__metadata__", {}))
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CorruptExport(f"{path}: not a readable safetensors file ({e})") from None


# ---- manifests and the directory ----------------------------------------------------------------


def spec_from_entry(entry: dict[str, Any]) -> Spec:
    """The spec of a manifest's table entry."""
    return spec_from_b64(entry["spec"], entry["kind"] == "dense")


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def generation_name(kind: str, seq: int) -> str:
    return f"{kind}-{seq:06d}"


def write_manifest(out: pathlib.Path, body: dict[str, Any]) -> pathlib.Path:
    """Write a generation's manifest last, atomically, with a checksum of its own body."""
    path = out / (generation_name(body["kind"], body["seq"]) + ".json")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({**body, "sha256": _digest(body)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(out)
    return path


def read_manifest(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        digest = data.pop("sha256")
        if _digest(data) != digest:
            raise CorruptExport(f"{path}: manifest checksum mismatch (edited or corrupted)")
        if data.get("format") != FORMAT:
            raise CorruptExport(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
        return data
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise CorruptExport(f"{path}: unreadable manifest ({e})") from None


def generations(out: pathlib.Path) -> list[tuple[int, str, pathlib.Path]]:
    """(seq, kind, manifest path) of every committed generation, oldest first."""
    found = []
    if out.is_dir():
        for p in out.iterdir():
            m = _NAME.match(p.name)
            if m:
                found.append((int(m.group(2)), m.group(1), p))
    return sorted(found)


def file_name(k: int, name: str) -> str:
    return f"{k:03d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:80]}.safetensors"


def shard_dir(generation: str, shard: int, num_shards: int) -> str:
    return f"{generation}/shard-{shard}-of-{num_shards}"


@dataclass
class ExportResult:
    """What one export call wrote."""

    kind: str  # "base" or "delta" ("none": nothing changed, nothing written)
    seq: int
    rows: int = 0
    tombstones: int = 0
    bytes: int = 0
    seconds: float = 0.0
    pause_s: float = 0.0  # how long the cut held pushes back (prepare to the last shard's copy)
    versions: list[int] = field(default_factory=list)
    path: Optional[pathlib.Path] = None


# ---- reading a chain ------------------------------------------------------------------------------


@dataclass
class ShardTable:
    """One table's part on one shard, as the export holds it (sorted by id)."""

    spec: Spec
    ids: np.ndarray
    values: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # steps, state.*


def load_shard_file(root: pathlib.Path, entry: dict[str, Any], shard: int) -> dict[str, np.ndarray]:
    """The arrays of one table's file of ``shard`` in a manifest entry, verified (CorruptExport names it)."""
    part = entry["shards"][shard]
    arrays, _ = read_safetensors(root / part["file"], part["sha256"])
    ids, values = arrays.get("ids"), arrays.get("values")
    if ids is None or values is None or ids.ndim != 1 or values.shape != (ids.shape[0], entry["dim"]):
        raise CorruptExport(f"{root / part['file']}: ids/values missing or not of shape [n], [n, {entry['dim']}]")
    if ids.shape[0] != part["rows"]:
        raise CorruptExport(f"{root / part['file']}: {ids.shape[0]} rows, the manifest says {part['rows']}")
    return arrays


def apply_delta(current: Optional[ShardTable], spec: Spec, arrays: dict[str, np.ndarray], full: bool) -> ShardTable:
    """A shard's table after a delta's file (numpy; ``compact`` and tests use it): tombstones first, then rows."""
    ids, values = arrays["ids"], arrays["values"]
    extra = {k: v for k, v in arrays.items() if k not in ("ids", "values", "tombstones")}
    if current is None or full:
        order = np.argsort(ids, kind="stable")
        return ShardTable(spec, ids[order].copy(), values[order].copy(), {k: v[order].copy() for k, v in extra.items()})
    keep = ~np.isin(current.ids, arrays.get("tombstones", np.zeros(0, np.int64)))
    keep &= ~np.isin(current.ids, ids)
    all_ids = np.concatenate([current.ids[keep], ids])
    order = np.argsort(all_ids, kind="stable")
    out_extra = {}
    for k, v in extra.items():
        if k in current.extra:
            out_extra[k] = np.concatenate([current.extra[k][keep], v])[order]
    return ShardTable(spec, all_ids[order], np.concatenate([current.values[keep], values])[order], out_extra)


class Chain:
    """The committed generations of an export directory a reader follows: the newest base, then deltas."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root

    def newest_base(self, at_most: Optional[int] = None) -> Optional[tuple[int, pathlib.Path]]:
        bases = [(seq, p) for seq, kind, p in generations(self.root) if kind == "base" and (at_most is None or seq <= at_most)]
        return bases[-1] if bases else None

    def after(self, seq: int) -> list[tuple[int, str, pathlib.Path]]:
        return [g for g in generations(self.root) if g[0] > seq]


def load_tables(root: pathlib.Path, upto: Optional[int] = None, shards: Optional[Iterable[int]] = None,
                ) -> tuple[dict[str, Any], dict[int, dict[str, ShardTable]]]:
    """Base + deltas of ``root`` up to generation ``upto`` (default: the newest), read for ``shards`` (default:
    all): (the last manifest applied, {shard: {table: ShardTable}})."""
    base = Chain(root).newest_base(upto)
    if base is None:
        raise CorruptExport(f"{root}: no base (base-NNNNNN.json) to start from")
    manifest = read_manifest(base[1])
    n = manifest["num_shards"]
    wanted = list(range(n)) if shards is None else list(shards)
    state: dict[int, dict[str, ShardTable]] = {s: {} for s in wanted}
    seq = base[0]
    todo = [(seq, "base", base[1])] + [g for g in Chain(root).after(seq) if g[1] == "delta" and (upto is None or g[0] <= upto)]
    for gseq, kind, path in todo:
        m = manifest if gseq == seq else read_manifest(path)
        if kind == "delta" and m["previous"] != manifest["seq"]:
            raise CorruptExport(f"{path}: delta {gseq} follows generation {m['previous']}, not {manifest['seq']}")
        if m["num_shards"] != n:
            raise CorruptExport(f"{path}: written for {m['num_shards']} shards, the chain has {n}")
        for s in wanted:
            for name in m.get("dropped", []):
                state[s].pop(name, None)
            for entry in m["tables"]:
                spec = spec_from_entry(entry)
                arrays = load_shard_file(root, entry, s)
                full = kind == "base" or entry["shards"][s].get("full", entry["full"])
                state[s][entry["name"]] = apply_delta(state[s].get(entry["name"]), spec, arrays, full)
        manifest = m
    return manifest, state


# ---- compaction ------------------------------------------------------------------------------------


def compact(src: Union[str, pathlib.Path], dst: Optional[Union[str, pathlib.Path]] = None,
            num_shards: Optional[int] = None, keep_bases: int = 2) -> ExportResult:
    """Fold base + deltas of ``src`` into one base. In place (``dst`` None): written as the newest
    generation's number, then bases beyond the newest ``keep_bases`` and the deltas before the oldest
    kept base are deleted (a serving shard that still needs a deleted delta reloads the newest base).
    With ``dst``: a new export there, with ``num_shards`` shards (resharded) if given."""
    t0 = time.perf_counter()
    src = pathlib.Path(src)
    manifest, state = load_tables(src)
    n = manifest["num_shards"]
    m = num_shards or n
    out = pathlib.Path(dst) if dst is not None else src
    seq = manifest["seq"] if dst is None else 0
    if dst is not None:
        out.mkdir(parents=True, exist_ok=True)
        if generations(out):
            raise ValueError(f"{out} holds an export already; compact into an empty directory")
    elif m != n:
        raise ValueError("resharding writes a new export: give a destination directory")
    gen = generation_name("base", seq)
    if dst is None and (src / (gen + ".json")).exists():
        return ExportResult("base", seq, seconds=0.0)  # the newest generation is a base already
    names: dict[str, Spec] = {}
    for tables in state.values():
        for name, t in tables.items():
            names[name] = t.spec
    result = ExportResult("base", seq, versions=list(manifest["versions"]) if m == n else [])
    entries = []
    for k, (name, spec) in enumerate(sorted(names.items())):
        parts = [state[s][name] for s in range(n) if name in state[s]]
        ids = np.concatenate([p.ids for p in parts])
        values = np.concatenate([p.values for p in parts])
        extra_keys = set.intersection(*(set(p.extra) for p in parts)) if parts else set()
        extra = {key: np.concatenate([p.extra[key] for p in parts]) for key in extra_keys}
        if isinstance(spec, DenseSpec):
            owner = np.zeros(ids.shape[0], np.int64)
            for s in range(m):
                owner[dense_rows_owned(spec.name, spec.rows, spec.chunk_rows, m, s)[ids]] = s
        else:
            owner = shard_of_ids(ids, m)
        dim = spec.cols if isinstance(spec, DenseSpec) else spec.dim
        entry = {"name": name, "kind": "dense" if isinstance(spec, DenseSpec) else "table", "dim": dim,
                 "spec": spec_to_b64(spec), "full": True, "shards": []}
        for s in range(m):
            sel = np.flatnonzero(owner == s)
            sel = sel[np.argsort(ids[sel], kind="stable")]
            sdir = out / shard_dir(gen, s, m)
            sdir.mkdir(parents=True, exist_ok=True)
            rel = f"{shard_dir(gen, s, m)}/{file_name(k, name)}"
            arrays = {"ids": ids[sel], "values": values[sel], **{key: v[sel] for key, v in extra.items()}}
            size, digest = write_safetensors(out / rel, arrays, {"format": FORMAT, "table": name, "kind": "base",
                                                                  "seq": seq, "shard": s, "num_shards": m})
            entry["shards"].append({"file": rel, "rows": int(sel.shape[0]), "tombstones": 0, "bytes": size,
                                    "sha256": digest})
            result.rows += int(sel.shape[0])
            result.bytes += size
        entries.append(entry)
    for s in range(m):
        (out / shard_dir(gen, s, m)).mkdir(parents=True, exist_ok=True)
        fsync_dir(out / shard_dir(gen, s, m))
    body = {"format": FORMAT, "kind": "base", "seq": seq, "previous": None, "created": time.time(),
            "num_shards": m, "optimizer_state": manifest.get("optimizer_state", False),
            "selection": manifest.get("selection", []), "versions": result.versions, "since": None,
            "tables": entries, "dropped": [], "rows": result.rows, "tombstones": 0, "bytes": result.bytes,
            "compacted_from": str(src) if dst is not None else None}
    result.path = write_manifest(out, body)
    if dst is None:
        prune(out, keep_bases)
    result.seconds = time.perf_counter() - t0
    return result


def prune(out: pathlib.Path, keep_bases: int = 2) -> list[str]:
    """Delete all but the newest ``keep_bases`` bases and the deltas up to the oldest kept one; returns
    the generations deleted (manifest first, so a reader never finds a manifest without its files)."""
    gens = generations(out)
    bases = [seq for seq, kind, _ in gens if kind == "base"]
    if len(bases) <= keep_bases:
        return []
    oldest = bases[-keep_bases] if keep_bases > 0 else bases[-1]
    gone = []
    for seq, kind, path in gens:
        if seq < oldest or (seq == oldest and kind == "delta"):  # base N holds deltas up to N
            path.unlink(missing_ok=True)
            shutil.rmtree(out / generation_name(kind, seq), ignore_errors=True)
            gone.append(generation_name(kind, seq))
    return gone
