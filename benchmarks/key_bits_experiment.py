"""Experiment for issue 12's 3-bit level: key channels at different widths (2-5 bits, 3 on average; 3-6 averaging
4 on the level's wide layers), chosen once per layer, kv head and channel by the allocation of
`key_bit_allocation_probe.py` on the bundled calibration prose, measured held out as `near_lossless.py` measures.

    python benchmarks/key_bits_experiment.py --text ../shared/data/botchan.txt --start 18000 --start 30000 \\
        --start 42000 --start 50000 --tokens 4096 [--out experiment.json]

A measurement, not a cache: the keys of each 128-token block are quantized before RoPE at their channels' widths
(the block's one outlier set aside and restored, as key_outliers=1 keeps it), then handed to the 3-bit level's
layout with 8-bit keys (k8: re-quantizing those levels moves them by at most 1/510 of the block's range), so the
values, scales, sinks, window and outliers are the level's own. Rows: fp16, the 3-bit level (keys before RoPE, its
wide layers 1, 10, 18), the same with the widths, and a control: the same path with every channel at the level's own
width (3, or 4 on the wide layers), which must measure as the level does.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from key_bit_allocation_probe import BLOCK, allocate, block_ranges, keys_and_weights  # noqa: E402
from near_lossless import paired  # noqa: E402

LEVEL = "kivi:k3v3:g64:s4:key_block=128:key_outliers=1:rope=pre:rotate_values=true:symmetric_values=true"
WIDE_LAYERS = (1, 10, 18)


def calibrate(model, tokenizer, rope, text: str, tokens: int, shared: bool = False) -> dict[int, np.ndarray]:  # noqa: ANN001
    """Per layer, the widths [n_kv, D] of its key channels (3 on average; 4 on WIDE_LAYERS). `shared`: every kv head
    of a layer gets the same number of channels at each width (its channels ranked by importance, the ranks' summed
    importance allocated), which a cache storing one code array per width needs."""
    ids = list(tokenizer.encode(Path(text).read_text(encoding="utf-8"), add_special_tokens=False))[:tokens]
    widths = {}
    for layer, (keys, weights) in enumerate(keys_and_weights(model, rope, ids)):
        dim = keys.shape[-1]
        base = 4 if layer in WIDE_LAYERS else 3
        choices = np.array([base - 1, base, base + 1, base + 2])
        steps = (2.0**choices - 1) ** 2 * 12
        importance = np.stack([weight * (block_ranges(keys[head]) ** 2).sum(axis=0)
                               for head, weight in enumerate(weights)])          # [n_kv, D]
        if shared:
            order = np.argsort(-importance, axis=1, kind="stable")
            ranked = np.take_along_axis(importance, order, axis=1).sum(axis=0)  # [D]: rank r's importance
            by_rank = choices[allocate(ranked[:, None] / steps[None, :], dim)]
            rows = np.empty_like(order)
            np.put_along_axis(rows, order, np.broadcast_to(by_rank, order.shape), axis=1)
        else:
            rows = np.stack([choices[allocate(row[:, None] / steps[None, :], dim)] for row in importance])
        widths[layer] = rows
    return widths


def fake_quantize(keys, widths, grid: str = "minmax"):  # noqa: ANN001, ANN201
    """`keys` [B, n_kv, T, D] (T whole blocks, before RoPE) quantized per channel and block at `widths` [n_kv, D],
    each block's one outlier per channel kept as it is. `grid`: "minmax" (the block's min-max range in float32),
    "minmax16" (the same with its scale and bias rounded to float16 and the codes chosen against them), or "mlx"
    (mx.quantize's own grid, in float32; every channel of a layer at one width)."""
    import mlx.core as mx

    from engine.kvcache.quant.outliers import split_block_outliers

    b, h, t, d = keys.shape
    transposed = keys.astype(mx.float32).swapaxes(-1, -2)                     # [B, H, D, T]
    kept, outliers, index = split_block_outliers(transposed, BLOCK)
    blocks = kept.reshape(b, h, d, t // BLOCK, BLOCK)
    if grid == "mlx":
        bits = int(np.unique(widths).item())
        quantized = mx.dequantize(*mx.quantize(kept, group_size=BLOCK, bits=bits), group_size=BLOCK, bits=bits)
        quantized = quantized.reshape(blocks.shape)
    else:
        low = mx.min(blocks, axis=-1, keepdims=True)
        high = mx.max(blocks, axis=-1, keepdims=True)
        levels = (2.0 ** mx.array(widths, dtype=mx.float32) - 1)[None, :, :, None, None]
        step = mx.maximum(high - low, 1e-12) / levels
        if grid == "minmax16":
            low, step = low.astype(mx.float16).astype(mx.float32), step.astype(mx.float16).astype(mx.float32)
        quantized = low + mx.clip(mx.round((blocks - low) / step), 0, levels) * step
    positions = mx.arange(BLOCK)
    restored = mx.where(positions == index.astype(mx.int32)[..., None], outliers[..., None], quantized)
    return restored.reshape(b, h, d, t).swapaxes(-1, -2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", required=True)
    parser.add_argument("--start", type=int, action="append", required=True)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--calibration-tokens", type=int, default=2048)
    parser.add_argument("--grids", action="store_true",
                        help="rows fp16 and the control on three grids instead (min-max in float32, min-max with "
                             "16-bit scale and bias, mx.quantize's)")
    parser.add_argument("--shared", action="store_true",
                        help="widths rows: every kv head of a layer at the same count of channels per width")
    parser.add_argument("--widths-grid", default="minmax", choices=("minmax", "minmax16"),
                        help="the widths rows' grid (minmax16: 16-bit scale and bias, as a cache stores them)")
    parser.add_argument("--rows", help="comma-separated rows to run besides fp16 (default: all)")
    parser.add_argument("--out")
    args = parser.parse_args()

    from engine.runtime import prepare_runtime

    prepare_runtime()
    from engine.kvcache import KVCacheBuilder, KVCacheConfig
    from engine.kvcache.evaluate import teacher_forced_token_stats
    from engine.kvcache.quant.rope import model_rope
    from engine.models.catalog import load_model
    from engine.models.default_model import ensure_default_model

    model, tokenizer, _ = load_model(ensure_default_model())
    rope = model_rope(model)
    widths = calibrate(model, tokenizer, rope, str(ROOT / "engine" / "kvcache" / "calibration_prose.txt"),
                       args.calibration_tokens, shared=args.shared)
    wide = ":wide=0.1:wide_layers=L" + ".".join(map(str, WIDE_LAYERS))
    level = KVCacheBuilder(KVCacheConfig.parse(LEVEL + wide)).for_model(model)
    holders = {bits: KVCacheBuilder(KVCacheConfig.parse(LEVEL.replace("k3v3", f"k8v{bits}"))).for_model(model)
               for bits in (3, 4)}

    def experiment(uniform: bool = False, grid: str = "minmax") -> list:
        normal, widened = holders[3].build(), holders[4].build()
        caches = [widened[i] if i in WIDE_LAYERS else normal[i] for i in range(len(normal))]
        for layer, cache in enumerate(caches):
            parent = type(cache)

            class Widths(parent):  # type: ignore[misc, valid-type]
                key_widths = np.full_like(widths[layer], 4 if layer in WIDE_LAYERS else 3) if uniform else widths[layer]

                def _encode(self, keys, values):  # noqa: ANN001, ANN202
                    before = self._rope.rotate(keys, self._n_compressed, inverse=True)
                    coded = fake_quantize(before, self.key_widths, grid)
                    return super()._encode(self._rope.rotate(coded, self._n_compressed).astype(keys.dtype), values)

            cache.__class__ = Widths
        return caches

    factories = {"fp16": KVCacheBuilder(KVCacheConfig.parse("fp16")).for_model(model).build,
                 "level": level.build, "widths": lambda: experiment(grid=args.widths_grid), "control": lambda: experiment(uniform=True)}
    if args.grids:  # what separates the control from the level: the grid, or its 16-bit scale and bias
        factories = {"fp16": factories["fp16"], "control": factories["control"],
                     "control_minmax16": lambda: experiment(uniform=True, grid="minmax16"),
                     "control_mlx": lambda: experiment(uniform=True, grid="mlx")}
    if args.rows:
        factories = {name: make for name, make in factories.items() if name == "fp16" or name in args.rows.split(",")}
    ids = list(tokenizer.encode(Path(args.text).read_text(encoding="utf-8", errors="replace"),
                                add_special_tokens=False))
    per = {name: {"nll": [], "kl": []} for name in factories}
    began = time.time()
    for start in args.start:
        stats = teacher_forced_token_stats(model, ids[start : start + args.tokens], factories, "fp16", 64,
                                           args.tokens // 2)
        for name, s in stats.items():
            per[name]["nll"].append(s.nll)
            per[name]["kl"].append(s.kl)
        print(f"window @{start}: {time.time() - began:.0f} s", flush=True)
    reference = np.concatenate(per["fp16"]["nll"])
    rows = []
    for name in factories:
        delta, se = paired(np.concatenate(per[name]["nll"]), reference)
        rows.append({"cache": name, "delta_nll": delta, "delta_nll_se": se, "ppl_change": math.expm1(delta),
                     "mean_kl": float(np.concatenate(per[name]["kl"]).mean())})
        print(f"{name:8s} Δppl {100 * math.expm1(delta):+.2f}% ±{100 * se:.2f}  KL {rows[-1]['mean_kl']:.4f}")
    share = np.bincount(np.concatenate([w.ravel() for w in widths.values()]), minlength=7)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "schema": "velox-key-bits-experiment/1", "level": LEVEL + wide, "grids": bool(args.grids),
            "shared": bool(args.shared), "widths_grid": args.widths_grid, "text": Path(args.text).name,
            "starts": args.start, "tokens": args.tokens, "widths_count": {str(b): int(c) for b, c in enumerate(share) if c},
            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
