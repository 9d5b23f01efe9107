"""Memory numbers: array/KV-cache byte counts that are exact, and system/MLX readings that make sense."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from engine.planning.memory import (
    MemorySnapshot,
    array_bytes,
    format_bytes,
    kv_cache_bytes,
    memory_pressure,
    mlx_memory,
    process_rss,
    reset_peak_memory,
    snapshot,
    system_memory,
)

BATCH, KV_HEADS, HEAD_DIM = 1, 3, 64  # the default model's KV shape per layer


def kv(tokens: int) -> mx.array:
    return mx.random.normal((BATCH, KV_HEADS, tokens, HEAD_DIM))


class Holder:
    def __init__(self, **attributes: object) -> None:
        self.__dict__.update(attributes)


class SlottedWithState:
    """No __dict__: its arrays are only reachable through `state`."""

    __slots__ = ("_arrays",)

    def __init__(self, *arrays: mx.array) -> None:
        self._arrays = arrays

    @property
    def state(self) -> tuple[mx.array, ...]:
        return self._arrays


class StateMadeOfSlices:
    """Has both: `state` hands out fresh slices of the arrays in __dict__ (as some mlx_lm caches do)."""

    def __init__(self, keys: mx.array) -> None:
        self.keys = keys

    @property
    def state(self) -> mx.array:
        return self.keys[..., :1, :]


def test_array_bytes_counts_each_array_once_through_any_structure() -> None:
    shared = mx.zeros((10, 10), dtype=mx.float32)  # 400 bytes
    small = mx.ones((7,), dtype=mx.int8)  # 7 bytes
    half = mx.zeros((3, 5), dtype=mx.float16)  # 30 bytes
    cyclic: list[object] = [shared]
    cyclic.append(cyclic)
    structure = {
        "list": [shared, small, "text", 3, None],
        "tuple": (shared, (small, shared)),
        "object": Holder(keys=shared, extra={"again": small}, label="x"),
        "slots": SlottedWithState(half, shared),
        "cycle": cyclic,
        "class": Holder,  # types and functions are not walked
    }
    assert array_bytes(structure) == 400 + 7 + 30
    assert array_bytes(shared) == 400
    assert array_bytes([]) == 0
    assert array_bytes("no arrays here") == 0


def test_array_bytes_prefers_dict_over_state_slices() -> None:
    keys = mx.zeros((1, 2, 8, 4))  # 256 bytes; its state slice would add 32 more if it were walked
    assert array_bytes(StateMadeOfSlices(keys)) == keys.nbytes == 256


def test_kv_cache_bytes_counts_the_allocated_kvcache_buffers() -> None:
    layers = [KVCache(), KVCache()]
    for layer in layers:
        layer.update_and_fetch(kv(10), kv(10))
    # KVCache preallocates 256 positions at a time: 10 tokens already hold a 256-position buffer.
    per_position = BATCH * KV_HEADS * HEAD_DIM * 4  # float32, keys or values
    assert kv_cache_bytes(layers) == 2 * 2 * 256 * per_position

    for layer in layers:
        layer.update_and_fetch(kv(300), kv(300))
    # Growing trims to the 10 used positions and appends ceil(300/256)*256 = 512: 522 positions allocated.
    assert layers[0].keys.shape[2] == 522 and layers[0].offset == 310
    expected = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    assert expected == 2 * 2 * 522 * per_position
    assert kv_cache_bytes(layers) == expected == sum(layer.nbytes for layer in layers)


def test_kv_cache_bytes_of_quantized_cache() -> None:
    bits, group_size = 4, 64
    layers = [QuantizedKVCache(group_size=group_size, bits=bits) for _ in range(3)]
    for layer in layers:
        layer.update_and_fetch(kv(20), kv(20))
    expected = sum(array.nbytes for layer in layers for part in (layer.keys, layer.values) for array in part)
    # Per position, keys or values: packed uint32 codes plus float32 scale and bias per group of 64.
    packed = HEAD_DIM * bits // 8
    scales_and_biases = 2 * (HEAD_DIM // group_size) * 4
    assert expected == 3 * 2 * 256 * BATCH * KV_HEADS * (packed + scales_and_biases)
    assert kv_cache_bytes(layers) == expected == sum(layer.nbytes for layer in layers)


def test_kv_cache_bytes_of_empty_caches() -> None:
    assert kv_cache_bytes([KVCache(), QuantizedKVCache()]) == 0
    assert kv_cache_bytes([]) == 0


def test_memory_pressure_levels() -> None:
    assert memory_pressure(50, 100) == "normal"
    assert memory_pressure(15, 100) == "warning"
    assert memory_pressure(5, 100) == "critical"
    assert memory_pressure(0, 0) == "critical"


def test_system_and_process_memory_are_sane() -> None:
    system = system_memory()
    assert 0 < system["available"] <= system["total"]
    assert 0 < system["used"] <= system["total"]
    assert 0.0 <= system["percent"] <= 100.0
    assert system["pressure"] == memory_pressure(system["available"], system["total"])
    assert 10_000_000 < process_rss() < system["total"]  # a Python process with MLX loaded


def test_mlx_counters_follow_allocations_and_peak_reset() -> None:
    size = 8_000_000
    before = mlx_memory()["active"]
    array = mx.zeros((size // 4,), dtype=mx.float32)
    mx.eval(array)
    during = mlx_memory()
    assert during["active"] >= before + size
    assert during["peak"] >= during["active"]
    del array
    reset_peak_memory()
    after = mlx_memory()
    assert after["active"] < before + size
    assert after["peak"] < before + size
    assert after["cache"] >= 0


def test_snapshot_gathers_everything() -> None:
    layers = [KVCache() for _ in range(4)]
    for layer in layers:
        keys, values = layer.update_and_fetch(kv(5), kv(5))
        mx.eval(keys, values)
    taken = snapshot(layers)
    assert isinstance(taken, MemorySnapshot)
    assert 0 < taken.system_available <= taken.system_total
    assert taken.pressure in ("normal", "warning", "critical")
    assert taken.process_rss > 0
    assert taken.mlx_peak >= taken.mlx_active >= taken.kv_cache  # the cache is evaluated, so it is active
    assert taken.kv_cache == kv_cache_bytes(layers) == 4 * 2 * 256 * KV_HEADS * HEAD_DIM * 4
    assert snapshot().kv_cache == 0
    assert "KV cache 1.6 MB" in taken.describe()


@pytest.mark.parametrize(
    ("n", "shown"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1_000, "1.0 KB"),
        (1_572_864, "1.6 MB"),
        (786_432, "786 KB"),
        (310_000_000, "310 MB"),
        (999_700_000, "1.0 GB"),  # unit chosen after rounding: never "1000 MB"
        (1_234_000_000, "1.2 GB"),
        (24 * 1024**3, "25.8 GB"),  # decimal units, as macOS shows a 24 GiB machine's RAM
        (-5_000_000, "-5.0 MB"),
        (2_500_000_000_000, "2.5 TB"),
    ],
)
def test_format_bytes_uses_decimal_units(n: int, shown: str) -> None:
    assert format_bytes(n) == shown
