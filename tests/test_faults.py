"""Seeded fault-injection scenarios (tests/support/faults.py): a quick few here, all of them under
the ``heavy`` marker (``make test-heavy``) and in ``benchmarks/faults.py``, which writes the report."""

from __future__ import annotations

import pytest

from tests.support.faults import SCENARIOS, Scenario


def _check(scenario: Scenario, tmp_path) -> None:
    outcome = scenario.run(tmp_path)
    if outcome.skipped:
        pytest.skip(outcome.skipped)
    assert outcome.holds, (outcome.checks, outcome.facts)


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.quick], ids=lambda s: s.name)
def test_quick_fault_scenarios_hold(scenario, tmp_path):
    _check(scenario, tmp_path)


@pytest.mark.heavy
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if not s.quick], ids=lambda s: s.name)
def test_every_other_fault_scenario_holds(scenario, tmp_path):
    _check(scenario, tmp_path)
