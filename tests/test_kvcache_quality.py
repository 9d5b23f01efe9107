"""Teacher-forced quality on the real default model (SmolLM2-135M): ~1k tokens of English prose fed in
chunks of 64 through each cache, every token stored compressed, compared with the fp16 cache.

The prose (tests/data/prose_sample.txt) is the opening of John Milton's *Areopagitica* (1644, public
domain, Project Gutenberg text).
"""

from __future__ import annotations

import pytest

from engine.kvcache import KVCacheConfig
from engine.kvcache.evaluate import QualityResult, teacher_forced_quality
from tests.kvcache_helpers import prose_tokens

# Prefill chunks attend through decoded blocks (the CPU-fast path; numerically the same quantized values
# as the fused path, which test_kvcache_attention checks against it).
BLOCKS = {"prefill_attention": "dequantize-blocks"}
CONFIGS = {
    "fp16": KVCacheConfig("fp16"),
    "affine-8": KVCacheConfig("affine", 8, group_size=64, options=BLOCKS),
    "affine-4": KVCacheConfig("affine", 4, group_size=64, options=BLOCKS),
    "rotated-4": KVCacheConfig("rotated", 4, group_size=64, options=BLOCKS),
    "affine-3": KVCacheConfig("affine", 3, group_size=32, options=BLOCKS),
    "rotated-3": KVCacheConfig("rotated", 3, group_size=32, options=BLOCKS),
    "affine-2": KVCacheConfig("affine", 2, group_size=32, options=BLOCKS),
}


@pytest.fixture(scope="module")
def quality(smollm) -> dict[str, QualityResult]:
    model, tokenizer, _ = smollm
    tokens = prose_tokens(tokenizer)
    assert 900 <= len(tokens) <= 1100
    return teacher_forced_quality(model, tokens, CONFIGS, reference="fp16", chunk_tokens=64)


@pytest.mark.slow
def test_kl_to_fp16_grows_as_bits_shrink(quality: dict[str, QualityResult]) -> None:
    kl = {name: result.kl_to_reference for name, result in quality.items()}
    assert kl["fp16"] == pytest.approx(0.0, abs=1e-6)
    assert 0 < kl["affine-8"] < kl["affine-4"] < kl["affine-3"] < kl["affine-2"], kl
    assert kl["affine-8"] < 0.01, kl


@pytest.mark.slow
def test_four_bit_perplexity_stays_close_to_fp16(quality: dict[str, QualityResult]) -> None:
    fp16 = quality["fp16"].perplexity
    # Measured on this text (fp16 ppl 64.2): 8-bit +0.04 %, rotated 4-bit g64 +8 to +9 %, affine 4-bit
    # g64 +11.5 % (mlx-lm's own QuantizedKVCache 4/64: +12.4 %). Paths that differ only by float rounding
    # move 4-bit ppl by ~1 % (a rounding difference flips a few codes), hence the margins.
    assert quality["affine-8"].perplexity < 1.01 * fp16
    assert quality["rotated-4"].perplexity < 1.12 * fp16
    assert quality["affine-4"].perplexity < 1.16 * fp16
    # 2-bit is broken (the issue measured the same): ppl x8 here.
    assert quality["affine-2"].perplexity > 2 * fp16


@pytest.mark.slow
def test_rotation_helps_at_low_bits(quality: dict[str, QualityResult]) -> None:
    assert quality["rotated-3"].perplexity < quality["affine-3"].perplexity
    assert quality["rotated-3"].kl_to_reference < quality["affine-3"].kl_to_reference
    assert quality["rotated-4"].kl_to_reference < quality["affine-4"].kl_to_reference


@pytest.mark.slow
def test_reported_bits_and_bytes(quality: dict[str, QualityResult]) -> None:
    assert quality["fp16"].effective_bits == 16
    assert quality["affine-4"].effective_bits == 4.5
    assert 4.5 < quality["rotated-4"].effective_bits < 4.51  # + the per-layer Hadamard signs
    assert quality["affine-4"].cache_bytes < 0.3 * quality["fp16"].cache_bytes
