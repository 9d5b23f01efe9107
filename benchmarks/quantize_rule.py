"""What MLX's GPU `mx.quantize` costs KIVI's key blocks against its CPU rule, on the embedded model's real keys.

MLX's CUDA and Metal `mx.quantize` start a group's max at 0 (mlx/backend/cuda/quantized/affine_quantize.cu, the Metal
`affine_quantize`: `w_max = 0`) and round half away from zero; its CPU backend takes the group's true max and rounds
half to even. A key channel over a 128-token block (KIVI keys, before RoPE as the app's levels store them) whose
entries are all negative is therefore quantized over [min, 0] on a GPU. This script counts such blocks in SmolLM2's
keys on real prose and compares the squared reconstruction error of both rules (plain blocks, no outliers or widths),
emulating each in NumPy with the scale and bias kept in bfloat16 as the store keeps them:

    python benchmarks/quantize_rule.py --out benchmarks/results/quantize-rule-cpu.json

On a GPU, `--groups` instead quantizes three 128-entry groups (all negative, all positive, both signs) with
`mx.quantize` on the GPU and on the CPU stream, each decoded on its own device (the rule as a GPU runs it):

    python benchmarks/quantize_rule.py --groups --out benchmarks/results/quantize-rule-h200.json

Velox's KIVI encode kernel (engine/kvcache/kernels/kivi_encode.py) follows the CPU rule on every backend.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROSE = ROOT / "tests" / "data" / "prose_sample.txt"
BLOCK = 128


def decoded(groups, bits: int, gpu: bool):  # noqa: ANN001, ANN201 - NumPy arrays
    """Groups (last axis) quantized and decoded by MLX's affine rule, its GPU form or its CPU form."""
    import mlx.core as mx
    import numpy as np

    low, high = groups.min(-1, keepdims=True), groups.max(-1, keepdims=True)
    if gpu:
        high = np.maximum(high, 0)
    levels = np.float32((1 << bits) - 1)
    step = np.maximum((high - low) / levels, np.float32(1e-7)).astype(np.float32)
    side = np.abs(low) > np.abs(high)
    step = np.where(side, step, -step)
    edge = np.where(side, low, high)
    rounded = (lambda v: np.sign(v) * np.floor(np.abs(v) + 0.5)) if gpu else np.rint
    q0 = rounded(edge / step)
    scale = np.where(q0 == 0, step, edge / np.where(q0 == 0, 1, q0)).astype(np.float32)
    bias = np.where(q0 == 0, 0, edge).astype(np.float32)
    codes = np.clip(rounded((groups - bias) / scale), 0, levels)

    def kept(x):  # noqa: ANN001, ANN202
        return np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))

    return codes * kept(scale) + kept(bias)


def groups_on_device(out: Path) -> int:
    """Three 128-entry bfloat16 groups quantized at 3 bits by `mx.quantize` on the default device and on the CPU."""
    import mlx.core as mx

    rows = []
    for low, high in ((-7.0, -5.0), (5.0, 7.0), (-7.0, 5.0)):
        group = mx.linspace(low, high, BLOCK).reshape(1, BLOCK).astype(mx.bfloat16)
        row: dict[str, object] = {"group": f"{low}..{high}"}
        for name, stream in (("gpu", mx.default_stream(mx.default_device())), ("cpu", mx.cpu)):
            with mx.stream(stream):
                codes, scales, biases = mx.quantize(group, group_size=BLOCK, bits=3)
                error = mx.abs(mx.dequantize(codes, scales, biases, group_size=BLOCK, bits=3).astype(mx.float32)
                               - group.astype(mx.float32)).max()
                row |= {f"{name}_scale": scales.astype(mx.float32).item(), f"{name}_bias": biases.astype(mx.float32).item(),
                        f"{name}_max_error": error.item()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out.write_text(json.dumps({
        "schema": "velox-bench/1", "kind": "quantize-rule-gpu", "device": str(mx.default_device()), "mlx": mx.__version__,
        "rows": rows,
        "note": "Each 128-entry bfloat16 group (mx.linspace(low, high, 128)) quantized at 3 bits by mx.quantize on the "
                "default device ('gpu_') and on the CPU stream ('cpu_'), decoded by mx.dequantize on the same device; "
                "max_error is the largest decoded error. Command: python benchmarks/quantize_rule.py --groups --out "
                "<this file>.",
    }, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--groups", action="store_true", help="the three groups on this device and the CPU")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.groups:
        return groups_on_device(args.out)

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kvcache.quant.rope import model_rope
    from engine.models.catalog import load_model
    from engine.models.default_model import ensure_default_model

    model, tokenizer, _ = load_model(ensure_default_model())
    ids = tokenizer.encode(PROSE.read_text(encoding="utf-8"), add_special_tokens=False)
    tokens = args.tokens // BLOCK * BLOCK
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    cache = make_prompt_cache(model)
    for start in range(0, tokens, 512):
        model(mx.array(ids[start : start + 512])[None], cache=cache)
        mx.eval([c.state for c in cache])
    rope = model_rope(model)
    blocks = []
    for layer in cache:  # keys before RoPE, in the model's bfloat16: [kv heads, channels, blocks, BLOCK]
        keys = rope.rotate(layer.keys[..., :tokens, :], 0, inverse=True).astype(mx.bfloat16)
        x = np.array(keys.astype(mx.float32))[0]
        blocks.append(x.transpose(0, 2, 1).reshape(x.shape[0], x.shape[2], tokens // BLOCK, BLOCK))
    rows = []
    for bits in (2, 3, 4):
        errors = {rule: [((decoded(g, bits, rule == "gpu") - g) ** 2).sum(-1) for g in blocks] for rule in ("cpu", "gpu")}
        negative = [g.max(-1) < 0 for g in blocks]
        on = {rule: sum(float(e[n].sum()) for e, n in zip(errs, negative, strict=True)) for rule, errs in errors.items()}
        total = {rule: sum(float(e.sum()) for e in errs) for rule, errs in errors.items()}
        rows.append({"bits": bits, "all_negative_blocks": sum(int(n.sum()) for n in negative) / sum(n.size for n in negative),
                     "squared_error_gpu_over_cpu": total["gpu"] / total["cpu"],
                     "on_all_negative_blocks": on["gpu"] / on["cpu"]})
        print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps({
        "schema": "velox-bench/1", "kind": "quantize-rule", "model": "SmolLM2-135M-Instruct (embedded)",
        "tokens": tokens, "block": BLOCK, "layers": len(cache), "rows": rows,
        "note": "Keys before RoPE of real prose (tests/data/prose_sample.txt, repeated), every layer and kv head, per "
                "channel over 128-token blocks; MLX's affine rule as its GPU backends compute it (max started at 0, "
                "round half away) against its CPU rule (true max, half to even), both emulated in NumPy with "
                "bfloat16 scale and bias. Command: python benchmarks/quantize_rule.py --out <this file>.",
    }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
