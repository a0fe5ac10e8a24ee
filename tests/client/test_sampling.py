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


def test_local_sampling_of_a_static_table_follows_its_slices_when_they_move() -> None:
    """Promised (sampling.py docstring, README): ``local`` draws among keys present on this node
    ("drawn among the rows present on this node when the sample is drawn ... so the sample costs no
    message"), falling back to the true distribution when none is here. For a static table the list
    of local keys is made once (``Sampler._static_local_keys``, client/sampling.py:179-184) and never
    again: after this node's slice moved away the sampler still drew only that slice's keys, now
    all remote, and never the other half of the table (here 10,000 draws: none of keys 50..99)."""
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("neg", 100, 1, mapping="range")
        w1.table("neg", 100, 1, mapping="range")
        assert t0.layout.owners.tolist() == [0, 1]
        t0.register_sampling(scheme="local", seed=2)
        assert (t0.sample_keys(100) < 50).all()  # slice 0 (keys 0..49) is node 0's
        w0.move_slice("neg", 0, to=1)
        t0.refresh_layout()
        assert t0.layout.owners.tolist() == [1, 1] and not t0.local  # nothing of the table is here now
        keys = np.concatenate([t0.sample_keys(1000) for _ in range(10)])
        # Nothing here: the true (uniform) distribution, so about half the keys are >= 50.
        assert (keys >= 50).sum() > 3000, f"{(keys >= 50).sum()} of {keys.size} draws among keys 50..99"


def test_pool_samples_hold_the_workers_own_earlier_pushes() -> None:
    """Promised (DESIGN §10, "whatever table kind, placement or fault": a read by worker w returns
    every update w itself pushed before the read; NuPS's pool scheme reuses sampled *keys*): a row
    handed out by ``pull_sample`` includes the worker's own acknowledged pushes. The pool scheme
    pulled the pool's rows once and handed the same copies out ``reuse`` times: after pushing 1.0
    to every key of a first sample, the next samples from the same pool returned those keys with
    their rows as they were before the push. Rows are pulled per sample now."""
    with ThreadCluster(nodes=1) as c:
        t = c.worker(0).table("neg", 8, 1, techniques="auto", init=shoal.Constant(0.0))
        t.register_sampling(scheme="pool", pool_size=8, reuse=4, seed=3)
        pushed = np.zeros(8)
        stale = 0
        for _ in range(8):  # 8 samples of 4: one pool of 8 keys x 4 uses
            keys, rows = t.pull_sample(t.prepare_sample(4))
            stale += int((rows[:, 0] != pushed[keys]).sum())
            t.push(keys, np.ones((4, 1), np.float32))
            np.add.at(pushed, keys, 1.0)
        assert np.array_equal(t.pull(np.arange(8))[:, 0], pushed)  # the pushes landed
        assert stale == 0, f"{stale} of 32 sampled rows lacked this worker's own earlier pushes"


def test_local_sampling_draws_keys_that_came_to_this_node_since_its_list_was_made() -> None:
    """Promised (README, Sampling schemes): ``local`` draws "among the rows present on this node when
    the sample is drawn", weights renormalised over them. The list of local keys was refreshed only
    every 64 draws; keys that left were caught, keys that arrived were not: after node 1's keys all
    moved here, the next 20 samples of 500 never drew one of them, though they were half the rows
    present here. The list is made again once the keys drawn since number a sixteenth of the
    table's."""
    from shoal.storage.kernels import ABSENT
    from tests.support.waiting import wait_until
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("neg", 40, 1, techniques="relocation")
        w1.table("neg", 40, 1, techniques="relocation")
        t0.register_sampling(scheme="local", seed=4)
        assert (t0.sample_keys(50) % 2 == 0).all()  # lists node 0's keys: the even ones
        odd = np.arange(1, 40, 2)
        t0.localize(odd)
        presence = c.servers[0].adaptive.tables["neg"].presence
        wait_until(lambda: (presence[odd] != ABSENT).all())
        keys = np.concatenate([t0.sample_keys(500) for _ in range(20)])
        # Uniform over the 40 keys now here: about half odd (P(fewer than 3000 of 10,000) ~ 0).
        assert (keys % 2 == 1).sum() > 3000, f"{(keys % 2 == 1).sum()} of {keys.size} draws among the 20 keys that came"


@pytest.mark.parametrize("heavy", [1.0, 3.0], ids=["alike", "unlike"])
def test_local_sampling_draws_by_weight_among_the_keys_here(heavy: float) -> None:
    """``local`` renormalises the weights over the keys present here. Weights alike wherever above zero
    (a table's entities beside its relations) are drawn as uniform draws among the drawable keys here,
    without an alias table; other weights through one. Either way no key of weight zero and no key
    elsewhere is drawn, and each drawable key here in proportion to its weight."""
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("neg", 40, 1, techniques="relocation")
        w1.table("neg", 40, 1, techniques="relocation")
        weights = np.ones(40)
        weights[30:] = 0.0  # never drawn
        weights[:10] = heavy
        t0.register_sampling(weights, scheme="local", seed=5)
        keys = np.concatenate([t0.sample_keys(1000) for _ in range(20)])
        here = np.arange(0, 30, 2)  # node 0's keys (the even ones) of weight above zero
        counts = np.bincount(keys, minlength=40)
        assert counts[np.setdiff1d(np.arange(40), here)].sum() == 0, counts
        expected = keys.size * weights[here] / weights[here].sum()
        # 20,000 draws: each count within 5 standard deviations of its expectation (about 1,100-1,300).
        assert (np.abs(counts[here] - expected) < 5 * np.sqrt(expected)).all(), (counts[here], expected)
