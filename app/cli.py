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

EXIT_ERROR = 1
EXIT_USAGE = 2


def _prepare_runtime() -> None:
    from engine.runtime import prepare_runtime

    prepare_runtime()


def _progress(message: str, fraction: float) -> None:
    print(f"\r[{fraction * 100:5.1f}%] {message:<60}", end="", file=sys.stderr, flush=True)
    if fraction >= 1.0:
        print(file=sys.stderr)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="velox", description="Chat with long documents on a local LLM.")
    sub = parser.add_subparsers(dest="command")

    chat = sub.add_parser("chat", help="chat in the terminal (interactive, or one-shot with --prompt)")
    chat.add_argument("--model", "-m", default=None, help="model folder, 'org/name' in the HF cache, or 'default'")
    chat.add_argument("--doc", "-d", action="append", default=[], help="attach a document (txt, md, pdf, html)")
    chat.add_argument("--prompt", "-p", default=None, help="ask one question, print the answer and exit")
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", "--temp", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--seed", type=int, default=0)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument(
        "--overflow", choices=["error", "drop-oldest", "truncate-middle"], default="error",
        help="what to do when the conversation exceeds the context (default: stop with an error)",
    )
    chat.add_argument("--kv", default=None, help="KV cache compression method (see `velox methods`)")
    chat.add_argument("--kv-bits", type=int, default=None, help="bits per value for the compressed KV cache")
    chat.add_argument("--stats", action="store_true", help="print speed and memory figures after each reply")

    sub.add_parser("models", help="list available models")
    sub.add_parser("info", help="show machine, MLX and memory facts")
    sub.add_parser("methods", help="list KV cache compression methods")
    sub.add_parser("levels", help="the app's compression levels: bits, configuration spec, measured figures")
    precompute = sub.add_parser("precompute", help="calibrate the vq method's codebooks for a model")
    precompute.add_argument("model", help="model folder, 'org/name' in the HF cache, or 'default'")
    precompute.add_argument("--bits", type=int, required=True, help="bits per coordinate (1, 2, 3 or 4)")
    precompute.add_argument("--out", required=True, help="folder for the codebook file")
    precompute.add_argument("--text", action="append", default=[],
                            help="calibration text file (default: text the model writes itself)")
    precompute.add_argument("--tokens", type=int, default=2048, help="calibration tokens (default 2048)")
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


def _print_stats(stats: Any) -> None:
    from engine.planning.memory import format_bytes

    print(
        f"[{stats.prompt_tokens} prompt tokens ({stats.reused_tokens} reused), "
        f"prefill {stats.prefill_tokens_per_second:.1f} tok/s, decode {stats.decode_tokens_per_second:.1f} tok/s, "
        f"TTFT {stats.time_to_first_token:.2f} s, peak {format_bytes(stats.peak_memory_bytes)}, "
        f"KV cache {format_bytes(stats.kv_cache_bytes)}]",
        file=sys.stderr,
    )


def _run_turn(session: Any, question: str, show_stats: bool) -> None:
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
    except KeyboardInterrupt:
        # Ctrl-C while the generator was running: the session's own cleanup already ran in `finally`.
        session.cancel()
        print("\n[stopped]", file=sys.stderr)


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
    if args.prompt is not None:
        _run_turn(session, args.prompt, args.stats)
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
        _run_turn(session, line, args.stats)


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
    from engine.planning.memory import format_bytes, snapshot
    from engine.runtime import runtime_status

    snap = snapshot()
    print(f"velox {engine.__version__} on {platform.system()} {platform.machine()}, Python {platform.python_version()}")
    for key, value in runtime_status().items():
        print(f"{key}: {value}")
    print(f"memory: {format_bytes(snap.system_available)} available of {format_bytes(snap.system_total)} "
          f"({snap.pressure}); this process {format_bytes(snap.process_rss)}")
    print(f"MLX memory: active {format_bytes(snap.mlx_active)}, peak {format_bytes(snap.mlx_peak)}, "
          f"cache {format_bytes(snap.mlx_cache)}")
    print(f"log file: {log_path()}")
    return 0


def _methods() -> int:
    from engine.kvcache import describe_methods

    for line in describe_methods():
        print(line)
    return 0


def _levels() -> int:
    """One line per level: key, effective bits (head_dim 128, 4096 tokens, everything counted), the config
    as one spec string, then the figures the committed quality sweep measured for it (kept in the table)."""
    from engine.planning.recommend import BUDGET_HEAD_DIM, BUDGET_KV_HEADS, BUDGET_TOKENS, LEVELS

    for level in LEVELS:
        bits = level.bits_per_value(BUDGET_HEAD_DIM, BUDGET_TOKENS, BUDGET_KV_HEADS)
        figures = "reference" if level.method in ("fp16", "fp32") else level.measured or "not measured"
        print(f"{level.key:>2}  {bits:6.3f}  {level.spec:<40} {figures}")
    return 0


def _precompute(args: argparse.Namespace) -> int:
    from engine.kvcache.calibration import precompute
    from engine.models.catalog import resolve_model

    path = resolve_model(args.model, progress=_progress)
    written = precompute(path, args.bits, args.out, texts=args.text, n_tokens=args.tokens, progress=_progress)
    print(f"{written}  (use the spec vq:{args.bits}+codebooks={Path(args.out).expanduser().resolve()})")
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
        if args.command == "levels":
            return _levels()
        if args.command == "precompute":
            return _precompute(args)
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
