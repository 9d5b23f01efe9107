"""The CPU fast path's weights (engine.runtime.cpu.weights): quantized mlx-lm models rewritten as
transposed fp32 modules that compute the same numbers."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from engine.runtime.cpu import blas, weights
from tests.fastpath_helpers import REPO_ROOT

# dequantize_model_to_fp32


def _tiny_llama(tie_word_embeddings: bool):

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
        tie_word_embeddings=tie_word_embeddings,
    )
    mx.random.seed(3)
    model = llama.Model(args)
    # Like a converted checkpoint: fp16 weights, then 4-bit affine quantization with fp16 scales.
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model, args


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_dequantized_model_matches_quantized_model_in_fp32(tie_word_embeddings: bool) -> None:

    quantized, args = _tiny_llama(tie_word_embeddings)
    assert isinstance(quantized.model.embed_tokens, nn.QuantizedEmbedding)
    # The reference: the same quantized weights, run with fp32 activations (scales upcast to fp32).
    reference = llama.Model(args)
    nn.quantize(reference, group_size=32, bits=4)
    reference.update(quantized.parameters())
    reference.set_dtype(mx.float32)
    # The model under test gets its own copy of the parameters, then is converted.
    converted = llama.Model(args)
    nn.quantize(converted, group_size=32, bits=4)
    converted.update(quantized.parameters())
    returned = weights.dequantize_model_to_fp32(converted)
    assert returned is converted

    modules = [module for _, module in converted.named_modules()]
    assert not any(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for m in modules)
    linear_class, embedding_class = weights.TransposedLinear, weights.TransposedEmbedding
    assert isinstance(converted.model.embed_tokens, embedding_class)
    assert isinstance(converted.model.layers[0].mlp.down_proj, linear_class)
    if not tie_word_embeddings:
        assert isinstance(converted.lm_head, linear_class)
    assert {value.dtype for _, value in tree_flatten(converted.parameters())} == {mx.float32}

    tokens = mx.array([[5, 17, 200, 3, 99, 42, 7, 255]])
    expected = reference(tokens)
    actual = converted(tokens)
    assert actual.dtype == mx.float32 and expected.dtype == mx.float32
    assert actual.shape == (1, 8, 256)
    np.testing.assert_allclose(np.array(actual), np.array(expected), rtol=1e-4, atol=1e-4)


def test_dequantized_weights_are_exactly_what_quantized_matmul_uses() -> None:

    mx.random.seed(11)
    float_layer = nn.Linear(64, 48, bias=True)
    float_layer.set_dtype(mx.float16)
    layer = nn.QuantizedLinear.from_linear(float_layer, 32, 4)
    model = nn.Sequential(layer)
    inputs = mx.random.normal((3, 64))
    # Multiplying by the identity makes quantized_matmul return its (transposed) effective weight.
    effective_weight = mx.quantized_matmul(
        mx.eye(64),
        layer.weight,
        layer.scales.astype(mx.float32),
        layer.biases.astype(mx.float32),
        transpose=True,
        group_size=32,
        bits=4,
    ).T
    bias = layer.bias.astype(mx.float32)
    weights.dequantize_model_to_fp32(model)
    converted = model.layers[0]
    assert type(converted).__name__ == "TransposedLinear"
    assert converted.weight_t.shape == (64, 48)  # stored transposed: [input dims, output dims]
    assert mx.array_equal(converted.weight, effective_weight)
    assert mx.array_equal(converted.bias, bias)
    np.testing.assert_allclose(
        np.array(converted(inputs)), np.array(inputs @ effective_weight.T + bias), rtol=1e-5, atol=1e-5
    )


def test_prefer_fp32_weights_is_false_without_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "_status", blas.FastBlasStatus(False, "off for the test"))
    assert weights.prefer_fp32_weights() is False
    monkeypatch.setattr(blas, "_status", None)
    assert weights.prefer_fp32_weights() is False


def test_transposed_layers_equal_plain_products_for_one_and_many_rows():
    """Weights stored transposed (fast one-token products): the same numbers as nn.Linear/nn.Embedding."""
    code = (
        "from engine.runtime.cpu.weights import TransposedEmbedding as Embedding, TransposedLinear as Linear\n"
        "import mlx.core as mx\n"
        "w = mx.random.normal((1536, 576)); b = mx.random.normal((1536,))\n"
        "layer = Linear(mx.contiguous(w.T), b)\n"
        "for rows in (1, 9, 300):\n"
        "    x = mx.random.normal((1, rows, 576))\n"
        "    assert mx.allclose(layer(x), x @ w.T + b, atol=1e-4).item(), rows\n"
        "assert mx.array_equal(layer.weight, w).item()\n"
        "table = mx.random.normal((5000, 64))\n"
        "emb = Embedding(mx.contiguous(table.T))\n"
        "ids = mx.array([[0, 4999, 17, 17]])\n"
        "assert mx.array_equal(emb(ids), table[ids]).item()\n"
        "for rows in (1, 40):\n"
        "    h = mx.random.normal((1, rows, 64))\n"
        "    assert mx.allclose(emb.as_linear(h), h @ table.T, atol=1e-4).item(), rows\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
