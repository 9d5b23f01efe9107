"""mlx-lm's attention masks in one place, for every attention Velox computes itself: the CPU fast path's
(`engine.runtime.cpu.attention`) and the compressed caches' own (`engine.kvcache.base`).

A mask is what mlx-lm passes to attention: None, the name "causal" (the L new queries are the last L of
the N key positions, each seeing the keys up to its own), or an array broadcastable to [B, heads, L, N],
boolean (True = may attend) or additive. It lives under `runtime` rather than `kvcache` because the CPU
attention is the lower layer: `engine.kvcache` imports it, never the other way round.
"""

from __future__ import annotations

import mlx.core as mx


def named_mask(name: str, first_position: int, n_queries: int, n_keys: int) -> mx.array:
    """The boolean [n_queries, n_keys] array for a mask given by name; query i sits at position
    `first_position + i`. "causal" is the only name mlx-lm uses; anything else is a ValueError."""
    if name != "causal":
        raise ValueError(f"Unknown attention mask {name!r}.")
    query_positions = mx.arange(first_position, first_position + n_queries)
    return query_positions[:, None] >= mx.arange(n_keys)[None]


def apply_attention_mask(
    scores: mx.array, mask: mx.array | str | None, n_queries: int, n_query_heads: int
) -> mx.array:
    """Apply mlx-lm's mask to grouped scores of shape [B, n_kv_heads, repeats, L, N].

    `mask` is None, "causal" (query i of the L new tokens sits at position N - L + i and sees keys up to
    it) or an array broadcastable to [B, heads, L, N], boolean (True = may attend) or additive. Per-query-
    head masks ([B, n_query_heads, L, N]) are regrouped to match.
    """
    if mask is None:
        return scores
    n_keys = scores.shape[-1]
    if isinstance(mask, str):
        mask = named_mask(mask, n_keys - n_queries, n_queries, n_keys)
    if mask.ndim == 4:
        batch, heads = mask.shape[:2]
        if heads == n_query_heads and heads != 1:
            mask = mask.reshape(batch, scores.shape[1], scores.shape[2], *mask.shape[-2:])
        else:
            mask = mx.expand_dims(mask, -3)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    return scores + mask.astype(scores.dtype)
