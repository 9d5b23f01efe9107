"""Start the desktop app: `python -m app` or `velox app`.

The MLX runtime is prepared by `import engine` (the controller imports it) before MLX loads. With a system tray
(macOS menu bar, most Linux desktops) the app lives there and closing the window keeps it running; without
one (`QSystemTrayIcon.isSystemTrayAvailable()` False: offscreen, some Linux desktops) it is a plain window
that quits when closed.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import PySide6
from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QIcon, QPalette
from PySide6.QtWidgets import QApplication, QSystemTrayIcon

from app.assets import asset_path
from app.controller import ChatController
from app.qt_platform import qt_platform_problem
from app.settings import load_settings
from app.store import ConversationStore
from app.views.chat_window import ChatWindow
from app.views.tray import TrayIcon
from app.views.widgets.theme import DARK, colors, style_sheet, ui_font
from engine.kvcache import all_method_info


def qt_binding_problem() -> str | None:
    """A sentence if the installed PySide6 is known to crash this app, else None.

    PySide6 6.12.0 drops one reference to `True` on every signal emit. On Python 3.12+ True is immortal and
    nothing happens; on 3.11 the count reaches zero after a few thousand emits (a streamed reply) and the
    interpreter aborts. The probe measures it directly, so a fixed build passes whatever its number.
    """
    if sys.version_info >= (3, 12):
        return None
    class _Probe(QObject):
        ping = Signal(int)

    probe = _Probe()
    probe.ping.connect(lambda _value: None)
    before = sys.getrefcount(True)
    for _ in range(16):
        probe.ping.emit(0)
    lost = before - sys.getrefcount(True)
    if lost >= 8:
        return (f"PySide6 {PySide6.__version__} has a reference-counting bug on Python "
                f"{sys.version_info.major}.{sys.version_info.minor} that crashes Velox after a few replies; "
                "install another version with: pip install 'pyside6!=6.12.0'.")
    return None


def hide_dock_icon() -> None:
    """On macOS, keep the running app out of the Dock (it lives in the menu bar).

    A bundled app gets this from LSUIElement in its Info.plist (set when packaging); when run from a
    terminal we ask AppKit directly if PyObjC happens to be installed, and otherwise leave the Dock icon.
    """
    if sys.platform != "darwin":
        return
    try:
        from AppKit import NSApplication, NSApplicationActivationPolicyAccessory  # macOS-only, optional
    except ImportError:
        return  # PyObjC is not a dependency; a Dock icon while running unbundled is harmless
    NSApplication.sharedApplication().setActivationPolicy_(NSApplicationActivationPolicyAccessory)


def apply_theme(app: Any, theme: str) -> None:
    """Fusion style off macOS (consistent on every Linux desktop), the chosen light/dark scheme, our font
    and style sheet."""
    if sys.platform != "darwin":
        app.setStyle("Fusion")
    hints = app.styleHints()
    if hasattr(hints, "setColorScheme"):  # Qt 6.8+
        scheme = {"light": Qt.ColorScheme.Light, "dark": Qt.ColorScheme.Dark}.get(theme, Qt.ColorScheme.Unknown)
        hints.setColorScheme(scheme)
    if theme == "dark" and sys.platform != "darwin":
        app.setPalette(_dark_palette())
    app.setFont(ui_font())
    app.setStyleSheet(style_sheet(colors()))


def _dark_palette() -> Any:
    palette = QPalette()
    roles = {
        QPalette.ColorRole.Window: DARK.window, QPalette.ColorRole.WindowText: DARK.text,
        QPalette.ColorRole.Base: DARK.field, QPalette.ColorRole.AlternateBase: DARK.sidebar,
        QPalette.ColorRole.Text: DARK.text, QPalette.ColorRole.Button: DARK.field,
        QPalette.ColorRole.ButtonText: DARK.text, QPalette.ColorRole.Highlight: DARK.accent,
        QPalette.ColorRole.HighlightedText: DARK.accent_text, QPalette.ColorRole.ToolTipBase: DARK.field,
        QPalette.ColorRole.ToolTipText: DARK.text, QPalette.ColorRole.PlaceholderText: DARK.secondary,
    }
    for role, value in roles.items():
        palette.setColor(role, QColor(value))
    return palette


def method_catalogue() -> list[Any]:
    """The KV cache methods for the Advanced picker: those that need no calibration."""
    return [info for info in all_method_info() if not info.needs_calibration]


def build_app(model: str | None = None, *, store_path: str | Path | None = None,
              settings_path: str | Path | None = None, loaded: tuple[Any, Any, Any] | None = None,
              use_tray: bool | None = None) -> tuple[Any, Any, Any]:
    """Create (controller, window, tray) on the running QApplication and start loading the model.

    `loaded` adopts an already loaded (model, tokenizer, info) (tests, screenshots); `use_tray` None means
    "if the system has one"."""
    settings = load_settings(settings_path)
    store = ConversationStore(store_path)
    controller = ChatController(store, settings, settings_path)
    tray_available = QSystemTrayIcon.isSystemTrayAvailable() if use_tray is None else use_tray
    window = ChatWindow(controller, quit_on_close=not tray_available, methods=method_catalogue())
    tray = None
    if tray_available:
        tray = TrayIcon(controller, window)
    if store.notice:  # the damaged database was moved aside: stays until the user closes it
        window.banner.show_message(store.notice, "notice", sticky=True)
    _add_local_server(controller, window, tray)
    controller.start(model=model, loaded=loaded)
    return controller, window, tray


def _add_local_server(controller: Any, window: Any, tray: Any) -> None:
    """The "Local server" switch (off until switched on): a Server menu in the window, and the same items in
    the tray menu where there is one. It serves the chat's model with the chat's compression level."""
    # Qt modules, imported with the rest of the GUI in build_app (after the Qt binding check)
    from app.server_control import LocalServerControl
    from app.views.widgets.server_menu import ServerMenuItems

    server = LocalServerControl(parent=controller)

    def choice() -> tuple[str | None, str]:
        path = controller.model["path"] if controller.model else ""
        return path or None, controller.level_key

    window.server_control = server
    window.server_items = ServerMenuItems(window.menuBar().addMenu("&Server"), server, choice)
    server.failed.connect(lambda text: window.banner.show_message(f"Local server: {text}", "error"))
    if tray is not None and tray.menu is not None:
        quit_action = tray.menu.actions()[-1]
        tray.server_items = ServerMenuItems(tray.menu, server, choice, before=quit_action)
        tray.menu.insertSeparator(quit_action)


def run_app(model: str | None = None, argv: Sequence[str] | None = None) -> int:
    """Run the app until it quits; returns the exit code."""
    problem = qt_platform_problem() or qt_binding_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    app = QApplication.instance() or QApplication(list(argv) if argv is not None else sys.argv[:1])
    app.setApplicationName("Velox")
    app.setApplicationDisplayName("Velox")
    app.setOrganizationName("Velox")
    app.setWindowIcon(QIcon(str(asset_path("velox-icon.png"))))
    apply_theme(app, load_settings().theme)
    tray_available = QSystemTrayIcon.isSystemTrayAvailable()
    if tray_available:
        hide_dock_icon()
    app.setQuitOnLastWindowClosed(not tray_available)
    controller, window, tray = build_app(model)
    app.aboutToQuit.connect(controller.shutdown)
    app.aboutToQuit.connect(window.server_control.stop)
    hints = app.styleHints()
    if hasattr(hints, "colorSchemeChanged"):  # Qt 6.5+: follow the system's light/dark switch live

        def follow_scheme(*_args: Any) -> None:
            app.setStyleSheet(style_sheet(colors()))
            window.restyle()

        hints.colorSchemeChanged.connect(follow_scheme)
    if tray is not None:
        app.aboutToQuit.connect(tray.hide)
    window.show()
    _quit_on_ctrl_c(app)
    return int(app.exec())


def _quit_on_ctrl_c(app: Any) -> None:
    """Ctrl-C in the terminal quits cleanly (the engine thread is stopped, settings saved).

    Python runs signal handlers only between bytecodes, never while Qt's C++ event loop waits; a timer that
    wakes the interpreter a few times a second lets the handler run."""
    signal.signal(signal.SIGINT, lambda *_args: app.quit())
    waker = QTimer(app)
    waker.setInterval(250)
    waker.timeout.connect(lambda: None)
    waker.start()
