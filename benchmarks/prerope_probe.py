"""Probe for issue 12: would quantizing KIVI's keys *before* RoPE (KVQuant) pay on the embedded model?

    python benchmarks/prerope_probe.py --text ../shared/data/botchan.txt --text ../shared/data/areopagitica.txt \\
        --start 2000 --start 8000 --tokens 2048 \\
        --specs fp16,kivi:k3v3:g64:s4:key_block=128,kivi:k3v3:g64:s4:key_block=128@pre --out probe.json

The near_lossless.py protocol (teacher forcing in 64-token chunks, second half of each window scored against the
first spec), where a spec ending in `@pre` is that cache with its keys stored pre-RoPE: keys enter the cache
rotated back by the inverse RoPE at their positions (so every stored key - sinks, window, compressed - is the
projection's raw output, whose channels keep their own scale instead of being mixed pairwise by position), and
the decoded history gets RoPE again before attention. Only the prefill path does that, which is the only path
teacher forcing in chunks takes: this is a measurement, not a cache the app can use (the single-token decode
paths, the GPU kernels, saving and re-encoding do not know about it; see issue 12's notes for what that takes).
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
sys.path.insert(0, str(ROOT / "benchmarks"))


def pre_rope_class(base_cls: type, rope: object) -> type:
    """`base_cls` with keys stored before RoPE (the model's own `rope` module: dims, traditional, base, scale)."""
    import mlx.core as mx

    def rotate(keys: mx.array, offset: int, sign: float) -> mx.array:
        return mx.fast.rope(keys.astype(mx.float32), rope.dims, traditional=rope.traditional, base=rope.base,
                            scale=sign * rope.scale, offset=offset).astype(keys.dtype)

    class PreRope(base_cls):  # type: ignore[misc, valid-type]
        def _keys_in(self, keys: mx.array) -> mx.array:
            # update_and_fetch calls this before advancing `offset`: the new keys sit at offset, offset + 1, ...
            return rotate(super()._keys_in(keys), self.offset, -1.0)

        def _dense_history(self, store: dict, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
            keys, values = super()._dense_history(store, dtype)  # every token, positions 0 .. offset - 1
            return rotate(keys, 0, 1.0), values

    return PreRope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", action="append", required=True)
    parser.add_argument("--start", type=int, action="append", required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--specs", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()

    from engine.runtime import prepare_runtime

    prepare_runtime()
    import mlx.core as mx
    from near_lossless import paired

    from engine.kvcache import KVCacheBuilder, KVCacheConfig
    from engine.kvcache.evaluate import teacher_forced_token_stats
    from engine.models.catalog import load_model
    from engine.models.default_model import ensure_default_model

    model, tokenizer, info = load_model(ensure_default_model())
    rope = model.model.layers[0].self_attn.rope
    probe = mx.random.normal((1, 2, 5, rope.dims))
    there = mx.fast.rope(probe, rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale, offset=7)
    back = mx.fast.rope(there, rope.dims, traditional=rope.traditional, base=rope.base, scale=-rope.scale, offset=7)
    assert float(mx.max(mx.abs(rope(probe, offset=7) - there))) == 0.0, "mx.fast.rope is not the model's RoPE"
    assert float(mx.max(mx.abs(back - probe))) < 1e-5, "negative scale does not invert RoPE"

    specs = [s.strip() for s in args.specs.split(",") if s.strip()]
    factories = {}
    for spec in specs:
        config = KVCacheConfig.parse(spec.removesuffix("@pre"))
        builder = KVCacheBuilder(config).for_model(model)
        if spec.endswith("@pre"):
            n_layers = len(builder.build())
            cls = pre_rope_class(type(builder.build()[0]), rope)
            factories[spec] = lambda config=config, cls=cls, n=n_layers: [cls(config, layer_index=i) for i in range(n)]
        else:
            factories[spec] = builder.build
    per_spec: dict[str, list] = {spec: [] for spec in specs}
    windows = []
    began = time.time()
    for text in args.text:
        ids = list(tokenizer.encode(Path(text).read_text(encoding="utf-8", errors="replace"), add_special_tokens=False))
        for start in args.start:
            tokens = ids[start : start + args.tokens]
            windows.append({"text": Path(text).name, "start": start, "tokens": len(tokens)})
            stats = teacher_forced_token_stats(model, tokens, factories, specs[0], 64, len(tokens) // 2)
            for spec, value in stats.items():
                per_spec[spec].append(value)
            print(f"window {Path(text).name}@{start}: {time.time() - began:.0f} s", flush=True)
    reference = np.concatenate([s.nll for s in per_spec[specs[0]]])
    rows = []
    for spec in specs:
        delta, se = paired(np.concatenate([s.nll for s in per_spec[spec]]), reference)
        kl = float(np.concatenate([s.kl for s in per_spec[spec]]).mean())
        top1 = float(np.concatenate([s.top1_agrees for s in per_spec[spec]]).mean())
        rows.append({"spec": spec.removesuffix("@pre"), "keys_before_rope": spec.endswith("@pre"), "delta_nll": delta, "delta_nll_se": se, "ppl_change": math.expm1(delta),
                     "mean_kl": kl, "top1": top1})
        print(f"{spec:56s} {100 * math.expm1(delta):+8.2f} % ± {100 * se:.2f}  KL {kl:.4f}  top1 {top1:.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "schema": "velox-prerope-probe/1", "model": info.name, "windows": windows, "chunk": 64,
            "scored": "second half of each window", "reference": specs[0], "command": " ".join(sys.argv),
            "seconds": time.time() - began, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
