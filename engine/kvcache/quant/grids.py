"""Min-max group quantization onto a non-uniform grid of levels (KVQuant's "nuq" idea, on KIVI's groups).

Affine quantization maps a group's values onto 2^b evenly spaced levels between the group's min and max:
x ≈ scale·code + bias with scale = (max - min)/(2^b - 1) and bias = min. A group's values are not spread
evenly over that range: about two of them sit at the ends and the rest gather in a bell towards the middle,
so the outer levels are nearly idle. A grid keeps the same scale and bias and the same packed codes, but
decodes code c to scale·grid[c] + bias, where grid (in code units, 0..2^b - 1) places its levels where the
normalized values actually lie:

    x ≈ scale·grid[code] + bias,   code = the nearest level of grid to (x - bias)/scale.

A decode kernel needs only a table lookup where it converts a code to a float; a kernel that folds scale and
bias into the query (KIVI's keys) still can, since the score stays linear in grid[code].

`GRIDS` holds the tables. "lloyd" grids are Lloyd-Max levels (least squared error) for the empirical
distribution of min-max-normalized values: keys per channel over 128-token blocks, values per token over
64-channel groups, pooled over every layer and head of SmolLM2-135M on 4096 tokens of prose (areopagitica and
botchan, 2,048 tokens each from token 2,000, none of it the held-out windows; 60 Lloyd iterations over the
pooled values and their mirror images 1 - v, so each grid is symmetric about the middle). They are fixed constants: nothing is
calibrated or stored per model. "lloyd_ends" grids are the same fit with the two outer levels held at 0 and
2^b - 1, so each group's min and max stay exact.

Codes are packed with `bitpack.pack_bits` (MLX's affine layout), so the packed arrays, scales and biases have
exactly the shapes and layout `mx.quantize` gives; only the meaning of a code changes.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from engine.errors import ConfigError
from engine.kvcache.quant.bitpack import pack_bits

# GRIDS[name][role][bits]: levels in code units (0 .. 2^bits - 1), ascending.
GRIDS: dict[str, dict[str, dict[int, tuple[float, ...]]]] = {
    "lloyd": {
        "key": {
            2: (0.555, 1.211, 1.789, 2.445),
            3: (0.587, 1.600, 2.413, 3.146, 3.854, 4.587, 5.400, 6.413),
            4: (0.439, 1.867, 2.987, 3.953, 4.825, 5.632, 6.397, 7.135,
                7.866, 8.604, 9.369, 10.176, 11.047, 12.013, 13.133, 14.561),
        },
        "value": {
            2: (0.513, 1.202, 1.798, 2.487),
            3: (0.420, 1.539, 2.386, 3.138, 3.863, 4.614, 5.462, 6.580),
            4: (0.250, 1.767, 2.938, 3.928, 4.812, 5.625, 6.392, 7.134,
                7.867, 8.608, 9.376, 10.189, 11.072, 12.062, 13.234, 14.750),
        },
    },
    "lloyd_ends": {
        "key": {
            2: (0.0, 1.090, 1.910, 3.0),
            3: (0.0, 1.326, 2.274, 3.103, 3.898, 4.727, 5.674, 7.0),
            4: (0.0, 1.589, 2.785, 3.803, 4.715, 5.557, 6.353, 7.121,
                7.880, 8.648, 9.444, 10.285, 11.198, 12.215, 13.411, 15.0),
        },
        "value": {
            2: (0.0, 1.097, 1.903, 3.0),
            3: (0.0, 1.352, 2.293, 3.109, 3.891, 4.707, 5.648, 7.0),
            4: (0.0, 1.604, 2.822, 3.842, 4.749, 5.582, 6.367, 7.126,
                7.875, 8.633, 9.419, 10.251, 11.158, 12.179, 13.396, 15.0),
        },
    },
}
GRID_NAMES = tuple(GRIDS)
GRID_BITS = (2, 3, 4)


def check_grid(name: str, bits: int) -> None:
    """ConfigError unless grid `name` has tables for `bits`-bit codes."""
    if name not in GRIDS:
        raise ConfigError(f"Unknown grid {name!r}; use {', '.join(GRID_NAMES)}.")
    if bits not in GRID_BITS:
        raise ConfigError(f"Grid {name!r} has levels for {', '.join(map(str, GRID_BITS))}-bit codes, not {bits}.")


@functools.cache
def grid_levels(name: str, role: str, bits: int) -> mx.array:
    """The levels of grid `name` for `role` ("key" or "value") codes of `bits` bits, float32, ascending."""
    check_grid(name, bits)
    return mx.array(np.asarray(GRIDS[name][role][bits], np.float32))


@functools.cache
def grid_table(name: str, role: str, bits: int) -> mx.array:
    """`grid_levels` padded with zeros to 16 entries: the decode kernel's lookup table (fixed size, so every
    width shares one kernel input shape; only the first 2^bits entries are ever indexed)."""
    levels = np.zeros(16, np.float32)
    levels[: 1 << bits] = GRIDS[name][role][bits]
    check_grid(name, bits)
    return mx.array(levels)


@functools.cache
def _boundaries(name: str, role: str, bits: int) -> mx.array:
    levels = np.asarray(GRIDS[name][role][bits], np.float32)
    return mx.array((levels[1:] + levels[:-1]) / 2)


def grid_quantize(array: mx.array, role: str, group_size: int, bits: int, grid: str) -> dict[str, mx.array]:
    """Quantize `array` along its last axis in groups of `group_size` onto grid `grid`: the store entries
    `{role}_codes` (uint32, MLX's packing), `{role}_scales` and `{role}_biases` (the array's dtype), shaped as
    `mx.quantize` shapes them. Codes are chosen against the stored (rounded) scale and bias."""
    shape = array.shape
    n_groups = shape[-1] // group_size
    groups = array.astype(mx.float32).reshape(*shape[:-1], n_groups, group_size)
    low, high = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
    scales = ((high - low) / (2**bits - 1)).astype(array.dtype)
    biases = low.astype(array.dtype)
    scale32 = scales.astype(mx.float32)
    # A constant group (scale 0) takes code 0 for every value; its level is then grid[0]·0 + bias = bias.
    normalized = mx.where(scale32 > 0, (groups - biases.astype(mx.float32)) / mx.where(scale32 > 0, scale32, 1), 0)
    codes = mx.sum(normalized[..., None] > _boundaries(grid, role, bits), axis=-1).astype(mx.uint8)
    return {
        f"{role}_codes": pack_bits(codes.reshape(shape), bits),
        f"{role}_scales": scales.squeeze(-1),
        f"{role}_biases": biases.squeeze(-1),
    }


def grid_dequantize(store: dict[str, mx.array], role: str, group_size: int, bits: int, grid: str) -> mx.array:
    """float32 scale·grid[code] + bias of the `role` entries of a store (the inverse of `grid_quantize`)."""
    codes, scales, biases = store[f"{role}_codes"], store[f"{role}_scales"], store[f"{role}_biases"]
    # mx.dequantize with unit scales and zero biases unpacks the codes themselves (exact small integers).
    unit = mx.ones(scales.shape, mx.float32)
    indices = mx.dequantize(codes, unit, mx.zeros_like(unit), group_size=group_size, bits=bits)
    levels = mx.take(grid_levels(grid, role, bits), indices.astype(mx.uint32))
    n_groups = scales.shape[-1]
    grouped = levels.reshape(*levels.shape[:-1], n_groups, group_size)
    decoded = grouped * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return decoded.reshape(levels.shape)
