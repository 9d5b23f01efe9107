"""Where a stalled token of mlx-lm's decode loop spends its time (GPU probe).

    python3 benchmarks/loop_stall_profile.py --out loop-stall-profile.json --context 32769 --steps 300 \
        --specs '<4-bit level>,<3-bit level>'

decode.py counts the loop's stalls (a token taking `STALL_FACTOR` times the median) and where they fall: on the lent
H200 the levels' fall on their key-block encodes (every 128 tokens), 45-80 ms against a median of 9 ms, without MLX's
peak memory rising (decode-stall-peaks-h200.json), so they are not copies of the store. This runs mlx-lm's loop as
`generate_step` does (the next token recorded on the generation stream while the GPU runs the current one, greedy)
over decode.py's 8B model and caches, and times each token's three phases apart: `record_ms`, the Python that records
the next step's graph (the model and the caches' update_and_fetch and attention); `dispatch_ms`, `mx.async_eval` of
it (MLX encodes the kernels: its CUDA graphs are built, and instantiated where its graph cache misses, and a kernel
never seen is compiled); `wait_ms`, the current token's `.item()` (the GPU still running the step). The record phase
is profiled (cProfile) for the slowest tokens, beside a median token's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def top_functions(profile: cProfile.Profile, n: int) -> list[dict[str, Any]]:
    """The `n` functions with the most time of their own in `profile`: name, own and cumulative ms, calls."""
    from benchmarks.decode import profiled_functions

    return [{"function": function, "own_ms": own * 1e3, "cum_ms": cumulative * 1e3, "calls": calls}
            for function, calls, own, cumulative in profiled_functions(profile)[:n]]


def profile_loop(model: Any, caches: list[Any], steps: int, warmup: int, top: int, slowest: int) -> dict[str, Any]:
    import mlx.core as mx

    stream = mx.new_stream(mx.default_device())  # mlx-lm's generation_stream

    def record(tokens: mx.array) -> tuple[mx.array, mx.array]:
        with mx.stream(stream):
            logits = model(tokens[None], cache=caches)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return mx.argmax(logprobs, axis=-1), logprobs.squeeze(0)

    start = int(caches[0].offset)
    y, logprobs = record(mx.array([128], dtype=mx.int32))
    mx.async_eval(y, logprobs)
    rows: list[dict[str, Any]] = []
    profiles: list[cProfile.Profile] = []
    for index in range(warmup + steps):
        profile = cProfile.Profile()
        began = time.perf_counter()
        profile.enable()
        next_y, next_logprobs = record(y)
        profile.disable()
        recorded = time.perf_counter()
        mx.async_eval(next_y, next_logprobs)
        dispatched = time.perf_counter()
        y.item()
        done = time.perf_counter()
        if index >= warmup:
            # the token read now was recorded a step earlier; the step recorded now makes the cache this long
            rows.append({"offset": start + index + 2, "ms": (done - began) * 1e3, "record_ms": (recorded - began) * 1e3,
                         "dispatch_ms": (dispatched - recorded) * 1e3, "wait_ms": (done - dispatched) * 1e3})
            profiles.append(profile)
        y, logprobs = next_y, next_logprobs
    median = statistics.median(row["ms"] for row in rows)
    ranked = sorted(range(len(rows)), key=lambda i: -rows[i]["ms"])
    middle = min(range(len(rows)), key=lambda i: abs(rows[i]["ms"] - median))

    def phases(name: str) -> float:
        return statistics.median(row[name] for row in rows)

    return {
        "median_ms": median, "mean_ms": statistics.fmean(row["ms"] for row in rows),
        "median_record_ms": phases("record_ms"), "median_dispatch_ms": phases("dispatch_ms"),
        "median_wait_ms": phases("wait_ms"),
        "tokens": rows,
        "slowest": [{**rows[i], "top": top_functions(profiles[i], top)} for i in ranked[:slowest]],
        "median_token": {**rows[middle], "top": top_functions(profiles[middle], top)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=32769)
    parser.add_argument("--specs", required=True, help="comma-separated cache specs (decode.py's syntax, # variants)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--slowest", type=int, default=3)
    parser.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    args = parser.parse_args(argv)

    import mlx.core as mx

    from benchmarks import decode

    shape = decode.SHAPES[args.shape]
    model = decode.build_model(shape)
    rows = []
    for spec in args.specs.split(","):
        try:
            with decode.spec_constants(spec) as cache_spec:
                caches = decode.make_caches(cache_spec, shape["layers"], shape)
                decode.fill(caches, args.context, shape)
                row = {"spec": spec, "context": args.context,
                       **profile_loop(model, caches, args.steps, args.warmup, args.top, args.slowest)}
        except Exception as error:  # noqa: BLE001 - one spec's failure is recorded, the others still run
            row = {"spec": spec, "context": args.context, "error": f"{type(error).__name__}: {error}"}
        rows.append(row)
        caches = None
        mx.clear_cache()
        print(spec[:40], {k: round(v, 2) for k, v in row.items() if k.endswith("_ms") and k != "ms"},
              row.get("error", ""))
        for token in [*row.get("slowest", []), *([row["median_token"]] if "median_token" in row else [])]:
            print(f"  token at {token['offset']}: {token['ms']:.1f} ms (record {token['record_ms']:.1f}, dispatch "
                  f"{token['dispatch_ms']:.1f}, wait {token['wait_ms']:.1f});",
                  "; ".join(f"{f['function']} {f['own_ms']:.1f}/{f['cum_ms']:.1f} ms x{f['calls']}"
                            for f in token["top"][:6]))
        Path(args.out).write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
