"""Checkpoints of a running cluster: taken at a clock boundary, restored onto another number of
servers, and a deterministic BSP run resumed from one ends bit-identical to the run never stopped."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

import shoal
from shoal.api.errors import CheckpointError
from shoal.client import checkpoints as client_checkpoints
from shoal.server.replicated import wire_version
from shoal.storage import checkpoint
from shoal.storage.kernels import ABSENT, OWNED, REPLICA
from shoal.wire import bodies
from tests.support.cluster import ThreadCluster
from tests.support.waiting import wait_until

KEYS, DIM, STEPS, AT = 600, 4, 10, 5


def _tables(w):
    emb = w.table("emb", KEYS, DIM, init=shoal.Normal(std=0.1), optimizer=shoal.optim.Adam(lr=0.01),
                  consistency=shoal.BSP(), mapping="hash", slices=6)
    bias = w.dense("bias", (3, 5), optimizer=shoal.optim.Adagrad(lr=0.1), consistency=shoal.BSP())
    return emb, bias


def _step(w, emb, bias, clock: int) -> None:
    """One deterministic BSP step: read everything, then each rank updates only its own keys."""
    everything = np.arange(KEYS)
    rows = emb.pull(everything)
    b = bias.pull()
    w.barrier()  # no push of this clock may land before every rank has read
    mine = everything[everything % w.num_workers == w.rank]
    grads = np.sin(rows[mine] * (clock + 1) + w.rank) + b.mean()
    emb.push(mine, grads.astype(np.float32))
    if w.rank == 0:
        bias.push(np.full((3, 5), 0.01 * (clock + 1), np.float32))
    w.advance_clock()


def _train(w, start: int, stop: int, root=None):
    emb, bias = _tables(w)
    clock = w.restore(root) if root is not None and start else 0
    assert clock == start
    for c in range(start, stop):
        if root is not None and not start and c == AT:
            w.checkpoint(root)
        _step(w, emb, bias, c)
    w.barrier()
    return emb.pull(np.arange(KEYS)), bias.pull()


def test_bsp_resume_from_a_checkpoint_on_fewer_servers_is_bit_identical(tmp_path):
    with ThreadCluster(nodes=2, workers_per_node=1) as two:
        uninterrupted = two.run_workers(lambda w: _train(w, 0, STEPS, tmp_path))
    with ThreadCluster(nodes=1, workers_per_node=2) as one:  # one server now, the same two workers
        resumed = one.run_workers(lambda w: _train(w, AT, STEPS, tmp_path))
    for (emb_a, bias_a), (emb_b, bias_b) in zip(uninterrupted, resumed, strict=True):
        assert emb_a.tobytes() == emb_b.tobytes()
        assert bias_a.tobytes() == bias_b.tobytes()
    with ThreadCluster(nodes=1, workers_per_node=2) as fresh:  # and restoring did matter
        fresh_end = fresh.run_workers(lambda w: _train(w, 0, STEPS - AT))
    assert fresh_end[0][0].tobytes() != resumed[0][0].tobytes()


def test_restore_onto_more_servers_keeps_values_and_optimiser_state(tmp_path):
    keys = np.arange(KEYS)
    with ThreadCluster(nodes=1) as one:
        w = one.worker(0)
        emb, _ = _tables(w)
        emb.push(keys, np.ones((KEYS, DIM), np.float32))
        w.advance_clock()
        path = w.checkpoint(tmp_path)
        saved = emb.pull(keys)
        emb.push(keys, np.ones((KEYS, DIM), np.float32))  # a second Adam step from the saved state
        two_steps = emb.pull(keys)
    assert path.parent == tmp_path and (path / "manifest.json").is_file()
    with ThreadCluster(nodes=3) as three:
        def body(w):
            emb, _ = _tables(w)
            assert w.restore(tmp_path) == 1
            w.barrier()
            restored = emb.pull(keys)
            w.barrier()
            if w.rank == 0:
                emb.push(keys, np.ones((KEYS, DIM), np.float32))
            w.advance_clock()  # under BSP a row read in clock 1 stays valid all through clock 1
            return restored, emb.pull(keys)
        (restored, again), *_ = three.run_workers(body)
    assert restored.tobytes() == saved.tobytes()
    assert again.tobytes() == two_steps.tobytes()  # Adam's moments came back too


def test_a_checkpoint_of_another_spec_is_refused_by_name(tmp_path):
    def save(w):
        w.table("emb", KEYS, DIM)
        w.table("other", 10, 2)
        with pytest.raises(CheckpointError, match="no table 'missing'"):
            w.checkpoint(tmp_path, tables=["missing"])
        return w.checkpoint(tmp_path, tables=["emb"])

    def load(w):
        w.table("emb", KEYS, DIM + 1)
        with pytest.raises(CheckpointError, match="was saved with a different spec"):
            w.restore(tmp_path)

    with ThreadCluster(nodes=2) as cluster:
        paths = cluster.run_workers(save)
    assert paths[0] == paths[1]  # rank 0 told every rank where it wrote
    with ThreadCluster(nodes=2) as cluster:
        cluster.run_workers(load)


def test_an_unwritable_root_fails_on_every_rank_by_name(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")

    def body(w):
        w.table("emb", KEYS, DIM)
        with pytest.raises(CheckpointError, match="failed on rank 0: .*Error"):
            w.checkpoint(blocker / "ckpt")

    with ThreadCluster(nodes=2) as cluster:
        cluster.run_workers(body)


def test_an_adaptive_table_is_saved_with_every_replica_change_and_restored_at_home(tmp_path):
    hot, moved, everything = np.arange(10), np.arange(10, 20), np.arange(40)
    # Replicas send their changes only when a checkpoint settles the table (no background sync in 60 s).
    options = dict(techniques="auto", init=shoal.Constant(0.0), sync_ms=60_000)

    with ThreadCluster(nodes=2) as cluster:
        adaptive = [s.adaptive for s in cluster.servers]

        def save(w):
            t = w.table("ad", 40, 2, **options)
            t.intent(hot, 1, 1000)  # both nodes: the hot keys are replicated
            w.advance_clock()
            if w.rank == 1:
                t.localize(moved)
            wait_until(lambda: all((a.tables["ad"].presence[hot] != ABSENT).all() for a in adaptive)
                        and (adaptive[1].tables["ad"].presence[moved] == OWNED).all())
            w.barrier()
            t.push(everything, np.full((40, 2), w.rank + 1.0, np.float32))
            w.barrier()
            if w.rank == 0:
                unsent = [a.tables["ad"].store.changed[a.tables["ad"].presence == REPLICA] for a in adaptive]
                assert any(part.any() for part in unsent), "no replica change was left to settle"
            return w.checkpoint(tmp_path)

        cluster.run_workers(save)

    with ThreadCluster(nodes=2) as cluster:
        def load(w):
            t = w.table("ad", 40, 2, **options)
            assert w.restore(tmp_path) == 1
            w.barrier()
            np.testing.assert_array_equal(t.pull(everything), 3.0)  # 1 + 2 from each key's two pushes
            w.barrier()
            if w.rank == 1:
                t.localize(hot)
                wait_until(lambda: (cluster.servers[1].adaptive.tables["ad"].presence[hot] == OWNED).all())
            w.barrier()
            with pytest.raises(CheckpointError, match="restore right after creating the tables"):
                w.restore(tmp_path)

        cluster.run_workers(load)
        assert [s.adaptive.describe()["ad"]["owned"] for s in cluster.servers] == [15, 25]


def test_a_replicated_table_is_saved_once_its_replicas_agree_and_restored_with_their_state(tmp_path):
    # Gossip every 60 s: at the checkpoint each replica holds only the pushes it accepted itself,
    # and Adagrad's accumulators differ per replica (each keeps its own).
    options = dict(replicas=2, gossip_ms=60_000, optimizer=shoal.optim.Adagrad(lr=0.1), init=shoal.Constant(0.5))
    keys = np.arange(30)

    def replicas(cluster):
        return {(server.node, shard): replica for server in cluster.servers
                for shard, replica in server.replication.tables["rep"].replicas.items()}

    with ThreadCluster(nodes=3) as cluster:
        def save(w):
            t = w.table("rep", 30, 2, **options)
            for step in range(3):
                t.push(keys, np.full((30, 2), (w.rank + 1.0) * (step + 1), np.float32))
            w.barrier()
            if w.rank == 0:
                by_shard = {}
                for (_, shard), r in replicas(cluster).items():
                    by_shard.setdefault(shard, set()).add(tuple(map(tuple, wire_version(r))))
                assert any(len(v) > 1 for v in by_shard.values()), "the replicas agreed before the checkpoint"
            w.checkpoint(tmp_path)
            return t.pull(keys)

        pulled = cluster.run_workers(save)
        saved = {at: r.state_arrays() for at, r in replicas(cluster).items()}
    parts = checkpoint.read_manifest(checkpoint.latest(tmp_path))["tables"]["rep"]["parts"]
    assert sorted((p["node"], p["shard"]) for p in parts) == sorted(saved)  # every replica wrote its rows
    for shard in {p["shard"] for p in parts}:
        assert len({str(p["version"]) for p in parts if p["shard"] == shard}) == 1  # ... as they agreed
    np.testing.assert_array_equal(pulled[0], pulled[1])  # converged: every replica holds every push
    np.testing.assert_array_equal(pulled[0], pulled[2])

    with ThreadCluster(nodes=3) as cluster:
        def load(w):
            t = w.table("rep", 30, 2, **options)
            assert w.restore(tmp_path) == 0
            w.barrier()
            np.testing.assert_array_equal(t.pull(keys), pulled[0])
            w.barrier()
            t.push(keys[:1], np.ones((1, 2), np.float32))
            w.barrier()
            with pytest.raises(CheckpointError, match="restore right after creating the tables"):
                w.restore(tmp_path)

        cluster.run_workers(load)
        restored = replicas(cluster)
        assert restored.keys() == saved.keys()
        for at, r in restored.items():  # each replica has its own accumulators back (untouched rows)
            np.testing.assert_array_equal(r.state_arrays()["first"][1:], saved[at]["first"][1:])

    with ThreadCluster(nodes=2) as cluster:  # another layout: rows found by key
        def load_fewer(w):
            t = w.table("rep", 30, 2, **options)
            w.restore(tmp_path)
            w.barrier()
            np.testing.assert_array_equal(t.pull(keys), pulled[0])

        cluster.run_workers(load_fewer)


def _every_kind(w):
    zero = shoal.Constant(0.0)
    return {"ad": w.table("ad", 40, 2, techniques="relocation", init=zero),
            "first": w.table("first", KEYS, DIM, init=zero, optimizer=shoal.optim.Adagrad(lr=0.1), slices=4),
            "rep": w.table("rep", 30, 2, replicas=2, init=zero),
            "second": w.table("second", KEYS, DIM, init=zero, mapping="hash")}


def _pull_all(tables):
    return {name: t.pull(np.arange(t.num_keys)) for name, t in tables.items()}


def _damage(path, file: str) -> bytes:
    part = path / file
    original = part.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    return original


@pytest.fixture(scope="module")
def saved_every_kind(tmp_path_factory):
    root = tmp_path_factory.mktemp("every-kind")

    def save(w):
        tables = _every_kind(w)
        for t in tables.values():
            t.push(np.arange(t.num_keys), np.full((t.num_keys, t.dim), w.rank + 1.0, np.float32))
        w.barrier()
        w.checkpoint(root)
        return _pull_all(tables)

    with ThreadCluster(nodes=2) as cluster:
        values = cluster.run_workers(save)[0]
    return root, values


@pytest.mark.parametrize("damaged", ["second:0", "second:1", "rep:1", "manifest", "latest"])
def test_a_failed_restore_loads_nothing_on_any_server(saved_every_kind, damaged):
    root, saved = saved_every_kind
    path = checkpoint.latest(root)
    manifest = checkpoint.read_manifest(path)
    restore_file = None
    if damaged == "manifest":
        target, original = path / "manifest.json", (path / "manifest.json").read_bytes()
        target.write_bytes(original[: len(original) // 2])
        match = "cannot read the manifest"
    elif damaged == "latest":
        target, original = root / "LATEST", (root / "LATEST").read_bytes()
        target.write_text("ckpt-999999999")
        match = "not a complete checkpoint"
    else:
        table, node = damaged.split(":")
        part = next(p for p in manifest["tables"][table]["parts"] if p["file"].split("/")[1].startswith(f"n{node}-"))
        target, original = path / part["file"], _damage(path, part["file"])
        restore_file, match = part["file"], "is damaged"

    try:
        with ThreadCluster(nodes=2) as cluster:
            def load(w):
                tables = _every_kind(w)
                with pytest.raises(CheckpointError, match=match) as failure:
                    w.restore(root)
                if restore_file is not None:
                    assert restore_file in str(failure.value)
                w.barrier()
                for name, rows in _pull_all(tables).items():  # every table as created: nothing was loaded
                    assert not rows.any(), f"table {name!r} was partly restored"
                w.barrier()
                if w.rank == 0:
                    target.write_bytes(original)
                w.barrier()
                assert w.restore(root) == 0  # once repaired, the same restore loads everything
                w.barrier()
                for name, rows in _pull_all(tables).items():
                    np.testing.assert_array_equal(rows, saved[name], err_msg=name)

            cluster.run_workers(load)
    finally:
        target.write_bytes(original)


def _save_one_table(root: Path) -> Path:
    with ThreadCluster(nodes=1) as c:
        w = c.worker(0)
        w.table("emb", 50, 2).push(np.arange(50), np.ones((50, 2), np.float32))
        w.advance_clock()
        return w.checkpoint(root)


def test_a_latest_file_of_garbage_is_a_checkpoint_error(tmp_path: Path) -> None:
    _save_one_table(tmp_path)
    (tmp_path / checkpoint.LATEST).write_bytes(b"\xff\xfe\x00ckpt")  # torn, or overwritten
    with pytest.raises(CheckpointError, match="cannot read"):
        checkpoint.latest(tmp_path)


@pytest.mark.parametrize("clock", ["missing", "seven", None, -1])
def test_a_manifest_without_a_clock_to_go_on_from_is_refused_before_any_row_is_loaded(tmp_path: Path, clock: object
                                                                                     ) -> None:
    # The clock was read after both phases of the restore had written every row (a KeyError, a
    # ValueError or a TypeError then, the rows loaded and the clock not resumed).
    path = _save_one_table(tmp_path)
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    if clock == "missing":
        del manifest["clock"]
    else:
        manifest["clock"] = clock
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with ThreadCluster(nodes=1) as c:
        w = c.worker(0)
        t = w.table("emb", 50, 2)
        with pytest.raises(CheckpointError, match="no clock to go on from"):
            w.restore(tmp_path)
        assert not t.pull(np.arange(50)).any()


def test_a_checkpoint_after_another_worker_drained_a_server_is_written(tmp_path: Path) -> None:
    # Rank 1 drains server 2 (its slices go to servers 0 and 1, then it leaves). Rank 0, which writes
    # the checkpoint, still listed server 2 and took it for dead: every attempt failed ("lost the rows").
    keys = np.arange(300)

    def body(w):
        t = w.table("emb", 300, 2, optimizer=shoal.optim.Sum(), slices=6)
        t.push(keys, np.ones((300, 2), np.float32))
        w.barrier()
        if w.rank == 1:
            w.remove_server(2, timeout=20)
        w.barrier()
        t.push(keys, np.ones((300, 2), np.float32))
        w.advance_clock()
        w.barrier()
        assert (t.pull(keys) == 2 * w.num_workers).all()
        return w.checkpoint(tmp_path)

    with ThreadCluster(nodes=3) as c:
        paths = c.run_workers(body, local_access=False)
    assert paths[0] == checkpoint.latest(tmp_path)
    with ThreadCluster(nodes=1) as c:  # what the two servers left held, every row once
        w = c.worker(0)
        t = w.table("emb", 300, 2, optimizer=shoal.optim.Sum(), slices=6)
        w.restore(tmp_path)
        assert (t.pull(keys) == 6).all()


@pytest.mark.heavy  # the rendezvous calls a server dead after 2 s without heartbeats
def test_a_replicated_table_restores_onto_its_live_replicas_when_a_server_is_dead(tmp_path: Path) -> None:
    # Every shard has a replica on two of three servers; server 2 dies before the restore. The live
    # replicas hold every row, and the restore is meant to go on without it: it counted the dead
    # server's copies among those to load and failed once every part was checked.
    import threading

    from shoal.cluster import membership

    keys, options = np.arange(30), {"replicas": 2, "init": shoal.Constant(0.0)}

    def save(w):
        w.table("rep", 30, 2, **options).push(keys, np.full((30, 2), w.rank + 1.0, np.float32))
        w.barrier()
        w.checkpoint(tmp_path)

    with ThreadCluster(nodes=3) as c:
        c.run_workers(save, local_access=False)
    with ThreadCluster(nodes=3) as c:
        workers = c.all_workers(local_access=False)
        tables = [w.table("rep", 30, 2, **options) for w in workers]
        c.servers[2].stop()
        c.threads[2].join(timeout=10)
        wait_until(lambda: not membership.status(workers[0].tracker, 5.0)["alive"][2], timeout=20,
                   what="server 2 called dead")
        errors: list[BaseException] = []

        def restore(w) -> None:
            try:
                w.restore(tmp_path)
            except BaseException as exc:  # the test's thread: reported below
                errors.append(exc)

        threads = [threading.Thread(target=restore, args=(w,)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors[0]
        np.testing.assert_array_equal(tables[0].pull(keys), 6.0)



def test_a_restored_replicated_table_read_by_merging_replicas_keeps_its_restored_values(tmp_path: Path) -> None:
    # The restored rows went into each replica's base, which a reader merging replicas (read quorum 2)
    # does not get: it added the replicas' origins to the initializer's rows, and lost the restored ones.
    keys = np.arange(20)
    options = {"replicas": 2, "read_quorum": 2, "gossip_ms": 10, "optimizer": shoal.optim.Sum(),
               "init": shoal.Constant(0.5)}

    def save(w):
        t = w.table("rep", 20, 1, **options)
        t.push(keys, np.full((20, 1), w.rank + 1.0, np.float32))
        w.barrier()
        w.checkpoint(tmp_path)
        return t.pull(keys)

    with ThreadCluster(nodes=2) as c:
        np.testing.assert_array_equal(c.run_workers(save)[0], 3.5)

    def load(w):
        t = w.table("rep", 20, 1, **options)
        w.restore(tmp_path)
        w.barrier()
        merged = t.pull(keys)
        w.barrier()  # every worker has read before any pushes (a read after the other's push saw 4.5)
        t.push(keys, np.ones((20, 1), np.float32))
        w.barrier()
        wait_until(lambda: (t.pull(keys) == 5.5).all(), what="both pushes, over the restored rows")
        return merged

    with ThreadCluster(nodes=2) as c:
        for merged in c.run_workers(load):
            np.testing.assert_array_equal(merged, 3.5)


REP_KEYS, STATIC_KEYS = 30, 40


def _rep_and_static(w):
    # "rep" sorts before "zstatic": every server loads the replicated table first.
    rep = w.table("rep", REP_KEYS, 2, replicas=2, gossip_ms=10, optimizer=shoal.optim.Adagrad(lr=0.1),
                  init=shoal.Constant(0.0))
    static = w.table("zstatic", STATIC_KEYS, 2, init=shoal.Constant(0.0))
    return rep, static


def test_a_replicated_restore_survives_gossip_of_the_restored_rows_from_a_peer_that_committed_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The commit of a restore reaches server 1 half a second after server 0 (a lost message sent
    # again, a slow link): meanwhile server 0 loaded its replicas and gossiped their RESTORED origin
    # to server 1. Server 1's restore took that origin for "updates taken already" and refused
    # (server/replicated.py restore), after server 0 had loaded every table: the static table was
    # left half restored, server 1's Adagrad accumulators were not restored, and every later restore
    # of the same checkpoint was refused for good.
    rep_keys, static_keys = np.arange(REP_KEYS), np.arange(STATIC_KEYS)

    def save(w):
        rep, static = _rep_and_static(w)
        rep.push(rep_keys, np.full((REP_KEYS, 2), w.rank + 1.0, np.float32))
        static.push(static_keys, np.full((STATIC_KEYS, 2), w.rank + 1.0, np.float32))
        w.barrier()
        w.checkpoint(tmp_path)
        w.barrier()
        return rep.pull(rep_keys), static.pull(static_keys)

    with ThreadCluster(nodes=2) as cluster:
        saved_rep, saved_static = cluster.run_workers(save)[0]

    ask = client_checkpoints._ask_servers

    def commit_reaches_server_1_late(worker, body, servers):
        if isinstance(body, bodies.Restore) and body.commit and len(servers) > 1:
            first = ask(worker, body, servers[:1])
            time.sleep(0.5)  # 50 gossip rounds
            return first + ask(worker, body, servers[1:])
        return ask(worker, body, servers)

    monkeypatch.setattr(client_checkpoints, "_ask_servers", commit_reaches_server_1_late)

    def load(w):
        rep, static = _rep_and_static(w)
        outcome = None
        try:
            w.restore(tmp_path)
        except shoal.ShoalError as exc:
            outcome = exc
        w.barrier()
        return outcome, rep.pull(rep_keys), static.pull(static_keys)

    with ThreadCluster(nodes=2) as cluster:
        results = cluster.run_workers(load)
    for outcome, rep_rows, static_rows in results:
        assert outcome is None, f"a valid checkpoint was refused: {outcome}"
        np.testing.assert_array_equal(static_rows, saved_static)
        np.testing.assert_array_equal(rep_rows, saved_rep)


def test_a_dense_table_is_not_restored_into_a_tensor_of_another_shape(tmp_path: Path) -> None:
    # A dense (3, 5) tensor is one row of 15 values; a (5, 3) one is the same row. With the shape saved
    # nowhere the two tables' specs were equal, and the saved matrix came back silently reinterpreted
    # in the other shape. The shape is part of the spec now.
    with ThreadCluster(nodes=1) as cluster:
        w = cluster.worker(0)
        w.dense("W", (3, 5), optimizer=shoal.optim.Sum()).push(np.arange(15, dtype=np.float32).reshape(3, 5))
        w.checkpoint(tmp_path)
    with ThreadCluster(nodes=1) as cluster:
        w = cluster.worker(0)
        transposed = w.dense("W", (5, 3), optimizer=shoal.optim.Sum())
        with pytest.raises(shoal.CheckpointError, match="shape"):
            w.restore(tmp_path)
        assert not transposed.pull().any()
