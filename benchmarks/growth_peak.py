"""How far a cache's peak memory rises above what it holds while a chunked prefill, then decoding, copies its buffers.

    python benchmarks/growth_peak.py --out growth_peak.json [--specs fp16:k16v16:g64,kivi:k4v4:g64:s4:key_block=128]
        [--layers 8] [--tokens 32768] [--chunk 2048] [--decode-steps 4]

A growth fills new buffers from the old ones (a decode step's first also copies a compressed store out of the room a
prefill grew ahead); the old ones are held until the copy is evaluated. This feeds `--layers` layers of the 8B
attention shape (8 kv heads, head_dim 128, bfloat16) `--tokens` random tokens in `--chunk`-token chunks, each chunk
through every layer in turn and evaluated once (as a prefill chunk's forward pass is), then `--decode-steps` single
tokens the same way, and records per chunk or step the cache's bytes (`held`, nbytes), MLX's active memory before it
and its peak during it, all above the memory in use before the first chunk; it prints, per spec, the chunk and the
decode step whose peak rose most above the bytes held before or after it. A spec's `#COPY_BUFFERS_NOW=false` leaves
the copies to the forward pass's evaluation, as before engine.kvcache.base.COPY_BUFFERS_NOW. Runs on any device;
nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode import spec_constants  # noqa: E402


def chunk_peaks(spec: str, layers: int, tokens: int, chunk: int, decode_steps: int = 0) -> list[dict[str, Any]]:
    import mlx.core as mx

    from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape

    with spec_constants(spec) as text:
        caches = KVCacheBuilder(KVCacheConfig.parse(text)).for_shape(
            ModelShape(n_layers=layers, n_heads=32, n_kv_heads=8, head_dim=128)).build()
        mx.synchronize()
        base = mx.get_active_memory()
        rows = []
        sizes = [("prefill", min(chunk, tokens - start)) for start in range(0, tokens, chunk)]
        for kind, size in sizes + [("decode", 1)] * decode_steps:
            x = mx.random.normal((1, 8, size, 128), key=mx.random.key(len(rows))).astype(mx.bfloat16)
            mx.eval(x)
            before = mx.get_active_memory() - base
            mx.reset_peak_memory()
            outputs = []
            for cache in caches:  # each layer's input is the previous layer's output, as in a forward pass
                cache.update_and_fetch(x, x)
                x = x * 1.0001
                outputs.append(x)
            mx.eval(outputs, [cache._held_arrays() for cache in caches])
            rows.append({"kind": kind, "tokens": caches[0].offset, "held": sum(cache.nbytes for cache in caches),
                         "active_before": before, "peak": mx.get_peak_memory() - base})
    return rows


def worst_excess(rows: list[dict[str, Any]], kind: str) -> tuple[int, int, int]:
    """(bytes held, the peak's excess over them, tokens) of the `kind` row whose peak rose most above the bytes the
    caches held before or after it (the larger: a step that gives room back holds less after it)."""
    worst = (0, 0, 0)
    for previous, row in zip([None, *rows[:-1]], rows, strict=True):
        if row["kind"] == kind:
            top = max(row["held"], previous["held"] if previous else 0)
            if not worst[2] or row["peak"] - top > worst[1]:
                worst = (top, row["peak"] - top, row["tokens"])
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--specs", default="fp16:k16v16:g64,kivi:k4v4:g64:s4:key_block=128")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=4)
    args = parser.parse_args()
    import mlx.core as mx

    record: dict[str, Any] = {"kind": "growth_peak", "device": str(mx.default_device()), "mlx": mx.__version__,
                              "layers": args.layers, "chunk": args.chunk, "runs": {}}
    for spec in [s.strip() for s in args.specs.split(",") if s.strip()]:
        rows = chunk_peaks(spec, args.layers, args.tokens, args.chunk, args.decode_steps)
        record["runs"][spec] = rows
        for kind in ("prefill", "decode"):
            top, excess, tokens = worst_excess(rows, kind)
            if tokens:
                print(f"{spec}: the worst {'chunk' if kind == 'prefill' else 'decode step'} ({tokens} tokens) peaked "
                      f"{excess / 1e6:.0f} MB above the {top / 1e6:.0f} MB held", flush=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
