"""Whole copies for a replica group's backup too far behind its primary, or whose log diverged: the primary takes a
checkpoint and sends it file by file (``send``: the checkpoint file, and its disk tier's checkpoint); the backup
gathers them (``IncomingCopy``) and installs them as its state and its newest checkpoint (``install``).

Both ends work in a directory of the system's temporary directory named with their pid
(``shardps-copy-{out,in}-<pid>-*``), gone when the copy ends; one that a member killed mid-copy left behind is removed
by the next member started on the machine (``sweep``), once no process has its pid (or it bears that member's own pid,
as a container's processes often get, and is not one of its copies in progress)."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
import tempfile
from typing import Generator, Iterator

from shardps.core.errors import InvalidArgument
from shardps.server.durability import checkpoints
from shardps.server.durability.replication import ReplicatedLog
from shardps.server.replica.frames import Frame
from shardps.server.shard.facade import Shard
from shardps.server.shard.recovery import load_state

log = logging.getLogger(__name__)

SCRATCH = re.compile(r"shardps-copy-(?:in|out)-(\d+)-")
_MINE: set[str] = set()  # this process's copies' directories in use (a leftover may bear our pid: a container's)


def scratch(kind: str) -> str:
    """A new directory for one copy's files (``kind``: out, the primary's; in, the backup's), named with our pid."""
    path = tempfile.mkdtemp(prefix=f"shardps-copy-{kind}-{os.getpid()}-")
    _MINE.add(os.path.basename(path))
    return path


def scratch_done(path: str) -> None:
    """A copy's directory, removed (at its end)."""
    _MINE.discard(os.path.basename(path))
    shutil.rmtree(path, ignore_errors=True)


def sweep(root: str = "") -> list[str]:
    """Remove the copies' directories that processes gone (killed mid-copy) left in ``root`` (the system's temporary
    directory); those of other live pids, and our own copies in progress, stay. Returns the paths removed."""
    gone: list[str] = []
    try:
        entries = list(pathlib.Path(root or tempfile.gettempdir()).iterdir())
    except OSError as e:
        log.warning("the temporary directory could not be swept of whole copies' files: %s", e)
        return gone
    for entry in entries:
        m = SCRATCH.match(entry.name)
        if m is None or not entry.is_dir() or entry.is_symlink():
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            if entry.name in _MINE:
                continue  # a copy of ours, in progress
        else:
            try:
                os.kill(pid, 0)
                continue  # a live process has that pid (its own copy, or another process's: left)
            except ProcessLookupError:
                pass
            except (PermissionError, OverflowError):
                continue
        shutil.rmtree(entry, ignore_errors=True)
        gone.append(str(entry))
    if gone:
        log.info("removed %d whole copies' directories left by processes gone: %s", len(gone), ", ".join(gone))
    return gone

CHUNK = 1 << 20  # bytes of a whole copy per frame


def install(shard: Shard, log_: ReplicatedLog, member: str, copy: IncomingCopy, lsn: int,
            history: list[tuple[int, int]]) -> None:
    """A whole copy of the primary as this member's state: loaded, its epochs taken, and kept as this member's
    newest checkpoint, with every older checkpoint and log record removed (they held another history)."""
    loaded = checkpoints.read(copy.path("checkpoint"))
    meta = loaded.meta
    if int(meta.get("lsn", -1)) != lsn or (meta["shard_index"], meta["num_shards"]) != \
            (shard.index, shard.num_shards):
        raise InvalidArgument(f"a whole copy for another place: {meta['shard_index']} of {meta['num_shards']} at "
                              f"record {meta.get('lsn')}, expected {shard.index} of {shard.num_shards} "
                              f"at {lsn}")
    tier = meta.get("disk_tier")
    tiers = shard.registry.tiers
    if tier:
        if tiers is None:
            raise InvalidArgument("the primary's copy has a disk tier, but this member has no --disk-dir")
        tiers.checkpoint_root.mkdir(parents=True, exist_ok=True)
        dst = tiers.checkpoint_root / tier
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(copy.path("tier"), dst)
    load_state(shard, meta, loaded.arrays)
    log_.restored(lsn, history)
    if shard.data_dir is not None and log_.mode != "none":
        shard.checkpointer.rebase("replica-copy")
    log.info("shard %d member %s: installed a whole copy of the primary at record %d", shard.index,
             member, lsn)


def send(shard: Shard, log_: ReplicatedLog, epoch: int, sent: list[int]) -> Generator[Frame, None, int]:
    """A whole copy: a checkpoint taken now, sent file by file; its LSN (records follow from there; ``sent`` holds the
    LSN the backup may acknowledge)."""
    meta, arrays, _ = shard.snapshot()
    tmp = scratch("out")
    try:
        path = pathlib.Path(tmp) / "checkpoint"
        checkpoints.write(path, meta, arrays)
        del arrays
        files = [("checkpoint", path)]
        tiers = shard.registry.tiers
        if meta.get("disk_tier") and tiers is not None:
            tier_dir = tiers.checkpoint_root / meta["disk_tier"]
            files += [(f"tier/{f.name}", f) for f in sorted(tier_dir.iterdir())]
        try:
            for name, f in files:
                yield from pieces(epoch, name, f)
        finally:
            if meta.get("disk_tier") and tiers is not None:
                tiers.remove_checkpoint(meta["disk_tier"])
    finally:
        scratch_done(tmp)
    history = log_.history
    sent[0] = int(meta["lsn"])  # acknowledged once the backup installed it
    yield Frame(epoch, copied=int(meta["lsn"]), history=[(e, s) for e, s in history])
    return int(meta["lsn"])


def pieces(epoch: int, name: str, path: pathlib.Path) -> Iterator[Frame]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        offset = 0
        while True:
            data = f.read(CHUNK)
            last = offset + len(data) >= size
            yield Frame(epoch, file=(name, offset, data, last))
            offset += len(data)
            if last:
                return


class IncomingCopy:
    """The files of a whole copy as they arrive, in a temporary directory."""

    def __init__(self) -> None:
        self.dir = pathlib.Path(scratch("in"))

    def path(self, name: str) -> pathlib.Path:
        return self.dir / name

    def add(self, name: str, offset: int, data: bytes, last: bool) -> None:
        if name != "checkpoint" and not (name.startswith("tier/") and "/" not in name[5:] and name[5:] not in
                                         ("", ".", "..")):
            raise InvalidArgument(f"a whole copy's file {name!r} is not one a copy holds")
        path = self.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if offset else "wb") as f:
            if f.seek(0, 2) != offset:
                raise InvalidArgument(f"a whole copy's file {name!r} arrived out of order (at byte {offset})")
            f.write(data)

    def close(self) -> None:
        scratch_done(str(self.dir))
