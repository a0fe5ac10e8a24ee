"""Memory fences for the one hand-over of rows without a lock: a hold in place letting go.

A hold (``storage.in_place``) lets go of its rows with a plain store of each
row's pin (``kernels.release``), with no row lock; a writer that then takes the
lock and finds a row no longer pinned writes its value. Every write the hold's
kernel made must be seen before that: ``release_fence`` orders the kernel's
writes before the stores that let go, and ``acquire_fence`` (after reading a
pin as clear) orders the reads of that pin before the reads and writes of the
row. On x86-64 both only keep the compiler from moving memory accesses across
them (its stores are not reordered with stores, nor loads with loads); on
weaker processors (ARM) they are the processor's barriers.

The functions here are stand-ins that a kernel's module names until numba
loads (``jit``: on the first kernel call), when ``jit.compile_all`` binds their
compiled forms, intrinsics, in their place (``jit.native``).
"""

from __future__ import annotations

from typing import Any

from shoal.storage import jit


def _fence(ordering: str) -> Any:
    """A fence of ``ordering`` as a numba intrinsic (imports numba)."""
    from numba.core import types
    from numba.core.extending import intrinsic

    def typer(typingctx: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            builder.fence(ordering)
            return context.get_dummy_value()

        return types.none(), codegen

    typer.__name__ = f"{ordering}_fence"
    return intrinsic(typer)


@jit.native(lambda: _fence("release"))
def release_fence() -> None:
    """Memory accesses before this one complete before the stores after it (a stand-in; see the module)."""


@jit.native(lambda: _fence("acquire"))
def acquire_fence() -> None:
    """Loads before this one complete before the memory accesses after it (a stand-in; see the module)."""
