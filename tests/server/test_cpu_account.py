"""A server charges its request loop's CPU to what it did: each op's messages, each timer."""

from __future__ import annotations

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
