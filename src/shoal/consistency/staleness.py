"""How stale reads were: the distribution is a first-class metric (DESIGN.md §4)."""

from __future__ import annotations

from typing import Any

import numpy as np

_MAX = 256  # staleness values above this share the last bucket


class StalenessHistogram:
    """Counts of reads by staleness: reader's clock minus the clock its rows are known current at."""

    def __init__(self) -> None:
        self.counts = np.zeros(_MAX + 1, dtype=np.int64)

    def record(self, staleness: np.ndarray | int, reads: int = 1) -> None:
        if isinstance(staleness, (int, np.integer)):
            self.counts[min(max(int(staleness), 0), _MAX)] += reads
            return
        clipped = np.clip(staleness, 0, _MAX)
        self.counts += np.bincount(clipped, minlength=_MAX + 1)[: _MAX + 1]

    @property
    def total(self) -> int:
        return int(self.counts.sum())

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
        nonzero = np.flatnonzero(self.counts)
        return {"counts": {str(int(s)): int(self.counts[s]) for s in nonzero}, "reads": self.total,
                "mean": self.mean(), "std": self.std(), "max": self.max()}

    def __repr__(self) -> str:
        if not self.total:
            return "StalenessHistogram(no reads)"
        shares = ", ".join(f"{int(s)}: {self.counts[s] / self.total:.1%}" for s in np.flatnonzero(self.counts)[:8])
        more = ", ..." if np.count_nonzero(self.counts) > 8 else ""
        return (f"StalenessHistogram({self.total} reads, mean {self.mean():.2f} clocks, max {self.max()}; "
                f"share of reads by clocks behind: {{{shares}{more}}})")

    def merge(self, other: StalenessHistogram) -> None:
        self.counts += other.counts
