"""Shared helpers for the KV cache tests (no tests here): tiny random llama models, a word-level
tokenizer for them, caches built, fed and checked the same way by every cache test, a dense reference
attention, and the real default model when it is present."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache, trim_prompt_cache

from engine.kvcache import KVCacheBuilder, KVCacheConfig, get_method

TINY_VOCAB = 100
DATA_DIR = Path(__file__).parent / "data"


def tiny_llama(
    head_dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, n_layers: int = 2, seed: int = 0
) -> llama.Model:
    """A random llama with hidden 64, in fp32 (all the model's weights evaluated)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=n_layers,
        intermediate_size=128,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=TINY_VOCAB,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    # Random init gives near-uniform attention; larger q/k weights make attention peaky like a real model.
    for layer in model.layers:
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * 4
        layer.self_attn.k_proj.weight = layer.self_attn.k_proj.weight * 4
    mx.eval(model.parameters())
    return model


@functools.cache
def tiny_tokenizer() -> Any:
    """Word-level tokenizer 'w1 w2 ...' for the tiny models; its EOS (id 100) lies outside the model's
    vocabulary so generation never stops early."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(1, TINY_VOCAB)}
    vocab["<unk>"] = 0
    vocab["</s>"] = TINY_VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


def random_kv(
    batch: int = 1,
    n_kv_heads: int = 2,
    n_tokens: int = 100,
    head_dim: int = 64,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    outlier_channels: tuple[int, ...] = (),
    outlier_scale: float = 20.0,
) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    k_key, v_key = mx.random.split(key)
    keys = mx.random.normal((batch, n_kv_heads, n_tokens, head_dim), key=k_key)
    values = mx.random.normal((batch, n_kv_heads, n_tokens, head_dim), key=v_key)
    if outlier_channels:
        boost = mx.ones((head_dim,))
        boost[mx.array(outlier_channels)] = outlier_scale
        keys = keys * boost
    return keys.astype(dtype), values.astype(dtype)


def build_caches(config: KVCacheConfig, model: llama.Model | None = None) -> tuple[llama.Model, list[Any]]:
    """A tiny llama (unless given) and one cache per layer for `config`."""
    model = model or tiny_llama()
    return model, KVCacheBuilder(config).for_model(model).build()


def feed_tokens(
    model: llama.Model, caches: list[Any], n_tokens: int, chunk: int = 50, seed: int = 0
) -> mx.array:
    """Run `n_tokens` random tokens through the model in chunks of `chunk`; the logits of all of them."""
    tokens = mx.random.randint(0, TINY_VOCAB, (1, n_tokens), key=mx.random.key(seed))
    outputs = [model(tokens[:, s : s + chunk], cache=caches) for s in range(0, n_tokens, chunk)]
    mx.eval(outputs, [c.state for c in caches])
    return mx.concatenate(outputs, axis=1)


@functools.cache
def tiny_vq_codebooks(bits: int, head_dim: int = 64, model_head_dim: int | None = None) -> str:
    """A folder with `bits`-bit VQ codebooks for tests: calibrated on the tiny llama with `model_head_dim`
    (its identity, for caches built for that model), or else on Gaussian keys and values of `head_dim`
    (like `random_kv`). Written once per session into a temporary folder."""
    import tempfile

    from engine.kvcache.calibration import calibrate_vq, codebooks_from_kv
    from engine.kvcache.quant.vq import model_identity, save_codebooks

    if model_head_dim is not None:
        model = tiny_llama(head_dim=model_head_dim)
        tokens = mx.random.randint(0, TINY_VOCAB, (600,), key=mx.random.key(1)).tolist()
        arrays = calibrate_vq(model, tokens, bits, iterations=8)
        identity = model_identity(model, "tiny llama")
    else:
        layers = [random_kv(n_kv_heads=2, n_tokens=1024, head_dim=head_dim, seed=100 + i) for i in range(2)]
        arrays = codebooks_from_kv(layers, bits, iterations=8)
        identity = {"name": "gaussian", "head_dim": head_dim, "n_layers": 2}
    return str(save_codebooks(tempfile.mkdtemp(prefix="velox-vq-"), bits, arrays, identity, "hadamard", 0).parent)


def make_cache(method: str, key_bits: int | None = None, value_bits: int | None = None, **kwargs: Any) -> Any:
    """One cache of `method`; `vq` gets Gaussian-calibrated codebooks for head_dim 64 unless given."""
    if method == "vq" and "codebooks" not in kwargs.get("options", {}):
        kwargs["options"] = {**kwargs.get("options", {}), "codebooks": tiny_vq_codebooks(key_bits or 2)}
    return get_method(method)(KVCacheConfig(method, key_bits, value_bits, **kwargs))


def filled(cache: Any, keys: mx.array, values: mx.array, chunk: int = 37) -> Any:
    """Feed tokens in uneven chunks, as prefill and decoding do; the cache, evaluated."""
    for start in range(0, keys.shape[-2], chunk):
        cache.update_and_fetch(keys[..., start : start + chunk, :], values[..., start : start + chunk, :])
    mx.eval(cache._held_arrays())
    return cache


def filled_then_stepped(cache: Any, keys: mx.array, values: mx.array) -> Any:
    """`cache` fed all but the last 3 tokens in one untidy chunk, then token by token (as a prefill and decode
    steps fill it), evaluated."""
    tokens = keys.shape[-2]
    cut = max(1, tokens - 3)
    cache.update_and_fetch(keys[..., :cut, :], values[..., :cut, :])
    for t in range(cut, tokens):
        cache.update_and_fetch(keys[..., t : t + 1, :], values[..., t : t + 1, :])
    mx.eval(cache.state)
    return cache


def queries_for(
    n_query_heads: int, n_queries: int, head_dim: int, seed: int = 5, dtype: mx.Dtype = mx.float32
) -> mx.array:
    return mx.random.normal((1, n_query_heads, n_queries, head_dim), key=mx.random.key(seed)).astype(dtype)


def key_and_attention_errors(
    cache: Any, keys: mx.array, queries: mx.array, expected: mx.array, scale: float
) -> tuple[float, float]:
    """(relative error of the decoded keys, of unmasked attention over the cache against `expected`)."""
    dense_keys, _ = cache.to_dense()
    return (
        relative_error(dense_keys, keys),
        relative_error(cache.attention(queries, cache, cache, scale, None), expected),
    )


def _segments(cache: Any) -> tuple[int, int, int] | None:
    # Dense caches (fp16, fp32) have no sink/compressed/window segments.
    return (cache.n_sink, cache.n_compressed, cache.n_window) if hasattr(cache, "n_compressed") else None


def assert_save_and_load_round_trip_bit_exactly(model: llama.Model, caches: list[Any], path: Path) -> None:
    """Saved with mlx-lm and loaded back, every cache has the same class, config, segments and state
    arrays, bit for bit, and continuing from either gives identical logits."""
    save_prompt_cache(str(path), caches, metadata={"model": "tiny"})
    loaded, metadata = load_prompt_cache(str(path), return_metadata=True)
    assert metadata == {"model": "tiny"}
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    for original, restored in zip(caches, loaded, strict=True):
        assert restored.offset == original.offset and restored.config == original.config
        assert _segments(restored) == _segments(original)
        original_leaves = dict(tree_flatten(original.state))
        restored_leaves = dict(tree_flatten(restored.state))
        assert sorted(original_leaves) == sorted(restored_leaves)
        for key, a in original_leaves.items():
            b = restored_leaves[key]
            if isinstance(a, mx.array):
                assert a.dtype == b.dtype and mx.array_equal(a, b), key
            else:
                assert a == b, key
    next_tokens = mx.array([[7, 8, 9]])
    assert mx.array_equal(model(next_tokens, cache=caches), model(next_tokens, cache=loaded))
    # A loaded cache holds exactly the filled tokens (no growth slack yet).
    assert all(0 < r.nbytes <= c.nbytes for c, r in zip(caches, loaded, strict=True))


def assert_trim_drops_the_newest_tokens(model: llama.Model, caches: list[Any]) -> None:
    """On caches fed 100 tokens: trimming 25 keeps exactly the first 75 (decoded as before), decoding
    continues after it, and trimming everything empties the cache."""
    before = [c.to_dense() for c in caches]
    assert trim_prompt_cache(caches, 25) == 25
    for cache, (keys, values) in zip(caches, before, strict=True):
        assert cache.offset == cache.size() == 75
        segments = _segments(cache)
        assert segments is None or sum(segments) - getattr(cache, "n_duplicated", 0) == 75  # sinks counted once
        trimmed_keys, trimmed_values = cache.to_dense()
        assert mx.array_equal(trimmed_keys, keys[..., :75, :])
        assert mx.array_equal(trimmed_values, values[..., :75, :])
    model(mx.array([[1, 2, 3]]), cache=caches)
    assert caches[0].offset == 78
    assert caches[0].trim(1000) == 78 and caches[0].empty()


def reference_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """Plain float32 softmax attention with K/V repeated for GQA, mask as mlx-lm gives it."""
    queries, keys, values = (x.astype(mx.float32) for x in (queries, keys, values))
    repeats = queries.shape[1] // keys.shape[1]
    if repeats > 1:
        keys = mx.repeat(keys, repeats, axis=1)
        values = mx.repeat(values, repeats, axis=1)
    scores = (queries * scale) @ keys.swapaxes(-1, -2)
    n_queries, n_keys = scores.shape[-2:]
    if isinstance(mask, str):
        mask = mx.arange(n_keys - n_queries, n_keys)[:, None] >= mx.arange(n_keys)[None]
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -mx.inf)
        else:
            scores = scores + mask
    return mx.softmax(scores, axis=-1) @ values


def relative_error(actual: mx.array, expected: mx.array) -> float:
    actual = actual.astype(mx.float32)
    expected = expected.astype(mx.float32)
    return (mx.linalg.norm(actual - expected) / mx.linalg.norm(expected)).item()


def real_model_dir() -> Path | None:
    """The converted default model folder, or None when it has not been prepared on this machine."""
    try:
        from engine.models.default_model import default_model_dir, is_default_model_ready
    except ImportError:
        return None
    return default_model_dir() if is_default_model_ready() else None


def prose_tokens(tokenizer: Any) -> list[int]:
    """~1k tokens of English prose (tests/data/prose_sample.txt, Milton's Areopagitica, public domain)."""
    text = (DATA_DIR / "prose_sample.txt").read_text(encoding="utf-8")
    return list(tokenizer.encode(text))


def registered_width_table(counts: tuple[int, ...], n_kv: int, seed: int, narrowest: int = 2) -> str:
    """A registered key widths table (option key_widths) for one layer of `n_kv` heads: `counts` channels at widths
    `narrowest`, `narrowest` + 1, ... (in that order; 2-5 for a 3-bit layer, 1-4 for a 2-bit one) in every head, placed
    at random channels per head; returns its digest."""
    import numpy as np

    from engine.kvcache.key_widths import register_table

    rng = np.random.default_rng(seed)
    by_rank = np.repeat(np.arange(narrowest, narrowest + len(counts)), counts).astype(np.uint8)
    return register_table([np.stack([rng.permutation(by_rank) for _ in range(n_kv)])])


def kivi_chunk(n_kv: int, tokens: int, head_dim: int, dtype, seed: int):  # noqa: ANN001, ANN201 - mx types
    """A chunk (keys, values) [1, n_kv, tokens, head_dim] for KIVI's encode: keys with per-channel offsets and spreads
    (some channels' blocks all negative, some all positive), 1 % spikes and ties (16-bit entries repeat), values about
    zero."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(seed)
    offsets = rng.uniform(-6, 6, (1, n_kv, 1, head_dim))
    spreads = rng.uniform(0.05, 3, (1, n_kv, 1, head_dim))
    keys = rng.standard_normal((1, n_kv, tokens, head_dim)) * spreads + offsets
    keys += (rng.random(keys.shape) < 0.01) * rng.choice([-15.0, 15.0], size=keys.shape)
    values = rng.standard_normal((1, n_kv, tokens, head_dim))
    return mx.array(keys.astype(np.float32)).astype(dtype), mx.array(values.astype(np.float32)).astype(dtype)


def kivi_group_errors(cache, store, keys, values):  # noqa: ANN001, ANN201 - mx types
    """Squared error of `store` (a KIVI chunk as `cache` encodes it) decoded in float32 against the chunk (keys,
    values) it encodes, per group: keys [1, n_kv, blocks, head_dim] (a channel's block of tokens), values
    [1, n_kv, tokens, head_dim / group_size]."""
    block, group = cache.token_block, cache.config.group_size
    keys32, values32 = keys.astype(mx.float32), values.astype(mx.float32)
    batch, heads, tokens, dim = keys32.shape
    key_error = mx.square(cache._decode_keys(store) - keys32).reshape(batch, heads, tokens // block, block, dim)
    value_error = mx.square(cache._decode_values(store) - values32).reshape(batch, heads, tokens, dim // group, group)
    return key_error.sum(axis=3), value_error.sum(axis=-1)


# A warp's matrix multiply-accumulate (the dialect's MMA_* ops) checked on its own: C [16, 8·NW] = A [16, K] times
# B [8·NW, K]ᵀ (B n-major, as the ops read it), one warp per 8 output columns, the tiles rounded by MMA_CAST.
MMA_GEMM_BODY = """
  MMA_SHARED MMA_T a_s[16 * K];
  MMA_SHARED MMA_T b_s[NW * 8 * K];
  SHARED float c_s[16 * NW * 8];
  for (int i = TID; i < 16 * K; i += NW * 32) a_s[i] = MMA_CAST(a[i]);
  for (int i = TID; i < NW * 8 * K; i += NW * 32) b_s[i] = MMA_CAST(b[i]);
  BARRIER();
  const int warp = TID / 32;
  MMA_ACC acc;
  MMA_ZERO(acc);
  for (int k0 = 0; k0 < K; k0 += 16) MMA_16X8X16(acc, a_s + k0, K, b_s + warp * 8 * K + k0, K);
  MMA_STORE(c_s + warp * 8, NW * 8, acc);
  BARRIER();
  for (int i = TID; i < 16 * NW * 8; i += NW * 32) c[i] = c_s[i];
"""


def mma_gemm_source():  # noqa: ANN201 - KernelSource
    from engine.kvcache.kernels.backend import KernelSource

    return KernelSource(name="velox_mma_gemm_check", input_names=("a", "b"), output_names=("c",), body=MMA_GEMM_BODY,
                        matrix_ops=True)


def mma_gemm(a, b, backend: str):  # noqa: ANN001, ANN201 - mx arrays
    """C = A·Bᵀ through the MMA ops on `backend` (A [16, K], B [8·NW, K], float32; K a multiple of 16)."""
    from engine.kvcache.kernels.backend import kernel

    warps = b.shape[0] // 8
    (c,) = kernel(mma_gemm_source(), backend)(
        inputs=[a, b], template=[("K", int(a.shape[1])), ("NW", warps)], grid=(warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1), output_shapes=[(16, warps * 8)], output_dtypes=[mx.float32])
    return c
