"""When may a pull be answered? One controller per table on each server.

There is no central scheduler: every server learns worker clocks from the
messages it receives and decides for its own shards, so a server whose clocks
have advanced answers while another still waits. A pull is held to the table's
model, or to the one its reader names for the slices it reads
(``consistency.schemes``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from shoal.api.consistency import Consistency, LazyPull
from shoal.consistency.clocks import ClockTable

T = TypeVar("T")


@dataclass
class HeldPull(Generic[T]):
    item: T
    worker: int
    clock: int
    required: int | None  # slowest clock the bound needs; None: no bound
    pushes_at_hold: int
    lazy: LazyPull | None = None
    since: float = 0.0
    lazy_deadline: float | None = None


@dataclass
class ControllerStats:
    served_at_once: int = 0
    held_by_bound: int = 0
    held_lazily: int = 0
    released_by_aggregation: int = 0
    released_by_pushes: int = 0
    released_by_timeout: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class ShardController(Generic[T]):
    """Serve, or hold until the table's bound (and the lazy pull buffer) allow it."""

    model: Consistency
    clocks: ClockTable
    now: Callable[[], float] = time.monotonic
    held: list[HeldPull[T]] = field(default_factory=list)
    pushes: int = 0
    stats: ControllerStats = field(default_factory=ControllerStats)

    def required(self, clock: int, model: Consistency | None = None) -> int | None:
        """Slowest clock a read at ``clock`` needs: all iterations before ``clock - bound``."""
        bound = (self.model if model is None else model).bound
        return None if bound is None else clock - bound

    def admit(self, item: T, worker: int, clock: int, model: Consistency | None = None) -> bool:
        """True: answer now. False: the pull is held until ``release`` hands it back. ``model``: the
        one its reader holds the rows it reads to, if not the table's."""
        model = self.model if model is None else model
        required = self.required(clock, model)
        slowest = self.clocks.slowest
        bound_met = required is None or slowest >= required
        if bound_met and not self._lazy_applies(clock, model.lazy):
            self.stats.served_at_once += 1
            return True
        pull = HeldPull(item, worker, clock, required, self.pushes, model.lazy, self.now())
        if bound_met:
            self._start_lazy_wait(pull)
            self.stats.held_lazily += 1
        else:
            self.stats.held_by_bound += 1
        self.held.append(pull)
        return False

    def _lazy_applies(self, clock: int, lazy: LazyPull | None) -> bool:
        """Hold a reader that is ahead of the slowest worker: its rows are about to change."""
        return lazy is not None and self.clocks.slowest < clock

    def _start_lazy_wait(self, pull: HeldPull[T]) -> None:
        assert pull.lazy is not None
        pull.lazy_deadline = self.now() + pull.lazy.timeout_ms / 1000.0
        pull.pushes_at_hold = self.pushes

    def holds_lazily(self) -> bool:
        """Whether a held pull waits in the lazy pull buffer (a push may release it)."""
        return any(p.lazy is not None for p in self.held)

    def on_push(self) -> None:
        self.pushes += 1

    def release(self) -> list[T]:
        """Pulls that may be answered now, in the order they arrived."""
        if not self.held:
            return []
        slowest = self.clocks.slowest
        now = self.now()
        out: list[T] = []
        keep: list[HeldPull[T]] = []
        for pull in self.held:
            if pull.required is not None and slowest < pull.required:
                keep.append(pull)
                continue
            lazy = pull.lazy
            if lazy is None or slowest >= pull.clock:
                if lazy is not None:
                    self.stats.released_by_aggregation += 1
                out.append(pull.item)
                continue
            if pull.lazy_deadline is None:  # the bound was just met: the lazy wait starts now
                self._start_lazy_wait(pull)
                self.stats.held_lazily += 1
            if lazy.max_pushes and self.pushes - pull.pushes_at_hold >= lazy.max_pushes:
                self.stats.released_by_pushes += 1
                out.append(pull.item)
            elif now >= pull.lazy_deadline:  # type: ignore[operator]
                self.stats.released_by_timeout += 1
                out.append(pull.item)
            else:
                keep.append(pull)
        self.held = keep
        return out

    def take(self, which: Callable[[T], bool]) -> list[T]:
        """The held pulls ``which`` picks, removed (in the order they arrived)."""
        taken = [p.item for p in self.held if which(p.item)]
        if taken:
            self.held = [p for p in self.held if not which(p.item)]
        return taken

    def expire(self, max_age: float) -> list[HeldPull[T]]:
        """Held pulls older than ``max_age`` seconds (their requester has given up): removed and returned."""
        cutoff = self.now() - max_age
        old = [p for p in self.held if p.since < cutoff]
        if old:
            self.held = [p for p in self.held if p.since >= cutoff]
        return old

    def next_deadline(self) -> float | None:
        """When the earliest lazy wait runs out (for the server loop's timer)."""
        deadlines = [p.lazy_deadline for p in self.held if p.lazy_deadline is not None]
        return min(deadlines) if deadlines else None

    def waiting_for(self) -> dict[int, list[int]]:
        """For each held pull's worker, the workers whose clocks it waits on."""
        return {p.worker: self.clocks.behind(p.required) for p in self.held if p.required is not None}
