"""The menu-bar (macOS) or tray (Linux, Windows) icon.

The icon carries the app's menu: Open Velox, New Chat, Attach Document…, the model and compression level,
a one-line memory readout, Reveal Log and Quit. On macOS a menu-bar (LSUIElement) app has no menu bar of
its own, so this menu is how people reach those commands there; a click on the status item opens it, as
menu-bar apps do. On Linux and Windows a click shows or hides the window and the menu is the context menu.
The macOS icon is a template image (black + alpha), which the system tints for light and dark menu bars.
"""

from __future__ import annotations

import sys
from typing import Any

from PySide6.QtCore import QObject, QUrl
from PySide6.QtGui import QAction, QActionGroup, QDesktopServices, QIcon
from PySide6.QtWidgets import QMenu, QSystemTrayIcon, QWidget

from app.assets import asset_path
from app.logs import log_path
from app.payloads import MemoryReading

IS_MAC = sys.platform == "darwin"


def tray_icon_image() -> QIcon:
    if IS_MAC:
        icon = QIcon()
        icon.addFile(str(asset_path("VeloxTrayTemplate.png")))
        icon.addFile(str(asset_path("VeloxTrayTemplate@2x.png")))
        icon.setIsMask(True)  # a template image: macOS recolours it
        return icon
    # Linux panels may be light or dark: a black template could vanish, so use the coloured app icon.
    return QIcon(str(asset_path("velox-icon-64.png")))


class TrayIcon(QObject):
    """Owns the QSystemTrayIcon; `controller` is the ChatController, `window` the ChatWindow."""

    def __init__(self, controller: Any, window: QWidget, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.window = window
        self.tray = QSystemTrayIcon(tray_icon_image(), self)
        self.tray.setToolTip("Velox")
        self.tray.activated.connect(self._activated)
        self.menu = self._build_menu()
        self.tray.setContextMenu(self.menu)
        controller.memoryUpdated.connect(self._refresh_tooltip)
        self.tray.show()

    def _build_menu(self) -> QMenu:
        menu = QMenu()
        menu.addAction("Open Velox", self.show_window)
        menu.addAction("New Chat", self._new_chat)
        menu.addAction("Attach Document…", self._attach_document)
        menu.addSeparator()
        self.model_action = QAction("Model: loading…", menu)
        self.model_action.setEnabled(False)
        menu.addAction(self.model_action)
        menu.addAction("Choose Model…", self._choose_model)
        compression = menu.addMenu("Compression")
        self.compression_group = QActionGroup(menu)
        for level in self.controller.levels():
            action = QAction(level.label, compression, checkable=True)
            action.setData(level.key)
            action.triggered.connect(lambda _checked=False, key=level.key: self._choose_level(key))
            self.compression_group.addAction(action)
            compression.addAction(action)
        self.memory_action = QAction("Memory: reading…", menu)
        self.memory_action.setEnabled(False)
        menu.addAction(self.memory_action)
        menu.addSeparator()
        menu.addAction("Reveal Log", self._reveal_log)
        menu.addAction("Quit Velox", self._quit)
        menu.aboutToShow.connect(self._refresh_menu)
        return menu

    def _refresh_menu(self) -> None:
        model = self.controller.model
        self.model_action.setText(f"Model: {model.name}" if model else "Model: loading…")
        for action in self.compression_group.actions():
            action.setChecked(action.data() == self.controller.level_key)
        self.memory_action.setText(self.controller.memory_line())

    def _refresh_tooltip(self, _reading: MemoryReading) -> None:
        model = self.controller.model
        name = model.name if model else "no model"
        self.tray.setToolTip(f"Velox — {name}\n{self.controller.memory_line()}")

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if IS_MAC:
            return  # a click opens the status item's menu, whose first entry opens the window
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            self.toggle_window()

    def toggle_window(self) -> None:
        if self.window.isVisible() and self.window.isActiveWindow():
            self.window.hide()
        else:
            self.show_window()

    def show_window(self) -> None:
        self.window.show()
        self.window.raise_()
        self.window.activateWindow()

    def _new_chat(self) -> None:
        self.controller.new_chat()
        self.show_window()

    def _attach_document(self) -> None:
        self.show_window()
        self.window.choose_document()

    def _reveal_log(self) -> None:
        """Show the log file's folder in Finder / the file manager, for attaching it to a bug report."""
        QDesktopServices.openUrl(QUrl.fromLocalFile(str(log_path().parent)))

    def _choose_model(self) -> None:
        self.show_window()
        self.window.open_model_picker()

    def _choose_level(self, key: str) -> None:
        self.window.compression.choose(key)

    def _quit(self) -> None:
        self.window.quit_app()

    def hide(self) -> None:
        self.tray.hide()
