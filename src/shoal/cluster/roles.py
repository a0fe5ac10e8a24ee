"""Who may ask for what. A tag proves that a sender holds the job's secret, not which member it
is: every member holds the same secret, so the sender id is the member's own word. Checking each
op against the role of the id it names keeps a misconfigured or buggy member (or a tool pointed
at the wrong job) from acting out of its place; it does not stop a member bent on lying.

A worker asks for rows, clocks, tables and checkpoints, and names only itself
(a CLOCK or BARRIER naming another rank is refused); a server talks to other
servers (gossip, placement, slice hand-over) and reports to the rendezvous; an
observer (``shoal status``) only reads; an operator's tool may also move slices
and drain servers, as a worker may.
"""

from __future__ import annotations

from enum import Enum

from shoal.api.errors import RoleError
from shoal.api.ids import OBSERVER, OPERATOR, server_node, server_sender
from shoal.wire.message import Message
from shoal.wire.ops import Op


class Role(Enum):
    WORKER = "worker"
    SERVER = "server"
    OBSERVER = "observer"
    OPERATOR = "operator"


_WORKER = frozenset({Role.WORKER})
_SERVER = frozenset({Role.SERVER})
_ANYONE = frozenset(Role)
_ADMIN = frozenset({Role.WORKER, Role.OPERATOR})

#: what a server serves, and to whom
SERVER_OPS: dict[Op, frozenset[Role]] = {
    **dict.fromkeys((Op.PULL, Op.PUSH, Op.PUSH_PULL, Op.CLOCK, Op.CONFIRM, Op.LOCALIZE, Op.INTENT, Op.GOSSIP_PERIOD,
                     Op.CREATE_TABLE, Op.CHECKPOINT, Op.RESTORE, Op.SETTLE, Op.SHUTDOWN), _WORKER),
    **dict.fromkeys((Op.GOSSIP, Op.PLACEMENT, Op.SLICE_STATE), _SERVER),
    **dict.fromkeys((Op.STATS, Op.PING, Op.REPLICA_STATS), _ANYONE),
}

#: what the rendezvous serves, and to whom (REGISTER and LEAVE: the member the body names)
RENDEZVOUS_OPS: dict[Op, frozenset[Role]] = {
    **dict.fromkeys((Op.BARRIER, Op.CREATE_TABLE, Op.SHUTDOWN), _WORKER),
    **dict.fromkeys((Op.MOVE_SLICE, Op.DRAIN), _ADMIN),
    Op.MOVE_DONE: _SERVER,
    **dict.fromkeys((Op.CLUSTER_STATUS, Op.LAYOUT, Op.PING, Op.REGISTER, Op.LEAVE), _ANYONE),
}


class Roles:
    """The members of one job, by sender id. ``num_nodes`` grows as servers join a running job."""

    def __init__(self, num_workers: int, num_nodes: int) -> None:
        self.num_workers, self.num_nodes = num_workers, num_nodes

    def role_of(self, sender: int) -> Role | None:
        if 0 <= sender < self.num_workers:
            return Role.WORKER
        if server_node(sender, self.num_nodes + 1) is not None:  # a server may be joining
            return Role.SERVER
        if sender == OBSERVER:
            return Role.OBSERVER
        if sender == OPERATOR:
            return Role.OPERATOR
        return None

    def check(self, msg: Message, rules: dict[Op, frozenset[Role]]) -> None:
        """Raise ``RoleError`` unless ``msg``'s sender may send it (ops missing from ``rules``
        pass here and are refused by the handler as not served)."""
        needed = rules.get(msg.op)
        if needed is None:
            return
        role = self.role_of(msg.sender)
        if role is None:
            raise RoleError(f"{msg.op.name} from sender {msg.sender}, which is no member of this job "
                            f"({self.num_workers} workers, {self.num_nodes} servers)")
        if role not in needed:
            raise RoleError(f"{msg.op.name} is for {' or '.join(sorted(r.value for r in needed))}; sender "
                            f"{msg.sender} is {role.value}")
        if msg.op in (Op.CLOCK, Op.BARRIER):
            self.names_itself(msg, "rank", msg.body.get("rank"))
        elif msg.op in (Op.REGISTER, Op.LEAVE) or (msg.op == Op.CLUSTER_STATUS and "role" in msg.body):
            self._claims(msg)  # a server's status report counts as its heartbeat and load

    def names_itself(self, msg: Message, field: str, value: object) -> None:
        if value != msg.sender:
            raise RoleError(f"{msg.op.name} from worker {msg.sender} names {field} {value!r}: a worker speaks "
                            "only for itself")

    def _claims(self, msg: Message) -> None:
        """REGISTER and LEAVE say which member they are for: the sender must be it."""
        role = msg.body.get("role")
        if role == "worker":
            rank = msg.body.get("rank")
            if not isinstance(rank, int) or not 0 <= rank < self.num_workers:
                raise RoleError(f"{msg.op.name} for worker rank {rank!r}, which is no rank of this job "
                                f"(0..{self.num_workers - 1})")
            self.names_itself(msg, "rank", rank)
        elif role == "server":
            node = msg.body.get("node")
            joining = msg.op == Op.REGISTER and node == self.num_nodes  # the next node, joining now
            if not isinstance(node, int) or not (0 <= node < self.num_nodes or joining):
                raise RoleError(f"{msg.op.name} for server {node!r}, which is no server of this job "
                                f"(0..{self.num_nodes - 1})")
            if msg.sender != server_sender(node):
                raise RoleError(f"{msg.op.name} for server {node} from sender {msg.sender}: a server speaks "
                                "only for itself")
        else:
            raise RoleError(f"{msg.op.name} for role {role!r}: members are workers and servers")
