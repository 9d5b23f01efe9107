"""Where a stalled token of mlx-lm's decode loop spends its host time (GPU probe).

    python3 benchmarks/loop_stall_profile.py --out loop-stall-profile.json --context 32769 --steps 300 \
        --specs '<4-bit level>,<3-bit level>'

decode.py counts the loop's stalls (a token taking `STALL_FACTOR` times the median) and where they fall: on the lent
H200 the levels' fall on their key-block encodes (every 128 tokens), 45-80 ms against a median of 9 ms, without MLX's
peak memory rising (decode-stall-peaks-h200.json), so they are not copies of the store. This runs the same loop
(decode.py's 8B model and caches, `generate_step`, greedy) with cProfile switched on around each token only, and
records, for the slowest tokens and for a median one, the functions with the most time of their own: time inside
the host's waits for the GPU (the token's `.item()`, an `mx.eval`) says the GPU ran long; time in Python or in
MLX's recording says the host did. Profiling slows every token alike, so the slow tokens still stand out.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def top_functions(profile: cProfile.Profile, n: int) -> list[dict[str, Any]]:
    """The `n` functions with the most time of their own in `profile`: name, own seconds, cumulative, calls."""
    stats = pstats.Stats(profile)
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({name})", "own_ms": own * 1e3,
                     "cum_ms": cumulative * 1e3, "calls": calls})
    return sorted(rows, key=lambda row: -row["own_ms"])[:n]


def profile_loop(model: Any, caches: list[Any], steps: int, warmup: int, top: int, slowest: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    start = int(caches[0].offset)
    loop = generate_step(mx.array([128], dtype=mx.int32), model, max_tokens=warmup + steps + 1, prompt_cache=caches,
                         sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
    tokens: list[tuple[float, int, cProfile.Profile]] = []
    for index in range(warmup + steps + 1):
        profile = cProfile.Profile()
        began = time.perf_counter()
        profile.enable()
        try:
            next(loop)
        except StopIteration:
            break
        finally:
            profile.disable()
        if index >= warmup:
            # the loop runs a step ahead: the token yielded now was computed while the next one was recorded
            tokens.append((time.perf_counter() - began, start + index + 1, profile))
    seconds = [token[0] for token in tokens]
    median = statistics.median(seconds)
    ranked = sorted(tokens, key=lambda token: -token[0])
    middle = min(tokens, key=lambda token: abs(token[0] - median))
    return {
        "median_ms": median * 1e3,
        "mean_ms": statistics.fmean(seconds) * 1e3,
        "slowest": [{"offset": offset, "ms": wall * 1e3, "top": top_functions(profile, top)}
                    for wall, offset, profile in ranked[:slowest]],
        "median_token": {"offset": middle[1], "ms": middle[0] * 1e3, "top": top_functions(middle[2], top)},
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
        cache_spec, constants = decode.split_spec(spec)
        saved = decode.set_kernel_constants(constants)
        try:
            caches = decode.make_caches(cache_spec, shape["layers"], shape)
            decode.fill(caches, args.context, shape)
            row = {"spec": spec, "context": args.context,
                   **profile_loop(model, caches, args.steps, args.warmup, args.top, args.slowest)}
        except Exception as error:  # noqa: BLE001 - one spec's failure is recorded, the others still run
            row = {"spec": spec, "context": args.context, "error": f"{type(error).__name__}: {error}"}
        finally:
            decode.set_kernel_constants(saved)
        rows.append(row)
        caches = None
        mx.clear_cache()
        print(spec[:40], {k: v for k, v in row.items() if k in ("median_ms", "mean_ms", "error")})
        for token in row.get("slowest", []):
            print(f"  token at {token['offset']}: {token['ms']:.1f} ms;",
                  "; ".join(f"{f['function']} {f['own_ms']:.1f}/{f['cum_ms']:.1f} ms x{f['calls']}"
                            for f in token["top"][:6]))
        if "median_token" in row:
            token = row["median_token"]
            print(f"  median token at {token['offset']}: {token['ms']:.1f} ms;",
                  "; ".join(f"{f['function']} {f['own_ms']:.1f}/{f['cum_ms']:.1f} ms" for f in token["top"][:6]))
        Path(args.out).write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
