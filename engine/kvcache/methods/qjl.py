"""QJL: keys as a 1-bit Johnson–Lindenstrauss sign sketch plus one norm; values by the `affine` partner.

Each key k of one head is stored as ‖k‖ (one 16-bit float) and sign(S k), m = key_bits·head_dim sign bits,
for a seeded m×d Gaussian sketch S held per layer (quant/sketch.py). Attention uses QJL's unbiased
estimator of the inner product,

    q·k ≈ ‖k‖ · sqrt(π/2)/m · (S q)·sign(S k),

so the query is sketched once per step (S q: [R, m]) and multiplied with the ±1 signs of the history, chunk
by chunk (the signs are unpacked to ±1 per chunk and dropped; nothing decoded is kept). key_bits is thus
"sketch bits per key coordinate": 1 = m = d as in the paper's smallest setting, 4 = m = 4d.

Values are quantized per token by the partner method named in option `values` (only "affine" so far:
MLX group quantization, value_bits and group_size of this config) and read by `mx.quantized_matmul`.

On a GPU whose backend is in kernels.decode.SKETCH_BACKENDS the decode kernel reads the signs, the norms and the
values' codes in one pass (codec "qjl"): each lane meets 8·key_bits sketch coordinates of the sketched query
(S q, computed once per step) with the key's signs; the 16-bit window and sinks take the query as it is.

What the estimator does not give: a small error on every score. Softmax attention is sensitive to score
errors on the few keys with large scores, which an unbiased but noisy estimate does not protect (the
paper keeps outlier channels in 16 bit for that); the measured cost is in BENCHMARKS.md.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from engine.errors import ConfigError
from engine.kvcache import kernels as _kernels
from engine.kvcache.base import SegmentedKVCache
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.kernels import Codec
from engine.kvcache.kernels.encode import codebook_encode
from engine.kvcache.methods._sketch import SketchMixin
from engine.kvcache.methods.affine import (
    AFFINE_GROUP_SIZES,
    SCALE_BITS,
    affine_dequantize,
    affine_matmul,
    affine_quantize,
    check_channel_groups,
)
from engine.kvcache.methods.turboquant import DEQUANTIZE_CHUNK_TOKENS, NORM_BITS
from engine.kvcache.quant.bitpack import MLX_AFFINE_BITS
from engine.kvcache.quant.sketch import (
    signs_as_pm_one,
    sketch_reconstruction,
    sketch_signs,
)
from engine.kvcache.registry import register_method

VALUE_PARTNERS = ("affine",)


@register_method("qjl")
class VeloxQJLKVCache(SketchMixin, SegmentedKVCache):
    # Sketch bits per key coordinate; values take MLX's affine bits (1-bit values included).
    supported_bits: ClassVar[tuple[int, ...]] = MLX_AFFINE_BITS
    default_bits: ClassVar[int] = 4
    supported_group_sizes: ClassVar[tuple[int, ...] | None] = AFFINE_GROUP_SIZES
    needs_calibration: ClassVar[bool] = False
    attention_path: ClassVar[str] = "dequantize-per-step"
    description: ClassVar[str] = (
        "QJL: keys as key_bits·head_dim sign bits of a seeded Gaussian sketch plus one 16-bit norm, scored "
        "with the unbiased sign estimator; values by the affine partner (quantized_matmul); a fused decode kernel "
        "on a GPU."
    )

    sketch_seed_offset: ClassVar[int] = 1_000_003

    @classmethod
    def sketch_rows(cls, config: KVCacheConfig, head_dim: int) -> int:
        return config.key_bits * head_dim

    @classmethod
    def check_config(cls, config: KVCacheConfig, head_dim: int) -> None:
        super().check_config(config, head_dim)
        check_channel_groups(cls.method_name, config, head_dim, what="values in ")
        partner = config.options.get("values", "affine")
        if partner not in VALUE_PARTNERS:
            raise ConfigError(
                f"Method 'qjl' stores values with {', '.join(VALUE_PARTNERS)}, not {partner!r}."
            )
        if cls.sketch_rows(config, head_dim) % 32:
            raise ConfigError(
                f"Method 'qjl' packs key_bits × head_dim sign bits into 32-bit words; "
                f"{config.key_bits} × {head_dim} is not a multiple of 32."
            )

    @classmethod
    def compressed_bits_per_token(cls, config: KVCacheConfig, head_dim: int) -> float:
        key_bits = cls.sketch_rows(config, head_dim) + NORM_BITS
        value_bits = head_dim * config.value_bits + head_dim // config.group_size * 2 * SCALE_BITS
        return float(key_bits + value_bits)

    # ----- encode / decode --------------------------------------------------------------------------------

    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        # The keys' norms and sketch signs in one launch where the backend is in kernels.encode.SKETCH_ENCODE_BACKENDS.
        mode = self.config.options.get("kernels", _kernels.DEFAULT_KERNEL_MODE)
        backend = _kernels.available_backend() if mode != "off" else None
        if keys.ndim == 4 and _kernels.encode.sketch_encode_takes(backend, keys.shape[-2], self._sketch.shape[0],
                                                                  keys.shape[-1]):
            norms, signs = codebook_encode(keys, [], self._dense_dtype, backend, sketch=self._sketch)
            return {
                "key_codes": signs,
                "key_norms": norms,
                **affine_quantize(values, "value", self.config.group_size, self.config.value_bits),
            }
        keys = keys.astype(mx.float32)
        # A long chunk on a GPU: MLX's matmul for S·k, the signs packed in one launch (kernels.encode)
        return {
            "key_codes": (_kernels.encode.sketch_signs_packed(keys, self._sketch, backend)
                          if backend in _kernels.encode.SIGN_PACK_BACKENDS
                          else sketch_signs(keys, self._sketch)),
            "key_norms": mx.linalg.norm(keys, axis=-1, keepdims=True).astype(self._dense_dtype),
            **affine_quantize(values, "value", self.config.group_size, self.config.value_bits),
        }

    def _decode_keys(self, store: dict[str, mx.array]) -> mx.array:
        # The estimator's reconstruction (see quant/sketch.py): right inner products, not close to k.
        return sketch_reconstruction(store["key_codes"], store["key_norms"], self._sketch)

    def _decode_values(self, store: dict[str, mx.array]) -> mx.array:
        return affine_dequantize(
            store, "value", self.config.group_size, self.config.value_bits, float32_scales=True
        )

    def _decode(self, store: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
        dtype = self._dense_dtype
        return self._decode_keys(store).astype(dtype), self._decode_values(store).astype(dtype)

    # ----- attention -----------------------------------------------------------------------------------------

    def _compressed_scores(self, queries: mx.array, store: dict[str, mx.array]) -> mx.array:
        m = self._sketch.shape[0]
        sketched = self._sketched_queries(queries)  # [.., R, m]
        n_tokens = store["key_norms"].shape[-2]
        parts = []
        for start in range(0, n_tokens, DEQUANTIZE_CHUNK_TOKENS):
            end = start + DEQUANTIZE_CHUNK_TOKENS
            signs = signs_as_pm_one(store["key_codes"][..., start:end, :], m)
            norms = store["key_norms"][..., start:end, :].astype(mx.float32).swapaxes(-1, -2)
            parts.append((sketched @ signs.swapaxes(-1, -2)) * norms)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def _compressed_values(self, weights: mx.array, store: dict[str, mx.array]) -> mx.array:
        return affine_matmul(
            weights, store, "value", self.config.group_size, self.config.value_bits, transpose=False
        )

    # ----- decode kernel ---------------------------------------------------------------------------------------

    def _kernel_codecs(self) -> tuple[Codec, list[mx.array], Codec, list[mx.array]] | None:
        assert self._store is not None
        store = self._store
        return (
            Codec("qjl", self.config.key_bits),
            [store["key_codes"], store["key_norms"]],
            Codec("affine", self.config.value_bits),
            [store["value_codes"], store["value_scales"], store["value_biases"]],
        )

    def _key_sketch(self) -> mx.array | None:
        return self._sketch
