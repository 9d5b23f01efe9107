"""Where a prefill chunk's time goes over compressed history, for one layer of the 8B shape (8 kv heads, head_dim
128, 16,384 compressed tokens): the history decode (`_dense_history`: the kernel where one decodes the method, else
MLX's operations), MLX's decode (`_decode`) and, for sketched keys, its parts (the sign bits' unpacking, the ±1
array, the Sᵀ·sign matmul in three dtypes), the encode of a 2,048-token chunk (`_encode`), then a 2,048-token chunk's
attention through the cache. A spec may carry kernel constants (`SPEC#NAME=VALUE`, as benchmarks/decode.py). Prints one row
per method and writes them with --out. Meant for a GPU (the H200 run: benchmarks/results/history-decode-profile-h200.json).

    python benchmarks/history_decode_profile.py [--out profile.json] [--specs turboquant_prod:k4v4:g64,...]
        [--tokens 16384] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode import spec_constants, split_spec  # noqa: E402
from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape  # noqa: E402
from engine.kvcache.kernels import available_backend, dequantize  # noqa: E402
from engine.kvcache.quant.bitpack import unpack_bits  # noqa: E402
from engine.kvcache.quant.sketch import signs_as_pm_one  # noqa: E402

SPECS = "turboquant_prod:k4v4:g64,qjl:k4v4:g64,polarquant:k4v4:g64,turboquant:k4v4:g64"


def timed(fn: Callable[[], object], repeats: int = 10) -> float:
    """Mean ms of `fn` evaluated, after one warm-up evaluation."""
    mx.eval(fn())
    mx.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - began) / repeats * 1e3


def profile(spec: str, tokens: int = 16384, chunk_queries: int = 2048) -> dict:
    """One row; `spec` may carry kernel constants (`SPEC#NAME=VALUE`, as benchmarks/decode.py), set while it runs."""
    with spec_constants(spec) as text:
        row = _profile(text, tokens, chunk_queries)
    _, constants = split_spec(spec)
    return row | ({"kernel_constants": constants} if constants else {})


def _profile(spec: str, tokens: int, chunk_queries: int) -> dict:
    cache = KVCacheBuilder(KVCacheConfig.parse(spec)).for_shape(ModelShape(1, 32, 8, 128)).build()[0]
    rng = np.random.default_rng(0)
    for start in range(0, tokens, 4096):
        size = min(4096, tokens - start)
        chunk = mx.array(rng.standard_normal((1, 8, size, 128)).astype(np.float32)).astype(mx.bfloat16)
        cache.update_and_fetch(chunk, chunk)
    store = cache._compressed_view()
    mx.eval(list(store.values()))
    row: dict = {"spec": spec, "tokens": cache.n_compressed}
    row["dense_history_ms"] = timed(lambda: cache._dense_history(store, mx.bfloat16))
    row["decode_ms"] = timed(lambda: cache._decode(store))
    if "key_residual_signs" in store or spec.startswith("qjl"):
        name = "key_residual_signs" if "key_residual_signs" in store else "key_codes"
        sketch = cache._sketch
        m = sketch.shape[0]
        row["signs_pm_one_ms"] = timed(lambda: signs_as_pm_one(store[name], m))  # unpacking included
        signs = signs_as_pm_one(store[name], m)
        signs16 = unpack_bits(store[name], 1, m).astype(mx.float16) * 2 - 1
        mx.eval(signs, signs16)
        row["sketch_matmul_f32_ms"] = timed(lambda: signs @ sketch.astype(mx.float32))
        row["sketch_matmul_bf16_ms"] = timed(lambda: signs.astype(mx.bfloat16) @ sketch.astype(mx.bfloat16))
        row["pm_f16_ms"] = timed(lambda: unpack_bits(store[name], 1, m).astype(mx.float16) * 2 - 1)
        row["sketch_matmul_f16_ms"] = timed(lambda: signs16 @ sketch)
        row["unpack_u8_ms"] = timed(lambda: unpack_bits(store[name], 1, m))
        backend = available_backend()
        if backend is not None:  # the kernel path's parts: the ±1 rows, then with the Sᵀ·sign matmul (and its blocks)
            count = min(dequantize.SKETCH_HISTORY_BLOCK, cache.n_compressed)
            row["sign_rows_block_ms"] = timed(lambda: dequantize.sign_rows(store[name], count, m, backend))
            row["sign_rows_block_tokens"] = count
            row["projection_ms"] = timed(
                lambda: dequantize._sketch_projection(store[name], sketch, cache.n_compressed, backend))
    if hasattr(cache, "_decode_unit"):
        row["decode_unit_key_ms"] = timed(lambda: cache._decode_unit(store, "key"))
        row["decode_unit_value_ms"] = timed(lambda: cache._decode_unit(store, "value"))
    new_tokens = mx.array(rng.standard_normal((1, 8, chunk_queries, 128)).astype(np.float32)).astype(mx.bfloat16)
    row[f"encode_chunk{chunk_queries}_ms"] = timed(lambda: list(cache._encode(new_tokens, new_tokens).values()))
    queries = mx.array(rng.standard_normal((1, 32, chunk_queries, 128)).astype(np.float32)).astype(mx.bfloat16)
    row[f"attention_chunk{chunk_queries}_ms"] = timed(
        lambda: cache.attention(queries, None, None, scale=128**-0.5, mask=None), repeats=5)
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--specs", default=SPECS)
    parser.add_argument("--tokens", type=int, default=16384, help="compressed tokens (the H200 run: 16,384)")
    parser.add_argument("--chunk", type=int, default=2048, help="queries of the timed prefill chunk")
    args = parser.parse_args()
    rows = []
    for spec in args.specs.split(","):
        rows.append(profile(spec, args.tokens, args.chunk))
        print(rows[-1], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"schema": "velox-history-profile/1", "device": str(mx.default_device()),
                                              "mlx": mx.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
