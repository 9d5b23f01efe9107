"""Choose a model: the engine's catalogue (embedded default, local folders, Hugging Face cache) with size and
context length, and a download of an mlx-community model by name with progress and cancel."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.views.widgets.theme import colors
from engine.planning.units import format_bytes

SOURCE_NAMES = {"embedded": "Built in", "local": "Folder", "hf-cache": "Hugging Face"}


def format_parameters(count: int) -> str:
    if count >= 1e9:
        return f"{count / 1e9:.1f}B"
    if count >= 1e6:
        return f"{count / 1e6:.0f}M"
    return str(count) if count else "—"


class ModelPickerDialog(QDialog):
    loadRequested = Signal(str)  # a model folder path
    downloadRequested = Signal(str)
    downloadCancelled = Signal()

    def __init__(self, models: list[Any], current_path: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Choose a Model")
        self.setMinimumSize(640, 420)
        self.models = models
        self.downloading = False
        layout = QVBoxLayout(self)
        layout.setContentsMargins(20, 18, 20, 16)
        layout.setSpacing(10)
        title = QLabel("Models on this computer")
        title.setStyleSheet("font-size: 12pt; font-weight: 600;")
        layout.addWidget(title)

        self.table = QTableWidget(0, 5)
        self.table.setHorizontalHeaderLabels(["Name", "Source", "Parameters", "Size", "Context"])
        self.table.verticalHeader().setVisible(False)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setShowGrid(False)
        self.table.setAlternatingRowColors(True)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for column in range(1, 5):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        header.setDefaultAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.table.itemDoubleClicked.connect(lambda _item: self._load())
        layout.addWidget(self.table, 1)
        self.note = QLabel("")
        self.note.setWordWrap(True)
        self.note.setObjectName("caption")
        layout.addWidget(self.note)
        self._fill(current_path)

        download_title = QLabel("Download from Hugging Face")
        download_title.setStyleSheet("font-weight: 600;")
        layout.addWidget(download_title)
        download_row = QHBoxLayout()
        self.repo_field = QLineEdit()
        self.repo_field.setPlaceholderText("mlx-community/Qwen2.5-1.5B-Instruct-4bit, or just the model's name")
        self.repo_field.returnPressed.connect(self._download)
        self.download_button = QPushButton("Download")
        self.download_button.clicked.connect(self._download)
        download_row.addWidget(self.repo_field, 1)
        download_row.addWidget(self.download_button)
        layout.addLayout(download_row)
        self.download_progress = QProgressBar()
        self.download_progress.setVisible(False)
        self.download_status = QLabel("")
        self.download_status.setWordWrap(True)
        self.download_status.setObjectName("caption")
        layout.addWidget(self.download_progress)
        layout.addWidget(self.download_status)

        buttons = QHBoxLayout()
        buttons.addStretch(1)
        close = QPushButton("Close")
        close.clicked.connect(self.reject)
        self.load_button = QPushButton("Load Model")
        self.load_button.setObjectName("primary")
        self.load_button.clicked.connect(self._load)
        buttons.addWidget(close)
        buttons.addWidget(self.load_button)
        layout.addLayout(buttons)
        self._selection_changed()

    def _fill(self, current_path: str) -> None:
        self.table.blockSignals(True)  # the buttons the selection updates do not exist yet
        self.table.setRowCount(len(self.models))
        for row, info in enumerate(self.models):
            name = QTableWidgetItem(info.name + ("  (in use)" if current_path and str(info.path) == current_path
                                                 else ""))
            if not info.ready:
                name.setForeground(Qt.GlobalColor.gray)
            name.setToolTip(str(info.path or "") + (f"\n{info.note}" if info.note else ""))
            cells = [
                name,
                QTableWidgetItem(SOURCE_NAMES.get(info.source, info.source)),
                QTableWidgetItem(format_parameters(info.parameters)),
                QTableWidgetItem(format_bytes(info.bytes_on_disk) if info.bytes_on_disk else "—"),
                QTableWidgetItem(f"{info.max_context:,}" if info.max_context else "—"),
            ]
            for column, item in enumerate(cells):
                if column and not info.ready:
                    item.setForeground(Qt.GlobalColor.gray)
                self.table.setItem(row, column, item)
            if current_path and str(info.path) == current_path:
                self.table.selectRow(row)
        self.table.blockSignals(False)

    def selected_model(self) -> Any | None:
        rows = self.table.selectionModel().selectedRows()
        return self.models[rows[0].row()] if rows else None

    def _selection_changed(self) -> None:
        info = self.selected_model()
        self.load_button.setEnabled(bool(info and info.ready))
        if info is None:
            self.note.setText("")
        elif not info.ready:
            self.note.setText(info.note or "This model cannot be loaded.")
        else:
            self.note.setText(f"{info.model_type} · {info.layers} layers · {info.kv_heads} KV heads × "
                              f"{info.head_dim} · weights {info.quantization}")

    def _load(self) -> None:
        info = self.selected_model()
        if info is not None and info.ready and info.path is not None:
            self.loadRequested.emit(str(info.path))
            self.accept()

    # ----- download -----------------------------------------------------------------------------------------
    def _download(self) -> None:
        if self.downloading:
            self.downloadCancelled.emit()
            self.download_status.setText("Cancelling…")
            return
        name = self.repo_field.text().strip()
        if not name:
            self.download_status.setText("Type a model name, e.g. mlx-community/SmolLM2-360M-Instruct.")
            return
        self.downloading = True
        self.download_button.setText("Cancel")
        self.download_progress.setVisible(True)
        self.download_progress.setRange(0, 0)  # busy until the size is known
        self.download_status.setStyleSheet("")
        self.download_status.setText("Starting…")
        self.downloadRequested.emit(name)

    def set_download_progress(self, message: str, fraction: float) -> None:
        if fraction < 0:
            self.download_progress.setRange(0, 0)
        else:
            self.download_progress.setRange(0, 1000)
            self.download_progress.setValue(int(fraction * 1000))
        self.download_status.setText(message + (f" — {fraction:.0%}" if fraction >= 0 else ""))

    def download_failed(self, message: str) -> None:
        self._download_done()
        self.download_status.setStyleSheet(f"color: {colors().bad};")
        self.download_status.setText(message)

    def download_finished(self, folder: str) -> None:
        self._download_done()
        self.download_status.setText(f"Downloaded to {folder}; loading it now.")

    def _download_done(self) -> None:
        self.downloading = False
        self.download_button.setText("Download")
        self.download_progress.setVisible(False)
