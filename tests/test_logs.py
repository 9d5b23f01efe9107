"""The log file: full tracebacks land there, the person sees one line that says where it is."""

from __future__ import annotations

import logging
import stat

import pytest

from app import cli, commands
from app.logs import log_path, setup_logging, unexpected_error_line


@pytest.fixture()
def log_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VELOX_LOG_DIR", str(tmp_path))
    root = logging.getLogger()
    before = list(root.handlers)
    yield tmp_path
    for handler in root.handlers[:]:
        if handler not in before:
            root.removeHandler(handler)
            handler.close()


def test_traceback_goes_to_a_private_log_file(log_dir) -> None:
    path = setup_logging()
    setup_logging()  # a second call adds no second handler
    assert path == log_dir / "velox.log" == log_path()
    assert sum(getattr(h, "velox_log", False) for h in logging.getLogger().handlers) == 1
    try:
        raise ValueError("the tokenizer exploded")
    except ValueError:
        logging.getLogger("engine.test").exception("generation failed")
    for handler in logging.getLogger().handlers:
        handler.flush()
    text = path.read_text()
    assert "generation failed" in text and "Traceback (most recent call last)" in text
    assert "ValueError: the tokenizer exploded" in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_unexpected_error_line_is_one_line_with_the_log_path(log_dir) -> None:
    line = unexpected_error_line(RuntimeError("first line\nsecond line"))
    assert "\n" not in line
    assert "RuntimeError: first line" in line and str(log_dir / "velox.log") in line


def test_cli_turns_a_bug_into_one_line_and_a_logged_traceback(log_dir, monkeypatch, capsys) -> None:
    def broken_listing() -> int:
        raise KeyError("catalogue index")

    monkeypatch.setattr(commands, "_models", broken_listing)
    assert cli.main(["models"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: Unexpected error (KeyError")
    for handler in logging.getLogger().handlers:
        handler.flush()
    text = (log_dir / "velox.log").read_text()
    assert "velox models failed" in text and "KeyError: 'catalogue index'" in text


def test_info_prints_the_log_path(log_dir, capsys) -> None:
    assert cli.main(["info"]) == 0
    assert f"log file: {log_dir / 'velox.log'}" in capsys.readouterr().out
