"""Rows held in place for a kernel (``Table.in_place``): zero-copy, locked, and nothing written lost."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import shoal
from shoal.storage.kernels import OWNED, REPLICA
from tests.support.cluster import ThreadCluster
from tests.support.waiting import wait_until


def test_rows_in_place_are_this_nodes_rows_without_a_copy_and_the_rest_is_named():
    with ThreadCluster(nodes=2) as c:
        t0 = c.worker(0).table("p", 20, 3, techniques="relocation", init=shoal.Constant(1.0))
        t1 = c.worker(1).table("p", 20, 3, techniques="relocation", init=shoal.Constant(1.0))
        keys = np.array([4, 5, 6, 7, 6])  # even keys start at node 0, odd ones at node 1
        requests = t0.counters["requests"]
        with t0.in_place(keys) as rows:
            np.testing.assert_array_equal(rows.slots, [4, -1, 6, -1, 6])
            np.testing.assert_array_equal(rows.absent, [1, 3])
            server_rows = c.servers[0].adaptive.tables["p"].store.values  # its own mapping of the segment
            rows.values[8, 0] = 7.0
            assert server_rows[8, 0] == 7.0  # the same memory, no copy
            rows.values[8, 0] = 1.0
            rows.values[[4, 6]] += 1.0
        assert t0.counters["requests"] == requests  # no message
        t0.push(keys[rows.absent], np.ones((2, 3), np.float32))
        np.testing.assert_array_equal(t1.pull(keys)[:, 0], 2.0)
        assert t0.counters["rows_in_place"] == 3


def test_a_pull_or_push_of_the_table_inside_the_block_is_refused_not_left_waiting_on_its_locks():
    with ThreadCluster(nodes=1) as c:
        t = c.worker(0).table("p", 10, 1, techniques="auto")
        other = c.worker(0).table("q", 10, 1, techniques="auto")
        with t.in_place([1, 2]):
            for call in (lambda: t.pull([3]), lambda: t.push([3], [[1.0]]), lambda: t.in_place([3])):
                with pytest.raises(shoal.TableError, match="held in place"):
                    call()
            other.push([3], [[1.0]])  # another table's rows are not held
        t.push([3], [[1.0]])
        np.testing.assert_array_equal(t.pull([3, 1]), [[1.0], [0.0]])


def test_of_two_holds_made_before_either_is_entered_only_one_is_open_at_a_time():
    with ThreadCluster(nodes=1) as c:
        t = c.worker(0).table("p", 10, 1, techniques="auto")
        first, second = t.in_place([1]), t.in_place([2])
        with first:
            for enter in (second.__enter__, first.__enter__):  # refused, and neither counts as open
                with pytest.raises(shoal.TableError, match="already held in place"):
                    enter()
        with second:  # the first one ended: the table has no open hold left
            second.values[second.slots[0], 0] = 4.0
        first.__exit__(None)  # a block ended twice leaves the table usable, not below zero
        t.push([1], [[1.0]])
        np.testing.assert_array_equal(t.pull([1, 2]), [[1.0], [4.0]])
        with pytest.raises(shoal.TableError, match="held in place"), t.in_place([3]):
            t.pull([3])
        np.testing.assert_array_equal(t.pull([3]), [[0.0]])


def test_an_error_inside_the_block_lets_the_rows_go_and_keeps_what_was_written_to_a_replica():
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("e", 20, 1, techniques="replication", sync_ms=5)
        t1 = w1.table("e", 20, 1, techniques="replication", sync_ms=5)
        hot = np.arange(0, 20, 2)
        for t, w in ((t0, w0), (t1, w1)):
            t.intent(hot, w.clock, w.clock + 1000)
        assert t1.wait_local(hot, timeout=20) == 0
        with pytest.raises(ZeroDivisionError):
            with t1.in_place(hot) as rows:
                rows.values[rows.slots] += 2.0
                raise ZeroDivisionError  # the kernel failed halfway
        t1.push(hot, np.ones((10, 1), np.float32))  # the rows are not held any more
        wait_until(lambda: (c.servers[0].adaptive.tables["e"].store.values[hot, 0] == 3.0).all())


def test_in_place_refuses_what_it_cannot_hold_and_checks_its_keys():
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        c.worker(1).table("r", 10, 1, replicas=2)
        with pytest.raises(shoal.TableError, match="quorums"):
            w.table("r", 10, 1, replicas=2).in_place([1])
        c.worker(1).table("h", 10, 1, locking="hogwild")
        c.worker(1).table("s", 10, 1, slices=4)
        with pytest.raises(shoal.TableError, match="locking='exact'"):
            w.table("h", 10, 1, locking="hogwild").in_place([1])
        with pytest.raises(shoal.TableError, match="2 slices"):
            w.table("s", 10, 1, slices=4).in_place([1])
        t = w.table("a", 10, 1, techniques="auto")
        with pytest.raises(shoal.KeyRangeError):
            t.in_place([10])


def test_a_static_slices_rows_in_place_with_the_rules_state_and_the_rest_through_messages():
    with ThreadCluster(nodes=2) as c:
        options = dict(optimizer=shoal.optim.Adagrad(lr=0.1), init=shoal.Constant(1.0))
        t0, t1 = c.worker(0).table("s", 40, 2, **options), c.worker(1).table("s", 40, 2, **options)
        keys = np.array([3, 25, 7])  # range slices: 0..19 on node 0, 20..39 on node 1
        with t0.in_place(keys) as rows:
            np.testing.assert_array_equal(rows.slots >= 0, [True, False, True])
            np.testing.assert_array_equal(rows.absent, [1])
            assert set(rows.state) == {"accum"}
            here = rows.slots[rows.slots >= 0]
            rows.values[here] += 2.0
            rows.state["accum"][here] += 4.0
        t0.push(keys[rows.absent], np.ones((1, 2), np.float32))
        np.testing.assert_array_equal(t1.pull([3, 7])[:, 0], 3.0)  # node 1 reads node 0's slice: the writes
        assert t1.pull([25])[0, 0] < 1.0  # one Adagrad step by push
        assert t0.counters["rows_in_place"] == 2


def test_in_place_writes_to_a_static_slice_moving_back_and_forth_land_exactly_once():
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("m", 100, 1, optimizer=shoal.optim.Sum())
        w1.table("m", 100, 1, optimizer=shoal.optim.Sum())
        keys = np.arange(0, 50)  # slice 0, node 0's at first
        ones = np.ones((50, 1), np.float32)
        moved = threading.Event()

        def mover() -> None:
            for to in (1, 0, 1, 0):
                w1.move_slice("m", 0, to=to)
                time.sleep(0.02)
            moved.set()

        thread = threading.Thread(target=mover)
        thread.start()
        rounds = 0
        deadline = time.monotonic() + 60
        while (not moved.is_set() or rounds < 40) and time.monotonic() < deadline:
            with t0.in_place(keys) as rows:
                rows.values[rows.slots[rows.slots >= 0]] += 1.0
            t0.push(keys[rows.absent], ones[rows.absent])
            rounds += 1
        thread.join()
        assert 0 < t0.counters["rows_in_place"] < 50 * rounds  # some rounds found the slice away
        np.testing.assert_array_equal(w1.table("m", 100, 1, optimizer=shoal.optim.Sum()).pull(keys)[:, 0], rounds)


def test_what_is_written_in_place_to_an_essp_slice_reaches_its_readers_eagerly():
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        options = dict(optimizer=shoal.optim.Sum(), consistency=shoal.ESSP(2))
        t0, t1 = w0.table("e", 40, 1, **options), w1.table("e", 40, 1, **options)
        keys = np.arange(5)  # node 0's slice
        assert (t1.pull(keys) == 0).all()  # node 1 caches them and hears of their changes
        with t0.in_place(keys) as rows:
            rows.values[rows.slots] += 5.0
        for _ in range(3):
            w0.advance_clock()
            w1.advance_clock()
        wait_until(lambda: (t1.pull(keys) == 5.0).all())


def test_without_local_access_every_key_is_absent():
    with ThreadCluster(nodes=1) as c:
        t = c.worker(0, local_access=False).table("a", 10, 2, techniques="auto")
        with t.in_place([1, 2]) as rows:
            assert rows.values.shape == (0, 2)
            np.testing.assert_array_equal(rows.slots, -1)
            np.testing.assert_array_equal(rows.absent, [0, 1])


def test_a_row_held_in_place_does_not_move_away_until_the_block_ends_and_what_was_written_goes_with_it():
    with ThreadCluster(nodes=2) as c:
        t0 = c.worker(0).table("m", 40, 2, techniques="relocation")
        t1 = c.worker(1).table("m", 40, 2, techniques="relocation")
        keys = np.arange(0, 40, 2)  # node 0's
        asked = threading.Event()
        with t0.in_place(keys) as rows:
            mover = threading.Thread(target=lambda: (t1.localize(keys), asked.set()))
            mover.start()
            asked.wait(10)
            time.sleep(0.3)  # node 1 asked for them meanwhile: they stay until the block ends
            assert (c.servers[0].adaptive.tables["m"].presence[keys] == OWNED).all()
            rows.values[rows.slots] += 5.0
        mover.join()
        wait_until(lambda: (c.servers[1].adaptive.tables["m"].presence[keys] == OWNED).all())
        np.testing.assert_array_equal(t1.pull(keys), 5.0)


def test_a_nodes_server_goes_on_serving_rows_held_in_place_and_what_it_adds_meanwhile_lands_once():
    with ThreadCluster(nodes=2) as c:
        t0 = c.worker(0).table("m", 40, 1, techniques="relocation")
        t1 = c.worker(1).table("m", 40, 1, techniques="relocation")
        keys = np.arange(0, 40, 2)  # node 0's
        seen: list[np.ndarray] = []
        served = threading.Event()

        def other_node() -> None:
            t1.push(keys, np.ones((20, 1), np.float32))  # to rows held on node 0
            seen.append(t1.pull(keys))
            served.set()

        with t0.in_place(keys) as rows:
            rows.values[rows.slots] += 5.0
            thread = threading.Thread(target=other_node)
            thread.start()
            answered_while_held = served.wait(10)  # node 0's server must not wait for the block
            rows.values[rows.slots] += 5.0
        thread.join()
        assert answered_while_held
        np.testing.assert_array_equal(seen[0], 6.0)  # the row as held, and the push beside it
        np.testing.assert_array_equal(t1.pull(keys), 11.0)
        store = c.servers[0].adaptive.tables["m"].store  # the push waits beside each row until its next write
        np.testing.assert_array_equal(store.values[keys, 0] + store.arrived[keys] * store.incoming[keys, 0], 11.0)


def test_a_row_another_worker_holds_is_elsewhere_for_a_block_and_its_pushes_wait_beside_it():
    with ThreadCluster(nodes=1, workers_per_node=2) as c:
        t0 = c.worker(0).table("m", 10, 1, techniques="auto")
        t1 = c.worker(1).table("m", 10, 1, techniques="auto")
        keys = np.arange(10)
        with t0.in_place(keys[:6]) as rows:
            with t1.in_place(keys) as other:
                np.testing.assert_array_equal(other.absent, np.arange(6))  # held by the first block
                other.values[other.slots[6:]] += 1.0
            t1.push(keys[other.absent], np.full((6, 1), 2.0, np.float32))  # no message: beside the rows
            np.testing.assert_array_equal(t1.pull(keys[:6]), 2.0)  # what it pushed, with the held rows
            rows.values[rows.slots] += 3.0
        np.testing.assert_array_equal(t0.pull(keys), [[5.0]] * 6 + [[1.0]] * 4)
        assert t1.counters["requests"] == 0


def test_what_is_written_in_place_to_a_replica_reaches_its_owner_once():
    with ThreadCluster(nodes=2) as c:
        w0, w1 = c.worker(0), c.worker(1)
        t0 = w0.table("r", 20, 1, techniques="replication", sync_ms=5)
        t1 = w1.table("r", 20, 1, techniques="replication", sync_ms=5)
        hot = np.arange(0, 20, 2)  # node 0's, wanted by node 1 too: node 1 holds replicas
        for t, w in ((t0, w0), (t1, w1)):
            t.intent(hot, w.clock, w.clock + 1000)
        assert t1.wait_local(hot, timeout=20) == 0
        assert (c.servers[1].adaptive.tables["r"].presence[hot] == REPLICA).all()
        for _ in range(5):
            with t1.in_place(hot) as rows:
                rows.values[rows.slots] += 1.0
            with t0.in_place(hot) as rows:
                rows.values[rows.slots] += 10.0
        assert t1.counters["replica_rows_in_place"] == 50
        wait_until(lambda: (c.servers[0].adaptive.tables["r"].store.values[hot, 0] == 55.0).all())
        time.sleep(0.1)  # later syncs add nothing more
        np.testing.assert_array_equal(c.servers[0].adaptive.tables["r"].store.values[hot, 0], 55.0)


@pytest.mark.parametrize("technique", ["relocation", "auto"])
def test_in_place_updates_from_four_processes_while_keys_move_and_replicate_land_exactly_once(tmp_path, technique):
    script = str(Path(__file__).resolve().parents[1] / "scripts" / "in_place_worker.py")
    rounds = 60
    proc = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--workers-per-node",
                           "2", "--", sys.executable, script, str(tmp_path), str(rounds), technique],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "counts.json").read_text())
    np.testing.assert_array_equal(result["counts"], 4.0 * rounds)  # each worker added 1 to each key each round
    workers = [json.loads((tmp_path / f"worker{rank}.json").read_text()) for rank in range(4)]
    assert min(w["rows_in_place"] for w in workers) > 0
    moved = sum(s["adaptive"]["moving"].get("keys_relocated_here", 0) for s in result["servers"])
    assert moved > 100  # keys really moved while rows were written in place
    if technique == "auto":
        assert sum(w["replica_rows_in_place"] for w in workers) > 0


def test_a_checkpoint_holds_what_was_pushed_beside_rows_held_in_place_once(tmp_path):
    """A push to rows another worker holds waits beside them after the block (no writer took them
    since); the checkpoint reads the rows with it, once."""
    ready, pushed = threading.Event(), threading.Event()
    keys = np.arange(10)
    with ThreadCluster(nodes=1, workers_per_node=2) as c:
        store = []

        def body(w):
            t = w.table("m", 10, 1, techniques="auto", init=shoal.Constant(0.0))
            w.barrier()
            if w.rank == 0:
                with t.in_place(keys[:6]) as rows:
                    ready.set()
                    assert pushed.wait(10)
                    rows.values[rows.slots] += 3.0
            else:
                assert ready.wait(10)
                t.push(keys[:6], np.full((6, 1), 2.0, np.float32))  # beside the held rows
                pushed.set()
            w.barrier()
            if w.rank == 0:
                store.append(c.servers[0].adaptive.tables["m"].store)
                assert store[0].arrived[:6].all() and store[0].values[0, 0] == 3.0  # still beside
            w.barrier()
            w.checkpoint(tmp_path)

        c.run_workers(body)
    with ThreadCluster(nodes=1) as fresh:
        w = fresh.worker(0)
        t = w.table("m", 10, 1, techniques="auto", init=shoal.Constant(0.0))
        w.restore(tmp_path)
        np.testing.assert_array_equal(t.pull(keys)[:, 0], [5.0] * 6 + [0.0] * 4)


def test_two_processes_holding_rows_in_place_never_share_a_place_in_the_table_of_holds() -> None:
    # ``pin_in_place`` picks a free place in ``holds`` (a read, then a write of the process id). Under
    # the row locks of the hold's own keys only, two processes holding keys of other lock stripes
    # picked the same place at once (about twice a second here): the first to end freed it while the
    # other still held its rows pinned under that number, for a third hold to take them as its own.
    import os
    import time
    import uuid

    from shoal.api.config import TableSpec
    from shoal.placement.adaptive_table import AdaptiveTable
    from shoal.storage.in_place import RowsInPlace

    spec = TableSpec("t", num_keys=64, dim=2, techniques="relocation", init=shoal.Constant(0.0))
    table = AdaptiveTable(spec, 0, 1, uuid.uuid4().hex[:12])
    store = table.store
    warm = RowsInPlace(store, np.array([0]))
    warm.open()
    warm.close()
    seconds = 3.0
    pids = []
    try:
        for key in (1, 2):  # stripes 1 and 2: the two holds never wait for each other
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    keys, me, end = np.array([key]), os.getpid(), time.monotonic() + seconds
                    while time.monotonic() < end:
                        hold = RowsInPlace(store, keys)
                        hold.open()
                        shared = store.holds[hold._hold] != me or store.pinned[key] != hold._hold
                        hold.close()
                        if shared:
                            code = 1
                            break
                finally:
                    os._exit(code)
            pids.append(pid)
        codes = []
        deadline = time.monotonic() + seconds + 20
        for pid in pids:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes.append(os.waitstatus_to_exitcode(status))
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    codes.append(-9)
                    break
                time.sleep(0.05)
        pids = []
        assert codes == [0, 0], f"a hold found its place in the table of holds taken by another process: {codes}"
    finally:
        for pid in pids:
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        table.close()


def test_a_hold_made_before_another_is_entered_does_not_hang_a_pull_inside_the_block():
    """``Table._check_not_held`` looks at the last hold made only; a pull inside the block of an earlier
    one takes the slice's (non-reentrant) thread lock that the block holds: it waits forever instead of
    raising ``TableError``."""
    with ThreadCluster(nodes=2) as c:
        t0 = c.worker(0).table("s", 40, 2)
        c.worker(1).table("s", 40, 2)
        keys = np.array([3, 7])  # node 0's slice
        first = t0.in_place(keys)
        t0.in_place(keys)  # made, never entered
        outcome: dict[str, object] = {}

        def body() -> None:
            try:
                with first:
                    outcome["rows"] = t0.pull(keys)
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome["error"] = exc

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        thread.join(5.0)
        hung = thread.is_alive()
        if hung:  # let the stuck thread go (a threading.Lock may be released by any thread)
            first.__exit__(None, None, None)
            thread.join(5.0)
        assert not hung, "a pull inside an in_place block waited 5 s on the block's own lock"
        assert isinstance(outcome.get("error"), shoal.TableError), outcome


_HELD_WHILE_SERVER_DIES = r'''
import json, os, select, signal, sys
import numpy as np
import shoal
from shoal.cluster.fdshare import fetch_fds, socket_name

out, kind = sys.argv[1], sys.argv[2]
ps = shoal.init()
options = {"techniques": "relocation"} if kind == "adaptive" else {}
t = ps.table("h", 10, 1, optimizer=shoal.optim.Sum(), **options)
reply, fds = fetch_fds(socket_name(ps.cluster.cluster_id, ps.node), {"clocks": True})
for fd in fds:
    os.close(fd)
server = int(reply["pid"])
result = {}
try:
    with t.in_place(np.arange(10)) as rows:
        gone = os.pidfd_open(server)
        os.kill(server, signal.SIGKILL)
        select.select([gone], [], [], 30)  # readable once the server has ended
        rows.values[rows.slots[rows.slots >= 0]] += 1.0  # into the dead server's memory
    result["in_place"] = "ended without an error"
except Exception as exc:
    result["in_place"] = type(exc).__name__
try:
    t.push(np.arange(10), np.ones((10, 1), np.float32))
    result["push"] = "acknowledged"
except Exception as exc:
    result["push"] = type(exc).__name__
with open(os.path.join(out, "result.json"), "w") as fh:
    json.dump(result, fh)
os._exit(0)
'''


@pytest.mark.parametrize("kind", ["adaptive", "static"])
def test_rows_written_in_place_while_the_nodes_server_died_are_not_acknowledged(tmp_path, kind):
    """Once this node's server has died its shared memory is nobody's: a write into it is lost and may
    not be acknowledged (a local pull or push raises ``ClusterError``). ``Table.in_place`` checked the
    server only when the block began: a server killed during the block left the writes made in it in
    the dead server's memory, and the block ended as if they had landed. The end of the block checks
    again."""
    import json
    import subprocess
    import sys

    script = tmp_path / "held.py"
    script.write_text(_HELD_WHILE_SERVER_DIES)
    proc = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "1", "--workers-per-node",
                           "1", "--on-server-failure", "continue", "--", sys.executable, str(script), str(tmp_path),
                           kind], capture_output=True, text=True, timeout=180)
    result_file = tmp_path / "result.json"
    assert result_file.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(result_file.read_text())
    assert result["push"] == "ClusterError", result  # the node's server is known dead to the worker
    assert result["in_place"] == "ClusterError", (
        f"writes in place into the memory of a server that died during the block were acknowledged: {result}")
