"""The checkpoint format: commit is atomic, damage is found, a kill mid-write never costs the last one."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from shoal.api.errors import CheckpointError
from shoal.storage import checkpoint

SPEC = {"name": "emb", "num_keys": 10, "dim": 2}


def _commit(root, clock: int, values: np.ndarray):
    staging = checkpoint.new_staging(root, clock)
    keys = np.arange(values.shape[0], dtype=np.int64)
    parts = [checkpoint.write_part(staging, 0, "n0-s0", keys[:6], {"values": values[:6]}),
             checkpoint.write_part(staging, 0, "n1-s1", keys[6:], {"values": values[6:]})]
    return checkpoint.commit(root, staging, {"clock": clock, "tables": {"emb": {"spec": SPEC, "parts": parts}}})


def _read_all(path):
    manifest = checkpoint.read_manifest(path)
    out = {}
    for keys, arrays in checkpoint.read_parts(path, manifest["tables"]["emb"]):
        for k, row in zip(keys, arrays["values"], strict=True):
            out[int(k)] = row
    return manifest["clock"], np.stack([out[k] for k in sorted(out)])


def test_the_newest_commit_is_latest_and_older_ones_are_pruned(tmp_path):
    for clock in range(5):
        _commit(tmp_path, clock, np.full((10, 2), clock, np.float32))
    clock, values = _read_all(checkpoint.latest(tmp_path))
    assert clock == 4 and (values == 4).all()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000000002", "ckpt-000000003", "ckpt-000000004"]
    assert not list(tmp_path.glob(".staging-*"))


def test_damaged_or_missing_parts_and_no_checkpoint_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint under"):
        checkpoint.latest(tmp_path)
    path = _commit(tmp_path, 7, np.ones((10, 2), np.float32))
    part = path / "t0" / "n1-s1.npz"
    data = bytearray(part.read_bytes())
    data[-20] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="damaged"):
        _read_all(path)
    part.unlink()
    with pytest.raises(CheckpointError, match="lacks its part"):
        _read_all(path)


def test_a_part_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    path = _commit(tmp_path, 1, np.ones((10, 2), np.float32))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tables"]["emb"]["parts"][0]["file"] = "../../etc/passwd"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        _read_all(path)


def test_parts_are_only_written_into_a_staging_directory(tmp_path):
    with pytest.raises(CheckpointError, match="staging"):
        checkpoint.check_staging(str(tmp_path))


WRITER = """
import sys
import numpy as np
from shoal.storage import checkpoint
root = sys.argv[1]
spec = {"name": "emb", "num_keys": 400_000, "dim": 16}
keys = np.arange(400_000, dtype=np.int64)
for clock in range(1, 1000):
    values = np.full((400_000, 16), clock, np.float32)
    staging = checkpoint.new_staging(root, clock)
    parts = [checkpoint.write_part(staging, 0, f"n0-s{s}", keys[s::2], {"values": values[s::2]}) for s in range(2)]
    checkpoint.commit(root, staging, {"clock": clock, "tables": {"emb": {"spec": spec, "parts": parts}}})
    print(clock, flush=True)
"""


def test_sigkill_at_random_moments_never_leaves_a_broken_latest(tmp_path):
    """A writer commits checkpoints of 25 MB in a loop; after its first commit it is killed at a
    seeded random moment, and each time LATEST names a complete checkpoint whose every row carries
    one clock."""
    rng = random.Random(11)
    root = tmp_path / "ckpt"
    last_clock = 0
    for _ in range(6):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout is not None and writer.stdout.readline()  # one commit done: kill during others
            time.sleep(rng.uniform(0.0, 0.8))
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait(timeout=10)
        path = checkpoint.latest(root)
        manifest = checkpoint.read_manifest(path)
        rows = 0
        for keys, arrays in checkpoint.read_parts(path, manifest["tables"]["emb"]):
            assert (arrays["values"] == manifest["clock"]).all()
            rows += keys.shape[0]
        assert rows == 400_000
        last_clock = manifest["clock"]
    assert last_clock > 0


def test_a_failed_latest_write_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    first = _commit(tmp_path, 1, np.ones((10, 2), np.float32))
    real_replace = os.replace

    def refuse_latest(src, dst):
        if str(dst).endswith(checkpoint.LATEST):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", refuse_latest)
    with pytest.raises(OSError, match="No space left"):
        _commit(tmp_path, 2, np.full((10, 2), 2, np.float32))
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert checkpoint.latest(tmp_path) == first
