"""Dense-and-sparse blocks: the one entry per block that widens its range most, kept aside in 16 bits.

KVQuant keeps the ~1 % largest key entries out of the quantizer; KIVI's per-channel key blocks (128 tokens of one
channel) are quantized between their min and max, so one large entry spreads the block's other 127 over a few codes.
`split_block_outliers` takes, per block, the entry whose removal shrinks the block's range most (its max or its min,
whichever is farther from its neighbour in sorted order), replaces it by that neighbour (the new range's end, so it
no longer sets the range), and returns it with its index in the block; `restore_block_outliers` puts it back after
decoding. One entry per 128-token block is 0.78 % of the entries and costs 16 + 8 bits per block.
"""

from __future__ import annotations

import mlx.core as mx

OUTLIER_INDEX_BITS = 8  # a uint8 index within a block (blocks of at most 256 entries)
OUTLIER_VALUE_BITS = 16


def split_block_outliers(array: mx.array, block: int) -> tuple[mx.array, mx.array, mx.array]:
    """(array with each block's outlier replaced, outliers [..., n_blocks] float16, their indices uint8) for blocks of
    `block` entries along the last axis (a multiple of `block`)."""
    if block > 1 << OUTLIER_INDEX_BITS or array.shape[-1] % block:
        raise ValueError(f"Blocks of {block} entries do not tile an axis of {array.shape[-1]} with uint8 indices.")
    shape = array.shape
    blocks = array.astype(mx.float32).reshape(*shape[:-1], shape[-1] // block, block)
    ordered = mx.sort(blocks, axis=-1)
    take_top = (ordered[..., -1] - ordered[..., -2]) >= (ordered[..., 1] - ordered[..., 0])
    index = mx.where(take_top, mx.argmax(blocks, axis=-1), mx.argmin(blocks, axis=-1))
    outlier = mx.take_along_axis(blocks, index[..., None], axis=-1)[..., 0]
    fill = mx.where(take_top, ordered[..., -2], ordered[..., 1])
    kept = mx.where(mx.arange(block) == index[..., None], fill[..., None], blocks)
    return kept.reshape(shape).astype(array.dtype), outlier.astype(mx.float16), index.astype(mx.uint8)


def restore_block_outliers(array: mx.array, outliers: mx.array, index: mx.array, block: int) -> mx.array:
    """`array` (decoded blocks along the last axis) with each block's outlier written back at its index."""
    shape = array.shape
    blocks = array.reshape(*shape[:-1], shape[-1] // block, block)
    at = mx.arange(block) == index.astype(mx.int32)[..., None]
    return mx.where(at, outliers.astype(array.dtype)[..., None], blocks).reshape(shape)
