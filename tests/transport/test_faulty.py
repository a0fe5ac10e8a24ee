"""The fault-injecting wrapper: seeded delay, loss, duplication and reordering."""

from __future__ import annotations

import time

import pytest

import shoal
from shoal.transport.faulty import Faults, FaultyTransport
from shoal.transport.zmq_transport import ZmqTransport


def exchange(faults: Faults, n: int = 200) -> tuple[list[int], float]:
    transport = FaultyTransport(ZmqTransport(), faults)
    listener = transport.listen("tcp://127.0.0.1:0")
    conn = transport.connect(listener.address)
    try:
        start = time.monotonic()
        for i in range(n):
            conn.send([i.to_bytes(4, "little")])
        got = []
        while True:
            item = listener.recv(0.3)
            if item is None:
                break
            got.append(int.from_bytes(item[1][0], "little"))
        return got, time.monotonic() - start
    finally:
        conn.close()
        listener.close()
        transport.close()


def test_delay_holds_messages_back():
    got, elapsed = exchange(Faults(delay_s=0.05), n=10)
    assert got == list(range(10)) and elapsed >= 0.05


def test_loss_and_duplication_follow_their_rates_and_replay_with_the_seed():
    faults = Faults(loss=0.2, duplicate=0.1, seed=11)
    first, _ = exchange(faults, n=500)
    second, _ = exchange(faults, n=500)
    assert 0.65 < len(set(first)) / 500 < 0.95
    assert len(first) > len(set(first))  # some arrived twice
    assert sorted(first) == sorted(second)  # same seed, same fate


def test_jitter_reorders():
    got, _ = exchange(Faults(jitter_s=0.01, seed=2), n=200)
    assert sorted(got) == list(range(200)) and got != list(range(200))


def test_settings_parse_and_check():
    assert Faults.parse("delay_ms=2,jitter_ms=1,loss=0.01,seed=4") == Faults(0.002, 0.001, 0.01, 0.0, 4)
    with pytest.raises(shoal.ConfigError, match="unknown fault settings"):
        Faults.parse("latency=3")
    with pytest.raises(shoal.ConfigError, match="loss must lie"):
        Faults(loss=1.5)
