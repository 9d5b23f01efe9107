"""Johnson–Lindenstrauss sign sketches: the 1-bit inner-product estimator of QJL.

For a random matrix S with m rows s_j ~ N(0, I_d), each sign(s_j·k) with (s_j·q) has expectation
E[(s_j·q) sign(s_j·k)] = sqrt(2/π) (q·k)/‖k‖, so

    q·k  ≈  ‖k‖ · sqrt(π/2) / m · (S q) · sign(S k)

is an unbiased estimate from m sign bits and one norm (Zandieh et al., "QJL", 2024). Its variance is at most
(π/2 - 1)·‖q‖²‖k‖²/m for independent rows.

`gaussian_sketch` draws the rows as orthogonal directions with independent chi_d lengths: each row is then
exactly N(0, I_d) (a Gaussian vector is a uniform direction times a chi_d length), so the estimator stays
unbiased, while rows within a block of d are orthogonal, which lowers the variance ("orthogonal random
features"; measured in tests/test_quant_math.py).

The estimator is linear in q, so it can also be read as a "reconstruction" k̂ = ‖k‖·sqrt(π/2)/m · Sᵀ sign(S k)
with q·k̂ equal to the estimate: that is how the caches decode sketched keys for dense export and for
attention over decoded blocks. k̂ is not close to k (only its inner products are unbiased).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from engine.kvcache.quant.bitpack import pack_bits, unpack_bits
from engine.kvcache.quant.rotation import random_orthogonal

SIGN_ESTIMATOR_SCALE = math.sqrt(math.pi / 2)


def gaussian_sketch(m: int, d: int, seed: int) -> mx.array:
    """An m×d sketch matrix from `seed`: blocks of d orthogonal rows, each with a chi_d length.

    Held in float16 (half the bytes of a per-layer constant that every cache counts): rounding S changes
    which fixed matrix is used, not the estimator, because keys and queries are sketched by the same S."""
    blocks = []
    for index in range(math.ceil(m / d)):
        directions = random_orthogonal(d, seed * 7919 + index).T  # rows are orthonormal directions
        lengths = np.sqrt(np.random.default_rng((seed, index)).chisquare(d, size=d))
        blocks.append(directions * lengths[:, None])
    return mx.array(np.concatenate(blocks)[:m].astype(np.float16))


def sketch_projection(x: mx.array, sketch: mx.array) -> mx.array:
    """S x of float vectors [..., d] in float32: [..., m] (whose signs `sketch_signs` packs, and kernels.encode's
    `sketch_signs_packed` too, from the same product)."""
    return x.astype(mx.float32) @ sketch.astype(mx.float32).T


def sketch_signs(x: mx.array, sketch: mx.array) -> mx.array:
    """sign(S x) of float vectors [..., d] as packed bits (1 = non-negative): uint32 [..., m/32]."""
    return pack_bits((sketch_projection(x, sketch) >= 0).astype(mx.uint8), 1)


def signs_as_pm_one(packed: mx.array, m: int) -> mx.array:
    """Packed sign bits -> float32 ±1 [..., m]."""
    return unpack_bits(packed, 1, m).astype(mx.float32) * 2 - 1


def sketch_reconstruction(packed: mx.array, norms: mx.array, sketch: mx.array) -> mx.array:
    """k̂ = ‖k‖ sqrt(π/2)/m Sᵀ sign(S k) [..., d] (float32): q·k̂ is the unbiased estimate of q·k."""
    m = sketch.shape[0]
    return (signs_as_pm_one(packed, m) @ sketch.astype(mx.float32)) * (norms.astype(mx.float32) * (SIGN_ESTIMATOR_SCALE / m))
