"""A non-modal banner above the conversation for errors and notices: it never blocks, never loses input,
and can be dismissed; notices fade on their own after a few seconds, errors stay until closed, and so do
sticky notices (one the user must read, like a damaged database moved aside while the model still loads):
a later message is shown below a sticky one instead of replacing it."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QWidget

from app.views.widgets import icons
from app.views.widgets.theme import colors

NOTICE_SECONDS = 6


class Banner(QFrame):
    dismissed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("banner")
        self.kind = ""
        self._sticky_text = ""  # the sticky message still showing, kept above later ones
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 8, 6, 8)
        layout.setSpacing(8)
        self.icon = QLabel()
        self.label = QLabel("")
        self.label.setWordWrap(True)
        self.label.setTextFormat(Qt.TextFormat.PlainText)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.close_button = QToolButton()
        self.close_button.setAutoRaise(True)
        self.close_button.setToolTip("Dismiss")
        self.close_button.clicked.connect(self.dismiss)
        layout.addWidget(self.icon, 0, Qt.AlignmentFlag.AlignTop)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.close_button, 0, Qt.AlignmentFlag.AlignTop)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.dismiss)
        self.setVisible(False)

    def show_message(self, text: str, kind: str = "error", *, sticky: bool = False) -> None:
        """kind: 'error' (red, stays) or 'notice' (neutral, hides after a few seconds unless `sticky`)."""
        if sticky:
            self._sticky_text = text
        elif self._sticky_text and self.isVisible():
            text = f"{self._sticky_text}\n\n{text}"
            sticky = True
        c = colors()
        self.kind = kind
        error = kind == "error"
        background = c.banner if error else c.assistant_bubble
        border = c.bad if error else c.separator
        foreground = c.banner_text if error else c.text
        self.setStyleSheet(f"QFrame#banner {{ background: {background}; border: 1px solid {border};"
                           f" border-radius: 8px; }} QFrame#banner QLabel {{ color: {foreground}; }}")
        self.icon.setPixmap(icons.pixmap("warning" if error else "document", border if error else c.secondary, 16))
        self.close_button.setIcon(icons.icon("close", foreground, 14))
        self.label.setText(text)
        self.setVisible(True)
        self._timer.stop()
        if not error and not sticky:
            self._timer.start(int(NOTICE_SECONDS * 1000))

    def text(self) -> str:
        return self.label.text() if self.isVisible() else ""

    def dismiss(self) -> None:
        self._timer.stop()
        self._sticky_text = ""
        self.setVisible(False)
        self.dismissed.emit()
