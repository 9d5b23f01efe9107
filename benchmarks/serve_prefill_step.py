"""Prefill speed and peak memory of `velox serve`'s caches against the prefill step (mlx-lm's
`--prefill-step-size`: how many prompt tokens go through the model at once).

For each level and step, a fresh serving cache (`engine.serve.provider.serving_cache_factory`, what the server
makes) takes the same prompt through mlx-lm's `stream_generate` (what the server runs) up to the first reply
token; prompt tokens per second and MLX's peak memory come from mlx-lm's own GenerationResponse. The order
of the runs is interleaved (level by level, each step in turn), and the load average is recorded beside them.

    python benchmarks/serve_prefill_step.py [--tokens 4096] [--levels 4,16] [--steps 2048,512] [--repeats 1]

Writes benchmarks/results/serve_prefill_step.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: the engine beside it
    sys.path.insert(0, str(ROOT))

# engine first: it prepares the CPU fast path (the BLAS shim) before MLX loads; imported after MLX, the
# model ran on MLX's scalar CPU matmuls (this script measured 1.3-6.4 prompt tokens per second).
import engine  # noqa: E402,F401,I001
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import stream_generate  # noqa: E402
from benchmarks.serve_ttft import DEFAULT_PROSE  # noqa: E402
from engine.models.catalog import load_model, resolve_model  # noqa: E402
from engine.planning.recommend import UNCOMPRESSED_LEVEL_KEY, level_by_key  # noqa: E402
from engine.serve.provider import serving_cache_factory  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "serve_prefill_step.json"


def _prompt(tokenizer: Any, prose: Path, n_tokens: int) -> list[int]:
    ids = tokenizer.encode(prose.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
    start = len(ids) // 20  # past the title pages, as serve_ttft.py
    return list(ids[start : start + n_tokens])


def measure(model: Any, tokenizer: Any, prompt: list[int], level: str, step: int) -> dict[str, Any]:
    config = None if level == UNCOMPRESSED_LEVEL_KEY else level_by_key(level).config
    cache = serving_cache_factory(config)(model)
    mx.clear_cache()
    mx.reset_peak_memory()
    load_before = os.getloadavg()[0]
    first = next(iter(stream_generate(
        model, tokenizer, mx.array(prompt), max_tokens=1, prompt_cache=cache, prefill_step_size=step,
    )))
    return {
        "level": level,
        "cache": "uncompressed" if config is None else config.describe(),
        "prefill_step": step,
        "prompt_tokens": first.prompt_tokens,
        "prompt_tokens_per_s": round(first.prompt_tps, 1),
        "peak_memory_mb": round(first.peak_memory * 1000, 1),  # mlx-lm reports GB (1e9 bytes)
        "kv_cache_mb": round(sum(c.nbytes for c in cache) / 1e6, 2),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prose", type=Path, default=DEFAULT_PROSE)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--levels", default="4,16")
    parser.add_argument("--steps", default="2048,512")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not args.prose.is_file():
        print(f"error: no prose at {args.prose}; pass --prose PATH", file=sys.stderr)
        return 1
    model, tokenizer, info = load_model(resolve_model(None))
    prompt = _prompt(tokenizer, args.prose, args.tokens)
    results: dict[str, Any] = {
        "schema": "velox-serve-prefill-step/1",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": info.name,
        "machine": {
            "platform": f"{platform.system()} {platform.machine()}",
            "cpu_count": os.cpu_count(),
            "mlx_device": str(mx.default_device()),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        },
        "runs": [],
    }
    steps = [int(s) for s in args.steps.split(",")]
    for _ in range(args.repeats):
        for level in args.levels.split(","):
            for step in steps:
                run = measure(model, tokenizer, prompt, level.strip(), step)
                results["runs"].append(run)
                print(json.dumps(run), file=sys.stderr, flush=True)
    results["machine"]["load_average_1_5_15_at_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
