"""Probe for issue 12's 3-bit level: would giving KIVI's key channels different bit widths (at the same 3 bits on
average) pay on the embedded model? An estimate, not a cache: no cache stores mixed widths yet.

    python benchmarks/key_bit_allocation_probe.py --text ../shared/data/botchan.txt --start 18000 --tokens 2048 \\
        [--out probe.json]

The window runs through the model with a 16-bit cache that records every query; then, per layer and kv head, each
key channel's error weight is the energy its RoPE pair's queries carry (Σ over the kv head's query heads of
(q_a² + q_b²)/2: a score's error from an error e in channel a of a key turned by RoPE averages to that weight times
e²), and its error for b bits over a 128-token block of keys stored before RoPE (KIVI's rope=pre, the block's one
outlier set aside as key_outliers=1 does) is range² / (2^b - 1)² / 12. Printed per layer: the weighted key error of
uniform 3-bit keys, and of the best widths from 2 to 5 bits averaging 3 (greedy: each extra bit where it lowers the
weighted error most), chosen once per layer, kv head and channel from this window (a calibrated allocation; the
same window also scores it, so it is optimistic) and, as a bound, per 128-token block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK = 128
WIDTHS = (2, 3, 4, 5)


def allocate(costs: np.ndarray, budget: int) -> np.ndarray:
    """Widths index per row of `costs` [n, len(WIDTHS)] (error at each width) summing to `budget` extra steps above
    the narrowest, by greedy marginal gain (the costs fall convexly with width, so greedy is optimal)."""
    n = costs.shape[0]
    level = np.zeros(n, dtype=int)
    gains = costs[:, 0] - costs[:, 1]
    for _ in range(budget):
        best = int(np.argmax(gains))
        level[best] += 1
        gains[best] = costs[best, level[best]] - costs[best, level[best] + 1] if level[best] + 1 < len(WIDTHS) else -1
    return level


def block_ranges(keys: np.ndarray) -> np.ndarray:
    """Range of each channel over each whole 128-token block of `keys` [T, D] with its one outlier set aside
    (the entry whose removal shrinks the range most): [blocks, D]."""
    blocks = keys[: keys.shape[0] // BLOCK * BLOCK].reshape(-1, BLOCK, keys.shape[1])
    ordered = np.sort(blocks, axis=1)
    top_gap = ordered[:, -1] - ordered[:, -2]
    low_gap = ordered[:, 1] - ordered[:, 0]
    high = np.where(top_gap >= low_gap, ordered[:, -2], ordered[:, -1])
    low = np.where(top_gap >= low_gap, ordered[:, 0], ordered[:, 1])
    return high - low


def keys_and_weights(model, rope, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:  # noqa: ANN001
    """Per layer of `model`, after it read `ids` in 64-token chunks through a 16-bit cache: its keys before RoPE
    [n_kv, T, D] and each key channel's error weight [n_kv, D] (Σ over the kv head's query heads of its RoPE pair's
    query energy, halved)."""
    import mlx.core as mx

    from engine.kvcache import KVCacheBuilder, KVCacheConfig

    caches = KVCacheBuilder(KVCacheConfig.parse("fp16")).for_model(model).build()
    energy: dict[int, mx.array] = {}
    cls = type(caches[0])
    original = cls.attention

    def recording(self, queries, keys, values, scale, mask):  # noqa: ANN001, ANN202 - the cache's own signature
        squares = mx.sum(queries.astype(mx.float32) ** 2, axis=2)[0]   # [n_q_heads, D]
        index = caches.index(self)
        energy[index] = squares if index not in energy else energy[index] + squares
        return original(self, queries, keys, values, scale, mask)

    cls.attention = recording
    try:
        tokens = mx.array(ids)[None]
        for start in range(0, len(ids), 64):
            mx.eval(model(tokens[:, start : start + 64], cache=caches))
    finally:
        cls.attention = original
    layers = []
    for layer, cache in enumerate(caches):
        keys = np.array(rope.rotate(cache.to_dense()[0], 0, inverse=True))[0]    # [n_kv, T, D], before RoPE
        q = np.array(energy[layer])                                             # [n_q, D]
        n_kv, _, dim = keys.shape
        half = dim // 2
        paired = q + (q[:, np.r_[half:dim, 0:half]] if not rope.traditional else q[:, np.arange(dim) ^ 1])
        layers.append((keys, paired.reshape(n_kv, -1, dim).sum(axis=1) / 2))
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", required=True)
    parser.add_argument("--start", type=int, default=18000)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out")
    args = parser.parse_args()

    from engine.runtime import prepare_runtime

    prepare_runtime()
    from engine.kvcache.quant.rope import model_rope
    from engine.models.catalog import load_model
    from engine.models.default_model import ensure_default_model

    model, tokenizer, _ = load_model(ensure_default_model())
    rope = model_rope(model)
    ids = list(tokenizer.encode(Path(args.text).read_text(encoding="utf-8", errors="replace"),
                                add_special_tokens=False))[args.start : args.start + args.tokens]
    rows = []
    total = {"uniform": 0.0, "static": 0.0, "per_block": 0.0}
    levels_used = np.zeros(len(WIDTHS))
    steps = np.array([(2**b - 1) ** 2 * 12.0 for b in WIDTHS])
    for layer, (keys, weights) in enumerate(keys_and_weights(model, rope, ids)):
        n_kv, _, dim = keys.shape
        row = {"layer": layer, "uniform": 0.0, "static": 0.0, "per_block": 0.0}
        for head in range(n_kv):
            weight = weights[head]                                                      # [D]
            ranges = block_ranges(keys[head]) ** 2                                      # [blocks, D]
            costs = weight[None, :, None] * ranges[:, :, None] / steps[None, None, :]   # [blocks, D, widths]
            uniform = costs[:, :, 1].sum()
            static = costs.sum(axis=0)                                                  # [D, widths]
            chosen = allocate(static, dim)                                              # D extra steps: 3 bits avg
            levels_used += np.bincount(chosen, minlength=len(WIDTHS))
            row["uniform"] += float(uniform)
            row["static"] += float(static[np.arange(dim), chosen].sum())
            row["per_block"] += float(sum(block[np.arange(dim), allocate(block, dim)].sum() for block in costs))
        row["static_ratio"] = row["static"] / row["uniform"]
        row["per_block_ratio"] = row["per_block"] / row["uniform"]
        for name in total:
            total[name] += row[name]
        rows.append(row)
        print(f"layer {layer:2d}: static {row['static_ratio']:.3f}  per block {row['per_block_ratio']:.3f}", flush=True)
    summary = {"static_ratio": total["static"] / total["uniform"], "per_block_ratio": total["per_block"] / total["uniform"],
               "mean_of_layer_static_ratios": float(np.mean([r["static_ratio"] for r in rows])),
               "width_share": {str(b): float(c / levels_used.sum()) for b, c in zip(WIDTHS, levels_used, strict=True)}}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"schema": "velox-key-bits-probe/1", "text": Path(args.text).name,
                                              "start": args.start, "tokens": len(ids), "summary": summary,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
