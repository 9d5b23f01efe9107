"""The model's weights as transposed fp32 modules: the second part of the Linux CPU fast path.

With MLX's GEMMs routed to OpenBLAS (:mod:`engine.runtime.cpu.blas`), an fp32 matmul is far faster on the
CPU than MLX's ``quantized_matmul``, and fp32 activations far faster than bf16/fp16 ones. So when
:func:`prefer_fp32_weights` says so, a loaded model is rewritten once by :func:`dequantize_model_to_fp32`.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from engine.runtime.cpu.blas import fast_blas_status


def prefer_fp32_weights() -> bool:
    """True when weights should be dequantized to fp32 at load: Linux, MLX on the CPU, fast BLAS on.

    On the CPU, fp32 GEMMs through OpenBLAS are far faster than MLX's quantized_matmul; on a GPU (Metal,
    CUDA) the quantized kernels are the fast ones and the smaller weights matter, so this is False there.
    """
    status = fast_blas_status()
    if sys.platform != "linux" or status is None or not status.enabled:
        return False
    return mx.default_device() == mx.cpu


# Weights are stored transposed, [input dims, output dims], and multiplied as ``x @ weight_t``. Why: in a
# one-token product OpenBLAS reads the whole weight once, and on this machine its kernel for a row-major
# [K, N] matrix (sgemv "Trans") streams at ~27 GB/s on one core while the kernel for [N, K] (``x @ W.T``,
# sgemv "NoTrans") manages ~12 GB/s. Measured through MLX with the shim's sgemv dispatch, one thread: the
# 210 projections of SmolLM2 34.2 -> 29.0 ms, the 49152 x 576 tied output layer 9.1 -> 5.1 ms per token.
# Prompt-sized GEMMs are as fast either way (946 vs 962 ms for 512 tokens). The tied embedding is stored
# once, transposed, and looked up by column, so no second copy of it exists.
class TransposedLinear(nn.Module):
    """y = x @ weight_t + bias, with weight_t = W.T stored contiguously."""

    def __init__(self, weight_t: mx.array, bias: mx.array | None = None) -> None:
        super().__init__()
        self.weight_t = weight_t
        if bias is not None:
            self.bias = bias

    @property
    def weight(self) -> mx.array:
        """[output dims, input dims], as nn.Linear has it (a transposed view, no copy)."""
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, self.weight_t)
        return x @ self.weight_t


class TransposedEmbedding(nn.Module):
    """Rows of the table are columns of weight_t; `as_linear` (tied output layer) is x @ weight_t."""

    def __init__(self, weight_t: mx.array) -> None:
        super().__init__()
        self.weight_t = weight_t

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.take(self.weight_t.T, ids, axis=0)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


def dequantize_model_to_fp32(model: Any) -> Any:
    """Replace quantized layers of an mlx-lm model with fp32 linear/embedding layers, in place.

    The fp32 weights are ``mx.dequantize`` of the packed weights with the scales/biases upcast to fp32,
    which is exactly the weight ``quantized_matmul`` multiplies by when activations are fp32. Every other
    floating parameter (norms, biases, unquantized bf16 layers) is cast to fp32 too, so all activations
    stay fp32 (bf16/fp16 on the CPU is many times slower). The weights are stored transposed
    (`TransposedLinear`, `TransposedEmbedding`); the layers still expose ``weight`` ([out, in], a view)
    and the embedding ``as_linear``, so tied embeddings keep working. Returns the same model object.
    """

    def transposed(weight: mx.array) -> mx.array:
        return mx.contiguous(weight.astype(mx.float32).T)

    def to_float_layer(_path: str, module: Any) -> Any:
        if isinstance(module, nn.QuantizedLinear | nn.Linear):
            weight = _dequantized_fp32_weight(module) if isinstance(module, nn.QuantizedLinear) else module.weight
            bias = module["bias"].astype(mx.float32) if "bias" in module else None
            return TransposedLinear(transposed(weight), bias)
        if isinstance(module, nn.QuantizedEmbedding | nn.Embedding):
            weight = _dequantized_fp32_weight(module) if isinstance(module, nn.QuantizedEmbedding) else module.weight
            return TransposedEmbedding(transposed(weight))
        return module

    leaves = tree_map_with_path(to_float_layer, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    model.set_dtype(mx.float32)
    # Materialise now so the dequantization cost is paid once at load, not inside the first prompt.
    mx.eval(model.parameters())
    return model


def _dequantized_fp32_weight(module: nn.Module) -> mx.array:
    biases = module.get("biases")
    return mx.dequantize(
        module["weight"],
        scales=module["scales"].astype(mx.float32),
        biases=biases.astype(mx.float32) if biases is not None else None,
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
    )
