"""Where a compressed cache's one-token update goes on a GPU: its parts over all 32 layers of the 8B shape.

    python benchmarks/update_profile.py --specs affine:k4v4:g64,rvq:k4v4:g64 [--contexts 8193,32769]
        [--repeats 10] [--out update.json] [--shape 8b|tiny]

decode_profile.py times `update_and_fetch` of one token whole; this splits it, each part as the median over
`--repeats` evaluations of all 32 layers at once (ms for the 32 layers; a cache's parts in the same process):

    update     `update_and_fetch` of one token, as a decode step calls it
    transform  the token's `_keys_in` / `_values_in` (a rotation where the method has one) and the 16-bit cast
    encode     `_encode` of that transformed token (the encode kernel where one runs)
    append     `_append_compressed` of that encoded token into the store (a slice update per array)
    incoming   `_encode_incoming` of the token as the model gives it: what `update_and_fetch` runs in place of
               transform + encode where a cache encodes new tokens directly (`_encodes_directly`: no window, the
               sinks full), e.g. the rotation applied in the encode kernel (kernels.encode.ROTATE_ENCODE_BACKENDS)

An append whose time grows with the context copies its buffers instead of updating them in place, so the parts are
timed at each context. Caches whose new token waits in a 16-bit window (KIVI) append only once a block fills; for
those `encode` and `append` are not a step's cost and are not timed. A GPU tool: on a CPU (`--shape tiny`) it runs,
but its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.common import median_ms  # noqa: E402


def profile(spec: str, context: int, shape: dict[str, Any], repeats: int) -> dict[str, Any]:
    import mlx.core as mx

    from benchmarks.decode import fill, make_caches, spec_constants, spec_row

    row = spec_row(spec, context)
    with spec_constants(spec) as cache_spec:
        caches = make_caches(cache_spec, shape["layers"], shape)
        fill(caches, context, shape)
        kv_shape = (1, shape["kv_heads"], 1, shape["head_dim"])
        keys = mx.random.normal(kv_shape).astype(mx.bfloat16)
        values = mx.random.normal(kv_shape).astype(mx.bfloat16)
        mx.eval(keys, values)

        def update() -> Any:
            return [c.state for c in caches if c.update_and_fetch(keys, values) is not None]

        def transform() -> Any:
            return [(c._keys_in(keys).astype(c._dense_dtype), c._values_in(values).astype(c._dense_dtype))
                    for c in caches]

        row["update"] = median_ms(update, repeats, warmup=2)
        if not hasattr(caches[0], "_keys_in"):  # a 16-bit cache: nothing but the update
            return row
        row["transform"] = median_ms(transform, repeats, warmup=2)
        if caches[0].token_block == 1 and not caches[0].config.residual_window:
            rotated = transform()
            mx.eval(rotated)

            def encode() -> Any:
                return [c._encode(k, v) for c, (k, v) in zip(caches, rotated, strict=True)]

            chunks = encode()
            mx.eval(chunks)

            def append() -> Any:
                for c, chunk in zip(caches, chunks, strict=True):
                    c._append_compressed(chunk)
                return [list(c._store.values()) for c in caches]

            row["encode"] = median_ms(encode, repeats, warmup=2)
            row["append"] = median_ms(append, repeats, warmup=2)
            row["arrays_appended"] = len(chunks[0])
            if caches[0]._encodes_directly():
                row["incoming"] = median_ms(lambda: [c._encode_incoming(keys, values) for c in caches], repeats,
                                            warmup=2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default="affine:k4v4:g64,turboquant:k4v4:g64,rvq:k4v4:g64")
    parser.add_argument("--contexts", default="8193,32769")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import mlx.core as mx

    from benchmarks import decode

    shape = decode.SHAPES[args.shape]
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for spec in [s for s in args.specs.split(",") if s]:
            rows.append(profile(spec, context, shape, args.repeats))
            gc.collect()
            mx.clear_cache()  # one spec's buffers gone before the next is filled
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"schema": "velox-bench/1", "kind": "update-profile",
                                        "device": str(mx.default_device()), "mlx": mx.__version__,
                                        "shape": shape, "repeats": args.repeats, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
