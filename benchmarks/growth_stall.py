"""What a cache's growth costs a decode step: new buffers for the whole history, as every 256 tokens.

    python benchmarks/growth_stall.py --out growth_stall.json [--context 32768] [--growths 4]

decode.py's per-token record of mlx-lm's loop (`gen_stall_offsets`) put one stall of 50-200 ms in every 128-step
window that crosses a multiple of 256 tokens, for Velox's 16-bit cache and every level alike (and mlx-lm's KVCache in
a longer run): that is where a cache's buffers grow (mlx-lm's KVCache concatenates 256 more slots; a compressed store copies into buffers
256 slots longer). This times the parts of one growth of 32 layers' arrays (the 8B shape: 8 kv heads, head_dim
128, keys and values in bfloat16, so 64 arrays), each evaluated alone and synchronized:

- `concat`: mlx-lm's growth, `concatenate([history, zeros(step)])` per array.
- `zeros_then_copy`: the compressed store's growth (`_grow_to`): zeros of the new length, the history copied in.
- `alloc_only`: zeros of the new length, nothing copied: what the allocation and fill cost.
- `copy_only`: the history copied into buffers already held (no allocation): the bandwidth's part.

Each variant runs `growths` times in a row from `context` tokens (each growth `step` slots longer than the last);
`step` 256 (as shipped) and 4,096 show whether a growth costs by its count or by its size. Memory counters from
MLX (active, cache, peak) are recorded after each variant. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128


def grow(name: str, arrays: list[Any], length: int, step: int, held: list[Any] | None) -> list[Any]:
    """One growth of every array by `step` slots, as variant `name` does it (unevaluated)."""
    import mlx.core as mx

    new_shape = (1, KV_HEADS, length + step, HEAD_DIM)
    if name == "concat":
        return [mx.concatenate([a, mx.zeros((1, KV_HEADS, step, HEAD_DIM), a.dtype)], axis=2) for a in arrays]
    if name == "alloc_only":
        return [mx.zeros(new_shape, a.dtype) for a in arrays]
    out = held if name == "copy_only" else [mx.zeros(new_shape, a.dtype) for a in arrays]
    for b, a in zip(out, arrays, strict=True):
        b[..., :length, :] = a
    return out


def run_variant(name: str, context: int, step: int, growths: int) -> dict[str, Any]:
    """ms of each of `growths` growths of LAYERS x 2 arrays of `context` tokens by `step` slots."""
    import mlx.core as mx

    shape = (1, KV_HEADS, context, HEAD_DIM)
    arrays = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(2 * LAYERS)]
    mx.eval(arrays)
    times = []
    length = context
    for _ in range(growths):
        held = None
        if name == "copy_only":  # buffers of the grown length, allocated and filled before the clock starts
            held = [mx.zeros((1, KV_HEADS, length + step, HEAD_DIM), mx.bfloat16) for _ in arrays]
            mx.eval(held)
        mx.synchronize()
        began = time.perf_counter()
        out = grow(name, arrays, length, step, held)
        mx.eval(out)
        mx.synchronize()
        times.append((time.perf_counter() - began) * 1000)
        if name != "alloc_only":
            arrays = out
        length += step
        del out, held
    return {"variant": name, "context": context, "step": step, "growth_ms": times,
            "history_bytes": 2 * LAYERS * KV_HEADS * context * HEAD_DIM * 2,
            "active_gb": mx.get_active_memory() / 1e9, "cache_gb": mx.get_cache_memory() / 1e9,
            "peak_gb": mx.get_peak_memory() / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contexts", default="32768")
    parser.add_argument("--steps", default="256,4096")
    parser.add_argument("--growths", type=int, default=4)
    args = parser.parse_args()
    import mlx.core as mx

    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for step in (int(s) for s in args.steps.split(",")):
            for name in ("concat", "zeros_then_copy", "alloc_only", "copy_only"):
                row = run_variant(name, context, step, args.growths)
                rows.append(row)
                print(f"{name:16s} {context:7d} +{step:5d}: " + ", ".join(f"{t:.1f}" for t in row["growth_ms"])
                      + f" ms; active {row['active_gb']:.1f} GB, cache {row['cache_gb']:.1f} GB", flush=True)
                mx.clear_cache()
    args.out.write_text(json.dumps({"kind": "growth_stall", "device": str(mx.default_device()),
                                    "mlx": mx.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
