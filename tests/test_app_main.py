"""The app's entry points: `run_app` builds a plain window when there is no system tray (offscreen) and ends
when that window is closed; `python -m app` parses its options."""

from __future__ import annotations

import subprocess
import sys
import time

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QSystemTrayIcon

from app.views.chat_window import ChatWindow


def test_run_app_without_a_tray_is_a_window_that_quits_when_closed(qapp, tmp_path, monkeypatch,
                                                                   default_model_path):
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path))  # the store and settings go here
    from app.main import run_app

    assert not QSystemTrayIcon.isSystemTrayAvailable()
    seen: dict[str, object] = {}

    def ours(widget: object) -> bool:
        return (isinstance(widget, ChatWindow) and widget.isVisible()
                and str(widget.controller.store.path).startswith(str(tmp_path)))

    def close_when_ready() -> None:
        windows = [w for w in QApplication.topLevelWidgets() if ours(w)]
        if windows and windows[0].controller.model is not None:
            seen["window"] = windows[0]
            seen["quit_on_last"] = QApplication.quitOnLastWindowClosed()
            seen["closed_at"] = time.monotonic()
            windows[0].close()  # like clicking the close button
            QTimer.singleShot(3000, QApplication.quit)  # a safety net if closing did not end the loop
        else:
            QTimer.singleShot(100, close_when_ready)

    QTimer.singleShot(100, close_when_ready)
    QTimer.singleShot(180_000, QApplication.quit)  # never hang the suite
    assert run_app(model=str(default_model_path)) == 0
    assert time.monotonic() - seen["closed_at"] < 2.5, "closing the window ended the app (not the safety net)"

    window = seen["window"]
    assert isinstance(window, ChatWindow) and window.quit_on_close and seen["quit_on_last"]
    assert not window.isVisible()
    assert window.controller._shut_down, "quitting stopped the engine thread"
    assert window.controller.model.name == "SmolLM2-135M-Instruct"
    assert (tmp_path / "velox.sqlite3").exists() and (tmp_path / "settings.json").exists()


def test_python_dash_m_app_describes_its_options():
    result = subprocess.run([sys.executable, "-m", "app", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "--model" in result.stdout and "Velox desktop app" in result.stdout
