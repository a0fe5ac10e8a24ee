"""Job processes forked from a launcher that loaded Shoal once: each must be what a fresh interpreter
running its command would have been, and the job must end as it did with fresh interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.launch.forked import PythonMain, python_main

PYTHON = sys.executable

#: what a worker sees of itself, written to the file named by its last argument (one per rank)
INTROSPECT = """
import json, logging, os, sys, threading, time
import numpy as np
import shoal
ps = shoal.init()
cpu_after_init = time.process_time()
seen = {
    "name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "cpu_after_init": cpu_after_init, "preloaded": ["numba" in sys.modules, "shoal.client.worker" in sys.modules],
    "draw": float(np.random.random()), "log_handlers": len(logging.root.handlers),
    "rank_env": os.environ["SHOAL_RANK"], "comm": open(f"/proc/{os.getpid()}/comm").read().strip(),
    "servers_preloaded": ["/numba/" in open(f"/proc/{s['pid']}/maps").read() for s in ps.server_stats()],
}
ps.barrier()
ps.shutdown()
out = sys.argv[-1] + f".{seen['rank_env']}"
open(out, "w").write(json.dumps(seen))
"""


def shoal_run(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "shoal.launch.cli", "run", "--connect-timeout", "30", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_only_this_interpreter_running_a_script_a_module_or_code_is_forked(tmp_path):
    assert python_main([PYTHON, "train.py", "--lr", "1"]) == PythonMain("script", "train.py", ("--lr", "1"))
    assert python_main([PYTHON, "-u", "-m", "pkg.train", "x"]) == PythonMain("module", "pkg.train", ("x",))
    assert python_main([PYTHON, "-c", "print(1)", "a"]) == PythonMain("code", "print(1)", ("a",))
    other = tmp_path / "python"  # the same file elsewhere is another environment
    other.symlink_to(os.path.realpath(PYTHON))
    for command in ([PYTHON], [PYTHON, "-u"], [PYTHON, "-m"], [PYTHON, "-O", "train.py"], [PYTHON, "-X", "dev", "t.py"],
                    ["bash", "-c", "true"], [str(other), "train.py"], ["no-such-program-here", "train.py"]):
        assert python_main(command) is None, command


@pytest.mark.parametrize("form", ["script", "module", "code"])
def test_a_forked_worker_is_what_a_fresh_interpreter_would_be(tmp_path, form):
    (tmp_path / "job.py").write_text(INTROSPECT)
    out = tmp_path / "seen"
    command = {"script": [PYTHON, "job.py", "a", str(out)], "module": [PYTHON, "-m", "job", "a", str(out)],
               "code": [PYTHON, "-c", INTROSPECT, "a", str(out)]}[form]
    done = shoal_run("--nodes", "2", "--", *command, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for rank, s in enumerate(seen):
        assert s["name"] == "__main__"
        assert s["argv"] == {"script": ["job.py", "a", str(out)], "module": [str(tmp_path / "job.py"), "a", str(out)],
                             "code": ["-c", "a", str(out)]}[form]
        assert s["path0"] == {"script": str(tmp_path), "module": str(tmp_path), "code": ""}[form]
        assert s["cwd"] == str(tmp_path) and s["rank_env"] == str(rank) and s["comm"] == f"shoal-w{rank}"
        assert s["log_handlers"] == 0  # not the launcher's logging
        # It starts with Shoal, numba and the kernels loaded, and has paid for none of it (a fresh
        # interpreter spends 0.25 s of CPU on the imports alone); so do the servers.
        assert s["preloaded"] == [True, True] and s["servers_preloaded"] == [True, True]
        assert s["cpu_after_init"] < 0.15
    assert seen[0]["draw"] != seen[1]["draw"]  # each its own random state, as fresh ones have


EXITS = """
import atexit, sys, threading, time, weakref
from pathlib import Path
import shoal
ps = shoal.init()
out = Path(sys.argv[1])
atexit.register(lambda: (out / f"atexit.{ps.rank}").write_text("ran"))
class Kept: pass
kept = Kept()
weakref.finalize(kept, (out / f"finalized.{ps.rank}").write_text, "ran")  # runs at exit, kept alive
def late():
    time.sleep(0.3)
    (out / f"thread.{ps.rank}").write_text("joined")
threading.Thread(target=late).start()  # not a daemon: the interpreter waits for it at exit
ps.barrier()
ps.shutdown()
if ps.rank == 1:
    print("rank 1 fails now", flush=True)
    raise RuntimeError("planned failure")
"""


def test_a_forked_worker_ends_as_an_interpreter_does_and_its_status_ends_the_job(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    done = shoal_run("--nodes", "1", "--workers-per-node", "2", "--", PYTHON, str(script), str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RuntimeError: planned failure" in done.stdout and "[w1] Traceback" in done.stdout
    assert (tmp_path / "thread.1").read_text() == "joined" and (tmp_path / "atexit.1").read_text() == "ran"
    assert (tmp_path / "finalized.1").read_text() == "ran"
    exited = shoal_run("--nodes", "1", "--", PYTHON, "-c", "import sys; print('bye'); sys.exit(3)")
    assert exited.returncode == 3 and "[w0] bye" in exited.stdout, exited.stdout + exited.stderr


def forked_from(cwd: Path) -> list[int]:
    """Processes whose working directory is ``cwd``: what a launcher started there and left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if os.readlink(entry / "cwd") == str(cwd):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_children_forked_for_a_job_that_cannot_start_are_ended_and_reaped(tmp_path):
    # The children are forked before the rendezvous binds: when it cannot, they must not stay waiting.
    done = shoal_run("--nodes", "2", "--host", "203.0.113.7", "--", PYTHON, "-c", "pass", cwd=tmp_path)
    assert done.returncode != 0 and "203.0.113.7" in done.stderr, done.stdout + done.stderr
    deadline = time.monotonic() + 10
    while forked_from(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert forked_from(tmp_path) == []


def test_fresh_interpreters_on_request_and_for_commands_of_other_programs(tmp_path):
    (tmp_path / "job.py").write_text(INTROSPECT)
    out = tmp_path / "seen"
    done = shoal_run("--nodes", "2", "--fresh-interpreters", "--", PYTHON, "job.py", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(Path(f"{out}.0").read_text())
    assert seen["preloaded"] == [False, True] and seen["servers_preloaded"] == [False, False]
    assert seen["comm"] != "shoal-w0"
    # A shell command is started as it is; the servers are still forked.
    shell = shoal_run("--nodes", "1", "--", "bash", "-c", "echo from bash $SHOAL_RANK")
    assert shell.returncode == 0 and "[w0] from bash 0" in shell.stdout, shell.stdout + shell.stderr


BUSY_LAUNCHER = """
import sys, threading, time
import zmq
import shoal.launch.local
from shoal.launch.forked import safe_to_fork
assert safe_to_fork()
context = zmq.Context()
socket = context.socket(zmq.PAIR)  # its I/O threads, seen once they have named themselves
deadline = time.monotonic() + 30
while safe_to_fork() and time.monotonic() < deadline:
    time.sleep(0.01)
assert not safe_to_fork()
socket.close(); context.term()
stop = threading.Event()
threading.Thread(target=stop.wait).start()
assert not safe_to_fork()
try:
    sys.exit(shoal.launch.local.run([sys.executable, sys.argv[1], sys.argv[2]], nodes=1, fork_from_launcher=True))
finally:
    stop.set()
"""


def test_a_launcher_running_other_threads_starts_fresh_interpreters(tmp_path):
    # A fork copies only the calling thread: a lock another held would stay held in every child.
    (tmp_path / "job.py").write_text(INTROSPECT)
    (tmp_path / "launcher.py").write_text(BUSY_LAUNCHER)
    out = tmp_path / "seen"
    done = subprocess.run([PYTHON, "launcher.py", "job.py", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(Path(f"{out}.0").read_text())["preloaded"] == [False, True]


CLEANING_LAUNCHER = """
import atexit, os, sys, tempfile
from pathlib import Path
import shoal.launch.local
log = Path(sys.argv[2])
atexit.register(lambda: log.open("a").write(f"launcher exit handler in {os.getpid()}\\n"))
with tempfile.TemporaryDirectory() as tmp:
    status = shoal.launch.local.run([sys.executable, "-c", "import shoal, sys; ps = shoal.init(); "
                                     "open(sys.argv[1] + '/out', 'w').write('done'); ps.shutdown()", tmp],
                                    nodes=2, fork_from_launcher=True)
    print(status, Path(tmp, "out").read_text())
"""


def test_the_launchers_exit_handlers_and_finalizers_stay_its_own(tmp_path):
    # Run at a forked child's exit, the launcher's TemporaryDirectory finalizer deleted the directory
    # the job wrote its results into (the MF demo's), and its exit handlers ran once per process.
    (tmp_path / "launcher.py").write_text(CLEANING_LAUNCHER)
    log = tmp_path / "exits.log"
    done = subprocess.run([PYTHON, "launcher.py", "job.py", str(log)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "0 done", done.stdout + done.stderr
    assert log.read_text().count("launcher exit handler") == 1


#: after the launcher's preload, what a server does at a table's build, its first intent and the first
#: answer to a replica's sync, and a worker at its first batch split over nodes
FIRST_WORK = """
import json, sys
import numpy as np
from shoal.launch.forked import preload
preload()
import shoal
from shoal.api.config import TableSpec
from shoal.placement import kernels as routing
from shoal.placement.intent import NodeIntents
from shoal.storage import kernels
from shoal.storage.initialize import fill_initial

def signatures():
    return {name: len(getattr(module, name).signatures) for module, names in
            ((kernels, ("seeded_normal", "seeded_uniform", "partition_by_owner")),
             (routing, ("distinct", "rows_in_range", "count_answered")))
            for name in names}

before = signatures()
wire = np.frombuffer(np.arange(4, dtype=np.int64).tobytes(), dtype=np.int64)  # keys as a message brings them
NodeIntents(num_keys=8).add(wire, 0, 1)
routing.rows_in_range(wire, 0, 8, np.empty(4, dtype=np.int64))
routing.count_answered(np.ones(8, dtype=np.int32), np.arange(4), np.arange(4))  # as a replica's server calls it
kernels.partition_by_owner(np.arange(4) % 2, 2)  # a worker's batch over two nodes
for init in (shoal.Normal(std=0.1), shoal.Uniform(-0.1, 0.1)):
    fill_initial(TableSpec("t", 8, 3, init=init), np.arange(4), np.empty((4, 3), np.float32))
print(json.dumps([before, signatures()]))
"""


def test_the_preload_leaves_no_kernel_to_compile_or_load_at_a_first_build_intent_sync_or_split():
    """Keys read from a message are read-only, a form numba compiles apart: without it in the preload
    each server compiled it at its first intent in a fresh install (0.6 s of CPU, during training)
    and loaded it at every job's first intent; the same for the initial rows at a table's build, for
    the count of a replica's syncs answered (loaded at the first answer, mid-training), and for a
    worker's split of a batch over nodes."""
    done = subprocess.run([PYTHON, "-c", FIRST_WORK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert after == before, (before, after)


#: every dtype a table may have, in a forked job: the preload loads the float32 kernels only
DTYPES = """
import sys
import numpy as np
import shoal
ps = shoal.init()
for dtype in ("float32", "float64"):
    for techniques in ("static", "auto"):
        t = ps.table(f"{dtype}_{techniques}", 100, 3, dtype=dtype, techniques=techniques, init=shoal.Constant(0.0),
                     optimizer=shoal.optim.Sum())
        keys = np.arange(ps.rank, 100, 7)
        if techniques == "auto":
            t.intent(keys, ps.clock + 1, ps.clock + 3)
        ps.advance_clock()
        t.push(keys, np.ones((keys.size, 3), dtype=dtype))
        ps.barrier()
        values = t.pull(np.arange(100))
        assert values.dtype == np.dtype(dtype), values.dtype
        expected = np.zeros(100)
        for rank in range(ps.num_workers):
            expected[rank::7] += 1
        assert (values == expected[:, None]).all(), (dtype, techniques, values[:, 0])
        ps.barrier()
ps.shutdown()
"""


def test_tables_of_either_dtype_serve_in_a_forked_job(tmp_path):
    (tmp_path / "job.py").write_text(DTYPES)
    done = shoal_run("--nodes", "2", "--", PYTHON, "job.py", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
