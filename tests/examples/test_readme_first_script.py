"""The README's first script runs as printed and prints what the README shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _first_script_section() -> str:
    text = README.read_text()
    start = text.index("## Your first script")
    return text[start:text.index("\n## ", start + 1)]


def test_the_first_script_runs_and_prints_what_the_readme_shows(tmp_path):
    section = _first_script_section()
    script = re.search(r"```python\n(.*?)```", section, re.S)[1]
    shown = re.search(r"```text\n(.*?)```", section, re.S)[1].splitlines()
    command = re.search(r"```sh\n(shoal run .*?) -- python first.py\n```", section)[1].split()
    (tmp_path / "first.py").write_text(script)
    done = subprocess.run([sys.executable, "-m", "shoal.launch.cli", *command[1:], "--", sys.executable, "first.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = done.stdout.splitlines()
    assert sorted(printed) == sorted(shown), done.stdout
