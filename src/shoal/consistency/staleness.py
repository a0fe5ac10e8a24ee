"""How stale reads were: the distribution is a first-class metric (DESIGN.md §4)."""

from __future__ import annotations

from typing import Any

import numpy as np

_MAX = 256  # staleness values above this share the last bucket


class StalenessHistogram:
    """Counts of reads by staleness: reader's clock minus the clock its rows are known current at."""

    def __init__(self) -> None:
        # A Python list: every reply records one value, and a numpy element costs more to add to.
        self._counts = [0] * (_MAX + 1)

    @property
    def counts(self) -> np.ndarray:
        """Reads per staleness value (a copy)."""
        return np.array(self._counts, dtype=np.int64)

    def record(self, staleness: np.ndarray | int, reads: int = 1) -> None:
        if isinstance(staleness, (int, np.integer)):
            self._counts[min(max(int(staleness), 0), _MAX)] += reads
            return
        per_value = np.bincount(np.clip(staleness, 0, _MAX), minlength=_MAX + 1)
        for value in np.flatnonzero(per_value):
            self._counts[value] += int(per_value[value])

    @property
    def total(self) -> int:
        return sum(self._counts)

    def mean(self) -> float:
        total = self.total
        return float((self.counts * np.arange(_MAX + 1)).sum() / total) if total else 0.0

    def std(self) -> float:
        total = self.total
        if not total:
            return 0.0
        values = np.arange(_MAX + 1)
        mean = self.mean()
        return float(np.sqrt((self.counts * (values - mean) ** 2).sum() / total))

    def max(self) -> int:
        nonzero = np.flatnonzero(self.counts)
        return int(nonzero[-1]) if nonzero.size else 0

    def as_dict(self) -> dict[str, Any]:
        counts = self.counts
        return {"counts": {str(int(s)): int(counts[s]) for s in np.flatnonzero(counts)}, "reads": self.total,
                "mean": self.mean(), "std": self.std(), "max": self.max()}

    def __repr__(self) -> str:
        if not self.total:
            return "StalenessHistogram(no reads)"
        counts, total = self.counts, self.total
        shares = ", ".join(f"{int(s)}: {counts[s] / total:.1%}" for s in np.flatnonzero(counts)[:8])
        more = ", ..." if np.count_nonzero(counts) > 8 else ""
        return (f"StalenessHistogram({self.total} reads, mean {self.mean():.2f} clocks, max {self.max()}; "
                f"share of reads by clocks behind: {{{shares}{more}}})")

    def merge(self, other: StalenessHistogram) -> None:
        for value, reads in enumerate(other._counts):
            self._counts[value] += reads
