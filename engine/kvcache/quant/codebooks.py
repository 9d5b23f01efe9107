"""Lloyd-Max scalar quantizer codebooks, and vectorised encode/decode against them.

A Lloyd-Max codebook minimises the expected squared error of quantizing one scalar drawn from a
known density to 2^bits levels: each boundary is the midpoint of its two neighbouring centroids and
each centroid is the conditional mean of its cell. We solve for that fixed point of the Lloyd map
(Newton's method, see ``_solve_codebook``) with cell integrals read from cumulative integrals of the
density tabulated on a fine grid -- numpy only, deterministic, once per (distribution, bits, dim), cached.

Distributions, all with mean 0 and variance 1/dim (variance 1 when ``dim`` is None):
  - "gaussian": N(0, 1/dim). After a random rotation, each coordinate of a unit vector in dimension d
    is approximately N(0, 1/d) -- the TurboQuant setting.
  - "laplacian": Laplace with variance 1/dim, for heavy-tailed residuals (second stage of RVQ).
  - "beta": the exact law of one coordinate of a uniformly random unit vector in dimension dim,
    f(x) ∝ (1 - x²)^((dim-3)/2) on [-1, 1]; needs dim >= 3.
"""

from __future__ import annotations

import functools
import math
import operator

import mlx.core as mx
import numpy as np

from engine.errors import ConfigError

DISTRIBUTIONS = ("gaussian", "laplacian", "beta")
MAX_CODEBOOK_BITS = 8

# Grid resolution: trapezoid integration error is ~h²·f'' / 12, about 1e-9 of the variance here,
# far below the float32 precision the codebooks are returned in.
_GRID_INTERVALS = 1 << 18
# Half-widths in standard deviations: tail mass beyond is < 1e-18, so no cell loses measurable mass.
_GAUSSIAN_HALF_WIDTH_SIGMAS = 10.0
_LAPLACIAN_HALF_WIDTH_SIGMAS = 30.0
_BETA_HALF_WIDTH_SIGMAS = 12.0
# The solver stops once a Lloyd step would move no centroid by more than this many standard deviations.
_LLOYD_TOLERANCE_SIGMAS = 1e-12
_SOLVER_MAX_STEPS = 500
# Boundaries compared per pass in encode_scalar (caps its temporary memory).
_ENCODE_BOUNDARY_CHUNK = 16


def _validated(distribution: str, bits: int, dim: int | None) -> tuple[str, int, int | None]:
    """The arguments checked and normalised to plain ints (numpy integers accepted), for the cache key."""
    if distribution not in DISTRIBUTIONS:
        raise ConfigError(
            f"Unknown codebook distribution {distribution!r}: use one of {', '.join(DISTRIBUTIONS)}."
        )
    try:
        bits = operator.index(bits)
        dim = None if dim is None else operator.index(dim)
    except TypeError:
        raise ConfigError(f"Codebook bits and dim must be integers, got {bits!r} and {dim!r}.") from None
    if not 1 <= bits <= MAX_CODEBOOK_BITS:
        raise ConfigError(f"Lloyd-Max codebooks support 1 to {MAX_CODEBOOK_BITS} bits, got {bits}.")
    if dim is not None and dim < 1:
        raise ConfigError(f"The codebook dimension must be a positive integer, got {dim}.")
    if distribution == "beta" and (dim is None or dim < 3):
        raise ConfigError(
            f"The 'beta' codebook is the law of a coordinate of a unit vector and needs dim >= 3, got {dim!r}."
        )
    return distribution, bits, dim


def _density_on_grid(distribution: str, dim: int | None) -> tuple[np.ndarray, np.ndarray, float]:
    """Grid x (float64, symmetric, contains 0), unnormalised density f(x) on it, and the std. deviation."""
    sigma = 1.0 / math.sqrt(dim) if dim is not None else 1.0
    if distribution == "gaussian":
        x = np.linspace(
            -_GAUSSIAN_HALF_WIDTH_SIGMAS * sigma, _GAUSSIAN_HALF_WIDTH_SIGMAS * sigma, _GRID_INTERVALS + 1
        )
        density = np.exp(-0.5 * (x / sigma) ** 2)
    elif distribution == "laplacian":
        # Laplace(0, b) has variance 2b², so b = sigma / sqrt(2) for variance sigma².
        scale_b = sigma / math.sqrt(2.0)
        x = np.linspace(
            -_LAPLACIAN_HALF_WIDTH_SIGMAS * sigma, _LAPLACIAN_HALF_WIDTH_SIGMAS * sigma, _GRID_INTERVALS + 1
        )
        density = np.exp(-np.abs(x) / scale_b)
    else:
        assert dim is not None
        half_width = min(1.0, _BETA_HALF_WIDTH_SIGMAS * sigma)
        x = np.linspace(-half_width, half_width, _GRID_INTERVALS + 1)
        exponent = (dim - 3) / 2.0
        if exponent == 0.0:
            density = np.ones_like(x)
        else:
            with np.errstate(divide="ignore"):
                density = np.exp(exponent * np.log1p(-np.minimum(x * x, 1.0)))
    return x, density, sigma


def _cumulative_trapezoid(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    steps = 0.5 * (y[1:] + y[:-1]) * np.diff(x)
    return np.concatenate([[0.0], np.cumsum(steps)])


class _CellIntegrals:
    """Integrals of f, x·f and x²·f (f normalised) over arbitrary cells, by interpolating cumulative tables.

    Tables are accumulated from both ends of the grid and a cell in the right half is integrated with
    the right-hand table: subtracting two cumulative values close to 1 would cancel away the few
    significant digits that a far-tail cell's tiny mass has.
    """

    def __init__(self, x: np.ndarray, density: np.ndarray) -> None:
        total = _cumulative_trapezoid(x, density)[-1]
        self.x = x
        self.density = density / total
        self.from_left = [_cumulative_trapezoid(x, moment * self.density) for moment in (1.0, x, x * x)]
        # from_right[k][j] = integral over [x_j, end]: accumulated over the reversed grid.
        self.from_right = [
            _cumulative_trapezoid(-x[::-1], (moment * self.density)[::-1])[::-1] for moment in (1.0, x, x * x)
        ]

    def over_cells(self, boundaries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(P, ∫x f, ∫x² f) over the cells (-inf, b0], (b0, b1], ..., (b_last, inf)."""
        edges = np.concatenate([[self.x[0]], boundaries, [self.x[-1]]])
        lower, upper = edges[:-1], edges[1:]
        in_right_half = lower >= 0.0
        results = []
        for left_table, right_table in zip(self.from_left, self.from_right, strict=True):
            left_integral = np.interp(upper, self.x, left_table) - np.interp(lower, self.x, left_table)
            right_integral = np.interp(lower, self.x, right_table) - np.interp(upper, self.x, right_table)
            results.append(np.where(in_right_half, right_integral, left_integral))
        return results[0], results[1], results[2]

    def density_at(self, points: np.ndarray) -> np.ndarray:
        return np.interp(points, self.x, self.density)


def _initial_centroids(x: np.ndarray, density: np.ndarray, levels: int) -> np.ndarray:
    # High-resolution theory: the optimal density of levels is ∝ f^(1/3), so start there.
    companded = _cumulative_trapezoid(x, np.cbrt(density))
    companded /= companded[-1]
    targets = (np.arange(levels) + 0.5) / levels
    return np.interp(targets, companded, x)


def _lloyd_map(integrals: _CellIntegrals, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One Lloyd step: midpoint boundaries, then the conditional mean of each cell. Returns (T(c), P, b)."""
    boundaries = 0.5 * (centroids[1:] + centroids[:-1])
    mass, first, _ = integrals.over_cells(boundaries)
    return first / np.maximum(mass, 1e-300), mass, boundaries


def _lloyd_map_jacobian(
    integrals: _CellIntegrals, mapped: np.ndarray, mass: np.ndarray, boundaries: np.ndarray
) -> np.ndarray:
    """dT/dc of the Lloyd map: tridiagonal, since cell i only moves with boundaries b_{i-1} and b_i."""
    levels = mapped.shape[0]
    boundary_density = integrals.density_at(boundaries)
    # Moving cell i's right edge b_i adds mass f(b_i)·db at x = b_i, pulling its mean towards b_i.
    by_right_edge = boundary_density * (boundaries - mapped[:-1]) / mass[:-1]
    by_left_edge = boundary_density * (mapped[1:] - boundaries) / mass[1:]
    jacobian = np.zeros((levels, levels))
    rows = np.arange(levels - 1)
    # b_i = (c_i + c_{i+1}) / 2, so each boundary derivative splits in halves over its two centroids.
    jacobian[rows, rows] += 0.5 * by_right_edge
    jacobian[rows, rows + 1] += 0.5 * by_right_edge
    jacobian[rows + 1, rows] += 0.5 * by_left_edge
    jacobian[rows + 1, rows + 1] += 0.5 * by_left_edge
    return jacobian


def _mirror(positive_half: np.ndarray) -> np.ndarray:
    return np.concatenate([-positive_half[::-1], positive_half])


@functools.cache
def _solve_codebook(
    distribution: str, bits: int, dim: int | None
) -> tuple[np.ndarray, np.ndarray, float, int]:
    """Read-only float64 (centroids, boundaries), expected squared error per scalar, and solver steps used.

    Plain Lloyd iteration converges linearly at a rate that approaches 1 as levels are added (about
    10^5 steps at 8 bits), so the fixed point c = T(c) is found by Newton's method on T(c) - c, whose
    Jacobian is tridiagonal and cheap. All densities here are symmetric, so only the positive half of
    the centroids is solved for and mirrored: besides halving the work this removes a near-degenerate
    "shift everything" direction of the Laplacian fixed point (its memoryless tail makes a shifted
    codebook almost a fixed point too), on which Newton would otherwise wander. A Newton step that
    would unsort the centroids or not reduce the residual is halved; failing that, a Lloyd step is taken.
    """
    x, density, sigma = _density_on_grid(distribution, dim)
    integrals = _CellIntegrals(x, density)
    levels = 1 << bits
    half = levels // 2
    positive = _initial_centroids(x, density, levels)[half:]
    tolerance = _LLOYD_TOLERANCE_SIGMAS * sigma
    # d(full centroids)/d(positive half): +1 on the upper half, -1 mirrored on the lower half.
    mirror_derivative = np.zeros((levels, half))
    mirror_derivative[half + np.arange(half), np.arange(half)] = 1.0
    mirror_derivative[half - 1 - np.arange(half), np.arange(half)] = -1.0
    steps_used = 0
    while steps_used < _SOLVER_MAX_STEPS:
        steps_used += 1
        mapped, mass, boundaries = _lloyd_map(integrals, _mirror(positive))
        residual = mapped[half:] - positive
        residual_size = np.max(np.abs(residual))
        if residual_size < tolerance:
            break
        full_jacobian = _lloyd_map_jacobian(integrals, mapped, mass, boundaries)
        jacobian = full_jacobian[half:] @ mirror_derivative - np.eye(half)
        newton_step = -np.linalg.solve(jacobian, residual)
        accepted = False
        step_fraction = 1.0
        for _ in range(20):
            candidate = positive + step_fraction * newton_step
            if candidate[0] > 0 and np.all(np.diff(candidate) > 0):
                candidate_mapped, _, _ = _lloyd_map(integrals, _mirror(candidate))
                if np.max(np.abs(candidate_mapped[half:] - candidate)) < residual_size:
                    positive, accepted = candidate, True
                    break
            step_fraction *= 0.5
        if not accepted:
            positive = mapped[half:]
    centroids = _mirror(positive)
    boundaries = 0.5 * (centroids[1:] + centroids[:-1])
    mass, first, second = integrals.over_cells(boundaries)
    distortion = float(np.sum(second - 2.0 * centroids * first + centroids * centroids * mass))
    centroids.setflags(write=False)
    boundaries.setflags(write=False)
    return centroids, boundaries, distortion, steps_used


def lloyd_max_codebook(distribution: str, bits: int, dim: int | None = None) -> tuple[mx.array, mx.array]:
    """Lloyd-Max codebook for a zero-mean density of variance 1/dim (1 if dim is None).

    Returns (centroids, boundaries) as float32 arrays, 2^bits centroids and 2^bits - 1 boundaries,
    both sorted ascending. Solved once per arguments and cached; each call returns fresh arrays.
    """
    centroids, boundaries, _, _ = _solve_codebook(*_validated(distribution, bits, dim))
    return mx.array(centroids.astype(np.float32)), mx.array(boundaries.astype(np.float32))


def lloyd_max_distortion(distribution: str, bits: int, dim: int | None = None) -> float:
    """Expected squared error per scalar of the :func:`lloyd_max_codebook` codebook on its own density."""
    return _solve_codebook(*_validated(distribution, bits, dim))[2]


def encode_scalar(x: mx.array, boundaries: mx.array) -> mx.array:
    """Codes (uint8) of x against sorted boundaries: code = number of boundaries b with x > b.

    Counting exceeded boundaries is exact for sorted boundaries, needs no distance to every centroid
    and no argmin, and sends a value equal to a boundary to the lower cell (NaN goes to code 0). The
    count is taken over at most 16 boundaries at a time so that the [..., boundaries] comparison
    temporary stays at 16 bytes per value even for 8-bit codebooks. (A gather-based binary search was
    measured 3-9x slower than this on the CPU backend for 2-5 bits.)
    """
    if boundaries.ndim != 1 or boundaries.shape[0] + 1 > (1 << MAX_CODEBOOK_BITS):
        raise ConfigError(
            f"encode_scalar needs a 1-D array of at most {(1 << MAX_CODEBOOK_BITS) - 1} boundaries, "
            f"got shape {tuple(boundaries.shape)}."
        )
    boundary_count = boundaries.shape[0]
    x = x.astype(mx.float32)[..., None]
    boundaries = boundaries.astype(mx.float32)
    codes = None
    for start in range(0, boundary_count, _ENCODE_BOUNDARY_CHUNK):
        # At most 255 boundaries in all, so every partial and total count fits in uint8.
        partial = mx.sum(x > boundaries[start : start + _ENCODE_BOUNDARY_CHUNK], axis=-1).astype(mx.uint8)
        codes = partial if codes is None else codes + partial
    if codes is None:
        return mx.zeros(x.shape[:-1], dtype=mx.uint8)
    return codes.astype(mx.uint8)


def decode_scalar(codes: mx.array, centroids: mx.array) -> mx.array:
    """Reconstructed values (float32): centroids[codes], elementwise."""
    return mx.take(centroids.astype(mx.float32), codes.astype(mx.uint32))
