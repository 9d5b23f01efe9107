"""Seeded orthonormal rotations of the last axis, used to spread outliers before scalar quantization.

The preferred rotation is a randomized Hadamard transform, R = H·diag(signs)/sqrt(d): it costs
O(d log d) per vector through ``mx.hadamard_transform`` and never stores a d×d matrix. MLX only
implements sizes d = m·2^k with m in (1, 12, 20, 28); for any other size the kernel does not
refuse but returns a non-orthogonal result (d=36), overflows (d=576) or corrupts the heap and kills
the process (d=100) -- measured on MLX 0.32.4 CPU. So support is decided from a whitelist before the
kernel is ever called, and other sizes fall back to a dense seeded random orthogonal matrix.

Conventions: a rotation acts on the last axis as a column vector, y = R x. For a batch of row
vectors this is ``y = x @ R.T``; ``inverse`` applies R^T. ``matrix`` is R itself (d×d float32), so a
cache that wants to fold the rotation into a projection can use ``x @ rotation.matrix.T``.
All math is float32; outputs are float32 whatever the input dtype.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from engine.errors import ConfigError

# Non-power-of-two Hadamard factors that MLX ships (mlx/backend/common/hadamard.h, from Sloane's
# library). MLX builds H_{m·2^k} = kron(H_m, H_{2^k}); H_12 is symmetric, H_20 and H_28 are not,
# so for them the transpose needed by ``inverse`` is not the same transform -- measured, see tests.
_HADAMARD_FACTORS = (1, 12, 20, 28)
_SYMMETRIC_HADAMARD_FACTORS = (1, 12)
# The MLX docs promise 2^k <= 8192 for float32 inputs; larger sizes are not relied upon.
_MAX_POWER_OF_TWO_FLOAT32 = 8192


def _hadamard_factor(d: int) -> int | None:
    """The m of d = m·2^k that MLX would use, or None when MLX cannot transform size d correctly."""
    if d < 1:
        return None
    for factor in _HADAMARD_FACTORS:
        if d % factor:
            continue
        power = d // factor
        if power & (power - 1) == 0 and power <= _MAX_POWER_OF_TWO_FLOAT32:
            return factor
    return None


def hadamard_supported(d: int) -> bool:
    """True when ``mx.hadamard_transform`` gives a correct orthogonal transform of size d (d = m·2^k)."""
    return _hadamard_factor(d) is not None


def random_signs(d: int, seed: int) -> np.ndarray:
    """Deterministic ±1 vector of length d (float32) drawn from ``seed`` with numpy's PCG64."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 2, size=d) * 2 - 1).astype(np.float32)


def random_orthogonal(d: int, seed: int) -> np.ndarray:
    """Haar-distributed d×d orthogonal matrix (float32) from ``seed``: QR of a Gaussian, signs fixed.

    Multiplying Q's columns by sign(diag(R)) makes the QR factorisation unique, which is what makes Q
    uniformly distributed rather than biased by the QR algorithm's sign convention.
    """
    rng = np.random.default_rng(seed)
    gaussian = rng.standard_normal((d, d))
    q, r = np.linalg.qr(gaussian)
    diagonal_signs = np.sign(np.diag(r))
    diagonal_signs[diagonal_signs == 0] = 1.0
    return (q * diagonal_signs[None, :]).astype(np.float32)


class Rotation:
    """An orthonormal d×d rotation R of the last axis, deterministic from ``seed``.

    Build it with :func:`make_rotation`. ``kind`` is "hadamard" or "orthogonal"; ``note`` is empty
    unless a Hadamard rotation was asked for and could not be given.
    """

    def __init__(self, dim: int, seed: int, kind: str, note: str = "") -> None:
        if dim < 1:
            raise ConfigError(f"A rotation needs a positive dimension, got {dim}.")
        if kind not in ("hadamard", "orthogonal"):
            raise ConfigError(f"Unknown rotation kind {kind!r}: use 'hadamard' or 'orthogonal'.")
        if kind == "hadamard" and not hadamard_supported(dim):
            raise ConfigError(
                f"A Hadamard rotation of size {dim} is not available in MLX (needs m·2^k, m in 1, 12, 20, 28)."
            )
        self.dim = dim
        self.seed = seed
        self.kind = kind
        self.note = note
        self._scale = 1.0 / math.sqrt(dim)
        self._dense: mx.array | None = None
        self._dense_transposed: mx.array | None = None
        self._signs: mx.array | None = None
        self._small_hadamard: mx.array | None = None
        if kind == "hadamard":
            self._signs = mx.array(random_signs(dim, seed))
            factor = _hadamard_factor(dim)
            if factor not in _SYMMETRIC_HADAMARD_FACTORS:
                assert factor is not None
                # H_m (±1 entries) for the transposed transform in ``inverse``.
                self._small_hadamard = mx.hadamard_transform(mx.eye(factor, dtype=mx.float32), scale=1.0).T
        else:
            dense = random_orthogonal(dim, seed)
            self._dense = mx.array(dense)
            # A contiguous copy of R^T: x @ R.T through a transposed view ran 2-3x slower on MLX's CPU
            # backend (576×576: 11.6 s against 3.7 s for 32k vectors).
            self._dense_transposed = mx.array(np.ascontiguousarray(dense.T))

    def _hadamard_forward(self, x: mx.array) -> mx.array:
        assert self._signs is not None
        return mx.hadamard_transform(x * self._signs, scale=self._scale)

    def _hadamard_transposed(self, y: mx.array) -> mx.array:
        """H^T y / sqrt(d) on the last axis, for H = kron(H_m, H_p) with H_m not symmetric (m = 20, 28).

        MLX builds its size-m·p transform as kron(H_m, H_p) (measured; the tests check the inverse), so
        H^T = kron(H_m^T, H_p): a Sylvester transform of size p, which is symmetric, then H_m^T across
        the m blocks -- O(d·(m + log p)) work instead of a d×d matmul.
        """
        assert self._small_hadamard is not None
        factor = self._small_hadamard.shape[0]
        blocks = y.reshape(*y.shape[:-1], factor, self.dim // factor)
        blocks = mx.hadamard_transform(blocks, scale=self._scale)
        # (H_m^T B)[a, b] = sum_a' H_m[a', a] B[a', b]: with blocks as [..., p, m] rows this is B^T @ H_m.
        mixed = mx.swapaxes(blocks, -1, -2) @ self._small_hadamard
        return mx.swapaxes(mixed, -1, -2).reshape(y.shape)

    def _check_shape(self, x: mx.array) -> None:
        if x.ndim == 0 or x.shape[-1] != self.dim:
            raise ConfigError(
                f"The rotation acts on a last axis of size {self.dim}, got shape {tuple(x.shape)}."
            )

    def _check(self, x: mx.array) -> mx.array:
        self._check_shape(x)
        return x.astype(mx.float32)

    def forward(self, x: mx.array) -> mx.array:
        """y = R x on the last axis (float32)."""
        if self.kind == "hadamard" and x.dtype in (mx.float16, mx.bfloat16, mx.float32):
            # The product with the float32 signs promotes a 16-bit input (MLX records that cast itself, before the
            # product: launch-count-h200.json), so no cast of our own is added. A decode step's rotation is four
            # launches with the caller's cast back; one kernel launch for them timed no faster on an H200
            # (BENCHMARKS.md, round 24).
            self._check_shape(x)
            return self._hadamard_forward(x)
        x = self._check(x)
        if self.kind == "hadamard":
            return self._hadamard_forward(x)
        assert self._dense_transposed is not None
        return x @ self._dense_transposed

    def inverse(self, y: mx.array) -> mx.array:
        """x = R^T y on the last axis (float32); undoes :meth:`forward`."""
        y = self._check(y)
        if self.kind == "hadamard":
            # R^T = diag(signs)·H^T/sqrt(d).
            assert self._signs is not None
            if self._small_hadamard is None:  # H symmetric: H^T is the same transform
                return mx.hadamard_transform(y, scale=self._scale) * self._signs
            return self._hadamard_transposed(y) * self._signs
        assert self._dense is not None
        return y @ self._dense

    def sylvester_inverse_signs(self) -> mx.array | None:
        """The signs (float32) when the inverse is signs ⊙ (H y)/sqrt(d) with H the Sylvester (natural order)
        Hadamard matrix, which a kernel applies as an in-place butterfly (d a power of two); None otherwise.
        The rotation's own array, not a copy (nothing more is held); the decode kernels' merge pass uses it to
        rotate attention outputs back (see engine/kvcache/kernels/decode.py)."""
        if self.kind != "hadamard" or self.dim & (self.dim - 1) or self._signs is None:
            return None
        return self._signs

    @property
    def matrix(self) -> mx.array:
        """R as a d×d float32 array (forward(x) == x @ matrix.T); built on first use for Hadamard kinds.

        Shared with the rotation itself: treat it as read-only.
        """
        if self._dense is None:
            # forward(e_i) is column i of R, so the rows of forward(I) are the columns of R.
            self._dense = self._hadamard_forward(mx.eye(self.dim, dtype=mx.float32)).T
        return self._dense

    def __repr__(self) -> str:
        suffix = f", note={self.note!r}" if self.note else ""
        return f"Rotation(dim={self.dim}, seed={self.seed}, kind={self.kind!r}{suffix})"


def make_rotation(d: int, seed: int, kind: str = "hadamard") -> Rotation:
    """A seeded orthonormal rotation of size d.

    ``kind="hadamard"`` gives the fast randomized Hadamard rotation when MLX supports size d and
    otherwise falls back to a seeded random orthogonal matrix, saying so in ``rotation.note``.
    ``kind="orthogonal"`` always gives the dense random orthogonal matrix.
    """
    if kind == "orthogonal":
        return Rotation(d, seed, "orthogonal")
    if kind != "hadamard":
        raise ConfigError(f"Unknown rotation kind {kind!r}: use 'hadamard' or 'orthogonal'.")
    if hadamard_supported(d):
        return Rotation(d, seed, "hadamard")
    note = (
        f"head_dim {d} is not m·2^k with m in (1, 12, 20, 28), which MLX's Hadamard transform needs; "
        "using a seeded random orthogonal matrix instead (d×d matmul per vector)."
    )
    return Rotation(d, seed, "orthogonal", note=note)
