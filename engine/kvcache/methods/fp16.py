"""Uncompressed baselines: every key and value stored as a 16-bit float ("fp16") or as float32 ("fp32").

"fp16" stores float16 (bfloat16 when the model computes in bfloat16, so nothing is converted on that
path). On the CPU backend models compute in float32, so each step this cache hands mlx-lm its history
converted to float32 (one cast of the history per layer and step, like a dequantize); memory is still
16 bits per value. "fp32" stores float32 exactly and needs no conversion on CPU, at twice the memory.
Both use mlx-lm's own attention (mx.fast.scaled_dot_product_attention), except on the Linux CPU fast path
(`engine.runtime.cpu.attention.active()`), where MLX has no fused attention kernel: there they attend over their
own buffers with `engine.runtime.cpu.attention.grouped_attention` through the attention hook, like the compressed
caches (`bits` then exists, which is what routes mlx-lm to the hook).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import mlx.core as mx

from engine.errors import ConfigError
from engine.kvcache.attention import AttendsOverOwnStorage, install_attention_dispatch
from engine.kvcache.base import DECODE_STEP_TOKENS, VeloxKVCache, _copy_now, _grow_to, sixteen_bit_dtype
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.registry import register_method
from engine.runtime.cpu import attention as cpu_attention


class DenseKVCache(AttendsOverOwnStorage, VeloxKVCache):
    """Keys and values in float buffers growing by `step` tokens, as mlx-lm's KVCache does."""

    attention_path: ClassVar[str] = "dense"
    storage_bits: ClassVar[int] = 16

    def __init__(self, config: KVCacheConfig, layer_index: int = 0) -> None:
        super().__init__(config, layer_index)
        self._reset_storage()

    @property
    def _attends_itself(self) -> bool:
        """Decided once per cache (also for caches mlx-lm rebuilds from a saved state without __init__)."""
        decided = self.__dict__.get("_attends_itself_decided")
        if decided is None:
            decided = self.__dict__["_attends_itself_decided"] = cpu_attention.active()
            if decided:
                install_attention_dispatch()
        return decided

    # mlx-lm sends attention to the hook exactly for caches that have `bits` (and passes `group_size`), so
    # both exist only while this cache attends over its own storage.
    @property
    def bits(self) -> int:
        if not self._attends_itself:
            raise AttributeError("bits")
        return self.storage_bits

    @property
    def group_size(self) -> int:
        if not self._attends_itself:
            raise AttributeError("group_size")
        return self.config.group_size

    def attention(
        self, queries: mx.array, keys: Any, values: Any, scale: float, mask: mx.array | str | None
    ) -> mx.array:
        cached_keys = self._keys[..., : self.offset, :].astype(queries.dtype)
        cached_values = self._values[..., : self.offset, :].astype(queries.dtype)
        return cpu_attention.attention(queries, cached_keys, cached_values, scale, mask)

    def _reset_storage(self) -> None:
        self._keys: mx.array | None = None
        self._values: mx.array | None = None
        self._reset_growth()

    @classmethod
    def check_config(cls, config: KVCacheConfig, head_dim: int) -> None:
        if config.residual_window or config.sink_tokens:
            raise ConfigError(
                f"Method {cls.method_name!r} keeps every token uncompressed already; "
                "residual_window and sink_tokens must be 0."
            )

    @classmethod
    def effective_bits_per_value(
        cls,
        config: KVCacheConfig,
        head_dim: int,
        n_tokens: int | None = None,
        n_kv_heads: int = 1,
        n_layers: int | None = None,
    ) -> float:
        config.validate(head_dim)
        return float(cls.storage_bits)

    def _storage_dtype(self) -> mx.Dtype:
        raise NotImplementedError

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if not self.is_set_up:
            self._setup_from(keys, values)
        n_new = keys.shape[-2]
        self._decoding = n_new <= DECODE_STEP_TOKENS
        if n_new <= self.step:  # not a prefill chunk: no more room ahead needed
            self.release_room_ahead(incoming=n_new, decoding=self._decoding)
        previous = self.offset
        needed = previous + n_new
        dtype = self._storage_dtype()
        if self._keys is None or needed > self._keys.shape[-2]:
            # room ahead for a prefill's next chunks, or a decode step's room (base.PREFILL_AHEAD_CHUNKS,
            # DECODE_GROWTH_SLOTS: a growth copies the whole history)
            capacity = self._growth_slots(needed, n_new, grows_existing=self._keys is not None)
            grown = [_grow_to(self._keys, previous, capacity, like=keys.astype(dtype)),
                     _grow_to(self._values, previous, capacity, like=values.astype(dtype))]
            if previous:
                _copy_now(grown)
            self._keys, self._values = grown
        self._keys[..., previous:needed, :] = keys
        self._values[..., previous:needed, :] = values
        self.offset = needed
        if self._attends_itself:
            return self, self
        cached_keys = self._keys[..., :needed, :]
        cached_values = self._values[..., :needed, :]
        # mlx-lm attends in the queries' dtype; convert only when storage differs (fp16 on CPU).
        return cached_keys.astype(keys.dtype), cached_values.astype(values.dtype)

    def trim(self, n: int) -> int:
        n = min(self.offset, max(0, n))
        self.offset -= n
        return n

    def release_room_ahead(self, incoming: int = 0, decoding: bool = False) -> None:
        """Give back the room a prefill grew ahead, as SegmentedKVCache.release_room_ahead does (the buffers copied into
        ones of `_slots_to_keep` slots, a decode step's room where a decode step gives it back): a cache's first decode
        step does this itself, a caller reading `nbytes` after a prefill it never decodes from calls it. The slots kept
        hold the `incoming` tokens of the step too, so a step whose tokens would not fit its tokens rounded up makes
        its growth here (one copy of the history, not two)."""
        if self._keys is None:
            return
        keep = self._slots_to_keep(self.offset + incoming, decoding)
        if self._keys.shape[-2] > keep:
            kept = [mx.contiguous(self._keys[..., :keep, :]), mx.contiguous(self._values[..., :keep, :])]
            _copy_now(kept)
            self._keys, self._values = kept

    def _held_arrays(self) -> list[mx.array]:
        return [a for a in (self._keys, self._values) if a is not None]

    def _array_state(self) -> dict[str, Any]:
        if self._keys is None or self.offset == 0:
            return {}
        return {"keys": self._keys[..., : self.offset, :], "values": self._values[..., : self.offset, :]}

    def _load_array_state(self, value: dict[str, Any]) -> None:
        self._keys = value.get("keys")
        self._values = value.get("values")

    def iter_dense(self, chunk_tokens: int = 1024) -> Iterator[tuple[mx.array, mx.array]]:
        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive.")
        for start in range(0, self.offset, chunk_tokens):
            end = min(start + chunk_tokens, self.offset)
            yield (
                self._keys[..., start:end, :].astype(self.input_dtype),
                self._values[..., start:end, :].astype(self.input_dtype),
            )


@register_method("fp16")
class VeloxFp16KVCache(DenseKVCache):
    supported_bits: ClassVar[tuple[int, ...]] = (16,)
    default_bits: ClassVar[int] = 16
    attention_path: ClassVar[str] = "dense"
    description: ClassVar[str] = (
        "Uncompressed baseline: keys and values as 16-bit floats (fp16, or bf16 for bf16 models)."
    )
    storage_bits: ClassVar[int] = 16

    def _storage_dtype(self) -> mx.Dtype:
        return sixteen_bit_dtype(self.input_dtype)


@register_method("fp32")
class VeloxFp32KVCache(DenseKVCache):
    supported_bits: ClassVar[tuple[int, ...]] = (32,)
    default_bits: ClassVar[int] = 32
    attention_path: ClassVar[str] = "dense"
    description: ClassVar[str] = "Uncompressed reference: keys and values as float32 (no conversion on CPU)."
    storage_bits: ClassVar[int] = 32

    def _storage_dtype(self) -> mx.Dtype:
        return mx.float32
