"""The `velox` commands (parsed by `app.cli`): chat in the terminal, list models, show machine facts.

Errors are one clear line on stderr and a non-zero exit code, never a traceback. MLX is reached only
through `engine` (whose import sets up the optional Linux CPU fast path first).
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import engine
from app import serve_cli
from app.logs import log_path, unexpected_error_line
from app.settings import load_settings
from app.store import ConversationStore, conversation_title, saved_caches_folder
from engine.chat.documents import load_document
from engine.chat.reply_check import degenerate_reply
from engine.chat.saved_cache import (
    UNCOMPRESSED_PREFIX,
    CacheFolder,
    SavedCacheError,
    read_cache_metadata,
    restore_session_cache,
    save_session_cache,
)
from engine.chat.session import (
    ChatSession,
    GenerationSettings,
    GenerationStats,
    Message,
    Notice,
    PrefillProgress,
    TextChunk,
)
from engine.errors import CancelledError, ConfigError, VeloxError
from engine.kvcache import KVCacheConfig, describe_methods
from engine.kvcache.calibration import precompute
from engine.models.catalog import hf_cached_snapshot, list_models, load_model, resolve_model
from engine.models.hub import DownloadProgress, download_model, normalize_repo_id
from engine.planning.memory import snapshot, system_memory
from engine.planning.recommend import BUDGET_TOKENS, LEVELS, CompressionLevel, check_fits, prefill_chunk_for
from engine.planning.units import format_bytes
from engine.runtime.status import on_gpu, runtime_status

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130

logger = logging.getLogger(__name__)


def _progress(message: str, fraction: float) -> None:
    print(f"\r[{fraction * 100:5.1f}%] {message:<60}", end="", file=sys.stderr, flush=True)
    if fraction >= 1.0:
        print(file=sys.stderr)


def _cache_config(args: argparse.Namespace) -> Any:
    if args.kv is None and args.kv_bits is None:
        return None
    # Without --kv, the method is the one the app's compression level of that many bits uses (the level
    # table follows the committed quality benchmark); --kv-bits alone picks that level outright.
    levels = {level.key: level for level in LEVELS}
    if args.kv is None and str(args.kv_bits) in levels:
        return levels[str(args.kv_bits)].config
    config = KVCacheConfig.parse(args.kv) if args.kv is not None else KVCacheConfig(levels["4"].config.method)
    if args.kv_bits is None:
        return config
    if config.key_bits is not None or config.value_bits is not None:
        raise ConfigError(f"--kv {args.kv} already gives the bits; leave out --kv-bits {args.kv_bits}.")
    return replace(config, key_bits=args.kv_bits, value_bits=args.kv_bits)


def _download_progress(progress: DownloadProgress) -> None:
    if progress.total_bytes:
        _progress(f"{progress.repo_id}: {format_bytes(progress.done_bytes)} of {format_bytes(progress.total_bytes)}",
                  progress.fraction)


def _download(repo: str, revision: str = "main") -> Path:
    repo = normalize_repo_id(repo)
    print(f"Downloading {repo} from Hugging Face (Ctrl-C stops; running it again resumes)…", file=sys.stderr)
    try:
        return download_model(repo, revision=revision, progress=_download_progress)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        raise CancelledError(f"The download of {repo} was stopped; run the same command again to resume.") from None


def _print_stats(stats: Any) -> None:
    print(
        f"[{stats.prompt_tokens} prompt tokens ({stats.reused_tokens} reused), "
        f"prefill {stats.prefill_tokens_per_second:.1f} tok/s, decode {stats.decode_tokens_per_second:.1f} tok/s, "
        f"TTFT {stats.time_to_first_token:.2f} s, peak {format_bytes(stats.peak_memory_bytes)}, "
        f"KV cache {format_bytes(stats.kv_cache_bytes)}]",
        file=sys.stderr,
    )


def _level_for(cache_config: Any) -> CompressionLevel:
    """What the memory check counts for `cache_config`: None (the session's default cache, in the model's compute
    dtype) is the uncompressed level; a compressed level's configuration is that level; any other configuration,
    Velox's 16-bit cache included (it stores 16 bits whatever the model computes in), is counted by its method's own
    bits formula."""
    if cache_config is None:
        return LEVELS[0]
    for level in LEVELS[1:]:
        if level.config == cache_config:
            return level
    return CompressionLevel("custom", cache_config.describe(), cache_config)


def _check_memory(session: Any, info: Any, level: CompressionLevel, question: str) -> None:
    """Refuse a turn whose KV cache would not fit in the memory this process may use (cgroup limits
    included), before any token is read: MemoryBudgetError with the engine's explanation; and set the prefill chunk
    the check counted. The app does the same before it reads a document (app/worker.py)."""
    draft = [*session.history, Message("user", question, list(session.pending_documents))]
    n_tokens = min(len(session.render_tokens(draft)) + session.settings.max_tokens, session.context_length)
    held = session.kv_cache_bytes()  # already allocated: out of "available", but ours to reuse
    available = system_memory()["available"] + held
    # On a GPU the prompt is prefilled in the largest chunk that still fits (engine.planning.recommend)
    chunk = prefill_chunk_for(info, n_tokens, level, available, gpu=on_gpu(), weights_bytes=0)
    check_fits(info, n_tokens, level, available, weights_bytes=0, prefill_chunk=chunk)
    session.settings.prefill_chunk = chunk


def _run_turn(session: Any, question: str, show_stats: bool) -> str | None:
    """Stream one reply to stdout; returns why the reply was degenerate (see engine.chat.reply_check),
    or None for a normal (or stopped) reply."""
    try:
        for event in session.send(question):
            if isinstance(event, TextChunk):
                print(event.text, end="", flush=True)
            elif isinstance(event, PrefillProgress) and event.total > 2048:
                print(f"\r[reading {event.done}/{event.total} tokens]", end="", file=sys.stderr, flush=True)
            elif isinstance(event, Notice):
                print(f"[{event.text}]", file=sys.stderr)
            elif isinstance(event, GenerationStats):
                print(flush=True)
                if event.finish_reason == "cancelled":
                    print("[stopped]", file=sys.stderr)
                if show_stats:
                    _print_stats(event)
                if event.finish_reason != "cancelled" and session.history:
                    return degenerate_reply(session.history[-1].content, event.generated_tokens, session.tokenizer)
    except KeyboardInterrupt:
        # Ctrl-C while the generator was running: the session's own cleanup already ran in `finally`.
        session.cancel()
        print("\n[stopped]", file=sys.stderr)
    return None


def _compression_label(cache_config: Any) -> str:
    """What the store records as a message's compression, in the app's words ('4-bit (kivi)')."""
    for level in LEVELS:
        if cache_config is None and level.key == "16":
            return level.label
        if cache_config is not None and level.config == cache_config:
            return f"{level.label} ({cache_config.method})"
    return str(cache_config)


class _SavedChat:
    """Where a terminal chat is saved: the app's conversation store and, beside it, the conversation's KV
    cache (engine.chat.saved_cache), so the app, `velox chats` and `velox chat --resume` all see it."""

    def __init__(self, store: ConversationStore, model_path: Path, model_name: str, *, write: bool,
                 conversation_id: int | None = None) -> None:
        self.store = store
        self.caches = CacheFolder(saved_caches_folder(store.path), load_settings().saved_cache_budget_bytes)
        self.model_path = model_path
        self.model_name = model_name
        self.write = write
        self.conversation_id = conversation_id

    def restore(self, session: Any) -> None:
        """Give the session the conversation's saved cache; a refused file is one line, then a re-read."""
        if self.conversation_id is None:
            return
        restored = restore_session_cache(self.caches, self.conversation_id, session, self.model_path)
        if restored.refusal:
            print(f"[{restored.refusal.rstrip('.')}; re-reading the conversation]", file=sys.stderr)

    def record(self, session: Any, compression: str) -> None:
        """Store the turn that just ended (the session's last question and reply), then its cache."""
        if not self.write or len(session.history) < 2:
            return
        question, answer = session.history[-2], session.history[-1]
        if self.conversation_id is None:
            self.conversation_id = self.store.create_conversation(
                conversation_title(question.content), model=self.model_name, compression=compression)
        self.store.append_message(self.conversation_id, "user", question.content, documents=question.documents,
                                  compression=compression)
        self.store.append_message(self.conversation_id, "assistant", answer.content, cancelled=answer.cancelled,
                                  stats=session.last_stats, compression=compression)
        if self.caches.budget_bytes <= 0:
            return
        try:
            save_session_cache(self.caches, self.conversation_id, session, self.model_path)
        except (SavedCacheError, OSError) as error:  # the conversation is saved; only a later re-read is lost
            logger.warning("The cache of conversation %s was not saved: %s", self.conversation_id, error)
            print(f"[the conversation's cache was not saved: {error}]", file=sys.stderr)
        except Exception as error:  # noqa: BLE001 - the reply is given and stored: a surprise costs the cache only
            logger.exception("Saving the cache of conversation %s failed", self.conversation_id)
            print(f"[the conversation's cache was not saved: {unexpected_error_line(error)}]", file=sys.stderr)


def _resume_compression(args: argparse.Namespace, caches: CacheFolder, conversation_id: int) -> Any:
    """The compression a resumed chat uses: what --kv/--kv-bits say, else what its saved cache was made
    with (so it is reused as it is), else none."""
    if args.kv is not None or args.kv_bits is not None:
        return _cache_config(args)
    try:
        label = read_cache_metadata(caches.path_for(conversation_id)).get("config", "")
        return None if not label or label.startswith(UNCOMPRESSED_PREFIX) else KVCacheConfig.parse(label)
    except (SavedCacheError, ConfigError):
        return None  # no usable file: the restore says why, if there is one


def _chat(args: argparse.Namespace) -> int:
    settings = GenerationSettings(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        overflow_policy=None if args.overflow == "error" else args.overflow,
    )
    documents = [load_document(path) for path in args.doc]
    cache_config = _cache_config(args)
    if args.download and not (args.model and Path(args.model).expanduser().exists()):  # a folder: nothing to fetch
        if not args.model:
            raise ConfigError("--download needs --model ORG/NAME: the model to fetch from Hugging Face.")
        repo = normalize_repo_id(args.model)
        if hf_cached_snapshot(repo) is None:
            _download(repo)
        args.model = repo
    # The app's store: a resumed conversation comes from it, and the chat is saved to it (unless --no-save).
    store = ConversationStore() if args.resume is not None or not args.no_save else None
    history: list[Message] = []
    if store is not None and args.resume is not None:
        _meta, messages = store.load_conversation(args.resume)
        history = ConversationStore.to_session_history(messages)
        cache_config = _resume_compression(args, CacheFolder(saved_caches_folder(store.path)), args.resume)
    path = resolve_model(args.model, progress=_progress)
    model, tokenizer, info = load_model(path)
    session = ChatSession(model, tokenizer, context_length=info.max_context, system_prompt=args.system,
                          settings=settings)
    if cache_config is not None:
        session.set_compression(cache_config)
    compression = _compression_label(cache_config)
    saved = None
    if store is not None:
        saved = _SavedChat(store, Path(path), info.name, write=not args.no_save, conversation_id=args.resume)
        session.history = history
        saved.restore(session)
    for document in documents:
        session.attach_document(document)
    level = _level_for(cache_config)
    if args.prompt is not None:
        _check_memory(session, info, level, args.prompt)
        degenerate = _saved_turn(session, args.prompt, args.stats, saved, compression)
        if degenerate:
            print(f"error: {degenerate}", file=sys.stderr)
            return EXIT_ERROR
        return 0
    print(f"Velox — chatting with {info.name}. Empty line or Ctrl-D quits; /new starts over; /doc PATH attaches.",
          file=sys.stderr)
    if args.resume is not None:
        print(f"[continuing conversation {args.resume}: {len(history)} messages]", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line or line in {"/quit", "/exit"}:
            return 0
        if line == "/new":
            session.new_chat()
            if saved is not None:
                saved.conversation_id = None  # the next question starts another saved conversation
            continue
        if line.startswith("/doc "):
            try:
                session.attach_document(load_document(line[5:].strip()))
                print("[attached]", file=sys.stderr)
            except VeloxError as error:
                print(f"error: {error}", file=sys.stderr)
            continue
        try:
            _check_memory(session, info, level, line)
        except VeloxError as error:
            print(f"error: {error}", file=sys.stderr)
            continue
        degenerate = _saved_turn(session, line, args.stats, saved, compression)
        if degenerate:
            print(f"warning: {degenerate}", file=sys.stderr)


def _saved_turn(session: Any, question: str, show_stats: bool, saved: _SavedChat | None, compression: str) -> str | None:
    """One turn (see `_run_turn`), then, unless the session refused it, the turn saved as the app saves it."""
    before = len(session.history)
    degenerate = _run_turn(session, question, show_stats)
    if saved is not None and len(session.history) == before + 2:
        saved.record(session, compression)
    return degenerate


def _chats() -> int:
    """Saved conversations, most recent first, one per line: ID, last change, messages, saved cache, title."""
    store = ConversationStore()
    caches = CacheFolder(saved_caches_folder(store.path))
    conversations = store.list_conversations()
    if not conversations:
        print("No saved conversations yet.", file=sys.stderr)
    for meta in conversations:
        file = caches.path_for(meta.id)
        cache = f"cache {format_bytes(file.stat().st_size)}" if file.is_file() else "no cache"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(meta.updated))
        print(f"{meta.id}  {when}  {meta.message_count} messages  {cache}  {meta.title}")
    return 0


def _models() -> int:
    for info in list_models():
        status = "ready" if info.ready else "not ready"
        print(f"{info.name:<40} {info.source:<9} {format_bytes(info.bytes_on_disk):>9} "
              f"ctx {info.max_context:>6}  {status}{'  — ' + info.note if info.note else ''}")
        if info.path:
            print(f"    {info.path}")
    return 0


def _info() -> int:
    snap = snapshot()
    print(f"velox {engine.__version__} on {platform.system()} {platform.machine()}, Python {platform.python_version()}")
    for key, value in runtime_status().items():
        print(f"{key}: {value}")
    print(f"memory: {format_bytes(snap.system_available)} available of {format_bytes(snap.system_total)} "
          f"({snap.pressure}, limited by {system_memory()['limited_by']}); "
          f"this process {format_bytes(snap.process_rss)}")
    print(f"MLX memory: active {format_bytes(snap.mlx_active)}, peak {format_bytes(snap.mlx_peak)}, "
          f"cache {format_bytes(snap.mlx_cache)}")
    print(f"log file: {log_path()}")
    return 0


def _methods() -> int:
    for line in describe_methods():
        print(line)
    return 0


def _levels() -> int:
    """One line per level: its bits, its configuration as one spec string (`KVCacheConfig.parse` reads it
    back), then its figures: effective bits where the level rule counts them (head_dim 128, 4096 tokens,
    sinks, windows and constants paid for) and what the committed quality sweep measured (kept in the table)."""
    for level in LEVELS:
        bits = level.budget_bits
        print(f"{level.key:>2}  {str(level.config):<36} {bits:.3f} bits at {BUDGET_TOKENS} tokens; "
              f"{level.measured or 'not measured'}")
    return 0


def _precompute(args: argparse.Namespace) -> int:
    path = resolve_model(args.model, progress=_progress)
    written = precompute(path, args.bits, args.out, texts=args.text, n_tokens=args.tokens, progress=_progress)
    codebooks = Path(args.out).expanduser().resolve()
    print(f"{written}  (use the spec {KVCacheConfig('vq', args.bits, args.bits, options={'codebooks': str(codebooks)})})")
    return 0


def _app(args: argparse.Namespace) -> int:
    from app.main import run_app  # Qt is loaded only for the desktop app, never for the terminal commands

    return run_app(model=args.model)


def run_command(args: argparse.Namespace, harness: Any = None) -> int:
    """Run the command `app.cli` parsed; the exit code. `harness` is the benchmark harness's CLI module
    when this runs from a source checkout (`velox bench`), else None."""
    try:
        if args.command == "chat":
            return _chat(args)
        if args.command == "models" and args.models_command == "download":
            print(_download(args.repo, args.revision))
            return 0
        if args.command == "models":
            return _models()
        if args.command == "info":
            return _info()
        if args.command == "chats":
            return _chats()
        if args.command == "methods":
            return _methods()
        if args.command == "levels":
            return _levels()
        if args.command == "precompute":
            return _precompute(args)
        if args.command == "app":
            return _app(args)
        if args.command == "serve":
            return serve_cli.run(args, _cache_config(args), _progress)
        if args.command == "bench":
            if harness is None:
                print(
                    "error: `velox bench` runs from a Velox source checkout: the benchmark harness "
                    "(benchmarks/harness) is not part of the installed app.",
                    file=sys.stderr,
                )
                return EXIT_ERROR
            return harness.run(args)
    except VeloxError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"error: unknown command {args.command!r}", file=sys.stderr)
    return EXIT_ERROR
