"""`velox serve`: its arguments and its run, kept out of app/cli.py (which only registers them).

The server prints `SERVING_PREFIX` + its base URL on stdout once it answers; the app's "Local server"
switch (app/server_control.py) waits for that line.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from engine.serve.example import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_PREFILL_STEP, client_example

SERVING_PREFIX = "Serving at "
LEVEL_CHOICES = ("16", "8", "4", "3", "2")  # the app's compression levels (engine.planning.recommend)
DEFAULT_LEVEL = "4"
MB = 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "A local OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models) on mlx-lm's "
        "server, with Velox's compressed KV cache. Prompt caches are reused across requests."
    )
    parser.epilog = (
        f"Point the openai Python client (pip install openai) at it:\n\n{client_example()}\n"
        "Streaming (stream=True), stop, max_tokens, temperature, top_p and seed work as in OpenAI's API; "
        "usage.prompt_tokens_details.cached_tokens says how many prompt tokens came from the prompt cache."
    )
    parser.add_argument("--model", "-m", default=None, help="model folder, 'org/name' in the HF cache, or 'default'")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST}: this "
                        "machine only; anything else exposes the model to the network)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free)")
    parser.add_argument("--level", choices=LEVEL_CHOICES, default=None,
                        help=f"the app's compression level in bits (default {DEFAULT_LEVEL}; 16 = uncompressed)")
    parser.add_argument("--kv", default=None, help="KV cache method instead of a level (see `velox methods`)")
    parser.add_argument("--kv-bits", type=int, default=None, help="bits per value for --kv")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a browser origin allowed by CORS, e.g. http://localhost:3000 (default: none)")
    parser.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body (default 4 MB)")
    parser.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask")
    parser.add_argument("--prompt-cache-mb", type=float, default=1024.0,
                        help="bytes of KV caches kept for reuse across requests, in MB (default 1024)")
    parser.add_argument("--prefill-step-size", type=int, default=None, metavar="N",
                        help="prompt tokens run through the model at once (default "
                        f"{DEFAULT_PREFILL_STEP}); smaller steps lower the peak memory of long prompts")
    parser.add_argument("--verbose", "-v", action="store_true", help="log every request")


def _cache_config(args: argparse.Namespace, kv_config: Any) -> Any:
    """The KVCacheConfig to serve with (None = uncompressed); `kv_config` is app.cli's --kv/--kv-bits one."""
    from engine.errors import ConfigError  # with the engine, once the command runs (app.cli stays light)

    if args.level is not None and (args.kv is not None or args.kv_bits is not None):
        raise ConfigError("Give either --level or --kv/--kv-bits, not both.")
    if kv_config is not None:
        return kv_config
    from engine.planning.recommend import UNCOMPRESSED_LEVEL_KEY, level_by_key  # as above

    level = args.level or DEFAULT_LEVEL
    return None if level == UNCOMPRESSED_LEVEL_KEY else level_by_key(level).config


def run(args: argparse.Namespace, kv_config: Any, progress: Any) -> int:
    """Serve until Ctrl-C. VeloxErrors (bad option, port taken, model fails) go to app.cli as one line."""
    # These load MLX and mlx-lm: only once `velox serve` runs, never for `velox --help`.
    from engine.models.catalog import resolve_model
    from engine.serve.server import ServeOptions, VeloxServer, is_loopback

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    options = ServeOptions(
        model=str(resolve_model(args.model, progress=progress)),
        host=args.host,
        port=args.port,
        cache_config=_cache_config(args, kv_config),
        api_key=args.api_key,
        allowed_origins=tuple(args.allow_origin),
        max_body_bytes=int(args.max_body_mb * MB),
        max_tokens_limit=args.max_tokens_limit,
        default_max_tokens=min(512, args.max_tokens_limit),
        prompt_cache_bytes=int(args.prompt_cache_mb * MB),
        prefill_step_size=DEFAULT_PREFILL_STEP if args.prefill_step_size is None else args.prefill_step_size,
    )
    if not is_loopback(args.host):
        print(f"warning: listening on {args.host}, not only this machine: anyone who can reach it can use the "
              f"model{'' if args.api_key else ' (no --api-key set)'}.", file=sys.stderr)
    server = VeloxServer(options)
    print("Loading the model …", file=sys.stderr, flush=True)
    try:
        server.start()
        print(f"{SERVING_PREFIX}{server.base_url}", flush=True)
        print(f"model {server.model_name!r} (or 'default'), KV cache {server.cache_description()}; "
              "Ctrl-C stops.", file=sys.stderr, flush=True)
        server.wait()
    except KeyboardInterrupt:
        print("\nstopping", file=sys.stderr)
    finally:
        server.stop()
    return 0
