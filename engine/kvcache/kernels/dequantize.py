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
(benchmarks/results/prefill-dequantize-ab-h200.json). KIVI, whose keys are stored per channel over blocks of tokens,
has a body of its own (`_KIVI_BODY`: block outliers, keys before RoPE), and sketched keys' Σ sign·S is one matmul over
±1 rows that `_SIGNS_BODY` writes or, where SKETCH_MMA_BACKENDS admits it, one launch on the GPU's matrix units
(`_SKETCH_MMA_BODY`; all below).

The compressed arrays are the cache's whole buffers (capacity >= n tokens; only the first n are read, and passing
the buffers rather than views avoids the copy MLX makes of a non-contiguous input); n travels as a ruler's length
(`backend.RULER`).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from engine.kvcache.kernels import decode as _decode
from engine.kvcache.kernels.backend import RULER, KernelSource, kernel, over_buffer_limit
from engine.kvcache.kernels.decode import _HEADER, Codec

THREADS = 128
# Backends where caches decode their history with this kernel. The CPU emulator checks it against the reference in
# the tests; CUDA passed the GPU parity test on the lent H200 (tests/test_kvcache_kernels.py), where a 32k-token
# prefill ran at 6,802 tok/s with it against 5,555 without for turboquant:4 and 6,632 against 4,441 for rvq:4 (fp16
# 7,274; affine:4 7,016 against 6,945), the two forms timed in one run (prefill-dequantize-ab-h200.json). Metal runs
# the same body with its own prelude (nothing in it beyond what the decode pass's Metal form already uses): enabled
# by construction, as the other kernels here (no Mac here: the GPU parity test runs on one).
BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")
# The codec kinds whose macros read a token's channels straight from device memory (KIVI's keys, staged per tile by
# the decode pass, take `_KIVI_BODY` here). PolarQuant's ("polar")
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
# benchmarks/results/prefill-sketch-history-h200.json). Its matmul form (SKETCH_HISTORY_MATMUL, below) passed the same
# test on the H200 (kernel-parity-history-r3-h200.log). Metal runs the same body: enabled by construction.
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
#if KEY_SKETCH && PROJ
    // Σ_j sign_j · S[j, :] computed beforehand for every token as one matmul (`proj`: SKETCH_HISTORY_MATMUL)
    {
      const float factor = kmul2[0] * (1.2533141373155003f / (float)(SK * D));
      for (int i = 0; i < 8; ++i) out[i] += factor * (float)proj[at + i];
    }
#elif KEY_SKETCH
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


# Sketched keys' history by a matmul (SKETCH_HISTORY_MATMUL): `_SIGNS_BODY` writes every token's m signs as ±1
# (float32, a thread per entry: a warp's stores are 128 contiguous bytes), one float32 matmul with the m×D sketch S
# gives Σ_j sign_j·S[j, :] per token (in float16 its rounding, ~1e-4 on a key entry, exceeded the reference's 2^-10),
# and `_BODY` (PROJ = 1) reads that in place of its own m·8 multiply-adds a thread, which read all m rows of S for
# every token and lane: qjl:k4v4's 16k-token layer history on the H200 took 2.51 ms that way and 1.34 ms now
# (history-profile-r2-h200.json, history-profile-r4-h200.json); unpacking the signs with MLX operations had taken 1.5
# ms alone (history-decode-profile-h200.json).
_SIGNS_BODY = """
  // Template: W (sign words per token), TD. Grid: x the entries of one (batch, kv head) row block, y that row block.
  // Thread: bit b of word w of token c's packed signs (bit 1 = +1), so a warp writes 32 consecutive entries (a thread
  // per word wrote 32 entries 128 bytes apart from its neighbours' per store). Index math in 32 bits with W a
  // constant: a block's n·W·32 entries are far below 2^31, and a 64-bit division by the token count per entry (the
  // first form: one flat grid) is a long instruction sequence on a GPU.
  const int n = (int)n_comp_r_shape[0] - 1;
  const int bh = GROUP_Y;
  const int idx = GROUP_X * NT + TID;
  if (idx < n * W * 32) {
    const int b = idx & 31;
    const int at = idx >> 5;             // (token, w) in row-major order
    const int w = at % W;
    const int c = at / W;
    const U32 word = signs[((long)bh * signs_shape[2] + c) * signs_shape[3] + w];
    pm[(long)bh * n * (W * 32) + idx] = static_cast<TD>(((word >> b) & 1u) ? 1.0f : -1.0f);
  }
"""
SIGNS_SOURCE = KernelSource(name="velox_sign_rows", input_names=("n_comp_r", "signs"), output_names=("pm",),
                            body=_SIGNS_BODY)
# The projection Σ_j sign_j·S[j, :] on the GPU's matrix units, with no ±1 rows in device memory (SKETCH_MMA_BACKENDS):
# a threadgroup of 4 warps takes 64 tokens of one kv head, each warp 16 of them against every channel (D/8 accumulator
# tiles); per 16 sketch rows the warp writes its tokens' signs as ±1 tiles in shared memory and the threadgroup stages
# those 16 rows of S, transposed, as two tiles whose sum is S exactly (MMA_CAST(s) and MMA_CAST of the rest: a float16
# entry has 11 significant bits, a bfloat16 8, the rest at most 3 more), so the products are S's own and the sums are
# float32 as the matmul's. The result is float32 [B, n_kv, n, D], what `_BODY` reads with PROJ.
_SKETCH_MMA_BODY = """
  // Template: D (head_dim, a multiple of 8), M (sketch rows, a multiple of 32), NT (128: 4 warps).
  constexpr int NW = NT / 32;
  constexpr int KC = 16;                 // sketch rows per step (one MMA's k)
  constexpr int LD = KC + 4;             // tiles' row stride (even, off the 32-bank period)
  constexpr int NTILE = D / 8;           // accumulator tiles per warp: every channel
  constexpr int W = M / 32;              // sign words per token
  const int n = (int)n_comp_r_shape[0] - 1;
  const int bh = GROUP_Y;
  const int warp = TID / 32;
  const int lane = TID % 32;
  const int t0 = GROUP_X * (NW * 16) + warp * 16;   // the warp's first token
  MMA_SHARED MMA_T a_s[NW * 16 * LD];    // each warp's 16 tokens x KC signs as ±1, row-major
  MMA_SHARED MMA_T hi_s[D * LD];         // S's KC rows, transposed (channel-major: element (k, ch) at ch * LD + k)
  MMA_SHARED MMA_T lo_s[D * LD];         // ... and what MMA_CAST left of them
  SHARED float c_s[NW * 16 * 8];         // one accumulator tile per warp on its way out
  const GLOBAL U32* my_signs = signs + ((long)bh * signs_shape[2]) * W;
  MMA_ACC acc[NTILE];   // unrolled loops below keep them in registers (a runtime index would put them in memory)
#pragma unroll
  for (int j = 0; j < NTILE; ++j) MMA_ZERO(acc[j]);
  for (int k0 = 0; k0 < M; k0 += KC) {
    BARRIER();   // the previous step's readers of the tiles are done
    for (int i = TID; i < KC * D; i += NT) {
      const int k = i / D;
      const int ch = i - k * D;
      const float v = (float)sk[(long)(k0 + k) * D + ch];
      const MMA_T high = MMA_CAST(v);
      hi_s[ch * LD + k] = high;
      lo_s[ch * LD + k] = MMA_CAST(v - (float)high);
    }
    for (int i = lane; i < 16 * KC; i += 32) {
      const int t = i / KC;
      const int k = i - t * KC;
      float pm = 0.0f;                   // tokens past the end: zero rows, never written out
      if (t0 + t < n) {
        const U32 word = my_signs[(long)(t0 + t) * W + ((k0 + k) >> 5)];
        pm = ((word >> ((k0 + k) & 31)) & 1u) ? 1.0f : -1.0f;
      }
      a_s[(warp * 16 + t) * LD + k] = MMA_CAST(pm);
    }
    BARRIER();
#pragma unroll
    for (int j = 0; j < NTILE; ++j) {
      MMA_16X8X16(acc[j], a_s + warp * 16 * LD, LD, hi_s + j * 8 * LD, LD);
      MMA_16X8X16(acc[j], a_s + warp * 16 * LD, LD, lo_s + j * 8 * LD, LD);
    }
  }
#pragma unroll
  for (int j = 0; j < NTILE; ++j) {
    BARRIER();
    MMA_STORE(c_s + warp * 128, 8, acc[j]);
    BARRIER();
    for (int i = lane; i < 128; i += 32) {
      const int t = i / 8;
      if (t0 + t < n) proj[((long)bh * n + t0 + t) * D + j * 8 + (i % 8)] = c_s[warp * 128 + i];
    }
  }
"""
SKETCH_MMA_SOURCE = KernelSource(name="velox_sketch_projection_mma", input_names=("n_comp_r", "signs", "sk"),
                                 output_names=("proj",), body=_SKETCH_MMA_BODY, matrix_ops=True)
# Backends where sketched keys' history takes that projection (else the ±1 rows and MLX's matmul below). CUDA: its
# parity run passed on the H200 (kernel-parity-sketch-mma-h200.log), and qjl:k4v4's 32k prefill went from 5,180 to
# 6,286 tok/s, 0.71x to 0.87x of fp16's 7,250 in the same process (prefill-sketch-mma-h200.json). Metal's matrix ops
# (simdgroup 8x8) have not run on a Mac yet, so Metal takes the float16 rows below.
SKETCH_MMA_BACKENDS: tuple[str, ...] = ("emulate", "cuda")
SKETCH_MMA_TOKENS = THREADS // 32 * 16   # tokens per threadgroup: 16 per warp (the body's NW * 16)


def sketch_mma_fits(head_dim: int, rows: int) -> bool:
    """Whether `_SKETCH_MMA_BODY` takes this shape: whole 8-channel tiles and 32-row words, and at most 128 channels
    (16 accumulator tiles a warp: 64 of a CUDA thread's registers; S's two transposed tiles 20 KB of an Apple GPU's 32
    KB of threadgroup memory, as floats there)."""
    return head_dim % 8 == 0 and head_dim <= 128 and rows % 32 == 0


def sketch_projection_mma(signs: mx.array, sketch: mx.array, n_tokens: int, backend: str) -> mx.array:
    """Σ_j sign_j·S[j, :] (float32 [B, n_kv, n_tokens, D]) of the first `n_tokens` tokens' packed signs
    [B, n_kv, capacity, m/32] in one launch on the matrix units (`_SKETCH_MMA_BODY`)."""
    batch, n_kv = signs.shape[:2]
    rows, head_dim = (int(x) for x in sketch.shape)
    (proj,) = kernel(SKETCH_MMA_SOURCE, backend)(
        inputs=[RULER(n_tokens), signs, sketch],
        template=[("D", head_dim), ("M", rows), ("NT", THREADS)],
        grid=((n_tokens + SKETCH_MMA_TOKENS - 1) // SKETCH_MMA_TOKENS * THREADS, batch * n_kv, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(batch, n_kv, n_tokens, head_dim)],
        output_dtypes=[mx.float32],
    )
    return proj


# Whether sketched keys' history is rebuilt through `_SIGNS_BODY` and a matmul (True) or by `_BODY`'s own sums, and
# how many tokens' ±1 rows one matmul takes.
SKETCH_HISTORY_MATMUL = True
SKETCH_HISTORY_BLOCK = 4096
# Backends where qjl's history written in 16 bits takes its ±1 rows and S in float16 (±1 exact, S stored in float16:
# the same products; MLX's float16 matmul accumulates in float32 on CUDA and rounds each Σ sign·S entry once to float16,
# 2^-11 of it: the key is that sum scaled, so within its 16-bit history's own rounding; turboquant_prod keeps float32,
# see dequantize_history): half the rows' bytes, and on the H200 MLX's float16 matmul
# took 0.14 ms against float32's 0.27 at 14,336 tokens, the ±1 rows 0.21 ms a 4,096-token block in float32
# (history-profile-r5-h200.json). Parity passed on the H200, and qjl:k4v4's 32k prefill took 6,187 tok/s against the
# float32 rows' 5,180 (prefill-sketch-mma-h200.json): where the matrix units decline a shape or are not admitted
# (Metal), qjl takes these. (A history is decoded into the cache's 16-bit dtype, so the float32 rows remain only for
# turboquant_prod where the matrix units decline.)
SKETCH_HALF_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")

# KIVI's keys are stored per channel over blocks of tokens (codes [B,H,D,cap·KB/32], scales and biases [B,H,D,cap/GK]),
# so a token's channels are D rows apart: `_BODY`'s codec macros read a token's 8 consecutive channels of a row
# instead. A threadgroup here decodes KIVI_TILE_TOKENS consecutive tokens of one kv head. Its keys are staged channel
# by channel in shared memory: a warp decodes 32 consecutive tokens of one channel (their code words contiguous, one
# block scale and bias, float32 as the reference's float32-scale dequantize; the block's outlier residual where KO and
# the token is its index). They are then written token by token, a warp taking consecutive channel pairs, each pair
# turned by its position where the keys were stored before RoPE (ROPE, TRAD: KIVI's rope=pre; compressed token c sits
# at position c, the sinks' copies being in KIVI's stream) as the tiled decode pass turns it (TURN_AT). Values are
# decoded 8 channels of a token a thread, as in `_BODY`. In place of MLX's dequantize, the outliers' scatter, the
# float32 RoPE over the whole history and the casts: each a history-sized pass (a 32k-token prefill of the 3-bit
# level ran at 0.79x of fp16, BENCHMARKS.md). The first form of this kernel, a thread per token's 8 key channel pairs,
# had each warp load touch 8 channel rows for 4 tokens: one layer's 14,336-token history of the
# 4-bit level's layout took 0.72 ms to decode on the H200 that way and 0.41 ms in tiles (0.75 against 0.61 ms for the
# 3-bit level's, 0.64 against 0.51 for the 2-bit level's; prefill-tiled-history-h200.json, same runs).
_KIVI_BODY = """
  // Template: D, G (value group), GK (key block), KB (key bits), ROPE, TRAD, KO, TD; KCLS, KBLO (key widths); TT (the
  // tokens of a threadgroup). Threadgroup: TT consecutive tokens of one kv head, keys and values.
  constexpr int TPT = D / 8;           // value lanes per token (8 channels each)
  constexpr int SD = D + 1;            // a staged token's stride: the 32 tokens a warp stages of one channel hit 32 banks
  SHARED float sh_k[TT * SD];
  const int n = (int)n_comp_r_shape[0] - 1;
  const int tiles = (n + TT - 1) / TT;
  const int bh = (int)GROUP_X / tiles;
  const int c0 = ((int)GROUP_X - bh * tiles) * TT;
  const int count = n - c0 < TT ? n - c0 : TT;
  WIDTH_CLASS_ENDS
  const long cap = (long)v0_shape[2];
  const long groups = cap / GK;        // key blocks per row (the capacity a multiple of GK)
  const long head = KCLS ? (long)(bh % kinv_shape[0]) * D : 0;
  // 1. The keys, channel by channel into shared memory: a warp decodes consecutive tokens of one channel (whole code
  // words, one scale and bias), where a thread per token read every channel's row for a single token.
  for (int i = TID; i < D * TT; i += NT) {
    const int ch = i / TT;             // the channel in the model's order
    const int t = i - ch * TT;
    if (t < count) {
      const int c = c0 + t;
      const int g = c / GK;
      // The channel's storage row (key widths: through kinv; its class's codes at its class's width) and its block's
      // scale, bias and outlier (one array each for every class, rows in the storage order).
      const int s = KCLS ? (int)kinv[head + ch] : ch;
      const long at = ((long)bh * D + s) * groups + g;
      const GLOBAL U32* codes = k0 + ((long)bh * D + s) * (cap * KB / 32);
      int w = KB;
      if (KCLS) {
        const int cl = CLASS_OF(s);
        const int first = PICK4(cl, 0, e0, e1, e2);
        w = KBLO + cl;
        codes = PICK4(cl, k0, w1c, w2c, w3c) + ((long)bh * (PICK4(cl, e0, e1, e2, e3) - first) + (s - first))
                                                 * (cap * w / 32);
      }
      float x = (float)k1[at] * (float)code_at(codes, c, w) + (float)k2[at];
      if (KO && (int)kidx[at] == c - g * GK) x += (float)kout[at];
      sh_k[t * SD + ch] = x;
    }
  }
  // 2. The values, 8 channels of one token a thread (as `_BODY` reads them), while the keys' stores settle.
  for (int i = TID; i < TT * TPT; i += NT) {
    const int t = i / TPT;
    const int lane = i - t * TPT;
    if (t < count) {
      const int c = c0 + t;
      float out[8];
      float mul;
      LOAD_VALUE(c, out, mul);
      const long at = ((long)bh * n + c) * D + lane * 8;
      for (int k = 0; k < 8; ++k) values[at + k] = static_cast<TD>(out[k] * mul);
    }
  }
  BARRIER();
  // 3. The keys out, token by token: a warp writes consecutive channel pairs of one token, each pair turned by its
  // position where the keys were stored before RoPE (compressed token c sits at position c: TURN_AT).
  for (int i = TID; i < TT * (D / 2); i += NT) {
    const int t = i / (D / 2);
    const int j = i - t * (D / 2);     // the pair; without RoPE, channels 2j and 2j + 1 (any pairing serves)
    if (t < count) {
      const int a = (ROPE && !TRAD) ? j : 2 * j;
      const int b = (ROPE && !TRAD) ? j + D / 2 : 2 * j + 1;
      float xa = sh_k[t * SD + a];
      float xb = sh_k[t * SD + b];
      if (ROPE) {
        float sn, cs;
        TURN_AT((float)(c0 + t), rfreq[j], sn, cs);
        const float ra = xa * cs - xb * sn;
        xb = xa * sn + xb * cs;
        xa = ra;
      }
      const long at = ((long)bh * n + c0 + t) * D;
      keys[at + a] = static_cast<TD>(xa);
      keys[at + b] = static_cast<TD>(xb);
    }
  }
"""
# Tokens a threadgroup of `_KIVI_BODY` decodes: its staged keys take KIVI_TILE_TOKENS x (D + 1) floats of shared memory
# (16.5 KB at head_dim 128, under Metal's 32 KB). 16 decoded the 4-bit layout's 14,336-token layer in 0.56 ms on the
# H200 against 0.41 for 32 (prefill-tiled-history-h200.json).
KIVI_TILE_TOKENS = 32
# Backends where KIVI caches decode their history with `_KIVI_BODY`. The CPU emulator checks it against the reference
# (tests/test_kvcache_kernel_emulation.py); CUDA passed the GPU parity test on the lent H200
# (tests/test_kvcache_kernels.py::test_kivi_history_decode_kernel_matches_reference, 300 to 33,000 tokens;
# kernel-parity-history-r3-h200.log), where a 32k-token prefill of the 3-bit level (keys before RoPE) ran at 6,072 and
# 6,026 tok/s with it against 5,821 without (fp16 7,273 / 7,169) and the 4-bit level's at 6,636 (against 6,382 without in
# the previous lease's run; prefill-history-kernels-r2-h200.json, prefill-history-kernels-h200.json). Its tiled form
# passed the same test on the H200 on 2026-12-03, every layout at 300, 8,193 and 33,000 tokens
# (kernel-parity-tiled-history-h200.log). Metal runs the same body (shared memory and a barrier, as the decode pass's
# Metal form uses them): enabled by construction.
KIVI_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")
# Backends where `_KIVI_BODY` decodes key channels at different widths (KIVI's key_widths; elsewhere such a history is
# decoded through MLX, one mx.dequantize per width and a gather). The CPU emulator checks it against the reference
# (tests/test_kvcache_kernel_emulation.py, a layer without its narrowest class among the layouts, keys before RoPE).
# On the lent H200 its first form (each lane's rows in storage order, keys as given) passed the GPU parity test
# (test_kivi_history_decode_kernel_matches_reference[level3-widths], 300 to 33,000 tokens;
# kernel-parity-widths-r2-h200.log), but a 32k-token prefill of the 8B shape then failed with an illegal memory
# access, before the fix of a layer whose narrowest class is empty (its arrays are placeholders, whose shape the
# kernels read for the key blocks per row; decode-key-widths-r2-h200.json). The present form (pair by pair through
# the inverse order, so keys before RoPE are turned too; WIDTH_ROPE_BACKENDS) passed the H200's parity test on
# 2026-12-03 with widths 2-5 as given, before RoPE and with the narrowest class empty, 300 to 33,000 tokens
# (kernel-parity-widths-r4-h200.log; widths 1-4 failed there, their caches filled through MLX's broken 1-bit CUDA
# quantize, see decode.ONE_BIT_BACKENDS). With 1-bit codes packed by Velox all of them passed there, widths 1-4 too
# (kernel-parity-widths-r5-h200.log), and a 32k-token prefill of the 8B shape ran through it as given and before RoPE
# (decode-key-widths-r6-h200.json): 4,414 tok/s for the 4-bit level as given against 4,289 through MLX and 7,187 for
# fp16 in the same run, so most of what the key widths cost a prefill on a GPU lies outside this kernel (issue 11).
# The tiled form reads each channel's storage row the same way (kernel-parity-tiled-history-h200.log).
# Metal runs the same body: enabled by construction, as every kernel here.
WIDTH_HISTORY_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")


def supported(key: Codec, value: Codec, head_dim: int, backend: str, rope: bool = False) -> bool:
    """Whether the kernel decodes this pair of codecs at `head_dim` (8 channels a thread) on `backend`; `rope`: KIVI
    keys stored before RoPE, which it turns (at different widths only on a backend in decode.WIDTH_ROPE_BACKENDS)."""
    if _decode.unverified_on(key, backend) or _decode.unverified_on(value, backend):
        return False
    # Metal's 31 buffer arguments: a kernel past them takes the reference path there (KIVI's tiled history decode
    # takes 22 since the key widths share their scales, biases and outliers: benchmarks/results/metal-buffers.json)
    return _takes(key, value, head_dim, backend, rope) and over_buffer_limit(dequantize_source(key, value), backend) is None


def _takes(key: Codec, value: Codec, head_dim: int, backend: str, rope: bool) -> bool:
    """`supported` but for the backend's limits: whether the kernel has code for this pair here."""
    if key.kind in _decode.SKETCH_KINDS and backend not in SKETCH_HISTORY_BACKENDS:
        return False
    if key.kind == "kivi_keys":  # 8 channel pairs a thread; values as every other kind's
        return (backend in KIVI_BACKENDS and value.kind == "affine" and key.supported and value.supported
                and not key.grid and not value.grid and head_dim % 16 == 0
                and (not key.widths or (backend in WIDTH_HISTORY_BACKENDS
                                        and (not rope or backend in _decode.WIDTH_ROPE_BACKENDS))))
    return (key.kind in KINDS and value.kind in KINDS and key.supported and value.supported and not key.grid
            and not value.grid and head_dim % 8 == 0)


@functools.cache
def dequantize_source(key: Codec, value: Codec, proj: bool = False) -> KernelSource:
    """The history-decode kernel for one (key codec, value codec) pair; `proj`: sketched keys read Σ_j sign_j·S[j, :]
    from an input `proj` in place of the sketch."""
    if key.kind == "kivi_keys":
        return KernelSource(
            name=f"velox_dequantize_kivi{key.bits}_{value.kind}{value.bits}_{int(value.symmetric)}"
                 + "_tiled"
                 + (f"_w{len(key.widths)}" if key.widths else ""),
            input_names=("n_comp_r", "k0", "k1", "k2", "kout", "kidx", "rfreq", *_decode.WIDTH_INPUTS,
                         *(f"v{i}" for i in range(value.slots))),
            output_names=("keys", "values"),
            body=_KIVI_BODY,
            header=_HEADER,
            defines=value.macro("VALUE"),
        )
    sketched = key.kind in _decode.SKETCH_KINDS
    if proj and not sketched:
        raise ValueError(f"Only sketched keys read a projection, not {key}.")
    return KernelSource(
        name=f"velox_dequantize_{key.kind}{key.bits}_{key.bits2}{'_l' + str(key.levels) if key.levels else ''}_"
             f"{value.kind}{value.bits}_{value.bits2}{'_l' + str(value.levels) if value.levels else ''}"
        + ("_proj" if proj else ""),  # one name per source text, as the decode pass's
        input_names=("n_comp_r", *(f"k{i}" for i in range(key.slots)), *(f"v{i}" for i in range(value.slots)),
                     *((("proj",) if proj else ("sk",)) if sketched else ())),
        output_names=("keys", "values"),
        body=_BODY,
        header=_HEADER,
        defines=f"#define PROJ {int(proj)}\n" + key.macro("KEY") + value.macro("VALUE"),
    )


def _sketch_projection(signs: mx.array, sketch: mx.array, n_tokens: int, backend: str,
                       dtype: mx.Dtype = mx.float32) -> mx.array:
    """Σ_j sign_j·S[j, :] ([B, n_kv, n_tokens, D]) for the first `n_tokens` tokens' packed signs
    [B, n_kv, capacity, m/32], SKETCH_HISTORY_BLOCK tokens at a time (the ±1 rows of a block are m entries a token:
    a 32k-token history of 8 kv heads at m = 512 would be a transient 0.5 GB at once). In float32, or in float16
    where `dtype` (the history's) is 16-bit and the backend is in SKETCH_HALF_BACKENDS; on the matrix units with no
    rows at all where the backend is in SKETCH_MMA_BACKENDS (float32)."""
    rows = int(sketch.shape[0])
    if backend in SKETCH_MMA_BACKENDS and sketch_mma_fits(int(sketch.shape[1]), rows):
        return sketch_projection_mma(signs, sketch, n_tokens, backend)
    half = dtype != mx.float32 and backend in SKETCH_HALF_BACKENDS
    work = mx.float16 if half else mx.float32
    sketch_w = sketch.astype(work)
    parts = []
    for start in range(0, n_tokens, SKETCH_HISTORY_BLOCK):
        count = min(SKETCH_HISTORY_BLOCK, n_tokens - start)
        block = signs if (start == 0 and count == signs.shape[2]) else signs[:, :, start : start + count]
        parts.append(sign_rows(block, count, rows, backend, work) @ sketch_w)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def sign_rows(signs: mx.array, n_tokens: int, rows: int, backend: str, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The first `n_tokens` tokens' packed signs [B, n_kv, ≥ n_tokens, rows/32] as ±1 [B, n_kv, n_tokens, rows] in
    `dtype` (`_SIGNS_BODY`)."""
    batch, n_kv = signs.shape[:2]
    (pm,) = kernel(SIGNS_SOURCE, backend)(
        inputs=[RULER(n_tokens), signs],
        template=[("W", rows // 32), ("NT", THREADS), ("TD", dtype)],
        grid=((n_tokens * rows + THREADS - 1) // THREADS * THREADS, batch * n_kv, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(batch, n_kv, n_tokens, rows)],
        output_dtypes=[dtype],
    )
    return pm


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
    key_block: int | None = None,
    rope: tuple[mx.array, bool] | None = None,
) -> tuple[mx.array, mx.array]:
    """Keys and values [B, n_kv, n_tokens, head_dim] in `dtype`, decoded from the first `n_tokens` of the codecs'
    arrays (each [B, n_kv, capacity, ...], in the order `decode._CODEC_MACROS` documents); sketched keys also need
    the m×D `sketch` S. KIVI keys (arrays [B, n_kv, D, ...], their outliers' residuals and indices last where the
    codec has them) are read in blocks of `key_block` tokens (default: the group size); `rope` (each channel pair's
    angle per position, traditional pairing) turns keys stored before RoPE, compressed token c at position c."""
    if not supported(key, value, head_dim, backend):
        raise ValueError(f"The history-decode kernel has no variant for {key} / {value} at head_dim {head_dim}.")
    sketched = key.kind in _decode.SKETCH_KINDS
    if sketched != (sketch is not None):
        raise ValueError(f"The history decode of {key} keys takes {'a' if sketched else 'no'} sketch.")
    if rope is not None and key.kind != "kivi_keys":
        raise ValueError("Only KIVI keys are stored before RoPE.")
    batch, n_kv = value_arrays[0].shape[:2]
    threads = batch * n_kv * n_tokens * (head_dim // 8)
    shape = (batch, n_kv, n_tokens, head_dim)
    template = [("D", head_dim), ("G", group_size), ("NT", THREADS), ("TD", dtype)]
    grid = (threads + THREADS - 1) // THREADS * THREADS
    if key.kind == "kivi_keys":
        head, outliers, widths = _decode.kivi_key_inputs(key, key_arrays)
        template.append(("TT", KIVI_TILE_TOKENS))  # a threadgroup per KIVI_TILE_TOKENS tokens of a kv head
        grid = batch * n_kv * ((n_tokens + KIVI_TILE_TOKENS - 1) // KIVI_TILE_TOKENS) * THREADS
        key_arrays = [*head, *outliers, _decode._no_grid() if rope is None else rope[0], *widths]
        template += [("GK", key_block or group_size), ("KB", key.widest), ("ROPE", int(rope is not None)),
                     ("TRAD", int(rope is not None and rope[1])), ("KO", int(key.outliers)),
                     ("KCLS", len(key.widths)), ("KBLO", key.widths[0] if key.widths else key.bits)]
    extra = [sketch] if sketched else []
    proj = sketched and SKETCH_HISTORY_MATMUL
    if proj:
        # float16 rows only for qjl, whose key is its projection scaled (the same relative error); turboquant_prod adds
        # the projection of a residual to its centroids, and that term can exceed the key entry it corrects (2^-11 of it
        # was ~1 % of small entries in the emulator's test)
        extra = [_sketch_projection(key_arrays[0] if key.kind == "qjl" else key_arrays[4], sketch, n_tokens, backend,
                                    dtype if key.kind == "qjl" else mx.float32)]
    keys, values = kernel(dequantize_source(key, value, proj), backend)(
        inputs=[RULER(n_tokens), *key_arrays, *value_arrays, *extra],
        template=template,
        grid=(grid, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[shape, shape],
        output_dtypes=[dtype, dtype],
    )
    return keys, values
