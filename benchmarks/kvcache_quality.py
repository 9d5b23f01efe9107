"""Teacher-forced quality of KV cache configs on the default model (or any mlx-lm model folder).

    python benchmarks/kvcache_quality.py [--model DIR] [--text FILE] [--tokens 1000] [--chunk 64]
                                         [--configs fp16,affine:k4v4:g64,...] [--out results.json]

A config is one KV cache spec token, read by `KVCacheConfig.parse` (engine/kvcache/config.py says the
syntax), e.g. `rotated:k3v3:g32:w128:s4` for a 16-bit recent window and sink tokens;
`:prefill_attention=dequantize-blocks` makes prefill chunks attend through decoded blocks (faster on a CPU).
The first config is the reference for KL (default fp16). Prints a table (perplexity, KL to the reference,
effective bits, bytes, seconds) and writes JSON. Compare methods by paired differences on the same tokens, never by absolute ppl.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_TEXT = ROOT / "tests" / "data" / "prose_sample.txt"
DEFAULT_CONFIGS = (
    "fp16,fp32,affine:k8v8:g64,affine:k4v4:g64,rotated:k4v4:g64,affine:k3v3:g32,rotated:k3v3:g32,affine:k2v2:g32,"
    "rotated:k2v2:g32"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="mlx-lm model folder (default: the embedded default model)")
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    from engine.runtime import prepare_runtime

    prepare_runtime()  # before MLX is imported: the Linux CPU fast path

    from engine.kvcache.evaluate import teacher_forced_quality
    from engine.models.catalog import load_model

    if args.model:
        model_dir = args.model
    else:
        from engine.models.default_model import ensure_default_model

        model_dir = ensure_default_model()
    model, tokenizer, info = load_model(model_dir)
    tokens = list(tokenizer.encode(Path(args.text).read_text(encoding="utf-8")))[: args.tokens]
    from engine.errors import ConfigError
    from engine.kvcache import KVCacheConfig

    names = [name.strip() for name in args.configs.split(",") if name.strip()]
    try:
        configs = {name: KVCacheConfig.parse(name) for name in names}
    except ConfigError as error:
        raise SystemExit(str(error)) from None
    results = teacher_forced_quality(model, tokens, configs, reference=names[0], chunk_tokens=args.chunk)

    print(f"{info.name}: {len(tokens)} tokens of {Path(args.text).name}, chunks of {args.chunk}")
    print(f"{'config':24s} {'ppl':>8s} {'KL':>9s} {'bits':>6s} {'cache MB':>9s} {'seconds':>8s}")
    for name, result in results.items():
        print(
            f"{name:24s} {result.perplexity:8.3f} {result.kl_to_reference:9.5f} {result.effective_bits:6.2f} "
            f"{result.cache_bytes / 1e6:9.2f} {result.seconds:8.1f}"
        )
    if args.out:
        payload = {
            "model": info.name,
            "text": Path(args.text).name,
            "tokens": len(tokens),
            "chunk": args.chunk,
            "reference": names[0],
            "results": {
                name: {**asdict(result), "config": result.config.to_dict()} for name, result in results.items()
            },
        }
        Path(args.out).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
