"""Shared memory between a client and a shard on one machine: the large parts of data-plane calls (a push's
rows, a pull's answer) pass through it instead of through the Unix socket.

Over the socket a 565 KB push crosses libzmq's I/O thread in the client, the kernel's copies in and out, and
libzmq's I/O thread in the shard; through a region it is one copy into shared memory by the client and one copy
out by the shard, and the socket carries a message of a few bytes naming the slot. A pull's answer is written by
the shard straight into a slot the client named, where the client reads it in place.

**The region.** On a connection over the data plane's Unix socket (the same machine and network namespace) whose
hello asks for one, the shard makes a region: a ``memfd`` (anonymous shared memory, gone with the last process that
maps it, nothing left behind a kill -9) of ``HEADER_BYTES`` and ``slots`` request slots and ``slots`` answer slots of
``slot_bytes``, sealed against shrinking and growing (a client cannot make the shard's accesses fault), with a random
nonce in its header. The hello's answer names it: the shard's pid, the descriptor, the nonce and the sizes. The
client opens ``/proc/<pid>/fd/<fd>``: the kernel allows that only to a process that may read the shard's memory
anyway (its ptrace access check: the same user, not a container's other pid namespace), so a region gives no
process access it did not have. The client then checks the nonce before it writes a byte (in another pid
namespace the same pid names another process: its file is not touched); anything that fails means no region, and
the connection's messages go through the socket as before.

**Who writes where.** Only the client allocates slots (one call at a time each; the shard keeps no state but the
mapping). A request ``[request id, frame or b"", REQUEST(request slot, bytes, answer slot)]`` names the request's
slot (its frame is there, not in the message) and/or an answer slot the answer may be written into; ``NO_SLOT``
for none. The shard copies a request out of its slot before reading any of it (the client could change it under a
check), and writes an answer that fits into the answer slot, answering ``[request id, b"", ANSWER(slot, bytes)]``;
an answer that does not fit (or an error) goes through the socket as before. The client frees a request slot when
its answer comes (the shard has copied it by then), and an answer slot when the last view of the answer goes (the
rows a pull returns are copies, so that is once they are assembled; a view kept longer keeps its slot).
"""

from __future__ import annotations

import collections
import ctypes
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
MIN_BYTES = 64 << 10  # smaller requests stay in their message (a copy into a slot costs more than it saves)
NO_SLOT = 0xFFFFFFFF
REQUEST = struct.Struct("<III")  # request slot, request bytes, answer slot
ANSWER = struct.Struct("<II")  # answer slot, answer bytes
ASK = b"region"  # the hello's last field when the client asks for a region
MEMFD_NAME = "shardps-region"
_OFFER = re.compile(rb"(\d{1,10}) (\d{1,10}) ([0-9a-f]{32}) (\d{1,10}) (\d{1,4})")


class RegionError(ValueError):
    """A request's region descriptor names what its connection does not have."""


def region_bytes(slot_bytes: int, slots: int) -> int:
    return HEADER_BYTES + 2 * slots * slot_bytes


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
        """The frame a request carries (copied out of its slot, or ``inline``), and the answer slot it offers: its
        number and a writable view of it (None: none); RegionError when the descriptor names anything outside the
        region."""
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
        self._mm = mm
        self._pin = ctypes.c_char.from_buffer(mm)  # (holds the mapping: it is never closed under a view)
        self._base = ctypes.addressof(self._pin)
        self.slot_bytes, self.slots = slot_bytes, slots
        self._requests: collections.deque[int] = collections.deque(range(slots))  # free slots (appends and pops:
        self._answers: collections.deque[int] = collections.deque(range(slots))  # atomic, any thread may free)

    def place(self, request: Any, answer: bool) -> Optional[tuple[Any, bytes, int, int]]:
        """Put a call in slots: ``request`` (its frame) when it is large and fits, and an answer slot when ``answer``
        (a pull: its answer may be large). (the frame to send, or b"" when it is in its slot; the ``REQUEST``
        descriptor; the request slot; the answer slot), or None when no slot was taken (the call goes as before)."""
        req = ans = NO_SLOT
        n = len(request)
        if MIN_BYTES <= n <= self.slot_bytes:
            try:
                req = self._requests.popleft()
            except IndexError:
                pass
            else:
                start = HEADER_BYTES + req * self.slot_bytes
                self._mm[start:start + n] = request
        if answer:
            try:
                ans = self._answers.popleft()
            except IndexError:
                pass
        if req == NO_SLOT and ans == NO_SLOT:
            return None
        if req == NO_SLOT:
            return request, REQUEST.pack(NO_SLOT, 0, ans), req, ans
        return b"", REQUEST.pack(req, n, ans), req, ans

    def release(self, req: int, ans: int) -> None:
        """Free a call's slots (its answer came through the socket, or the answer slot is a ``view``'s now)."""
        if req != NO_SLOT:
            self._requests.append(req)
        if ans != NO_SLOT:
            self._answers.append(ans)

    def answer(self, ans: int, described: Any) -> memoryview:
        """The answer the shard wrote into slot ``ans`` (``described``: its ``ANSWER``), read in place: the slot is
        freed when the last view of it goes. ValueError when the description does not fit the call."""
        if len(described) != ANSWER.size:
            raise ValueError(f"an answer's description is {ANSWER.size} bytes, got {len(described)}")
        slot, n = ANSWER.unpack(described)
        if slot != ans or n > self.slot_bytes:
            raise ValueError(f"an answer in slot {slot} of {n} bytes, for a call given slot {ans}")
        address = self._base + HEADER_BYTES + (self.slots + ans) * self.slot_bytes
        return memoryview(np.asarray(_Lease(self, ans, address, n)))


class _Lease:
    """An answer slot's bytes as numpy reads foreign memory: the array made from it keeps this (and the region's
    mapping) alive, and the slot is freed when it goes."""

    __slots__ = ("__array_interface__", "_region", "_slot")

    def __init__(self, region: ClientRegion, slot: int, address: int, n: int) -> None:
        self._region, self._slot = region, slot
        self.__array_interface__ = {"version": 3, "shape": (n,), "typestr": "|u1", "data": (address, False)}

    def __del__(self) -> None:
        self._region._answers.append(self._slot)


def open_offer(offer: bytes) -> Optional[ClientRegion]:
    """Map the region a hello's answer describes, or None (it cannot be opened from here, or it is not the shard's:
    nothing is written to a file whose nonce does not match)."""
    m = _OFFER.fullmatch(offer)
    if m is None:
        return None
    pid, fd, nonce, slot_bytes, slots = int(m[1]), int(m[2]), bytes.fromhex(m[3].decode()), int(m[4]), int(m[5])
    if not (0 < slots <= 64 and MIN_BYTES <= slot_bytes <= 1 << 30):
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
