"""Affine group quantization of keys and values (MLX's `mx.quantize`), attended without dequantizing.

Each token's key (and value) vector is cut into groups of `group_size` channels; each group stores
`bits`-bit codes plus a 16-bit scale and a 16-bit bias (x ≈ scale·code + bias). Attention reads the
packed codes directly with `mx.quantized_matmul` (q·Kᵀ, then softmax weights·V), exactly as mlx-lm's
quantized SDPA does, but with separate key and value bits and optional 16-bit sink/window tokens.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from engine.errors import ConfigError
from engine.kvcache.base import SegmentedKVCache
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.kernels import Codec
from engine.kvcache.quant.bitpack import pack_bits, unpack_bits
from engine.kvcache.registry import register_method

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
SCALE_BITS = 16  # scales and biases are stored as fp16 (bf16 for bf16 models)


def check_channel_groups(method_name: str, config: KVCacheConfig, head_dim: int, what: str = "") -> None:
    """ConfigError unless groups of `config.group_size` channels tile head_dim (`what`: e.g. "values ")."""
    if head_dim % config.group_size:
        fitting = ", ".join(str(g) for g in AFFINE_GROUP_SIZES if head_dim % g == 0) or "none fits"
        raise ConfigError(
            f"Method {method_name!r} quantizes {what}groups of {config.group_size} channels, "
            f"but head_dim {head_dim} is not divisible by {config.group_size}; choose a group size "
            f"that divides it ({fitting})."
        )


# MLX 0.32.4 documents 1-bit affine codes, but only its CPU backend has them all: on CUDA `mx.quantize` at 1 bit
# returns zero codes, scales and biases without an error and `mx.quantized_matmul` refuses it (H200, 2026-12-03;
# BENCHMARKS.md, round 14). 1-bit codes are therefore packed and unpacked here (the same layout and levels: a
# group's min and max), and multiplied by MLX only on the CPU.
ONE_BIT = 1


def affine_quantize(array: mx.array, role: str, group_size: int, bits: int) -> dict[str, mx.array]:
    """`mx.quantize` of `array` along its last axis as the store entries `{role}_codes/_scales/_biases` (at 1 bit,
    `minmax_quantize`: the same levels, packed here on every backend)."""
    if bits == ONE_BIT:
        return minmax_quantize(array, role, group_size, bits)
    codes, scales, biases = mx.quantize(array, group_size=group_size, bits=bits)
    return {f"{role}_codes": codes, f"{role}_scales": scales, f"{role}_biases": biases}


def symmetric_quantize(array: mx.array, role: str, group_size: int, bits: int) -> dict[str, mx.array]:
    """Groups of `group_size` along the last axis as x ≈ s·(code - h), h = (2^bits - 1)/2, s = max|x| / h: codes packed
    as `mx.quantize` packs them and one scale per group, no bias (for zero-centred groups, e.g. rotated values:
    half the side bits of `affine_quantize`). `with_symmetric_biases` gives the arrays MLX's affine ops read."""
    half = ((1 << bits) - 1) / 2
    shape = array.shape
    groups = array.astype(mx.float32).reshape(*shape[:-1], shape[-1] // group_size, group_size)
    scales = (mx.max(mx.abs(groups), axis=-1) / half).astype(array.dtype)
    stored = scales.astype(mx.float32)[..., None]  # the codes are chosen against the scale as it is kept
    codes = mx.clip(mx.round(groups / mx.where(stored > 0, stored, 1.0) + half), 0, 2 * half)
    return {f"{role}_codes": pack_bits(codes.astype(mx.uint32).reshape(shape), bits), f"{role}_scales": scales}


def minmax_quantize(array: mx.array, role: str, group_size: int, bits: int) -> dict[str, mx.array]:
    """Groups of `group_size` along the last axis over their exact min..max: scale (max - min)/(2^bits - 1), bias min,
    both kept in the array's dtype (as `mx.quantize` keeps them) and the codes chosen against them as kept; the
    layout is `mx.quantize`'s, so every reader (`mx.quantized_matmul`, `mx.dequantize`, the kernels) reads it
    unchanged. `mx.quantize` instead keeps the group's larger-magnitude end exact and widens the step until zero is
    a code: over [-5.7, 4.1] at 3 bits its step is 1.425 and its top code 4.275, a wider step than 9.8/7 = 1.4."""
    levels = (1 << bits) - 1
    shape = array.shape
    groups = array.astype(mx.float32).reshape(*shape[:-1], shape[-1] // group_size, group_size)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    scales = ((high - low) / levels).astype(array.dtype)
    biases = low.astype(array.dtype)
    step = scales.astype(mx.float32)[..., None]
    codes = mx.clip(mx.round((groups - biases.astype(mx.float32)[..., None]) / mx.where(step > 0, step, 1.0)), 0, levels)
    return {f"{role}_codes": pack_bits(codes.astype(mx.uint32).reshape(shape), bits), f"{role}_scales": scales,
            f"{role}_biases": biases}


def with_symmetric_biases(store: dict[str, mx.array], role: str, bits: int) -> dict[str, mx.array]:
    """`store` with `role`'s biases (-h·s) derived from its scales, transient, for MLX's affine operations and the
    decode kernels' affine codec; the store itself holds no biases for a symmetric role. Scales and biases come in
    float32: -h·s rounded to 16 bits would shift every value of the group by the same error."""
    scales = store[f"{role}_scales"].astype(mx.float32)
    return {**store, f"{role}_scales": scales, f"{role}_biases": scales * -(((1 << bits) - 1) / 2)}


def affine_dequantize(
    store: dict[str, mx.array], role: str, group_size: int, bits: int, *, float32_scales: bool
) -> mx.array:
    """`mx.dequantize` of the `role` entries of a store (with float32 scales and biases if asked; at 1 bit unpacked
    here, see ONE_BIT)."""
    scales, biases = store[f"{role}_scales"], store[f"{role}_biases"]
    if float32_scales:
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    codes = store[f"{role}_codes"]
    if bits == ONE_BIT:
        length = codes.shape[-1] * 32
        bits_of = unpack_bits(codes, bits, length).reshape(*codes.shape[:-1], length // group_size, group_size)
        decoded = bits_of.astype(scales.dtype) * scales[..., None] + biases[..., None]
        return decoded.reshape(*codes.shape[:-1], length)
    return mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits)


def affine_matmul(
    x: mx.array, store: dict[str, mx.array], role: str, group_size: int, bits: int, *, transpose: bool
) -> mx.array:
    """`mx.quantized_matmul` of `x` with the packed `role` entries of a store (at 1 bit off the CPU, where MLX has
    no such matmul: the entries decoded, then multiplied)."""
    if bits == ONE_BIT and mx.default_device() != mx.cpu:
        decoded = affine_dequantize(store, role, group_size, bits, float32_scales=False).astype(x.dtype)
        return x @ (mx.swapaxes(decoded, -1, -2) if transpose else decoded)
    return mx.quantized_matmul(
        x,
        store[f"{role}_codes"],
        store[f"{role}_scales"],
        store[f"{role}_biases"],
        transpose=transpose,
        group_size=group_size,
        bits=bits,
    )


@register_method("affine")
class VeloxAffineKVCache(SegmentedKVCache):
    supported_bits: ClassVar[tuple[int, ...]] = AFFINE_BITS
    default_bits: ClassVar[int] = 4
    supported_group_sizes: ClassVar[tuple[int, ...] | None] = AFFINE_GROUP_SIZES
    needs_calibration: ClassVar[bool] = False
    attention_path: ClassVar[str] = "fused"
    description: ClassVar[str] = (
        "MLX affine group quantization of keys and values (per-group fp16 scale and bias); "
        "attention reads the packed codes with quantized_matmul."
    )

    @classmethod
    def check_config(cls, config: KVCacheConfig, head_dim: int) -> None:
        super().check_config(config, head_dim)
        check_channel_groups(cls.method_name, config, head_dim)

    @classmethod
    def compressed_bits_per_token(cls, config: KVCacheConfig, head_dim: int) -> float:
        groups = head_dim // config.group_size
        key_bits = head_dim * config.key_bits + groups * 2 * SCALE_BITS
        value_bits = head_dim * config.value_bits + groups * 2 * SCALE_BITS
        return float(key_bits + value_bits)

    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        group_size = self.config.group_size
        return {
            **affine_quantize(keys, "key", group_size, self.config.key_bits),
            **affine_quantize(values, "value", group_size, self.config.value_bits),
        }

    def _compressed_scores(self, queries: mx.array, store: dict[str, mx.array]) -> mx.array:
        return affine_matmul(
            queries, store, "key", self.config.group_size, self.config.key_bits, transpose=True
        )

    def _compressed_values(self, weights: mx.array, store: dict[str, mx.array]) -> mx.array:
        return affine_matmul(
            weights, store, "value", self.config.group_size, self.config.value_bits, transpose=False
        )

    def _kernel_codecs(self) -> tuple[Codec, list[mx.array], Codec, list[mx.array]] | None:
        assert self._store is not None
        store = self._store
        return (
            Codec("affine", self.config.key_bits),
            [store["key_codes"], store["key_scales"], store["key_biases"]],
            Codec("affine", self.config.value_bits),
            [store["value_codes"], store["value_scales"], store["value_biases"]],
        )

    # Decoding uses float32 scales and biases, as quantized_matmul does with float32 activations: with
    # the stored fp16 ones mx.dequantize returns fp16, whose rounding of scale·code + bias (up to 0.008 on
    # SmolLM2's keys) shifted attention scores by up to 0.3 and cost KL 0.04 against the fused path.
    def _decode_keys(self, store: dict[str, mx.array]) -> mx.array:
        return affine_dequantize(
            store, "key", self.config.group_size, self.config.key_bits, float32_scales=True
        )

    def _decode_values(self, store: dict[str, mx.array]) -> mx.array:
        return affine_dequantize(
            store, "value", self.config.group_size, self.config.value_bits, float32_scales=True
        )

    def _decode(self, store: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
        return self._decode_keys(store), self._decode_values(store)
