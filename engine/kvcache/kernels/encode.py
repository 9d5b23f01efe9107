"""Fused encode of new tokens for the codebook methods (turboquant, rvq): norm, Lloyd-Max codes, bit
packing (and RVQ's residual stage) in one launch per role.

The pure-MLX encode (`RotatedCodebookKVCache._encode_role`) is ~30 small operations per role (norm,
division, one comparison and sum per boundary chunk, the packing's shifts, sums and stacks); while decoding
they run for one token per layer and step, so their launches, not their arithmetic, set the time. Here one
thread encodes one vector (a token of one kv head), so a decode step's encode is one launch of
batch × kv_heads threads, and a 4,096-token prefill chunk's is 32k threads.

The arithmetic follows the reference exactly: u = x / max(‖x‖, tiny), code = number of boundaries below u
(equal goes down), codes packed as a little-endian bit stream (`quant/bitpack.py`); RVQ's residual
r = u - c₁[code₁] is divided by max(rms(r), tiny), coded against the second boundaries, and its scale is
the least-squares fit Σ r·c₂ / max(Σ c₂², tiny). Sums run in a different order than MLX's reductions, so a
value lying within float rounding of a boundary can take the neighbouring code (the tests allow for it).
The rotation itself stays in MLX (`_keys_in`: a Hadamard transform), as on the reference path.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from engine.kvcache.kernels.backend import KernelSource, kernel

THREADS = 64

_ENCODE_BODY = """
  const long row = (long)GROUP_X * NT + TID;
  const long n_rows = (long)xin_shape[0] * xin_shape[1] * xin_shape[2];
  if (row < n_rows) {
    constexpr int W1 = D * B1 / 32;
    const long base = row * D;
    float ss = 0.0f;
    for (int d = 0; d < D; ++d) { const float v = (float)xin[base + d]; ss += v * v; }
    const float norm = sqrt(ss);
    const float denom = FMAX(norm, 1e-30f);
    norms[row] = static_cast<TN>(norm);
    U64 acc = 0;
    int nbits = 0;
    int w = 0;
    float r2 = 0.0f;
    for (int d = 0; d < D; ++d) {
      const float u = (float)xin[base + d] / denom;
      int code = 0;
      for (int j = 0; j < NB1; ++j) code += (u > bnd1[j]) ? 1 : 0;
      acc |= ((U64)code) << nbits;
      nbits += B1;
      if (nbits >= 32) { packed[row * W1 + w] = (U32)(acc & 0xffffffffu); ++w; acc >>= 32; nbits -= 32; }
      if (STAGES == 2) { const float r = u - cen1[code]; r2 += r * r; }
    }
#if STAGES == 2
    constexpr int W2 = D * B2 / 32;
    const float rms = sqrt(r2 / D);
    const float rdenom = FMAX(rms, 1e-30f);
    acc = 0;
    nbits = 0;
    w = 0;
    float dot = 0.0f;
    float sq = 0.0f;
    for (int d = 0; d < D; ++d) {
      const float u = (float)xin[base + d] / denom;
      int code = 0;
      for (int j = 0; j < NB1; ++j) code += (u > bnd1[j]) ? 1 : 0;
      const float r = u - cen1[code];
      const float z = r / rdenom;
      int code2 = 0;
      for (int j = 0; j < NB2; ++j) code2 += (z > bnd2[j]) ? 1 : 0;
      const float c2 = cen2[code2];
      dot += r * c2;
      sq += c2 * c2;
      acc |= ((U64)code2) << nbits;
      nbits += B2;
      if (nbits >= 32) { residual[row * W2 + w] = (U32)(acc & 0xffffffffu); ++w; acc >>= 32; nbits -= 32; }
    }
    rscales[row] = static_cast<TN>(dot / FMAX(sq, 1e-30f));
#endif
  }
"""


@functools.cache
def encode_source(stages: int) -> KernelSource:
    """The encode kernel for one (turboquant) or two (rvq) codebook stages."""
    if stages not in (1, 2):
        raise ValueError(f"The codebook encode kernel has one or two stages, not {stages}.")
    inputs = ("xin", "bnd1", "cen1") + (("bnd2", "cen2") if stages == 2 else ())
    outputs = ("norms", "packed") + (("residual", "rscales") if stages == 2 else ())
    return KernelSource(
        name=f"velox_codebook_encode{stages}",
        input_names=inputs,
        output_names=outputs,
        body=_ENCODE_BODY,
        defines=f"#define STAGES {stages}\n",
    )


def codebook_encode(
    vectors: mx.array,
    stages: list[tuple[int, mx.array, mx.array]],
    norm_dtype: mx.Dtype,
    backend: str,
) -> list[mx.array]:
    """Encode [..., n, D] vectors; `stages` = [(bits, centroids, boundaries)] (one or two stages).

    Returns [norms [..., n, 1], codes [..., n, D·bits/32]] and for two stages also
    [residual codes, residual scales [..., n, 1]], norms and scales in `norm_dtype`.
    """
    if vectors.ndim != 4:
        raise ValueError(f"codebook_encode takes [batch, heads, tokens, head_dim], got {vectors.shape}.")
    *lead, n, head_dim = vectors.shape
    rows = lead[0] * lead[1] * n
    inputs = []
    template: list[tuple[str, object]] = [("D", head_dim), ("NT", THREADS), ("TN", norm_dtype)]
    output_shapes = [(*lead, n, 1), (*lead, n, head_dim * stages[0][0] // 32)]
    output_dtypes = [norm_dtype, mx.uint32]
    for index, (bits, centroids, boundaries) in enumerate(stages, start=1):
        inputs += [boundaries.astype(mx.float32), centroids.astype(mx.float32)]
        template += [(f"B{index}", bits), (f"NB{index}", int(boundaries.shape[0]))]
    if len(stages) == 2:
        output_shapes += [(*lead, n, head_dim * stages[1][0] // 32), (*lead, n, 1)]
        output_dtypes += [mx.uint32, norm_dtype]
    run = kernel(encode_source(len(stages)), backend)
    groups = (rows + THREADS - 1) // THREADS
    return run(
        inputs=[vectors, *inputs],
        template=template,
        grid=(groups * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=output_shapes,
        output_dtypes=output_dtypes,
    )
