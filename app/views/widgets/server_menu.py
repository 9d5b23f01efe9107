"""The "Local server" menu items (tray menu and the window's Server menu): the switch, its address, and
"Copy Python Example". Thin: state and work live in app.server_control.LocalServerControl."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import QMenu

# What to serve when switched on: (model folder or None for the default, compression level key).
ServeChoice = Callable[[], tuple[str | None, str]]


class ServerMenuItems(QObject):
    """Adds the items to `menu` (before `before`, else at the end) and keeps them in step with `control`."""

    def __init__(self, menu: QMenu, control: Any, choice: ServeChoice, before: QAction | None = None) -> None:
        super().__init__(menu)
        self.control = control
        self.choice = choice
        self.switch = QAction("Local Server", menu, checkable=True)
        self.switch.setToolTip("An OpenAI-compatible server on this machine, using the chat's compression level")
        self.switch.triggered.connect(self._switched)
        self.address = QAction("", menu)
        self.address.setEnabled(False)
        self.copy = QAction("Copy Python Example", menu)
        self.copy.triggered.connect(self.copy_example)
        for action in (self.switch, self.address, self.copy):
            menu.insertAction(before, action) if before is not None else menu.addAction(action)
        control.changed.connect(self._refresh)
        self._refresh(control.summary())

    def _switched(self, checked: bool) -> None:
        model, level = self.choice()
        self.control.set_enabled(checked, model=model, level=level)

    def copy_example(self) -> None:
        QGuiApplication.clipboard().setText(self.control.example())

    def _refresh(self, summary: dict[str, Any]) -> None:
        self.switch.setChecked(summary["state"] != "off")
        self.address.setText(summary["line"])
        self.copy.setEnabled(summary["state"] == "on")
