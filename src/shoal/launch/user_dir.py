"""The per-user directory where launchers leave what only their user may reach: jobs' run files and
secrets, and the warm launcher's socket. Light to import: ``shoal run`` reads it before anything
else, to find a warm launcher."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from shoal.api.errors import ConfigError


def runs_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"shoal-runs-{os.getuid()}"


def private_runs_dir() -> Path:
    """``runs_dir``, made if missing; refused unless it is ours and closed to everyone else (another
    user could have made it first in the shared temporary directory, to read what we put there)."""
    folder = runs_dir()
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(f"{folder} must be a directory of user {os.getuid()} that no one else may enter; "
                          "remove it, or set TMPDIR to a private directory")
    return folder
