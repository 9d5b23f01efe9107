"""A model's rotary position embedding, for caches that store keys before it (KIVI's option `rope=pre`).

Why: RoPE turns each pair of key channels by an angle that grows with the position, so over a block of tokens a
channel's range becomes that of its pair's larger partner. KIVI quantizes keys per channel over a block; stored
before RoPE, each channel keeps its own range (KVQuant's observation; on SmolLM2 it cut the KL of the wide levels
by a quarter to a third, BENCHMARKS.md round 5). The cache turns incoming keys back by their positions (the
model hands it keys after RoPE) and turns decoded keys forward again before attention.

Only the plain RoPE of mlx.nn.RoPE (dims, traditional, base, scale) is read from a model: its parameters fit in
the cache's spec, so a saved cache or a re-encode needs no model. Other position schemes (scaled or per-layer
RoPE variants) are refused with a clear error rather than guessed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import ConfigError


@dataclass(frozen=True)
class RopeParameters:
    """mx.fast.rope's arguments: the leading `dims` channels rotate; `traditional` pairs (2i, 2i+1) instead
    of (i, i + dims/2); position p turns pair i by p · scale · base^(-2i/dims). (KIVI's spec options
    rope_dims, rope_base, rope_scale, rope_traditional hold these fields in this order.)"""

    dims: int
    base: float
    scale: float = 1.0
    traditional: bool = False

    def rotate(self, x: mx.array, offset: int, inverse: bool = False) -> mx.array:
        """`x` [..., T, D] with token t at position offset + t turned forward (or back), in float32."""
        scale = -self.scale if inverse else self.scale  # a negative scale turns by the opposite angle
        return mx.fast.rope(x.astype(mx.float32), self.dims, traditional=self.traditional, base=self.base,
                            scale=scale, offset=offset)

    @functools.cache  # noqa: B019 - frozen and hashable; one small array per RoPE, shared by every layer's cache
    def frequencies(self) -> mx.array:
        """Each channel pair's angle per position (float32 [dims/2]), read off mx.fast.rope itself at position 1
        (so a kernel computing position x angle turns keys as MLX's RoPE did when they were turned back)."""
        half = self.dims // 2
        first = mx.arange(half) * 2 if self.traditional else mx.arange(half)
        second = first + 1 if self.traditional else first + half
        unit = (mx.arange(self.dims)[None, :] == first[:, None]).astype(mx.float32)  # pair j's first channel
        turned = self.rotate(unit[:, None, None, :], 1)[:, 0, 0, :]  # [pair, channel] at position 1
        cosine = mx.take_along_axis(turned, first[:, None], axis=-1)[:, 0]
        sine = mx.take_along_axis(turned, second[:, None], axis=-1)[:, 0]
        return mx.arctan2(sine, cosine)


def _attention_modules(model: Any) -> list[Any]:
    # `model.layers`, where KVCacheBuilder.for_model reads a model's layers (builder.model_shape).
    layers = getattr(model, "layers", None)
    if not layers:
        raise ConfigError("Keys before RoPE (rope=pre) need the model's layers (model.layers); this model has none.")
    modules = [getattr(layer, "self_attn", None) for layer in layers]
    if any(module is None for module in modules):
        raise ConfigError("Keys before RoPE (rope=pre) need each layer's attention (self_attn); this model's differ.")
    return modules


def model_rope(model: Any) -> RopeParameters:
    """The RoPE every attention layer of `model` applies to its keys; ConfigError where it is not one plain
    mlx.nn.RoPE shared by all layers."""
    found = set()
    for module in _attention_modules(model):
        rope = getattr(module, "rope", None)
        if type(rope) is not nn.RoPE:  # subclasses and scaled variants compute other angles
            name = type(rope).__name__ if rope is not None else "no rope module"
            raise ConfigError(
                f"Keys before RoPE (rope=pre) need a model whose attention uses plain RoPE (mlx.nn.RoPE); "
                f"this one has {name}."
            )
        found.add(RopeParameters(int(rope.dims), float(rope.base), float(rope.scale), bool(rope.traditional)))
    if len(found) != 1:
        raise ConfigError("Keys before RoPE (rope=pre) need one RoPE for every layer; this model's layers differ.")
    return found.pop()
