"""Large data-plane messages built straight into libzmq's own message memory, and sent from it without a copy.

A pull's answer or a push of a few thousand rows is about half a megabyte. Built as a Python buffer, it was copied
once more into libzmq's message at each send (pyzmq copies: its zero-copy sends release the Python buffer through
pyzmq's garbage-collector thread, a Python thread woken per message that takes the interpreter lock from the one
serving calls). Here the message is made with ``zmq_msg_init_size`` (libzmq's allocation) and written in place: a
push's rows are gathered straight into it, a pull's answer copied into it once. A send hands libzmq a reference to
it (``zmq_msg_copy`` shares the content, counted), so the message stays ours to send again (a call resent on a new
connection) until its last reference goes; libzmq frees it with no Python involved.

libzmq's C functions are called through ``ctypes`` on the library pyzmq itself loaded (found in the process's
mappings: the same instance, so pyzmq's sockets are its sockets). Where that library cannot be found (another
platform, a pyzmq linked statically), ``outgoing`` returns None and messages are Python buffers copied at each send,
as before.

``Outgoing.view`` is the only way to the bytes: a writable byte view that keeps the message alive (the numpy array
under it holds a reference to its ``Outgoing``), so no view outlives the memory it shows.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from typing import Any, Optional

import numpy as np

MIN_BYTES = 64 << 10  # smaller messages: a Python buffer, copied at the send (cheaper than the calls here)


class _Msg(ctypes.Structure):
    """``zmq_msg_t``: 64 opaque bytes, pointer-aligned."""

    _fields_ = [("_", ctypes.c_void_p * 8)]


_lib: Optional[Any] = None
_tried = False
_load_lock = threading.Lock()


def _find_libzmq() -> Optional[str]:
    """The path of the libzmq pyzmq loaded (Linux: from /proc/self/maps), or None."""
    import zmq  # noqa: F401 - loads libzmq

    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "libzmq" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def _load() -> Optional[Any]:
    global _lib, _tried
    if _tried:
        return _lib
    with _load_lock:
        if _tried:
            return _lib
        lib = None
        if os.environ.get("SHARDPS_ZMQ_IN_PLACE", "1") != "0":
            path = _find_libzmq()
            if path is not None:
                try:
                    lib = ctypes.CDLL(path)
                    msg_p = ctypes.POINTER(_Msg)
                    for name, args, res in (
                        ("zmq_msg_init", [msg_p], ctypes.c_int),
                        ("zmq_msg_init_size", [msg_p, ctypes.c_size_t], ctypes.c_int),
                        ("zmq_msg_data", [msg_p], ctypes.c_void_p),
                        ("zmq_msg_copy", [msg_p, msg_p], ctypes.c_int),
                        ("zmq_msg_send", [msg_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int),
                        ("zmq_msg_close", [msg_p], ctypes.c_int),
                        ("zmq_errno", [], ctypes.c_int),
                    ):
                        fn = getattr(lib, name)
                        fn.argtypes, fn.restype = args, res
                except (OSError, AttributeError):
                    lib = None
        _lib = lib
        _tried = True
    return _lib


def available() -> bool:
    """Whether messages can be built in libzmq's memory here."""
    return _load() is not None


class Outgoing:
    """A libzmq message of ``nbytes``, ours until the last view and reference go (``outgoing``)."""

    __slots__ = ("_msg", "_ref", "nbytes", "__weakref__")

    def __init__(self, lib: Any, nbytes: int) -> None:
        self._msg = _Msg()
        self._ref = ctypes.byref(self._msg)
        self.nbytes = -1  # (not made: nothing to close)
        if lib.zmq_msg_init_size(self._ref, nbytes) != 0:
            raise MemoryError(f"libzmq could not allocate a message of {nbytes} bytes")
        self.nbytes = nbytes

    def view(self) -> memoryview:
        """The message's bytes, writable (format "B"); the view keeps the message alive."""
        assert _lib is not None
        return memoryview(np.asarray(_Exported(self, _lib.zmq_msg_data(self._ref))))  # type: ignore[arg-type]

    def send(self, handle: int, flags: int) -> None:
        """Send (a reference to) the message on the libzmq socket ``handle`` (``zmq.Socket.underlying``); raises
        as pyzmq does (``zmq.Again`` when it would block with NOBLOCK). The message stays ours."""
        import zmq

        lib = _lib
        assert lib is not None
        out = _Msg()
        ref = ctypes.byref(out)
        lib.zmq_msg_init(ref)
        if lib.zmq_msg_copy(ref, self._ref) != 0:
            code = lib.zmq_errno()
            lib.zmq_msg_close(ref)
            raise zmq.ZMQError(code)
        while lib.zmq_msg_send(ref, handle, flags) < 0:
            code = lib.zmq_errno()
            if code == errno.EINTR:
                continue
            lib.zmq_msg_close(ref)
            if code == errno.EAGAIN:
                raise zmq.Again(code)
            raise zmq.ZMQError(code)

    def __del__(self) -> None:
        lib = _lib
        if lib is not None and self.nbytes >= 0:
            lib.zmq_msg_close(self._ref)


class _Exported:
    """An ``Outgoing``'s bytes as numpy reads foreign memory (the array interface): the array made from it keeps
    this, and so the message, alive. (Not a ctypes array type per size: ctypes keeps every such type for good.)"""

    __slots__ = ("__array_interface__", "outgoing")

    def __init__(self, outgoing: Outgoing, address: int) -> None:
        self.outgoing = outgoing
        self.__array_interface__ = {"version": 3, "shape": (outgoing.nbytes,), "typestr": "|u1",
                                    "data": (address, False)}


def outgoing(nbytes: int, reply: bool = False) -> Optional[memoryview]:
    """A writable byte view of a new libzmq message of ``nbytes`` (sent without a copy by ``send_multipart``), or
    None where such messages cannot be made (and for messages under ``MIN_BYTES``). ``reply``: a shard's whole
    answer, which goes into the shared-memory slot its call offered when there is one and it fits (``answer_into``)."""
    if nbytes < MIN_BYTES:
        return None
    if reply:
        target = getattr(_THREAD, "target", None)
        if target is not None and nbytes <= target.nbytes:
            _THREAD.target, _THREAD.handed = None, target[:nbytes]
            return _THREAD.handed
    lib = _load()
    if lib is None:
        return None
    return Outgoing(lib, nbytes).view()


def owner(buf: Any) -> Optional[Outgoing]:
    """The ``Outgoing`` whose whole message ``buf`` is (a view ``outgoing`` returned), else None."""
    if type(buf) is not memoryview:
        return None
    base = getattr(buf.obj, "base", None)
    if type(base) is not _Exported or buf.nbytes != base.outgoing.nbytes or not buf.contiguous:
        return None
    return base.outgoing


def answering_here() -> bool:
    """Whether large replies encoded on this thread go into libzmq messages (a shard's data-plane thread, after
    ``answer_in_place``)."""
    return getattr(_THREAD, "answering", False)


def answer_in_place() -> None:
    """Encode this thread's large replies (``wire.encode_pull_response`` and ``encode_repeated`` of a whole
    StreamResponse) into libzmq messages from now on: a shard's data-plane threads, which send them without a copy.
    A gRPC thread's replies must stay bytes."""
    _THREAD.answering = True


def answer_into(target: Optional[memoryview]) -> None:
    """The call this thread serves next may write its answer into ``target`` (a shared-memory slot the client
    offered, ``shardps.core.region``), if it is large and fits; ``taken`` tells whether it did."""
    _THREAD.target, _THREAD.handed = target, None


def taken() -> Optional[memoryview]:
    """The view of the slot ``answer_into`` offered that the answer was built in (None: it was not); the offer ends."""
    handed = getattr(_THREAD, "handed", None)
    _THREAD.target = _THREAD.handed = None
    return handed


_THREAD = threading.local()


def send_multipart(sock: Any, parts: list, flags: int = 0) -> None:
    """``sock.send_multipart(parts, flags)`` (copying), the last part sent from its libzmq message without a copy
    when it is one (``outgoing``)."""
    import zmq

    last = owner(parts[-1])
    if last is None:
        sock.send_multipart(parts, flags, copy=True)
        return
    for part in parts[:-1]:
        sock.send(part, flags | zmq.SNDMORE, copy=True)
    last.send(sock.underlying, flags)
