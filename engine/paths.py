"""Where Velox keeps its files: the per-user data directory (overridable for tests with VELOX_DATA_DIR).

The data directory holds whole conversations and documents, so it is private to the user: created 0700,
and tightened to 0700 when an older Velox left it readable by others (`private_dir`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import platformdirs

APP_NAME = "Velox"
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """Create `path` (and its parents) if needed and make `path` itself 0700; returns it."""
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    if os.name == "posix" and stat.S_IMODE(path.stat().st_mode) != PRIVATE_DIR_MODE:
        try:
            path.chmod(PRIVATE_DIR_MODE)
        except PermissionError:  # a folder we do not own (a shared VELOX_DATA_DIR): leave it as it is
            pass
    return path


def make_private_file(path: Path) -> None:
    """Make an existing file 0600 (readable and writable by its owner only); a missing file is ignored."""
    if os.name != "posix":
        return
    try:
        if stat.S_IMODE(path.stat().st_mode) != PRIVATE_FILE_MODE:
            path.chmod(PRIVATE_FILE_MODE)
    except FileNotFoundError:
        pass


def data_dir() -> Path:
    """The user data directory, created on first use, private to the user."""
    override = os.environ.get("VELOX_DATA_DIR")
    path = Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    return private_dir(path)


def models_dir() -> Path:
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_dir() -> Path:
    """Where Velox writes its log files (overridable with VELOX_LOG_DIR), created on first use, 0700."""
    override = os.environ.get("VELOX_LOG_DIR")
    path = Path(override) if override else Path(platformdirs.user_log_dir(APP_NAME, appauthor=False))
    return private_dir(path)  # logs name the user's documents and models: private like the data dir
