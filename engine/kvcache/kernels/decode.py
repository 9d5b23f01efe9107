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
from dataclasses import dataclass

import mlx.core as mx

from engine.kvcache.kernels.backend import RULER, KernelSource, kernel

# Threads per threadgroup of the attention pass (head_dim if larger: the merge gives each of the first
# head_dim threads one output channel); a multiple of the subgroup width D/8.
THREADS = 128
# A split takes at least this many tokens (fewer and the merge pass costs more than it saves)...
MIN_SPLIT_TOKENS = 128
# ...and the grid aims at this many threadgroups (~8 per multiprocessor of a 132-SM H200; enough to
# keep memory busy on smaller GPUs too).
TARGET_GROUPS = 1024
MAX_SPLITS = 256

# How 8 consecutive channels [lane*8, lane*8 + 8) of compressed token `c` are read into float `out[8]`,
# with `mul` the per-token factor (a norm) that multiplies the score or the softmax weight. `P` is the
# input prefix (k or v) and `BITS`/`BITS2` the code widths; `bh` and `lane` are the body's variables.
_CODEC_MACROS = {
    # Per-token groups of G channels (MLX affine quantization): codes [B,H,cap,D·bits/32], scales and
    # biases [B,H,cap,D/G]. x = scale·code + bias.
    "affine": """
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const long row_ = (long)bh * {P}0_shape[2] + (c); \\
  unpack8({P}0 + row_ * {P}0_shape[3], lane * 8, {BITS}, out); \\
  const long g_ = row_ * {P}1_shape[3] + (lane * 8) / G; \\
  const float s_ = (float){P}1[g_]; \\
  const float b_ = (float){P}2[g_]; \\
  for (int i_ = 0; i_ < 8; ++i_) out[i_] = s_ * out[i_] + b_; \\
  mul = 1.0f; }}
""",
    # KIVI keys: per channel, over blocks of G tokens, stored transposed: codes [B,H,D,cap·bits/32],
    # scales and biases [B,H,D,cap/G]. Each of the 8 channels is its own row; neighbouring subgroups read
    # the neighbouring tokens of the same words, so the words come from DRAM once.
    "kivi_keys": """
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const int bit_ = (c) * {BITS}; \\
  const int w_ = bit_ >> 5; \\
  const int sh_ = bit_ & 31; \\
  for (int i_ = 0; i_ < 8; ++i_) {{ \\
    const long d_ = (long)bh * D + lane * 8 + i_; \\
    const GLOBAL U32* row_ = {P}0 + d_ * {P}0_shape[3]; \\
    U32 v_ = row_[w_] >> sh_; \\
    if (sh_ + {BITS} > 32) v_ |= row_[w_ + 1] << (32 - sh_); \\
    const long g_ = d_ * {P}1_shape[3] + (c) / G; \\
    out[i_] = (float){P}1[g_] * (float)(v_ & ((1u << {BITS}) - 1u)) + (float){P}2[g_]; }} \\
  mul = 1.0f; }}
""",
    # TurboQuant: codes [B,H,cap,D·bits/32] of a rotated unit vector, norms [B,H,cap,1], centroids [>=8].
    "codebook": """
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const long row_ = (long)bh * {P}0_shape[2] + (c); \\
  unpack8({P}0 + row_ * {P}0_shape[3], lane * 8, {BITS}, out); \\
  for (int i_ = 0; i_ < 8; ++i_) out[i_] = {P}2[(int)out[i_]]; \\
  mul = (float){P}1[row_]; }}
""",
    # RVQ: first-stage codes, norms, first table, residual codes, residual scales [B,H,cap,1], second table:
    # x = norm · (c1[code1] + s · c2[code2]).
    "rvq": """
#define LOAD_{ROLE}(c, out, mul) {{ \\
  const long row_ = (long)bh * {P}0_shape[2] + (c); \\
  float r_[8]; \\
  unpack8({P}0 + row_ * {P}0_shape[3], lane * 8, {BITS}, out); \\
  unpack8({P}3 + row_ * {P}3_shape[3], lane * 8, {BITS2}, r_); \\
  const float rs_ = (float){P}4[row_]; \\
  for (int i_ = 0; i_ < 8; ++i_) out[i_] = {P}2[(int)out[i_]] + rs_ * {P}5[(int)r_[i_]]; \\
  mul = (float){P}1[row_]; }}
""",
}
_CODEC_SLOTS = {"affine": 3, "kivi_keys": 3, "codebook": 3, "rvq": 6}

_HEADER = """
// Codes [first, first + 8) of a row packed as a little-endian bit stream of `bits`-bit codes (MLX's affine
// packing, also Velox's pack_bits): at most two 32-bit words, since first·bits is a multiple of 8 and
// 8·bits <= 64 for every width but 7.
INLINE void unpack8(const GLOBAL U32* row, int first, int bits, THREAD float* out) {
  const int bit = first * bits;
  const int w = bit >> 5;
  const int sh = bit & 31;
  U64 x = (U64)row[w];
  if (sh + 8 * bits > 32) x |= ((U64)row[w + 1]) << 32;
  x >>= sh;
  const U64 mask = (((U64)1) << bits) - 1;
  for (int i = 0; i < 8; ++i) out[i] = (float)((x >> (i * bits)) & mask);
}
"""

# The attention pass. Template ints: D (head_dim), R (query rows per kv head), NT (threads), G (group).
_ATTEND_BODY = """
  constexpr int TPT = D / 8;          // lanes per token
  constexpr int NSG = NT / TPT;       // tokens in flight per threadgroup
  const int lane = TID % TPT;
  const int sg = TID / TPT;
  const int bh = GROUP_Y;
  const int n_sink = n_sink_r_shape[0] - 1;
  const int n_comp = n_comp_r_shape[0] - 1;
  const int n_win = n_win_r_shape[0] - 1;
  const int n_total = n_sink + n_comp + n_win;
  const int per_split = (n_total + GROUPS_X - 1) / GROUPS_X;
  const int t_begin = GROUP_X * per_split;
  const int t_end = (t_begin + per_split < n_total) ? t_begin + per_split : n_total;

  // The R query rows of this kv head, scaled, in shared memory (read as broadcasts; keeping them in
  // registers cost 32 more registers a thread and halved the threadgroups a multiprocessor holds).
  SHARED float sh_q[R * D];
  const float scale = qscale[0];
  for (int i = TID; i < R * D; i += NT) sh_q[i] = scale * (float)qry[(long)bh * R * D + i];
  float m_run[R];
  float l_run[R];
  float o_acc[R][8];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 8; ++i) o_acc[r][i] = 0.0f;
    m_run[r] = -1e30f;   // finite: exp(m_run - m_new) must be 0, not NaN, on the first token
    l_run[r] = 0.0f;
  }
  BARRIER();
  const long sink_base = (long)bh * sink_k_shape[2] * D + lane * 8;
  const long win_base = (long)bh * win_k_shape[2] * D + lane * 8;

  // Each subgroup takes UNROLL tokens per iteration and issues all their loads before any arithmetic,
  // so more bytes are in flight per thread (decode attention is bound by memory latency x parallelism).
  // Every thread runs the same number of iterations (t_begin/t_end are per threadgroup), so the lane
  // shuffles below are reached by whole warps / simdgroups.
  constexpr int UNROLL = 2;
  for (int base = t_begin; base < t_end; base += UNROLL * NSG) {
    float kx[UNROLL][8];
    float vx[UNROLL][8];
    float kmul[UNROLL];
    float vmul[UNROLL];
    bool valid[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * NSG + sg;
      valid[u] = t < t_end;
      kmul[u] = 1.0f;
      vmul[u] = 1.0f;
      if (!valid[u]) {
        for (int i = 0; i < 8; ++i) { kx[u][i] = 0.0f; vx[u][i] = 0.0f; }
      } else if (t < n_sink) {
        const long off = sink_base + (long)t * D;
        for (int i = 0; i < 8; ++i) { kx[u][i] = (float)sink_k[off + i]; vx[u][i] = (float)sink_v[off + i]; }
      } else if (t < n_sink + n_comp) {
        const int c = t - n_sink;
        LOAD_KEY(c, kx[u], kmul[u]);
        LOAD_VALUE(c, vx[u], vmul[u]);
      } else {
        const long off = win_base + (long)(t - n_sink - n_comp) * D;
        for (int i = 0; i < 8; ++i) { kx[u][i] = (float)win_k[off + i]; vx[u][i] = (float)win_v[off + i]; }
      }
    }
    // Scores of the UNROLL tokens first, then one rescale of the running output per row for all of them
    // (not one per token) and one exp per token and row.
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s[UNROLL];
      float m_new = m_run[r];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float part = 0.0f;
        for (int i = 0; i < 8; ++i) part += sh_q[r * D + lane * 8 + i] * kx[u][i];
        for (int step = TPT / 2; step > 0; step >>= 1) part += LANE_XOR(part, step);
        s[u] = valid[u] ? part * kmul[u] : -1e30f;
        m_new = FMAX(m_new, s[u]);
      }
      const float corr = EXP(m_run[r] - m_new);
      l_run[r] *= corr;
      for (int i = 0; i < 8; ++i) o_acc[r][i] *= corr;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const float p = valid[u] ? EXP(s[u] - m_new) : 0.0f;
        l_run[r] += p;
        const float pv = p * vmul[u];
        for (int i = 0; i < 8; ++i) o_acc[r][i] += pv * vx[u][i];
      }
      m_run[r] = m_new;
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

# The merge pass: one threadgroup per query row (bh·R + r), one thread per channel.
_MERGE_BODY = """
  const int row = GROUP_X;
  const int bh = row / R;
  const int r = row % R;
  const int splits = part_m_shape[1];
  float big = -1e30f;
  for (int s = 0; s < splits; ++s) big = FMAX(big, part_m[((long)bh * splits + s) * R + r]);
  float numerator = 0.0f;
  float denominator = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const long at = ((long)bh * splits + s) * R + r;
    const float w = EXP(part_m[at] - big);
    numerator += w * part_o[at * D + TID];
    denominator += w * part_l[at];
  }
  out[(long)row * D + TID] = static_cast<TO>(numerator / denominator);
"""

MERGE_SOURCE = KernelSource(
    name="velox_decode_merge",
    input_names=("part_m", "part_l", "part_o"),
    output_names=("out",),
    body=_MERGE_BODY,
)


@dataclass(frozen=True)
class Codec:
    """How the compressed arrays of one role (keys or values) are read: a kind and its code widths."""

    kind: str
    bits: int
    bits2: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _CODEC_MACROS:
            raise ValueError(f"Unknown codec kind {self.kind!r}; known are {', '.join(_CODEC_MACROS)}.")

    @property
    def slots(self) -> int:
        """How many arrays this codec reads (see `_CODEC_MACROS` for their order)."""
        return _CODEC_SLOTS[self.kind]

    def macro(self, role: str) -> str:
        prefix = "k" if role == "KEY" else "v"
        return _CODEC_MACROS[self.kind].format(ROLE=role, P=prefix, BITS=self.bits, BITS2=self.bits2)

    @property
    def supported(self) -> bool:
        """Code widths `unpack8` reads in at most two words (all but 7 bits; 1-8 bits)."""
        widths = (self.bits, self.bits2) if self.kind == "rvq" else (self.bits,)
        return all(1 <= b <= 8 and b != 7 for b in widths)


@functools.cache
def attend_source(key: Codec, value: Codec) -> KernelSource:
    """The attention pass for one (key codec, value codec) pair: the shared body with the two macros."""
    inputs = (
        "qry", "qscale", "sink_k", "sink_v", "win_k", "win_v", "n_sink_r", "n_comp_r", "n_win_r",
        *(f"k{i}" for i in range(key.slots)),
        *(f"v{i}" for i in range(value.slots)),
    )
    name = f"velox_decode_{key.kind}{key.bits}_{key.bits2}_{value.kind}{value.bits}_{value.bits2}"
    return KernelSource(
        name=name,
        input_names=inputs,
        output_names=("part_m", "part_l", "part_o"),
        body=_ATTEND_BODY,
        header=_HEADER,
        defines=key.macro("KEY") + value.macro("VALUE"),
    )


def head_dim_supported(head_dim: int) -> bool:
    """head_dim = 8·TPT with TPT a power of two dividing 32 (lanes of one token sit in one warp)."""
    lanes = head_dim // 8
    return head_dim % 8 == 0 and 0 < lanes <= 32 and lanes & (lanes - 1) == 0


def group_supported(group_size: int) -> bool:
    """Each lane's 8 channels must sit in one scale group."""
    return group_size % 8 == 0


def split_count(n_tokens: int, n_rows: int) -> int:
    """Splits of the token axis: enough threadgroups to fill the GPU, at least MIN_SPLIT_TOKENS each."""
    by_tokens = max(1, math.ceil(n_tokens / MIN_SPLIT_TOKENS))
    by_groups = max(1, TARGET_GROUPS // max(1, n_rows))
    return max(1, min(by_tokens, by_groups, MAX_SPLITS))


_SCALES: dict[float, mx.array] = {}
_DUMMIES: dict[tuple[int, str], mx.array] = {}


def _scale_array(scale: float) -> mx.array:
    # Built once per scale value (one per model): no host-to-device upload per step.
    array = _SCALES.get(scale)
    if array is None:
        array = _SCALES[scale] = mx.full((8,), scale, dtype=mx.float32)
    return array


def _dummy(head_dim: int, dtype: mx.Dtype) -> mx.array:
    """Stands in for an empty sink or window (never read: its count is 0); one per dtype and head_dim."""
    key = (head_dim, str(dtype))
    array = _DUMMIES.get(key)
    if array is None:
        array = _DUMMIES[key] = mx.zeros((1, 1, 1, head_dim), dtype=dtype)
    return array


def decode_attention(
    queries: mx.array,
    scale: float,
    sink: tuple[mx.array, mx.array] | None,
    window: tuple[mx.array, mx.array] | None,
    n_compressed: int,
    key_codec: Codec,
    key_arrays: list[mx.array],
    value_codec: Codec,
    value_arrays: list[mx.array],
    group_size: int,
    backend: str,
    out_dtype: mx.Dtype | None = None,
) -> mx.array:
    """Attention of grouped queries [B, n_kv, R, D] over sink + compressed + window; returns [B, n_kv, R, D].

    `sink`/`window` are 16-bit (keys, values) [B, n_kv, n, D] holding exactly their tokens; the compressed
    arrays are the cache's whole buffers (capacity >= n_compressed tokens: only the first n_compressed are
    read, and passing the buffers rather than views of them avoids a copy of the history per step).
    `group_size` is the config's: channels per scale of affine codes, tokens per scale of KIVI keys.
    """
    batch, n_kv, rows, head_dim = queries.shape
    present = sink if sink is not None else window
    dense = mx.bfloat16 if present is None else present[0].dtype
    n_sink = 0 if sink is None else sink[0].shape[-2]
    n_win = 0 if window is None else window[0].shape[-2]
    sink_k, sink_v = sink if sink is not None else (_dummy(head_dim, dense), _dummy(head_dim, dense))
    win_k, win_v = window if window is not None else (_dummy(head_dim, dense), _dummy(head_dim, dense))
    n_total = n_sink + n_compressed + n_win
    bh = batch * n_kv
    splits = split_count(n_total, bh)
    threads = max(THREADS, head_dim)
    out_dtype = out_dtype or queries.dtype

    attend = kernel(attend_source(key_codec, value_codec), backend)
    part_m, part_l, part_o = attend(
        inputs=[
            queries, _scale_array(scale), sink_k, sink_v, win_k, win_v,
            RULER(n_sink), RULER(n_compressed), RULER(n_win), *key_arrays, *value_arrays,
        ],
        template=[("D", head_dim), ("R", rows), ("NT", threads), ("G", group_size)],
        grid=(splits * threads, bh, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(bh, splits, rows), (bh, splits, rows), (bh, splits, rows, head_dim)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    merge = kernel(MERGE_SOURCE, backend)
    (out,) = merge(
        inputs=[part_m, part_l, part_o],
        template=[("D", head_dim), ("R", rows), ("TO", out_dtype)],
        grid=(bh * rows * head_dim, 1, 1),
        threadgroup=(head_dim, 1, 1),
        output_shapes=[(batch, n_kv, rows, head_dim)],
        output_dtypes=[out_dtype],
    )
    return out
