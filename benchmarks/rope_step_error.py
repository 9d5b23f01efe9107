"""How far turning a run's later tokens by their pair's step (decode.ROPE_STEP) moves keys from the reference's RoPE.

    python benchmarks/rope_step_error.py [--out benchmarks/results/rope-step-error.json]

The reference (mx.fast.rope, and the tiled pass without ROPE_STEP) turns the key at position p by the float32 product
p x frequency; with ROPE_STEP the pass turns a run of TILED_RUN tokens' first key that way and each next one by one
more position's exact turn. For a Llama-3.1-shaped RoPE (head_dim 128, base 500,000) over the 4,096 positions before
each length: the largest and mean difference of the angles, and, for random keys, values and a query (numpy, float64
otherwise), the largest difference of the scores and of one attention output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kvcache.kernels.decode import TILED_RUN  # noqa: E402

HEAD_DIM = 128
BASE = 500000.0
TOKENS = 4096


def measure(length: int, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    freq = (1.0 / BASE ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)).astype(np.float32)
    positions = np.arange(length - TOKENS, length)
    reference = (positions.astype(np.float32)[:, None] * freq[None, :]).astype(np.float64)
    first = positions // TILED_RUN * TILED_RUN
    stepped = ((first.astype(np.float32)[:, None] * freq[None, :]).astype(np.float64)
               + (positions - first)[:, None] * freq[None, :].astype(np.float64))
    keys, values = rng.standard_normal((2, TOKENS, HEAD_DIM))
    query = 2.0 * rng.standard_normal(HEAD_DIM)

    def attend(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x1, x2 = keys[:, : HEAD_DIM // 2], keys[:, HEAD_DIM // 2:]
        turned = np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles), x1 * np.sin(angles) + x2 * np.cos(angles)], 1)
        scores = turned @ query / np.sqrt(HEAD_DIM)
        weights = np.exp(scores - scores.max())
        return scores, weights / weights.sum() @ values

    (s_ref, o_ref), (s_step, o_step) = attend(reference), attend(stepped)
    gap = np.abs(reference - stepped)
    return {"length": length, "angle_max_rad": float(gap.max()), "angle_mean_rad": float(gap.mean()),
            "score_max_diff": float(np.abs(s_ref - s_step).max()), "output_max_diff": float(np.abs(o_ref - o_step).max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = [measure(length) for length in (8193, 33000, 131073)]
    for row in rows:
        print(f"{row['length']:7d}: angle max {row['angle_max_rad']:.5f} rad (mean {row['angle_mean_rad']:.6f}), score max "
              f"{row['score_max_diff']:.5f}, output max {row['output_max_diff']:.6f}")
    if args.out:
        args.out.write_text(json.dumps({"kind": "rope-step-error", "head_dim": HEAD_DIM, "base": BASE, "tokens": TOKENS,
                                        "run": TILED_RUN, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
