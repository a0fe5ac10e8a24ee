"""The lane (``client.lane``, ``server.lane``): small static pulls and pushes served whole in
compiled code.

Jobs of real processes (a launched server has a lane; threads beside a server do not), checked by
counting: every read holds its worker's own pushes, whether the lane or the general path served
it, in one slice or several, with other reads in flight, while a slice moves away and back; every
push, on the lane or the general way, is in the final rows exactly once, also when the lane's
answer was late and its general copy went too. A lane whose server stopped answering is given
up, and asked for again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shoal.wire import keyed_hash

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lane_worker.py"


def run_job(tmp_path: Path, mode: str, rounds: int, workers_per_node: int, *options: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--workers-per-node",
                           str(workers_per_node), "--connect-timeout", "30", "--request-timeout", "60", *options,
                           "--", sys.executable, str(SCRIPT), str(tmp_path), mode, str(rounds)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((tmp_path / f"w{rank}.json").read_text()) for rank in range(2 * workers_per_node)]


def test_reads_through_the_lane_hold_the_workers_own_pushes_and_every_push_counts_once_across_slice_moves(
        tmp_path):
    results = run_job(tmp_path, "count", 400, workers_per_node=2)
    pushed = np.sum([r["pushed"] for r in results], axis=0)
    for r in results:
        assert r["missed"] == [], "a read missed its own worker's acknowledged push"
        assert r["uniform"]
        assert r["final"] == pushed.astype(float).tolist(), "a push was lost or applied twice"
    lane_pulls = sum(r["counters"].get("lane_pulls", 0) for r in results)
    lane_pushes = sum(r["counters"].get("lane_pushes", 0) for r in results)
    general = sum(r["counters"].get("requests", 0) for r in results) - lane_pushes
    served = sum(s.get("lane_pulls", 0) for s in results[0]["servers"])
    applied = sum(s.get("lane_pushes", 0) for s in results[0]["servers"])
    # both paths, beside each other (the general way: push_pulls, parts sent again after a move)
    assert lane_pulls > 100 and lane_pushes > 100 and general > 100, (lane_pulls, lane_pushes, general)
    # What the workers counted, the servers applied; on a busy machine a lane answer may come after the
    # worker's wait (then the push's general copy was acknowledged, not applied again: counted above)
    late = sum(r["counters"].get("lane_general", 0) for r in results)
    assert lane_pushes <= applied <= lane_pushes + late, (applied, lane_pushes, late)
    # pulls of keys in both slices, through the lane in part (one node's) or whole (both on one)
    assert sum(r["lane batches"] for r in results) > 50
    # and right after a push not waited for: the server reads once it has handled that push
    assert sum(r["lane unwaited"] for r in results) > 50
    assert served == lane_pulls  # what the workers counted, the servers served (no request served twice)


def test_every_push_counts_once_when_the_lanes_lose_requests_and_answers(tmp_path):
    """The count job with some of each worker's lane requests dropped unsent and some of the answers
    dropped unread (``lossy``): the lane times out, what was in flight on it goes the general way, and
    a push the server applied whose answer was lost is acknowledged there, not applied again."""
    results = run_job(tmp_path, "lossy", 1500, 2, "--resend-timeout", "0.1")
    pushed = np.sum([r["pushed"] for r in results], axis=0)
    for r in results:
        assert r["missed"] == [], "a read missed its own worker's acknowledged push"
        assert r["final"] == pushed.astype(float).tolist(), "a push was lost or applied twice"
    servers = results[0]["servers"]
    applied = sum(s.get("lane_pushes", 0) for s in servers)
    copies = sum(s.get("lane_push_copies", 0) for s in servers)
    answered = sum(r["counters"].get("lane_pushes", 0) for r in results)
    assert copies > 0  # applied on the lane, its answer lost: its general copy only acknowledged
    # every push the lane applied was either answered there or acknowledged the general way
    assert applied == answered + copies, (applied, answered, copies)


def test_the_lane_answers_no_one_without_the_key_refuses_replays_and_bounded_reads_and_keeps_serving(tmp_path):
    result = run_job(tmp_path, "forge", 0, workers_per_node=1)[0]
    assert result["wrong key"] == "no answer"
    assert result["cut tag"] == "no answer"
    assert result["valid"] == "rows"
    assert result["older"] == "no answer"  # an older request number from the same incarnation
    assert result["again"] == "rows"  # the same request again is read again (a read changes nothing)
    assert result["lane after"] == 1
    assert result["bounded table"] == "general"  # bounded reads wait on clocks: the general path's
    assert result["slice elsewhere"] == "general"
    assert result["bounded through the lane"] == 0
    # pushes the lane must not apply: answered "general" (the worker would send them that way)
    assert result["push whose turn passed"] == "general"  # its stream went past it: applied once already
    assert result["push whose turn is far"] == "general"  # held a while for the requests before it
    assert result["push of a NaN"] == "general"  # the general path drops such rows and says so
    assert result["push of the wrong size"] == "general"
    assert result["push to a table with state"] == "general"  # Adagrad's rule: the general path's
    assert result["rows pushed to"] == [0.0, 0.0]  # none of them applied
    assert result["a push after"] == 1.0 and result["pushes through the lane"] == 1  # the stream goes on


def test_a_lane_that_went_unanswered_is_given_up_for_a_while_and_asked_for_again(tmp_path):
    result = run_job(tmp_path, "pause", 0, 1, "--resend-timeout", "0.5")[0]
    assert result["lane before"] == 1
    # read the general way once the server was back, after the push sent on the lane while it was
    # stopped, applied once though both its copies reached the server
    assert result["while stopped"] == 2.0
    assert result["lane given up"]
    assert result["lane again"] == 2.0  # a new lane, not the general path for good
    # after LANE_RETRY_RESENDS resend timeouts from the failure (less the stop's rest), not much later
    assert result["lane again after s"] < 10


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 104, 1023, 1024])
def test_the_compiled_keyed_hash_is_blake3s(size):
    import blake3

    key = os.urandom(32)
    data = np.frombuffer(os.urandom(size + 3), np.uint8)
    tag = np.zeros(36, np.uint8)
    keyed_hash.keyed_blake3(keyed_hash.key_words(key), data, size, tag, 2)
    assert tag[2:34].tobytes() == blake3.blake3(data[:size].tobytes(), key=key).digest()
