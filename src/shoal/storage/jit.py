"""Kernels compiled with numba on first use, not on import.

numba's import costs a process about 0.3 s and its first call (LLVM, the cached
kernels) about 0.15 s more; a job's launcher, its rendezvous, and servers and
workers that never touch a row (a barrier-only job, a worker between tables)
should not pay that. So ``@kernel`` records the plain function and returns a
stand-in; the first call of any stand-in compiles every recorded kernel (or
loads it from numba's cache) and rebinds each module's name to its compiled
form, so kernels that call kernels are compiled calls, and ``module.kernel(...)``
after that reaches numba with no stand-in in between.

Kernels divide as numpy does (``error_model="numpy"``): under Python's rules every
division checks its divisor for zero to raise ``ZeroDivisionError``, and that branch
keeps LLVM from vectorising the loop around it. Adagrad's update of 10,000 rows of
64 took 5.6 ms that way against 2.6 (2.4 ms against 0.5 on rows in the caches), with
the same results to the bit. No kernel divides by what can be zero: the update rules'
divisors are square roots plus ``eps``, the others' counts and sums checked positive
before the call.

numba's cache knows a kernel by its source file's date and size, not by the options
it was compiled with: a change of options here goes with a change to the kernels'
modules, or kernels cached with the old options go on being loaded.
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
#: names kernels call that numba needs objects of its own for (intrinsics, C functions): each
#: stand-in, and what makes its compiled form
_natives: dict[int, tuple[Callable[..., Any], Callable[[], Any]]] = {}
_made: dict[int, Any] = {}  # the compiled forms made so far, by their stand-in's id
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


def native(compiled: Callable[[], Any]) -> Callable[[F], F]:
    """Name what a kernel calls that is not a kernel: an intrinsic, a C function. The decorated
    function stands in (it is what Python calls, if anything may); when the kernels compile,
    ``compiled()`` (which may import numba) makes its compiled form, bound in its place in every
    kernel's module that names it."""
    def register(stand_in: F) -> F:
        _natives[id(stand_in)] = (stand_in, compiled)
        return stand_in

    return register


def compile_all() -> dict[types.FunctionType, Callable[..., Any]]:
    """Every recorded kernel's compiled form, by plain function; imports numba the first time."""
    with _lock:
        if len(_compiled) < len(_recorded):
            import numba

            _defer_blas_check()
            for key, (_, make) in list(_natives.items()):
                if key not in _made:
                    _made[key] = make()
            for fn in _recorded:
                if fn not in _compiled:
                    names = fn.__globals__
                    for name, value in list(names.items()):  # the natives it names, as compiled forms
                        entry = _natives.get(id(value))
                        if entry is not None and entry[0] is value:
                            names[name] = _made[id(value)]
                    _compiled[fn] = numba.njit(nogil=True, cache=True, error_model="numpy")(fn)
                    fn.__globals__[fn.__name__] = _compiled[fn]
        return _compiled


def _defer_blas_check() -> None:
    """Let numba's first compilation skip importing ``scipy.linalg`` (0.2-0.3 s in every process).

    Loading its array functions, numba asks whether BLAS is there by importing
    ``scipy.linalg.cython_blas``, only to choose how one family of functions
    (``np.vdot`` and kin) is typed; none of Shoal's kernels uses BLAS. While that
    module loads, the question is answered by whether scipy is installed; numba's
    real check, the import and its guard on the BLAS integer width, still runs
    when a kernel first uses BLAS (``np.dot`` in an application's kernel).
    A numba without these names (another version) is left alone.
    """
    import importlib.util
    import sys

    if "numba.np.arraymath" in sys.modules:
        return
    try:
        from numba.np import linalg
    except ImportError:
        return
    real = getattr(linalg, "ensure_blas", None)
    if real is None:
        return

    def scipy_installed() -> None:
        if importlib.util.find_spec("scipy") is None:
            raise ImportError("scipy is not installed")

    linalg.ensure_blas = scipy_installed
    try:
        import numba.np.arraymath  # noqa: F401  (its import runs the check, with the answer above)
    finally:
        linalg.ensure_blas = real


def is_loaded() -> bool:
    """Whether this process has compiled (and so imported numba for) its kernels."""
    return bool(_compiled)
