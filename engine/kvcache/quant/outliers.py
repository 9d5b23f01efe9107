"""Dense-and-sparse blocks: the one entry per block that widens its range most, kept aside in 16 bits.

KVQuant keeps the ~1 % largest key entries out of the quantizer; KIVI's per-channel key blocks (128 tokens of one
channel) are quantized between their min and max, so one large entry spreads the block's other 127 over a few codes.
`split_block_outliers` takes, per block, the entry whose removal shrinks the block's range most (its max or its min,
whichever is farther from its neighbour in sorted order), replaces it by that neighbour (the new range's end, so it
no longer sets the range), and returns it with its index in the block. What is stored is not the entry but its
residual against the decoded block, entry − decoded[index] (`block_residuals`), so a reader adds one product to the
score of one token: q_c·residual, on top of the codes it reads anyway (the decode kernel, and `scatter_block_scores`
on the reference path), and `add_block_residuals` restores decoded keys. One entry per 128-token block is 0.78 % of
the entries and costs 16 + 8 bits per block.
"""

from __future__ import annotations

import math

import mlx.core as mx

OUTLIER_INDEX_BITS = 8  # a uint8 index within a block (blocks of at most 256 entries)
OUTLIER_VALUE_BITS = 16


def split_block_outliers(array: mx.array, block: int) -> tuple[mx.array, mx.array, mx.array]:
    """(array with each block's outlier replaced, outliers [..., n_blocks] float32, their indices uint8) for blocks of
    `block` entries along the last axis (a multiple of `block`)."""
    if block > 1 << OUTLIER_INDEX_BITS or array.shape[-1] % block:
        raise ValueError(f"Blocks of {block} entries do not tile an axis of {array.shape[-1]} with uint8 indices.")
    shape = array.shape
    blocks = array.astype(mx.float32).reshape(*shape[:-1], shape[-1] // block, block)
    # The two largest and two smallest entries by reductions, not a sort: MLX's CUDA sort launches a row of the grid
    # per block, and a 33k-token chunk of 2 kv heads has more blocks (66k) than a CUDA grid has rows (65,535).
    positions = mx.arange(block)
    top_at, low_at = mx.argmax(blocks, axis=-1), mx.argmin(blocks, axis=-1)
    top, low = mx.max(blocks, axis=-1), mx.min(blocks, axis=-1)
    below_top = mx.max(mx.where(positions == top_at[..., None], -mx.inf, blocks), axis=-1)
    above_low = mx.min(mx.where(positions == low_at[..., None], mx.inf, blocks), axis=-1)
    take_top = (top - below_top) >= (above_low - low)
    index = mx.where(take_top, top_at, low_at)
    outlier = mx.where(take_top, top, low)
    fill = mx.where(take_top, below_top, above_low)
    kept = mx.where(positions == index[..., None], fill[..., None], blocks)
    return kept.reshape(shape).astype(array.dtype), outlier, index.astype(mx.uint8)


def block_residuals(decoded: mx.array, outliers: mx.array, index: mx.array, block: int) -> mx.array:
    """float16 outlier − decoded entry at its index, per block of `block` entries along `decoded`'s last axis."""
    shape = decoded.shape
    blocks = decoded.astype(mx.float32).reshape(*shape[:-1], shape[-1] // block, block)
    at = mx.take_along_axis(blocks, index.astype(mx.int32)[..., None], axis=-1)[..., 0]
    return (outliers.astype(mx.float32) - at).astype(mx.float16)


def add_block_residuals(array: mx.array, residuals: mx.array, index: mx.array, block: int) -> mx.array:
    """`array` (decoded blocks along the last axis) with each block's residual added at its index."""
    shape = array.shape
    blocks = array.reshape(*shape[:-1], shape[-1] // block, block)
    at = index.astype(mx.int32)[..., None]
    # One scatter of the blocks' entries (a prefill decodes the whole history: no mask or sum of its size)
    restored = mx.take_along_axis(blocks, at, axis=-1) + residuals.astype(array.dtype)[..., None]
    return mx.put_along_axis(blocks, at, restored, axis=-1).reshape(shape)


def scatter_block_scores(scores: mx.array, queries: mx.array, residuals: mx.array, index: mx.array,
                         block: int) -> mx.array:
    """`scores` [..., R, T] of `queries` [..., R, D] against keys decoded without their outliers, with each outlier's
    share added: q_c·residual at token block·b + index for channel c and block b (`residuals`, `index` [..., D, T /
    block]). D·T/block products and one scatter-add, not a dense correction of the keys' size."""
    *lead, rows, tokens = scores.shape
    channels, blocks = residuals.shape[-2:]
    shares = queries.astype(mx.float32)[..., :, :, None] * residuals.astype(mx.float32)[..., None, :, :]
    position = index.astype(mx.int32) + mx.arange(blocks, dtype=mx.int32) * block             # [..., D, nb]
    # flat index of (lead, row, position) in scores [lead·R·T]
    base = (mx.arange(math.prod(lead) * rows, dtype=mx.int32) * tokens).reshape(*lead, rows, 1, 1)
    flat = (base + position.reshape(*lead, 1, channels, blocks)).reshape(-1)
    out = scores.astype(mx.float32).reshape(-1).at[flat].add(shares.reshape(-1))
    return out.reshape(scores.shape)
