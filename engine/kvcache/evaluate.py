"""Teacher-forced quality of KV cache configs: the same text through the model once per config.

Every token goes through the cache in chunks (as prefill does), so later chunks attend over compressed
history. Configs run in lockstep, one chunk at a time, so only one chunk of reference log-probabilities is
alive at once. Reported per config: mean next-token NLL, perplexity, and mean KL(reference || config) per
predicted token, where the reference is one of the configs (normally "fp16" or "fp32").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kvcache.builder import KVCacheBuilder
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.registry import get_method
from engine.planning.memory import array_bytes


@dataclass(frozen=True)
class QualityResult:
    name: str
    config: KVCacheConfig
    nll: float
    perplexity: float
    kl_to_reference: float
    effective_bits: float
    cache_bytes: int
    seconds: float


def teacher_forced_quality(
    model: Any,
    tokens: list[int],
    configs: dict[str, KVCacheConfig],
    reference: str,
    chunk_tokens: int = 64,
) -> dict[str, QualityResult]:
    """Run `tokens` through `model` once per config; compare each with the `reference` config."""
    if reference not in configs:
        raise ValueError(f"The reference {reference!r} must be one of the configs.")
    if len(tokens) < 2:
        raise ValueError("Need at least two tokens to score next-token predictions.")
    builders = {name: KVCacheBuilder(config).for_model(model) for name, config in configs.items()}
    caches = {name: builder.build() for name, builder in builders.items()}
    ids = mx.array(tokens)[None]
    n_predicted = len(tokens) - 1
    nll_sum = {name: mx.array(0.0) for name in configs}
    kl_sum = {name: mx.array(0.0) for name in configs}
    seconds = dict.fromkeys(configs, 0.0)
    for start in range(0, n_predicted, chunk_tokens):
        end = min(start + chunk_tokens, n_predicted)
        inputs, targets = ids[:, start:end], ids[0, start + 1 : end + 1]
        logprobs = {}
        for name in configs:
            began = time.perf_counter()
            logits = model(inputs, cache=caches[name])[0].astype(mx.float32)
            logprobs[name] = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(logprobs[name], targets[:, None], axis=-1)
            nll_sum[name] = nll_sum[name] - picked.sum()
            mx.eval(nll_sum[name], logprobs[name])
            seconds[name] += time.perf_counter() - began
        reference_probs = mx.exp(logprobs[reference])
        for name in configs:
            kl = (reference_probs * (logprobs[reference] - logprobs[name])).sum()
            kl_sum[name] = kl_sum[name] + kl
        mx.eval(kl_sum)
    results = {}
    for name, builder in builders.items():
        _give_back_room_ahead(caches[name])
        nll = nll_sum[name].item() / n_predicted
        shape = builder.shape
        assert shape is not None
        results[name] = QualityResult(
            name=name,
            config=builder.config,
            nll=nll,
            perplexity=math.exp(nll),
            kl_to_reference=kl_sum[name].item() / n_predicted,
            effective_bits=get_method(builder.config.method).effective_bits_per_value(
                builder.config, shape.head_dim, n_predicted, shape.n_kv_heads, n_layers=shape.n_layers
            ),
            cache_bytes=sum(cache.nbytes for cache in caches[name]),
            seconds=seconds[name],
        )
    return results


def _give_back_room_ahead(caches: list[Any]) -> None:
    """What a cache's first decode step does: give back the room its buffers (a compressed store, or the 16-bit
    cache's) grew ahead for more prefill chunks (base.PREFILL_AHEAD_CHUNKS), so the bytes read after a teacher-forced
    pass, which never decodes, are what the cache holds while it decodes. Other caches (mlx-lm's) have no such room."""
    for cache in caches:
        release = getattr(cache, "release_room_ahead", None)
        if release is not None:
            release()


# ----- per-token statistics for any prompt cache (benchmarks) ------------------------------------------

PromptCacheFactory = Callable[[], list[Any]]


@dataclass(frozen=True)
class TokenStats:
    """Per-token teacher-forced statistics of one prompt cache on the scored tokens (numpy arrays, one
    entry per scored next-token prediction, in position order)."""

    name: str
    nll: np.ndarray  # -log p(target)
    kl: np.ndarray  # KL(reference || this) over the vocabulary at that position
    top1_agrees: np.ndarray  # bool: this argmax == the reference's argmax
    seconds: float
    held_bytes: int  # bytes of every array the cache holds at the end (engine.planning.memory.array_bytes)


def teacher_forced_token_stats(
    model: Any,
    tokens: list[int],
    cache_factories: dict[str, PromptCacheFactory],
    reference: str,
    chunk_tokens: int = 64,
    score_from: int = 0,
) -> dict[str, TokenStats]:
    """Feed `tokens` through `model` once per prompt cache, `chunk_tokens` at a time, and return per-token
    NLL, KL(reference || cache) and top-1 agreement for the predictions of tokens[score_from + 1:].

    Unlike `teacher_forced_quality`, the caches come from factories, so mlx-lm's own caches and other
    packages' caches are compared on exactly the same footing as Velox configs. Configs run in lockstep
    one chunk at a time: per chunk the reference runs first, then every other cache, so at most two
    chunks of log-probabilities are alive. Tokens before `score_from` still pass through every cache
    (in chunks), so each scored token attends over a history that the cache has compressed.
    """
    if reference not in cache_factories:
        raise ValueError(f"The reference {reference!r} must be one of the caches.")
    if not 0 <= score_from < len(tokens) - 1:
        raise ValueError("score_from must leave at least one next-token prediction to score.")
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive.")
    order = [reference, *(name for name in cache_factories if name != reference)]
    caches = {name: cache_factories[name]() for name in order}
    ids = mx.array(tokens)[None]
    n_predicted = len(tokens) - 1
    parts: dict[str, dict[str, list[mx.array]]] = {name: {"nll": [], "kl": [], "top1": []} for name in order}
    seconds = dict.fromkeys(order, 0.0)
    for start in range(0, n_predicted, chunk_tokens):
        end = min(start + chunk_tokens, n_predicted)
        inputs = ids[:, start:end]
        scored_from = max(score_from - start, 0)  # first row of this chunk that is scored
        targets = ids[0, start + 1 + scored_from : end + 1]
        reference_logprobs = reference_probs = reference_top1 = None
        for name in order:
            began = time.perf_counter()
            logits = model(inputs, cache=caches[name])[0]
            if scored_from >= end - start:  # nothing scored in this chunk: only fill the cache
                mx.eval([getattr(cache, "state", cache) for cache in caches[name]])
                seconds[name] += time.perf_counter() - began
                continue
            logits = logits[scored_from:].astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nll = -mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
            top1 = mx.argmax(logprobs, axis=-1)
            if name == reference:
                reference_logprobs, reference_probs, reference_top1 = logprobs, mx.exp(logprobs), top1
                kl = mx.zeros_like(nll)
            else:
                kl = (reference_probs * (reference_logprobs - logprobs)).sum(axis=-1)
            agrees = top1 == reference_top1
            mx.eval(nll, kl, agrees, reference_probs)
            seconds[name] += time.perf_counter() - began
            parts[name]["nll"].append(nll)
            parts[name]["kl"].append(kl)
            parts[name]["top1"].append(agrees)
    for name in order:
        _give_back_room_ahead(caches[name])
    return {
        name: TokenStats(
            name=name,
            nll=np.array(mx.concatenate(parts[name]["nll"])),
            kl=np.array(mx.concatenate(parts[name]["kl"])),
            top1_agrees=np.array(mx.concatenate(parts[name]["top1"])),
            seconds=seconds[name],
            held_bytes=array_bytes(caches[name]),
        )
        for name in order
    }
