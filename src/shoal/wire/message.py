"""The one data model for all traffic: a typed header plus raw arrays."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.wire.ops import Op


@dataclass(slots=True)
class Message:
    """One request or reply.

    ``req`` pairs a reply with its request; ``sender`` is the node or worker id
    of the peer that wrote it; ``incarnation`` names the requester's stream of
    requests (``req`` only grows within one, and a receiver serves each
    (sender, incarnation, req) once, whatever connection it came by); ``body`` holds small op-specific fields (checked
    per op by ``wire.schema``); ``arrays`` travel as raw frames.
    """

    op: Op
    req: int = 0
    table: str = ""
    epoch: int = 0
    clock: int = 0
    sender: int = -1
    incarnation: int = 0
    flags: int = 0
    body: dict[str, Any] = field(default_factory=dict)
    arrays: list[np.ndarray] = field(default_factory=list)

    def reply(self, op: Op = Op.OK, body: dict[str, Any] | None = None,
              arrays: list[np.ndarray] | None = None, sender: int = -1) -> Message:
        return Message(op=op, req=self.req, table=self.table, epoch=self.epoch, sender=sender,
                       incarnation=self.incarnation, body=body or {}, arrays=arrays or [])
