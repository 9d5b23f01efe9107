"""Memory measurements: the machine, this process, MLX's allocator, and the bytes a KV cache really holds.

Sizes are reported in bytes; `engine.planning.units.format_bytes` shows them in decimal units.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
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


def system_memory(*, cgroup_root: Path | None = None, proc_cgroup: Path | None = None,
                  platform: str | None = None) -> dict[str, Any]:
    """Memory this process may use: total, available, used (bytes), percent used, a pressure level, and
    `limited_by` (what set the figures: 'physical memory', a cgroup, or macOS's page counts).

    The tightest of physical memory and every cgroup limit above this process (v1 or v2): inside a 1 GB
    container psutil alone reports the host's free memory, and a plan made from it ends with the kernel
    killing the process. On macOS, available memory is the kernel's own free + reclaimable figure
    (`macos_available_from_vm_stat`), when it is lower than psutil's. The cgroup paths and the platform are
    injectable for tests.
    """
    vm = psutil.virtual_memory()
    total, available, limited_by = int(vm.total), int(vm.available), "physical memory"
    if (platform or sys.platform) == "darwin":
        counted = _macos_available_from_vm_stat(total)
        if counted is not None and counted < available:
            available, limited_by = counted, "macOS free + reclaimable pages"
    for limit in cgroup_memory_limits(cgroup_root or CGROUP_ROOT, proc_cgroup or PROC_SELF_CGROUP):
        if limit.available < available:
            available, limited_by = limit.available, limit.where
        total = min(total, limit.limit)
    available = min(available, total)
    used = total - available
    return {
        "total": total,
        "available": available,
        "used": used,
        "percent": 100.0 * used / total if total > 0 else 100.0,
        "pressure": memory_pressure(available, total),
        "limited_by": limited_by,
    }


# ------------------------------------------------------------------------------------------ cgroup limits

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is no limit.
_CGROUP_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class CgroupLimit:
    """The memory limit of one cgroup this process belongs to (itself or an ancestor)."""

    limit: int  # bytes the cgroup may hold before the kernel reclaims and then OOM-kills
    usage: int  # bytes it holds now, this process included
    reclaimable: int  # inactive page cache the kernel drops before it kills anything
    where: str  # e.g. 'cgroup v2 /sys/fs/cgroup/user.slice/memory.max'

    @property
    def available(self) -> int:
        return max(0, self.limit - self.usage + min(self.reclaimable, self.usage))


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stat_value(path: Path, *keys: str) -> int:
    """The first of `keys` found in a cgroup memory.stat file (0 when none is)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(maxsplit=1) for line in lines if " " in line)
    for key in keys:
        if key in values and values[key].strip().isdigit():
            return int(values[key])
    return 0


def _own_cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory-controller path) of this process, from /proc/self/cgroup ('ID:controllers:path')."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    v2 = v1 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _self_and_ancestors(base: Path, relative: str | None) -> list[Path]:
    """`base/relative` and every folder above it up to `base` itself (limits nest: the tightest wins).
    A path that is not under the mount as seen from here (another namespace) leaves only `base`."""
    folders = [base]
    if relative:
        current = base
        for part in (piece for piece in relative.split("/") if piece and piece not in (".", "..")):
            current = current / part
            folders.append(current)
    return [folder for folder in folders if folder.is_dir()]


def cgroup_memory_limits(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> list[CgroupLimit]:
    """Every memory limit set on this process's cgroups, v2 (`memory.max`) and v1
    (`memory/memory.limit_in_bytes`); empty when there are none or no cgroup file system is mounted."""
    v2_path, v1_path = _own_cgroup_paths(proc_cgroup)
    limits = []
    for folder in _self_and_ancestors(root, v2_path):
        raw = _read_text(folder / "memory.max")
        if raw is None or raw == "max" or not raw.isdigit():
            continue
        limits.append(CgroupLimit(
            limit=int(raw), usage=_read_int(folder / "memory.current") or 0,
            reclaimable=_stat_value(folder / "memory.stat", "inactive_file"),
            where=f"cgroup v2 {folder / 'memory.max'}",
        ))
    for folder in _self_and_ancestors(root / "memory", v1_path):
        limit = _read_int(folder / "memory.limit_in_bytes")
        if limit is None or limit >= _CGROUP_V1_UNLIMITED:
            continue
        limits.append(CgroupLimit(
            limit=limit, usage=_read_int(folder / "memory.usage_in_bytes") or 0,
            reclaimable=_stat_value(folder / "memory.stat", "total_inactive_file", "inactive_file"),
            where=f"cgroup v1 {folder / 'memory.limit_in_bytes'}",
        ))
    return limits


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


# ------------------------------------------------------------------------------------ macOS page counts

VM_STAT_COMMAND = ("vm_stat",)
_VM_STAT_LINE = re.compile(r'^"?([^:"]+)"?:\s+(\d+)\.?$')
_VM_STAT_PAGE_SIZE = re.compile(r"page size of (\d+) bytes")
# The counters the free + reclaimable figure is made of, and the page lists that together cover the machine's
# memory (the check that the output describes this machine); without any of them there is no figure.
VM_STAT_HELD = ("Anonymous pages", "Pages wired down", "Pages occupied by compressor")
VM_STAT_LISTS = ("Pages free", "Pages active", "Pages inactive", "Pages speculative", "Pages wired down",
                 "Pages occupied by compressor")
# The page lists may add up to a little more than the memory the OS reports (a few pages in flight).
VM_STAT_SLACK = 1.02


def parse_vm_stat(text: str) -> tuple[int | None, dict[str, int]]:
    """(page size in bytes, {counter: pages}) from the output of macOS's `vm_stat`. The page size is None when
    the header line that states it is missing or is not a power of two of at least 1 KiB: Apple Silicon counts
    16 KiB pages and Intel 4 KiB, so guessing would be off by four times. Lines in other shapes are skipped."""
    size = _VM_STAT_PAGE_SIZE.search(text)
    page_size = int(size.group(1)) if size else None
    if page_size is not None and (page_size < 1024 or page_size & (page_size - 1)):
        page_size = None
    counters = {}
    for line in text.splitlines():
        match = _VM_STAT_LINE.match(line.strip())
        if match:
            counters[match.group(1).strip()] = int(match.group(2))
    return page_size, counters


def macos_available_bytes(total: int, page_size: int, counters: dict[str, int]) -> int:
    """Free + reclaimable memory the way Activity Monitor counts it: everything but app memory
    (anonymous pages that are not purgeable), wired memory and the compressor's pages. psutil counts
    free + inactive instead, which includes dirty app pages that can only go to swap."""
    app = max(0, counters.get("Anonymous pages", 0) - counters.get("Pages purgeable", 0))
    held = app + counters.get("Pages wired down", 0) + counters.get("Pages occupied by compressor", 0)
    return max(0, total - held * page_size)


def macos_available_from_vm_stat(output: str, total: int) -> int | None:
    """Free + reclaimable bytes of a machine of `total` bytes, from its `vm_stat` output; None when the output
    cannot be trusted (no page size, a needed counter missing, or page lists that add up to more memory than
    the machine has), so the caller keeps psutil's figure instead of acting on a wrong one."""
    page_size, counters = parse_vm_stat(output)
    if page_size is None or any(name not in counters for name in (*VM_STAT_HELD, *VM_STAT_LISTS)):
        return None
    if sum(counters[name] for name in VM_STAT_LISTS) * page_size > total * VM_STAT_SLACK:
        return None  # the output describes a bigger machine (or another page size) than this one
    available = macos_available_bytes(total, page_size, counters)
    return available if available > 0 else None


def _macos_available_from_vm_stat(total: int) -> int | None:
    # The only macOS-only code: run vm_stat (milliseconds). None when it cannot be run or read.
    try:
        finished = subprocess.run(list(VM_STAT_COMMAND), capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return None
    if finished.returncode != 0:
        return None
    return macos_available_from_vm_stat(finished.stdout, total)


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
