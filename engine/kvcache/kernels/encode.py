"""Fused encode of new tokens for the codebook methods (turboquant, rvq, turboquant_prod, qjl's keys, polarquant):
norm, codes, bit packing (and RVQ's residual stage, a sketch's signs, PolarQuant's angles) in one launch per role.

The pure-MLX encode (`RotatedCodebookKVCache._encode_role`) is ~30 small operations per role (norm,
division, one comparison and sum per boundary chunk, the packing's shifts, sums and stacks); while decoding
they run for one token per layer and step, so their launches, not their arithmetic, set the time. Here one
launch encodes every new vector of a role. A warp of 32 lanes encodes one vector (a token of one kv head):
each lane loads and codes D/32 of its coordinates, the norm (and RVQ's residual sums) are warp reductions,
and the codes meet in shared memory, where each lane packs whole 32-bit words. The first form gave each
vector one thread, which walked its D coordinates one after another (twice more for RVQ's residual): while
decoding, a launch of batch × kv_heads threads each waiting on D reads of device memory. Timed side by side
on the H200 (BENCHMARKS.md, `decode-encode-ab-h200.json`), the warp layout decoded rvq 6-19 % faster
(turboquant: within the rounds' spread).

The arithmetic follows the reference exactly: u = x / max(‖x‖, tiny), code = number of boundaries below u
(equal goes down), codes packed as a little-endian bit stream (`quant/bitpack.py`); RVQ's residual
r = u - c₁[code₁] is divided by max(rms(r), tiny), coded against the second boundaries, and its scale is
the least-squares fit Σ r·c₂ / max(Σ c₂², tiny). Sums run in a different order than MLX's reductions, so a
value lying within float rounding of a boundary can take the neighbouring code (the tests allow for it).
The rotation (a Hadamard transform) stays in MLX on the reference path (`_keys_in`); where ROTATE_ENCODE_BACKENDS has
the backend, a window-less cache's new tokens come here before it, and the warp applies it (`rotation_fusable`).

Sketched keys take a sketch variant (`sketch=True`): turboquant_prod's after their (b-1)-bit codes, the residual
r = u - c[code] (its norm ‖r‖ stored too), qjl's with no codebook stage, the key itself, go to shared memory; each
lane computes every 32nd row of S r for the m×D sketch S (float16, read from device memory; m = D, or key_bits·D
for qjl), and the warp packs their signs (1 = non-negative). Where the backend is not in SKETCH_ENCODE_BACKENDS (a GPU
parity run decides), those keys encode through MLX operations. qjl's long chunks take S·k from one MLX matmul and
pack its signs in a launch of their own (`sketch_signs_packed`).

PolarQuant has a kernel of its own (`polar_encode`, the same warp layout and packing): the warp walks the polar
tree of the unit vector a level at a time in shared memory (see `_POLAR_BODY`); its angles come from ATAN2, so,
as with the boundaries above, an angle within float rounding of a cell's edge can take the neighbouring code.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from engine.kvcache.kernels.backend import KernelSource, kernel
from engine.kvcache.kernels.rotate import WARP_HADAMARD, rotation_scale, warp_rotatable
from engine.kvcache.quant.sketch import sketch_projection

THREADS = 128  # 4 vectors, one warp each, per threadgroup

_WARP_PROLOGUE = """
  // One warp (32 lanes) per vector, NT / 32 vectors per threadgroup: lane l holds dims l, l + 32, ... (coalesced
  // loads), the sums are warp reductions, and the codes meet in shared memory to be packed a word per lane.
  constexpr int VPG = NT / 32;
  constexpr int P = (D + 31) / 32;
  const int lane = TID & 31;
  const int slot = TID >> 5;
  const long row = (long)GROUP_X * VPG + slot;
  const long n_rows = (long)xin_shape[0] * xin_shape[1] * xin_shape[2];
  const bool valid = row < n_rows;
  const long base = (valid ? row : 0) * D;
#if SKETCH
  constexpr int CW = SKM > D ? SKM : D;  // codes or signs per vector in shared memory
#else
  constexpr int CW = D;
#endif
  SHARED U32 sh_codes[VPG * CW];
  // This vector's N codes of B bits (in sh_codes, from its slot FROM on) packed into dst, a word per lane and round.
  // Word w holds stream bits [32w, 32w + 32): codes floor(32w / B) .. while their first bit is below 32w + 32; a code
  // that began in the word before adds its high bits (shifted right), one running past the end its low.
#define PACK_CODES(dst, B, N, FROM) \\
  for (int w = lane; w < (N) * (B) / 32; w += 32) { \\
    U32 word = 0; \\
    for (int d = (32 * w) / (B); d < (N) && d * (B) < 32 * w + 32; ++d) { \\
      const int shift = d * (B) - 32 * w; \\
      const U32 c = sh_codes[slot * CW + (FROM) + d]; \\
      word |= shift >= 0 ? (c << shift) : (c >> (-shift)); } \\
    dst[row * ((N) * (B) / 32) + w] = word; }
  float x[P];
  for (int p = 0; p < P; ++p) {
    const int d = lane + 32 * p;
    x[p] = (valid && d < D) ? (float)xin[base + d] : 0.0f;
  }
#if ROTATE
  // The method's rotation R x = H (signs ⊙ x) / sqrt(D) (Sylvester H, D = 32·P a power of two), then the rounding to
  // the 16-bit dtype TR the reference path stores first (kernels/rotate.py's WARP_HADAMARD: coordinate d = lane + 32 p,
  // a shuffle for each of d's five low bits, register pairs for the rest).
  for (int p = 0; p < P; ++p) x[p] *= rsign[lane + 32 * p];
""" + WARP_HADAMARD + """
  for (int p = 0; p < P; ++p) x[p] = (float)static_cast<TR>(x[p] * rscale[0]);
#endif
  float ss = 0.0f;
  for (int p = 0; p < P; ++p) ss += x[p] * x[p];
  for (int m = 16; m > 0; m >>= 1) ss += LANE_XOR(ss, m);
  const float norm = sqrt(ss);
  const float denom = FMAX(norm, 1e-30f);
  if (valid && lane == 0) norms[row] = static_cast<TN>(norm);
"""

_ENCODE_BODY = _WARP_PROLOGUE + """
#if STAGES == 0
  float r2 = ss;  // qjl's keys: no codebook stage, the sketch takes the key itself
#else
  float r2 = 0.0f;
  for (int p = 0; p < P; ++p) {
    const int d = lane + 32 * p;
    if (d < D) {
      const float u = x[p] / denom;
      int code = 0;
      for (int j = 0; j < NB1; ++j) code += (u > bnd1[j]) ? 1 : 0;
      sh_codes[slot * CW + d] = (U32)code;
      if (STAGES == 2 || SKETCH) { x[p] = u - cen1[code]; r2 += x[p] * x[p]; }
    }
  }
  BARRIER();
  if (valid) {
    PACK_CODES(packed, B1, D, 0);
  }
#endif
#if SKETCH
  // The signs of S r for the SKM×D sketch `sk`: turboquant_prod's keys (r the residual, SKM = D; its norm is stored
  // too) and qjl's (r the key itself, SKM = key_bits·D). A lane takes sketch rows lane, lane + 32, ...: each a
  // product over the whole of r, which the warp first puts in shared memory.
  SHARED float sh_r[VPG * D];
#if STAGES == 1
  for (int m = 16; m > 0; m >>= 1) r2 += LANE_XOR(r2, m);
#endif
  for (int p = 0; p < P; ++p) {
    const int d = lane + 32 * p;
    if (d < D) sh_r[slot * D + d] = x[p];
  }
  BARRIER();  // also: every lane has packed the codes before they are overwritten
  for (int j = lane; j < SKM; j += 32) {
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc += (float)sk[(long)j * D + d] * sh_r[slot * D + d];
    sh_codes[slot * CW + j] = acc >= 0.0f ? 1u : 0u;
  }
  BARRIER();
  if (valid) {
    PACK_CODES(signs, 1, SKM, 0);
#if STAGES == 1
    if (lane == 0) rnorm[row] = static_cast<TN>(sqrt(r2));
#endif
  }
#endif
#if STAGES == 2
  for (int m = 16; m > 0; m >>= 1) r2 += LANE_XOR(r2, m);
  const float rdenom = FMAX(sqrt(r2 / D), 1e-30f);
  float dot = 0.0f;
  float sq = 0.0f;
  BARRIER();  // every lane has packed the first stage's codes before they are overwritten
  for (int p = 0; p < P; ++p) {
    const int d = lane + 32 * p;
    if (d < D) {
      const float z = x[p] / rdenom;
      int code2 = 0;
      for (int j = 0; j < NB2; ++j) code2 += (z > bnd2[j]) ? 1 : 0;
      const float c2 = cen2[code2];
      dot += x[p] * c2;
      sq += c2 * c2;
      sh_codes[slot * CW + d] = (U32)code2;
    }
  }
  for (int m = 16; m > 0; m >>= 1) dot += LANE_XOR(dot, m);
  for (int m = 16; m > 0; m >>= 1) sq += LANE_XOR(sq, m);
  BARRIER();
  if (valid) {
    PACK_CODES(residual, B2, D, 0);
    if (lane == 0) rscales[row] = static_cast<TN>(dot / FMAX(sq, 1e-30f));
  }
#endif
"""


# PolarQuant (methods/polarquant.py, quant/polar.py): the unit vector goes to shared memory, and the warp walks the
# polar tree level by level, one angle per lane and round: level 1 takes pairs of coordinates (angle in [0, 2π),
# uniform cells of B1 bits), each higher level pairs of the radii the level below left (angle in [0, π/2], coded
# against that level's NBH boundaries, bndh[(level - 2) * NBH + k]). Radii alternate between two buffers (a level's
# writes would overwrite the pairs another lane still reads). Codes: level 1 in slots [0, D/2), the higher levels
# one after another from D/2 on, with one padding slot at D - 1 (as the reference concatenates them).
_POLAR_BODY = _WARP_PROLOGUE + """
  constexpr int H = D / 2;
  SHARED float sh_rad[VPG * (D + H)];
  const int ua = slot * (D + H);  // [ua, ua + D): the unit vector, then odd levels' radii; [ua + D, ua + D + H): even
  for (int p = 0; p < P; ++p) {
    const int d = lane + 32 * p;
    if (d < D) sh_rad[ua + d] = x[p] / denom;
  }
  BARRIER();
  for (int j = lane; j < H; j += 32) {
    const float e = sh_rad[ua + 2 * j];
    const float o = sh_rad[ua + 2 * j + 1];
    float a = ATAN2(o, e);
    if (a < 0.0f) a += 6.2831853071795864f;
    // cells / 2π is 2^B1 · float(1 / 2π) exactly, the float the reference multiplies by
    const int code = (int)floor(a * ((float)(1 << B1) * 0.15915494309189535f));
    sh_codes[slot * CW + j] = (U32)(code < (1 << B1) - 1 ? code : (1 << B1) - 1);
    sh_rad[ua + D + j] = sqrt(e * e + o * o);
  }
  BARRIER();
  int at = H;
  for (int level = 2, n = D / 4; n >= 1; ++level, n >>= 1) {
    const int src = (level % 2 == 0) ? ua + D : ua;
    const int dst = (level % 2 == 0) ? ua : ua + D;
    for (int j = lane; j < n; j += 32) {
      const float e = sh_rad[src + 2 * j];
      const float o = sh_rad[src + 2 * j + 1];
      const float a = ATAN2(o, e);
      int code = 0;
      for (int k = 0; k < NBH; ++k) code += (a > bndh[(level - 2) * NBH + k]) ? 1 : 0;
      sh_codes[slot * CW + at + j] = (U32)code;
      sh_rad[dst + j] = sqrt(e * e + o * o);
    }
    at += n;
    BARRIER();
  }
  if (lane == 0) sh_codes[slot * CW + D - 1] = 0u;
  BARRIER();
  if (valid) {
    PACK_CODES(first, B1, H, 0);
    PACK_CODES(higher, BH, H, H);
  }
"""

# Backends where sketched keys (turboquant_prod's, qjl's) encode through the kernel; elsewhere through MLX
# operations. The CPU emulator checks it against the reference (tests/test_kvcache_kernel_emulation.py); CUDA passed
# the GPU parity tests on the lent H200 (tests/test_kvcache_kernels.py, test_codebook_encode_kernel_matches_reference
# for turboquant_prod and the keys of test_qjl_encode_kernel_matches_reference; 2026-12-02, commit ba40b06), where
# turboquant_prod:k4v4 decoded the whole model at 39.2 / 39.2 tok/s at 8k / 32k against 20.6 / 18.3 with MLX's
# encode, qjl:k4v4 within the rounds' spread (benchmarks/results/decode-sketch-encode-polar-h200.json). Metal runs
# the same body: enabled by construction, as every kernel here.
SKETCH_ENCODE_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")
# Backends where a rotated codebook method's new tokens reach the encode kernel before their rotation, which the kernel
# applies (define ROTATE): per layer and decode step, the rotation's sign products, transforms and 16-bit casts of keys
# and values leave the step (turboquant:k4v4's step 1,550 -> 1,230 operations, as many as affine's; rvq's 1,806 ->
# 1,486; launch-count-rotate-h200.json). CUDA passed the GPU parity run (test_encode_kernel_rotates_as_the_reference
# and the decode parity of every rotated codebook method through it; kernel-parity-rotate-encode-h200.log), and
# turboquant:k4v4's 8k step took 1.19 / 1.13 of affine's against 1.28 / 1.23 without (decode-rotate-encode-h200.json).
# Metal runs the same body (its LANE_XOR and 16-bit casts are the decode kernels'): enabled by construction.
ROTATE_ENCODE_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")
# The most new tokens whose keys encode through the kernel where the sketch has more rows than a key has channels
# (qjl at 2 or more key bits: m = key_bits·D); a longer chunk (a prefill's) encodes through MLX, whose S·k is one
# matmul on the GPU's matrix units, where each of the kernel's warps reads all m rows of S for its key (m·D
# multiply-adds: 64k for qjl:4 at D = 128). A 2,048-token chunk of 8 kv heads on the H200: qjl:k4v4 4.86 ms through
# the kernel against 0.87 through MLX; turboquant_prod:k4v4 (m = D, and its MLX encode is ~30 operations) 1.41 against
# 2.11, so it keeps the kernel (benchmarks/results/history-profile-r2-h200.json). None: the kernel at any length.
SKETCH_ENCODE_MAX_TOKENS: int | None = 64


def sketch_encode_takes(backend: str | None, n_tokens: int, rows: int, head_dim: int) -> bool:
    """Whether `n_tokens` new keys of `head_dim` channels with an m = `rows` sketch encode through the kernel on
    `backend`."""
    if backend not in SKETCH_ENCODE_BACKENDS:
        return False
    return SKETCH_ENCODE_MAX_TOKENS is None or rows <= head_dim or n_tokens <= SKETCH_ENCODE_MAX_TOKENS

# Sketched keys of a long chunk (past SKETCH_ENCODE_MAX_TOKENS) take S·k from one MLX matmul, then their signs are
# packed here in one launch: a thread per 32-bit word reads its 32 projections (bit b: projection 32w + b >= 0, as
# quant/sketch.py's sketch_signs), in place of `pack_bits`' MLX chain (a comparison, casts, a product with each bit's
# place and a sum over a [.., m/32, 32] array), which was most of qjl:k4v4's 0.87 ms to encode a 2,048-token chunk of
# 8 kv heads on the H200 (its matmul ~0.02 ms; prefill-layer-sketch-h200.json). Backends where it runs (elsewhere
# `pack_bits`): CUDA passed the GPU parity test on the H200 (test_sign_pack_kernel_matches_mlx_packing, word for word;
# kernel-parity-sign-pack-h200.log), where qjl:k4v4's 32k-token prefill ran at 5,682 tok/s with it against 5,407
# without in one process (pipelined 6,139 against 6,027; fp16 7,289 / 8,079; prefill-sign-pack-h200.json). Metal runs
# the same body: enabled by construction.
SIGN_PACK_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")

_SIGN_PACK_BODY = """
  // Template: W (words per row), NT. Thread: word w of one row of `proj` [rows, 32·W] (float32).
  const long idx = (long)GROUP_X * NT + TID;
  if (idx < (long)proj_shape[0] * W) {
    const GLOBAL float* p = proj + idx * 32;   // (row, w) in row-major order: the row's entries 32w .. 32w + 31
    U32 word = 0u;
    for (int b = 0; b < 32; ++b) word |= (p[b] >= 0.0f ? 1u : 0u) << b;
    packed[idx] = word;
  }
"""
SIGN_PACK_SOURCE = KernelSource(name="velox_sign_pack", input_names=("proj",), output_names=("packed",),
                                body=_SIGN_PACK_BODY)


def sketch_signs_packed(vectors: mx.array, sketch: mx.array, backend: str) -> mx.array:
    """sign(S x) of [..., n, D] vectors packed as quant/sketch.py's `sketch_signs` packs them (uint32 [..., n, m/32],
    1 = non-negative): the same float32 matmul, the packing in one launch (`_SIGN_PACK_BODY`)."""
    projected = sketch_projection(vectors, sketch)
    *lead, m = projected.shape
    if m % 32:
        raise ValueError(f"Sign packing takes a multiple of 32 sketch rows, not {m}.")
    rows = math.prod(lead)
    words = rows * (m // 32)
    (packed,) = kernel(SIGN_PACK_SOURCE, backend)(
        inputs=[projected.reshape(rows, m)],
        template=[("W", m // 32), ("NT", THREADS)],
        grid=((words + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*lead, m // 32)],
        output_dtypes=[mx.uint32],
    )
    return packed


# Backends where PolarQuant's keys and values encode through the polar kernel (`polar_encode`); elsewhere through
# MLX operations (~100 small ones per role: the transform's levels, a code search per level, two packings). The CPU
# emulator checks it against the reference (tests/test_kvcache_kernel_emulation.py); CUDA passed the GPU parity test
# on the lent H200 (tests/test_kvcache_kernels.py::test_codebook_encode_kernel_matches_reference, polarquant at 2-4
# bits; 2026-12-02, commit 15e4e7c), where polarquant:k4v4 decoded the whole model at 37.2 / 38.2 tok/s at 8k / 32k
# against 8.6 / 10.7 with MLX's encode, and prefilled 32k tokens at 6,663 tok/s against 5,109 (fp16 7,239;
# benchmarks/results/decode-polar-encode-h200.json). Metal runs the same body (its ATAN2 is MSL's precise one).
POLAR_ENCODE_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")


@functools.cache
def encode_source(stages: int, sketch: bool = False, rotate: bool = False) -> KernelSource:
    """The encode kernel for one (turboquant) or two (rvq) codebook stages; with `sketch`, the signs of a sketch
    too: of the residual after one stage, whose norm is stored as well (turboquant_prod's keys), or, with no stage,
    of the vector itself (qjl's keys). With `rotate` it takes the vectors before the method's Hadamard rotation and
    applies it (and the 16-bit rounding) first (`rotation_fusable`)."""
    if not ((stages in (1, 2) and not sketch) or (stages in (0, 1) and sketch)):
        raise ValueError(f"The codebook encode kernel has one or two stages, or a sketch after none or one; "
                         f"not {stages} stages{' with a sketch' if sketch else ''}.")
    inputs = ("xin", *(("rsign", "rscale") if rotate else ()), *(("bnd1", "cen1") if stages >= 1 else ()),
              *(("bnd2", "cen2") if stages == 2 else ()), *(("sk",) if sketch else ()))
    outputs = ("norms", *(("packed",) if stages >= 1 else ()), *(("residual", "rscales") if stages == 2 else ()),
               *(("rnorm",) if sketch and stages == 1 else ()), *(("signs",) if sketch else ()))
    return KernelSource(
        name=f"velox_codebook_encode{stages}" + ("_sketch" if sketch else "") + ("_rotate" if rotate else ""),
        input_names=inputs,
        output_names=outputs,
        body=_ENCODE_BODY,
        defines=f"#define STAGES {stages}\n#define SKETCH {int(sketch)}\n#define ROTATE {int(rotate)}\n",
    )


def rotation_fusable(backend: str | None, signs: mx.array | None, head_dim: int) -> bool:
    """Whether the encode kernel applies a rotation itself on `backend`: admitted there (ROTATE_ENCODE_BACKENDS)
    and one a warp applies (`rotate.warp_rotatable`; `signs`: Rotation.sylvester_inverse_signs)."""
    return backend in ROTATE_ENCODE_BACKENDS and warp_rotatable(signs, head_dim)


def codebook_encode(
    vectors: mx.array,
    stages: list[tuple[int, mx.array, mx.array]],
    norm_dtype: mx.Dtype,
    backend: str,
    sketch: mx.array | None = None,
    rotation_signs: mx.array | None = None,
) -> list[mx.array]:
    """Encode [..., n, D] vectors; `stages` = [(bits, centroids, boundaries)] (one or two stages).
    With `rotation_signs` (`rotation_fusable` checked by the caller) the vectors are taken before the rotation
    H (signs ⊙ x) / sqrt(D), which the kernel applies and rounds to `norm_dtype` (the cache's 16-bit dtype) first.

    Returns [norms [..., n, 1], codes [..., n, D·bits/32]] and for two stages also
    [residual codes, residual scales [..., n, 1]], norms and scales in `norm_dtype`. With an m×D `sketch` and one
    stage (m = D) also [the residual's norms [..., n, 1], the signs of its sketch, packed [..., n, m/32]]; with a
    sketch and no stage [norms, the signs of the vectors' sketch].
    """
    if vectors.ndim != 4:
        raise ValueError(f"codebook_encode takes [batch, heads, tokens, head_dim], got {vectors.shape}.")
    *lead, n, head_dim = vectors.shape
    rows = lead[0] * lead[1] * n
    inputs = []
    template: list[tuple[str, object]] = [("D", head_dim), ("NT", THREADS), ("TN", norm_dtype)]
    if rotation_signs is not None:
        inputs += [rotation_signs, rotation_scale(head_dim)]
        template.append(("TR", norm_dtype))
    output_shapes = [(*lead, n, 1)] + ([(*lead, n, head_dim * stages[0][0] // 32)] if stages else [])
    output_dtypes = [norm_dtype] + ([mx.uint32] if stages else [])
    for index, (bits, centroids, boundaries) in enumerate(stages, start=1):
        inputs += [boundaries.astype(mx.float32), centroids.astype(mx.float32)]
        template += [(f"B{index}", bits), (f"NB{index}", int(boundaries.shape[0]))]
    if len(stages) == 2:
        output_shapes += [(*lead, n, head_dim * stages[1][0] // 32), (*lead, n, 1)]
        output_dtypes += [mx.uint32, norm_dtype]
    if sketch is not None:
        rows_m = int(sketch.shape[0])
        inputs.append(sketch)
        template.append(("SKM", rows_m))
        if stages:
            output_shapes.append((*lead, n, 1))
            output_dtypes.append(norm_dtype)
        output_shapes.append((*lead, n, rows_m // 32))
        output_dtypes.append(mx.uint32)
    run = kernel(encode_source(len(stages), sketch is not None, rotation_signs is not None), backend)
    groups = (rows + THREADS // 32 - 1) // (THREADS // 32)
    return run(
        inputs=[vectors, *inputs],
        template=template,
        grid=(groups * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=output_shapes,
        output_dtypes=output_dtypes,
    )


POLAR_SOURCE = KernelSource(
    name="velox_polar_encode",
    input_names=("xin", "bndh"),
    output_names=("norms", "first", "higher"),
    body=_POLAR_BODY,
    defines="#define SKETCH 0\n",
)


def polar_encode(
    vectors: mx.array, first_bits: int, higher_bits: int, boundaries: mx.array, norm_dtype: mx.Dtype, backend: str
) -> list[mx.array]:
    """PolarQuant's encode of [..., n, D] vectors in one launch: [norms [..., n, 1], level-1 codes
    [..., n, D/2·first_bits/32], higher-level codes [..., n, D/2·higher_bits/32]] as `_encode_role` makes them.
    `boundaries` [levels - 1, NBH]: each higher level's sorted boundaries, level 2 first."""
    if vectors.ndim != 4:
        raise ValueError(f"polar_encode takes [batch, heads, tokens, head_dim], got {vectors.shape}.")
    *lead, n, head_dim = vectors.shape
    rows = lead[0] * lead[1] * n
    half = head_dim // 2
    run = kernel(POLAR_SOURCE, backend)
    groups = (rows + THREADS // 32 - 1) // (THREADS // 32)
    return run(
        inputs=[vectors, boundaries.astype(mx.float32).reshape(-1)],
        template=[("D", head_dim), ("NT", THREADS), ("TN", norm_dtype), ("B1", first_bits), ("BH", higher_bits),
                  ("NBH", int(boundaries.shape[-1]))],
        grid=(groups * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*lead, n, 1), (*lead, n, half * first_bits // 32), (*lead, n, half * higher_bits // 32)],
        output_dtypes=[norm_dtype, mx.uint32, mx.uint32],
    )
