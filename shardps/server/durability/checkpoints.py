"""Atomic, checksummed checkpoint files.

Layout of one file::

    b"SHARDPS2" | u64 header length | header (JSON) | array bytes ... | CRC-32C of all before (u32, little-endian)

Files written before the CRC-32C end in a SHA-256 of all before instead, after ``b"SHARDPS1"``; they are still
read. The CRC-32C runs at about 8 GB/s here against SHA-256's 0.9 (with the CPU's SHA instructions): checksumming a
checkpoint took as long as copying the table for it. It guards against damage (truncation, torn or flipped bits),
as the segment files' and the log's do, not against an adversary (the data directory is the shard's own).
The header lists every array (name, dtype, shape, offset). A file is written
under a temporary name, fsynced, renamed into place and the directory fsynced,
so a crash leaves either the old or the new checkpoint, never half of one; a
truncated or corrupted file fails its checksum on load and is skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Any, Iterator, Union

import google_crc32c
import numpy as np

from shardps.core.files import ChecksummedWriter, fsync_dir
from shardps.core.specs import DenseSpec, TableSpec, spec_from_b64, spec_to_b64

log = logging.getLogger(__name__)

MAGIC = b"SHARDPS2"  # the checksum is a CRC-32C
SHA256_MAGIC = b"SHARDPS1"  # written before: the checksum a SHA-256 (read, never written)
_TRAILER = {MAGIC: 4, SHA256_MAGIC: 32}  # the checksum's bytes by format
SUFFIX = ".ckpt"
_ALIGN = 64


class CorruptCheckpoint(Exception):
    """A checkpoint file failed its checksum or could not be parsed."""


@dataclass
class Loaded:
    """A checkpoint read back: its metadata, arrays and file."""

    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    path: pathlib.Path


def spec_entry(spec: Union[TableSpec, DenseSpec]) -> dict[str, Any]:
    """A table's entry in a checkpoint header: name, kind and spec (its protobuf form, base64)."""
    return {"name": spec.name, "dense": isinstance(spec, DenseSpec), "spec": spec_to_b64(spec)}


def spec_of(entry: dict[str, Any]) -> Union[TableSpec, DenseSpec]:
    """The spec of a checkpoint header's table entry."""
    return spec_from_b64(entry["spec"], entry["dense"])


def write(path: pathlib.Path, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> int:
    """Write a checkpoint atomically to ``path``; returns its size in bytes."""
    entries = []
    offset = 0
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        entries.append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset})
        offset += -(-arr.nbytes // _ALIGN) * _ALIGN
    header = json.dumps({"meta": meta, "arrays": entries}).encode()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        w = ChecksummedWriter(f)
        w.write(MAGIC)
        w.write(struct.pack("<Q", len(header)))
        w.write(header)
        w.write(b"\0" * (-w.pos % _ALIGN))
        for arr in arrays.values():
            w.write(arr)
            w.write(b"\0" * (-arr.nbytes % _ALIGN))
        f.write(struct.pack("<I", w.crc))
        f.flush()
        os.fsync(f.fileno())
        size = w.pos + 4
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return size


def read(path: pathlib.Path) -> Loaded:
    """Read and verify a checkpoint; raises CorruptCheckpoint on any damage."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < len(MAGIC) + 8 + 4:
            raise CorruptCheckpoint(f"{path}: truncated ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            trailer = _TRAILER.get(mm[: len(MAGIC)])
            if trailer is None:
                raise CorruptCheckpoint(f"{path}: not a shardps checkpoint (or its first bytes are damaged)")
            if size < len(MAGIC) + 8 + trailer:
                raise CorruptCheckpoint(f"{path}: truncated ({size} bytes)")
            body = memoryview(mm)[: size - trailer]
            try:
                if trailer == 4:
                    ok = google_crc32c.value(np.frombuffer(body, np.uint8)) == struct.unpack("<I", mm[size - 4 :])[0]
                else:
                    ok = hashlib.sha256(body).digest() == mm[size - 32 :]
                if not ok:
                    raise CorruptCheckpoint(f"{path}: checksum mismatch (truncated or corrupted)")
                (hlen,) = struct.unpack("<Q", body[8:16])
                header = json.loads(bytes(body[16 : 16 + hlen]))
                base = 16 + hlen + (-(16 + hlen) % _ALIGN)
                arrays = {}
                for e in header["arrays"]:
                    dt = np.dtype(e["dtype"])
                    count = int(np.prod(e["shape"], dtype=np.int64))
                    start = base + e["offset"]
                    arr = np.frombuffer(body[start : start + count * dt.itemsize], dtype=dt).reshape(e["shape"])
                    arrays[e["name"]] = arr.copy()
                    del arr
            finally:
                body.release()
    return Loaded(meta=header["meta"], arrays=arrays, path=path)


def list_checkpoints(data_dir: pathlib.Path) -> list[pathlib.Path]:
    """Checkpoint files in ``data_dir``, newest first (by the sequence number in the name)."""
    files = [p for p in data_dir.glob("ckpt-*" + SUFFIX)]
    return sorted(files, key=lambda p: p.name, reverse=True)


def load_newest(data_dir: pathlib.Path) -> Iterator[Loaded]:
    """Yield valid checkpoints newest first, logging and skipping corrupt ones."""
    for path in list_checkpoints(data_dir):
        try:
            yield read(path)
        except (CorruptCheckpoint, ValueError, KeyError, OSError) as e:
            log.error("skipping corrupt checkpoint %s: %s", path, e)


def file_name(seqno: int, checkpoint_id: str) -> str:
    return f"ckpt-{seqno:012d}-{checkpoint_id}{SUFFIX}"


def prune(data_dir: pathlib.Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints (and stale temporary files)."""
    for old in list_checkpoints(data_dir)[keep:]:
        old.unlink(missing_ok=True)
    for tmp in data_dir.glob("*.tmp"):
        tmp.unlink(missing_ok=True)
