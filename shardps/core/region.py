"""Shared memory between a client and a shard on one machine: a pull's answer is written by the shard straight
into a slot the client named, where the client reads it in place.

Over the Unix socket a 565 KB answer crosses the shard's libzmq I/O thread, the kernel's copies out and in, and
the client's libzmq I/O thread; through a region it is written once by the shard, and the socket carries a few bytes
naming the slot. (Requests stay in their messages: a push copied into a slot by the calling thread and out by the
shard's serving thread, which must copy it before reading it since the client could change it under a check, put
both copies on the call's path where libzmq's I/O threads had done the work beside it: measured, a new user's
loop, whose pushes precede the next pull, ran 12% slower that way.)

**The region.** On a connection over the data plane's Unix socket (the same machine and network namespace) whose
hello asks for one, the shard makes a region: a ``memfd`` (anonymous shared memory, gone with the last process that
maps it, nothing left behind a kill -9) of ``HEADER_BYTES`` and ``slots`` answer slots of ``slot_bytes``, sealed
against shrinking and growing (a client cannot make the shard's writes fault), with a random nonce in its header.
The hello's answer names it: the shard's pid, the descriptor, the nonce and the sizes. The client opens
``/proc/<pid>/fd/<fd>``: the kernel allows that only to a process that may read the shard's memory anyway (its
ptrace access check: the same user, not a container's other pid namespace), so a region gives no process access it
did not have. The client checks the nonce before it uses the region (in another pid namespace the same pid names
another process); anything that fails means no region, and answers come through the socket as before. The shard
only writes into a region, never reads from it.

**Slots.** Only the client hands them out (the shard keeps no state but the mapping). A pull goes as
``[request id, REQUEST(answer slot), frame]``; the shard writes an answer that is large and fits into that slot and
answers ``[request id, b"", ANSWER(slot, bytes)]``; a small answer, one that does not fit, or an error comes through
the socket as before. The client frees a slot when the last view of the answer in it goes (the rows a pull returns
are copies, so that is once they are assembled; a view kept longer keeps its slot).
"""

from __future__ import annotations

import collections
import fcntl
import mmap
import os
import re
import struct
from typing import Any, Optional

import numpy as np

HEADER_BYTES = 4096  # the nonce, then nothing (the slots start page-aligned)
NONCE_BYTES = 16
SLOT_BYTES = 2 << 20  # the largest answer that goes through a slot (a pull of 8,192 rows of 64 float32)
SLOTS = 4  # answer slots of a region (pulls in flight on one connection that use them)
MIN_SLOT_BYTES = 64 << 10  # (smaller answers come in their message: ``zmsg.MIN_BYTES``)
NO_SLOT = 0xFFFFFFFF
REQUEST = struct.Struct("<I")  # the answer slot a call offers
ANSWER = struct.Struct("<II")  # answer slot, answer bytes
ASK = b"region"  # the hello's last field when the client asks for a region
MEMFD_NAME = "shardps-region"
_OFFER = re.compile(rb"(\d{1,10}) (\d{1,10}) ([0-9a-f]{32}) (\d{1,10}) (\d{1,4})")


class RegionError(ValueError):
    """A request's region descriptor names what its connection does not have."""


def region_bytes(slot_bytes: int, slots: int) -> int:
    return HEADER_BYTES + slots * slot_bytes


class ShardRegion:
    """A connection's region, on the shard's side (see the module docstring)."""

    def __init__(self, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS) -> None:
        self.slot_bytes, self.slots = slot_bytes, slots
        size = region_bytes(slot_bytes, slots)
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd: Optional[int] = fd  # open until the client attached (its first request naming the region)
        self.nonce = os.urandom(NONCE_BYTES)
        mm[:NONCE_BYTES] = self.nonce
        self._view = memoryview(mm)

    def offer(self) -> bytes:
        """The hello answer's description of the region: "<pid> <fd> <nonce hex> <slot bytes> <slots>"."""
        assert self._fd is not None
        return b"%d %d %s %d %d" % (os.getpid(), self._fd, self.nonce.hex().encode(), self.slot_bytes, self.slots)

    def attached(self) -> None:
        """The client opened the region (it named it in a request): the shard's descriptor is not needed."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def request(self, descriptor: Any) -> tuple[int, memoryview]:
        """The answer slot a request offers (its ``REQUEST``): its number and a writable view of it; RegionError when
        the descriptor is malformed or names a slot outside the region."""
        if len(descriptor) != REQUEST.size:
            raise RegionError(f"a region descriptor is {REQUEST.size} bytes, got {len(descriptor)}")
        (ans,) = REQUEST.unpack(descriptor)
        if ans >= self.slots:
            raise RegionError(f"answer slot {ans} of a region of {self.slots}")
        start = HEADER_BYTES + ans * self.slot_bytes
        self.attached()
        return ans, self._view[start:start + self.slot_bytes]

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


class ClientRegion:
    """A connection's region, on the client's side: the slots it hands out (see the module docstring)."""

    def __init__(self, mm: mmap.mmap, slot_bytes: int, slots: int) -> None:
        self._pin = np.frombuffer(mm, np.uint8)  # (holds the mapping: it is never closed under a view)
        self._base = self._pin.ctypes.data
        self.slot_bytes, self.slots = slot_bytes, slots
        self._answers: collections.deque[int] = collections.deque(range(slots))  # free slots (appends and pops
        # are atomic: any thread may free one, when the last view of an answer goes)

    def offer(self) -> Optional[tuple[bytes, int]]:
        """A free answer slot for a pull: (its ``REQUEST``, its number), or None when all are held."""
        try:
            ans = self._answers.popleft()
        except IndexError:
            return None
        return REQUEST.pack(ans), ans

    def release(self, ans: int) -> None:
        """Free an answer slot whose call was answered through the socket."""
        self._answers.append(ans)

    def answer(self, ans: int, described: Any) -> memoryview:
        """The answer the shard wrote into slot ``ans`` (``described``: its ``ANSWER``), read in place: the slot is
        freed when the last view of it goes. ValueError when the description does not fit the call."""
        if len(described) != ANSWER.size:
            raise ValueError(f"an answer's description is {ANSWER.size} bytes, got {len(described)}")
        slot, n = ANSWER.unpack(described)
        if slot != ans or n > self.slot_bytes:
            raise ValueError(f"an answer in slot {slot} of {n} bytes, for a call given slot {ans}")
        address = self._base + HEADER_BYTES + ans * self.slot_bytes
        return memoryview(np.asarray(_Lease(self, ans, address, n)))  # type: ignore[arg-type]


class _Lease:
    """An answer slot's bytes as numpy reads foreign memory: the array made from it keeps this (and the region's
    mapping) alive, and the slot is freed when it goes."""

    __slots__ = ("__array_interface__", "_region", "_slot")

    def __init__(self, region: ClientRegion, slot: int, address: int, n: int) -> None:
        self._region, self._slot = region, slot
        self.__array_interface__ = {"version": 3, "shape": (n,), "typestr": "|u1", "data": (address, True)}

    def __del__(self) -> None:
        self._region._answers.append(self._slot)


def open_offer(offer: bytes) -> Optional[ClientRegion]:
    """Map the region a hello's answer describes, or None (it cannot be opened from here, or it is not the shard's:
    a file whose nonce does not match is never used)."""
    m = _OFFER.fullmatch(offer)
    if m is None:
        return None
    pid, fd, nonce, slot_bytes, slots = int(m[1]), int(m[2]), bytes.fromhex(m[3].decode()), int(m[4]), int(m[5])
    if not (0 < slots <= 64 and MIN_SLOT_BYTES <= slot_bytes <= 1 << 30):
        return None
    size = region_bytes(slot_bytes, slots)
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME}"):
            return None  # (not opened at all: opening some files has effects)
        f = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(f).st_size != size:
            return None
        mm = mmap.mmap(f, size, access=mmap.ACCESS_READ)  # (read only: the client never writes a region)
    except (OSError, ValueError):
        return None
    finally:
        os.close(f)
    if mm[:NONCE_BYTES] != nonce:
        mm.close()
        return None
    return ClientRegion(mm, slot_bytes, slots)
