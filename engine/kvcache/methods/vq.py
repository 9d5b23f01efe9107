"""VQ: product vector quantization of smoothed, rotated keys and values with calibrated codebooks
(VecInfer-style), attention scores through a lookup table of query–centroid products.

Calibration (`velox precompute MODEL --bits B --out DIR`, engine/kvcache/calibration.py) runs text through
the user's model and stores, per layer and role, per-channel smoothing scales s and a k-means codebook of
K = 2^(B·g) centroids of g-coordinate sub-vectors (quant/vq.py). Each vector x is then stored as
    u = R (x / s) / ‖R (x / s)‖   cut into d/g sub-vectors, each replaced by its nearest centroid's index,
plus ‖R (x / s)‖ as one 16-bit float; R is the layer's seeded Hadamard rotation. Smoothing divides out the
channels that carry most of the keys' magnitude (the outliers that waste a codebook's coverage) and the
rotation spreads what is left evenly, so one codebook serves every sub-space and head of a layer: per layer
and role the constants are d smoothing scales and K·g centroid coordinates (16-bit), a few kilobytes.

Attention: q·k = (q ⊙ s)·(x / s), so queries are multiplied by s and rotated like the keys. For each query
and sub-space j a table LUT[j, c] = q_j · centroid_c is built once per step ([R, d/g, K]); a key's score is
its norm times Σ_j LUT[j, code_j], read by one gather over the history's codes (chunked, nothing decoded).
Values are decoded chunk by chunk (centroids times norms), weighted, and the output is rotated back and
multiplied by the values' s. On a backend in kernels.decode.VQ_BACKENDS the decode kernel reads the codes, norms and
centroids of both roles instead (codec "vq"), and a prefill chunk's history decode too.

Config: option `codebooks` = the folder given to `--out` (or the file itself); keys and values use the same
bits (one file per bit width). The file must come from this model (architecture hash and shape), with this
config's rotation and seed: anything else is a ConfigError naming the difference. The file's checksum is
written into the cache's config, so a saved prompt cache refuses to load against changed codebooks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import mlx.core as mx

from engine.errors import ConfigError
from engine.kvcache.base import SegmentedKVCache
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.kernels import Codec
from engine.kvcache.methods._rotation import RotationMixin
from engine.kvcache.methods.turboquant import NORM_BITS
from engine.kvcache.quant.bitpack import pack_bits, unpack_bits
from engine.kvcache.quant.vq import (
    SUBSPACE_DIM,
    VQCodebooks,
    check_model,
    index_bits,
    load_codebooks,
    model_identity,
    nearest_centroid,
    subspace_dim,
)
from engine.kvcache.registry import register_method

CONSTANT_BITS = 16  # smoothing scales and centroids are held as float16
# Bound on the [R, tokens, sub-spaces] gather temporary of the lookup-table scores (floats).
_LUT_GATHER_ELEMENTS = 1 << 22
_VALUE_CHUNK_TOKENS = 1024
_TINY_NORM = 1e-30


@register_method("vq")
class VeloxVQKVCache(RotationMixin, SegmentedKVCache):
    supported_bits: ClassVar[tuple[int, ...]] = tuple(SUBSPACE_DIM)
    default_bits: ClassVar[int] = 2
    needs_calibration: ClassVar[bool] = True
    attention_path: ClassVar[str] = "dequantize-per-step"
    description: ClassVar[str] = (
        "Product VQ (VecInfer-style): calibrated per-channel smoothing, Hadamard rotation, k-means codebooks "
        "of sub-vectors (velox precompute); a fused decode kernel on a GPU, elsewhere scores by a query-centroid "
        "lookup table and values decoded per step."
    )

    # ----- config and formula ----------------------------------------------------------------------------

    @classmethod
    def check_config(cls, config: KVCacheConfig, head_dim: int) -> None:
        super().check_config(config, head_dim)  # (the codebooks themselves are checked where they are read)
        if config.key_bits != config.value_bits:
            raise ConfigError("Method 'vq' uses one codebook file per bit width: give keys and values the same bits.")
        g = subspace_dim(config.key_bits)
        if head_dim % g or (head_dim // g * index_bits(config.key_bits)) % 32:
            raise ConfigError(
                f"Method 'vq' cuts head_dim into sub-vectors of {g} with {index_bits(config.key_bits)}-bit "
                f"indices packed into 32-bit words; head_dim {head_dim} does not allow it."
            )

    @classmethod
    def compressed_bits_per_token(cls, config: KVCacheConfig, head_dim: int) -> float:
        return float(2 * (head_dim * config.key_bits + NORM_BITS))

    @classmethod
    def constant_bytes(cls, config: KVCacheConfig, head_dim: int) -> int:
        g = subspace_dim(config.key_bits)
        per_role = (head_dim + (1 << index_bits(config.key_bits)) * g) * CONSTANT_BITS // 8
        return super().constant_bytes(config, head_dim) + 2 * per_role

    @classmethod
    def check_model(cls, config: KVCacheConfig, model: Any) -> None:
        """The builder's check that the codebooks belong to `model` (before any cache is built)."""
        check_model(cls._codebooks_of(config), model_identity(model))

    @classmethod
    def _codebooks_of(cls, config: KVCacheConfig) -> VQCodebooks:
        if not config.options.get("codebooks"):
            raise ConfigError(
                "Method 'vq' needs its calibrated codebooks: write them with `velox precompute MODEL --bits "
                f"{config.key_bits} --out DIR` and add :codebooks=DIR to the spec."
            )
        return load_codebooks(config.options["codebooks"], config.key_bits)

    # ----- set-up: codebooks of this layer --------------------------------------------------------------

    def _reset_storage(self) -> None:
        super()._reset_storage()
        self._rotation = None
        self._smooth: dict[str, mx.array] = {}
        self._centroids: dict[str, mx.array] = {}

    def _setup(
        self, batch: int, n_kv_heads: int, k_head_dim: int, v_head_dim: int, input_dtype: mx.Dtype
    ) -> None:
        super()._setup(batch, n_kv_heads, k_head_dim, v_head_dim, input_dtype)
        config = self.config
        codebooks = self._codebooks_of(config)
        recorded = codebooks.model
        problems = []
        # The structure the arrays need (the whole model identity is checked by the builder, which has it).
        if recorded.get("head_dim") != k_head_dim:
            problems.append(f"head_dim {recorded.get('head_dim')}, not {k_head_dim}")
        if self.layer_index >= int(recorded.get("n_layers", 0)):
            problems.append(f"{recorded.get('n_layers')} layers, not layer {self.layer_index}")
        if (codebooks.rotation, codebooks.seed) != (config.rotation, config.seed):
            problems.append(
                f"rotation {codebooks.rotation} seed {codebooks.seed}, not {config.rotation} seed {config.seed}"
            )
        expected = config.options.get("codebooks_sha256")
        if expected is not None and expected != codebooks.checksum:
            problems.append("other codebooks than the ones this cache was encoded with (checksum differs)")
        if problems:
            raise ConfigError(f"The VQ codebooks {codebooks.path} do not fit: {'; '.join(problems)}.")
        if expected is None:
            # Recorded in the config (and so in saved prompt caches): a reload must find the same codebooks.
            self.config = replace(config, options={**config.options, "codebooks_sha256": codebooks.checksum})
        for role in ("key", "value"):
            self._smooth[role], self._centroids[role] = codebooks.layer(role, self.layer_index)

    def _constant_arrays(self) -> list[mx.array]:
        return super()._constant_arrays() + list(self._smooth.values()) + list(self._centroids.values())

    # ----- transforms: smoothing, then the rotation --------------------------------------------------------

    def _keys_in(self, keys: mx.array) -> mx.array:
        return super()._keys_in(keys.astype(mx.float32) / self._smooth["key"].astype(mx.float32))

    def _queries_in(self, queries: mx.array) -> mx.array:
        return super()._queries_in(queries.astype(mx.float32) * self._smooth["key"].astype(mx.float32))

    def _values_in(self, values: mx.array) -> mx.array:
        return super()._values_in(values.astype(mx.float32) / self._smooth["value"].astype(mx.float32))

    def _output_rotation_signs(self) -> mx.array | None:
        return None  # `_output_out` also undoes the values' smoothing: it runs after the kernel

    def _output_out(self, output: mx.array) -> mx.array:
        return super()._output_out(output) * self._smooth["value"].astype(mx.float32)

    def _keys_out(self, keys: mx.array) -> mx.array:
        return super()._keys_out(keys.astype(mx.float32)) * self._smooth["key"].astype(mx.float32)

    def _values_out(self, values: mx.array) -> mx.array:
        return super()._values_out(values.astype(mx.float32)) * self._smooth["value"].astype(mx.float32)

    # ----- encode / decode ---------------------------------------------------------------------------------

    @property
    def _g(self) -> int:
        return subspace_dim(self.config.key_bits)

    def _encode_role(self, vectors: mx.array, role: str) -> dict[str, mx.array]:
        vectors = vectors.astype(mx.float32)
        norms = mx.linalg.norm(vectors, axis=-1, keepdims=True)
        unit = vectors / mx.maximum(norms, _TINY_NORM)
        codes = nearest_centroid(unit.reshape(*unit.shape[:-1], -1, self._g), self._centroids[role])
        return {
            f"{role}_codes": pack_bits(codes, index_bits(self.config.key_bits)),
            f"{role}_norms": norms.astype(self._dense_dtype),
        }

    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        return {**self._encode_role(keys, "key"), **self._encode_role(values, "value")}

    def _codes(self, store: dict[str, mx.array], role: str) -> mx.array:
        n_sub = self._k_head_dim // self._g
        return unpack_bits(store[f"{role}_codes"], index_bits(self.config.key_bits), n_sub).astype(mx.uint32)

    def _decode_role(self, store: dict[str, mx.array], role: str) -> mx.array:
        """float32 vectors [..., tokens, d] (transformed space) of a slice of the store."""
        centroids = self._centroids[role].astype(mx.float32)
        codes = self._codes(store, role)
        unit = mx.take(centroids, codes, axis=0).reshape(*codes.shape[:-1], -1)
        return unit * store[f"{role}_norms"].astype(mx.float32)

    def _kernel_codecs(self) -> tuple[Codec, list[mx.array], Codec, list[mx.array]] | None:
        # The decode kernel reads the codes, norms and each role's centroids (codec "vq" of kernels/decode.py):
        # q·k = norm · Σ_j q_j·centroid[code_j] in the smoothed, rotated space, as the lookup table computes it.
        assert self._store is not None
        store, codec = self._store, Codec("vq", index_bits(self.config.key_bits), self._g)
        return (codec, [store["key_codes"], store["key_norms"], self._centroids["key"]],
                codec, [store["value_codes"], store["value_norms"], self._centroids["value"]])

    def _decode_keys(self, store: dict[str, mx.array]) -> mx.array:
        return self._decode_role(store, "key")

    def _decode_values(self, store: dict[str, mx.array]) -> mx.array:
        return self._decode_role(store, "value")

    def _decode(self, store: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
        dtype = self._dense_dtype
        return self._decode_keys(store).astype(dtype), self._decode_values(store).astype(dtype)

    # ----- attention ----------------------------------------------------------------------------------------

    def _compressed_scores(self, queries: mx.array, store: dict[str, mx.array]) -> mx.array:
        g = self._g
        centroids = self._centroids["key"].astype(mx.float32)
        n_centroids = centroids.shape[0]
        *lead, rows, dim = queries.shape
        n_sub = dim // g
        # LUT[.., r, j·K + c] = q_j · centroid_c: one small matmul per step.
        lut = (queries.astype(mx.float32).reshape(*lead, rows, n_sub, g) @ centroids.T).reshape(*lead, rows, -1)
        offsets = mx.arange(n_sub, dtype=mx.uint32) * n_centroids
        n_tokens = store["key_norms"].shape[-2]
        chunk = max(1, _LUT_GATHER_ELEMENTS // max(1, rows * n_sub))
        parts = []
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            codes = self._codes({"key_codes": store["key_codes"][..., start:end, :]}, "key") + offsets
            index = mx.broadcast_to(codes.reshape(*lead, 1, -1), (*lead, rows, (end - start) * n_sub))
            gathered = mx.take_along_axis(lut, index, axis=-1).reshape(*lead, rows, end - start, n_sub)
            norms = store["key_norms"][..., start:end, :].astype(mx.float32).swapaxes(-1, -2)
            parts.append(gathered.sum(axis=-1) * norms)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def _compressed_values(self, weights: mx.array, store: dict[str, mx.array]) -> mx.array:
        weights = weights.astype(mx.float32)
        n_tokens = store["value_norms"].shape[-2]
        output = None
        for start in range(0, n_tokens, _VALUE_CHUNK_TOKENS):
            end = start + _VALUE_CHUNK_TOKENS
            chunk = {name: store[name][..., start:end, :] for name in ("value_codes", "value_norms")}
            part = weights[..., start:end] @ self._decode_role(chunk, "value")
            output = part if output is None else output + part
        return output
