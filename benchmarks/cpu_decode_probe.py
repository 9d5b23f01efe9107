"""Decode speed of a few caches on this CPU with the embedded model, after a real chunked prefill (timed too).

    python benchmarks/cpu_decode_probe.py --tokens 4000 --specs kivi:k2v2:g64:s4:key_block=128,fp16 [--out probe.json]

Each cache is filled by prefilling `--tokens` tokens of botchan (from token 2,000) in 512-token chunks, then 12
greedy decode steps are timed and the median of the last 10 is reported (tok/s). Used to check what a cache that
decodes its history every step (e.g. KIVI with key_grid, where no quantized_matmul reads the codes) costs on the
CPU against the 2-bit level and the 16-bit cache, in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--specs", required=True)
    parser.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "botchan.txt"))
    parser.add_argument("--out")
    args = parser.parse_args()

    from engine.runtime import prepare_runtime

    prepare_runtime()
    import mlx.core as mx

    from engine.kvcache import KVCacheBuilder, KVCacheConfig
    from engine.models.catalog import load_model
    from engine.models.default_model import ensure_default_model

    model, tokenizer, info = load_model(ensure_default_model())
    ids = tokenizer.encode(Path(args.text).read_text(encoding="utf-8"), add_special_tokens=False)
    ids = ids[2000 : 2000 + args.tokens]
    rows = []
    for spec in args.specs.split(","):
        caches = KVCacheBuilder(KVCacheConfig.parse(spec)).for_model(model, tokenizer=tokenizer).build()
        prefill_began = time.perf_counter()
        for start in range(0, len(ids), 512):
            mx.eval(model(mx.array([ids[start : start + 512]]), cache=caches))
        prefill_seconds = time.perf_counter() - prefill_began
        token = mx.array([[ids[-1]]])
        times = []
        for _ in range(12):
            began = time.perf_counter()
            logits = model(token, cache=caches)
            mx.eval(logits)
            times.append(time.perf_counter() - began)
            token = mx.argmax(logits[:, -1:], axis=-1)
        steady = sorted(times[2:])
        rows.append({"spec": spec, "context": len(ids), "decode_tok_s": 1 / steady[len(steady) // 2],
                     "prefill_tok_s": len(ids) / prefill_seconds})
        print(f"{spec:70s} {rows[-1]['decode_tok_s']:.1f} tok/s at {len(ids)} tokens "
              f"(prefill {rows[-1]['prefill_tok_s']:.0f} tok/s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "schema": "velox-cpu-decode-probe/1", "model": info.name, "device": str(mx.default_device()),
            "command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
