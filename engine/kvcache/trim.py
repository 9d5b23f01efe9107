"""Trimming a model's per-layer caches for reuse: the prompt cache of `velox serve` and the chat session keep
a cache across requests, trim it back to the prefix a new prompt shares, then run the new tokens.

mlx-lm's `trim_prompt_cache(caches, n)` drops exactly `n` tokens. For a compressed cache that is not always
what a reused cache needs: a KIVI cache cut inside a key block keeps the block's first tokens only decoded,
and they are quantized a second time when new tokens refill the block, so the reused cache would differ from
(and be worse than) one that never held the trimmed tokens. That happened in `velox serve` at the 4-bit level:
re-asking an earlier question after a follow-up reused the question's tokens at 4 bits where a fresh request
keeps them in 16-bit, and the answer changed. `trim_for_reuse` trims back to where every layer's cache can
be rebuilt exactly (`VeloxKVCache.reuse_trim_length`); the caller runs the extra tokens again.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import trim_prompt_cache


def reuse_trim_length(caches: list[Any], n: int) -> int:
    """The fewest tokens, at least `n`, to trim from every layer so that running them again rebuilds the
    caches exactly. Caches without `reuse_trim_length` (mlx-lm's own) store each token on its own: `n`."""
    offset = caches[0].offset if caches else 0
    length = min(offset, max(0, n))
    while True:  # widen until every layer agrees (layers share one config, so one pass in practice)
        widest = max(
            (cache.reuse_trim_length(length) if hasattr(cache, "reuse_trim_length") else length)
            for cache in caches
        ) if caches else length
        if widest == length:
            return length
        length = widest


def trim_for_reuse(caches: list[Any], n: int) -> int:
    """Trim at least the newest `n` tokens of every layer's cache, as many as `reuse_trim_length` says, so
    that feeding the trimmed tokens again gives the caches a never-trimmed run would hold. Returns how
    many were trimmed (the caller runs that many tokens of its prompt again)."""
    length = reuse_trim_length(caches, n)
    if length:
        trim_prompt_cache(caches, length)
    return length


__all__ = ["reuse_trim_length", "trim_for_reuse"]
