"""One pull, push or push_pull of a table whose keys can move (static slices, adaptive keys): its
requests in flight, and the parts to send again where their keys are now."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shoal.api.errors import ProtocolError, ShoalError
from shoal.storage import kernels
from shoal.wire.message import Message
from shoal.wire.ops import Op

Positions = np.ndarray | None


WRITES = (Op.PUSH, Op.PUSH_PULL)
READS = (Op.PULL, Op.PUSH_PULL)


class Part:
    """One request of a call: where it went, its place in the stream, and which keys it carries."""

    __slots__ = ("node", "seq", "positions", "epoch", "op", "req", "answered")

    def __init__(self, node: int, seq: int, positions: Positions, epoch: int, op: Op) -> None:
        self.node, self.seq, self.positions, self.epoch, self.op = node, seq, positions, epoch, op
        self.req = 0
        self.answered = False  # a reply or an error came for it (else it ended given up)


class Call:
    """One pull, push or push_pull: its parts in flight, and the parts to send again after a move.

    Keys answered "moved" go where they are now (``client.routed``): their push at once, in the
    background (``RoutedAccess.after_receive``), their read when the caller waits (``step``:
    ``reread``), because a read may have to wait for its bound and the background must never wait.
    While it waits it also asks (``watch``) whether the servers it waits for are still alive.
    """

    def __init__(self, op: Op, keys: np.ndarray, values: np.ndarray | None, result: Rows | None, clock: int,
                 reread: Callable[[Call], None], watch: Callable[[Call], None], started: float) -> None:
        self._reread, self._watch = reread, watch
        self.op, self.keys, self.values, self.result, self.clock = op, keys, values, result, clock
        self.parts: dict[int, Part] = {}
        #: positions answered "moved", with the op they were sent with
        self.moved: list[tuple[np.ndarray, Op]] = []
        #: positions whose rows are to be read again where their keys are now
        self.rereads: list[np.ndarray] = []
        self.attempts = 0
        self.started = started  # on the worker's clock
        self.error: ShoalError | None = None
        #: whether its future's outcome was asked for (an error nobody asked for is raised by
        #: ``Worker.wait_all``, so that it does not vanish)
        self.observed = False
        #: pushes are numbered in the order they start (a fence waits for those before a point)
        self.index = 0
        #: parts read through a lane (``client.lane``), not answered yet, and what takes their answers
        #: (waiting for them, or taking those already here)
        self.laned: list[Any] = []
        self.take_laned: Callable[[Call, bool], None] | None = None

    def finished(self) -> bool:
        if self.laned:  # answers already here are taken: a future's ``done()`` asks this
            assert self.take_laned is not None
            self.take_laned(self, False)
        return not self.parts and not self.laned and not self.moved and (not self.rereads or self.error is not None)

    def awaited(self) -> set[int]:
        return set(self.parts)

    def step(self) -> None:
        if self.laned:
            assert self.take_laned is not None
            self.take_laned(self, True)
        if self.rereads and self.error is None:
            self._reread(self)
        self._watch(self)

    def written(self, part_positions: Positions) -> tuple[np.ndarray, np.ndarray]:
        """The keys and values a push part carries."""
        assert self.values is not None
        if part_positions is None:
            return self.keys, self.values
        return self.keys[part_positions], self.values[part_positions]

    def unsent_writes(self) -> list[np.ndarray]:
        """Positions of pushes answered "moved", not sent again yet."""
        return [positions for positions, op in self.moved if op in WRITES]

    def positions(self, part_positions: Positions) -> np.ndarray:
        return np.arange(self.keys.shape[0]) if part_positions is None else part_positions

    def outcome(self) -> Any:
        self.observed = True
        if self.error is not None:
            raise self.error
        return None if self.result is None else self.result.get()


class Rows:
    """The rows a pull returns, filled by local reads and replies as they arrive.

    When one reply carries every row in order and the caller gave no ``out``,
    the reply's own (writable) frame becomes the result: no copy at all.
    """

    def __init__(self, n: int, dim: int, dtype: np.dtype, out: np.ndarray | None) -> None:
        self.n, self.dim, self.dtype = n, dim, dtype
        self._array = out

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.empty((self.n, self.dim), dtype=self.dtype)
        return self._array

    def get(self) -> np.ndarray:
        return self.array()

    def take_whole(self, msg: Message) -> None:
        rows = self._checked(msg, self.n)
        if self._array is None and rows.flags.writeable:
            self._array = rows
        else:
            self.array()[...] = rows

    def place(self, pos: np.ndarray, msg: Message, keep: np.ndarray | None = None) -> None:
        """The reply's rows at ``pos`` of the result (only those where ``keep`` is true, if given)."""
        rows = self._checked(msg, pos.shape[0])
        if keep is None:
            self.place_rows(pos, rows)
        else:
            self.place_rows(pos[keep], rows[keep])

    def place_rows(self, pos: np.ndarray, rows: np.ndarray) -> None:
        """``rows`` at positions ``pos`` of the result."""
        kernels.place_rows(self.array(), pos, rows)

    def _checked(self, msg: Message, n: int) -> np.ndarray:
        rows = msg.arrays[0] if msg.op == Op.VALUES and msg.arrays else None
        if rows is None or rows.shape != (n, self.dim) or rows.dtype != self.dtype:
            got = None if rows is None else (rows.shape, rows.dtype)
            raise ProtocolError(f"expected {n} row(s) of {self.dim} {self.dtype} in reply, got {msg.op.name} {got}")
        return rows

