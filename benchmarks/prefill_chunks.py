"""Where a chunked prefill's time goes, chunk by chunk: the 8B-shaped model of `decode.py` (random 4-bit weights)
prefills N tokens in chunks (4,096 tokens unless --chunk says; decode.py's prefill rows use 2,048) into fresh caches of each spec, in the order given (a spec may repeat: its
first run pays for compiling the kernels it meets, a later one does not), and for every chunk the host time to build
the graph (`model(chunk, cache=caches)`) and the time to evaluate it are recorded.

`key_widths=uniform` in a spec stands for one random key-widths table with the same class sizes in every layer
(seeded; widths 3-6 at 4 key bits, 2-5 at 3), where `key_widths=calibrated` measures them on the model as
`decode.py` does (each layer its own class sizes): the two tell a cost of the widths themselves from one of
per-layer layouts.

    python benchmarks/prefill_chunks.py --tokens 32768 --out benchmarks/results/prefill-chunks-h200.json \\
        --specs "kivi:k4v4:g64:s4:key_block=128:rotate_values=true:key_widths=uniform,kivi:k4v4:g64:s4:key_block=128:rotate_values=true"

For a GPU (on a CPU it runs, slowly). The caches take kernels=auto and prefill_attention=auto, as the app's do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import decode as bench  # noqa: E402

CHUNK = 4096  # tokens per chunk unless --chunk says
# Class sizes of the uniform table per 128 channels: widths bits-1 .. bits+2, averaging the key bits exactly.
UNIFORM_COUNTS = (40, 56, 24, 8)


def uniform_widths(key_bits: int, shape: dict[str, Any]) -> str:
    """The digest of a registered key-widths table with the same class sizes in every layer (seed 0)."""
    import numpy as np

    from engine.kvcache.key_widths import register_table

    rng = np.random.default_rng(0)
    counts = [count * shape["head_dim"] // 128 for count in UNIFORM_COUNTS]
    ranks = np.repeat(np.arange(key_bits - 1, key_bits + 3), counts).astype(np.uint8)
    return register_table([np.stack([rng.permutation(ranks) for _ in range(shape["kv_heads"])])
                           for _ in range(shape["layers"])])


def caches_for(spec: str, shape: dict[str, Any]) -> list[Any]:
    from engine.kvcache import KVCacheConfig

    if "key_widths=uniform" in spec:
        bits = KVCacheConfig.parse(spec.replace(":key_widths=uniform", "")).key_bits
        spec = spec.replace("key_widths=uniform", f"key_widths={uniform_widths(bits, shape)}")
    return bench.make_caches(spec, shape["layers"], shape)


def prefill_chunks(model: Any, spec: str, prompt: Any, shape: dict[str, Any], chunk: int = CHUNK) -> dict[str, Any]:
    import mlx.core as mx

    caches = caches_for(spec, shape)
    mx.synchronize()
    began = time.perf_counter()
    times = bench.chunked_prefill(model, caches, prompt, chunk)
    mx.synchronize()
    seconds = time.perf_counter() - began
    builds = [round(1000 * build, 1) for build, _ in times]
    evals = [round(1000 * evaluation, 1) for _, evaluation in times]
    del caches
    mx.clear_cache()
    return {"spec": spec, "tokens": int(prompt.shape[1]), "tok_s": prompt.shape[1] / seconds, "build_ms": builds,
            "eval_ms": evals}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", required=True, help="comma-separated specs, in the order to run (may repeat)")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=CHUNK)
    parser.add_argument("--shape", choices=sorted(bench.SHAPES), default="8b", help="tiny: a check of the command")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from engine.runtime import prepare_runtime

    prepare_runtime()
    import mlx.core as mx

    shape = bench.SHAPES[args.shape]
    model = bench.build_model(shape)
    bench._CALIBRATION_MODEL[:] = [model]  # key_widths=calibrated is measured on it, as decode.py does
    prompt = mx.random.randint(0, shape["vocab"], (1, args.tokens)).astype(mx.int32)
    mx.eval(prompt)
    rows = []
    for spec in args.specs.split(","):
        with bench.spec_constants(spec) as text:  # SPEC#NAME=VALUE: an engine constant set for this row
            row = prefill_chunks(model, text, prompt, shape, args.chunk) | bench.constants_entry(spec)
        print(json.dumps(row), flush=True)
        rows.append(row)
    args.out.write_text(json.dumps({"schema": "velox-bench/1", "kind": "prefill-chunks", "device":
                                    str(mx.default_device()), "mlx": mx.__version__, "shape": shape,
                                    "chunk": args.chunk, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
