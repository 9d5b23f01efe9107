"""The engine worker: the one thread that does all MLX work for the desktop app.

`EngineWorker` is a QObject moved to its own QThread. The GUI asks it for work through queued signals
(`EngineThread` wires them) and hears back through signals that carry the frozen records of `app.payloads`
(and plain str/int/float), so no widget ever touches a model, a tokenizer or an mx.array. Jobs run one at a
time in arrival order, each inside `_job`, which marks the worker busy and, whatever happens, idle again;
`cancel()` is the one method the GUI calls directly: it only sets thread-safe flags that the running job
polls between steps.

MLX is reached only through `engine` (no `import mlx` here). A separate `DownloadWorker` thread runs
`engine.models.hub.download_model`: a download is network work, not MLX work, and must not hold up the chat
for minutes.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.logs import unexpected_error_line
from app.payloads import (
    CompressionReport,
    DocumentInspection,
    GenerationOptions,
    IngestChoice,
    IngestResult,
    LevelAdvice,
    LevelVerdict,
    ModelSummary,
    Overflow,
    SavedCacheStatus,
    TurnResult,
)
from engine.chat.documents import count_tokens, load_document
from engine.chat.reply_check import degenerate_reply
from engine.chat.saved_cache import CacheFolder, SavedCacheError, restore_session_cache, save_session_cache
from engine.chat.session import (
    ChatSession,
    GenerationSettings,
    GenerationStats,
    Message,
    Notice,
    PrefillProgress,
    TextChunk,
)
from engine.errors import (
    CancelledError,
    ConfigError,
    ContextOverflowError,
    MemoryBudgetError,
    ModelError,
    VeloxError,
)
from engine.models.catalog import load_model, resolve_model
from engine.models.hub import DownloadProgress, download_model, hub_endpoint, normalize_repo_id
from engine.planning.memory import system_memory
from engine.planning.recommend import (
    DEFAULT_PREFILL_CHUNK,
    cache_bytes,
    check_fits,
    check_switch_fits,
    fit_verdicts,
    level_by_key,
    prefill_chunk_for,
    recommend,
)
from engine.planning.units import format_bytes
from engine.runtime.status import gpu_kernels_off, on_gpu

# How often the worker reports live numbers while it runs a job: often enough for a smooth plot and gauges,
# rarely enough that signals never flood the GUI's event queue.
THROUGHPUT_INTERVAL_S = 0.25
KV_BYTES_INTERVAL_S = 1.0
# The GIL switch interval while the worker runs. Python's default (5 ms) lets a busy worker thread keep the
# GIL for a whole interval at a time, and on a loaded machine the hand-over convoys into 100-400 ms GUI
# stalls; 1 ms keeps the event loop's worst gap around 50 ms (measured on 2 busy cores), at a negligible
# cost to the worker, whose heavy lifting happens in MLX with the GIL released.
GIL_SWITCH_INTERVAL_S = 0.001

logger = logging.getLogger(__name__)


def _unexpected(failure: str, error: BaseException) -> str:
    """The traceback goes to the log file; the person reads `failure` and one line that says where it is."""
    logger.error("%s", failure, exc_info=error)
    return f"{failure}. {unexpected_error_line(error)}"


def _level_or_none(key: str) -> Any | None:

    try:
        return level_by_key(str(key))
    except ConfigError:
        return None


class EngineWorker(QObject):
    """Owns the model, the tokenizer and the ChatSession; every public slot runs on the worker thread."""

    # model
    modelLoadProgress = Signal(str, float)
    modelLoaded = Signal(object)  # ModelSummary
    modelLoadFailed = Signal(str)
    recommendation = Signal(object)  # LevelAdvice or None
    # a turn
    busyChanged = Signal(bool, str)  # busy, what ('loading', 'thinking', 'reading', 'compressing', 'reopening', '')
    turnStarted = Signal(str)  # 'send' | 'regenerate'
    prefillProgress = Signal(int, int)
    textChunk = Signal(str)
    notice = Signal(str)
    throughput = Signal(str, float)  # phase ('prefill' | 'decode'), tokens per second
    turnFinished = Signal(object)  # TurnResult
    turnFailed = Signal(str)
    overflow = Signal(object)  # Overflow
    # documents
    documentInspected = Signal(object)  # DocumentInspection
    documentFailed = Signal(str, str)  # path, message
    ingestProgress = Signal(int, int)
    documentIngested = Signal(object)  # IngestResult
    # compression and memory
    compressionChanged = Signal(object)  # CompressionReport
    calibrationProgress = Signal(str, float)  # a wide level's one-time layer calibration: message, fraction
    kvBytes = Signal(int, int)  # bytes held now, bytes a 16-bit cache would need for the same tokens
    historySet = Signal(int)  # number of messages now in the session
    savedCache = Signal(object)  # SavedCacheStatus

    def __init__(self) -> None:
        super().__init__()
        self.stop_event = threading.Event()
        self.session: Any = None
        self.info: Any = None
        self._model: Any = None
        self._tokenizer: Any = None
        self._level_key = "16"
        self._method_override: str | None = None
        self._overflow_policy: str | None = None
        self._kernels_off_reported = False  # said once a session (_report_gpu_kernels_off)
        self._inspected: dict[int, Any] = {}
        self._next_doc_id = 1
        self._defaults: GenerationOptions | None = None
        self._last_kv_emit = 0.0
        self._saved_caches: CacheFolder | None = None  # where conversations' caches are kept (None: nowhere)

    # ----- called from the GUI thread ---------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the running job (a reply, a document being read). Thread-safe; a no-op when idle."""
        self.stop_event.set()
        session = self.session
        if session is not None:
            session.cancel()

    # ----- the frame of every job ---------------------------------------------------------------------
    @contextmanager
    def _job(self, what: str, report: Callable[[str], None] | None = None, failure: str = "") -> Iterator[None]:
        """Busy for the duration of one job, and idle again on every path out of it (the GUI marked itself
        busy when it asked). With `report`, an error inside the job is not raised but reported in one line:
        a VeloxError's own sentence, or for a surprise `failure` and where its logged traceback is (a failure
        inside MLX must not kill the worker thread). Nothing may follow the `with` block in the job: after a reported
        error, execution continues there."""
        self.busyChanged.emit(True, what)
        try:
            yield
        except VeloxError as error:
            if report is None:
                raise
            report(str(error))
        except Exception as error:
            if report is None:
                raise
            report(_unexpected(failure, error))
        finally:
            self._report_gpu_kernels_off()
            self.busyChanged.emit(False, "")

    def _report_gpu_kernels_off(self) -> None:
        """Say once, after the job that found it, that the GPU kernels failed their first run here and were turned
        off: replies stay what they were, decoding is slower (the log has the details)."""
        reason = gpu_kernels_off()
        if reason is not None and not self._kernels_off_reported:
            self._kernels_off_reported = True
            self.notice.emit("Velox's GPU kernels could not be used on this machine's GPU and were turned off for this "
                             f"session: replies are the same, decoding is slower. ({reason})")

    # ----- model ----------------------------------------------------------------------------------------
    @Slot(str)
    def load_model(self, spec: str) -> None:
        """Load a model (a folder, 'org/name' in the HF cache, or '' for the embedded default)."""

        def progress(message: str, fraction: float) -> None:
            self.modelLoadProgress.emit(message, float(fraction))

        with self._job("loading", self.modelLoadFailed.emit, "The model could not be loaded"):
            path = resolve_model(spec or None, progress=progress)
            model, tokenizer, info = load_model(path, progress=progress)
            self._install_model(model, tokenizer, info)

    @Slot(object)
    def adopt_model(self, loaded: tuple[Any, Any, Any]) -> None:
        """Use an already loaded (model, tokenizer, info): the tests share one model across windows."""
        model, tokenizer, info = loaded
        self._install_model(model, tokenizer, info)

    def _install_model(self, model: Any, tokenizer: Any, info: Any) -> None:

        self._model, self._tokenizer, self.info = model, tokenizer, info
        self.session = ChatSession(model, tokenizer, context_length=info.max_context or None,
                                   settings=self._session_settings(self._defaults or GenerationOptions()))
        self._inspected.clear()
        self._overflow_policy = None
        self.modelLoaded.emit(ModelSummary.from_info(info))
        if self._level_key != "16" or self._method_override:
            self._apply_compression(self._level_key, self._method_override, announce=True)
        self._emit_kv_bytes(force=True)
        self.recommendation.emit(self._recommend(info.max_context))

    def _recommend(self, context_tokens: int) -> LevelAdvice:

        try:
            # The model is loaded: its weights are already out of the "available" memory.
            result = recommend(self.info, context_tokens, system_memory()["available"], weights_bytes=0)
        except VeloxError as error:
            return LevelAdvice("", "", str(error), context_tokens)
        level = result.level
        return LevelAdvice(str(level.key) if level else "", str(level.label) if level else "",
                           str(result.reason), int(result.n_tokens))

    @Slot(object)
    def configure(self, defaults: GenerationOptions) -> None:
        """Default generation settings (max_tokens, temperature, top_p): fit checks use the reply budget."""
        self._defaults = defaults
        if self.session is not None:
            self.session.settings.max_tokens = defaults.max_tokens
            self.session.settings.temperature = defaults.temperature
            self.session.settings.top_p = defaults.top_p

    # ----- conversation ---------------------------------------------------------------------------------
    @Slot()
    def new_chat(self) -> None:
        if self.session is not None:
            self.session.new_chat()
            self._overflow_policy = None
            self.historySet.emit(0)

    @Slot(str, object)
    def configure_saved_caches(self, folder: str, budget_bytes: int) -> None:
        """Keep conversations' caches in `folder` within `budget_bytes` (0: keep none, and drop those kept)."""
        self._saved_caches = CacheFolder(folder, max(int(budget_bytes), 0)) if folder else None
        if self._saved_caches is not None:
            try:
                self._saved_caches.enforce_budget()
            except OSError as error:
                self.notice.emit(f"The saved conversation caches could not be tidied: {error}")

    @Slot(int, object)
    def open_conversation(self, conversation_id: int, history: list[Any]) -> None:
        """Show the session a stored conversation and take over its saved cache, so the next question
        prefills only its own tokens. A file that does not fit this model, template or a damaged one is
        refused in one line (`notice`), and the next turn re-reads the conversation from its text."""
        self.set_history(history)
        folder, session = self._saved_caches, self.session
        if folder is None or session is None or self.info is None or not self.info.path:
            return
        with self._job("reopening", self.notice.emit, "The saved cache could not be used"):
            try:
                restored = restore_session_cache(folder, conversation_id, session, self.info.path)
            except OSError as error:  # the folder itself is unreadable: the same as a refused file
                restored = None
                message = f"The saved cache could not be read ({error})."
            else:
                message = restored.refusal
            if message:
                self.notice.emit(f"{message.rstrip('.')}; Velox will re-read this conversation.")
                self.savedCache.emit(SavedCacheStatus(conversation_id, "refused", message=message))
            elif restored is not None and restored.tokens:
                self.savedCache.emit(SavedCacheStatus(
                    conversation_id, "restored", file_bytes=self._file_bytes(conversation_id),
                    tokens=restored.tokens,
                    message=f"re-encoded from {restored.reencoded_from}" if restored.reencoded_from else "",
                ))
            self._emit_kv_bytes(force=True)

    @Slot(int)
    def save_conversation_cache(self, conversation_id: int) -> None:
        """Write the session's cache as the conversation's (after its reply is stored). Only a consistent
        cache is written (every layer holding exactly the tokens the session lists); a failure costs the
        next reopen a re-read, never the conversation, and is reported in one line."""
        folder, session = self._saved_caches, self.session
        if folder is None or session is None or self.info is None or not self.info.path:
            return
        if folder.budget_bytes <= 0:
            folder.delete(conversation_id)  # caches are not kept: none may be left stale either
            return
        try:
            size = save_session_cache(folder, conversation_id, session, self.info.path)
        except (SavedCacheError, OSError) as error:
            # An older file stays: it holds an earlier state of this conversation, still a valid prefix.
            logger.warning("The cache of conversation %s was not saved: %s", conversation_id, error)
            self.savedCache.emit(SavedCacheStatus(conversation_id, "not-saved", message=str(error)))
            return
        except Exception as error:  # a surprise costs the next reopen a re-read, never the worker thread
            self.savedCache.emit(SavedCacheStatus(conversation_id, "not-saved",
                                                  message=_unexpected("Saving the cache failed", error)))
            return
        self.savedCache.emit(SavedCacheStatus(conversation_id, "saved", file_bytes=size,
                                              tokens=len(session.cached_tokens)))

    @Slot(int)
    def forget_conversation_cache(self, conversation_id: int) -> None:
        """Delete a deleted conversation's cache file (queued after any save of it still waiting)."""
        if self._saved_caches is not None and self._saved_caches.delete(conversation_id):
            self.savedCache.emit(SavedCacheStatus(conversation_id, "deleted"))

    def _file_bytes(self, conversation_id: int) -> int:
        path = self._saved_caches.path_for(conversation_id) if self._saved_caches else None
        return path.stat().st_size if path is not None and path.is_file() else 0

    @Slot(object)
    def set_history(self, history: list[Any]) -> None:
        """Replace the conversation (e.g. one reopened from the store); the cache keeps any common prefix."""
        if self.session is None:
            return
        self.session.new_chat()
        self.session.history = list(history)
        self._overflow_policy = None
        self.historySet.emit(len(self.session.history))

    @Slot(str, object)
    def send(self, text: str, options: GenerationOptions) -> None:
        self._run_turn(text, options, regenerate=False)

    @Slot(object)
    def regenerate(self, options: GenerationOptions) -> None:
        self._run_turn("", options, regenerate=True)

    def _session_settings(self, options: GenerationOptions, overflow_policy: str | None = None) -> Any:

        return GenerationSettings(max_tokens=options.max_tokens, temperature=options.temperature,
                                  top_p=options.top_p, seed=options.seed, overflow_policy=overflow_policy)

    def _run_turn(self, text: str, options: GenerationOptions, *, regenerate: bool) -> None:
        if options.overflow_policy:
            # The user chose how this conversation may overflow; later turns keep that choice.
            self._overflow_policy = options.overflow_policy
        with self._job("thinking", self.turnFailed.emit, "The reply failed"):
            session = self.session
            if session is None:
                raise ModelError("No model is loaded yet.")
            settings = self._session_settings(options, options.overflow_policy or self._overflow_policy)
            settings.prefill_chunk, refusal = self._memory_plan(
                session.cache_offset + session.count_tokens(text) + settings.max_tokens)
            if refusal:
                self.turnFailed.emit(refusal)
                return
            self.turnStarted.emit("regenerate" if regenerate else "send")
            try:
                reply, stats = self._stream(session.regenerate(settings) if regenerate
                                            else session.send(text, settings))
            except ContextOverflowError as error:  # the session refused the turn before changing anything
                self.overflow.emit(Overflow(
                    text=text, message=str(error), needed=error.needed_tokens, limit=error.limit_tokens,
                    has_documents=any(m.documents for m in session.history) or bool(session.pending_documents),
                    regenerate=regenerate,
                    # Only what can work is offered: tried on the rendered conversation, nothing changes.
                    remedies=session.overflow_remedies(text, settings, regenerate=regenerate),
                ))
                return
            if stats is not None:
                if stats.prefill_tokens_per_second > 0:
                    self.throughput.emit("prefill", float(stats.prefill_tokens_per_second))
                if stats.decode_tokens_per_second > 0:
                    self.throughput.emit("decode", float(stats.decode_tokens_per_second))
            last = session.history[-1] if session.history else None
            if stats is not None and stats.finish_reason != "cancelled" and last is not None:
                degenerate = degenerate_reply(last.content, stats.generated_tokens, session.tokenizer)
                if degenerate:
                    self.notice.emit(degenerate)
            self.turnFinished.emit(TurnResult(
                text=last.content if last is not None and last.role == "assistant" else reply,
                cancelled=bool(stats is None or stats.finish_reason == "cancelled"),
                stats=stats,
                regenerated=regenerate,
                documents=tuple(d.name for d in session.history[-2].documents) if len(session.history) >= 2
                else (),
            ))
            self._emit_kv_bytes(force=True)

    def _stream(self, events: Iterator[Any]) -> tuple[str, Any]:
        """Relay a turn's events to the GUI, with live tok/s samples; returns (reply text, GenerationStats)."""

        session = self.session
        reply = ""
        stats: Any = None
        started = time.perf_counter()
        first_chunk_at: float | None = None
        offset_at_first_chunk = 0
        last_sample = 0.0
        for event in self._stoppable(events):
            now = time.perf_counter()
            if isinstance(event, TextChunk):
                if first_chunk_at is None:
                    first_chunk_at, offset_at_first_chunk = now, session.cache_offset
                reply += event.text
                self.textChunk.emit(event.text)
                if now - last_sample >= THROUGHPUT_INTERVAL_S and now > first_chunk_at:
                    # Tokens really decoded, read from the cache's length (a chunk may hold several
                    # tokens, or none while a multi-byte character is incomplete).
                    decoded = session.cache_offset - offset_at_first_chunk
                    self.throughput.emit("decode", decoded / (now - first_chunk_at))
                    last_sample = now
                self._emit_kv_bytes()
            elif isinstance(event, PrefillProgress):
                self.prefillProgress.emit(event.done, event.total)
                if event.done and now - last_sample >= THROUGHPUT_INTERVAL_S:
                    self.throughput.emit("prefill", event.done / max(now - started, 1e-9))
                    last_sample = now
            elif isinstance(event, Notice):
                self.notice.emit(event.text)
            elif isinstance(event, GenerationStats):
                stats = event
        return reply, stats

    def _stoppable(self, events: Iterator[Any]) -> Iterator[Any]:
        """Pass events through, cancelling the session as soon as Stop was pressed (even before it started)."""
        for event in events:
            if self.stop_event.is_set():
                self.session.cancel()
            yield event

    # ----- documents -------------------------------------------------------------------------------------
    @Slot(str)
    def inspect_document(self, path: str) -> None:
        """Read a document and report its size in tokens, whether it fits the context and each level's memory."""
        if self.session is None:
            self.documentFailed.emit(path, "Load a model before attaching a document.")
            return

        def failed(message: str) -> None:
            self.documentFailed.emit(path, message)

        with self._job("reading", failed, f"{Path(path).name} could not be read"):
            self.documentInspected.emit(self._inspect(path))

    def _inspect(self, path: str) -> DocumentInspection:

        document = load_document(path)
        tokens = count_tokens(document, self._tokenizer)
        doc_id = self._next_doc_id
        self._next_doc_id += 1
        self._inspected[doc_id] = document
        session = self.session
        # The whole conversation with this document and an empty question, plus room for a reply.
        draft = [*session.history, Message("user", "", [*session.pending_documents, document])]
        needed = len(session.render_tokens(draft)) + session.settings.max_tokens
        available = int(system_memory()["available"])
        # The cache never holds more than the context: an overflowing document is judged at that size.
        judged = min(needed, session.context_length)
        return DocumentInspection(
            doc_id=doc_id, path=str(document.path), name=document.name, kind=document.kind,
            chars=document.n_chars, tokens=tokens, context_needed=needed,
            context_length=session.context_length, fits_context=needed <= session.context_length,
            available_bytes=available, current_level=self._level_key,
            verdicts=tuple(LevelVerdict.from_verdict(v)
                           for v in fit_verdicts(self.info, judged, available, weights_bytes=0)),
            advice=self._recommend(judged),
        )

    @Slot(int)
    def discard_document(self, doc_id: int) -> None:
        self._inspected.pop(doc_id, None)

    @Slot(int, object)
    def ingest_document(self, doc_id: int, choice: IngestChoice) -> None:
        """Attach an inspected document and read it into the cache now, with progress; cancellable."""
        def failed(message: str) -> None:
            self.documentIngested.emit(IngestResult(doc_id, "", cancelled=True, failed=True, message=message))

        with self._job("reading", failed, "Reading the document failed"):
            self._ingest_document(doc_id, choice)

    def _ingest_document(self, doc_id: int, choice: IngestChoice) -> None:
        document = self._inspected.pop(doc_id, None)
        if document is None or self.session is None:
            self.documentIngested.emit(IngestResult(doc_id, "", cancelled=True, failed=True,
                                                    message="That document is no longer waiting."))
            return
        session = self.session
        if choice.level and (choice.level != self._level_key or choice.method):
            self._apply_compression(choice.level, choice.method, announce=True)
        if choice.overflow_policy:
            self._overflow_policy = choice.overflow_policy
        chunk, refusal = self._document_memory_plan(document)
        if refusal:
            self.documentIngested.emit(IngestResult(0, document.name, str(document.path), cancelled=True,
                                                    failed=True, message=refusal))
            return
        session.attach_document(document)
        previous_policy, previous_chunk = session.settings.overflow_policy, session.settings.prefill_chunk
        session.settings.overflow_policy, session.settings.prefill_chunk = self._overflow_policy, chunk
        started = time.perf_counter()
        last_sample = 0.0
        cancelled = failed = False
        message = ""
        try:
            for progress in self._stoppable(session.prefill_pending()):
                self.ingestProgress.emit(progress.done, progress.total)
                now = time.perf_counter()
                if progress.done and now - last_sample >= THROUGHPUT_INTERVAL_S:
                    self.throughput.emit("prefill", progress.done / max(now - started, 1e-9))
                    last_sample = now
                self._emit_kv_bytes()
        except CancelledError:
            cancelled = True
            message = f"Reading {document.name} was cancelled; it was not attached."
        except VeloxError as error:
            cancelled = failed = True
            message = str(error)
        except Exception as error:
            cancelled = failed = True
            message = _unexpected(f"Reading {document.name} failed", error)
        finally:
            session.settings.overflow_policy, session.settings.prefill_chunk = previous_policy, previous_chunk
        if cancelled:
            session.pending_documents = [d for d in session.pending_documents if d is not document]
        self.documentIngested.emit(IngestResult(
            doc_id=doc_id, name=document.name, path=str(document.path),
            tokens=session.count_tokens(document.text), seconds=time.perf_counter() - started,
            cancelled=cancelled, failed=failed, message=message,
            document=document,  # a frozen dataclass: safe to hand to the GUI thread (for saving)
        ))
        self._emit_kv_bytes(force=True)

    def _memory_plan(self, n_tokens: int) -> tuple[int, str]:
        """(prefill chunk, refusal) for a cache of `n_tokens` at the current level: the chunk its prefill takes
        (`_fit_plan`) and the engine's explanation if it would not fit in memory (checked before the work starts, so
        the OS never has to kill the app; '' when it fits)."""
        held = self.session.kv_cache_bytes()  # already allocated: it is not "available" any more, but is ours
        return self._fit_plan(min(n_tokens, self.session.context_length), held)

    def _document_memory_plan(self, document: Any) -> tuple[int, str]:
        """(prefill chunk, refusal) for the conversation with `document` (see `_memory_plan`)."""

        session = self.session
        draft = [*session.history, Message("user", "", [*session.pending_documents, document])]
        n_tokens = min(len(session.render_tokens(draft)) + session.settings.max_tokens, session.context_length)
        return self._fit_plan(n_tokens, 0)

    def _fit_plan(self, n_tokens: int, held_bytes: int) -> tuple[int, str]:
        """The prefill chunk for `n_tokens` at the current level (on a GPU the largest that still fits:
        engine.planning.recommend.prefill_chunk_for) and the refusal with it ('' when the cache fits)."""
        available = system_memory()["available"] + held_bytes
        try:
            chunk = prefill_chunk_for(self.info, n_tokens, self._level_key, available, gpu=on_gpu(), weights_bytes=0)
            check_fits(self.info, n_tokens, self._level_key, available, weights_bytes=0, prefill_chunk=chunk)
        except (MemoryBudgetError, ConfigError) as error:
            return DEFAULT_PREFILL_CHUNK, str(error)
        return chunk, ""

    # ----- compression -----------------------------------------------------------------------------------
    @Slot(str, object)
    def set_compression(self, level_key: str, method: str | None) -> None:
        with self._job("compressing"):
            self._apply_compression(level_key, method, announce=True)

    def _apply_compression(self, level_key: str, method: str | None, *, announce: bool) -> None:
        level = _level_or_none(level_key)
        report = CompressionReport(key=level_key, label=level.label if level else f"{level_key}-bit",
                                   method=method or (level.config.method if level else ""), override=method)
        session = self.session
        if session is None:
            self._level_key, self._method_override = level_key, method
            self.compressionChanged.emit(replace(report, message="The level will apply when a model is loaded."))
            return
        if level is None:
            self.compressionChanged.emit(replace(report, message=f"There is no compression level {level_key!r}."))
            return
        before = session.kv_cache_bytes()
        try:
            if level.key == "16" and not method:
                config = None  # mlx-lm's own 16-bit cache: the uncompressed baseline
            else:
                config = level.config
                if method and method != config.method:
                    config = replace(config, method=method)
            if session.cached_tokens and self.info is not None:
                # the held cache stays until the new one is complete: refuse before re-encoding what would not fit
                target = level if config is None else replace(level, config=config)
                check_switch_fits(self.info, len(session.cached_tokens), target, system_memory()["available"])
            result = session.set_compression(config, progress=self.calibrationProgress.emit)
        except VeloxError as error:
            self.compressionChanged.emit(replace(report, before=before, after=before, message=str(error)))
            return
        except Exception as error:
            self.compressionChanged.emit(replace(report, before=before, after=before,
                                                 message=_unexpected("Switching compression failed", error)))
            return
        self._level_key, self._method_override = level_key, method
        if announce:
            self.compressionChanged.emit(replace(
                report, before=int(result.bytes_before), after=int(result.bytes_after), available=True,
                method=config.method if config is not None else "fp16", seconds=float(result.seconds),
                tokens=int(result.tokens), note=result.note,
            ))
        self._emit_kv_bytes(force=True)

    # ----- memory ----------------------------------------------------------------------------------------
    def _fp16_bytes(self, n_tokens: int) -> int:
        # 16 bits even where the model computes in float32 (Linux CPU): the panel compares against a 16-bit cache
        try:
            return int(cache_bytes(replace(self.info, compute_bits=16), n_tokens, level_by_key("16")))
        except VeloxError:
            return int(self.info.kv_bytes_per_token(16)) * n_tokens

    def _emit_kv_bytes(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.session is None or (not force and now - self._last_kv_emit < KV_BYTES_INTERVAL_S):
            return
        self._last_kv_emit = now
        self.kvBytes.emit(int(self.session.kv_cache_bytes()), self._fp16_bytes(self.session.cache_offset))


class DownloadWorker(QObject):
    """Downloads an MLX model from the Hugging Face hub into its cache (engine.models.hub), on its own thread."""

    progress = Signal(str, float)  # message, fraction (negative: size not known yet)
    finished = Signal(str)  # local snapshot folder
    failed = Signal(str)

    def __init__(self) -> None:
        super().__init__()
        self.stop_event = threading.Event()

    def cancel(self) -> None:
        self.stop_event.set()

    @Slot(str)
    def download(self, name: str) -> None:

        self.stop_event.clear()

        def progress(status: DownloadProgress) -> None:
            if status.total_bytes:
                self.progress.emit(f"Downloading {status.repo_id}: {format_bytes(status.done_bytes)} of "
                                   f"{format_bytes(status.total_bytes)}", status.fraction)
            else:
                host = hub_endpoint().split("://", 1)[-1]
                self.progress.emit(f"Contacting {host} for {status.repo_id}", -1.0)

        try:
            folder = download_model(normalize_repo_id(name), progress=progress, cancel=self.stop_event)
        except VeloxError as error:  # DownloadError, CancelledError: one sentence each
            self.failed.emit(str(error))
            return
        except Exception as error:  # never let a surprise kill the download thread silently
            self.failed.emit(_unexpected("The download failed", error))
            return
        self.finished.emit(str(folder))


class EngineThread(QObject):
    """Starts the worker on its own QThread and exposes one request signal per job (queued across threads).

    `stop()` cancels the running job, lets the thread finish its queue and joins it: call it before quitting.
    """

    requestLoadModel = Signal(str)
    requestAdoptModel = Signal(object)
    requestConfigure = Signal(object)  # GenerationOptions
    requestSend = Signal(str, object)  # text, GenerationOptions
    requestRegenerate = Signal(object)  # GenerationOptions
    requestNewChat = Signal()
    requestSetHistory = Signal(object)
    requestOpenConversation = Signal(int, object)  # conversation id, its history
    requestConfigureSavedCaches = Signal(str, object)  # folder, budget in bytes (an int over 2**31)
    requestSaveCache = Signal(int)  # conversation id
    requestForgetCache = Signal(int)  # conversation id
    requestInspectDocument = Signal(str)
    requestIngestDocument = Signal(int, object)  # doc_id, IngestChoice
    requestDiscardDocument = Signal(int)
    requestSetCompression = Signal(str, object)
    requestDownload = Signal(str)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self.worker = EngineWorker()
        self.thread = QThread()
        self.thread.setObjectName("velox-engine")
        self.worker.moveToThread(self.thread)
        self.downloader = DownloadWorker()
        self.download_thread = QThread()
        self.download_thread.setObjectName("velox-download")
        self.downloader.moveToThread(self.download_thread)
        w = self.worker
        self.requestLoadModel.connect(w.load_model)
        self.requestAdoptModel.connect(w.adopt_model)
        self.requestConfigure.connect(w.configure)
        self.requestSend.connect(w.send)
        self.requestRegenerate.connect(w.regenerate)
        self.requestNewChat.connect(w.new_chat)
        self.requestSetHistory.connect(w.set_history)
        self.requestOpenConversation.connect(w.open_conversation)
        self.requestConfigureSavedCaches.connect(w.configure_saved_caches)
        self.requestSaveCache.connect(w.save_conversation_cache)
        self.requestForgetCache.connect(w.forget_conversation_cache)
        self.requestInspectDocument.connect(w.inspect_document)
        self.requestIngestDocument.connect(w.ingest_document)
        self.requestDiscardDocument.connect(w.discard_document)
        self.requestSetCompression.connect(w.set_compression)
        self.requestDownload.connect(self.downloader.download)
        self.thread.start()
        self.download_thread.start()

    def begin_job(self) -> None:
        """Called by the GUI just before it queues a job that Stop may cancel."""
        self.worker.stop_event.clear()

    def cancel(self) -> None:
        self.worker.cancel()

    def stop(self, timeout_ms: int = 30_000) -> None:
        self.worker.cancel()
        self.downloader.cancel()
        for thread in (self.thread, self.download_thread):
            thread.quit()
            thread.wait(timeout_ms)
