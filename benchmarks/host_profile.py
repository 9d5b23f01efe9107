"""Where a decode step's host time goes: Python's profiler over `model(token, cache=caches)` alone.

    python benchmarks/host_profile.py --out host.json [--specs fp16,affine:k4v4:g64] [--context 8193] [--steps 30]

A synchronous decode step (decode.py's measurement: build the graph, then evaluate it) pays the host time that
records MLX's graph before the GPU starts; decode.py's `--profile` splits a step into that `build` and the rest.
This script says which functions the build spends it in: for each cache spec (decode.py's syntax, kernel variants
`#NAME=VALUE` included) the 8B-shaped model's caches are filled to `--context` tokens, then `--steps` steps are
built under cProfile (each evaluated outside it) and the functions with the most own time are recorded, with the
build's median wall time without the profiler. On a CPU (`--shape tiny`) it runs, but the kernel path (a GPU's)
is not taken there, unless `--stub-kernels` stands in for the GPU: the caches then take the CUDA kernel path and each
kernel object is a stand-in whose launch only records zeros of its outputs' shapes, so the host's own (Python) time
of that path is measured on a CPU, without MLX's CUDA front end (which formats each launch's source in C++ on a GPU
machine). `--shape 8b-attention` keeps the 8B shape's attention (32 layers, 32 query / 8 kv heads, head_dim 128) with
a narrow MLP, hidden size and vocabulary, so a CPU evaluates its steps in milliseconds.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import decode as bench  # noqa: E402


def profile_builds(model: Any, spec: str, context: int, steps: int, shape: dict[str, Any],
                   top: int) -> dict[str, Any]:
    """One spec's build times (ms, without the profiler) and its `top` functions by own time under it."""
    import mlx.core as mx

    with bench.spec_constants(spec) as text:
        caches = bench.make_caches(text, shape["layers"], shape)
        bench.fill(caches, context, shape)
        token = mx.array([[128]], dtype=mx.int32)
        for _ in range(3):  # plans, kernels and compiled functions made before anything is timed
            mx.eval(model(token, cache=caches))
        builds = []
        for _ in range(steps):
            mx.synchronize()
            began = time.perf_counter()
            logits = model(token, cache=caches)
            builds.append((time.perf_counter() - began) * 1e3)
            mx.eval(logits)
        profiler = cProfile.Profile()
        for _ in range(steps):
            mx.synchronize()
            profiler.enable()
            logits = model(token, cache=caches)
            profiler.disable()
            mx.eval(logits)
    entries = [{"function": function, "calls_per_step": calls / steps, "own_ms_per_step": own * 1e3 / steps,
                "total_ms_per_step": total * 1e3 / steps}
               for function, calls, own, total in bench.profiled_functions(profiler)]
    builds.sort()
    return {"spec": text, **bench.constants_entry(spec), "context": context, "build_ms": builds[len(builds) // 2],
            "profiled_ms": sum(e["own_ms_per_step"] for e in entries), "top": entries[:top]}


# The 8B shape's attention and layer count with small matrices elsewhere (see the module doc).
ATTENTION_SHAPE = {**bench.SHAPES["8b"], "hidden": 512, "mlp": 512, "vocab": 512}


def stub_kernels() -> None:
    """Make the caches take the CUDA kernel path on this machine with stand-in kernel objects (see the module doc);
    the first-run check, which would compare their zeros with the reference path, is skipped."""
    import mlx.core as mx

    from engine.kvcache import kernel_check
    from engine.kvcache.kernels import backend

    def stand_in(source: Any, backend_name: str) -> Any:
        def launch(*, output_shapes: list[Any], output_dtypes: list[Any], **_: Any) -> list[Any]:
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]

        return launch

    kernel_check.CHECKED_BACKENDS = ()
    backend.device_backend = lambda: "cuda"
    backend.build = stand_in
    backend._BUILT.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--specs", default="fp16,affine:k4v4:g64")
    parser.add_argument("--context", type=int, default=8193)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--shape", choices=(*bench.SHAPES, "8b-attention"), default="8b")
    parser.add_argument("--stub-kernels", action="store_true",
                        help="on a CPU, take the GPU kernel path with stand-in kernels (see the module doc)")
    args = parser.parse_args()
    from engine.runtime import prepare_runtime

    prepare_runtime()
    import mlx.core as mx

    if args.stub_kernels:
        stub_kernels()
    shape = ATTENTION_SHAPE if args.shape == "8b-attention" else bench.SHAPES[args.shape]
    model = bench.build_model(shape)
    bench._CALIBRATION_MODEL[:] = [model]
    record: dict[str, Any] = {"schema": "velox-bench/1", "kind": "host-profile", "device": str(mx.default_device()),
                              "mlx": mx.__version__, "shape": shape, "steps": args.steps,
                              "stub_kernels": args.stub_kernels, "rows": []}
    for spec in args.specs.split(","):
        row = profile_builds(model, spec, args.context, args.steps, shape, args.top)
        record["rows"].append(row)
        print(f"{spec} {args.context}: build {row['build_ms']:.3f} ms (profiled {row['profiled_ms']:.3f})", flush=True)
        for entry in row["top"][:15]:
            print(f"  {entry['own_ms_per_step']:.4f} ms own  {entry['calls_per_step']:6.1f} calls  {entry['function']}")
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
