"""What the first run of a cache's kernels costs (engine/kvcache/kernel_check.py), beside the compiles a first reply
pays anyway (GPU probe; on the CPU the check does nothing and only the first use is timed).

    python3 benchmarks/first_run_cost.py --out first-run-cost.json --specs '<4-bit level>,<3-bit level>'

Each spec runs in two fresh processes, each with an empty MLX PTX cache (MLX_PTX_CACHE_DIR: MLX's CUDA build keeps
the PTX it compiles under /tmp, so a second process would find the first's): one with the check as shipped, one with
it skipped (`kernel_check.CHECKED_BACKENDS` emptied). A process builds decode.py's model (8B-shaped, random 4-bit
weights), then times `make_caches` (the key widths' calibration where the spec asks for it, and `build`, with the
check's own time apart), a second `make_caches` (the check already done in this process), and the first use: a
300-token prefill, a decode step and a 16-token chunk through the whole model, then the median of 7 decode steps. The
check's cost is the difference of the two processes' totals (build + first use), the rest being the same compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("check", "nocheck")
FIRST_USE = (300, 1, 16)  # tokens of the first prefill, decode step and chunk
STEADY_STEPS = 7


def run_one(spec: str, mode: str, shape_name: str) -> dict[str, Any]:
    """One process's figures (this process: call it in a fresh one)."""
    import mlx.core as mx
    import numpy as np

    import engine.kvcache.builder as builder
    import engine.kvcache.kernel_check as kernel_check
    from benchmarks.decode import _CALIBRATION_MODEL, SHAPES, build_model, make_caches
    from engine.kvcache.kernels.backend import disabled_reason

    if mode == "nocheck":
        kernel_check.CHECKED_BACKENDS = ()
    check_s = [0.0]
    verify = builder.verify_kernels

    def timed_verify(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        verify(*args, **kwargs)
        check_s[0] += time.perf_counter() - start

    builder.verify_kernels = timed_verify
    shape = SHAPES[shape_name]
    model = build_model(shape)
    mx.eval(model.parameters())
    _CALIBRATION_MODEL[:] = [model]
    start = time.perf_counter()
    caches = make_caches(spec, shape["layers"], shape)
    build_s = time.perf_counter() - start
    first_check_s = check_s[0]
    start = time.perf_counter()
    make_caches(spec, shape["layers"], shape)
    second_build_s = time.perf_counter() - start
    rng = np.random.default_rng(1)

    def step(tokens: int) -> float:
        begin = time.perf_counter()
        mx.eval(model(mx.array(rng.integers(0, shape["vocab"], (1, tokens))), cache=caches))
        return time.perf_counter() - begin

    first = [step(n) for n in FIRST_USE]
    steady = statistics.median(step(1) for _ in range(STEADY_STEPS))
    return {"spec": spec, "mode": mode, "device": str(mx.default_device()), "build_s": build_s,
            "check_s": first_check_s, "second_build_s": second_build_s, "first_prefill_s": first[0],
            "first_decode_s": first[1], "first_chunk_s": first[2], "steady_decode_ms": steady * 1e3,
            "first_total_s": build_s + sum(first), "kernels_disabled": disabled_reason()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--specs", required=True, help="comma-separated cache specs (decode.py's syntax)")
    parser.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a process may take")
    parser.add_argument("--one", nargs=2, metavar=("SPEC", "MODE"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.shape)), flush=True)
        return 0
    rows = []
    for spec in args.specs.split(","):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as ptx:
                env = {**os.environ, "MLX_PTX_CACHE_DIR": ptx}
                command = [sys.executable, __file__, "--out", args.out, "--specs", spec, "--shape", args.shape,
                           "--one", spec, mode]
                try:
                    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
                    lines = done.stdout.strip().splitlines()
                    row = (json.loads(lines[-1]) if done.returncode == 0 and lines
                           else {"spec": spec, "mode": mode, "error": done.stderr.strip()[-600:]})
                except subprocess.TimeoutExpired:
                    row = {"spec": spec, "mode": mode, "error": f"timed out after {args.timeout:.0f} s"}
            rows.append(row)
            figures = {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}
            print(f"{mode:8s} {spec[:60]}: {figures or row.get('error')}", flush=True)
    record = {"schema": "velox-bench/1", "kind": "first-run-cost", "shape": args.shape, "first_use": FIRST_USE,
              "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
