"""The long fuzz run: the wire decoder and every server op, 100,000 cases and more.

    python benchmarks/fuzz.py [--cases 100000] [--seconds 3600] [--atheris-runs 200000]

Runs the properties of ``tests/wire/test_fuzz.py`` (strategies and checks in
``tests/support/fuzzing.py`` and ``fuzz_server.py``) for ``--cases`` cases in all,
split over five targets: the decoder on random bytes, on broken messages, and on
broken signed messages (keyed BLAKE3 tags), and a real server fed decodable
requests of every op, broken ones, garbage and attacks on a protected table, with
the job's secret (the default: requests with a valid tag and without, replayed,
from senders out of their role) and without one. A decoder case passes if it yields a message that fits its schema
or a ``ShoalError``; a server case if no handler fails and every reply is
well-formed; at the end of every chunk the protected table must be bit-identical.

Each target runs in a child process with a deadline, in chunks of fresh Hypothesis
runs: a hang shows as a child that outlives its deadline (and is killed), not as a
stuck script. Then, if ``atheris`` imports, ``fuzz_atheris.py`` runs a
coverage-guided pass over the decoder and the server for ``--atheris-runs`` inputs.
Counts, rates and failures go to ``results/fuzz.{json,md}``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from tests.support.fuzz_frames import broken_frames, check_decode, random_frames  # noqa: E402
from tests.support.fuzz_server import FuzzServer, feed_case, server_cases  # noqa: E402
from tests.support.fuzzing import LIMITS, SECRET, run_property  # noqa: E402

from common import write_results  # noqa: E402
from shoal.wire import Codec  # noqa: E402

#: share of the cases for each target
TARGETS = {
    "decode: random bytes": 0.10,
    "decode: broken messages": 0.15,
    "decode: broken signed messages": 0.20,
    "server with a secret (the default): requests, broken and garbage": 0.40,
    "server without a secret: requests, broken and garbage": 0.15,
}
CHUNK = 2500  # cases per Hypothesis run; a fresh run starts from fresh random choices
GRACE_S = 120  # past its deadline, a child still running is hung


def _failure(exc: BaseException) -> str:
    """The exception and Hypothesis' falsifying example, for the results file."""
    return "".join(traceback.format_exception(exc))[-4000:]


def run_target(name: str, cases: int, seconds: float) -> dict[str, Any]:
    """Run one target for ``cases`` cases or ``seconds``, whichever ends first (in a child process)."""
    started = time.monotonic()
    deadline = started + seconds
    secret = SECRET if "signed" in name or "with a secret" in name else None
    outcomes: Counter[str] = Counter()
    fuzz = FuzzServer(secret) if name.startswith("server") else None
    if fuzz is None:
        codec = Codec(LIMITS, secret)
        strategy = random_frames if "random" in name else broken_frames(secret)

        def check(frames: Any) -> None:
            outcomes[check_decode(codec, frames)] += 1

        def count() -> int:
            return sum(outcomes.values())
    else:
        strategy, check = server_cases(fuzz), partial(feed_case, fuzz)

        def count() -> int:
            return fuzz.cases
    failures = []
    intact: bool | None = None
    slowest = 0.0
    try:
        while count() < cases and time.monotonic() < deadline:
            try:
                run_property(strategy, check, min(CHUNK, cases - count()), derandomize=False)
                if fuzz is not None:
                    fuzz.tick()
                    fuzz.check_intact()
            except Exception as exc:  # a failing case, found and shrunk by Hypothesis
                failures.append(_failure(exc))
                break
        if fuzz is not None:
            try:
                fuzz.check_intact()
                intact = True
            except AssertionError as exc:
                failures.append(_failure(exc))
                intact = False
    finally:
        if fuzz is not None:
            outcomes.update(fuzz.tally)
            slowest = fuzz.slowest_s
            fuzz.close()
    elapsed = time.monotonic() - started
    result: dict[str, Any] = {"cases": count(), "seconds": round(elapsed, 1),
                              "cases_per_s": round(count() / elapsed, 1), "failures": failures,
                              "outcomes": dict(sorted(outcomes.items()))}
    if fuzz is not None:
        result |= {"protected_table_intact": intact, "slowest_case_s": round(slowest, 3)}
    return result


def run_child(name: str, cases: int, seconds: float) -> dict[str, Any]:
    """Run a target in a child process; a child that outlives its deadline is killed and counted as hung."""
    with tempfile.TemporaryDirectory(prefix="shoal-fuzz-out-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", name, "--cases", str(cases), "--seconds", str(seconds),
                   "--out", str(out)]
        try:
            proc = subprocess.run(command, timeout=seconds + GRACE_S, capture_output=True, text=True)
        except subprocess.TimeoutExpired:  # run() has killed and reaped it
            return {"cases": 0, "hang": True, "failures": [f"no result {seconds + GRACE_S:.0f}s in: a hang"]}
        if not out.exists():
            return {"cases": 0, "hang": False, "failures": [f"child exited {proc.returncode}: {proc.stderr[-4000:]}"]}
        return {**json.loads(out.read_text()), "hang": False}


def run_atheris(runs: int, seconds: int) -> dict[str, Any]:
    """The coverage-guided pass, in a child process (libFuzzer ends its process when done)."""
    if importlib.util.find_spec("atheris") is None:
        return {"skipped": "atheris is not installed (pip install 'shoal[fuzz]')"}
    work = Path(tempfile.mkdtemp(prefix="shoal-atheris-"))
    command = [sys.executable, str(HERE / "fuzz_atheris.py"), "--runs", str(runs), "--seconds", str(seconds),
               "--work", str(work)]
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=seconds + GRACE_S)
        hang = False
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        hang = True
    elapsed = time.monotonic() - started
    shutil.rmtree(Path(tempfile.gettempdir()) / f"shoal-fuzz-{proc.pid}", ignore_errors=True)  # its FuzzServer's
    done = re.findall(r"Done (\d+) runs in (\d+) second", output)
    coverage = re.findall(r"cov: (\d+) ft: (\d+)", output)
    crashes = sorted(p.name for p in work.glob("crash-*")) + sorted(p.name for p in work.glob("timeout-*"))
    result = {
        "runs": int(done[-1][0]) if done else None,
        "seconds": round(elapsed, 1),
        "exit_code": proc.returncode,
        "hang": hang,
        "coverage_edges": int(coverage[-1][0]) if coverage else None,
        "coverage_features": int(coverage[-1][1]) if coverage else None,
        "failures": [] if proc.returncode == 0 and not hang else [output[-4000:]],
        "crash_inputs": {name: (work / name).read_bytes().hex()[:4000] for name in crashes},
    }
    shutil.rmtree(work, ignore_errors=True)
    if result["runs"]:
        result["runs_per_s"] = round(result["runs"] / elapsed, 1)
    return result


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def tree() -> dict[str, Any]:
    """Which code was fuzzed: the commit, and whether the working tree differed from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    changed = [line.split(maxsplit=1)[1] for line in git("status", "--porcelain", "--", "src").splitlines()]
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_changes_in_src": changed}


def table(results: dict[str, Any]) -> str:
    lines = ["| target | cases | seconds | cases/s | failures | hang |", "|---|---:|---:|---:|---:|---|"]
    for name, r in results["targets"].items():
        lines.append(f"| {name} | {r['cases']:,} | {r.get('seconds', '-')} | {r.get('cases_per_s', '-')} "
                     f"| {len(r['failures'])} | {r['hang']} |")
    t = results["total"]
    lines.append(f"| **all Hypothesis targets** | **{t['cases']:,}** | {t['seconds']} | {t['cases_per_s']} "
                 f"| {t['failures']} | |")
    a = results["atheris"]
    if "skipped" in a:
        lines.append(f"\natheris: skipped ({a['skipped']}).")
    else:
        lines.append(f"\natheris {results['versions']['atheris']}: {a['runs']} runs in {a['seconds']} s, "
                     f"{len(a['failures'])} failure(s), coverage {a['coverage_edges']} edges / "
                     f"{a['coverage_features']} features.")
    server = results["targets"]["server with a secret (the default): requests, broken and garbage"]
    lines.append(f"\nProtected table intact after every chunk: {server.get('protected_table_intact')}; "
                 f"slowest server case {server.get('slowest_case_s')} s.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100_000, help="Hypothesis cases over all targets")
    parser.add_argument("--seconds", type=float, default=3600, help="time budget of the Hypothesis targets")
    parser.add_argument("--atheris-runs", type=int, default=200_000, help="inputs of the atheris pass (0: none)")
    parser.add_argument("--atheris-seconds", type=int, default=600)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.out).write_text(json.dumps(run_target(args.child, args.cases, args.seconds)))
        return

    results: dict[str, Any] = {
        "versions": {p: version(p) for p in ("hypothesis", "atheris", "numpy", "msgspec")},
        "tree": tree(), "cases_asked": args.cases, "seconds_budget": args.seconds, "targets": {},
    }
    started = time.monotonic()
    for name, share in TARGETS.items():
        cases = round(args.cases * share)
        print(f"{name}: {cases:,} cases ...", flush=True)
        r = results["targets"][name] = run_child(name, cases, max(60.0, args.seconds * share))
        print(f"  {r['cases']:,} cases in {r.get('seconds')} s ({r.get('cases_per_s')}/s), "
              f"{len(r['failures'])} failure(s){', HUNG' if r['hang'] else ''}", flush=True)
        for failure in r["failures"]:
            print(failure, flush=True)
    elapsed = time.monotonic() - started
    total = sum(r["cases"] for r in results["targets"].values())
    results["total"] = {"cases": total, "seconds": round(elapsed, 1), "cases_per_s": round(total / elapsed, 1),
                        "failures": sum(len(r["failures"]) for r in results["targets"].values()),
                        "hangs": sum(r["hang"] for r in results["targets"].values())}
    print(f"all: {total:,} cases in {elapsed:.0f} s ({total / elapsed:.0f}/s), "
          f"{results['total']['failures']} failure(s)", flush=True)
    if args.atheris_runs:
        print(f"atheris: {args.atheris_runs:,} runs ...", flush=True)
        results["atheris"] = run_atheris(args.atheris_runs, args.atheris_seconds)
    else:
        results["atheris"] = {"skipped": "--atheris-runs 0"}
    print(f"  {results['atheris']}"[:2000], flush=True)
    write_results("fuzz", results, table(results))
    failed = results["total"]["failures"] + results["total"]["hangs"] + len(results["atheris"].get("failures", []))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
