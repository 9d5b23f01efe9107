"""The recursive polar transform of PolarQuant (Han et al., 2025) and codebooks for its angles.

A vector x in dimension d = 2^L is written as one radius and d-1 angles:
  level 1: each pair (x_2i, x_2i+1) -> radius r_i = ‖pair‖ and angle ψ_i = atan2(x_2i+1, x_2i) in [0, 2π);
  level l > 1: each pair of level-(l-1) radii -> their norm and atan2(r_odd, r_even) in [0, π/2];
after L levels one radius is left: ‖x‖. The transform is exact and inverts level by level.

After a random rotation the coordinates of x/‖x‖ are close to i.i.d. Gaussian, which fixes each level's
angle law without calibration: level-1 angles are uniform on [0, 2π) (a uniform quantizer is optimal), and a
level-l angle is atan2 of two chi variables with n = 2^(l-1) degrees of freedom each, whose density is
∝ sin(2ψ)^(n-1) on [0, π/2]: concentrated around π/4 more and more at higher levels, so few bits suffice.
`angle_codebook` gives the Lloyd-Max codebook of that density.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

_GRID = 1 << 16
_LLOYD_STEPS = 300


def polar_levels(d: int) -> int:
    """L with d = 2^L; ValueError unless d is a power of two of at least 2."""
    levels = d.bit_length() - 1
    if d < 2 or (1 << levels) != d:
        raise ValueError(f"The polar transform needs a power-of-two dimension, not {d}.")
    return levels


def level_table_offset(level: int, first_bits: int, higher_bits: int) -> int:
    """Where level `level`'s centroids start in one array holding the tables of levels 1..L one after another (level
    1's 2^first_bits, then 2^higher_bits a level): the layout PolarQuant holds and its decode kernel reads."""
    return 0 if level == 1 else (1 << first_bits) + (level - 2) * (1 << higher_bits)


def polar_angles(x: mx.array) -> tuple[list[mx.array], mx.array]:
    """Angles of every level (level l: [..., d / 2^l], float32) and the final radius [..., 1]."""
    radii = x.astype(mx.float32)
    angles = []
    for level in range(polar_levels(x.shape[-1])):
        pairs = radii.reshape(*radii.shape[:-1], -1, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        angle = mx.arctan2(odd, even)
        if level == 0:
            angle = mx.where(angle < 0, angle + 2 * math.pi, angle)
        angles.append(angle)
        radii = mx.sqrt(even * even + odd * odd)
    return angles, radii


def polar_vector(angles: list[mx.array], radius: mx.array) -> mx.array:
    """Inverse of `polar_angles`: the vector [..., d] (float32) from every level's angles and the radius."""
    radii = radius.astype(mx.float32)
    for angle in reversed(angles):
        radii = mx.stack([radii * mx.cos(angle), radii * mx.sin(angle)], axis=-1)
        radii = radii.reshape(*radii.shape[:-2], -1)
    return radii


def uniform_angle_codebook(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Centroids and boundaries of the uniform quantizer of [0, 2π) (level-1 angles)."""
    width = 2 * math.pi / (1 << bits)
    centroids = (np.arange(1 << bits) + 0.5) * width
    return centroids.astype(np.float32), (np.arange(1, 1 << bits) * width).astype(np.float32)


@functools.lru_cache(maxsize=64)
def angle_codebook(level: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max centroids and boundaries (float32) for a level-`level` angle (level >= 2; see module doc).

    Lloyd's iteration on a fine grid of [0, π/2]: the density is smooth and unimodal, so it converges to
    the optimum from quantile starting points (a few hundred steps, once per (level, bits), cached)."""
    if level < 2:
        raise ValueError("Level-1 angles are uniform: use uniform_angle_codebook.")
    n = 1 << (level - 1)
    x = (np.arange(_GRID) + 0.5) * (math.pi / 2 / _GRID)
    log_density = (n - 1) * np.log(np.sin(2 * x))
    density = np.exp(log_density - log_density.max())
    cumulative = np.cumsum(density)
    cumulative /= cumulative[-1]
    levels = 1 << bits
    centroids = np.interp((np.arange(levels) + 0.5) / levels, cumulative, x)
    # Cumulative mass and first moment, so each cell's integrals are two look-ups.
    mass = np.concatenate([[0.0], np.cumsum(density)])
    moment = np.concatenate([[0.0], np.cumsum(density * x)])
    for _ in range(_LLOYD_STEPS):
        edges = np.concatenate([[0], np.searchsorted(x, (centroids[1:] + centroids[:-1]) / 2), [_GRID]])
        cell_mass = mass[edges[1:]] - mass[edges[:-1]]
        cell_moment = moment[edges[1:]] - moment[edges[:-1]]
        centroids = np.where(cell_mass > 0, cell_moment / np.maximum(cell_mass, 1e-300), centroids)
    boundaries = (centroids[1:] + centroids[:-1]) / 2
    return centroids.astype(np.float32), boundaries.astype(np.float32)
