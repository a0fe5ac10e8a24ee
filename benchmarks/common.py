"""Shared helpers: interleaved timing and result files. Benchmarks are not tests."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent


def run_example(script: Path, args: list[str], **cluster: Any) -> dict[str, Any]:
    """Run ``script`` on a local cluster (``cluster``: ``nodes=``, ``local_access=``, ...) and return
    what it wrote with ``--out`` (JSON)."""
    import shoal.launch.local

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        status = shoal.launch.local.run([sys.executable, str(script), *args, "--out", str(out)],
                                        prefix_output=False, **cluster)
        if status != 0:
            raise SystemExit(f"{script.name} {' '.join(args)} ({cluster}) failed with status {status}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def run_example_of(src: Path, script: Path, args: list[str], nodes: int) -> dict[str, Any]:
    """``run_example`` of the Shoal whose source is ``src`` (``checked_out``), in a launcher of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", str(nodes), "--no-prefix", "--",
               sys.executable, str(script), *args, "--out", str(out)]
        done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} with {src} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


@contextlib.contextmanager
def checked_out(rev: str) -> Iterator[tuple[str, Path]]:
    """Commit ``rev`` (its short name, and its ``src``) in a temporary git worktree, for as long as
    the block runs. Its source is compiled to bytecode first, as this tree's is and an installed
    package's: with none, each of a job's processes would compile every module again (0.4-0.5 s)."""
    short = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True, check=True,
                           cwd=ROOT).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), short], capture_output=True, check=True,
                       cwd=ROOT)
        try:
            for src in (ROOT / "src", tree / "src"):
                subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
            yield short, tree / "src"
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], capture_output=True, cwd=ROOT)


def time_call(fn: Callable[[], object], min_seconds: float = 0.2, min_calls: int = 5) -> float:
    """Median seconds per call over a run of at least ``min_seconds`` and ``min_calls`` calls."""
    fn()  # warm up (compilation, page faults)
    samples = []
    start = time.perf_counter()
    while len(samples) < min_calls or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
        if len(samples) > 100_000:
            break
    return statistics.median(samples)


def interleaved(contenders: dict[str, Callable[[], object]], rounds: int = 7, min_seconds: float = 0.2
                ) -> dict[str, float]:
    """Median seconds per call of each contender, alternating them round by round.

    Alternating spreads the machine's noise over all contenders instead of
    letting one of them run in a quiet or a busy phase alone.
    """
    per: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            per[name].append(time_call(fn, min_seconds))
    return {name: statistics.median(v) for name, v in per.items()}


def machine() -> dict[str, Any]:
    import os

    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "shmem_huge_pages": shmem_huge_pages()}


def shmem_huge_pages() -> str:
    """The kernel's transparent huge page policy for shared memory (the bracketed word), or "unknown".

    Private arrays get huge pages where numpy asks for them; Shoal's shared memory only where this
    policy is "advise" or "always", so it matters to any comparison of the two.
    """
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return "unknown"
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else "unknown"


def write_results(name: str, data: dict[str, Any], table: str) -> None:
    """Write ``results/<name>.json`` (figures) and ``results/<name>.md`` (the printed table)."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"machine": machine(), **data}, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(table + "\n")
    print(f"\nwrote {RESULTS / name}.json and .md")
