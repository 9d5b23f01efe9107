"""The seeded per-layer rotation of head_dim shared by `rotated`, `turboquant` and `rvq`.

Keys and values are stored rotated (x -> R x); attention stays in the rotated space because
    q·k = (Rq)·(Rk)   and   Σ p_i v_i = Rᵀ Σ p_i (R v_i),
so queries are rotated alike and the output rotated back. Layer `i` uses the rotation seeded `seed + i`.
(The leading underscore keeps the registry's discovery from importing this module: it registers nothing.)
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from engine.errors import ConfigError
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.quant.rotation import Rotation, make_rotation

ROTATION_KINDS = ("hadamard", "orthogonal")


def rotation_arrays(rotation: Rotation) -> list[mx.array]:
    """Every array a rotation object holds (its signs, or its dense matrix once built)."""
    return [value for value in vars(rotation).values() if isinstance(value, mx.array)]


class RotationMixin:
    """Rotation set-up, config check, constants and the `_*_in`/`_*_out` transforms of a rotated cache.

    Put it before the cache base class (`class C(RotationMixin, SegmentedKVCache)`) so its `check_config`,
    `_setup`, `constant_bytes` and transforms wrap the base's.
    """

    method_name: ClassVar[str]
    config: KVCacheConfig
    layer_index: int
    # None until `_setup` knows head_dim.
    _rotation: Rotation | None = None

    @classmethod
    def layer_rotation(cls, config: KVCacheConfig, head_dim: int, layer_index: int) -> Rotation:
        return make_rotation(head_dim, config.seed + layer_index, config.rotation)

    @classmethod
    def check_config(cls, config: KVCacheConfig, head_dim: int) -> None:
        super().check_config(config, head_dim)  # type: ignore[misc]
        if config.rotation not in ROTATION_KINDS:
            raise ConfigError(
                f"Unknown rotation {config.rotation!r} for method {cls.method_name!r}; "
                f"use {' or '.join(ROTATION_KINDS)}."
            )

    @classmethod
    def constant_bytes(cls, config: KVCacheConfig, head_dim: int) -> int:
        rotation = cls.layer_rotation(config, head_dim, 0)
        return sum(array.nbytes for array in rotation_arrays(rotation))

    def _setup(
        self, batch: int, n_kv_heads: int, k_head_dim: int, v_head_dim: int, input_dtype: mx.Dtype
    ) -> None:
        if k_head_dim != v_head_dim:
            raise ConfigError(
                f"Method {self.method_name!r} needs keys and values of one head_dim, "
                f"got {k_head_dim} and {v_head_dim}."
            )
        super()._setup(batch, n_kv_heads, k_head_dim, v_head_dim, input_dtype)  # type: ignore[misc]
        self._rotation = self.layer_rotation(self.config, k_head_dim, self.layer_index)

    @property
    def rotation_note(self) -> str:
        return self._rotation.note if self._rotation is not None else ""

    def _constant_arrays(self) -> list[mx.array]:
        return [] if self._rotation is None else rotation_arrays(self._rotation)

    def _keys_in(self, keys: mx.array) -> mx.array:
        return self._rotation.forward(keys)

    def _values_in(self, values: mx.array) -> mx.array:
        return self._rotation.forward(values)

    def _queries_in(self, queries: mx.array) -> mx.array:
        return self._rotation.forward(queries)

    def _output_out(self, output: mx.array) -> mx.array:
        return self._rotation.inverse(output)

    def _output_rotation_signs(self) -> mx.array | None:
        return None if self._rotation is None else self._rotation.sylvester_inverse_signs()

    def _keys_out(self, keys: mx.array) -> mx.array:
        return self._rotation.inverse(keys)

    def _values_out(self, values: mx.array) -> mx.array:
        return self._rotation.inverse(values)
