"""How far a cache's peak memory rises above what it holds while a chunked prefill grows its buffers.

    python benchmarks/growth_peak.py --out growth_peak.json [--specs fp16:k16v16:g64,kivi:k4v4:g64:s4:key_block=128]
        [--layers 8] [--tokens 32768] [--chunk 2048]

A growth fills new buffers from the old ones, and until the evaluation that fills them ends the old ones are still
held: the memory planner (engine.planning.recommend) budgets the cache, its room ahead and a chunk's working memory,
but not those old buffers. This feeds `--layers` layers of the 8B attention shape (8 kv heads, head_dim 128,
bfloat16) `--tokens` random tokens in `--chunk`-token chunks, each chunk through every layer in turn and evaluated
once (as a prefill chunk's forward pass is), and records per chunk the cache's bytes (`held`, nbytes), MLX's active
memory before the chunk and its peak during it, all above the memory in use before the first chunk. Runs on any
device; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def chunk_peaks(spec: str, layers: int, tokens: int, chunk: int) -> list[dict[str, Any]]:
    import mlx.core as mx

    from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape

    caches = KVCacheBuilder(KVCacheConfig.parse(spec)).for_shape(
        ModelShape(n_layers=layers, n_heads=32, n_kv_heads=8, head_dim=128)).build()
    mx.synchronize()
    base = mx.get_active_memory()
    rows = []
    for start in range(0, tokens, chunk):
        x = mx.random.normal((1, 8, chunk, 128), key=mx.random.key(start)).astype(mx.bfloat16)
        mx.eval(x)
        before = mx.get_active_memory() - base
        mx.reset_peak_memory()
        outputs = []
        for cache in caches:  # each layer's input is the previous layer's output, as in a forward pass
            cache.update_and_fetch(x, x)
            x = x * 1.0001
            outputs.append(x)
        mx.eval(outputs, [cache._held_arrays() for cache in caches])
        rows.append({"tokens": start + chunk, "held": sum(cache.nbytes for cache in caches),
                     "active_before": before, "peak": mx.get_peak_memory() - base})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--specs", default="fp16:k16v16:g64,kivi:k4v4:g64:s4:key_block=128")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=2048)
    args = parser.parse_args()
    import mlx.core as mx

    record: dict[str, Any] = {"kind": "growth_peak", "device": str(mx.default_device()), "mlx": mx.__version__,
                              "layers": args.layers, "chunk": args.chunk, "runs": {}}
    for spec in [s.strip() for s in args.specs.split(",") if s.strip()]:
        rows = chunk_peaks(spec, args.layers, args.tokens, args.chunk)
        record["runs"][spec] = rows
        worst = max(rows, key=lambda row: row["peak"] - row["held"])
        print(f"{spec}: held {rows[-1]['held'] / 1e6:.0f} MB at {rows[-1]['tokens']} tokens; the worst chunk "
              f"({worst['tokens']} tokens) peaked {(worst['peak'] - worst['held']) / 1e6:.0f} MB above the "
              f"{worst['held'] / 1e6:.0f} MB held", flush=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
