"""How many operations one whole-model decode step records, cache by cache: the GPU launches a step pays.

    python benchmarks/launch_count.py --specs fp16,kivi:k4v4:g64:s4:key_block=128 [--context 1000] [--shape 8b|tiny]
        [--out counts.json]

On the lent GPU a decode step of the 8B shape is bound by neither the weights' bytes nor the cache's: decode.py's
fp16 step takes ~9 ms where reading every byte once takes ~1.5. What a cache adds to a step is mostly operations,
each a launch (and a gap) on the GPU, so this counts them: for each spec (decode.py's spec syntax, `#NAME=VALUE`
variants included) the 8B-shaped model's caches are filled with `--context` random tokens, one step
`model(token, cache=caches)` is recorded (not evaluated) and the graph behind its logits and every cache's state is
written with `mx.export_to_dot` and its operation nodes counted by primitive. Rows: `spec`, `operations`,
`launches` (operations less the VIEW_PRIMITIVES, which launch nothing on contiguous input: an upper bound),
`per_layer_over_fp16` and `launches_per_layer_over_fp16` ((count - fp16's) / layers, where an fp16 row ran first),
`by_primitive`. Which path a cache records depends on the backend (its kernels on a GPU, the reference
path on a CPU), so the figures that matter come from the GPU; `--shape tiny` on a CPU checks the command.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Primitives that are views or metadata on a GPU (no kernel) when their input is contiguous, as a decode step's are:
# a step's launches are at most its operations less these.
VIEW_PRIMITIVES = frozenset({"Broadcast", "ExpandDims", "Flatten", "Reshape", "Slice", "Squeeze", "Transpose",
                             "Unflatten"})

# An operation node of mx.export_to_dot's output: `{ 1234 [label ="Matmul", shape=rectangle]; }` (arrays are
# quoted letters without a shape).
_OPERATION = re.compile(r'\[label ="([^"]*)", shape=rectangle\]')


def count_operations(dot_text: str) -> collections.Counter[str]:
    """The operation nodes of a graph in mx.export_to_dot's format, by primitive name."""
    return collections.Counter(_OPERATION.findall(dot_text))


def step_operations(spec: str, context: int, shape: dict[str, Any], model: Any) -> collections.Counter[str]:
    """The operations of one recorded decode step of `model` over caches of `spec` holding `context` tokens."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from benchmarks.decode import fill, make_caches, spec_constants

    with spec_constants(spec) as cache_spec:
        caches = make_caches(cache_spec, shape["layers"], shape)
        fill(caches, context, shape)
        token = mx.array([[128]], dtype=mx.int32)
        logits = model(token, cache=caches)
        state = [v for c in caches for _, v in tree_flatten(c.state) if isinstance(v, mx.array)]
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "step.dot"
            mx.export_to_dot(str(path), logits, *state)
            return count_operations(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default="fp16,affine:k4v4:g64", help="comma-separated cache specs (decode.py's)")
    parser.add_argument("--context", type=int, default=1000, help="tokens in each cache before the step")
    parser.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)

    import mlx.core as mx

    from benchmarks import decode

    shape = decode.SHAPES[args.shape]
    model = decode.build_model(shape)
    decode._CALIBRATION_MODEL[:] = [model]  # key_widths=calibrated is measured on it, as decode.py does
    rows: list[dict[str, Any]] = []
    fp16: dict[str, Any] | None = None  # the fp16 row, once it ran
    for spec in [s for s in args.specs.split(",") if s]:
        counts = step_operations(spec, args.context, shape, model)
        total = sum(counts.values())
        launches = total - sum(n for name, n in counts.items() if name in VIEW_PRIMITIVES)
        row: dict[str, Any] = {"spec": decode.split_spec(spec)[0], **decode.constants_entry(spec),  # as decode.py's
                               "operations": total, "launches": launches, "by_primitive": dict(counts.most_common())}
        if spec == "fp16":
            fp16 = row
        if fp16 is not None:
            row["per_layer_over_fp16"] = (total - fp16["operations"]) / shape["layers"]
            row["launches_per_layer_over_fp16"] = (launches - fp16["launches"]) / shape["layers"]
        rows.append(row)
        top = ", ".join(f"{name} {n}" for name, n in counts.most_common(8))
        print(f"{spec}: {total} operations, {launches} launches at most ({top})", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"schema": "velox-bench/1", "kind": "launch-count", "device": str(mx.default_device()),
                                        "mlx": mx.__version__, "context": args.context, "shape": shape, "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
