"""Before a document is read: its size in tokens, whether it fits the context, and a memory verdict for every
compression level. The user picks a level (and, when the context overflows, whether to leave out the middle),
then the document is read with a progress bar that can be cancelled. Nothing overflows silently."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QDialog,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QVBoxLayout,
    QWidget,
)

from app.payloads import DocumentInspection, IngestChoice, IngestResult
from app.views.widgets import icons
from app.views.widgets.theme import colors

TRUNCATE_MIDDLE = "truncate-middle"



def _fits(report: DocumentInspection, key: str) -> bool:
    verdict = report.verdict(key)
    return verdict is not None and verdict.fits


def default_level(report: DocumentInspection) -> str:
    """The level to preselect: the current one if it fits, else the recommendation, else the best that fits."""
    current = report.current_level
    if not report.verdicts or _fits(report, current):
        return current
    recommended = report.advice.key if report.advice else ""
    if recommended and _fits(report, recommended):
        return recommended
    for verdict in report.verdicts:
        if verdict.fits:
            return verdict.key
    return current


class DocumentDialog(QDialog):
    """Shows an inspected document (EngineWorker.documentInspected) and asks how to read it."""

    ingestRequested = Signal(int, object)  # doc_id, IngestChoice
    stopRequested = Signal()
    discarded = Signal(int)

    def __init__(self, report: DocumentInspection, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.report = report
        self.reading = False
        self.finished_report: IngestResult | None = None
        self._started = 0.0
        c = colors()
        self.setWindowTitle(f"Attach {report.name}")
        self.setModal(False)
        self.setMinimumWidth(520)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(22, 20, 22, 18)
        layout.setSpacing(12)

        header = QHBoxLayout()
        icon = QLabel()
        icon.setPixmap(icons.pixmap("document", c.accent, 34, 1.5))
        header.addWidget(icon, 0, Qt.AlignmentFlag.AlignTop)
        titles = QVBoxLayout()
        titles.setSpacing(2)
        name = QLabel(report.name)
        name.setStyleSheet("font-size: 12pt; font-weight: 600;")
        name.setTextFormat(Qt.TextFormat.PlainText)
        facts = QLabel(f"{report.kind.upper()} · {report.chars:,} characters · {report.tokens:,} tokens")
        facts.setObjectName("caption")
        titles.addWidget(name)
        titles.addWidget(facts)
        header.addLayout(titles, 1)
        layout.addLayout(header)

        needed, limit = report.context_needed, report.context_length
        self.context_label = QLabel()
        self.context_label.setWordWrap(True)
        if report.fits_context:
            self.context_label.setText(f"With the conversation so far it needs {needed:,} of the model's "
                                       f"{limit:,}-token context.")
        else:
            self.context_label.setText(
                f"<b>It does not fit the context:</b> with the conversation so far it needs {needed:,} tokens, "
                f"but the model holds {limit:,}. About {needed - limit:,} tokens must be left out.")
            self.context_label.setStyleSheet(f"color: {c.bad};")
        layout.addWidget(self.context_label)

        layout.addWidget(self._verdict_box(report))

        advice = report.advice
        if advice is not None and advice.reason:
            text = f"Recommended: <b>{advice.label}</b>. " if advice.key else ""
            rec = QLabel(text + advice.reason)
            rec.setWordWrap(True)
            rec.setObjectName("caption")
            layout.addWidget(rec)

        level_row = QHBoxLayout()
        level_row.addWidget(QLabel("Compression:"))
        self.level_combo = QComboBox()
        for verdict in report.verdicts:
            status = "fits" if verdict.fits else ("not available" if not verdict.supported else "does not fit")
            self.level_combo.addItem(f"{verdict.label} — {status}", verdict.key)
        if not report.verdicts:
            self.level_combo.addItem("Current level", report.current_level)
        chosen = self.level_combo.findData(default_level(report))
        self.level_combo.setCurrentIndex(max(chosen, 0))
        self.level_combo.currentIndexChanged.connect(self._update_state)
        level_row.addWidget(self.level_combo, 1)
        layout.addLayout(level_row)

        # Overflow of the context: the user must choose; there is no silent default.
        self.overflow_group = QButtonGroup(self)
        self.truncate_choice = QRadioButton("Leave out the middle of the document so it fits")
        self.cancel_choice = QRadioButton("Don't attach it")
        self.overflow_group.addButton(self.truncate_choice)
        self.overflow_group.addButton(self.cancel_choice)
        self.overflow_group.buttonToggled.connect(lambda *_: self._update_state())
        overflow_box = QVBoxLayout()
        overflow_box.setSpacing(4)
        overflow_box.addWidget(self.truncate_choice)
        overflow_box.addWidget(self.cancel_choice)
        self.overflow_widget = QWidget()
        self.overflow_widget.setLayout(overflow_box)
        self.overflow_widget.setVisible(not report.fits_context)
        layout.addWidget(self.overflow_widget)

        self.progress = QProgressBar()
        self.progress.setRange(0, max(report.tokens, 1))
        self.progress.setValue(0)
        self.progress.setVisible(False)
        self.progress_label = QLabel("")
        self.progress_label.setObjectName("caption")
        self.progress_label.setVisible(False)
        layout.addWidget(self.progress)
        layout.addWidget(self.progress_label)
        self.hint = QLabel("")
        self.hint.setWordWrap(True)
        self.hint.setStyleSheet(f"color: {c.warn};")
        layout.addWidget(self.hint)

        buttons = QHBoxLayout()
        buttons.addStretch(1)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self._cancel)
        self.read_button = QPushButton("Read Document")
        self.read_button.setObjectName("primary")
        self.read_button.setDefault(True)
        self.read_button.clicked.connect(self._read)
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(self.read_button)
        layout.addLayout(buttons)
        self._update_state()

    def _verdict_box(self, report: DocumentInspection) -> QWidget:
        c = colors()
        box = QFrame()
        box.setObjectName("verdicts")
        box.setStyleSheet(f"QFrame#verdicts {{ background: {c.sidebar}; border-radius: 8px; }}")
        grid = QGridLayout(box)
        grid.setContentsMargins(12, 10, 12, 10)
        grid.setHorizontalSpacing(8)
        grid.setVerticalSpacing(5)
        title = QLabel("MEMORY AT EACH LEVEL")
        title.setObjectName("sectionTitle")
        grid.addWidget(title, 0, 0, 1, 2)
        verdicts = report.verdicts
        if not verdicts:
            missing = QLabel("Fit verdicts are not available in this engine yet.")
            missing.setObjectName("caption")
            grid.addWidget(missing, 1, 0, 1, 2)
        self.verdict_labels: dict[str, QLabel] = {}
        for row, verdict in enumerate(verdicts, start=1):
            mark = QLabel("✓" if verdict.fits else "✕")
            mark.setStyleSheet(f"color: {c.good if verdict.fits else c.bad}; font-weight: 700;")
            text = verdict.sentence
            text = text[0].upper() + text[1:] if text else text
            if verdict.key == report.current_level:
                text += "  (current)"
            label = QLabel(text)
            label.setWordWrap(True)
            label.setTextFormat(Qt.TextFormat.PlainText)
            grid.addWidget(mark, row, 0, Qt.AlignmentFlag.AlignTop)
            grid.addWidget(label, row, 1)
            self.verdict_labels[verdict.key] = label
        grid.setColumnStretch(1, 1)
        return box

    # ----- choices --------------------------------------------------------------------------------------
    def chosen_level(self) -> str:
        return str(self.level_combo.currentData())

    def choice(self) -> IngestChoice:
        return IngestChoice(level=self.chosen_level(),
                            overflow_policy=TRUNCATE_MIDDLE if self.truncate_choice.isChecked() else None)

    def _level_fits(self, key: str) -> bool:
        verdict = self.report.verdict(key)
        return verdict is None or verdict.fits

    def _update_state(self) -> None:
        if self.reading:
            return
        problems = []
        if not self._level_fits(self.chosen_level()):
            problems.append("The cache would not fit in memory at this level: choose a smaller level.")
        if not self.report.fits_context and not self.truncate_choice.isChecked():
            problems.append("Choose whether to leave out the middle of the document.")
        if self.cancel_choice.isChecked():
            problems = []
        self.hint.setText(" ".join(problems) if not self.cancel_choice.isChecked() else "")
        self.hint.setVisible(bool(self.hint.text()))
        self.read_button.setText("Close" if self.cancel_choice.isChecked() else "Read Document")
        self.read_button.setEnabled(self.cancel_choice.isChecked() or not problems)

    # ----- reading -----------------------------------------------------------------------------------------
    def _read(self) -> None:
        if self.cancel_choice.isChecked():
            self._discard()
            return
        self.reading = True
        self._started = time.perf_counter()
        self.level_combo.setEnabled(False)
        self.overflow_widget.setEnabled(False)
        self.read_button.setEnabled(False)
        self.read_button.setText("Reading…")
        self.cancel_button.setText("Stop")
        self.progress.setVisible(True)
        self.progress_label.setVisible(True)
        self.progress_label.setText("Starting…")
        self.hint.setText("")
        self.hint.setVisible(False)
        self.ingestRequested.emit(self.report.doc_id, self.choice())

    def set_progress(self, done: int, total: int) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)
        elapsed = time.perf_counter() - self._started
        rate = f" · {done / elapsed:.0f} tok/s" if elapsed > 0 and done else ""
        self.progress_label.setText(f"Reading {done:,} of {total:,} tokens{rate}")

    def finish(self, result: IngestResult) -> None:
        """The worker's documentIngested report: close on success, show why otherwise."""
        self.finished_report = result
        self.reading = False
        if result.cancelled:
            self.progress_label.setText(result.message or "Cancelled.")
            self.cancel_button.setText("Close")
            self.read_button.setVisible(False)
            return
        self.progress.setValue(self.progress.maximum())
        self.accept()

    def _cancel(self) -> None:
        if self.reading:
            self.cancel_button.setEnabled(False)
            self.progress_label.setText("Stopping…")
            self.stopRequested.emit()
            return
        if self.finished_report is None:
            self._discard()
        else:
            self.reject()

    def _discard(self) -> None:
        self.discarded.emit(self.report.doc_id)
        self.reject()

    def closeEvent(self, event) -> None:  # noqa: ANN001 - Qt override
        if self.reading:
            self.stopRequested.emit()
        elif self.finished_report is None:
            self.discarded.emit(self.report.doc_id)
        super().closeEvent(event)
