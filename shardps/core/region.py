"""Shared memory between a client and a shard on one machine: a pull's answer is written by the shard straight
into a slot the client named, where the client reads it in place; a push that trails a pull is built by the client
in a slot, and the shard copies it out.

Over the Unix socket a 565 KB message crosses the sender's libzmq I/O thread, the kernel's copies out and in, and
the receiver's libzmq I/O thread; through a region the socket carries a few bytes naming the slot. An answer is
written once, by the shard. A push is built in its slot by the client (its rows gathered there, where they would
have been gathered into a libzmq message) and copied out by the shard before it reads a byte (the client could change
the slot under a check). Only a push that trails a pull (``read_your_writes=False``: it leaves after the next pull's
calls) is built there: the shard's copy is then made after it served that pull. A push that precedes the next pull
(read-your-writes, a new user's loop) stays in its message: there the shard's copy stood on the pull's path, where
libzmq's I/O threads had done that work beside it (measured: that loop ran 8-12% slower with its pushes in slots).

**The region.** On a connection over the data plane's Unix socket (the same machine and network namespace) whose
hello asks for one, the shard makes a region: a ``memfd`` (anonymous shared memory, gone with the last process that
maps it, nothing left behind a kill -9) of ``HEADER_BYTES``, ``slots`` request slots and ``slots`` answer slots of
``slot_bytes``, sealed against shrinking and growing (a client cannot make the shard's accesses fault), with a random
nonce in its header. The hello's answer names it: the shard's pid, the descriptor, the nonce and the sizes. The
client opens ``/proc/<pid>/fd/<fd>``: the kernel allows that only to a process that may read the shard's memory
anyway (its ptrace access check: the same user, not a container's other pid namespace), so a region gives no
process access it did not have; what such a process could write into a request slot it could send over the socket
(and read a same-user client's token from its files and environment), and the shard checks it as any request. The
client checks the nonce before it writes a byte (in another pid namespace the same pid names another process: its
file is not touched); anything that fails means no region, and messages go through the socket as before.

**Slots.** Only the client hands them out (the shard keeps no state but the mapping). A call goes as
``[request id, REQUEST(request slot, request bytes, answer slot), frame or b""]``: a call built in a request slot
names it and carries no frame (``NO_SLOT``: the frame is in the message), and a pull offers an answer slot
(``NO_SLOT``: none). The shard copies a request out of its slot before reading any of it, writes an answer that is
large and fits into the offered slot and answers ``[request id, b"", ANSWER(slot, bytes)]``; a small answer, one
that does not fit, or an error comes through the socket as before. A slot is freed when the last view of what it
holds goes: an answer's once the rows are assembled (the rows a pull returns are copies); a request's once its call
is over, answered (the shard copied it before answering) or failed with its connection (whose region is not
written again: a new connection has a new one).
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
SLOT_BYTES = 2 << 20  # the largest request or answer that goes through a slot (a pull of 8,192 rows of 64 float32)
SLOTS = 4  # request slots and answer slots of a region (calls in flight on one connection that use them)
MIN_SLOT_BYTES = 64 << 10  # smaller requests stay in their message, as smaller answers (``zmsg.MIN_BYTES``)
NO_SLOT = 0xFFFFFFFF
REQUEST = struct.Struct("<III")  # request slot, request bytes, answer slot
ANSWER = struct.Struct("<II")  # answer slot, answer bytes
ASK = b"region"  # the hello's last field when the client asks for a region
MEMFD_NAME = "shardps-region"
_OFFER = re.compile(rb"(\d{1,10}) (\d{1,10}) ([0-9a-f]{32}) (\d{1,10}) (\d{1,4})")


class RegionError(ValueError):
    """A request's region descriptor names what its connection does not have."""


def region_bytes(slot_bytes: int, slots: int) -> int:
    return HEADER_BYTES + 2 * slots * slot_bytes  # request slots, then answer slots


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

    def request(self, descriptor: Any, inline: Any) -> tuple[Any, int, Optional[memoryview]]:
        """The frame a request carries (copied out of its request slot, or ``inline``: its message's) and the answer
        slot it offers: its number and a writable view of it (NO_SLOT, None: none). RegionError when the descriptor
        is malformed or names anything outside the region."""
        if len(descriptor) != REQUEST.size:
            raise RegionError(f"a region descriptor is {REQUEST.size} bytes, got {len(descriptor)}")
        req, n, ans = REQUEST.unpack(descriptor)
        if req != NO_SLOT:
            if req >= self.slots:
                raise RegionError(f"request slot {req} of a region of {self.slots}")
            if n > self.slot_bytes:
                raise RegionError(f"a request of {n} bytes in a slot of {self.slot_bytes}")
            if len(inline):
                raise RegionError("a request both in its slot and in its message")
            start = HEADER_BYTES + req * self.slot_bytes
            frame: Any = bytes(self._view[start:start + n])  # a copy: the client could change the slot under a check
        elif n:
            raise RegionError("a request's length with no request slot")
        else:
            frame = inline
        target = None
        if ans != NO_SLOT:
            if ans >= self.slots:
                raise RegionError(f"answer slot {ans} of a region of {self.slots}")
            start = HEADER_BYTES + (self.slots + ans) * self.slot_bytes
            target = self._view[start:start + self.slot_bytes]
        self.attached()
        return frame, ans, target

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
        # Free slots, the one freed last first (its pages made and likely in cache: one call at a time keeps using
        # one slot, where taking them in turn made a new connection's first calls fault in 4 slots' pages on both
        # sides). A deque's appends and pops are atomic: any thread may free.
        self._requests: collections.deque[int] = collections.deque(range(slots))
        self._answers: collections.deque[int] = collections.deque(range(slots))

    def reserve(self, nbytes: int) -> Optional[memoryview]:
        """A writable view of ``nbytes`` of a free request slot to build a request in (None: it is too small or too
        large for one, or none is free). The slot is the view's until the last view of it goes."""
        if not MIN_SLOT_BYTES <= nbytes <= self.slot_bytes:
            return None
        try:
            req = self._requests.popleft()
        except IndexError:
            return None
        address = self._base + HEADER_BYTES + req * self.slot_bytes
        return memoryview(np.asarray(_Lease(self, self._requests, req, address, nbytes, False)))  # type: ignore

    def placed(self, request: Any) -> Optional[tuple[int, int]]:
        """(request slot, bytes) when ``request`` is a whole view ``reserve`` made in this region, else None."""
        if type(request) is not memoryview:
            return None
        lease = getattr(request.obj, "base", None)
        if type(lease) is not _Lease or lease.free is not self._requests or request.nbytes != lease.nbytes:
            return None
        return lease.slot, lease.nbytes

    def offer(self) -> Optional[int]:
        """A free answer slot for a pull, or None when all are held."""
        try:
            return self._answers.popleft()
        except IndexError:
            return None

    def release(self, ans: int) -> None:
        """Free an answer slot whose call was answered through the socket."""
        self._answers.appendleft(ans)

    def answer(self, ans: int, described: Any) -> memoryview:
        """The answer the shard wrote into slot ``ans`` (``described``: its ``ANSWER``), read in place: the slot is
        freed when the last view of it goes. ValueError when the description does not fit the call."""
        if len(described) != ANSWER.size:
            raise ValueError(f"an answer's description is {ANSWER.size} bytes, got {len(described)}")
        slot, n = ANSWER.unpack(described)
        if slot != ans or ans >= self.slots or n > self.slot_bytes:
            raise ValueError(f"an answer in slot {slot} of {n} bytes, for a call given slot {ans}")
        address = self._base + HEADER_BYTES + (self.slots + ans) * self.slot_bytes
        return memoryview(np.asarray(_Lease(self, self._answers, ans, address, n, True)))  # type: ignore[arg-type]


class _Lease:
    """A slot's bytes as numpy reads foreign memory: the array made from it keeps this (and the region's mapping)
    alive, and the slot goes back to ``free`` when it goes. A request slot's lease is its request's, built there and
    held by its call until the call is over: answered (the shard copied it before answering), or failed with its
    connection, whose region is never written again (a new connection has a new one)."""

    __slots__ = ("__array_interface__", "_region", "free", "slot", "nbytes")

    def __init__(self, region: ClientRegion, free: collections.deque, slot: int, address: int, nbytes: int,
                 readonly: bool) -> None:
        self._region, self.free, self.slot, self.nbytes = region, free, slot, nbytes
        self.__array_interface__ = {"version": 3, "shape": (nbytes,), "typestr": "|u1", "data": (address, readonly)}

    def __del__(self) -> None:
        self.free.appendleft(self.slot)


def open_offer(offer: bytes) -> Optional[ClientRegion]:
    """Map the region a hello's answer describes, or None (it cannot be opened from here, or it is not the shard's:
    nothing is written to a file whose nonce does not match)."""
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
        f = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(f).st_size != size:
            return None
        mm = mmap.mmap(f, size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(f)
    if mm[:NONCE_BYTES] != nonce:
        mm.close()
        return None
    return ClientRegion(mm, slot_bytes, slots)
