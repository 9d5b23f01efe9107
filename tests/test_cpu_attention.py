"""engine.runtime.cpu.attention: the Linux CPU fast path's attention equals MLX's, block by block and mask by mask."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.chat.session import _default_cache_factory
from engine.kvcache import KVCacheBuilder, KVCacheConfig, get_method
from engine.runtime.cpu import attention as cpu_attention
from tests.kvcache_helpers import tiny_llama

needs_fast_path = pytest.mark.skipif(not cpu_attention.active(), reason="the Linux CPU fast path is off here")


def _qkv(n_heads: int, n_kv: int, n_queries: int, n_keys: int, seed: int = 0) -> tuple[mx.array, ...]:
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    return (
        mx.random.normal((2, n_heads, n_queries, 64), key=k1),
        mx.random.normal((2, n_kv, n_keys, 64), key=k2) * 2,
        mx.random.normal((2, n_kv, n_keys, 64), key=k3),
    )


@pytest.mark.parametrize("block_elements", [1 << 18, 700])  # one block / many blocks of queries
@pytest.mark.parametrize(
    ("n_heads", "n_kv", "n_queries", "n_keys"),
    [(9, 3, 1, 2048), (9, 3, 200, 300), (4, 4, 33, 33), (8, 1, 5, 70)],
)
def test_grouped_attention_equals_mlx_for_every_mask_kind(
    monkeypatch: pytest.MonkeyPatch, block_elements: int, n_heads: int, n_kv: int, n_queries: int, n_keys: int
) -> None:
    monkeypatch.setattr(cpu_attention, "SCORE_BLOCK_ELEMENTS", block_elements)
    queries, keys, values = _qkv(n_heads, n_kv, n_queries, n_keys)
    positions = mx.arange(n_keys - n_queries, n_keys)[:, None] >= mx.arange(n_keys)[None]
    random_bool = mx.random.uniform(shape=(2, n_heads, n_queries, n_keys), key=mx.random.key(5)) > 0.3
    random_bool = mx.logical_or(random_bool, mx.arange(n_keys) == 0)  # every query may attend to something
    additive = mx.random.normal((n_queries, n_keys), key=mx.random.key(6))
    for mask in [None, "causal", positions, random_bool, additive]:
        expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=mask)
        got = cpu_attention.grouped_attention(queries, keys, values, 0.125, mask)
        assert got.shape == expected.shape
        assert mx.allclose(got, expected, atol=2e-6, rtol=1e-5), (None if mask is None else getattr(mask, "shape", mask))


@needs_fast_path
def test_the_exp_is_accurate_to_float32_and_exactly_zero_far_below() -> None:
    x = np.concatenate([np.linspace(-87.0, 0.0, 200_001), [-1e4, -3.4e38]]).astype(np.float32)
    got = np.array(cpu_attention._exp_of_shifted(mx.array(x)[None], mx.zeros((1, 1))))[0].astype(np.float64)
    exact = np.exp(x.astype(np.float64))
    relative = np.abs(got[:-2] - exact[:-2]) / exact[:-2]
    assert relative.max() < 3e-7  # a float32 ulp is 1.2e-7
    assert got[-1] == 0.0 and got[-2] == 0.0


def test_softmax_equals_mlx_precise_softmax() -> None:
    scores = mx.random.normal((3, 7, 1000), key=mx.random.key(1)) * 20
    assert mx.allclose(cpu_attention.softmax(scores), mx.softmax(scores, axis=-1, precise=True), atol=1e-7)
    assert mx.allclose(cpu_attention.softmax(scores).sum(axis=-1), mx.ones((3, 7)), atol=1e-6)


def test_query_blocks_stay_under_the_limit() -> None:
    assert cpu_attention.query_block(9, 2048) * 9 * 2048 <= cpu_attention.SCORE_BLOCK_ELEMENTS
    assert cpu_attention.query_block(9, 10**9) == 1  # never zero queries per block


@needs_fast_path
def test_dense_caches_attend_through_the_hook_on_the_fast_path() -> None:
    model = tiny_llama()
    for method in ("fp32", "fp16"):
        cache = get_method(method)(KVCacheConfig(method))
        keys = mx.random.normal((1, 2, 10, 64))
        fetched = cache.update_and_fetch(keys, keys)
        # mlx-lm sends attention to the hook exactly for caches with `bits`; the hook calls cache.attention.
        assert fetched == (cache, cache) and hasattr(cache, "bits")
    caches = _default_cache_factory(model)
    assert {type(c).__name__ for c in caches} == {"VeloxFp32KVCache"}
    reference = KVCacheBuilder(KVCacheConfig("fp32")).for_model(model).build()
    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7]])
    assert mx.allclose(model(tokens, cache=caches), model(tokens, cache=reference))


def test_dense_caches_use_mlx_attention_when_the_fast_path_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_attention, "_active", False)
    cache = get_method("fp32")(KVCacheConfig("fp32"))
    keys = mx.random.normal((1, 2, 10, 64))
    fetched_keys, _ = cache.update_and_fetch(keys, keys)
    assert isinstance(fetched_keys, mx.array) and mx.array_equal(fetched_keys, keys)
    assert not hasattr(cache, "bits") and not hasattr(cache, "group_size")
    assert {type(c).__name__ for c in _default_cache_factory(tiny_llama())} == {"KVCache"}


def test_attention_uses_mlx_for_one_query_and_grouped_for_more(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(cpu_attention, "grouped_attention", lambda *args: calls.append("grouped") or args[0])
    queries, keys, values = _qkv(9, 3, 1, 100)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=None)
    assert mx.array_equal(cpu_attention.attention(queries, keys, values, 0.125, None), expected) and calls == []
    queries, keys, values = _qkv(9, 3, 4, 100)
    cpu_attention.attention(queries, keys, values, 0.125, "causal")
    assert calls == ["grouped"]
