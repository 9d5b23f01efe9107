"""The composer: a rounded field where Enter sends and Shift+Enter starts a new line, with attach and
send/stop buttons. It grows with its text up to a few lines, then scrolls."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QFrame, QHBoxLayout, QPlainTextEdit, QToolButton, QVBoxLayout, QWidget

from app.views.widgets import icons
from app.views.widgets.theme import colors

MAX_VISIBLE_LINES = 8


class ChatInput(QPlainTextEdit):
    """Plain-text input: Enter (or keypad Enter) submits, Shift+Enter inserts a newline."""

    submitted = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setPlaceholderText("Message Velox…")
        self.setTabChangesFocus(True)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.document().setDocumentMargin(2)
        self.textChanged.connect(self._fit_height)
        self.submit_enabled = True
        self._fit_height()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
                return
            if not (event.modifiers() & (Qt.KeyboardModifier.AltModifier | Qt.KeyboardModifier.ControlModifier)):
                self.submit()
                return
        super().keyPressEvent(event)

    def submit(self) -> None:
        text = self.toPlainText().strip()
        if not text or not self.submit_enabled:
            return
        self.clear()
        self.submitted.emit(text)

    def _fit_height(self) -> None:
        line = self.fontMetrics().lineSpacing()
        lines = max(1, min(MAX_VISIBLE_LINES, int(self.document().size().height())))
        self.setFixedHeight(lines * line + 2 * int(self.document().documentMargin()) + 4)


class Composer(QFrame):
    """Attach button, the input field, and a round send button that turns into Stop while busy."""

    submitted = Signal(str)
    attachRequested = Signal()
    stopRequested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("composer")
        c = colors()
        self._colors = c
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.setSpacing(2)
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(6)
        self.attach_button = QToolButton()
        attach_tip = "Attach a document (PDF, Markdown, HTML, text)"
        icons.dress_button(self.attach_button, "attach", c.secondary, 18, attach_tip)
        self.attach_button.clicked.connect(self.attachRequested.emit)
        self.input = ChatInput()
        self.input.submitted.connect(self.submitted.emit)
        self.input.textChanged.connect(self._update_send_enabled)
        self.send_button = QToolButton()
        self.send_button.setFixedSize(28, 28)
        self.send_button.setIconSize(icons.icon_size(16))
        self.send_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.send_button.clicked.connect(self._send_or_stop)
        row.addWidget(self.attach_button, 0, Qt.AlignmentFlag.AlignBottom)
        row.addWidget(self.input, 1)
        row.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        outer.addLayout(row)
        self.busy = False
        self.model_ready = False
        self._apply_state()

    def _send_or_stop(self) -> None:
        if self.busy:
            self.stopRequested.emit()
        else:
            self.input.submit()

    def set_busy(self, busy: bool) -> None:
        self.busy = busy
        self._apply_state()

    def set_model_ready(self, ready: bool) -> None:
        self.model_ready = ready
        self._apply_state()

    def _update_send_enabled(self) -> None:
        self._apply_state()

    def _apply_state(self) -> None:
        c = self._colors
        has_text = bool(self.input.toPlainText().strip())
        self.input.submit_enabled = self.model_ready and not self.busy
        if self.busy:
            self.send_button.setIcon(icons.icon("stop", "#ffffff", 16))
            self.send_button.setToolTip("Stop (Esc)")
            background, enabled = c.text if not c.dark else c.secondary, True
        else:
            self.send_button.setIcon(icons.icon("send", "#ffffff", 16))
            self.send_button.setToolTip("Send (Enter) — Shift+Enter for a new line")
            enabled = has_text and self.model_ready
            background = c.accent if enabled else c.selection
        self.send_button.setEnabled(enabled)
        self.send_button.setStyleSheet(
            f"QToolButton {{ background: {background}; border-radius: 14px; border: none; }}"
        )
