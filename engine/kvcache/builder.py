"""Build one Velox KV cache per layer for an mlx-lm model, usable as `prompt_cache` unchanged.

    caches = KVCacheBuilder(KVCacheConfig(method="rotated", key_bits=4)).for_model(model).build()
    mlx_lm.stream_generate(model, tokenizer, prompt, prompt_cache=caches)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.errors import ConfigError
from engine.kvcache.attention import install_attention_dispatch
from engine.kvcache.base import VeloxKVCache
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.kernel_check import verify_kernels
from engine.kvcache.registry import get_method, register_with_mlx_lm


@dataclass(frozen=True)
class ModelShape:
    """What a KV cache needs to know about the model's attention."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def gqa_repeats(self) -> int:
        return self.n_heads // self.n_kv_heads


def _argument(args: Any, *names: str) -> Any:
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return None


def model_shape(model: Any) -> ModelShape:
    """Read layers, heads, kv heads and head_dim from an mlx-lm model (`model.layers`, `model.args`)."""
    layers = getattr(model, "layers", None)
    args = getattr(model, "args", None)
    if layers is None or args is None:
        raise ConfigError("This model does not expose `layers` and `args`, so its KV cache cannot be built.")
    if any(getattr(layer, "use_sliding", False) for layer in layers):
        raise ConfigError(
            "This model uses sliding-window attention layers, which Velox's compressed caches do not support."
        )
    n_heads = _argument(args, "num_attention_heads", "n_heads")
    n_kv_heads = _argument(args, "num_key_value_heads", "n_kv_heads") or n_heads
    hidden = _argument(args, "hidden_size", "dim")
    head_dim = _argument(args, "head_dim")
    if head_dim is None and n_heads and hidden:
        head_dim = hidden // n_heads
    if not (n_heads and n_kv_heads and head_dim):
        raise ConfigError("Cannot read the attention heads and head_dim from this model's arguments.")
    if n_heads % n_kv_heads:
        raise ConfigError(f"{n_heads} query heads cannot be grouped onto {n_kv_heads} kv heads.")
    return ModelShape(n_layers=len(layers), n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)


def model_dtype(model: Any) -> mx.Dtype:
    """The float dtype of the model's parameters (a quantized model's scales, its norms), which its activations and
    so its keys and values have; bfloat16 where it has none."""
    parameters = getattr(model, "parameters", None)
    for _, value in tree_flatten(parameters() if callable(parameters) else {}):
        if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.bfloat16


class KVCacheBuilder:
    """Validated construction of a per-layer prompt cache for one config and one model."""

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.shape: ModelShape | None = None
        self.dtype: mx.Dtype = mx.bfloat16  # the model's activations' (for_model reads it), which the kernels take

    def for_model(
        self, model: Any, calibration_tokens: Sequence[int] | None = None, tokenizer: Any = None,
        progress: Callable[[str, float], None] | None = None,
    ) -> KVCacheBuilder:
        """Validate for `model`; what the config needs from the model is written into it (the method's
        `resolve_for_model`: KIVI's rope=pre gets the model's RoPE). A `wide=F` config that does not name
        its layers gets them here from the layer-sensitivity calibration (cached on disk), so `self.config`
        names them (`wide_layers`) and re-encoding to it needs no model; likewise `key_widths=calibrated` becomes
        the digest of the key channel widths measured for the model (engine/kvcache/key_widths.py). Their tokens:
        `calibration_tokens`; else, with the model's `tokenizer`, the bundled prose; else text the model writes
        itself (which ranks SmolLM2's layers worse: see layer_sensitivity's module doc). `progress(message,
        fraction)` hears of a calibration that runs (once per model and level; none where a calibration is cached or
        bundled)."""
        self.shape = model_shape(model)
        self.dtype = model_dtype(model)
        self.config = self.config.validate(self.shape.head_dim)
        method = get_method(self.config.method)
        method.check_model(self.config, model)
        resolved = method.resolve_for_model(self.config, model)
        if resolved is not self.config:  # only what the model added needs checking again
            self.config = resolved.validate(self.shape.head_dim)
        if self.config.wide_fraction is not None and self.config.wide_layers is None:
            # Loaded only when asked for (it imports this module).
            from engine.kvcache.layer_sensitivity import calibrated_wide_layers, prose_calibration_tokens

            if calibration_tokens is None and tokenizer is not None:
                calibration_tokens = prose_calibration_tokens(tokenizer)
            layers = calibrated_wide_layers(model, self.config, calibration_tokens, progress)
            self.config = self.config.with_wide_layers(layers)
        self.config.check_wide_layers(self.shape.n_layers)
        if self.config.options.get("key_widths") == "calibrated":
            # After the wide layers: a wide layer's channels share its wider bits. Loaded only when asked for.
            from engine.kvcache.key_widths import calibrated_key_widths
            from engine.kvcache.layer_sensitivity import prose_calibration_tokens, self_written_tokens

            if calibration_tokens is None:
                calibration_tokens = (prose_calibration_tokens(tokenizer) if tokenizer is not None
                                      else [int(t) for t in self_written_tokens(model, 1, 1024)[0].tolist()])
            self.config = calibrated_key_widths(model, self.config, calibration_tokens, progress)
        return self

    def for_shape(self, shape: ModelShape) -> KVCacheBuilder:
        """Validate for a model shape alone (no calibration: a `wide=F` config builds only with its
        wide_layers named; its bits are known either way)."""
        self.shape = shape
        self.config = self.config.validate(shape.head_dim)
        self.config.check_wide_layers(shape.n_layers)
        return self

    def effective_bits_per_value(self, n_tokens: int | None = None) -> float:
        """The registry's formula for this model; with `wide=F`, averaged over its layers (floor(F·L)/L)."""
        shape = self._require_shape()
        return get_method(self.config.method).effective_bits_per_value(
            self.config, shape.head_dim, n_tokens, shape.n_kv_heads, n_layers=shape.n_layers
        )

    def build(self) -> list[VeloxKVCache]:
        """One cache per layer; installs the attention hook and mlx-lm loader registration (idempotent).
        Each cache is given the whole config and its layer index and stores `config.for_layer(i)`."""
        shape = self._require_shape()
        cache_class = get_method(self.config.method)
        install_attention_dispatch()
        register_with_mlx_lm()
        # Where a GPU runs the kernels: each layer configuration's kernels tried once against the reference path
        # (in this process: a caller that ran `verify_kernels` with its progress shown finds them done)
        self.verify_kernels()
        return [cache_class(self.config, layer_index=i) for i in range(shape.n_layers)]

    def verify_kernels(self, progress: Callable[[str, float], None] | None = None) -> KVCacheBuilder:
        """Where a GPU runs Velox's kernels, run each layer configuration's once against the reference path
        (engine/kvcache/kernel_check.py; once per process), telling `progress(message, fraction)`; `build` does it
        anyway, without progress."""
        verify_kernels(self.config, self._require_shape(), self.dtype, progress)
        return self

    def _require_shape(self) -> ModelShape:
        if self.shape is None:
            raise ConfigError("Call for_model(model) before building the KV cache.")
        return self.shape


def dense_chunks(cache: Any, chunk_tokens: int) -> Iterator[tuple[mx.array, mx.array]]:
    """(keys, values) chunks of any supported cache: a Velox cache, or mlx-lm's KVCache."""
    if hasattr(cache, "iter_dense"):
        yield from cache.iter_dense(chunk_tokens=chunk_tokens)
        return
    keys, values, offset = getattr(cache, "keys", None), getattr(cache, "values", None), cache.offset
    if offset == 0:
        return  # an empty mlx-lm KVCache has no arrays yet
    if keys is None or not isinstance(keys, mx.array):
        raise ConfigError(f"Cannot re-encode a {type(cache).__name__}: it does not hold plain keys and values.")
    for start in range(0, offset, chunk_tokens):
        end = min(start + chunk_tokens, offset)
        yield keys[..., start:end, :], values[..., start:end, :]


def reencode_caches(
    caches: list[Any], config: KVCacheConfig, chunk_tokens: int = 1024
) -> list[VeloxKVCache]:
    """New per-layer caches holding the same tokens as `caches`, stored with `config` (validated already).

    This is the live compression switch of `ChatSession.set_compression` and what `velox bench speed`
    times for it: see `reencode_into`."""
    cache_class = get_method(config.method)
    config.check_wide_layers(len(caches))
    install_attention_dispatch()
    return reencode_into(caches, [cache_class(config, layer_index=i) for i in range(len(caches))], chunk_tokens)


def reencode_into(caches: list[Any], targets: list[Any], chunk_tokens: int = 1024) -> list[Any]:
    """Fill each empty cache of `targets` with the tokens of the same layer of `caches`; returns `targets`.

    Each layer is decoded and re-encoded `chunk_tokens` at a time, so the extra memory at any moment is one
    layer's new cache plus one dense chunk (the history is dequantized once, here, not per step). A target is
    a Velox cache (which encodes the chunks itself) or mlx-lm's KVCache (the uncompressed "Off" level)."""
    if len(caches) != len(targets):
        raise ConfigError(f"Cannot re-encode {len(caches)} layers into {len(targets)}.")
    for old, new in zip(caches, targets, strict=True):
        if hasattr(new, "load_dense"):
            new.load_dense(dense_chunks(old, chunk_tokens))
            continue
        for keys, values in dense_chunks(old, chunk_tokens):
            new.update_and_fetch(keys, values)
            mx.eval(new.state)  # one chunk at a time: the old layer's decoded chunks are freed as we go
    return targets
