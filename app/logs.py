"""The log file a user can attach to a bug report: full tracebacks go there, one line goes to the UI.

`setup_logging()` is called once by each entry point (CLI, app). The file rotates (1 MB, three old files
kept) in the platform's user log directory, e.g. ~/Library/Logs/Velox on macOS and
~/.local/state/Velox/log on Linux. Nothing is logged about what people type or attach: only events and
errors.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path
from types import TracebackType

from engine.paths import log_dir

LOG_FILE_NAME = "velox.log"
MAX_LOG_BYTES = 1 << 20
KEPT_LOG_FILES = 3
_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(threadName)s]: %(message)s"


def log_path() -> Path:
    """The current log file's path."""
    return log_dir() / LOG_FILE_NAME


def setup_logging(level: int = logging.INFO) -> Path:
    """Send the `engine` and `app` loggers (and uncaught exceptions) to the rotating log file; returns its
    path. Calling it again changes nothing, unless the log folder changed (then the file follows it)."""
    path = log_path()
    root = logging.getLogger()
    for handler in root.handlers[:]:  # a handler for another log folder (VELOX_LOG_DIR changed) is replaced
        if getattr(handler, "velox_log", False) and Path(handler.baseFilename) != path:
            root.removeHandler(handler)
            handler.close()
    if not any(getattr(handler, "velox_log", False) for handler in root.handlers):
        handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=MAX_LOG_BYTES, backupCount=KEPT_LOG_FILES, encoding="utf-8"
        )
        handler.velox_log = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
        path.chmod(0o600)  # errors may quote file names; keep them private
    for name in ("engine", "app"):
        logging.getLogger(name).setLevel(level)
    sys.excepthook = _log_uncaught
    return path


def _log_uncaught(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
    if not issubclass(kind, KeyboardInterrupt):
        logging.getLogger("app").critical("Uncaught exception", exc_info=(kind, error, trace))
    sys.__excepthook__(kind, error, trace)


def unexpected_error_line(error: BaseException) -> str:
    """The one line a person sees for an error we did not expect, pointing at the full traceback."""
    first = (str(error).strip().splitlines() or [""])[0]
    detail = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return f"Unexpected error ({detail}). The details are in {log_path()}."
