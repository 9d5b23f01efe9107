"""Where one layer's prefill chunk goes, part by part: a cache of one layer of `decode.py`'s 8B shape (32 query and
8 kv heads of 128) holding N tokens, then a chunk of C new ones. Timed, each the median of R runs after two warm-ups
that compile what they meet:

* `encode`: the chunk's encode alone (`_encode`: quantize, key widths, outliers; compressed caches only),
* `update`: the chunk's whole update (`update_and_fetch`: encode and append; trimmed back after each run, untimed
  since 2026-12-03's thirteenth session: results before it include the trim),
* `history`: the decode of the compressed history a chunk attends over (`_dense_history`: the decode with the sink
  tokens and the window joined to it; compressed caches only),
* `decoded`: that decode alone (`_decoded_history`: on a GPU, the history-decode kernel's launch),
* `attend`: the chunk's attention through mlx-lm's SDPA call (the history decoded inside, as in the model).

What an option costs shows by running specs that differ in it (key_widths, key_outliers, symmetric_values, rope).
`key_widths=uniform` stands for a seeded random key-widths table (`prefill_chunks.uniform_widths`); specs with
rope=pre need the model's RoPE written in (rope_dims, rope_base, ...), as `decode.py`'s rows write it.

    python benchmarks/prefill_layer.py --history 14336 --chunk 2048 --out prefill-layer.json --specs A,B,...

For a GPU: a CPU runs it, but it times the reference path there. `--shape tiny` checks the command in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import decode as bench  # noqa: E402
from benchmarks import prefill_chunks  # noqa: E402
from benchmarks.harness.common import median_ms  # noqa: E402

PARTS = ("encode", "update", "history", "decoded", "attend")


def profile_layer(spec: str, shape: dict[str, Any], history: int, chunk: int, repeats: int,
                  parts_wanted: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """One spec's row: the parts' median times (ms) for one layer holding `history` tokens."""
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention

    (cache,) = prefill_chunks.caches_for(spec, {**shape, "layers": 1})
    n_kv, head_dim, dtype = shape["kv_heads"], shape["head_dim"], getattr(mx, shape["dtype"])
    mx.random.seed(1)

    def tokens(n: int) -> tuple[mx.array, mx.array]:
        return (mx.random.normal((1, n_kv, n, head_dim)).astype(dtype),
                mx.random.normal((1, n_kv, n, head_dim)).astype(dtype))

    for start in range(0, history, chunk):
        cache.update_and_fetch(*tokens(min(chunk, history - start)))
        mx.eval(cache.state)
    keys, values = tokens(chunk)
    queries = mx.random.normal((1, shape["heads"], chunk, head_dim)).astype(dtype)
    mx.eval(keys, values, queries)

    def encode() -> None:
        mx.eval(cache._encode(keys, values))

    def update() -> None:
        cache.update_and_fetch(keys, values)
        mx.eval(cache.state)

    def trim_back() -> None:  # after each update, untimed: the layer holds `history` tokens again
        cache.trim(chunk)
        mx.eval(cache.state)

    def history_decode() -> None:
        mx.eval(cache._dense_history(cache._compressed_view(), dtype))

    def decoded() -> None:
        mx.eval(*cache._decoded_history(cache._compressed_view(), dtype))

    # A 16-bit cache has no encode or history decode: its update and attention only.
    compressed = hasattr(cache, "_encode")
    parts = ({"encode": encode, "update": update, "history": history_decode, "decoded": decoded} if compressed
             else {"update": update})
    parts = {name: run for name, run in parts.items() if name in parts_wanted}
    undo = {"update": trim_back}
    for _ in range(2):
        for name, run in parts.items():
            run()
            if name in undo:
                undo[name]()
    row: dict[str, Any] = {"spec": spec, "history": history, "chunk": chunk}
    for name, run in parts.items():
        row[f"{name}_ms"] = median_ms(run, repeats, after=undo.get(name))
    cached_keys, cached_values = cache.update_and_fetch(keys, values)  # what the attention runs on
    mx.eval(cache.state)
    row["nbytes"] = cache.nbytes
    if "attend" not in parts_wanted:
        return row

    def attend() -> None:
        mx.eval(scaled_dot_product_attention(queries, cached_keys, cached_values, cache=cache,
                                             scale=head_dim ** -0.5, mask="causal"))

    attend()
    row["attend_ms"] = median_ms(attend, repeats)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", required=True, help="comma-separated cache specs")
    parser.add_argument("--history", type=int, default=14336, help="tokens the layer holds before the chunk")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated parts to time (default: %(default)s; on a CPU attention takes minutes)")
    parser.add_argument("--shape", choices=sorted(bench.SHAPES), default="8b", help="tiny: a check of the command")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from engine.runtime import prepare_runtime

    prepare_runtime()
    import mlx.core as mx

    parts = tuple(part for part in args.parts.split(",") if part)
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}, not {args.parts!r}")
    shape = bench.SHAPES[args.shape]
    rows = []
    for spec in args.specs.split(","):
        with bench.spec_constants(spec) as text:  # SPEC#NAME=VALUE: an engine constant set for this row
            row = profile_layer(text, shape, args.history, args.chunk, args.repeats, parts) | bench.constants_entry(spec)
        print(json.dumps(row), flush=True)
        rows.append(row)
        args.out.write_text(json.dumps({"schema": "velox-bench/1", "kind": "prefill-layer", "device":
                                        str(mx.default_device()), "mlx": mx.__version__, "shape": shape,
                                        "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
