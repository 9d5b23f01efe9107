"""PolarQuant: the recursive polar transform of rotated keys and values, angles quantized per level.

Each vector x of one head is rotated (the layer's randomized Hadamard rotation, as in `turboquant`), stored
as its norm (16-bit) and the d-1 angles of the recursive polar transform of the unit vector (quant/polar.py):
d/2 level-1 angles, uniform on [0, 2π), get b+1 bits (uniform quantizer); the d/2-1 angles of the higher
levels, concentrated around π/4 more sharply at every level, get b-1 bits each with the Lloyd-Max codebook of
their level's known density. That is d·b code bits per vector (one (b-1)-bit slot is padding, so the
higher-level codes fill whole 32-bit words), the same as b-bit `turboquant`. No calibration and no per-block
scales: after the rotation the angle laws are known in advance, which is PolarQuant's point.

Reconstruction runs the transform backwards from radius 1, then multiplies by the norm. Attention decodes the
history chunk by chunk each step, like `turboquant` (the shared `RotatedCodebookKVCache` path), except where the
decode kernel reads the angle codes itself (codec "polar" of kernels/decode.py: each lane rebuilds its 8 channels
from the angles on their path, on a backend in `POLAR_BACKENDS`). On a backend in kernels/encode.py's
`POLAR_ENCODE_BACKENDS` new tokens are encoded in one launch (the polar kernel), elsewhere by the MLX operations below.
"""

from __future__ import annotations

import math
from typing import ClassVar

import mlx.core as mx

from engine.errors import ConfigError
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.kernels import Codec
from engine.kvcache.kernels import encode as _encode_kernels
from engine.kvcache.kernels.encode import polar_encode
from engine.kvcache.methods.turboquant import NORM_BITS, Codebook, RotatedCodebookKVCache, centroid_lookup
from engine.kvcache.quant.bitpack import pack_bits, unpack_bits
from engine.kvcache.quant.codebooks import encode_scalar
from engine.kvcache.quant.polar import (
    angle_codebook,
    level_table_offset,
    polar_angles,
    polar_levels,
    polar_vector,
    uniform_angle_codebook,
)
from engine.kvcache.registry import register_method


@register_method("polarquant")
class VeloxPolarQuantKVCache(RotatedCodebookKVCache):
    supported_bits: ClassVar[tuple[int, ...]] = (2, 3, 4)
    default_bits: ClassVar[int] = 4
    description: ClassVar[str] = (
        "PolarQuant: recursive polar transform of the rotated vector, level-1 angles at b+1 bits (uniform), "
        "higher levels at b-1 bits (Lloyd-Max per level), one 16-bit norm; a fused decode kernel on a GPU, "
        "dequantized chunk by chunk elsewhere."
    )
    # Encoded by kernels/encode.py's polar kernel where encode.POLAR_ENCODE_BACKENDS has the backend (`_kernel_encode`)
    encode_kernel: ClassVar[bool] = True
    rotation_in_encode: ClassVar[bool] = False  # its kernel (polar_encode) takes rotated tokens

    @classmethod
    def stage_bits(cls, bits: int) -> tuple[int, ...]:
        return (bits + 1, bits - 1)  # level-1 angles, higher-level angles

    @classmethod
    def side_bits_per_vector(cls) -> int:
        return NORM_BITS

    @classmethod
    def check_config(cls, config: KVCacheConfig, head_dim: int) -> None:
        # The rotation check of the shared bases; the unit-codebook option does not apply here.
        super(RotatedCodebookKVCache, cls).check_config(config, head_dim)
        try:
            polar_levels(head_dim)
        except ValueError:
            raise ConfigError(
                f"Method 'polarquant' needs a power-of-two head_dim, not {head_dim}."
            ) from None
        for bits in {config.key_bits, config.value_bits}:
            for stage_bits in cls.stage_bits(bits):
                if (head_dim // 2 * stage_bits) % 32:
                    raise ConfigError(
                        f"Method 'polarquant' packs head_dim/2 angles of {stage_bits} bits into 32-bit "
                        f"words; head_dim {head_dim} does not allow it."
                    )

    @classmethod
    def _build_codebooks(cls, config: KVCacheConfig, head_dim: int) -> dict[str, Codebook]:
        codebooks: dict[str, Codebook] = {}
        for role, bits in (("key", config.key_bits), ("value", config.value_bits)):
            first_bits, higher_bits = cls.stage_bits(bits)
            tables = [uniform_angle_codebook(first_bits)]
            tables += [angle_codebook(level, higher_bits) for level in range(2, polar_levels(head_dim) + 1)]
            for level, (centroids, boundaries) in enumerate(tables, start=1):
                codebooks[f"{role}{level}"] = (mx.array(centroids), mx.array(boundaries))
        return codebooks

    def _reset_storage(self) -> None:
        super()._reset_storage()
        self._kernel_tables: dict[str, mx.array] = {}
        self._level_boundaries: dict[str, mx.array] = {}

    def _setup(
        self, batch: int, n_kv_heads: int, k_head_dim: int, v_head_dim: int, input_dtype: mx.Dtype
    ) -> None:
        super()._setup(batch, n_kv_heads, k_head_dim, v_head_dim, input_dtype)  # also builds the codebooks
        # Each role's centroids of levels 1..L are held once, in one array: the decode kernel takes one input for
        # them (Metal binds at most 31 buffers a kernel; one per level took the pass to 37), and the reference
        # path reads a level's slice of it (`_level_centroids`). The levels' boundaries move to `_level_boundaries`
        # and `_codebooks` is emptied, so each centroid is held once, as `constant_bytes` counts it.
        levels = polar_levels(k_head_dim)
        self._kernel_tables = {}
        for role in ("key", "value"):
            tables = [self._codebooks[f"{role}{level}"][0] for level in range(1, levels + 1)]
            # the kernel and `_level_centroids` read level l at `level_table_offset`
            first_bits, higher_bits = self.stage_bits(self._role_bits(role))
            if [t.size for t in tables] != [1 << first_bits] + [1 << higher_bits] * (levels - 1):
                raise ValueError(f"PolarQuant's {role} tables hold {[t.size for t in tables]} centroids, not 2^bits a level.")
            self._kernel_tables[role] = mx.concatenate(tables)
        self._level_boundaries = {name: boundaries for name, (_, boundaries) in self._codebooks.items()}
        self._codebooks = {}

    def _constant_arrays(self) -> list[mx.array]:
        # The rotation's arrays (the codebook base's own list is empty: `_codebooks` was emptied in `_setup`), then
        # the packed centroids and the boundaries.
        return super()._constant_arrays() + list(self._kernel_tables.values()) + list(self._level_boundaries.values())

    def _level_centroids(self, role: str, level: int) -> mx.array:
        """Level `level`'s centroids of `role`: a slice of the role's one table, at the kernel's offsets."""
        first_bits, higher_bits = self.stage_bits(self._role_bits(role))
        start = level_table_offset(level, first_bits, higher_bits)
        return self._kernel_tables[role][start : start + (1 << (first_bits if level == 1 else higher_bits))]

    def _encode_unit(self, unit: mx.array, role: str) -> dict[str, mx.array]:
        first_bits, higher_bits = self.stage_bits(self._role_bits(role))
        angles, _ = polar_angles(unit)
        cells = 1 << first_bits
        first = mx.minimum(mx.floor(angles[0] * (cells / (2 * math.pi))), cells - 1).astype(mx.uint8)
        higher = [
            encode_scalar(angle, self._level_boundaries[f"{role}{level}"])
            for level, angle in enumerate(angles[1:], start=2)
        ]
        padding = mx.zeros((*unit.shape[:-1], 1), dtype=mx.uint8)
        return {
            f"{role}_codes": pack_bits(first, first_bits),
            f"{role}_angle_codes": pack_bits(mx.concatenate([*higher, padding], axis=-1), higher_bits),
        }

    def _kernel_encode(self, vectors: mx.array, role: str, backend: str) -> dict[str, mx.array]:
        """`_encode_role` in one launch (kernels/encode.py's polar kernel), where that kernel has passed its parity
        tests on `backend`; the same entries in the same order."""
        if backend not in _encode_kernels.POLAR_ENCODE_BACKENDS:
            return self._encode_role(vectors, role)
        first_bits, higher_bits = self.stage_bits(self._role_bits(role))
        levels = polar_levels(self._k_head_dim)
        boundaries = mx.stack([self._level_boundaries[f"{role}{level}"] for level in range(2, levels + 1)])
        parts = polar_encode(vectors, first_bits, higher_bits, boundaries, self._dense_dtype, backend)
        return dict(zip((f"{role}_norms", f"{role}_codes", f"{role}_angle_codes"), parts, strict=True))

    def _decode_unit(self, store: dict[str, mx.array], role: str) -> mx.array:
        first_bits, higher_bits = self.stage_bits(self._role_bits(role))
        half = self._k_head_dim // 2
        angles = [centroid_lookup(unpack_bits(store[f"{role}_codes"], first_bits, half), self._level_centroids(role, 1))]
        higher = unpack_bits(store[f"{role}_angle_codes"], higher_bits, half)
        start, size = 0, half // 2
        for level in range(2, polar_levels(self._k_head_dim) + 1):
            angles.append(centroid_lookup(higher[..., start : start + size], self._level_centroids(role, level)))
            start, size = start + size, size // 2
        ones = mx.ones((*higher.shape[:-1], 1), dtype=mx.float32)
        return polar_vector(angles, ones)

    # ----- decode kernel ---------------------------------------------------------------------------------------

    def _kernel_codecs(self) -> tuple[Codec, list[mx.array], Codec, list[mx.array]] | None:
        assert self._store is not None
        store, levels = self._store, polar_levels(self._k_head_dim)
        codecs: list = []
        for role in ("key", "value"):
            first_bits, higher_bits = self.stage_bits(self._role_bits(role))
            codecs += [Codec("polar", first_bits, higher_bits, levels=levels),
                       [store[f"{role}_codes"], store[f"{role}_norms"], store[f"{role}_angle_codes"],
                        self._kernel_tables[role]]]
        return codecs[0], codecs[1], codecs[2], codecs[3]
