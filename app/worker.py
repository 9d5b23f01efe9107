"""The engine worker: the one thread that does all MLX work for the desktop app.

`EngineWorker` is a QObject moved to its own QThread. The GUI asks it for work through queued signals
(`EngineThread` wires them) and hears back through signals that carry plain data only (str, int, float,
dicts, lists, and the engine's frozen dataclasses), so no widget ever touches a model, a tokenizer or an
mx.array. Jobs run one at a time in arrival order; `cancel()` is the one method the GUI calls directly: it only
sets thread-safe flags that the running job polls between steps.

MLX is reached only through `engine` (no `import mlx` here). A separate `DownloadWorker` thread fetches
models from the Hugging Face hub: a download is network work, not MLX work, and must not hold up the chat
for minutes.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.logs import unexpected_error_line
from engine.chat.documents import count_tokens, load_document
from engine.chat.reply_check import degenerate_reply
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
    DownloadError,
    MemoryBudgetError,
    VeloxError,
)
from engine.models.catalog import load_model, resolve_model
from engine.planning.memory import system_memory
from engine.planning.recommend import LEVELS, cache_bytes, check_fits, fit_verdicts, recommend

# How often the worker reports live numbers while it runs a job: often enough for a smooth plot and gauges,
# rarely enough that signals never flood the GUI's event queue.
THROUGHPUT_INTERVAL_S = 0.25
KV_BYTES_INTERVAL_S = 1.0
MLX_COMMUNITY = "mlx-community"
# The GIL switch interval while the worker runs. Python's default (5 ms) lets a busy worker thread keep the
# GIL for a whole interval at a time, and on a loaded machine the hand-over convoys into 100-400 ms GUI
# stalls; 1 ms keeps the event loop's worst gap around 50 ms (measured on 2 busy cores), at a negligible
# cost to the worker, whose heavy lifting happens in MLX with the GIL released.
GIL_SWITCH_INTERVAL_S = 0.001


def compression_levels() -> list[Any]:
    """The engine's compression levels (16/8/4/3/2 bits) in slider order."""
    return list(LEVELS)  # highest precision first, the slider's order


def find_level(key: str) -> Any | None:
    for level in compression_levels():
        if str(level.key) == str(key):
            return level
    return None


def level_summary(level: Any) -> dict[str, Any]:
    return {
        "key": str(level.key),
        "label": str(level.label),
        "method": str(level.method),
        "key_bits": level.key_bits,
        "value_bits": level.value_bits,
        "group_size": level.group_size,
        "quality_note": level.quality_note,
    }


def model_summary(info: Any) -> dict[str, Any]:
    """What the GUI shows about a model, from an engine ModelInfo."""
    return {
        "name": info.name,
        "path": str(info.path) if info.path else "",
        "source": info.source,
        "parameters": int(info.parameters),
        "bytes_on_disk": int(info.bytes_on_disk),
        "max_context": int(info.max_context),
        "layers": int(info.layers),
        "kv_heads": int(info.kv_heads),
        "head_dim": int(info.head_dim),
        "quantization": info.quantization,
        "kv_bytes_per_token_16": int(info.kv_bytes_per_token(16)),
        "ready": bool(info.ready),
        "note": info.note,
    }


def stats_summary(stats: Any) -> dict[str, Any]:
    return asdict(stats)


_log = logging.getLogger("app.worker")  # full tracebacks go to the log file (app/logs.py)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class EngineWorker(QObject):
    """Owns the model, the tokenizer and the ChatSession; every public slot runs on the worker thread."""

    # model
    modelLoadProgress = Signal(str, float)
    modelLoaded = Signal(object)  # model_summary dict
    modelLoadFailed = Signal(str)
    recommendation = Signal(object)  # {'key', 'label', 'reason', 'context_tokens'} or None
    # a turn
    busyChanged = Signal(bool, str)  # busy, what ('loading', 'thinking', 'reading', 'compressing', '')
    turnStarted = Signal(str)  # 'send' | 'regenerate'
    prefillProgress = Signal(int, int)
    textChunk = Signal(str)
    notice = Signal(str)
    throughput = Signal(str, float)  # phase ('prefill' | 'decode'), tokens per second
    turnFinished = Signal(object)  # {'text', 'cancelled', 'stats': dict, 'regenerated': bool}
    turnFailed = Signal(str)
    overflow = Signal(object)  # {'text', 'message', 'needed', 'limit', 'has_documents', 'regenerate'}
    # documents
    documentInspected = Signal(object)
    documentFailed = Signal(str, str)  # path, message
    ingestProgress = Signal(int, int)
    documentIngested = Signal(object)  # {'doc_id', 'name', 'tokens', 'seconds', 'cancelled', 'message'}
    # compression and memory
    compressionChanged = Signal(object)  # {'key', 'label', 'method', 'before', 'after', 'available', 'message'}
    kvBytes = Signal(int, int)  # bytes held now, bytes a 16-bit cache would need for the same tokens
    historySet = Signal(int)  # number of messages now in the session

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
        self._inspected: dict[int, Any] = {}
        self._next_doc_id = 1
        self._defaults: dict[str, Any] = {}
        self._last_kv_emit = 0.0

    # ----- called from the GUI thread ---------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the running job (a reply, a document being read). Thread-safe; a no-op when idle."""
        self.stop_event.set()
        session = self.session
        if session is not None:
            session.cancel()

    # ----- model ----------------------------------------------------------------------------------------
    @Slot(str)
    def load_model(self, spec: str) -> None:
        """Load a model (a folder, 'org/name' in the HF cache, or '' for the embedded default)."""
        self.busyChanged.emit(True, "loading")
        try:
            def progress(message: str, fraction: float) -> None:
                self.modelLoadProgress.emit(message, float(fraction))

            path = resolve_model(spec or None, progress=progress)
            model, tokenizer, info = load_model(path, progress=progress)
        except VeloxError as error:
            self.modelLoadFailed.emit(str(error))
            self.busyChanged.emit(False, "")
            return
        except Exception as error:  # never let a surprise kill the worker thread silently
            _log.exception("loading the model %s failed", spec)
            self.modelLoadFailed.emit(f"The model could not be loaded: {unexpected_error_line(error)}")
            self.busyChanged.emit(False, "")
            return
        self._install_model(model, tokenizer, info)
        self.busyChanged.emit(False, "")

    @Slot(object)
    def adopt_model(self, loaded: tuple[Any, Any, Any]) -> None:
        """Use an already loaded (model, tokenizer, info): the tests share one model across windows."""
        model, tokenizer, info = loaded
        self._install_model(model, tokenizer, info)

    def _install_model(self, model: Any, tokenizer: Any, info: Any) -> None:
        self._model, self._tokenizer, self.info = model, tokenizer, info
        self.session = ChatSession(model, tokenizer, context_length=info.max_context or None,
                                   settings=GenerationSettings(**self._defaults))
        self._inspected.clear()
        self._overflow_policy = None
        self.modelLoaded.emit(model_summary(info))
        if self._level_key != "16" or self._method_override:
            self._apply_compression(self._level_key, self._method_override, announce=True)
        self._emit_kv_bytes(force=True)
        self.recommendation.emit(self._recommend(info.max_context))

    def _recommend(self, context_tokens: int) -> dict[str, Any] | None:
        try:
            # The model is loaded: its weights are already out of the "available" memory.
            result = recommend(self.info, context_tokens, system_memory()["available"], weights_bytes=0)
        except VeloxError as error:
            return {"key": "", "label": "", "reason": str(error), "context_tokens": context_tokens}
        level = result.level
        return {"key": str(level.key) if level else "", "label": str(level.label) if level else "",
                "reason": str(result.reason), "context_tokens": int(result.n_tokens)}

    @Slot(object)
    def configure(self, options: dict[str, Any]) -> None:
        """Default generation settings (max_tokens, temperature, top_p): fit checks use the reply budget."""
        self._defaults = {key: options[key] for key in ("max_tokens", "temperature", "top_p") if key in options}
        if self.session is not None:
            for key, value in self._defaults.items():
                setattr(self.session.settings, key, value)

    # ----- conversation ---------------------------------------------------------------------------------
    @Slot()
    def new_chat(self) -> None:
        if self.session is not None:
            self.session.new_chat()
            self._overflow_policy = None
            self.historySet.emit(0)

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
    def send(self, text: str, options: dict[str, Any]) -> None:
        self._run_turn(text, options, regenerate=False)

    @Slot(object)
    def regenerate(self, options: dict[str, Any]) -> None:
        self._run_turn("", options, regenerate=True)

    def _generation_settings(self, options: dict[str, Any]) -> Any:
        policy = options.get("overflow_policy") or self._overflow_policy
        if options.get("overflow_policy"):
            # The user chose how this conversation may overflow; later turns keep that choice.
            self._overflow_policy = options["overflow_policy"]
        return GenerationSettings(
            max_tokens=int(options.get("max_tokens", 512)),
            temperature=float(options.get("temperature", 0.0)),
            top_p=float(options.get("top_p", 1.0)),
            seed=options.get("seed", 0),
            overflow_policy=policy,
        )

    def _run_turn(self, text: str, options: dict[str, Any], *, regenerate: bool) -> None:
        if self.session is None:
            self.turnFailed.emit("No model is loaded yet.")
            self.busyChanged.emit(False, "")
            return
        session = self.session
        settings = self._generation_settings(options)
        self.busyChanged.emit(True, "thinking")
        refusal = self._memory_refusal(session.cache_offset + session.count_tokens(text) + settings.max_tokens)
        if refusal:
            self.turnFailed.emit(refusal)
            self.busyChanged.emit(False, "")
            return
        self.turnStarted.emit("regenerate" if regenerate else "send")
        if regenerate and session.history and session.history[-1].role == "assistant":
            restore = list(session.history)
        else:
            restore = None
        reply = ""
        stats: Any = None
        started = time.perf_counter()
        first_chunk_at: float | None = None
        offset_at_first_chunk = 0
        last_sample = 0.0
        try:
            events = session.regenerate(settings) if regenerate else session.send(text, settings)
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
        except ContextOverflowError as error:
            if restore is not None:
                session.history = restore  # regenerate popped the turn before finding it does not fit
                session.pending_documents = [d for d in session.pending_documents
                                             if not any(d is doc for m in restore for doc in m.documents)]
            self.overflow.emit({
                "text": text, "message": str(error), "needed": error.needed_tokens,
                "limit": error.limit_tokens, "regenerate": regenerate,
                "has_documents": any(m.documents for m in session.history) or bool(session.pending_documents),
            })
            self.busyChanged.emit(False, "")
            return
        except VeloxError as error:
            self.turnFailed.emit(str(error))
            self.busyChanged.emit(False, "")
            return
        except Exception as error:  # a failure inside MLX: report it, keep the worker alive
            _log.exception("a reply failed")
            self.turnFailed.emit(f"The reply failed: {unexpected_error_line(error)}")
            self.busyChanged.emit(False, "")
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
        self.turnFinished.emit({
            "text": last.content if last is not None and last.role == "assistant" else reply,
            "cancelled": bool(stats is None or stats.finish_reason == "cancelled"),
            "stats": stats_summary(stats) if stats is not None else None,
            "regenerated": regenerate,
            "documents": [d.name for d in session.history[-2].documents] if len(session.history) >= 2 else [],
        })
        self._emit_kv_bytes(force=True)
        self.busyChanged.emit(False, "")

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
        self.busyChanged.emit(True, "reading")
        try:
            document = load_document(path)
            tokens = count_tokens(document, self._tokenizer)
        except VeloxError as error:
            self.documentFailed.emit(path, str(error))
            self.busyChanged.emit(False, "")
            return
        except Exception as error:
            _log.exception("inspecting a document failed")
            self.documentFailed.emit(path, f"{Path(path).name} could not be read: {unexpected_error_line(error)}")
            self.busyChanged.emit(False, "")
            return
        doc_id = self._next_doc_id
        self._next_doc_id += 1
        self._inspected[doc_id] = document
        session = self.session
        # The whole conversation with this document and an empty question, plus room for a reply.
        draft = [*session.history, Message("user", "", [*session.pending_documents, document])]
        needed = len(session.render_tokens(draft)) + session.settings.max_tokens
        available = int(system_memory()["available"])
        self.documentInspected.emit({
            "doc_id": doc_id,
            "path": str(document.path),
            "name": document.name,
            "kind": document.kind,
            "chars": document.n_chars,
            "tokens": tokens,
            "context_needed": needed,
            "context_length": session.context_length,
            "fits_context": needed <= session.context_length,
            "available_bytes": available,
            "current_level": self._level_key,
            # The cache never holds more than the context: an overflowing document is judged at that size.
            "verdicts": self._verdicts(min(needed, session.context_length), available),
            "recommendation": self._recommend(min(needed, session.context_length)),
        })
        self.busyChanged.emit(False, "")

    def _verdicts(self, n_tokens: int, available: int) -> list[dict[str, Any]]:
        return [
            {
                "key": verdict.level.key,
                "label": verdict.level.label,
                "fits": verdict.fits,
                "supported": verdict.supported,
                "bytes": verdict.cache_bytes,
                "sentence": verdict.message,
            }
            for verdict in fit_verdicts(self.info, n_tokens, available, weights_bytes=0)
        ]

    @Slot(int)
    def discard_document(self, doc_id: int) -> None:
        self._inspected.pop(doc_id, None)

    @Slot(int, object)
    def ingest_document(self, doc_id: int, choice: dict[str, Any]) -> None:
        """Attach an inspected document and read it into the cache now, with progress; cancellable.

        `choice`: {'level': key or None (switch compression first), 'method': name or None,
        'overflow_policy': None or 'truncate-middle'}."""
        self.busyChanged.emit(True, "reading")
        try:
            self._ingest_document(doc_id, choice)
        finally:
            self.busyChanged.emit(False, "")  # on every path: the GUI marked itself busy when it asked

    def _ingest_document(self, doc_id: int, choice: dict[str, Any]) -> None:
        document = self._inspected.pop(doc_id, None)
        if document is None or self.session is None:
            self.documentIngested.emit({"doc_id": doc_id, "name": "", "tokens": 0, "seconds": 0.0,
                                        "cancelled": True, "failed": True,
                                        "message": "That document is no longer waiting."})
            return
        session = self.session
        if choice.get("level") and (choice["level"] != self._level_key or choice.get("method")):
            self._apply_compression(choice["level"], choice.get("method"), announce=True)
        if choice.get("overflow_policy"):
            self._overflow_policy = choice["overflow_policy"]
        if not self._check_memory(document):
            return
        session.attach_document(document)
        previous_policy = session.settings.overflow_policy
        session.settings.overflow_policy = self._overflow_policy
        started = time.perf_counter()
        last_sample = 0.0
        cancelled = False
        message = ""
        failed = False
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
            _log.exception("reading a document failed")
            cancelled = failed = True
            message = f"Reading {document.name} failed: {unexpected_error_line(error)}"
        finally:
            session.settings.overflow_policy = previous_policy
        if cancelled:
            session.pending_documents = [d for d in session.pending_documents if d is not document]
        tokens = session.count_tokens(document.text)
        self.documentIngested.emit({
            "doc_id": doc_id, "name": document.name, "path": str(document.path), "tokens": tokens,
            "seconds": time.perf_counter() - started, "cancelled": cancelled, "failed": failed, "message": message,
            "document": document,  # a frozen dataclass: safe to hand to the GUI thread (for saving)
        })
        self._emit_kv_bytes(force=True)

    def _memory_refusal(self, n_tokens: int) -> str:
        """The engine's explanation if a cache of `n_tokens` at the current level would not fit in memory
        (checked before the work starts, so the OS never has to kill the app); '' when it fits."""
        held = self.session.kv_cache_bytes()  # already allocated: it is not "available" any more, but is ours
        try:
            check_fits(self.info, min(n_tokens, self.session.context_length), self._level_key,
                       system_memory()["available"] + held, weights_bytes=0)
        except (MemoryBudgetError, ConfigError) as error:
            return str(error)
        return ""

    def _check_memory(self, document: Any) -> bool:
        """Refuse, with the engine's explanation, a document whose cache would not fit in memory."""
        session = self.session
        draft = [*session.history, Message("user", "", [*session.pending_documents, document])]
        n_tokens = min(len(session.render_tokens(draft)) + session.settings.max_tokens, session.context_length)
        try:
            check_fits(self.info, n_tokens, self._level_key, system_memory()["available"], weights_bytes=0)
        except (MemoryBudgetError, ConfigError) as error:
            self.documentIngested.emit({"doc_id": 0, "name": document.name, "path": str(document.path),
                                        "tokens": 0, "seconds": 0.0, "cancelled": True, "failed": True,
                                        "message": str(error)})
            return False
        return True

    # ----- compression -----------------------------------------------------------------------------------
    @Slot(str, object)
    def set_compression(self, level_key: str, method: str | None) -> None:
        self.busyChanged.emit(True, "compressing")
        self._apply_compression(level_key, method, announce=True)
        self.busyChanged.emit(False, "")

    def _apply_compression(self, level_key: str, method: str | None, *, announce: bool) -> None:
        level = find_level(level_key)
        report: dict[str, Any] = {"key": level_key, "label": level.label if level else f"{level_key}-bit",
                                  "method": method or (level.method if level else ""), "override": method,
                                  "before": 0, "after": 0, "available": False, "message": "", "seconds": 0.0}
        session = self.session
        if session is None:
            self._level_key, self._method_override = level_key, method
            report["message"] = "The level will apply when a model is loaded."
            self.compressionChanged.emit(report)
            return
        if level is None:
            report["message"] = f"There is no compression level {level_key!r}."
            self.compressionChanged.emit(report)
            return
        before = session.kv_cache_bytes()
        try:
            if level.key == "16" and not method:
                config = None  # mlx-lm's own 16-bit cache: the uncompressed baseline
            else:
                config = level.to_config()
                if method and method != config.method:
                    config = replace(config, method=method)
            result = session.set_compression(config)
        except VeloxError as error:
            report.update(before=before, after=before, message=str(error))
            self.compressionChanged.emit(report)
            return
        except Exception as error:
            _log.exception("switching compression failed")
            report.update(before=before, after=before,
                          message=f"Switching compression failed: {unexpected_error_line(error)}")
            self.compressionChanged.emit(report)
            return
        self._level_key, self._method_override = level_key, method
        report.update(
            before=int(result.bytes_before), after=int(result.bytes_after), available=True,
            method=config.method if config is not None else "fp16", seconds=float(result.seconds),
            tokens=int(result.tokens), note=result.note,
        )
        if announce:
            self.compressionChanged.emit(report)
        self._emit_kv_bytes(force=True)

    # ----- memory ----------------------------------------------------------------------------------------
    def _fp16_bytes(self, n_tokens: int) -> int:
        level = find_level("16")
        if level is not None:
            try:
                return int(cache_bytes(self.info, n_tokens, level))
            except VeloxError:
                pass
        return int(self.info.kv_bytes_per_token(16)) * n_tokens

    def _emit_kv_bytes(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.session is None or (not force and now - self._last_kv_emit < KV_BYTES_INTERVAL_S):
            return
        self._last_kv_emit = now
        self.kvBytes.emit(int(self.session.kv_cache_bytes()), self._fp16_bytes(self.session.cache_offset))


class DownloadWorker(QObject):
    """Downloads an MLX model from the Hugging Face hub into its cache, with progress and cancel."""

    progress = Signal(str, float)  # message, fraction (negative: size not known yet)
    finished = Signal(str)  # local snapshot folder
    failed = Signal(str)

    def __init__(self) -> None:
        super().__init__()
        self.stop_event = threading.Event()

    def cancel(self) -> None:
        self.stop_event.set()

    @staticmethod
    def repo_id(name: str) -> str:
        """'org/name' as typed, or a bare name taken from mlx-community."""
        name = name.strip().strip("/")
        if name.startswith("https://huggingface.co/"):
            name = name[len("https://huggingface.co/"):]
        return name if "/" in name else f"{MLX_COMMUNITY}/{name}"

    @Slot(str)
    def download(self, name: str) -> None:
        self.stop_event.clear()
        repo = self.repo_id(name)
        try:
            folder = self._download(repo)
        except CancelledError as error:
            self.failed.emit(str(error))
            return
        except DownloadError as error:
            self.failed.emit(str(error))
            return
        self.finished.emit(folder)

    def _download(self, repo: str) -> str:
        try:  # huggingface_hub is only needed for downloads: loaded on the first one
            from huggingface_hub import snapshot_download
            from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
        except ImportError as error:
            raise DownloadError("Downloading models needs the huggingface_hub package, which is not installed.") \
                from error
        worker = self

        class _Progress:
            """A tqdm stand-in: huggingface_hub reports bytes through it; raising here cancels the download."""

            totals: dict[int, float] = {}
            done: dict[int, float] = {}

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.total = float(kwargs.get("total") or 0)
                self.n = float(kwargs.get("initial") or 0)
                self.desc = str(kwargs.get("desc") or "")
                self.disable = False
                _Progress.totals[id(self)] = self.total
                _Progress.done[id(self)] = self.n
                self._report()

            def update(self, n: float = 1) -> None:
                if worker.stop_event.is_set():
                    raise CancelledError(f"The download of {repo} was cancelled.")
                self.n += float(n or 0)
                _Progress.done[id(self)] = self.n
                self._report()

            def _report(self) -> None:
                total = sum(_Progress.totals.values())
                done = sum(_Progress.done.values())
                fraction = done / total if total > 0 else -1.0
                worker.progress.emit(f"Downloading {repo}", min(fraction, 1.0))

            def __iter__(self) -> Iterator[Any]:
                return iter(())

            def __enter__(self) -> _Progress:
                return self

            def __exit__(self, *exc: Any) -> None:
                self.close()

            def set_description(self, desc: str = "", refresh: bool = True) -> None:
                self.desc = desc

            def set_postfix(self, *args: Any, **kwargs: Any) -> None:
                pass

            def refresh(self) -> None:
                pass

            def reset(self, total: float | None = None) -> None:
                self.total = float(total or 0)
                _Progress.totals[id(self)] = self.total

            def close(self) -> None:
                pass

        self.progress.emit(f"Contacting huggingface.co for {repo}", -1.0)
        try:
            folder = snapshot_download(
                repo, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"],
                tqdm_class=_Progress,  # type: ignore[arg-type]
            )
        except CancelledError:
            raise
        except RepositoryNotFoundError as error:
            raise DownloadError(f"There is no model named {repo} on Hugging Face (or it is private).") from error
        except LocalEntryNotFoundError as error:
            from huggingface_hub import constants  # loaded with snapshot_download above

            if constants.HF_HUB_OFFLINE:
                raise DownloadError(
                    f"{repo} is not downloaded and Hugging Face offline mode is on (HF_HUB_OFFLINE=1), so "
                    "Velox cannot fetch it; unset HF_HUB_OFFLINE to download."
                ) from error
            raise DownloadError(
                f"Velox could not reach huggingface.co to download {repo}: this computer seems to be offline. "
                "Connect to the internet and try again, or pick a model that is already on disk."
            ) from error
        except OSError as error:
            raise DownloadError(f"The download of {repo} failed: {_first_line(error)}") from error
        except Exception as error:  # httpx / requests errors of every kind
            raise DownloadError(f"The download of {repo} failed: {_first_line(error)}") from error
        if self.stop_event.is_set():
            raise CancelledError(f"The download of {repo} was cancelled.")
        self.progress.emit(f"Downloaded {repo}", 1.0)
        return str(folder)


class EngineThread(QObject):
    """Starts the worker on its own QThread and exposes one request signal per job (queued across threads).

    `stop()` cancels the running job, lets the thread finish its queue and joins it: call it before quitting.
    """

    requestLoadModel = Signal(str)
    requestAdoptModel = Signal(object)
    requestConfigure = Signal(object)
    requestSend = Signal(str, object)
    requestRegenerate = Signal(object)
    requestNewChat = Signal()
    requestSetHistory = Signal(object)
    requestInspectDocument = Signal(str)
    requestIngestDocument = Signal(int, object)
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
