"""Errors the engine raises on purpose: each carries a message fit to show a person as it is."""

from __future__ import annotations


class VeloxError(Exception):
    """Base class: a clear, one-line explanation of what went wrong and what to do about it."""


class ModelError(VeloxError):
    """A model file or folder is missing, corrupt, or of an architecture we do not support."""


class DownloadError(VeloxError):
    """A download could not be done (offline, not found, checksum mismatch)."""


class DocumentError(VeloxError):
    """A document cannot be read as text (empty, binary, encrypted, undecodable, too large)."""


class ContextOverflowError(VeloxError):
    """The conversation does not fit in the model's context window."""

    DEFAULT_ADVICE = (
        "Choose an overflow policy ('drop-oldest' turns or 'truncate-middle' of the document), or shorten the input."
    )

    def __init__(self, needed_tokens: int, limit_tokens: int, detail: str = "", advice: str | None = None) -> None:
        self.needed_tokens = needed_tokens
        self.limit_tokens = limit_tokens
        self.overflow_tokens = needed_tokens - limit_tokens
        message = (
            f"The conversation needs {needed_tokens} tokens but the model's context holds {limit_tokens}: "
            f"it overflows by {self.overflow_tokens} tokens. {advice or self.DEFAULT_ADVICE}"
        )
        if detail:
            message += f" {detail}"
        super().__init__(message)


class MemoryBudgetError(VeloxError):
    """The work would need more memory than the machine can give without being killed."""


class ConfigError(VeloxError):
    """A compression configuration is invalid (unknown method, unsupported bits, unsuitable head_dim)."""


class CancelledError(VeloxError):
    """The user cancelled a long operation."""
