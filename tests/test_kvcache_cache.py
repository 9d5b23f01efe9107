"""The mlx-lm cache contract: honest nbytes, compressed storage, trim, save/load, generate, re-encode."""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import generate, stream_generate
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from engine.kvcache import KVCacheBuilder, KVCacheConfig, get_method, reencode_caches
from engine.planning.memory import array_bytes
from tests.kvcache_helpers import (
    assert_save_and_load_round_trip_bit_exactly,
    assert_trim_drops_the_newest_tokens,
    build_caches,
    feed_tokens,
    random_kv,
    relative_error,
    tiny_llama,
    tiny_tokenizer,
)

CONFIGS = {
    "fp16": KVCacheConfig("fp16"),
    "fp32": KVCacheConfig("fp32"),
    "affine-4": KVCacheConfig("affine", 4, group_size=32),
    "affine-k4v2-window": KVCacheConfig("affine", 4, 2, group_size=32, residual_window=16, sink_tokens=4),
    "rotated-3": KVCacheConfig("rotated", 3, group_size=32),
    "rotated-4-window": KVCacheConfig("rotated", 4, group_size=32, residual_window=8, sink_tokens=2),
    "kivi-rotated-values": KVCacheConfig("kivi", 4, group_size=32, sink_tokens=2, options={"rotate_values": True}),
    "kivi-plain-hadamard-values": KVCacheConfig("kivi", 3, group_size=32, options={"rotate_values": "plain"}),
    "kivi-clip-search": KVCacheConfig("kivi", 4, group_size=32, sink_tokens=2, options={"clip_search": True}),
    "kivi-key-grid": KVCacheConfig("kivi", 2, group_size=32, sink_tokens=2, options={"key_grid": "lloyd"}),
    "kivi-grids": KVCacheConfig(
        "kivi", 3, group_size=32, options={"key_grid": "lloyd_ends", "value_grid": "lloyd", "key_block": 64}
    ),
    "kivi-symmetric-values-key-outliers": KVCacheConfig(
        "kivi", 3, group_size=32, sink_tokens=2,
        options={"rotate_values": True, "symmetric_values": True, "key_outliers": 1, "key_block": 64},
    ),
    "kivi-symmetric-values": KVCacheConfig("kivi", 4, 2, group_size=32, options={"symmetric_values": True}),
    # Per-layer bits: layer 0 (the one the nbytes test walks) stores k5v4, layer 1 the spec's k4v3.
    "kivi-wide-layer": KVCacheConfig(
        "kivi", 4, 3, group_size=32, sink_tokens=2,
        options={"rotate_values": True, "wide": 0.5, "wide_layers": "L0"},
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nbytes_is_every_array_held_and_matches_the_formula(name: str) -> None:
    model, caches = build_caches(CONFIGS[name])
    assert all(c.nbytes == 0 for c in caches)
    feed_tokens(model, caches, 300)
    cache = caches[0]
    assert cache.offset == 300
    assert cache.nbytes == array_bytes(cache) > 0
    method = get_method(cache.config.method)
    head_dim, n_kv_heads = 32, 2
    # Buffers grow by 256-token steps, so the formula is evaluated at the allocated token count.
    if hasattr(cache, "capacity"):
        allocated = cache.allocated_tokens
    else:
        allocated = 512
    expected = method.expected_nbytes(cache.config, head_dim, allocated, n_kv_heads)
    assert cache.nbytes == pytest.approx(expected, rel=1e-12)
    # Filled to a step boundary, nbytes equals the formula at the real token count.
    feed_tokens(model, caches, 512 - 300, seed=1)
    if hasattr(cache, "capacity") and cache.n_compressed == cache.capacity:
        assert cache.nbytes == pytest.approx(method.expected_nbytes(cache.config, head_dim, 512, n_kv_heads))


@pytest.mark.parametrize("name", ["affine-4", "affine-k4v2-window", "rotated-3", "rotated-4-window"])
def test_keys_and_values_are_both_stored_compressed(name: str) -> None:
    model, caches = build_caches(CONFIGS[name])
    feed_tokens(model, caches, 400)
    cache = caches[0]
    config = cache.config
    dense_tokens = config.sink_tokens + config.residual_window
    for array in cache._held_arrays():
        if mx.issubdtype(array.dtype, mx.floating) and array.ndim == 4:
            # Float arrays are either the few 16-bit sink/window tokens or per-group scales/biases.
            assert array.shape[-2] <= dense_tokens or array.shape[-1] == 32 // config.group_size, array.shape
    store = cache._store
    assert store["key_codes"].dtype == mx.uint32 and store["value_codes"].dtype == mx.uint32
    fp16_bytes = 2 * 400 * 2 * 32 * 2  # keys+values, tokens, kv heads, head_dim, 2 bytes
    ratio = (config.key_bits + config.value_bits) / 2 / 16
    # Allocated in 256-token steps (512 slots for ~400 tokens); scales add 32/group_size bits.
    assert cache.nbytes < fp16_bytes * 512 / 400 * (ratio + 2 / 16)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_and_load_round_trip_bit_exactly(name: str, tmp_path: Path) -> None:
    model, caches = build_caches(CONFIGS[name])
    feed_tokens(model, caches, 130, chunk=40)
    assert_save_and_load_round_trip_bit_exactly(model, caches, tmp_path / "cache.safetensors")


def test_save_and_load_an_unused_cache(tmp_path: Path) -> None:
    _, caches = build_caches(CONFIGS["rotated-3"])
    path = tmp_path / "empty.safetensors"
    save_prompt_cache(str(path), caches)
    loaded = load_prompt_cache(str(path))
    assert all(c.empty() and c.offset == 0 and c.nbytes == 0 for c in loaded)
    assert loaded[0].config == caches[0].config


@pytest.mark.parametrize("name", list(CONFIGS))
def test_trim_drops_the_newest_tokens(name: str) -> None:
    model, caches = build_caches(CONFIGS[name])
    feed_tokens(model, caches, 100, chunk=30)
    assert_trim_drops_the_newest_tokens(model, caches)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mlx_lm_generate_runs_unchanged(name: str) -> None:
    model, caches = build_caches(CONFIGS[name])
    tokenizer = tiny_tokenizer()
    prompt = " ".join(f"w{(i * 7) % 97 + 2}" for i in range(40))
    text = generate(model, tokenizer, prompt, max_tokens=6, prompt_cache=caches)
    assert len(text.split()) == 6
    mlx_lm_caches = make_prompt_cache(model)
    reference = generate(model, tokenizer, prompt, max_tokens=6, prompt_cache=mlx_lm_caches)
    assert caches[0].offset == mlx_lm_caches[0].offset  # mlx-lm feeds tokens the same way to both
    # stream_generate with a small prefill step: several prompt chunks over a growing history.
    _, fresh = build_caches(CONFIGS[name], model)
    responses = list(
        stream_generate(model, tokenizer, prompt, max_tokens=4, prompt_cache=fresh, prefill_step_size=16)
    )
    assert responses[-1].generation_tokens == 4
    if name == "fp32":
        assert text == reference  # fp32 storage is exact: the same tokens as mlx-lm's own cache


def test_greedy_tokens_with_8_bit_cache_match_the_uncompressed_model() -> None:
    model = tiny_llama()
    prompt = mx.array([(i * 13) % 97 + 2 for i in range(60)])
    reference = [int(token) for token, _ in generate_step(prompt, model, max_tokens=10)]
    caches = KVCacheBuilder(KVCacheConfig("affine", 8, group_size=32)).for_model(model).build()
    compressed = [int(token) for token, _ in generate_step(prompt, model, max_tokens=10, prompt_cache=caches)]
    assert len(compressed) == 10
    assert compressed == reference


@pytest.mark.parametrize(("source", "target"), [("affine-4", "rotated-4-window"), ("fp16", "rotated-3")])
def test_dense_export_and_re_encode_in_chunks(source: str, target: str) -> None:
    model, caches = build_caches(CONFIGS[source])
    feed_tokens(model, caches, 200)
    old = caches[0]
    new = get_method(CONFIGS[target].method)(CONFIGS[target], layer_index=0)
    new.load_dense(old.iter_dense(chunk_tokens=64))
    assert new.offset == old.offset == 200
    old_keys, old_values = old.to_dense()
    new_keys, new_values = new.to_dense()
    assert new_keys.shape == old_keys.shape and new_keys.dtype == old_keys.dtype
    assert relative_error(new_keys, old_keys) < 0.25 and relative_error(new_values, old_values) < 0.25
    # from_dense re-encodes the same way as load_dense over chunks.
    again = get_method(CONFIGS[target].method)(CONFIGS[target]).from_dense(
        old_keys, old_values, chunk_tokens=64
    )
    assert mx.array_equal(again.to_dense()[0], new_keys)


def test_batches_of_two_sequences() -> None:
    cache = get_method("rotated")(KVCacheConfig("rotated", 8, group_size=64, residual_window=4))
    keys, values = random_kv(batch=2, n_tokens=40, head_dim=64)
    cache.update_and_fetch(keys, values)
    queries = mx.random.normal((2, 4, 1, 64))
    output = cache.attention(queries, cache, cache, 0.125, None)
    single = get_method("rotated")(KVCacheConfig("rotated", 8, group_size=64, residual_window=4))
    single.update_and_fetch(keys[1:], values[1:])
    assert output.shape == (2, 4, 1, 64)
    assert mx.allclose(output[1:], single.attention(queries[1:], single, single, 0.125, None), atol=1e-5)


def test_reencode_caches_from_mlx_lm_and_between_methods() -> None:
    model = tiny_llama()
    mlx_lm_caches = make_prompt_cache(model)
    feed_tokens(model, mlx_lm_caches, 120, chunk=40)
    exact = reencode_caches(mlx_lm_caches, KVCacheConfig("fp32"), chunk_tokens=50)
    assert [c.offset for c in exact] == [120] * len(model.layers)
    for ours, theirs in zip(exact, mlx_lm_caches, strict=True):  # float32 storage: the same numbers
        keys, values = ours.to_dense()
        used = theirs.offset
        assert mx.array_equal(keys, theirs.keys[..., :used, :]) and mx.array_equal(values, theirs.values[..., :used, :])
    next_tokens = mx.array([[5, 6]])
    # On the Linux CPU fast path our cache attends with engine.runtime.cpu.attention (float rounding apart).
    assert mx.allclose(model(next_tokens, cache=exact), model(next_tokens, cache=mlx_lm_caches), atol=1e-5)
    compressed = reencode_caches(exact, KVCacheConfig("rotated", 8, group_size=32, residual_window=4))
    assert compressed[1].offset == 122 and compressed[1].layer_index == 1
    keys, _ = exact[1].to_dense()
    assert relative_error(compressed[1].to_dense()[0], keys) < 0.02


def _fill_with_fresh_tokens(cache, n_tokens: int, chunk: int) -> None:
    # The tokens live only inside this function, so afterwards the cache is all that holds memory.
    keys, values = random_kv(n_kv_heads=3, n_tokens=n_tokens, head_dim=64, seed=21)
    for start in range(0, n_tokens, chunk):
        cache.update_and_fetch(keys[..., start : start + chunk, :], values[..., start : start + chunk, :])
        mx.eval(cache._held_arrays())


@pytest.mark.parametrize(
    "config",
    [
        KVCacheConfig("affine", 4, residual_window=128, sink_tokens=4),
        KVCacheConfig("rotated", 3, group_size=32, residual_window=100, sink_tokens=4),
        KVCacheConfig("fp16"),
    ],
    ids=lambda config: config.describe(),
)
def test_nbytes_is_the_memory_mlx_really_holds(config: KVCacheConfig) -> None:
    """Sinks and window are copied out of the prefill chunks they came from: a slice would keep the
    whole 1000-token chunk alive without nbytes showing it."""
    # A first fill on a throwaway cache takes MLX's one-time allocations out of the measurement.
    _fill_with_fresh_tokens(get_method(config.method)(config), 300, chunk=100)
    gc.collect()
    # Emptying MLX's buffer cache makes every allocation below fresh: a reused cached buffer may be
    # larger than asked for, and active memory counts its full size.
    mx.clear_cache()
    before = mx.get_active_memory()
    cache = get_method(config.method)(config)
    _fill_with_fresh_tokens(cache, 2100, chunk=1000)
    gc.collect()
    assert mx.get_active_memory() - before == cache.nbytes > 0
