"""Attention for the Linux CPU fast path (its third part, after `blas` and `weights`): the same mathematics as
`mx.fast.scaled_dot_product_attention`, laid out for MLX's CPU backend.

Why: on MLX's CPU backend `scaled_dot_product_attention` has no fused kernel. It repeats the grouped K/V
heads, materialises every score of a prefill chunk at once and runs `exp` at ~12 ns per element (a scalar
loop; numpy's vectorised exp is ~1 ns). Measured on SmolLM2's shapes (9 query heads, 3 kv heads, d=64),
per layer: decode at 2k tokens 0.58 ms, a 512-token prefill chunk against 2k tokens 149-166 ms. Profiling
the whole model, attention was two thirds of prefill time and a third of decode time at 2k tokens.

What this module does instead, all in MLX ops:
- Query heads are grouped onto their kv head by a free reshape (no repeated K/V in memory).
- Softmax uses `exp(x) = 2^n * e^g` (n = round(x log2 e), |g| <= ln2/2, degree-7 polynomial for e^g,
  2^n built in the float's exponent bits), compiled with `mx.compile` into one fused elementwise kernel.
  Measured relative error 9e-8 over [-87, 0] (MLX's own CPU exp: 3.8e-6); below e^-88 it returns exactly 0.
- Scores are computed for blocks of queries holding at most `SCORE_BLOCK_ELEMENTS` scores: MLX's compiled
  CPU kernels run 5x slower per element once an operand passes ~8 MB (measured: 2.5 ns per element at 1M
  elements, 14 ns at 2M and above), and small blocks also keep the working memory small.
Measured (same shapes): prefill chunk 512x512 37 -> 19 ms, 512x2048 149 -> 80 ms per layer. One-token
decoding stays with MLX's function (`attention` picks; see MIN_QUERIES_FOR_GROUPED).

Only used when `active()`: Linux, the fast path on (`engine.runtime.cpu.weights.prefer_fp32_weights()`, which also
means the model computes in fp32 on the CPU), and `mx.compile` works (it needs a C++ compiler at run time on
Linux; without one the grouped, blocked layout is kept with MLX's own softmax). macOS never comes here.
"""

from __future__ import annotations

import math
import os
from typing import Any

import mlx.core as mx

from engine.runtime.cpu.weights import prefer_fp32_weights
from engine.runtime.masks import apply_attention_mask, named_mask

ENV_SWITCH = "VELOX_FAST_ATTENTION"
# Scores per block (1 MB of float32); 64k-512k measured within 5% of each other at 512x2048, 1M+ is slow.
SCORE_BLOCK_ELEMENTS = 1 << 18

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
# ln 2 = _LN2_HIGH + _LN2_LOW, the high part with few enough mantissa bits that n * _LN2_HIGH is exact.
_LN2_HIGH = 0.693145751953125
_LN2_LOW = _LN2 - _LN2_HIGH
# Taylor coefficients of e^g, highest degree first (for Horner's rule); on |g| <= ln2/2 the remainder
# g^8/8! is below 6e-9.
_EXP_COEFFICIENTS = tuple(1.0 / math.factorial(k) for k in range(7, -1, -1))

_active: bool | None = None
_compiled_exp_parts: Any = None


def _exp_parts(scores: mx.array, row_max: mx.array) -> tuple[mx.array, mx.array]:
    """exp(scores - row_max) = poly * 2^n for float32 scores <= row_max: returns poly and the float32 bit
    pattern of 2^n (as int32). The bit cast itself (`view`) cannot be compiled shapeless, so it is left to
    the caller; shapeless matters because decoding grows the key axis by one every step, and a shaped
    compile would retrace (~0.5 ms) each time."""
    # Cody-Waite reduction: g = x - n ln2 with ln2 split in two, so g keeps float32 accuracy even where
    # n is large (x near -87); the float32 product x * log2(e) alone would lose 5e-6 there. Below -88 the
    # result is denormal: clamping makes n = -127, whose exponent field 0 gives exactly 0.
    x = mx.maximum(scores - row_max, -88.0)
    n = mx.round(x * _LOG2E)
    g = (x - n * _LN2_HIGH) - n * _LN2_LOW
    poly = _EXP_COEFFICIENTS[0]
    for coefficient in _EXP_COEFFICIENTS[1:]:
        poly = poly * g + coefficient
    return poly, mx.left_shift(n.astype(mx.int32) + 127, 23)


def _exp_of_shifted(scores: mx.array, row_max: mx.array) -> mx.array:
    poly, two_to_n_bits = _compiled_exp_parts(scores, row_max)
    return poly * two_to_n_bits.view(mx.float32)


def _compiles_here() -> bool:
    """True if `mx.compile` builds and runs the exp here and it matches exp (it needs a C++ compiler)."""
    try:
        x = mx.array([[-100.0, -20.0, -1.5, -0.25, 0.0], [-3.0, -2.0, -1.0, 0.0, -7.0]], dtype=mx.float32)
        got = _exp_of_shifted(x, mx.zeros((2, 1), dtype=mx.float32))
        expected = mx.exp(x)
        return bool(mx.all(mx.abs(got - expected) <= 1e-6 * expected + 1e-30).item())
    except Exception:  # no compiler, or a backend without compiled kernels: keep MLX's own exp
        return False


def active() -> bool:
    """True when this module's attention should replace MLX's on this process's default device."""
    global _active, _compiled_exp_parts
    if _active is None:
        _compiled_exp_parts = mx.compile(_exp_parts, shapeless=True)
        if not _compiles_here():
            _compiled_exp_parts = None
        _active = os.environ.get(ENV_SWITCH, "1") != "0" and prefer_fp32_weights()
    return _active and mx.default_device() == mx.cpu


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis, as `mx.softmax(scores, axis=-1, precise=True)` (float32 scores)."""
    numerator, total = _numerator_and_total(scores)
    return numerator * (1.0 / total)


def _numerator_and_total(scores: mx.array) -> tuple[mx.array, mx.array]:
    row_max = mx.max(scores, axis=-1, keepdims=True)
    if _compiled_exp_parts is None:
        numerator = mx.exp(scores - row_max)
    else:
        numerator = _exp_of_shifted(scores, row_max)
    return numerator, mx.sum(numerator, axis=-1, keepdims=True)


def query_block(n_score_rows_per_query: int, n_keys: int) -> int:
    """How many queries fit in one block of at most SCORE_BLOCK_ELEMENTS scores (at least one)."""
    return max(1, SCORE_BLOCK_ELEMENTS // max(1, n_score_rows_per_query * n_keys))


# Below this many queries (one-token decoding) MLX's own scaled_dot_product_attention is used: measured
# inside SmolLM2 decoding at 2k/8k cached tokens it ran 56/101 ms per token against 70/115 ms with
# grouped_attention (at one query, per-op Python overhead and a copy of the strided key view dominate, and
# exp is only 9 x n_keys values). Prefill chunks keep grouped_attention, 2x faster there.
MIN_QUERIES_FOR_GROUPED = 2


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """The faster of MLX's attention and `grouped_attention` for this many queries (see above)."""
    if queries.shape[2] < MIN_QUERIES_FOR_GROUPED:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    return grouped_attention(queries, keys, values, scale, mask)


def grouped_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """softmax(scale * Q Kᵀ + mask) V for queries [B, n_q_heads, L, D] over keys/values [B, n_kv, N, D].

    `mask` is what mlx-lm passes: None, "causal" (the L queries are the last L of the N positions) or an
    array broadcastable to [B, n_q_heads, L, N] (boolean: True may attend; otherwise additive).
    """
    batch, n_query_heads, n_queries, head_dim = queries.shape
    n_kv = keys.shape[1]
    n_keys = keys.shape[2]
    repeats = n_query_heads // n_kv
    # [B, n_kv, repeats, L, D]: query heads sharing a kv head side by side (a free reshape).
    grouped = (queries * scale).reshape(batch, n_kv, repeats, n_queries, head_dim)
    keys_t = keys.swapaxes(-1, -2)
    step = query_block(n_kv * repeats, n_keys)
    outputs = []
    for start in range(0, n_queries, step):
        stop = min(start + step, n_queries)
        block = grouped[:, :, :, start:stop, :]
        rows = stop - start
        scores = (block.reshape(batch, n_kv, repeats * rows, head_dim) @ keys_t).reshape(
            batch, n_kv, repeats, rows, n_keys
        )
        scores = apply_attention_mask(scores, _mask_rows(mask, start, stop, n_queries, n_keys), rows, n_query_heads)
        numerator, total = _numerator_and_total(scores)
        weighted = numerator.reshape(batch, n_kv, repeats * rows, n_keys) @ values
        # Normalise the small output, not the large weights (one pass over the scores fewer).
        outputs.append(weighted.reshape(batch, n_kv, repeats, rows, -1) * (1.0 / total))
    output = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=3)
    return output.reshape(batch, n_query_heads, n_queries, -1)


def _mask_rows(mask: mx.array | str | None, start: int, stop: int, n_queries: int, n_keys: int) -> Any:
    """The part of `mask` that applies to queries start..stop of n_queries."""
    if mask is None or (start == 0 and stop == n_queries):
        return mask
    if isinstance(mask, str):
        return named_mask(mask, n_keys - n_queries + start, stop - start, n_keys)
    if mask.ndim >= 2 and mask.shape[-2] == n_queries:
        return mask[..., start:stop, :]
    return mask  # one row broadcast over every query
