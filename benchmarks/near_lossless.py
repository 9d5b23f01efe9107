"""Near-lossless level candidates: teacher-forced Δ perplexity and KL against fp16 on held-out prose.

    python benchmarks/near_lossless.py --text ../shared/data/areopagitica.txt --tokens 2048 \\
        --specs fp16,kivi:k4v4:g64,kivi:k4v4:g64:s4:key_block=128 [--windows 2 | --start N ...] \\
        [--out benchmarks/results/near_lossless.json]

Each spec is a `KVCacheConfig.parse` string (the first must be the reference, normally fp16). `--start` places
a window at that token of every text (repeatable), e.g. away from the windows the quality sweep
(benchmarks/results/quality.json) scores, so the figures are on prose no level was chosen on. Each window of
`--tokens` tokens goes through every cache in 64-token chunks; the second half is scored (so every scored
token attends over compressed history). Per spec: Δ mean NLL vs the reference with a batch-means standard
error (64-token blocks), the perplexity change exp(Δ) - 1, mean KL(ref || cache), top-1 agreement, and the
effective bits per value at 4096 tokens by the registry's formula (every scale, norm, codebook and 16-bit
sink/window token counted) next to the bits measured from the arrays the caches hold at the window's end.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BITS_AT_TOKENS = 4096
SE_BLOCK = 64


def paired(values: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    diff = np.asarray(values, np.float64) - np.asarray(reference, np.float64)
    blocks = diff.size // SE_BLOCK
    means = diff[: blocks * SE_BLOCK].reshape(blocks, SE_BLOCK).mean(axis=1)
    return float(diff.mean()), float(means.std(ddof=1) / math.sqrt(blocks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="mlx-lm model folder (default: the embedded default model)")
    parser.add_argument("--text", action="append", required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=1, help="windows per text, evenly spaced")
    parser.add_argument("--start", type=int, action="append", default=[],
                        help="a window starting at this token of each text (repeatable; replaces --windows)")
    parser.add_argument("--specs", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()

    from engine.runtime import prepare_runtime

    prepare_runtime()

    from engine.kvcache import KVCacheBuilder, KVCacheConfig, get_method, model_shape
    from engine.kvcache.evaluate import teacher_forced_token_stats
    from engine.models.catalog import load_model

    if args.model:
        model_dir = args.model
    else:
        from engine.models.default_model import ensure_default_model

        model_dir = ensure_default_model()
    model, tokenizer, info = load_model(model_dir)
    shape = model_shape(model)
    names = [s.strip() for s in args.specs.split(",") if s.strip()]
    configs = {name: KVCacheConfig.parse(name) for name in names}
    # The builder validates each spec for the model; a `wide=F` spec gets its layers from the calibration here
    # (as the app's session does: the bundled prose, the opening of Areopagitica, never these windows), and
    # `builders[name].config` names them.
    builders = {name: KVCacheBuilder(config).for_model(model, tokenizer=tokenizer) for name, config in configs.items()}
    factories = {name: builder.build for name, builder in builders.items()}
    reference = names[0]
    per_spec: dict[str, dict[str, list]] = {name: {"nll": [], "kl": [], "top1": [], "bytes": []} for name in names}
    windows = []
    began = time.time()
    plan = []  # (text, its token ids, window starts), checked before any window runs
    for text in args.text:
        ids = list(tokenizer.encode(Path(text).read_text(encoding="utf-8", errors="replace"), add_special_tokens=False))
        first = len(ids) // 20
        room = len(ids) - first - args.tokens
        starts = args.start or [
            first + (room * index // max(args.windows - 1, 1) if args.windows > 1 else room // 2)
            for index in range(args.windows)
        ]
        for start in starts:
            if start < 0 or start + args.tokens > len(ids):
                sys.exit(f"{Path(text).name} has {len(ids):,} tokens: a {args.tokens:,}-token window at {start:,} "
                         "does not fit in it (choose another --start, or --windows).")
        plan.append((text, ids, starts))
    for text, ids, starts in plan:
        for start in starts:
            tokens = ids[start : start + args.tokens]
            windows.append({"text": Path(text).name, "start": start, "tokens": len(tokens)})
            stats = teacher_forced_token_stats(model, tokens, factories, reference, 64, len(tokens) // 2)
            for name, s in stats.items():
                per_spec[name]["nll"].append(s.nll)
                per_spec[name]["kl"].append(s.kl)
                per_spec[name]["top1"].append(s.top1_agrees)
                per_spec[name]["bytes"].append(s.held_bytes)
            print(f"window {Path(text).name}@{start}: {time.time() - began:.0f} s", flush=True)
    ref_nll = np.concatenate(per_spec[reference]["nll"])
    rows = []
    print(f"{'spec':44s} {'Δppl %':>8s} {'±se':>6s} {'KL':>8s} {'top1':>6s} {'bits@4k':>7s} {'held b':>7s}")
    for name in names:
        nll = np.concatenate(per_spec[name]["nll"])
        delta, se = paired(nll, ref_nll)
        config = builders[name].config
        method = get_method(config.method)
        # Averaged over this model's layers where some are wider (floor(F·L)/L; F itself is the budget).
        bits = method.effective_bits_per_value(
            config, shape.head_dim, BITS_AT_TOKENS, shape.n_kv_heads, n_layers=shape.n_layers)
        held_bits = per_spec[name]["bytes"][-1] * 8 / (
            2 * shape.n_layers * shape.n_kv_heads * shape.head_dim * (windows[-1]["tokens"] - 1)
        )
        row = {
            "spec": name,
            **({"built": str(config)} if config.wide_fraction is not None else {}),
            "delta_nll": delta,
            "delta_nll_se": se,
            "ppl_change": math.expm1(delta),
            "mean_kl": float(np.concatenate(per_spec[name]["kl"]).mean()),
            "top1": float(np.concatenate(per_spec[name]["top1"]).mean()),
            "bits_at_4k": bits,
            "held_bits_at_window": held_bits,
        }
        rows.append(row)
        print(
            f"{name:44s} {100 * row['ppl_change']:8.2f} {100 * se:6.2f} {row['mean_kl']:8.4f} {row['top1']:6.3f} "
            f"{bits:7.3f} {held_bits:7.3f}",
            flush=True,
        )
    if args.out:
        payload = {
            "schema": "velox-near-lossless/1",
            "model": info.name,
            "windows": windows,
            "chunk": 64,
            "scored": "second half of each window",
            "reference": reference,
            "command": " ".join(sys.argv),
            "seconds": time.time() - began,
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
