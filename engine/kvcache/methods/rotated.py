"""Affine quantization after a seeded random rotation of head_dim (randomized Hadamard by default).

Keys often have a few outlier channels; a group containing one gets a wide scale and the other channels
lose precision. Rotating every key by an orthonormal R (R = H·diag(signs)/√d) spreads each outlier over
all channels before `mx.quantize`. Attention stays fused on the packed codes because
    q·k = (Rq)·(Rk)            (rotate the queries the same way),
    Σ p_i v_i = Rᵀ Σ p_i (R v_i) (weight the rotated values, rotate the output back),
so the history is never dequantized. Each layer uses its own rotation, seeded `seed + layer_index`
(the rotation itself, shared with `turboquant` and `rvq`, is `methods/_rotation.py`).
If MLX has no Hadamard transform of size head_dim, the rotation falls back to a dense seeded orthogonal
matrix (and says so in `rotation_note`).
"""

from __future__ import annotations

from typing import ClassVar

from engine.kvcache.methods._rotation import RotationMixin
from engine.kvcache.methods.affine import VeloxAffineKVCache
from engine.kvcache.registry import register_method


@register_method("rotated")
class VeloxRotatedKVCache(RotationMixin, VeloxAffineKVCache):
    # Bits, group sizes, calibration and the fused attention path are those of `affine`.
    description: ClassVar[str] = (
        "Randomized Hadamard rotation of head_dim, then affine group quantization of keys and values; "
        "queries rotated alike and the output rotated back, so attention stays on the packed codes."
    )
