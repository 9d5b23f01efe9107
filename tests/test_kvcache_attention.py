"""Attention over compressed storage: the dispatch hook, masks, GQA, dtypes, and accuracy by bits."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import pytest
from mlx_lm.models import llama
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

import engine.kvcache.base as kv_base
from engine.errors import ConfigError
from engine.kvcache import (
    KVCacheConfig,
    attention_dispatch_installed,
    install_attention_dispatch,
    uninstall_attention_dispatch,
)
from engine.kvcache.attention import original_quantized_sdpa
from engine.kvcache.kernels import available_backend
from tests.kvcache_helpers import (
    filled,
    key_and_attention_errors,
    make_cache,
    queries_for,
    random_kv,
    reference_attention,
    relative_error,
    tiny_llama,
)

# ----- dispatch hook ----------------------------------------------------------------------------------


def test_dispatch_install_and_uninstall_are_idempotent_and_reversible() -> None:
    public_sdpa = mlx_base.scaled_dot_product_attention
    uninstall_attention_dispatch()
    assert mlx_base.quantized_scaled_dot_product_attention is original_quantized_sdpa()
    install_attention_dispatch()
    install_attention_dispatch()
    assert attention_dispatch_installed()
    assert mlx_base.quantized_scaled_dot_product_attention is not original_quantized_sdpa()
    uninstall_attention_dispatch()
    uninstall_attention_dispatch()
    assert not attention_dispatch_installed()
    assert mlx_base.quantized_scaled_dot_product_attention is original_quantized_sdpa()
    # The function models import by name is never touched.
    assert mlx_base.scaled_dot_product_attention is public_sdpa
    assert llama.scaled_dot_product_attention is public_sdpa


def _on_cuda() -> bool:
    return available_backend() == "cuda"


@pytest.mark.skipif(_on_cuda(), reason="mlx-lm's QuantizedKVCache needs quantized_matmul shapes MLX's CUDA lacks")
def test_mlx_lm_caches_are_untouched_by_the_hook() -> None:
    model = tiny_llama()
    tokens = mx.random.randint(0, 100, (1, 40), key=mx.random.key(1))

    def run_plain() -> mx.array:
        caches = make_prompt_cache(model)
        out = model(tokens[:, :24], cache=caches)
        return mx.concatenate([out, model(tokens[:, 24:], cache=caches)], axis=1)

    def run_quantized() -> mx.array:
        # mlx-lm's own QuantizedKVCache (bits/group_size set) goes through the hooked function.
        caches = make_prompt_cache(model)
        model(tokens[:, :24], cache=caches)
        caches = [c.to_quantized(group_size=32, bits=4) for c in caches]
        return model(tokens[:, 24:], cache=caches)

    uninstall_attention_dispatch()
    plain_before, quantized_before = run_plain(), run_quantized()
    install_attention_dispatch()
    plain_after, quantized_after = run_plain(), run_quantized()
    assert mx.array_equal(plain_before, plain_after)
    assert mx.array_equal(quantized_before, quantized_after)


def test_a_velox_cache_reinstalls_the_hook_on_first_use() -> None:
    uninstall_attention_dispatch()
    cache = make_cache("affine", 4, group_size=32)
    keys, values = random_kv(n_tokens=8, head_dim=32)
    cache.update_and_fetch(keys, values)
    assert attention_dispatch_installed()


def test_model_attention_goes_through_the_cache() -> None:
    model = tiny_llama()
    caches = [make_cache("affine", 8, group_size=32) for _ in model.layers]
    calls = []
    original = type(caches[0]).attention

    def counting(self, *args, **kwargs):
        calls.append(self.layer_index)
        return original(self, *args, **kwargs)

    type(caches[0]).attention = counting
    try:
        model(mx.array([[3, 4, 5]]), cache=caches)
    finally:
        type(caches[0]).attention = original
    assert len(calls) == len(model.layers)


# ----- accuracy against dense attention ---------------------------------------------------------------


@pytest.mark.parametrize("method", ["affine", "rotated"])
@pytest.mark.parametrize(
    "options",
    [{}, {"residual_window": 16}, {"sink_tokens": 4, "residual_window": 16}, {"sink_tokens": 200}],
)
def test_fused_attention_equals_attention_over_the_decoded_cache(method: str, options: dict) -> None:
    """The fused path computes exactly attention over what the cache stores (no hidden fp16 copy)."""
    keys, values = random_kv(n_kv_heads=2, n_tokens=150, head_dim=64, seed=2)
    cache = filled(make_cache(method, 4, 3, group_size=32, **options), keys, values)
    assert cache.offset == 150
    dense_keys, dense_values = cache.to_dense()
    queries = queries_for(6, 16, 64)
    for mask in ("causal", None):
        fused = cache.attention(queries, cache, cache, scale=0.125, mask=mask)
        expected = reference_attention(queries, dense_keys, dense_values, 0.125, mask)
        assert relative_error(fused, expected) < 2e-3


def test_segments_hold_sinks_window_and_compressed_middle() -> None:
    keys, values = random_kv(n_tokens=100, head_dim=64, seed=3)
    cache = filled(make_cache("affine", 4, group_size=64, sink_tokens=4, residual_window=16), keys, values)
    assert (cache.n_sink, cache.n_compressed, cache.n_window) == (4, 80, 16)
    dense_keys, dense_values = cache.to_dense()
    # Sink and window tokens are exact in fp16; the middle is quantized (close, not equal).
    for dense, original in ((dense_keys, keys), (dense_values, values)):
        rounded = original.astype(mx.float16).astype(mx.float32)
        assert mx.array_equal(dense[..., :4, :], rounded[..., :4, :])
        assert mx.array_equal(dense[..., -16:, :], rounded[..., -16:, :])
        middle_error = relative_error(dense[..., 4:-16, :], original[..., 4:-16, :])
        assert 0 < middle_error < 0.15


@pytest.mark.parametrize("method", ["affine", "rotated"])
def test_attention_error_decreases_with_bits(method: str) -> None:
    keys, values = random_kv(n_tokens=256, head_dim=64, seed=4)
    queries = queries_for(4, 8, 64)
    expected = reference_attention(queries, keys, values, 0.3, "causal")
    errors = []
    for bits in (2, 3, 4, 5, 6, 8):
        cache = filled(make_cache(method, bits, group_size=64), keys, values)
        errors.append(relative_error(cache.attention(queries, cache, cache, 0.3, "causal"), expected))
    assert errors == sorted(errors, reverse=True), errors
    assert errors[-1] < 0.03 and errors[0] > 2.5 * errors[2]


@pytest.mark.parametrize(("bits", "group_size"), [(4, 64), (3, 32)])
def test_rotation_beats_plain_affine_on_keys_with_outlier_channels(bits: int, group_size: int) -> None:
    # Three channels 8x larger than the rest, as in real keys. (Measured: with extreme single-channel
    # outliers, 25x, and groups of 32, plain affine can win: it stores a group's extreme exactly.)
    keys, values = random_kv(n_tokens=256, head_dim=64, seed=6, outlier_channels=(3, 17, 40), outlier_scale=8)
    queries = queries_for(4, 8, 64)
    expected = reference_attention(queries, keys, values, 0.05, None)
    results = {}
    for method in ("affine", "rotated"):
        cache = filled(make_cache(method, bits, group_size=group_size), keys, values)
        results[method] = key_and_attention_errors(cache, keys, queries, expected, 0.05)
    assert results["rotated"][0] < 0.75 * results["affine"][0], results
    assert results["rotated"][1] < 0.9 * results["affine"][1], results


# ----- masks, GQA, dtypes -----------------------------------------------------------------------------


def test_mask_forms_from_mlx_lm_agree() -> None:
    keys, values = random_kv(n_kv_heads=2, n_tokens=120, head_dim=64, seed=7)
    cache = filled(make_cache("affine", 8, group_size=64, residual_window=8), keys, values)
    queries = queries_for(4, 20, 64)
    dense_keys, dense_values = cache.to_dense()
    causal = cache.attention(queries, cache, cache, 0.125, "causal")
    boolean = create_causal_mask(20, offset=100)
    assert mx.allclose(cache.attention(queries, cache, cache, 0.125, boolean), causal, atol=1e-6)
    additive = mx.where(boolean, 0.0, -1e9)
    assert mx.allclose(cache.attention(queries, cache, cache, 0.125, additive), causal, atol=1e-5)
    # A batch/head mask [B, 1, L, N], and a per-query-head one with a different pattern per head.
    assert mx.allclose(cache.attention(queries, cache, cache, 0.125, boolean[None, None]), causal, atol=1e-6)
    per_head = mx.broadcast_to(boolean, (1, 4, 20, 120)) & (mx.arange(4)[None, :, None, None] != 1)[..., :1]
    per_head = per_head | (mx.arange(120) < 50)[None, None, None]
    got = cache.attention(queries, cache, cache, 0.125, per_head)
    expected = reference_attention(queries, dense_keys, dense_values, 0.125, per_head)
    assert relative_error(got, expected) < 2e-3  # fp16 rounding of dequantized values in the reference


@pytest.mark.parametrize(("n_query_heads", "n_kv_heads"), [(2, 2), (6, 2), (9, 3), (8, 1)])
def test_grouped_query_attention(n_query_heads: int, n_kv_heads: int) -> None:
    keys, values = random_kv(n_kv_heads=n_kv_heads, n_tokens=70, head_dim=64, seed=8)
    cache = filled(make_cache("rotated", 8, group_size=64, residual_window=5), keys, values)
    queries = queries_for(n_query_heads, 3, 64)
    expected = reference_attention(queries, keys, values, 0.125, "causal")
    assert relative_error(cache.attention(queries, cache, cache, 0.125, "causal"), expected) < 0.02


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("method", ["affine", "rotated"])
def test_input_dtypes(dtype: mx.Dtype, method: str) -> None:
    keys, values = random_kv(n_tokens=64, head_dim=64, seed=9, dtype=dtype)
    cache = filled(make_cache(method, 8, group_size=64, residual_window=4), keys, values)
    queries = queries_for(4, 2, 64, dtype=dtype)
    output = cache.attention(queries, cache, cache, 0.125, "causal")
    assert output.dtype == dtype
    expected = reference_attention(queries, keys, values, 0.125, "causal")
    assert relative_error(output, expected) < 0.03
    dense_keys, _ = cache.to_dense()
    assert dense_keys.dtype == dtype


def test_model_logits_with_compressed_caches_track_the_uncompressed_model() -> None:
    model = tiny_llama()
    tokens = mx.random.randint(0, 100, (1, 96), key=mx.random.key(11))
    reference = model(tokens, cache=[KVCache() for _ in model.layers])
    errors = {}
    for bits in (8, 4, 2):
        caches = [make_cache("affine", bits, group_size=32) for _ in model.layers]
        outputs = [model(tokens[:, s : s + 32], cache=caches) for s in range(0, 96, 32)]
        errors[bits] = relative_error(mx.concatenate(outputs, axis=1), reference)
    assert errors[8] < 0.05
    assert errors[8] < errors[4] < errors[2]


@pytest.mark.parametrize("whole_history", [False, True], ids=["key-blocks", "whole-history"])
@pytest.mark.parametrize("method", ["affine", "rotated", "kivi", "turboquant"])
def test_dequantize_blocks_prefill_matches_the_fused_path(method: str, whole_history: bool, monkeypatch) -> None:
    monkeypatch.setattr(kv_base, "DEQUANTIZE_BLOCK_TOKENS", 64)  # several blocks, a partial last one
    # A chunk attends over the whole decoded history at once (CPU fast path, GPU), up to a byte cap.
    monkeypatch.setattr(kv_base, "DENSE_HISTORY_MAX_BYTES", 1 << 30 if whole_history else 0)
    assert not whole_history or kv_base._dense_attention(mx.float32) is not None, "no whole-history path here"
    keys, values = random_kv(n_kv_heads=2, n_tokens=150, head_dim=64, seed=12)
    segments = {"sink_tokens": 4, "residual_window": 8}
    fused = filled(
        make_cache(method, 4, 3, group_size=64, options={"prefill_attention": "fused"}, **segments), keys, values
    )
    blocked = filled(
        make_cache(
            method, 4, 3, group_size=64, options={"prefill_attention": "dequantize-blocks"}, **segments
        ),
        keys,
        values,
    )
    queries = queries_for(4, 16, 64)  # 2 query heads per kv head x 16 tokens = 32 rows: dequantize path
    expected = fused.attention(queries, fused, fused, 0.125, "causal")
    assert relative_error(blocked.attention(queries, blocked, blocked, 0.125, "causal"), expected) < 2e-3

    fused_calls = []
    original = type(blocked)._compressed_scores
    monkeypatch.setattr(
        type(blocked), "_compressed_scores", lambda self, *a: fused_calls.append(1) or original(self, *a)
    )
    blocked.attention(queries, blocked, blocked, 0.125, "causal")
    assert fused_calls == []
    if not _on_cuda():  # on CUDA decoding reads the codes with the decode kernel, or decodes them
        blocked.attention(queries[..., -1:, :], blocked, blocked, 0.125, None)  # decoding stays fused
        assert fused_calls == [1]


def test_prefill_attention_option_is_validated() -> None:
    with pytest.raises(ConfigError, match="prefill_attention"):
        KVCacheConfig("affine", options={"prefill_attention": "fast"}).validate(64)
    assert KVCacheConfig("affine", options={"prefill_attention": "auto"}).validate(64)


def test_auto_prefill_attention_follows_the_device() -> None:
    rows = kv_base.DEQUANTIZE_MIN_ROWS
    metal = available_backend() == "metal"
    cuda = _on_cuda()
    assert kv_base._attends_decoded("auto", rows) == (not metal)
    assert kv_base._attends_decoded("dequantize-blocks", rows)
    # quantized_matmul on CUDA has no kernel for most attention shapes: decoded there whatever the choice
    assert kv_base._attends_decoded("fused", rows) == cuda
    assert kv_base._attends_decoded("auto", 1) == cuda
