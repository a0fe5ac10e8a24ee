"""The public calls and their asynchronous forms: a call either succeeds with the right values or
raises a typed ``ShoalError``; an async call's error surfaces from its future, or from ``wait_all``
when nobody asked its future, never lost and never raised into an unrelated call; nothing waits
forever."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import shoal
from shoal.client.worker import Worker
from tests.support.cluster import ThreadCluster, fail_first_static_push

# --------------------------------------------------------------------------- futures


def test_a_pull_future_whose_request_wait_all_gave_up_on_raises_instead_of_returning_garbage():
    """``wait_all`` (also inside ``barrier`` and ``shutdown``) times out on a held pull and forgets its
    request; the pull's future then reports success with uninitialised rows."""
    with ThreadCluster(nodes=2) as c:  # servers hold a read up to their request timeout, 10 s
        # Worker 0 alone gives up after 1 s (no race with the server's own expiry of the held read).
        w0 = Worker(replace(c.spec, timeouts=replace(c.spec.timeouts, request_s=1.0)), 0, 0, c.transport)
        c.workers.append(w0)
        w1 = c.worker(1)
        t0 = w0.table("b", 100, 2, init=shoal.Constant(7.0), consistency=shoal.BSP())
        w1.table("b", 100, 2, init=shoal.Constant(7.0), consistency=shoal.BSP())
        w0.advance_clock()  # worker 1 stays at clock 0: node 1 holds worker 0's BSP read
        fut = t0.pull_async(np.arange(50, 60))
        with pytest.raises(shoal.RequestTimeoutError):
            w0.wait_all()
        try:
            rows = fut.wait()
        except shoal.ShoalError:
            pass  # the right outcome: the read failed
        else:
            pytest.fail(f"the abandoned pull's future returned rows instead of raising: {rows[:2].tolist()} "
                        "(every row is 7.0)")
        w1.advance_clock()


def test_a_pull_future_of_a_worker_shut_down_before_its_answer_raises_instead_of_returning_garbage():
    """``shutdown`` gives up on the held read (its ``wait_all`` times out, logged as an unclean
    shutdown) and closes the tracker; the future then returns uninitialised rows as if read."""
    with ThreadCluster(nodes=2) as c:
        w0 = Worker(replace(c.spec, timeouts=replace(c.spec.timeouts, request_s=1.0)), 0, 0, c.transport)
        c.workers.append(w0)
        w1 = c.worker(1)
        t0 = w0.table("b", 100, 2, init=shoal.Constant(7.0), consistency=shoal.BSP())
        w1.table("b", 100, 2, init=shoal.Constant(7.0), consistency=shoal.BSP())
        w0.advance_clock()
        fut = t0.pull_async(np.arange(50, 60))
        w0.shutdown()
        try:
            rows = fut.wait()
        except shoal.ShoalError:
            pass
        else:
            pytest.fail(f"a future of a closed worker returned rows never read: {rows[:2].tolist()}")
        w1.advance_clock()


def test_wait_all_raises_the_error_of_an_async_push_nobody_waited_for():
    """``RequestTracker.wait_all`` promises to raise a failed async push's error so that it does not
    vanish; a static table's push keeps its error in its call, so ``wait_all``/``barrier`` pass."""
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        t = w.table("u", 40, 2)
        fail_first_static_push(c, 1)
        t.push_async(np.array([30]), np.ones((1, 2), np.float32))  # fire and forget: keys of node 1
        with pytest.raises(shoal.ShoalError, match="injected"):
            w.wait_all()


# ------------------------------------------------------------------------ dense tables


def test_dense_pull_into_an_out_array_that_is_not_c_contiguous_fills_it_or_refuses_it():
    with ThreadCluster(nodes=2) as c:
        d = c.worker(0).dense("d", (3, 4), init=shoal.Constant(1.0), slice_size=5)
        out = np.zeros((3, 4), np.float32, order="F")
        try:
            got = d.pull(out=out)
        except shoal.ShoalError:
            return  # refused, as Table.pull refuses such an ``out``: fine
        assert got is out
        np.testing.assert_array_equal(out, 1.0)  # fails: the rows went into a temporary copy


def test_dense_pull_into_a_read_only_out_raises_a_typed_error():
    with ThreadCluster(nodes=2) as c:
        d = c.worker(0).dense("d", (3, 4), init=shoal.Constant(1.0))
        out = np.zeros((3, 4), np.float32)
        out.flags.writeable = False
        with pytest.raises(shoal.ShoalError):
            d.pull(out=out)  # ValueError: assignment destination is read-only


def test_dense_push_of_non_float_values_raises_dtype_error_and_changes_nothing():
    """A table refuses bool, int and str values with ``DTypeError`` (only float dtypes are cast); a
    dense table casts bool and int silently and lets numpy's ValueError out for strings."""
    with ThreadCluster(nodes=2) as c:
        d = c.worker(0).dense("d", (2, 3), init=shoal.Constant(1.0))
        with pytest.raises(shoal.DTypeError):
            d.push(np.ones((2, 3), dtype=bool))
        with pytest.raises(shoal.DTypeError):
            d.push([["a", "b", "c"], ["d", "e", "f"]])
        np.testing.assert_array_equal(d.pull(), 1.0)


def test_a_dense_shape_given_as_a_numpy_integer_works_or_raises_a_typed_error():
    with ThreadCluster(nodes=1) as c:
        w = c.worker(0)
        try:
            d = w.dense("n", np.int64(5))
        except shoal.ShoalError:
            return
        assert d.pull().shape == (5,)  # TypeError: 'numpy.int64' object is not iterable, before this


# ------------------------------------------------------------------ argument checking


@pytest.mark.parametrize("call", ["pull_ragged_keys", "push_ragged_values", "pull_out_list"])
def test_python_lists_that_are_not_arrays_raise_typed_errors(call):
    with ThreadCluster(nodes=1) as c:
        t = c.worker(0).table("t", 10, 2, init=shoal.Constant(1.0))
        with pytest.raises(shoal.ShoalError):
            if call == "pull_ragged_keys":
                t.pull([[1, 2], [3]])  # ValueError: inhomogeneous shape
            elif call == "push_ragged_values":
                t.push([1, 2], [[1.0, 2.0], [3.0]])  # ValueError: inhomogeneous shape
            else:
                t.pull([1], out=[[0.0, 0.0]])  # AttributeError: 'list' object has no attribute 'shape'
        np.testing.assert_array_equal(t.pull(np.arange(10)), 1.0)


# ------------------------------------------------------------------------ consistency


def test_set_consistency_with_slices_given_by_a_generator_changes_them():
    """``SliceSchemes.check`` consumes the iterable, then ``set`` checks it again and finds it empty:
    the call returns as if done and no slice changes."""
    with ThreadCluster(nodes=2) as c:
        t = c.worker(0).table("s", 40, 2, consistency=shoal.SSP(3))
        t.set_consistency(shoal.BSP(), slices=(s for s in [1]))
        assert t.consistency_of(1) == shoal.BSP()
