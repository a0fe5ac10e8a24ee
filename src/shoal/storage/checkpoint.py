"""Checkpoints on disk: every row of every table by global key, with its optimiser state.

Layout of a checkpoint root::

    root/LATEST                  name of the newest complete checkpoint
    root/ckpt-000000120/         one checkpoint, taken at clock 120
        manifest.json            clock, table specs, and every part with its size and SHA-256
        t0/n1-s3.npz             keys and arrays of slice 3 of table 0, as server 1 held it
    root/.staging-120-<hex>/     a checkpoint being written (ignored, removed on the next commit)

Parts are keyed by global key, not by row, so a checkpoint restores onto any
number of servers. A checkpoint becomes visible in two atomic steps: its
staging directory is renamed into place, then ``LATEST`` is replaced. A
process killed at any point leaves ``LATEST`` naming a complete checkpoint
(or none). Parts are plain ``.npz`` files read with ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from shoal.api.config import TableSpec
from shoal.api.errors import CheckpointError, ShoalError

FORMAT = 1
#: numpy parses each array's header with ast.literal_eval, which CPython 3.11 before 3.11.8 can fail
#: with "SystemError: AST constructor recursion depth mismatch" when threads do it at once
#: (python/cpython#106905): servers of one process (an embedded cluster) read parts one at a time
_NPY_PARSE = threading.Lock()
LATEST = "LATEST"
MANIFEST = "manifest.json"
_STAGING = ".staging-"
_PREFIX = "ckpt-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a temporary file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write leaves the old file and nothing else
        raise
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def new_staging(root: str | os.PathLike[str], clock: int) -> Path:
    """A fresh directory under ``root`` to write a checkpoint into."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f"{_STAGING}{clock}-{secrets.token_hex(4)}"
    staging.mkdir()
    return staging


def check_staging(staging: str | os.PathLike[str]) -> Path:
    """Refuse to write parts anywhere but into a staging directory that exists (a server's guard)."""
    path = Path(staging)
    if not path.name.startswith(_STAGING) or not path.is_dir():
        raise CheckpointError(f"{str(staging)!r} is not a checkpoint staging directory")
    return path


def write_part(staging: Path, table_index: int, part: str, keys: np.ndarray,
               arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Write one part (``keys`` and the rows' ``arrays``); returns its manifest entry."""
    folder = staging / f"t{table_index}"
    path = folder / f"{part}.npz"
    try:
        folder.mkdir(exist_ok=True)
        with open(path, "xb") as f:  # never overwrite: a part name is written once per checkpoint
            np.savez(f, keys=keys, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
    except FileExistsError:
        raise CheckpointError(f"part {str(path)!r} was written already (the same checkpoint asked for twice?)") \
            from None
    except OSError as exc:
        raise CheckpointError(f"cannot write part {str(path)!r}: {exc}") from None
    return {"file": f"t{table_index}/{path.name}", "rows": int(keys.shape[0]), "bytes": path.stat().st_size,
            "sha256": _sha256(path)}


def commit(root: str | os.PathLike[str], staging: Path, manifest: dict[str, Any], keep: int = 3) -> Path:
    """Make ``staging`` the newest checkpoint; keep the ``keep`` newest, drop older ones and stale staging."""
    root = Path(root)
    manifest = {"format": FORMAT, "created": time.time(), **manifest}
    for folder in staging.iterdir():
        if folder.is_dir():
            _fsync_dir(folder)
    _write_durably(staging / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    final = root / f"{_PREFIX}{int(manifest['clock']):09d}"
    if final.exists():
        final = root / f"{final.name}-{secrets.token_hex(3)}"
    os.rename(staging, final)
    _fsync_dir(root)
    _write_durably(root / LATEST, final.name.encode())
    _prune(root, final, keep)
    return final


def _prune(root: Path, newest: Path, keep: int) -> None:
    done = sorted((p for p in root.iterdir() if p.name.startswith(_PREFIX) and p.is_dir()),
                  key=lambda p: p.stat().st_mtime)
    for old in done[:-keep] if keep > 0 else []:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.iterdir():
        if stale.name.startswith(_STAGING):
            shutil.rmtree(stale, ignore_errors=True)


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def latest(root: str | os.PathLike[str]) -> Path:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one)."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        return root
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint under {str(root)!r} (no {LATEST} file)") from None
    except (OSError, UnicodeDecodeError) as exc:  # torn or overwritten
        raise CheckpointError(f"cannot read {root / LATEST}: {exc}") from None
    path = root / name
    if "/" in name or not name.startswith(_PREFIX) or not (path / MANIFEST).is_file():
        raise CheckpointError(f"{root / LATEST} names {name!r}, which is not a complete checkpoint")
    return path


def check_saved_spec(name: str, entry: Mapping[str, Any], spec: TableSpec) -> None:
    """Raise ``CheckpointError`` naming the fields in which the table was saved with another spec."""
    try:
        saved = TableSpec.from_dict(entry.get("spec"))
    except ShoalError as exc:
        raise CheckpointError(f"the checkpoint's spec of table {name!r} is damaged: {exc}") from None
    if "shape" not in entry["spec"]:  # saved before specs named a dense table's shape: taken as it is here
        saved = replace(saved, shape=spec.shape)
    if saved != spec:
        raise CheckpointError(f"table {name!r} was saved with a different spec: "
                              f"{saved.differences(spec, 'saved', 'here')}")


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the manifest of {str(path)!r}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{str(path)!r} has checkpoint format {found!r}, not {FORMAT}")
    tables = manifest.get("tables")
    if not isinstance(tables, dict) or not all(_is_entry(e) for e in tables.values()):
        # A RESTORE names its path on the wire: what lies there is checked before it is read.
        raise CheckpointError(f"the manifest of {str(path)!r} does not list its tables' specs and parts")
    clock = manifest.get("clock")
    if type(clock) is not int or clock < 0:  # the clock a restore goes on from: checked before any row is read
        raise CheckpointError(f"the manifest of {str(path)!r} has no clock to go on from (found {clock!r})")
    return manifest


def _is_entry(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("spec"), dict) and isinstance(entry.get("parts"), list)
            and all(isinstance(p, dict) and isinstance(p.get("file"), str) and type(p.get("bytes")) is int
                    and isinstance(p.get("sha256"), str) for p in entry["parts"]))


def part_keys(path: Path, part: dict[str, Any]) -> np.ndarray:
    """The keys of one part just written under ``path`` (its rows are not read)."""
    try:
        with _NPY_PARSE, np.load(path / part["file"], allow_pickle=False) as data:
            return np.asarray(data["keys"])
    except Exception as exc:
        raise CheckpointError(f"part {part['file']!r} under {str(path)!r} cannot be read back: {exc!r}") from None


def place_saved(targets: Mapping[str, np.ndarray], rows: np.ndarray, arrays: Mapping[str, np.ndarray],
                pick: np.ndarray, table: str, write: bool = True) -> None:
    """Restore: ``target[rows] = arrays[name][pick]`` for every target array (values and optimiser
    state); a part that lacks one, or holds rows of another shape, is refused by name before any
    row is written. ``write`` False only checks (a restore's first phase)."""
    for name, target in targets.items():
        source = arrays.get(name)
        if source is None or source.shape[1:] != target.shape[1:]:
            raise CheckpointError(f"part of {table!r} lacks {name!r} of rows {target.shape[1:]} (has {sorted(arrays)})")
    if write:
        for name, target in targets.items():
            target[rows] = arrays[name][pick]


def read_parts(path: Path, entry: dict[str, Any]) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Each part of one table's manifest entry: its keys and arrays, after checking size and checksum."""
    num_keys = int(entry["spec"]["num_keys"])
    for part in entry["parts"]:
        file = path / part["file"]
        if Path(part["file"]).is_absolute() or ".." in Path(part["file"]).parts:
            raise CheckpointError(f"part {part['file']!r} of {str(path)!r} points outside the checkpoint")
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {str(path)!r} lacks its part {part['file']!r}") from None
        if size != part["bytes"] or _sha256(file) != part["sha256"]:
            raise CheckpointError(f"part {part['file']!r} of {str(path)!r} is damaged (size or SHA-256 differ)")
        try:
            with _NPY_PARSE, np.load(file, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
        except Exception as exc:  # numpy and zipfile raise many types on a file that is no .npz
            raise CheckpointError(f"part {part['file']!r} of {str(path)!r} is not an .npz of arrays: {exc!r}") \
                from None
        keys = arrays.pop("keys", None)
        if keys is None or keys.ndim != 1 or keys.dtype.kind != "i":
            raise CheckpointError(f"part {part['file']!r} has no integer keys")
        if keys.size and (keys.min() < 0 or keys.max() >= num_keys):
            raise CheckpointError(f"part {part['file']!r} has keys outside [0, {num_keys})")
        if any(a.dtype.kind not in "biuf" for a in arrays.values()):
            raise CheckpointError(f"part {part['file']!r} holds arrays that are not numbers")
        if any(a.ndim == 0 or a.shape[0] != keys.shape[0] for a in arrays.values()):
            raise CheckpointError(f"part {part['file']!r}: arrays and keys disagree on the number of rows")
        yield keys, arrays
