"""Turn the data of an N-shard cluster into that of an M-shard cluster.

Each old shard is restored exactly as on start (newest valid checkpoint plus
its write-ahead log), then every row of every table, with its optimizer state,
step count and metadata (last push, pushes), is routed to the shard that owns it under M shards, and one
checkpoint per new shard is written. Nothing is lost or duplicated: the row
counts are checked before anything is written.
"""

from __future__ import annotations

import logging
import pathlib
import re
import time
from typing import Any

import numpy as np

from shardps.core.ids import unique_ids
from shardps.core.routing import dense_rows_owned, shard_of_ids
from shardps.core.specs import DenseSpec, TableSpec
from shardps.server.durability import checkpoints
from shardps.server.shard.facade import Shard, ShardConfig
from shardps.server.storage.disk import DiskTiers, RecordCodec
from shardps.server.storage.tiered import read_spill, write_spill

log = logging.getLogger(__name__)

_SHARD_DIR = re.compile(r"^shard-(\d+)$")
TABLE_WIDE = "table."  # snapshot keys of a table as a whole (not one entry per row)


def shard_dirs(root: pathlib.Path) -> list[pathlib.Path]:
    """``root/shard-0 .. shard-(N-1)``; raises if the set is not contiguous."""
    found = {}
    for p in root.iterdir() if root.is_dir() else []:
        m = _SHARD_DIR.match(p.name)
        if m and p.is_dir():
            found[int(m.group(1))] = p
    if not found:
        raise ValueError(f"{root} holds no shard-<i> directories")
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"{root}: shard directories {sorted(found)} are not 0..{len(found) - 1}")
    return [found[i] for i in range(len(found))]


def reshard(src: pathlib.Path, dst: pathlib.Path, num_shards: int) -> dict[str, Any]:
    """Reshard the cluster data in ``src`` (shard-*/) into ``num_shards`` shards under ``dst``."""
    if num_shards < 1:
        raise ValueError("--shards must be >= 1")
    dirs = shard_dirs(src)
    old_n = len(dirs)
    for j in range(num_shards):
        d = dst / f"shard-{j}"
        if d.exists() and any(d.iterdir()):
            raise ValueError(f"{d} is not empty: reshard into a fresh directory")
    snapshots = []
    for i, d in enumerate(dirs):
        shard = Shard(ShardConfig(i, old_n, data_dir=str(d), durability="checkpoint"))
        meta, arrays, _ = shard.snapshot()
        if meta.get("disk_tier"):  # tables with a disk tier: their rows on disk join the hot ones
            _add_disk_rows(shard, meta, arrays)
        _owned_only(shard, meta, arrays)
        snapshots.append((meta, arrays))
        shard.close()
    # Every shard knows every table's spec; check they agree.
    specs: dict[str, dict] = {}
    for meta, _ in snapshots:
        for entry in meta["tables"]:
            prev = specs.setdefault(entry["name"], entry)
            if prev["spec"] != entry["spec"] or prev["dense"] != entry["dense"]:
                raise ValueError(f"table {entry['name']!r} has different specs on different shards")
    names = sorted(specs)
    version = max(int(m["version"]) for m, _ in snapshots)
    merged: dict[str, dict[str, np.ndarray]] = {}
    for name in names:
        parts: dict[str, list[np.ndarray]] = {}
        for meta, arrays in snapshots:
            idx = next((k for k, e in enumerate(meta["tables"]) if e["name"] == name), None)
            if idx is None:
                continue
            prefix = f"t{idx}."
            for key, arr in arrays.items():
                if key.startswith(prefix):
                    if key.endswith(".meta.last_version"):  # keep "versions since the last push" (TTL) per row
                        arr = np.where(arr > 0, arr + (version - int(meta["version"])), 0)
                    parts.setdefault(key[len(prefix):], []).append(arr)
        # Per-row arrays are concatenated; a table's own arrays (its admission sketch) are merged by their
        # element-wise maximum: every count stays at least what any old shard had (over-counts admit early).
        merged[name] = {k: (np.maximum.reduce(v) if k.startswith(TABLE_WIDE) else np.concatenate(v))
                        for k, v in parts.items()}
        ids = merged[name]["ids"]
        if unique_ids(ids).shape[0] != ids.shape[0]:
            raise ValueError(f"table {name!r}: an id is held by more than one old shard; refusing to reshard")
    stamp = time.strftime("reshard-%Y%m%d-%H%M%S")
    summary: dict[str, Any] = {"from_shards": old_n, "to_shards": num_shards, "tables": {}}
    for name in names:
        summary["tables"][name] = {"rows": int(merged[name]["ids"].shape[0]), "per_shard": [0] * num_shards}
    for j in range(num_shards):
        meta_j: dict[str, Any] = {
            "shard_index": j, "num_shards": num_shards, "version": version, "seen": {},
            "tables": [], "wal_segment": 0, "checkpoint_id": stamp, "seqno": 1,
        }
        arrays_j: dict[str, np.ndarray] = {}
        for i, name in enumerate(names):
            entry = specs[name]
            meta_j["tables"].append(entry)
            ids = merged[name]["ids"]
            if entry["dense"]:
                spec = checkpoints.spec_of(entry)
                assert isinstance(spec, DenseSpec)
                mine = dense_rows_owned(name, spec.rows, spec.chunk_rows, num_shards, j)[ids]
            else:
                mine = shard_of_ids(ids, num_shards) == j
            for key, arr in merged[name].items():
                arrays_j[f"t{i}.{key}"] = arr if key.startswith(TABLE_WIDE) else arr[mine]
            summary["tables"][name]["per_shard"][j] = int(mine.sum())
        d = dst / f"shard-{j}"
        d.mkdir(parents=True, exist_ok=True)
        name = checkpoints.file_name(1, stamp)
        tiered = [(i, checkpoints.spec_of(e)) for i, e in enumerate(meta_j["tables"]) if _tiered(e)]
        if tiered:  # every row of a table with a disk tier goes to the new shard's disk tier (default --disk-dir)
            meta_j["disk_tier"] = name.removesuffix(checkpoints.SUFFIX)
            _write_disk_tier(DiskTiers(d / "disk", j, num_shards), meta_j["disk_tier"], tiered, arrays_j)
        checkpoints.write(d / name, meta_j, arrays_j)
    for name, t in summary["tables"].items():
        assert sum(t["per_shard"]) == t["rows"], f"{name}: rows lost or duplicated"
    log.info("resharded %s (%d shards) into %s (%d shards)", src, old_n, dst, num_shards)
    return summary


def _owned_only(shard: Shard, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Keep the rows the shard owns under its slot map (a migration stopped midway leaves rows on its target that
    are still the source's)."""
    for i, entry in enumerate(meta["tables"]):
        p = f"t{i}."
        ids = arrays.get(p + "ids")
        if ids is None or not ids.shape[0]:
            continue
        keep = shard.slots.owned(checkpoints.spec_of(entry), ids)
        if keep.all():
            continue
        for k in [k for k in arrays if k.startswith(p) and not k[len(p):].startswith(TABLE_WIDE)]:
            arrays[k] = arrays[k][keep]


def _tiered(entry: dict[str, Any]) -> bool:
    spec = checkpoints.spec_of(entry)
    return isinstance(spec, TableSpec) and spec.disk is not None


def _codec(spec: TableSpec) -> RecordCodec:
    return RecordCodec(spec.dim, list(spec.optimizer.state_names()))


def _add_disk_rows(shard: Shard, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Add to a snapshot's arrays every row of its tables with a disk tier: the hot ones spilled into the tier's
    checkpoint of the snapshot, then those only on disk (the checkpoint is removed afterwards)."""
    tiers = shard.registry.tiers
    assert tiers is not None
    reader = tiers.open_checkpoint(meta["disk_tier"])
    try:
        for i, entry in enumerate(meta["tables"]):
            if not _tiered(entry):
                continue
            spec = checkpoints.spec_of(entry)
            assert isinstance(spec, TableSpec)
            codec = _codec(spec)
            hot, _ = read_spill(tiers.checkpoint_root / meta["disk_tier"], spec.name, codec.describe())
            parts = [{k: np.asarray(v) for k, v in hot.items() if k != "meta.on_disk"}]
            hot_ids = np.sort(parts[0]["ids"])
            for ids, rec in reader.scan(spec.name, codec):
                keep = ~np.isin(ids, hot_ids, assume_unique=True)
                part = {"ids": ids[keep], "rows": rec["rows"][keep], "steps": rec["steps"][keep]}
                part.update({"meta." + f: rec[f][keep] for f in ("last_version", "last_time", "touches")})
                part.update({"state." + n: rec["state." + n][keep] for n in spec.optimizer.state_names()})
                parts.append(part)
            p = f"t{i}."
            for k in parts[0]:
                arrays[p + k] = np.concatenate([part[k] for part in parts])
            arrays.pop(p + "table.disk_rows", None)
    finally:
        reader.close()
        tiers.remove_checkpoint(meta["disk_tier"])


def _write_disk_tier(tiers: DiskTiers, name: str, tiered: list[tuple[int, Any]], arrays: dict[str, np.ndarray]) -> None:
    """Write every row of the tables with a disk tier to a new shard's disk tier and checkpoint it as ``name``, none
    of them in memory; their entries in ``arrays`` become the count of rows on disk."""
    spilled: list[tuple[TableSpec, int, list[tuple[str, np.ndarray]]]] = []
    try:
        tiers.reset()
        for i, spec in tiered:
            p = f"t{i}."
            store = tiers.create(spec.name, _codec(spec))
            n = arrays[p + "ids"].shape[0]
            fields = {"rows": arrays[p + "rows"], "steps": arrays[p + "steps"]}
            fields.update({k: arrays[p + "meta." + k] for k in ("last_version", "last_time", "touches")})
            fields.update({"state." + s: arrays[p + "state." + s] for s in spec.optimizer.state_names()})
            for lo in range(0, n, 65536):
                store.put(arrays[p + "ids"][lo:lo + 65536], {k: v[lo:lo + 65536] for k, v in fields.items()})
            empty = [(k[len(p):], arrays[k][:0]) for k in arrays if k.startswith(p)]
            empty.sort(key=lambda e: e[0] != "ids")  # the ids first, as a spill has them
            spilled.append((spec, n, empty + [("meta.on_disk", np.zeros(0, np.uint8))]))
            for k in [k for k in arrays if k.startswith(p)]:
                del arrays[k]
            arrays[p + "table.disk_rows"] = np.array([n], np.int64)
        tier_dir = tiers.checkpoint(name)
        for spec, n, empty in spilled:  # every row on disk, none in memory
            write_spill(tier_dir, spec.name, spec.name, _codec(spec).describe(), n, empty)
        tiers.sync_checkpoint(name)
    finally:
        tiers.close()
