"""A cache's kernels tried once on this machine's GPU before a conversation relies on them.

On a Mac the kernels run as Metal, which no compiler here has seen (the tests check their text against a model of
MSL: tests/metal_model.py); on NVIDIA they run through MLX's CUDA build. A kernel that does not build on the user's
GPU, or that computes something other than the reference path, must not cost an answer halfway through it. So before
a model's caches are handed out (`KVCacheBuilder.build`), each distinct layer configuration runs once on a small
random cache of the model's shape through its kernels: a 300-token chunk (a key block encoded, a window left over), a
decode step, a 16-token chunk over the compressed history; and the same inputs through the reference path. If a step
raises, or an output differs from the reference's by more than quantization can explain, kernels are turned off for
the rest of the process under "auto" (`kernels.backend.disable`: every cache then takes the reference path, and the
log says why) and the build fails with the reason under "require".

Once per configuration, shape and dtype in a process. Its time is mostly the GPU compiler's, building the kernels
the first reply would otherwise build: seconds to minutes where the machine has not compiled them before. So the chat
session runs it where the app shows progress (a switch of compression: `KVCacheBuilder.verify_kernels(progress)`),
and `build` finds it done. Nothing runs where no GPU kernel backend is (the CPU, CI).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx

from engine.errors import ConfigError
from engine.kvcache import kernels as _kernels
from engine.kvcache.config import KVCacheConfig

log = logging.getLogger(__name__)

PROBE_TOKENS = 300  # past a 128-token key block and a 256-token group, with a window left over
PROBE_CHUNK = 16  # a prefill chunk over the compressed history
STEP_NAMES = ("a decode step", "a chunk over the history")  # the two probes after the first chunk, as reported
# Relative to the outputs' size: the attention kernels against the reference path on the same arrays (their GPU parity
# tests hold 2e-3 in bfloat16 on outputs of about this size); the encode kernels' store against the reference's, which
# may differ by a code step where the two round a tie differently. A broken kernel is off by the outputs' own size.
ATTENTION_TOLERANCE = 0.02
ENCODE_TOLERANCE = 0.25

# Where the reference caches run, in order, the encode kernels' store being held to the first that it is close to: the
# CPU, then the default device (None; the next is filled only where the store is not close to the ones before). The KIVI
# encode kernel follows MLX's CPU rule for an affine group (its true max, ties to even); MLX's GPU `mx.quantize` starts
# a group's max at 0 and rounds half away from zero (BENCHMARKS.md, round 19), so at 2 bits about a tenth of bfloat16
# groups of random values get another scale there, up to 2.4 apart in decoded value (benchmarks/quantize_rule.py's
# emulation of both): held to the GPU's rule alone, the kernel failed its first run on an H200 by 0.145 with outputs up
# to 0.46. A layout the encode kernels decline quantizes on the GPU by the GPU's rule, hence the default device after.
# The CPU goes first because what runs there compiles nothing for the GPU: on an H100 a check with every reference on
# the default device took 39.5 s of a fresh machine's compiles, 31.3 s with them on the CPU (first_run_cost.py;
# BENCHMARKS.md, round 32), MLX's CUDA build compiling the references' float32 operations for it.
REFERENCE_DEVICES: tuple[Any, ...] = (mx.cpu, None)

# The GPU backends whose kernels are tried (the emulator's tests check their own kernels; theirs add it here).
CHECKED_BACKENDS: tuple[str, ...] = ("cuda", "metal")

_VERIFIED: set[tuple[Any, ...]] = set()


def verify_kernels(config: KVCacheConfig, shape: Any, dtype: mx.Dtype = mx.bfloat16,
                   progress: Callable[[str, float], None] | None = None) -> None:
    """Run the kernels of every distinct layer configuration of `config` once at `shape` (a ModelShape) in `dtype`,
    as the module docstring says; on a failure turn kernels off ("auto") or raise ConfigError ("require").
    `progress(message, fraction)` hears of each configuration before its run (seconds to minutes where the GPU
    compiler has not seen the kernels: the caller shows it rather than a first reply that seems to hang)."""
    mode = config.options.get("kernels", _kernels.DEFAULT_KERNEL_MODE)
    backend = _kernels.available_backend()
    if mode == "off" or backend not in CHECKED_BACKENDS:
        return
    # Imported here: the registry imports the methods, which import this package's base.
    from engine.kvcache.registry import get_method

    cache_class = get_method(config.method)
    pending: dict[tuple[Any, ...], int] = {}  # each configuration not yet run in this process: its first layer
    for index in range(shape.n_layers):
        key = (str(config.for_layer(index)), shape.n_heads, shape.n_kv_heads, shape.head_dim, str(dtype), backend)
        if key not in _VERIFIED:  # this process ran it already (a failure turned kernels off or raised)
            pending.setdefault(key, index)
    for done, (key, index) in enumerate(pending.items()):
        layer = key[0]
        if progress is not None:
            # short: the app shows it after "Calibrating for this model: " on the title's status line
            progress(f"GPU kernels ({done + 1} of {len(pending)})", done / len(pending))
        failure = _first_run(cache_class, config, index, shape, dtype)
        if failure is not None:
            reason = f"the {backend} kernels of {layer} failed their first run on this GPU: {failure}"
            if mode == "require":
                raise ConfigError(f"kernels='require' but {reason}.")
            log.warning("Turning the GPU kernels off for this session (every cache takes the reference path): %s",
                        reason)
            _kernels.backend.disable(reason)
            return
        _VERIFIED.add(key)


def _first_run(cache_class: Any, config: KVCacheConfig, index: int, shape: Any, dtype: mx.Dtype) -> str | None:
    """Why layer `index`'s kernels failed (None: they ran and agreed with the reference path)."""
    off = replace(config, options={**config.options, "kernels": "off"})
    on = config  # as the model's caches will run: a layout the kernels decline takes the reference path in both
    stream = mx.random.key(index)
    parts = mx.random.split(stream, 6)
    d = shape.head_dim

    def normal(part: int, tokens: int, heads: int) -> mx.array:
        return mx.random.normal((1, heads, tokens, d), key=parts[part]).astype(dtype)

    keys, values = normal(0, PROBE_TOKENS, shape.n_kv_heads), normal(1, PROBE_TOKENS, shape.n_kv_heads)
    steps = [
        (normal(2, 1, shape.n_kv_heads), normal(3, 1, shape.n_kv_heads), normal(4, 1, shape.n_heads)),
        (normal(2, PROBE_CHUNK, shape.n_kv_heads), normal(3, PROBE_CHUNK, shape.n_kv_heads),
         normal(5, PROBE_CHUNK, shape.n_heads)),
    ]
    scale = d**-0.5
    try:
        cache = cache_class(on, layer_index=index)
    except (ConfigError, ValueError) as error:  # a configuration that needs its model: not the kernels' doing
        log.info("Kernel check skipped for %s: %s", config.for_layer(index), error)
        return None
    # The kernels' cache against the reference path reading the same arrays (a shallow copy with kernels off): the
    # attention kernels, to their parity; then against caches filled through the reference path: the encode kernels,
    # to what quantization leaves (their rounding may differ from MLX's by a step on ties).
    outputs: list[tuple[str, bool, mx.array, mx.array]] = []  # (step, a kernel ran, kernels' output, same arrays')
    try:
        cache.update_and_fetch(keys, values)
        for name, (new_keys, new_values, queries) in zip(STEP_NAMES, steps, strict=True):
            cache.update_and_fetch(new_keys, new_values)
            same_arrays = copy.copy(cache)
            same_arrays.config = replace(cache.config, options={**cache.config.options, "kernels": "off"})
            got = _attention(cache, queries, scale)
            with mx.stream(mx.cpu):  # for the reason REFERENCE_DEVICES gives
                same = _attention(same_arrays, queries.astype(mx.float32), scale)
            mx.eval(got, same)
            outputs.append((name, _took_a_kernel(cache, queries), got, same))
    except Exception as error:  # noqa: BLE001 - a GPU compiler's refusal or a launch error: whatever it raises
        return f"{type(error).__name__}: {error}"
    for name, kernel_ran, got, same in outputs:
        size = max(float(mx.max(mx.abs(same))), 1e-3)
        error = float(mx.max(mx.abs(got - same)))
        if kernel_ran and not error <= ATTENTION_TOLERANCE * size:  # also NaN
            return f"{name} differs from the reference path by {error:.3g} (outputs up to {size:.3g})"
    failure = None
    for device in REFERENCE_DEVICES:
        failure = _encode_failure(outputs, cache_class(off, layer_index=index), device or mx.default_device(),
                                  (keys, values), steps, scale)
        if failure is None:
            return None
    return failure


def _attention(cache: Any, queries: mx.array, scale: float) -> mx.array:
    """`cache`'s attention to `queries` (causal for a chunk), as float32. The references get float32 queries, so the
    reference path computes in float32 (in 16 bits its own rounding is ~3 % of the outputs; the kernels compute in
    float32 and round only their output)."""
    mask = "causal" if queries.shape[2] > 1 else None
    return cache.attention(queries, None, None, scale=scale, mask=mask).astype(mx.float32)


def _encode_failure(outputs: list[tuple[str, bool, mx.array, mx.array]], reference: Any, device: Any,
                    first: tuple[mx.array, mx.array], steps: list[tuple[mx.array, mx.array, mx.array]],
                    scale: float) -> str | None:
    """Why the kernels' store is not close to that of `reference` (a cache with kernels off) fed the same tokens on
    `device`: each step's same-array output in `outputs` against the reference's attention to the same queries."""
    try:
        with mx.stream(device):
            reference.update_and_fetch(*first)
            found = []
            for new_keys, new_values, queries in steps:
                reference.update_and_fetch(new_keys, new_values)
                found.append(_attention(reference, queries.astype(mx.float32), scale))
            mx.eval(found)
    except Exception as error:  # noqa: BLE001 - as the kernels' run: a launch error on this device is a failure
        return f"{type(error).__name__}: {error}"
    for (name, _, _, same), expected in zip(outputs, found, strict=True):
        size = max(float(mx.max(mx.abs(same))), 1e-3)
        error = float(mx.max(mx.abs(same - expected)))
        if not error <= ENCODE_TOLERANCE * size:  # also NaN
            return (f"{name} over the kernels' encode differs from one over the reference's by {error:.3g} (outputs up "
                    f"to {size:.3g})")
    return None


def _took_a_kernel(cache: Any, queries: mx.array) -> bool:
    """Whether the cache's attention to `queries` ran a kernel (the decode pass for one token, the history decode for a
    chunk); where none ran, its 16-bit reference path is not held to the kernels' float32 precision."""
    if queries.shape[2] == 1:
        plan = getattr(cache, "_decode_plan", None)
        return plan is not None and plan(queries.shape[1] // cache._n_kv_heads) is not None
    launch = getattr(cache, "_dequantize_launch", None)
    return launch is not None and launch() is not None


def forget() -> None:
    """Forget which configurations were verified (tests)."""
    _VERIFIED.clear()
