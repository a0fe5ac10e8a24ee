"""Worker requests at a node of an adaptive table: served from the rows here, held for rows on
their way here, and answered "moved" for the rest (DESIGN.md §6).

A pull or push is served from present rows at once. Keys this node is about to
receive (asked for, or recorded here as their owner) make the request wait for
them, so that a worker that just localised keys is not bounced; a request that
waits longer than ``HELD_S`` is answered with what is here and "moved" for the
rest, and the worker retries there.
"""

from __future__ import annotations

import numpy as np

from shoal.placement.adaptive_table import AdaptiveTable, Answer, Held
from shoal.storage.kernels import ABSENT, REPLICA

HELD_S = 2.0  # a request waiting for rows on their way here longer than this is answered "moved"


def serve_pull(table: AdaptiveTable, keys: np.ndarray, ticket: object, now: float) -> Answer | None:
    """Rows of ``keys`` (checked, int64); None: held until the rows on their way here arrive."""
    values = np.zeros((keys.shape[0], table.spec.dim), dtype=table.spec.dtype)
    pos, coming = _moved(table, keys, table.store.read_present(keys, values))
    if coming.size:
        table.held.append(Held(ticket, keys, None, coming, None, now))
        table.stats["requests_held"] += 1
        return None
    return _answer(table, ticket, keys, pos, values, None)


def serve_push(table: AdaptiveTable, keys: np.ndarray, grads: np.ndarray, ticket: object, now: float,
               positions: np.ndarray | None = None) -> Answer | None:
    """Apply the present part of a push (rows checked and finite); the rest waits for its rows if they
    are on their way here (None), else is answered "moved". ``positions``: where a held rest's keys sat
    in the request the worker sent."""
    # A replica here takes only this node's workers' writes (in shared memory): one taken from
    # another node's worker sits in it until its next sync, and the worker read its row without it
    # once the key came to its own node. Those go to the owner ("moved").
    replicas = table.presence[keys] == REPLICA
    if replicas.any():
        others = np.flatnonzero(~replicas)
        absent = others[table.store.update_present(keys[others], grads[others], table.scale)]
        pos = np.sort(np.concatenate([np.flatnonzero(replicas), absent]))
    else:
        pos = table.store.update_present(keys, grads, table.scale)
    pos, coming = _moved(table, keys, pos)
    if coming.size:
        where = pos if positions is None else positions[pos]
        table.held.append(Held(ticket, keys[pos], grads[pos], coming, where, now))
        table.stats["requests_held"] += 1
        return None
    return _answer(table, ticket, keys, pos, None, positions)


def replay_held(table: AdaptiveTable, now: float) -> list[Answer]:
    """Serve again the held requests whose rows have all arrived."""
    ready = [h for h in table.held if not _coming(table, h.waiting_for).any()]
    if not ready:
        return []
    table.held = [h for h in table.held if h not in ready]
    answers = []
    for h in ready:
        if h.grads is None:
            answer = serve_pull(table, h.keys, h.ticket, now)
        else:
            answer = serve_push(table, h.keys, h.grads, h.ticket, now, h.positions)
        if answer is not None:
            answers.append(answer)
    return answers


def expire_held(table: AdaptiveTable, now: float) -> list[Answer]:
    """Answer requests that waited too long for rows that did not come: what is here now, and
    "moved" for the rest (the requester then retries elsewhere)."""
    stale = [h for h in table.held if now - h.since > HELD_S]
    if not stale:
        return []
    table.held = [h for h in table.held if h not in stale]
    table.stats["held_requests_timed_out"] += len(stale)
    answers = []
    for h in stale:
        if h.grads is None:
            values = np.zeros((h.keys.shape[0], table.spec.dim), dtype=table.spec.dtype)
            absent_at = table.store.read_present(h.keys, values)
            answers.append(_answer(table, h.ticket, h.keys, absent_at, values, None))
        else:
            absent_at = table.store.update_present(h.keys, h.grads, table.scale)
            answers.append(_answer(table, h.ticket, h.keys, absent_at, None, h.positions))
    return answers


def _moved(table: AdaptiveTable, keys: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions of absent keys (``pos``), and those of them on their way here (the request waits
    for these)."""
    if not pos.size:
        return pos, pos
    missing = keys[pos]
    return pos, missing[_coming(table, missing)]


def _coming(table: AdaptiveTable, keys: np.ndarray) -> np.ndarray:
    """Which of ``keys`` are absent and on their way here (asked for, or known to be this node's);
    a key that arrived and left again at once is not."""
    return (table.presence[keys] == ABSENT) & (table.incoming[keys] | (table.where(keys) == table.node))


def _answer(table: AdaptiveTable, ticket: object, keys: np.ndarray, pos: np.ndarray, values: np.ndarray | None,
            positions: np.ndarray | None) -> Answer:
    owners = table.where(keys[pos]) if pos.size else np.empty(0, dtype=np.int64)
    if pos.size:
        table.stats["answered_moved"] += int(pos.size)
    return Answer(ticket, values, pos if positions is None else positions[pos], owners)
