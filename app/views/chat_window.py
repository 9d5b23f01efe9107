"""The chat window: conversations on the left, the chat in the middle, compression and memory on the right.

It only shows the controller's state and forwards what the user does; everything it displays arrives as
plain data through the controller's signals, so it never waits on the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, Qt, Signal
from PySide6.QtGui import (
    QAction,
    QActionGroup,
    QCloseEvent,
    QDragEnterEvent,
    QDropEvent,
    QGuiApplication,
    QKeySequence,
)
from PySide6.QtWidgets import (
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.controller import ChatController, ChatEntry, OpenedConversation, overflow_question
from app.payloads import (
    CompressionReport,
    DocumentInspection,
    IngestChoice,
    IngestResult,
    ModelSummary,
    Overflow,
    PendingDocument,
)
from app.settings import SAVED_CACHE_BUDGET_CHOICES
from app.views.widgets import icons
from app.views.widgets.compression_slider import CompressionSlider
from app.views.widgets.conversation_list import ConversationList
from app.views.widgets.document_dialog import DocumentDialog
from app.views.widgets.error_banner import Banner
from app.views.widgets.input_box import Composer
from app.views.widgets.memory_panel import MemoryPanel, section_title
from app.views.widgets.message_view import MessageList, document_chip
from app.views.widgets.model_picker import ModelPickerDialog, format_parameters
from app.views.widgets.theme import colors
from engine.planning.units import format_bytes

DOCUMENT_SUFFIXES = (".txt", ".md", ".markdown", ".pdf", ".html", ".htm")
DOCUMENT_FILTER = "Documents (*.pdf *.md *.markdown *.txt *.html *.htm);;All files (*)"
SIDEBAR_WIDTH = 232
INSPECTOR_WIDTH = 292
# Show the reading progress bar for prompts at least this long; shorter ones are read in a blink.
PROGRESS_MIN_TOKENS = 256
BUSY_TEXT = {"loading": "Loading model…", "thinking": "Thinking…", "reading": "Reading…",
             "compressing": "Re-encoding the cache…", "reopening": "Loading the saved cache…"}



class ChatWindow(QMainWindow):
    """The main window. `quit_on_close`: without a tray icon, closing the window ends the app."""

    closed = Signal()

    def __init__(self, controller: ChatController, quit_on_close: bool = True, methods: list[Any] | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.quit_on_close = quit_on_close
        self.document_dialog: DocumentDialog | None = None
        self.model_picker: ModelPickerDialog | None = None
        self.overflow_box: QMessageBox | None = None
        self._queued_documents: list[str] = []
        self.pending_names: list[str] = []
        self.setWindowTitle("Velox")
        self.setAcceptDrops(True)
        self.resize(1180, 760)
        self.setMinimumSize(760, 480)
        c = colors()

        root = QWidget()
        root_layout = QHBoxLayout(root)
        root_layout.setContentsMargins(0, 0, 0, 0)
        root_layout.setSpacing(0)
        self.sidebar = self._build_sidebar()
        root_layout.addWidget(self.sidebar)
        root_layout.addWidget(self._build_chat(c), 1)
        self.inspector = self._build_inspector(methods)
        root_layout.addWidget(self.inspector)
        self.setCentralWidget(root)
        self._build_menus()
        self._connect()
        if controller.settings.window_geometry:
            self.restoreGeometry(QByteArray(controller.settings.window_geometry))

    # ----- building ----------------------------------------------------------------------------------------
    def _build_sidebar(self) -> QFrame:
        c = colors()
        sidebar = QFrame()
        sidebar.setObjectName("sidebar")
        sidebar.setFixedWidth(SIDEBAR_WIDTH)
        layout = QVBoxLayout(sidebar)
        layout.setContentsMargins(10, 14, 10, 10)
        layout.setSpacing(8)
        self.new_chat_button = QPushButton("  New Chat")
        self.new_chat_button.setObjectName("flat")
        icons.dress_button(self.new_chat_button, "new-chat", c.text, 16, "New chat (Ctrl+N)")
        self.new_chat_button.setStyleSheet("text-align: left; font-weight: 600; padding: 6px 8px;")
        layout.addWidget(self.new_chat_button)
        heading = section_title("Conversations")
        heading.setContentsMargins(8, 6, 0, 0)
        layout.addWidget(heading)
        self.conversation_list = ConversationList()
        layout.addWidget(self.conversation_list, 1)
        return sidebar

    def _build_chat(self, c: Any) -> QWidget:
        chat = QWidget()
        chat.setObjectName("chatArea")
        layout = QVBoxLayout(chat)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)

        header = QFrame()
        header.setObjectName("header")
        header_layout = QHBoxLayout(header)
        header_layout.setContentsMargins(16, 8, 10, 8)
        header_layout.setSpacing(6)
        self.sidebar_button = QToolButton()
        sidebar_tip = "Show or hide the conversation list"
        icons.dress_button(self.sidebar_button, "sidebar", c.secondary, 18, sidebar_tip, pointing_cursor=False)
        titles = QVBoxLayout()
        titles.setSpacing(0)
        self.title_label = QLabel("New Chat")
        self.title_label.setObjectName("headerTitle")
        self.title_label.setTextFormat(Qt.TextFormat.PlainText)
        self.status_label = QLabel("Starting…")
        self.status_label.setObjectName("caption")
        titles.addWidget(self.title_label)
        titles.addWidget(self.status_label)
        self.model_button = QPushButton("No model")
        self.model_button.setObjectName("flat")
        icons.dress_button(self.model_button, "chip", c.secondary, 16, "Choose a model")
        self.inspector_button = QToolButton()
        inspector_tip = "Show or hide compression and memory"
        icons.dress_button(self.inspector_button, "inspector", c.secondary, 18, inspector_tip, pointing_cursor=False)
        header_layout.addWidget(self.sidebar_button)
        header_layout.addSpacing(4)
        header_layout.addLayout(titles, 1)
        header_layout.addWidget(self.model_button)
        header_layout.addWidget(self.inspector_button)
        layout.addWidget(header)

        self.progress = QProgressBar()
        self.progress.setVisible(False)
        self.progress.setTextVisible(False)  # a 3-pixel bar: its percentage text would spill over the chat
        self.progress.setFixedHeight(3)
        self.progress.setStyleSheet("QProgressBar { border-radius: 0; max-height: 3px; }"
                                    "QProgressBar::chunk { border-radius: 0; }")
        layout.addWidget(self.progress)

        banner_holder = QWidget()
        banner_layout = QVBoxLayout(banner_holder)
        banner_layout.setContentsMargins(16, 8, 16, 0)
        self.banner = Banner()
        banner_layout.addWidget(self.banner)
        banner_holder.setVisible(True)
        layout.addWidget(banner_holder)

        self.messages = MessageList()
        layout.addWidget(self.messages, 1)

        bottom = QWidget()
        bottom_layout = QVBoxLayout(bottom)
        bottom_layout.setContentsMargins(20, 4, 20, 14)
        bottom_layout.setSpacing(6)
        # Documents read and waiting for the next question.
        self.chips = QWidget()
        self.chips_layout = QHBoxLayout(self.chips)
        self.chips_layout.setContentsMargins(4, 0, 4, 0)
        self.chips_layout.setSpacing(6)
        self.chips.setVisible(False)
        bottom_layout.addWidget(self.chips)
        self.composer = Composer()
        bottom_layout.addWidget(self.composer)
        footer = QLabel("Enter to send · Shift+Enter for a new line · drop a document to attach it")
        footer.setObjectName("caption")
        footer.setAlignment(Qt.AlignmentFlag.AlignCenter)
        bottom_layout.addWidget(footer)
        layout.addWidget(bottom)
        return chat

    def _build_inspector(self, methods: list[Any] | None) -> QFrame:
        inspector = QFrame()
        inspector.setObjectName("inspector")
        inspector.setFixedWidth(INSPECTOR_WIDTH)
        outer = QVBoxLayout(inspector)
        outer.setContentsMargins(0, 0, 0, 0)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        content = QWidget()
        content.setObjectName("inspectorContent")
        content.setStyleSheet("QWidget#inspectorContent { background: transparent; }")
        layout = QVBoxLayout(content)
        layout.setContentsMargins(16, 16, 16, 16)
        layout.setSpacing(10)
        layout.addWidget(section_title("KV cache compression"))
        self.compression = CompressionSlider(self.controller.levels(), methods)
        layout.addWidget(self.compression)
        layout.addSpacing(10)
        self.memory_panel = MemoryPanel()
        layout.addWidget(self.memory_panel)
        layout.addStretch(1)
        scroll.setWidget(content)
        outer.addWidget(scroll)
        return inspector

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        self.new_chat_action = self._action(file_menu, "New Chat", QKeySequence.StandardKey.New, self.controller.new_chat)
        self.attach_action = self._action(file_menu, "Attach Document…", QKeySequence.StandardKey.Open,
                                          self.choose_document)
        self.model_action = self._action(file_menu, "Choose Model…", QKeySequence("Ctrl+Shift+M"),
                                         self.open_model_picker)
        file_menu.addSeparator()
        self._action(file_menu, "Close Window", QKeySequence.StandardKey.Close, self.close)
        quit_action = self._action(file_menu, "Quit Velox", QKeySequence.StandardKey.Quit, self.quit_app)
        quit_action.setMenuRole(QAction.MenuRole.QuitRole)

        edit_menu = bar.addMenu("&Edit")
        self._action(edit_menu, "Copy Last Reply", QKeySequence("Ctrl+Shift+C"), self.copy_last_reply)

        chat_menu = bar.addMenu("&Chat")
        self.stop_action = self._action(chat_menu, "Stop", QKeySequence("Esc"), self.controller.stop)
        self.regenerate_action = self._action(chat_menu, "Regenerate Reply", QKeySequence("Ctrl+R"),
                                              self.controller.regenerate)
        chat_menu.addSeparator()
        self.compression_menu = chat_menu.addMenu("Compression")
        self.compression_actions = QActionGroup(self)
        for level in self.controller.levels():
            action = QAction(level.label, self, checkable=True)
            action.setData(level.key)
            action.triggered.connect(lambda _checked=False, key=level.key: self.compression.choose(key))
            self.compression_actions.addAction(action)
            self.compression_menu.addAction(action)
        # Conversations' KV caches kept on disk, so reopening one reads nothing again.
        self.cache_budget_menu = chat_menu.addMenu("Saved Cache Disk Budget")
        self.cache_budget_actions = QActionGroup(self)
        budget = self.controller.settings.saved_cache_budget_bytes
        for choice in sorted({*SAVED_CACHE_BUDGET_CHOICES, budget}):
            action = QAction(format_bytes(choice) if choice else "Off (keep none)", self, checkable=True)
            action.setChecked(choice == budget)
            action.triggered.connect(lambda _checked=False, size=choice: self.controller.set_saved_cache_budget(size))
            self.cache_budget_actions.addAction(action)
            self.cache_budget_menu.addAction(action)

        view_menu = bar.addMenu("&View")
        self.sidebar_action = self._action(view_menu, "Show Conversations", QKeySequence("Ctrl+Alt+S"),
                                           self.toggle_sidebar)
        self.inspector_action = self._action(view_menu, "Show Inspector", QKeySequence("Ctrl+Alt+I"),
                                             self.toggle_inspector)
        for action in (self.sidebar_action, self.inspector_action):
            action.setCheckable(True)
            action.setChecked(True)

    def _action(self, menu: Any, text: str, shortcut: Any, slot: Any) -> QAction:
        action = QAction(text, self)
        action.setShortcut(shortcut)
        action.triggered.connect(lambda _checked=False: slot())
        menu.addAction(action)
        # Also on the window: a menu-bar-only (LSUIElement) app shows no menu bar on macOS, and the
        # shortcuts (Cmd-W hides, Cmd-Q quits, ...) must work without it.
        self.addAction(action)
        return action

    def _connect(self) -> None:
        ctl = self.controller
        self.new_chat_button.clicked.connect(ctl.new_chat)
        self.conversation_list.conversationChosen.connect(ctl.open_conversation)
        self.conversation_list.deleteRequested.connect(ctl.delete_conversation)
        self.composer.submitted.connect(ctl.send)
        self.composer.stopRequested.connect(ctl.stop)
        self.composer.attachRequested.connect(self.choose_document)
        self.messages.copyRequested.connect(self.copy_text)
        self.messages.regenerateRequested.connect(ctl.regenerate)
        self.model_button.clicked.connect(self.open_model_picker)
        self.sidebar_button.clicked.connect(self.toggle_sidebar)
        self.inspector_button.clicked.connect(self.toggle_inspector)
        self.compression.levelChosen.connect(lambda key, method: ctl.set_compression(key, method))

        ctl.modelChanged.connect(self._on_model_changed)
        ctl.modelProgress.connect(lambda message, _fraction: self.status_label.setText(message))
        ctl.busyChanged.connect(self._on_busy)
        ctl.conversationsChanged.connect(self._on_conversations)
        ctl.conversationOpened.connect(self._on_conversation_opened)
        ctl.entryAdded.connect(self._on_entry_added)
        ctl.lastEntryRemoved.connect(self.messages.remove_last)
        ctl.replyStreaming.connect(self.messages.stream_text)
        ctl.replyFinished.connect(self._on_reply_finished)
        ctl.prefillProgress.connect(self._on_prefill_progress)
        ctl.calibrationProgress.connect(self._on_calibration_progress)
        ctl.overflowChoiceNeeded.connect(self.ask_overflow)
        ctl.errorRaised.connect(lambda text: self.banner.show_message(text, "error"))
        ctl.noticeRaised.connect(lambda text: self.banner.show_message(text, "notice"))
        ctl.documentInspected.connect(self._on_document_inspected)
        ctl.documentFailed.connect(lambda _path, _message: self._next_queued_document())
        ctl.ingestProgress.connect(self._on_ingest_progress)
        ctl.documentIngested.connect(self._on_document_ingested)
        ctl.pendingDocumentsChanged.connect(self._on_pending_documents)
        ctl.compressionChanged.connect(self._on_compression_changed)
        ctl.recommendationChanged.connect(self.compression.set_recommendation)
        ctl.memoryUpdated.connect(self.memory_panel.update_memory)
        ctl.throughputSample.connect(self.memory_panel.add_throughput)
        ctl.statsChanged.connect(self.memory_panel.update_stats)
        ctl.downloadProgress.connect(self._on_download_progress)
        ctl.downloadFailed.connect(self._on_download_failed)
        ctl.downloadFinished.connect(self._on_download_finished)
        self.compression.set_current(ctl.level_key, ctl.method)
        self._check_compression_action(ctl.level_key)
        self.composer.set_model_ready(ctl.model is not None)

    # ----- controller -> view ----------------------------------------------------------------------------------
    def _on_model_changed(self, model: ModelSummary) -> None:
        context = f"{model.max_context // 1024}k" if model.max_context >= 1024 else str(model.max_context)
        self.model_button.setText(f" {model.name}")
        self.model_button.setToolTip(f"{model.name} · {format_parameters(model.parameters)} parameters · "
                                     f"{context} context · {format_bytes(model.bytes_on_disk)} on disk\n"
                                     "Click to choose another model")
        self.composer.set_model_ready(True)
        self.status_label.setText(f"{format_parameters(model.parameters)} parameters · {context} context")
        self.composer.input.setFocus()

    def _on_busy(self, busy: bool, what: str) -> None:
        self.composer.set_busy(busy and what in ("thinking", "reading"))
        self.messages.set_busy(busy)
        self.regenerate_action.setEnabled(not busy)
        if busy:
            self.status_label.setText(BUSY_TEXT.get(what, "Working…"))
        else:
            self.progress.setVisible(False)
            model = self.controller.model
            if model:
                self._on_model_changed(model)

    def _on_conversations(self, conversations: list[Any]) -> None:
        self.conversation_list.set_conversations(conversations)
        self.conversation_list.select(self.controller.conversation_id)
        if self.controller.conversation_id is not None:
            meta = next((m for m in conversations if m.id == self.controller.conversation_id), None)
            if meta is not None:
                self.title_label.setText(meta.title)

    def _on_conversation_opened(self, opened: OpenedConversation) -> None:
        self.title_label.setText(opened.title)
        self.messages.clear()
        for entry in opened.entries:
            self.messages.add_message(entry.role, entry.text, entry.documents, entry.caption)
        self.conversation_list.select(opened.id)
        self.chips.setVisible(False)

    def _on_entry_added(self, entry: ChatEntry) -> None:
        self.messages.add_message(entry.role, entry.text, entry.documents, entry.caption)

    def _on_reply_finished(self, entry: ChatEntry) -> None:
        self.messages.stream_text(entry.text)
        self.messages.flush()
        if self.messages.bubbles:
            self.messages.bubbles[-1].set_caption(entry.caption)

    def _on_calibration_progress(self, message: str, fraction: float) -> None:
        """A level with per-layer bits measuring this model's layers (once per model; minutes on a small CPU)."""
        self.progress.setVisible(True)
        self.progress.setRange(0, 100)
        self.progress.setValue(max(0, min(100, round(fraction * 100))))
        # short: the status line sits beside the title (a long text is cut off before the count)
        self.status_label.setText(f"Calibrating for this model: {message}")

    def _on_prefill_progress(self, done: int, total: int) -> None:
        if total >= PROGRESS_MIN_TOKENS and done < total:
            self.progress.setVisible(True)
            self.progress.setRange(0, total)
            self.progress.setValue(done)
            self.status_label.setText(f"Reading the prompt: {done:,} of {total:,} tokens")
        else:
            self.progress.setVisible(False)
            if done >= total and self.controller.busy:
                self.status_label.setText("Writing…")

    def _on_pending_documents(self, documents: list[PendingDocument]) -> None:
        while self.chips_layout.count():
            item = self.chips_layout.takeAt(0)
            if item.widget():
                item.widget().hide()
                item.widget().deleteLater()
        self.pending_names = [d.name for d in documents]
        if not documents:
            self.chips.setVisible(False)
            return
        caption = QLabel("Attached to your next message:")
        caption.setObjectName("caption")
        self.chips_layout.addWidget(caption)
        for document in documents:
            chip = document_chip(f"{document.name} · {document.tokens:,} tokens read", colors())
            self.chips_layout.addWidget(chip)
        self.chips_layout.addStretch(1)
        self.chips.setVisible(True)

    def _on_compression_changed(self, report: CompressionReport) -> None:
        self.compression.show_report(report)
        if report.available or self.controller.model is None:
            self.compression.set_current(report.key, report.override)
            self._check_compression_action(report.key)
        else:
            self.compression.set_current(self.controller.level_key, self.controller.method)
            self._check_compression_action(self.controller.level_key)

    def _check_compression_action(self, key: str) -> None:
        for action in self.compression_actions.actions():
            action.setChecked(action.data() == key)

    # ----- documents ---------------------------------------------------------------------------------------------
    def choose_document(self) -> None:
        path, _filter = QFileDialog.getOpenFileName(self, "Attach a Document", str(Path.home()), DOCUMENT_FILTER)
        if path:
            self.attach_paths([path])

    def attach_paths(self, paths: list[str]) -> None:
        """Inspect documents one after another (each gets its own fit dialog)."""
        self._queued_documents.extend(paths)
        if self.document_dialog is None or not self.document_dialog.isVisible():
            self._next_queued_document()

    def _next_queued_document(self) -> None:
        if self._queued_documents:
            self.controller.attach_document(self._queued_documents.pop(0))

    def _on_document_inspected(self, report: DocumentInspection) -> None:
        dialog = DocumentDialog(report, self)
        dialog.ingestRequested.connect(self._ingest)
        dialog.stopRequested.connect(self.controller.stop)
        dialog.discarded.connect(self.controller.discard_document)
        dialog.finished.connect(lambda _result: self._next_queued_document())
        self.document_dialog = dialog
        dialog.show()
        dialog.raise_()

    def _ingest(self, doc_id: int, choice: IngestChoice) -> None:
        if not self.controller.ingest_document(doc_id, choice) and self.document_dialog is not None:
            self.document_dialog.finish(IngestResult(doc_id, "", cancelled=True,
                                                     message="Velox is busy; try again in a moment."))

    def _on_ingest_progress(self, done: int, total: int) -> None:
        if self.document_dialog is not None:
            self.document_dialog.set_progress(done, total)

    def _on_document_ingested(self, report: IngestResult) -> None:
        if self.document_dialog is not None:
            self.document_dialog.finish(report)

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        urls = event.mimeData().urls() if event.mimeData().hasUrls() else []
        if any(url.isLocalFile() and url.toLocalFile().lower().endswith(DOCUMENT_SUFFIXES) for url in urls):
            event.acceptProposedAction()
        else:
            event.ignore()

    def dropEvent(self, event: QDropEvent) -> None:
        paths = [url.toLocalFile() for url in event.mimeData().urls() if url.isLocalFile()]
        if paths:
            event.acceptProposedAction()
            self.attach_paths(paths)

    # ----- overflow ---------------------------------------------------------------------------------------------
    def ask_overflow(self, info: Overflow) -> None:
        """Never silent: the user picks how the conversation is made to fit, or gives up."""
        question = overflow_question(info)
        box = QMessageBox(self)
        box.setIcon(QMessageBox.Icon.Warning)
        box.setWindowTitle("The conversation is too long")
        box.setText(question.text)
        box.setInformativeText(question.detail)
        buttons = {box.addButton(label, QMessageBox.ButtonRole.AcceptRole): policy
                   for policy, label in question.choices}
        cancel = box.addButton("Cancel" if buttons else "OK", QMessageBox.ButtonRole.RejectRole)
        box.setDefaultButton(cancel)

        def answered(button: Any) -> None:
            policy = buttons.get(button)
            self.overflow_box = None
            if policy is None:
                self.composer.input.setPlainText(info.text)
            self.controller.resolve_overflow(info, policy)

        box.buttonClicked.connect(answered)
        self.overflow_box = box
        box.open()

    # ----- model picker --------------------------------------------------------------------------------------------
    def open_model_picker(self) -> None:
        models = self.controller.list_models()
        current = self.controller.model.path if self.controller.model else ""
        picker = ModelPickerDialog(models, current, self)
        picker.loadRequested.connect(self.controller.load_model)
        picker.downloadRequested.connect(self.controller.download_model)
        picker.downloadCancelled.connect(self.controller.cancel_download)
        self.model_picker = picker
        picker.open()

    def _on_download_progress(self, message: str, fraction: float) -> None:
        if self.model_picker is not None:
            self.model_picker.set_download_progress(message, fraction)

    def _on_download_failed(self, message: str) -> None:
        if self.model_picker is not None and self.model_picker.isVisible():
            self.model_picker.download_failed(message)
        else:
            self.banner.show_message(message, "error")

    def _on_download_finished(self, folder: str) -> None:
        if self.model_picker is not None:
            self.model_picker.download_finished(folder)

    def restyle(self) -> None:
        """Redraw with the current palette (the system switched between light and dark)."""
        self.messages.clear()
        for entry in self.controller.entries:
            self.messages.add_message(entry.role, entry.text, entry.documents, entry.caption)
        self.composer.set_busy(self.composer.busy)
        self.update()

    # ----- small actions ----------------------------------------------------------------------------------------
    def copy_text(self, text: str) -> None:
        QGuiApplication.clipboard().setText(text)
        self.banner.show_message("Copied to the clipboard.", "notice")

    def copy_last_reply(self) -> None:
        replies = [entry for entry in self.controller.entries if entry.role == "assistant"]
        if replies:
            self.copy_text(replies[-1].text)

    def toggle_sidebar(self) -> None:
        self.sidebar.setVisible(not self.sidebar.isVisible())
        self.sidebar_action.setChecked(self.sidebar.isVisible())

    def toggle_inspector(self) -> None:
        self.inspector.setVisible(not self.inspector.isVisible())
        self.inspector_action.setChecked(self.inspector.isVisible())

    def quit_app(self) -> None:
        self.quit_on_close = True
        self.close()
        app = QGuiApplication.instance()
        if app is not None:
            app.quit()

    def closeEvent(self, event: QCloseEvent) -> None:
        self.controller.settings.window_geometry = bytes(self.saveGeometry().data())
        self.controller.save_settings()
        if not self.quit_on_close:
            # With a tray icon the app keeps running; the window comes back from the tray.
            event.ignore()
            self.hide()
            return
        self.closed.emit()
        super().closeEvent(event)
