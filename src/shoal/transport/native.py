"""ZeroMQ sockets that compiled code reads and writes itself.

A round trip through pyzmq costs the interpreter more than libzmq and the kernel
together (``benchmarks/results/lean_request.md``: the same checked 1-key pull
with each side in one compiled function ran 1.4x as fast as raw pyzmq's). These
sockets are pyzmq's, opened in the transport's context; numba calls the libzmq
pyzmq loaded, by symbol name (so the compiled code is cached: bound through
``ctypes`` it was compiled again in every process), on the socket's handle.

``send``, ``recv``, ``more`` and ``drain`` are kernels (``storage.jit``) for other
kernels, beside libzmq's own functions (``zmq_msg_*``: a message whose memory
compiled code fills, sent without a copy); ``ptr`` turns an address (a handle, an
array's ``ctypes.data``) into a C pointer; ``c_function`` declares a C function for
kernels. Nothing here imports numba before the first kernel call.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from shoal.api.errors import ConfigError
from shoal.storage.jit import kernel, native

SNDMORE = 2
DONTWAIT = 1
_RCVMORE = 13
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # (pyzmq's enums cost an object per use)


def _libzmq_path() -> str:
    """The libzmq pyzmq loaded: its wheel's copy, else the system's."""
    here = os.path.dirname(zmq.__file__)
    found = sorted(glob.glob(os.path.join(here, "..", "pyzmq.libs", "libzmq*.so*")))
    return found[0] if found else ctypes.util.find_library("zmq") or "libzmq.so.5"


def c_function(name: str, signature: Callable[[Any], Any], library: str | None = None) -> Any:
    """C function ``name`` for compiled code, declared by its symbol (numba caches code that calls
    it so; through ``ctypes`` every process compiled it again, seconds before its first request).
    ``signature`` makes its type from numba's types module; ``library`` is loaded first."""
    import llvmlite.binding as llvm
    from numba.core import types

    if library is not None:
        llvm.load_library_permanently(library)
    return types.ExternalFunction(name, signature(types))


def _pointer_intrinsic() -> Any:
    from llvmlite import ir
    from numba.core import types
    from numba.core.extending import intrinsic

    def as_pointer(typingctx: Any, address: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

        return types.voidptr(types.intp), codegen

    return intrinsic(as_pointer)


# Stand-ins for compiled code (``storage.jit.native``): Python never calls them.

@native(_pointer_intrinsic)
def ptr(address: int) -> int:
    """An address (a socket's handle, an array's ``ctypes.data``) as a C pointer."""
    raise NotImplementedError("compiled code only")


@native(lambda: c_function("zmq_send", lambda t: t.intc(t.voidptr, t.voidptr, t.size_t, t.intc), _libzmq_path()))
def zmq_send(socket: int, data: int, size: int, flags: int) -> int:
    raise NotImplementedError("compiled code only")


@native(lambda: c_function("zmq_recv", lambda t: t.intc(t.voidptr, t.voidptr, t.size_t, t.intc), _libzmq_path()))
def zmq_recv(socket: int, data: int, size: int, flags: int) -> int:
    raise NotImplementedError("compiled code only")


@native(lambda: c_function("zmq_getsockopt", lambda t: t.intc(t.voidptr, t.intc, t.voidptr, t.voidptr), _libzmq_path()))
def zmq_getsockopt(socket: int, option: int, value: int, size: int) -> int:
    raise NotImplementedError("compiled code only")


@native(lambda: c_function("zmq_msg_init_size", lambda t: t.intc(t.voidptr, t.size_t), _libzmq_path()))
def zmq_msg_init_size(msg: int, size: int) -> int:
    raise NotImplementedError("compiled code only")


# (its pointer taken as an address, to count bytes from)
@native(lambda: c_function("zmq_msg_data", lambda t: t.intp(t.voidptr), _libzmq_path()))
def zmq_msg_data(msg: int) -> int:
    raise NotImplementedError("compiled code only")


@native(lambda: c_function("zmq_msg_send", lambda t: t.intc(t.voidptr, t.voidptr, t.intc), _libzmq_path()))
def zmq_msg_send(msg: int, socket: int, flags: int) -> int:
    raise NotImplementedError("compiled code only")


@native(lambda: c_function("zmq_msg_close", lambda t: t.intc(t.voidptr), _libzmq_path()))
def zmq_msg_close(msg: int) -> int:
    raise NotImplementedError("compiled code only")


@kernel
def more(handle: int, scratch: np.ndarray) -> bool:
    """Whether the message being received has another frame (``scratch``: 2 int64s)."""
    scratch[0] = 0
    scratch[1] = 8
    zmq_getsockopt(ptr(handle), _RCVMORE, ptr(scratch.ctypes.data), ptr(scratch.ctypes.data + 8))
    return bool(scratch[0] != 0)


@kernel
def recv(handle: int, buffer: np.ndarray, flags: int) -> int:
    """A frame into ``buffer`` (uint8): its size (larger than the buffer when cut short), or -1."""
    return zmq_recv(ptr(handle), ptr(buffer.ctypes.data), buffer.size, flags)


@kernel
def send(handle: int, buffer: np.ndarray, size: int, flags: int) -> int:
    """``buffer``'s first ``size`` bytes as a frame; -1 if it could not go."""
    return zmq_send(ptr(handle), ptr(buffer.ctypes.data), size, flags)


@kernel
def drain(handle: int, scratch: np.ndarray, sink: np.ndarray) -> None:
    """Receive, and drop, what is left of the message being received."""
    while more(handle, scratch):
        zmq_recv(ptr(handle), ptr(sink.ctypes.data), sink.size, 0)


class NativeSocket:
    """A pyzmq socket handed to compiled code by its handle. Used by one thread at a time."""

    def __init__(self, socket: zmq.Socket[Any], address: str) -> None:
        self.socket = socket
        self.handle: int = socket.underlying
        self.address = address

    @classmethod
    def listen(cls, ctx: zmq.Context[Any], host: str) -> NativeSocket:
        """A ROUTER on a free port of ``host`` (a loopback address)."""
        socket = ctx.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDTIMEO, 100)  # a requester that stopped reading loses its reply
        try:
            socket.bind(f"tcp://{host}:*")
        except zmq.ZMQError as exc:
            socket.close(0)
            raise ConfigError(f"cannot bind a native socket on {host!r}: {exc}") from exc
        return cls(socket, socket.getsockopt_string(zmq.LAST_ENDPOINT))

    @classmethod
    def connect(cls, ctx: zmq.Context[Any], address: str, timeout_s: float) -> NativeSocket:
        """A DEALER to ``address``; each receive waits at most ``timeout_s``."""
        socket = ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
        socket.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        try:
            socket.connect(address)
        except zmq.ZMQError as exc:
            socket.close(0)
            raise ConfigError(f"cannot connect a native socket to {address!r}: {exc}") from exc
        return cls(socket, address)

    def readable(self) -> bool:
        """Whether a message waits to be received."""
        return bool(int(self.socket.get(_EVENTS)) & _POLLIN)

    def close(self) -> None:
        self.socket.close(0)
