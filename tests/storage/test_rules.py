"""Update rules on a shard store against straightforward numpy implementations."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.api.config import TableSpec
from shoal.api.initializers import Constant
from shoal.api.optim import SGD, Adagrad, Adam, Sum
from shoal.storage.shard import ShardStore


def reference(opt, steps, n, dim):
    w = np.full((n, dim), 0.5)
    h = np.full((n, dim), getattr(opt, "initial_accumulator", 0.0))
    m = np.zeros((n, dim))
    v = np.zeros((n, dim))
    t = np.zeros(n)
    for rows, grads in steps:
        g = np.zeros((n, dim))
        np.add.at(g, rows, grads)
        touched = np.unique(rows)
        for r in touched:
            if isinstance(opt, Sum):
                w[r] += g[r]
            elif isinstance(opt, SGD):
                w[r] -= opt.lr * g[r]
            elif isinstance(opt, Adagrad):
                h[r] += g[r] ** 2
                w[r] -= opt.lr * g[r] / (np.sqrt(h[r]) + opt.eps)
            else:
                t[r] += 1
                m[r] = opt.beta1 * m[r] + (1 - opt.beta1) * g[r]
                v[r] = opt.beta2 * v[r] + (1 - opt.beta2) * g[r] ** 2
                mhat = m[r] / (1 - opt.beta1 ** t[r])
                vhat = v[r] / (1 - opt.beta2 ** t[r])
                w[r] -= opt.lr * mhat / (np.sqrt(vhat) + opt.eps)
    return w


@pytest.mark.parametrize("opt", [Sum(), SGD(lr=0.1), Adagrad(lr=0.1, initial_accumulator=0.1), Adam(lr=0.01)],
                         ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rule_matches_reference_with_duplicates(opt, dtype):
    n, dim = 30, 5
    spec = TableSpec("r", n, dim, dtype=dtype, init=Constant(0.5), optimizer=opt)
    store = ShardStore.create(spec, 0, np.arange(n), "rules")
    rng = np.random.default_rng(3)
    steps = []
    for _ in range(15):
        rows = rng.integers(0, n, 12)
        grads = rng.standard_normal((12, dim))
        steps.append((rows, grads))
        store.update(rows.astype(np.int64), grads.astype(dtype))
    tol = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(store.values, reference(opt, steps, n, dim), rtol=tol, atol=tol)
    store.close()


def test_state_lives_in_the_segment_so_an_attached_view_sees_it():
    spec = TableSpec("s", 10, 2, optimizer=Adagrad(lr=1.0))
    store = ShardStore.create(spec, 0, np.arange(10), "state")
    import os

    other = ShardStore.attach(spec, 0, 10, os.dup(store.fd), store.segment.label)
    store.update(np.array([4]), np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(other.state["accum"][4], 1.0)
    np.testing.assert_array_equal(other.values[4], store.values[4])
    other.update(np.array([4]), np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(store.state["accum"][4], 2.0)
    other.close()
    store.close()
