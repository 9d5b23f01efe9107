"""The compression-level planner: cache sizes, fit verdicts and the recommendation table."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.errors import ConfigError, MemoryBudgetError, ModelError
from engine.kvcache import KVCacheBuilder, ModelShape
from engine.kvcache.config import KVCacheConfig, n_wide_layers
from engine.kvcache.key_widths import register_table
from engine.kvcache.quant.channel_widths import allocate_widths
from engine.models.catalog import DEFAULT_MODEL_SPEC, ModelInfo
from engine.planning.recommend import (
    LEVEL_KEYS,
    LEVEL_TABLE,
    LEVELS,
    RUNTIME_OVERHEAD_BYTES,
    cache_bytes,
    check_fits,
    fit_verdicts,
    level_by_key,
    level_verdict,
    recommend,
    resident_weights_bytes,
    working_bytes,
)

GiB = 2**30
GB = 10**9

# Llama-3.1-8B-Instruct, 4-bit MLX conversion: 32 layers, 32 query heads, 8 KV heads, head_dim 128.
LLAMA_8B = ModelInfo(
    name="Llama-3.1-8B-Instruct-4bit", path=None, source="local", model_type="llama",
    parameters=8_030_261_248, bytes_on_disk=4_500_000_000, layers=32, attention_heads=32, kv_heads=8,
    head_dim=128, max_context=131072, hidden_size=4096, vocab_size=128256, ready=True,
)
SMOLLM2 = ModelInfo(
    name="SmolLM2-135M-Instruct", path=None, source="embedded", bytes_on_disk=99_986_209, ready=True,
    layers=DEFAULT_MODEL_SPEC["layers"], attention_heads=DEFAULT_MODEL_SPEC["attention_heads"],
    kv_heads=DEFAULT_MODEL_SPEC["kv_heads"], head_dim=DEFAULT_MODEL_SPEC["head_dim"],
    max_context=DEFAULT_MODEL_SPEC["max_context"], vocab_size=DEFAULT_MODEL_SPEC["vocab_size"],
    parameters=DEFAULT_MODEL_SPEC["parameters"],
)
# A head size (80) that none of the table's group sizes (64, 32) divides: only the uncompressed level works.
ODD_HEADS = ModelInfo(
    name="odd-heads", path=None, source="local", bytes_on_disk=1_000_000_000, layers=24, attention_heads=32,
    kv_heads=32, head_dim=80, max_context=4096, vocab_size=50000, ready=True,
)

# (model, context tokens, available bytes, prefill chunk, expected level key or None)
RECOMMENDATION_TABLE = [
    # Llama-3.1-8B, default 512-token prefill chunks.
    (LLAMA_8B, 8192, 8 * GiB, 512, "8"),  # 16-bit fits, but its 1.07 GB cache is 12% of memory
    (LLAMA_8B, 8192, 16 * GiB, 512, "8"),  # 6% of memory: still worth halving
    (LLAMA_8B, 8192, 64 * GiB, 512, "16"),  # 1.6% of memory: not worth compressing
    (LLAMA_8B, 32768, 8 * GiB, 512, None),  # 4.5 GB weights + 2.1 GB prefill scores leave no room at all
    (LLAMA_8B, 32768, 16 * GiB, 512, "8"),
    (LLAMA_8B, 32768, 64 * GiB, 512, "8"),
    (LLAMA_8B, 131072, 8 * GiB, 512, None),
    (LLAMA_8B, 131072, 16 * GiB, 512, None),  # 8.6 GB of prefill scores alone
    (LLAMA_8B, 131072, 64 * GiB, 512, "8"),  # 17 GB uncompressed fits but is a quarter of memory
    # Smaller prefill chunks shrink the working memory, and compression makes the difference.
    (LLAMA_8B, 32768, 8 * GiB, 128, "4"),  # 8-bit (2.3 GB) does not fit, 4-bit (1.2 GB) does
    (LLAMA_8B, 131072, 8 * GiB, 128, None),
    (LLAMA_8B, 131072, 16 * GiB, 128, "4"),  # 8-bit would need 9.1 GB of cache
    (LLAMA_8B, 131072, int(14.4 * GB), 128, "3"),  # room for 4.3 GB: 3-bit (3.8 GB), not 4-bit (4.8 GB)
    (LLAMA_8B, 131072, int(13.0 * GB), 128, "2"),  # room for 3.2 GB: 2-bit (2.7 GB) only
    # The default model.
    (SMOLLM2, 2048, 24 * GiB, 512, "16"),
    (SMOLLM2, 8192, 24 * GiB, 512, "16"),
    (SMOLLM2, 8192, 1 * GiB, 512, "8"),  # 189 MB uncompressed is 18% of 1 GiB
    (SMOLLM2, 2048, 200 * 10**6, 512, None),  # not even the runtime fits
    # Nothing but 16-bit suits head_dim 80.
    (ODD_HEADS, 4096, 16 * GiB, 512, "16"),
]


@pytest.mark.parametrize(
    ("info", "tokens", "available", "chunk", "expected"),
    RECOMMENDATION_TABLE,
    ids=[f"{row[0].layers}L-{row[1]}tok-{row[2] / GB:.1f}GB-chunk{row[3]}" for row in RECOMMENDATION_TABLE],
)
def test_recommendation_table(
    info: ModelInfo, tokens: int, available: int, chunk: int, expected: str | None
) -> None:
    recommendation = recommend(info, tokens, available, prefill_chunk=chunk)
    assert (recommendation.level.key if recommendation.level else None) == expected, recommendation.reason
    assert recommendation.reason
    if expected is None:
        assert recommendation.reason.startswith("Nothing fits")
        assert "more free memory" in recommendation.reason
        assert not any(verdict.fits for verdict in recommendation.verdicts)
    else:
        chosen = next(v for v in recommendation.verdicts if v.level.key == expected)
        assert chosen.fits and chosen.needed_bytes <= 0.8 * available
        # Nothing more precise is recommended-and-fitting except 16-bit ruled out by the small-cache rule.
        more_precise = LEVEL_KEYS[: LEVEL_KEYS.index(expected)]
        fitting_more_precise = [k for k in more_precise if next(v for v in recommendation.verdicts
                                                              if v.level.key == k).fits]
        assert fitting_more_precise in ([], ["16"])


def test_two_bit_reason_warns_about_quality() -> None:
    recommendation = recommend(LLAMA_8B, 131072, int(13.0 * GB), prefill_chunk=128)
    assert recommendation.level is not None and recommendation.level.key == "2"
    assert "quality is poor" in recommendation.reason


def test_missing_memory_is_exactly_enough() -> None:
    """The memory a 'nothing fits' answer says is missing really makes the smallest level fit."""
    recommendation = recommend(LLAMA_8B, 131072, 8 * GiB)
    assert recommendation.level is None
    smallest = min(recommendation.verdicts, key=lambda verdict: verdict.needed_bytes)
    assert smallest.level.key == "2"
    missing = smallest.missing_bytes
    assert missing > 0
    assert recommend(LLAMA_8B, 131072, 8 * GiB + missing).level is not None
    assert recommend(LLAMA_8B, 131072, 8 * GiB + missing - 10**6).level is None


def test_context_longer_than_the_model_is_capped_and_said() -> None:
    recommendation = recommend(SMOLLM2, 32768, 24 * GiB)
    assert recommendation.context_capped
    assert recommendation.n_tokens == 8192
    assert recommendation.level is not None and recommendation.level.key == "16"
    assert "8192 tokens" in recommendation.reason and "32768" in recommendation.reason
    verdicts = fit_verdicts(SMOLLM2, 32768, 24 * GiB)
    assert all(verdict.exceeds_context for verdict in verdicts)
    assert "exceed the model's 8192-token context" in verdicts[0].message
    assert not any(verdict.exceeds_context for verdict in fit_verdicts(SMOLLM2, 8192, 24 * GiB))


def test_cache_bytes_follow_the_formula() -> None:
    tokens = 8192
    assert cache_bytes(LLAMA_8B, tokens, "16") == LLAMA_8B.kv_bytes_per_token(16) * tokens == 2**30
    # 8-bit affine, group 64: 8 bits + an fp16 scale and bias (32 bits) per 64 values = 8.5 bits.
    assert cache_bytes(LLAMA_8B, tokens, "8") == tokens * 2 * 32 * 8 * 128 * 8.5 / 8
    sizes = [cache_bytes(LLAMA_8B, tokens, level) for level in LEVELS]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert cache_bytes(LLAMA_8B, 0, "4") == 0


def test_level_bits_are_the_registry_formula_of_their_config() -> None:
    from engine.kvcache.registry import get_method

    for level in LEVELS:
        formula = get_method(level.config.method).effective_bits_per_value(level.config, 128)
        assert level.effective_bits == formula, level.key
    assert level_by_key("16").effective_bits == 16.0
    assert level_by_key("8").effective_bits == 8.5
    # 4-bit codes; keys: an fp16 scale and bias per channel and 128-token block (0.25 bits), values: per 64
    # channels (0.5 bits); a tenth of the layers one bit wider (wide=0.1: +0.1). The 4 sink tokens' 16 bits
    # vanish in this per-value figure of an endless context.
    assert level_by_key("4").effective_bits == pytest.approx(4.375 + 0.1)
    assert level_by_key("2").effective_bits == pytest.approx(2.375 + 0.1)  # 2-bit codes, the same scales, wide=0.1


@pytest.mark.parametrize("key", LEVEL_KEYS)
def test_estimate_matches_a_real_cache(key: str) -> None:
    """The bytes real Velox caches of every layer hold after 1024 tokens match the estimate."""
    level = level_by_key(key)
    config = level.config.validate(SMOLLM2.head_dim)
    if config.wide_fraction is not None:
        # which layers a calibration widens does not change the bytes: name the first ones
        config = config.with_wide_layers(range(n_wide_layers(config.wide_fraction, SMOLLM2.layers)))
    if "key_widths" in config.options:
        # nor which key channels get which width: any table averaging each layer's bits
        layer_bits = [config.key_bits + (layer < n_wide_layers(config.wide_fraction or 0.0, SMOLLM2.layers))
                      for layer in range(SMOLLM2.layers)]
        rng = np.random.default_rng(0)
        digest = register_table([allocate_widths(rng.lognormal(0.0, 1.0, (SMOLLM2.kv_heads, SMOLLM2.head_dim)), bits)
                                 for bits in layer_bits])
        config = replace(config, options={**config.options, "key_widths": digest})
    shape = ModelShape(n_layers=SMOLLM2.layers, n_heads=SMOLLM2.kv_heads, n_kv_heads=SMOLLM2.kv_heads,
                       head_dim=SMOLLM2.head_dim)
    caches = KVCacheBuilder(config).for_shape(shape).build()
    keys = mx.random.normal((1, SMOLLM2.kv_heads, 1024, SMOLLM2.head_dim))
    values = mx.random.normal((1, SMOLLM2.kv_heads, 1024, SMOLLM2.head_dim))
    for cache in caches:
        cache.update_and_fetch(keys, values)
    mx.eval([cache.state for cache in caches])
    assert sum(cache.nbytes for cache in caches) == pytest.approx(cache_bytes(SMOLLM2, 1024, level), rel=0.01)


def test_the_uncompressed_level_counts_the_floats_the_loaded_model_computes_in(smollm) -> None:
    # The app's "Off" level is the session's default cache (mlx-lm's KVCache, or on the Linux CPU fast path
    # Velox's float32 cache): it holds keys and values in the model's compute dtype, which load_model reports.
    from engine.chat.session import _default_cache_factory
    from engine.runtime.cpu.weights import prefer_fp32_weights

    model, _, info = smollm
    assert info.compute_bits == (32 if prefer_fp32_weights() else 16)
    caches = _default_cache_factory(model)
    model(mx.array([[1 + i % 500 for i in range(1024)]]), cache=caches)
    mx.eval([cache.state for cache in caches])
    held = sum(cache.nbytes for cache in caches)
    assert held == pytest.approx(cache_bytes(info, 1024, "16"), rel=0.01)
    # a folder inspected without loading says 16 bits; the compressed levels store 16-bit parts whatever it says
    assert cache_bytes(replace(info, compute_bits=16), 1024, "16") * info.compute_bits // 16 == cache_bytes(
        info, 1024, "16")
    assert cache_bytes(replace(info, compute_bits=16), 1024, "4") == cache_bytes(info, 1024, "4")


def test_a_cache_configuration_of_ones_own_is_counted_by_its_own_formula() -> None:
    # `velox chat --kv SPEC` checks memory for its own configuration, not for the level with as many bits (or the
    # 16-bit one, where no level had them)
    from app.commands import _level_for
    from engine.kvcache import get_method

    config = KVCacheConfig.parse("affine:k2v2:g64")
    custom = _level_for(config)
    assert custom.config == config and custom.key not in LEVEL_KEYS
    assert _level_for(None) is LEVELS[0] and _level_for(LEVELS[2].config) is LEVELS[2]
    # Velox's own 16-bit cache stores 16 bits even where the model computes in float32 (the default cache does not)
    sixteen = _level_for(LEVELS[0].config)
    assert cache_bytes(replace(LLAMA_8B, compute_bits=32), 8192, sixteen) == cache_bytes(LLAMA_8B, 8192, "16")
    bits = get_method("affine").effective_bits_per_value(config, 128, 8192, 8)
    verdict = level_verdict(LLAMA_8B, 8192, custom, 64 * GiB)
    assert verdict.fits and verdict.cache_bytes == -(-8192 * 2 * 32 * 8 * 128 * bits // 8)
    assert verdict.cache_bytes < cache_bytes(LLAMA_8B, 8192, "4") < cache_bytes(LLAMA_8B, 8192, "16")
    assert check_fits(LLAMA_8B, 8192, custom, 64 * GiB) == verdict
    # every level's verdict in fit_verdicts is the one level_verdict gives
    assert fit_verdicts(LLAMA_8B, 8192, 8 * GiB) == [level_verdict(LLAMA_8B, 8192, level, 8 * GiB) for level in LEVELS]
    with pytest.raises(MemoryBudgetError, match="affine"):
        check_fits(LLAMA_8B, 131072, custom, 8 * GiB)


def test_levels_make_valid_configs() -> None:
    assert [row[0] for row in LEVEL_TABLE] == ["16", "8", "4", "3", "2"]
    for (key, label, spec, note, measured), level in zip(LEVEL_TABLE, LEVELS, strict=True):
        assert (level.key, level.label, str(level.config), level.quality_note, level.measured) == (
            key, label, spec, note, measured)
        assert level.config.validate(128) == level.config  # written out in full: nothing left to a default
    assert level_by_key("16").config == KVCacheConfig("fp16", 16, 16, 64)
    assert level_by_key("4").config == KVCacheConfig("kivi", 4, 4, 64, sink_tokens=4,
                                                     options={"key_block": 128, "key_widths": "calibrated",
                                                              "rotate_values": True, "wide": 0.1})
    assert level_by_key("2").config.options["rope"] == "auto"  # the one level that stores keys before RoPE on a GPU
    with pytest.raises(ConfigError, match="Unknown compression level"):
        level_by_key("5")


def test_verdict_sentences() -> None:
    verdicts = {v.level.key: v for v in fit_verdicts(LLAMA_8B, 131072, 16 * GiB, prefill_chunk=128)}
    assert verdicts["4"].message == "fits at 4-bit: 4.8 GB of cache"
    # 25.0 GB: 2,048 tokens of decode room (decode_room_bytes) and one layer's old buffers while a growth copies them
    # (growth_copy_bytes: 17.2 GB / 32 layers) included
    assert verdicts["16"].message.startswith("does not fit at Off (16-bit): needs 25.0 GB")
    assert "17.2 GB free" in verdicts["16"].message
    odd = {v.level.key: v for v in fit_verdicts(ODD_HEADS, 1024, 16 * GiB)}
    assert odd["16"].supported and not odd["8"].supported and not odd["8"].fits
    assert "head_dim 80 is not divisible by 64" in odd["8"].message


def test_working_memory_and_weights() -> None:
    chunk_scores = 512 * 131072 * 32 * 4
    assert working_bytes(LLAMA_8B, 131072) == RUNTIME_OVERHEAD_BYTES + chunk_scores + 512 * 128256 * 4
    # A short prompt is prefilled in one chunk of its own length.
    assert working_bytes(SMOLLM2, 100) == RUNTIME_OVERHEAD_BYTES + 100 * 100 * 9 * 4 + 100 * 49152 * 4
    assert resident_weights_bytes(LLAMA_8B) == 4_500_000_000
    assert resident_weights_bytes(LLAMA_8B, fp32_weights=True) == 8_030_261_248 * 4
    # Weights already loaded (weights_bytes=0) leave more room.
    assert recommend(LLAMA_8B, 32768, 8 * GiB).level is None
    assert recommend(LLAMA_8B, 32768, 8 * GiB, weights_bytes=0).level is not None


def test_check_fits_refuses_before_the_os_kills_us() -> None:
    verdict = check_fits(LLAMA_8B, 131072, "4", 16 * GiB, prefill_chunk=128)
    assert verdict.fits
    with pytest.raises(MemoryBudgetError, match=r"would need 25\.0 GB") as caught:
        check_fits(LLAMA_8B, 131072, level_by_key("16"), 16 * GiB, prefill_chunk=128)
    assert "stronger compression level" in str(caught.value)
    with pytest.raises(ConfigError):
        check_fits(ODD_HEADS, 1024, "4", 16 * GiB)


def test_a_gpu_prefills_in_the_largest_chunk_that_still_fits() -> None:
    """prefill_chunk_for: on a GPU the largest of GPU_PREFILL_CHUNKS whose working memory fits with the cache (a long
    context that fits only with the default chunk keeps it); a CPU always keeps the default."""
    from engine.planning.recommend import DEFAULT_PREFILL_CHUNK, GPU_PREFILL_CHUNKS, prefill_chunk_for

    assert GPU_PREFILL_CHUNKS == (2048, 1024) and DEFAULT_PREFILL_CHUNK == 512
    assert prefill_chunk_for(SMOLLM2, 8192, "3", 16 * GiB, gpu=True) == 2048
    assert prefill_chunk_for(SMOLLM2, 8192, "3", 16 * GiB, gpu=False) == 512
    # Llama-3.1-8B at 128k tokens, 4-bit level: a chunk's fp32 scores are 8.6 GB at 512 tokens, 34 GB at 2,048
    chosen = {free: prefill_chunk_for(LLAMA_8B, 131072, "4", free * GiB, gpu=True) for free in (24, 34, 64)}
    assert chosen == {24: 512, 34: 1024, 64: 2048}
    for free, chunk in chosen.items():
        assert check_fits(LLAMA_8B, 131072, "4", free * GiB, prefill_chunk=chunk).fits
        for larger in (size for size in GPU_PREFILL_CHUNKS if size > chunk):
            with pytest.raises(MemoryBudgetError):
                check_fits(LLAMA_8B, 131072, "4", free * GiB, prefill_chunk=larger)
    # Nothing fits (not even the default chunk): the default, whose refusal check_fits gives
    assert prefill_chunk_for(LLAMA_8B, 131072, "16", 16 * GiB, gpu=True) == 512


def test_model_without_a_shape_is_an_error() -> None:
    broken = ModelInfo(name="broken", path=Path("/nowhere"), source="local")
    with pytest.raises(ModelError, match="does not say its shape"):
        recommend(broken, 1024, 16 * GiB)
    with pytest.raises(ModelError):
        cache_bytes(broken, 1024, "16")


def test_every_level_budgets_the_room_a_chunked_prefill_grows_and_the_real_cache_stays_within() -> None:
    """fit_verdicts counts, at every level and for a prompt of more than one chunk, the room the cache grows
    ahead for the next chunks (prefill_room_bytes); a real cache fed the prompt chunk by chunk never holds more than
    the cache the formula gives (at the tokens rounded up to the 256-token step) plus that room."""
    from engine.kvcache import get_method
    from engine.planning.recommend import decode_room_bytes, growth_copy_bytes, prefill_room_bytes

    chunk, n_tokens = 512, 3000
    eight = level_by_key("8")
    verdicts = {v.level.key: v for v in fit_verdicts(SMOLLM2, n_tokens, 64 * GiB, prefill_chunk=chunk)}
    room = prefill_room_bytes(SMOLLM2, n_tokens, eight, chunk)
    assert room == cache_bytes(SMOLLM2, 3 * chunk, eight) > 0
    def working(key: str, room: int) -> int:  # a chunk's working memory, the room and a growth's copy of one layer
        copy = growth_copy_bytes(SMOLLM2, n_tokens, key, room)
        assert copy == -(-(cache_bytes(SMOLLM2, n_tokens, key) + room) // SMOLLM2.layers) > 0
        return working_bytes(SMOLLM2, n_tokens, chunk) + room + copy

    assert verdicts["8"].working_bytes == working("8", room)
    assert prefill_room_bytes(SMOLLM2, chunk, eight, chunk) == 0  # one chunk: no room
    # a decoding cache's room (an eighth of its tokens, at most 2,048); the 16-bit cache grows a prefill's room too,
    # the larger here
    assert decode_room_bytes(SMOLLM2, n_tokens, "16") == cache_bytes(SMOLLM2, n_tokens // 8, "16") > 0
    assert prefill_room_bytes(SMOLLM2, n_tokens, "16", chunk) == cache_bytes(SMOLLM2, 3 * chunk, "16") > (
        decode_room_bytes(SMOLLM2, n_tokens, "16"))
    assert verdicts["16"].working_bytes == working("16", prefill_room_bytes(SMOLLM2, n_tokens, "16", chunk))
    assert decode_room_bytes(SMOLLM2, 100_000, eight) == cache_bytes(SMOLLM2, 2048, eight)
    long = {v.level.key: v for v in fit_verdicts(SMOLLM2, 100_000, 64 * GiB, prefill_chunk=chunk)}
    long_room = max(prefill_room_bytes(SMOLLM2, 100_000, eight, chunk), decode_room_bytes(SMOLLM2, 100_000, eight))
    assert long["8"].working_bytes == working_bytes(SMOLLM2, 100_000, chunk) + long_room + growth_copy_bytes(
        SMOLLM2, 100_000, eight, long_room)
    # a level that widens some layers copies the widest layer's buffers: the 2-bit level's are 3-bit ones
    two = level_by_key("2")
    assert two.config.wide_fraction and growth_copy_bytes(SMOLLM2, n_tokens, two, 0) > 1.3 * (
        cache_bytes(SMOLLM2, n_tokens, two) / SMOLLM2.layers)

    info = replace(SMOLLM2, layers=1)
    data = mx.random.normal((1, info.kv_heads, n_tokens, info.head_dim), key=mx.random.key(3)).astype(mx.bfloat16)
    for level in (eight, level_by_key("16")):
        (cache,) = KVCacheBuilder(level.config).for_shape(ModelShape(
            n_layers=1, n_heads=info.attention_heads, n_kv_heads=info.kv_heads, head_dim=info.head_dim)).build()
        held = []
        for start in range(0, n_tokens, chunk):
            cache.update_and_fetch(data[..., start:start + chunk, :], data[..., start:start + chunk, :])
            mx.eval(cache.state)
            held.append(cache.nbytes)
        step = get_method(level.config.method).step
        tidy = cache_bytes(info, -(-n_tokens // step) * step, level)
        assert tidy < max(held) <= tidy + prefill_room_bytes(info, n_tokens, level, chunk)  # the room held, counted


def test_a_live_switch_is_checked_against_the_memory_free_beside_the_held_cache() -> None:
    """check_switch_fits: the new cache, its room ahead while the chunks are re-encoded, one layer's growth copy and
    one dense chunk must fit beside the cache still held. A person at 16 bits near the limit can still compress (the
    turn check, which also budgets a prefill chunk's scores, would refuse the same memory), and a switch up that
    would not fit is refused with the reason before anything is re-encoded."""
    import inspect

    from engine.chat.session import ChatSession
    from engine.kvcache.builder import reencode_into
    from engine.planning.recommend import (
        SWITCH_CHUNK_TOKENS,
        check_switch_fits,
        growth_copy_bytes,
        prefill_room_bytes,
        switch_bytes,
    )

    for function in (ChatSession.set_compression, reencode_into):  # the chunk the check counts is the switch's
        assert inspect.signature(function).parameters["chunk_tokens"].default == SWITCH_CHUNK_TOKENS
    n_tokens = 131072
    room = prefill_room_bytes(LLAMA_8B, n_tokens, "4", SWITCH_CHUNK_TOKENS)
    assert switch_bytes(LLAMA_8B, n_tokens, "4") == (
        cache_bytes(LLAMA_8B, n_tokens, "4") + room + growth_copy_bytes(LLAMA_8B, n_tokens, "4", room)
        + SWITCH_CHUNK_TOKENS * 2 * 8 * 128 * 4)
    assert switch_bytes(LLAMA_8B, 0, "4") == 0
    # 16-bit at 131k holds 17.2 GB; 8 GB free beside it: compressing to 4 bits fits, a fresh turn's check would not
    free = 8 * GiB
    assert check_switch_fits(LLAMA_8B, n_tokens, "4", free) == switch_bytes(LLAMA_8B, n_tokens, "4")
    with pytest.raises(MemoryBudgetError):
        check_fits(LLAMA_8B, n_tokens, "4", free, weights_bytes=0, prefill_chunk=512)
    with pytest.raises(MemoryBudgetError, match=r"Switching 131072 tokens .* to Off \(16-bit\) would need 18\.\d GB"):
        check_switch_fits(LLAMA_8B, n_tokens, "16", 16 * GiB)


def test_a_real_switch_stays_within_what_the_check_counts(smollm) -> None:
    """The memory a real switch of SmolLM2's 30 layers from the 16-bit cache to the 4-bit level allocates beside the
    cache it re-encodes (MLX's peak above what was in use before) stays within switch_bytes, and is most of it."""
    from engine.kvcache.builder import reencode_into
    from engine.planning.recommend import switch_bytes

    model, tokenizer, info = smollm
    n_tokens = 3000
    caches = KVCacheBuilder(level_by_key("16").config).for_model(model).build()
    for start in range(0, n_tokens, 512):
        data = mx.random.normal((1, info.kv_heads, min(512, n_tokens - start), info.head_dim), key=mx.random.key(start))
        for cache in caches:
            cache.update_and_fetch(data, data)
        mx.eval([cache.state for cache in caches])
    targets = KVCacheBuilder(level_by_key("4").config).for_model(model, tokenizer=tokenizer).build()  # bundled widths
    mx.synchronize()
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    reencode_into(caches, targets)
    mx.eval([cache.state for cache in targets])
    rise = mx.get_peak_memory() - active
    assert 0.5 * switch_bytes(info, n_tokens, "4") < rise <= switch_bytes(info, n_tokens, "4"), rise
