"""Teacher-forced quality of KV cache configs: the same text through the model once per config.

Every token goes through the cache in chunks (as prefill does), so later chunks attend over compressed
history. Configs run in lockstep, one chunk at a time, so only one chunk of reference log-probabilities is
alive at once. Reported per config: mean next-token NLL, perplexity, and mean KL(reference || config) per
predicted token, where the reference is one of the configs (normally "fp16" or "fp32").
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.kvcache.builder import KVCacheBuilder
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.registry import get_method


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
                builder.config, shape.head_dim, n_predicted, shape.n_kv_heads
            ),
            cache_bytes=sum(cache.nbytes for cache in caches[name]),
            seconds=seconds[name],
        )
    return results
