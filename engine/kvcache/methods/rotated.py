"""Affine quantization after a seeded random rotation of head_dim (randomized Hadamard by default).

Keys often have a few outlier channels; a group containing one gets a wide scale and the other channels
lose precision. Rotating every key by an orthonormal R (R = H·diag(signs)/√d) spreads each outlier over
all channels before `mx.quantize`. Attention stays fused on the packed codes because
    q·k = (Rq)·(Rk)            (rotate the queries the same way),
    Σ p_i v_i = Rᵀ Σ p_i (R v_i) (weight the rotated values, rotate the output back),
so the history is never dequantized. Each layer uses its own rotation, seeded `seed + layer_index`.
If MLX has no Hadamard transform of size head_dim, the rotation falls back to a dense seeded orthogonal
matrix (and says so in `rotation_note`).
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from engine.errors import ConfigError
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.methods.affine import AFFINE_BITS, AFFINE_GROUP_SIZES, VeloxAffineKVCache
from engine.kvcache.quant.rotation import Rotation, make_rotation
from engine.kvcache.registry import register_method

ROTATION_KINDS = ("hadamard", "orthogonal")


def rotation_arrays(rotation: Rotation) -> list[mx.array]:
    """Every array a rotation object holds (its signs, or its dense matrix once built)."""
    return [value for value in vars(rotation).values() if isinstance(value, mx.array)]


@register_method("rotated")
class VeloxRotatedKVCache(VeloxAffineKVCache):
    supported_bits: ClassVar[tuple[int, ...]] = AFFINE_BITS
    default_bits: ClassVar[int] = 4
    supported_group_sizes: ClassVar[tuple[int, ...] | None] = AFFINE_GROUP_SIZES
    needs_calibration: ClassVar[bool] = False
    attention_path: ClassVar[str] = "fused"
    description: ClassVar[str] = (
        "Randomized Hadamard rotation of head_dim, then affine group quantization of keys and values; "
        "queries rotated alike and the output rotated back, so attention stays on the packed codes."
    )

    @classmethod
    def check_config(cls, config: KVCacheConfig, head_dim: int) -> None:
        super().check_config(config, head_dim)
        if config.rotation not in ROTATION_KINDS:
            raise ConfigError(
                f"Unknown rotation {config.rotation!r} for method 'rotated'; use {' or '.join(ROTATION_KINDS)}."
            )

    @classmethod
    def constant_bytes(cls, config: KVCacheConfig, head_dim: int) -> int:
        rotation = make_rotation(head_dim, config.seed, config.rotation)
        return sum(array.nbytes for array in rotation_arrays(rotation))

    def _setup(
        self, batch: int, n_kv_heads: int, k_head_dim: int, v_head_dim: int, input_dtype: mx.Dtype
    ) -> None:
        if k_head_dim != v_head_dim:
            raise ConfigError(
                f"Method 'rotated' needs keys and values of one head_dim, got {k_head_dim} and {v_head_dim}."
            )
        super()._setup(batch, n_kv_heads, k_head_dim, v_head_dim, input_dtype)
        self._rotation = make_rotation(k_head_dim, self.config.seed + self.layer_index, self.config.rotation)

    @property
    def rotation_note(self) -> str:
        rotation = getattr(self, "_rotation", None)
        return rotation.note if rotation is not None else ""

    def _constant_arrays(self) -> list[mx.array]:
        rotation = getattr(self, "_rotation", None)
        return [] if rotation is None else rotation_arrays(rotation)

    def _keys_in(self, keys: mx.array) -> mx.array:
        return self._rotation.forward(keys)

    def _values_in(self, values: mx.array) -> mx.array:
        return self._rotation.forward(values)

    def _queries_in(self, queries: mx.array) -> mx.array:
        return self._rotation.forward(queries)

    def _output_out(self, output: mx.array) -> mx.array:
        return self._rotation.inverse(output)

    def _keys_out(self, keys: mx.array) -> mx.array:
        return self._rotation.inverse(keys)

    def _values_out(self, values: mx.array) -> mx.array:
        return self._rotation.inverse(values)
