"""Attention only of a synthetic Llama-3.1-8B-shaped decode step on a GPU (MLX CUDA or Metal), with its bound.

    python -m benchmarks.harness.gpu --out gpu.json [--contexts 4096,8192,...] [--specs fp16,affine:k4v4:g64,...]

One decode step is the attention of one new token in each of 32 layers (32 query heads grouped onto 8 kv
heads of head_dim 128, bf16) over that layer's cache of N tokens; the 32 layers' caches are distinct, so a
step reads every cached byte once, as a real step would (32 layers also keep the working set far above the
GPU's L2 cache). Keys, values and queries are random: speed does not depend on their values. Projections,
MLP and sampling are left out, so these are attention-only times, not decode speeds (benchmarks/decode.py
times the whole model).

Beside each time is its physical bound: the bytes the caches hold (every array of the 32 layers) divided by
the device's read bandwidth, measured here with a large reduction; `bound / measured` is the fraction of
the memory system's speed the attention path reaches. Velox caches attend through `cache.attention`, the
same call the attention hook makes inside a model; mlx-lm's caches through mlx-lm's own attention functions.
Every failure (e.g. a quantized_matmul shape without a CUDA kernel) is recorded with its message.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.harness.common import prompt_spans

DEFAULT_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
DEFAULT_SPECS = (
    "fp16", "mlx-kv", "mlx-q:k8v8", "mlx-q:k4v4", "affine:k8v8:g64", "affine:k4v4:g64", "rotated:k4v4:g64",
    "rotated:k3v3:g32", "kivi:k4v4:g32", "turboquant:k4v4", "turboquant:k3v3", "rvq:k3v3",
)
N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 32, 8, 128
FILL_CHUNK = 16384


def read_bandwidth(n_bytes: int = 4 << 30, repeats: int = 10) -> dict[str, float]:
    """Bytes/s of a large reduction (reads every byte once) and of a copy (reads and writes), best of runs."""
    data = mx.random.uniform(shape=(n_bytes // 4,), dtype=mx.float32)
    mx.eval(data)
    reads, copies = [], []
    for _ in range(repeats):
        mx.synchronize()
        began = time.perf_counter()
        mx.eval(mx.sum(data))
        mx.synchronize()
        reads.append(n_bytes / (time.perf_counter() - began))
        began = time.perf_counter()
        copy = data * 1.0
        mx.eval(copy)
        mx.synchronize()
        copies.append(2 * n_bytes / (time.perf_counter() - began))
        del copy
    del data
    return {"read_bytes_per_second": max(reads), "copy_bytes_per_second": max(copies), "bytes": n_bytes}


def _attend(spec: Any, cache: Any, fetched: Any, queries: mx.array, scale: float) -> mx.array:
    if spec.family == "velox" and spec.method not in ("fp16", "fp32"):
        return cache.attention(queries, None, None, scale=scale, mask=None)
    if spec.family == "mlx-lm" and spec.method == "quantized":
        from mlx_lm.models.base import quantized_scaled_dot_product_attention

        keys, values = fetched
        return quantized_scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=None, group_size=cache.group_size, bits=cache.bits
        )
    keys, values = fetched
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=None)


def time_spec(spec: Any, source_keys: mx.array, source_values: mx.array, context: int, steps: int,
              warmup: int) -> dict[str, Any]:
    """Median ms of one 32-layer attention decode step over caches holding `context` tokens."""
    from engine.planning.memory import array_bytes

    caches = spec.factory_for_shape(N_LAYERS, HEAD_DIM)()
    fetched = [None] * N_LAYERS
    for start, end in prompt_spans(0, context, FILL_CHUNK):  # the bytes held then are what a decoding cache holds
        for index, cache in enumerate(caches):
            fetched[index] = cache.update_and_fetch(source_keys[..., start:end, :], source_values[..., start:end, :])
        mx.eval([getattr(cache, "state", cache) for cache in caches])
    if spec.family != "velox" or spec.method in ("fp16", "fp32"):
        mx.eval(fetched)  # the views attention reads (dense or quantized tuples)
    else:
        fetched = [None] * N_LAYERS  # compressed caches attend over their own storage
    held = array_bytes(caches)
    queries = [mx.random.normal((1, N_HEADS, 1, HEAD_DIM)).astype(source_keys.dtype) for _ in range(N_LAYERS)]
    mx.eval(queries)
    scale = HEAD_DIM**-0.5
    times = []
    for step in range(warmup + steps):
        mx.synchronize()
        began = time.perf_counter()
        outputs = [_attend(spec, c, f, q, scale) for c, f, q in zip(caches, fetched, queries, strict=True)]
        mx.eval(outputs)
        mx.synchronize()
        if step >= warmup:
            times.append((time.perf_counter() - began) * 1000)
    times.sort()
    del caches, fetched, outputs
    gc.collect()
    mx.clear_cache()
    return {"ms_median": times[len(times) // 2], "ms_min": times[0], "ms_max": times[-1], "held_bytes": held}


def probe_shapes(out_path: Path, context: int = 512) -> list[dict[str, Any]]:
    """Which quantized attention shapes run at all: mlx-lm's QuantizedKVCache (update + its quantized SDPA)
    and Velox's fused `affine`/`kivi` attention, over dtypes, query lengths, bits, group sizes and head_dims.
    Each combination is tried once on `context` random tokens; failures keep their first message line.
    Rows are written to `out_path` as they come: on the H200 a first 540-combination probe did not finish within
    300 s (each new shape compiles kernels), so a cut-off run still leaves what it tried."""
    from benchmarks.harness.specs import parse_spec

    rows: list[dict[str, Any]] = []
    for dtype_name in ("float16", "bfloat16", "float32"):
        dtype = getattr(mx, dtype_name)
        for head_dim in (64, 128):
            keys = mx.random.normal((1, 2, context, head_dim)).astype(dtype)
            values = mx.random.normal((1, 2, context, head_dim)).astype(dtype)
            for bits in (2, 3, 4, 8):
                for group in (g for g in (32, 64, 128) if head_dim % g == 0):
                    for n_queries in (1, 4, 64):
                        queries = mx.random.normal((1, 8, n_queries, head_dim)).astype(dtype)
                        for text in (f"mlx-q:k{bits}v{bits}:g{group}", f"affine:k{bits}v{bits}:g{group}",
                                     f"kivi:k{bits}v{bits}:g{group}"):
                            row = {"spec": text, "dtype": dtype_name, "head_dim": head_dim, "queries": n_queries}
                            try:
                                spec = parse_spec(text)
                                cache = spec.factory_for_shape(1, head_dim)()[0]
                                fetched = cache.update_and_fetch(keys, values)
                                mask = "causal" if n_queries > 1 else None
                                if spec.family == "velox":
                                    out = cache.attention(queries, None, None, scale=head_dim**-0.5, mask=mask)
                                else:
                                    from mlx_lm.models.base import quantized_scaled_dot_product_attention

                                    out = quantized_scaled_dot_product_attention(
                                        queries, *fetched, scale=head_dim**-0.5, mask=mask, group_size=group, bits=bits
                                    )
                                mx.eval(out)
                                row["ok"] = bool(mx.all(mx.isfinite(out)).item())
                            except Exception as error:  # the point is to record it
                                message = str(error).strip().splitlines()
                                row["ok"] = False
                                row["error"] = f"{type(error).__name__}: {message[0][:200] if message else ''}"
                            rows.append(row)
                            out_path.write_text(json.dumps({"kind": "gpu-probe", "device": str(mx.default_device()),
                                                       "mlx": mx.__version__, "rows": rows}) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default=",".join(str(c) for c in DEFAULT_CONTEXTS))
    parser.add_argument("--specs", default=",".join(DEFAULT_SPECS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--probe", action="store_true", help="only try which quantized attention shapes run")
    args = parser.parse_args(argv)
    if args.probe:
        rows = probe_shapes(Path(args.out))
        failed = [r for r in rows if not r["ok"]]
        for row in failed:
            print(f"FAILED {row}", flush=True)
        print(f"{len(rows) - len(failed)} of {len(rows)} shapes ran", flush=True)
        return 0

    from benchmarks.harness.specs import parse_specs

    contexts = [int(c) for c in args.contexts.split(",")]
    specs = parse_specs(args.specs)
    record: dict[str, Any] = {
        "schema": "velox-bench/1", "kind": "gpu", "device": str(mx.default_device()),
        "mlx": mx.__version__, "platform": f"{platform.system()} {platform.machine()}",
        "shape": {"layers": N_LAYERS, "heads": N_HEADS, "kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "contexts": contexts, "steps": args.steps, "warmup": args.warmup,
    }
    try:
        import subprocess

        record["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as error:  # not an NVIDIA machine, or no nvidia-smi
        record["gpu"] = f"unknown ({type(error).__name__})"
    record["bandwidth"] = read_bandwidth()
    read_bw = record["bandwidth"]["read_bytes_per_second"]
    print(f"read bandwidth {read_bw / 1e12:.2f} TB/s, copy {record['bandwidth']['copy_bytes_per_second'] / 1e12:.2f} TB/s",
          flush=True)
    mx.random.seed(0)
    max_context = max(contexts)
    source_keys = mx.random.normal((1, N_KV_HEADS, max_context, HEAD_DIM)).astype(mx.bfloat16)
    source_values = mx.random.normal((1, N_KV_HEADS, max_context, HEAD_DIM)).astype(mx.bfloat16)
    mx.eval(source_keys, source_values)
    rows = []
    for spec in specs:
        for context in contexts:
            row: dict[str, Any] = {"spec": spec.text, "label": spec.label, "context": context}
            try:
                row |= time_spec(spec, source_keys, source_values, context, args.steps, args.warmup)
                row["bound_ms"] = row["held_bytes"] / read_bw * 1000
                row["fraction_of_bound"] = row["bound_ms"] / row["ms_median"]
                print(f"{spec.text:14s} {context:7d}: {row['ms_median']:8.3f} ms (bound {row['bound_ms']:.3f} ms, "
                      f"{row['held_bytes'] / 1e9:.3f} GB)", flush=True)
            except Exception as error:  # record what fails (e.g. no CUDA kernel for a quantized_matmul shape)
                row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"
                print(f"{spec.text:14s} {context:7d}: FAILED {row['error']}", flush=True)
                gc.collect()
                mx.clear_cache()
            rows.append(row)
            Path(args.out).write_text(json.dumps({**record, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
