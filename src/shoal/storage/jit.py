"""Kernels compiled with numba on first use, not on import.

numba's import costs a process about 0.4 s and its first call (LLVM, the cached
kernels) about 0.6 s more; a job's launcher, its rendezvous, and servers and
workers that never touch a row (a barrier-only job, a worker between tables)
should not pay that. So ``@kernel`` records the plain function and returns a
stand-in; the first call of any stand-in compiles every recorded kernel (or
loads it from numba's cache) and rebinds each module's name to its compiled
form, so kernels that call kernels are compiled calls, and ``module.kernel(...)``
after that reaches numba with no stand-in in between.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])

_recorded: list[types.FunctionType] = []
_compiled: dict[types.FunctionType, Callable[..., Any]] = {}
_lock = threading.Lock()


def kernel(fn: F) -> F:
    """``fn`` compiled with ``numba.njit(nogil=True, cache=True)`` when any kernel is first called."""
    plain = cast(types.FunctionType, fn)
    _recorded.append(plain)
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def stand_in(*args: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = compile_all()[plain]
        return compiled(*args)

    return cast(F, stand_in)


def compile_all() -> dict[types.FunctionType, Callable[..., Any]]:
    """Every recorded kernel's compiled form, by plain function; imports numba the first time."""
    with _lock:
        if len(_compiled) < len(_recorded):
            import numba

            for fn in _recorded:
                if fn not in _compiled:
                    _compiled[fn] = numba.njit(nogil=True, cache=True)(fn)
                    fn.__globals__[fn.__name__] = _compiled[fn]
        return _compiled


def is_loaded() -> bool:
    """Whether this process has compiled (and so imported numba for) its kernels."""
    return bool(_compiled)
