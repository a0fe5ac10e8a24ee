"""Run every seeded fault-injection scenario and write the report.

    python benchmarks/faults.py [--only NAME ...]

Scenarios and their invariants live in tests/support/faults.py. Writes
benchmarks/results/faults.json (every check and measured fact) and
benchmarks/results/faults.md (one line per scenario). Exit status 1 if any
scenario that ran broke an invariant.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.faults import SCENARIOS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="scenario names to run (default: all)")
    args = p.parse_args()
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    outcomes = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shoal-faults-") as tmp:
        for scenario in chosen:
            outcome = scenario.run(Path(tmp) / scenario.name)
            verdict = "skipped" if outcome.skipped else "holds" if outcome.holds else "BROKEN"
            print(f"{scenario.name:28s} seed {scenario.seed:3d}  {verdict:8s} {outcome.seconds:6.1f}s  "
                  + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in outcome.checks.items()), flush=True)
            outcomes.append(outcome)
    ran = [o for o in outcomes if not o.skipped]
    held = [o for o in ran if o.holds]
    print(f"\n{len(held)} of {len(ran)} scenarios held their invariants ({len(outcomes) - len(ran)} skipped) "
          f"in {time.monotonic() - start:.0f}s")
    if not args.only:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "faults.json").write_text(json.dumps({
            "machine": {"python": platform.python_version(), "arch": platform.machine()},
            "held": len(held), "ran": len(ran), "skipped": len(outcomes) - len(ran),
            "scenarios": [{**asdict(o), "holds": o.holds} for o in outcomes]}, indent=1, default=str))
        lines = ["# Fault-injection scenarios", "",
                 f"{len(held)} of {len(ran)} seeded scenarios held every invariant "
                 f"({len(outcomes) - len(ran)} skipped). Reproduce: `make faults` "
                 "(scenarios in `tests/support/faults.py`).", "",
                 "| scenario | seed | fault | must hold | verdict | facts |", "|---|---|---|---|---|---|"]
        for o in outcomes:
            verdict = f"skipped ({o.skipped})" if o.skipped else "holds" if o.holds else "**broken**: " + ", ".join(
                k for k, v in o.checks.items() if not v)
            facts = ", ".join(f"{k} {v}" for k, v in o.facts.items() if k != "output_tail")
            lines.append(f"| {o.scenario} | {o.seed} | {o.fault} | {o.must_hold} | {verdict} | {facts} |")
        (RESULTS / "faults.md").write_text("\n".join(lines) + "\n")
    return 0 if len(held) == len(ran) else 1


if __name__ == "__main__":
    sys.exit(main())
