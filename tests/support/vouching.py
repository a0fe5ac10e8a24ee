"""What servers vouch for, checked as they send it: a test where every worker pushes +1 to every key of
a table each clock knows the least each row must hold once the servers' slowest clock is ``m``.

A read that misses an update shows a bound broken only when a worker happens to read that row
then; the server that vouched for rows lacking it (in an ESSP rows message: "these rows, and the
rest of these slices unchanged, hold every update before ``m``"; in a reply: "these rows hold every
update before its clock") is caught every time it does, with the moment and the slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.server.server import ParameterServer
from shoal.wire.message import Message
from shoal.wire.ops import Op


@dataclass
class VouchWatch:
    """Rows of ``table`` vouched for at clock ``m`` must hold at least ``per_clock * min(m, clocks)``."""

    table: str
    per_clock: int
    clocks: int
    violations: list[dict[str, Any]] = field(default_factory=list)
    checked: int = 0

    def least(self, clock: int) -> float:
        return float(self.per_clock * min(clock, self.clocks))

    def check(self, server: ParameterServer, msg: Message) -> None:
        if msg.table != self.table or msg.op not in (Op.ROWS, Op.VALUES):
            return
        self.checked += 1
        least = self.least(msg.clock)
        if msg.op == Op.VALUES:
            rows = msg.arrays[0]
            if rows.size and float(rows.min()) < least:
                self.violations.append({"server": server.node, "reply at clock": msg.clock, "least": least,
                                        "holds": float(rows.min())})
            return
        served = server.tables[self.table]
        for shard in msg.body["shards"]:  # the slices whose rows not resent did not change
            store = served.stores.get(shard)
            holds = float(store.read(np.arange(store.num_rows)).min()) if store is not None else None
            if holds is None or holds < least:
                self.violations.append({"server": server.node, "rows at clock": msg.clock, "slice": shard,
                                        "least": least, "holds": holds, "clocks": server.clocks.clocks.tolist()})


def watch_vouching(servers: list[ParameterServer], watch: VouchWatch) -> VouchWatch:
    """Check what each of ``servers`` sends, in its own loop before it goes (a server reads its slices
    there, so nothing moves under the check)."""
    for server in servers:
        send = server._send

        def checked(peer: bytes, msg: Message, codec: Any, server: ParameterServer = server, send: Any = send) -> None:
            watch.check(server, msg)
            send(peer, msg, codec)

        server._send = checked  # type: ignore[method-assign]
    return watch
