"""Memory measurements: the machine, this process, MLX's allocator, and the bytes a KV cache really holds.

Sizes are reported in bytes; `engine.planning.units.format_bytes` shows them in decimal units.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import psutil

from engine.planning.units import format_bytes

# Pressure is judged from the fraction of RAM still available. Below these fractions the OS starts to
# compress/swap (warning) and then risks killing processes (critical); the cut-offs are deliberately simple.
WARNING_AVAILABLE_FRACTION = 0.20
CRITICAL_AVAILABLE_FRACTION = 0.10

# Things that cannot hold an mx.array, or must not be walked into (classes, modules, code).
_LEAF_TYPES = (str, bytes, bytearray, int, float, complex, bool, type(None), range)
_OPAQUE_TYPES = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
)
_SKIPPED_TYPES = _LEAF_TYPES + _OPAQUE_TYPES


def memory_pressure(available: int, total: int) -> str:
    """'normal', 'warning' or 'critical' from the fraction of RAM that is still available."""
    fraction = available / total if total > 0 else 0.0
    if fraction < CRITICAL_AVAILABLE_FRACTION:
        return "critical"
    if fraction < WARNING_AVAILABLE_FRACTION:
        return "warning"
    return "normal"


def system_memory() -> dict[str, Any]:
    """RAM of the whole machine: total, available, used (bytes), percent used, and a pressure level."""
    vm = psutil.virtual_memory()
    return {
        "total": int(vm.total),
        "available": int(vm.available),
        "used": int(vm.used),
        "percent": float(vm.percent),
        "pressure": memory_pressure(int(vm.available), int(vm.total)),
    }


def process_rss() -> int:
    """Resident set size of this process in bytes."""
    return int(psutil.Process().memory_info().rss)


def _mlx_memory_function(name: str) -> Any:
    # mlx >= 0.24 has these at top level; older releases only had them under mx.metal.
    function = getattr(mx, name, None)
    if function is None:
        function = getattr(mx.metal, name)
    return function


def mlx_memory() -> dict[str, int]:
    """MLX allocator counters in bytes: memory held by live arrays, its peak, and the free-buffer cache."""
    return {
        "active": int(_mlx_memory_function("get_active_memory")()),
        "peak": int(_mlx_memory_function("get_peak_memory")()),
        "cache": int(_mlx_memory_function("get_cache_memory")()),
    }


def reset_peak_memory() -> None:
    """Start MLX's peak-memory counter afresh, so the next peak measures only what follows."""
    _mlx_memory_function("reset_peak_memory")()


def array_bytes(obj: Any) -> int:
    """Bytes of every distinct mx.array reachable from `obj`, each counted once.

    Walks lists, tuples, sets, dicts, and objects' `__dict__`; an object without a `__dict__` is read
    through its `state` attribute if it has one. `__dict__` is preferred over `state` because some caches
    build `state` from fresh slices, which would be counted as extra arrays. Arrays are deduplicated by
    identity: two different array objects that are views of one buffer are both counted.
    """
    total = 0
    seen: set[int] = set()
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, _SKIPPED_TYPES):
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, mx.array):
            total += item.nbytes
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        elif hasattr(item, "__dict__"):
            stack.extend(vars(item).values())
        elif hasattr(item, "state"):
            stack.append(item.state)
    return total


def kv_cache_bytes(prompt_cache: list[Any]) -> int:
    """Bytes held by a prompt cache (one cache object per layer).

    This is what the cache has allocated, not just the filled part: mlx_lm's KVCache grows in steps of
    256 positions, so 10 cached tokens already hold a 256-position buffer.
    """
    return array_bytes(list(prompt_cache))


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of every memory number Velox shows; all sizes in bytes."""

    system_total: int
    system_available: int
    pressure: str
    process_rss: int
    mlx_active: int
    mlx_peak: int
    mlx_cache: int
    kv_cache: int  # 0 when no prompt cache was given

    def describe(self) -> str:
        """A one-line summary for a status bar or a log."""
        return (
            f"RAM {format_bytes(self.system_available)} free of {format_bytes(self.system_total)} "
            f"({self.pressure}), process {format_bytes(self.process_rss)}, "
            f"MLX {format_bytes(self.mlx_active)} (peak {format_bytes(self.mlx_peak)}, "
            f"cache {format_bytes(self.mlx_cache)}), KV cache {format_bytes(self.kv_cache)}"
        )


def snapshot(prompt_cache: list[Any] | None = None) -> MemorySnapshot:
    """Read system, process, MLX and (if given) KV-cache memory at once."""
    system = system_memory()
    mlx_counters = mlx_memory()
    return MemorySnapshot(
        system_total=system["total"],
        system_available=system["available"],
        pressure=system["pressure"],
        process_rss=process_rss(),
        mlx_active=mlx_counters["active"],
        mlx_peak=mlx_counters["peak"],
        mlx_cache=mlx_counters["cache"],
        kv_cache=kv_cache_bytes(prompt_cache) if prompt_cache is not None else 0,
    )
