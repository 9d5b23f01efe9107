"""KIVI: keys quantized per channel over blocks of tokens, values per token; attention on the packed codes.

Keys have a few channels with large magnitude in every token; quantizing each key per token puts those
outliers in the same group as the small channels. KIVI instead quantizes each channel over a block of
G = `group_size` consecutive tokens (one scale and bias per channel and block), so an outlier channel gets
its own scale. Values have no such channel structure and are quantized per token, in groups of G channels,
exactly as `affine` does.

Key layout, chosen so attention reads the codes with `mx.quantized_matmul`: a block of keys [G, D] is
transposed to [D, G] and quantized along the token axis with MLX's affine quantization (group = G), and
blocks are appended along that axis. The stored keys Kᵀ are therefore [.., D, T·bits/32] packed words with
scales and biases [.., D, T/G], and
    scores = q · Kᵀ = quantized_matmul(q, codes, scales, biases, transpose=False, group_size=G)
multiplies by the transposed quantized matrix directly (the last axis of a transpose=False weight is its
output axis, here the tokens, which is also the quantization axis). Values use transpose=False on
[.., T, D·bits/32] as in `affine`. Nothing is ever dequantized for attention.

Only whole blocks can be quantized, so tokens leave the 16-bit recent window G at a time: the window holds
between `residual_window` and `residual_window` + G - 1 tokens (the KIVI paper's residual; with
residual_window 0 it holds the partial newest block only). Trimming into a block moves that block's kept
tokens back into the window, decoded (see `trim`).

Option `key_block` (32, 64 or 128 tokens; default: the group size) sets the key blocks apart from the
values' channel groups: 128-token blocks halve the keys' scale overhead (0.25 bits per value instead of 0.5).
Sink tokens stay in the block stream too (their 16-bit originals are what attention reads; see
`SegmentedKVCache.sinks_in_stream`), so blocks stay aligned to absolute positions.

Option `rotate_values` (true/false; default false) stores each value rotated by the layer's seeded rotation
(`rotation`, randomized Hadamard by default; layer i seeded `seed + i`) before its per-token groups are
quantized, and rotates the attention output back (Σ p_i v_i = Rᵀ Σ p_i (R v_i)): a value channel with large
magnitude no longer widens its whole group's scale. Keys and queries are untouched (a rotation would smear the
outlier channels that the keys' per-channel scales exist for), so the decode kernel reads the same codes and
the rotation back is one small transform of its output. The rotation's signs are per-layer constants, counted.
`rotate_values=plain` uses the plain Walsh-Hadamard transform H/√d instead (no random signs: nothing is held,
so the cache keeps the bits of plain KIVI; it needs head_dim = 2^k or 12·2^k, where H is symmetric and so its own
inverse). A few outlier channels are spread alike either way; the signs only guard against inputs aligned with
H's rows.

Option `clip_search` (true/false; default false) quantizes every group (a key channel's block, a value token's
channel group) at the range that gives it the least squared error among a few clippings of its min..max
range (`CLIP_RATIOS`, about its midpoint): at 4 bits one outlier no longer spreads the other 63 values over a
few codes. Only the scales, biases and codes chosen change, not their layout, so attention and the decode kernel
read them as before; quantizing takes len(CLIP_RATIOS) times longer. At 2 bits the search's gain is the keys':
searching the keys' groups only (values over their plain range) was as good held out (+18.99 % against +18.67 % on
4k windows with keys before RoPE, KL 0.2025 against 0.2052), searching values only much worse (benchmarks/results/
near_lossless_2bit_cliprole.json), so one option covers both roles.

Options `key_grid` and `value_grid` (uniform, lloyd or lloyd_ends; default uniform) decode that role's codes onto
a non-uniform grid of levels (`quant/grids.py`, KVQuant's "nuq" idea): each group keeps its min-max scale and
bias, but code c means scale·grid[c] + bias, with the levels placed where min-max-normalized keys (values) of
real prose lie. The arrays and bytes are those of plain KIVI. No `mx.quantized_matmul` reads a grid, so
attention decodes the gridded role (float32) and multiplies; on a GPU the tiled decode kernel reads the codes
and looks their levels up (`Codec.grid`). Measured on SmolLM2-135M, held-out prose (benchmarks/results/near_lossless_lowbits.json):
at 2 bits `key_grid=lloyd` is perplexity +40.2% (KL 0.347) and with rotate_values=true +32.1% (KL 0.300), against
+88.7% plain and +53.9% with clip_search, at the same 2.39 bits; at 3 and 4 bits the grids cost quality (3-bit
key_grid +8.6%, value_grid +10.7%, against +7.2%; 4-bit value_grid +1.21% against +1.04%), and at 2 bits
value_grid does too (+55.7%). The levels are MSE-optimal, which at 3+ bits moves the outer levels off the group's
extremes that large attention scores depend on.

Option `wide=F` (a fraction 0..1) stores floor(F × n_layers) layers with one more key and value bit (k5v5 in a
k4v4 spec; 8-bit and 6-bit roles cannot widen: kivi has no 9- or 7-bit codes), the layers that lose the most
when quantized, found by a calibration pass on the model (`engine/kvcache/layer_sensitivity.py`); the builder
names them in option `wide_layers=L1.10.18`. Each layer's cache holds its own plain configuration
(`KVCacheConfig.for_layer`), so everything below reads the layer's real bits. The bits formula averages over the
layers. Simulated on SmolLM2-135M (benchmarks/results/near_lossless_lowbits_experiments.json): layers 1, 10 and
18 of 30 at k5v5 took the 4-bit level from +1.04% to +0.46% perplexity on held-out prose, at 4.49 bits.

Option `rope=pre` stores the keys of the compressed blocks before RoPE (KVQuant): RoPE turns each channel pair by
an angle that grows with the position, so over a block a channel's range becomes its pair's larger one; turned
back by their positions (`quant/rope.py`) each channel keeps its own range. The builder writes the model's RoPE
into the spec (`rope_dims`, `rope_base`, `rope_scale`, `rope_traditional`) so a saved or re-encoded cache needs no
model; decoded keys are turned forward again by their positions on every path (prefill, dense export, trim).
Sinks and window stay as the model gave them (16-bit: nothing to gain). No `mx.quantized_matmul` applies RoPE to
packed keys, so without a GPU kernel attention decodes the compressed keys every step (rope=pre is not a level on
that account); the tiled decode pass has the variant (template ROPE: each key pair decoded and turned by its
position), checked against the reference in the CPU emulator and on the H200 (`kernels/decode.py`, ROPE_BACKENDS:
CUDA and Metal), where the 4-bit level decodes at 98-103 % of its speed without it at 8k, 32k and 131k tokens
(BENCHMARKS.md, issue 11's *phase 1 by runs of tokens*; `decode-runs4-rope-h200.json`).
Option `rope=auto`, which the 4-, 3- and 2-bit levels carry, asks for keys before RoPE only where that kernel will
turn them (`rope_pre_declines`: a GPU backend in ROPE_BACKENDS, kernels not off, a plain full-width RoPE, a tile
for the layout) and keys as given elsewhere; the builder resolves it for the model and device, so a built cache's
spec says rope=pre or nothing.
Probe on SmolLM2-135M, held out (BENCHMARKS.md round 5): the wide 4-bit level's KL 0.0096 -> 0.0071 (2k
windows), +1.19% -> +0.70% on 4k windows; the wide 3-bit level with rotated values +2.60% (+5.82% without both).

Option `symmetric_values` (true/false; default false) quantizes each value group as s·(code - h), h = (2^b - 1)/2,
s = max|x| / h: one 16-bit scale per group and no bias (0.25 bits per value less at 64-channel groups). Rotated
values (`rotate_values`) are close to zero-mean per group, which is what a grid centred on zero needs; unrotated
they are not, and it loses (held out, 2k windows: +5.46 % against the 3-bit level's +3.40 %). MLX's affine ops read
the codes with biases -h·s derived per use (transient; not held); the decode kernel derives them from the scales.

Option `key_outliers` (0 or 1; default 0) keeps, per key channel and block, the one entry that widens the block's
range most in 16 bits with an 8-bit index (`quant/outliers.py`: KVQuant's dense-and-sparse split), and quantizes the
block without it: +0.094 bits per value at 128-token blocks. Paid for by symmetric rotated values it took the 3-bit
level's layout from +3.31 % to +2.78 % on two held-out 4k windows at 3.46 bits (BENCHMARKS.md, issue 12's round 10),
and with them it is the 3-bit level since round 11 (four windows: +3.48 %, KL 0.0314, against +3.68 %, KL 0.0423).
The residual of each outlier against its decoded entry is what is stored, so attention adds q_c·residual to one
token's score per channel and block: on the reference path one scatter-add after `mx.quantized_matmul`, in the decode
kernel's tiled pass once per channel and tile as it stages the tile (`kernels/decode.py`, OUTLIER_BACKENDS).

Option `key_widths=calibrated` stores the key channels at different widths around the key bits (2-5 bits averaging 3
in a 3-bit layer, 1-4 averaging 2 in a 2-bit one), the bits going where the queries lean and the keys range most
(`quant/channel_widths.py`; the importance is measured on the model by `engine/kvcache/key_widths.py`, and the builder
writes the table's digest in the spec, key_widths=kw...). Every kv head of a layer has the same count of channels at each width, so each width's
channels' codes are one array (key_codes_w3, ...), and the scales, biases and outliers, the same per channel and block
as plain KIVI's (so the bits are the spec's), are one array each over all channels, all stored in a per-head channel
order, narrowest width first (a kernel then reads every class through a few buffers: Metal binds at most 31, see
kernels/backend.py). Attention gathers
the query's channels into that order once and adds one `mx.quantized_matmul` per width. The order and its inverse are
per-layer constants, counted; a saved cache holds its layer's widths. The decode kernel's tiled pass reads every
class at its own width with the query gathered into the storage order (`kernels/decode.py`, Codec.widths;
WIDTH_BACKENDS), and the history-decode kernel writes each decoded row at its channel (dequantize.py;
WIDTH_HISTORY_BACKENDS: elsewhere a prefill chunk decodes the history through MLX, one `mx.dequantize` per width).
Keys before RoPE at different widths are turned by both kernels pair by pair, each channel read at its own row and
width, only on a backend in WIDTH_ROPE_BACKENDS (elsewhere rope=auto keeps such keys as given).

Option `minmax_keys` (true/false; default false) quantizes each key channel's block over its exact min..max
(`minmax_quantize`) where `mx.quantize` keeps the block's larger-magnitude end exact and widens the step until zero
is a code. Same arrays and layout: every reader, the decode kernels included, reads them unchanged.

Keys therefore have their token axis last, unlike the base class's "token axis -2" store, so this class
manages its own store layout: `_append_compressed`, `_compressed_view`, `capacity`, `trim` and
`iter_dense` are overridden. Value arrays keep the base layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import astuple, fields, replace
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np

from engine.errors import ConfigError
from engine.kvcache import kernels as _kernels
from engine.kvcache.base import SegmentedKVCache, _copy_now, _grow_to, skip_tokens
from engine.kvcache.config import WIDE_LAYERS_OPTION, WIDE_OPTION, KVCacheConfig, parse_wide_layers
from engine.kvcache.kernels import Codec
from engine.kvcache.kernels.kivi_encode import kivi_encode
from engine.kvcache.kernels.kivi_encode import supported as kivi_encode_supported
from engine.kvcache.methods._rotation import ROTATION_KINDS, rotation_arrays
from engine.kvcache.methods.affine import (
    AFFINE_BITS,
    AFFINE_GROUP_SIZES,
    ONE_BIT,
    SCALE_BITS,
    affine_dequantize,
    affine_matmul,
    affine_quantize,
    check_channel_groups,
    minmax_quantize,
    symmetric_quantize,
    with_symmetric_biases,
)
from engine.kvcache.quant.channel_widths import WidthClasses, width_choices
from engine.kvcache.quant.fused import compiled_on_gpu
from engine.kvcache.quant.grids import GRID_NAMES, check_grid, grid_dequantize, grid_quantize, grid_table
from engine.kvcache.quant.outliers import (
    OUTLIER_INDEX_BITS,
    OUTLIER_VALUE_BITS,
    add_block_residuals,
    block_residuals,
    scatter_block_scores,
    split_block_outliers,
)
from engine.kvcache.quant.rope import RopeParameters, model_rope
from engine.kvcache.quant.rotation import Rotation, hadamard_supported, make_rotation
from engine.kvcache.registry import register_method

# The key arrays (key_*) have the token axis last (per-channel keys); every other store array has it at -2. With
# key_widths each width's channels have their own codes, named with the width (key_codes_w3, ...); the scales, biases
# and outliers of every width are one array each, rows in the storage order (each width's rows, narrowest first).
_WIDTH_SUFFIX = re.compile(r"_w(\d+)$")
# A cache saved before the widths shared their scales, biases and outliers: one array of each per width.
_OLD_WIDTH_PART = re.compile(r"^(key_scales|key_biases|key_outlier_residuals|key_outlier_index)_w(\d+)$")

# Option key_widths: key channels at different widths (quant/channel_widths.py); `calibrated` asks the builder to
# measure them (engine/kvcache/key_widths.py), which writes the table's digest (kw...) in its place.
KEY_WIDTHS_OPTION = "key_widths"
KEY_WIDTHS_CALIBRATED = "calibrated"


def _is_key_part(name: str) -> bool:
    return name.startswith("key_")


def _width_store(store: dict[str, mx.array], width: int, start: int, end: int) -> dict[str, mx.array]:
    """The key arrays of one width's channels (storage rows [start, end)) under the plain names (key_codes, ...), as
    the affine ops read them: its codes, and its rows of the shared scales, biases and outliers."""
    part = {name: array[..., start:end, :] for name, array in store.items()
            if _is_key_part(name) and not name.startswith("key_codes")}
    part["key_codes"] = store[f"key_codes_w{width}"]
    return part


def merge_width_parts(store: dict[str, mx.array]) -> dict[str, mx.array]:
    """A store saved with one array of scales, biases and outliers per width (key_scales_w3, ...) in today's layout:
    each part one array, the widths' rows narrowest first (the storage order). Other stores come back as they are."""
    old: dict[str, list[tuple[int, mx.array]]] = {}
    for name, array in store.items():
        match = _OLD_WIDTH_PART.match(name)
        if match:
            old.setdefault(match.group(1), []).append((int(match.group(2)), array))
    if not old:
        return store
    merged = {name: array for name, array in store.items() if not _OLD_WIDTH_PART.match(name)}
    for part, arrays in old.items():
        merged[part] = mx.concatenate([array for _, array in sorted(arrays, key=lambda pair: pair[0])], axis=-2)
    return merged

# Option rope=pre (keys stored before RoPE) and the model's RoPE, which the builder writes beside it: one
# option per RopeParameters field, in its order.
ROPE_OPTION = "rope"
# rope=auto: keys before RoPE where the decode kernel turns them (`rope_pre_declines`), as given elsewhere; the
# builder resolves it for the model and device (to rope=pre with the RoPE written in, or no rope option).
ROPE_AUTO = "auto"
ROPE_PARAMETERS = tuple(f"rope_{field.name}" for field in fields(RopeParameters))


# Fractions of a group's half-range kept about its midpoint, tried by clip_search (1.0: plain min..max). At 2 bits,
# down to 0.85 lost +21.2 % perplexity, to 0.7 +13.8 %, to 0.6 +14.9 %, to 0.5 +16.6 % (held out, 2k windows, keys
# before RoPE: benchmarks/results/near_lossless_2bit_cliprange.json).
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
# Entries (candidates × the array's) quantized in one pass of the clip search. It bounds the pass's transient: the
# candidates in the array's dtype and their decoded float32 copy, ~6 bytes an entry (~100 MB at 2^24). A 2,048-token
# chunk of 8 kv heads of 128 takes its 7 candidates in one pass.
CLIP_PASS_ENTRIES = 1 << 24


# Lloyd steps of the 1-bit candidate (`_two_means`): the levels settle within a few.
TWO_MEANS_STEPS = 3


def _two_means(groups: mx.array, low: mx.array, high: mx.array) -> tuple[mx.array, mx.array]:
    """Per group (last axis), the two levels of the least squared error that 1 bit can hold: each the mean of the
    entries nearer it (Lloyd's iteration from min and max). Clipped to them, a group's 1-bit min..max code is its
    nearer level: for a bell-shaped channel about ±0.8σ, where min and max sit at ±2.5σ or beyond."""
    bottom, top = low, high
    for _ in range(TWO_MEANS_STEPS):
        upper = groups >= (bottom + top) / 2
        n_upper = upper.sum(axis=-1, keepdims=True)
        n_lower = groups.shape[-1] - n_upper
        top = mx.where(n_upper > 0, mx.where(upper, groups, 0).sum(axis=-1, keepdims=True) / mx.maximum(n_upper, 1), top)
        bottom = mx.where(n_lower > 0,
                          mx.where(upper, 0, groups).sum(axis=-1, keepdims=True) / mx.maximum(n_lower, 1), bottom)
    return bottom, top


def clipped_quantize(array: mx.array, role: str, group_size: int, bits: int) -> dict[str, mx.array]:
    """`affine_quantize` with each group clipped to the range (of CLIP_RATIOS, and at 1 bit its two means) that
    quantizes it with the least squared error (the first such range in that order); the same store entries and
    layout. The candidate ranges are quantized together, stacked on a new leading axis, in passes of at most
    CLIP_PASS_ENTRIES entries: on a GPU a pass is a few launches whatever its size."""
    shape = array.shape
    n_groups = shape[-1] // group_size
    exact = array.astype(mx.float32)
    groups = exact.reshape(*shape[:-1], n_groups, group_size)
    low, high = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
    middle, half = (low + high) / 2, (high - low) / 2
    ranges = [(middle - ratio * half, middle + ratio * half) for ratio in CLIP_RATIOS]
    if bits == ONE_BIT:
        ranges.append(_two_means(groups, low, high))
    per_pass = max(1, CLIP_PASS_ENTRIES // max(array.size, 1))
    best: dict[str, mx.array] = {}
    best_error: mx.array | None = None
    for first in range(0, len(ranges), per_pass):
        bottoms, tops = (mx.stack([pair[side] for pair in ranges[first : first + per_pass]]) for side in (0, 1))
        candidates = mx.clip(groups[None], bottoms, tops).reshape(-1, *shape).astype(array.dtype)
        if first == 0:  # 1.0 quantizes the array itself (clip's midpoint ± half-range can move min and max by a rounding)
            candidates = mx.concatenate([array[None], candidates[1:]])
        found = affine_quantize(candidates, role, group_size, bits)
        decoded = affine_dequantize(found, role, group_size, bits, float32_scales=True)
        errors = mx.square(decoded - exact).reshape(-1, *groups.shape).sum(axis=-1)  # [candidates, ..., n_groups]
        choice = mx.argmin(errors, axis=0)[None]  # the first of equal errors
        error = mx.take_along_axis(errors, choice, axis=0)[0]
        # scales/biases: one per group; codes: group_size·bits/32 words per group.
        chosen = {name: mx.take_along_axis(part.reshape(*part.shape[:-1], n_groups, -1), choice[..., None], axis=0)[0]
                  for name, part in found.items()}
        if best_error is None:
            best, best_error = chosen, error
            continue
        better = error < best_error
        best_error = mx.where(better, error, best_error)
        best = {name: mx.where(better[..., None], part, best[name]) for name, part in chosen.items()}
    return {name: part.reshape(*shape[:-1], -1) for name, part in best.items()}


# The quantizers by name: mx.compile takes strings, not functions, as constants.
_QUANTIZERS = {"affine": affine_quantize, "clipped": clipped_quantize, "minmax": minmax_quantize,
               "symmetric": symmetric_quantize}


def _key_block_entries(keys_transposed: mx.array, block: int, bits: int, quantizer: str, grid: str | None,
                       outliers: tuple[mx.array, mx.array] | None) -> dict[str, mx.array]:
    """Kᵀ [.., D, T] of one width quantized per channel over blocks of `block` tokens, as the store's key entries;
    `outliers`: each block's outlier and its index, already taken out of Kᵀ (`split_block_outliers`), or None."""
    store = (_QUANTIZERS[quantizer](keys_transposed, "key", block, bits) if grid is None
             else grid_quantize(keys_transposed, "key", block, bits, grid))
    if outliers is not None:
        # Stored as residuals against the decoded block (quant/outliers.py): a reader adds q_c·residual to one
        # token's score on top of the codes it reads anyway.
        decoded = affine_dequantize(store, "key", block, bits, float32_scales=True)
        store["key_outlier_residuals"] = block_residuals(decoded, *outliers, block)
        store["key_outlier_index"] = outliers[1]
    return store


@compiled_on_gpu
def quantize_key_blocks(keys_transposed: mx.array, key_order: mx.array | None,
                        width_rows: tuple[tuple[int, int, int], ...] | None, block: int, bits: int, quantizer: str,
                        grid: str | None, outliers: int) -> dict[str, mx.array]:
    """New keys Kᵀ [.., D, T] as the store's key entries (`_key_block_entries`), with each block's outlier aside where
    `outliers`; with key widths (`width_rows`: each width's (width, first row, end row) in the storage order
    `key_order` [n_kv, D]) each width's channels at that width, their codes named for it (key_codes_w3, ...), the
    scales, biases and outliers of all widths one entry each, rows in the storage order. Compiled
    on a GPU (quant/fused.py): the outlier split's reductions, the residuals and the clip search are chains of small
    operations."""
    if width_rows is not None:
        assert key_order is not None
        keys_transposed = mx.take_along_axis(keys_transposed, key_order[None, :, :, None], axis=-2)
    split: tuple[mx.array, mx.array] | None = None
    if outliers:  # per channel and block, so one split serves every width
        keys_transposed, block_outliers, index = split_block_outliers(keys_transposed, block)
        split = (block_outliers, index)
    if width_rows is None:
        return _key_block_entries(keys_transposed, block, bits, quantizer, grid, split)
    per_width = [
        _key_block_entries(keys_transposed[..., start:end, :], block, width, quantizer, None,
                           None if split is None else (split[0][..., start:end, :], split[1][..., start:end, :]))
        for width, start, end in width_rows
    ]
    store = {f"key_codes_w{width}": entries.pop("key_codes")
             for (width, _, _), entries in zip(width_rows, per_width, strict=True)}
    for name in per_width[0]:
        store[name] = mx.concatenate([entries[name] for entries in per_width], axis=-2)
    return store


@compiled_on_gpu
def quantize_value_groups(values: mx.array, group_size: int, bits: int, quantizer: str,
                          grid: str | None) -> dict[str, mx.array]:
    """New values [.., T, D] quantized per token in groups of `group_size` channels, as the store's value entries
    (compiled on a GPU: the symmetric form and the clip search are chains of small operations)."""
    if grid is None:
        return _QUANTIZERS[quantizer](values, "value", group_size, bits)
    return grid_quantize(values, "value", group_size, bits, grid)


class PlainHadamard:
    """H/√d on the last axis, without random signs: orthonormal and, for d = 2^k or 12·2^k, symmetric, so it is
    its own inverse. It holds no arrays (float32 out, as `Rotation`)."""

    def __init__(self, dim: int) -> None:
        if not hadamard_supported(dim) or dim % 20 == 0 or dim % 28 == 0:
            raise ConfigError(f"rotate_values=plain needs head_dim 2^k or 12·2^k, not {dim}.")
        self.dim = dim

    def forward(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x.astype(mx.float32), scale=1.0 / math.sqrt(self.dim))

    inverse = forward


@register_method("kivi")
class VeloxKIVIKVCache(SegmentedKVCache):
    supported_bits: ClassVar[tuple[int, ...]] = AFFINE_BITS
    default_bits: ClassVar[int] = 4
    supported_group_sizes: ClassVar[tuple[int, ...] | None] = AFFINE_GROUP_SIZES
    needs_calibration: ClassVar[bool] = False
    widens_layers: ClassVar[bool] = True
    attention_path: ClassVar[str] = "fused"
    description: ClassVar[str] = (
        "KIVI: keys quantized per channel over blocks of group_size tokens, values per token; the newest "
        "partial block stays 16-bit; attention reads the packed codes with quantized_matmul."
    )

    # The values' rotation (option rotate_values), or None; set by `_setup` once head_dim is known.
    _value_rotation: Rotation | PlainHadamard | None = None
    # The model's RoPE where the compressed keys are stored before it (option rope=pre), else None.
    _rope: RopeParameters | None = None
    # Option key_widths: each kv head's channels in storage order [n_kv, D] and its inverse, each width's rows, and
    # why they are missing where the table is not on this machine (set by `_setup`, or by a saved state).
    _key_order: mx.array | None = None
    _key_inverse: mx.array | None = None
    _width_classes: tuple[tuple[int, int, int], ...] | None = None
    _key_widths_missing: str | None = None

    @property
    def token_block(self) -> int:  # type: ignore[override]
        return self.token_block_for(self.config)

    @classmethod
    def check_config(cls, config: KVCacheConfig, head_dim: int) -> None:
        super().check_config(config, head_dim)
        check_channel_groups(cls.method_name, config, head_dim, what="values in ")
        if not isinstance(config.options.get("clip_search", False), bool):
            raise ConfigError("Method 'kivi' takes clip_search=true or clip_search=false.")
        rotate = config.options.get("rotate_values", False)
        if not (isinstance(rotate, bool) or rotate == "plain"):  # not `in`: 1 == True
            raise ConfigError("Method 'kivi' takes rotate_values=true, rotate_values=plain or rotate_values=false.")
        if config.options.get("rotate_values") == "plain":
            PlainHadamard(head_dim)  # raises for a head_dim it cannot transform
        elif cls.rotates_values(config) and config.rotation not in ROTATION_KINDS:
            raise ConfigError(
                f"Unknown rotation {config.rotation!r} for method 'kivi'; use {' or '.join(ROTATION_KINDS)}."
            )
        for role, bits in (("key", config.key_bits), ("value", config.value_bits)):
            grid = config.options.get(f"{role}_grid")
            if grid is None or grid == "uniform":
                continue
            if grid not in GRID_NAMES:
                raise ConfigError(f"Method 'kivi' takes {role}_grid=uniform or {role}_grid={' or '.join(GRID_NAMES)}.")
            check_grid(grid, bits)
            if config.options.get("clip_search", False):
                raise ConfigError("Method 'kivi' takes clip_search or a grid (key_grid, value_grid), not both.")
        # Each of these chooses a role's scales and biases its own way, as clip_search and a grid do.
        cls._check_own_scales(config, "symmetric_values", "value", "chooses its own scale and bias")
        cls._check_own_scales(config, "minmax_keys", "key", "chooses the keys' scales and biases its own way")
        outliers = config.options.get("key_outliers", 0)
        if isinstance(outliers, bool) or outliers not in (0, 1):
            raise ConfigError(f"Method 'kivi' takes key_outliers=0 or key_outliers=1, not {outliers!r}.")
        if outliers and cls.grid_of(config, "key") is not None:
            raise ConfigError("Method 'kivi' takes key_outliers or a key_grid, not both.")
        block = cls.key_block(config)
        if block not in AFFINE_GROUP_SIZES or cls.step % block:
            raise ConfigError(
                f"Method 'kivi' needs a key block (group size, or option key_block) of 32, 64 or 128 tokens, "
                f"not {block}."
            )
        cls.check_rope(config, head_dim)
        cls.check_key_widths(config)
        cls.check_wide(config, head_dim)

    @classmethod
    def _check_own_scales(cls, config: KVCacheConfig, option: str, role: str, why: str) -> None:
        """Boolean option `option`, which chooses `role`'s scales and biases itself: not with clip_search or a grid
        of that role."""
        chosen = config.options.get(option, False)
        if not isinstance(chosen, bool):
            raise ConfigError(f"Method 'kivi' takes {option}=true or {option}=false.")
        if chosen and (config.options.get("clip_search", False) or cls.grid_of(config, role) is not None):
            raise ConfigError(f"Method 'kivi' takes {option} without clip_search or a {role}_grid (each {why}).")

    @classmethod
    def check_key_widths(cls, config: KVCacheConfig) -> None:
        """Option key_widths: `calibrated`, or the digest the builder wrote for it; at key bits with a narrower and a
        wider code around them; not with a key grid (whose levels are per width)."""
        from engine.kvcache.key_widths import is_digest  # imported here: it imports the builder

        option = config.options.get(KEY_WIDTHS_OPTION)
        if option is None:
            return
        if option != KEY_WIDTHS_CALIBRATED and not is_digest(option):
            raise ConfigError("Method 'kivi' takes key_widths=calibrated (the builder then writes its calibration's "
                              f"digest, key_widths=kw...), not {option!r}.")
        choices = width_choices(config.key_bits)
        if len(choices) < 2 or choices[0] >= config.key_bits:
            raise ConfigError(f"Method 'kivi' takes key_widths at 2, 3, 4, 5 or 6 key bits (a narrower and a wider code "
                              f"around them), not {config.key_bits}.")
        if cls.grid_of(config, "key") is not None:
            raise ConfigError("Method 'kivi' takes key_widths or a key_grid, not both.")

    @classmethod
    def check_rope(cls, config: KVCacheConfig, head_dim: int) -> None:
        """Option rope=pre, and the model's RoPE beside it once the builder has written it (all or none)."""
        options = config.options
        rope = options.get(ROPE_OPTION)
        given = [name for name in ROPE_PARAMETERS if name in options]
        if rope is None or rope == ROPE_AUTO:
            if given:
                raise ConfigError(f"Method 'kivi' takes {given[0]} only with rope=pre.")
            return
        if rope != "pre":
            raise ConfigError("Method 'kivi' takes rope=pre (keys stored before RoPE), rope=auto (before RoPE where a "
                              "GPU decode kernel turns them, as given elsewhere) or no rope option.")
        if not given:
            return  # KVCacheBuilder.for_model writes the model's RoPE (resolve_for_model)
        if len(given) != len(ROPE_PARAMETERS):
            missing = [name for name in ROPE_PARAMETERS if name not in options]
            raise ConfigError(f"Method 'kivi' with rope=pre takes all of {', '.join(ROPE_PARAMETERS)}; "
                              f"{', '.join(missing)} missing.")
        dims, base, scale = options["rope_dims"], options["rope_base"], options["rope_scale"]
        if isinstance(dims, bool) or not isinstance(dims, int) or dims <= 0 or dims % 2 or dims > head_dim:
            raise ConfigError(f"rope_dims must be an even number of channels up to head_dim {head_dim}, not {dims!r}.")
        for name, value in (("rope_base", base), ("rope_scale", scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, not {value!r}.")
        if not isinstance(options["rope_traditional"], bool):
            raise ConfigError("rope_traditional must be true or false.")

    @classmethod
    def rope_parameters(cls, config: KVCacheConfig) -> RopeParameters | None:
        """The RoPE the compressed keys are stored before (option rope=pre with the model's RoPE written in)."""
        options = config.options
        if options.get(ROPE_OPTION) != "pre" or "rope_dims" not in options:
            return None
        dims, base, scale, traditional = (options[name] for name in ROPE_PARAMETERS)
        return RopeParameters(int(dims), float(base), float(scale), bool(traditional))

    @classmethod
    def gpu_unverified(cls, config: KVCacheConfig) -> str | None:
        """1-bit key channels (key_widths at 2 key bits) until a GPU backend has passed their parity run
        (decode.ONE_BIT_BACKENDS)."""
        if KEY_WIDTHS_OPTION in config.options and 1 in width_choices(config.key_bits) and not (
                set(_kernels.decode.ONE_BIT_BACKENDS) & {"cuda", "metal"}):
            return "no GPU decode kernel has passed the parity tests with 1-bit key channels yet"
        return None

    @classmethod
    def rope_pre_declines(cls, config: KVCacheConfig, model: Any) -> str | None:
        """Why `rope=auto` keeps the keys as the model gives them for `config` on `model` here (None: it stores
        them before RoPE): only where the decode kernel will turn them (a GPU backend in ROPE_BACKENDS, kernels
        not off, the model's plain RoPE over every channel, a tiled-pass tile for every layer's bits); anywhere
        else keys before RoPE would make every decode step decode the whole history."""
        if config.options.get("kernels", _kernels.DEFAULT_KERNEL_MODE) == "off":
            return "kernels are off"
        if _kernels.available_backend() is None:
            return f"no GPU decode kernel turns keys on the default device ({mx.default_device()})"
        try:
            rope = model_rope(model)
        except ConfigError as error:
            return str(error)
        # The builder imports the methods: imported at call time.
        from engine.kvcache.builder import model_shape

        shape = model_shape(model)
        head_dim = shape.head_dim
        if not (_kernels.decode.head_dim_supported(head_dim) and _kernels.decode.group_supported(config.group_size)):
            return f"the decode kernel has no variant for head_dim {head_dim} and group size {config.group_size}"
        layers = (config.without_wide(), config.widened()) if config.wide_fraction is not None else (config,)
        for layer in layers:  # the widened layers' codes too
            declined = cls._rope_kernel_declines(layer, rope, head_dim, shape.n_heads // shape.n_kv_heads)
            if declined is not None:
                return declined
        return None

    @classmethod
    def _rope_kernel_declines(cls, config: KVCacheConfig, rope: RopeParameters, head_dim: int,
                              rows: int) -> str | None:
        """Why the decode kernel cannot turn the keys of one layer's `config`, stored before `rope`, on this
        device (None: it can); the cache asks it of itself (`_kernel_declines_here`) and rope=auto of every
        layer before choosing, for `rows` query heads per kv head (the tile depends on them)."""
        if _kernels.available_backend() not in _kernels.decode.ROPE_BACKENDS:
            return "the decode kernel's RoPE (rope=pre) has not passed the parity tests on this backend yet"
        tiled_declines = _kernels.decode.tiled_declines(_kernels.available_backend())
        if tiled_declines is not None:
            return tiled_declines  # only the tiled pass turns keys
        if rope.dims != head_dim:
            return f"the decode kernel turns keys over all channels, not rope_dims {rope.dims} of {head_dim}"
        widths = width_choices(config.key_bits) if KEY_WIDTHS_OPTION in config.options else ()
        if widths and _kernels.available_backend() not in _kernels.decode.WIDTH_ROPE_BACKENDS:
            return ("the decode kernel's key widths before RoPE (key_widths with rope=pre) have not passed the parity "
                    "tests on this backend yet")
        key = Codec("kivi_keys", config.key_bits, grid=cls.grid_of(config, "key") is not None, widths=widths)
        value = Codec("affine", config.value_bits, grid=cls.grid_of(config, "value") is not None)
        if _kernels.decode.tiled_tile(key, value, config.group_size, head_dim, cls.key_block(config), rows) is None:
            return (f"only the tiled decode pass turns keys stored before RoPE, and it has no tile for {rows} query "
                    f"heads per kv head in this layout")
        return cls._outlier_kernel_declines(config, head_dim, rows)  # the outliers' own tile and backend

    @classmethod
    def resolve_for_model(cls, config: KVCacheConfig, model: Any) -> KVCacheConfig:
        if config.options.get(ROPE_OPTION) == ROPE_AUTO:
            if cls.rope_pre_declines(config, model) is not None:
                return replace(config, options={k: v for k, v in config.options.items() if k != ROPE_OPTION})
            config = replace(config, options={**config.options, ROPE_OPTION: "pre"})
        if config.options.get(ROPE_OPTION) != "pre":
            return config
        rope = model_rope(model)
        written = cls.rope_parameters(config)
        if written is not None:
            if written != rope:
                raise ConfigError(f"This KV cache stores keys before the RoPE {written}; the model's is {rope}.")
            return config
        return replace(config, options={**config.options, **dict(zip(ROPE_PARAMETERS, astuple(rope), strict=True))})

    def _kernel_rope(self) -> tuple[mx.array, bool] | None:
        # The kernels turn every channel pair: a RoPE over fewer channels (rope_dims < head_dim) has no kernel.
        if self._rope is None or self._rope.dims != self._k_head_dim:
            return None
        return self._rope.frequencies(), self._rope.traditional

    def _kernel_declines_here(self, rows: int) -> str | None:
        if self._rope is None:
            return self._outlier_kernel_declines(self.config, self._k_head_dim, rows)
        return self._rope_kernel_declines(self.config, self._rope, self._k_head_dim, rows)

    @classmethod
    def _outlier_kernel_declines(cls, config: KVCacheConfig, head_dim: int, rows: int) -> str | None:
        """Why the decode kernel cannot add one layer's key outliers (option key_outliers) on this device, for `rows`
        query heads per kv head (None: it can, or the layer has none)."""
        if not config.options.get("key_outliers", 0):
            return None
        if _kernels.available_backend() not in _kernels.decode.OUTLIER_BACKENDS:
            return "the decode kernel's key outliers (key_outliers) have not passed the parity tests on this backend yet"
        key = Codec("kivi_keys", config.key_bits, outliers=True)
        value = Codec("affine", config.value_bits, grid=cls.grid_of(config, "value") is not None)
        if _kernels.decode.tiled_tile(key, value, config.group_size, head_dim, cls.key_block(config), rows) is None:
            return (f"only the tiled decode pass adds key outliers, and it has no tile for {rows} query heads per kv "
                    f"head in this layout")
        return None

    @classmethod
    def check_wide(cls, config: KVCacheConfig, head_dim: int) -> None:
        """Options `wide=F` (a fraction 0..1 of the layers stored with one more key and value bit) and
        `wide_layers=L...` (which ones, given with `wide`; the builder writes it after calibrating): the
        widened bits must be bits kivi has (8 cannot widen, nor 6: there is no 7-bit code), and the widened
        configuration must pass every other check (a grid at its bits, say)."""
        options = config.options
        if WIDE_OPTION not in options:
            if WIDE_LAYERS_OPTION in options:
                raise ConfigError("Method 'kivi' takes wide_layers only with wide=F (the fraction it widens).")
            return
        fraction = options[WIDE_OPTION]
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ConfigError(f"Method 'kivi' takes wide=F with F a fraction of the layers, 0 to 1, not {fraction!r}.")
        if WIDE_LAYERS_OPTION in options:
            parse_wide_layers(options[WIDE_LAYERS_OPTION])
        widened = config.widened()
        for role, bits in (("key", widened.key_bits), ("value", widened.value_bits)):
            if bits not in cls.supported_bits:
                raise ConfigError(
                    f"Method 'kivi' cannot widen {bits - 1}-bit {role}s (wide={fraction}): a wide layer stores "
                    f"one more bit and kivi has {', '.join(str(b) for b in cls.supported_bits)}-bit codes."
                )
        cls.check_config(widened, head_dim)

    @classmethod
    def key_block(cls, config: KVCacheConfig) -> int:
        """Tokens per key block (one scale and bias per channel and block): option `key_block`, else the
        group size. Larger blocks halve the keys' scale overhead (0.25 instead of 0.5 bits at 128)."""
        return int(config.options.get("key_block", config.group_size))

    @classmethod
    def token_block_for(cls, config: KVCacheConfig) -> int:
        return cls.key_block(config)

    @classmethod
    def grid_of(cls, config: KVCacheConfig, role: str) -> str | None:
        """Option `key_grid` / `value_grid`: the non-uniform levels `role` codes decode to (`quant/grids.py`),
        or None (evenly spaced: affine)."""
        grid = config.options.get(f"{role}_grid")
        return None if grid in (None, "uniform") else grid

    @classmethod
    def decodes_history_without_kernel(cls, config: KVCacheConfig) -> str | None:
        if config.options.get(ROPE_OPTION) == "pre":
            return "keys stored before RoPE (rope=pre) must be turned by their positions: attention decodes them"
        if cls.grid_of(config, "key") is not None or cls.grid_of(config, "value") is not None:
            # Measured on the 2-core CPU, SmolLM2 at 4,000 tokens: 3.2 tok/s against 8.1 for plain 2-bit KIVI
            # (benchmarks/results/cpu_decode_probe.json).
            return "no quantized_matmul reads codes on a grid (key_grid, value_grid): attention decodes them"
        return None

    @classmethod
    def rotates_values(cls, config: KVCacheConfig) -> bool:
        return bool(config.options.get("rotate_values", False))

    @classmethod
    def constant_bytes(cls, config: KVCacheConfig, head_dim: int) -> int:
        if config.options.get("rotate_values", False) in (False, "plain"):
            return 0
        rotation = make_rotation(head_dim, config.seed, config.rotation)
        return sum(array.nbytes for array in rotation_arrays(rotation))

    def _setup(
        self, batch: int, n_kv_heads: int, k_head_dim: int, v_head_dim: int, input_dtype: mx.Dtype
    ) -> None:
        super()._setup(batch, n_kv_heads, k_head_dim, v_head_dim, input_dtype)
        self._rope = self.rope_parameters(self.config)
        if self._rope is None and self.config.options.get(ROPE_OPTION) == "pre":
            raise ConfigError("A KIVI cache with rope=pre needs the model's RoPE in its spec: build it with "
                              "KVCacheBuilder(config).for_model(model).")
        if self.config.options.get("rotate_values") == "plain":
            self._value_rotation = PlainHadamard(v_head_dim)
        elif self.rotates_values(self.config):
            self._value_rotation = make_rotation(v_head_dim, self.config.seed + self.layer_index, self.config.rotation)
        self._setup_key_widths()

    def _setup_key_widths(self) -> None:
        """This layer's key channel widths (option key_widths) from its calibration's table, where this process or
        this machine has it; a saved cache brings its own (`_load_extra_state`), so a missing table is an error only
        when the cache is used without one (`_width_rows`)."""
        # Imported here: key_widths imports the builder, which imports the methods.
        from engine.kvcache.key_widths import key_widths_table

        self._key_order = self._key_inverse = None
        self._width_classes = None
        self._key_widths_missing = None
        option = self.config.options.get(KEY_WIDTHS_OPTION)
        if option is None:
            return
        if option == KEY_WIDTHS_CALIBRATED:
            raise ConfigError("A KIVI cache with key_widths=calibrated needs its model's calibration: build it with "
                              "KVCacheBuilder(config).for_model(model).")
        try:
            table = key_widths_table(option)
        except ConfigError as error:
            self._key_widths_missing = str(error)
            return
        if self.layer_index >= len(table):
            raise ConfigError(f"The key width calibration {option} has {len(table)} layers; this is layer "
                              f"{self.layer_index}.")
        self._set_key_widths(table[self.layer_index])

    def _set_key_widths(self, widths: np.ndarray) -> None:
        expected = (self._n_kv_heads, self._k_head_dim)
        if tuple(widths.shape) != expected:
            raise ConfigError(f"Key channel widths shaped {tuple(widths.shape)} do not fit {expected[0]} kv heads of "
                              f"{expected[1]} channels.")
        try:
            classes = WidthClasses.of(widths, self.config.key_bits)
        except ValueError as error:
            raise ConfigError(f"Layer {self.layer_index}'s key channel widths: {error}") from error
        dtype = mx.uint8 if self._k_head_dim <= 256 else mx.uint16
        self._key_order = mx.array(classes.order, dtype=dtype)
        self._key_inverse = mx.array(classes.inverse, dtype=dtype)
        self._width_classes = classes.rows
        self._key_widths_missing = None

    @property
    def _width_rows(self) -> tuple[tuple[int, int, int], ...] | None:
        """(width, first row, end row) of each width's channels in storage order, or None (one width)."""
        if self._key_widths_missing is not None:
            raise ConfigError(self._key_widths_missing)
        return self._width_classes

    def _layer_widths(self) -> np.ndarray:
        """[n_kv, D] uint8: each key channel's width (from the storage order and the widths' rows)."""
        assert self._key_order is not None and self._width_classes is not None
        by_row = np.zeros(self._k_head_dim, dtype=np.uint8)
        for width, start, end in self._width_classes:
            by_row[start:end] = width
        widths = np.empty((self._n_kv_heads, self._k_head_dim), dtype=np.uint8)
        np.put_along_axis(widths, np.array(self._key_order).astype(np.int64),
                          np.broadcast_to(by_row, widths.shape), axis=1)
        return widths

    def _extra_state(self) -> dict[str, Any]:
        return {} if self._key_order is None else {"key_widths": mx.array(self._layer_widths())}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        if "key_widths" in extra:
            self._set_key_widths(np.array(extra["key_widths"]))
        if self._store is not None:
            self._store = merge_width_parts(self._store)

    def _constant_arrays(self) -> list[mx.array]:
        arrays = rotation_arrays(self._value_rotation) if isinstance(self._value_rotation, Rotation) else []
        if self._key_order is not None:
            arrays += [self._key_order, self._key_inverse]
        return arrays

    @classmethod
    def head_constant_bytes(cls, config: KVCacheConfig, head_dim: int) -> int:
        # key_widths: each kv head's channel order and its inverse.
        if KEY_WIDTHS_OPTION not in config.options:
            return 0
        return 2 * head_dim * (1 if head_dim <= 256 else 2)

    # Values live rotated in the cache (sinks and window too), so attention's output is in the rotated space.
    def _values_in(self, values: mx.array) -> mx.array:
        return values if self._value_rotation is None else self._value_rotation.forward(values)

    def _output_out(self, output: mx.array) -> mx.array:
        return output if self._value_rotation is None else self._value_rotation.inverse(output)

    def _output_rotation_signs(self) -> mx.array | None:
        if isinstance(self._value_rotation, Rotation):
            return self._value_rotation.sylvester_inverse_signs()
        return None

    def _values_out(self, values: mx.array) -> mx.array:
        return values if self._value_rotation is None else self._value_rotation.inverse(values)

    @classmethod
    def compressed_bits_per_token(cls, config: KVCacheConfig, head_dim: int) -> float:
        # Keys: a scale and a bias per channel and block of G tokens = head_dim·32/G bits per token.
        key_bits = head_dim * config.key_bits + head_dim * 2 * SCALE_BITS / cls.key_block(config)
        # key_outliers: one 16-bit entry and its 8-bit index per channel and block.
        key_bits += config.options.get("key_outliers", 0) * head_dim * (
            OUTLIER_VALUE_BITS + OUTLIER_INDEX_BITS) / cls.key_block(config)
        # Values: a scale and a bias per token and group of G channels (symmetric_values: the scale only).
        sides = 1 if config.options.get("symmetric_values", False) else 2
        value_bits = head_dim * config.value_bits + head_dim // config.group_size * sides * SCALE_BITS
        return float(key_bits + value_bits)

    # ----- encode / decode --------------------------------------------------------------------------------

    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        options = self.config.options
        clipped = "clipped" if options.get("clip_search", False) else "affine"
        key_quantizer = "minmax" if options.get("minmax_keys", False) else clipped
        value_quantizer = "symmetric" if options.get("symmetric_values", False) else clipped
        if self._rope is not None:  # these tokens are compressed tokens n_compressed, ... (= their positions)
            keys = self._rope.rotate(keys, self._n_compressed, inverse=True).astype(keys.dtype)
        rows = self._width_rows
        backend = self._encode_backend(key_quantizer, value_quantizer)
        if backend is not None:  # one launch for both roles (kernels/kivi_encode.py)
            return kivi_encode(keys, values, rows, self._key_order if rows else None, self.config.key_bits,
                               self.token_block, key_quantizer, bool(options.get("key_outliers", 0)),
                               self.config.group_size, self.config.value_bits, value_quantizer, backend,
                               (CLIP_RATIOS, TWO_MEANS_STEPS))
        # [.., T, D] -> [.., D, T]: groups of G along the token axis = one block per channel.
        key_store = quantize_key_blocks(keys.swapaxes(-1, -2), self._key_order if rows else None, rows,
                                        self.token_block, self.config.key_bits, key_quantizer,
                                        self.grid_of(self.config, "key"), int(options.get("key_outliers", 0)))
        value_store = quantize_value_groups(values, self.config.group_size, self.config.value_bits, value_quantizer,
                                            self.grid_of(self.config, "value"))
        return {**value_store, **key_store}

    def _encode_backend(self, key_quantizer: str, value_quantizer: str) -> str | None:
        """The kernel backend that encodes this cache's chunks in one launch (kernels/kivi_encode.py), or None: the
        reference's operations (kernels off, no GPU, or a rule the kernel lacks: grids)."""
        if self.config.options.get("kernels", _kernels.DEFAULT_KERNEL_MODE) == "off":
            return None
        backend = _kernels.available_backend()
        rows = self._width_rows
        widths = tuple(width for width, _, _ in rows) if rows else (self.config.key_bits,)
        grids = self.grid_of(self.config, "key") is not None or self.grid_of(self.config, "value") is not None
        if not kivi_encode_supported(key_quantizer, value_quantizer, widths, self.config.group_size, self.token_block,
                                     self._k_head_dim, backend, grids) or self._v_head_dim != self._k_head_dim:
            return None
        return backend

    def _plain_keys(self, store: dict[str, mx.array], *, float32_scales: bool) -> mx.array:
        """Decoded Kᵀ [.., D, T] of affine keys (no grid), outliers restored; key_widths: every width's channels
        decoded at its width, then put back in channel order."""
        rows = self._width_rows
        if rows is None:
            return self._with_outliers(store, affine_dequantize(
                store, "key", self.token_block, self.config.key_bits, float32_scales=float32_scales))
        assert self._key_inverse is not None
        parts = []
        for width, start, end in rows:
            part = _width_store(store, width, start, end)
            parts.append(self._with_outliers(part, affine_dequantize(
                part, "key", self.token_block, width, float32_scales=float32_scales)))
        ordered = mx.concatenate(parts, axis=-2)
        return mx.take_along_axis(ordered, self._key_inverse[None, :, :, None], axis=-2)

    def _readable(self, store: dict[str, mx.array]) -> dict[str, mx.array]:
        """`store` as MLX's affine operations and the decode kernel read it: with the values' biases derived from
        their scales where values are symmetric (transient)."""
        if self.config.options.get("symmetric_values", False):
            return with_symmetric_biases(store, "value", self.config.value_bits)
        return store

    def _with_outliers(self, store: dict[str, mx.array], keys_transposed: mx.array) -> mx.array:
        """Decoded Kᵀ with the blocks' 16-bit outliers restored (option key_outliers: their residuals added)."""
        if "key_outlier_residuals" not in store:
            return keys_transposed
        return add_block_residuals(keys_transposed, store["key_outlier_residuals"], store["key_outlier_index"],
                                      self.token_block)

    def _grid_decode(self, store: dict[str, mx.array], role: str) -> mx.array | None:
        """float32 decoded `role` entries if that role has a grid, else None (keys come out as Kᵀ, as stored)."""
        grid = self.grid_of(self.config, role)
        if grid is None:
            return None
        if role == "key":
            return grid_dequantize(store, "key", self.token_block, self.config.key_bits, grid)
        return grid_dequantize(store, "value", self.config.group_size, self.config.value_bits, grid)

    def _decode(self, store: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
        group_size = self.config.group_size
        dtype = store["value_scales"].dtype
        store = self._readable(store)
        keys_transposed = self._grid_decode(store, "key")
        if keys_transposed is None:
            keys_transposed = self._plain_keys(store, float32_scales=False)
        values = self._grid_decode(store, "value")
        if values is None:
            values = affine_dequantize(store, "value", group_size, self.config.value_bits, float32_scales=False)
        return keys_transposed.swapaxes(-1, -2).astype(dtype), values.astype(dtype)

    # Attention's dequantize path (prefill chunks) computes in float32: float32 scales make `mx.dequantize`
    # ~7x faster on the CPU (its float16 arithmetic is scalar there; measured 14 -> 2 ms for 7.9k tokens x 3
    # heads x 64 channels), and the keys come out as Kᵀ, the layout the score matmul wants.
    def _decode_keys(self, store: dict[str, mx.array]) -> mx.array:
        keys_transposed = self._grid_decode(store, "key")
        if keys_transposed is not None:
            return keys_transposed.swapaxes(-1, -2)
        return self._plain_keys(store, float32_scales=True).swapaxes(-1, -2)

    # Compressed token i is at position i: KIVI keeps the sinks' copies in its stream (`sinks_in_stream`), so
    # the stream starts at position 0.
    def _keys_by_position(self) -> bool:
        return self._rope is not None

    def _decode_at(self, store: dict[str, mx.array], start: int) -> tuple[mx.array, mx.array]:
        keys, values = self._decode(store)
        if self._rope is not None:
            keys = self._rope.rotate(keys, start).astype(keys.dtype)
        return keys, values

    def _decode_keys_at(self, store: dict[str, mx.array], start: int) -> mx.array:
        keys = self._decode_keys(store)
        return keys if self._rope is None else self._rope.rotate(keys, start)

    def _decode_values(self, store: dict[str, mx.array]) -> mx.array:
        values = self._grid_decode(store, "value")
        if values is not None:
            return values
        return affine_dequantize(
            self._readable(store), "value", self.config.group_size, self.config.value_bits, float32_scales=True
        )

    def _compressed_scores(self, queries: mx.array, store: dict[str, mx.array]) -> mx.array:
        # queries [.., R, D] @ Kᵀ [.., D, T] with Kᵀ quantized along T: transpose=False.
        keys_transposed = self._grid_decode(store, "key")
        if keys_transposed is not None:  # no quantized_matmul reads a grid: decode, then multiply
            return queries.astype(mx.float32) @ keys_transposed
        rows = self._width_rows
        if rows is None:
            return self._plain_scores(queries, store, self.config.key_bits)
        # key_widths: the queries' channels gathered into the keys' storage order once, one product per width.
        assert self._key_order is not None
        ordered = mx.take_along_axis(queries, self._key_order[None, :, None, :], axis=-1)
        scores = None
        for width, start, end in rows:
            part = self._plain_scores(ordered[..., start:end], _width_store(store, width, start, end),
                                      width).astype(mx.float32)
            scores = part if scores is None else scores + part
        assert scores is not None
        return scores

    def _plain_scores(self, queries: mx.array, store: dict[str, mx.array], bits: int) -> mx.array:
        scores = affine_matmul(queries, store, "key", self.token_block, bits, transpose=False)
        if "key_outlier_residuals" in store:  # each block's outlier: one product added to one token's score
            scores = scatter_block_scores(scores, queries, store["key_outlier_residuals"], store["key_outlier_index"],
                                          self.token_block)
        return scores

    def _compressed_values(self, weights: mx.array, store: dict[str, mx.array]) -> mx.array:
        values = self._grid_decode(store, "value")
        if values is not None:
            return weights.astype(mx.float32) @ values
        return affine_matmul(
            weights, self._readable(store), "value", self.config.group_size, self.config.value_bits, transpose=False
        )

    def _kernel_key_block(self) -> int:
        return self.key_block(self.config)

    def _kernel_codecs(self) -> tuple[Codec, list[mx.array], Codec, list[mx.array]] | None:
        assert self._store is not None
        # The store's own arrays, never derived ones: the plan that holds them lives while blocks are appended in place
        # (symmetric values: the kernel derives each bias from the scales; the placeholder where the biases would be
        # is never read, see Codec.symmetric).
        store = self._store
        key_grid, value_grid = self.grid_of(self.config, "key"), self.grid_of(self.config, "value")
        symmetric = bool(self.config.options.get("symmetric_values", False))
        # A gridded role's arrays end with its levels (only the tiled decode pass reads grids: see Codec.grid).
        outliers = "key_outlier_residuals" in store
        rows = self._width_rows
        if rows is not None:  # key widths: every class of width_choices, None where the layer has no such channel
            assert self._key_order is not None
            present = {width: end for width, _, end in rows}
            widths = width_choices(self.config.key_bits)
            ends, end = [], 0
            for width in widths:
                end = present.get(width, end)
                ends.append(end)
            # The tiled pass stages D x key bits words a token (KMEAN): the widths must average the key bits exactly
            # (WidthClasses checks it when the widths are set).
            assert sum((e - s) * w for w, s, e in zip(widths, [0, *ends], ends, strict=False)) == (
                self._k_head_dim * self.config.key_bits)
            # each class's codes (None where the layer has no channel of that width), then the classes' shared
            # scales, biases and outliers
            key_arrays = [_kernels.decode.width_ends(tuple(ends)), self._key_order, self._key_inverse,
                          *(store.get(f"key_codes_w{width}") for width in widths),
                          store["key_scales"], store["key_biases"],
                          *((store["key_outlier_residuals"], store["key_outlier_index"]) if outliers else ())]
            codec = Codec("kivi_keys", self.config.key_bits, outliers=outliers, widths=widths)
            return (codec, key_arrays, *self._value_codec(store, value_grid, symmetric))
        return (
            Codec("kivi_keys", self.config.key_bits, grid=key_grid is not None, outliers=outliers),
            [store["key_codes"], store["key_scales"], store["key_biases"],
             *([] if key_grid is None else [grid_table(key_grid, "key", self.config.key_bits)]),
             *([store["key_outlier_residuals"], store["key_outlier_index"]] if outliers else [])],
            *self._value_codec(store, value_grid, symmetric),
        )

    def _value_codec(self, store: dict[str, mx.array], grid: str | None,
                     symmetric: bool) -> tuple[Codec, list[mx.array]]:
        return (
            Codec("affine", self.config.value_bits, grid=grid is not None, symmetric=symmetric),
            [store["value_codes"], store["value_scales"], store["value_scales" if symmetric else "value_biases"],
             *([] if grid is None else [grid_table(grid, "value", self.config.value_bits)])],
        )

    # ----- store layout: keys have the token axis last --------------------------------------------------

    def _key_units(self, name: str, n_tokens: int) -> int:
        """Length along the last axis of key array `name` for `n_tokens` tokens (a multiple of G)."""
        if name.startswith("key_codes"):
            width = _WIDTH_SUFFIX.search(name)
            return n_tokens * (self.config.key_bits if width is None else int(width.group(1))) // 32
        return n_tokens // self.token_block

    def _slice_store(self, store: dict[str, mx.array], start: int, end: int) -> dict[str, mx.array]:
        """Tokens [start, end) of every store array; start and end are multiples of G."""
        return {
            name: (
                array[..., self._key_units(name, start) : self._key_units(name, end)]
                if _is_key_part(name)
                else array[..., start:end, :]
            )
            for name, array in store.items()
        }

    @property
    def capacity(self) -> int:
        return 0 if self._store is None else self._store["value_codes"].shape[-2]

    def _append_compressed(self, chunk: dict[str, mx.array]) -> None:
        n_new = chunk["value_codes"].shape[-2]
        used = self._n_compressed
        needed = used + n_new
        if self._store is None or needed > self.capacity:
            new_capacity = self._growth_slots(needed, n_new, grows_existing=self._store is not None)
            grown = {}
            for name, part in chunk.items():
                old = None if self._store is None else self._store[name]
                if _is_key_part(name):
                    buffer = mx.zeros(
                        (*part.shape[:-1], self._key_units(name, new_capacity)), dtype=part.dtype
                    )
                    if old is not None and used:
                        buffer[..., : self._key_units(name, used)] = old[..., : self._key_units(name, used)]
                    grown[name] = buffer
                else:
                    grown[name] = _grow_to(old, used, new_capacity, like=part)
            if used:
                _copy_now(list(grown.values()))
            self._store = grown
        for name, part in chunk.items():
            if _is_key_part(name):
                self._store[name][..., self._key_units(name, used) : self._key_units(name, needed)] = part
            else:
                self._store[name][..., used:needed, :] = part
        self._n_compressed = needed

    def _compressed_view(self) -> dict[str, mx.array]:
        assert self._store is not None
        if self._n_compressed == self.capacity:
            return self._store
        return self._slice_store(self._store, 0, self._n_compressed)

    def trim(self, n: int) -> int:
        """Drop the newest `n` tokens. A block cut in the middle cannot stay quantized (its scales cover
        G tokens), so its kept tokens move into the 16-bit window, decoded: attention and `to_dense` see
        exactly the values they saw before the trim; they are quantized again when the block refills."""
        trimmed = super().trim(n)
        group_size = self.token_block
        partial = self._n_compressed % group_size
        if partial:
            assert self._store is not None and self.n_window == 0
            block_start = self._n_compressed - partial
            # The whole block is still in the buffer (trimming only lowered the count): decode it.
            keys, values = self._decode_at(
                self._slice_store(self._store, block_start, block_start + group_size), block_start)
            self._window_keys = keys[..., :partial, :]
            self._window_values = values[..., :partial, :]
            self._n_compressed = block_start
        return trimmed

    def reuse_trim_length(self, n: int) -> int:
        """`n`, widened to the start of the key block it would cut: a cut block's kept tokens survive only
        decoded (see `trim`), and quantized again with the tokens that refill the block they would differ
        from the block an untrimmed cache holds; trimming back to the block start and running those tokens
        again keeps every block quantized once, from the model's own keys."""
        n = min(self.offset, max(0, n))
        compressed_cut = n - self.n_window
        if compressed_cut <= 0 or compressed_cut >= self._n_compressed:
            return n  # only window tokens go, or every compressed block (sinks are kept token by token)
        return n + (self._n_compressed - compressed_cut) % self.token_block

    def iter_dense(self, chunk_tokens: int = 1024) -> Iterator[tuple[mx.array, mx.array]]:
        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive.")
        dtype = self.input_dtype
        if self.n_sink:
            yield self._sink_keys.astype(dtype), self._values_out(self._sink_values).astype(dtype)
        yield from skip_tokens(self._iter_stream(chunk_tokens), self.n_duplicated)

    def _iter_stream(self, chunk_tokens: int) -> Iterator[tuple[mx.array, mx.array]]:
        dtype = self.input_dtype
        group_size = self.token_block
        # Decode whole blocks at a time, then hand them out at most `chunk_tokens` tokens at once.
        span = max(group_size, chunk_tokens // group_size * group_size)
        for start in range(0, self._n_compressed, span):
            end = min(start + span, self._n_compressed)
            assert self._store is not None
            keys, values = self._decode_at(self._slice_store(self._store, start, end), start)
            for piece in range(0, end - start, chunk_tokens):
                yield (
                    keys[..., piece : piece + chunk_tokens, :].astype(dtype),
                    self._values_out(values[..., piece : piece + chunk_tokens, :]).astype(dtype),
                )
        if self.n_window:
            yield self._window_keys.astype(dtype), self._values_out(self._window_values).astype(dtype)
