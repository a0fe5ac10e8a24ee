"""A server charges its request loop's CPU to what it did: each op's messages, each timer."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from shoal import Normal, TableSpec
from shoal.wire import Message, Op
from tests.support.live_server import LiveServer, RawClient

SPEC = TableSpec("t", num_keys=16, dim=4, init=Normal(std=1.0), seed=1)


def test_every_message_is_charged_once_to_its_op_and_the_parts_fit_in_the_loop_threads_cpu(
        start_server: Callable[..., LiveServer], connect: Callable[..., RawClient]) -> None:
    client = connect(start_server())
    client.create_table(SPEC)
    keys = np.arange(4, dtype=np.int64)
    for _ in range(7):
        client.pull(keys)
    for _ in range(3):
        client.push(keys, np.ones((4, 4), np.float32))
    client.send_frames([b"not a message"])
    assert client.reply().op == Op.ERROR

    stats = client.call(Message(Op.STATS)).body  # charged after it answers: not in its own counts
    use = stats["cpu"]
    activities = {name: count for name, (count, _) in use["activities"].items() if not name.startswith("timer")}
    assert activities == {"CREATE_TABLE": 1, "PULL": 7, "PUSH": 3, "malformed": 1}
    assert all(seconds > 0 for count, seconds in use["activities"].values() if count >= 3)
    timers = {name for name in use["activities"] if name.startswith("timer")}
    assert {"timer sync", "timer adaptive", "timer replication"} <= timers  # no heartbeat: registered nowhere
    charged = sum(seconds for _, seconds in use["activities"].values())
    assert 0 < charged <= use["loop_s"]  # the rest of the loop thread's CPU: waiting for and reading messages


def test_a_loop_waiting_for_a_table_being_built_wakes_once_a_millisecond_not_in_a_spin(
        start_server: Callable[..., LiveServer], connect: Callable[..., RawClient]) -> None:
    """While a table is built off the loop, the loop looks for it every millisecond. ZeroMQ waits in
    whole milliseconds, and a wait just under one was truncated to none: the loop ran its timers
    tens of thousands of times a second for the whole build, taking the CPU (and the interpreter's
    lock) from the thread building the table."""
    client = connect(start_server())
    client.create_table(SPEC)  # numba's kernels loaded: the build below is the rows alone

    def passes() -> int:
        return int(client.call(Message(Op.STATS)).body["cpu"]["activities"]["timer builds"][0])

    before = passes()
    start = time.monotonic()
    client.create_table(TableSpec("big", num_keys=300_000, dim=32, init=Normal(std=1.0), seed=1))
    took = time.monotonic() - start
    woke = passes() - before
    assert woke <= 1.5 * took * 1000 + 20, f"{woke} timer passes in a build of {took:.3f} s"


def test_requests_with_no_timer_due_run_the_timers_about_every_50_ms_not_after_each_request(
        start_server: Callable[..., LiveServer], connect: Callable[..., RawClient]) -> None:
    """A pass of the timers cost a server about as much as a small request. It ran after every
    message at most every 2 ms, though between two clocks of a busy job almost none had anything
    to do; now only when a timer has (a deadline, something waiting), and every 50 ms regardless."""
    client = connect(start_server())
    client.create_table(SPEC)
    keys = np.arange(4, dtype=np.int64)

    def passes() -> int:
        return int(client.call(Message(Op.STATS)).body["cpu"]["activities"]["timer builds"][0])

    before, start, requests = passes(), time.monotonic(), 0
    while requests < 2000 and (requests < 200 or time.monotonic() - start < 0.5):
        client.pull(keys)
        requests += 1
    took = time.monotonic() - start
    ran = passes() - before
    assert ran <= took / 0.05 + 5, f"{ran} timer passes in {took:.3f} s of {requests} requests"
