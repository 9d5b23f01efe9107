"""The calibration behind KIVI's option `key_widths`: how many bits each key channel of each layer gets.

`key_widths=calibrated` asks for key channels at different widths, averaging the layer's key bits
(`quant/channel_widths.py` says why and how they are allocated). What a channel's importance is, is measured here,
once per model and spec, in one pass: the model reads the calibration tokens (the bundled prose, as the wide layers'
calibration does) through 16-bit caches that also add up each query channel's energy; then, per layer and kv head,
a channel's importance is the energy of the queries that meet it (summed over the kv head's query heads; for keys
stored before RoPE, the mean over the channel's RoPE pair, which turns the two into each other) times the sum over
its key blocks of the block's range² (keys before RoPE where the spec stores them so, each block's one outlier set
aside where it keeps one), which is what the channel's rounding error in the scores grows with.

`KVCacheBuilder.for_model` writes the result into the spec as `key_widths=kw<digest>` (a digest of the widths): the
table itself is kept in the user's data folder (`calibration/key_widths-<digest>.json`, with the model's identity and
what was measured) and in this process, so re-encoding to the spec needs no model, and a saved cache holds its own
layer's widths (a loaded one needs no file). One pass of ~1k tokens: seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.errors import ConfigError
from engine.kvcache.attention import install_attention_dispatch
from engine.kvcache.builder import model_shape
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.layer_sensitivity import calibration_dir
from engine.kvcache.quant.channel_widths import allocate_widths
from engine.kvcache.quant.outliers import split_block_outliers
from engine.kvcache.quant.rope import RopeParameters, model_rope
from engine.kvcache.quant.vq import model_identity, weights_fingerprint
from engine.kvcache.registry import get_method
from engine.paths import data_dir, make_private_file

SCHEMA = "velox-key-widths/1"
OPTION = "key_widths"
DIGEST_PREFIX = "kw"
# Tokens per forward call of the calibration pass (the sums do not depend on it; memory does).
CHUNK_TOKENS = 256
BUNDLED_DIR = Path(__file__).with_name("calibrations")

Progress = Callable[[str, float], None]

# Tables made or read in this process, by digest: the caches of a spec look their layer up here first.
_TABLES: dict[str, tuple[np.ndarray, ...]] = {}


def is_digest(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(DIGEST_PREFIX) and len(value) == len(DIGEST_PREFIX) + 16


def table_digest(widths: Sequence[np.ndarray]) -> str:
    """`kw` + 16 hex digits of a sha256 over every layer's widths (shape and values)."""
    described = json.dumps([np.asarray(w).astype(int).tolist() for w in widths])
    return DIGEST_PREFIX + hashlib.sha256(described.encode()).hexdigest()[:16]


def register_table(widths: Sequence[np.ndarray]) -> str:
    """Keep a table in this process; returns its digest."""
    table = tuple(np.asarray(w, dtype=np.uint8) for w in widths)
    digest = table_digest(table)
    _TABLES[digest] = table
    return digest


def _read(path: Path) -> dict[str, Any] | None:
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and saved.get("schema") == SCHEMA else None


def _table_of(saved: dict[str, Any]) -> tuple[np.ndarray, ...] | None:
    try:
        table = tuple(np.asarray(layer, dtype=np.uint8) for layer in saved["widths"])
    except (KeyError, TypeError, ValueError):
        return None
    return table if table_digest(table) == saved.get("digest") else None


def key_widths_table(digest: str) -> tuple[np.ndarray, ...]:
    """Every layer's widths [n_kv, D] for `digest`: from this process, the bundled calibrations or the data
    folder's; ConfigError where none holds it (or its contents do not match its digest)."""
    if digest in _TABLES:
        return _TABLES[digest]
    for folder in (BUNDLED_DIR, data_dir() / "calibration"):
        saved = _read(folder / f"key_widths-{digest}.json")
        table = None if saved is None else _table_of(saved)
        if table is not None and saved is not None and saved.get("digest") == digest:
            _TABLES[digest] = table
            return table
    raise ConfigError(f"No key width calibration {digest} is on this machine: build the cache for its model "
                      f"with key_widths=calibrated (KVCacheBuilder.for_model) to measure it again.")


def _recording_class() -> type:
    """The 16-bit cache, adding up the energy of each query channel it attends with ([n_q_heads, D], float32)."""
    dense = get_method("fp16")

    class QueryEnergyCache(dense):  # type: ignore[misc, valid-type]
        query_energy: mx.array | None = None

        # The 16-bit cache hands mlx-lm its arrays (and never sees the queries) except on the CPU fast path: this
        # one always attends itself, so mlx-lm's attention hook brings it every query on any device.
        @property
        def _attends_itself(self) -> bool:
            return True

        def attention(self, queries, keys, values, scale, mask):  # noqa: ANN001, ANN202 - the cache's signature
            squares = mx.sum(mx.square(queries.astype(mx.float32)), axis=(0, 2))
            self.query_energy = squares if self.query_energy is None else self.query_energy + squares
            cached_keys = self._keys[..., : self.offset, :].astype(queries.dtype)
            cached_values = self._values[..., : self.offset, :].astype(queries.dtype)
            return mx.fast.scaled_dot_product_attention(queries, cached_keys, cached_values, scale=scale, mask=mask)

    return QueryEnergyCache


def channel_importance(model: Any, tokens: Sequence[int], config: KVCacheConfig) -> list[np.ndarray]:
    """Per layer, each key channel's importance [n_kv, D] (see the module doc) for caches of `config` (its key
    block, outliers and rope=pre) after `model` read `tokens`."""
    shape = model_shape(model)
    if len(tokens) < 2 * CHUNK_TOKENS:
        raise ConfigError(f"Key width calibration needs at least {2 * CHUNK_TOKENS} tokens, not {len(tokens)}.")
    kivi = get_method(config.method)
    block = kivi.token_block_for(config)
    rope: RopeParameters | None = model_rope(model) if config.options.get("rope") == "pre" else None
    outliers = bool(config.options.get("key_outliers", 0))
    install_attention_dispatch()
    recording = _recording_class()
    caches = [recording(KVCacheConfig("fp16"), layer_index=i) for i in range(shape.n_layers)]
    ids = mx.array([int(t) for t in tokens])[None]
    for start in range(0, ids.shape[1], CHUNK_TOKENS):
        model(ids[:, start : start + CHUNK_TOKENS], cache=caches)
        mx.eval([c.state for c in caches], [c.query_energy for c in caches])
    importance = []
    for cache in caches:
        keys = cache.to_dense()[0][0].astype(mx.float32)                  # [n_kv, T, D]
        if rope is not None:
            keys = rope.rotate(keys, 0, inverse=True)
        n_kv, n_tokens, dim = keys.shape
        whole = n_tokens // block * block
        transposed = keys[:, :whole, :].swapaxes(-1, -2)                 # [n_kv, D, T]
        if outliers:
            transposed = split_block_outliers(transposed, block)[0]
        blocks = transposed.reshape(n_kv, dim, whole // block, block)
        spread = mx.sum(mx.square(blocks.max(axis=-1) - blocks.min(axis=-1)), axis=-1)   # [n_kv, D]
        energy = cache.query_energy                                      # [n_q, D]
        if rope is not None:  # RoPE turns a pair's channels into each other: each gets the pair's mean
            half = dim // 2
            partner = (mx.array(np.arange(dim) ^ 1) if rope.traditional
                       else mx.concatenate([mx.arange(half, dim), mx.arange(0, half)]))
            energy = (energy + energy[:, partner]) / 2
        weight = energy.reshape(n_kv, -1, dim).sum(axis=1)
        importance.append(np.array(weight * spread, dtype=np.float64))
    return importance


def _measured_key(model: Any, config: KVCacheConfig, layer_bits: list[int], tokens: Sequence[int]) -> dict[str, Any]:
    """What a calibration depends on: the model (identity and weights), what the spec stores, the tokens."""
    kivi = get_method(config.method)
    return {
        "schema": SCHEMA,
        "model": {**model_identity(model), "weights_sha256": weights_fingerprint(model)},
        "layer_key_bits": layer_bits,
        "key_block": kivi.token_block_for(config),
        "key_outliers": int(config.options.get("key_outliers", 0)),
        "rope_pre": config.options.get("rope") == "pre",
        "tokens_sha256": hashlib.sha256(json.dumps([int(t) for t in tokens]).encode()).hexdigest(),
        "chunk_tokens": CHUNK_TOKENS,
    }


def _saved_for(key: dict[str, Any]) -> str | None:
    """The digest of a calibration already made for `key` (bundled or in the data folder), registered."""
    for folder in (BUNDLED_DIR, data_dir() / "calibration"):
        for path in sorted(folder.glob("key_widths-*.json")) if folder.is_dir() else ():
            saved = _read(path)
            if saved is None or saved.get("key") != key:
                continue
            table = _table_of(saved)
            if table is not None:
                _TABLES[saved["digest"]] = table
                return str(saved["digest"])
    return None


def calibrated_key_widths(model: Any, config: KVCacheConfig, tokens: Sequence[int],
                          progress: Progress | None = None) -> KVCacheConfig:
    """`config` (key_widths=calibrated, its wide layers named, its RoPE written) with `key_widths=kw<digest>`:
    the widths measured for `model` on `tokens` (or read from an earlier calibration), kept on disk and here."""
    n_layers = model_shape(model).n_layers
    layer_bits = [config.for_layer(i).key_bits for i in range(n_layers)]
    key = _measured_key(model, config, layer_bits, tokens)
    digest = _saved_for(key)
    if digest is None:
        if progress:
            progress("measuring the key channels' importance", 0.0)
        began = time.perf_counter()
        importance = channel_importance(model, tokens, config)
        widths = [allocate_widths(layer, bits) for layer, bits in zip(importance, layer_bits, strict=True)]
        digest = register_table(widths)
        record = {"schema": SCHEMA, "key": key, "digest": digest, "seconds": time.perf_counter() - began,
                  "widths": [w.astype(int).tolist() for w in widths]}
        path = calibration_dir() / f"key_widths-{digest}.json"
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(record) + "\n", encoding="utf-8")
        make_private_file(partial)
        os.replace(partial, path)  # whole or not at all
        if progress:
            progress("measuring the key channels' importance", 1.0)
    return replace(config, options={**config.options, OPTION: digest})
