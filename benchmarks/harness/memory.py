"""Bytes a KV cache actually holds: every mx.array reachable from the cache objects (engine.planning.memory.array_bytes),
compared with fp16, and MLX's active/peak memory while the cache fills.

Two sources of keys and values go through the same code path (`update_and_fetch`, chunk by chunk, as the
model calls it):
* the real keys/values SmolLM2 produced for 8192 tokens of prose (a snapshot taken once with an fp16 cache),
  read back at 1k, 2k, 4k and 8k tokens;
* random normal keys/values (bf16, as those models run) with the shape of one layer of Llama-3.1-8B, Qwen3-8B
  and Mistral-7B (8 kv heads, head_dim 128: the same per layer for all three), at 4k-32k tokens; the bytes
  of one layer are multiplied by the model's layer count (32, 36, 32), which is exact because every layer
  holds the same arrays.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.harness.common import effective_bits_from_bytes, log, prompt_spans
from benchmarks.harness.specs import CacheSpec

SNAPSHOT_CHUNK = 512
FILL_CHUNK = 1024
# (name, layers, kv heads, head_dim): the three reference models' attention shapes.
LARGE_MODEL_SHAPES = (
    ("Llama-3.1-8B", 32, 8, 128),
    ("Qwen3-8B", 36, 8, 128),
    ("Mistral-7B", 32, 8, 128),
)


def kv_snapshot_path(cache_dir: Path, model_name: str, n_tokens: int) -> Path:
    return cache_dir / f"kv-{model_name}-{n_tokens}.safetensors"


def make_kv_snapshot(model: Any, tokens: list[int], path: Path) -> Path:
    """Prefill `tokens` through a Velox fp16 cache and save every layer's keys and values (fp16)."""
    from benchmarks.harness.quality import prefill
    from engine.kvcache import KVCacheBuilder, KVCacheConfig

    caches = KVCacheBuilder(KVCacheConfig("fp16")).for_model(model).build()
    prefill(model, caches, tokens, SNAPSHOT_CHUNK)
    arrays = {}
    for index, cache in enumerate(caches):
        keys, values = cache.to_dense()
        arrays[f"k{index}"] = keys.astype(mx.float16)
        arrays[f"v{index}"] = values.astype(mx.float16)
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), arrays)
    return path


def load_kv_snapshot(path: Path) -> tuple[list[mx.array], list[mx.array]]:
    arrays = mx.load(str(path))
    n_layers = len(arrays) // 2
    keys, values = [arrays[f"k{i}"] for i in range(n_layers)], [arrays[f"v{i}"] for i in range(n_layers)]
    mx.eval(keys, values)  # loaded lazily otherwise: the first cache measured would be charged for the file
    return keys, values


def fill(caches: list[Any], keys: list[mx.array], values: list[mx.array], start: int, end: int,
         dtype: mx.Dtype, chunk: int = FILL_CHUNK) -> None:
    """Feed tokens [start, end) of every layer's keys/values into its cache, `chunk` tokens at a time and the last
    token on its own (`prompt_spans`), as mlx-lm's generate_step feeds a prompt: at `end` a Velox cache has given back
    a prefill's room ahead and keeps a decode step's room, as it does when it starts decoding."""
    for s, e in prompt_spans(start, end, chunk):
        for cache, k, v in zip(caches, keys, values, strict=True):
            cache.update_and_fetch(k[..., s:e, :].astype(dtype), v[..., s:e, :].astype(dtype))
        mx.eval([getattr(cache, "state", cache) for cache in caches])


def held_bytes_curve(
    spec: CacheSpec, keys: list[mx.array], values: list[mx.array], checkpoints: Sequence[int], dtype: mx.Dtype
) -> list[dict[str, Any]]:
    """Fill fresh caches for `spec` with the given keys/values and read what they hold at each checkpoint."""
    from engine.planning.memory import array_bytes

    n_layers = len(keys)
    _, n_kv_heads, _, head_dim = keys[0].shape
    gc.collect()
    mx.clear_cache()
    baseline = mx.get_active_memory()
    mx.reset_peak_memory()
    caches = spec.factory_for_shape(n_layers, head_dim)()
    rows = []
    done = 0
    for checkpoint in sorted(checkpoints):
        fill(caches, keys, values, done, checkpoint, dtype)
        done = checkpoint
        # A decoding Velox cache keeps room for the next steps (up to an eighth more tokens, engine.kvcache.base); given
        # back here, the bytes read are those of the tokens, rounded up to the 256-token step as mlx-lm's caches are.
        for cache in caches:
            if hasattr(cache, "release_room_ahead"):
                cache.release_room_ahead()
        held = array_bytes(caches)
        velox_nbytes = sum(getattr(cache, "nbytes", 0) for cache in caches)
        rows.append({
            "tokens": checkpoint,
            "held_bytes": held,
            "velox_nbytes": velox_nbytes if spec.family == "velox" else None,
            "effective_bits": effective_bits_from_bytes(held, checkpoint, n_layers, n_kv_heads, head_dim),
            # MLX's allocator: arrays alive now, and the most alive at once while filling (transients
            # of encoding a chunk included), both above what was alive before the caches were made.
            "mlx_active_delta_bytes": mx.get_active_memory() - baseline,
            "mlx_peak_delta_bytes": mx.get_peak_memory() - baseline,
        })
    del caches
    gc.collect()
    return rows


def model_memory(specs: Sequence[CacheSpec], snapshot: Path, checkpoints: Sequence[int]) -> dict[str, Any]:
    """Held bytes of every spec on the real SmolLM2 keys/values (fp32 inputs, as the CPU model makes them)."""
    keys, values = load_kv_snapshot(snapshot)
    available = keys[0].shape[-2]
    checkpoints = [c for c in checkpoints if c <= available]
    out = {}
    for spec in specs:
        log(f"  memory: {spec.text} on the model's keys/values")
        out[spec.text] = held_bytes_curve(spec, keys, values, checkpoints, mx.float32)
    return {"checkpoints": checkpoints, "layers": len(keys), "kv_heads": keys[0].shape[1],
            "head_dim": keys[0].shape[-1], "results": out}


def large_shape_memory(specs: Sequence[CacheSpec], checkpoints: Sequence[int], seed: int = 0) -> dict[str, Any]:
    """Held bytes of one random bf16 layer with 8 kv heads of head_dim 128, scaled to each reference model."""
    n_kv_heads, head_dim = LARGE_MODEL_SHAPES[0][2], LARGE_MODEL_SHAPES[0][3]
    assert all(shape[2:] == (n_kv_heads, head_dim) for shape in LARGE_MODEL_SHAPES)
    max_tokens = max(checkpoints)
    mx.random.seed(seed)
    keys = [mx.random.normal((1, n_kv_heads, max_tokens, head_dim)).astype(mx.bfloat16)]
    values = [mx.random.normal((1, n_kv_heads, max_tokens, head_dim)).astype(mx.bfloat16)]
    mx.eval(keys, values)
    per_layer = {}
    for spec in specs:
        log(f"  memory: {spec.text} on one random {n_kv_heads}x{head_dim} layer")
        per_layer[spec.text] = held_bytes_curve(spec, keys, values, checkpoints, mx.bfloat16)
    models = {}
    for name, layers, _, _ in LARGE_MODEL_SHAPES:
        models[name] = {
            spec: [
                {"tokens": row["tokens"], "held_bytes": row["held_bytes"] * layers,
                 "effective_bits": row["effective_bits"],
                 "mlx_active_delta_bytes": row["mlx_active_delta_bytes"] * layers}
                for row in rows
            ]
            for spec, rows in per_layer.items()
        }
    return {
        "checkpoints": list(checkpoints),
        "shapes": [{"model": n, "layers": layers, "kv_heads": h, "head_dim": d} for n, layers, h, d in LARGE_MODEL_SHAPES],
        "input_dtype": "bfloat16",
        "note": (
            "one layer measured (per_layer, with its MLX peak while filling), held and active bytes multiplied "
            "by the model's layer count (every layer holds the same arrays)"
        ),
        "per_layer": per_layer,
        "models": models,
    }
