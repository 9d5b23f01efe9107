"""What one operation of a decode step costs the host, on a GPU: recording it and running it.

    python benchmarks/launch_cost.py --out launch_cost.json [--context 8193] [--calls 32] [--repeats 20]

Issue 11: at 8k and 32k tokens the whole-model decode step of the 8B-shaped model is host-bound (the 16-bit
step is several times its memory bound), so what a compressed layer adds on the host decides its speed. For
each operation below, `record_us` is the host time of building it into MLX's graph (no evaluation; median per
call over `calls` calls, `repeats` times), and `eval_us` the time of evaluating `calls` independent copies at
once, per copy (MLX's per-primitive work on the host, the launches and the GPU's own time, pipelined as in a
step). Operations, one layer of the 8B shape (32 query / 8 kv heads, head_dim 128, bfloat16):

- `kernel_trivial`: a custom kernel copying 128 floats (1 input, 1 output, no template): MLX's floor for a
  custom kernel.
- `kernel_trivial_inputs`, `kernel_trivial_templates`, `kernel_trivial_wide`: the same body, called with the
  decode pass's count of inputs (15), of template arguments (15), or both: what the marshalling of a call costs.
- `sdpa_fp16`: `mx.fast.scaled_dot_product_attention` of one query over `context` 16-bit tokens.
- `attention_<spec>`: mlx-lm's `scaled_dot_product_attention` through a filled cache of `spec` (for a
  compressed cache: Velox's decode kernels).
- `update_<spec>`: `update_and_fetch` of one token into that cache.

Nothing is asserted; the figures are for reading beside `decode.py --profile`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPECS = ("fp16", "kivi:k4v4:g64:s4:key_block=128:rotate_values=true")


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def measure(build: Any, calls: int, repeats: int) -> dict[str, float]:
    """Median host time per call of `build()` (recording only), and evaluation time per call of `calls`."""
    import mlx.core as mx

    mx.eval(build())  # compile and warm
    records, evals = [], []
    for _ in range(repeats):
        mx.synchronize()
        began = time.perf_counter()
        outs = [build() for _ in range(calls)]
        recorded = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        done = time.perf_counter()
        records.append((recorded - began) / calls * 1e6)
        evals.append((done - recorded) / calls * 1e6)
    return {"record_us": _median(records), "eval_us": _median(evals)}


def _trivial_kernel(inputs: int, templates: int) -> Any:
    import mlx.core as mx

    from engine.kvcache.kernels.backend import available_backend

    backend = available_backend()
    names = ["inp"] + [f"extra{i}" for i in range(inputs - 1)]
    if backend == "cuda":
        source = "int i = threadIdx.x; out[i] = inp[i];"
        make = mx.fast.cuda_kernel
    else:
        source = "uint i = thread_position_in_grid.x; out[i] = inp[i];"
        make = mx.fast.metal_kernel
    kernel = make(name=f"velox_trivial_{inputs}_{templates}", input_names=names, output_names=["out"],
                  source=source)
    data = mx.zeros((128,), mx.float32)
    extras = [mx.zeros((1,), mx.float32) for _ in range(inputs - 1)]
    template = [(f"T{i}", i) for i in range(templates)] or None

    def build() -> Any:
        kwargs = {"template": template} if template else {}
        return kernel(inputs=[data, *extras], grid=(128, 1, 1), threadgroup=(128, 1, 1),
                      output_shapes=[(128,)], output_dtypes=[mx.float32], **kwargs)[0]

    return build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=8193)
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention

    from benchmarks.decode import SHAPE, fill, make_caches

    rows: list[dict[str, Any]] = []

    def record(name: str, build: Any) -> None:
        row = {"op": name, **measure(build, args.calls, args.repeats)}
        rows.append(row)
        print(f"{name:60s} record {row['record_us']:8.1f} us   eval {row['eval_us']:8.1f} us", flush=True)

    from engine.kvcache.kernels.backend import available_backend

    if available_backend() is not None:  # a GPU backend (no custom kernels on the CPU)
        record("kernel_trivial", _trivial_kernel(1, 0))
        record("kernel_trivial_inputs", _trivial_kernel(15, 0))
        record("kernel_trivial_templates", _trivial_kernel(1, 15))
        record("kernel_trivial_wide", _trivial_kernel(15, 15))
    heads, kv_heads, head_dim = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    queries = mx.random.normal((1, heads, 1, head_dim)).astype(mx.bfloat16)
    history = mx.random.normal((1, kv_heads, args.context, head_dim)).astype(mx.bfloat16)
    mx.eval(queries, history)
    scale = head_dim ** -0.5
    record("sdpa_fp16", lambda: mx.fast.scaled_dot_product_attention(queries, history, history, scale=scale))
    token = mx.random.normal((1, kv_heads, 1, head_dim)).astype(mx.bfloat16)
    mx.eval(token)
    for spec in SPECS:
        (cache,) = make_caches(spec, 1, SHAPE)
        fill([cache], args.context, SHAPE)
        keys, values = cache.update_and_fetch(token, token)
        mx.eval(keys, values) if isinstance(keys, mx.array) else mx.eval(cache.state)
        record(f"attention_{spec}", lambda c=cache, k=keys, v=values: scaled_dot_product_attention(
            queries, k, v, cache=c, scale=scale, mask=None))

        def update(c: Any = cache) -> Any:
            # The cache grows by one token per call, as in decoding (a block is quantized every key_block calls).
            k, v = c.update_and_fetch(token, token)
            return [k, v] if isinstance(k, mx.array) else c.state

        record(f"update_{spec}", update)
    payload = {"schema": "velox-launch-cost/1", "context": args.context, "calls": args.calls,
               "repeats": args.repeats, "mlx": mx.__version__, "device": str(mx.default_device()), "rows": rows}
    Path(args.out).write_text(json.dumps(payload, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
