"""The compression control: a five-stop slider (Off / 8 / 4 / 3 / 2 bits), the method each stop stands for,
an Advanced picker for the exact method, the engine's recommendation, and what the last switch saved."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtGui import QFont, QPainter, QPaintEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from app.payloads import CompressionReport, LevelAdvice, LevelSummary
from app.views.widgets.theme import colors, qcolor
from engine.planning.units import format_bytes

HANDLE_WIDTH = 18  # the slider handle's width in the style sheet (16 px + border)



def tick_label(level: LevelSummary) -> str:
    return "Off" if level.key == "16" else level.key


class TickLabels(QWidget):
    """The stop names, each centred under where the slider's handle rests at that stop."""

    def __init__(self, labels: list[str], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.labels = labels
        self.selected = 0
        self.setFixedHeight(self.fontMetrics().height() + 2)

    def set_selected(self, index: int) -> None:
        self.selected = index
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:
        c = colors()
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.TextAntialiasing)
        count = len(self.labels)
        usable = self.width() - HANDLE_WIDTH
        for index, text in enumerate(self.labels):
            centre = HANDLE_WIDTH / 2 + (usable * index / (count - 1) if count > 1 else 0)
            font = QFont(self.font())
            font.setPointSizeF(max(self.font().pointSizeF() - 1.0, 7.0))
            font.setWeight(QFont.Weight.DemiBold if index == self.selected else QFont.Weight.Normal)
            painter.setFont(font)
            painter.setPen(qcolor(c.text if index == self.selected else c.secondary))
            width = painter.fontMetrics().horizontalAdvance(text) + 4
            left = min(max(centre - width / 2, 0), self.width() - width)
            painter.drawText(QRectF(left, 0, width, self.height()), Qt.AlignmentFlag.AlignCenter, text)
        painter.end()


class CompressionSlider(QWidget):
    """Emits levelChosen(key, method or None) when the user settles on a stop (release, click, keys)."""

    levelChosen = Signal(str, object)

    def __init__(self, levels: list[LevelSummary], methods: list[Any] | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.levels = levels
        self.methods = methods or []  # engine.kvcache MethodInfo records
        self._current_key = levels[0].key if levels else "16"
        self._recommended: LevelAdvice | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(6)

        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, max(len(levels) - 1, 0))
        self.slider.setPageStep(1)
        self.slider.setTickPosition(QSlider.TickPosition.NoTicks)
        self.slider.setCursor(Qt.CursorShape.PointingHandCursor)
        self.slider.setAccessibleName("KV cache compression")
        self.slider.valueChanged.connect(self._on_value_changed)
        self.slider.sliderReleased.connect(self._commit)
        layout.addWidget(self.slider)

        self.ticks = TickLabels([tick_label(level) for level in levels])
        layout.addWidget(self.ticks)

        self.description = QLabel("")
        self.description.setWordWrap(True)
        layout.addWidget(self.description)

        advanced_row = QHBoxLayout()
        self.advanced = QCheckBox("Advanced")
        self.advanced.toggled.connect(self._toggle_advanced)
        self.method_combo = QComboBox()
        self.method_combo.setVisible(False)
        self.method_combo.activated.connect(lambda _index: self._commit())
        advanced_row.addWidget(self.advanced)
        advanced_row.addWidget(self.method_combo, 1)
        layout.addLayout(advanced_row)

        self.recommendation = QLabel("")
        self.recommendation.setWordWrap(True)
        self.recommendation.setObjectName("caption")
        self.use_recommended = QPushButton("Use recommended")
        self.use_recommended.setObjectName("link")
        self.use_recommended.setCursor(Qt.CursorShape.PointingHandCursor)
        self.use_recommended.clicked.connect(self._accept_recommendation)
        self.use_recommended.setVisible(False)
        layout.addWidget(self.recommendation)
        layout.addWidget(self.use_recommended, 0, Qt.AlignmentFlag.AlignLeft)

        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.status.setObjectName("caption")
        layout.addWidget(self.status)
        self._preview(self.slider.value())

    # ----- state from the controller ------------------------------------------------------------------------
    def set_current(self, key: str, method: str | None = None) -> None:
        index = self._index_of(key)
        if index is None:
            return
        self._current_key = key
        self.slider.blockSignals(True)
        self.slider.setValue(index)
        self.slider.blockSignals(False)
        self._preview(index)
        if method:
            position = self.method_combo.findData(method)
            if position >= 0:
                self.method_combo.setCurrentIndex(position)
        self._update_recommendation()

    def set_recommendation(self, recommendation: LevelAdvice | None) -> None:
        self._recommended = recommendation
        self._update_recommendation()

    def show_report(self, report: CompressionReport) -> None:
        if not report.available:
            self.status.setText(report.message)
            self.status.setStyleSheet(f"color: {colors().warn};" if report.message else "")
            return
        self.status.setStyleSheet("")
        before, after = report.before, report.after
        text = f"Switched live to {report.label} ({report.method})."
        if before or after:
            text += f" Cache {format_bytes(before)} → {format_bytes(after)}."
        self.status.setText(text)

    # ----- internals ----------------------------------------------------------------------------------------------
    def _index_of(self, key: str) -> int | None:
        return next((i for i, level in enumerate(self.levels) if level.key == key), None)

    def selected_level(self) -> LevelSummary | None:
        index = self.slider.value()
        return self.levels[index] if 0 <= index < len(self.levels) else None

    def selected_method(self) -> str | None:
        if not self.advanced.isChecked() or not self.method_combo.isVisible():
            return None
        level = self.selected_level()
        method = self.method_combo.currentData()
        return None if level is None or method == level.method else method

    def _preview(self, index: int) -> None:
        if not self.levels:
            self.description.setText("Compression levels are not available.")
            return
        level = self.levels[index]
        self.ticks.set_selected(index)
        if level.key == "16":
            self.description.setText("<b>Off</b> — keys and values kept as 16-bit floats.")
        else:
            bits = (f"K{level.key_bits}/V{level.value_bits}" if level.key_bits != level.value_bits
                    else f"{level.key_bits}-bit")
            extras = f", {level.extras}" if level.extras else ""
            self.description.setText(f"<b>{level.label}</b> — {level.method} {bits}, groups of "
                                     f"{level.group_size}{extras} · {level.quality_note}")
        self._fill_methods(level)

    def _fill_methods(self, level: LevelSummary) -> None:
        wanted = level.key_bits
        self.method_combo.blockSignals(True)
        self.method_combo.clear()
        for info in self.methods:
            if wanted in info.supported_bits:
                suffix = " (default)" if info.name == level.method else ""
                self.method_combo.addItem(info.name + suffix, info.name)
                self.method_combo.setItemData(self.method_combo.count() - 1, info.description,
                                              Qt.ItemDataRole.ToolTipRole)
        position = self.method_combo.findData(level.method)
        if position >= 0:
            self.method_combo.setCurrentIndex(position)
        self.method_combo.blockSignals(False)

    def _toggle_advanced(self, on: bool) -> None:
        self.method_combo.setVisible(on)
        if not on and self.selected_level() and self.selected_level().key == self._current_key:
            self._commit()

    def _on_value_changed(self, index: int) -> None:
        self._preview(index)
        # While dragging only preview; a click on the groove or a key press settles at once.
        if not self.slider.isSliderDown():
            self._commit()

    def _commit(self) -> None:
        level = self.selected_level()
        if level is None:
            return
        self._current_key = level.key
        self.levelChosen.emit(level.key, self.selected_method())
        self._update_recommendation()

    def choose(self, key: str, method: str | None = None) -> None:
        """Select a stop as if the user had (used by the tray menu and tests)."""
        index = self._index_of(key)
        if index is None:
            return
        self.slider.blockSignals(True)
        self.slider.setValue(index)
        self.slider.blockSignals(False)
        self._preview(index)
        if method:
            self.advanced.setChecked(True)
            position = self.method_combo.findData(method)
            if position >= 0:
                self.method_combo.setCurrentIndex(position)
        self._commit()

    def _update_recommendation(self) -> None:
        r = self._recommended
        if not r or not r.reason:
            self.recommendation.setText("")
            self.use_recommended.setVisible(False)
            return
        if r.key:
            self.recommendation.setText(f"Recommended: {r.label}. {r.reason}")
        else:
            self.recommendation.setText(r.reason)
        self.use_recommended.setVisible(bool(r.key) and r.key != self._current_key)
        self.use_recommended.setText(f"Use {r.label}" if r.key else "")

    def _accept_recommendation(self) -> None:
        if self._recommended and self._recommended.key:
            self.choose(self._recommended.key)
