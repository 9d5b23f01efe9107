"""Whole-model decode speed of every KV cache on a GPU: `velox bench decode`.

    velox bench decode --out decode.json [--contexts 8193,32769,131073] [--specs fp16,kivi:4:64,...]
                       [--steps 10] [--warmup 3] [--rounds 1] [--no-generate] [--prefill 32768] [--shape 8b|tiny]
    python benchmarks/decode.py ...   (the same, from a checkout without installing)
    python benchmarks/decode.py --out decode.json --merge 8k.json 32k.json 131k.json   (one record of several runs:
                                                                                       see `merge_records`)

A Llama-3.1-8B-shaped model (32 layers, 32 query / 8 kv heads, head_dim 128, hidden 4096, MLP 14336,
vocabulary 128256) built with mlx-lm's own llama class, its weights random and quantized to 4 bits in groups
of 64 with `nn.quantize` (like an mlx-community 4-bit model); everything runs in bfloat16. For each cache
and context N, every layer's cache is filled with N random tokens through `update_and_fetch` in 4,096-token
chunks (N untidy on purpose: 8k+1, 32k+1, 128k+1), then the median time of one whole-model decode step,
`model(token, cache=caches)`, each evaluated before the next is recorded, is measured (each step appends its
token, as decoding does); and, unless --no-generate, the tokens per second of mlx-lm's own decode loop over the
same caches (`generate_step`, greedy: what mlx_lm.stream_generate, the app and `velox serve` run; it records
the next step while the GPU runs the current one, so host and GPU time overlap).

With --rounds N (N > 1) every cache of a context is filled at once and all are timed in turn N times: each
row then holds its per-round steps and the median and range of its per-round ratios to fp16, so the ratio does not
carry the drift between runs (one figure of the same code moved by 25 % between runs on the lent GPU).

Beside each figure is the step's memory bound: (weight bytes + the bytes the caches hold) / read
bandwidth, the bandwidth measured here with a large reduction; `bound_tok_s` is the speed a step reading
every byte once at that bandwidth would reach. With --prefill N, a chunked prefill of an N-token prompt
(2,048-token chunks through the model, as mlx-lm's generate does; and again with the next chunk recorded while the
current one runs, as the app does: `pipelined_prefill_tok_s`) is timed for a few caches too.

Spec strings: `fp16` (Velox's 16-bit cache, the reference row of the ratios), `mlx-kv` (mlx-lm's KVCache),
`no-history` (no cache at all: each step attends to its own token alone, so its speed is the model's without reading
any history, the most any cache can reach in that run; its `vs_fp16` is the ceiling of every cache's ratio there),
`mlx-q:BITS[:GROUP]` (mlx-lm's QuantizedKVCache), `METHOD[:BITS[:GROUP]][+wN][+sN]` (a Velox method, e.g.
kivi:4:64, turboquant:3, affine:4:64+w128+s4), or one in the project's spec syntax (`velox methods`; e.g.
kivi:k4v4:g64:s4:key_block=128), and `...@off` for a Velox method with kernels off; `...#NAME=VALUE` (repeatable)
sets a constant of engine.kvcache.kernels.decode, .dequantize or .encode (a JSON value) while that spec's caches are filled
and timed, so a kernel variant and the default are timed in the same run (e.g. `kivi:k2v2:g64#TILED_PREFETCH=false`;
its rows hold the cache spec in `spec` and the constants in `kernel_constants`). Rows:
`spec`, `context`, `tok_s`, `ms`, `bound_tok_s`, `held_bytes`, `vs_fp16`, `gen_tok_s`, `gen_ms`, `gen_vs_fp16`,
or `error` where it failed.

`--shape tiny` swaps the 8B shape for a 2-layer llama (4 query / 2 kv heads, head_dim 64) and a 64 MiB
bandwidth probe: seconds on a CPU, for checking the command end to end, not for figures. The module imports
no MLX until `run` (the `velox bench` parser is built from `add_arguments` before the runtime is prepared).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_CONTEXTS = (8193, 32769, 131073)
DEFAULT_SPECS = (
    "fp16", "mlx-kv", "mlx-q:4",
    "affine:4:64", "rotated:4:64", "kivi:4:64", "kivi:4:32", "kivi:3:64", "kivi:2:64",
    "turboquant:4", "turboquant:3", "rvq:4", "rvq:3",
)
PREFILL_SPECS = ("fp16", "mlx-kv", "kivi:4:64", "affine:4:64", "turboquant:4")
FILL_CHUNK = 4096
PREFILL_CHUNK = 2048
SHAPES: dict[str, dict[str, Any]] = {
    "8b": {
        "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 4096, "mlp": 14336,
        "vocab": 128256, "weight_bits": 4, "weight_group": 64, "dtype": "bfloat16",
    },
    # For checking the command on a CPU in seconds; hidden, MLP and vocabulary are multiples of the weight
    # group so `nn.quantize` takes every layer, as it does for the 8B shape.
    "tiny": {
        "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64, "hidden": 256, "mlp": 512,
        "vocab": 512, "weight_bits": 4, "weight_group": 64, "dtype": "bfloat16",
    },
}
SHAPE = SHAPES["8b"]
# Bytes the bandwidth probe reduces: 4 GiB is far beyond any cache on the GPU; the tiny shape needs none of it.
READ_PROBE_BYTES = {"8b": 4 << 30, "tiny": 64 << 20}


def build_model(shape: dict[str, Any] = SHAPE) -> nn.Module:
    """The llama of `shape` (by default 8B-shaped) with random 4-bit g64 weights (bf16 activations)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(
        model_type="llama", hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        intermediate_size=shape["mlp"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], rms_norm_eps=1e-5, vocab_size=shape["vocab"], rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    model = Model(args)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=shape["weight_group"], bits=shape["weight_bits"])
    mx.eval(model.parameters())
    return model


def weight_bytes(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def read_bandwidth(n_bytes: int = 4 << 30, repeats: int = 10) -> float:
    """Bytes/s of a large reduction (reads every byte once), best of `repeats`."""
    import mlx.core as mx

    data = mx.random.uniform(shape=(n_bytes // 4,), dtype=mx.float32)
    mx.eval(data)
    best = 0.0
    for _ in range(repeats):
        mx.synchronize()
        began = time.perf_counter()
        mx.eval(mx.sum(data))
        mx.synchronize()
        best = max(best, n_bytes / (time.perf_counter() - began))
    del data
    return best


def set_kernel_constants(constants: dict[str, Any]) -> dict[str, Any]:
    """Sets constants of engine.kvcache.kernels.decode (or, failing that, .dequantize, .encode or .kivi_encode,
    e.g. KIVI_ENCODE_BACKENDS=["cuda"], of the caches' engine.kvcache.base, e.g. PREFILL_AHEAD_CHUNKS, or of
    engine.kvcache.quant.fused, COMPILE_ENCODE) by name; returns their previous values."""
    from engine.kvcache import base as cache_base
    from engine.kvcache.kernels import decode as decode_kernels
    from engine.kvcache.kernels import dequantize as dequantize_kernels
    from engine.kvcache.kernels import encode as encode_kernels
    from engine.kvcache.kernels import kivi_encode
    from engine.kvcache.quant import fused

    previous = {}
    modules = (decode_kernels, dequantize_kernels, encode_kernels, kivi_encode, cache_base, fused)
    for name, value in constants.items():
        module = next((m for m in modules if hasattr(m, name)), None)
        if module is None:
            raise SystemExit(f"engine.kvcache.kernels.decode, .dequantize, .encode, .kivi_encode, engine.kvcache.base and "
                             f"engine.kvcache.quant.fused have no constant {name!r}")
        previous[name] = getattr(module, name)
        setattr(module, name, value)
    return previous


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """(the cache spec, the kernel constants of its `#NAME=VALUE` parts)."""
    text, *pairs = spec.split("#")
    return text, {name: json.loads(value) for name, _, value in (pair.partition("=") for pair in pairs)}


def spec_row(spec: str, context: int) -> dict[str, Any]:
    """A result row's start: the cache spec (the one spec syntax, readable by KVCacheConfig.parse) and, for a
    kernel variant, its constants."""
    return {"spec": split_spec(spec)[0], "context": context} | constants_entry(spec)


def constants_entry(spec: str) -> dict[str, Any]:
    """A row's `kernel_constants` entry for a spec's `#NAME=VALUE` parts (empty without any)."""
    constants = split_spec(spec)[1]
    return {"kernel_constants": constants} if constants else {}


@contextlib.contextmanager
def spec_constants(spec: str) -> Iterator[str]:
    """The spec without its `#NAME=VALUE` parts, with those constants set for the block (restored after)."""
    text, constants = split_spec(spec)
    previous = set_kernel_constants(constants)
    try:
        yield text
    finally:
        set_kernel_constants(previous)


def profiled_functions(profiler: Any) -> list[tuple[str, int, float, float]]:
    """(`file:line(name)`, calls, own seconds, cumulative seconds) of every function a cProfile profiler saw, the most
    own time first (host_profile.py and loop_stall_profile.py read their profiles through it)."""
    import pstats

    rows = [(f"{Path(path).name}:{line}({name})", calls, own, cumulative)
            for (path, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items()]  # type: ignore[attr-defined]
    return sorted(rows, key=lambda row: -row[2])


# The model `key_widths=calibrated` and vq's codebooks are measured on (set by `run`), and each such config once
# measured: the widths of a random model's channels are no guide to quality, but they give the layers the class sizes
# a calibration gives.
_CALIBRATION_MODEL: list[Any] = []
_CALIBRATED: dict[str, Any] = {}
_CODEBOOKS: dict[str, str] = {}  # vq codebook folders made by `_with_codebooks`, by bits, rotation, seed and shape


def _calibration_input(shape: dict[str, Any]) -> tuple[nn.Module, list[int]]:
    """The model calibrations are measured on and its 1,024 seeded random tokens; a tool that times caches without
    a model of its own (decode_profile.py, gpu kernels alone) gets one of `shape` built here."""
    import numpy as np

    if not _CALIBRATION_MODEL:
        _CALIBRATION_MODEL[:] = [build_model(shape)]
    return _CALIBRATION_MODEL[0], np.random.default_rng(0).integers(0, shape["vocab"], 1024).tolist()


def _calibrated(config: Any, shape: dict[str, Any]) -> Any:
    """`config` with key_widths=calibrated measured on the benchmark's model (`_calibration_input`), once."""
    from engine.kvcache import KVCacheBuilder

    text = config.to_json()
    if text not in _CALIBRATED:
        model, tokens = _calibration_input(shape)
        _CALIBRATED[text] = KVCacheBuilder(config).for_model(model, calibration_tokens=tokens).config
    return _CALIBRATED[text]


def _with_codebooks(config: Any, shape: dict[str, Any]) -> Any:
    """`config` (method vq, no `codebooks` option) with codebooks calibrated on the benchmark's model
    (`_calibration_input`), saved once per bit width in a folder of this process: product VQ needs a
    calibration of its model, and this model's weights are random, so its codebooks are made here, not shipped
    (their fit does not change the speed a step has: every code costs the same lookup)."""
    import tempfile

    from engine.kvcache.calibration import calibrate_vq
    from engine.kvcache.quant.vq import model_identity, save_codebooks

    key = f"vq{config.key_bits}:{config.rotation}:{config.seed}:{shape['layers']}:{shape['head_dim']}"
    if key not in _CODEBOOKS:
        model, tokens = _calibration_input(shape)
        arrays = calibrate_vq(model, tokens, config.key_bits, rotation=config.rotation, seed=config.seed)
        folder = tempfile.mkdtemp(prefix="velox-bench-vq-")
        save_codebooks(folder, config.key_bits, arrays, model_identity(model, name="velox-bench"),
                       rotation=config.rotation, seed=config.seed)
        _CODEBOOKS[key] = folder
    return replace(config, options={**config.options, "codebooks": _CODEBOOKS[key]})


# The spec of the ceiling row (see the module doc): not a cache a user can pick, so not in the harness's syntax.
NO_HISTORY = "no-history"


@functools.cache
def _no_history_cache() -> type:
    """mlx-lm's KVCache that keeps nothing: `update_and_fetch` hands back the tokens it is given, so the model's
    attention reads only the step's own keys and values, and the offset still moves on (RoPE positions as a
    decoding cache's). A class made on first use: this module imports no MLX until `run`."""
    from mlx_lm.models.cache import KVCache

    class NoHistoryCache(KVCache):
        def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
            self.offset += keys.shape[2]
            return keys, values

        @property
        def state(self) -> list[Any]:
            return []

        @property
        def nbytes(self) -> int:
            return 0

    return NoHistoryCache


def make_caches(spec: str, n_layers: int, shape: dict[str, Any] = SHAPE) -> list[Any]:
    """Per-layer caches for a spec string (see the module doc)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if spec == "mlx-kv":
        return [KVCache() for _ in range(n_layers)]
    if spec == NO_HISTORY:
        return [_no_history_cache()() for _ in range(n_layers)]
    if spec.startswith("mlx-q:"):
        parts = spec[len("mlx-q:"):].split(":")
        bits, group = int(parts[0]), int(parts[1]) if len(parts) > 1 else 64
        return [QuantizedKVCache(group_size=group, bits=bits) for _ in range(n_layers)]
    from engine.errors import ConfigError
    from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape

    text, _, mode = spec.partition("@")
    model_shape = ModelShape(n_layers=n_layers, n_heads=shape["heads"], n_kv_heads=shape["kv_heads"],
                             head_dim=shape["head_dim"])
    try:  # the project's one spec syntax (KVCacheConfig.parse), e.g. kivi:k4v4:g64:s4:key_block=128
        config = KVCacheConfig.parse(text)
    except ConfigError:
        config = None  # this script's older form, below
    if config is not None:
        if config.method not in ("fp16", "fp32"):
            config = replace(config, options={**config.options, "kernels": mode or "auto", "prefill_attention": "auto"})
        if config.options.get("key_widths") == "calibrated":
            config = _calibrated(config, shape)
        if config.method == "vq" and not config.options.get("codebooks"):
            config = _with_codebooks(config, shape)
        return KVCacheBuilder(config).for_shape(model_shape).build()
    head, *extras = text.split("+")
    method, *rest = head.split(":")
    fields: dict[str, Any] = {"method": method}
    if rest:
        fields["key_bits"] = int(rest[0])
    if len(rest) > 1:
        fields["group_size"] = int(rest[1])
    for extra in extras:
        fields["residual_window" if extra[0] == "w" else "sink_tokens"] = int(extra[1:])
    if method not in ("fp16", "fp32"):
        fields["options"] = {"kernels": mode or "auto", "prefill_attention": "auto"}
    return KVCacheBuilder(KVCacheConfig(**fields)).for_shape(model_shape).build()


def cache_bytes(caches: list[Any]) -> int:
    """Bytes a decode step reads from the caches: Velox's `nbytes`; mlx-lm's state (views up to offset)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    total = 0
    for cache in caches:
        if hasattr(cache, "_held_arrays"):
            total += cache.nbytes
        else:
            total += sum(v.nbytes for _, v in tree_flatten(cache.state) if isinstance(v, mx.array))
    return total


def fill(caches: list[Any], context: int, shape: dict[str, Any] = SHAPE) -> None:
    """`context` random tokens into every layer through update_and_fetch, FILL_CHUNK at a time and the last one on
    its own (`prompt_spans`: the bytes held then are what a decoding cache holds)."""
    import mlx.core as mx

    from benchmarks.harness.common import prompt_spans

    chunk = (1, shape["kv_heads"], FILL_CHUNK, shape["head_dim"])
    for start, end in prompt_spans(0, context, FILL_CHUNK):
        n = end - start
        keys = mx.random.normal(chunk).astype(mx.bfloat16)[..., :n, :]
        values = mx.random.normal(chunk).astype(mx.bfloat16)[..., :n, :]
        for cache in caches:
            cache.update_and_fetch(keys, values)
        mx.eval([c.state for c in caches])


def time_decode(model: nn.Module, caches: list[Any], steps: int, warmup: int) -> list[float]:
    import mlx.core as mx

    token = mx.array([[128]], dtype=mx.int32)
    times = []
    for step in range(warmup + steps):
        mx.synchronize()
        began = time.perf_counter()
        logits = model(token, cache=caches)
        mx.eval(logits)
        mx.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - began)
    return sorted(times)


def time_generate(model: nn.Module, caches: list[Any], steps: int, warmup: int,
                  token_seconds: list[float] | None = None, token_offsets: list[int] | None = None,
                  token_peaks: list[int] | None = None) -> float:
    """Seconds per token of mlx-lm's own decode loop (`generate_step`, greedy) over the filled caches, after
    `warmup` tokens: the loop mlx_lm.stream_generate and so the app and `velox serve` run, which records
    step n+1 while the GPU runs step n (`mx.async_eval`), so host time and GPU time overlap there. Each timed
    token's own interval is appended to `token_seconds` where given (a stall shows there, not in the mean), and
    the cache's length at that token to `token_offsets` (within one token: the loop runs a step ahead), so a stall
    can be matched to the store's growth or a key block's encode; and how far MLX's peak memory rose above its active
    memory at the token before to `token_peaks` (bytes): a store that a step copies instead of writing in place (a
    growth, or an append MLX could not do in place because the step still running holds the buffer) shows there."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    start = int(caches[0].offset)
    prompt = mx.array([128], dtype=mx.int32)
    marks, rises = [], []
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in generate_step(prompt, model, max_tokens=warmup + steps + 1, prompt_cache=caches,
                           sampler=lambda logprobs: mx.argmax(logprobs, axis=-1)):
        marks.append(time.perf_counter())  # each token is read back (.item()) before it is yielded
        rises.append(mx.get_peak_memory() - active)  # host-side counters: no wait for the GPU
        active = mx.get_active_memory()
        mx.reset_peak_memory()
    if token_seconds is not None:
        token_seconds.extend(b - a for a, b in zip(marks[warmup:], marks[warmup + 1:], strict=False))
    if token_peaks is not None:
        token_peaks.extend(rises[warmup + 1:])
    if token_offsets is not None:
        token_offsets.extend(start + index + 1 for index in range(warmup, len(marks) - 1))
    return (marks[-1] - marks[warmup]) / steps


# A token of mlx-lm's loop that takes this many times the median token is counted as a stall.
STALL_FACTOR = 3.0


def _megabytes(values: list[float]) -> str:
    return "[" + ", ".join(f"{value:.0f}" for value in values) + "]"


def token_latency(token_seconds: list[float], token_offsets: list[int] | None = None,
                  token_peaks: list[int] | None = None) -> dict[str, Any]:
    """What a user of the loop feels beside its mean: the median and slowest token (ms), and the stalls (tokens over
    STALL_FACTOR x the median) with the time they added over the median and, given each token's cache length, the
    lengths they happened at; given each token's peak memory rise (`time_generate`), the median token's and the
    stalls' (MB)."""
    if not token_seconds:
        return {}
    ordered = sorted(token_seconds)
    median = statistics.median(ordered)
    stalls = [index for index, t in enumerate(token_seconds) if t > STALL_FACTOR * median]
    latency = {"gen_token_ms_median": median * 1000, "gen_token_ms_max": ordered[-1] * 1000,
               "gen_stalls": len(stalls), "gen_stall_ms": sum(token_seconds[i] - median for i in stalls) * 1000}
    if token_offsets is not None:
        latency["gen_stall_offsets"] = [token_offsets[i] for i in stalls]
    if token_peaks:
        latency["gen_token_peak_mb_median"] = statistics.median(token_peaks) / 1e6
        latency["gen_stall_peak_mb"] = [token_peaks[i] / 1e6 for i in stalls]
    return latency


def interleaved_rows(model: nn.Module, specs: list[str], context: int, args: argparse.Namespace,
                     shape: dict[str, Any], bandwidth: float, weights: int,
                     on_round: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """--rounds N: every spec's caches filled to `context` at once, then N rounds each timing every spec in
    turn, so the 16-bit reference and each cache are measured minutes, not a whole run, apart (on the lent GPU
    one figure moved by 25 % between runs of the same code). Per spec: the median over rounds of each round's
    median step, and `vs_fp16` the median of the per-round ratios to fp16's step, with their range. `on_round` is
    given the rows of the rounds done so far after each round but the last (a caller writes them, so a run that its
    time limit cuts short keeps its finished rounds)."""
    import mlx.core as mx

    filled: dict[str, list[Any]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for spec in specs:
        rows[spec] = spec_row(spec, context)
        try:
            with spec_constants(spec) as text:
                filled[spec] = make_caches(text, shape["layers"], shape)
                fill(filled[spec], context, shape)
            held = cache_bytes(filled[spec])
            rows[spec] |= {"held_bytes": held, "bound_tok_s": bandwidth / (weights + held)}
        except Exception as error:
            rows[spec]["error"] = _error_text(error)
            filled.pop(spec, None)
    steps: dict[str, list[float]] = {spec: [] for spec in filled}
    generated: dict[str, list[float]] = {spec: [] for spec in filled}
    tokens: dict[str, list[float]] = {spec: [] for spec in filled}
    offsets: dict[str, list[int]] = {spec: [] for spec in filled}
    peaks: dict[str, list[int]] = {spec: [] for spec in filled}
    for round_index in range(args.rounds):
        for spec, caches in list(filled.items()):
            try:
                with spec_constants(spec):
                    times = time_decode(model, caches, args.steps, args.warmup)
                    steps[spec].append(times[len(times) // 2])
                    if args.generate:
                        generated[spec].append(time_generate(model, caches, args.steps, args.warmup,
                                                             tokens[spec], offsets[spec], peaks[spec]))
            except Exception as error:
                rows[spec]["error"] = _error_text(error)
                del filled[spec]
        if on_round is not None and round_index < args.rounds - 1:
            on_round([_round_row(dict(row), steps, generated, tokens, offsets, peaks) for row in rows.values()])

    out = []
    for spec, row in rows.items():
        row = _round_row(row, steps, generated, tokens, offsets, peaks)
        if "error" not in row:
            print(f"{spec:16s} {context:7d}: {row['tok_s']:7.1f} tok/s, x{row.get('vs_fp16', float('nan')):.2f} fp16 "
                  f"(rounds {', '.join(f'{t:.2f}' for t in row['rounds_ms'])} ms)"
                  + (f"; mlx-lm loop x{row['gen_vs_fp16']:.2f}" if "gen_vs_fp16" in row else "")
                  + (f"; stalls at {row['gen_stall_offsets']}, peaks {_megabytes(row['gen_stall_peak_mb'])} MB "
                     f"(median token {row['gen_token_peak_mb_median']:.0f})" if row.get("gen_stall_offsets") else "")
                  + (f"; SLOW ROUNDS {row['slow_rounds']} (over {SLOW_ROUND_FACTOR:g}x the fastest round's step: "
                     "read the rounds, not the median)" if row.get("slow_rounds") else ""),
                  flush=True)
        else:
            print(f"{spec:16s} {context:7d}: FAILED {row['error']}", flush=True)
        out.append(row)
    ceiling = rows.get(NO_HISTORY)
    if ceiling is not None and "vs_fp16" in ceiling:
        loop = f", of its mlx-lm loop x{ceiling['gen_vs_fp16']:.2f}" if "gen_vs_fp16" in ceiling else ""
        print(f"ceiling at {context}: no cache passes x{ceiling['vs_fp16']:.2f} of fp16's step{loop} in this run",
              flush=True)
    del filled
    gc.collect()
    mx.clear_cache()
    return out


def _write_partial(out: Path, record: dict[str, Any], done: list[dict[str, Any]],
                   partial: list[dict[str, Any]]) -> None:
    out.write_text(json.dumps({**record, "rows": done + partial, "partial": True}, indent=1) + "\n")


# A round whose median step took this many times the spec's fastest round's is named in the row (`slow_rounds`) and
# printed: on an H100 the 16-bit cache's first round at 131k took 24x its later rounds' steps (BENCHMARKS.md, round
# 34), and with two rounds such a round is half of the median a row reports.
SLOW_ROUND_FACTOR = 2.0


def _round_row(row: dict[str, Any], steps: dict[str, list[float]], generated: dict[str, list[float]],
               tokens: dict[str, list[float]], offsets: dict[str, list[int]],
               peaks: dict[str, list[int]]) -> dict[str, Any]:
    """`row` (a spec's fields before timing) with its rounds' figures so far, as `interleaved_rows` reports them."""
    # statistics.median: with an even number of rounds the mean of the middle two, so a row's tok/s and its ratio
    # to fp16 come from the same rounds (the upper middle alone gave the slower step but the higher ratio).
    median = statistics.median
    spec = row["spec"]
    if "error" in row or not steps.get(spec):
        return row
    row |= {"tok_s": 1 / median(steps[spec]), "ms": median(steps[spec]) * 1000,
            "rounds_ms": [t * 1000 for t in steps[spec]]}
    fastest = min(steps[spec])
    slow = [i + 1 for i, t in enumerate(steps[spec]) if t > SLOW_ROUND_FACTOR * fastest]
    if slow:
        row["slow_rounds"] = slow
    if generated[spec]:
        row |= {"gen_tok_s": 1 / median(generated[spec]), "gen_ms": median(generated[spec]) * 1000,
                "rounds_gen_ms": [t * 1000 for t in generated[spec]]} | token_latency(
            tokens[spec], offsets[spec], peaks[spec])
    for key, series in (("vs_fp16", steps), ("gen_vs_fp16", generated)):
        reference = series.get("fp16")
        if reference and series[spec] and len(reference) == len(series[spec]):
            ratios = sorted(a / b for a, b in zip(reference, series[spec], strict=True))
            row[key], row[key + "_range"] = median(ratios), [ratios[0], ratios[-1]]
    return row


def chunked_prefill(model: nn.Module, caches: list[Any], prompt: Any,
                    chunk: int = PREFILL_CHUNK) -> list[tuple[float, float]]:
    """Feeds `prompt` [1, N] through the model into `caches` in chunks of `chunk` tokens, each evaluated with the
    caches' state before the next; per chunk, the seconds to build its graph (host) and to evaluate it."""
    import mlx.core as mx

    times = []
    for start in range(0, prompt.shape[1], chunk):
        began = time.perf_counter()
        logits = model(prompt[:, start : start + chunk], cache=caches)
        built = time.perf_counter()
        mx.eval(logits, [c.state for c in caches])
        times.append((built - began, time.perf_counter() - built))
    return times


def time_prefill(model: nn.Module, spec: str, n_tokens: int, shape: dict[str, Any] = SHAPE,
                 chunk: int = PREFILL_CHUNK) -> dict[str, Any]:
    """A chunked prefill of `n_tokens` into fresh caches, timed on a later run: the first compiles the
    kernels it meets (on an H200 the first chunk of the first cache took 25-37 s, the next ones 0.3 s), which
    would be charged to whichever spec happens to come first. The first run's time is kept as `first_prefill_s`:
    in a fresh process with one spec, what a user's first prompt pays for the compiles. `prefill_s` is the prefill
    as mlx-lm's generate runs it (each chunk recorded, then evaluated); `pipelined_prefill_s` the app's
    (engine/chat/prefill.py: the next chunk recorded while the current one is evaluated), in new caches each. The
    pipelined way is run once untimed first too (`first_pipelined_prefill_s`): its graphs (no logits evaluated) meet
    kernels the other way did not compile, and on the H200 the first process of a fresh machine timed the 16-bit
    cache's pipelined prefill at 4,048-5,654 tok/s against 8,012-8,091 in every later process. `chunk`: tokens per
    chunk both ways (`prefill_chunk`)."""
    import mlx.core as mx

    from engine.chat.prefill import prefill_chunks

    prompt = mx.random.randint(0, shape["vocab"], (1, n_tokens)).astype(mx.int32)
    mx.eval(prompt)
    runs = []
    for run in ("first", "first pipelined", "timed", "pipelined"):  # mlx-lm's way, then the app's
        caches = make_caches(spec, shape["layers"], shape)
        mx.synchronize()
        began = time.perf_counter()
        if run.endswith("pipelined"):  # the app's prefill: the next chunk recorded while the current one runs
            for _ in prefill_chunks(model, caches, prompt[0], chunk, pipelined=True):
                pass
        else:  # mlx-lm's generate: one chunk after another
            chunked_prefill(model, caches, prompt, chunk)
        mx.synchronize()
        runs.append(time.perf_counter() - began)
        if run != "pipelined":
            del caches
            gc.collect()
            mx.clear_cache()
    # One decode step after the real prefill, to show the cache it built decodes too.
    step = time_decode(model, caches, steps=3, warmup=1)
    del caches
    return {"prefill_chunk": chunk, "prefill_s": runs[2], "prefill_tok_s": n_tokens / runs[2], "first_prefill_s": runs[0],
            "first_pipelined_prefill_s": runs[1], "pipelined_prefill_s": runs[3],
            "pipelined_prefill_tok_s": n_tokens / runs[3],
            "decode_tok_s_after": 1 / step[1]}


def profile_step(model: nn.Module, spec: str, context: int, repeats: int = 20,
                 shape: dict[str, Any] = SHAPE) -> dict[str, Any]:
    """Where one decode step's time goes, for one cache at one context (all times in ms).

    `step`: the whole-model step (median). `build`: host time of `model(token, cache=caches)` alone, which
    only records MLX's graph; `eval`: the rest of the step (launching and running it). `layer_update`,
    `layer_attention`: one layer's `update_and_fetch` of one token and its attention through mlx-lm's
    `scaled_dot_product_attention`, each evaluated alone (so launch latency included), median over
    `repeats`; `layer_attention_batched`: the same attention `repeats` times in one evaluation, divided (GPU
    time with the launches pipelined).
    """
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention

    caches = make_caches(spec, shape["layers"], shape)
    fill(caches, context, shape)
    token = mx.array([[128]], dtype=mx.int32)
    builds, evals, steps = [], [], []
    for step in range(repeats + 3):
        mx.synchronize()
        began = time.perf_counter()
        logits = model(token, cache=caches)
        built = time.perf_counter()
        mx.eval(logits)
        mx.synchronize()
        done = time.perf_counter()
        if step >= 3:
            builds.append(built - began)
            evals.append(done - built)
            steps.append(done - began)
    cache = caches[0]
    shape_q = (1, shape["heads"], 1, shape["head_dim"])
    shape_kv = (1, shape["kv_heads"], 1, shape["head_dim"])
    queries = mx.random.normal(shape_q).astype(mx.bfloat16)
    keys = mx.random.normal(shape_kv).astype(mx.bfloat16)
    values = mx.random.normal(shape_kv).astype(mx.bfloat16)
    mx.eval(queries, keys, values)
    scale = shape["head_dim"] ** -0.5
    updates, attends = [], []
    for _ in range(repeats):
        mx.synchronize()
        began = time.perf_counter()
        k, v = cache.update_and_fetch(keys, values)
        mx.eval(k, v) if isinstance(k, mx.array) else mx.eval(cache.state)
        mx.synchronize()
        updated = time.perf_counter()
        out = scaled_dot_product_attention(queries, k, v, cache=cache, scale=scale, mask=None)
        mx.eval(out)
        mx.synchronize()
        updates.append(updated - began)
        attends.append(time.perf_counter() - updated)
    k, v = cache.update_and_fetch(keys, values)
    outs = [scaled_dot_product_attention(queries * (1 + i / 64), k, v, cache=cache, scale=scale, mask=None)
            for i in range(repeats)]
    mx.eval(queries)
    mx.synchronize()
    began = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    batched = (time.perf_counter() - began) / repeats
    del caches, outs
    gc.collect()
    mx.clear_cache()

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2] * 1000

    return {
        "spec": spec, "context": context, "step": median(steps), "build": median(builds), "eval": median(evals),
        "layer_update": median(updates), "layer_attention": median(attends), "layer_attention_batched": batched * 1000,
    }


def _loadavg() -> str:
    """The machine's load average (Linux), recorded beside the timings."""
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def _error_text(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """decode's options, on its own parser or on `velox bench decode`'s (MLX-free, see the module doc)."""
    parser.add_argument("--out", required=True, help="the JSON file to write (rewritten after every row)")
    parser.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                        help="comma-separated cache lengths in tokens (default: %(default)s)")
    parser.add_argument("--specs", default=",".join(DEFAULT_SPECS),
                        help="comma-separated caches, fp16 first for the ratios (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per row (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default: %(default)s)")
    parser.add_argument("--prefill", type=int, default=0, help="also time a chunked prefill of this many tokens")
    parser.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                        help="tokens per chunk of the --prefill timing (the app's: 512 on a CPU; on a GPU up to 2,048 "
                             "where memory allows) (default: %(default)s)")
    parser.add_argument("--prefill-specs", default=",".join(PREFILL_SPECS),
                        help="caches of the --prefill timing (default: %(default)s)")
    parser.add_argument("--profile", default="", help="SPECS@CONTEXT: also profile one step of these caches")
    parser.add_argument("--kernel-constants", default="",
                        help='JSON {name: value} set on engine.kvcache.kernels.decode, .dequantize or .encode first '
                             '(e.g. {"TILED_PREFETCH": false})')
    parser.add_argument("--rounds", type=int, default=1,
                        help="N > 1: fill every spec's caches at once per context, then time them in turn N times "
                             "(ratios to fp16 per round; their median and range)")
    parser.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True,
                        help="also time mlx-lm's own decode loop (generate_step, which overlaps host and GPU "
                             "work as the app's does): gen_tok_s, gen_vs_fp16 (default: on)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="8b",
                        help="the model: 8b (Llama-3.1-8B-shaped, the default) or tiny (2 layers, for a quick check)")
    parser.add_argument("--merge", nargs="+", metavar="FILE", default=None,
                        help="measure nothing: write --out as one record of these runs' records (a table timed a "
                             "context, or a group of caches beside fp16, per call, where a call's time is limited)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="decode.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


# Fields of a record that describe its run rather than the model and method of measurement: a merged record keeps
# each part's under `parts`.
_RUN_FIELDS = ("device", "gpu", "loadavg_start", "loadavg_end", "read_bytes_per_second", "note", "partial")


def merge_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of several runs of this script (a table timed a context, or a group of caches, per call): their
    rows in order, the contexts in the order first seen, and each run's own fields under `parts`. The runs must have
    measured alike (same shape, steps, warmup, rounds, MLX and kernel constants), and a cache and context may be in
    one run only, except the 16-bit reference: a run that splits a context's caches across calls times fp16 in each
    (a row's ratios are to its own run's fp16), and the later runs' fp16 rows are kept under their part's
    `reference_rows`, so `rows` holds each (spec, context) once."""
    if not records:
        raise ValueError("Nothing to merge.")
    first = records[0]
    alike = ("schema", "kind", "mlx", "shape", "steps", "warmup", "fill_chunk", "kernel_constants", "rounds",
             "weight_bytes")
    for record in records[1:]:
        differing = [field for field in alike if record.get(field) != first.get(field)]
        if differing:
            raise ValueError(f"These runs were not measured alike: {', '.join(differing)} differ.")
    merged = {key: value for key, value in first.items() if key not in (*_RUN_FIELDS, "rows", "prefill", "profile")}
    merged["contexts"], merged["parts"], merged["rows"] = [], [], []
    seen: set[tuple[str, int]] = set()
    for record in records:
        part = {key: record[key] for key in _RUN_FIELDS if key in record}
        part["contexts"] = sorted({row["context"] for row in record["rows"]})
        for row in record["rows"]:
            pair = (row["spec"], row["context"])
            if pair in seen:
                if row["spec"] != "fp16":
                    raise ValueError(f"{row['spec']} at {row['context']} tokens is in more than one run.")
                part.setdefault("reference_rows", []).append(row)
                continue
            seen.add(pair)
            merged["rows"].append(row)
            if row["context"] not in merged["contexts"]:
                merged["contexts"].append(row["context"])
        merged["parts"].append(part)
    prefill = [row for record in records for row in record.get("prefill", [])]
    if prefill:
        merged["prefill"] = prefill
    return merged


def run(args: argparse.Namespace) -> int:
    """The decode benchmark of parsed `add_arguments` options; writes args.out, returns the exit code."""
    if getattr(args, "merge", None):
        merged = merge_records([json.loads(Path(path).read_text()) for path in args.merge])
        Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
        print(f"{args.out}: {len(merged['rows'])} rows, contexts {', '.join(map(str, merged['contexts']))}")
        cut = [path for path, part in zip(args.merge, merged["parts"], strict=True) if part.get("partial")]
        if cut:
            print(f"cut short by its time limit (fewer rounds than --rounds): {', '.join(cut)}")
        return 0
    from engine.runtime import prepare_runtime

    prepare_runtime()  # the CPU fast path must be set up before MLX is first imported (no-op on a GPU)
    import mlx.core as mx

    shape = SHAPES[args.shape]
    contexts = [int(c) for c in args.contexts.split(",")]
    specs = [s.strip() for s in args.specs.split(",") if s.strip()]
    constants = json.loads(args.kernel_constants) if getattr(args, "kernel_constants", "") else {}
    set_kernel_constants(constants)

    record: dict[str, Any] = {
        "schema": "velox-bench/1", "kind": "decode", "device": str(mx.default_device()), "mlx": mx.__version__,
        "platform": f"{platform.system()} {platform.machine()}", "shape": shape, "contexts": contexts,
        "steps": args.steps, "warmup": args.warmup, "fill_chunk": FILL_CHUNK, "kernel_constants": constants,
    }
    try:
        record["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()
    except Exception as error:  # not an NVIDIA machine
        record["gpu"] = f"unknown ({type(error).__name__})"
    record["loadavg_start"] = _loadavg()
    bandwidth = read_bandwidth(READ_PROBE_BYTES[args.shape])
    record["read_bytes_per_second"] = bandwidth
    model = build_model(shape)
    _CALIBRATION_MODEL[:] = [model]
    weights = weight_bytes(model)
    record["weight_bytes"] = weights
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; weights {weights / 1e6:.1f} MB", flush=True)

    out = Path(args.out)
    if args.profile:
        profile_specs, _, profile_context = args.profile.partition("@")
        profiles = []
        for spec in profile_specs.split(","):
            try:
                profiles.append(profile_step(model, spec, int(profile_context or 32769), shape=shape))
            except Exception as error:
                profiles.append({"spec": spec, "error": _error_text(error)})
            print("profile " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in profiles[-1].items()), flush=True)
        record["profile"] = profiles
        out.write_text(json.dumps({**record, "rows": []}, indent=1) + "\n")
    rows: list[dict[str, Any]] = []
    reference: dict[int, float] = {}
    reference_gen: dict[int, float] = {}
    if args.rounds > 1:
        record["rounds"] = args.rounds
        for context in contexts:
            # a round's rows are written beside the contexts' before it, the record marked "partial" until it ends
            write_round = functools.partial(_write_partial, out, record, list(rows))
            rows += interleaved_rows(model, specs, context, args, shape, bandwidth, weights, on_round=write_round)
            out.write_text(json.dumps({**record, "rows": rows}, indent=1) + "\n")
        specs = []  # every row is made
    for spec in specs:
        for context in contexts:
            row: dict[str, Any] = spec_row(spec, context)
            caches = None
            try:
                with spec_constants(spec) as text:
                    caches = make_caches(text, shape["layers"], shape)
                    fill(caches, context, shape)
                    held = cache_bytes(caches)
                    times = time_decode(model, caches, args.steps, args.warmup)
                median = times[len(times) // 2]
                row |= {
                    "tok_s": 1 / median, "ms": median * 1000, "ms_min": times[0] * 1000, "ms_max": times[-1] * 1000,
                    "held_bytes": held, "bound_tok_s": bandwidth / (weights + held),
                }
                if args.generate:
                    token_seconds: list[float] = []
                    token_offsets: list[int] = []
                    token_peaks: list[int] = []
                    with spec_constants(spec):
                        per_token = time_generate(model, caches, args.steps, args.warmup, token_seconds, token_offsets,
                                                  token_peaks)
                    row |= ({"gen_tok_s": 1 / per_token, "gen_ms": per_token * 1000}
                            | token_latency(token_seconds, token_offsets, token_peaks))
                if spec == "fp16":
                    reference[context] = row["tok_s"]
                    reference_gen[context] = row.get("gen_tok_s", 0.0)
                if context in reference:
                    row["vs_fp16"] = row["tok_s"] / reference[context]
                if reference_gen.get(context) and "gen_tok_s" in row:
                    row["gen_vs_fp16"] = row["gen_tok_s"] / reference_gen[context]
                generated = (f"; mlx-lm loop {row['gen_tok_s']:.1f} tok/s x{row.get('gen_vs_fp16', float('nan')):.2f}, "
                             f"token max {row['gen_token_ms_max']:.1f} ms, {row['gen_stalls']} stalls"
                             f" at {row['gen_stall_offsets']}, peaks {_megabytes(row.get('gen_stall_peak_mb', []))} MB"
                             if "gen_tok_s" in row else "")
                print(f"{spec:16s} {context:7d}: {row['tok_s']:7.1f} tok/s ({row['ms']:.2f} ms; bound "
                      f"{row['bound_tok_s']:.0f} tok/s; cache {held / 1e9:.2f} GB; "
                      f"x{row.get('vs_fp16', float('nan')):.2f} fp16{generated})", flush=True)
            except Exception as error:  # record what fails, e.g. a quantized_matmul shape without a kernel
                row["error"] = _error_text(error)
                print(f"{spec:16s} {context:7d}: FAILED {row['error']}", flush=True)
            del caches
            gc.collect()
            mx.clear_cache()
            rows.append(row)
            out.write_text(json.dumps({**record, "rows": rows}, indent=1) + "\n")
    record["loadavg_end"] = _loadavg()
    _note_kernels_disabled(record)
    out.write_text(json.dumps({**record, "rows": rows}, indent=1) + "\n")
    if args.prefill:
        prefill_rows = []
        for spec in [s.strip() for s in args.prefill_specs.split(",") if s.strip()]:
            row = spec_row(spec, args.prefill)
            try:
                with spec_constants(spec) as text:
                    row |= time_prefill(model, text, args.prefill, shape, args.prefill_chunk)
                print(f"prefill {spec:16s} {args.prefill}: {row['prefill_tok_s']:.0f} tok/s, pipelined "
                      f"{row['pipelined_prefill_tok_s']:.0f} (then decode {row['decode_tok_s_after']:.1f} tok/s)",
                      flush=True)
            except Exception as error:
                row["error"] = _error_text(error)
                print(f"prefill {spec:16s}: FAILED {row['error']}", flush=True)
            gc.collect()
            mx.clear_cache()
            prefill_rows.append(row)
            _note_kernels_disabled(record)
            out.write_text(json.dumps({**record, "rows": rows, "prefill": prefill_rows}, indent=1) + "\n")
    return 0


def _note_kernels_disabled(record: dict[str, Any]) -> None:
    """A kernel that failed its first run on this GPU (engine/kvcache/kernel_check.py) turned every kernel off for
    the rest of the run, so the rows timed after it are the reference path's: the record says so, and why."""
    from engine.kvcache.kernels.backend import disabled_reason

    reason = disabled_reason()
    if reason is not None and record.get("kernels_disabled") != reason:
        record["kernels_disabled"] = reason
        print(f"WARNING: kernels were turned off during this run (rows after it took the reference path): {reason}",
              flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
