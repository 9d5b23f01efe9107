"""A small live plot of prefill and decode speed (tokens per second) over the last minute, drawn with QPainter."""

from __future__ import annotations

import math
import time
from collections import deque

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QFont, QPainter, QPainterPath, QPaintEvent, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from app.views.widgets.theme import colors, qcolor

WINDOW_SECONDS = 60.0
MAX_SAMPLES = 600


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 x 10^k at or above `value` (axis maximum that reads well)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        candidate = step * 10**exponent
        if candidate >= value:
            return float(candidate)
    return float(10 ** (exponent + 1))


class ThroughputPlot(QWidget):
    """Two series, 'prefill' and 'decode', as lines over time; the y axis fits the visible maximum."""

    def __init__(self, parent: QWidget | None = None, clock=time.monotonic) -> None:  # noqa: ANN001
        super().__init__(parent)
        self._clock = clock
        self.samples: dict[str, deque[tuple[float, float]]] = {
            "prefill": deque(maxlen=MAX_SAMPLES), "decode": deque(maxlen=MAX_SAMPLES)}
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumHeight(96)

    def sizeHint(self) -> QSize:
        return QSize(220, 110)

    def add_sample(self, phase: str, tokens_per_second: float, at: float | None = None) -> None:
        if phase not in self.samples or not math.isfinite(tokens_per_second):
            return
        self.samples[phase].append((self._clock() if at is None else at, float(tokens_per_second)))
        self.update()

    def latest(self, phase: str) -> float | None:
        series = self.samples.get(phase)
        return series[-1][1] if series else None

    def paintEvent(self, event: QPaintEvent) -> None:
        c = colors()
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        small = QFont(self.font())
        small.setPointSizeF(max(self.font().pointSizeF() - 1.5, 7.0))
        painter.setFont(small)
        metrics = painter.fontMetrics()
        line = metrics.height()
        now = self._clock()
        visible = {phase: [(t, v) for t, v in series if now - t <= WINDOW_SECONDS]
                   for phase, series in self.samples.items()}
        peak = max((v for series in visible.values() for _, v in series), default=0.0)
        top_value = nice_ceiling(peak * 1.1) if peak > 0 else 10.0
        label_width = metrics.horizontalAdvance(f"{top_value:g}") + 6
        plot = QRectF(label_width, 4, self.width() - label_width - 2, self.height() - line - 10)

        # Frame: baseline, a faint middle grid line, the axis labels.
        painter.setPen(QPen(qcolor(c.separator), 1))
        painter.drawLine(QPointF(plot.left(), plot.bottom()), QPointF(plot.right(), plot.bottom()))
        dashed = QPen(qcolor(c.separator), 1, Qt.PenStyle.DashLine)
        painter.setPen(dashed)
        painter.drawLine(QPointF(plot.left(), plot.top()), QPointF(plot.right(), plot.top()))
        painter.drawLine(QPointF(plot.left(), plot.center().y()), QPointF(plot.right(), plot.center().y()))
        painter.setPen(qcolor(c.secondary))
        painter.drawText(QRectF(0, plot.top() - line / 2, label_width - 4, line),
                         Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, f"{top_value:g}")
        painter.drawText(QRectF(0, plot.bottom() - line / 2, label_width - 4, line),
                         Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, "0")

        series_colors = {"prefill": c.plot_prefill, "decode": c.plot_decode}
        for phase, points in visible.items():
            if not points:
                continue
            path = QPainterPath()
            for index, (t, v) in enumerate(points):
                x = plot.right() - (now - t) / WINDOW_SECONDS * plot.width()
                y = plot.bottom() - min(v / top_value, 1.0) * plot.height()
                if index == 0:
                    path.moveTo(x, y)
                else:
                    path.lineTo(x, y)
            painter.setPen(QPen(qcolor(series_colors[phase]), 1.8, Qt.PenStyle.SolidLine,
                                Qt.PenCapStyle.RoundCap, Qt.PenJoinStyle.RoundJoin))
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawPath(path)
            last_t, last_v = points[-1]
            x = plot.right() - (now - last_t) / WINDOW_SECONDS * plot.width()
            y = plot.bottom() - min(last_v / top_value, 1.0) * plot.height()
            painter.setBrush(qcolor(series_colors[phase]))
            painter.setPen(Qt.PenStyle.NoPen)
            painter.drawEllipse(QPointF(x, y), 2.5, 2.5)

        # Legend under the plot, with the latest value of each series.
        x = plot.left()
        legend_y = plot.bottom() + 5
        for phase in ("decode", "prefill"):
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(qcolor(series_colors[phase]))
            painter.drawRoundedRect(QRectF(x, legend_y + line / 2 - 3, 10, 6), 3, 3)
            latest = self.latest(phase)
            text = f"{phase} {latest:.1f} tok/s" if latest is not None else f"{phase} —"
            painter.setPen(qcolor(c.secondary))
            painter.drawText(QRectF(x + 14, legend_y, 200, line),
                             Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, text)
            x += 14 + metrics.horizontalAdvance(text) + 12
        painter.end()
