"""Sampling access (``register_sampling``, ``prepare_sample``, ``pull_sample``) and the worker's intent
calls: bad input and the distribution drawn from. Each docstring says what went wrong before."""

from __future__ import annotations

import numpy as np
import pytest

import shoal
from tests.support.cluster import ThreadCluster

# ------------------------------------------------------------------ bad input, typed errors


@pytest.mark.parametrize("bad", [
    {"reuse": "3"},
    {"reuse": None},
    {"pool_size": None},
    {"seed": "x"},
    {"seed": -1},
    {"seed": 1.5},
    {"weights": "abc"},
    {"weights": {"a": 1.0}},
    {"reuse": 10**30},
], ids=lambda d: f"{next(iter(d))}={next(iter(d.values()))!r}")
def test_register_sampling_refuses_bad_arguments_with_a_shoal_error(bad: dict) -> None:
    """Bad input to the sampling API gives a typed ShoalError. ``reuse``/``pool_size`` that were not
    numbers raised TypeError, a seed that was no non-negative int raised TypeError/ValueError from
    numpy, weights that were not numbers raised ValueError/TypeError, and a ``reuse`` too large for
    int64 was accepted and the first sample raised OverflowError."""
    with ThreadCluster(nodes=1) as c:
        t = c.worker(0).table("neg", 100, 2, techniques="auto")
        options = {"scheme": "pool", **bad}
        with pytest.raises(shoal.ShoalError):
            t.register_sampling(**options)
            t.pull_sample(t.prepare_sample(3))


@pytest.mark.parametrize("call", ["intent", "localize"])
def test_intent_and_localize_take_a_table_or_its_name_and_refuse_anything_else(call: str) -> None:
    """``ps.intent(table, keys, start)`` and ``ps.localize`` called ``table.intent``/``table.localize``
    on whatever they were given: a table's name (as ``move_slice`` takes it), the name of no table
    or anything else raised AttributeError. They take a table or its name now, and anything else is a
    TableError."""
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        w.table("neg", 100, 2, techniques="auto")
        if call == "intent":  # by name, as move_slice takes it
            w.intent("neg", [1, 2], start=w.clock + 1)
        else:
            w.localize("neg", [1, 2])
        for wrong in ("no-such-table", 3):
            with pytest.raises(shoal.TableError):
                if call == "intent":
                    w.intent(wrong, [1, 2], start=w.clock + 1)
                else:
                    w.localize(wrong, [1, 2])


# ------------------------------------------------------------------ distributions


def test_weights_accepted_as_valid_are_drawn_by_their_weights_even_when_their_sum_overflows() -> None:
    """Samples come from the registered distribution; weights are accepted when finite and
    non-negative with a positive sum. Weights [1e308, 1e308, 1, ...] passed that check, but the
    alias table scaled them by n / sum = n / inf = 0: every column kept its own key and draws were
    uniform (9,809 of 10,000 draws were keys of probability ~1e-308). Weights are scaled to a
    maximum of 1 first."""
    with ThreadCluster(nodes=1) as c:
        t = c.worker(0).table("neg", 100, 1, techniques="auto")
        weights = np.ones(100)
        weights[:2] = 1e308
        with np.errstate(over="ignore"):
            t.register_sampling(weights, scheme="naive", seed=1)
        keys = np.concatenate([t.sample_keys(1000) for _ in range(10)])
        others = int((keys >= 2).sum())
        # P(a key >= 2) is 98 / 2e308: not one in 10,000 draws.
        assert others == 0, f"{others} of {keys.size} draws were keys of weight 1 beside two of weight 1e308"
