"""Base classes of Velox's KV caches, fulfilling mlx-lm's cache contract.

`VeloxKVCache` is what every method shares: the config, the offset, save/load through mlx-lm's
`save_prompt_cache`/`load_prompt_cache` (`state` is a dict with a JSON `meta` entry, rebuilt by
`from_state`), honest `nbytes`, trimming, masks, and the dense export/import used by the live switch.

`SegmentedKVCache` is the base of compressed methods. Tokens live in three segments, in position order:

    [ sink tokens (16-bit) | compressed history | recent window (16-bit) ]

The first `sink_tokens` tokens stay in 16-bit for good (attention sinks), the newest `residual_window`
tokens stay in 16-bit until they age out, and everything in between is stored only in compressed form.
There is never a 16-bit copy of the compressed history: attention reads the compressed arrays directly
through the method's `_compressed_scores`/`_compressed_values` (e.g. `mx.quantized_matmul`), reached
through the single dispatch hook in `attention.py`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache
from mlx_lm.models.cache import create_attention_mask as _mlx_create_attention_mask

from engine.errors import ConfigError
from engine.kvcache import attention as _attention
from engine.kvcache import kernels as _kernels
from engine.kvcache.config import KVCacheConfig, n_wide_layers
from engine.kvcache.quant.sketch import SIGN_ESTIMATOR_SCALE
from engine.runtime.cpu import attention as cpu_attention
from engine.runtime.masks import apply_attention_mask

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

# `options["prefill_attention"]` of compressed caches. "fused" always reads the packed codes
# (e.g. with mx.quantized_matmul). "dequantize-blocks" decodes the compressed history in blocks of
# DEQUANTIZE_BLOCK_TOKENS for query blocks of at least DEQUANTIZE_MIN_ROWS rows (prefill chunks; single
# tokens only on CUDA, where the decode kernel is not used: see `_attends_decoded`) and multiplies with ordinary matmuls: on a CPU, where MLX's quantized_matmul is
# not BLAS-backed, that is ~3x faster for 64-token chunks (measured on SmolLM2 shapes). The decoded block
# is transient (freed after use); nothing 16-bit is kept. "auto" picks "fused" on Metal, where
# quantized_matmul is the fast kernel, and "dequantize-blocks" elsewhere (CPU; CUDA, see below); it is the
# default, so the app, `velox chat` and the server all prefill the fastest way the device has (with "fused"
# as the default, SmolLM2's 18-token follow-up over 7.9k cached KIVI-4 tokens took 1.65 s on the CPU, 0.82 s
# with "auto").
PREFILL_ATTENTION_CHOICES = ("fused", "dequantize-blocks", "auto")
DEFAULT_PREFILL_ATTENTION = "auto"
DEQUANTIZE_BLOCK_TOKENS = 4096
DEQUANTIZE_MIN_ROWS = 16
# A prefill chunk on the dequantize path attends over the whole history decoded at once (a transient copy of
# one layer's keys and values, freed after the chunk; nothing 16-bit is kept) when it is at most this many
# bytes: on a GPU through MLX's fused SDPA (the key blocks below materialise every query's scores), on the
# Linux CPU fast path through its query-blocked softmax (engine/runtime/cpu/attention.py; past ~400k scores
# at once MLX's CPU softmax runs at ~20 ns per score instead of ~4, fresh allocations page-fault). Measured on
# SmolLM2 (KIVI 4-bit, CPU), a 512-token chunk over 4k cached tokens: 21.5 s with the key blocks, 8.4 s this
# way (the float32 cache: 8.6 s). Above the cap (e.g. an 8B model past ~64k tokens in bf16), the key blocks.
DENSE_HISTORY_MAX_BYTES = 256 << 20
# A prefill chunk of more than `step` tokens that grows the compressed store (from the second chunk on) grows it with
# room for this many more chunks of its size. Growing every store array to the exact need at every chunk (a new
# buffer each, the history copied over) cost the key-widths layout (15 arrays a layer against 6 for plain KIVI) a
# fifth of its 32k-token prefill in 2,048-token chunks on an H200: 5,056 tok/s against 6,094 with the store grown
# in 8,192-token steps, fp16 6,832 / 6,777 in the same runs (benchmarks/results/prefill-chunks-growth-step-h200.json);
# with this room the 4-bit level prefilled at 0.80x of fp16 against 0.71x without (prefill-room-ahead-h200.json).
# The 16-bit cache's buffers grow the same way, since each growth now waits for the queued work (COPY_BUFFERS_NOW):
# growing at every chunk, they would stop the app's pipelined prefill (engine/chat/prefill.py) at every chunk.
# The room is given back at the first update of at most `step` tokens (a decode step: `release_room_ahead`;
# mlx-lm's generate_step feeds a prompt's last token on its own), which keeps a decode step's room
# (DECODE_GROWTH_SLOTS), since the next steps would soon grow the buffers again (a second copy of the history a few
# hundred tokens after the first); nbytes counts the room while it is held.
PREFILL_AHEAD_CHUNKS = 3
# A decode step that finds its buffers full grows them with room for an eighth of the tokens they hold, at most
# DECODE_GROWTH_SLOTS (rounded up to `step`, as every growth), where it grew them by `step` before. Every growth
# allocates new buffers for the whole history and copies it over: in mlx-lm's loop on an H200 the token that grew
# them took 60-200 ms where the others took 9-15 (decode-stalls-h200.json: each 128-step window crossing a multiple of
# 256 tokens had one such stall, the 16-bit cache's included), and one growth by 4,096 slots cost what one by 256 did
# (growth-stall-h200.json; the allocation as much as the copy). Over 384 steps (decode-growth-room-h200.json) the
# 16-bit cache's stalls went from 2-3 to none and the 4-bit level's stalled time from 248 to 124 ms at 32k and from
# 411 to 80 ms at 131k (its remaining stalls fall on key-block encodes, cause not yet known). A short cache grows as
# before (an eighth of 2,048 tokens is one step). The room is at most min(DECODE_GROWTH_SLOTS, tokens /
# DECODE_GROWTH_FRACTION) + `step` slots; nbytes counts it, and engine.planning.recommend budgets it
# (`decode_room_bytes`).
DECODE_GROWTH_SLOTS = 2048
DECODE_GROWTH_FRACTION = 8
# An update of at most this many tokens is a decode step for the growth above (mlx-lm's loop feeds one token a step,
# speculative decoding a few); a longer one is a prefill chunk, however short (the quality harness feeds 64 tokens at
# a time, and its caches' bytes stay those of a prefill).
DECODE_STEP_TOKENS = 16
# A growth copies one layer's history into its new buffers at once (`_copy_now`), as does the release of a prefill's
# room ahead into smaller ones, so the old buffers are freed before the next layer's copy. Left to the forward pass's
# evaluation, every layer's old buffers were still held at its peak (MLX allocates outputs as it queues work and frees
# inputs when that work completes): on the CPU, a 16-bit cache of 8 layers of the 8B shape fed 2,048-token chunks
# peaked 1,044 MB above the 1,074 MB it held at 32k tokens, the 4-bit level 163 MB above 312 (growth_peak.py,
# growth-peak-cpu.json), and a decode step growing (or releasing) every layer's buffers held as much. Copied at once,
# the excess is one layer's old buffers and a chunk's working memory (growth-peak-copy-now-cpu.json), which the
# planner budgets (engine.planning.recommend.growth_copy_bytes). Costs a wait for the queued work once per copy (in a
# prefill chunk that grows, or one decode step in 2,048 at long contexts). False leaves the copies to the forward pass
# (a benchmark's A/B switch).
COPY_BUFFERS_NOW = True
_NOTHING_COMPRESSED = "no compressed tokens yet"


def dtype_name(dtype: mx.Dtype) -> str:
    for name, candidate in _DTYPES.items():
        if candidate == dtype:
            return name
    raise ConfigError(f"KV caches store float16, bfloat16 or float32 inputs, not {dtype}.")


def sixteen_bit_dtype(input_dtype: mx.Dtype) -> mx.Dtype:
    """The 16-bit float used for 16-bit segments and quantization scales: bf16 for bf16 models (no
    conversions on the model's own path), fp16 otherwise (fp32 inputs on CPU are stored as fp16)."""
    return mx.bfloat16 if input_dtype == mx.bfloat16 else mx.float16


class VeloxKVCache(_BaseCache):
    """What every Velox cache shares. Subclasses declare the registry attributes below."""

    # Declared by each method (checked by `register_method`).
    method_name: ClassVar[str] = ""
    supported_bits: ClassVar[tuple[int, ...]] = ()
    default_bits: ClassVar[int] = 0
    needs_calibration: ClassVar[bool] = False
    attention_path: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # Group sizes the method accepts (None: any that divides head_dim).
    supported_group_sizes: ClassVar[tuple[int, ...] | None] = None
    # Whether the method takes options `wide`/`wide_layers` (some layers one bit wider; see config.py).
    widens_layers: ClassVar[bool] = False
    # Buffers grow in steps of this many tokens (as in mlx-lm), so appends are not quadratic.
    step: ClassVar[int] = 256

    def __init__(self, config: KVCacheConfig, layer_index: int = 0) -> None:
        # `spec` is what was asked for, the whole model's (with `wide`, naming the wide layers); `config` is
        # what this layer stores (`KVCacheConfig.for_layer`: its real bits, no `wide` options), so attention,
        # trim, the decode kernel and the bits formula read one plain configuration.
        self.spec = config
        self.config = config.for_layer(layer_index)
        self.layer_index = layer_index
        self.offset = 0
        self._input_dtype_name: str | None = None
        self._k_head_dim = 0
        self._v_head_dim = 0
        self._n_kv_heads = 0
        self._batch = 0

    # ----- the method's declarations -------------------------------------------------------------

    @classmethod
    def check_config(cls, config: KVCacheConfig, head_dim: int) -> None:
        """Method-specific checks (bits were checked already); raise ConfigError with one sentence."""
        if cls.supported_group_sizes is not None and config.group_size not in cls.supported_group_sizes:
            raise ConfigError(
                f"Method {cls.method_name!r} supports group sizes "
                f"{', '.join(str(g) for g in cls.supported_group_sizes)}, not {config.group_size}."
            )

    @classmethod
    def check_model(cls, config: KVCacheConfig, model: Any) -> None:
        """Checks against the model itself (e.g. calibrated codebooks made for it); ConfigError if not."""

    @classmethod
    def resolve_for_model(cls, config: KVCacheConfig, model: Any) -> KVCacheConfig:
        """`config` with what it needs from `model` written into its options (e.g. KIVI's rope=pre: the
        model's RoPE), so a saved or re-encoded cache needs no model; ConfigError where the model has none."""
        return config

    @classmethod
    def effective_bits_per_value(
        cls,
        config: KVCacheConfig,
        head_dim: int,
        n_tokens: int | None = None,
        n_kv_heads: int = 1,
        n_layers: int | None = None,
    ) -> float:
        """Bits stored per cached key or value element, counting every scale, bias, norm, codebook,
        rotation and 16-bit token amortised over `n_tokens` (None: the long-context limit), averaged over
        the layers where some are stored wider (option `wide`, over `n_layers` layers; see `wide_bits`)."""
        raise NotImplementedError

    @classmethod
    def wide_bits(
        cls,
        config: KVCacheConfig,
        head_dim: int,
        n_tokens: int | None,
        n_kv_heads: int,
        n_layers: int | None,
    ) -> float | None:
        """The bits averaged over the layers of a `wide=F` config, or None without `wide`: base + share ×
        (widened - base), where share = floor(F·L)/L of a model of `n_layers` = L layers, and F itself where
        the layer count is not known (the budget the fraction asks for; floor(F·L)/L never exceeds it)."""
        fraction = config.wide_fraction
        if fraction is None:
            return None
        share = fraction if n_layers is None else n_wide_layers(fraction, n_layers) / n_layers
        base = cls.effective_bits_per_value(config.without_wide(), head_dim, n_tokens, n_kv_heads)
        wide = cls.effective_bits_per_value(config.widened(), head_dim, n_tokens, n_kv_heads)
        return base + share * (wide - base)

    @classmethod
    def expected_nbytes(
        cls, config: KVCacheConfig, head_dim: int, n_tokens: int, n_kv_heads: int, batch: int = 1
    ) -> float:
        """Bytes the formula predicts for `n_tokens` tokens of one layer (keys and values)."""
        bits = cls.effective_bits_per_value(config, head_dim, n_tokens, n_kv_heads)
        return bits * 2 * head_dim * n_tokens * n_kv_heads * batch / 8

    # ----- mlx-lm cache contract -----------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        raise NotImplementedError

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        raise NotImplementedError

    def reuse_trim_length(self, n: int) -> int:
        """How many of the newest tokens to trim, at least `n` (at most `offset`), so that feeding the trimmed
        tokens again rebuilds exactly the cache that was never trimmed. `trim(n)` drops exactly `n` and
        keeps what the rest attend to, but a method that encodes tokens together (KIVI's key blocks) can
        only keep a cut block by decoding it, and the block would be quantized a second time when it
        refills; a cache reused for new tokens (a prompt cache) trims this many instead (see
        `engine.kvcache.trim.trim_for_reuse`). Here every token is stored on its own: `n`."""
        return min(self.offset, max(0, n))

    def make_mask(self, *args: Any, **kwargs: Any) -> mx.array | str | None:
        return _mlx_create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self._held_arrays())

    def _held_arrays(self) -> list[mx.array]:
        """Every mx.array this cache holds (storage, 16-bit segments, rotations, codebooks)."""
        raise NotImplementedError

    @property
    def state(self) -> dict[str, Any]:
        # "config" is what this layer stores (its real bits), so a reader that knows no `wide` option still
        # reads the truth; "spec" (only for a `wide` spec) is the whole model's, restored as `spec`.
        meta = {
            "config": self.config.to_json(),
            **({"spec": self.spec.to_json()} if self.spec.has_wide else {}),
            "layer_index": self.layer_index,
            "offset": self.offset,
            "input_dtype": self._input_dtype_name,
            "k_head_dim": self._k_head_dim,
            "v_head_dim": self._v_head_dim,
            "n_kv_heads": self._n_kv_heads,
            "batch": self._batch,
        }
        return {"meta": meta, **self._array_state()}

    @state.setter
    def state(self, value: dict[str, Any]) -> None:
        meta = value["meta"]
        config = KVCacheConfig.from_json(meta["config"])
        VeloxKVCache.__init__(self, config, int(meta["layer_index"]))
        if "spec" in meta:
            # The saved layer config is authoritative (it may hold what set-up added, e.g. a checksum); the
            # spec is what the cache shows and re-encodes from.
            self.spec = KVCacheConfig.from_json(meta["spec"])
        self._reset_storage()
        if meta.get("input_dtype"):
            self._setup(
                batch=int(meta["batch"]),
                n_kv_heads=int(meta["n_kv_heads"]),
                k_head_dim=int(meta["k_head_dim"]),
                v_head_dim=int(meta["v_head_dim"]),
                input_dtype=_DTYPES[meta["input_dtype"]],
            )
            self._load_array_state(value)
        self.offset = int(meta["offset"])

    def _array_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_array_state(self, value: dict[str, Any]) -> None:
        raise NotImplementedError

    # ----- set-up ------------------------------------------------------------------------------------

    def _reset_storage(self) -> None:
        raise NotImplementedError

    @property
    def is_set_up(self) -> bool:
        return self._input_dtype_name is not None

    def _setup(
        self, batch: int, n_kv_heads: int, k_head_dim: int, v_head_dim: int, input_dtype: mx.Dtype
    ) -> None:
        """Fix the shapes on the first tokens (or from a saved state) and check the config against them."""
        for head_dim in sorted({k_head_dim, v_head_dim}):
            self.config = self.config.validate(head_dim)
        self._batch = batch
        self._n_kv_heads = n_kv_heads
        self._k_head_dim = k_head_dim
        self._v_head_dim = v_head_dim
        self._input_dtype_name = dtype_name(input_dtype)

    def _setup_from(self, keys: mx.array, values: mx.array) -> None:
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError("KV caches take keys and values shaped [batch, kv_heads, tokens, head_dim].")
        self._setup(keys.shape[0], keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype)

    @property
    def input_dtype(self) -> mx.Dtype:
        return _DTYPES[self._input_dtype_name or "float32"]

    # ----- dense export / import (live re-encode) ------------------------------------------------------

    def iter_dense(self, chunk_tokens: int = 1024) -> Iterator[tuple[mx.array, mx.array]]:
        """Yield (keys, values) of all cached tokens in position order, at most `chunk_tokens` at a time,
        decoded to the model's input dtype. Decoding happens chunk by chunk, so peak extra memory is
        bounded by one chunk."""
        raise NotImplementedError

    def to_dense(self) -> tuple[mx.array, mx.array] | tuple[None, None]:
        """All cached keys and values, decoded ([B, kv_heads, offset, head_dim] each)."""
        chunks = list(self.iter_dense(chunk_tokens=max(self.offset, 1)))
        if not chunks:
            return None, None
        if len(chunks) == 1:
            return chunks[0]
        return (
            mx.concatenate([k for k, _ in chunks], axis=-2),
            mx.concatenate([v for _, v in chunks], axis=-2),
        )

    def load_dense(self, chunks: Iterable[tuple[mx.array, mx.array]]) -> VeloxKVCache:
        """Replace the contents with these dense (keys, values) chunks, encoding each as it comes."""
        spec, config = self.spec, self.config
        VeloxKVCache.__init__(self, config, self.layer_index)
        self.spec = spec
        self._reset_storage()
        for keys, values in chunks:
            self.update_and_fetch(keys, values)
            mx.eval(self._held_arrays())
        return self

    def from_dense(self, keys: mx.array, values: mx.array, chunk_tokens: int = 1024) -> VeloxKVCache:
        """Replace the contents with dense keys/values, encoded `chunk_tokens` tokens at a time."""
        total = keys.shape[-2]
        starts = range(0, total, chunk_tokens)
        return self.load_dense(
            (keys[..., s : s + chunk_tokens, :], values[..., s : s + chunk_tokens, :]) for s in starts
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.describe()}, layer={self.layer_index}, offset={self.offset})"

    def _slots_for(self, tokens: int) -> int:
        """Token slots a buffer grown to hold `tokens` tokens allocates: `tokens` rounded up to `step`."""
        return math.ceil(tokens / self.step) * self.step

    def _decode_slots_for(self, tokens: int) -> int:
        """Token slots a buffer grown by a decode step to hold `tokens` allocates: room for an eighth more, at most
        DECODE_GROWTH_SLOTS, rounded up to `step`."""
        return self._slots_for(tokens + min(DECODE_GROWTH_SLOTS, tokens // DECODE_GROWTH_FRACTION))

    def _reset_growth(self) -> None:
        """Forget the growth bookkeeping (with the buffers, in `_reset_storage`): whether the update being stored is a
        decode step's (DECODE_STEP_TOKENS), and whether the buffers' last growth was one's (its room is kept: see
        `_slots_to_keep`)."""
        self._decoding = False
        self._grown_by_decode = False

    def _growth_slots(self, needed: int, n_new: int, grows_existing: bool) -> int:
        """Token slots to grow buffers to for `needed` tokens, `n_new` of them new, recording which kind of growth it
        is (`_grown_by_decode`): a decode step's room (`_decode_slots_for`) where existing buffers grow at a decode step
        (`_decoding`, set by update_and_fetch; the block it completes may be longer: KIVI's 128 tokens); otherwise
        rounded up to `step`, with room for PREFILL_AHEAD_CHUNKS more chunks where existing buffers grow for a chunk of
        more than `step` tokens (a prompt prefilled in one call holds exactly its tokens)."""
        self._grown_by_decode = self._decoding and grows_existing
        if self._grown_by_decode:
            return self._decode_slots_for(needed)
        ahead = PREFILL_AHEAD_CHUNKS * n_new if n_new > self.step and grows_existing else 0
        return self._slots_for(needed + ahead)

    def _slots_to_keep(self, tokens: int, decoding: bool = False) -> int:
        """Token slots kept when a prefill's room ahead is given back from buffers holding `tokens` tokens: `tokens`
        rounded up to `step` (at least `step`), or a decode step's room where a decode step gives it back (`decoding`)
        or the last growth was a decode step's: the next decode steps fill that room. Kept tighter, the appends of the
        next few hundred tokens would grow the buffers again, a second copy of the history right after the first.
        A caller's own release, not a decode step's, gives that room back too (the bytes of the tokens alone)."""
        slots = self._decode_slots_for if decoding or self._grown_by_decode else self._slots_for
        return max(self.step, slots(tokens))


def _copy_now(copies: list[mx.array]) -> None:
    """Evaluate one layer's new buffers, so the old ones they copy can be freed (see COPY_BUFFERS_NOW)."""
    if COPY_BUFFERS_NOW:
        mx.eval(copies)


def _grow_to(array: mx.array | None, used: int, capacity: int, like: mx.array) -> mx.array:
    """A buffer of `capacity` tokens on axis -2, keeping the first `used` tokens of `array`."""
    shape = (*like.shape[:-2], capacity, like.shape[-1])
    grown = mx.zeros(shape, dtype=like.dtype)
    if array is not None and used > 0:
        grown[..., :used, :] = array[..., :used, :]
    return grown


class SegmentedKVCache(_attention.AttendsOverOwnStorage, VeloxKVCache):
    """Base of compressed methods: sink tokens + compressed history + recent window (see module doc).

    A method implements `_encode`, `_compressed_scores`, `_compressed_values` and `_decode`, and may
    override the `_*_in`/`_*_out` transforms (e.g. a rotation) and `_constant_arrays`.
    Compressed storage is a dict of arrays sharing the token axis (-2): for example packed codes,
    scales and biases of keys and of values.
    """

    # Tokens move from the window into compressed storage in multiples of this (per-channel methods
    # such as KIVI quantize blocks of tokens together).
    token_block: ClassVar[int] = 1

    def __init__(self, config: KVCacheConfig, layer_index: int = 0) -> None:
        super().__init__(config, layer_index)
        self._reset_storage()

    @classmethod
    def check_config(cls, config: KVCacheConfig, head_dim: int) -> None:
        super().check_config(config, head_dim)
        choice = config.options.get("prefill_attention", DEFAULT_PREFILL_ATTENTION)
        if choice not in PREFILL_ATTENTION_CHOICES:
            raise ConfigError(
                f"prefill_attention must be {', '.join(PREFILL_ATTENTION_CHOICES)}, not {choice!r}."
            )
        _kernels.check_kernel_mode(config.options.get("kernels", _kernels.DEFAULT_KERNEL_MODE))

    def _reset_storage(self) -> None:
        self._sink_keys: mx.array | None = None
        self._sink_values: mx.array | None = None
        self._window_keys: mx.array | None = None
        self._window_values: mx.array | None = None
        self._store: dict[str, mx.array] | None = None
        self._n_compressed = 0
        self._reset_growth()
        # (store, config, rows, device, DecodePlan or None) of the last decode step (see `_decode_plan`).
        self._plan_cache: tuple[Any, ...] | None = None

    # mlx-lm's scaled_dot_product_attention sends caches with `bits` to the hooked quantized path.
    @property
    def bits(self) -> int:
        return int(self.config.key_bits or 0)

    @property
    def group_size(self) -> int:
        return self.config.group_size

    # ----- what a method implements --------------------------------------------------------------------

    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        """Compress tokens (in transformed space, 16-bit): arrays whose axis -2 is the token axis."""
        raise NotImplementedError

    def _compressed_scores(self, queries: mx.array, store: dict[str, mx.array]) -> mx.array:
        """queries [B, n_kv, R, Dk] (scaled, transformed) · compressed keys -> [B, n_kv, R, n_compressed]."""
        raise NotImplementedError

    @classmethod
    def decodes_history_without_kernel(cls, config: KVCacheConfig) -> str | None:
        """Why a decode step of `config` decodes the whole history where no GPU kernel runs (the CPU, or
        kernels off) although the method attends on its packed codes otherwise (None: it does not). The level
        rule leaves such configurations out, as it leaves out methods whose attention path is not fused."""
        return None

    @classmethod
    def kernel_declines(cls, config: KVCacheConfig) -> str | None:
        """Why the decode kernel has no variant for `config` itself, whatever the device (None: it may have
        one; `_kernel_unsupported` also checks the shape, the codes and the method). The level rule
        (benchmarks/harness/levels.py) leaves such configurations out: on a GPU they decode without it."""
        return None

    @classmethod
    def gpu_unverified(cls, config: KVCacheConfig) -> str | None:
        """Why no GPU backend (CUDA, Metal) has yet passed the parity tests for what `config` stores, so that a GPU
        would decode it without the kernel (None: one has). The level rule leaves such configurations out too; the
        kernels themselves check their backend at each step (kernels.decode.unverified_on)."""
        return None

    def _kernel_codecs(
        self,
    ) -> tuple[_kernels.Codec, list[mx.array], _kernels.Codec, list[mx.array]] | None:
        """How the decode kernel reads this method's whole store buffers: (key codec, key arrays, value
        codec, value arrays), in the order of `kernels/decode.py`'s codec macros; None: no kernel."""
        return None

    def _key_sketch(self) -> mx.array | None:
        """The m×D sketch S of keys stored as its sign bits (`_kernel_codecs`' key codec in
        kernels.decode.SKETCH_KINDS: turboquant_prod, qjl), which the decode kernel's sketched query and the history
        decode need; None for a method whose keys have channels of their own."""
        return None

    def _sketched_queries(self, queries: mx.array) -> mx.array | None:
        """sqrt(π/2)/m · S q (float32) for sketched keys, None for every other method: what a sketched key's sign
        bits are scored against (the decode kernel's second query, of the queries as `_queries_in` gives them;
        qjl's reference scores)."""
        sketch = self._key_sketch()
        if sketch is None:
            return None
        return (queries.astype(mx.float32) @ sketch.T) * (SIGN_ESTIMATOR_SCALE / sketch.shape[0])

    def _kernel_key_block(self) -> int:
        """Tokens per key scale block the decode kernel reads (KIVI's key block; others: the group size)."""
        return self.config.group_size

    def _kernel_rope(self) -> tuple[mx.array, bool] | None:
        """Keys stored before RoPE: (each channel pair's angle per position, traditional pairing) for the
        decode kernel to turn them by; None where keys are stored as given."""
        return None

    def _kernel_declines_here(self, rows: int) -> str | None:
        """Why the decode kernel cannot read this cache on this device, for `rows` query heads per kv head,
        although the config has a variant (e.g. a variant not yet verified on the device's backend); None: it
        can."""
        return None

    def _compressed_values(self, weights: mx.array, store: dict[str, mx.array]) -> mx.array:
        """weights [B, n_kv, R, n_compressed] · compressed values -> [B, n_kv, R, Dv]."""
        raise NotImplementedError

    def _decode(self, store: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
        """Decompress a slice of the store into 16-bit keys and values (transformed space)."""
        raise NotImplementedError

    def _decode_keys(self, store: dict[str, mx.array]) -> mx.array:
        """Only the keys of `_decode` (methods may override to skip decoding values)."""
        return self._decode(store)[0]

    def _keys_by_position(self) -> bool:
        """True where the stored keys depend on their positions beyond what the model gave (KIVI's rope=pre):
        scores then need decoded keys (`_decode_keys_at`), never the packed codes."""
        return False

    def _decode_at(self, store: dict[str, mx.array], start: int) -> tuple[mx.array, mx.array]:
        """`_decode` of a slice whose first token is compressed token `start` (its stream index)."""
        return self._decode(store)

    def _decode_keys_at(self, store: dict[str, mx.array], start: int) -> mx.array:
        """`_decode_keys` of a slice whose first token is compressed token `start`."""
        return self._decode_keys(store)

    def _decode_values(self, store: dict[str, mx.array]) -> mx.array:
        return self._decode(store)[1]

    def _slice_store(self, store: dict[str, mx.array], start: int, end: int) -> dict[str, mx.array]:
        """Tokens [start, end) of every store array (token axis -2; methods with another layout override)."""
        return {name: array[..., start:end, :] for name, array in store.items()}

    def _constant_arrays(self) -> list[mx.array]:
        """Arrays held besides the tokens (rotations, codebooks); counted in nbytes."""
        return []

    @classmethod
    def compressed_bits_per_token(cls, config: KVCacheConfig, head_dim: int) -> float:
        """Bits one compressed token takes in one kv head, keys and values together."""
        raise NotImplementedError

    @classmethod
    def constant_bytes(cls, config: KVCacheConfig, head_dim: int) -> int:
        """Bytes of per-layer constants (see `_constant_arrays`)."""
        return 0

    @classmethod
    def head_constant_bytes(cls, config: KVCacheConfig, head_dim: int) -> int:
        """Bytes of per-layer constants held once per kv head (see `_constant_arrays`)."""
        return 0

    def _keys_in(self, keys: mx.array) -> mx.array:
        return keys

    def _values_in(self, values: mx.array) -> mx.array:
        return values

    def _queries_in(self, queries: mx.array) -> mx.array:
        return queries

    def _output_out(self, output: mx.array) -> mx.array:
        return output

    def _output_rotation_signs(self) -> mx.array | None:
        """Where `_output_out` is exactly a Sylvester-Hadamard inverse rotation, its signs/sqrt(d) (see
        `Rotation.sylvester_inverse_signs`): the decode kernel's merge pass then rotates the output back itself
        (one launch instead of four small ones per layer and token). None: `_output_out` runs after the kernel."""
        return None

    def _keys_out(self, keys: mx.array) -> mx.array:
        return keys

    def _values_out(self, values: mx.array) -> mx.array:
        return values

    # ----- formula ---------------------------------------------------------------------------------------

    @classmethod
    def token_block_for(cls, config: KVCacheConfig) -> int:
        """`token_block` under `config` (methods whose block depends on the config override this)."""
        return cls.token_block

    @classmethod
    def sinks_in_stream(cls, config: KVCacheConfig) -> bool:
        """Whether the sink tokens also stay in the compressed stream (see `update_and_fetch`).

        Methods that compress blocks of tokens together (KIVI) keep their blocks aligned to absolute
        positions this way: otherwise s sink tokens shift every block by s, and at a length that is a
        multiple of the block (4096 tokens, say) block - s tokens wait in the 16-bit window. The sinks'
        compressed copies cost s compressed tokens (counted) and are never attended to."""
        return config.sink_tokens > 0 and cls.token_block_for(config) > 1

    @classmethod
    def token_split(cls, config: KVCacheConfig, n_tokens: int) -> tuple[int, int, int]:
        """(sink, compressed, window) token counts once `n_tokens` have been added, however chunked
        (compressed and window include the sinks' copies when `sinks_in_stream`)."""
        n_sink = min(config.sink_tokens, n_tokens)
        rest = n_tokens if cls.sinks_in_stream(config) else n_tokens - n_sink
        overflow = max(0, rest - config.residual_window)
        block = cls.token_block_for(config)
        n_compressed = overflow // block * block
        return n_sink, n_compressed, rest - n_compressed

    @classmethod
    def effective_bits_per_value(
        cls,
        config: KVCacheConfig,
        head_dim: int,
        n_tokens: int | None = None,
        n_kv_heads: int = 1,
        n_layers: int | None = None,
    ) -> float:
        config = config.validate(head_dim)
        averaged = cls.wide_bits(config, head_dim, n_tokens, n_kv_heads, n_layers)
        if averaged is not None:
            return averaged
        compressed = cls.compressed_bits_per_token(config, head_dim)
        values_per_token = 2 * head_dim  # one key and one value vector per token and kv head
        if n_tokens is None:
            return compressed / values_per_token
        if n_tokens <= 0:
            raise ValueError("n_tokens must be positive (or None for the long-context limit).")
        n_sink, n_compressed, n_window = cls.token_split(config, n_tokens)
        total_bits = (
            n_compressed * compressed
            + (n_sink + n_window) * values_per_token * 16
            + cls.constant_bytes(config, head_dim) * 8 / n_kv_heads
            + cls.head_constant_bytes(config, head_dim) * 8
        )
        return total_bits / (n_tokens * values_per_token)

    # ----- cache contract ---------------------------------------------------------------------------------

    @property
    def n_sink(self) -> int:
        return 0 if self._sink_keys is None else self._sink_keys.shape[-2]

    @property
    def n_window(self) -> int:
        return 0 if self._window_keys is None else self._window_keys.shape[-2]

    @property
    def n_compressed(self) -> int:
        return self._n_compressed

    @property
    def n_duplicated(self) -> int:
        """Sink tokens whose copies lead the compressed stream (0 unless `sinks_in_stream`)."""
        return self.n_sink if self.sinks_in_stream(self.config) else 0

    @property
    def allocated_tokens(self) -> int:
        """Token slots held: sinks, allocated compressed slots and window (the sinks' stream copies once)."""
        return self.n_sink + self.capacity + self.n_window - self.n_duplicated

    @property
    def capacity(self) -> int:
        """Compressed token slots allocated (nbytes counts them all)."""
        return 0 if self._store is None else next(iter(self._store.values())).shape[-2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if not self.is_set_up:
            self._setup_from(keys, values)
        if not _attention.attention_dispatch_installed():
            # Our caches only work through the hook; install it on first use (see attention.py).
            _attention.install_attention_dispatch()
        n_new = keys.shape[-2]
        self._decoding = n_new <= DECODE_STEP_TOKENS
        if n_new <= self.step:  # decoding (not a prefill chunk): no more room ahead needed
            self.release_room_ahead(decoding=self._decoding)
        if self._encodes_directly():
            # Every new token goes straight to compressed storage (what the path below does with no window and
            # the sinks full), so the method may take them before its transforms (`_encode_incoming`).
            self._append_compressed(self._encode_incoming(keys, values))
            self.offset += n_new
            return self, self
        keys, values = self._stored_in(keys, values)
        start = 0
        if self.n_sink < self.config.sink_tokens and self.offset == self.n_sink:
            start = min(self.config.sink_tokens - self.n_sink, n_new)
            self._sink_keys = _owned(_append(self._sink_keys, keys[..., :start, :]))
            self._sink_values = _owned(_append(self._sink_values, values[..., :start, :]))
        if self.sinks_in_stream(self.config):
            start = 0  # the sinks' tokens also enter the stream (see `sinks_in_stream`)
        if start < n_new:
            new_keys, new_values = keys[..., start:, :], values[..., start:, :]
            if start:  # a view past the sink tokens would pin them twice
                new_keys, new_values = _owned(new_keys), _owned(new_values)
            self._window_keys = _append(self._window_keys, new_keys)
            self._window_values = _append(self._window_values, new_values)
        overflow = max(0, self.n_window - self.config.residual_window)
        overflow = overflow // self.token_block * self.token_block
        if overflow:
            chunk_keys, chunk_values = self._window_keys[..., :overflow, :], self._window_values[..., :overflow, :]
            if self._n_compressed == 0 and self.n_duplicated:
                chunk_keys, chunk_values = self._neutral_sink_copies(chunk_keys, chunk_values)
            self._append_compressed(self._encode(chunk_keys, chunk_values))
            if overflow == self.n_window:
                self._window_keys = self._window_values = None
            else:
                self._window_keys = _owned(self._window_keys[..., overflow:, :])
                self._window_values = _owned(self._window_values[..., overflow:, :])
        self.offset += n_new
        return self, self

    def _encodes_directly(self) -> bool:
        """Whether new tokens go straight to compressed storage: tokens compressed one by one, no 16-bit window,
        the sink tokens all held and none of them in the stream."""
        return (self.token_block == 1 and self.config.residual_window == 0 and self.n_window == 0
                and self.n_sink >= self.config.sink_tokens and not self.sinks_in_stream(self.config))

    def _encode_incoming(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        """`_encode` of new tokens as the model gives them: transformed and cast to the 16-bit dtype first, as
        every stored token is. A method whose encode kernel applies its transform itself overrides this."""
        return self._encode(*self._stored_in(keys, values))

    def _stored_in(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """New tokens as every part of the cache stores them: transformed (`_keys_in`, `_values_in`) and in the
        16-bit dtype."""
        dense_dtype = self._dense_dtype
        return self._keys_in(keys).astype(dense_dtype), self._values_in(values).astype(dense_dtype)

    def _neutral_sink_copies(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The first block with its sink copies replaced by the mean of the block's other tokens.

        The copies are never attended to (the 16-bit sinks are), but a block quantized per channel takes its
        range from every token in it, and attention sinks are outliers: measured on SmolLM2 (4-bit KIVI, 2048
        tokens), keeping the real sink keys in block 0 cost +2.5 % perplexity against +1.0 % with sinks out
        of the stream. Neutral copies keep the block's range that of its real tokens."""
        n, block = self.n_duplicated, self.token_block
        def neutral(x: mx.array) -> mx.array:
            filler = mx.mean(x[..., n:block, :].astype(mx.float32), axis=-2, keepdims=True).astype(x.dtype)
            return mx.concatenate([mx.broadcast_to(filler, (*x.shape[:-2], n, x.shape[-1])), x[..., n:, :]], axis=-2)

        return neutral(keys), neutral(values)

    def release_room_ahead(self, decoding: bool = False) -> None:
        """Give back the room a prefill grew ahead (see PREFILL_AHEAD_CHUNKS): the store copied into buffers of its
        tokens rounded up to `step` (at least `step`). A cache's first decode step does this itself (`decoding`: it
        keeps a decode step's room, `_slots_to_keep`); a caller that reads `nbytes` after a prefill it never decodes
        from (a teacher-forced evaluation) calls it. The room a decode step grew is kept, as far as such a growth
        leaves it (`_decode_slots_for`): the next decode steps fill it; what a trim freed beyond that is given back
        too."""
        if self._store is None:
            return
        keep = self._slots_to_keep(self._n_compressed, decoding)
        if self.capacity > keep:
            kept = {name: _owned(part) for name, part in self._slice_store(self._store, 0, keep).items()}
            _copy_now(list(kept.values()))
            self._store = kept

    def _append_compressed(self, chunk: dict[str, mx.array]) -> None:
        n_new = next(iter(chunk.values())).shape[-2]
        needed = self._n_compressed + n_new
        if self._store is None or needed > self.capacity:
            capacity = self._growth_slots(needed, n_new, grows_existing=self._store is not None)
            grown = {
                name: _grow_to(None if self._store is None else self._store[name], self._n_compressed, capacity,
                               like=part)
                for name, part in chunk.items()
            }
            if self._n_compressed:
                _copy_now(list(grown.values()))
            self._store = grown
        for name, part in chunk.items():
            self._store[name][..., self._n_compressed : needed, :] = part
        self._n_compressed = needed

    def _compressed_view(self) -> dict[str, mx.array]:
        assert self._store is not None
        if self._n_compressed == self.capacity:
            return self._store
        return {name: array[..., : self._n_compressed, :] for name, array in self._store.items()}

    def trim(self, n: int) -> int:
        n = min(self.offset, max(0, n))
        left = n
        if left and self.n_window:
            take = min(left, self.n_window)
            keep = self.n_window - take
            if keep:
                self._window_keys = _owned(self._window_keys[..., :keep, :])
                self._window_values = _owned(self._window_values[..., :keep, :])
            else:
                self._window_keys = self._window_values = None
            left -= take
        if left and self._n_compressed:
            take = min(left, self._n_compressed)
            self._n_compressed -= take
            left -= take
        if self.sinks_in_stream(self.config) and self.n_sink > self.offset - n:
            left = self.n_sink - (self.offset - n)  # the stream was trimmed into the sinks' copies
        elif self.n_duplicated:
            left = 0
        if left and self.n_sink:
            keep = self.n_sink - left
            if keep:
                self._sink_keys = _owned(self._sink_keys[..., :keep, :])
                self._sink_values = _owned(self._sink_values[..., :keep, :])
            else:
                self._sink_keys = self._sink_values = None
        self.offset -= n
        return n

    @property
    def _dense_dtype(self) -> mx.Dtype:
        return sixteen_bit_dtype(self.input_dtype)

    def _held_arrays(self) -> list[mx.array]:
        arrays = [
            a
            for a in (self._sink_keys, self._sink_values, self._window_keys, self._window_values)
            if a is not None
        ]
        if self._store is not None:
            arrays.extend(self._store.values())
        arrays.extend(self._constant_arrays())
        return arrays

    # ----- attention ----------------------------------------------------------------------------------------

    def attention(
        self, queries: mx.array, keys: Any, values: Any, scale: float, mask: mx.array | str | None
    ) -> mx.array:
        """Softmax attention of `queries` [B, n_q_heads, L, Dk] over every cached token.

        Query heads are grouped onto their kv head by a free reshape to [B, n_kv, repeats*L, D]
        (as mlx-lm's quantized SDPA does), so keys and values are never repeated in memory.
        """
        if queries.shape[2] == 1 and not isinstance(mask, mx.array):
            # One new token with no mask (or mlx-lm's "causal", which masks nothing for it): the fused kernel.
            plan = self._decode_plan(queries.shape[1] // self._n_kv_heads)
            if plan is not None:
                return self._kernel_attention(plan, queries, scale)
        batch, n_query_heads, n_queries, _ = queries.shape
        n_kv = self._n_kv_heads
        repeats = n_query_heads // n_kv
        transformed = self._queries_in(queries)

        n_compressed = self._n_compressed
        store = self._compressed_view() if n_compressed else {}
        dequantize = self._keys_by_position() or _attends_decoded(
            self.config.options.get("prefill_attention", DEFAULT_PREFILL_ATTENTION), repeats * n_queries
        )

        # In the queries' own dtype: a method's transform may return float32 queries (a float32 rotation),
        # and float32 attention over the whole history ran at half the speed on an H200 (no tensor cores).
        dense_dtype = queries.dtype
        attend_dense = _dense_attention(dense_dtype) if dequantize else None
        if attend_dense is not None and self._dense_history_bytes(dense_dtype) <= DENSE_HISTORY_MAX_BYTES:
            keys, values = self._dense_history(store, dense_dtype)
            output = attend_dense(transformed.astype(dense_dtype), keys, values, scale, mask)
            return self._output_out(output).astype(queries.dtype)

        grouped = (transformed * scale).reshape(batch, n_kv, repeats * n_queries, -1)
        compute_dtype = grouped.dtype
        # Token ranges of the compressed history decoded one at a time (only on the dequantize path).
        blocks = (
            [(s, min(s + DEQUANTIZE_BLOCK_TOKENS, n_compressed)) for s in range(0, n_compressed, DEQUANTIZE_BLOCK_TOKENS)]
            if dequantize
            else []
        )

        scores = []
        if n_compressed and not dequantize:
            scores.append(self._compressed_scores(grouped, store).astype(compute_dtype))
        for start, end in blocks:
            block_keys = self._decode_keys_at(self._slice_store(store, start, end), start).astype(compute_dtype)
            scores.append(grouped @ block_keys.swapaxes(-1, -2))
        if self.n_window:
            scores.append(grouped @ self._window_keys.astype(compute_dtype).swapaxes(-1, -2))
        n_duplicated = self.n_duplicated
        if n_duplicated:  # the sinks' copies in the stream are never attended to: their 16-bit originals are
            stream = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
            scores = [stream[..., n_duplicated:]]
        if self.n_sink:
            scores.insert(0, grouped @ self._sink_keys.astype(compute_dtype).swapaxes(-1, -2))
        all_scores = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
        n_keys = all_scores.shape[-1]

        all_scores = all_scores.reshape(batch, n_kv, repeats, n_queries, n_keys)
        all_scores = apply_attention_mask(all_scores, mask, n_queries, n_query_heads)
        weights = _softmax(all_scores)
        weights = weights.reshape(batch, n_kv, repeats * n_queries, n_keys)

        output = None
        position = 0
        if self.n_sink:
            part = weights[..., : self.n_sink]
            output = _add(output, part @ self._sink_values.astype(compute_dtype))
            weights = weights[..., self.n_sink :]
        if n_duplicated:  # zero weight on the sinks' stream copies
            weights = mx.concatenate([mx.zeros((*weights.shape[:-1], n_duplicated), weights.dtype), weights], axis=-1)
        if n_compressed and not dequantize:
            part = weights[..., position : position + n_compressed]
            output = _add(output, self._compressed_values(part, store).astype(compute_dtype))
        for start, end in blocks:
            block_values = self._decode_values(self._slice_store(store, start, end)).astype(compute_dtype)
            output = _add(output, weights[..., position + start : position + end] @ block_values)
        position += n_compressed
        if self.n_window:
            part = weights[..., position:]
            output = _add(output, part @ self._window_values.astype(compute_dtype))

        output = output.reshape(batch, n_query_heads, n_queries, -1)
        return self._output_out(output).astype(queries.dtype)

    def _dense_history_bytes(self, dtype: mx.Dtype) -> int:
        """Bytes of every cached key and value decoded into `dtype` (the prefill path's transient copy)."""
        return 2 * self.offset * self._n_kv_heads * max(self._k_head_dim, self._v_head_dim) * dtype.size

    def _dense_history(self, store: dict[str, mx.array], dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Every cached key and value, decoded into `dtype` in the method's own space (what `_queries_in`
        queries attend to), in token order. Transient: built for one prefill chunk's attention and freed."""
        keys: list[mx.array] = []
        values: list[mx.array] = []
        if self._n_compressed:
            history_keys, history_values = self._decoded_history(store, dtype)
            keys.append(history_keys)
            values.append(history_values)
        if self.n_window:
            keys.append(self._window_keys.astype(dtype))
            values.append(self._window_values.astype(dtype))
        # The sinks' copies lead the stream: their 16-bit originals come first instead. Dropped as views of the
        # stream's parts, so the one concatenation below is the only copy (concatenating the stream first and then
        # the sinks copied a history-sized array twice per role).
        drop = self.n_duplicated
        while drop and keys:
            if drop >= keys[0].shape[-2]:
                drop -= keys[0].shape[-2]
                del keys[0], values[0]
            else:
                keys[0], values[0] = keys[0][..., drop:, :], values[0][..., drop:, :]
                drop = 0
        if self.n_sink:
            keys.insert(0, self._sink_keys.astype(dtype))
            values.insert(0, self._sink_values.astype(dtype))
        if len(keys) == 1:
            return keys[0], values[0]
        return mx.concatenate(keys, axis=-2), mx.concatenate(values, axis=-2)

    def _decoded_history(self, store: dict[str, mx.array], dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """The compressed tokens (`store`, the compressed view) decoded into `dtype`: on a GPU kernel backend in one
        launch for both roles where the method's codecs have the history-decode kernel (kernels/dequantize.py;
        `kernels="off"` keeps the reference), else through `_decode_keys_at` and `_decode_values`."""
        launch = self._dequantize_launch()
        if launch is None:
            return self._decode_keys_at(store, 0).astype(dtype), self._decode_values(store).astype(dtype)
        backend, (key_codec, key_arrays, value_codec, value_arrays) = launch
        dense = self._dense_dtype  # as the reference: decoded into the cache's 16-bit dtype, then cast
        keys, values = _kernels.dequantize_history(
            key_codec, key_arrays, value_codec, value_arrays, self._n_compressed, self._k_head_dim,
            self.config.group_size, dense, backend, sketch=self._key_sketch(), key_block=self._kernel_key_block(),
            rope=self._kernel_rope())
        return (keys, values) if dense == dtype else (keys.astype(dtype), values.astype(dtype))

    def _dequantize_launch(self) -> tuple[str, tuple[Any, ...]] | None:
        """(backend, the method's kernel codecs and arrays) where the history-decode kernel decodes this cache, else
        None."""
        if self.config.options.get("kernels", _kernels.DEFAULT_KERNEL_MODE) == "off":
            return None
        if self._keys_by_position() and self._kernel_rope() is None:  # keys stored before a RoPE no kernel turns
            return None
        backend = _kernels.available_backend()
        if backend not in _kernels.dequantize.BACKENDS or self._store is None or self._k_head_dim != self._v_head_dim:
            return None
        codecs = self._kernel_codecs()
        if codecs is None or not _kernels.dequantize.supported(codecs[0], codecs[2], self._k_head_dim, backend,
                                                               rope=self._kernel_rope() is not None):
            return None
        return backend, codecs

    def _kernel_unsupported(self, rows: int) -> str | None:
        """Why this cache cannot attend with the decode kernel right now, for `rows` query heads per kv head
        (the tiled pass's tile depends on them: threadgroup memory); None: it can."""
        if self._store is None:
            return _NOTHING_COMPRESSED
        if self._k_head_dim != self._v_head_dim or not _kernels.decode.head_dim_supported(self._k_head_dim):
            return f"the decode kernel has no variant for head_dim {self._k_head_dim}/{self._v_head_dim}"
        if not _kernels.decode.group_supported(self.config.group_size):
            return f"the decode kernel needs a group size divisible by 8, not {self.config.group_size}"
        codecs = self._kernel_codecs()
        if codecs is None:
            return f"method {self.method_name!r} has no decode kernel"
        backend = _kernels.available_backend()
        unverified = _kernels.decode.unverified_on
        # Sketched keys: verified on the backend, and their sketched query rows must fit the threadgroup memory
        key_declines = (_kernels.decode.sketch_declines(codecs[0], self._k_head_dim, rows, backend)
                        if codecs[0].kind in _kernels.decode.SKETCH_KINDS else unverified(codecs[0], backend))
        declined = (self.kernel_declines(self.config) or self._kernel_declines_here(rows) or key_declines
                    or unverified(codecs[2], backend))
        if declined is not None:
            return declined
        if not (codecs[0].supported and codecs[2].supported):
            return f"the decode kernel cannot read {self.config.key_bits}/{self.config.value_bits}-bit codes"
        chosen = _kernels.decode.choose_pass(codecs[0], codecs[2], self.config.group_size, self._k_head_dim,
                                             self._kernel_key_block(), rows, backend)
        if chosen is None:
            return (
                f"the decode kernel has no tile for group size {self.config.group_size} "
                f"at head_dim {self._k_head_dim} and {rows} query heads per kv head"
            )
        # the pass plan_decode launches (Metal binds a kernel's arrays to at most 31 buffer arguments)
        return _kernels.backend.over_buffer_limit(chosen[0], backend)

    def _decode_kernel_backend(self, rows: int) -> str | None:
        mode = self.config.options.get("kernels", _kernels.DEFAULT_KERNEL_MODE)
        if mode == "off":
            return None
        if _kernels.available_backend() is None:
            return _kernels.resolve_backend(mode)  # None, or the "require" error saying why
        reason = self._kernel_unsupported(rows)
        if reason is _NOTHING_COMPRESSED:
            # Nothing compressed to read: the reference path is a plain 16-bit attention (also under "require").
            return None
        return _kernels.resolve_backend(mode, reason)

    def __deepcopy__(self, memo: dict[int, Any]) -> SegmentedKVCache:
        """A copy holding the same tokens (mlx-lm's server copies prompt caches before extending them). The
        decode kernel's cached plan is left out: it refers to the device and to this cache's own arrays, and
        the copy builds its own on its first decode step."""
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            setattr(clone, name, None if name == "_plan_cache" else copy.deepcopy(value, memo))
        return clone

    def _decode_plan(self, rows: int) -> _kernels.DecodePlan | None:
        """The decode kernel's plan, or None for the reference path; rebuilt only when the compressed
        buffers, the config or the default device change (a decode step then does no Python set-up work
        beyond the launch: per layer and token, that host time is a visible part of a GPU decode step)."""
        device = mx.default_device()
        cached = self._plan_cache
        if (
            cached is not None
            and cached[0] is self._store
            and cached[1] is self.config
            and cached[2] == rows
            and cached[3] == device
        ):
            return cached[4]
        backend = self._decode_kernel_backend(rows)
        plan = None
        if backend is not None:
            codecs = self._kernel_codecs()
            assert codecs is not None
            key_codec, key_arrays, value_codec, value_arrays = codecs
            plan = _kernels.plan_decode(
                key_codec, key_arrays, value_codec, value_arrays, self.config.group_size,
                self._k_head_dim, rows, backend, self._kernel_key_block(), rope=self._kernel_rope(),
                tokens=self.capacity,
            )
        if self._store is not None:  # "nothing compressed yet" is rechecked until something is
            self._plan_cache = (self._store, self.config, rows, device, plan)
        return plan

    def _kernel_attention(self, plan: _kernels.DecodePlan, queries: mx.array, scale: float) -> mx.array:
        """`attention` of one new token per sequence through the fused decode kernel (see kernels/decode.py)."""
        signs = self._output_rotation_signs()
        transformed = self._queries_in(queries)
        output = _kernels.decode_attention(
            plan,
            transformed,
            self._n_kv_heads,
            scale,
            (self._sink_keys, self._sink_values) if self.n_sink else None,
            (self._window_keys, self._window_values) if self.n_window else None,
            self._n_compressed,
            self.n_duplicated,
            out_signs=signs,
            sketched=self._sketched_queries(transformed) if plan.sketch else None,
            # the merge pass, which rotates the output back, also casts it (else `_output_out` still works on it)
            out_dtype=queries.dtype if signs is not None else None,
        )
        if signs is None:
            output = self._output_out(output)
        return output if output.dtype == queries.dtype else output.astype(queries.dtype)

    # ----- state and dense export ---------------------------------------------------------------------------

    def _array_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for name in ("sink_keys", "sink_values", "window_keys", "window_values"):
            array = getattr(self, "_" + name)
            if array is not None:
                state[name] = array
        if self._n_compressed:
            state["compressed"] = dict(self._compressed_view())
        extra = self._extra_state()
        if extra:
            state["extra"] = extra
        return state

    def _load_array_state(self, value: dict[str, Any]) -> None:
        for name in ("sink_keys", "sink_values", "window_keys", "window_values"):
            setattr(self, "_" + name, value.get(name))
        compressed = value.get("compressed")
        if compressed:
            self._store = dict(compressed)
            self._n_compressed = self.capacity
        self._load_extra_state(value.get("extra") or {})

    def _extra_state(self) -> dict[str, Any]:
        """Method arrays that cannot be rebuilt from the config (e.g. calibrated codebooks)."""
        return {}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        pass

    def iter_dense(self, chunk_tokens: int = 1024) -> Iterator[tuple[mx.array, mx.array]]:
        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive.")
        dtype = self.input_dtype
        if self.n_sink:
            yield (
                self._keys_out(self._sink_keys).astype(dtype),
                self._values_out(self._sink_values).astype(dtype),
            )
        yield from skip_tokens(self._iter_stream(chunk_tokens), self.n_duplicated)

    def _iter_stream(self, chunk_tokens: int) -> Iterator[tuple[mx.array, mx.array]]:
        """The compressed tokens, then the window's, decoded to the input dtype, in chunks."""
        dtype = self.input_dtype
        for start in range(0, self._n_compressed, chunk_tokens):
            end = min(start + chunk_tokens, self._n_compressed)
            assert self._store is not None
            keys, values = self._decode_at(self._slice_store(self._store, start, end), start)
            yield self._keys_out(keys).astype(dtype), self._values_out(values).astype(dtype)
        if self.n_window:
            yield (
                self._keys_out(self._window_keys).astype(dtype),
                self._values_out(self._window_values).astype(dtype),
            )


def skip_tokens(
    chunks: Iterator[tuple[mx.array, mx.array]], n: int
) -> Iterator[tuple[mx.array, mx.array]]:
    """The (keys, values) chunks without their first `n` tokens (the sinks' stream copies)."""
    for keys, values in chunks:
        if n >= keys.shape[-2]:
            n -= keys.shape[-2]
            continue
        yield (keys[..., n:, :], values[..., n:, :]) if n else (keys, values)
        n = 0


def _softmax(scores: mx.array) -> mx.array:
    """Softmax over keys: MLX's, or on the Linux CPU fast path the same maths with a vectorised exp."""
    if scores.dtype == mx.float32 and cpu_attention.active():
        return cpu_attention.softmax(scores)
    return mx.softmax(scores, axis=-1, precise=True)


def _dense_attention(dtype: mx.Dtype) -> Any:
    """The attention function a prefill chunk uses over the whole decoded history on this device, or None
    (then the key blocks): the CPU fast path's query-blocked attention, or MLX's fused SDPA on a GPU."""
    if mx.default_device() == mx.gpu:
        return _fast_sdpa
    if dtype == mx.float32 and cpu_attention.active():
        return cpu_attention.grouped_attention
    return None


def _fast_sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _attends_decoded(choice: str, rows: int) -> bool:
    """Whether `rows` query rows per kv head attend over decoded history (key blocks or the whole history)
    rather than through the packed codes with quantized_matmul, for option `prefill_attention` = `choice`."""
    backend = _kernels.available_backend()
    if backend == "cuda":
        # MLX 0.32's CUDA quantized_matmul has no kernel for most attention shapes (measured on an H200:
        # "No implementation for problem shape: 1533x8128x64x3", also 3x65x64x2 at 8 bits), so on CUDA the
        # history is always decoded: for prefill chunks, and for single tokens the decode kernel declines.
        return True
    if rows < DEQUANTIZE_MIN_ROWS:
        return False  # one new token: the packed codes (decoding the history per token would cost more)
    if choice == "auto":
        # Fused prefill needs quantized_matmul for hundreds of query rows at once: fast on Metal, slow on the
        # CPU (not BLAS-backed), so only Metal attends fused.
        return backend != "metal"
    return choice == "dequantize-blocks"


def _owned(array: mx.array | None) -> mx.array | None:
    """A copy that owns exactly its own bytes. A slice is a view that keeps its whole source buffer alive
    (e.g. the 4 sink tokens of a 2048-token prefill chunk would pin the chunk), which nbytes would not
    show; 16-bit segments are small, so copying them keeps nbytes equal to the memory really held."""
    return None if array is None else mx.contiguous(array)


def _append(existing: mx.array | None, new: mx.array) -> mx.array | None:
    if new.shape[-2] == 0:
        return existing
    if existing is None:
        return new
    return mx.concatenate([existing, new], axis=-2)


def _add(total: mx.array | None, part: mx.array) -> mx.array:
    return part if total is None else total + part


def config_from_state(state: dict[str, Any]) -> KVCacheConfig:
    """The config saved in a Velox cache state (for inspecting saved prompt caches)."""
    return KVCacheConfig.from_json(state["meta"]["config"])


__all__ = [
    "SegmentedKVCache",
    "VeloxKVCache",
    "apply_attention_mask",
    "config_from_state",
    "dtype_name",
    "sixteen_bit_dtype",
]
