"""The sidebar list of conversations: title and a relative date, newest first; right-click to delete."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QPoint, QRect, QSize, Qt, Signal
from PySide6.QtGui import QFont, QPainter
from PySide6.QtWidgets import (
    QListWidget,
    QListWidgetItem,
    QMenu,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
)

from app.views.widgets.theme import colors, qcolor

ID_ROLE = Qt.ItemDataRole.UserRole
SUBTITLE_ROLE = Qt.ItemDataRole.UserRole + 1


def relative_time(timestamp: float, now: float | None = None) -> str:
    """'Just now', '5 min ago', 'Today 14:05', 'Yesterday', or a date, like a Mac list shows it."""
    now = time.time() if now is None else now
    delta = now - timestamp
    if delta < 60:
        return "Just now"
    if delta < 3600:
        return f"{int(delta // 60)} min ago"
    today = time.localtime(now)
    then = time.localtime(timestamp)
    if then.tm_yday == today.tm_yday and then.tm_year == today.tm_year:
        return time.strftime("Today %H:%M", then)
    if delta < 2 * 86400 and (today.tm_yday - then.tm_yday) % 366 == 1:
        return "Yesterday"
    return time.strftime("%-d %b %Y", then)


class _TwoLineDelegate(QStyledItemDelegate):
    """Title on the first line, a small grey subtitle (date, message count) on the second."""

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex) -> QSize:
        metrics = option.fontMetrics
        return QSize(option.rect.width(), metrics.height() * 2 + 16)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem,
              index: QModelIndex | QPersistentModelIndex) -> None:
        c = colors()
        painter.save()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = option.rect.adjusted(6, 1, -6, -1)
        if option.state & QStyle.StateFlag.State_Selected:
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(qcolor(c.selection))
            painter.drawRoundedRect(rect, 7, 7)
        elif option.state & QStyle.StateFlag.State_MouseOver:
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(qcolor(c.selection, 0.5))
            painter.drawRoundedRect(rect, 7, 7)
        text_rect = rect.adjusted(10, 6, -10, -6)
        title_font = QFont(option.font)
        title_font.setWeight(QFont.Weight.Medium)
        painter.setFont(title_font)
        painter.setPen(qcolor(c.text))
        line = option.fontMetrics.height()
        title = painter.fontMetrics().elidedText(str(index.data(Qt.ItemDataRole.DisplayRole)),
                                                 Qt.TextElideMode.ElideRight, text_rect.width())
        painter.drawText(QRect(text_rect.left(), text_rect.top(), text_rect.width(), line),
                         Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, title)
        small = QFont(option.font)
        small.setPointSizeF(max(option.font.pointSizeF() - 1.5, 7.0))
        painter.setFont(small)
        painter.setPen(qcolor(c.secondary))
        painter.drawText(QRect(text_rect.left(), text_rect.top() + line + 2, text_rect.width(), line),
                         Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                         str(index.data(SUBTITLE_ROLE) or ""))
        painter.restore()


class ConversationList(QListWidget):
    conversationChosen = Signal(int)
    deleteRequested = Signal(int)

    def __init__(self, parent=None) -> None:  # noqa: ANN001 - Qt parent
        super().__init__(parent)
        self.setItemDelegate(_TwoLineDelegate(self))
        self.setMouseTracking(True)
        self.setVerticalScrollMode(QListWidget.ScrollMode.ScrollPerPixel)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._menu)
        self.itemClicked.connect(self._chosen)
        self._current_id: int | None = None

    def set_conversations(self, conversations: list[Any]) -> None:
        """Show ConversationMeta records (newest first), keeping the current one selected."""
        self.blockSignals(True)
        self.clear()
        for meta in conversations:
            item = QListWidgetItem(meta.title or "Untitled")
            item.setData(ID_ROLE, int(meta.id))
            count = f" · {meta.message_count} messages" if meta.message_count else ""
            item.setData(SUBTITLE_ROLE, relative_time(meta.updated) + count)
            item.setToolTip(meta.title)
            self.addItem(item)
        self.blockSignals(False)
        self.select(self._current_id)

    def select(self, conversation_id: int | None) -> None:
        self._current_id = conversation_id
        self.blockSignals(True)
        self.clearSelection()
        for row in range(self.count()):
            item = self.item(row)
            if item.data(ID_ROLE) == conversation_id:
                item.setSelected(True)
                self.setCurrentItem(item)
                break
        self.blockSignals(False)

    def ids(self) -> list[int]:
        return [int(self.item(row).data(ID_ROLE)) for row in range(self.count())]

    def _chosen(self, item: QListWidgetItem) -> None:
        self.conversationChosen.emit(int(item.data(ID_ROLE)))

    def _menu(self, position: QPoint) -> None:
        item = self.itemAt(position)
        if item is None:
            return
        menu = QMenu(self)
        menu.addAction("Delete Conversation", lambda: self.deleteRequested.emit(int(item.data(ID_ROLE))))
        menu.exec(self.viewport().mapToGlobal(position))
