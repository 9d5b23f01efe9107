"""Where a GPU decode step's cache time goes: each part over all 32 layers of the 8B shape, in one evaluation.

    python benchmarks/decode_profile.py --out profile.json [--contexts 8193,32769] \\
        [--specs fp16,kivi:k4v4:g64:s4:key_block=128:rotate_values=true] [--sweep] [--repeats 10]

For each cache spec (decode.py's spec syntax) and context, 32 per-layer caches (one per layer, as the model
holds them, so no layer's history sits in the GPU's L2 cache for the next) are filled with random tokens and
these are timed, each as the median over `--repeats` evaluations of all 32 layers at once (launches
pipelined, as in a model step; ms for the 32 layers):

    update     `update_and_fetch` of one token
    attention  mlx-lm's `scaled_dot_product_attention` over the cache (what a model layer calls)
    both       update then attention, per layer
    kernel     Velox caches with a decode kernel: the attention and merge launches alone
               (`decode_attention` with the cache's plan: no query or output transforms; sketched keys' S·q included)

`--sweep` also times `kernel` for the kernel's launch constants (the tiled or per-subgroup pass for KIVI, tokens in
flight per subgroup, threads per threadgroup, target threadgroups, minimum tokens per split), to choose them from
measurements.
A GPU tool: on a CPU it runs (`--shape tiny`) but its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.common import median_ms  # noqa: E402

SWEEP = (
    {"TILED": False}, {"TILED": False, "TARGET_GROUPS": 256},
    {"TILED_TARGET_GROUPS": 128}, {"TILED_TARGET_GROUPS": 512}, {"TILED_TARGET_GROUPS": 1024},
    {"UNROLL": 1}, {"UNROLL": 4}, {"THREADS": 256}, {"THREADS": 256, "UNROLL": 1},
    {"TARGET_GROUPS": 256}, {"TARGET_GROUPS": 512}, {"TARGET_GROUPS": 2048}, {"TARGET_GROUPS": 4096},
    {"MIN_SPLIT_TOKENS": 64}, {"MIN_SPLIT_TOKENS": 256}, {"MIN_SPLIT_TOKENS": 512},
)


def profile(spec: str, context: int, shape: dict[str, Any], repeats: int, sweep: bool,
            variants: tuple[dict[str, Any], ...] = SWEEP) -> list[dict[str, Any]]:
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention

    from benchmarks.decode import fill, make_caches
    from engine.kvcache.kernels import decode as decode_kernels

    n_layers = shape["layers"]
    caches = make_caches(spec, n_layers, shape)
    fill(caches, context, shape)
    q_shape = (1, shape["heads"], 1, shape["head_dim"])
    kv_shape = (1, shape["kv_heads"], 1, shape["head_dim"])
    queries = [mx.random.normal(q_shape).astype(mx.bfloat16) for _ in range(n_layers)]
    keys = mx.random.normal(kv_shape).astype(mx.bfloat16)
    values = mx.random.normal(kv_shape).astype(mx.bfloat16)
    mx.eval(queries, keys, values)
    scale = shape["head_dim"] ** -0.5
    fetched = [cache.update_and_fetch(keys, values) for cache in caches]
    mx.eval([c.state for c in caches])

    def update() -> Any:
        return [c.state for c in caches if c.update_and_fetch(keys, values) is not None]

    def attention() -> Any:
        return [scaled_dot_product_attention(q, k, v, cache=c, scale=scale, mask=None)
                for q, (k, v), c in zip(queries, fetched, caches, strict=True)]

    def both() -> Any:
        outs = []
        for q, c in zip(queries, caches, strict=True):
            k, v = c.update_and_fetch(keys, values)
            outs.append(scaled_dot_product_attention(q, k, v, cache=c, scale=scale, mask=None))
        return outs

    row: dict[str, Any] = {"spec": spec, "context": context}
    row["attention"] = median_ms(attention, repeats, warmup=2)
    row["update"] = median_ms(update, repeats, warmup=2)
    row["both"] = median_ms(both, repeats, warmup=2)
    rows = [row]
    plans = [c._decode_plan(shape["heads"] // shape["kv_heads"]) if hasattr(c, "_decode_plan") else None
             for c in caches]
    if all(p is not None for p in plans):

        def kernel() -> Any:
            outs = []
            for q, c in zip(queries, caches, strict=True):
                plan = c._decode_plan(shape["heads"] // shape["kv_heads"])
                outs.append(decode_kernels.decode_attention(
                    plan, q, c._n_kv_heads, scale,
                    (c._sink_keys, c._sink_values) if c.n_sink else None,
                    (c._window_keys, c._window_values) if c.n_window else None,
                    c._n_compressed, c.n_duplicated,
                    sketched=c._sketched_queries(q) if plan.sketch else None))  # sketched keys' second query
            return outs

        row["kernel"] = median_ms(kernel, repeats, warmup=2)
        row["splits"] = decode_kernels.split_count(caches[0]._n_compressed, shape["kv_heads"], plans[0].tile,
                                                   plans[0].target_groups)
        if sweep:
            defaults = {name: getattr(decode_kernels, name) for name in (
                "TILED", "TILED_TARGET_GROUPS", "UNROLL", "THREADS", "TARGET_GROUPS", "MIN_SPLIT_TOKENS",
                "TILED_PREFETCH", "TILED_MAX_TILE", "TILED_SHARED_LIMIT")}
            for variant in variants:
                for name, value in {**defaults, **variant}.items():
                    setattr(decode_kernels, name, value)
                for c in caches:
                    c._plan_cache = None
                try:
                    ms = median_ms(kernel, repeats, warmup=2)
                    rows.append({"spec": spec, "context": context, "variant": variant, "kernel": ms})
                except Exception as error:  # noqa: BLE001 - a variant the layout refuses is recorded
                    rows.append({"spec": spec, "context": context, "variant": variant, "error": str(error)[:200]})
                print(rows[-1], flush=True)
            for name, value in defaults.items():
                setattr(decode_kernels, name, value)
            for c in caches:
                c._plan_cache = None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="8193,32769")
    parser.add_argument("--specs", default="fp16,kivi:k4v4:g64:s4:key_block=128:rotate_values=true",
                        help="cache specs in decode.py's syntax, kernel variants (SPEC#NAME=VALUE) included")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--variants", help="the sweep's variants as a JSON list of {constant: value} (default: SWEEP)")
    parser.add_argument("--shape", default="8b", choices=("8b", "tiny"))
    args = parser.parse_args()

    from engine.runtime import prepare_runtime

    prepare_runtime()
    import mlx.core as mx

    from benchmarks.decode import SHAPES, constants_entry, spec_constants

    shape = SHAPES[args.shape]
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for spec in args.specs.split(","):
            variants = tuple(json.loads(args.variants)) if args.variants else SWEEP
            with spec_constants(spec) as text:  # a `SPEC#NAME=VALUE` variant: its constants set while it runs
                profiled = profile(text, context, shape, args.repeats, args.sweep, variants)
            for row in profiled:
                row.update(constants_entry(spec))
                if "variant" not in row:
                    print(json.dumps(row), flush=True)
                rows.append(row)
            gc.collect()  # the caches of the last profile are unreachable now
            mx.clear_cache()
    result = {"schema": "velox-bench/1", "kind": "decode-profile", "device": str(mx.default_device()),
              "mlx": mx.__version__, "shape": shape, "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
