"""A Hadamard rotation of whole vectors in one launch: y = H (signs ⊙ x) / sqrt(D), cast to the dtype asked for.

Through MLX the rotation of a decode step's one token is four launches: the cast of the 16-bit input to float32 (the
product with float32 signs promotes it), the product, the transform, and the cast back to the cache's 16-bit dtype.
Per layer and step that is the KIVI levels' value rotation (rotate_values) and the rotated methods' query rotation;
launches, not arithmetic, set their time there (BENCHMARKS.md, round 23). Here one warp rotates one vector: lane l holds
coordinates l, l + 32, ... (D = 32·P, a power of two), and the transform's butterflies pair two lanes (a shuffle) for
each of a coordinate's five low bits and two of a lane's registers for the rest (`WARP_HADAMARD`, which the encode
kernel shares). Sums run in another order than MLX's transform, so a coordinate within float rounding of a 16-bit
step may round the other way (the tests allow for it); the reference path keeps MLX's.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from engine.kvcache.kernels.backend import KernelSource, kernel

THREADS = 128  # 4 vectors, one warp each, per threadgroup
# Backends where the rotation runs here (elsewhere through MLX). CUDA passed the GPU parity run (the kernel against
# MLX's transform, and the decode parity of KIVI with rotated values, turboquant, rvq and rotated through it;
# kernel-parity-rotate-kernel-h200.log), but a step's timing has not run yet: one launch of ours in place of three
# or four of MLX's is fewer launches, not surely less time (a custom kernel's call builds and hashes its source).
ROTATE_BACKENDS: tuple[str, ...] = ("emulate",)

# The transform of a warp's vector held as float x[P] (coordinate lane + 32 p) in place, unscaled: for each bit of a
# coordinate, the side whose bit is clear takes the sum, the side whose bit is set the difference (partner - own).
WARP_HADAMARD = """
  for (int m = 1; m < 32; m <<= 1) {
    for (int p = 0; p < P; ++p) {
      const float other = LANE_XOR(x[p], m);
      x[p] = (lane & m) ? other - x[p] : x[p] + other;
    }
  }
  for (int h = 1; h < P; h <<= 1) {
    for (int p = 0; p < P; ++p) {
      if ((p & h) == 0) {
        const float a = x[p];
        const float b = x[p + h];
        x[p] = a + b;
        x[p + h] = a - b;
      }
    }
  }
"""

_ROTATE_BODY = """
  // Template: D, NT, TO (the output dtype). One warp per vector of `xin` [rows, D].
  constexpr int P = D / 32;
  const int lane = TID & 31;
  const long row = (long)GROUP_X * (NT / 32) + (TID >> 5);
  const long n_rows = (long)xin_shape[0] * xin_shape[1] * xin_shape[2];
  const bool valid = row < n_rows;  // uniform in a warp: every lane reaches the shuffles
  const long base = (valid ? row : 0) * D;
  float x[P];
  for (int p = 0; p < P; ++p) x[p] = (float)xin[base + lane + 32 * p] * rsign[lane + 32 * p];
""" + WARP_HADAMARD + """
  if (valid) {
    for (int p = 0; p < P; ++p) out[base + lane + 32 * p] = static_cast<TO>(x[p] * rscale[0]);
  }
"""

ROTATE_SOURCE = KernelSource(
    name="velox_hadamard_rotate",
    input_names=("xin", "rsign", "rscale"),
    output_names=("out",),
    body=_ROTATE_BODY,
)


def warp_rotatable(signs: mx.array | None, head_dim: int) -> bool:
    """Whether a warp rotates these vectors (`WARP_HADAMARD`): a Hadamard rotation in natural (Sylvester) order
    (`signs`: Rotation.sylvester_inverse_signs, None for any other) over D = 32 lanes times a power of two."""
    return signs is not None and head_dim >= 32 and head_dim & (head_dim - 1) == 0


def rotate_takes(backend: str | None, signs: mx.array | None, head_dim: int) -> bool:
    """Whether `hadamard_rotate` runs for a rotation on `backend`: admitted there (ROTATE_BACKENDS) and
    `warp_rotatable`."""
    return backend in ROTATE_BACKENDS and warp_rotatable(signs, head_dim)


@functools.cache
def rotation_scale(head_dim: int) -> mx.array:
    """1/sqrt(head_dim), the rotation's own float (Rotation._scale) in float32 as MLX's transform takes it: one array
    per head_dim for the process, not one a step."""
    return mx.array([1.0 / math.sqrt(head_dim)], dtype=mx.float32)


def hadamard_rotate(x: mx.array, signs: mx.array, out_dtype: mx.Dtype, backend: str) -> mx.array:
    """H (signs ⊙ x) / sqrt(D) of every vector of `x` [B, H, n, D] (any float dtype), in `out_dtype`, in one launch
    (`rotate_takes` checked by the caller)."""
    if x.ndim != 4:
        raise ValueError(f"hadamard_rotate takes [batch, heads, tokens, head_dim], got {x.shape}.")
    head_dim = x.shape[-1]
    rows = x.shape[0] * x.shape[1] * x.shape[2]
    groups = (rows + THREADS // 32 - 1) // (THREADS // 32)
    (out,) = kernel(ROTATE_SOURCE, backend)(
        inputs=[x, signs, rotation_scale(head_dim)],
        template=[("D", head_dim), ("NT", THREADS), ("TO", out_dtype)],
        grid=(groups * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[out_dtype],
    )
    return out
