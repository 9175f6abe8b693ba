"""Writing exports from a running cluster (the format is ``shardps.core.exports``): ``Exporter`` takes a
cluster-wide cut like a two-phase checkpoint (every shard holds pushes back, then copies what it exports
and resumes), reads each shard's copy in pages through any ``call(shard, method, request)`` (the client's
transport, or the ``shardps export`` command's own channels) and writes a base or a delta."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np

from shardps.core import codec
from shardps.core.errors import ExportGap
from shardps.core.exports import (
    FORMAT,
    Chain,
    ExportResult,
    Spec,
    file_name,
    generation_name,
    generations,
    read_manifest,
    shard_dir,
    write_manifest,
    write_safetensors,
)
from shardps.core.files import fsync_dir
from shardps.core.specs import DenseSpec, dense_spec_from_pb, spec_from_b64, spec_to_b64, table_spec_from_pb
from shardps.v1 import shardps_pb2 as pb

log = logging.getLogger(__name__)

Caller = Callable[[int, str, Any], Any]  # (shard, method, request message) -> reply message


class Exporter:
    """Writes bases and deltas of a running cluster into an export directory.

    Args:
        call: ``call(shard, method, request)`` -> reply, for ``shardps.v1.Shard`` methods.
        num_shards: shards in the cluster (shard i is call's shard i): every index its slot map has.
        hold_s: longest time shards hold pushes back for a cut (the copy itself takes milliseconds).
        shards: the shards that own rows (default: all); the others (removed by ``shardps reshard``) get empty files.

    A cluster that moved slots (``shardps reshard``) writes its slot map at the cut into the manifest
    (``slot_map``): shards serving the export route by it. A delta needs the map of the generation before it.
    """

    def __init__(self, call: Caller, num_shards: int, hold_s: float = 30.0, shards: Optional[list[int]] = None) -> None:
        self.call = call
        self.num_shards = num_shards
        self.hold_s = hold_s
        self.shards = list(range(num_shards)) if shards is None else sorted(shards)

    # -- the cut --

    def _cut(self, tables: list[str], optimizer_state: bool, since: Optional[list[int]]
             ) -> tuple[str, list[pb.ExportResponse], float]:
        """PREPARE every shard, then BEGIN on each: (export id, BEGIN replies, seconds pushes were held)."""
        eid = uuid.uuid4().hex[:16]
        shards = self.shards
        started = time.perf_counter()
        try:
            for s in shards:
                self.call(s, "Export", pb.ExportRequest(phase=pb.ExportRequest.PREPARE, export_id=eid, hold_s=self.hold_s))
            begun = []
            for s in shards:
                begun.append(self.call(s, "Export", pb.ExportRequest(
                    phase=pb.ExportRequest.BEGIN, export_id=eid, tables=tables, optimizer_state=optimizer_state,
                    delta=since is not None, since_version=since[s] if since is not None else 0)))
            begun = _with_empty(begun, shards, self.num_shards)
        except BaseException:
            for s in shards:
                for phase in (pb.ExportRequest.ABORT, pb.ExportRequest.END):
                    try:
                        self.call(s, "Export", pb.ExportRequest(phase=phase, export_id=eid))
                    except Exception as e:  # noqa: BLE001 - best effort; the hold ends by itself
                        log.warning("export %s: releasing shard %d failed: %s", eid, s, e)
            raise
        return eid, begun, time.perf_counter() - started

    def _pages(self, shard: int, eid: str, name: str, total: int, tombstones: bool = False
               ) -> Iterator[tuple[int, pb.ExportResponse, np.ndarray]]:
        """(offset, reply, its ids) of each page of one table's copy on one shard (or of its tombstones)."""
        at = 0
        while at < total:
            r = self.call(shard, "Export", pb.ExportRequest(phase=pb.ExportRequest.READ, export_id=eid, table=name,
                                                           offset=at, read_tombstones=tombstones))
            ids = codec.decode(r.ids, "ids")
            if ids.shape[0] == 0:
                what = "tombstones" if tombstones else "rows"
                raise RuntimeError(f"shard {shard}: export {eid} of {name!r} {what} ended at {at} of {total}")
            yield at, r, ids
            at += ids.shape[0]

    def _read(self, shard: int, eid: str, name: str, rows: int, tombstones: int, dim: int,
              optimizer_state: bool) -> dict[str, np.ndarray]:
        """Every page of one table's copy on one shard, into arrays (``tombstones`` -1: none asked)."""
        out: dict[str, np.ndarray] = {"ids": np.empty(rows, np.int64), "values": np.empty((rows, dim), np.float32)}
        for at, r, ids in self._pages(shard, eid, name, rows):
            k = ids.shape[0]
            out["ids"][at:at + k] = ids
            out["values"][at:at + k] = codec.decode(r.values, "values")
            if optimizer_state:
                if "steps" not in out:
                    out["steps"] = np.empty(rows, np.int64)
                    for sname in r.state:
                        out["state." + sname] = np.empty((rows, dim), np.float32)
                out["steps"][at:at + k] = codec.decode(r.steps, "steps")
                for sname, t in r.state.items():
                    out["state." + sname][at:at + k] = codec.decode(t, sname)
        if optimizer_state and "steps" not in out:
            out["steps"] = np.zeros(0, np.int64)
        if tombstones >= 0:
            out["tombstones"] = np.empty(tombstones, np.int64)
            for at, _, ids in self._pages(shard, eid, name, tombstones, tombstones=True):
                out["tombstones"][at:at + ids.shape[0]] = ids
        return out

    def _end(self, eid: str) -> None:
        for s in self.shards:
            try:
                self.call(s, "Export", pb.ExportRequest(phase=pb.ExportRequest.END, export_id=eid))
            except Exception as failure:  # noqa: BLE001 - the shard frees it by itself later
                log.warning("export %s: ending on shard %d failed: %s", eid, s, failure)

    def _write(self, out: pathlib.Path, kind: str, seq: int, previous: Optional[int], tables: list[str],
               optimizer_state: bool, since: Optional[list[int]], known: Optional[set[str]],
               previous_map: Optional[dict[str, Any]] = None) -> ExportResult:
        t0 = time.perf_counter()
        eid, begun, pause = self._cut(tables, optimizer_state, since)
        slot_map = _cut_map(begun)
        if previous_map is not None and kind == "delta" and _map_key(slot_map) != _map_key(previous_map):
            self._end(eid)
            raise ExportGap(f"{out}: the cluster's slot map changed since the last cut (epoch "
                            f"{_map_key(previous_map)[0]} -> {_map_key(slot_map)[0]}: slots moved between shards); "
                            "write a new base")
        gen = generation_name(kind, seq)
        result = ExportResult(kind, seq, versions=[int(b.version) for b in begun], pause_s=pause)
        entries: dict[str, dict[str, Any]] = {}
        try:
            for s, reply in enumerate(begun):
                if reply is None:  # a shard that owns nothing: its empty files follow
                    continue
                sdir = out / shard_dir(gen, s, self.num_shards)
                sdir.mkdir(parents=True, exist_ok=True)
                for k, t in enumerate(reply.tables):
                    dense = t.HasField("dense")
                    spec: Spec = dense_spec_from_pb(t.dense) if dense else table_spec_from_pb(t.spec)
                    dim = spec.cols if isinstance(spec, DenseSpec) else spec.dim
                    full = since is None or t.full
                    if not full and known is not None and spec.name not in known:
                        raise RuntimeError(f"shard {s} copied only changes of {spec.name!r}, which the export lacks")
                    arrays = self._read(s, eid, spec.name, int(t.rows), -1 if full else int(t.tombstones), dim,
                                        optimizer_state)
                    e = entries.setdefault(spec.name, {"name": spec.name, "kind": "dense" if dense else "table",
                                                       "dim": dim, "spec": spec_to_b64(spec), "full": full,
                                                       "shards": [None] * self.num_shards})
                    e["full"] = e["full"] and full
                    rel = f"{shard_dir(gen, s, self.num_shards)}/{file_name(k, spec.name)}"
                    meta = {"format": FORMAT, "table": spec.name, "kind": kind, "seq": seq, "shard": s,
                            "num_shards": self.num_shards, "version": int(reply.version)}
                    size, digest = write_safetensors(out / rel, arrays, meta)
                    n_tomb = int(arrays["tombstones"].shape[0]) if "tombstones" in arrays else 0
                    e["shards"][s] = {"file": rel, "rows": int(t.rows), "tombstones": n_tomb, "bytes": size,
                                      "sha256": digest, "full": full}
                    result.rows += int(t.rows)
                    result.tombstones += n_tomb
                    result.bytes += size
                fsync_dir(sdir)
        finally:
            self._end(eid)
        for s, reply in enumerate(begun):  # a shard owning nothing: an empty file per table
            if reply is not None:
                continue
            sdir = out / shard_dir(gen, s, self.num_shards)
            sdir.mkdir(parents=True, exist_ok=True)
            for k, (name, e) in enumerate(sorted(entries.items())):
                spec = spec_from_b64(e["spec"], e["kind"] == "dense")
                arrays = _empty_arrays(e["dim"], spec, optimizer_state, not e["full"])
                rel = f"{shard_dir(gen, s, self.num_shards)}/{file_name(k, name)}"
                meta = {"format": FORMAT, "table": name, "kind": kind, "seq": seq, "shard": s,
                        "num_shards": self.num_shards, "version": 0}
                size, digest = write_safetensors(out / rel, arrays, meta)
                e["shards"][s] = {"file": rel, "rows": 0, "tombstones": 0, "bytes": size, "sha256": digest,
                                  "full": e["full"]}
                result.bytes += size
            fsync_dir(sdir)
        for name, entry in entries.items():  # a table a shard did not report (created between two BEGINs): refuse
            if any(part is None for part in entry["shards"]):
                raise RuntimeError(f"table {name!r} was not in every shard's copy (created during the export?); retry")
        body = {"format": FORMAT, "kind": kind, "seq": seq, "previous": previous, "created": time.time(),
                "num_shards": self.num_shards, "optimizer_state": optimizer_state, "selection": tables,
                "versions": result.versions, "since": since, "tables": list(entries.values()),
                "dropped": sorted((known or set()) - set(entries)) if kind == "delta" else [],
                "rows": result.rows, "tombstones": result.tombstones, "bytes": result.bytes}
        if slot_map is not None:
            body["slot_map"] = slot_map
        if kind == "delta" and not result.rows and not result.tombstones and not body["dropped"] \
                and not any(e["full"] for e in entries.values()):
            shutil.rmtree(out / gen, ignore_errors=True)  # nothing changed: no generation
            return ExportResult("none", previous or 0, versions=result.versions, pause_s=pause,
                                seconds=time.perf_counter() - t0)
        result.path = write_manifest(out, body)
        result.seconds = time.perf_counter() - t0
        log.info("export %s: %s %d, %d rows, %d tombstones, %d bytes in %.2fs", out, kind, seq, result.rows,
                 result.tombstones, result.bytes, result.seconds)
        return result

    # -- public --

    def base(self, out: Union[str, pathlib.Path], tables: Optional[list[str]] = None,
             optimizer_state: bool = False) -> ExportResult:
        """Write a base of every table (or of ``tables``) at one cluster-wide cut, numbered after what
        ``out`` holds (deltas then follow it)."""
        out = pathlib.Path(out)
        out.mkdir(parents=True, exist_ok=True)
        gens = generations(out)
        seq = gens[-1][0] + 1 if gens else 0
        return self._write(out, "base", seq, None, list(tables or []), optimizer_state, None, None)

    def delta(self, out: Union[str, pathlib.Path], fallback_base: bool = False) -> ExportResult:
        """Write the next delta of ``out``: rows changed since its last cut, tombstones, dropped tables. If the
        cluster cannot give one (a shard restarted, the shard map changed, tombstones overflowed): a new
        base with ``fallback_base``, else ExportGap. Nothing changed: nothing is written (kind "none")."""
        out = pathlib.Path(out)
        gens = generations(out)
        if not gens:
            if fallback_base:
                return self.base(out)
            raise ExportGap(f"{out}: no base to follow; export a base first")
        last = read_manifest(gens[-1][2])
        selection, optimizer_state = last.get("selection", []), last.get("optimizer_state", False)
        try:
            if last["num_shards"] != self.num_shards:
                raise ExportGap(f"{out} was written by {last['num_shards']} shards, the cluster has {self.num_shards}")
            if len(last["versions"]) != self.num_shards:  # a resharded compaction: no cut of this cluster
                raise ExportGap(f"{out}'s last generation was resharded offline: it follows no cut of this cluster")
            known = self._known_tables(out)
            return self._write(out, "delta", gens[-1][0] + 1, gens[-1][0], selection, optimizer_state,
                               [int(v) for v in last["versions"]], known, last.get("slot_map") or {})
        except Exception as e:
            if not fallback_base or not _is_gap(e):
                raise
            log.warning("export %s: no delta possible (%s): writing a new base", out, e)
            return self._write(out, "base", gens[-1][0] + 1, None, selection, optimizer_state, None, None)

    @staticmethod
    def _known_tables(out: pathlib.Path) -> set[str]:
        """Tables the chain holds after its last generation."""
        base = Chain(out).newest_base()
        assert base is not None
        names = {e["name"] for e in read_manifest(base[1])["tables"]}
        for _, _kind, path in Chain(out).after(base[0]):
            m = read_manifest(path)
            names |= {e["name"] for e in m["tables"]}
            names -= set(m.get("dropped", []))
        return names


def _with_empty(begun: list[Any], shards: list[int], n: int) -> list[Any]:
    """BEGIN replies by shard index, None for the shards not asked (they own nothing)."""
    out: list[Any] = [None] * n
    for s, reply in zip(shards, begun):
        out[s] = reply
    return out


def _cut_map(begun: list[Any]) -> Optional[dict[str, Any]]:
    """The slot map at the cut (the newest the shards reported), or None for a cluster that never moved a slot."""
    maps = [json.loads(r.slot_map) for r in begun if r is not None and r.slot_map]
    if not maps:
        return None
    newest = max(maps, key=lambda m: int(m["epoch"]))
    return newest if newest["epoch"] or newest.get("map_id") else None


def _map_key(m: Optional[dict[str, Any]]) -> tuple[int, str]:
    return (int(m["epoch"]), str(m.get("map_id", ""))) if m else (0, "")


def _empty_arrays(dim: int, spec: Spec, optimizer_state: bool, delta: bool) -> dict[str, np.ndarray]:
    out = {"ids": np.zeros(0, np.int64), "values": np.zeros((0, dim), np.float32)}
    if optimizer_state:
        out["steps"] = np.zeros(0, np.int64)
        out.update({"state." + n: np.zeros((0, dim), np.float32) for n in spec.optimizer.state_names()})
    if delta:
        out["tombstones"] = np.zeros(0, np.int64)
    return out


def _is_gap(e: BaseException) -> bool:
    """An ExportGap, raised here or by a shard (the client library maps it to its own class)."""
    return isinstance(e, ExportGap) or getattr(e, "kind", "") == "export_gap" or type(e).__name__ == "ExportGapError"


