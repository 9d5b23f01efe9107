"""Shared helpers for the KV cache tests (no tests here): tiny random llama models, a word-level
tokenizer for them, a dense reference attention, and the real default model when it is present."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama

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
        from engine.default_model import default_model_dir, is_default_model_ready
    except ImportError:
        return None
    return default_model_dir() if is_default_model_ready() else None


def prose_tokens(tokenizer: Any) -> list[int]:
    """~1k tokens of English prose (tests/data/prose_sample.txt, Milton's Areopagitica, public domain)."""
    text = (DATA_DIR / "prose_sample.txt").read_text(encoding="utf-8")
    return list(tokenizer.encode(text))

