"""`velox` command line: chat in the terminal, list models, show machine facts.

Errors are one clear line on stderr and a non-zero exit code, never a traceback. This module is the
parser and nothing else; the commands are in `app.commands`, imported once a command runs, so `velox
--help` and usage errors do not load the engine (mlx-lm imports transformers: ~2.5 s of CPU on the
2-core test machine, against ~0.3 s for the parser alone).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.logs import setup_logging, unexpected_error_line

EXIT_ERROR = 1
EXIT_USAGE = 2


def _build_parser(harness: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="velox", description="Chat with long documents on a local LLM.")
    sub = parser.add_subparsers(dest="command")

    chat = sub.add_parser("chat", help="chat in the terminal (interactive, or one-shot with --prompt)")
    chat.add_argument("--model", "-m", default=None, help="model folder, 'org/name' in the HF cache, or 'default'")
    chat.add_argument("--download", action="store_true",
                      help="download --model from Hugging Face first if it is not in the HF cache yet")
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

    models = sub.add_parser("models", help="list available models, or download one")
    models_sub = models.add_subparsers(dest="models_command")
    download = models_sub.add_parser("download", help="download an MLX model from Hugging Face (resumable)")
    download.add_argument("repo", help="'org/name', or a bare name from mlx-community")
    download.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    sub.add_parser("info", help="show machine, MLX and memory facts")
    sub.add_parser("methods", help="list KV cache compression methods")
    app = sub.add_parser("app", help="start the desktop app")
    app.add_argument("--model", "-m", default=None)
    bench = sub.add_parser("bench", help="benchmark the KV caches (quality, memory, speed; from a source checkout)")
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
    from benchmarks.harness import cli  # only in a source checkout: found at run time, never installed

    return cli


def main(argv: Sequence[str] | None = None) -> int:
    harness = _bench_harness()
    parser = _build_parser(harness)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    setup_logging()
    try:
        from app.commands import run_command  # loads the engine: only once a command runs (see above)

        return run_command(args, harness)
    except Exception as error:  # noqa: BLE001 - the one place that turns any bug into a line + a log entry
        logging.getLogger("app").exception("velox %s failed", args.command)
        print(f"error: {unexpected_error_line(error)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
