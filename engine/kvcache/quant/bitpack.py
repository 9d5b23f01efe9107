"""Pack small integer codes (1 to 8 bits) along the last axis into uint32 words, and back.

Layout: the codes of one row form a little-endian bit stream -- code i occupies bits
[bits·i, bits·i + bits) of the stream, and stream bit k is bit (k mod 32) of word k // 32. For 3, 5,
6 and 7 bits some codes straddle two words (low bits at the top of one word, high bits at the bottom
of the next).

This is exactly the layout of MLX's affine quantization (checked on MLX 0.32.4, CPU backend, for
1, 2, 3, 4, 5, 6 and 8 bits: ``mx.dequantize`` of our packed codes with scale s and bias b returns
s·q + b bit for bit; see tests/test_quant_math.py), so a cache may hand words packed here straight to
``mx.dequantize`` / ``mx.quantized_matmul`` together with its own scales and biases (group_size
dividing the row length). MLX has no 7-bit mode; 7-bit packing works here but only for our own use.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from engine.errors import ConfigError

PACKABLE_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
# Bit widths whose packing mx.dequantize / mx.quantized_matmul (affine mode) accept.
MLX_AFFINE_BITS = (1, 2, 3, 4, 5, 6, 8)

_WORD_BITS = 32


class _Layout:
    """Where each code of a repeating group sits: a group is the fewest codes filling whole words."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.codes_per_group = _WORD_BITS // math.gcd(bits, _WORD_BITS)
        self.words_per_group = self.codes_per_group * bits // _WORD_BITS
        offsets = bits * np.arange(self.codes_per_group)
        self.word_of_code = offsets // _WORD_BITS
        self.shift_of_code = offsets % _WORD_BITS
        self.straddles = self.shift_of_code + bits > _WORD_BITS
        self.mask = (1 << bits) - 1
        # For unpacking: the high part of a straddling code comes from the next word, shifted up.
        self.next_word_of_code = np.minimum(self.word_of_code + 1, self.words_per_group - 1)
        self.high_shift_of_code = np.where(self.straddles, (_WORD_BITS - self.shift_of_code) % _WORD_BITS, 0)
        # For packing, per word w and code i of a group: the code's low bits land in w shifted up by its offset
        # (where it starts in w), its high bits shifted down (where it straddles into w from w - 1); 0 elsewhere.
        words = np.arange(self.words_per_group)[:, None]
        self.starts_in = (self.word_of_code[None, :] == words).astype(np.uint32)
        self.spills_into = ((self.word_of_code[None, :] == words - 1) & self.straddles[None, :]).astype(np.uint32)
        self.spill_shift = np.where(self.straddles, _WORD_BITS - self.shift_of_code, 0).astype(np.uint32)


@functools.cache
def _layout(bits: int) -> _Layout:
    return _Layout(bits)


def _check_bits(bits: int) -> _Layout:
    if bits not in PACKABLE_BITS:
        raise ConfigError(f"Codes can be packed at {', '.join(map(str, PACKABLE_BITS))} bits, not {bits!r}.")
    return _layout(bits)


def packed_length(d: int, bits: int) -> int:
    """Number of uint32 words that ``d`` codes of ``bits`` bits pack into; d·bits must be a multiple of 32."""
    _check_bits(bits)
    if d < 0 or (d * bits) % _WORD_BITS:
        raise ConfigError(
            f"{d} codes of {bits} bits do not fill whole 32-bit words: the last axis needs d·bits divisible by 32."
        )
    return d * bits // _WORD_BITS


def pack_bits(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes (values < 2^bits) along the last axis: shape [..., d] -> uint32 [..., d·bits/32].

    Bits of a code above ``bits`` are dropped rather than allowed to spill into the neighbouring code.
    """
    layout = _check_bits(bits)
    if codes.ndim == 0:
        raise ConfigError("pack_bits needs at least one axis to pack along.")
    if not mx.issubdtype(codes.dtype, mx.integer):
        raise ConfigError(f"pack_bits packs integer codes, got dtype {codes.dtype}.")
    d = codes.shape[-1]
    word_count = packed_length(d, bits)
    leading = codes.shape[:-1]
    grouped = (codes.astype(mx.uint32) & layout.mask).reshape(
        *leading, d // layout.codes_per_group, 1, layout.codes_per_group
    )
    # Every word of a group at once: the codes' parts in it (disjoint bits, so their sum is their OR), one product
    # and one sum (a GPU runs a handful of launches, not one slice-sum per word and an add per straddling code).
    low = (grouped << mx.array(layout.shift_of_code.astype(np.uint32))) * mx.array(layout.starts_in)
    if layout.straddles.any():
        low = low + (grouped >> mx.array(layout.spill_shift)) * mx.array(layout.spills_into)
    packed = mx.sum(low, axis=-1)
    return packed.reshape(*leading, word_count)


def unpack_bits(packed: mx.array, bits: int, d: int) -> mx.array:
    """Inverse of :func:`pack_bits`: uint32 [..., d·bits/32] -> uint8 codes [..., d]."""
    layout = _check_bits(bits)
    word_count = packed_length(d, bits)
    if packed.ndim == 0 or packed.shape[-1] != word_count:
        raise ConfigError(
            f"{d} codes of {bits} bits pack into {word_count} words, but the last axis holds "
            f"{packed.shape[-1] if packed.ndim else 'no'} words."
        )
    leading = packed.shape[:-1]
    grouped = packed.astype(mx.uint32).reshape(*leading, d // layout.codes_per_group, layout.words_per_group)
    codes = mx.take(grouped, mx.array(layout.word_of_code.astype(np.uint32)), axis=-1) >> mx.array(
        layout.shift_of_code.astype(np.uint32)
    )
    if layout.straddles.any():
        high = mx.take(grouped, mx.array(layout.next_word_of_code.astype(np.uint32)), axis=-1) << mx.array(
            layout.high_shift_of_code.astype(np.uint32)
        )
        # Non-straddling codes must take nothing from the next word (their shift of 0 would copy it).
        codes = codes | (high * mx.array(layout.straddles.astype(np.uint32)))
    return (codes & layout.mask).astype(mx.uint8).reshape(*leading, d)
