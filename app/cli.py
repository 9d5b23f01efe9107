"""`velox` command line: chat in the terminal, list models, show machine facts.

Errors are one clear line on stderr and a non-zero exit code, never a traceback.
MLX is imported only through `engine`, and only after the optional Linux CPU fast path is set up
(it must run before `mlx.core` is first imported).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.logs import log_path, setup_logging, unexpected_error_line
from app.settings import MAX_TEMPERATURE  # the app's range: above it sampling is noise (no MLX import)

EXIT_ERROR = 1
EXIT_USAGE = 2


def _prepare_runtime() -> None:
    from engine.runtime import prepare_runtime

    prepare_runtime()


def _progress(message: str, fraction: float) -> None:
    print(f"\r[{fraction * 100:5.1f}%] {message:<60}", end="", file=sys.stderr, flush=True)
    if fraction >= 1.0:
        print(file=sys.stderr)


def _number_checker(kind: type, accepts: Any, meaning: str) -> Any:
    """An argparse `type=` that converts with `kind` and accepts only values `accepts` allows: a bad value
    is one usage line from argparse, not a traceback later or, worse, nonsense output."""

    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected {meaning}") from None
        if value != value or not accepts(value):  # value != value: NaN
            raise argparse.ArgumentTypeError(f"{text} is out of range; expected {meaning}")
        return value

    return check


_positive_int = _number_checker(int, lambda value: value >= 1, "a whole number of at least 1")
_non_negative_int = _number_checker(int, lambda value: value >= 0, "a whole number of at least 0")
_temperature = _number_checker(float, lambda value: 0.0 <= value <= MAX_TEMPERATURE,
                               f"a temperature from 0 to {MAX_TEMPERATURE:g}")
_probability = _number_checker(float, lambda value: 0.0 < value <= 1.0, "a probability above 0 and at most 1")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="velox", description="Chat with long documents on a local LLM.")
    sub = parser.add_subparsers(dest="command")

    chat = sub.add_parser("chat", help="chat in the terminal (interactive, or one-shot with --prompt)")
    chat.add_argument("--model", "-m", default=None, help="model folder, 'org/name' in the HF cache, or 'default'")
    chat.add_argument("--doc", "-d", action="append", default=[], help="attach a document (txt, md, pdf, html)")
    chat.add_argument("--prompt", "-p", default=None, help="ask one question, print the answer and exit")
    chat.add_argument("--max-tokens", type=_positive_int, default=512, help="longest reply, in tokens (>= 1)")
    chat.add_argument("--temperature", "--temp", type=_temperature, default=0.0,
                      help=f"sampling temperature, 0 (greedy) to {MAX_TEMPERATURE:g}")
    chat.add_argument("--top-p", type=_probability, default=1.0, help="nucleus sampling mass, in (0, 1]")
    chat.add_argument("--seed", type=_non_negative_int, default=0)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument(
        "--overflow", choices=["error", "drop-oldest", "truncate-middle"], default="error",
        help="what to do when the conversation exceeds the context (default: stop with an error)",
    )
    chat.add_argument("--kv", default=None, help="KV cache compression method (see `velox methods`)")
    chat.add_argument("--kv-bits", type=_positive_int, default=None, help="bits per value for the compressed KV cache")
    chat.add_argument("--stats", action="store_true", help="print speed and memory figures after each reply")

    sub.add_parser("models", help="list available models")
    sub.add_parser("info", help="show machine, MLX and memory facts")
    sub.add_parser("methods", help="list KV cache compression methods")
    app = sub.add_parser("app", help="start the desktop app")
    app.add_argument("--model", "-m", default=None)
    bench = sub.add_parser("bench", help="benchmark the KV caches (quality, memory, speed; from a source checkout)")
    harness = _bench_harness()
    if harness is not None:
        harness.add_arguments(bench)
    else:
        bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def _bench_harness() -> Any:
    """The benchmark harness's CLI module, or None: it lives in a source checkout's `benchmarks/`
    (it is not installed with the app), found beside the `app` package this runs from."""
    checkout = Path(__file__).resolve().parents[1]
    if not (checkout / "benchmarks" / "harness" / "cli.py").is_file():
        return None
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from benchmarks.harness import cli  # MLX-free at import

    return cli


def _cache_config(args: argparse.Namespace) -> Any:
    if args.kv is None and args.kv_bits is None:
        return None
    from engine.kvcache import KVCacheConfig
    from engine.planning.recommend import LEVELS

    # Without --kv, the method is the one the app's compression level of that many bits uses (the level
    # table follows the committed quality benchmark); --kv-bits alone picks that level outright.
    levels = {level.key: level for level in LEVELS}
    if args.kv is None and str(args.kv_bits) in levels:
        return levels[str(args.kv_bits)].to_config()
    method = args.kv or levels["4"].method
    if args.kv_bits is None:
        return KVCacheConfig(method=method)
    return KVCacheConfig(method=method, key_bits=args.kv_bits, value_bits=args.kv_bits)


def _level_key(cache_config: Any) -> str:
    """The app's compression level whose memory estimate covers `cache_config`: the level itself, else the
    level with as many key bits, else the 16-bit level (an upper bound for every quantized method)."""
    from engine.planning.recommend import LEVELS

    if cache_config is None:
        return LEVELS[0].key
    for level in LEVELS:
        if level.to_config() == cache_config:
            return level.key
    same_bits = [level.key for level in LEVELS if level.key_bits == getattr(cache_config, "key_bits", None)]
    return same_bits[0] if same_bits else LEVELS[0].key


def _check_memory(session: Any, info: Any, level_key: str, question: str) -> None:
    """Refuse a turn whose KV cache would not fit in the memory this process may use (cgroup limits
    included), before any token is read: MemoryBudgetError with the engine's explanation. The app does
    the same check before it reads a document (app/worker.py)."""
    from engine.chat.session import Message
    from engine.planning.memory import system_memory
    from engine.planning.recommend import check_fits

    draft = [*session.history, Message("user", question, list(session.pending_documents))]
    n_tokens = min(len(session.render_tokens(draft)) + session.settings.max_tokens, session.context_length)
    held = session.kv_cache_bytes()  # already allocated: out of "available", but ours to reuse
    check_fits(info, n_tokens, level_key, system_memory()["available"] + held, weights_bytes=0)


def _print_stats(stats: Any) -> None:
    from engine.planning.memory import format_bytes

    print(
        f"[{stats.prompt_tokens} prompt tokens ({stats.reused_tokens} reused), "
        f"prefill {stats.prefill_tokens_per_second:.1f} tok/s, decode {stats.decode_tokens_per_second:.1f} tok/s, "
        f"TTFT {stats.time_to_first_token:.2f} s, peak {format_bytes(stats.peak_memory_bytes)}, "
        f"KV cache {format_bytes(stats.kv_cache_bytes)}]",
        file=sys.stderr,
    )


def _run_turn(session: Any, question: str, show_stats: bool) -> str | None:
    """Stream one reply to stdout; returns why the reply was degenerate (see engine.chat.reply_check),
    or None for a normal (or stopped) reply."""
    from engine.chat.reply_check import degenerate_reply
    from engine.chat.session import GenerationStats, Notice, PrefillProgress, TextChunk

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


def _chat(args: argparse.Namespace) -> int:
    from engine.chat.documents import load_document
    from engine.chat.session import ChatSession, GenerationSettings
    from engine.models.catalog import load_model, resolve_model

    settings = GenerationSettings(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        overflow_policy=None if args.overflow == "error" else args.overflow,
    )
    documents = [load_document(path) for path in args.doc]
    cache_config = _cache_config(args)
    path = resolve_model(args.model, progress=_progress)
    model, tokenizer, info = load_model(path)
    session = ChatSession(model, tokenizer, context_length=info.max_context, system_prompt=args.system,
                          settings=settings)
    if cache_config is not None:
        session.set_compression(cache_config)
    for document in documents:
        session.attach_document(document)
    level_key = _level_key(cache_config)
    if args.prompt is not None:
        _check_memory(session, info, level_key, args.prompt)
        degenerate = _run_turn(session, args.prompt, args.stats)
        if degenerate:
            print(f"error: {degenerate}", file=sys.stderr)
            return EXIT_ERROR
        return 0
    print(f"Velox — chatting with {info.name}. Empty line or Ctrl-D quits; /new starts over; /doc PATH attaches.",
          file=sys.stderr)
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
            continue
        if line.startswith("/doc "):
            from engine.errors import VeloxError

            try:
                session.attach_document(load_document(line[5:].strip()))
                print("[attached]", file=sys.stderr)
            except VeloxError as error:
                print(f"error: {error}", file=sys.stderr)
            continue
        from engine.errors import VeloxError

        try:
            _check_memory(session, info, level_key, line)
        except VeloxError as error:
            print(f"error: {error}", file=sys.stderr)
            continue
        degenerate = _run_turn(session, line, args.stats)
        if degenerate:
            print(f"warning: {degenerate}", file=sys.stderr)


def _models() -> int:
    from engine.models.catalog import list_models
    from engine.planning.memory import format_bytes

    for info in list_models():
        status = "ready" if info.ready else "not ready"
        print(f"{info.name:<40} {info.source:<9} {format_bytes(info.bytes_on_disk):>9} "
              f"ctx {info.max_context:>6}  {status}{'  — ' + info.note if info.note else ''}")
        if info.path:
            print(f"    {info.path}")
    return 0


def _info() -> int:
    import platform

    import engine
    from engine.planning.memory import format_bytes, snapshot, system_memory
    from engine.runtime import runtime_status

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
    from engine.kvcache import describe_methods

    for line in describe_methods():
        print(line)
    return 0


def _app(args: argparse.Namespace) -> int:
    from app.main import run_app

    return run_app(model=args.model)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    setup_logging()
    _prepare_runtime()
    from engine.errors import VeloxError

    try:
        if args.command == "chat":
            return _chat(args)
        if args.command == "models":
            return _models()
        if args.command == "info":
            return _info()
        if args.command == "methods":
            return _methods()
        if args.command == "app":
            return _app(args)
        if args.command == "bench":
            harness = _bench_harness()
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
        return 130
    except Exception as error:  # noqa: BLE001 - the one place that turns any bug into a line + a log entry
        logging.getLogger("app").exception("velox %s failed", args.command)
        print(f"error: {unexpected_error_line(error)}", file=sys.stderr)
        return EXIT_ERROR
    parser.print_help()
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
