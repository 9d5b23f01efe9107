"""Key channels at different bit widths: which channel gets how many bits, and the storage order that follows.

A KIVI key channel is quantized over blocks of tokens with its own scale and bias, so its rounding error is about
range² / (2^b − 1)² / 12 per entry at b bits, and what that error costs is the energy of the queries that meet the
channel. Giving a channel that many queries lean on, or a wide-ranged one, a bit more and a quiet one a bit less, at
the same bits on average, lowers the attention scores' error (issue 12's probe: query-weighted key error 29 % of
uniform 3-bit on SmolLM2; held out, perplexity +1.74 % against the 3-bit level's +3.48 %).

`allocate_widths` takes each channel's importance (query energy × Σ over blocks of its range², measured by the
calibration in `engine/kvcache/key_widths.py`) and gives the layer's channels widths from `width_choices(bits)`,
averaging exactly `bits`. Every kv head of a layer gets the same number of channels at each width (its own channels
ranked by importance; the ranks' importance, summed over the heads, is what is allocated), so a cache stores one code
array per width, [batch, kv heads, channels of that width, tokens], that `mx.quantized_matmul` reads at that width.
`WidthClasses` is that layout: each head's channels in storage order (narrowest width first) and each width's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Widths a channel may take around a layer's key bits (one narrower, two wider), where MLX has codes of that width
# (1-bit codes since MLX 0.32: a channel's block at its min or max, so a 2-bit layer gives its quietest channels 1 bit
# and its busiest 3 or 4; issue 12's 2-bit level held out, keys before RoPE: +18.7 % → +9.5 %).
WIDTH_OFFSETS = (-1, 0, 1, 2)
CODE_WIDTHS = (1, 2, 3, 4, 5, 6, 8)


def width_choices(bits: int) -> tuple[int, ...]:
    """Widths a channel of a layer at `bits` key bits may take (contiguous from the narrowest)."""
    choices: list[int] = []
    for offset in WIDTH_OFFSETS:
        width = bits + offset
        if width in CODE_WIDTHS and (not choices or width == choices[-1] + 1):
            choices.append(width)
        elif choices:
            break
    return tuple(choices)


def _greedy_levels(costs: np.ndarray, steps: int) -> np.ndarray:
    """Per row of `costs` [n, widths] (error at each width, falling convexly), how many widths above the narrowest it
    gets, `steps` in all, each where it lowers the error most (greedy is optimal for convex costs)."""
    n, n_widths = costs.shape
    level = np.zeros(n, dtype=np.int64)
    gains = costs[:, 0] - costs[:, 1] if n_widths > 1 else np.full(n, -np.inf)
    for _ in range(steps):
        best = int(np.argmax(gains))
        level[best] += 1
        up = level[best] + 1
        gains[best] = costs[best, level[best]] - costs[best, up] if up < n_widths else -np.inf
    return level


def allocate_widths(importance: np.ndarray, bits: int) -> np.ndarray:
    """Widths [n_kv, D] (uint8) for a layer's key channels from their `importance` [n_kv, D] (≥ 0), averaging
    `bits` exactly, with the same count of channels at each width in every kv head."""
    importance = np.asarray(importance, dtype=np.float64)
    if importance.ndim != 2 or not np.all(np.isfinite(importance)) or np.any(importance < 0):
        raise ValueError("Key channel importance must be a finite, non-negative [kv heads, channels] array.")
    choices = np.array(width_choices(bits))
    n_kv, dim = importance.shape
    order = np.argsort(-importance, axis=1, kind="stable")
    ranked = np.take_along_axis(importance, order, axis=1).sum(axis=0)   # [D]: rank r's importance, all heads
    errors = ranked[:, None] / ((2.0 ** choices - 1) ** 2)[None, :]
    by_rank = choices[_greedy_levels(errors, dim * (bits - int(choices[0])))].astype(np.uint8)
    widths = np.empty((n_kv, dim), dtype=np.uint8)
    np.put_along_axis(widths, order, np.broadcast_to(by_rank, (n_kv, dim)), axis=1)
    return widths


@dataclass(frozen=True)
class WidthClasses:
    """A layer's key channels grouped by width: `order[h]` lists head h's channels in storage order (narrowest
    first, then by channel), `rows` the (width, first row, end row) of each width in that order, the same for every
    kv head."""

    order: np.ndarray               # [n_kv, D] channel indices
    rows: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, widths: np.ndarray, bits: int) -> WidthClasses:
        """The classes of `widths` [n_kv, D]; ValueError where the heads' counts differ or the mean is not `bits`."""
        widths = np.asarray(widths)
        if widths.ndim != 2 or widths.shape[1] == 0:
            raise ValueError(f"Key channel widths must be [kv heads, channels], not {widths.shape}.")
        allowed = width_choices(bits)
        if not np.isin(widths, allowed).all():
            raise ValueError(f"Key channel widths at {bits} bits must be among {allowed}.")
        order = np.argsort(widths, axis=1, kind="stable")
        ordered = np.take_along_axis(widths, order, axis=1)
        if not (ordered == ordered[:1]).all():
            raise ValueError("Every kv head must have the same count of key channels at each width.")
        if int(ordered[0].sum()) != bits * widths.shape[1]:
            raise ValueError(f"Key channel widths must average {bits} bits, not {ordered[0].mean():.3f}.")
        rows = []
        for width in np.unique(ordered[0]):
            where = np.flatnonzero(ordered[0] == width)
            rows.append((int(width), int(where[0]), int(where[-1]) + 1))
        return cls(order=order, rows=tuple(rows))

    @property
    def inverse(self) -> np.ndarray:
        """[n_kv, D]: where each channel sits in storage order."""
        return np.argsort(self.order, axis=1, kind="stable")
