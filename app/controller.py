"""The app's logic, without widgets: what the chat window and the tray show, and what they can ask for.

`ChatController` sits between the views and the engine worker. It keeps the visible conversation (a list of
plain `ChatEntry` records), saves every message to the ConversationStore as it completes, remembers the
settings, polls memory once a second, and turns the worker's signals into view-ready ones. It never touches
MLX: model work goes to `app.worker.EngineWorker` on its thread; the memory poll reads counters only.
Tests drive it directly (send, stop, attach, switch compression) without creating a window.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from app.payloads import (
    CompressionReport,
    GenerationOptions,
    IngestChoice,
    IngestResult,
    LevelAdvice,
    LevelSummary,
    MemoryReading,
    ModelSummary,
    Overflow,
    PendingDocument,
    SavedCacheStatus,
    TurnResult,
    stats_from_record,
)
from app.settings import AUTO_COMPRESSION, Settings, load_settings, save_settings
from app.store import ConversationStore, StoreError, conversation_title, saved_caches_folder
from app.worker import EngineThread
from engine.chat.saved_cache import CacheFolder
from engine.chat.session import GenerationStats
from engine.models.catalog import list_models
from engine.planning.memory import snapshot
from engine.planning.recommend import LEVELS
from engine.planning.units import format_bytes

MEMORY_POLL_MS = 1000
# A streaming reply is written to the database at most this often (a transaction without fsync, on the GUI
# thread), so a crash of the app loses at most this much of what was shown.
PARTIAL_SAVE_INTERVAL_S = 1.0
# The overflow dialog's button for each policy the engine can apply.
OVERFLOW_CHOICE_LABELS = {
    "drop-oldest": "Drop the oldest turns",
    "truncate-middle": "Leave out the middle of the document",
}


@dataclass
class ChatEntry:
    """One message as the window shows it."""

    role: str
    text: str
    documents: list[str] = field(default_factory=list)
    caption: str = ""
    cancelled: bool = False
    stats: GenerationStats | None = None


@dataclass(frozen=True)
class OpenedConversation:
    """The conversation the window shows now (id None: a new chat, not saved yet)."""

    id: int | None
    title: str
    entries: tuple[ChatEntry, ...]


@dataclass
class TurnInFlight:
    """The question being answered: what to save, and what to put back if the engine refuses it."""

    text: str
    regenerate: bool
    user_saved: bool
    documents: list[str]
    replaced: ChatEntry | None = None  # the reply a regeneration replaces
    partial_save_failed: bool = False  # saving the streaming reply failed once: reported once, not retried


def reply_caption(stats: GenerationStats | None, cancelled: bool = False, interrupted: bool = False) -> str:
    """'42 tokens · 31.5 tok/s · first token 0.42 s' (and '· stopped' when the user stopped it);
    'interrupted' for a reply cut off by a crash (saved while it streamed, never finished)."""
    if interrupted:
        return "interrupted"
    if stats is None:
        return "stopped" if cancelled else ""
    parts = [f"{stats.generated_tokens} tokens"]
    if stats.decode_tokens_per_second:
        parts.append(f"{stats.decode_tokens_per_second:.1f} tok/s")
    if stats.time_to_first_token:
        parts.append(f"first token {stats.time_to_first_token:.2f} s")
    if cancelled or stats.finish_reason == "cancelled":
        parts.append("stopped")
    return " · ".join(parts)


@dataclass(frozen=True)
class OverflowQuestion:
    """What the overflow dialog says, and the choices it offers: only policies that make the message fit.
    No choices: it says plainly that the message does not fit, and offers none."""

    text: str
    detail: str
    choices: tuple[tuple[str, str], ...]  # (policy, button label)


def overflow_question(info: Overflow) -> OverflowQuestion:
    """The overflow dialog's content for `info` (the widget only shows it)."""
    # The engine's sentence up to "it overflows by N tokens."; the choices replace its advice.
    facts = re.match(r".*?overflows by \d+ tokens\.", info.message)
    facts_text = facts.group(0) if facts else info.message
    choices = tuple((policy, OVERFLOW_CHOICE_LABELS[policy]) for policy in info.remedies
                    if policy in OVERFLOW_CHOICE_LABELS)
    if choices:
        return OverflowQuestion("This message does not fit in the model's context.",
                                f"{facts_text}\n\nHow should Velox make it fit?", choices)
    if info.has_documents:
        advice = ("Neither dropping the oldest turns nor leaving out the middle of the document makes it fit. "
                  "Start a new chat, or shorten the message or the document.")
    else:
        advice = ("Even on its own this message is too long for the model's context, so there is nothing "
                  "Velox can leave out. Shorten the message.")
    return OverflowQuestion("This message does not fit in the model's context.", f"{facts_text}\n\n{advice}", ())


class ChatController(QObject):
    """State and actions of the chat app. Create it, connect a view, then call `start()`."""

    # model
    modelChanged = Signal(object)  # ModelSummary
    modelProgress = Signal(str, float)
    modelFailed = Signal(str)
    busyChanged = Signal(bool, str)
    # conversation
    conversationsChanged = Signal(object)  # list[ConversationMeta]
    conversationOpened = Signal(object)  # OpenedConversation
    entryAdded = Signal(object)  # ChatEntry
    lastEntryRemoved = Signal()
    replyStreaming = Signal(str)  # the reply so far
    replyFinished = Signal(object)  # the final ChatEntry of the reply
    calibrationProgress = Signal(str, float)  # the worker's: a wide level calibrating its layers, once
    prefillProgress = Signal(int, int)
    overflowChoiceNeeded = Signal(object)  # Overflow
    # messages for the user
    errorRaised = Signal(str)
    noticeRaised = Signal(str)
    # documents
    documentInspected = Signal(object)  # DocumentInspection
    documentFailed = Signal(str, str)
    ingestProgress = Signal(int, int)
    documentIngested = Signal(object)  # IngestResult
    pendingDocumentsChanged = Signal(object)  # list[PendingDocument]
    # compression and memory
    compressionChanged = Signal(object)  # CompressionReport
    recommendationChanged = Signal(object)  # LevelAdvice or None
    memoryUpdated = Signal(object)  # MemoryReading
    throughputSample = Signal(str, float)
    statsChanged = Signal(object)  # the last reply's GenerationStats
    savedCacheChanged = Signal(object)  # SavedCacheStatus: a conversation's cache saved, reused or refused
    # downloads
    downloadProgress = Signal(str, float)
    downloadFinished = Signal(str)
    downloadFailed = Signal(str)

    def __init__(self, store: ConversationStore, settings: Settings | None = None,
                 settings_file: str | Path | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.settings_file = Path(settings_file) if settings_file else None
        self.settings = settings if settings is not None else load_settings(self.settings_file)
        self.engine = EngineThread(self)
        # Conversations' KV caches live beside the database; the worker writes and reads them, this side
        # only lists their sizes (for the panel) and deletes a deleted conversation's.
        self.saved_caches = CacheFolder(saved_caches_folder(store.path), self.settings.saved_cache_budget_bytes)
        self.last_saved_cache: SavedCacheStatus | None = None
        self.entries: list[ChatEntry] = []
        self.conversation_id: int | None = None
        self.model: ModelSummary | None = None
        self.busy = False
        self.busy_what = ""
        self.pending_documents: list[PendingDocument] = []
        self.level_key = self.settings.compression if self.settings.compression != AUTO_COMPRESSION else "16"
        self.method: str | None = self.settings.method_override
        self.recommendation: LevelAdvice | None = None
        self.kv_held = 0
        self.kv_fp16 = 0
        self.last_stats: GenerationStats | None = None
        self.last_memory: MemoryReading | None = None
        self._levels: list[LevelSummary] | None = None
        self._pending_document_objects: list[Any] = []  # engine Documents attached to the next question
        self._streaming = ""
        self._turn: TurnInFlight | None = None
        self._reply_message_id: int | None = None  # the streaming reply's row, once its first text is saved
        self._last_partial_save = 0.0
        self._shut_down = False
        self._connect_worker()
        self._memory_timer = QTimer(self)
        self._memory_timer.setInterval(MEMORY_POLL_MS)
        self._memory_timer.timeout.connect(self.refresh_memory)

    def _connect_worker(self) -> None:
        w = self.engine.worker
        w.modelLoadProgress.connect(self.modelProgress.emit)
        w.modelLoaded.connect(self._on_model_loaded)
        w.modelLoadFailed.connect(self._on_model_failed)
        w.recommendation.connect(self._on_recommendation)
        w.busyChanged.connect(self._on_busy)
        w.prefillProgress.connect(self._on_prefill_progress)
        w.calibrationProgress.connect(self.calibrationProgress.emit)
        w.textChunk.connect(self._on_text_chunk)
        w.notice.connect(self.noticeRaised.emit)
        w.throughput.connect(self.throughputSample.emit)
        w.turnFinished.connect(self._on_turn_finished)
        w.turnFailed.connect(self._on_turn_failed)
        w.overflow.connect(self._on_overflow)
        w.documentInspected.connect(self.documentInspected.emit)
        w.documentFailed.connect(self._on_document_failed)
        w.ingestProgress.connect(self.ingestProgress.emit)
        w.documentIngested.connect(self._on_document_ingested)
        w.compressionChanged.connect(self._on_compression_changed)
        w.kvBytes.connect(self._on_kv_bytes)
        w.savedCache.connect(self._on_saved_cache)
        d = self.engine.downloader
        d.progress.connect(self.downloadProgress.emit)
        d.finished.connect(self._on_download_finished)
        d.failed.connect(self.downloadFailed.emit)

    # ----- life cycle ---------------------------------------------------------------------------------------
    def start(self, model: str | None = None, loaded: tuple[Any, Any, Any] | None = None) -> None:
        """Load the model (or adopt an already loaded one), reopen the last conversation, start polling."""
        try:
            # Replies still 'streaming' belong to an app that died mid-reply: their text is kept, marked.
            if self.store.mark_interrupted_replies():
                self.noticeRaised.emit("Velox stopped during a reply last time; what it had written is kept, "
                                       "marked as interrupted.")
        except StoreError as error:
            self.errorRaised.emit(str(error))
        self.refresh_conversations()
        self.engine.requestConfigureSavedCaches.emit(str(self.saved_caches.folder), self.saved_caches.budget_bytes)
        conversations = self.store.list_conversations()
        if conversations:
            self.open_conversation(conversations[0].id, sync_worker=False)
        else:
            self.conversationOpened.emit(OpenedConversation(None, "New Chat", ()))
        self.engine.requestConfigure.emit(self.generation_options())
        if self.level_key != "16" or self.method:
            self.engine.requestSetCompression.emit(self.level_key, self.method)
        if loaded is not None:
            self.engine.requestAdoptModel.emit(loaded)
        else:
            self.load_model(model if model is not None else (self.settings.last_model or ""))
        self._memory_timer.start()
        self.refresh_memory()

    def shutdown(self) -> None:
        """Stop the worker (cancelling any reply) and save the settings. Safe to call twice."""
        if self._shut_down:
            return
        self._shut_down = True
        self._memory_timer.stop()
        self.engine.stop()
        self.save_settings()

    def save_settings(self) -> None:
        try:
            save_settings(self.settings, self.settings_file)
        except OSError as error:
            self.errorRaised.emit(f"The settings could not be saved: {error}")

    # ----- model --------------------------------------------------------------------------------------------
    def load_model(self, spec: str) -> None:
        self.engine.requestLoadModel.emit(spec)

    def list_models(self) -> list[Any]:
        """The engine's catalogue (reads only JSON headers: milliseconds, no MLX work)."""

        return list_models()

    def _on_model_loaded(self, summary: ModelSummary) -> None:
        self.model = summary
        self.settings.last_model = summary.path or summary.name
        self.modelChanged.emit(summary)
        if self.conversation_id is not None:
            # A newly loaded model starts a new session: give it the open conversation.
            self._sync_worker_history()
        self.save_settings()

    def _on_model_failed(self, message: str) -> None:
        self.modelFailed.emit(message)
        self.errorRaised.emit(message)

    def _on_recommendation(self, recommendation: LevelAdvice | None) -> None:
        self.recommendation = recommendation
        self.recommendationChanged.emit(recommendation)
        if (recommendation and recommendation.key and self.settings.compression == AUTO_COMPRESSION
                and recommendation.key != self.level_key):
            self.set_compression(recommendation.key, None, remember=False)

    def download_model(self, name: str) -> None:
        self.engine.requestDownload.emit(name)

    def cancel_download(self) -> None:
        self.engine.downloader.cancel()

    def _on_download_finished(self, folder: str) -> None:
        self.downloadFinished.emit(folder)
        self.load_model(folder)

    # ----- busy state -------------------------------------------------------------------------------------------
    def _on_busy(self, busy: bool, what: str) -> None:
        self.busy = busy
        self.busy_what = what
        self.busyChanged.emit(busy, what)

    def _claim(self, what: str) -> bool:
        """Mark the app busy before queueing a job, so a second click cannot queue a second one."""
        if self.busy:
            self.noticeRaised.emit("Velox is still busy; stop the current reply first.")
            return False
        if self.model is None:
            self.errorRaised.emit("The model is not loaded yet.")
            return False
        self.engine.begin_job()
        self._on_busy(True, what)
        return True

    # ----- conversation --------------------------------------------------------------------------------------------
    def refresh_conversations(self) -> None:
        try:
            self.conversationsChanged.emit(self.store.list_conversations())
        except StoreError as error:
            self.errorRaised.emit(str(error))

    def _conversation_locked(self, action: str) -> bool:
        """A reply or a document being read belongs to the open conversation: it cannot change under them."""
        if self.busy and (self._turn is not None or self.busy_what in ("thinking", "reading")):
            self.noticeRaised.emit(f"Stop the reply or the document being read before {action}.")
            return True
        return False

    def open_conversation(self, conversation_id: int, sync_worker: bool = True) -> None:
        if self._conversation_locked("switching conversations"):
            return
        try:
            meta, messages = self.store.load_conversation(conversation_id)
        except StoreError as error:
            self.errorRaised.emit(str(error))
            return
        self.conversation_id = meta.id
        self.entries = [
            ChatEntry(m.role, m.content, [d.name for d in m.documents],
                      reply_caption(stats_from_record(m.stats), m.cancelled, m.interrupted)
                      if m.role == "assistant" else "",
                      m.cancelled, stats_from_record(m.stats))
            for m in messages if m.role != "system"
        ]
        self.pending_documents = []
        self.pendingDocumentsChanged.emit([])
        self.conversationOpened.emit(OpenedConversation(meta.id, meta.title, tuple(self.entries)))
        if sync_worker:
            self._sync_worker_history()

    def _sync_worker_history(self) -> None:
        if self.conversation_id is None:
            self.engine.requestNewChat.emit()
            return
        _meta, messages = self.store.load_conversation(self.conversation_id)
        # The worker also takes over the conversation's saved cache, if there is a valid one.
        self.engine.requestOpenConversation.emit(self.conversation_id, ConversationStore.to_session_history(messages))

    def new_chat(self) -> None:
        if self._conversation_locked("starting a new chat"):
            return
        self.conversation_id = None
        self.entries = []
        self.pending_documents = []
        self.pendingDocumentsChanged.emit([])
        self.engine.requestNewChat.emit()
        self.conversationOpened.emit(OpenedConversation(None, "New Chat", ()))

    def delete_conversation(self, conversation_id: int) -> None:
        if conversation_id == self.conversation_id:
            if self._conversation_locked("deleting this conversation"):
                return
            self.new_chat()
        try:
            self.store.delete(conversation_id)
        except StoreError as error:
            self.errorRaised.emit(str(error))
            self.refresh_conversations()
            return
        # Its cache goes with it: now, and again on the worker after any save of it still queued there.
        try:
            self.saved_caches.delete(conversation_id)
        except OSError as error:
            self.errorRaised.emit(f"The conversation's saved cache could not be deleted: {error}")
        self.engine.requestForgetCache.emit(conversation_id)
        self.refresh_conversations()

    def generation_options(self, overflow_policy: str | None = None) -> GenerationOptions:
        return GenerationOptions(max_tokens=self.settings.max_tokens, temperature=self.settings.temperature,
                                 top_p=self.settings.top_p, overflow_policy=overflow_policy)

    def send(self, text: str, overflow_policy: str | None = None) -> bool:
        """Ask `text`; the reply streams through replyStreaming and ends with replyFinished."""
        text = text.strip()
        if not text or not self._claim("thinking"):
            return False
        documents = [doc.name for doc in self.pending_documents]
        self._turn = TurnInFlight(text, regenerate=False, user_saved=False, documents=documents)
        self._streaming = ""
        self._add_entry(ChatEntry("user", text, documents))
        self._add_entry(ChatEntry("assistant", ""))
        self.engine.requestSend.emit(text, self.generation_options(overflow_policy))
        return True

    def regenerate(self, overflow_policy: str | None = None) -> bool:
        if len(self.entries) < 2 or self.entries[-1].role != "assistant":
            self.noticeRaised.emit("There is no reply to regenerate.")
            return False
        if not self._claim("thinking"):
            return False
        old = self.entries.pop()
        self.lastEntryRemoved.emit()
        self._turn = TurnInFlight(self.entries[-1].text, regenerate=True, user_saved=True,
                                  documents=self.entries[-1].documents, replaced=old)
        self._streaming = ""
        self._add_entry(ChatEntry("assistant", ""))
        self.engine.requestRegenerate.emit(self.generation_options(overflow_policy))
        return True

    def stop(self) -> None:
        """Stop the reply or the document being read; what was produced so far is kept."""
        self.engine.cancel()

    def _add_entry(self, entry: ChatEntry) -> None:
        self.entries.append(entry)
        self.entryAdded.emit(entry)

    def _remove_last_entry(self) -> None:
        if self.entries:
            self.entries.pop()
            self.lastEntryRemoved.emit()

    def _on_prefill_progress(self, done: int, total: int) -> None:
        self._save_user_message()
        self.prefillProgress.emit(done, total)

    def _on_text_chunk(self, text: str) -> None:
        self._save_user_message()
        self._streaming += text
        if self.entries and self.entries[-1].role == "assistant":
            self.entries[-1].text = self._streaming
        self._save_partial_reply()
        self.replyStreaming.emit(self._streaming)

    def _save_partial_reply(self) -> None:
        """Write the reply so far: the row is created with the first text, then updated at most every
        PARTIAL_SAVE_INTERVAL_S; `_on_turn_finished` completes it. A regenerated reply replaces the old
        one in the database as soon as its first text exists."""
        turn = self._turn
        if turn is None or self.conversation_id is None or turn.partial_save_failed:
            return
        now = time.monotonic()
        try:
            if self._reply_message_id is None:
                if turn.regenerate:
                    position = self._last_assistant_position()
                    if position is not None:
                        self.store.delete_messages_from(self.conversation_id, position)
                self._reply_message_id = self.store.append_message(
                    self.conversation_id, "assistant", self._streaming, compression=self.compression_label(),
                    state="streaming", durable=False,
                )
            elif now - self._last_partial_save >= PARTIAL_SAVE_INTERVAL_S:
                self.store.update_message(self._reply_message_id, content=self._streaming, durable=False)
            else:
                return
        except StoreError as error:
            turn.partial_save_failed = True  # one message per reply, not one per token
            self.errorRaised.emit(f"The reply could not be saved as it streams: {error}")
            return
        self._last_partial_save = now

    def _save_user_message(self) -> None:
        """The question is written once the engine has accepted it (it fits the context)."""
        turn = self._turn
        if turn is None or turn.user_saved:
            return
        turn.user_saved = True
        session_documents = self._pending_document_objects
        try:
            if self.conversation_id is None:
                self.conversation_id = self.store.create_conversation(
                    conversation_title(turn.text), model=self.model.name if self.model else "",
                    compression=self.compression_label(),
                )
            self.store.append_message(self.conversation_id, "user", turn.text, documents=session_documents,
                                      compression=self.compression_label())
        except StoreError as error:
            self.errorRaised.emit(f"The message could not be saved: {error}")
        self.pending_documents = []
        self._pending_document_objects = []
        self.pendingDocumentsChanged.emit([])
        self.refresh_conversations()

    def _on_turn_finished(self, result: TurnResult) -> None:
        regenerated = self._turn.regenerate if self._turn is not None else result.regenerated
        self._save_user_message()
        self._turn = None
        stats = result.stats
        cancelled = result.cancelled
        entry = self.entries[-1] if self.entries and self.entries[-1].role == "assistant" else ChatEntry("assistant", "")
        entry.text = result.text
        entry.cancelled = cancelled
        entry.stats = stats
        entry.caption = reply_caption(stats, cancelled)
        if stats is not None:
            self.last_stats = stats
            self.statsChanged.emit(stats)
        reply_id, self._reply_message_id = self._reply_message_id, None
        persisted = False
        try:
            if reply_id is not None:  # saved while streaming: complete that row
                self.store.update_message(reply_id, content=entry.text, cancelled=cancelled, stats=stats,
                                          compression=self.compression_label(), state="complete")
            elif self.conversation_id is not None:
                if regenerated:
                    position = self._last_assistant_position()
                    if position is not None:
                        self.store.delete_messages_from(self.conversation_id, position)
                self.store.append_message(self.conversation_id, "assistant", entry.text, cancelled=cancelled,
                                          stats=stats, compression=self.compression_label())
            persisted = self.conversation_id is not None
        except StoreError as error:
            self.errorRaised.emit(f"The reply could not be saved: {error}")
        if persisted:
            # The reply is on disk: now its cache (written on the worker thread, which checks that the
            # session is consistent; a stopped reply's cache holds exactly the tokens it kept).
            self.engine.requestSaveCache.emit(self.conversation_id)
        self.replyFinished.emit(entry)
        self.refresh_conversations()

    def _last_assistant_position(self) -> int | None:
        _meta, messages = self.store.load_conversation(self.conversation_id)
        if messages and messages[-1].role == "assistant":
            return messages[-1].position
        return None

    def _undo_turn_entries(self) -> TurnInFlight | None:
        turn, self._turn = self._turn, None
        if turn is None:
            return None
        self._forget_partial_reply(turn)
        self._remove_last_entry()  # the reply placeholder
        if turn.replaced is not None:
            self._add_entry(turn.replaced)  # the reply that was to be replaced comes back
        elif not turn.user_saved:
            self._remove_last_entry()  # the question, never accepted
        return turn

    def _forget_partial_reply(self, turn: TurnInFlight) -> None:
        """A turn that failed after its first text was saved: the database goes back to what the view shows
        again (no partial reply; a regenerated reply's predecessor restored)."""
        reply_id, self._reply_message_id = self._reply_message_id, None
        if reply_id is None or self.conversation_id is None:
            return
        try:
            position = self._last_assistant_position()
            if position is not None:
                self.store.delete_messages_from(self.conversation_id, position)
            old = turn.replaced
            if turn.regenerate and old is not None:
                self.store.append_message(self.conversation_id, "assistant", old.text, cancelled=old.cancelled,
                                          stats=old.stats, compression=self.compression_label())
        except StoreError as error:
            self.errorRaised.emit(f"The conversation could not be updated: {error}")

    def _on_turn_failed(self, message: str) -> None:
        self._undo_turn_entries()
        self.errorRaised.emit(message)

    def _on_overflow(self, info: Overflow) -> None:
        turn = self._undo_turn_entries()
        if turn is not None:
            info = replace(info, text=turn.text, regenerate=turn.regenerate)
        self.overflowChoiceNeeded.emit(info)

    def resolve_overflow(self, info: Overflow, policy: str | None) -> None:
        """The user's answer to an overflow: one of `info.remedies`, or None to give up."""
        if policy is None:
            self.noticeRaised.emit("Nothing was sent: the conversation does not fit in the model's context.")
            return
        if policy not in info.remedies:
            self.noticeRaised.emit(f"Nothing was sent: '{policy}' cannot make this conversation fit.")
            return
        if info.regenerate:
            self.regenerate(overflow_policy=policy)
        else:
            self.send(info.text, overflow_policy=policy)

    # ----- documents -----------------------------------------------------------------------------------------------
    def attach_document(self, path: str) -> None:
        """Read a document and report its size and fit verdicts (documentInspected); nothing is attached yet."""
        if self.model is None:
            self.errorRaised.emit("Load a model before attaching a document.")
            return
        self.engine.requestInspectDocument.emit(str(path))

    def _on_document_failed(self, path: str, message: str) -> None:
        self.documentFailed.emit(path, message)
        self.errorRaised.emit(message)

    def ingest_document(self, doc_id: int, choice: IngestChoice) -> bool:
        """Attach an inspected document and read it now, as the user chose in the document dialog."""
        if not self._claim("reading"):
            return False
        if choice.level and choice.level != self.level_key:
            # The level picked for the document becomes the remembered one, like a slider move.
            self.settings.compression = choice.level
            self.settings.method_override = choice.method
            self.save_settings()
        self.engine.requestIngestDocument.emit(doc_id, choice)
        return True

    def discard_document(self, doc_id: int) -> None:
        self.engine.requestDiscardDocument.emit(doc_id)

    def _on_document_ingested(self, report: IngestResult) -> None:
        if report.cancelled:
            if report.failed:
                self.errorRaised.emit(report.message)
            elif report.message:
                self.noticeRaised.emit(report.message)
        else:
            self.pending_documents.append(PendingDocument(report.name, report.tokens))
            self._pending_document_objects.append(report.document)
            self.pendingDocumentsChanged.emit(list(self.pending_documents))
        self.documentIngested.emit(report)

    # ----- compression ----------------------------------------------------------------------------------------------
    def levels(self) -> list[LevelSummary]:
        """The engine's compression levels (16/8/4/3/2 bits), highest precision first: the slider's order."""
        if self._levels is None:

            self._levels = [LevelSummary.from_level(level) for level in LEVELS]
        return list(self._levels)

    def compression_label(self) -> str:
        level = next((level for level in self.levels() if level.key == self.level_key), None)
        label = level.label if level else f"{self.level_key}-bit"
        method = self.method or (level.method if level else "")
        return f"{label} ({method})" if method and self.level_key != "16" else label

    def set_compression(self, level_key: str, method: str | None = None, remember: bool = True) -> None:
        """Switch the KV cache to `level_key` (optionally with another method) live, keeping the conversation."""
        if remember:
            self.settings.compression = level_key
            self.settings.method_override = method
            self.save_settings()
        self.engine.requestSetCompression.emit(level_key, method)

    def _on_compression_changed(self, report: CompressionReport) -> None:
        if report.available or self.model is None:
            self.level_key = report.key
            self.method = report.override
            if self.conversation_id is not None:
                try:
                    self.store.set_conversation_settings(self.conversation_id, compression=self.compression_label())
                except StoreError:
                    pass
        self.compressionChanged.emit(report)

    # ----- saved caches ----------------------------------------------------------------------------------------------
    def set_saved_cache_budget(self, budget_bytes: int) -> None:
        """The disk budget for conversations' saved caches (0: keep none); older ones are evicted to fit."""
        budget = max(int(budget_bytes), 0)
        self.settings.saved_cache_budget_bytes = budget
        self.saved_caches.budget_bytes = budget
        self.save_settings()
        self.engine.requestConfigureSavedCaches.emit(str(self.saved_caches.folder), budget)

    def saved_cache_bytes(self) -> tuple[int, int, int]:
        """(this conversation's saved cache, all saved caches, the budget) in bytes on disk: file sizes
        only (a few stat calls), never MLX work."""
        try:
            files = self.saved_caches.files()
            total = sum(path.stat().st_size for path in files)
            mine = self.saved_caches.path_for(self.conversation_id) if self.conversation_id is not None else None
            own = mine.stat().st_size if mine is not None and mine in files else 0
        except OSError:  # a file evicted between listing and reading: the next poll is right again
            return 0, 0, self.saved_caches.budget_bytes
        return own, total, self.saved_caches.budget_bytes

    def _on_saved_cache(self, status: SavedCacheStatus) -> None:
        self.last_saved_cache = status
        if status.action == "not-saved" and status.message:
            self.noticeRaised.emit(f"This conversation's cache was not saved: {status.message}")
        self.savedCacheChanged.emit(status)

    # ----- memory ----------------------------------------------------------------------------------------------------
    def _on_kv_bytes(self, held: int, fp16: int) -> None:
        self.kv_held, self.kv_fp16 = held, fp16

    def refresh_memory(self) -> MemoryReading:
        """Read system, process and MLX memory (cheap counters, no MLX work) and publish them."""

        started = time.perf_counter()
        snap = snapshot(None)
        reading = MemoryReading.from_snapshot(snap, self.kv_held, self.kv_fp16, time.perf_counter() - started,
                                              self.saved_cache_bytes())
        self.last_memory = reading
        self.memoryUpdated.emit(reading)
        return reading

    def memory_line(self) -> str:
        """One line for the tray menu: free RAM and the cache held."""

        if not self.last_memory:
            return "Memory: reading…"
        m = self.last_memory
        return (f"{format_bytes(m.system_available)} free · KV cache {format_bytes(m.kv_held)}"
                f" ({self.compression_label()})")
