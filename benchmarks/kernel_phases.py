"""Where the tiled decode kernel's time goes on a GPU: the same launches with parts of the body cut out.

    python benchmarks/kernel_phases.py --out phases.json [--contexts 8193,32769,131073] \\
        [--spec kivi:k4v4:g64:s4:key_block=128:rotate_values=true] [--repeats 10]

For one cache spec and each context, 32 per-layer caches (as a model holds them) are filled with random tokens,
then `decode_attention` of all 32 layers is timed in one evaluation (median ms of `--repeats`), for the kernel
as it is and for variants of its body with one part removed by text substitution (the results are wrong; only
their time matters):

    full        the kernel as shipped
    no_stage    the tile neither loaded nor staged (the phases read stale shared memory)
    no_scores   phase 1 (key codes x query) skipped
    no_softmax  phase 2 skipped
    no_values   phase 3 (weights x value codes) skipped
    empty       every tile skipped (launch, query staging, output write and merge only)

and `read`: one `mx.sum` over each layer's compressed arrays (the bytes the kernel must read, at MLX's
reduction speed), `host`: the host time to record and launch the 32 layers' kernels (`mx.async_eval` returning)
against `wall` for the whole evaluation. A GPU tool: on a CPU it needs `--backend emulate` and means nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_SPEC = "kivi:k4v4:g64:s4:key_block=128:rotate_values=true"

# (name, [(text in _TILED_BODY, replacement)]): each text must occur exactly once.
VARIANTS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("full", ()),
    ("no_stage", (
        ("if (PF && comp_tiles > 0) STAGE_LOAD(c_begin);", ""),
        ("if (!PF) STAGE_LOAD(base);\n      STAGE_STORE();\n      if (PF && tile + 1 < comp_tiles) STAGE_LOAD(base + CT);",
         ""),
    )),
    # Every form of phase 1 (keys before RoPE, key widths, plain) skipped: the chain's first test always holds.
    ("no_scores", (
        ("      if (ROPE) {\n        // Keys stored before RoPE", "      if (true) {} else if (ROPE) {\n        // Keys stored before RoPE"),
    )),
    ("no_softmax", (("for (int r = wid; r < R; r += NW) {", "for (int r = wid; r < 0; r += NW) {"),)),
    ("no_values", (("if (!dense) {\n      const int vbit", "if (false) {\n      const int vbit"),)),
    ("empty", (("for (int tile = 0; tile < all_tiles; ++tile) {", "for (int tile = 0; tile < 0; ++tile) {"),)),
)


def variant_body(body: str, cuts: tuple[tuple[str, str], ...]) -> str:
    for text, replacement in cuts:
        if body.count(text) != 1:
            raise ValueError(f"variant text occurs {body.count(text)} times: {text[:60]!r}")
        body = body.replace(text, replacement)
    return body


def _median(run: Any, repeats: int) -> tuple[float, float]:
    """(median wall ms, median host ms until async_eval returns) of evaluating `run()`."""
    import mlx.core as mx

    walls, hosts = [], []
    for i in range(repeats + 2):
        mx.synchronize()
        began = time.perf_counter()
        outs = run()
        mx.async_eval(outs)
        launched = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        if i >= 2:
            walls.append(time.perf_counter() - began)
            hosts.append(launched - began)
    return sorted(walls)[len(walls) // 2] * 1000, sorted(hosts)[len(hosts) // 2] * 1000


def measure(spec: str, context: int, shape: dict[str, Any], repeats: int, backend: str) -> list[dict[str, Any]]:
    import mlx.core as mx

    from benchmarks.decode import fill, make_caches
    from engine.kvcache.kernels import decode as dk
    from engine.kvcache.kernels.backend import kernel

    n_layers = shape["layers"]
    caches = make_caches(spec, n_layers, shape)
    fill(caches, context, shape)
    rows_per_kv = shape["heads"] // shape["kv_heads"]
    q_shape = (1, shape["heads"], 1, shape["head_dim"])
    queries = [mx.random.normal(q_shape).astype(mx.bfloat16) for _ in range(n_layers)]
    mx.eval(queries)
    scale = shape["head_dim"] ** -0.5
    plans = [c._decode_plan(rows_per_kv) for c in caches]
    if any(p is None for p in plans):
        raise SystemExit(f"{spec}: no decode kernel on this device")
    results: list[dict[str, Any]] = []
    for name, cuts in VARIANTS:
        # each plan's own source (its constants and defines kept: the wide layers' differ), with the cuts
        variant_plans = [dataclasses.replace(p, attend=kernel(dataclasses.replace(
            p.source, name=f"{p.source.name}_{name}", body=variant_body(p.source.body, cuts)), backend)) for p in plans]

        def run(variant_plans: list[Any] = variant_plans) -> list[Any]:
            return [
                dk.decode_attention(
                    p, q, c._n_kv_heads, scale,
                    (c._sink_keys, c._sink_values) if c.n_sink else None,
                    (c._window_keys, c._window_values) if c.n_window else None,
                    c._n_compressed, c.n_duplicated,
                )
                for p, q, c in zip(variant_plans, queries, caches, strict=True)
            ]

        wall, host = _median(run, repeats)
        results.append({"spec": spec, "context": context, "variant": name, "wall": wall, "host": host})
        print(json.dumps(results[-1]), flush=True)
    held = [list(p.arrays[:6]) for p in plans]
    read_bytes = sum(a.nbytes for arrays in held for a in arrays)
    wall, host = _median(lambda: [mx.sum(a.view(mx.uint8).astype(mx.uint32)) for arrays in held for a in arrays], repeats)
    results.append({"spec": spec, "context": context, "variant": "read", "wall": wall, "host": host,
                    "bytes": read_bytes, "splits": dk.split_count(caches[0]._n_compressed, shape["kv_heads"],
                                                                   plans[0].tile, plans[0].target_groups)})
    print(json.dumps(results[-1]), flush=True)
    caches.clear()
    plans.clear()
    gc.collect()
    mx.clear_cache()
    return results


def main() -> None:
    from benchmarks.decode import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="8193,32769,131073")
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--backend", default="cuda", help="cuda or metal (emulate: a CPU check of the script)")
    args = parser.parse_args()
    if args.backend == "emulate":  # the caches plan their kernels for the emulator, as the emulation tests do
        from engine.kvcache import kernels
        from engine.kvcache.kernels.emulate import EMULATE

        kernels.available_backend = lambda: EMULATE
    rows: list[dict[str, Any]] = []
    for context in (int(c) for c in args.contexts.split(",")):
        rows += measure(args.spec, context, SHAPES[args.shape], args.repeats, args.backend)
        Path(args.out).write_text(json.dumps({"kind": "kernel-phases", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
