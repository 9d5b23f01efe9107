"""The one place where Velox hooks into mlx-lm's attention, so a compressed cache attends over its own storage.

Why this dispatch point: every mlx-lm model module does `from .base import scaled_dot_product_attention`,
so replacing `mlx_lm.models.base.scaled_dot_product_attention` would not reach the names already bound in
llama.py, qwen3.py and the ~200 other model files. But that function, for any cache that has a `bits`
attribute, calls `quantized_scaled_dot_product_attention`, which it looks up in *its own module's globals at
call time*. Replacing that single global therefore reaches every model, whenever it was imported, and
nothing else in mlx-lm calls it. Our compressed caches expose `bits`/`group_size` (so mlx-lm routes them
there) and return themselves from `update_and_fetch`; the dispatcher sees such a cache in place of the
packed keys and calls `cache.attention(...)`. Every other argument combination goes to mlx-lm's original
function untouched, so mlx-lm's own QuantizedKVCache and all plain caches behave exactly as before.

Limitation inherited from mlx-lm: its `scaled_dot_product_attention` refuses attention sinks (`sinks=`, as
in gpt-oss) for caches with `bits`, so our compressed caches do not serve such models.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx_lm.models.base as mlx_base

# If this module is ever re-imported while the dispatcher is installed, recover the true original from it.
_ORIGINAL = getattr(
    mlx_base.quantized_scaled_dot_product_attention,
    "velox_wrapped_original",
    mlx_base.quantized_scaled_dot_product_attention,
)


class AttendsOverOwnStorage:
    """Marker base for caches whose `update_and_fetch` returns `(self, self)` and that implement
    `attention(queries, keys, values, scale, mask)` over their own (compressed) storage."""

    def attention(
        self, queries: mx.array, keys: Any, values: Any, scale: float, mask: mx.array | str | None
    ) -> mx.array:
        raise NotImplementedError


def _dispatching_quantized_sdpa(
    queries: mx.array,
    q_keys: Any,
    q_values: Any,
    scale: float,
    mask: mx.array | str | None,
    group_size: int = 64,
    bits: int = 8,
) -> mx.array:
    if isinstance(q_keys, AttendsOverOwnStorage):
        return q_keys.attention(queries, q_keys, q_values, scale=scale, mask=mask)
    return _ORIGINAL(queries, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)


_dispatching_quantized_sdpa.velox_wrapped_original = _ORIGINAL  # type: ignore[attr-defined]


def install_attention_dispatch() -> None:
    """Route attention for caches that attend over their own storage to them. Idempotent."""
    mlx_base.quantized_scaled_dot_product_attention = _dispatching_quantized_sdpa


def uninstall_attention_dispatch() -> None:
    """Put mlx-lm's original function back. Idempotent. (A Velox cache used afterwards reinstalls it.)"""
    mlx_base.quantized_scaled_dot_product_attention = _ORIGINAL


def attention_dispatch_installed() -> bool:
    return mlx_base.quantized_scaled_dot_product_attention is _dispatching_quantized_sdpa


def original_quantized_sdpa() -> Any:
    """mlx-lm's own function, as it was when Velox was imported (for tests and diagnostics)."""
    return _ORIGINAL
