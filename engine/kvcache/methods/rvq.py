"""Two-stage residual scalar quantization (RVQ) of rotated unit vectors, for keys and values.

As in `turboquant`, each vector is stored as its norm and codes of its rotated unit vector u = R x / ‖x‖:
  stage 1: b₁-bit Lloyd-Max codes of u for N(0, 1/d) (or the Beta law: option `codebook`), c₁[codes₁];
  stage 2: the residual r = u - c₁[codes₁] is divided by its RMS ‖r‖/√d and quantized with the b₂-bit
           Lloyd-Max codebook of a unit-variance Laplacian, c₂[codes₂]; the stored residual scale (one
           16-bit float per vector) is then the least-squares fit s = <r, c₂[codes₂]> / ‖c₂[codes₂]‖²,
           which never does worse than the RMS for those codes (measured: 3-7% lower MSE at d = 64).
Reconstruction: x̂ = ‖x‖ · Rᵀ (c₁[codes₁] + s · c₂[codes₂]).

Measured at d = 64 (MSE per unit vector): 1+1 bits 0.126 against 0.117 for 2-bit `turboquant`, and 2+2
bits 0.022 against 0.0095 for 4-bit `turboquant`: a scalar residual stage with a mismatched (Laplacian)
density does not beat one Lloyd-Max stage of the same total bits, and stores 16 more bits per vector.

Stage split of a `bits` setting (the total code bits per coordinate): 2 → 1+1, 3 → 2+1, 4 → 2+2
(b₁ = ⌈bits/2⌉, b₂ = ⌊bits/2⌋). Per vector this stores d·bits code bits plus two 16-bit floats (norm and
residual scale), 16 bits more than `turboquant` at the same code bits.

Attention dequantizes per layer and step in bounded chunks, exactly like `turboquant` (see that module for
the kernel that will replace it; here it also reads s and the second codebook).
"""

from __future__ import annotations

import math
from typing import ClassVar

import mlx.core as mx

from engine.kvcache.config import KVCacheConfig
from engine.kvcache.kernels import Codec
from engine.kvcache.methods.turboquant import NORM_BITS, Codebook, RotatedCodebookKVCache, centroid_lookup
from engine.kvcache.quant.bitpack import pack_bits, unpack_bits
from engine.kvcache.quant.codebooks import encode_scalar, lloyd_max_codebook
from engine.kvcache.registry import register_method

RESIDUAL_SCALE_BITS = 16
_TINY_SCALE = 1e-30


@register_method("rvq")
class VeloxRVQKVCache(RotatedCodebookKVCache):
    supported_bits: ClassVar[tuple[int, ...]] = (2, 3, 4)
    default_bits: ClassVar[int] = 4
    description: ClassVar[str] = (
        "Residual scalar quantization: Gaussian Lloyd-Max codes of the rotated unit vector, then Laplacian "
        "Lloyd-Max codes of the RMS-scaled residual (2 = 1+1, 3 = 2+1, 4 = 2+2 bits); a fused decode kernel on a "
        "GPU, dequantized per step elsewhere."
    )

    @classmethod
    def stage_bits(cls, bits: int) -> tuple[int, ...]:
        return (math.ceil(bits / 2), bits // 2)

    @classmethod
    def stage_codebook(cls, config: KVCacheConfig, stage: int, bits: int, head_dim: int) -> Codebook:
        if stage == 0:
            return lloyd_max_codebook(cls.unit_codebook_name(config), bits, head_dim)
        return lloyd_max_codebook("laplacian", bits)  # unit variance: residuals are divided by their RMS

    @classmethod
    def side_bits_per_vector(cls) -> int:
        return NORM_BITS + RESIDUAL_SCALE_BITS

    def _encode_unit(self, unit: mx.array, role: str) -> dict[str, mx.array]:
        first_bits, second_bits = self.stage_bits(self._role_bits(role))
        first_centroids, first_boundaries = self._codebooks[f"{role}0"]
        second_centroids, second_boundaries = self._codebooks[f"{role}1"]
        first_codes = encode_scalar(unit, first_boundaries)
        residual = unit - centroid_lookup(first_codes, first_centroids)
        rms = mx.sqrt(mx.mean(residual * residual, axis=-1, keepdims=True))
        second_codes = encode_scalar(residual / mx.maximum(rms, _TINY_SCALE), second_boundaries)
        second = centroid_lookup(second_codes, second_centroids)
        # Least-squares scale for these codes (>= 0: each code has its residual coordinate's sign).
        fitted = mx.sum(residual * second, axis=-1, keepdims=True) / mx.maximum(
            mx.sum(second * second, axis=-1, keepdims=True), _TINY_SCALE
        )
        return {
            f"{role}_codes": pack_bits(first_codes, first_bits),
            f"{role}_residual_codes": pack_bits(second_codes, second_bits),
            f"{role}_residual_scales": fitted.astype(self._dense_dtype),
        }

    def _kernel_codecs(self) -> tuple[Codec, list[mx.array], Codec, list[mx.array]] | None:
        assert self._store is not None
        store = self._store
        codecs = []
        for role in ("key", "value"):
            first_bits, second_bits = self.stage_bits(self._role_bits(role))
            arrays = [
                store[f"{role}_codes"],
                store[f"{role}_norms"],
                self._kernel_table(f"{role}0"),
                store[f"{role}_residual_codes"],
                store[f"{role}_residual_scales"],
                self._kernel_table(f"{role}1"),
            ]
            codecs += [Codec("rvq", first_bits, second_bits), arrays]
        return codecs[0], codecs[1], codecs[2], codecs[3]

    def _decode_unit(self, store: dict[str, mx.array], role: str) -> mx.array:
        first_bits, second_bits = self.stage_bits(self._role_bits(role))
        first_centroids, _ = self._codebooks[f"{role}0"]
        second_centroids, _ = self._codebooks[f"{role}1"]
        head_dim = self._k_head_dim
        first = centroid_lookup(unpack_bits(store[f"{role}_codes"], first_bits, head_dim), first_centroids)
        second = centroid_lookup(
            unpack_bits(store[f"{role}_residual_codes"], second_bits, head_dim), second_centroids
        )
        return first + store[f"{role}_residual_scales"].astype(mx.float32) * second
