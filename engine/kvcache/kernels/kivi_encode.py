"""KIVI's encode of a prefill chunk in one launch: keys per channel over blocks of tokens (each block's outlier set
aside, each channel at its width), values per token in groups of channels, codes packed, scales, biases, outlier
residuals and indices written as the store holds them.

On the reference path (`kivi.quantize_key_blocks`, `kivi.quantize_value_groups`; compiled on a GPU) the 3-bit level's
encode is ~35 launches per layer and chunk even compiled: the reorder into storage order, the outlier split's
reductions, one quantize, dequantize and residual per key width, the symmetric values' reduction and packing. On the
H200 a 2,048-token chunk of one 8B-shaped layer took 0.99 ms to encode that way and 2.31 ms to update with its stores
(prefill-layer-compiled-r2-h200.json), against 0.12 ms for a 16-bit cache's update: the launches, not the work (a
chunk's keys and values are 8 MB), set the time. Here one thread encodes one channel's block of keys (its GK entries
read down the token axis, the storage row's channel through the layer's order) or one group of a token's values,
from a single launch for both roles.

The arithmetic is the reference's on the CPU, exactly (the tests compare every entry):
* MLX's affine rule (`mx.quantize`, which the reference calls): scale (max - min)/(2^b - 1) with the group's larger-
  magnitude end made a code (edge / round(edge / scale)), codes round((x - bias) / scale) capped at 2^b - 1, rounding
  half to even. MLX's CUDA and Metal `mx.quantize` differ from its CPU one in two ways: they round half away from
  zero, and they start the group's max at 0, so a group whose entries are all negative is quantized over [min, 0]
  (mlx/backend/cuda/quantized/affine_quantize.cu and the Metal kernel's `w_max = 0`). A key channel with a negative
  offset over a 128-token block is such a group: on a GPU the reference stores it with a coarser step than the CPU
  measured its quality with. The kernel follows the CPU's rule on every backend.
* min..max (`minmax_quantize`, minmax_keys, and every 1-bit channel): scale and bias kept in 16 bits, codes chosen
  against them as kept.
* symmetric values (`symmetric_quantize`): scale max|x| / h kept in 16 bits, codes round(x / scale + h).
* outliers (`split_block_outliers`, `block_residuals`): the entry whose removal shrinks the block's range most (the
  first of equal maxima or minima), replaced by its neighbour in sorted order; stored as its float16 residual against
  the decoded block.
The clip search (clip_search, the 2-bit level) and grids keep the reference path: `supported` says so.

A GPU divides in IEEE single precision as the CPU does unless a compiler contracts or approximates; a value that lands
within float rounding of a code boundary may then take the neighbouring code (the GPU parity test allows 1 in 1,000
packed words).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from engine.kvcache.kernels.backend import KernelSource, kernel

THREADS = 128
# Backends where KIVI's chunks encode through this kernel. The CPU emulator checks it against the reference
# (tests/test_kvcache_kernel_emulation.py). CUDA and Metal: not yet run on a GPU (a GPU parity run admits them).
KIVI_ENCODE_BACKENDS: tuple[str, ...] = ("emulate",)
# Quantizer names as the cache's encode names them (kivi._QUANTIZERS) -> the kernel's codes for them.
KEY_QUANTIZERS = {"affine": 0, "minmax": 1}
VALUE_QUANTIZERS = {"affine": 0, "minmax": 1, "symmetric": 2}
MAX_CLASSES = 4
_KINDS_16 = {mx.float32: 0, mx.bfloat16: 1, mx.float16: 2}  # TDK

_HEADER = """
// Codes of a group into a little-endian bit stream of `bits`-bit codes (Velox's pack_bits, MLX's affine packing):
// `acc` gathers bits from `pos` on, and each filled 32-bit word is stored at dst[word].
#define PACK_CODE(dst, code, bits, pos, acc) { \\
    const int sh_ = (pos) & 31; \\
    acc |= (U32)(code) << sh_; \\
    if (sh_ + (bits) >= 32) { \\
      (dst)[(pos) >> 5] = acc; \\
      acc = sh_ == 0 ? 0u : (U32)(code) >> (32 - sh_); \\
    } \\
    pos += (bits); }

// KEPT(v): v as the store keeps it in the 16-bit type TD (TDK: 1 bfloat16, 2 float16, 0 float32), as a float. The CPU
// emulator holds 16-bit arrays as float, so there it rounds by hand, to nearest even as MLX's casts do.
#ifdef EMU_ARRAYS
INLINE float emu_keep16(float v, int kind) {
  if (kind == 2) return (float)(_Float16)v;
  if (kind == 0) return v;
  U32 u = AS_U32(v);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  return AS_F32(u);
}
#define KEPT(v) emu_keep16((v), TDK)
#else
#define KEPT(v) ((float)static_cast<TD>(v))
#endif

// MLX's affine rule (its CPU backend's `mx.quantize`) for a group over [lo, hi] at `bits` bits: the scale and bias the
// codes are chosen against (float32; the store keeps them rounded to 16 bits).
INLINE void affine_rule(float lo, float hi, int bits, THREAD float& scale, THREAD float& bias) {
  float s = FMAX((hi - lo) / (float)((1 << bits) - 1), 1e-7f);
  const bool side = fabs(lo) > fabs(hi);
  s = side ? s : -s;
  const float edge = side ? lo : hi;
  const float q0 = RINT(edge / s);
  scale = q0 == 0.0f ? s : edge / q0;
  bias = q0 == 0.0f ? 0.0f : edge;
}

INLINE U32 group_code(float x, float scale, float bias, int bits) {
  return (U32)fmin(fmax(RINT((x - bias) / scale), 0.0f), (float)((1 << bits) - 1));
}
"""

_BODY = """
  // Template: D, GK (key block), NCL (key width classes: 1 without widths), ORD (key rows in a stored order), KQ, VQ
  // (the rules: 0 MLX's affine, 1 min..max, 2 symmetric), G (value group), VB (value bits), TD (the 16-bit type of
  // scales and biases) and TDK (which one), TR (float16: the outliers' residuals). Defines: KO (outliers), VSYM.
  const long B = (long)keys_shape[0];
  const int H = (int)keys_shape[1];
  const long T = (long)keys_shape[2];
  const long nb = T / GK;
  const long key_jobs = B * H * nb * D;
  const long value_jobs = B * H * T * (D / G);
  const long idx = (long)GROUP_X * NT + TID;
  const float inf = AS_F32(0x7f800000u);
  if (idx < key_jobs) {
    // One storage row s of one block b of one kv head: GK entries down the token axis (a warp: 32 rows of a block).
    const int s = (int)(idx % D);
    const long rest = idx / D;
    const long b = rest % nb;
    const long bh = rest / nb;
    const int ch = ORD ? (int)kord[(bh % H) * D + s] : s;
    const int e0 = NCL > 1 ? (int)kends[0] : D;
    const int e1 = NCL > 2 ? (int)kends[1] : D;
    const int e2 = NCL > 3 ? (int)kends[2] : D;
    const int cl = (s >= e0) + (s >= e1) + (s >= e2);
    const int first = cl == 0 ? 0 : cl == 1 ? e0 : cl == 2 ? e1 : e2;
    const int end = cl == 0 ? e0 : cl == 1 ? e1 : cl == 2 ? e2 : D;
    const int w = (int)kwid[cl];
    const long row = bh * (end - first) + (s - first);   // the row among its class's rows
    const GLOBAL TD* x = keys + (bh * T + b * GK) * D + ch;
    float top = -inf, top2 = -inf, low = inf, low2 = inf;
    int top_at = 0, low_at = 0;
    for (int t = 0; t < GK; ++t) {
      const float v = (float)x[(long)t * D];
      if (v > top) { top2 = top; top = v; top_at = t; } else if (v > top2) { top2 = v; }
      if (v < low) { low2 = low; low = v; low_at = t; } else if (v < low2) { low2 = v; }
    }
    // The outlier: the end farther from its neighbour (the top on a tie), replaced by that neighbour.
    const bool take_top = (top - top2) >= (low2 - low);
    const int at = KO ? (take_top ? top_at : low_at) : -1;
    const float fill = take_top ? top2 : low2;
    const float hi = KO && take_top ? top2 : top;
    const float lo = KO && !take_top ? low2 : low;
    float scale, bias, kept_scale, kept_bias;
    if (KQ == 0 && w > 1) {
      affine_rule(lo, hi, w, scale, bias);
      kept_scale = KEPT(scale);
      kept_bias = KEPT(bias);
    } else {                            // min..max (every 1-bit channel too): codes against the kept scale and bias
      kept_scale = KEPT((hi - lo) / (float)((1 << w) - 1));
      kept_bias = KEPT(lo);
      scale = kept_scale > 0.0f ? kept_scale : 1.0f;
      bias = kept_bias;
    }
    const long words = (long)GK * w / 32;
    GLOBAL U32* dst = PICK_CLASS(cl, kc) + row * (nb * words) + b * words;
    int pos = 0;
    U32 acc = 0u;
    U32 outlier_code = 0u;
    for (int t = 0; t < GK; ++t) {
      const float v = t == at ? fill : (float)x[(long)t * D];
      const U32 code = group_code(v, scale, bias, w);
      if (t == at) outlier_code = code;
      PACK_CODE(dst, code, w, pos, acc);
    }
    const long g = row * nb + b;
    PICK_CLASS(cl, ks)[g] = static_cast<TD>(kept_scale);
    PICK_CLASS(cl, kb)[g] = static_cast<TD>(kept_bias);
#if KO
    // The residual against the entry as decoded with the kept scale and bias in float32 (the reference's decode).
    const float decoded = (float)outlier_code * kept_scale + kept_bias;
    PICK_CLASS(cl, kr)[g] = static_cast<TR>((take_top ? top : low) - decoded);
    PICK_CLASS(cl, ki)[g] = (uint8_t)at;
#endif
  } else if (idx < key_jobs + value_jobs) {
    // One group of G channels of one token's values.
    const long j = idx - key_jobs;
    const int g = (int)(j % (D / G));
    const long token = j / (D / G);
    const GLOBAL TD* x = values + token * D + g * G;
    float lo = inf, hi = -inf;
    for (int c = 0; c < G; ++c) {
      const float v = (float)x[c];
      lo = fmin(lo, v);
      hi = fmax(hi, v);
    }
    const float half = (float)((1 << VB) - 1) / 2.0f;
    float scale, bias, kept_scale, kept_bias;
    if (VQ == 2) {                      // symmetric: x = s (code - h), s = max|x| / h
      kept_scale = KEPT(fmax(fabs(lo), fabs(hi)) / half);
      kept_bias = 0.0f;
      scale = kept_scale > 0.0f ? kept_scale : 1.0f;
      bias = 0.0f;
    } else if (VQ == 0 && VB > 1) {
      affine_rule(lo, hi, VB, scale, bias);
      kept_scale = KEPT(scale);
      kept_bias = KEPT(bias);
    } else {
      kept_scale = KEPT((hi - lo) / (float)((1 << VB) - 1));
      kept_bias = KEPT(lo);
      scale = kept_scale > 0.0f ? kept_scale : 1.0f;
      bias = kept_bias;
    }
    constexpr int words = G * VB / 32;
    GLOBAL U32* dst = vc + token * (D * VB / 32) + g * words;
    int pos = 0;
    U32 acc = 0u;
    for (int c = 0; c < G; ++c) {
      const float v = (float)x[c];
      const U32 code = VQ == 2 ? (U32)fmin(fmax(RINT(v / scale + half), 0.0f), 2.0f * half)
                               : group_code(v, scale, bias, VB);
      PACK_CODE(dst, code, VB, pos, acc);
    }
    vs[token * (D / G) + g] = static_cast<TD>(kept_scale);
#if !VSYM
    vb[token * (D / G) + g] = static_cast<TD>(kept_bias);
#endif
  }
"""


def supported(key_quantizer: str, value_quantizer: str, widths: tuple[int, ...], group_size: int, key_block: int,
              head_dim: int, backend: str | None, grids: bool = False) -> bool:
    """Whether this kernel encodes KIVI's chunks with these quantizers and widths on `backend`."""
    return (backend in KIVI_ENCODE_BACKENDS and not grids and key_quantizer in KEY_QUANTIZERS
            and value_quantizer in VALUE_QUANTIZERS and 1 <= len(widths) <= MAX_CLASSES
            and all(1 <= w <= 8 for w in widths) and key_block % 32 == 0 and key_block <= 256
            and group_size % 32 == 0 and head_dim % group_size == 0)


@functools.cache
def encode_source(classes: int, outliers: bool, symmetric_values: bool) -> KernelSource:
    """The encode kernel for `classes` key width classes (one output set each), with or without outliers and value
    biases."""
    parts = "csbri" if outliers else "csb"
    key_outputs = tuple(f"k{part}{c}" for c in range(classes) for part in parts)
    value_outputs = ("vc", "vs") if symmetric_values else ("vc", "vs", "vb")
    pick = f"name##{classes - 1}"  # PICK_CLASS(c, kc): class c's output kc<c>
    for c in reversed(range(classes - 1)):
        pick = f"((c) == {c} ? name##{c} : {pick})"
    return KernelSource(
        name=f"velox_kivi_encode_{classes}{'_o' if outliers else ''}{'_s' if symmetric_values else ''}",
        input_names=("keys", "values", "kord", "kends", "kwid"),
        output_names=(*key_outputs, *value_outputs),
        body=_BODY,
        header=_HEADER,
        defines=f"#define PICK_CLASS(c, name) {pick}\n#define KO {int(outliers)}\n#define VSYM {int(symmetric_values)}\n",
    )


def kivi_encode(keys: mx.array, values: mx.array, widths: tuple[tuple[int, int, int], ...] | None,
                key_order: mx.array | None, key_bits: int, key_block: int, key_quantizer: str, outliers: bool,
                group_size: int, value_bits: int, value_quantizer: str, backend: str) -> dict[str, mx.array]:
    """The store entries of new keys and values [B, n_kv, T, D] (T a multiple of `key_block`) as
    `kivi.quantize_key_blocks` and `kivi.quantize_value_groups` give them: keys per channel over blocks of
    `key_block` tokens (with `widths`, each width's (width, first row, end row) in the storage order `key_order`
    [n_kv, D], entries named for the width), values per token in groups of `group_size` channels."""
    batch, n_kv, tokens, head_dim = keys.shape
    classes = widths or ((key_bits, 0, head_dim),)
    symmetric = value_quantizer == "symmetric"
    source = encode_source(len(classes), outliers, symmetric)
    blocks = tokens // key_block
    key_jobs = batch * n_kv * blocks * head_dim
    value_jobs = batch * n_kv * tokens * (head_dim // group_size)
    ends = [end for _, _, end in classes] + [head_dim] * (MAX_CLASSES - len(classes))
    width_of = [width for width, _, _ in classes] + [0] * (MAX_CLASSES - len(classes))
    order = key_order if widths else mx.zeros((1, 1), dtype=mx.uint8)
    shapes, dtypes = [], []
    for width, start, end in classes:
        rows = end - start
        shapes += [(batch, n_kv, rows, tokens * width // 32), (batch, n_kv, rows, blocks), (batch, n_kv, rows, blocks)]
        dtypes += [mx.uint32, keys.dtype, keys.dtype]
        if outliers:
            shapes += [(batch, n_kv, rows, blocks)] * 2
            dtypes += [mx.float16, mx.uint8]
    value_groups = (batch, n_kv, tokens, head_dim // group_size)
    shapes += [(batch, n_kv, tokens, head_dim * value_bits // 32), value_groups]
    dtypes += [mx.uint32, keys.dtype]
    if not symmetric:
        shapes.append(value_groups)
        dtypes.append(keys.dtype)
    outputs = kernel(source, backend)(
        inputs=[keys, values, order, mx.array(ends, dtype=mx.int32), mx.array(width_of, dtype=mx.int32)],
        template=[("D", head_dim), ("GK", key_block), ("NCL", len(classes)), ("ORD", int(bool(widths))),
                  ("KQ", KEY_QUANTIZERS[key_quantizer]), ("VQ", VALUE_QUANTIZERS[value_quantizer]),
                  ("G", group_size), ("VB", value_bits), ("NT", THREADS), ("TD", keys.dtype),
                  ("TDK", _KINDS_16[keys.dtype]), ("TR", mx.float16)],
        grid=((key_jobs + value_jobs + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    )
    value_names = ["value_codes", "value_scales"] + ([] if symmetric else ["value_biases"])
    key_parts = ["key_codes", "key_scales", "key_biases"] + (
        ["key_outlier_residuals", "key_outlier_index"] if outliers else [])
    per_class = len(key_parts)
    store = dict(zip(value_names, outputs[len(classes) * per_class:], strict=True))
    for c, (width, _, _) in enumerate(classes):
        suffix = f"_w{width}" if widths else ""
        for p, name in enumerate(key_parts):
            store[name + suffix] = outputs[c * per_class + p]
    return store
