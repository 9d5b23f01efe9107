"""Settings remembered across restarts, in `data_dir()/settings.json`.

Loading never fails: a missing file gives the defaults, a missing or invalid value gives that value's
default, and a file that is not valid JSON is moved aside (renamed with a timestamp, logged) and the
defaults are used. Keys this version does not know are kept and written back, so running an older Velox
does not erase a newer one's settings. Saving is atomic: the JSON goes to a temporary file in the same
folder, is synced to disk and then renamed over the old file, so a crash leaves the old or the new
settings, never half of each.

No MLX or Qt import here: the app reads its settings before anything else starts.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.paths import data_dir
from engine.planning.recommend import LEVEL_KEYS

SETTINGS_FILE_NAME = "settings.json"
SETTINGS_FORMAT_VERSION = 1
THEMES = ("system", "light", "dark")
# 'auto' follows engine.planning.recommend's recommendation; otherwise one of the level keys ('16', '8', ...).
AUTO_COMPRESSION = "auto"
COMPRESSION_CHOICES = (AUTO_COMPRESSION, *LEVEL_KEYS)
MAX_TEMPERATURE = 2.0
MAX_TOKENS_LIMIT = 1_000_000
# Conversations' KV caches kept on disk beside the database (engine.chat.saved_cache), least recently used
# evicted first; 0 keeps none. The menu offers these sizes.
DEFAULT_SAVED_CACHE_BUDGET = 2 * 1024**3
SAVED_CACHE_BUDGET_CHOICES = (0, 512 * 1024**2, 1024**3, DEFAULT_SAVED_CACHE_BUDGET, 5 * 1024**3, 10 * 1024**3)
MAX_SAVED_CACHE_BUDGET = 1024**5

logger = logging.getLogger(__name__)


@dataclass
class Settings:
    last_model: str | None = None  # a model folder path or name, as engine.models.catalog.resolve_model takes it
    compression: str = AUTO_COMPRESSION
    method_override: str | None = None  # advanced: a KV cache method name that replaces the level's method
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    window_geometry: bytes | None = None  # QWidget.saveGeometry(); base64 in the file
    theme: str = "system"
    saved_cache_budget_bytes: int = DEFAULT_SAVED_CACHE_BUDGET  # disk kept for conversations' caches; 0: none
    # Keys found in the file that this version does not know; written back unchanged.
    unknown_keys: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _optional_text(value: Any) -> bool:
    return value is None or (isinstance(value, str) and bool(value.strip()))


# One check per field: a stored value failing it is replaced by the default.
_VALIDATORS: dict[str, Any] = {
    "last_model": _optional_text,
    "compression": lambda value: value in COMPRESSION_CHOICES,
    "method_override": _optional_text,
    "temperature": lambda value: _is_number(value) and 0.0 <= value <= MAX_TEMPERATURE,
    "top_p": lambda value: _is_number(value) and 0.0 < value <= 1.0,
    "max_tokens": lambda value: isinstance(value, int) and not isinstance(value, bool)
    and 1 <= value <= MAX_TOKENS_LIMIT,
    "theme": lambda value: value in THEMES,
    "saved_cache_budget_bytes": lambda value: isinstance(value, int) and not isinstance(value, bool)
    and 0 <= value <= MAX_SAVED_CACHE_BUDGET,
}


def settings_path() -> Path:
    return data_dir() / SETTINGS_FILE_NAME


def _decode_geometry(value: Any) -> bytes | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None


def settings_from_dict(data: dict[str, Any]) -> Settings:
    """Settings from a decoded JSON object: known, valid values taken; the rest defaults or kept aside."""
    settings = Settings()
    known = {f.name for f in fields(Settings)} - {"unknown_keys"}
    for name, value in data.items():
        if name == "version":
            continue
        if name not in known:
            settings.unknown_keys[name] = value
        elif name == "window_geometry":
            settings.window_geometry = _decode_geometry(value)
        elif _VALIDATORS[name](value):
            if name in ("temperature", "top_p"):
                value = float(value)
            setattr(settings, name, value)
        else:
            logger.warning("Ignoring the invalid setting %s=%r; using the default.", name, value)
    return settings


def settings_to_dict(settings: Settings) -> dict[str, Any]:
    data: dict[str, Any] = dict(settings.unknown_keys)
    data["version"] = SETTINGS_FORMAT_VERSION
    for f in fields(Settings):
        if f.name == "unknown_keys":
            continue
        value = getattr(settings, f.name)
        if f.name == "window_geometry":
            value = base64.b64encode(value).decode("ascii") if value else None
        data[f.name] = value
    return data


def load_settings(path: str | Path | None = None) -> Settings:
    """The saved settings, or the defaults for anything missing, invalid or unreadable."""
    path = Path(path) if path is not None else settings_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Settings()
    except OSError as error:
        logger.warning("The settings file %s cannot be read (%s); using the defaults.", path, error)
        return Settings()
    try:
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict):
            raise ValueError("it does not hold a JSON object")
    except ValueError as error:  # includes JSONDecodeError and UnicodeDecodeError
        moved = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        try:
            path.replace(moved)
            logger.warning("The settings file %s is damaged (%s); moved it to %s, using defaults.", path, error, moved)
        except OSError:
            logger.warning("The settings file %s is damaged (%s); using the defaults.", path, error)
        return Settings()
    return settings_from_dict(data)


def save_settings(settings: Settings, path: str | Path | None = None) -> None:
    """Write the settings atomically (temporary file, fsync, rename)."""
    path = Path(path) if path is not None else settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(settings_to_dict(settings), indent=2, sort_keys=True, ensure_ascii=False)
    descriptor, temporary_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            stream.write(text + "\n")
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary_name, path)
    except BaseException:
        Path(temporary_name).unlink(missing_ok=True)
        raise
    # Make the rename itself durable (POSIX: the directory entry lives in the folder).
    if hasattr(os, "O_DIRECTORY"):
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
