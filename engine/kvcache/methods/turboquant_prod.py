"""TurboQuant-prod: b-1 bits of TurboQuant-MSE for each key plus a 1-bit QJL sketch of its residual.

TurboQuant-MSE (`turboquant`) minimises the reconstruction error, but its inner products are biased: the
quantized unit vector is shrunk towards the centroids, so q·k̂ underestimates large scores on average. The
paper's "prod" variant spends one of the b bits differently: keys get (b-1)-bit Lloyd-Max codes c[codes] of
the rotated unit vector u, and the residual r = u - c[codes] is stored as its norm ‖r‖ (16-bit) and the
d signs of S r for a seeded d×d Gaussian sketch S (quant/sketch.py). The key's inner product is then

    q·k ≈ ‖k‖ (q·c[codes] + ‖r‖ sqrt(π/2)/d (S q)·sign(S r)),

unbiased for every q. It is linear in q, so decoding a key as c[codes] + ‖r‖ sqrt(π/2)/d Sᵀ sign(S r)
gives exactly that estimate through the shared chunked attention of `RotatedCodebookKVCache`.

Values keep b-bit TurboQuant-MSE codes (attention weights average values, where the MSE codebook is the
better choice, as in the paper). The decode kernel reads the codes, the signs and both norms (codec "prod" of
kernels/decode.py) with the sketched query S q (sqrt(π/2)/d, in float32) beside the rotated one, where its backend
is in `SKETCH_BACKENDS`. Per key vector: d·b code bits and two 16-bit floats; per value: d·b bits
and one. Compare with `turboquant` at equal bits in BENCHMARKS.md: lower bias, higher variance.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from engine.kvcache import kernels as _kernels
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.kernels import Codec
from engine.kvcache.kernels.encode import codebook_encode
from engine.kvcache.methods._sketch import SketchMixin
from engine.kvcache.methods.turboquant import (
    NORM_BITS,
    Codebook,
    RotatedCodebookKVCache,
    VeloxTurboQuantKVCache,
    centroid_lookup,
)
from engine.kvcache.quant.bitpack import pack_bits, unpack_bits
from engine.kvcache.quant.codebooks import encode_scalar, lloyd_max_codebook
from engine.kvcache.quant.sketch import (
    sketch_reconstruction,
    sketch_signs,
)
from engine.kvcache.registry import register_method


@register_method("turboquant_prod")
class VeloxTurboQuantProdKVCache(SketchMixin, RotatedCodebookKVCache):
    supported_bits: ClassVar[tuple[int, ...]] = (2, 3, 4)
    default_bits: ClassVar[int] = 4
    description: ClassVar[str] = (
        "TurboQuant-prod: keys as (b-1)-bit TurboQuant-MSE codes plus a 1-bit QJL sketch of the residual "
        "(unbiased inner products), values as b-bit TurboQuant-MSE; a fused decode kernel on a GPU, dequantized "
        "chunk by chunk elsewhere."
    )

    sketch_seed_offset: ClassVar[int] = 2_000_003

    @classmethod
    def sketch_rows(cls, config: KVCacheConfig, head_dim: int) -> int:
        return head_dim  # the residual's sketch: m = d rows

    @classmethod
    def stage_bits(cls, bits: int) -> tuple[int, ...]:
        # Code widths that must pack into words: the MSE stage of keys (b-1), values (b), the sketch (1).
        return (bits - 1, bits, 1)

    @classmethod
    def stage_codebook(cls, config: KVCacheConfig, stage: int, bits: int, head_dim: int) -> Codebook:
        return lloyd_max_codebook(cls.unit_codebook_name(config), bits, head_dim)

    @classmethod
    def _build_codebooks(cls, config: KVCacheConfig, head_dim: int) -> dict[str, Codebook]:
        return {
            "key0": cls.stage_codebook(config, 0, config.key_bits - 1, head_dim),
            "value0": cls.stage_codebook(config, 0, config.value_bits, head_dim),
        }

    @classmethod
    def compressed_bits_per_token(cls, config: KVCacheConfig, head_dim: int) -> float:
        key_bits = head_dim * config.key_bits + 2 * NORM_BITS  # (b-1)·d codes + d signs, norm, ‖r‖
        value_bits = head_dim * config.value_bits + NORM_BITS
        return float(key_bits + value_bits)

    def _encode_unit(self, unit: mx.array, role: str) -> dict[str, mx.array]:
        if role == "value":
            return VeloxTurboQuantKVCache._encode_unit(self, unit, role)  # type: ignore[arg-type]
        centroids, boundaries = self._codebooks["key0"]
        codes = encode_scalar(unit, boundaries)
        residual = unit - centroid_lookup(codes, centroids)
        return {
            "key_codes": pack_bits(codes, self.config.key_bits - 1),
            "key_residual_norms": mx.linalg.norm(residual, axis=-1, keepdims=True).astype(self._dense_dtype),
            "key_residual_signs": sketch_signs(residual, self._sketch),
        }

    def _kernel_encode(self, vectors: mx.array, role: str, backend: str,
                       rotation_signs: mx.array | None = None) -> dict[str, mx.array]:
        """Values as turboquant's; keys in one launch too (their codes, then the residual's norm and the signs of
        its sketch) where the backend is in kernels.encode.SKETCH_ENCODE_BACKENDS, else through `_encode_role`.
        With `rotation_signs`, `vectors` are before the rotation (the kernel applies it; `_encode_role` after
        `_keys_in`)."""
        centroids, boundaries = self._codebooks[f"{role}0"]
        if role == "value":
            parts = codebook_encode(vectors, [(self.config.value_bits, centroids, boundaries)], self._dense_dtype,
                                    backend, rotation_signs=rotation_signs)
            return dict(zip(["value_norms", "value_codes"], parts, strict=True))
        if not _kernels.encode.sketch_encode_takes(backend, vectors.shape[-2], self._sketch.shape[0], vectors.shape[-1]):
            if rotation_signs is not None:
                vectors = self._keys_in(vectors).astype(self._dense_dtype)
            return self._encode_role(vectors, role)
        parts = codebook_encode(vectors, [(self.config.key_bits - 1, centroids, boundaries)], self._dense_dtype,
                                backend, sketch=self._sketch, rotation_signs=rotation_signs)
        return dict(zip(["key_norms", "key_codes", "key_residual_norms", "key_residual_signs"], parts, strict=True))

    def _decode_unit(self, store: dict[str, mx.array], role: str) -> mx.array:
        if role == "value":
            return VeloxTurboQuantKVCache._decode_unit(self, store, role)  # type: ignore[arg-type]
        centroids, _ = self._codebooks["key0"]
        codes = unpack_bits(store["key_codes"], self.config.key_bits - 1, self._k_head_dim)
        return centroid_lookup(codes, centroids) + sketch_reconstruction(
            store["key_residual_signs"], store["key_residual_norms"], self._sketch
        )

    # ----- decode kernel ---------------------------------------------------------------------------------------

    def _kernel_codecs(self) -> tuple[Codec, list[mx.array], Codec, list[mx.array]] | None:
        assert self._store is not None
        store = self._store
        return (
            Codec("prod", self.config.key_bits - 1),
            [store["key_codes"], store["key_norms"], self._kernel_table("key0"), store["key_residual_norms"],
             store["key_residual_signs"]],
            Codec("codebook", self.config.value_bits),
            [store["value_codes"], store["value_norms"], self._kernel_table("value0")],
        )

    def _key_sketch(self) -> mx.array | None:
        return self._sketch  # the residuals' sketch (m = d rows); the kernel meets it with the rotated queries
