"""Decode of a cache's whole compressed history into 16-bit keys and values in one launch: what a prefill chunk
attends over on a GPU (`SegmentedKVCache._decoded_history`).

A prefill chunk over compressed history decodes each layer's history into a transient 16-bit copy and attends
with MLX's fused SDPA (base.py). For the codebook methods the reference decode is ~10 MLX operations per role
over the whole history (the bit unpacking's gathers, shifts and masks, the centroid gather, the norm, the
casts), each writing a history-sized intermediate in 32 bits: on the H200 a 32k-token prefill into turboquant:4
ran at 0.76x of the 16-bit cache's speed and rvq:4 at 0.62x, against 0.95x for KIVI (BENCHMARKS.md, issue 11's
target is 0.8x). Here one thread decodes 8 channels of one token of both roles with the decode kernels' own
codec macros (`decode._CODEC_MACROS`: the same unpacking and arithmetic as the decode pass), writing the 16-bit
keys and values once: in the same run turboquant:4 then prefilled at 0.94x and rvq:4 at 0.91x
(benchmarks/results/prefill-dequantize-ab-h200.json).

The compressed arrays are the cache's whole buffers (capacity >= n tokens; only the first n are read, and passing
the buffers rather than views avoids the copy MLX makes of a non-contiguous input); n travels as a ruler's length
(`backend.RULER`).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from engine.kvcache.kernels import decode as _decode
from engine.kvcache.kernels.backend import RULER, KernelSource, kernel
from engine.kvcache.kernels.decode import _HEADER, Codec

THREADS = 128
# Backends where caches decode their history with this kernel. The CPU emulator checks it against the reference in
# the tests; CUDA passed the GPU parity test on the lent H200 (tests/test_kvcache_kernels.py), where a 32k-token
# prefill ran at 6,802 tok/s with it against 5,555 without for turboquant:4 and 6,632 against 4,441 for rvq:4 (fp16
# 7,274; affine:4 7,016 against 6,945), the two forms timed in one run (prefill-dequantize-ab-h200.json). Metal runs
# the same body with its own prelude (nothing in it beyond what the decode pass's Metal form already uses): enabled
# by construction, as the other kernels here (no Mac here: the GPU parity test runs on one).
BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")
# The codec kinds whose macros read a token's channels straight from device memory (KIVI's keys are staged per
# tile by the decode pass and have their own dense path: quantized_matmul / mx.dequantize). PolarQuant's ("polar")
# and product VQ's ("vq") only on a backend in decode.POLAR_BACKENDS / VQ_BACKENDS, where their decode pass has
# passed the parity tests. Sketched keys ("prod": turboquant_prod's, "qjl") have no 8 channels of their own to
# read: a thread rebuilds its 8 channels of the estimator's reconstruction k̂ = ‖k‖·sqrt(π/2)/m · Sᵀ sign(S k)
# (turboquant_prod: of the residual, added to its centroids) from every one of the token's m sign bits and its 8
# columns of S (m·8 multiply-adds; S, float16, stays in the caches) — in place of MLX's bit unpacking, a ±1 array of
# m floats per token and a matmul, which took 3.6 ms of a 16k-token layer's history against 0.2 for turboquant's
# (H200, 8 kv heads; BENCHMARKS.md). Only on a backend in SKETCH_HISTORY_BACKENDS.
KINDS = ("affine", "codebook", "rvq", "polar", "vq", "prod", "qjl")
# Backends where sketched keys take this kernel. The CPU emulator checks it against the reference
# (tests/test_kvcache_kernel_emulation.py); CUDA passed the GPU parity test on the lent H200
# (tests/test_kvcache_kernels.py::test_history_decode_kernel_matches_reference; 2026-12-02, commit dddb261), where a
# 32k-token prefill ran at 5,731 tok/s with it against 4,161 without for turboquant_prod:4 and 3,982 against 3,763 for
# qjl:4 (its m = 4·D sign rows per key: four times the work per thread; fp16 7,259;
# benchmarks/results/prefill-sketch-history-h200.json). Metal runs the same body: enabled by construction.
SKETCH_HISTORY_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")

_BODY = """
  // Template: D (head_dim), G (affine group), TD (output dtype). Thread: 8 channels of one token of one kv head.
  constexpr int TPT = D / 8;
  const long n = (long)n_comp_r_shape[0] - 1;
  const long bhs = (long)k0_shape[0] * k0_shape[1];
  const long idx = (long)GROUP_X * NT + TID;
  if (idx < bhs * n * TPT) {
    const int lane = (int)(idx % TPT);
    const long token = idx / TPT;          // (bh, c) in row-major order: the output's row
    const int bh = (int)(token / n);
    const int c = (int)(token - (long)bh * n);
    const long at = token * D + lane * 8;
    float out[8];
    float mul;
#if KEY_SKETCH
    const int u = 0;  // the decode pass's names for one token in flight, which the sketch macros fill
    U32 ksg[1][SK];
    float kmul2[1];
#endif
    LOAD_KEY(c, out, mul);
#if KEY_SKETCH
    {
      // out += kmul2 · sqrt(π/2)/m · Σ_j sign_j · S[j, 8·lane .. 8·lane + 8), over the token's m = SK·D sign bits
      constexpr int M = SK * D;
      float acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
      for (int w = 0; w < M / 32; ++w) {
        const U32 word = KEY_SIGN_WORD(c, w);
        for (int b = 0; b < 32; ++b) {
          const float sign = ((word >> b) & 1u) ? 1.0f : -1.0f;
          const long row = (long)(32 * w + b) * D + lane * 8;
          for (int i = 0; i < 8; ++i) acc[i] += sign * (float)sk[row + i];
        }
      }
      const float factor = kmul2[0] * (1.2533141373155003f / (float)M);
      for (int i = 0; i < 8; ++i) out[i] += factor * acc[i];
    }
#endif
    for (int i = 0; i < 8; ++i) keys[at + i] = static_cast<TD>(out[i] * mul);
    LOAD_VALUE(c, out, mul);
    for (int i = 0; i < 8; ++i) values[at + i] = static_cast<TD>(out[i] * mul);
  }
"""


def supported(key: Codec, value: Codec, head_dim: int, backend: str) -> bool:
    """Whether the kernel decodes this pair of codecs at `head_dim` (8 channels a thread) on `backend`."""
    if _decode.unverified_on(key, backend) or _decode.unverified_on(value, backend):
        return False
    if key.kind in _decode.SKETCH_KINDS and backend not in SKETCH_HISTORY_BACKENDS:
        return False
    return (key.kind in KINDS and value.kind in KINDS and key.supported and value.supported and not key.grid
            and not value.grid and head_dim % 8 == 0)


@functools.cache
def dequantize_source(key: Codec, value: Codec) -> KernelSource:
    """The history-decode kernel for one (key codec, value codec) pair."""
    return KernelSource(
        name=f"velox_dequantize_{key.kind}{key.bits}_{key.bits2}_{value.kind}{value.bits}_{value.bits2}",
        input_names=("n_comp_r", *(f"k{i}" for i in range(key.slots)), *(f"v{i}" for i in range(value.slots)),
                     *(("sk",) if key.kind in _decode.SKETCH_KINDS else ())),
        output_names=("keys", "values"),
        body=_BODY,
        header=_HEADER,
        defines=key.macro("KEY") + value.macro("VALUE"),
    )


def dequantize_history(
    key: Codec,
    key_arrays: list[mx.array],
    value: Codec,
    value_arrays: list[mx.array],
    n_tokens: int,
    head_dim: int,
    group_size: int,
    dtype: mx.Dtype,
    backend: str,
    sketch: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Keys and values [B, n_kv, n_tokens, head_dim] in `dtype`, decoded from the first `n_tokens` of the codecs'
    arrays (each [B, n_kv, capacity, ...], in the order `decode._CODEC_MACROS` documents); sketched keys also need
    the m×D `sketch` S."""
    if not supported(key, value, head_dim, backend):
        raise ValueError(f"The history-decode kernel has no variant for {key} / {value} at head_dim {head_dim}.")
    sketched = key.kind in _decode.SKETCH_KINDS
    if sketched != (sketch is not None):
        raise ValueError(f"The history decode of {key} keys takes {'a' if sketched else 'no'} sketch.")
    batch, n_kv = key_arrays[0].shape[:2]
    threads = batch * n_kv * n_tokens * (head_dim // 8)
    shape = (batch, n_kv, n_tokens, head_dim)
    keys, values = kernel(dequantize_source(key, value), backend)(
        inputs=[RULER(n_tokens), *key_arrays, *value_arrays, *([sketch] if sketched else [])],
        template=[("D", head_dim), ("G", group_size), ("NT", THREADS), ("TD", dtype)],
        grid=((threads + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[shape, shape],
        output_dtypes=[dtype, dtype],
    )
    return keys, values
