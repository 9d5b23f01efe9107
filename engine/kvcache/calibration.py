"""Calibration of the `vq` method on the user's model: `velox precompute MODEL --bits B --out DIR`.

Text goes through the model with an ordinary mlx-lm cache; each layer's keys and values (after RoPE, as the
cache sees them) are transformed exactly as the `vq` cache will transform them (per-channel smoothing, the
layer's seeded rotation, division by the norm), cut into sub-vectors, and clustered with k-means into that
layer's codebook. Smoothing scales are sqrt(max |x_c|) per channel over the calibration tokens and heads
(SmoothQuant's balance with α = 1/2), normalised to geometric mean 1.

Without a text, the model writes its own calibration text (sampled from a few neutral openings with a fixed
seed): codebooks need the model's key/value statistics, not any particular corpus, and this keeps the
command self-contained.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from engine.kvcache.config import KVCacheConfig
from engine.kvcache.quant.vq import (
    ROLES,
    index_bits,
    kmeans,
    model_identity,
    save_codebooks,
    subspace_dim,
)

DEFAULT_TOKENS = 2048
KMEANS_ITERATIONS = 25
_OPENINGS = (
    "Chapter One\n\nThe letter arrived on a grey morning in early spring,",
    "A practical introduction to how rivers shape the land around them.",
    "Dear committee members, I am writing to explain the results of our survey",
    "def parse_config(path):\n    \"\"\"Read the settings file and return a dictionary.\"\"\"\n",
)

Progress = Callable[[str, float], None]


def generated_calibration_tokens(model: Any, tokenizer: Any, n_tokens: int, seed: int = 0) -> list[int]:
    """`n_tokens` tokens the model writes itself, continuing `_OPENINGS` in turn (temperature 1)."""

    mx.random.seed(seed)
    per_opening = max(16, n_tokens // len(_OPENINGS))
    tokens: list[int] = []
    for opening in _OPENINGS:
        text = generate(model, tokenizer, opening, max_tokens=per_opening, sampler=make_sampler(temp=1.0))
        tokens += list(tokenizer.encode(opening + text, add_special_tokens=False))
    return tokens[:n_tokens]


def collect_kv(model: Any, tokens: Sequence[int], chunk: int = 512) -> list[tuple[mx.array, mx.array]]:
    """Per layer (keys, values) [1, kv_heads, n, head_dim] of `tokens`, as a cache would receive them."""

    cache = make_prompt_cache(model)
    for start in range(0, len(tokens), chunk):
        model(mx.array(list(tokens[start : start + chunk]))[None], cache=cache)
        mx.eval([c.state for c in cache])
    n = len(tokens)
    return [(c.keys[..., :n, :].astype(mx.float32), c.values[..., :n, :].astype(mx.float32)) for c in cache]


def smoothing_scales(x: mx.array) -> mx.array:
    """sqrt(max |x_c|) per channel over every leading axis, normalised to geometric mean 1."""
    peak = mx.max(mx.abs(x.reshape(-1, x.shape[-1])), axis=0)
    scales = mx.sqrt(mx.maximum(peak, 1e-6))
    return scales / mx.exp(mx.mean(mx.log(scales)))


def calibrate_vq(
    model: Any,
    tokens: Sequence[int],
    bits: int,
    rotation: str = "hadamard",
    seed: int = 0,
    iterations: int = KMEANS_ITERATIONS,
    progress: Progress | None = None,
) -> dict[str, mx.array]:
    """The codebook arrays for `model`, calibrated on `tokens` (see `codebooks_from_kv`)."""
    return codebooks_from_kv(collect_kv(model, tokens), bits, rotation, seed, iterations, progress)


def codebooks_from_kv(
    layers: Sequence[tuple[mx.array, mx.array]],
    bits: int,
    rotation: str = "hadamard",
    seed: int = 0,
    iterations: int = KMEANS_ITERATIONS,
    progress: Progress | None = None,
) -> dict[str, mx.array]:
    """Codebook arrays (`{role}_smooth` [L, d], `{role}_centroids` [L, K, g], float16) from each layer's
    calibration (keys, values) [..., tokens, head_dim]."""
    from engine.kvcache.methods.vq import VeloxVQKVCache  # the methods load on first use (registry.py)

    g = subspace_dim(bits)
    n_centroids = 1 << index_bits(bits)
    config = KVCacheConfig("vq", bits, bits, rotation=rotation, seed=seed)
    smooth: dict[str, list[mx.array]] = {role: [] for role in ROLES}
    centroids: dict[str, list[mx.array]] = {role: [] for role in ROLES}
    for layer_index, (keys, values) in enumerate(layers):
        layer_rotation = VeloxVQKVCache.layer_rotation(config, keys.shape[-1], layer_index)
        for role, x in zip(ROLES, (keys, values), strict=True):
            x = x.astype(mx.float32)
            scales = smoothing_scales(x).astype(mx.float16)
            transformed = layer_rotation.forward(x / scales.astype(mx.float32))
            unit = transformed / mx.maximum(mx.linalg.norm(transformed, axis=-1, keepdims=True), 1e-30)
            smooth[role].append(scales)
            codebook = kmeans(unit.reshape(-1, g), n_centroids, iterations, seed=seed + layer_index)
            centroids[role].append(codebook.astype(mx.float16))
        if progress:
            progress(f"codebooks of layer {layer_index + 1}/{len(layers)}", (layer_index + 1) / len(layers))
    arrays = {}
    for role in ROLES:
        arrays[f"{role}_smooth"] = mx.stack(smooth[role])
        arrays[f"{role}_centroids"] = mx.stack(centroids[role])
    mx.eval(arrays)
    return arrays


def precompute(
    model_dir: str | Path,
    bits: int,
    out_dir: str | Path,
    texts: Sequence[str | Path] = (),
    n_tokens: int = DEFAULT_TOKENS,
    progress: Progress | None = None,
) -> Path:
    """Load the model in `model_dir`, calibrate `bits`-bit VQ codebooks on `texts` (or on text the model
    writes) and save them in `out_dir`; returns the file written."""
    from engine.models.catalog import load_model  # only `velox precompute` loads a model here

    subspace_dim(bits)  # ConfigError for unsupported bits before the model is loaded
    model, tokenizer, info = load_model(str(model_dir))
    if texts:
        tokens: list[int] = []
        for text in texts:
            tokens += list(tokenizer.encode(Path(text).read_text(encoding="utf-8", errors="replace"), add_special_tokens=False))
        tokens = tokens[:n_tokens]
    else:
        if progress:
            progress("the model writes its calibration text", 0.0)
        tokens = generated_calibration_tokens(model, tokenizer, n_tokens)
    arrays = calibrate_vq(model, tokens, bits, progress=progress)
    identity = model_identity(model, name=getattr(info, "name", "") or Path(model_dir).name)
    return save_codebooks(out_dir, bits, arrays, identity, rotation="hadamard", seed=0)
