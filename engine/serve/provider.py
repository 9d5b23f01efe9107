"""The model side of `velox serve`: mlx-lm's ModelProvider and prompt cache, made to hold Velox's caches.

mlx-lm's server makes every prompt cache with `make_prompt_cache(model)`, which asks the model's own
`make_cache()` first. `ServedModel` is the loaded model with a `make_cache` that builds Velox's caches, so
each place mlx-lm makes a cache (single-request serving, its batchability probe, `stream_generate`) makes a
Velox one; nothing in mlx-lm's request handling is copied or patched for it.

What cannot take Velox caches: mlx-lm's `BatchGenerator` (continuous batching) merges per-request caches
into batch caches with `cache.merge(...)` and later `extract`s and `filter`s them (`BatchKVCache`); Velox's
caches have no batched form, so `ModelProvider.is_batchable` (which probes `hasattr(cache, "merge")`) is
False for them and mlx-lm serves requests one at a time (`ResponseGenerator._serve_single`), queued in
arrival order. Only the uncompressed level off the CPU fast path uses mlx-lm's own KVCache, and so batches.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache
from mlx_lm.server import ModelProvider

from engine.chat.session import _default_cache_factory
from engine.errors import ModelError
from engine.kvcache import KVCacheBuilder
from engine.kvcache.trim import trim_for_reuse
from engine.models.catalog import load_model, resolve_model

CacheFactory = Callable[[Any], list[Any]]

# Names a request may give in "model" for the loaded model (besides its own name and folder).
DEFAULT_MODEL_NAMES = ("default", "default_model")


class CompressedCaches:
    """The cache factory of a compressed level: `config` resolved for the served model once (`prepare`, with
    its tokenizer: a `wide=F` level's layers are calibrated there, on the bundled prose, or read from the
    calibration cache), then one per-layer cache list per request without any further calibration work."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self._resolved: dict[int, Any] = {}

    def prepare(self, model: Any, tokenizer: Any = None) -> None:
        self._resolved[id(model)] = KVCacheBuilder(self.config).for_model(model, tokenizer=tokenizer).config

    def __call__(self, model: Any) -> list[Any]:
        if id(model) not in self._resolved:
            self.prepare(model)
        return KVCacheBuilder(self._resolved[id(model)]).for_model(model).build()


def serving_cache_factory(config: Any | None) -> CacheFactory:
    """Per-layer caches for `config` (a KVCacheConfig; see `CompressedCaches`), or for None the chat session's
    uncompressed default (mlx-lm's KVCache; on the Linux CPU fast path the float32 Velox cache, which attends
    faster there). Compressed caches prefill the device's fastest way (`prefill_attention` defaults to "auto")."""
    if config is None:
        return _default_cache_factory
    return CompressedCaches(config)


class ServedModel:
    """The loaded model as mlx-lm's server sees it: calls and attributes go to the model, and `make_cache`
    builds the caches of `cache_factory`. A wrapper rather than a new attribute on the model, so the model
    object (which a caller may share, e.g. the tests' session fixture) is left untouched."""

    def __init__(self, model: Any, cache_factory: CacheFactory) -> None:
        self.model = model
        self.cache_factory = cache_factory

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def make_cache(self) -> list[Any]:
        return self.cache_factory(self.model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class VeloxModelProvider(ModelProvider):
    """Serves exactly one model, loaded through Velox's catalogue (checked folder, CPU fast path weights).

    mlx-lm's provider would load whatever a request names, downloading from the Hugging Face hub; this one
    answers only to the names in `served_names` and never loads anything else."""

    def __init__(
        self,
        cli_args: argparse.Namespace,
        cache_factory: CacheFactory,
        *,
        model_spec: str | None = None,
        loaded: tuple[Any, Any, Any] | None = None,
    ) -> None:
        super().__init__(cli_args)
        self.cache_factory = cache_factory
        self.model_spec = model_spec
        self.info: Any = None
        self.load_error: str | None = None
        self._preloaded = loaded
        self.served_names: set[str] = set(DEFAULT_MODEL_NAMES)
        if loaded is not None:
            self._name(loaded[2])

    def _name(self, info: Any) -> None:
        self.info = info
        self.served_names.add(info.name)
        if info.path is not None:
            self.served_names.add(str(info.path))

    def serves(self, name: str | None) -> bool:
        return name is None or name in self.served_names

    @property
    def model_name(self) -> str:
        return self.info.name if self.info is not None else "default"

    def load_default(self) -> None:
        """Called by mlx-lm's generation thread when it starts: load the model there (mlx-lm keeps model
        work on that thread). A failure is kept in `load_error` for `VeloxServer.start` to report as one
        line, rather than raised: raising would end mlx-lm's generation thread with a logged traceback."""
        try:
            self.load("default")
        except Exception as error:  # a ModelError, or anything MLX raises while loading
            self.load_error = (str(error).strip().splitlines() or [type(error).__name__])[0]

    def load(self, model_path: str, adapter_path: str | None = None, draft_model_path: str | None = None):
        if not self.serves(model_path):
            raise ModelError(f"The model {model_path!r} is not served here; use 'default' or {self.model_name!r}.")
        if adapter_path is not None:
            raise ModelError("Adapters are not supported by velox serve.")
        if draft_model_path not in (None, *DEFAULT_MODEL_NAMES):
            raise ModelError("Draft models (speculative decoding) are not supported by velox serve.")
        if self.model is None:
            self._load_velox_model()
        return self.model, self.tokenizer

    def _load_velox_model(self) -> None:
        if self._preloaded is not None:
            model, tokenizer, info = self._preloaded
            self._preloaded = None
        else:
            model, tokenizer, info = load_model(resolve_model(self.model_spec))
        self._name(info)
        prepare = getattr(self.cache_factory, "prepare", None)
        if prepare is not None:  # resolve the level for this model once, with its tokenizer (CompressedCaches)
            prepare(model, tokenizer)
        served = ServedModel(model, self.cache_factory)
        self.model_key = (str(info.path), None, None)
        self.model = served
        self.tokenizer = tokenizer
        self.processor = None
        self.draft_model = None
        # mlx-lm's own probe: batch only when every cache can be merged into a batch cache.
        self.is_batchable = all(hasattr(cache, "merge") for cache in served.make_cache())


class VeloxPromptCache(LRUPromptCache):
    """mlx-lm's LRU prompt cache (a token trie of caches, reused across requests), bounded by `max_bytes`
    counted with each cache's `nbytes`: for Velox caches the bytes of every array they really hold.

    The lookup is mlx-lm's (an exact entry, else the longest stored prefix of the prompt, else a longer
    entry sharing more of the prompt, trimmed back to it) with two changes:
    - a reused cache is trimmed with `trim_for_reuse`, not `trim_prompt_cache`: a KIVI cache cut inside
      a key block would keep that block's tokens only decoded and quantize them a second time (a re-asked
      question then read its own tokens at 4 bits and was answered differently from a fresh request), so
      the cut widens to the block's start and those tokens are run again;
    - an exact hit is trimmed too (by at least one token): mlx-lm returns it with no tokens left to run,
      and the model needs one to compute the first reply token from.
    """

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        # The trie and its search are mlx-lm's (LRUPromptCache keeps it in `_trie`); what is taken from it
        # and how it is trimmed is decided here.
        found = self._trie.search(model, tokens)
        if found.exact is not None:
            return self._trimmed(found.model, found.exact, tokens, len(tokens) - 1)
        shorter = len(found.shorter) if found.shorter is not None else 0
        if found.longer is not None and found.common_prefix > shorter:
            cache, rest = self._trimmed(found.model, found.longer, tokens, min(len(tokens) - 1, found.common_prefix))
            if cache is not None and len(tokens) - len(rest) > shorter:
                return cache, rest
        if shorter:
            entry = self._trie.get(found.model, found.shorter)
            return copy.deepcopy(entry.prompt_cache), tokens[shorter:]
        return None, tokens

    def _trimmed(
        self, model: Any, key: list[int], tokens: list[int], keep: int
    ) -> tuple[list[Any] | None, list[int]]:
        """A copy of the entry stored under `key`, trimmed for reuse to at most its first `keep` tokens,
        and the tokens of the prompt it does not hold; (None, tokens) if it cannot be trimmed."""
        entry = self._trie.get(model, key)
        if not can_trim_prompt_cache(entry.prompt_cache):
            return None, tokens
        cache = copy.deepcopy(entry.prompt_cache)
        trimmed = trim_for_reuse(cache, len(key) - keep)
        return cache, tokens[len(key) - trimmed:]


__all__ = [
    "DEFAULT_MODEL_NAMES",
    "ServedModel",
    "VeloxModelProvider",
    "VeloxPromptCache",
    "serving_cache_factory",
]
