"""Engine-core benchmark: first-run fetch+convert, cached load, prefill/decode speed on a ~2k-token
document, peak memory. Each measurement that depends on process state runs in its own subprocess.

    python benchmarks/engine_core.py [--prose PATH] [--out benchmarks/results/engine_core.json]

Prints a table and writes JSON. The prose is --prose, else botchan.txt in $VELOX_BENCH_DATA, else (a developer
checkout's default) in ../shared/data.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The same folder as `velox bench` reads its prose from (benchmarks/harness/common.py).
DEFAULT_PROSE = Path(os.environ.get("VELOX_BENCH_DATA") or ROOT.parent / "shared" / "data") / "botchan.txt"

FIRST_RUN = """
import time, json
t = time.perf_counter()
from engine.models.default_model import ensure_default_model
ensure_default_model()
print(json.dumps({"seconds": time.perf_counter() - t}))
"""

SPEED = """
import json, os, sys, time
fast = os.environ.get("VELOX_FAST_BLAS", "1") != "0"
t0 = time.perf_counter()
from engine.runtime.status import runtime_status
from engine.models.catalog import load_model
from engine.models.default_model import ensure_default_model
from engine.chat.documents import Document
from engine.chat.session import ChatSession, GenerationSettings, GenerationStats, TextChunk
import mlx.core as mx
model, tokenizer, info = load_model(ensure_default_model())
load_seconds = time.perf_counter() - t0
prose = open(sys.argv[1], encoding="utf-8").read()
ids = tokenizer.encode(prose, add_special_tokens=False)
start = len(ids) // 3
text = tokenizer.decode(ids[start:start + int(sys.argv[2])])
settings = GenerationSettings(max_tokens=int(sys.argv[3]), prefill_chunk=512)
session = ChatSession(model, tokenizer, settings=settings)
session.attach_document(Document(None, "excerpt.txt", "text", text, len(text)))
reply = ""
for event in session.send("Summarise this excerpt in a few sentences."):
    if isinstance(event, TextChunk):
        reply += event.text
    elif isinstance(event, GenerationStats):
        stats = event
print(json.dumps({
    "load_seconds": load_seconds, "prompt_tokens": stats.prompt_tokens,
    "prefill_tok_s": stats.prefill_tokens_per_second, "decode_tok_s": stats.decode_tokens_per_second,
    "generated_tokens": stats.generated_tokens, "ttft_s": stats.time_to_first_token,
    "peak_memory_bytes": stats.peak_memory_bytes, "kv_cache_bytes": stats.kv_cache_bytes,
    "reply": reply, "runtime": runtime_status(),
}))
"""


def _run(code: str, args: list[str], env: dict[str, str]) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                            env=dict(env, PYTHONPATH=str(ROOT)))
    if result.returncode != 0:
        raise SystemExit(f"benchmark step failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prose", type=Path, default=DEFAULT_PROSE, help=f"prose file (default: {DEFAULT_PROSE})")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engine_core.json")
    args = parser.parse_args()
    if not args.prose.is_file():
        raise SystemExit(f"No prose file at {args.prose}; pass --prose PATH or set VELOX_BENCH_DATA to its folder.")
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="velox-bench-") as fresh:
        first = _run(FIRST_RUN, [], dict(env, VELOX_DATA_DIR=fresh))
    cached = _run(FIRST_RUN, [], env)
    results = {"machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
               "first_run_fetch_convert_s": first["seconds"], "cached_resolve_s": cached["seconds"], "runs": {}}
    for label, fast in [("stock", "0"), ("fast path", "1")]:
        run = _run(SPEED, [str(args.prose), str(args.tokens), str(args.max_tokens)], dict(env, VELOX_FAST_BLAS=fast))
        results["runs"][label] = run
    print(f"machine: {results['machine']}")
    print(f"first run (download + verify + convert): {first['seconds']:.1f} s; cached: {cached['seconds']:.2f} s")
    print(f"{'path':<10} {'load s':>7} {'prompt':>7} {'prefill tok/s':>14} {'decode tok/s':>13} {'TTFT s':>7} {'peak MB':>8}")
    for label, run in results["runs"].items():
        print(f"{label:<10} {run['load_seconds']:>7.2f} {run['prompt_tokens']:>7} {run['prefill_tok_s']:>14.1f} "
              f"{run['decode_tok_s']:>13.1f} {run['ttft_s']:>7.2f} {run['peak_memory_bytes'] / 1e6:>8.0f}")
    same = results["runs"]["stock"]["reply"] == results["runs"]["fast path"]["reply"]
    results["identical_text"] = same
    print(f"identical text on both paths: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
