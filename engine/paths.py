"""Where Velox keeps its files: the per-user data directory (overridable for tests with VELOX_DATA_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "Velox"


def data_dir() -> Path:
    """The user data directory, created on first use."""
    override = os.environ.get("VELOX_DATA_DIR")
    path = Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_dir() -> Path:
    """Where Velox writes its log files (overridable with VELOX_LOG_DIR), created on first use."""
    override = os.environ.get("VELOX_LOG_DIR")
    path = Path(override) if override else Path(platformdirs.user_log_dir(APP_NAME, appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path
