"""The placement of one adaptive table at one node, as a state machine (DESIGN.md §6).

Events come in (a worker's pull, push, localisation or intent; a placement
message from another node; a tick of the clock), the state in
``AdaptiveTable`` changes, and each event returns the ``Effects`` it asks for:
placement messages to send and held worker requests to answer. No sockets and
no clock: the server reads the time and the workers' clocks, passes them in,
and carries the effects out (the thread's CPU clock is read only to count what
copying rows costs, never to decide).

Between nodes (all one-way, each kind declared in ``placement.messages``):

* ``relocate`` (requester -> home): move keys to the requester; the home
  records the new owner and asks the old one for a ``handover``;
* ``handover`` (home -> owner): give up keys; the owner sends their ``state``;
* ``state`` (old owner -> new owner): rows and interest; requests that waited
  for them are served;
* ``owner`` (owner -> home): keys an owner moved on its own (intent-driven);
* ``announce`` (node -> owner): a node's workers will (or no longer) use keys;
* ``replicate`` (owner -> node): a replica of keys;
* ``sync`` / ``synced`` (replica -> owner -> replica): the replica's change since
  the last sync, and the owner's row after adding it; with ``drop`` the replica
  goes away after its last change is in. A part for keys that moved on is
  passed to their owner, which answers it too: ``synced`` counts such parts.

A message to this node itself is taken in at once, inside the same event.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shoal.api.errors import ProtocolError
from shoal.placement import held
from shoal.placement.adaptive_table import AdaptiveTable, Answer, Effects, Send, SyncInFlight, WaitingState
from shoal.placement.intent import ACT_EVERY_S, ACTION_S, Action, smoothed_window
from shoal.placement.kernels import count_answered
from shoal.placement.messages import (
    Announce,
    Handover,
    Owner,
    PlacementMessage,
    Relocate,
    Replicate,
    State,
    Sync,
    Synced,
    array_bytes,
    array_fields,
    checked_fields,
)
from shoal.placement.ownership import MAX_HOPS, home_of
from shoal.storage.kernels import (
    OWNED,
    REPLICA,
    add_owned_and_read,
    add_present,
    any_nonfinite,
    apply_synced,
    give_unheld,
    read_present,
    receive_replicas,
    receive_rows,
    release,
    take_changes,
)
from shoal.storage.shard import ShardStore
from shoal.storage.validate import as_keys, as_rows

log = logging.getLogger(__name__)

SYNC_HOPS = 16  # a replica's change chasing a key that keeps moving: after this many hops it is logged and lost
HANDOVER_HOPS = 16  # the same for a handover
ANNOUNCE_HOPS = 16  # ... and for an announcement
HOLD_CHECK_S = 1.0  # how often a server looks for rows held in place by a process that died
# Tables without a sync period of their own: replicas sync at each clock of the node's workers, at
# most this often (a sync costs a server about a millisecond of CPU per 800 KB of changed rows) ...
SYNC_MIN_MS = 10.0
SYNC_MAX_MS = 50.0  # ... and at least this often (clocks that stand still)
# The node's clock is read from its workers' slots in shared memory, which wake nobody: a server with
# such replicas looks at it this long after finding it standing still, then again as long after as it
# has stood still (a look costs a pass of the timers, 55 us alone and two to four times that in a job:
# at every 5 ms, 1-3% of a core while the clocks stood still for good).
CLOCK_LOOK_MS = 5.0
ROUND_SLACK_S = 0.01  # a round of intents waits this long at most for the replicas' sync to go with it
# A sync's answer brings back the owner's rows of the keys it carries. A replica only read here would
# never be carried (it has no change), so each sync to an owner also carries one in this many of its
# other replicas, in turn: a replica is at most this many of its owner's syncs behind the owner's row.
REFRESH_ROUNDS = 8


class PlacementMachine:
    """Decisions about where the keys of one adaptive table live, at one node."""

    def __init__(self, table: AdaptiveTable) -> None:
        self.table = table
        self.node = table.node
        #: how often this node acts on the table's intents at most (its ``act_ms``, or ``ACT_EVERY_S``)
        self.act_every_s = ACT_EVERY_S if table.spec.act_ms is None else table.spec.act_ms / 1000.0
        self._effects = Effects()
        self._now = 0.0
        self._node_clock = 0  # the slowest clock of this node's workers, as last heard
        self._reach = 1  # how many clocks ahead the last round of intents took in
        #: since when the node's clock has been seen standing still at the last sync's (None: it moved)
        self._still_since: float | None = None

    # ----------------------------------------------------------------- events

    def pull(self, keys: np.ndarray, ticket: object, now: float) -> Effects:
        """A worker's pull of ``keys`` (checked): answered now, or held for rows on their way here."""
        self._now = now
        self._answer(held.serve_pull(self.table, keys, ticket, now))
        return self._take()

    def push(self, keys: np.ndarray, grads: np.ndarray, ticket: object, now: float) -> Effects:
        """A worker's push (keys and finite rows checked)."""
        self._now = now
        self._answer(held.serve_push(self.table, keys, grads, ticket, now))
        return self._take()

    def localize(self, keys: np.ndarray) -> Effects:
        """A local worker asks for keys to live here: ask their homes."""
        table = self.table
        keys = keys[(table.presence[keys] != OWNED) & ~table.incoming[keys]]
        if keys.size:
            table.incoming[keys] = True
            table.stats["localize_requested"] += int(keys.size)
            homes = home_of(keys, table.num_nodes)
            for home in np.unique(homes):
                self._send(int(home), Relocate(keys[homes == home], self.node))
        return self._take()

    def intend(self, keys: np.ndarray, start: int, end: int) -> None:
        """A local worker will use ``keys`` during clocks ``[start, end)``: acted on when they come near."""
        self.table.intents.add(keys, start, end)

    def receive(self, sender: int, message: PlacementMessage, now: float, node_clock: int) -> Effects:
        """A placement message from the server of node ``sender`` (its fields and arrays were checked
        against its kind's declaration on arrival; node numbers, counts and rows are checked here);
        ``node_clock``: the slowest clock of this node's workers, as heard now.

        Raises:
            ProtocolError: a node that is no node of the table, a count out of range, NaN/Inf rows.
        """
        self._now = now
        self._node_clock = node_clock
        self._receive(sender, message)
        return self._take()

    def tick(self, now: float, node_clock: int, clock_s: float) -> Effects:
        """Act on intents that came into the window (``node_clock``: the slowest clock of this node's
        workers; ``clock_s``: seconds per clock lately), sync replicas when due, and answer requests
        that waited too long."""
        table = self.table
        self._now = now
        self._node_clock = node_clock
        if node_clock > table.synced_clock:
            self._still_since = None
        elif self._still_since is None:
            self._still_since = now
        syncing = self._sync_due(now, node_clock)
        self._act_on_intents(node_clock, clock_s, syncing)
        if now >= table.next_hold_check:
            table.next_hold_check = now + HOLD_CHECK_S
            self._let_go_of_the_dead()
        if table.held_back:
            self._give_held_later()
        if syncing:
            table.next_sync = self._next_on_grid(now)
            table.synced_at, table.synced_clock = now, node_clock
            self._sync()
        for answer in held.expire_held(table, now):
            self._answer(answer)
        return self._take()

    def due(self, now: float, node_clock: int, clock_s: float) -> bool:
        """Whether ``tick`` would find anything to do: a sync, a round of intents, a hold check, a
        deadline of ``next_wake``, or rows and requests that wait for a later pass (it changes nothing).
        Between two clocks of a busy job most passes of the server's loop find nothing; asking this
        first spares them."""
        table = self.table
        if table.held or table.held_back or now >= table.next_hold_check or now >= self.next_wake():
            return True
        if self._sync_due(now, node_clock):
            return True
        if table.spec.techniques == "static":
            return False
        window = table.window if node_clock == table.acted_at else \
            math.ceil(smoothed_window(ACTION_S, clock_s, table.window_estimate))
        stride = self._stride(clock_s)
        return ((table.intents.starts_within(node_clock, window)
                 or self._round_due(now, node_clock, clock_s, stride, False))
                and table.intents.any_due(node_clock, window + stride - 1))

    def _stride(self, clock_s: float) -> int:
        """Clocks between two rounds of intents: ``act_every_s`` of them (one, while no clock was timed)."""
        return max(1, math.ceil(self.act_every_s / clock_s)) if clock_s > 0 else 1

    def _round_due(self, now: float, clock: int, clock_s: float, stride: int, syncing: bool) -> bool:
        """Whether a round of intents is due: every ``stride`` clocks or ``act_every_s``, whichever comes
        first. It goes with the last sync of the replicas before it is due, so that the announcements
        and the sync travel to a peer in one message and come back answered in one; alone only when
        no sync comes within ``ROUND_SLACK_S`` of it."""
        table = self.table
        if table.next_action - stride <= clock < table.next_action:
            due_s = min(table.next_action_s, now + (table.next_action - clock) * clock_s)
        else:  # a stride of clocks passed (or a clock was set back)
            due_s = now
        if syncing:
            return due_s < self._sync_after(now, clock_s)  # the next sync would come after it
        return due_s <= now and self._sync_after(table.synced_at, clock_s) > now + ROUND_SLACK_S

    def _sync_after(self, then: float, clock_s: float) -> float:
        """About when the replicas sync next after a sync at ``then``: on the grid of the table's period;
        with none, a clock of the node's workers later (``SYNC_MIN_MS`` at the soonest) or on the grid of
        ``SYNC_MAX_MS``, whichever comes first (only the grid while no replica is here: ``_sync_due``)."""
        grid = self._next_on_grid(then)
        if self.table.spec.sync_ms is not None or not self.table.holds_replicas:
            return grid
        return min(grid, then + max(clock_s, SYNC_MIN_MS / 1000.0))

    def _next_on_grid(self, then: float) -> float:
        """The sync after ``then`` at the latest, on a grid of the table's period (``SYNC_MAX_MS`` without
        one): the tables with one period sync in the same pass, and their syncs to a node go as one
        message."""
        period = (self.table.spec.sync_ms or SYNC_MAX_MS) / 1000.0
        return (math.floor(then / period) + 1) * period

    def next_wake(self) -> float:
        """When this table's timer must run next: at its sync period's next tick and, for a table
        without one that holds replicas, once a sync by the node's clock may be due (``SYNC_MIN_MS``
        after the last sync; a clock found standing still is looked at again ``CLOCK_LOOK_MS`` later,
        then as long again as it has stood still, until it moves). Workers whose reads
        never wait on clocks tick at most every quiet period (``client.ticks``), and their server reads
        the clocks between in shared memory; a server that slept until its next message or period
        synced replicas twice per 50 ms at most, not at each clock."""
        table = self.table
        if table.spec.sync_ms is not None or not table.holds_replicas:
            return table.next_sync
        by_clock = table.synced_at + SYNC_MIN_MS / 1000.0
        if self._still_since is not None:  # the clock stood still at the last look: look again later
            by_clock = max(by_clock, self._now + max(CLOCK_LOOK_MS / 1000.0, self._now - self._still_since))
        return min(table.next_sync, by_clock)

    def _sync_due(self, now: float, node_clock: int) -> bool:
        """A table's own period is due; with none, a clock of the node's workers since the last sync
        (no sooner than ``SYNC_MIN_MS`` after it) or ``SYNC_MAX_MS`` since it. A period in time alone
        bounds a replica's age, not the updates it misses: a fast job on small hot tables (an epoch of
        MovieLens 100k or Kinships in 15-50 ms) read rows more than an epoch behind at 50 ms. A table
        holding no replica here has nothing to send by the clock: it looks for replicas on the grid
        (the node owning a hot table's rows looked at every clock, in a pass of its own)."""
        table = self.table
        if now >= table.next_sync:
            return True
        return (table.spec.sync_ms is None and table.holds_replicas and node_clock > table.synced_clock
                and now >= table.synced_at + SYNC_MIN_MS / 1000.0)

    def settle(self, now: float) -> tuple[Effects, list[str]]:
        """Before a checkpoint: send replicas' changes to their owners now; what still keeps the owned
        rows here from being final."""
        self._now = now
        self._sync()
        return self._take(), self.unsettled()

    def unsettled(self) -> list[str]:
        table = self.table
        assert table.store.changed is not None
        why = []
        replicas = np.flatnonzero(table.presence == REPLICA)
        if replicas.size and table.store.changed[replicas].any():
            why.append("replicas have changes not yet sent to their owners")
        # A sync that only refreshes replicas carries no change a checkpoint waits for (the timer sends
        # one every period, and this would never be empty between them).
        changing = sum(flight.changes for flight in table.syncs_in_flight.values())
        if changing:
            why.append(f"{changing} replica sync(s) unanswered")
        if table.waiting_states:
            why.append(f"{int(table.state_waits.sum())} key(s) came while their replica's sync is unanswered")
        if table.incoming.any() or table.deferred_syncs or table.deferred_handovers:
            why.append(f"{int(table.incoming.sum())} key(s) on their way here")
        if table.held:
            why.append(f"{len(table.held)} request(s) waiting for keys")
        assert table.store.pinned is not None
        if table.held_back or table.store.pinned.any():
            why.append("rows are held in place by a worker")
        return why

    def _let_go_of_the_dead(self) -> None:
        """Let go of the rows a process pinned (``Table.in_place``) if it died holding them, so that
        they can move again (what arrived beside them goes in with their next write)."""
        store = self.table.store
        assert store.pinned is not None and store.holds is not None
        for hold in np.flatnonzero(store.holds != 0).tolist():  # a copy first: holds begin and end meanwhile
            pid = int(store.holds[hold])
            if pid and not _process_alive(pid):
                with store.hold(None, exclusive=True):
                    release(store.pinned, store.holds, hold, np.flatnonzero(store.pinned == hold))
                self.table.stats["holds_of_dead_processes_ended"] += 1
                log.warning("server %d: a process that died held rows of %r in place: let go",
                            self.node, self.table.spec.name)

    @contextlib.contextmanager
    def _moving_rows(self, exclusive: bool) -> Iterator[None]:
        """The store held while rows are copied in or out of it, the thread's CPU meanwhile counted
        (``rows_cpu_us``): what moving rows costs this server, beside the bytes each kind sends."""
        started = time.thread_time()
        try:
            with self.table.store.hold(None, exclusive=exclusive):
                yield
        finally:
            self.table.stats["rows_cpu_us"] += round((time.thread_time() - started) * 1e6)

    def _take(self) -> Effects:
        effects, self._effects = self._effects, Effects()
        return effects

    def _answer(self, answer: Answer | None) -> None:
        if answer is not None:
            self._effects.answers.append(answer)

    def _send(self, node: int, message: PlacementMessage) -> None:
        if node == self.node:  # to ourselves: no message
            self._receive(self.node, message)
        else:
            stats = self.table.stats
            stats[f"placement_{message.kind}_sent"] += 1
            stats[f"placement_{message.kind}_keys_sent"] += message.keys.shape[0]
            stats[f"placement_{message.kind}_bytes_sent"] += array_bytes(message)
            self._effects.sends.append(Send(self.table.spec.name, node, message))

    def _receive(self, sender: int, message: PlacementMessage) -> None:
        try:
            message = self._checked(sender, message)
        except ValueError as exc:
            raise ProtocolError(f"malformed placement message {message.kind!r}: {exc}") from None
        match message:
            case Relocate():
                self._relocate_at_home(message.keys, message.to)
            case Handover():
                self._handover(message.keys, message.epochs, message.to, message.hops)
            case Owner():
                self._learn_owner(message.keys, message.owner, message.epochs, message.steps)
            case Announce():
                self._announce(message.keys, message.active, message.node, message.generation, message.hops)
            case State():
                self._receive_state(message.keys, message.rows, message.interest, message.generations,
                                    message.replicas, message.epochs, message.steps)
            case Replicate():
                self._receive_replica(message.keys, message.rows, sender)
            case Sync():
                self._sync_at_owner(message.keys, message.rows, message.drop, message.origin, message.target,
                                    message.hops, message.part, message.parent)
            case Synced():
                self._synced(message.keys, message.rows, message.drop, message.target, message.parts, message.part,
                             message.parent)

    def _checked(self, sender: int, message: PlacementMessage) -> PlacementMessage:
        """``message`` with its keys, rows and integer arrays as the table uses them, once its node
        numbers and counts are in range and its rows finite (a peer sending NaN/Inf is broken: nothing
        of it is applied). Arrays off the wire are so already: the message is then taken as it came."""
        table = self.table
        num_nodes = table.num_nodes
        _node(sender, num_nodes)
        cls = type(message)
        for name, holds in checked_fields(cls):
            _CHECKS[holds](getattr(message, name), num_nodes)
        keys = as_keys(message.keys, table.spec)
        fixed: dict[str, np.ndarray] = {} if keys is message.keys else {"keys": keys}
        for name, kind, _ in array_fields(cls)[1:]:
            value = getattr(message, name)
            if name == "rows":
                taken = as_rows(value, keys.shape[0], table.spec, strict_dtype=True)
                if any_nonfinite(taken):
                    log.error("server %d: %s message of %r from server %d carries NaN/Inf: dropped",
                              self.node, message.kind, table.spec.name, sender)
                    raise ProtocolError(f"placement {message.kind!r} from server {sender} carries NaN/Inf")
            elif kind == "i":
                if value.ndim == 2 and value.shape[1] != num_nodes:  # a number per node of the table
                    raise ValueError(f"{name} must have a column per node ({num_nodes}), got {value.shape}")
                taken = value.astype(np.int64, copy=False)
            else:
                continue
            if taken is not value:
                fixed[name] = taken
        return dataclasses.replace(message, **fixed) if fixed else message

    # ------------------------------------------------------------ relocation

    def _relocate_at_home(self, keys: np.ndarray, to: int) -> None:
        table = self.table
        home = keys[table.directory.is_home(keys)]
        table.hints.learn(home, to)
        superseded = home[table.incoming[home] & (table.presence[home] != OWNED)] if to != self.node else _NO_KEYS
        table.incoming[superseded] = False  # a request of this node's for them is superseded
        for owner, (part, epochs) in table.directory.move(keys, to).items():
            self._send(owner, Handover(part, epochs, to))
        if superseded.size:  # changes and announcements that waited for them follow them
            self._retry_deferred_syncs()
            self._retry_deferred_announcements()

    def _handover(self, keys: np.ndarray, epochs: np.ndarray, to: int, hops: int) -> None:
        """Give owned keys to ``to`` unless a newer move brought them here; chase the others.

        A key not here is on its way here (the handover waits for it), or moved on: the handover
        follows it to where this node sent its rows, by the same channel, so it arrives behind the key
        (the location cache may name another node by then: a home's own decision, a report of a later
        move); a key that never was here goes by the hints. When ``to`` is this node, the key is to come
        back here from wherever it went. A handover older than the key's version here is dropped, and
        the node it was for told where the key is (it would wait for it otherwise). A key held in
        place here goes when its hold ends (``_give_held_later``).
        """
        table = self.table
        owned = table.presence[keys] == OWNED
        here, here_epochs = keys[owned], epochs[owned]
        newer = here_epochs > table.epoch[here]
        if not newer.all():
            table.stats["handovers_stale"] += int((~newer).sum())
            stale = here[~newer]
            if to != self.node:  # the node it was for waits for the key no longer: tell it where it is
                self._send(to, Owner(stale, table.epoch[stale], table.step[stale], self.node))
        here, here_epochs = here[newer], here_epochs[newer]
        kept = self._give(here, to, here_epochs, np.zeros_like(here_epochs))
        if kept.size:
            table.held_back.append((here[kept], here_epochs[kept], to))
        rest, rest_epochs = keys[~owned], epochs[~owned]
        where = table.hints.route(rest, hops)
        where[where == self.node] = table.where(rest[where == self.node])  # a home: the owner it knows
        sent_to = table.sent_to[rest]
        where = np.where(sent_to >= 0, sent_to, where)
        # A key asked for (``incoming``) that never left here is on its way: wait for it. One that left
        # may have gone on since the request (the home decided on a later one): follow it.
        wait = ((where == self.node) | (table.incoming[rest] & (to != self.node) & (sent_to < 0))
                | table.state_waits[rest])
        if wait.any():
            table.deferred_handovers.append((rest[wait], rest_epochs[wait], to))
        if to != self.node:  # followed elsewhere: this node's request for them was superseded
            table.incoming[rest[~wait]] = False
        rest, rest_epochs, where = rest[~wait], rest_epochs[~wait], where[~wait]
        if rest.size and hops >= HANDOVER_HOPS:
            table.stats["handovers_lost"] += int(rest.size)
            log.error("server %d: a handover of %d key(s) of %r to node %d found no owner in %d hops: dropped",
                      self.node, rest.size, table.spec.name, to, hops)
        elif rest.size:
            for node, part in _group(where, np.arange(rest.size)):
                self._send(node, Handover(rest[part], rest_epochs[part], to, hops + 1))

    def _give(self, keys: np.ndarray, to: int, epochs: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Hand owned keys, their interest and their version (``epochs``, ``steps``: from now on theirs)
        to ``to``; from now on requests for them are redirected. Keys a worker here holds in place stay
        until the hold ends: returns their positions in ``keys``."""
        table = self.table
        if to == self.node or not keys.size:
            table.epoch[keys], table.step[keys] = epochs, steps
            return _NO_KEYS
        store = table.store
        assert store.pinned is not None and store.arrived is not None and store.incoming is not None
        values = np.empty((keys.shape[0], table.spec.dim), dtype=table.spec.dtype)
        kept_at = np.empty(keys.shape[0], dtype=np.int64)
        with self._moving_rows(exclusive=True):
            kept_at = kept_at[:give_unheld(store.values, table.presence, store.pinned, store.arrived, store.incoming,
                                           keys, values, kept_at)]
        if kept_at.size:
            table.stats["keys_held_back"] += int(kept_at.size)
            given = np.ones(keys.shape[0], dtype=np.bool_)
            given[kept_at] = False
            keys, values, epochs, steps = keys[given], values[given], epochs[given], steps[given]
        if keys.size:
            table.epoch[keys], table.step[keys] = epochs, steps
            table.hints.learn(keys, to)
            table.sent_to[keys] = to
            interest = table.interest.interest[keys]  # indexing by an array copies
            generations = table.interest.generations_of(keys)
            replicas = table.interest.replicas[keys]
            table.interest.interest[keys] = 0
            table.interest.replicas[keys] = 0
            table.stats["keys_relocated_away"] += int(keys.size)
            self._send(to, State(keys, values, interest, generations, replicas, epochs, steps))
        return kept_at

    def _give_held_later(self) -> None:
        """Give the keys that were held in place when they were to go, where their holds have ended (a
        move on intent only while the node it was for still alone wants the key)."""
        table = self.table
        assert table.store.pinned is not None
        waiting, table.held_back = table.held_back, []
        for keys, epochs, to in waiting:
            # Keys still held wait on, with no lock or pass of the give (most of them, where blocks follow
            # each other); a pin read clear here is read again under the row lock by the give.
            still = table.store.pinned[keys] != 0
            if still.any():
                table.held_back.append((keys[still], None if epochs is None else epochs[still], to))
                if still.all():
                    continue
                keys, epochs = keys[~still], None if epochs is None else epochs[~still]
            if epochs is not None:
                self._handover(keys, epochs, to, 0)
                continue
            keys = keys[table.presence[keys] == OWNED]
            wanted = keys[(table.interest.interest[keys] >> to) & 1 == 1]
            self._move_on_intent(table.interest.decide(table.spec.techniques, wanted, to, self.node)
                                 .get(Action.RELOCATE, _NO_KEYS), to)

    def _receive_state(self, keys: np.ndarray, values: np.ndarray, interest: np.ndarray, generations: np.ndarray,
                       replicas: np.ndarray, epochs: np.ndarray, steps: np.ndarray) -> None:
        """Rows that come to be owned here. Where a sync of a replica here is on its way with a change
        the rows may lack, they wait for its answer (``WaitingState``): taken now, the row read here
        lacked this node's own write until the old owner's pass of the change came back."""
        table = self.table
        waits = table.unanswered[keys] > 0
        if waits.any():
            state = WaitingState(keys, values, interest, generations, replicas, epochs, steps)
            table.waiting_states.append(state.split(waits))
            table.state_waits[keys[waits]] = True
            table.incoming[keys[waits]] = True  # requests for them wait here
            table.stats["states_waiting_for_syncs"] += int(waits.sum())
            keys, values, interest, generations, replicas, epochs, steps = (
                state.keys, state.values, state.interest, state.generations, state.replicas, state.epochs, state.steps)
            if not keys.size:
                return
        self._take_rows(keys, values, interest, generations, replicas, epochs, steps)

    def _take_waiting_states(self) -> None:
        """The waiting rows whose syncs from here have all been answered."""
        table = self.table
        waiting, table.waiting_states = table.waiting_states, []
        for state in waiting:
            ready = table.unanswered[state.keys] == 0
            if ready.any():
                taken = state.split(ready)
                table.state_waits[taken.keys] = False
                self._take_rows(taken.keys, taken.values, taken.interest, taken.generations, taken.replicas,
                                taken.epochs, taken.steps)
            if state.keys.size:
                table.waiting_states.append(state)

    def _add_to_waiting_rows(self, keys: np.ndarray, deltas: np.ndarray, drop: np.ndarray, origin: int
                             ) -> np.ndarray:
        """A replica's change to rows waiting here: added to them; their rows after."""
        rows = np.empty((keys.shape[0], deltas.shape[1]), dtype=deltas.dtype)
        for state in self.table.waiting_states:
            where, found = state.positions(keys)
            at = where[found]
            state.values[at] += deltas[found]
            state.replicas[at[drop[found].astype(bool)]] &= ~(1 << origin)
            rows[found] = state.values[at]
        return rows

    def _take_rows(self, keys: np.ndarray, values: np.ndarray, interest: np.ndarray, generations: np.ndarray,
                   replicas: np.ndarray, epochs: np.ndarray, steps: np.ndarray) -> None:
        table = self.table
        store = table.store
        assert store.base is not None and store.changed is not None
        assert store.pinned is not None and store.arrived is not None and store.incoming is not None
        with self._moving_rows(exclusive=True):
            # A replica here becomes the row: its changes not yet synced (what its value moved from its
            # base) stay in.
            receive_rows(store.values, store.base, store.changed, table.presence, store.pinned, store.arrived,
                         store.incoming, keys, values)
        table.epoch[keys], table.step[keys] = epochs, steps
        table.replica_owner[keys] = -1
        table.dropping[keys] = False
        table.incoming[keys] = False
        table.hints.learn(keys, self.node)
        table.interest.interest[keys] |= interest
        # The last announcement of each node taken wherever the key was (only its owner takes one, so
        # these are the newest): an older one still on its way is not taken here either.
        table.interest.took(keys, generations)
        # Where this node held a replica it now holds the row: counted as a replica's holder still, it
        # would never be sent one again once the key moves on.
        replicas = replicas & ~(1 << self.node)
        table.interest.replicas[keys] |= replicas
        table.stats["keys_relocated_here"] += int(keys.size)
        # The homes already know: they started the move, or the old owner told them.
        for holder in _bits(np.bitwise_or.reduce(replicas) if replicas.size else 0):
            mine = keys[(replicas >> holder) & 1 == 1]
            self._send(holder, Owner(mine, table.epoch[mine], table.step[mine], self.node))
        self._retry_deferred_handovers()
        self._retry_deferred_syncs()
        self._retry_deferred_announcements()
        for answer in held.replay_held(table, self._now):
            self._answer(answer)

    def _retry_deferred_handovers(self) -> None:
        deferred, self.table.deferred_handovers = self.table.deferred_handovers, []
        for keys, epochs, to in deferred:
            self._handover(keys, epochs, to, 0)

    def _retry_deferred_syncs(self) -> None:
        """The parts of syncs that waited for keys on their way here: added where the keys came, passed
        on where they will not come (another request superseded this node's)."""
        deferred, self.table.deferred_syncs = self.table.deferred_syncs, []
        for keys, deltas, drop, origin, target, hops, part, parent in deferred:
            self._sync_at_owner(keys, deltas, drop, origin, target, hops, part, parent)

    def _retry_deferred_announcements(self) -> None:
        """Announcements that waited for keys on their way here: taken where the keys came, passed on
        where they will not come."""
        deferred, self.table.deferred_announcements = self.table.deferred_announcements, []
        for keys, active, node, generation, hops in deferred:
            self._announce(keys, active, node, generation, hops)

    def _learn_owner(self, keys: np.ndarray, owner: int, epochs: np.ndarray, steps: np.ndarray) -> None:
        """Keys moved to ``owner`` without this node asking: as their home (the newest report wins),
        as a replica's holder, or as the node a superseded move was for."""
        table = self.table
        home = table.directory.is_home(keys)
        table.hints.learn(table.directory.record(keys, owner, epochs, steps), owner)
        table.hints.learn(keys[~home], owner)
        table.replica_owner[keys[table.presence[keys] == REPLICA]] = owner
        # As the node a superseded move was for: the key will not come; what waited for it goes on.
        awaited = keys[table.incoming[keys] & (table.presence[keys] != OWNED) & ~table.state_waits[keys]]
        if awaited.size and owner != self.node:
            table.incoming[awaited] = False
            self._retry_deferred_handovers()
            self._retry_deferred_syncs()
            self._retry_deferred_announcements()
            for answer in held.replay_held(table, self._now):
                self._answer(answer)

    def _move_on_intent(self, keys: np.ndarray, to: int) -> None:
        """Move owned keys to a node that alone wants them, and tell their homes (one step later
        than the version they had, so that the homes order such reports)."""
        table = self.table
        if not keys.size:
            return
        kept = self._give(keys, to, table.epoch[keys], table.step[keys] + 1)
        if kept.size:
            table.held_back.append((keys[kept], None, to))
            given = np.ones(keys.shape[0], dtype=np.bool_)
            given[kept] = False
            keys = keys[given]
        homes = home_of(keys, table.num_nodes)
        for home in np.unique(homes):
            part = keys[homes == home]
            self._send(int(home), Owner(part, table.epoch[part], table.step[part], to))

    # ------------------------------------------------------------ replication

    def _replicate_to(self, keys: np.ndarray, node: int) -> None:
        table = self.table
        keys = keys[(table.interest.replicas[keys] >> node) & 1 == 0]
        if not keys.size:
            return
        with self._moving_rows(exclusive=False):
            values = _rows_of(table.store, keys)
        table.interest.replicas[keys] |= 1 << node
        table.stats["replicas_made"] += int(keys.size)
        self._send(node, Replicate(keys, values))

    def _receive_replica(self, keys: np.ndarray, values: np.ndarray, owner: int) -> None:
        table = self.table
        store = table.store
        assert store.base is not None
        taken = np.empty(keys.shape[0], dtype=np.int64)
        with self._moving_rows(exclusive=True):
            keys = taken[:receive_replicas(store.values, store.base, table.presence, keys, values, taken)]
        table.replica_owner[keys] = owner
        # Made for interest this node has withdrawn meanwhile: it goes with its first sync.
        table.dropping[keys] = ~table.intents.announced[keys]
        table.stats["replicas_held"] += int(keys.size)
        table.holds_replicas = True
        for answer in held.replay_held(table, self._now):
            self._answer(answer)

    def _sync(self) -> None:
        """Send each owner the change its replicas here saw since the last sync, and a turn of the others
        to refresh (one sync in flight per owner)."""
        table = self.table
        store = table.store
        assert store.base is not None and store.changed is not None
        assert store.pinned is not None and store.arrived is not None and store.incoming is not None
        replicas = np.flatnonzero(table.presence == REPLICA)
        table.holds_replicas = bool(replicas.size)
        if not replicas.size:
            return
        for owner, keys in _group(table.replica_owner[replicas], replicas):
            if owner in table.syncs_in_flight:
                continue
            turn = table.refresh_turns[owner] % REFRESH_ROUNDS
            table.refresh_turns[owner] += 1
            also = table.dropping[keys] | (keys % REFRESH_ROUNDS == turn)
            with self._moving_rows(exclusive=True):
                changed, deltas, moved = take_changes(store.values, store.base, store.changed, store.pinned,
                                                      store.arrived, store.incoming, keys, also)
            if not changed.size:
                continue
            part = table.new_part()
            # In key order already, as ``SyncInFlight`` keeps them: ``keys`` come from ``flatnonzero``, in order
            table.syncs_in_flight[owner] = SyncInFlight(part, changed, bool(moved))
            table.unanswered[changed] += 1
            table.stats["sync_sent"] += 1
            self._send(owner, Sync(changed, deltas, table.dropping[changed].astype(np.uint8), self.node, owner,
                                   part=part, parent=part))

    def _sync_at_owner(self, keys: np.ndarray, deltas: np.ndarray, drop: np.ndarray, origin: int, target: int,
                       hops: int, part: int, parent: int) -> None:
        """Add part ``part`` of a replica's change. What is for keys that moved on is passed on as parts of
        its own (their owners add them), what is for keys on their way here waits for them as one; the
        answer says how many such parts there are, and the replica waits for their answers too (nothing
        it sent is unaccounted for). A part with nothing to add here yet waits whole, unanswered."""
        table = self.table
        store = table.store
        assert store.changed is not None and store.pinned is not None
        assert store.arrived is not None and store.incoming is not None
        # The usual sync finds every key owned here and none waiting for a state: added and read in one call.
        values = np.empty(deltas.shape, dtype=deltas.dtype)
        with self._moving_rows(exclusive=True):
            usual = add_owned_and_read(store.values, table.presence, store.pinned, store.arrived, store.incoming,
                                       table.state_waits, keys, deltas, values)
        if usual:
            if drop.any():
                table.interest.replicas[keys[drop.astype(bool)]] &= ~(1 << origin)
            self._send(origin, Synced(keys, values, drop, target, 0, part, parent))
            return
        owned = table.presence[keys] == OWNED
        waits = table.state_waits[keys]  # rows here, waiting for a sync from here (added to them)
        rest = np.flatnonzero(~(owned | waits))
        parts = 0
        if rest.size:
            dest = self._route_after_keys(keys[rest], hops)
            here = dest == self.node
            if here.all() and not (owned | waits).any():
                table.deferred_syncs.append((keys, deltas, drop, origin, target, hops, part, parent))
                return
            if here.any():
                waiting = rest[here]
                parts += 1
                table.deferred_syncs.append((keys[waiting], deltas[waiting], drop[waiting], origin, target, hops,
                                             table.new_part(), part))
            onward, dest = rest[~here], dest[~here]
            if onward.size and hops >= SYNC_HOPS:
                table.stats["sync_rows_lost"] += int(onward.size)
                log.error("server %d: a replica's change to %d key(s) of %r found no owner in %d hops: lost",
                          self.node, onward.size, table.spec.name, hops)
            elif onward.size:
                table.stats["sync_forwarded"] += int(onward.size)
                for owner, group in _group(dest, onward):
                    parts += 1
                    self._send(owner, Sync(keys[group], deltas[group], drop[group], origin, target, hops + 1,
                                           table.new_part(), part))
            taken = owned | waits
            keys, deltas, drop, owned, waits = keys[taken], deltas[taken], drop[taken], owned[taken], waits[taken]
        if waits.any():
            values = np.empty((keys.shape[0], deltas.shape[1]), dtype=deltas.dtype)
            values[waits] = self._add_to_waiting_rows(keys[waits], deltas[waits], drop[waits], origin)
            mine = np.flatnonzero(owned)
        else:
            mine = None
        with self._moving_rows(exclusive=True):
            if mine is None:
                add_present(store.values, store.changed, table.presence, store.pinned, store.arrived,
                            store.incoming, keys, deltas, 1.0, np.empty(keys.shape[0], dtype=np.int64))
                values = _rows_of(store, keys)
            else:
                add_present(store.values, store.changed, table.presence, store.pinned, store.arrived,
                            store.incoming, keys[mine], deltas[mine], 1.0, np.empty(mine.shape[0], dtype=np.int64))
                values[mine] = _rows_of(store, keys[mine])
        table.interest.replicas[keys[owned & drop.astype(bool)]] &= ~(1 << origin)
        self._send(origin, Synced(keys, values, drop, target, parts, part, parent))

    def _route_after_keys(self, keys: np.ndarray, hops: int) -> np.ndarray:
        """Where a message about keys not owned here (a replica's change, an announcement) goes next
        (this node: it waits for them). As a handover does: behind a key's rows where this node sent
        them (the same channel), else to its owner as known here (the home after ``MAX_HOPS``), and it
        waits for a key asked for here that never left (the home's directory may name this node before
        the key arrives, and the hint here the home: passed back and forth, a change was lost after
        ``SYNC_HOPS``)."""
        table = self.table
        dest = table.where(keys)
        if hops >= MAX_HOPS:  # the home knows the owner
            away = ~table.directory.is_home(keys)
            dest[away] = home_of(keys[away], table.num_nodes)
        sent_to = table.sent_to[keys]
        dest = np.where(sent_to >= 0, sent_to, dest)
        dest[table.incoming[keys] & (sent_to < 0)] = self.node
        return dest

    def _synced(self, keys: np.ndarray, values: np.ndarray, drop: np.ndarray, target: int, parts: int, part: int,
                parent: int) -> None:
        table = self.table
        store = table.store
        assert store.base is not None and store.changed is not None
        assert store.pinned is not None and store.arrived is not None and store.incoming is not None
        flight = table.syncs_in_flight.get(target)
        settled = _NO_KEYS
        if flight is not None:
            done = flight.answer(part, parent, parts)
            settled = flight.answered_keys(keys, done)
            if done:
                del table.syncs_in_flight[target]
            # A key with a later sync from here still on its way (to an owner learned of meanwhile)
            # keeps its replica as it is: this answer's rows may lack that sync's change, and a
            # replica rebased on them would be read without it until that sync is answered.
            if count_answered(table.unanswered, settled, keys):
                later = table.unanswered[keys] > 0
                keys, values, drop = keys[~later], values[~later], drop[~later]
        gone = np.empty(keys.shape[0], dtype=np.int64)
        with self._moving_rows(exclusive=True):
            # A replica goes once its last change is in; changes made meanwhile go in the next sync.
            gone = gone[:apply_synced(store.values, store.base, store.changed, table.presence, store.pinned,
                                      store.arrived, store.incoming, keys, values, drop, gone)]
        table.dropping[gone] = False
        table.replica_owner[gone] = -1
        table.stats["replicas_dropped"] += int(gone.size)
        if table.waiting_states and settled.size:
            self._take_waiting_states()

    # ---------------------------------------------------------------- intent

    def _announce(self, keys: np.ndarray, active: bool, node: int, generation: int, hops: int) -> None:
        """At (what we think is) the owner: note a node's interest and act on it, unless a newer
        announcement of that node's came first (by another route)."""
        table = self.table
        # Which keys are owned here is read before acting: a key moved to ``node`` now carries its
        # interest with its rows, and passing the announcement on after it would only bring it back.
        here = table.presence[keys] == OWNED
        owned, rest = keys[here], keys[~here]
        if active and node != self.node and owned.size:
            # This node's own interest in them that ended by the clock heard is withdrawn first, not
            # at the round it waits for (up to ``act_every_s``, longer on a busy machine): counted
            # still, it would have them copied to their next user instead of moved.
            self._withdraw(table.intents.ended_among(owned, self._node_clock, max(self._reach, table.window)))
        if owned.size:
            newer = table.interest.take(owned, generation, node)
            if not newer.all():
                table.stats["announcements_stale"] += int((~newer).sum())
                owned = owned[newer]
        if owned.size:
            if active:
                table.interest.announce(owned, node)
                for action, part in table.interest.decide(table.spec.techniques, owned, node, self.node).items():
                    if action == Action.RELOCATE and part.size:
                        self._move_on_intent(part, node)
                    elif action == Action.REPLICATE and part.size:
                        self._replicate_to(part, node)
            else:
                table.interest.withdraw(owned, node)
        if not rest.size:
            return
        # Routed as a replica's change is, and never dropped (the key would come with an interest still
        # counted that was withdrawn, or without one announced): for keys on their way here it waits
        # for them, past ``MAX_HOPS`` it goes on to the owner the home knows.
        dest = self._route_after_keys(rest, hops)
        waits = dest == self.node
        if waits.any():
            table.deferred_announcements.append((rest[waits], active, node, generation, hops))
        onward, dest = rest[~waits], dest[~waits]
        if onward.size and hops >= ANNOUNCE_HOPS:
            table.stats["announcements_lost"] += int(onward.size)
            log.error("server %d: an announcement of %d key(s) of %r found no owner in %d hops: dropped",
                      self.node, onward.size, table.spec.name, hops)
        elif onward.size:
            for owner, part in _group(dest, onward):
                self._send(owner, Announce(part, active, node, generation, hops + 1))

    def _act_on_intents(self, clock: int, clock_s: float, syncing: bool) -> None:
        table = self.table
        if table.spec.techniques == "static":
            return
        if clock != table.acted_at:  # the estimate moves once per clock, not per pass of the loop
            table.acted_at = clock
            table.window_estimate = smoothed_window(ACTION_S, clock_s, table.window_estimate)
            table.window = math.ceil(table.window_estimate)
        # Acting costs the servers per round more than per key: on fast clocks, act every few clocks on
        # what comes into the window until the next round (withdrawals wait as long, and no longer than
        # the table's period: a clock that stands still would keep them waiting for good), unless an
        # intent not acted on yet is about to start.
        stride = self._stride(clock_s)
        if not table.intents.starts_within(clock, table.window) and not self._round_due(self._now, clock, clock_s,
                                                                                         stride, syncing):
            return
        if syncing and clock_s > 0:  # this round reaches past the next sync, which takes the next round
            stride = max(stride, math.ceil((self._sync_after(self._now, clock_s) - self._now) / clock_s) + 1)
        reach = self._reach = table.window + stride - 1
        if not table.intents.any_due(clock, reach):  # most passes: nothing to do
            return
        table.next_action, table.next_action_s = clock + stride, self._now + self.act_every_s
        start, stop = table.intents.due(clock, reach)
        if start.size:
            # Interest came back before a replica here sent its last change: keep the replica (the
            # owner, still counting it, would not send it again).
            table.dropping[start] = False
            table.stats["intents_announced"] += int(start.size)
            self._announce(start, True, self.node, table.intents.stamp(), 0)
        self._withdraw(stop)

    def _withdraw(self, stop: np.ndarray) -> None:
        if stop.size:
            table = self.table
            table.stats["intents_withdrawn"] += int(stop.size)
            table.dropping[stop[table.presence[stop] == REPLICA]] = True
            self._announce(stop, False, self.node, table.intents.stamp(), 0)


def _rows_of(store: ShardStore, keys: np.ndarray) -> np.ndarray:
    """A copy of the rows of ``keys`` (with what arrived beside a row held in place): the compiled
    gather, about twice as fast as indexing by an array (rows of KGE's tables are 1.6 KB, and a
    relocation copies a thousand at once)."""
    assert store.presence is not None and store.arrived is not None and store.incoming is not None
    out = np.empty((keys.shape[0], store.values.shape[1]), dtype=store.values.dtype)
    absent = read_present(store.values, store.presence, store.arrived, store.incoming, keys, out,
                          np.empty(keys.shape[0], dtype=np.int64))
    assert absent == 0, "rows of keys owned here"
    return out


_NO_KEYS = np.empty(0, dtype=np.int64)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _group(where: np.ndarray, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    if not where.size:
        return []
    first = where[0]
    if (where == first).all():  # the usual case (with two nodes, always): one node, no sort
        return [(int(first), keys)]
    return [(int(n), keys[where == n]) for n in np.unique(where)]


def _bits(mask: int) -> list[int]:
    return [i for i in range(64) if (int(mask) >> i) & 1]


def _node(value: Any, num_nodes: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_nodes:
        raise ValueError(f"bad node {value!r}")


def _part(value: Any, num_nodes: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise ValueError(f"bad part of a sync {value!r}")


def _number(value: Any, num_nodes: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise ValueError(f"bad number {value!r}")


def _count(value: Any, num_nodes: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 20:
        raise ValueError(f"bad count {value!r}")


#: the check of each kind of body field (``messages.checked_fields``), given the table's number of nodes
_CHECKS: dict[str, Callable[[Any, int], None]] = {"node": _node, "part": _part, "number": _number, "count": _count}
