"""A process started with malformed ``SHOAL_*`` variables fails at once, naming the variable (README,
"Many machines"): each case here failed with a raw traceback, named an internal field, or went on."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

# ---------------------------------------------------------------------------------------------
# README, "Many machines": "Any other scheduler ... starts ... the workers with the `SHOAL_*`
# variables set ... A missing or malformed variable fails at once with its name." (also the
# docstring of shoal/launch/env.py). These malformed values fail without naming the variable
# (raw OverflowError/ValueError tracebacks, or a ConfigError about an internal field), or are
# silently accepted and the process goes on.

_BASE = {
    "SHOAL_CLUSTER_ID": "readmereview",
    "SHOAL_NUM_NODES": "1",
    "SHOAL_WORKERS_PER_NODE": "1",
    "SHOAL_RENDEZVOUS": "tcp://127.0.0.1:9",  # nothing answers: a process that gets past its checks fails later
    "SHOAL_NODE": "0",
    "SHOAL_RANK": "0",
    "SHOAL_CONNECT_TIMEOUT": "1",
    "SHOAL_SECRET": "00112233445566778899aabbccddeeff",
    "SHOAL_METRICS": "0",
}

_WORKER = [sys.executable, "-c", "import shoal; shoal.init()"]
_SERVER = [sys.executable, "-m", "shoal.launch.server_main"]


def _run_with(command: list[str], name: str, value: str) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(_BASE)
    if name == "SHOAL_METRICS_PORT":
        env.pop("SHOAL_METRICS")
    env[name] = value
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    started = time.monotonic()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    return time.monotonic() - started, proc.stdout + proc.stderr


@pytest.mark.parametrize(("command", "name", "value"), [
    (_WORKER, "SHOAL_METRICS_PORT", "70000"),   # OverflowError: bind(): port must be 0-65535.
    (_SERVER, "SHOAL_METRICS_PORT", "-5"),      # OverflowError traceback from the server
    (_SERVER, "SHOAL_LOG_LEVEL", "LOUD"),       # ValueError: Unknown level: 'LOUD'
    (_WORKER, "SHOAL_NUM_NODES", "0"),          # ConfigError: num_nodes must be >= 1, got 0
    (_WORKER, "SHOAL_CONNECT_TIMEOUT", "-1"),   # ConfigError: Timeouts.connect_s must be > 0 seconds
    (_WORKER, "SHOAL_FAULTS", "bogus"),         # ConfigError: bad fault setting 'bogus' in 'bogus'
    (_WORKER, "SHOAL_LAUNCHER_PID", "abc"),     # ignored: the worker is not bound to any launcher
    (_WORKER, "SHOAL_LOCAL_ACCESS", "maybe"),   # ignored: taken as on
], ids=lambda v: v if isinstance(v, str) else ("worker" if v is _WORKER else "server"))
def test_a_malformed_shoal_variable_fails_at_once_with_its_name(command: list[str], name: str, value: str):
    took, output = _run_with(command, name, value)
    assert name in output, f"{name}={value!r} did not fail naming {name} (after {took:.1f} s):\n{output[-600:]}"
    assert took < 0.5 + 10, output  # at once, not after waiting for peers
