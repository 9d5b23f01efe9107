"""The app's "Local server" switch: `velox serve` in a child process, its state, its address and an example.

A child process rather than a thread beside the chat: the chat worker already runs the model on its own
thread, and MLX work from two threads on one model would have to be serialised by hand; in its own process
a request can never slow or break a chat, a fault there cannot take the app down, and switching off is a
clean kill. The cost is a second copy of the weights in memory while the switch is on.

No widgets here: the views (app/views/widgets/server_menu.py) only show `summary()` and call `set_enabled`,
so tests drive this object offscreen.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, Signal

from app.serve_cli import SERVING_PREFIX
from engine.serve.example import DEFAULT_PORT, base_url, client_example

# The folder holding the `app` and `engine` packages: the child runs `python -m app.cli` from a checkout
# as well as from an installed package.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_MS = 5000


class LocalServerControl(QObject):
    """Off by default. States: "off", "starting" (loading the model), "on" (answering at `address`)."""

    changed = Signal(object)  # summary()
    failed = Signal(str)  # one line: why the server stopped or did not start

    def __init__(self, port: int = DEFAULT_PORT, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.port = port
        self.state = "off"
        self.address: str | None = None
        self.error: str | None = None
        self.process: QProcess | None = None
        self._stopping = False
        self._last_error_line = ""
        self._stdout_tail = ""

    # ----- what the views show ----------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.state != "off"

    def shown_address(self) -> str:
        return self.address or base_url(port=self.port)

    def example(self) -> str:
        return client_example(self.shown_address())

    def summary(self) -> dict[str, Any]:
        line = {
            "off": "Local server: off",
            "starting": "Local server: starting…",
            "on": f"Local server: {self.shown_address()}",
        }[self.state]
        return {"state": self.state, "address": self.address, "line": line, "error": self.error}

    # ----- the switch -------------------------------------------------------------------------------------

    def set_enabled(self, enabled: bool, model: str | None = None, level: str = "4") -> None:
        if enabled and self.state == "off":
            self.start(model=model, level=level)
        elif not enabled and self.state != "off":
            self.stop()

    def command(self, model: str | None, level: str) -> list[str]:
        arguments = ["-m", "app.cli", "serve", "--port", str(self.port), "--level", level]
        if model:
            arguments += ["--model", model]
        return [sys.executable, *arguments]

    def start(self, model: str | None = None, level: str = "4") -> None:
        """Start serving `model` (a folder, or None for the default) with the app's compression `level`."""
        if self.process is not None:
            return
        program, *arguments = self.command(model, level)
        process = QProcess(self)
        environment = QProcessEnvironment.systemEnvironment()
        paths = [str(PACKAGE_ROOT), environment.value("PYTHONPATH", "")]
        environment.insert("PYTHONPATH", ":".join(p for p in paths if p))
        process.setProcessEnvironment(environment)
        process.readyReadStandardOutput.connect(self._read_stdout)
        process.readyReadStandardError.connect(self._read_stderr)
        process.finished.connect(self._finished)
        process.errorOccurred.connect(self._process_error)
        self.process = process
        self.error = None
        self._stopping = False
        self._last_error_line = ""
        self._stdout_tail = ""
        self._set_state("starting")
        process.start(program, arguments)

    def stop(self) -> None:
        """Switch off: ask the server to stop (SIGTERM), kill it if it does not within a few seconds."""
        process = self.process
        if process is None:
            return
        self._stopping = True
        process.terminate()
        if not process.waitForFinished(STOP_GRACE_MS):
            process.kill()
            process.waitForFinished(STOP_GRACE_MS)
        self._clear()

    # ----- the child's output -----------------------------------------------------------------------------

    def _read_stdout(self) -> None:
        if self.process is None:
            return
        self._stdout_tail += bytes(self.process.readAllStandardOutput().data()).decode(errors="replace")
        *lines, self._stdout_tail = self._stdout_tail.split("\n")
        for line in lines:
            if line.startswith(SERVING_PREFIX):
                self.address = line[len(SERVING_PREFIX):].strip()
                self._set_state("on")

    def _read_stderr(self) -> None:
        if self.process is None:
            return
        text = bytes(self.process.readAllStandardError().data()).decode(errors="replace")
        for line in text.splitlines():
            if line.startswith(("error:", "warning:")):
                self._last_error_line = line.split(":", 1)[1].strip()

    def _finished(self, exit_code: int, _status: Any) -> None:
        if self.process is None or self._stopping:
            return
        self._read_stderr()
        reason = self._last_error_line or f"The local server stopped (exit code {exit_code})."
        self._clear()
        self.error = reason
        self.failed.emit(reason)
        self.changed.emit(self.summary())

    def _process_error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart and self.process is not None:
            self._clear()
            self.error = f"The local server could not be started ({sys.executable})."
            self.failed.emit(self.error)
            self.changed.emit(self.summary())

    def _clear(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            process.deleteLater()
        self.address = None
        self._set_state("off")

    def _set_state(self, state: str) -> None:
        self.state = state
        self.changed.emit(self.summary())
