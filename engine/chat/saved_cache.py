"""A conversation's KV cache on disk, so reopening it never reads its documents through the model again.

One file per conversation, in mlx-lm's prompt-cache format (`save_prompt_cache`: a safetensors file whose
arrays are each layer's `state`, compressed exactly as the chat held it), with Velox's metadata beside the
arrays: a format version, the identity of the model that computed it, the cache configuration, the chat
template's hash and the token ids the cache holds. A file is only ever used when all of these match; any
doubt (another model, a changed file, a truncated write, an unknown version) is a `SavedCacheError` with one
sentence, and the caller re-reads from the stored text as if there were no file. A stale cache can cost
time, never a wrong answer.

Writes are atomic (temporary file in the same folder, fsync, rename, fsync of the folder) and private
(0600), so a crash or kill -9 during a save leaves the previous file intact. `CacheFolder` keeps the files
within a byte budget, evicting the least recently used conversation first.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from engine.errors import ConfigError, VeloxError
from engine.kvcache import KVCacheConfig

FORMAT_VERSION = "velox-conversation-cache/1"
FILE_SUFFIX = ".safetensors"
DEFAULT_BUDGET_BYTES = 2 * 1024**3
STALE_PARTIAL_S = 600  # a save takes well under a second; an older temporary file is a killed save's
UNCOMPRESSED_PREFIX = "16-bit "  # the config label of a session without compression, e.g. "16-bit KVCache"
MAX_HEADER_BYTES = 64 * 1024**2  # a safetensors header is a few kB; anything larger is not ours


class SavedCacheError(VeloxError):
    """A saved cache cannot be used; the message says why in one sentence."""


@dataclass(frozen=True)
class CacheIdentity:
    """What must be equal for a saved cache to be valid for the chat at hand."""

    model: str  # model_identity() of the weights that computed it
    template: str  # template_identity() of the chat template and system prompt that rendered the tokens
    config: str  # the cache configuration ("mlx-lm KVCache" for the 16-bit default)

    def as_metadata(self) -> dict[str, str]:
        return {"model": self.model, "template": self.template, "config": self.config}


def model_identity(model_dir: str | Path) -> str:
    """The folder's resolved path plus the name, size and modification time of every weight and config
    file: cheap (no hashing of gigabytes), and any replaced, converted or edited file changes it."""
    folder = Path(model_dir).resolve()
    digest = hashlib.sha256(str(folder).encode())
    for path in sorted(folder.glob("*")):
        if path.suffix in {".safetensors", ".json", ".gguf"} and path.is_file():
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def template_identity(tokenizer: Any, system_prompt: str | None) -> str:
    """A hash of the chat template and system prompt (the rendered tokens depend on both)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # some tokenizers keep several named templates
        template = json.dumps(template, sort_keys=True, default=str)
    return hashlib.sha256(f"{template}\n--system--\n{system_prompt or ''}".encode()).hexdigest()


def _tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()


def save_cache_file(path: str | Path, prompt_cache: list[Any], tokens: Sequence[int],
                    identity: CacheIdentity) -> int:
    """Write the cache (holding exactly `tokens`) to `path` atomically; returns the file's size in bytes."""
    path = Path(path)
    if not prompt_cache or int(prompt_cache[0].offset) != len(tokens):
        raise SavedCacheError(
            f"The cache holds {int(prompt_cache[0].offset) if prompt_cache else 0} tokens, not the "
            f"{len(tokens)} it is being saved with; not saved."
        )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # caches hold documents: private like them
    metadata = {
        "format": FORMAT_VERSION,
        **identity.as_metadata(),
        "tokens": json.dumps(list(tokens)),
        "tokens_sha256": _tokens_digest(tokens),
    }
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.partial{FILE_SUFFIX}")
    try:
        save_prompt_cache(str(temporary), prompt_cache, metadata)
        os.chmod(temporary, 0o600)
        descriptor = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_folder(path.parent)
    return path.stat().st_size


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def load_cache_file(path: str | Path, expected: CacheIdentity) -> tuple[list[Any], list[int]]:
    """(prompt cache, the token ids it holds) from `path`, or SavedCacheError saying why it cannot be used."""
    path = Path(path)
    if not path.is_file():
        raise SavedCacheError("There is no saved cache for this conversation.")
    try:
        prompt_cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    except Exception as error:  # noqa: BLE001 - a damaged file may fail anywhere in MLX's reader
        raise SavedCacheError(f"The saved cache is damaged or truncated ({type(error).__name__}).") from error
    if metadata.get("format") != FORMAT_VERSION:
        raise SavedCacheError(f"The saved cache has an unknown format ({metadata.get('format', 'none')!r}).")
    for field, label in (("model", "another model"), ("template", "another chat template or system prompt"),
                         ("config", "another compression setting")):
        if metadata.get(field) != getattr(expected, field):
            raise SavedCacheError(f"The saved cache was made with {label}.")
    try:
        tokens = [int(token) for token in json.loads(metadata["tokens"])]
    except (KeyError, ValueError, TypeError) as error:
        raise SavedCacheError("The saved cache's token list is unreadable.") from error
    if _tokens_digest(tokens) != metadata.get("tokens_sha256"):
        raise SavedCacheError("The saved cache's token list does not match its checksum.")
    if not prompt_cache or any(int(layer.offset) != len(tokens) for layer in prompt_cache):
        raise SavedCacheError("The saved cache does not hold the tokens it lists.")
    return prompt_cache, tokens


class CacheFolder:
    """The folder of saved conversation caches, kept within `budget_bytes` (least recently used first out)."""

    def __init__(self, folder: str | Path, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.folder = Path(folder)
        self.budget_bytes = budget_bytes

    def path_for(self, conversation_id: int) -> Path:
        return self.folder / f"conversation-{int(conversation_id)}{FILE_SUFFIX}"

    def files(self) -> list[Path]:
        """Saved cache files, least recently used first (a load or save touches the file)."""
        if not self.folder.is_dir():
            return []
        found = [p for p in self.folder.glob(f"conversation-*{FILE_SUFFIX}") if p.is_file()]
        return sorted(found, key=lambda p: p.stat().st_mtime_ns)

    def bytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.files())

    def save(self, conversation_id: int, prompt_cache: list[Any], tokens: Sequence[int],
             identity: CacheIdentity) -> int:
        """Save one conversation's cache, then evict others until the folder fits the budget. Returns the
        new file's size; a cache larger than the whole budget is not kept (SavedCacheError)."""
        path = self.path_for(conversation_id)
        size = save_cache_file(path, prompt_cache, tokens, identity)
        if size > self.budget_bytes:
            path.unlink(missing_ok=True)
            raise SavedCacheError(
                f"This conversation's cache ({size / 1e6:.0f} MB) is larger than the disk budget for saved "
                f"caches ({self.budget_bytes / 1e6:.0f} MB); it was not kept."
            )
        self.enforce_budget(keep=path)
        return size

    def load(self, conversation_id: int, expected: CacheIdentity) -> tuple[list[Any], list[int]]:
        path = self.path_for(conversation_id)
        loaded = load_cache_file(path, expected)
        os.utime(path)  # most recently used now
        return loaded

    def delete(self, conversation_id: int) -> bool:
        path = self.path_for(conversation_id)
        existed = path.exists()
        path.unlink(missing_ok=True)
        return existed

    def enforce_budget(self, keep: Path | None = None) -> list[Path]:
        """Delete least recently used files until the total fits the budget; returns what was deleted.
        Also sweeps temporary files that a killed save left behind (older than STALE_PARTIAL_S)."""
        if self.folder.is_dir():
            cutoff = time.time() - STALE_PARTIAL_S
            for leftover in self.folder.glob(f".conversation-*.partial{FILE_SUFFIX}"):
                if leftover.stat().st_mtime < cutoff:
                    leftover.unlink(missing_ok=True)
        files = self.files()
        total = sum(p.stat().st_size for p in files)
        evicted = []
        for path in files:
            if total <= self.budget_bytes:
                break
            if path == keep:
                continue
            total -= path.stat().st_size
            path.unlink(missing_ok=True)
            evicted.append(path)
        return evicted


def read_cache_metadata(path: str | Path) -> dict[str, str]:
    """The Velox metadata of a saved cache file, read from its safetensors header only (no arrays loaded);
    SavedCacheError when the file is missing or its header is unreadable."""
    path = Path(path)
    try:
        with path.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            if length > MAX_HEADER_BYTES:
                raise ValueError("header too large")
            header = json.loads(stream.read(length).decode("utf-8"))
    except FileNotFoundError as error:
        raise SavedCacheError("There is no saved cache for this conversation.") from error
    except (OSError, struct.error, ValueError) as error:
        raise SavedCacheError(f"The saved cache is damaged or truncated ({type(error).__name__}).") from error
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        return {}
    # mlx-lm flattens [our metadata, the layers' meta_state, their class names] into "0.key", "1.i", "2.i.j".
    return {str(key)[2:]: str(value) for key, value in metadata.items() if str(key).startswith("0.")}


def config_label(session: Any) -> str:
    """The cache configuration a ChatSession holds, as the identity records it: the config's one-token
    spec (`kivi:k4v4:g64`), or for an uncompressed session "16-bit " plus the class its cache uses (mlx-lm's
    KVCache, or the float32 cache of the Linux CPU fast path)."""
    if session.compression is not None:
        return str(session.compression)
    return UNCOMPRESSED_PREFIX + type(session.prompt_cache[0]).__name__


def session_identity(session: Any, model_dir: str | Path) -> CacheIdentity:
    """The identity a saved cache must carry to be valid for `session` (a ChatSession on `model_dir`)."""
    return CacheIdentity(model_identity(model_dir), template_identity(session.tokenizer, session.system_prompt),
                         config_label(session))


def save_session_cache(folder: CacheFolder, conversation_id: int, session: Any, model_dir: str | Path) -> int:
    """Save the session's cache as `conversation_id`'s (then keep the folder within its budget); returns the
    file's size. Refused (SavedCacheError) unless every layer holds exactly the session's `cached_tokens`:
    a cache caught between two states is never written."""
    tokens = list(session.cached_tokens)
    offsets = {int(layer.offset) for layer in session.prompt_cache}
    if not tokens or offsets != {len(tokens)}:
        raise SavedCacheError(f"The cache holds {sorted(offsets)} tokens, not the {len(tokens)} it lists; not saved.")
    return folder.save(conversation_id, session.prompt_cache, tokens, session_identity(session, model_dir))


@dataclass(frozen=True)
class Restored:
    """What `restore_session_cache` did: tokens adopted (0: none), and a sentence when a file was refused."""

    tokens: int
    refusal: str = ""
    reencoded_from: str = ""  # the config the file was saved with, when it was re-encoded to the session's


def _saved_config(label: str) -> Any:
    """The KVCacheConfig a saved file's config label names (None: uncompressed); ConfigError if none."""
    if label.startswith(UNCOMPRESSED_PREFIX):
        return None
    return KVCacheConfig.parse(label)


def restore_session_cache(folder: CacheFolder, conversation_id: int, session: Any,
                          model_dir: str | Path) -> Restored:
    """Give `session` the saved cache of `conversation_id`, so its next turn prefills only new tokens.

    A file saved at another compression level is loaded as it was saved and re-encoded to the session's
    level (as a live switch does: no model call). No file: Restored(0). Any other doubt (another model or
    template, a damaged file, an unknown version): Restored(0, the reason), the session untouched, and the
    next turn re-reads the conversation from its text."""
    path = folder.path_for(conversation_id)
    if not path.is_file():
        return Restored(0)
    expected = session_identity(session, model_dir)
    try:
        saved_label = read_cache_metadata(path).get("config", "")
        if saved_label and saved_label != expected.config:
            try:
                saved_config = _saved_config(saved_label)
            except ConfigError:
                raise SavedCacheError("The saved cache was made with an unknown compression setting.") from None
            prompt_cache, tokens = folder.load(conversation_id, replace(expected, config=saved_label))
            target, held, held_tokens = session.compression, session.prompt_cache, list(session.cached_tokens)
            session.adopt_saved_cache(prompt_cache, tokens, compression=saved_config)
            try:
                session.set_compression(target)
            except Exception:
                session.adopt_saved_cache(held, held_tokens, compression=target)  # as it was
                raise
            return Restored(len(tokens), reencoded_from=saved_label)
        prompt_cache, tokens = folder.load(conversation_id, expected)
    except SavedCacheError as error:
        return Restored(0, str(error))
    session.adopt_saved_cache(prompt_cache, tokens)
    return Restored(len(tokens))
