"""The benchmarks that drive placement machines and storage kernels in their own process, run small:
what they call is still there and takes what they pass, and their own checks hold. They call the
machine and the kernels directly, so a change of those breaks them where a job's API would not,
and nothing else runs them between measurements."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_placement  # noqa: E402
import rows_floor  # noqa: E402


def test_placement_events_run_and_every_sync_is_added_once():
    # ``run`` itself checks that the owner's rows hold every replica's sync exactly once.
    timer = bench_placement.run(rounds=3)
    assert set(timer.times) == {"announce at the owner: relocate", "wire: encode and decode a state",
                                "state at the new owner", "sync timer at the replica", "sync at the owner",
                                "answer at the replica"}
    assert all(len(times) == 3 and min(times) >= 0 for times in timer.times.values())


def test_the_rows_floor_prices_every_step_of_every_kind():
    prices = rows_floor.cpu_per_mb(rounds=3)
    steps = {step for kind in rows_floor.STEPS_OF_KIND.values() for step in kind}
    assert steps <= set(prices)
    assert all(math.isfinite(ms) and ms > 0 for ms in prices.values())
    assert set(rows_floor.per_kind(prices)) == set(rows_floor.STEPS_OF_KIND)
