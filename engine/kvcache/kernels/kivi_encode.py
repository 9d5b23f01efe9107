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
* the clip search (`clipped_quantize`, clip_search: the 2-bit level): each candidate range (CLIP_RATIOS about the
  group's midpoint, at 1 bit also the two means) coded by the affine rule and its squared error summed, the first
  least kept. Its sums run in another order than MLX's reductions (and a GPU fuses multiply-adds), so two candidates
  within float rounding of each other may be chosen the other way: the GPU parity test holds every group's squared
  error within 1e-3 of the reference's and lets 1 % of stored entries differ.
Grids (key_grid, value_grid) keep the reference path: `supported` says so.

A GPU divides in IEEE single precision as the CPU does unless a compiler contracts or approximates; a value that lands
within float rounding of a code boundary may then take the neighbouring code (the GPU parity test allows 1 in 1,000
packed words).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from engine.kvcache.kernels.backend import KernelSource, kernel

THREADS = 128
# Backends where KIVI's chunks encode through this kernel. The CPU emulator checks it against the reference, exactly
# (tests/test_kvcache_kernel_emulation.py). CUDA passed the GPU parity test on the lent H200 (2026-12-03, commit
# b26e05a; kernel-parity-kivi-encode-h200.log: the 4- and 3-bit levels' layouts, key widths, min..max keys in
# float16), where one 8B-shaped layer's 2,048-token update at the 3-bit level's layout took 1.40 ms with it against
# 2.64 ms through MLX (encode alone 0.52 against 1.19 ms; the 4-bit level's 1.16 against 1.23 ms, its encode 0.51
# against 0.40), and a 32k-token prefill of the 3-bit level ran at 6,269 tok/s against 5,668 (fp16 7,301;
# prefill-kivi-encode-h200.json). Metal runs the same body with its own prelude: enabled by construction, as the other
# kernels here (no Mac here).
KIVI_ENCODE_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")
# Backends where the kernel also runs the clip search (the 2-bit level). Its first H200 parity run found 0.29 % of one
# width's code words differing from the reference, over the 1 in 1,000 allowed for plain rounding: a group choosing
# another candidate of (nearly) the same error. The parity test now compares each group's error with the reference's
# (a worse choice fails it) and passed on the H200 (2026-12-03, kernel-parity-kivi-encode-r2-h200.log); a 32k-token
# prefill of the 2-bit level ran at 6,185 tok/s with it against fp16's 7,242 (prefill-clip-admitted-h200.json; 4,703
# through MLX in an earlier process, prefill-clip-encode-h200.json). Metal: the same body, by construction.
CLIP_SEARCH_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")
# Quantizer names as the cache's encode names them (kivi._QUANTIZERS) -> the kernel's codes for them.
KEY_QUANTIZERS = {"affine": 0, "minmax": 1, "clipped": 3}
VALUE_QUANTIZERS = {"affine": 0, "minmax": 1, "symmetric": 2, "clipped": 3}
MAX_CLASSES = 4
_KINDS_16 = {mx.float32: 0, mx.bfloat16: 1, mx.float16: 2}  # TDK

_HEADER = """
// min, max and abs through the dialect's FMAX (exact for the finite entries a cache holds)
#define MIN2(a, b) (-FMAX(-(a), -(b)))
#define MAX2(a, b) FMAX((a), (b))
#define ABS1(x) FMAX((x), -(x))
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

// keep16<T, K16>(v): v as the store keeps it in the 16-bit type T (K16: 1 bfloat16, 2 float16, 0 float32), as a float.
// The CPU emulator holds 16-bit arrays as float, so there it rounds by hand, to nearest even as MLX's casts do.
#ifdef EMU_ARRAYS
template <typename T, int K16>
INLINE float keep16(float v) {
  if (K16 == 2) return (float)(_Float16)v;
  if (K16 == 0) return v;
  const U32 u = AS_U32(v);
  return AS_F32((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}
#else
template <typename T, int K16>
INLINE float keep16(float v) { return (float)static_cast<T>(v); }
#endif

// v clipped to [b, t] and kept in 16 bits (a clipped candidate's entries and bounds)
template <typename T, int K16>
INLINE float clamp16(float v, float b, float t) { return keep16<T, K16>(MIN2(MAX2(v, b), t)); }

// A group's entry i: x[i * stride], or `fill` at index `at` (a key block's outlier, set aside).
template <typename T>
INLINE float entry(const GLOBAL T* x, long stride, int i, int at, float fill) {
  return i == at ? fill : (float)x[i * stride];
}

// The scale and bias a group over [lo, hi] is coded against at `bits` bits, and the 16-bit ones the store keeps. Rule
// 0: MLX's affine rule as its CPU backend's `mx.quantize` computes it (the group's larger-magnitude end made a code;
// codes against the float32 scale and bias); rule 1 (and every 1-bit group): min..max, codes against the kept ones.
template <typename T, int K16>
INLINE void group_rule(float lo, float hi, int bits, int rule, THREAD float& scale, THREAD float& bias,
                       THREAD float& kept_scale, THREAD float& kept_bias) {
  const float levels = (float)((1 << bits) - 1);
  if (rule == 0 && bits > 1) {
    float s = FMAX((hi - lo) / levels, 1e-7f);
    const bool side = ABS1(lo) > ABS1(hi);
    s = side ? s : -s;
    const float edge = side ? lo : hi;
    const float q0 = RINT(edge / s);
    scale = q0 == 0.0f ? s : edge / q0;
    bias = q0 == 0.0f ? 0.0f : edge;
    kept_scale = keep16<T, K16>(scale);
    kept_bias = keep16<T, K16>(bias);
  } else {
    kept_scale = keep16<T, K16>((hi - lo) / levels);
    kept_bias = keep16<T, K16>(lo);
    scale = kept_scale > 0.0f ? kept_scale : 1.0f;
    bias = kept_bias;
  }
}

INLINE U32 group_code(float x, float scale, float bias, int bits) {
  return (U32)MIN2(MAX2(RINT((x - bias) / scale), 0.0f), (float)((1 << bits) - 1));
}

// The clip search (`kivi.clipped_quantize`, rule 3): of the candidate ranges, the group itself, then [mid - r half,
// mid + r half] for r in CLIP_RATIOS and at 1 bit the two means, the first of least squared error against the entries
// (each candidate's entries clipped and kept in 16 bits, coded by rule 0, decoded with the kept scale and bias).
// Returns its bounds (`clipped` false: the group itself) and narrows [lo, hi] to them.
template <typename T, int K16>
INLINE void clip_search(const GLOBAL T* x, long stride, int n, int at, float fill, THREAD float& lo, THREAD float& hi,
                        int bits, THREAD bool& clipped, THREAD float& bottom, THREAD float& top) {
  const float mid = (lo + hi) / 2.0f;
  const float half_range = (hi - lo) / 2.0f;  // not `half`: a type name in MSL
  const int candidates = NCLIP + (bits == 1 ? 1 : 0);
  float best = 0.0f;
  clipped = false;
  for (int k = 0; k < candidates; ++k) {
    float b = lo, t = hi;
    if (k == NCLIP) {                  // 1 bit: the two means, by Lloyd's iteration from min and max
      for (int step = 0; step < TWO_MEANS; ++step) {
        const float cut = (b + t) / 2.0f;
        float upper = 0.0f, lower = 0.0f;
        int n_upper = 0;
        for (int i = 0; i < n; ++i) {
          const float v = entry(x, stride, i, at, fill);
          if (v >= cut) { upper += v; ++n_upper; } else { lower += v; }
        }
        t = n_upper > 0 ? upper / (float)n_upper : t;
        b = n_upper < n ? lower / (float)(n - n_upper) : b;
      }
    } else if (k > 0) {
      b = mid - CLIP_RATIO(k) * half_range;
      t = mid + CLIP_RATIO(k) * half_range;
    }
    const float c_lo = k == 0 ? lo : clamp16<T, K16>(lo, b, t);
    const float c_hi = k == 0 ? hi : clamp16<T, K16>(hi, b, t);
    float scale, bias, kept_scale, kept_bias;
    group_rule<T, K16>(c_lo, c_hi, bits, 0, scale, bias, kept_scale, kept_bias);
    float error = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float v = entry(x, stride, i, at, fill);
      const float c = k == 0 ? v : clamp16<T, K16>(v, b, t);
      const float decoded = (float)group_code(c, scale, bias, bits) * kept_scale + kept_bias;
      error += (decoded - v) * (decoded - v);
    }
    if (k == 0 || error < best) {
      best = error;
      clipped = k > 0;
      bottom = b;
      top = t;
    }
  }
  if (clipped) {
    lo = clamp16<T, K16>(lo, bottom, top);
    hi = clamp16<T, K16>(hi, bottom, top);
  }
}
"""

_BODY = """
  // Template: D, GK (key block), NCL (key width classes: 1 without widths), ORD (key rows in a stored order), KQ, VQ
  // (the rules: 0 MLX's affine, 1 min..max, 2 symmetric, 3 the clip search), G (value group), VB (value bits), TD (the
  // 16-bit type of scales and biases) and TDK (which one), TR (float16: the outliers' residuals). Defines: KO
  // (outliers), VSYM (values without biases), NCLIP, CLIP_RATIO(k), TWO_MEANS (the clip search's candidates).
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
    float hi = KO && take_top ? top2 : top;
    float lo = KO && !take_top ? low2 : low;
    bool clipped = false;
    float bottom = lo, ceiling = hi;
    if (KQ == 3) clip_search<TD, TDK>(x, D, GK, at, fill, lo, hi, w, clipped, bottom, ceiling);
    float scale, bias, kept_scale, kept_bias;
    group_rule<TD, TDK>(lo, hi, w, KQ == 1 ? 1 : 0, scale, bias, kept_scale, kept_bias);
    const long words = (long)GK * w / 32;
    GLOBAL U32* dst = PICK_CLASS(cl, kc) + row * (nb * words) + b * words;
    int pos = 0;
    U32 acc = 0u;
    U32 outlier_code = 0u;
    for (int t = 0; t < GK; ++t) {
      const float v = entry(x, (long)D, t, at, fill);
      const U32 code = group_code(clipped ? clamp16<TD, TDK>(v, bottom, ceiling) : v, scale, bias, w);
      if (t == at) outlier_code = code;
      PACK_CODE(dst, code, w, pos, acc);
    }
    // The scales, biases and outliers of every class share one array each, rows in the storage order.
    const long g = (bh * D + s) * nb + b;
    ks[g] = static_cast<TD>(kept_scale);
    kb[g] = static_cast<TD>(kept_bias);
#if KO
    // The residual against the entry as decoded with the kept scale and bias in float32 (the reference's decode).
    const float decoded = (float)outlier_code * kept_scale + kept_bias;
    kr[g] = static_cast<TR>((take_top ? top : low) - decoded);
    ki[g] = (uint8_t)at;
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
      lo = MIN2(lo, v);
      hi = MAX2(hi, v);
    }
    const float half_levels = (float)((1 << VB) - 1) / 2.0f;
    bool clipped = false;
    float bottom = lo, ceiling = hi;
    if (VQ == 3) clip_search<TD, TDK>(x, 1, G, -1, 0.0f, lo, hi, VB, clipped, bottom, ceiling);
    float scale, bias, kept_scale, kept_bias;
    if (VQ == 2) {                      // symmetric: x = s (code - h), s = max|x| / h
      kept_scale = keep16<TD, TDK>(MAX2(ABS1(lo), ABS1(hi)) / half_levels);
      kept_bias = 0.0f;
      scale = kept_scale > 0.0f ? kept_scale : 1.0f;
      bias = 0.0f;
    } else {
      group_rule<TD, TDK>(lo, hi, VB, VQ == 1 ? 1 : 0, scale, bias, kept_scale, kept_bias);
    }
    constexpr int words = G * VB / 32;
    GLOBAL U32* dst = vc + token * (D * VB / 32) + g * words;
    int pos = 0;
    U32 acc = 0u;
    for (int c = 0; c < G; ++c) {
      const float v = clipped ? clamp16<TD, TDK>((float)x[c], bottom, ceiling) : (float)x[c];
      const U32 code = VQ == 2 ? (U32)MIN2(MAX2(RINT(v / scale + half_levels), 0.0f), 2.0f * half_levels)
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
    if "clipped" in (key_quantizer, value_quantizer) and backend not in CLIP_SEARCH_BACKENDS:
        return False
    return (backend in KIVI_ENCODE_BACKENDS and not grids and key_quantizer in KEY_QUANTIZERS
            and value_quantizer in VALUE_QUANTIZERS and 1 <= len(widths) <= MAX_CLASSES
            and all(1 <= w <= 8 for w in widths) and key_block % 32 == 0 and key_block <= 256
            and group_size % 32 == 0 and head_dim % group_size == 0)


@functools.cache
def encode_source(classes: int, outliers: bool, symmetric_values: bool,
                  clip: tuple[tuple[float, ...], int] = ((1.0,), 0)) -> KernelSource:
    """The encode kernel for `classes` key width classes (the codes of each, then the scales, biases and outliers of
    all), with or without outliers and value biases; `clip`: the clip search's ratios (the first 1.0, the group itself)
    and its two means' Lloyd steps (kivi.CLIP_RATIOS, kivi.TWO_MEANS_STEPS)."""
    key_outputs = (*(f"kc{c}" for c in range(classes)), "ks", "kb", *(("kr", "ki") if outliers else ()))
    value_outputs = ("vc", "vs") if symmetric_values else ("vc", "vs", "vb")
    pick = f"name##{classes - 1}"  # PICK_CLASS(c, kc): class c's output kc<c>
    for c in reversed(range(classes - 1)):
        pick = f"((c) == {c} ? name##{c} : {pick})"
    ratios, steps = clip
    ratio = "0.0f"
    for k in reversed(range(1, len(ratios))):
        ratio = f"((k) == {k} ? {float(ratios[k])!r}f : {ratio})"
    clip_defines = f"#define NCLIP {len(ratios)}\n#define CLIP_RATIO(k) {ratio}\n#define TWO_MEANS {int(steps)}\n"
    return KernelSource(
        name=f"velox_kivi_encode_{classes}{'_o' if outliers else ''}{'_s' if symmetric_values else ''}",
        input_names=("keys", "values", "kord", "kends", "kwid"),
        output_names=(*key_outputs, *value_outputs),
        body=_BODY,
        header=clip_defines + _HEADER,
        defines=f"#define PICK_CLASS(c, name) {pick}\n#define KO {int(outliers)}\n#define VSYM {int(symmetric_values)}\n",
    )


@functools.cache
def _int_array(values: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A small constant input (the classes' ends and widths, a placeholder order), made once per process: not an
    upload per layer and chunk."""
    return mx.array(values, dtype=dtype)


def kivi_encode(keys: mx.array, values: mx.array, widths: tuple[tuple[int, int, int], ...] | None,
                key_order: mx.array | None, key_bits: int, key_block: int, key_quantizer: str, outliers: bool,
                group_size: int, value_bits: int, value_quantizer: str, backend: str,
                clip: tuple[tuple[float, ...], int] = ((1.0,), 0)) -> dict[str, mx.array]:
    """The store entries of new keys and values [B, n_kv, T, D] (T a multiple of `key_block`) as
    `kivi.quantize_key_blocks` and `kivi.quantize_value_groups` give them: keys per channel over blocks of
    `key_block` tokens (with `widths`, each width's (width, first row, end row) in the storage order `key_order`
    [n_kv, D], each width's codes named for it, the scales, biases and outliers of all widths one entry each, rows in
    the storage order), values per token in groups of `group_size` channels; `clip`: the clip
    search's ratios and two-means steps, for the quantizer "clipped"."""
    batch, n_kv, tokens, head_dim = keys.shape
    if tokens % key_block:
        raise ValueError(f"KIVI encodes whole key blocks: {tokens} tokens are not a multiple of {key_block}.")
    classes = widths or ((key_bits, 0, head_dim),)
    symmetric = value_quantizer == "symmetric"
    source = encode_source(len(classes), outliers, symmetric, clip)
    blocks = tokens // key_block
    key_jobs = batch * n_kv * blocks * head_dim
    value_jobs = batch * n_kv * tokens * (head_dim // group_size)
    ends = [end for _, _, end in classes] + [head_dim] * (MAX_CLASSES - len(classes))
    width_of = [width for width, _, _ in classes] + [0] * (MAX_CLASSES - len(classes))
    order = key_order if widths else _int_array((0,), mx.uint8)
    shapes = [(batch, n_kv, end - start, tokens * width // 32) for width, start, end in classes]
    dtypes = [mx.uint32] * len(classes)
    shapes += [(batch, n_kv, head_dim, blocks)] * 2
    dtypes += [keys.dtype, keys.dtype]
    if outliers:
        shapes += [(batch, n_kv, head_dim, blocks)] * 2
        dtypes += [mx.float16, mx.uint8]
    value_groups = (batch, n_kv, tokens, head_dim // group_size)
    shapes += [(batch, n_kv, tokens, head_dim * value_bits // 32), value_groups]
    dtypes += [mx.uint32, keys.dtype]
    if not symmetric:
        shapes.append(value_groups)
        dtypes.append(keys.dtype)
    outputs = kernel(source, backend)(
        inputs=[keys, values, order, _int_array(tuple(ends), mx.int32), _int_array(tuple(width_of), mx.int32)],
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
    key_names = [f"key_codes_w{width}" if widths else "key_codes" for width, _, _ in classes]
    key_names += ["key_scales", "key_biases"] + (["key_outlier_residuals", "key_outlier_index"] if outliers else [])
    # the reference's order (values, then keys): a store's arrays keep the order of its first chunk
    return dict(zip(value_names + key_names, outputs[len(key_names):] + outputs[:len(key_names)], strict=True))
