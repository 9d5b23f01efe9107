"""`velox` command line: chat in the terminal, list models, show machine facts.

Errors are one clear line on stderr and a non-zero exit code, never a traceback. This module is the
parser and nothing else; the commands are in `app.commands`, imported once a command runs, so `velox
--help` and usage errors do not load the engine (mlx-lm imports transformers: ~2.5 s of CPU on the
2-core test machine, against ~0.3 s for the parser alone).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app import serve_cli  # MLX-free: its arguments and the client example only
from app.logs import setup_logging, unexpected_error_line
from app.settings import MAX_TEMPERATURE  # the app's range: above it sampling is noise (no MLX import)

EXIT_ERROR = 1
EXIT_USAGE = 2


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


def _build_parser(harness: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="velox", description="Chat with long documents on a local LLM.")
    sub = parser.add_subparsers(dest="command")

    chat = sub.add_parser("chat", help="chat in the terminal (interactive, or one-shot with --prompt)")
    chat.add_argument("--model", "-m", default=None, help="model folder, 'org/name' in the HF cache, or 'default'")
    chat.add_argument("--download", action="store_true",
                      help="download --model from Hugging Face first if it is not in the HF cache yet")
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
    chat.add_argument("--kv", default=None,
                      help="KV cache compression: a method (see `velox methods`) or a full cache spec such as "
                           "kivi:k4v4:g64 or rotated:k3v2:g32:w128")
    chat.add_argument("--kv-bits", type=_positive_int, default=None, help="bits per value for the compressed KV cache")
    chat.add_argument("--stats", action="store_true", help="print speed and memory figures after each reply")
    chat.add_argument("--resume", type=_positive_int, default=None, metavar="ID",
                      help="continue a saved conversation (IDs from `velox chats`), reusing its saved cache")
    chat.add_argument("--no-save", action="store_true",
                      help="do not save this chat as a conversation (by default it is, like the app's chats)")
    sub.add_parser("chats", help="list saved conversations, most recent first (ID first)")

    models = sub.add_parser("models", help="list available models, or download one")
    models_sub = models.add_subparsers(dest="models_command")
    download = models_sub.add_parser("download", help="download an MLX model from Hugging Face (resumable)")
    download.add_argument("repo", help="'org/name', or a bare name from mlx-community")
    download.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    sub.add_parser("info", help="show machine, MLX and memory facts")
    sub.add_parser("methods", help="list KV cache compression methods")
    sub.add_parser("levels", help="the app's compression levels: bits, configuration spec, measured figures")
    precompute = sub.add_parser("precompute", help="calibrate the vq method's codebooks for a model")
    precompute.add_argument("model", help="model folder, 'org/name' in the HF cache, or 'default'")
    precompute.add_argument("--bits", type=_positive_int, required=True, help="bits per coordinate (1, 2, 3 or 4)")
    precompute.add_argument("--out", required=True, help="folder for the codebook file")
    precompute.add_argument("--text", action="append", default=[],
                            help="calibration text file (default: text the model writes itself)")
    precompute.add_argument("--tokens", type=_positive_int, default=2048, help="calibration tokens (default 2048)")
    app = sub.add_parser("app", help="start the desktop app")
    app.add_argument("--model", "-m", default=None)
    serve_cli.add_arguments(sub.add_parser("serve", help="a local OpenAI-compatible server with the compressed KV cache"))
    bench = sub.add_parser("bench", help="benchmark the KV caches (quality, memory, speed, decode; from a source checkout)")
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
    except BrokenPipeError:
        # The reader went away (`velox levels | head`): not an error. Point stdout at devnull so the interpreter's
        # final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as error:  # noqa: BLE001 - the one place that turns any bug into a line + a log entry
        logging.getLogger("app").exception("velox %s failed", args.command)
        print(f"error: {unexpected_error_line(error)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
