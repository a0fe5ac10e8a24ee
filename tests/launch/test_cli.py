"""The ``shoal`` command's basics: its version, and help for every option."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

import shoal
from shoal.launch.cli import _parser


def test_version_is_the_installed_packages():
    done = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"shoal {shoal.__version__}"
    assert shoal.__version__ == importlib.metadata.version("shoal")


def test_every_option_of_every_command_has_help():
    parser = _parser()
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)][0].choices
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, sub in commands.items() for action in sub._actions
               if not action.help or action.help == argparse.SUPPRESS]
    assert not missing, missing
