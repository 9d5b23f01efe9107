"""Every registered method on the real SmolLM2 keys and values at a 2k-token context: the bytes a cache
reports are exactly the arrays it holds, within the method's formula, with keys and values both
compressed; and attention through it stays close to attention over the uncompressed history."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.kvcache import KVCacheBuilder, KVCacheConfig, get_method, known_methods
from engine.planning.memory import array_bytes

PROSE = Path(__file__).parent / "data" / "prose_sample.txt"
N_TOKENS = 2048
COMPRESSED_METHODS = [name for name in known_methods() if name not in {"fp16", "fp32"}]


@pytest.fixture(scope="module")
def vq_codebooks(real_kv, tmp_path_factory):
    """VQ codebooks of SmolLM2 at 2 (the default) and 4 bits, calibrated on the first 1024 of the 2048 tokens."""
    from engine.kvcache.calibration import codebooks_from_kv
    from engine.kvcache.quant.vq import model_identity, save_codebooks

    model, kv = real_kv
    folder = tmp_path_factory.mktemp("vq")
    calibration = [(k[..., :1024, :], v[..., :1024, :]) for k, v in kv]
    for bits in (2, 4):
        arrays = codebooks_from_kv(calibration, bits, iterations=10)
        save_codebooks(folder, bits, arrays, model_identity(model, "SmolLM2"), "hadamard", 0)
    return str(folder)


def config_for(method: str, codebooks: str, **fields) -> KVCacheConfig:
    """The method's config; calibrated methods (vq) get the fixture's codebooks."""
    options = {"codebooks": codebooks} if get_method(method).needs_calibration else {}
    return KVCacheConfig(method=method, options=options, **fields)


@pytest.fixture(scope="module")
def real_kv(smollm):
    """Keys and values (after RoPE) of 2048 real prose tokens, from every layer of SmolLM2."""
    model, tokenizer, _ = smollm
    ids = tokenizer.encode(PROSE.read_text(encoding="utf-8"), add_special_tokens=False)
    ids = (ids * (N_TOKENS // len(ids) + 1))[:N_TOKENS]
    cache = make_prompt_cache(model)
    for start in range(0, N_TOKENS, 512):
        model(mx.array(ids[start:start + 512])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return model, [(c.keys[..., :N_TOKENS, :], c.values[..., :N_TOKENS, :]) for c in cache]


@pytest.mark.parametrize("method", known_methods())
def test_bytes_held_at_2k_tokens_are_honest_and_within_the_formula(real_kv, vq_codebooks, method):
    """The prompt fed as mlx-lm's generate_step feeds it: in 512-token chunks, then its last token on its own."""
    model, kv = real_kv
    caches = KVCacheBuilder(config_for(method, vq_codebooks)).for_model(model).build()
    config = caches[0].config

    def formula(n_tokens: int) -> float:
        return sum(get_method(method).expected_nbytes(config, 64, n_tokens, 3) for _ in caches)

    def feed(start: int, end: int) -> int:
        for cache, (keys, values) in zip(caches, kv, strict=True):
            for at in range(start, end, 512):
                cache.update_and_fetch(keys[..., at:min(at + 512, end), :], values[..., at:min(at + 512, end), :])
            mx.eval(cache._held_arrays() if hasattr(cache, "_held_arrays") else cache.state)
        held = sum(cache.nbytes for cache in caches)
        assert held == sum(array_bytes(cache) for cache in caches)  # reported == walked, layer by layer too
        assert all(cache.nbytes == array_bytes(cache) for cache in caches)
        return held

    # During the chunked prefill a compressed store also holds room for the next chunks (base.PREFILL_AHEAD_CHUNKS),
    # counted; the last token, on its own, gives it back, keeping the room a decode step grows (an eighth more tokens).
    assert feed(0, N_TOKENS - 1) <= formula(N_TOKENS + 3 * 512) * (1 + 1e-9)
    held = feed(N_TOKENS - 1, N_TOKENS)
    fp16_bytes = 2 * len(kv) * kv[0][0].shape[1] * N_TOKENS * kv[0][0].shape[-1] * 2
    decode_room = N_TOKENS // 8
    assert held <= formula(N_TOKENS + decode_room) * (1 + 1e-9) < formula(N_TOKENS + 3 * 512)
    if method in COMPRESSED_METHODS:
        # 16-bit keys alone (or values alone) would already take half of the fp16 bytes: both are compressed.
        assert held < fp16_bytes / 2


@pytest.mark.parametrize("method", COMPRESSED_METHODS)
def test_attention_through_4_bit_cache_stays_close_on_real_keys(real_kv, vq_codebooks, method):
    model, kv = real_kv
    keys, values = kv[5]
    config = config_for(method, vq_codebooks, key_bits=4, value_bits=4)
    cache = KVCacheBuilder(config).for_model(model).build()[5]
    cache.update_and_fetch(keys, values)
    queries = keys[:, :, -4:, :].astype(mx.float32)  # real key-like vectors as queries
    queries = mx.repeat(queries, 3, axis=1)  # 9 query heads on 3 kv heads
    scale = 64 ** -0.5
    out = cache.attention(queries, None, None, scale, None)
    reference = mx.fast.scaled_dot_product_attention(queries, keys.astype(mx.float32),
                                                     values.astype(mx.float32), scale=scale)
    error = (mx.linalg.norm(out - reference) / mx.linalg.norm(reference)).item()
    print(f"{method}: relative attention error {error:.4f}")
    assert error < 0.2  # measured 0.09 (rotated) to 0.14 (rvq); a broken rotation or codebook gives ~1
