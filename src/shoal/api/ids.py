"""The id spaces of a job, in one place: who sent a message, whose pushes a replica counts.

**Senders** (a message header's ``sender``, a request tracker's peer numbers):

=====================  ==========================================================
``0 .. workers-1``     a worker, by rank
``SERVERS + node``     a server, on server-to-server messages (gossip, placement)
``RENDEZVOUS`` (-1)    the rendezvous, as the peer a tracker connects to
``OBSERVER`` (-3)      ``shoal status`` and the run-report sampler: no worker, so
                       servers keep no clock for it; it only reads
``OPERATOR`` (-4)      an operator's tool: reads, moves slices, drains servers
=====================  ==========================================================

**Origins** (the slots of a replicated shard's SumLattice): a worker's pushes
count under ``worker_origin(rank, incarnation)``, so a restarted worker is a new
origin and never collides with its earlier self.
"""

from __future__ import annotations

from typing import NewType

#: a message's sender: a worker rank, ``SERVERS + node``, ``RENDEZVOUS``, ``OBSERVER`` or ``OPERATOR``
Sender = NewType("Sender", int)
#: a SumLattice slot: whose pushes an update counts as
Origin = NewType("Origin", int)

SERVERS = 1 << 30
RENDEZVOUS = Sender(-1)
OBSERVER = Sender(-3)
OPERATOR = Sender(-4)

WORKER_ORIGINS = 1 << 40  # origins below this are reserved
#: the origin a replicated table's restored rows count as (what a checkpoint holds, over the initial rows)
RESTORED = Origin(1)
RANK_BITS = 20  # worker origin = WORKER_ORIGINS + (incarnation << RANK_BITS) + rank
MAX_RANKS = 1 << RANK_BITS
MAX_INCARNATIONS = 1 << 20

#: the shard number of an adaptive table's node-wide store (it has no shards)
ADAPTIVE_SHARD = -1


def server_sender(node: int) -> Sender:
    """The sender id of server ``node`` on server-to-server messages."""
    return Sender(SERVERS + node)


def server_node(sender: int, num_nodes: int) -> int | None:
    """The node of a server's sender id, or None if ``sender`` is no server of ``num_nodes``."""
    node = sender - SERVERS
    return node if 0 <= node < num_nodes else None


def worker_origin(rank: int, incarnation: int) -> Origin:
    """The origin of a worker's pushes: its rank and incarnation."""
    return Origin(WORKER_ORIGINS + (incarnation << RANK_BITS) + rank)
