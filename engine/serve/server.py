"""`VeloxServer`: mlx-lm's OpenAI-compatible server (its ResponseGenerator: queueing, prompt cache reuse,
generation) on one Velox model with Velox's KV caches, behind `VeloxAPIHandler`'s checks.

    server = VeloxServer(ServeOptions(port=0, cache_config=level_by_key("4").config))
    server.start()           # loads the model, binds, serves on a background thread
    print(server.base_url)   # http://127.0.0.1:PORT/v1
    server.stop()
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

import mlx.core as mx
from mlx_lm.server import ResponseGenerator

from engine.errors import ModelError, VeloxError
from engine.serve.example import DEFAULT_PREFILL_STEP, base_url
from engine.serve.handler import RequestLimits, handler_class
from engine.serve.provider import VeloxModelProvider, VeloxPromptCache, serving_cache_factory

log = logging.getLogger("velox.serve")

LOAD_TIMEOUT_S = 600.0


class ServeError(VeloxError):
    """The server cannot start (address in use, bad option, model failed to load)."""


@dataclass(frozen=True)
class ServeOptions:
    """Everything `velox serve` can be told."""

    model: str | None = None  # a catalogue spec: None/'default', a folder, or 'org/name' in the HF cache
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port
    cache_config: Any = None  # a KVCacheConfig; None: uncompressed (see serving_cache_factory)
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens_limit: int = 4096
    default_max_tokens: int = 512
    prompt_cache_bytes: int = 1024 * 1024 * 1024  # bytes of caches kept for reuse across requests
    prompt_cache_entries: int = 10
    prefill_step_size: int = DEFAULT_PREFILL_STEP

    def check(self) -> None:
        for name in ("max_body_bytes", "max_tokens_limit", "default_max_tokens", "prompt_cache_entries",
                     "prefill_step_size"):
            if getattr(self, name) < 1:
                raise ServeError(f"{name.replace('_', '-')} must be at least 1.")
        if self.prompt_cache_bytes < 0:
            raise ServeError("The prompt cache budget cannot be negative.")
        if not 0 <= self.port <= 65535:
            raise ServeError(f"The port must be between 0 and 65535, not {self.port}.")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ServeError("The default max tokens cannot exceed the max tokens limit.")


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (binding there is unreachable from the network)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _mlx_lm_arguments(options: ServeOptions) -> argparse.Namespace:
    """The `cli_args` mlx-lm's ModelProvider and ResponseGenerator read, from Velox's options."""
    return argparse.Namespace(
        model=None, adapter_path=None, draft_model=None, trust_remote_code=False, chat_template="",
        use_default_chat_template=False, chat_template_args={}, pipeline=False,
        host=options.host, port=options.port, allowed_origins=list(options.allowed_origins),
        num_draft_tokens=3, max_tokens=options.default_max_tokens, temp=0.0, top_p=1.0, top_k=0, min_p=0.0,
        decode_concurrency=32, prompt_concurrency=8, prefill_step_size=options.prefill_step_size,
        prompt_cache_size=options.prompt_cache_entries, prompt_cache_bytes=options.prompt_cache_bytes,
        # mlx-lm's own KV quantization stays off: the caches are Velox's, made by the model's make_cache.
        kv_bits=None, kv_group_size=64, quantized_kv_start=0, log_level="INFO",
    )


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback here; the handler already answered what it could.
        error = sys.exc_info()[1]
        log.warning("connection from %s failed: %s", client_address[0], type(error).__name__)


class VeloxResponseGenerator(ResponseGenerator):
    """mlx-lm's generation thread, which also destroys the MLX streams it made before it ends: streams left
    to process exit abort it now and then ("terminate called without an active exception")."""

    def _run_generate(self) -> None:
        try:
            super()._run_generate()
        finally:
            mx.synchronize()
            mx.clear_streams()


class VeloxServer:
    """One model served over the OpenAI API. `start()` returns once it answers; `stop()` shuts it down."""

    def __init__(self, options: ServeOptions, *, loaded: tuple[Any, Any, Any] | None = None) -> None:
        options.check()
        self.options = options
        self.cache_factory = serving_cache_factory(options.cache_config)
        self.provider = VeloxModelProvider(
            _mlx_lm_arguments(options), self.cache_factory, model_spec=options.model, loaded=loaded
        )
        self.prompt_cache = VeloxPromptCache(options.prompt_cache_entries, options.prompt_cache_bytes)
        self.generator: Any = None
        self.httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port = options.port

    # ----- facts -------------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        return base_url(self.options.host, self.port)

    @property
    def model_name(self) -> str:
        return self.provider.model_name

    def cache_description(self) -> str:
        config = self.options.cache_config
        return "uncompressed" if config is None else config.describe()

    # ----- life cycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the address, load the model on mlx-lm's generation thread, then serve in the background.
        ServeError (one line) if the address is taken or the model does not load."""
        self.httpd = self._bind()
        self._port = int(self.httpd.server_address[1])
        self.generator = VeloxResponseGenerator(self.provider, self.prompt_cache)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while self.provider.model is None and self.provider.load_error is None:
            if time.monotonic() > deadline or not self.generator.generation_available():
                break
            time.sleep(0.05)
        if self.provider.model is None:
            reason = self.provider.load_error or "the model did not load"
            self.stop()
            raise ModelError(reason) if self.provider.load_error else ServeError(reason)
        limits = RequestLimits(
            max_body_bytes=self.options.max_body_bytes,
            max_tokens=self.options.max_tokens_limit,
            api_key=self.options.api_key or None,
            allowed_origins=tuple(self.options.allowed_origins),
            served_names=frozenset(self.provider.served_names),
            model_name=self.provider.model_name,
        )
        bound_handler = handler_class(limits)
        generator = self.generator
        self.httpd.RequestHandlerClass = lambda *args, **kwargs: bound_handler(generator, *args, **kwargs)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="velox-serve-http", daemon=True)
        self._thread.start()

    def _bind(self) -> _HTTPServer:
        host, port = self.options.host, self.options.port
        try:
            family, _, _, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
        except socket.gaierror as error:
            raise ServeError(f"Cannot resolve the host {host!r}: {error.strerror}.") from None

        class Bound(_HTTPServer):
            address_family = family

        try:
            # The handler class is set in start() once the model is loaded; nothing is accepted before.
            return Bound(address, lambda *args: None, bind_and_activate=True)
        except OSError as error:
            raise ServeError(f"Cannot listen on {host}:{port}: {error.strerror or error}.") from None

    def wait(self) -> None:
        """Block until the server stops (KeyboardInterrupt passes through to the caller)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        """Stop answering, end the generation thread; safe to call more than once."""
        if self.httpd is not None:
            if self._thread is not None:
                self.httpd.shutdown()
                self._thread.join()
            self.httpd.server_close()
            self.httpd = None
        if self.generator is not None:
            self.generator.stop_and_join()
            self.generator = None
        self._thread = None
