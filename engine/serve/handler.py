"""HTTP request handling of `velox serve`: mlx-lm's `APIHandler`, behind checks that make it safe to leave on.

mlx-lm's handler does the OpenAI work (parameters, chat templates, stop sequences, SSE streaming, usage).
In front of it this subclass adds what a local server needs: an optional API key, CORS only for the
origins given (mlx-lm allows `*` by default), a bounded body read (mlx-lm reads any Content-Length), a
bound on max_tokens, only the served model (mlx-lm would download any model a request names), text-only
messages (mlx-lm would fetch image URLs from the network), and every malformed request answered with a
4xx JSON error (OpenAI's shape) rather than an exception in a handler thread.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mlx_lm.server import APIHandler

log = logging.getLogger("velox.serve")

POST_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/completions")
# A body over the limit is read and dropped up to this many bytes, so the client (which is still sending)
# reads the 413 instead of a reset connection; beyond it the connection is simply closed.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
_DRAIN_CHUNK = 1024 * 1024
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class RequestLimits:
    """What the handler accepts."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens: int = 4096  # the most a request may ask for
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    served_names: frozenset[str] = field(default_factory=frozenset)
    model_name: str = "default"


class RequestError(Exception):
    """A request the server refuses: HTTP status, message for the client, OpenAI error code."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_body(body: Any, path: str, limits: RequestLimits) -> dict[str, Any]:
    """The request body, checked (RequestError otherwise); `stream_options` normalised for mlx-lm."""
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "'model' must be a string.")
    if model is not None and model not in limits.served_names:
        raise RequestError(
            404, f"The model {model!r} does not exist here; this server serves {limits.model_name!r} "
            "(also reachable as 'default').", "model_not_found",
        )
    # Answer with the served model's own name (OpenAI's replies name the model that answered; mlx-lm
    # would echo the alias asked for, or its internal 'default_model').
    body["model"] = limits.model_name
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise RequestError(400, f"'{name}' must be a positive integer, not {value!r}.")
        if value > limits.max_tokens:
            raise RequestError(400, f"'{name}' must be at most {limits.max_tokens} on this server, not {value}.")
    if body.get("n", 1) != 1:
        raise RequestError(400, "Only one choice per request is supported ('n' must be 1).")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        raise RequestError(400, "'stop' must be a string or a list of strings.")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise RequestError(400, "'stream_options' must be an object like {\"include_usage\": true}.")
        body["stream_options"] = {"include_usage": options.get("include_usage", False)}
    for name in ("adapters", "draft_model"):
        if body.get(name) is not None:
            raise RequestError(400, f"'{name}' is not supported by this server.")
    if path.endswith("/chat/completions"):
        _check_messages(body.get("messages"))
    elif not isinstance(body.get("prompt"), str):
        raise RequestError(400, "'prompt' must be a string.")
    return body


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of messages.")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in MESSAGE_ROLES:
            raise RequestError(
                400, f"messages[{index}] must be an object with a 'role' of {', '.join(MESSAGE_ROLES)}."
            )
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        text_parts = isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content
        )
        if not text_parts:
            raise RequestError(
                400, f"messages[{index}].content must be a string or a list of text parts (no images here)."
            )


class VeloxAPIHandler(APIHandler):
    """mlx-lm's handler with the checks of this module. One instance per connection (HTTP/1.0)."""

    limits = RequestLimits()  # replaced per server by `handler_class`
    # Socket reads and writes give up after this long, so a stalled client cannot hold a thread forever.
    timeout = 300

    # ----- responses ------------------------------------------------------------------------------------

    def send_response(self, code: int, message: str | None = None) -> None:
        self._responded = True
        super().send_response(code, message)

    def send_json_error(self, status: int, message: str, code: str | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        payload = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self._set_cors_headers()
        self.end_headers()
        self.wfile.write(payload)
        self.wfile.flush()

    def _set_cors_headers(self) -> None:
        # Only the configured origins, never '*' unless given; mlx-lm sends '*' and allows every method.
        origin = self.headers.get("Origin")
        allowed = self.limits.allowed_origins
        if origin is None or not ("*" in allowed or origin in allowed):
            return
        self.send_header("Access-Control-Allow-Origin", "*" if "*" in allowed else origin)
        self.send_header("Vary", "Origin")
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
        log.info("%s %s", self.address_string(), format % args)

    # ----- checks ------------------------------------------------------------------------------------------

    def _authorized(self) -> bool:
        key = self.limits.api_key
        if not key:
            return True
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return True
        self.send_json_error(401, "Missing or wrong API key (send 'Authorization: Bearer <key>').", "invalid_api_key")
        return False

    def _read_body(self) -> bytes:
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise RequestError(411, "A Content-Length header is required.")
        try:
            length = int(length_header)
        except ValueError:
            raise RequestError(400, "The Content-Length header is not a number.") from None
        if length < 0:
            raise RequestError(400, "The Content-Length header is negative.")
        if length > self.limits.max_body_bytes:
            self._drain(length)
            raise RequestError(
                413, f"The request body has {length} bytes; this server accepts at most "
                f"{self.limits.max_body_bytes}.", "request_too_large",
            )
        body = self.rfile.read(length)
        if len(body) < length:
            raise RequestError(400, "The request body ended before its Content-Length.")
        return body

    def _drain(self, length: int) -> None:
        if length > DRAIN_LIMIT_BYTES:
            self.close_connection = True
            return
        left = length
        while left > 0:
            chunk = self.rfile.read(min(_DRAIN_CHUNK, left))
            if not chunk:
                break
            left -= len(chunk)

    # ----- methods -----------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._guarded(self._get)

    def do_POST(self) -> None:
        self._guarded(self._post)

    def _guarded(self, handle: Any) -> None:
        """Run `handle`; a refused request gets its JSON error; anything unexpected a 500 (if nothing was
        sent yet) and one log line; a client that went away ends the request quietly."""
        self._responded = False
        try:
            handle()
        except RequestError as error:
            self.send_json_error(error.status, str(error), error.code)
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as error:
            log.info("client %s went away: %s", self.address_string(), type(error).__name__)
            self.close_connection = True
        except Exception as error:  # a bug or an MLX failure: answer, log one line, keep serving
            log.error("request failed: %s: %s", type(error).__name__, error)
            if not self._responded:
                self.send_json_error(500, f"The server failed on this request: {type(error).__name__}.")
            self.close_connection = True

    def _get(self) -> None:
        path = urlsplit(self.path).path
        if path == "/health":
            self.handle_health_check()
            return
        if not self._authorized():
            return
        if path == "/v1/models" or path.startswith("/v1/models/"):
            self._models(path)
            return
        raise RequestError(404, f"Unknown endpoint {path}.", "not_found")

    def _models(self, path: str) -> None:
        names = [self.limits.model_name, "default"]
        wanted = path[len("/v1/models/"):] if path.startswith("/v1/models/") else None
        if wanted is not None and wanted not in self.limits.served_names:
            raise RequestError(404, f"The model {wanted!r} does not exist here.", "model_not_found")
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "velox"} for name in names]
        payload = cards[0] if wanted is not None else {"object": "list", "data": cards}
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self._set_cors_headers()
        self.end_headers()
        self.wfile.write(body)

    def _post(self) -> None:
        path = urlsplit(self.path).path
        if path not in POST_PATHS:
            raise RequestError(404, f"Unknown endpoint {path}.", "not_found")
        if not self._authorized():
            return
        raw = self._read_body()
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise RequestError(400, f"The request body is not valid JSON: {error}.") from None
        body = check_body(body, path, self.limits)
        # Hand the checked body to mlx-lm's handler, which reads it from rfile with its Content-Length.
        checked = json.dumps(body).encode()
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(checked))
        self.path = path
        connection_file = self.rfile
        self.rfile = io.BytesIO(checked)
        try:
            super().do_POST()
        finally:
            self.rfile = connection_file


def handler_class(limits: RequestLimits) -> type[VeloxAPIHandler]:
    """A handler class bound to one server's limits."""
    return type("BoundVeloxAPIHandler", (VeloxAPIHandler,), {"limits": limits})
