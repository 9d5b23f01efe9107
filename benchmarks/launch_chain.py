"""What a launch costs when each depends on the one before, on a GPU: a built-in op, a custom kernel, 16-bit SDPA.

    python benchmarks/launch_chain.py --out launch_chain.json [--launches 64] [--repeats 15]

Issue 11: in a decode step each layer's operations wait for the previous ones, so what bounds a small launch is
not its arithmetic but how soon the next can start. For each kind, `launches` dependent launches (each reads the
previous one's output) are recorded and evaluated, `repeats` times; per launch (median): `host_us`, the time to
build them into MLX's graph, and `total_us`, building plus evaluating them to completion.

- `builtin_add`: `y + 1.0` on 32,768 floats.
- `custom_short`: a custom kernel doing the same, with 21 integer template arguments (as many as the tiled decode
  pass passes).
- `custom_long`: the same kernel with ~22 KB of unused macro definitions in its source: MLX's CUDA front end
  rebuilds and hashes a custom kernel's whole source per call (the tiled pass's source is ~13 KB compacted).
- `sdpa_8k`: `mx.fast.scaled_dot_product_attention` of one query token (32 heads, 8 kv heads, head_dim 128, bf16)
  over 8,193 16-bit tokens: the fp16 cache's attention in one layer.

Nothing is asserted; the figures are for reading beside `decode_profile.py`. A GPU tool (CUDA or Metal).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ELEMENTS = 256 * 128
THREADS = 128
_BODY = "const int i = GROUP_X * NT + TID; y[i] = x[i] + 1.0f;\n"
_FILLER = "".join(f"#define VELOX_PROBE_UNUSED_{i} (x[{i}] * {i}.0f + 1.0f)\n" for i in range(400))


def chains(launches: int) -> dict[str, Any]:
    """name -> a function recording `launches` dependent launches of that kind (returns the last output)."""
    import mlx.core as mx

    from engine.kvcache.kernels.backend import KernelSource, available_backend, kernel

    backend = available_backend()
    if backend is None:
        raise SystemExit("launch_chain.py needs a GPU kernel backend (MLX's CUDA or Metal build on a GPU).")
    x = mx.zeros((ELEMENTS,))
    query = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    history = mx.zeros((1, 8, 8193, 128), mx.bfloat16)
    mx.eval(x, query, history)
    template = [(f"T{i}", i) for i in range(20)] + [("NT", THREADS)]

    def custom(body: str, name: str) -> Any:
        run = kernel(KernelSource(name=name, input_names=("x",), output_names=("y",), body=body), backend)

        def record() -> Any:
            y = x
            for _ in range(launches):
                y = run(inputs=[y], template=template, grid=(ELEMENTS, 1, 1), threadgroup=(THREADS, 1, 1),
                        output_shapes=[y.shape], output_dtypes=[mx.float32])[0]
            return y
        return record

    def builtin() -> Any:
        y = x
        for _ in range(launches):
            y = y + 1.0
        return y

    def sdpa() -> Any:
        y = query
        for _ in range(launches):
            y = mx.fast.scaled_dot_product_attention(y, history, history, scale=128**-0.5)
        return y

    return {"builtin_add": builtin, "custom_short": custom(_BODY, "velox_probe_short"),
            "custom_long": custom(_FILLER + _BODY, "velox_probe_long"), "sdpa_8k": sdpa}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--launches", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    import mlx.core as mx

    rows = {}
    for name, record in chains(args.launches).items():
        mx.eval(record())  # compile and warm up
        host, total = [], []
        for _ in range(args.repeats):
            mx.synchronize()
            began = time.perf_counter()
            last = record()
            recorded = time.perf_counter()
            mx.eval(last)
            mx.synchronize()
            host.append(recorded - began)
            total.append(time.perf_counter() - began)
        rows[name] = {"host_us": sorted(host)[len(host) // 2] / args.launches * 1e6,
                      "total_us": sorted(total)[len(total) // 2] / args.launches * 1e6}
        print(name, {key: round(value, 1) for key, value in rows[name].items()}, flush=True)
    record = {"schema": "velox-bench/1", "kind": "launch-chain", "device": str(mx.default_device()),
              "mlx": mx.__version__, "launches": args.launches, "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
