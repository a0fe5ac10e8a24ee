"""Operation codes. Values are part of the protocol: never renumber, only append."""

from __future__ import annotations

from enum import IntEnum

# 3: a placement batch may carry several tables' messages (an older peer would apply them to the first)
# 4: a replica's sync and each answer name their part of it (an older peer counted answers, and lost count)
# 5: "moved" may say a push_pull's push went in (an older worker sent the push again: applied twice)
# 6: a replicated push names its worker's lowest open push (``floor``): no replica gives up one above it
# 7: a replica's gaps are the numbers of the updates it lacks (a count before), gossip may carry fills,
#    and a TOTALS reply counts each origin's gaps (an older peer took two different states for one)
# 8: the tag ends frame 0 instead of being a frame of its own (an older peer takes it for part of the header)
# 9: a placement announcement is numbered among its node's, and a key's state carries the last of each
#    node's taken (an older peer misreads both)
PROTOCOL_VERSION = 9


class Op(IntEnum):
    # replies
    OK = 1
    VALUES = 2
    ERROR = 3
    # cluster
    REGISTER = 10
    CLUSTER_STATUS = 11
    BARRIER = 12
    LEAVE = 13
    PING = 14
    SHUTDOWN = 15
    # tables
    CREATE_TABLE = 20
    PULL = 21
    PUSH = 22
    PUSH_PULL = 23
    CLOCK = 24
    STATS = 25
    ROWS = 26  # server -> worker, unasked: rows changed up to a clock (ESSP)
    GOSSIP = 27  # replica -> replica: version vector and the updates the other lacks
    TOTALS = 28  # reply: per-origin running sums of rows, for a reader merging replicas
    REPLICA_STATS = 29  # what the probabilistic model needs: delays and push rates
    LOCALIZE = 30  # worker -> its node's server: move these keys here
    INTENT = 31  # worker -> its node's server: I will use these keys in clocks [start, end)
    PLACEMENT = 32  # server -> server: relocation, replication and intent traffic of adaptive tables
    LAYOUT = 33  # -> rendezvous: a table's slice owners at the current epoch, and the servers
    MOVE_SLICE = 34  # -> rendezvous: move a slice to a server (answered once it has moved)
    SLICE_STATE = 35  # server -> server: a moving slice's rows, optimiser state, clocks and subscribers
    MOVE_DONE = 36  # server -> rendezvous: a slice has been handed over (or could not be)
    DRAIN = 37  # -> rendezvous: hand a server's slices to the others, then let it leave
    CHECKPOINT = 38  # worker -> server: write your slices of these tables into a staging directory
    RESTORE = 39  # worker -> server: load the rows you own from a checkpoint
    SETTLE = 40  # worker -> server: finish the placement traffic of these adaptive tables; say if it has
    FENCE = 41  # server -> worker, unasked: a slice of this table moved here; confirm when your pushes landed
    CONFIRM = 42  # worker -> server: every push of mine routed by a layout older than this epoch has landed
    GOSSIP_PERIOD = 43  # worker -> server: gossip this replicated table's replicas at another period from now on


#: each op's name, for counters and labels on every message (an enum member's ``.name`` is a
#: property lookup that costs more than the dictionary)
OP_NAMES: dict[Op, str] = {op: op.name for op in Op}


class Flag:
    """Bits of the header's ``flags`` field."""

    NO_REPLY = 1  # one-way message: the receiver sends nothing back
    SIGNED = 2  # frame 0 ends with a tag over every frame (keyed BLAKE3)
    SIGNED_HEADER = 4  # frame 0 ends with a tag over the header only: for a wire only this machine reaches
