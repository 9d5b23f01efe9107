"""The per-layer sign sketch S that `qjl`'s keys and `turboquant_prod`'s key residuals are stored against.

Each layer draws its m×D sketch (quant/sketch.py: `gaussian_sketch`, float16) from the config's seed, the layer's
index and the method's own offset at set-up, and holds it as a constant array (in `nbytes` and `constant_bytes`).
(The leading underscore keeps the registry's discovery from importing this module: it registers nothing.)
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from engine.kvcache.config import KVCacheConfig
from engine.kvcache.quant.sketch import gaussian_sketch

SKETCH_BYTES_PER_ENTRY = 2  # float16


class SketchMixin:
    """Set-up, constants and bytes of a cache's sign sketch `_sketch` [m, D].

    Put it before the cache base class (`class C(SketchMixin, SegmentedKVCache)`); a subclass says how many rows
    (`sketch_rows`) and offsets its seed (`sketch_seed_offset`) so that no sketch coincides with a rotation seeded
    `seed + layer`."""

    sketch_seed_offset: ClassVar[int]
    config: KVCacheConfig
    layer_index: int

    @classmethod
    def sketch_rows(cls, config: KVCacheConfig, head_dim: int) -> int:
        raise NotImplementedError

    @classmethod
    def layer_sketch(cls, config: KVCacheConfig, head_dim: int, layer_index: int) -> mx.array:
        seed = config.seed + layer_index + cls.sketch_seed_offset
        return gaussian_sketch(cls.sketch_rows(config, head_dim), head_dim, seed)

    @classmethod
    def constant_bytes(cls, config: KVCacheConfig, head_dim: int) -> int:
        sketch = cls.sketch_rows(config, head_dim) * head_dim * SKETCH_BYTES_PER_ENTRY
        return super().constant_bytes(config, head_dim) + sketch  # type: ignore[misc]

    def _reset_storage(self) -> None:
        super()._reset_storage()  # type: ignore[misc]
        self._sketch: mx.array | None = None

    def _setup(self, batch: int, n_kv_heads: int, k_head_dim: int, v_head_dim: int, input_dtype: mx.Dtype) -> None:
        super()._setup(batch, n_kv_heads, k_head_dim, v_head_dim, input_dtype)  # type: ignore[misc]
        self._sketch = self.layer_sketch(self.config, k_head_dim, self.layer_index)

    def _constant_arrays(self) -> list[mx.array]:
        held = super()._constant_arrays()  # type: ignore[misc]
        return held + ([] if self._sketch is None else [self._sketch])
