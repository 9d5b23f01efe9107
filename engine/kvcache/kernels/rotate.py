"""A Hadamard rotation done by one warp: the butterflies the encode kernel applies to a new token (`WARP_HADAMARD`).

Lane l holds coordinates l, l + 32, ... of a vector (D = 32·P, a power of two); the transform's butterflies pair two
lanes (a shuffle) for each of a coordinate's five low bits and two of a lane's registers for the rest. Sums run in
another order than MLX's transform, so a coordinate within float rounding of a 16-bit step may round the other way
(the tests allow for it); the reference path keeps MLX's.

A kernel that rotated a decode step's token in one launch (the KIVI levels' new value, the rotated methods' query:
four MLX launches) lived here; it was timed on an H200 twice and did not shorten a step (BENCHMARKS.md, round 24).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

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


def warp_rotatable(signs: mx.array | None, head_dim: int) -> bool:
    """Whether a warp rotates these vectors (`WARP_HADAMARD`): a Hadamard rotation in natural (Sylvester) order
    (`signs`: Rotation.sylvester_inverse_signs, None for any other) over D = 32 lanes times a power of two."""
    return signs is not None and head_dim >= 32 and head_dim & (head_dim - 1) == 0


@functools.cache
def rotation_scale(head_dim: int) -> mx.array:
    """1/sqrt(head_dim), the rotation's own float (Rotation._scale) in float32 as MLX's transform takes it: one array
    per head_dim for the process, not one a step."""
    return mx.array([1.0 / math.sqrt(head_dim)], dtype=mx.float32)
