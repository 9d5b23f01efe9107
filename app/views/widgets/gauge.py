"""A horizontal gauge: a label, a value on the right, and a rounded bar with an optional reference mark."""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QFont, QPainter, QPaintEvent
from PySide6.QtWidgets import QSizePolicy, QWidget

from app.views.widgets.theme import colors, qcolor

BAR_HEIGHT = 6


class Gauge(QWidget):
    """Shows `fraction` (0..1) of a bar; `marker` (0..1, optional) draws a thin tick, e.g. the 16-bit size."""

    def __init__(self, title: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = title
        self.value_text = "—"
        self.detail_text = ""
        self.fraction = 0.0
        self.marker: float | None = None
        self.color = colors().accent
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_value(self, fraction: float, value_text: str, detail_text: str = "", color: str | None = None,
                  marker: float | None = None) -> None:
        self.fraction = min(max(float(fraction), 0.0), 1.0)
        self.value_text = value_text
        self.detail_text = detail_text
        self.marker = None if marker is None else min(max(float(marker), 0.0), 1.0)
        if color:
            self.color = color
        self.setToolTip(f"{self.title}: {value_text}" + (f" — {detail_text}" if detail_text else ""))
        self.update()

    def sizeHint(self) -> QSize:
        line = self.fontMetrics().height()
        return QSize(200, line + 8 + BAR_HEIGHT + line + 4)  # title, bar, detail line (always reserved)

    def minimumSizeHint(self) -> QSize:
        return QSize(120, self.sizeHint().height())

    def paintEvent(self, event: QPaintEvent) -> None:
        c = colors()
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        width = self.width()
        line = self.fontMetrics().height()
        painter.setPen(qcolor(c.text))
        painter.drawText(QRectF(0, 0, width, line), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                         self.title)
        value_font = QFont(self.font())
        value_font.setWeight(QFont.Weight.DemiBold)
        painter.setFont(value_font)
        painter.drawText(QRectF(0, 0, width, line), Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                         self.value_text)
        top = line + 5
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(qcolor(c.selection))
        painter.drawRoundedRect(QRectF(0, top, width, BAR_HEIGHT), BAR_HEIGHT / 2, BAR_HEIGHT / 2)
        if self.fraction > 0:
            filled = max(BAR_HEIGHT, width * self.fraction)
            painter.setBrush(qcolor(self.color))
            painter.drawRoundedRect(QRectF(0, top, filled, BAR_HEIGHT), BAR_HEIGHT / 2, BAR_HEIGHT / 2)
        if self.marker is not None:
            x = min(max(width * self.marker, 1.5), width - 1.5)
            painter.setBrush(qcolor(c.secondary))
            painter.drawRoundedRect(QRectF(x - 1, top - 3, 2, BAR_HEIGHT + 6), 1, 1)
        if self.detail_text:
            small = QFont(self.font())
            small.setPointSizeF(max(self.font().pointSizeF() - 1.5, 7.0))
            painter.setFont(small)
            painter.setPen(qcolor(c.secondary))
            painter.drawText(QRectF(0, top + BAR_HEIGHT + 3, width, line),
                             Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, self.detail_text)
        painter.end()
