"""The conversation: rounded message bubbles rendered from Markdown, streamed text, copy and regenerate.

Each bubble is a read-only QTextBrowser whose QTextDocument is laid out at the bubble's width and sized to
its content, so a short message gets a small bubble and a long one wraps at ~75% of the column. Streaming
replaces the Markdown of the last bubble; re-rendering is coalesced to ~30 frames a second so a fast model
never floods the GUI thread.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QEvent, QObject, QPoint, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QTextDocument
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QMenu,
    QScrollArea,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.views.widgets import icons
from app.views.widgets.theme import Colors, colors

BUBBLE_WIDTH_FRACTION = 0.78
BUBBLE_PADDING_H = 14
BUBBLE_PADDING_V = 9
STREAM_FRAME_MS = 33
MAX_COLUMN_WIDTH = 820


class MarkdownView(QTextBrowser):
    """Read-only Markdown text that sizes itself to its content at a given maximum width."""

    def __init__(self, text_color: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setTextInteractionFlags(
            Qt.TextInteractionFlag.TextSelectableByMouse | Qt.TextInteractionFlag.LinksAccessibleByMouse
            | Qt.TextInteractionFlag.TextSelectableByKeyboard
        )
        self.setStyleSheet(f"QTextBrowser {{ background: transparent; color: {text_color}; border: none; }}")
        self.viewport().setAutoFillBackground(False)
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.NoContextMenu)  # the bubble's own menu handles it
        self.document().setDocumentMargin(0)
        self._markdown = ""
        self._max_width = 400

    def set_markdown(self, text: str) -> None:
        self._markdown = text
        # A code block still being streamed has no closing fence yet; Markdown then shows the rest as code,
        # which is what the reader expects while it arrives.
        self.setMarkdown(text)
        self.fit(self._max_width)

    def markdown(self) -> str:
        return self._markdown

    def fit(self, max_width: int) -> None:
        """Lay the text out at no more than `max_width` pixels and take exactly the size it needs."""
        self._max_width = max(60, max_width)
        document = self.document()
        document.setTextWidth(self._max_width)
        ideal = math.ceil(document.idealWidth()) + 2
        width = min(self._max_width, ideal)
        document.setTextWidth(width)
        height = math.ceil(document.size().height())
        self.setFixedSize(width, max(height, self.fontMetrics().height()))


def document_chip(name: str, c: Colors) -> QFrame:
    """A small rounded tag with a document icon and the file name."""
    chip = QFrame()
    chip.setObjectName("documentChip")
    chip.setStyleSheet(f"QFrame#documentChip {{ background: {c.assistant_bubble}; border: 1px solid {c.separator};"
                       f" border-radius: 9px; }} QFrame#documentChip QLabel {{ color: {c.text}; }}")
    chip.setToolTip(f"Document attached to this message: {name}")
    layout = QHBoxLayout(chip)
    layout.setContentsMargins(8, 3, 10, 3)
    layout.setSpacing(5)
    icon = QLabel()
    icon.setPixmap(icons.pixmap("document", c.accent, 15))
    label = QLabel(name)
    label.setTextFormat(Qt.TextFormat.PlainText)
    layout.addWidget(icon)
    layout.addWidget(label)
    return chip


class MessageBubble(QFrame):
    """One message: the rounded bubble, documents it carried, and a caption row with actions."""

    copyRequested = Signal(object)  # self
    regenerateRequested = Signal()

    def __init__(self, role: str, text: str, documents: list[str] | None = None,
                 palette: Colors | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.role = role
        self.palette_colors = c = palette or colors()
        self.streaming = False
        self.cancelled = False
        user = role == "user"
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.setSpacing(4)

        self.documents_row = QHBoxLayout()
        self.documents_row.setSpacing(6)
        outer.addLayout(self.documents_row)
        self.set_documents(documents or [])

        self.bubble = QFrame()
        self.bubble.setObjectName("bubble")
        background = c.user_bubble if user else c.assistant_bubble
        self.bubble.setStyleSheet(f"QFrame#bubble {{ background: {background}; border-radius: 16px; }}")
        bubble_layout = QVBoxLayout(self.bubble)
        bubble_layout.setContentsMargins(BUBBLE_PADDING_H, BUBBLE_PADDING_V, BUBBLE_PADDING_H, BUBBLE_PADDING_V)
        self.view = MarkdownView(c.user_text if user else c.assistant_text)
        self.view.setFont(QGuiApplication.font())
        bubble_layout.addWidget(self.view)
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        if user:
            row.addStretch(1)
        row.addWidget(self.bubble)
        if not user:
            row.addStretch(1)
        outer.addLayout(row)

        self.caption_row = QHBoxLayout()
        self.caption_row.setContentsMargins(6, 0, 6, 0)
        self.caption_row.setSpacing(2)
        self.caption = QLabel("")
        self.caption.setObjectName("caption")
        self.copy_button = self._action_button("copy", "Copy message")
        self.copy_button.clicked.connect(lambda: self.copyRequested.emit(self))
        self.regenerate_button = self._action_button("regenerate", "Regenerate this reply")
        self.regenerate_button.clicked.connect(self.regenerateRequested.emit)
        self.regenerate_button.setVisible(False)
        if user:
            self.caption_row.addStretch(1)
            self.caption_row.addWidget(self.caption)
            self.copy_button.setVisible(False)  # user text is copied from the context menu
        else:
            self.caption_row.addWidget(self.copy_button)
            self.caption_row.addWidget(self.regenerate_button)
            self.caption_row.addSpacing(4)
            self.caption_row.addWidget(self.caption)
            self.caption_row.addStretch(1)
        outer.addLayout(self.caption_row)

        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._show_menu)
        self.view.installEventFilter(self)
        self.view.viewport().installEventFilter(self)
        self.set_text(text)

    def _action_button(self, icon_name: str, tip: str) -> QToolButton:
        button = QToolButton()
        icons.dress_button(button, icon_name, self.palette_colors.secondary, 14, tip)
        button.setAutoRaise(True)
        return button

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.ContextMenu:
            self._show_menu(self.mapFromGlobal(event.globalPos()))
            return True
        return super().eventFilter(watched, event)

    def _show_menu(self, position: QPoint) -> None:
        menu = QMenu(self)
        selected = self.view.textCursor().selectedText()
        if selected:
            menu.addAction("Copy Selection", self.view.copy)
        menu.addAction("Copy Message", lambda: self.copyRequested.emit(self))
        if self.regenerate_button.isVisible():
            menu.addAction("Regenerate", self.regenerateRequested.emit)
        menu.exec(self.mapToGlobal(position))

    # ----- content --------------------------------------------------------------------------------------
    def text(self) -> str:
        return self.view.markdown()

    def set_text(self, text: str) -> None:
        shown = text if text else ("…" if self.role == "assistant" else "")
        self.view.set_markdown(shown)
        self.view._markdown = text

    def set_documents(self, names: list[str]) -> None:
        while self.documents_row.count():
            item = self.documents_row.takeAt(0)
            if item.widget():
                item.widget().deleteLater()
        if not names:
            return
        if self.role == "user":
            self.documents_row.addStretch(1)
        for name in names:
            self.documents_row.addWidget(document_chip(name, self.palette_colors))
        if self.role != "user":
            self.documents_row.addStretch(1)

    def set_caption(self, text: str) -> None:
        self.caption.setText(text)

    def set_can_regenerate(self, allowed: bool) -> None:
        self.regenerate_button.setVisible(allowed and self.role == "assistant")

    def fit(self, column_width: int) -> None:
        bubble_max = int(column_width * BUBBLE_WIDTH_FRACTION) - 2 * BUBBLE_PADDING_H
        self.view.fit(bubble_max)


class MessageList(QScrollArea):
    """The scrolling column of bubbles, with an empty-state hint and auto-scroll while streaming."""

    copyRequested = Signal(str)
    regenerateRequested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setObjectName("chatArea")
        self.column = QWidget()
        self.column.setObjectName("messageColumn")
        self.column_layout = QVBoxLayout(self.column)
        self.column_layout.setContentsMargins(24, 20, 24, 20)
        self.column_layout.setSpacing(14)
        self.placeholder = self._make_placeholder()
        self.column_layout.addWidget(self.placeholder, 1)
        # Extra height goes below the last message, never into the bubbles.
        self.column_layout.addStretch(1)
        self.setWidget(self.column)
        self.bubbles: list[MessageBubble] = []
        self._pending_text: str | None = None
        self._stream_timer = QTimer(self)
        self._stream_timer.setSingleShot(True)
        self._stream_timer.setInterval(STREAM_FRAME_MS)
        self._stream_timer.timeout.connect(self._flush_stream)
        self.verticalScrollBar().rangeChanged.connect(self._follow_bottom)
        self._stick_to_bottom = True
        self.verticalScrollBar().valueChanged.connect(self._remember_position)

    def _make_placeholder(self) -> QWidget:
        c = colors()
        box = QWidget()
        layout = QVBoxLayout(box)
        layout.addStretch(1)
        title = QLabel("Ask anything")
        title.setAlignment(Qt.AlignmentFlag.AlignCenter)
        title.setStyleSheet(f"font-size: 17pt; font-weight: 600; color: {c.text};")
        hint = QLabel("Type a question below, or drop a document (PDF, Markdown, HTML, text) here\n"
                      "to chat about it. Everything stays on this computer.")
        hint.setAlignment(Qt.AlignmentFlag.AlignCenter)
        hint.setObjectName("hint")
        layout.addWidget(title)
        layout.addWidget(hint)
        layout.addStretch(2)
        return box

    # ----- building ---------------------------------------------------------------------------------------
    def clear(self) -> None:
        self._stream_timer.stop()
        self._pending_text = None
        for bubble in self.bubbles:
            self._discard(bubble)
        self.bubbles.clear()
        self.placeholder.setVisible(True)

    def _discard(self, bubble: MessageBubble) -> None:
        # Hidden and unparented at once: deleteLater alone leaves it painted until the event loop runs.
        self.column_layout.removeWidget(bubble)
        bubble.hide()
        bubble.setParent(None)
        bubble.deleteLater()

    def add_message(self, role: str, text: str, documents: list[str] | None = None,
                    caption: str = "") -> MessageBubble:
        self.placeholder.setVisible(False)
        bubble = MessageBubble(role, text, documents)
        bubble.copyRequested.connect(lambda b: self.copyRequested.emit(b.text()))
        bubble.regenerateRequested.connect(self.regenerateRequested.emit)
        bubble.set_caption(caption)
        # Insert before the trailing stretch.
        self.column_layout.insertWidget(self.column_layout.count() - 1, bubble)
        self.bubbles.append(bubble)
        bubble.fit(self._column_width())
        self._stick_to_bottom = True
        self._update_regenerate()
        return bubble

    def remove_last(self) -> None:
        if self.bubbles:
            self._discard(self.bubbles.pop())
        self.placeholder.setVisible(not self.bubbles)
        self._update_regenerate()

    def stream_text(self, full_text: str) -> None:
        """Show `full_text` in the last bubble soon (coalesced to one re-render per frame)."""
        self._pending_text = full_text
        if not self._stream_timer.isActive():
            self._stream_timer.start()

    def flush(self) -> None:
        self._stream_timer.stop()
        self._flush_stream()

    def _flush_stream(self) -> None:
        if self._pending_text is None or not self.bubbles:
            return
        bubble = self.bubbles[-1]
        bubble.set_text(self._pending_text)
        bubble.fit(self._column_width())
        self._pending_text = None

    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._update_regenerate()

    def _update_regenerate(self) -> None:
        busy = getattr(self, "_busy", False)
        for index, bubble in enumerate(self.bubbles):
            bubble.set_can_regenerate(not busy and index == len(self.bubbles) - 1 and bubble.role == "assistant")

    # ----- layout -----------------------------------------------------------------------------------------
    def _column_width(self) -> int:
        margins = self.column_layout.contentsMargins()
        return min(self.viewport().width(), MAX_COLUMN_WIDTH) - margins.left() - margins.right()

    def resizeEvent(self, event) -> None:  # noqa: ANN001 - Qt override
        super().resizeEvent(event)
        width = self._column_width()
        # Keep a readable line length on wide windows: centre the column.
        side = max(24, (self.viewport().width() - MAX_COLUMN_WIDTH) // 2 + 24)
        self.column_layout.setContentsMargins(side, 20, side, 20)
        for bubble in self.bubbles:
            bubble.fit(width)

    def _remember_position(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._stick_to_bottom = value >= bar.maximum() - 40

    def _follow_bottom(self, _minimum: int, maximum: int) -> None:
        if self._stick_to_bottom:
            self.verticalScrollBar().setValue(maximum)

    def texts(self) -> list[tuple[str, str]]:
        """(role, text) of every bubble: what the user sees, for tests and accessibility."""
        return [(bubble.role, bubble.text()) for bubble in self.bubbles]


def markdown_to_plain(text: str) -> str:
    """The text of a Markdown message as it reads (for copying), via Qt's own Markdown parser."""
    document = QTextDocument()
    document.setMarkdown(text)
    return document.toPlainText()


