"""Fused single-token decode attention over a segmented compressed cache (split-K flash-decoding).

One launch reads every cached token of every kv head once and writes, per block of tokens (a "split"), the
running max, the softmax denominator and the unnormalised output of each query row; a second, tiny launch
merges the splits. The tokens are the cache's three segments in position order,

    [ sink tokens (16-bit) | compressed history | recent window (16-bit) ]

so the 16-bit tokens fall into the same online softmax as the compressed ones (no concatenation, no
second softmax, nothing 16-bit materialised for the history).

Layout of the work. A threadgroup handles one (batch, kv head) and one split of tokens. Its threads form
subgroups of D/8 lanes; a subgroup takes one token at a time and each lane owns 8 consecutive channels of
it: the lane decodes its 8 key channels (from whatever the method stores: affine codes + scale + bias,
KIVI's per-channel codes, centroid indices × norm, ...), multiplies them with the R query rows of that kv
head (GQA: the R = n_heads / n_kv_heads query heads share each decoded key, so each compressed byte is
read once per kv head, not once per query head), sums over the subgroup with lane shuffles, updates the
online softmax of each row and accumulates its 8 value channels. At the end the subgroups of the
threadgroup are merged through shared memory.

The attention body is one text for every method and both backends. What differs per method is only how
8 channels of one compressed token are read: a "codec" (`Codec`), which becomes two macros, LOAD_KEY and
LOAD_VALUE, at the top of the source. Codebook methods attend in the rotated space: the caller rotates
the query once and rotates the output back once; the kernel looks up centroid × norm, with the norm
folded into the score (keys) or the softmax weight (values), one multiply per token instead of per channel.

The pure-MLX path (`SegmentedKVCache.attention` with kernels off) is the reference and the CPU path; the
parity tests compare the two.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from engine.kvcache.kernels.backend import RULER, KernelSource, kernel, over_buffer_limit
from engine.kvcache.quant.polar import level_table_offset

# Threads per threadgroup of the attention pass (head_dim if larger: the merge gives each of the first
# head_dim threads one output channel); a multiple of the subgroup width D/8.
THREADS = 128
# A split takes at least this many tokens (fewer and the merge pass costs more than it saves)...
MIN_SPLIT_TOKENS = 128
# ...and the grid aims at this many threadgroups (~8 per multiprocessor of a 132-SM H200; enough to
# keep memory busy on smaller GPUs too).
TARGET_GROUPS = 1024
# The tiled pass (below) aims at fewer, longer splits: on an H200 at 32,769 tokens (8B shape, 32 layers) its
# kernel time was 3.62 ms at 256 threadgroups against 4.34 ms at 1024 (benchmarks/results/decode-profile-h200.json).
TILED_TARGET_GROUPS = 256
# The tiled pass loads each tile during the previous tile's work (template PF; see `_TILED_BODY`).
TILED_PREFETCH = True
# The tiled pass's largest tile (tokens staged per round of its three phases; fewer rounds, fewer barriers).
TILED_MAX_TILE = 64
# ...and its smallest, where a smaller tile would fit the threadgroup memory (below: the per-subgroup pass).
TILED_MIN_TILE = 32
# Tokens per thread in the tiled pass's phase 1 (template TT; at most 4, so 8-bit codes of a run fit two words).
TILED_RUN = 4
# Threadgroup memory the tiled pass may declare: Apple GPUs give a threadgroup 32 KB (CUDA's static limit is 48 KB).
TILED_SHARED_LIMIT = 32 * 1024
# Longer tiles for long caches, by backend: (tile, the threadgroup memory it may declare, from how many compressed slots
# of the cache). 128-token tiles halve the tile loop's rounds (barriers, softmax updates, staging set-up) but need
# 39-42 KB at the levels' key widths, past an Apple GPU's 32 KB and within CUDA's 48 KB of static shared memory; below
# ~24k tokens they leave too few tiles a split to hide each tile's loads. GPU time of the 32 layers' pass on an H200,
# 64- -> 128-token tiles (benchmarks/results/gpu-timeline-tile128-*-h200.json), the 4-bit level: 0.85 -> 0.99 ms at
# 8k, 1.34 -> 1.40 at 16k, 1.84 -> 1.79 at 24k, 2.32 -> 2.19 at 32k, 8.04 -> 6.75 at 131k; the 3-bit level 1.02 ->
# 1.14, 1.68 -> 1.75, 2.33 -> 2.32, 2.98 -> 2.89, 10.84 -> 9.74. (The 2-bit level's narrower codes fit 128 anywhere.)
TILED_LONG_TILES: dict[str, tuple[int, int, int]] = {"cuda": (128, 48 * 1024, 24 * 1024)}
MAX_SPLITS = 256
# Key widths (KIVI's key_widths): at most this many classes of key channels, each at its own width (template KCLS).
MAX_WIDTH_CLASSES = 4
# Tokens each subgroup has in flight per iteration (template U).
UNROLL = 2
# Whether a plan's constant launch arguments (D, R, NT, G, ..., ~20 for the tiled pass) are compiled into its attention
# kernel's source, one kernel object per plan, so that a step's call passes only the 3 that vary (CS, NS, TD).
# MLX's CUDA front end formats every template argument into the kernel's source text on every call. With them in the
# source, decode_attention's own host time (profiled) fell 1.30 -> 0.94 and 1.19 -> 0.93 ms a step (32 layers, the 4-
# and 2-bit levels; host-profile-plan-constants-h200.json) and their step took 2-5 % less at 8k and 32k, 4 of 4 pairs
# (decode-plan-constants-h200.json); the same kernels either way (the arguments become the same `constexpr int`
# lines; kernel-parity-plan-constants-h200.log).
PLAN_CONSTANTS_IN_SOURCE = True
# Backends where the per-subgroup pass stages the codebook codecs' centroid tables in threadgroup memory (define
# STAGE_TABLES): turboquant's, rvq's and turboquant_prod's token loop ~5-9 % fewer instructions (sm_90a offline,
# kernel-resources-r22.json). Parity passed on the H200 (kernel-parity-staged-tables-h200.log), but the timing did not
# pay: the kernel alone slower at 8k (turboquant 1.92 -> 2.53 ms, rvq 2.27 -> 2.93 for 32 layers), 4-7 % faster at 32k
# (decode-profile-staged-tables-h200.json), the step within the rounds' spread (decode-staged-tables-h200.json). Off.
STAGED_TABLE_BACKENDS: tuple[str, ...] = ("emulate",)

# How 8 consecutive channels [lane*8, lane*8 + 8) of compressed token `c` are read into float `out[8]`,
# with `mul` the per-token factor (a norm) that multiplies the score or the softmax weight. `P` is the
# input prefix (k or v) and `BITS`/`BITS2` the code widths; `bh` and `lane` are the body's variables.
_CODEC_MACROS = {
    # Per-token groups of G channels (MLX affine quantization): codes [B,H,cap,D·bits/32], scales and
    # biases [B,H,cap,D/G]. x = scale·code + bias; a symmetric codec (SYM: KIVI's symmetric_values) holds no biases
    # (the third array is a placeholder) and takes -h·s, h = (2^bits - 1)/2.
    "affine": """
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const long row_ = (long)bh * {P}0_shape[2] + (c); \\
  U32 c_[8]; \\
  unpack8u({P}0 + row_ * {P}0_shape[3], lane * 8, {BITS}, c_); \\
  const long g_ = row_ * {P}1_shape[3] + (lane * 8) / G; \\
  const float s_ = (float){P}1[g_]; \\
  const float b_ = {SYM} ? -0.5f * (float)((1u << {BITS}) - 1u) * s_ : (float){P}2[g_]; \\
  for (int i_ = 0; i_ < 8; ++i_) out[i_] = s_ * U2F(c_[i_]) + b_; \\
  mul = 1.0f; }}
""",
    # KIVI keys: per channel, over blocks of GK tokens (the key block; G by default), stored transposed:
    # codes [B,H,D,cap·bits/32], scales and biases [B,H,D,cap/GK]. Read channel-major straight from device memory, each lane's 8 channels
    # are 8 rows and 24 scattered loads a token, so they are staged instead (STAGE_KEYS, once per tile of CT
    # tokens, CT <= GK so one scale per channel): the tile's codes, token-major as bytes in shared memory
    # (coalesced: a warp reads whole 32-byte row segments), and q·s per channel and Σ q·b per row (the
    # keys' scales and biases folded into the query: q·x = Σ (q·s)·code + Σ q·b). LOAD_KEY then reads a
    # token's 8 codes as two shared words.
    "kivi_keys": """
#define KEY_STAGED 1
#define QSLOTS 2
#define KC_WORDS (CT * D / 4)
#define STAGE_KEYS(tile_c) {{ \\
  const int g_ = (tile_c) / GK; \\
  for (int i_ = TID; i_ < R * D; i_ += NT) \\
    sh_q[R * D + i_] = sh_q[i_] * (float){P}1[((long)bh * D + i_ % D) * {P}1_shape[3] + g_]; \\
  for (int r_ = TID / 32; r_ < R; r_ += NT / 32) {{ \\
    float acc_ = 0.0f; \\
    for (int d_ = TID % 32; d_ < D; d_ += 32) \\
      acc_ += sh_q[r_ * D + d_] * (float){P}2[((long)bh * D + d_) * {P}2_shape[3] + g_]; \\
    for (int st_ = 16; st_ > 0; st_ >>= 1) acc_ += LANE_XOR(acc_, st_); \\
    if (TID % 32 == 0) sh_q[2 * R * D + r_] = acc_; }} \\
  _Pragma("unroll 1") \\
  for (int i_ = TID; i_ < (D / 4) * (CT / 8); i_ += NT) {{ \\
    const int o_ = i_ % (CT / 8); \\
    const int d4_ = i_ / (CT / 8); \\
    U64 x_[4]; \\
    for (int j_ = 0; j_ < 4; ++j_) \\
      x_[j_] = bits8({P}0 + ((long)bh * D + d4_ * 4 + j_) * {P}0_shape[3], (tile_c) + 8 * o_, {BITS}); \\
    for (int t_ = 0; t_ < 8; ++t_) {{ \\
      U32 w_ = 0u; \\
      for (int j_ = 0; j_ < 4; ++j_) w_ |= (((U32)(x_[j_] >> (t_ * {BITS}))) & ((1u << {BITS}) - 1u)) << (8 * j_); \\
      sh_kc[(8 * o_ + t_) * (D / 4) + d4_] = w_; }} }} }}
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const int at_ = (((c) - c_begin) % CT) * (D / 4) + lane * 2; \\
  const U32 a_ = sh_kc[at_]; \\
  const U32 b_ = sh_kc[at_ + 1]; \\
  for (int i_ = 0; i_ < 4; ++i_) {{ \\
    out[i_] = U2F((a_ >> (8 * i_)) & 255u); \\
    out[4 + i_] = U2F((b_ >> (8 * i_)) & 255u); }} \\
  mul = 1.0f; }}
""",
    # TurboQuant: codes [B,H,cap,D·bits/32] of a rotated unit vector, norms [B,H,cap,1], centroids [>=8].
    "codebook": """
#define {P}T1 {P}2
#define {P}T1_N (1 << {BITS})
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const long row_ = (long)bh * {P}0_shape[2] + (c); \\
  U32 c_[8]; \\
  unpack8u({P}0 + row_ * {P}0_shape[3], lane * 8, {BITS}, c_); \\
  for (int i_ = 0; i_ < 8; ++i_) out[i_] = {P}T1[c_[i_]]; \\
  mul = (float){P}1[row_]; }}
""",
    # RVQ: first-stage codes, norms, first table, residual codes, residual scales [B,H,cap,1], second table:
    # x = norm · (c1[code1] + s · c2[code2]).
    "rvq": """
#define {P}T1 {P}2
#define {P}T1_N (1 << {BITS})
#define {P}T2 {P}5
#define {P}T2_N (1 << {BITS2})
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const long row_ = (long)bh * {P}0_shape[2] + (c); \\
  U32 c_[8]; \\
  U32 r_[8]; \\
  unpack8u({P}0 + row_ * {P}0_shape[3], lane * 8, {BITS}, c_); \\
  unpack8u({P}3 + row_ * {P}3_shape[3], lane * 8, {BITS2}, r_); \\
  const float rs_ = (float){P}4[row_]; \\
  for (int i_ = 0; i_ < 8; ++i_) out[i_] = {P}T1[c_[i_]] + rs_ * {P}T2[r_[i_]]; \\
  mul = (float){P}1[row_]; }}
""",
    # Keys with a 1-bit sign sketch (QJL's estimator): the score adds a second product, of the sketched query
    # row (sh_q2: sqrt(π/2)/m · S q, scaled, staged once) with the key's ±1 signs, times a per-token factor. A
    # lane's sketch coordinates are [lane·8·SK, (lane + 1)·8·SK), its 8·SK sign bits SK bytes of the packed row
    # (bit 1 = +1), kept as bytes (ksg) until the scores; kmul2 is the factor (0 for 16-bit tokens). Key role only.
    # KEY_SIGN_WORD(c, w) is word w of token c's packed signs (the history decode reads them all: kernels/dequantize.py).
    # turboquant_prod: (b-1)-bit codes of the rotated unit vector, norms, centroids, the residual's norms and the
    # d signs of its sketch: x·q = norm · (q·c[code] + ‖r‖ · (S q)·sign · sqrt(π/2)/d).
    "prod": """
#define KEY_SKETCH 1
#define SK 1
#define KEY_SIGN_WORD(c, w) {P}4[((long)bh * {P}4_shape[2] + (c)) * {P}4_shape[3] + (w)]
#define {P}T1 {P}2
#define {P}T1_N (1 << {BITS})
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const long row_ = (long)bh * {P}0_shape[2] + (c); \\
  U32 c_[8]; \\
  unpack8u({P}0 + row_ * {P}0_shape[3], lane * 8, {BITS}, c_); \\
  for (int i_ = 0; i_ < 8; ++i_) out[i_] = {P}T1[c_[i_]]; \\
  ksg[u][0] = ({P}4[row_ * {P}4_shape[3] + (lane * 8) / 32] >> ((lane * 8) % 32)) & 255u; \\
  kmul2[u] = (float){P}3[row_]; \\
  mul = (float){P}1[row_]; }}
""",
    # QJL: the m = SK·D signs of S k (SK = the key bits: sketch rows per channel) and the norm; no first-stage
    # codes (out is 0): x·q = norm · (S q)·sign · sqrt(π/2)/m.
    "qjl": """
#define KEY_SKETCH 1
#define SK {BITS}
#define KEY_SIGN_WORD(c, w) {P}0[((long)bh * {P}0_shape[2] + (c)) * {P}0_shape[3] + (w)]
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const long row_ = (long)bh * {P}0_shape[2] + (c); \\
  for (int i_ = 0; i_ < 8; ++i_) out[i_] = 0.0f; \\
  for (int j_ = 0; j_ < SK; ++j_) {{ \\
    const int b_ = (lane * SK + j_) * 8; \\
    ksg[u][j_] = ({P}0[row_ * {P}0_shape[3] + b_ / 32] >> (b_ % 32)) & 255u; }} \\
  kmul2[u] = 1.0f; \\
  mul = (float){P}1[row_]; }}
""",
    # Product VQ: codes of BITS2-channel sub-vectors (BITS each: index bits), norms [B,H,cap,1], the role's
    # centroids [K, BITS2] (16-bit): a lane's 8 channels are 8 / BITS2 whole sub-vectors.
    "vq": """
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const long row_ = (long)bh * {P}0_shape[2] + (c); \\
  const GLOBAL U32* r_ = {P}0 + row_ * {P}0_shape[3]; \\
  for (int j_ = 0; j_ < 8 / {BITS2}; ++j_) {{ \\
    const U32 code_ = code_at(r_, (lane * 8) / {BITS2} + j_, {BITS}); \\
    for (int i_ = 0; i_ < {BITS2}; ++i_) out[j_ * {BITS2} + i_] = (float){P}2[code_ * {BITS2} + i_]; }} \\
  mul = (float){P}1[row_]; }}
""",
    # PolarQuant: level-1 angle codes (BITS), norms, the higher levels' angle codes (BITS2; levels 2..L in turn, then
    # one padding code), and the centroid tables of levels 1..L in one array. Its text depends on L (`_polar_macro`).
    "polar": "",
}
_CODEC_SLOTS = {"affine": 3, "kivi_keys": 3, "codebook": 3, "rvq": 6, "prod": 5, "qjl": 2, "vq": 3}
# Key codecs with a sign sketch (a second, sketched query: `attend_source` adds the input qry2).
SKETCH_KINDS = ("prod", "qjl")

_HEADER = """
// Codes [first, first + 8) of a row packed as a little-endian bit stream of `bits`-bit codes (MLX's affine
// packing, also Velox's pack_bits): at most two 32-bit words, since first·bits is a multiple of 8 and
// 8·bits <= 64 for every width but 7. 32-bit shifts where the 8 codes sit in one word (4 bits and less,
// lane-aligned): 64-bit shifts and conversions cost several instructions each. `first` is a multiple of 8 at every
// call (a lane's 8 channels), so at 1, 2 and 4 bits the 8 codes never straddle a word: known at compile time for a
// literal width, which drops the 64-bit branch from the code.
INLINE void unpack8u(const GLOBAL U32* row, int first, int bits, THREAD U32* out) {
  const int bit = first * bits;
  const int w = bit >> 5;
  const int sh = bit & 31;
  const U32 mask = (1u << bits) - 1u;
  if (32 % (8 * bits) == 0 || sh + 8 * bits <= 32) {
    const U32 x = row[w] >> sh;
    for (int i = 0; i < 8; ++i) out[i] = (x >> (i * bits)) & mask;
  } else {
    const U64 x = (((U64)row[w]) | (((U64)row[w + 1]) << 32)) >> sh;
    for (int i = 0; i < 8; ++i) out[i] = ((U32)(x >> (i * bits))) & mask;
  }
}

// Code `i` (`bits` wide) of the bit stream `x` as the float 1 + code / 2^bits: the code moved into the top `bits`
// bits of 1.0's mantissa, exactly, in a shift and one logic op (with constant i and bits; an integer-to-float
// conversion, or U2F's add, costs more). The caller refolds its scale and bias for it. `one` is 1.0's bits read
// from memory: with the literal the compiler spends two logic ops (a mask and an or: a logic op takes one
// immediate), with a register one.
INLINE float unit_code(U32 x, int i, int bits, U32 one) {
  const int up = 23 - bits;
  const U32 placed = (i * bits >= up) ? (x >> (i * bits - up)) : (x << (up - i * bits));
  return AS_F32(one | (placed & (((1u << bits) - 1u) << up)));
}

// Code `i` of a row packed as a little-endian bit stream of `bits`-bit codes (1-8 bits; it may straddle two words).
INLINE U32 code_at(const GLOBAL U32* row, int i, int bits) {
  const int bit = i * bits;
  const int w = bit >> 5;
  const int sh = bit & 31;
  U64 x = (U64)row[w];
  if (sh + bits > 32) x |= ((U64)row[w + 1]) << 32;
  return ((U32)(x >> sh)) & ((1u << bits) - 1u);
}

// The 8·bits bits of codes [first, first + 8), shifted down to bit 0 (bits of later codes above them).
INLINE U64 bits8(const GLOBAL U32* row, int first, int bits) {
  const int bit = first * bits;
  const int w = bit >> 5;
  const int sh = bit & 31;
  U64 x = (U64)row[w];
  if (sh + 8 * bits > 32) x |= ((U64)row[w + 1]) << 32;
  return x >> sh;
}

// The sine and cosine of a pair's angle at `position`, as MLX's RoPE computes the angle (float32 position x
// frequency), reduced to [-pi, pi] by whole turns (2 pi in two parts, fused: ~1e-7 rad up to 10^5 turns) so the fast
// sine and cosine serve: a full-range sincosf costs ~40 instructions a pair and a slow path past 10^5 rad.
#define TURN_AT(position, freq, sn, cs) { \
    const float angle_ = (position) * (freq); \
    const float turns_ = RINT(angle_ * 0.159154943091895f); \
    SINCOS_PI(FMA(-turns_, -1.7484555314695172e-07f, FMA(-turns_, 6.2831854820251465f, angle_)), sn, cs); }

// Key widths (KCLS > 0; KIVI's key_widths), for the kernels that read them (the tiled pass, the history decode): each
// class's end row in storage order, e0..e3 (a class the layout has not ends at D); one of four values by a class c
// (only the chosen one is evaluated); the class of storage row d.
#define WIDTH_CLASS_ENDS \
  const int e0 = KCLS > 0 ? (int)kends[0] : D; \
  const int e1 = KCLS > 1 ? (int)kends[1] : D; \
  const int e2 = KCLS > 2 ? (int)kends[2] : D; \
  const int e3 = KCLS > 3 ? (int)kends[3] : D;
#define PICK4(c, a0, a1, a2, a3) ((c) == 0 ? (a0) : (c) == 1 ? (a1) : (c) == 2 ? (a2) : (a3))
#define CLASS_OF(d) (((d) >= e0) + ((d) >= e1) + ((d) >= e2))
"""

# The attention pass. Template ints: D (head_dim), R (query rows per kv head), NT (threads), G (group),
# GK (KIVI's key block), CT (tokens per tile of the compressed range), CS (leading compressed tokens not
# attended: KIVI's copies of the sink tokens, whose 16-bit originals are the sinks), NS (sink tokens),
# U (tokens per subgroup in flight). The window's length comes as a count (n_win_r, a `Ruler` slice), not a template
# argument: a step that empties the window (a key block's encode) would otherwise launch a kernel of its own.
_ATTEND_BODY = """
#ifndef KEY_SKETCH
#define KEY_SKETCH 0
#endif
  constexpr int TPT = D / 8;          // lanes per token
  constexpr int NSG = NT / TPT;       // subgroups: tokens in flight per threadgroup and unrolled step
  constexpr int ITER = U * NSG;       // tokens per iteration of the threadgroup
  const int lane = TID % TPT;
  const int sg = TID / TPT;
  const int bh = GROUP_Y;
  const int n_comp = n_comp_r_shape[0] - 1;
  const int n_win = n_win_r_shape[0] - 1;
  // This split's share: whole tiles of CT compressed tokens (tile starts stay aligned, which the staged
  // KIVI keys need), and the last split also takes the 16-bit tokens (sinks, then the window).
  const int n_tiles = (n_comp + CT - 1) / CT;
  const int tiles_per_split = (n_tiles + GROUPS_X - 1) / GROUPS_X;
  const int c_begin = GROUP_X * tiles_per_split * CT;
  const int c_end = (c_begin + tiles_per_split * CT < n_comp) ? c_begin + tiles_per_split * CT : n_comp;
  const int c_span = (c_end > c_begin) ? ((c_end - c_begin + ITER - 1) / ITER) * ITER : 0;
  const int d_count = (GROUP_X == GROUPS_X - 1) ? NS + n_win : 0;
  const int v_end = c_span + d_count;

  // The R query rows of this kv head, scaled, in shared memory (read as broadcasts). Staged methods keep
  // a second, per-tile copy multiplied by their per-channel scales, and per row the bias term Σ q·b.
  SHARED float sh_q[QSLOTS * R * D + R];
  SHARED U32 sh_kc[KC_WORDS];
  const float scale = qscale[0];
  for (int i = TID; i < R * D; i += NT) sh_q[i] = scale * (float)qry[(long)bh * R * D + i];
  // The codebook codecs' centroid tables (kT1, kT2, vT1, vT2: 2^bits floats each) in threadgroup memory, where
  // every lane looks up 8 entries a token and role: a table of at most 32 entries is read without bank conflicts,
  // and a lookup is a 32-bit shared address instead of a 64-bit device one (the same values: the codec macros name
  // the device tables until these are staged; the history decode reads those). Where STAGED_TABLE_BACKENDS admits
  // the backend (STAGE_TABLES).
#ifndef STAGE_TABLES
#define STAGE_TABLES 0
#endif
#if defined(kT1_N) && STAGE_TABLES
  SHARED float sh_kt1[kT1_N];
  for (int i = TID; i < kT1_N; i += NT) sh_kt1[i] = kT1[i];
#undef kT1
#define kT1 sh_kt1
#endif
#if defined(kT2_N) && STAGE_TABLES
  SHARED float sh_kt2[kT2_N];
  for (int i = TID; i < kT2_N; i += NT) sh_kt2[i] = kT2[i];
#undef kT2
#define kT2 sh_kt2
#endif
#if defined(vT1_N) && STAGE_TABLES
  SHARED float sh_vt1[vT1_N];
  for (int i = TID; i < vT1_N; i += NT) sh_vt1[i] = vT1[i];
#undef vT1
#define vT1 sh_vt1
#endif
#if defined(vT2_N) && STAGE_TABLES
  SHARED float sh_vt2[vT2_N];
  for (int i = TID; i < vT2_N; i += NT) sh_vt2[i] = vT2[i];
#undef vT2
#define vT2 sh_vt2
#endif
#if KEY_SKETCH
  // The sketched query rows (SK·D coordinates each), scaled alike, laid out [a lane's coordinate k < SK·8][lane][row]:
  // a token's lanes read adjacent words and a coordinate's R rows are adjacent (one 16-byte read at R = 4). Laid out
  // row by row, a token's lanes were SK·8 words apart and met in the same memory banks on every read (qjl at 4
  // bits: 16 lanes 128 bytes apart, its 32 16-byte reads a token 8-way conflicts).
  SHARED float sh_q2[R * SK * D];
  for (int i = TID; i < R * SK * D; i += NT) {
    const int r2 = i / (SK * D);
    const int c2 = i % (SK * D);
    sh_q2[((c2 % (SK * 8)) * TPT + c2 / (SK * 8)) * R + r2] = scale * (float)qry2[(long)bh * R * SK * D + i];
  }
  BARRIER();
  float q2_sum[R];
  for (int r = 0; r < R; ++r) {
    q2_sum[r] = 0.0f;
    for (int k = 0; k < SK * 8; ++k) q2_sum[r] += sh_q2[(k * TPT + lane) * R + r];
  }
#endif
  float m_run[R];
  float l_run[R];
  float o_acc[R][8];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 8; ++i) o_acc[r][i] = 0.0f;
    m_run[r] = -1e30f;   // finite: exp(m_run - m_new) must be 0, not NaN, on the first token
    l_run[r] = 0.0f;
  }
  BARRIER();

  // Each subgroup takes U tokens per iteration and issues all their loads before any arithmetic, so more
  // bytes are in flight per thread. Every thread runs the same iterations (the bounds are per
  // threadgroup), so barriers and lane shuffles are reached by whole threadgroups and warps.
  for (int base = 0; base < v_end; base += ITER) {
    const bool comp = base < c_span;
#if KEY_STAGED
    if (comp && base % CT == 0) {
      BARRIER();
      STAGE_KEYS(c_begin + base);
      BARRIER();
    }
    const int qoff = comp ? R * D : 0;
#else
    const int qoff = 0;
#endif
    float kx[U][8];
    float vx[U][8];
    float kmul[U];
    float vmul[U];
    bool valid[U];
#if KEY_SKETCH
    U32 ksg[U][SK];   // a compressed key's sign bits, 8 per byte of the lane's sketch coordinates
    float kmul2[U];   // the sketch term's factor (0: a 16-bit token has none)
#endif
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * NSG + sg;
      kmul[u] = 1.0f;
      vmul[u] = 1.0f;
#if KEY_SKETCH
      kmul2[u] = 0.0f;
      for (int j = 0; j < SK; ++j) ksg[u][j] = 0u;
#endif
      if (comp) {
        const int c = c_begin + v;
        valid[u] = c < c_end && c >= CS;
        if (valid[u]) {
          LOAD_KEY(c, kx[u], kmul[u]);
          LOAD_VALUE(c, vx[u], vmul[u]);
        }
      } else {
        const int d = v - c_span;
        valid[u] = d < d_count;
        if (valid[u]) {
          const long off = (d < NS) ? ((long)bh * NS + d) * D : ((long)bh * n_win + (d - NS)) * D;
          const GLOBAL TD* kp = (d < NS) ? sink_k + off : win_k + off;
          const GLOBAL TD* vp = (d < NS) ? sink_v + off : win_v + off;
          for (int i = 0; i < 8; ++i) { kx[u][i] = (float)kp[lane * 8 + i]; vx[u][i] = (float)vp[lane * 8 + i]; }
        }
      }
      if (!valid[u]) {
        for (int i = 0; i < 8; ++i) { kx[u][i] = 0.0f; vx[u][i] = 0.0f; }
      }
    }
#if KEY_SKETCH
    // The sketch products of the U tokens and R rows, each query coordinate read once for all U tokens: Σ ±q2 as
    // 2·Σ_{sign bit set} q2 - Σ q2 (q2_sum, the lane's per row), one predicated add a bit and row instead of a
    // select and an add.
    float sk2[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < R; ++r) sk2[u][r] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < SK; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int at = ((j * 8 + i) * TPT + lane) * R;
        float q2[R];
#pragma unroll
        for (int r = 0; r < R; ++r) q2[r] = sh_q2[at + r];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if ((ksg[u][j] >> i) & 1u) {
#pragma unroll
            for (int r = 0; r < R; ++r) sk2[u][r] += q2[r];
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < R; ++r) sk2[u][r] = 2.0f * sk2[u][r] - q2_sum[r];
    }
#endif
    // Scores of the U tokens first, then one rescale of the running output per row for all of them (not
    // one per token) and one exp per token and row.
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s[U];
      float m_new = m_run[r];
      const float qb = (qoff != 0) ? sh_q[2 * R * D + r] : 0.0f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float part = 0.0f;
        for (int i = 0; i < 8; ++i) part += sh_q[qoff + r * D + lane * 8 + i] * kx[u][i];
#if KEY_SKETCH
        part += kmul2[u] * sk2[u][r];
#endif
        for (int step = TPT / 2; step > 0; step >>= 1) part += LANE_XOR(part, step);
        s[u] = valid[u] ? (part + qb) * kmul[u] : -1e30f;
        m_new = FMAX(m_new, s[u]);
      }
      // Rescale only when the running max grows (rarely, once past the first tokens): the same sums.
      if (m_new > m_run[r]) {
        const float corr = EXP(m_run[r] - m_new);
        l_run[r] *= corr;
        for (int i = 0; i < 8; ++i) o_acc[r][i] *= corr;
        m_run[r] = m_new;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = valid[u] ? EXP(s[u] - m_new) : 0.0f;
        l_run[r] += p;
        const float pv = p * vmul[u];
        for (int i = 0; i < 8; ++i) o_acc[r][i] += pv * vx[u][i];
      }
    }
  }

  // Merge the NSG subgroups of this threadgroup; one (max, denominator, output) per split leaves.
  SHARED float sh_m[NSG * R];
  SHARED float sh_l[NSG * R];
  SHARED float sh_o[NSG * D];
  if (lane == 0) {
    for (int r = 0; r < R; ++r) { sh_m[sg * R + r] = m_run[r]; sh_l[sg * R + r] = l_run[r]; }
  }
  BARRIER();
  const long split_row = ((long)bh * GROUPS_X + GROUP_X) * R;
  for (int r = 0; r < R; ++r) {
    float big = -1e30f;
    for (int s = 0; s < NSG; ++s) big = FMAX(big, sh_m[s * R + r]);
    const float mine = EXP(m_run[r] - big);
    for (int i = 0; i < 8; ++i) sh_o[sg * D + lane * 8 + i] = o_acc[r][i] * mine;
    BARRIER();
    if (TID < D) {
      float acc = 0.0f;
      for (int s = 0; s < NSG; ++s) acc += sh_o[s * D + TID];
      part_o[(split_row + r) * D + TID] = acc;
    }
    if (TID == 0) {
      float denominator = 0.0f;
      for (int s = 0; s < NSG; ++s) denominator += sh_l[s * R + r] * EXP(sh_m[s * R + r] - big);
      part_m[split_row + r] = big;
      part_l[split_row + r] = denominator;
    }
    BARRIER();
  }
"""

# The tiled attention pass for KIVI keys and affine values (the app's levels). Same grid, splits and outputs as
# the pass above, but a tile of CT tokens goes through three phases separated by barriers instead of each
# subgroup carrying a token through everything, so no lane shuffles run per token and each exp runs once:
#   1. scores: the tile's key codes are staged in shared memory (coalesced); each thread takes a run of TT = 4
#      tokens and a slice of the channels and meets their codes with the R query rows (the keys' per-channel
#      scales folded into the query once per tile, their biases into one term per row; keys before RoPE are
#      decoded and turned per token instead); the slices of a warp add up by shuffles;
#   2. softmax: one warp per row adds a token's parts, takes the tile's max and sums, updates the running max and
#      denominator and writes the tile's weights;
#   3. values: each thread owns 8 channels of every NSG-th token (its codes loaded at the start of the tile,
#      so their latency overlaps phases 1-2) and accumulates weight × code, with the value's scale folded
#      into the weight and its bias into one sum per row.
# No per-token key or value arrays in registers. Staging through registers (STAGE_LOAD/STAGE_STORE) with PF: 128
# registers under nvcc for sm_90a at 4 bits, no spills, 19.9 KB of threadgroup memory (`python
# benchmarks/kernel_resources.py --instructions` counts each phase's instructions:
# benchmarks/results/kernel-instructions.json). At TILED_TARGET_GROUPS threadgroups (~2 per multiprocessor of an
# H200) registers limit nothing: the grid sets the occupancy.
# Template ints as above plus KB, VB (key and value bits), PF (1: each tile loaded during the previous tile's
# phases), TT (phase 1's tokens per thread), KGRID/VGRID (codes on a grid), ROPE/TRAD (keys stored before RoPE), KO
# (1: each key block's outlier share added to its token's score, KIVI's key_outliers) and VSYM (1: values with a
# scale and no bias, each bias derived from its scale); CT divides GK and NT, NT/CT threads share a 16-bit token in
# phase 1, and NSG = NT / (D/8) token groups share the tile in phase 3.
_TILED_BODY = """
  constexpr int TPT = D / 8;           // phase 3: lanes per token (8 channels each)
  constexpr int NSG = NT / TPT;        // phase 3: token groups
  constexpr int TPG = CT / NSG;        // phase 3: tokens per thread per tile
  constexpr int HALVES = NT / CT;      // phase 1: threads per token
  constexpr int DH = D / HALVES;       // phase 1: channels per thread
  constexpr int KW = CT * KB / 32;     // staged key words per channel per tile
  constexpr int NW = NT / 32;          // warps
  constexpr int VWT = D * VB / 32;     // value code words per token
  constexpr int VG = D / G;            // value groups per token
  // Whether a key code can straddle two words (3, 5, 6 bits); where 32 is a multiple of KB it never does, and the
  // compiler cannot see that from t1 * KB alone (the check cost 6 of the 32 instructions per 2 channels in phase 1).
  constexpr bool KSPLIT = (32 % KB) != 0;
  // Phase 1 of compressed tiles: each thread takes a run of TT consecutive tokens and a slice of DC channels, so one
  // shared word holds several of its codes and one read of a channel's q·s (or, keys before RoPE, of a pair's
  // scales and query rows) serves TT tokens (one token and a word read per code before: ~11 instructions per
  // channel and token, ~6.5 now). A token's partial scores add up by shuffles within a warp, then in phase 2.
  // TT (template, TILED_RUN = 4) rather than 8: the same instructions per code within a few percent, half the
  // accumulators and half the partial scores in shared memory (Apple GPUs give a threadgroup 32 KB; see
  // tiled_shared_bytes). TT * KB <= 32: a run's codes lie in one word or two.
  constexpr int RUNS = CT / TT;        // phase 1: token runs per tile
  constexpr int SLICES = NT / RUNS;    // phase 1: channel slices (partial scores per token)
  constexpr int DC = D / SLICES;       // phase 1: channels per thread
  // Padded shared layouts, so the threads of a warp read and write distinct banks: a channel's row of key words
  // gets an odd stride; q·s gets a gap of 4 floats after every 8 channels (a warp's slices read their channels in
  // distinct 16-byte units); partial scores skip a word every 32 tokens (a warp's runs, a word every TT tokens,
  // then fall on distinct banks).
  constexpr int KWP = KW + ((KW % 2) ? 0 : 1);
  constexpr int CTP = CT + (CT + 31) / 32;
  constexpr int SS = R * CTP;
  // The slices in one warp (SPW) add their partial scores by shuffles before storing them: the parts in shared
  // memory are one per warp (NT·TT·R floats with one per slice: 16 KB at R = 8, past a 32 KB threadgroup).
  constexpr int RW = RUNS < 32 ? RUNS : 32;   // runs in one warp
  constexpr int SPW = 32 / RW;
  constexpr int NH = SLICES / SPW > HALVES ? SLICES / SPW : HALVES;
  // Keys read as 1 + code/2^KB in phase 1 (see there): the staged q·s is 2^KB·q·s and the staged bias
  // bias − 2^KB·scale, so Σ (2^KB q·s)·x + Σ q·(bias − 2^KB·scale) = Σ q·(scale·code + bias).
  constexpr bool KFOLD = !KGRID;
  constexpr float KUP = KFOLD ? (float)(1u << KB) : 1.0f;
  const int bh = GROUP_Y;
  // KCLS > 0 (KIVI's key_widths): the key channels, in the cache's storage order, fall into KCLS classes, class c of
  // KBLO + c bits over rows [end of class c - 1, kends[c]) (a class may be empty), each class with its own codes (k0
  // for class 0, wNc for class N); the scales, biases and outliers (k1, k2, kout, kidx) are one array each, all rows in
  // the storage order, as without classes.
  // The query's channels are gathered into the storage order as they are loaded (kord: each kv head's order), so
  // phase 1 meets every key row with its own channel, and the 16-bit tokens read their keys through the same order.
  // KB is then the widest class's width (the staged rows' stride); every class's row of a tile is whole words.
  WIDTH_CLASS_ENDS
  // Class c's first staged word among a tile's key words (all classes' rows one after another): off1, off2, off3.
  const int off1 = e0 * (CT * KBLO / 32);
  const int off2 = off1 + (e1 - e0) * (CT * (KBLO + 1) / 32);
  const int off3 = off2 + (e2 - e1) * (CT * (KBLO + 2) / 32);
  const int cls_words = off3 + (e3 - e2) * (CT * (KBLO + 3) / 32);
  const int n_comp = n_comp_r_shape[0] - 1;
  const int n_win = n_win_r_shape[0] - 1;
  const int n_tiles = (n_comp + CT - 1) / CT;
  const int tiles_per_split = (n_tiles + GROUPS_X - 1) / GROUPS_X;
  const int c_begin = GROUP_X * tiles_per_split * CT;
  const int c_end = (c_begin + tiles_per_split * CT < n_comp) ? c_begin + tiles_per_split * CT : n_comp;
  const int comp_tiles = (c_end > c_begin) ? (c_end - c_begin + CT - 1) / CT : 0;
  // The 16-bit tokens (sinks, then window) in tiles of CT, all in the last split (spreading them one tile a split
  // over the last splits timed no faster on an H200: benchmarks/results/decode-profile-spread-dense-h200.json).
  const int d_count = NS + n_win;
  const int d_tiles = (d_count + CT - 1) / CT;
  const int my_d_tiles = (GROUP_X == GROUPS_X - 1) ? d_tiles : 0;
  const int all_tiles = comp_tiles + my_d_tiles;
  // The arrays' row lengths follow from the capacity (compressed slots, a multiple of GK) and the template, not from
  // their shapes: each shape read is a buffer argument, and Metal binds at most 31 (kernels/backend.py).
  const long cap = (long)v0_shape[2];
  const long k_row = cap * KB / 32;              // key code words per channel row (no classes)
  const long k_groups = cap / GK;                // key blocks per channel row
  const long v_row = VWT;                        // value code words per token
  const long v_groups = VG;                      // value groups per token

  SHARED float sh_q[D * R];          // scaled queries, channel-major: sh_q[d * R + r]
#define QS_AT(d, r) ((d) * R + (int)((unsigned)(d) >> 3) * 4 + (r))
#define S_AT(h, r, t) ((h) * SS + (r) * CTP + (t) + (t) / 32)
// KCLS: a phase-1 run's TT codes of storage row `row` at width `w` (runtime), code 0 at bit 0 (two words, always).
#define CLASS_RUN_CODES(row, w) \
  ((U32)((((U64)sh_kw[(row) * KWP + ((run * TT * (w)) >> 5) + 1] << 32) | \
          (U64)sh_kw[(row) * KWP + ((run * TT * (w)) >> 5)]) >> ((run * TT * (w)) & 31)))
// A phase-1 run's TT codes of the channel row whose first staged word for the run is at `at`, code 0 at bit 0 (a
// second word where codes straddle words: 3, 5, 6 bits).
#define RUN_CODES(at) (KSPLIT ? (U32)((((U64)sh_kw[(at) + 1] << 32) | (U64)sh_kw[at]) >> ksh) : sh_kw[at] >> ksh)
  SHARED float sh_qs[D * R + D / 2 + 4];   // queries x the tile's key scales, at QS_AT(channel, row)
  SHARED float sh_kb[D];             // the tile's key biases (refolded, KFOLD)
  SHARED float sh_ks[D];             // ... and scales x KUP (ROPE: each key is decoded and turned by its position)
  SHARED float sh_rf[D / 2];         // ROPE: each channel pair's angle per position (MLX's, see RopeParameters)
  // KO (KIVI's key_outliers): the tile's block outliers' shares of each score, q_c x residual (quant/outliers.py),
  // at [r * CT + t]; added by STAGE_STORE, read and set back to zero by phase 2.
  SHARED float sh_ox[KO ? R * CT : 1];
  SHARED U32 sh_kw[D * KWP + 1];     // the tile's key codes, one row of KW words (KWP apart) per channel
  SHARED U32 sh_vw[CT * VWT + 1];    // the tile's value codes, one row of VWT words per token
  SHARED float sh_vs[CT * VG];       // ... their scales
  SHARED float sh_vb[CT * VG];       // ... and biases
  // Partial scores, part h of row r and token t at S_AT(h, r, t); after the tile loop, the token groups' outputs.
  SHARED float sh_s[NH * SS > NSG * D ? NH * SS : NSG * D];
  SHARED float sh_p[CT * R];         // the tile's softmax weights, token-major (phase 3 reads a token's R at once)
  SHARED float sh_m[R];
  SHARED float sh_l[R];
  SHARED float sh_corr[R];
  const float scale = qscale[0];
  const U32 one_bits = AS_U32(qscale[1]);   // 1.0 (see unit_code)
  SHARED int sh_ord[KCLS ? D : 1];   // KCLS: this kv head's channel at each storage row
  SHARED int sh_inv[KCLS ? D : 1];   // ... and each channel's storage row (keys before RoPE: a pair's two rows)
  for (int i = TID; i < R * D; i += NT) {
    const int row = i % D;
    const int channel = KCLS ? (int)kord[(long)(bh % kord_shape[0]) * D + row] : row;
    sh_q[row * R + i / D] = scale * (float)qry[(long)bh * R * D + (i / D) * D + channel];
    if (KCLS && i < D) {
      sh_ord[KCLS ? row : 0] = channel;
      sh_inv[KCLS ? channel : 0] = row;
    }
  }
  if (TID < R) { sh_m[TID] = -1e30f; sh_l[TID] = 0.0f; }
  // Codes on a non-uniform grid (KIVI's key_grid / value_grid): code c stands for grid[c] in code units, so
  // scale·grid[c] + bias; the keys' fold of scale and bias into the query holds as for plain codes.
  SHARED float sh_kgrid[16];
  SHARED float sh_vgrid[16];
  if (TID < 16) { sh_kgrid[TID] = grids[TID]; sh_vgrid[TID] = grids[16 + TID]; }   // keys' 16 levels, then values'
  if (ROPE) for (int i = TID; i < D / 2; i += NT) sh_rf[i] = rfreq[i];
  // ROPE_STEP (decode.ROPE_STEP_BACKENDS): phase 1 turns a run's first token by its angle as the reference computes it
  // and each next token by one more position's turn of its pair (cos, sin of the pair's angle per position, here),
  // so a run of TT tokens takes one sine and cosine a pair instead of TT. The angles of a run's later tokens then
  // differ from the reference's float32 position x frequency by that product's rounding (< 0.008 rad at 131k tokens,
  // the size of the reference's own error against the exact angle).
#ifndef ROPE_STEP
#define ROPE_STEP 0
#endif
  SHARED float sh_rstep[ROPE_STEP ? D : 2];
  if (ROPE && ROPE_STEP) for (int i = TID; i < D / 2; i += NT) {
    float sn, cs;
    TURN_AT(1.0f, rfreq[i], sn, cs);
    sh_rstep[ROPE_STEP ? 2 * i : 0] = cs;
    sh_rstep[ROPE_STEP ? 2 * i + 1 : 1] = sn;
  }

  const int lane = TID % TPT;
  const int tg = TID / TPT;
  float o_acc[R][8];
  float o_bias[R];
  for (int r = 0; r < R; ++r) {
    o_bias[r] = 0.0f;
    for (int i = 0; i < 8; ++i) o_acc[r][i] = 0.0f;
  }
  const int t1 = TID % CT;       // phase 1: this thread's token in the tile
  const int share = TID / CT;    // ... and its share of the channels (not `half`: a type name in MSL)

  // A tile's staged data in registers, NT threads taking every NT-th element (loads independent of each other).
  // KCLS: the classes' rows hold D x CT x KMEAN / 32 words a tile (their widths average the layer's key bits, KMEAN,
  // exactly), fewer than D rows at the widest width's KW.
  constexpr int NKW = KCLS ? (D * CT * KMEAN / 32 + NT - 1) / NT : (D * KW + NT - 1) / NT;
  constexpr int NVW = (CT * VWT + NT - 1) / NT;
  constexpr int NVG = (CT * VG + NT - 1) / NT;
  constexpr int NDK = (D + NT - 1) / NT;
  // Where NT threads cover an array in whole rounds (TID < NT), the bounds checks below always hold: skipped at
  // compile time (they cost predicates and a shared-memory address per store).
  constexpr bool FULL_KW = (D * KW) % NT == 0;
  constexpr bool FULL_VW = (CT * VWT) % NT == 0;
  constexpr bool FULL_VG = (CT * VG) % NT == 0;
  constexpr bool FULL_DK = D % NT == 0;
  constexpr float VUP = (float)(1u << VB);    // phase 3 reads value codes as 1 + code / 2^VB (see there)
  // Where whole rows of codes fall to each thread (NT a multiple of the words per row), its code loads start from
  // one pointer fixed for the split, the tile adding a plain offset (64-bit index arithmetic per load otherwise: it
  // was most of the staging's instructions).
  constexpr bool KEY_ROWS = NT % KW == 0;     // key words: channel TID / KW (+ NT / KW a round), word TID % KW
  constexpr bool VALUE_ROWS = NT % VWT == 0;  // value words: token TID / VWT (+ NT / VWT a round), word TID % VWT
  const GLOBAL U32* k0_mine = k0 + ((long)bh * D + (KEY_ROWS ? TID / KW : 0)) * k_row + (KEY_ROWS ? TID % KW : 0);
  const GLOBAL U32* v0_mine = v0 + (long)bh * cap * v_row + (VALUE_ROWS ? TID % VWT : 0);
  const int kw_mine = (TID / KW) * KWP + TID % KW;   // KEY_ROWS: where this thread's first staged key word goes
  const long v_stride = (long)(NT / VWT) * v_row;    // VALUE_ROWS: from one of this thread's value words to the next
  U32 st_kw[NKW];
  // KCLS: each staged key word's place, the same in every tile (so the class search and the divisions by a class's
  // words per row run once per split, not per tile: they were more instructions than phase 1's): its shared slot x 4
  // + its class (-1: no word), and its source index less the tile's part, which is (tile start / 32) x the width.
  int st_kat[KCLS ? NKW : 1];
  const GLOBAL U32* st_kptr[KCLS ? NKW : 1];   // ... and where in its class's codes the word of the split's first tile is
  if (KCLS) {
    for (int j = 0; j < NKW; ++j) {
      const int i = TID + j * NT;   // word i of the classes' rows one after another
      st_kat[KCLS ? j : 0] = -1;
      st_kptr[KCLS ? j : 0] = k0;
      if (i < cls_words) {
        const int c = (i >= off1) + (i >= off2) + (i >= off3);
        const int w = KBLO + c;
        const int kwc = CT * w / 32;
        const int local = i - PICK4(c, 0, off1, off2, off3);
        const int first = PICK4(c, 0, e0, e1, e2);
        const int rows = PICK4(c, e0, e1, e2, e3) - first;
        st_kptr[KCLS ? j : 0] = PICK4(c, k0, w1c, w2c, w3c) + ((long)bh * rows + local / kwc) * (cap * w / 32)
                                + local % kwc;
        st_kat[KCLS ? j : 0] = ((first + local / kwc) * KWP + local % kwc) * 4 + c;
      }
    }
  }
  // KCLS: the 2^width of this thread's key channel row (TID < D: NDK is 1, as NT >= D), phase 1's x.
  static_assert(!KCLS || NDK == 1, "key widths: one key channel row per thread");
  const int my_c = KCLS ? CLASS_OF(TID < D ? TID : 0) : 0;
  const float my_kup = (float)(1u << (KBLO + my_c));
  U32 st_vw[NVW];
  float st_vs[NVG];
  float st_vb[NVG];
  float st_ks[NDK];
  float st_kb[NDK];
  int st_ko[KO ? NDK : 1];
  float st_kd[KO ? NDK : 1];
// Channel d's block outlier, at token t of the tile being stored (any other t: not in this tile), with its residual:
// its share of each row's score, q_d x residual, added to sh_ox (two channels may share a token, hence SHARED_ADD).
// One thread per channel and tile, where phase 1's threads would each test their channels for every run of tokens.
// Keys before RoPE: the residual is a change of channel d before RoPE, turned with its pair at the token's position
// (base + t, as phase 1 turns the keys): (e, 0) for the pair's first channel, (0, e) for its second.
#define OUTLIER_SHARES(d, t, e) { \
    if ((unsigned)(t) < (unsigned)CT) { \
      if (ROPE) { \
        /* KCLS: d is a storage row; the pair is of its channel, the query read at the pair's rows */ \
        const int ch_ = KCLS ? sh_ord[KCLS ? (d) : 0] : (d); \
        const int j_ = TRAD ? ch_ / 2 : ch_ % (D / 2); \
        const int a_ = TRAD ? 2 * j_ : j_; \
        const int b_ = TRAD ? 2 * j_ + 1 : j_ + D / 2; \
        const int qa_ = KCLS ? sh_inv[KCLS ? a_ : 0] : a_; \
        const int qb_ = KCLS ? sh_inv[KCLS ? b_ : 0] : b_; \
        float sn_, cs_; \
        TURN_AT((float)(base + (t)), sh_rf[j_], sn_, cs_); \
        const float ea_ = (ch_ == a_) ? (e) : 0.0f; \
        const float eb_ = (ch_ == a_) ? 0.0f : (e); \
        const float ra_ = ea_ * cs_ - eb_ * sn_; \
        const float rb_ = ea_ * sn_ + eb_ * cs_; \
        for (int r_ = 0; r_ < R; ++r_) \
          SHARED_ADD(&sh_ox[r_ * CT + (t)], sh_q[qa_ * R + r_] * ra_ + sh_q[qb_ * R + r_] * rb_); \
      } else { \
        for (int r_ = 0; r_ < R; ++r_) SHARED_ADD(&sh_ox[r_ * CT + (t)], sh_q[(d) * R + r_] * (e)); \
      } \
    } \
  }
#define STAGE_LOAD(at) { \
    const int sb = (at); \
    const int kg = sb / GK; \
    for (int j = 0; j < NKW; ++j) { \
      const int i = TID + j * NT; \
      if (KCLS) { \
        const int kat = st_kat[KCLS ? j : 0]; \
        if (kat >= 0) st_kw[j] = st_kptr[KCLS ? j : 0][(long)(sb >> 5) * (KBLO + (kat & 3))]; \
      } else if (FULL_KW || i < D * KW) { \
        if (KEY_ROWS) st_kw[j] = k0_mine[(long)(j * (NT / KW)) * k_row + sb * KB / 32]; \
        else st_kw[j] = k0[((long)bh * D + i / KW) * k_row + (long)sb * KB / 32 + i % KW]; \
      } \
    } \
    for (int j = 0; j < NVW; ++j) { \
      const int i = TID + j * NT; \
      if (FULL_VW || i < CT * VWT) { \
        if (VALUE_ROWS) { \
          /* No clamp at the split's end (one stride from word to word): a tile lies inside the cache's capacity */ \
          /* (a multiple of its key block, hence of CT, as the key loads assume too), and a code past the end */ \
          /* reads as a finite value (1 + code/2^VB, or a grid level) that phase 2 gives weight 0; the scales */ \
          /* and biases, any 16-bit pattern, stay clamped. */ \
          st_vw[j] = v0_mine[(long)(sb + TID / VWT) * v_row + (long)j * v_stride]; \
        } else { \
          const long c = (sb + i / VWT < c_end) ? sb + i / VWT : c_begin; \
          st_vw[j] = v0[((long)bh * cap + c) * v_row + i % VWT]; \
        } \
      } \
    } \
    for (int j = 0; j < NVG; ++j) { \
      const int i = TID + j * NT; \
      const long c = (sb + i / VG < c_end) ? sb + i / VG : c_begin; \
      if (FULL_VG || i < CT * VG) { \
        st_vs[j] = (float)v1[((long)bh * cap + c) * v_groups + i % VG]; \
        /* VSYM (scale-only values, KIVI's symmetric_values): the bias is -h·s, h = (2^VB - 1)/2, from the scale */ \
        st_vb[j] = VSYM ? -0.5f * (float)((1u << VB) - 1u) * st_vs[j] \
                        : (float)v2[((long)bh * cap + c) * v_groups + i % VG]; \
      } \
    } \
    for (int j = 0; j < NDK; ++j) { \
      const int d = TID + j * NT; \
      if (FULL_DK || d < D) { \
        st_ks[j] = (float)k1[((long)bh * D + d) * k_groups + kg]; \
        st_kb[j] = (float)k2[((long)bh * D + d) * k_groups + kg]; \
        if (KO) { \
          st_ko[KO ? j : 0] = (int)kidx[((long)bh * D + d) * k_groups + kg] - sb % GK; \
          st_kd[KO ? j : 0] = (float)kout[((long)bh * D + d) * k_groups + kg]; \
        } \
      } \
    } \
  }
#define STAGE_STORE() { \
    for (int j = 0; j < NKW; ++j) { \
      const int i = TID + j * NT; \
      if (KCLS) { \
        if (st_kat[KCLS ? j : 0] >= 0) sh_kw[st_kat[KCLS ? j : 0] >> 2] = st_kw[j]; \
      } else if (FULL_KW || i < D * KW) { \
        sh_kw[KEY_ROWS ? kw_mine + j * (NT / KW) * KWP : (i / KW) * KWP + i % KW] = st_kw[j]; \
      } \
    } \
    for (int j = 0; j < NVW; ++j) if (FULL_VW || TID + j * NT < CT * VWT) sh_vw[TID + j * NT] = st_vw[j]; \
    for (int j = 0; j < NVG; ++j) if (FULL_VG || TID + j * NT < CT * VG) { \
      sh_vs[TID + j * NT] = VGRID ? st_vs[j] : st_vs[j] * VUP; \
      sh_vb[TID + j * NT] = VGRID ? st_vb[j] : st_vb[j] - VUP * st_vs[j]; \
    } \
    for (int j = 0; j < NDK; ++j) { \
      const int d = TID + j * NT; \
      if (FULL_DK || d < D) { \
        /* KCLS: each class's codes are read against 2^(its width) (phase 1) */ \
        const float kup = KCLS ? my_kup : KUP; \
        sh_kb[d] = KFOLD ? st_kb[j] - kup * st_ks[j] : st_kb[j]; \
        sh_ks[d] = kup * st_ks[j]; \
        for (int r = 0; r < R; ++r) sh_qs[QS_AT(d, r)] = sh_q[d * R + r] * (kup * st_ks[j]); \
        if (KO) OUTLIER_SHARES(d, st_ko[KO ? j : 0], st_kd[KO ? j : 0]); \
      } \
    } \
  }
  if (KO) for (int i = TID; i < R * CT; i += NT) sh_ox[KO ? i : 0] = 0.0f;   // the first tile's barrier orders it
  if (PF && comp_tiles > 0) STAGE_LOAD(c_begin);

  for (int tile = 0; tile < all_tiles; ++tile) {
    const bool dense = tile >= comp_tiles;
    const int base = dense ? (tile - comp_tiles) * CT : c_begin + tile * CT;
    BARRIER();   // the previous tile's readers of the staged arrays are done
    if (!dense) {
      // Stage the tile in shared memory: key codes, the key block's scales and biases, value codes, scales
      // and biases (values staged too, rather than held in registers through phase 3, to keep registers for
      // the accumulators). With PF the tile was loaded into registers during the previous tile's phases
      // (STAGE_LOAD below), so the loads' latency overlaps work instead of stalling every threadgroup at the
      // barrier; without PF it is loaded here.
      if (!PF) STAGE_LOAD(base);
      STAGE_STORE();
      if (PF && tile + 1 < comp_tiles) STAGE_LOAD(base + CT);
      BARRIER();
      // Phase 1 (compressed): tokens [run*TT, run*TT + TT) of the tile, channels [slice*DC, slice*DC + DC). The
      // run's TT codes of a channel are TT*KB consecutive bits of its staged row (one word, two where they straddle),
      // each read as x = 1 + code/2^KB (the code moved into the top of 1.0's mantissa: exact, a shift and a logic
      // op) against the refolded scales (KFOLD above); a key grid looks its level up instead.
      const int run = TID % RUNS;
      const int slice = TID / RUNS;
      const int kbit = run * TT * KB;
      const int kw0 = kbit >> 5;
      const int ksh = kbit & 31;
      float acc[TT][R];
      for (int i = 0; i < TT; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = 0.0f;
      if (ROPE) {
        // Keys stored before RoPE (KIVI's rope=pre): token t of the tile sits at position base + t (the stream
        // starts at position 0); the thread's DC/2 channel pairs are decoded, turned by position x the pair's
        // angle, and met by the query (the keys' bias is inside the decoded key: no per-tile fold).
        constexpr int DP = DC / 2;
        const float first = (float)(base + run * TT);   // the run's first position (exact below 2^24, as + i)
#pragma unroll 2
        for (int jj = 0; jj < DP; ++jj) {
          const int j = slice * DP + jj;
          const int a = TRAD ? 2 * j : j;
          const int b = TRAD ? 2 * j + 1 : j + D / 2;
          // KCLS (key widths): the pair's channels sit at rows of their own classes, so each is read at its row with
          // its class's width (a runtime width: the two may differ)
          const int row_a = KCLS ? sh_inv[KCLS ? a : 0] : a;
          const int row_b = KCLS ? sh_inv[KCLS ? b : 0] : b;
          const int wa = KCLS ? KBLO + CLASS_OF(row_a) : KB;
          const int wb = KCLS ? KBLO + CLASS_OF(row_b) : KB;
          const U32 bits_a = KCLS ? CLASS_RUN_CODES(row_a, wa) : RUN_CODES(a * KWP + kw0);
          const U32 bits_b = KCLS ? CLASS_RUN_CODES(row_b, wb) : RUN_CODES(b * KWP + kw0);
          const float scale_a = sh_ks[row_a], bias_a = sh_kb[row_a], scale_b = sh_ks[row_b], bias_b = sh_kb[row_b];
          const float freq = sh_rf[j];
          float qa[R], qb[R];
#pragma unroll
          for (int r = 0; r < R; ++r) { qa[r] = sh_q[row_a * R + r]; qb[r] = sh_q[row_b * R + r]; }
          float sn, cs;
          if (ROPE_STEP) TURN_AT(first, freq, sn, cs);
          const float step_c = sh_rstep[ROPE_STEP ? 2 * j : 0], step_s = sh_rstep[ROPE_STEP ? 2 * j + 1 : 1];
#pragma unroll
          for (int i = 0; i < TT; ++i) {
            const float xa = KCLS ? unit_code(bits_a, i, wa, one_bits)
                : KGRID ? sh_kgrid[(bits_a >> (i * KB)) & ((1u << KB) - 1u)] : unit_code(bits_a, i, KB, one_bits);
            const float xb = KCLS ? unit_code(bits_b, i, wb, one_bits)
                : KGRID ? sh_kgrid[(bits_b >> (i * KB)) & ((1u << KB) - 1u)] : unit_code(bits_b, i, KB, one_bits);
            const float ka = scale_a * xa + bias_a;
            const float kb = scale_b * xb + bias_b;
            if (!ROPE_STEP) {
              TURN_AT(first + (float)i, freq, sn, cs);
            } else if (i > 0) {   // one more position: (cs, sn) turned by the pair's step
              const float turned = cs * step_c - sn * step_s;
              sn = sn * step_c + cs * step_s;
              cs = turned;
            }
            const float ra = ka * cs - kb * sn;
            const float rb = ka * sn + kb * cs;
#pragma unroll
            for (int r = 0; r < R; ++r) {   // two multiply-adds (a sum of the two products first costs a third op)
              acc[i][r] += qa[r] * ra;
              acc[i][r] += qb[r] * rb;
            }
          }
        }
      } else if (KCLS && KUNI) {
        // Key widths, uniform form (KUNI): the slice's channels in one unrolled loop, each at its class's width read at
        // run time (variable shifts cost what constant ones do, and codes are read as two words), so the two slices of
        // a warp never wait on each other where they fall into different classes.
#pragma unroll
        for (int j = 0; j < DC; ++j) {
          const int d = slice * DC + j;
          const int w = KBLO + CLASS_OF(d);
          const U32 bits = CLASS_RUN_CODES(d, w);
          float q[R];
#pragma unroll
          for (int r = 0; r < R; ++r) q[r] = sh_qs[QS_AT(d, r)];
#pragma unroll
          for (int i = 0; i < TT; ++i) {
            const float x = unit_code(bits, i, w, one_bits);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[i][r] += q[r] * x;
          }
        }
      } else if (KCLS) {
        // Key widths: the slice's channels class by class, each at its own (compile-time) width. A slice takes every
        // SLICES-th row (row = slice mod SLICES), not DC consecutive ones: every slice then holds about as many rows
        // of each class, so the two slices of a warp run the same trip counts (consecutive rows put a class boundary
        // between them, and the warp ran both slices' loops one after the other).
#pragma unroll
        for (int c = 0; c < (KCLS ? KCLS : 1); ++c) {
          const int w = KBLO + c;
          const int lo0 = PICK4(c, 0, e0, e1, e2);
          const int hi0 = PICK4(c, e0, e1, e2, e3);
          const int cbit = run * TT * w;
          const int cw0 = cbit >> 5;
          const int csh = cbit & 31;
          for (int d = lo0 + (slice - lo0 % SLICES + SLICES) % SLICES; d < hi0; d += SLICES) {
            const int at = d * KWP + cw0;
            const U32 bits = ((32 % w) != 0) ? (U32)((((U64)sh_kw[at + 1] << 32) | (U64)sh_kw[at]) >> csh)
                                             : sh_kw[at] >> csh;
            float q[R];
#pragma unroll
            for (int r = 0; r < R; ++r) q[r] = sh_qs[QS_AT(d, r)];
#pragma unroll
            for (int i = 0; i < TT; ++i) {
              const float x = unit_code(bits, i, w, one_bits);
#pragma unroll
              for (int r = 0; r < R; ++r) acc[i][r] += q[r] * x;
            }
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < DC; ++j) {
          const int d = slice * DC + j;
          const U32 bits = RUN_CODES(d * KWP + kw0);
          float q[R];
#pragma unroll
          for (int r = 0; r < R; ++r) q[r] = sh_qs[QS_AT(d, r)];
#pragma unroll
          for (int i = 0; i < TT; ++i) {
            const float x = KGRID ? sh_kgrid[(bits >> (i * KB)) & ((1u << KB) - 1u)] : unit_code(bits, i, KB, one_bits);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[i][r] += q[r] * x;
          }
        }
      }
#pragma unroll
      for (int m = RUNS; m < 32; m <<= 1)   // lanes m apart hold the same run in the warp's other slices
#pragma unroll
        for (int i = 0; i < TT; ++i)
#pragma unroll
          for (int r = 0; r < R; ++r) acc[i][r] += LANE_XOR(acc[i][r], m);
      if (slice % SPW == 0) {
#pragma unroll
        for (int i = 0; i < TT; ++i)
#pragma unroll
          for (int r = 0; r < R; ++r) sh_s[S_AT(slice / SPW, r, run * TT + i)] = acc[i][r];
      }
    } else {
      // Phase 1 (16-bit sinks, then window): token t1's keys read directly.
      float acc[R];
      for (int r = 0; r < R; ++r) acc[r] = 0.0f;
      const int dd = base + t1;
      if (dd < d_count) {
        const GLOBAL TD* kp = (dd < NS) ? sink_k + ((long)bh * NS + dd) * D : win_k + ((long)bh * n_win + (dd - NS)) * D;
        for (int d = share * DH; d < share * DH + DH; ++d) {
          const float x = (float)kp[KCLS ? sh_ord[KCLS ? d : 0] : d];
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r] += sh_q[d * R + r] * x;
        }
      }
      for (int r = 0; r < R; ++r) sh_s[S_AT(share, r, t1)] = acc[r];
    }
    BARRIER();
    // Phase 2: warp r takes row r (and r + NW, ...): the keys' bias term, the tile's max and weights.
    const int wid = TID / 32;
    const int wl = TID % 32;
    for (int r = wid; r < R; r += NW) {
      float qb = 0.0f;
      if (!dense && !ROPE) {
        for (int d = wl; d < D; d += 32) qb += sh_q[d * R + r] * sh_kb[d];
        for (int st = 16; st > 0; st >>= 1) qb += LANE_XOR(qb, st);
      }
      // A token's score is the sum of its parts: one per warp's slices of a compressed tile, HALVES otherwise.
      const int parts = dense ? HALVES : SLICES / SPW;
      constexpr int PT = (CT + 31) / 32;    // tokens per lane, their scores kept in registers
      float score[PT];
      float tmax = -1e30f;
#pragma unroll
      for (int k = 0; k < PT; ++k) {
        const int t = wl + 32 * k;
        float s = -1e30f;
        if (CT % 32 == 0 || t < CT) {
          s = qb;
          for (int h = 0; h < parts; ++h) s += sh_s[S_AT(h, r, t)];
          if (KO && !dense) {   // the block outliers' shares (STAGE_STORE), cleared for the next tile
            s += sh_ox[KO ? r * CT + t : 0];
            sh_ox[KO ? r * CT + t : 0] = 0.0f;
          }
          const int c = base + t;
          const bool ok = dense ? (c < d_count) : (c < c_end && c >= CS);
          s = ok ? s : -1e30f;
        }
        score[k] = s;
        tmax = FMAX(tmax, s);
      }
      for (int st = 16; st > 0; st >>= 1) tmax = FMAX(tmax, LANE_XOR(tmax, st));
      const float m_old = sh_m[r];
      const float m_new = FMAX(m_old, tmax);
      float lsum = 0.0f;
#pragma unroll
      for (int k = 0; k < PT; ++k) {
        const int t = wl + 32 * k;
        if (CT % 32 == 0 || t < CT) {
          const float p = (score[k] > -1e29f) ? EXP(score[k] - m_new) : 0.0f;
          sh_p[t * R + r] = p;
          lsum += p;
        }
      }
      for (int st = 16; st > 0; st >>= 1) lsum += LANE_XOR(lsum, st);
      if (wl == 0) {
        const float corr = EXP(m_old - m_new);
        sh_corr[r] = corr;
        sh_l[r] = sh_l[r] * corr + lsum;
        sh_m[r] = m_new;
      }
    }
    BARRIER();
    // Phase 3: rescale, then weight x value of this thread's tokens.
    for (int r = 0; r < R; ++r) {
      const float corr = sh_corr[r];
      o_bias[r] *= corr;
      for (int i = 0; i < 8; ++i) o_acc[r][i] *= corr;
    }
    if (!dense) {
      const int vbit = lane * 8 * VB;
      const int vw = vbit >> 5;
      const int vsh = vbit & 31;
      const int vg = (lane * 8) / G;
#pragma unroll
      for (int j = 0; j < TPG; ++j) {
        const int t = tg + j * NSG;
        U64 bits = (U64)sh_vw[t * VWT + vw];
        if (vsh + 8 * VB > 32) bits |= ((U64)sh_vw[t * VWT + vw + 1]) << 32;
        bits >>= vsh;
        const float vscale = sh_vs[t * VG + vg];
        const float vbias = sh_vb[t * VG + vg];
        float x[8];
        for (int i = 0; i < 8; ++i) {
          if (VGRID) {
            x[i] = sh_vgrid[((U32)(bits >> (i * VB))) & ((1u << VB) - 1u)];
          } else {
            // Code i moved to the top VB bits of the mantissa of 1.0: x = 1 + code / 2^VB exactly, in a shift and
            // two logic ops (U2F adds a float add to those); the staged scale and bias were refolded for it
            // (STAGE_STORE: scale·code + bias = (2^VB·scale)·x + (bias − 2^VB·scale)).
            const U32 placed = (i * VB >= 23 - VB) ? (U32)(bits >> (i * VB - (23 - VB)))
                                                   : ((U32)bits << ((23 - VB) - i * VB));
            x[i] = AS_F32(one_bits | (placed & (((1u << VB) - 1u) << (23 - VB))));
          }
        }
        for (int r = 0; r < R; ++r) {
          const float p = sh_p[t * R + r];
          const float ps = p * vscale;
          o_bias[r] += p * vbias;
          for (int i = 0; i < 8; ++i) o_acc[r][i] += ps * x[i];
        }
      }
    } else {
      for (int j = 0; j < TPG; ++j) {
        const int t = tg + j * NSG;
        const int dd = base + t;
        if (dd < d_count) {
          const GLOBAL TD* vp = (dd < NS) ? sink_v + ((long)bh * NS + dd) * D : win_v + ((long)bh * n_win + (dd - NS)) * D;
          float x[8];
          for (int i = 0; i < 8; ++i) x[i] = (float)vp[lane * 8 + i];
          for (int r = 0; r < R; ++r) {
            const float p = sh_p[t * R + r];
            for (int i = 0; i < 8; ++i) o_acc[r][i] += p * x[i];
          }
        }
      }
    }
  }

  // The NSG token groups share one running max (block-uniform): their outputs just add up.
  // Into sh_s (no phase reads it after the loop's last barrier): one array fewer within a threadgroup's 32 KB.
  const long split_row = ((long)bh * GROUPS_X + GROUP_X) * R;
#pragma unroll
  for (int r = 0; r < R; ++r) {   // unrolled: o_acc[r] stays in registers (a runtime index puts it in memory)
    BARRIER();
    for (int i = 0; i < 8; ++i) sh_s[tg * D + lane * 8 + i] = o_acc[r][i] + o_bias[r];
    BARRIER();
    for (int d = TID; d < D; d += NT) {
      float acc = 0.0f;
      for (int g = 0; g < NSG; ++g) acc += sh_s[g * D + d];
      part_o[(split_row + r) * D + d] = acc;
    }
    if (TID == 0) {
      part_m[split_row + r] = sh_m[r];
      part_l[split_row + r] = sh_l[r];
    }
  }
"""

# The merge pass: one threadgroup of NM = max(D, 32) threads per query row (bh·R + r). The splits' maxima and
# weights are computed in parallel (one split per thread) and reduced across the threadgroup; then each of the
# first D threads sums one output channel over the splits, loads independent of each other. (A loop over the
# splits in every thread, each step waiting for its load, cost ~20-40 us a layer at 64-128 splits on an H200.)
_MERGE_BODY = """
  constexpr int NWM = NM / 32;
  const int row = GROUP_X;
  const int bh = row / R;
  const int r = row % R;
  const int splits = part_m_shape[1];
  SHARED float sh_w[MAXS];
  SHARED float sh_red[NWM];
  float big = -1e30f;
  for (int s = TID; s < splits; s += NM) big = FMAX(big, part_m[((long)bh * splits + s) * R + r]);
  for (int st = 16; st > 0; st >>= 1) big = FMAX(big, LANE_XOR(big, st));
  if (TID % 32 == 0) sh_red[TID / 32] = big;
  BARRIER();
  big = sh_red[0];
  for (int i = 1; i < NWM; ++i) big = FMAX(big, sh_red[i]);
  float denominator = 0.0f;
  for (int s = TID; s < splits; s += NM) {
    const long at = ((long)bh * splits + s) * R + r;
    const float w = EXP(part_m[at] - big);
    sh_w[s] = w;
    denominator += w * part_l[at];
  }
  for (int st = 16; st > 0; st >>= 1) denominator += LANE_XOR(denominator, st);
  BARRIER();
  if (TID % 32 == 0) sh_red[TID / 32] = denominator;
  BARRIER();
  denominator = 0.0f;
  for (int i = 0; i < NWM; ++i) denominator += sh_red[i];
  float value = 0.0f;
  if (TID < D) {
    float numerator = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) numerator += sh_w[s] * part_o[(((long)bh * splits + s) * R + r) * D + TID];
    value = numerator / denominator;
  }
  if (ROT) {
    // The cache's inverse rotation signs ⊙ (H y)/sqrt(D) (oscale = 1/sqrt(D)), H the Sylvester Hadamard matrix,
    // as an in-place butterfly over the row: stage h maps (a, b) at (i, i|h) to (a + b, a - b).
    SHARED float sh_y[NM];
    sh_y[TID] = value;
    BARRIER();
    for (int h = 1; h < D; h <<= 1) {
      float mixed = 0.0f;
      if (TID < D) {
        const float mine = sh_y[TID];
        const float other = sh_y[TID ^ h];
        mixed = (TID & h) ? other - mine : mine + other;
      }
      BARRIER();
      sh_y[TID] = mixed;
      BARRIER();
    }
    value = sh_y[TID] * ((TID < D) ? signs[TID] * oscale[0] : 0.0f);
  }
  if (TID < D) out[(long)row * D + TID] = static_cast<TO>(value);
"""

MERGE_SOURCE = KernelSource(
    name="velox_decode_merge",
    input_names=("part_m", "part_l", "part_o", "signs", "oscale"),
    output_names=("out",),
    body=_MERGE_BODY,
)


@dataclass(frozen=True)
class Codec:
    """How the compressed arrays of one role (keys or values) are read: a kind and its code widths."""

    kind: str
    bits: int
    bits2: int = 0
    # Codes on a non-uniform grid (KIVI's key_grid / value_grid options): the role's arrays end with the grid's
    # levels in code units (float32, 16 entries); only the tiled pass reads them.
    grid: bool = False
    # PolarQuant's levels L (head_dim = 2^L); 0 for every other kind.
    levels: int = 0
    # KIVI keys with one 16-bit outlier per channel and key block (option key_outliers): the role's arrays end with
    # their residuals (float16) and indices (uint8), [B, H, D, blocks]; only the tiled pass reads them.
    outliers: bool = False
    # Affine codes with one scale per group and no bias (KIVI's symmetric_values): x = s·(code - (2^bits - 1)/2). The
    # role's arrays are codes, scales, and a placeholder where the biases would be (read by neither pass): the kernel
    # derives each bias from the cache's own scales, so nothing derived is held between steps.
    symmetric: bool = False
    # KIVI keys at different widths per channel (option key_widths): the classes' widths, consecutive from the
    # narrowest (`bits` is then the layer's mean). The role's arrays are then each class's end row in storage order
    # (int32 [len(widths)]), each kv head's channel order and its inverse (the cache's), and each class's codes,
    # scales, biases (and outliers), None for a class the layer has no channels of; only the tiled pass and the
    # history decode read them.
    widths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _CODEC_MACROS:
            raise ValueError(f"Unknown codec kind {self.kind!r}; known are {', '.join(_CODEC_MACROS)}.")
        if (self.kind == "polar") != (self.levels >= 3):
            raise ValueError("A polar codec needs its levels (at least 3: 8 channels a lane); no other codec has any.")
        if self.outliers and (self.kind != "kivi_keys" or self.grid):
            raise ValueError("Only KIVI keys without a grid have block outliers.")
        if self.symmetric and (self.kind != "affine" or self.grid):
            raise ValueError("Only affine codes without a grid are symmetric.")
        if self.widths and (self.kind != "kivi_keys" or self.grid or len(self.widths) > MAX_WIDTH_CLASSES
                            or list(self.widths) != list(range(self.widths[0], self.widths[0] + len(self.widths)))):
            raise ValueError(f"Only KIVI keys without a grid have key widths, at most {MAX_WIDTH_CLASSES} consecutive "
                             f"ones, not {self.widths}.")

    @property
    def slots(self) -> int:
        """How many arrays this codec reads (see `_CODEC_MACROS` for their order)."""
        return 4 if self.kind == "polar" else _CODEC_SLOTS[self.kind]

    def macro(self, role: str) -> str:
        prefix = "k" if role == "KEY" else "v"
        if self.kind == "polar":
            return _polar_macro(role, prefix, self.bits, self.bits2, self.levels)
        return _CODEC_MACROS[self.kind].format(ROLE=role, P=prefix, BITS=self.bits, BITS2=self.bits2,
                                               SYM=int(self.symmetric))

    @property
    def supported(self) -> bool:
        """Code widths `unpack8u` reads in at most two words (all but 7 bits; 1-8 bits)."""
        if self.kind == "vq":  # whole sub-vectors per lane's 8 channels; codes read one at a time
            return 1 <= self.bits <= 8 and self.bits2 in (1, 2, 4, 8)
        widths = (self.bits, self.bits2) if self.kind in ("rvq", "polar") else (self.bits,)
        return all(1 <= b <= 8 and b != 7 for b in widths + self.widths)

    @property
    def widest(self) -> int:
        """The widest code of this role (the classes' widest with key widths)."""
        return max(self.widths) if self.widths else self.bits


def _polar_macro(role: str, prefix: str, first_bits: int, higher_bits: int, levels: int) -> str:
    """LOAD_<role> for PolarQuant with L = `levels`: a lane's 8 channels [8·lane, 8·lane + 8) are one level-3 node,
    so the angles above it (levels L..4, one per level) give the node's radius, the level-3 angle splits it in two,
    the two level-2 angles in four and the four level-1 angles give the 8 values: x = radius · (cos or sin of each
    angle on the path; cos on the even child). Level l's angles start at code D/2 - D/2^(l-1) of the higher-level
    codes; level-1 angles lie in [0, 2π), where SINCOS_PI takes ψ - π and both results change sign. Tables: one
    array in slot 3, every level's centroids one after another (level 1's 2^first_bits, then 2^higher_bits a level:
    one input rather than L, as Metal binds at most 31 buffers a kernel). The product with the radius runs from the
    top level down, as the reference does."""
    p, d = prefix, 1 << levels

    def angle(level: int, index: str) -> str:
        offset = level_table_offset(level, first_bits, higher_bits)
        return f"{p}3[{offset} + code_at(a_, {d // 2 - d // (1 << (level - 1))} + ({index}), {higher_bits})]"

    lines = [
        f"#define LOAD_{role}(c, out, mul) {{ \\",
        f"  const long row_ = (long)bh * {p}0_shape[2] + (c); \\",
        f"  const GLOBAL U32* a_ = {p}2 + row_ * {p}2_shape[3]; \\",
        f"  const GLOBAL U32* f_ = {p}0 + row_ * {p}0_shape[3]; \\",
        "  float rho_ = 1.0f; \\",
        "  float s_, c_; \\",
    ]
    for level in range(levels, 3, -1):
        lines.append(f"  SINCOS_PI({angle(level, f'lane >> {level - 3}')}, s_, c_); \\")
        lines.append(f"  rho_ *= ((lane >> {level - 4}) & 1) ? s_ : c_; \\")
    lines += [
        f"  SINCOS_PI({angle(3, 'lane')}, s_, c_); \\",
        "  const float r0_ = rho_ * c_; \\",
        "  const float r1_ = rho_ * s_; \\",
        "  float q_[4]; \\",
        f"  SINCOS_PI({angle(2, '2 * lane')}, s_, c_); \\",
        "  q_[0] = r0_ * c_; \\",
        "  q_[1] = r0_ * s_; \\",
        f"  SINCOS_PI({angle(2, '2 * lane + 1')}, s_, c_); \\",
        "  q_[2] = r1_ * c_; \\",
        "  q_[3] = r1_ * s_; \\",
        "  for (int j_ = 0; j_ < 4; ++j_) { \\",
        f"    SINCOS_PI({p}3[code_at(f_, 4 * lane + j_, {first_bits})] - 3.14159265358979f, s_, c_); \\",
        "    out[2 * j_] = -q_[j_] * c_; \\",
        "    out[2 * j_ + 1] = -q_[j_] * s_; } \\",
        f"  mul = (float){p}1[row_]; }}",
    ]
    return "\n".join(lines) + "\n"


_UNSTAGED_KEYS = "#define KEY_STAGED 0\n#define QSLOTS 1\n#define KC_WORDS 1\n"


@functools.cache
def attend_source(key: Codec, value: Codec) -> KernelSource:
    """The attention pass for one (key codec, value codec) pair: the shared body with the two macros."""
    if value.kind in SKETCH_KINDS:
        raise ValueError(f"The {value.kind!r} codec reads keys only.")
    if key.outliers or key.widths:
        raise ValueError("Only the tiled pass reads block outliers and key widths.")
    inputs = (
        "qry", *(("qry2",) if key.kind in SKETCH_KINDS else ()), "qscale", "sink_k", "sink_v", "win_k", "win_v",
        "n_comp_r", "n_win_r", *(f"k{i}" for i in range(key.slots)), *(f"v{i}" for i in range(value.slots)),
    )
    name = (f"velox_decode_{key.kind}{key.bits}_{key.bits2}{'_l' + str(key.levels) if key.levels else ''}_"
            f"{value.kind}{value.bits}_{value.bits2}{'_l' + str(value.levels) if value.levels else ''}"
            f"{'_sym' if value.symmetric else ''}")
    staged = "" if key.kind == "kivi_keys" else _UNSTAGED_KEYS
    return KernelSource(
        name=name,
        input_names=inputs,
        output_names=("part_m", "part_l", "part_o"),
        body=_ATTEND_BODY,
        header=_HEADER,
        defines=staged + key.macro("KEY") + value.macro("VALUE"),
    )


# Backends where the tiled pass turns keys stored before RoPE (ROPE = 1; KIVI's rope=pre); elsewhere a rope=pre
# cache attends through the reference path, decoding its keys. The CPU emulator checks it against the reference in
# the tests; CUDA passed the GPU parity tests on the lent H200 (tests/test_kvcache_kernels.py, positions up to 33k,
# traditional and not), where the 4-bit level decodes at 98-103 % of its speed with keys after RoPE at 8k, 32k and
# 131k tokens once phase 1 took runs of tokens (benchmarks/results/decode-runs4-rope-h200.json).
# Metal runs the same body; its only text of its own is the prelude's SINCOS_PI, RINT and FMA (MSL's precise
# sin/cos, rint, fma): as with every other kernel here it is enabled by construction, not by a measurement (no Mac
# here: the GPU parity test runs on one).
ROPE_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")

# Backends where the tiled pass turns keys stored before RoPE a run at a time (template define ROPE_STEP, see
# `_TILED_BODY`): one sine and cosine a pair and run of TILED_RUN tokens, the run's other tokens turned by the pair's
# step; phase 1 of the levels with keys before RoPE spends most of its instructions on the angles. Off everywhere until
# a GPU times it, the emulator included, so the emulator's tests run what CUDA and Metal run; its own tests let the
# emulator in (its later tokens' angles are not the reference's float32 products, within their rounding:
# benchmarks/rope_step_error.py, at most 0.0074 rad and 3.1e-4 on an attention's output at 131k positions).
ROPE_STEP_BACKENDS: tuple[str, ...] = ()

# Backends where the tiled pass adds KIVI's block outliers (KO = 1; option key_outliers) to its scores; elsewhere such a
# cache attends through the reference path (quantized_matmul plus one scatter-add of q_c·residual per block). The CPU
# emulator checks it against the reference in the tests; CUDA passed the GPU parity test on the lent H200
# (tests/test_kvcache_kernels.py::test_decode_kernel_adds_key_outliers: keys as given and before RoPE, traditional or
# not, 1,000 to 33,000 tokens; 2026-12-02, commit 0ffe363, kernel-parity-outliers-h200.log), where the 3-bit candidate
# of issue 12 decoded at 0.88x/0.76x/0.64x of fp16 at 8k/32k/131k against 0.95x/0.76x/0.71x for the same cache without
# outliers (benchmarks/results/decode-outliers-h200.json); rerun with scale-only values read from the store's own
# scales (Codec.symmetric; commit b1a19da, 26 passed, kernel-parity-symmetric-h200.log). Metal runs the same body; its
# only text of its own is the prelude's SHARED_ADD (a compare-and-swap loop): enabled by construction, as every kernel.
OUTLIER_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")

# Backends where the tiled pass reads key channels at different widths (KCLS > 0; KIVI's key_widths); elsewhere such a
# cache attends through the reference path (one quantized_matmul per width on the gathered query). The CPU emulator
# checks it against the reference in the tests (tests/test_kvcache_kernel_emulation.py); CUDA passed the GPU parity
# test on the lent H200 (tests/test_kvcache_kernels.py::test_decode_kernel_reads_key_widths: two class layouts, 1,000
# to 33,000 tokens, with the single-width tiled tests rerun; 69 passed, kernel-parity-widths-h200.log), where the
# 3-bit layout with widths decoded at 0.74x/0.63x/0.51x of fp16 at 8k/32k/131k against 0.81x/0.75x/0.67x for the
# same layout without them (benchmarks/results/decode-key-widths-h200.json). Changed since, on the emulator's word: the
# key blocks per row counted from the capacity (a layer without its narrowest class), keys before RoPE (admitted by
# WIDTH_ROPE_BACKENDS only) and the uniform phase 1 (WIDTH_UNIFORM_RUNS, off). Metal runs the same body: enabled by
# construction, as every kernel here.
WIDTH_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")

# Backends where the kernels read a class of 1-bit key channels (key_widths at 2 key bits, widths 1-4; KBLO 1). The CPU
# emulator checks both kernels against the reference at that layout. The H200's first parity run of it failed, its
# caches having been filled through MLX's CUDA `mx.quantize`, which returns zeros at 1 bit; with 1-bit codes packed by
# Velox (methods/affine.py ONE_BIT) every key-widths parity test passed there on 2026-12-03, widths 1-4 and 2-5, as
# given and before RoPE, tiled pass and history decode, up to 33,000 tokens (kernel-parity-widths-r5-h200.log: 51
# passed), and the 2-bit layout with widths decoded the 8B shape at 8k/32k/131k (decode-key-widths-r6-h200.json).
# Metal runs the same body: enabled by construction, as every kernel here. KIVI.gpu_unverified leaves such layouts out
# of the level rule where no GPU backend is here.
ONE_BIT_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")

# Backends where the tiled pass and the history decode turn key channels at different widths stored before RoPE (KCLS
# with ROPE: each channel of a pair read at its row and its class's width); elsewhere such a cache attends through the
# reference path, and rope=auto keeps keys at different widths as given. The CPU emulator checks both kernels against
# the reference in the tests (tests/test_kvcache_kernel_emulation.py); CUDA passed the GPU parity tests on the lent
# H200 (kernel-parity-widths-r5-h200.log) and decoded and prefilled the 8B shape at 32k with them
# (decode-key-widths-r6-h200.json). There the 4-bit layout decoded slower before RoPE than as given (0.72x/0.68x/0.56x
# of fp16 at 8k/32k/131k against 0.96x/0.88x/0.73x in the same run), which is why the 4- and 3-bit levels keep their
# keys as given (no rope=auto; engine/planning/recommend.py) and only the 2-bit level, which needs the quality, stores
# them before RoPE. Metal runs the same body: enabled by construction, as every kernel here.
WIDTH_ROPE_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")

# Key widths, keys as given: phase 1 of the tiled pass in its uniform form (template KUNI: every channel of a slice in
# one loop, its width read at run time) rather than class by class at compile-time widths (the measured default:
# decode-key-widths-h200.json); benchmarks/decode.py times both with `#WIDTH_UNIFORM_RUNS=true`.
WIDTH_UNIFORM_RUNS = False

# The tiled pass (`_TILED_BODY`) for the KIVI-keys + affine-values pair; False selects the per-subgroup pass for
# them too (kept for comparison: benchmarks/decode_profile.py --sweep times both).
TILED = True


@functools.cache
def tiled_source() -> KernelSource:
    """The tiled attention pass (KIVI keys, affine values); code widths are template arguments KB and VB."""
    inputs = (
        "qry", "qscale", "sink_k", "sink_v", "win_k", "win_v", "n_comp_r", "n_win_r",
        "k0", "k1", "k2", "v0", "v1", "v2", "grids", "rfreq", "kout", "kidx", *TILED_WIDTH_INPUTS,
    )
    return KernelSource(
        name="velox_decode_tiled_kivi_affine",
        input_names=inputs,
        output_names=("part_m", "part_l", "part_o"),
        body=_TILED_BODY,
        header=_HEADER,
    )


def tiled_declines(backend: str | None) -> str | None:
    """Why the tiled pass cannot run on `backend` (None: it can): on Metal, were it to take more buffer arguments
    than a kernel gets (30 of 31 now; tests/metal_model.py counts every launch's). Where it declines, plain KIVI
    takes the per-subgroup pass (`attend_source`) and the layouts only the tiled pass reads (key widths, keys before
    RoPE, key outliers: the app's levels) the reference path."""
    return over_buffer_limit(tiled_source(), backend)


def tiled_tile(key: Codec, value: Codec, group_size: int, head_dim: int, key_block: int | None,
               rows: int, max_tile: int | None = None, shared_limit: int | None = None) -> int | None:
    """CT of the tiled pass for this pair and layout with `rows` query rows per kv head, or None where it does
    not apply (see `_TILED_BODY`). The tile starts at `max_tile` (TILED_MAX_TILE) and is halved until the pass's
    threadgroup memory fits `shared_limit` (TILED_SHARED_LIMIT)."""
    if not TILED or key.kind != "kivi_keys" or value.kind != "affine":
        return None
    if (key.grid and key.bits > 4) or (value.grid and value.bits > 4):
        return None  # a grid's table holds at most 16 levels
    threads = threads_for(head_dim)
    token_groups = threads // (head_dim // 8)
    block = key_block or group_size
    tile = min(max_tile or TILED_MAX_TILE, block)
    limit = shared_limit or TILED_SHARED_LIMIT
    while True:
        if threads % tile or tile % token_groups or block % tile or any((tile * w) % 32 for w in (key.bits, *key.widths)):
            return None
        # Phase 1 gives each thread a run of TILED_RUN tokens and a slice of the channels (TT, RUNS, SLICES),
        # whole channel pairs where keys are stored before RoPE.
        runs = tile // TILED_RUN
        if tile % TILED_RUN or threads % runs or (head_dim // 2) % (threads // runs):
            return None
        shared = tiled_shared_bytes(head_dim, rows, threads, tile, key.widest, value.bits, group_size, key.outliers,
                                    bool(key.widths))
        if shared <= limit:
            return tile
        tile //= 2
        if tile < TILED_MIN_TILE:
            return None


def tiled_shared_bytes(head_dim: int, rows: int, threads: int, tile: int, key_bits: int, value_bits: int,
                       group_size: int, outliers: bool = False, widths: bool = False) -> int:
    """Bytes of threadgroup memory the tiled pass declares (`_TILED_BODY`'s SHARED arrays, all 4-byte; an upper
    bound: the compiler drops what a variant never reads, e.g. the RoPE angles)."""
    d, r, nt, ct = head_dim, rows, threads, tile
    key_words = ct * key_bits // 32
    key_row = key_words + (0 if key_words % 2 else 1)                                  # KWP
    runs = ct // TILED_RUN
    slices = nt // runs
    padded = ct + (ct + 31) // 32                                                      # CTP
    parts = max(slices // (32 // min(runs, 32)), nt // ct)                            # NH
    part = r * padded                                                                  # SS
    words = (
        d * r                                       # sh_q
        + d * r + d // 2 + 4                        # sh_qs
        + 2 * d + d // 2                            # sh_kb, sh_ks, sh_rf
        + d * key_row + 1                           # sh_kw
        + ct * d * value_bits // 32 + 1             # sh_vw
        + 2 * ct * (d // group_size)                # sh_vs, sh_vb
        + max(parts * part, (nt // (d // 8)) * d)   # sh_s (also the token groups' outputs)
        + ct * r                                    # sh_p
        + 3 * r + 32                                # sh_m, sh_l, sh_corr, the two grids
        + (r * ct if outliers else 0)               # sh_ox (declared with 1 element without KO, never read)
        + (d if widths else 1)                      # sh_ord
    )
    return 4 * words


# Backends where the sketch codecs (turboquant_prod's and qjl's keys) run; elsewhere those caches attend through the
# reference path. The CPU emulator checks them against the reference (tests/test_kvcache_kernel_emulation.py); CUDA
# passed the GPU parity test on the lent H200 (tests/test_kvcache_kernels.py::test_decode_kernel_reads_sketched_keys,
# now ..._and_polar_angles; 70 and 4,097 tokens, head_dim 128 and 64), where a whole-model decode step at 8k / 32k tokens took 52 / 59 ms for
# turboquant_prod:k4v4 and 23 / 39 ms for qjl:k4v4 against 138 / 359 and 88 / 192 ms through the reference
# (benchmarks/results/decode-sketch-h200.json). Metal runs the same body (nothing in its prelude the other codecs do
# not use): enabled by construction, as every kernel here.
SKETCH_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")


# Backends where the vq codec (product VQ) runs; elsewhere vq caches attend through their lookup-table path. The CPU
# emulator checks it against the reference (tests/test_kvcache_kernel_emulation.py); CUDA passed the GPU parity test
# on the lent H200 (tests/test_kvcache_kernels.py::test_decode_kernel_reads_vq_codes: 1-4 bits, 70 and 4,097 tokens;
# 2026-12-02, commit ba40b06). Metal runs the same body: enabled by construction, as every kernel here.
VQ_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")

# Backends where the polar codec (PolarQuant) runs; elsewhere polarquant caches attend through the reference path.
# The CPU emulator checks it against the reference (tests/test_kvcache_kernel_emulation.py); CUDA passed the GPU
# parity tests on the lent H200 (test_decode_kernel_reads_sketched_keys_and_polar_angles, 2-4 bits, 70 and 4,097
# tokens; test_history_decode_kernel_matches_reference; 2026-12-02, commit ba40b06), where a whole-model step of
# polarquant:k4v4 took 135 / 151 ms at 8k / 32k against 231 / 346 through the reference, and a 32k prefill ran at
# 5,183 tok/s against 3,810 (benchmarks/results/decode-sketch-encode-polar-h200.json). Metal runs the same body.
POLAR_BACKENDS: tuple[str, ...] = ("emulate", "cuda", "metal")


def unverified_on(codec: Codec, backend: str | None) -> str | None:
    """Why `codec` may not run on `backend` yet (a kind whose parity run there has not passed: SKETCH_BACKENDS,
    VQ_BACKENDS, POLAR_BACKENDS, WIDTH_BACKENDS, read at call time so a run can set them), or None (also for an
    unknown backend)."""
    if (codec.widths or codec.outliers) and (declined := tiled_declines(backend)) is not None:
        return declined  # only the tiled pass reads them
    if codec.widths and backend is not None and backend not in WIDTH_BACKENDS:
        return "the decode kernel's key widths (key_widths) have not passed the parity tests on this backend yet"
    if codec.widths and min(codec.widths) == 1 and backend is not None and backend not in ONE_BIT_BACKENDS:
        return "the decode kernel's 1-bit key channels (key_widths at 2 bits) have not passed the parity tests here yet"
    backends = {"prod": SKETCH_BACKENDS, "qjl": SKETCH_BACKENDS, "vq": VQ_BACKENDS, "polar": POLAR_BACKENDS}.get(
        codec.kind)
    if backends is None or backend is None or backend in backends:
        return None
    return f"the decode kernel's {codec.kind} codec has not passed the parity tests on this backend yet"


def sketch_declines(key: Codec, head_dim: int, rows: int, backend: str | None) -> str | None:
    """Why the attention pass cannot read sketched keys (`key` a SKETCH_KINDS codec) here, or None: the backend
    must have passed the parity tests (`unverified_on`), and with the sketched query rows (R·SK·D floats) the
    pass's threadgroup memory must stay under TILED_SHARED_LIMIT (the bound an Apple GPU sets)."""
    unverified = unverified_on(key, backend)
    if unverified is not None:
        return unverified
    sketch = key.bits if key.kind == "qjl" else 1  # SK
    groups = threads_for(head_dim) // (head_dim // 8)  # NSG
    # sh_q, sh_kc, sh_q2, sh_m, sh_l, sh_o of `_ATTEND_BODY` (4-byte words), and the centroid tables staged (the
    # keys' where they have codes, a value codec's at most 2^8)
    words = rows * head_dim + rows + 1 + rows * sketch * head_dim + 2 * groups * rows + groups * head_dim
    words += (1 << key.bits if key.kind == "prod" else 0) + (1 << 8)
    if 4 * words > TILED_SHARED_LIMIT:
        return (f"the decode kernel's sketched queries need more threadgroup memory than {TILED_SHARED_LIMIT} bytes at "
                f"{rows} query heads per kv head")
    return None


def head_dim_supported(head_dim: int) -> bool:
    """head_dim = 8·TPT with TPT a power of two dividing 32 (lanes of one token sit in one warp)."""
    lanes = head_dim // 8
    return head_dim % 8 == 0 and 0 < lanes <= 32 and lanes & (lanes - 1) == 0


def group_supported(group_size: int) -> bool:
    """Each lane's 8 channels must sit in one scale group."""
    return group_size % 8 == 0


def threads_for(head_dim: int) -> int:
    """Threads per threadgroup of the attention pass."""
    return max(THREADS, head_dim)


def tile_tokens(key: Codec, group_size: int, head_dim: int, key_block: int | None = None) -> int | None:
    """CT: compressed tokens per tile (splits are whole tiles); None where no tile fits the layout.

    A tile must hold whole iterations (UNROLL tokens per subgroup); staged KIVI keys also need a tile
    inside one key block (`key_block`, default the group size: one scale per channel) and of at most 64
    tokens (shared memory).
    """
    if key.grid or key.widths:
        return None  # only the tiled pass reads codes on a grid, or key widths
    per_iteration = UNROLL * threads_for(head_dim) // (head_dim // 8)
    tile = min(key_block or group_size, 64) if key.kind == "kivi_keys" else 64
    if tile % per_iteration or tile % 8:
        return None
    return tile


def split_count(n_compressed: int, n_rows: int, tile: int, target_groups: int | None = None) -> int:
    """Splits of the compressed tokens: about `target_groups` threadgroups (default TARGET_GROUPS) to fill
    the GPU, at least MIN_SPLIT_TOKENS each, whole tiles each, and no split left empty."""
    tiles = max(1, math.ceil(n_compressed / tile))
    by_tokens = max(1, math.ceil(n_compressed / MIN_SPLIT_TOKENS))
    by_groups = max(1, (target_groups or TARGET_GROUPS) // max(1, n_rows))
    wanted = max(1, min(tiles, by_tokens, by_groups, MAX_SPLITS))
    per_split = math.ceil(tiles / wanted)
    return math.ceil(tiles / per_split)


# The launches' constant inputs, each built once (no host-to-device upload per step), by what they are.
_CONSTANTS: dict[tuple[Any, ...], Any] = {}


def _constant(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """The constant input `make()` builds, built the first time `key` is asked for."""
    value = _CONSTANTS.get(key)
    if value is None:
        value = _CONSTANTS[key] = make()
    return value


def _scale_array(scale: float) -> mx.array:
    # One per scale value (one per model). [scale, 1.0, ...]: the tiled pass takes 1.0 from memory (unit_code); 8
    # elements keep Metal from passing it in the constant space.
    return _constant(("scale", scale), lambda: mx.array([scale] + [1.0] * 7, dtype=mx.float32))


def _no_grid() -> mx.array:
    """The tiled pass's grid input for a role without a grid (read into shared memory, never used)."""
    return _constant(("grid",), lambda: mx.zeros((16,), dtype=mx.float32))


def _no_grids() -> mx.array:
    """The tiled pass's grids input where neither role has a grid (the keys' 16 levels, then the values')."""
    return _constant(("grids",), lambda: mx.zeros((32,), dtype=mx.float32))


def _no_outliers() -> tuple[mx.array, mx.array]:
    """The tiled pass's block-outlier inputs for keys without them (KO = 0: never read; 8 elements, see
    `_placeholder`)."""
    return _placeholder(mx.float16), _placeholder(mx.uint8)


def _dummy(head_dim: int, dtype: mx.Dtype) -> mx.array:
    """Stands in for an absent sink or window (never read: NS = 0, or a window count of 0); one per dtype and
    head_dim."""
    return _constant(("dense", head_dim, str(dtype)), lambda: mx.zeros((1, 1, 1, head_dim), dtype=dtype))


@dataclass(frozen=True)
class DecodePlan:
    """What a cache's decode steps launch, fixed while its compressed buffers stay the same arrays: the
    two kernels, the compressed arrays in codec order, and its compile-time constants (`constants`), which a call
    passes as template arguments (`template`) unless PLAN_CONSTANTS_IN_SOURCE compiled them into the kernel.
    Building it once per buffer growth keeps the per-step host work to the launch itself."""

    source: KernelSource  # the attention pass as `attend` was built from it (its plan's defines and constants in it)
    attend: object
    merge: object
    arrays: tuple[mx.array, ...]
    template: tuple[tuple[str, object], ...]
    constants: tuple[tuple[str, object], ...]
    tile: int
    threads: int
    target_groups: int
    sketch: bool = False  # the key codec reads a second, sketched query (SKETCH_KINDS)


# The key widths' inputs of the kernels reading KIVI keys (the tiled pass, the history decode), after the others: the
# classes' ends, the storage order and its inverse, and the codes of classes 1.. (class 0's are k0; the scales, biases
# and outliers of all classes are k1, k2, kout, kidx). The tiled pass gathers its channels through the order alone.
WIDTH_INPUTS = ("kends", "kord", "kinv", *(f"w{c}c" for c in range(1, MAX_WIDTH_CLASSES)))
TILED_WIDTH_INPUTS = tuple(name for name in WIDTH_INPUTS if name != "kinv")


def kivi_key_inputs(key_codec: Codec,
                    key_arrays: list[mx.array | None]) -> tuple[list[mx.array], list[mx.array], list[mx.array]]:
    """KIVI keys' arrays as the kernels take them: (codes, scales, biases), (outlier residuals, indices), and the
    WIDTH_INPUTS; with key widths the codes are class 0's; placeholders for what the layout lacks (never read)."""
    if key_codec.widths:
        return _width_inputs(key_codec, key_arrays)
    arrays: list[mx.array] = [a for a in key_arrays if a is not None]
    assert len(arrays) == len(key_arrays)
    outliers = list(arrays[-2:]) if key_codec.outliers else list(_no_outliers())
    widths = [_placeholder(mx.int32), _placeholder(mx.uint8), _placeholder(mx.uint8),
              *[_placeholder(arrays[0].dtype)] * (MAX_WIDTH_CLASSES - 1)]
    return arrays[:3], outliers, widths


def _width_inputs(key_codec: Codec,
                  key_arrays: list[mx.array | None]) -> tuple[list[mx.array], list[mx.array], list[mx.array]]:
    """`kivi_key_inputs` with key widths (`Codec.widths`): the ends, the order, its inverse, each class's codes (None
    where the layer has no channel of that width), then the classes' shared scales, biases (and outliers) as given;
    class 0's codes come first as k0, a placeholder for each class the layer lacks (and for absent outliers)."""
    classes = len(key_codec.widths)
    ends, order, inverse, *rest = key_arrays
    codes, shared = rest[:classes], rest[classes:]
    assert ends is not None and order is not None and inverse is not None
    if len(shared) != (4 if key_codec.outliers else 2) or any(a is None for a in shared):
        raise ValueError(f"Key widths {key_codec.widths} take each class's codes, then the scales, biases"
                         f"{' and outliers' if key_codec.outliers else ''} of all; got {len(rest)} arrays.")
    like = next(a for a in codes if a is not None)
    codes = [a if a is not None else _placeholder(like.dtype) for a in codes]
    codes += [_placeholder(like.dtype)] * (MAX_WIDTH_CLASSES - classes)
    outliers = list(shared[2:]) if key_codec.outliers else list(_no_outliers())
    return [codes[0], shared[0], shared[1]], outliers, [ends, order, inverse, *codes[1:]]


def width_ends(ends: tuple[int, ...]) -> mx.array:
    """Key widths: each class's end row in storage order as the tiled pass reads it (int32; one array per layout,
    built once, as the launch's other constants)."""
    return _constant(("ends", ends), lambda: mx.array(ends, dtype=mx.int32))


def _placeholder(dtype: mx.Dtype) -> mx.array:
    """Zeros of `dtype` for an input a launch never reads (a kernel's signature has its inputs' dtypes). Eight
    elements: MLX's Metal front end passes a smaller input in the `constant` address space (kernels/backend.py), and a
    kernel choosing between a class's arrays and a placeholder (`p = c == 0 ? k0 : w1c`) needs both in `device`."""
    return _constant(("placeholder", str(dtype)), lambda: mx.zeros((8,), dtype=dtype))


# The centroid tables each codebook codec reads (its array slot, its code width's attribute): all 2^bits of them are
# staged when STAGE_TABLES is on.
TABLE_SLOTS = {"codebook": ((2, "bits"),), "rvq": ((2, "bits"), (5, "bits2")), "prod": ((2, "bits"),)}


def staged_tables(source: KernelSource) -> KernelSource:
    """The per-subgroup pass `source` with its codecs' centroid tables staged in threadgroup memory (STAGE_TABLES)."""
    return replace(source, defines="#define STAGE_TABLES 1\n" + source.defines)


def rope_by_step(source: KernelSource) -> KernelSource:
    """The tiled pass `source` turning keys stored before RoPE a run of tokens at a time (ROPE_STEP)."""
    return replace(source, defines="#define ROPE_STEP 1\n" + source.defines)


def _tables_whole(codec: Codec, arrays: list[mx.array | None]) -> bool:
    """Whether each centroid table of `codec` in `arrays` holds an entry for every code (what staging copies)."""
    return all(arrays[slot] is not None and arrays[slot].size >= 1 << getattr(codec, width)
               for slot, width in TABLE_SLOTS.get(codec.kind, ()))


def choose_pass(key: Codec, value: Codec, group_size: int, head_dim: int, key_block: int | None, rows: int,
                backend: str | None, tokens: int = 0) -> tuple[KernelSource, int, bool] | None:
    """The attention pass a cache of this layout launches on `backend`: (its source, its tile, whether it is the tiled
    pass), or None where neither pass has a tile. The tiled pass where it has a tile and the backend builds it (the
    backend's long tile from `tokens` compressed slots, TILED_LONG_TILES), else the per-subgroup pass. plan_decode
    launches what this picks, and a cache asks it whether it can launch at all, so the two never disagree."""
    tiled = (tiled_tile(key, value, group_size, head_dim, key_block, rows)
             if tiled_declines(backend) is None else None)
    long_tile, long_limit, long_from = TILED_LONG_TILES.get(backend or "", (0, 0, 0))
    if tiled is not None and long_tile > tiled and tokens >= long_from:
        tiled = tiled_tile(key, value, group_size, head_dim, key_block, rows, long_tile, long_limit) or tiled
    if tiled is not None:
        return tiled_source(), tiled, True
    tile = tile_tokens(key, group_size, head_dim, key_block)
    return None if tile is None else (attend_source(key, value), tile, False)


def plan_decode(
    key_codec: Codec,
    key_arrays: list[mx.array | None],
    value_codec: Codec,
    value_arrays: list[mx.array],
    group_size: int,
    head_dim: int,
    rows: int,
    backend: str,
    key_block: int | None = None,
    rope: tuple[mx.array, bool] | None = None,
    tokens: int = 0,
) -> DecodePlan:
    """The DecodePlan of one cache (the caller checked `tile_tokens` is not None). `rope`: keys stored before
    RoPE (KIVI's rope=pre, full rotary), as (each channel pair's angle per position, float32 [D/2];
    traditional pairing), which only the tiled pass turns (the caller checked `tiled_tile`). `tokens`: the
    compressed slots the plan will read (the cache's capacity), which pick the backend's long tile where it has
    one (`choose_pass`)."""
    threads = threads_for(head_dim)
    chosen = choose_pass(key_codec, value_codec, group_size, head_dim, key_block, rows, backend, tokens)
    assert chosen is not None
    source, tile, tiled = chosen
    arrays = (*key_arrays, *value_arrays)
    if rope is not None and not tiled:
        raise ValueError("Only the tiled decode pass turns keys stored before RoPE.")
    if tiled:
        template = (("D", head_dim), ("R", rows), ("NT", threads), ("G", group_size),
                    ("GK", key_block or group_size), ("CT", tile), ("KB", key_codec.widest), ("VB", value_codec.bits),
                    ("KGRID", int(key_codec.grid)), ("VGRID", int(value_codec.grid)), ("PF", int(TILED_PREFETCH)),
                    ("TT", TILED_RUN),
                    ("ROPE", int(rope is not None)), ("TRAD", int(rope is not None and rope[1])),
                    ("KO", int(key_codec.outliers)), ("VSYM", int(value_codec.symmetric)),
                    ("KCLS", len(key_codec.widths)), ("KBLO", key_codec.widths[0] if key_codec.widths else key_codec.bits),
                    ("KUNI", int(WIDTH_UNIFORM_RUNS and bool(key_codec.widths))), ("KMEAN", key_codec.bits))
        head, outliers, widths = kivi_key_inputs(key_codec, key_arrays)
        # codes, scales, biases of each role, the two grids (one input, zeros where a role has none), the angles, the
        # keys' block outliers (placeholders without), then the key widths' inputs (the order, not its inverse)
        grids = (_no_grids() if not (key_codec.grid or value_codec.grid) else
                 mx.concatenate([key_arrays[3] if key_codec.grid else _no_grid(),
                                 value_arrays[3] if value_codec.grid else _no_grid()]))
        arrays = (*head, *value_arrays[:3], grids, _no_grid() if rope is None else rope[0], *outliers,
                  *(a for name, a in zip(WIDTH_INPUTS, widths, strict=True) if name in TILED_WIDTH_INPUTS))
    else:
        template = (("D", head_dim), ("R", rows), ("NT", threads), ("G", group_size),
                    ("GK", key_block or group_size), ("CT", tile), ("U", UNROLL))
    if (not tiled and backend in STAGED_TABLE_BACKENDS and _tables_whole(key_codec, key_arrays)
            and _tables_whole(value_codec, value_arrays)):
        source = staged_tables(source)
    if tiled and rope is not None and backend in ROPE_STEP_BACKENDS:
        source = rope_by_step(source)
    constants = tuple(template)
    if PLAN_CONSTANTS_IN_SOURCE:
        lines = "".join(f"constexpr int {name} = {int(value)};\n" for name, value in constants)
        source, template = replace(source, defines=lines + source.defines), ()
    return DecodePlan(
        source=source,
        attend=kernel(source, backend),
        merge=kernel(MERGE_SOURCE, backend),
        arrays=arrays,
        template=tuple(template),
        constants=constants,
        tile=tile,
        threads=threads,
        target_groups=TILED_TARGET_GROUPS if tiled else TARGET_GROUPS,
        sketch=key_codec.kind in SKETCH_KINDS,
    )


def decode_attention(
    plan: DecodePlan,
    queries: mx.array,
    n_kv: int,
    scale: float,
    sink: tuple[mx.array, mx.array] | None,
    window: tuple[mx.array, mx.array] | None,
    n_compressed: int,
    n_skipped: int = 0,
    out_signs: mx.array | None = None,
    sketched: mx.array | None = None,
    out_dtype: mx.Dtype | None = None,
) -> mx.array:
    """Attention of one query token per sequence over sink + compressed + window.

    `queries` [B, n_q_heads, 1, D] (query head h attends with kv head h // (n_q_heads / n_kv), so the rows
    of one kv head are consecutive: no reshape is needed); returns the same shape, in `out_dtype` if given (the
    model's dtype where the method's queries are float32 after its transform: the merge pass casts, not a launch
    of its own), else the queries' dtype.
    `sink`/`window` are 16-bit (keys, values) [B, n_kv, n, D] holding exactly their tokens; the compressed
    arrays in the plan are the cache's whole buffers (capacity >= n_compressed tokens: only the first
    n_compressed are read, and passing the buffers rather than views avoids a copy of the history a step).
    The first `n_skipped` compressed tokens are not attended (copies of the sinks kept in a block stream).
    `out_signs` (float32 [D], see `Rotation.sylvester_inverse_signs`): the merge pass also rotates the output
    back, signs ⊙ H·out / sqrt(D), instead of the caller (in float32, before the cast to the queries' dtype).
    `sketched` [B, n_q_heads, 1, SK·D] (float32): the sketched queries a plan with sketched keys reads (`plan.sketch`),
    sqrt(π/2)/m · S q in the method's own space, scaled by `scale` in the kernel like the queries.
    """
    if plan.sketch != (sketched is not None):
        raise ValueError("A plan for sketched keys needs the sketched queries, and only such a plan takes them.")
    batch, n_heads, _, head_dim = queries.shape
    rows = n_heads // n_kv
    present = sink if sink is not None else window
    dense = mx.bfloat16 if present is None else present[0].dtype
    sink_k, sink_v = sink if sink is not None else (_dummy(head_dim, dense), _dummy(head_dim, dense))
    win_k, win_v = window if window is not None else (_dummy(head_dim, dense), _dummy(head_dim, dense))
    n_sink = 0 if sink is None else sink[0].shape[-2]
    bh = batch * n_kv
    splits = split_count(n_compressed, bh, plan.tile, plan.target_groups)
    threads = plan.threads

    part_m, part_l, part_o = plan.attend(
        inputs=[queries, *(() if sketched is None else (sketched,)), _scale_array(scale), sink_k, sink_v, win_k, win_v,
                RULER(n_compressed), RULER(0 if window is None else window[0].shape[-2]), *plan.arrays],
        template=[*plan.template, ("CS", n_skipped), ("NS", n_sink), ("TD", dense)],
        grid=(splits * threads, bh, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(bh, splits, rows), (bh, splits, rows), (bh, splits, rows, head_dim)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    merge_threads = max(32, head_dim)
    (out,) = plan.merge(
        inputs=[part_m, part_l, part_o, _scale_array(1.0) if out_signs is None else out_signs,
                _scale_array(1.0 / math.sqrt(head_dim))],
        template=[("D", head_dim), ("R", rows), ("NM", merge_threads), ("MAXS", MAX_SPLITS),
                  ("ROT", int(out_signs is not None)), ("TO", out_dtype or queries.dtype)],
        grid=(bh * rows * merge_threads, 1, 1),
        threadgroup=(merge_threads, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[out_dtype or queries.dtype],
    )
    return out
