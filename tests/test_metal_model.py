"""The Metal model (tests/metal_model.py) that checks every emulated launch's Metal text: it loads wherever the test
extras are installed, it refuses what Apple's compiler refuses in the ways the kernels could go wrong, and it takes
what MSL allows that OpenCL, whose front end it borrows, does not."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from engine.errors import ConfigError
from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape, kernels
from engine.kvcache.kernels import Codec, emulate
from engine.kvcache.kernels.backend import (
    METAL_MAX_BUFFERS,
    KernelSource,
    buffer_arguments,
    over_buffer_limit,
)
from tests import metal_model

HELPER = """
INLINE float first(const GLOBAL float* p) { return p[0]; }
INLINE void fill(THREAD float* p) { p[0] = 1.0f; }
"""


def _errors(body: str, sizes: tuple[int, ...] = (64,), header: str = HELPER,
            template: tuple[tuple[str, object], ...] = ()) -> tuple[str, ...]:
    names = tuple(f"x{i}" for i in range(len(sizes)))
    source = KernelSource(name="probe", input_names=names, output_names=("out",), body=body, header=header)
    unit = metal_model.metal_unit(source, [(mx.float32, size, 1) for size in sizes], [mx.float32], template)
    return metal_model.check_unit(unit)


def test_libclang_of_the_test_extras_loads_and_checks_every_emulated_launch() -> None:
    # pyproject's test extras install libclang: without it every emulated launch would go unchecked as Metal
    assert metal_model.available()
    assert metal_model.check_launch in emulate.LAUNCH_CHECKS


def test_a_plain_kernel_compiles() -> None:
    assert _errors("  SHARED float sh[32];\n  sh[TID] = first(x0);\n  BARRIER();\n  out[TID] = sh[31 - TID];\n") == ()


@pytest.mark.parametrize(("body", "sizes", "expected"), [
    # `half` is a type name in MSL (the tiled pass and the KIVI encode called variables so)
    ("  const float half = 0.5f;\n  out[TID] = half;\n", (64,), "declaration specifier"),
    # an input of fewer than 8 elements is MLX's `constant`: a helper taking device memory cannot read it
    ("  out[TID] = first(x0);\n", (4,), "no matching function"),
    ("  const GLOBAL float* p = x0;\n  out[TID] = p[0];\n", (4,), "cannot initialize"),
    # threadgroup memory is not the thread's
    ("  SHARED float sh[32];\n  fill(sh);\n  out[TID] = sh[0];\n", (64,), "no matching function"),
    # metal::max takes two values of one type (CUDA's fmaxf converts)
    ("  out[TID] = FMAX(x0[TID], 0);\n", (64,), "no matching function"),
    # simd_shuffle_xor takes 32-bit or narrower values
    ("  U64 w = 1;\n  w = LANE_XOR(w, 1);\n  out[TID] = (float)w;\n", (64,), "does not shuffle"),
    # as_type between types of one size
    ("  U64 w = 1;\n  out[TID] = as_type<float>(w);\n", (64,), "different sizes"),
    # a pointer without an address space is the thread's in MSL, not device memory's
    ("  float* p = (float*)x0;\n  out[TID] = p[0];\n", (64,), "address space"),
])
def test_what_metal_refuses_is_refused(body: str, sizes: tuple[int, ...], expected: str) -> None:
    errors = _errors(body, sizes)
    assert errors and any(expected in error for error in errors), errors


def test_the_same_kernel_passes_once_its_input_is_large_enough_for_device_memory() -> None:
    assert _errors("  out[TID] = first(x0);\n", (8,)) == ()
    # a small input indexed in the body itself works in either address space
    assert _errors("  out[TID] = x0[0];\n", (1,)) == ()


@pytest.mark.parametrize("body", [
    # names OpenCL reserves and MSL does not
    "  const int local = TID;\n  const int global = 2 * local;\n  out[TID] = (float)global;\n",
    # threadgroup memory declared in a nested block of the kernel (MLX's own sort kernel does)
    "  if (TID < 64) {\n    SHARED float sh[64];\n    sh[TID] = 1.0f;\n    out[TID] = sh[0];\n  }\n",
    # template constants as MLX's Metal front end passes them
    "  out[TID] = (float)(R * (FLAG ? 2 : 1));\n",
])
def test_what_metal_allows_passes(body: str) -> None:
    assert _errors(body, template=(("R", 4), ("FLAG", True))) == ()


def test_a_refused_launch_fails_in_the_emulator_before_it_runs() -> None:
    source = KernelSource(name="probe_half", input_names=("x",), output_names=("out",),
                          body="  const float half = x[TID];\n  out[TID] = half;\n")
    with pytest.raises(RuntimeError, match="would not compile as Metal"):
        emulate.emulated_kernel(source)(inputs=[mx.zeros((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                                        output_shapes=[(32,)], output_dtypes=[mx.float32])


def test_the_engine_counts_the_buffers_mlx_binds() -> None:
    from tests.test_kvcache_kernels import ALL_SOURCES

    for source in ALL_SOURCES:
        unit = metal_model.metal_unit(source, [(mx.float32, 64, 1)] * len(source.input_names),
                                      [mx.float32] * len(source.output_names), ())
        assert metal_model.buffers_in(unit) == buffer_arguments(source), source.name
    # every kernel fits (the tiled pass took 47 before the key widths' classes shared their scales, biases and outliers,
    # the polar pass 37 before its levels' tables were one input)
    assert not [s.name for s in ALL_SOURCES if over_buffer_limit(s, "metal") is not None]
    assert not any(over_buffer_limit(s, "cuda") for s in ALL_SOURCES)


def _cache_on_metal(spec: str, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    """A one-layer cache of `spec` holding 300 tokens (filled on the reference path), asked what it would decode with
    were the default device a Mac's GPU (nothing is launched)."""
    config = KVCacheConfig.parse(spec)
    off = replace(config, options={**config.options, "kernels": "off"})
    shape = ModelShape(n_layers=1, n_heads=8, n_kv_heads=2, head_dim=128)
    cache = KVCacheBuilder(off).for_shape(shape).build()[0]
    keys, values = (mx.random.normal((1, 2, 300, 128), key=mx.random.key(seed)) for seed in (1, 2))
    cache.update_and_fetch(keys, values)
    cache.config = replace(cache.config, options={**cache.config.options, "kernels": "auto"})
    monkeypatch.setattr(kernels, "available_backend", lambda: "metal")
    return cache


_ROPE_PRE = ("kivi:k3v3:g64:s4:key_block=128:key_outliers=1:rotate_values=true:symmetric_values=true:rope=pre:"
             "rope_dims=128:rope_base=500000.0:rope_scale=1.0:rope_traditional=false")


@pytest.mark.parametrize(("spec", "limit", "declined"), [
    ("kivi:k4v4:g64:s4:key_block=128", 31, False),  # plain KIVI: the tiled pass (30 buffers)
    ("affine:k4v4:g64", 31, False),
    ("kivi:k4v4:g64:s4:key_block=128:key_outliers=1", 31, False),  # the tiled pass adds the outliers
    (_ROPE_PRE, 31, False),  # keys before RoPE: the tiled pass turns them
    ("polarquant:k4v4:g64", 31, False),  # 25 buffers
    # were a kernel past the limit (here a limit of 29): plain KIVI takes the per-subgroup pass (24), the layouts only
    # the tiled pass reads (30) take the reference path, and "require" says why
    ("kivi:k4v4:g64:s4:key_block=128", 29, False),
    ("kivi:k4v4:g64:s4:key_block=128:key_outliers=1", 29, True),
    (_ROPE_PRE, 29, True),
])
def test_on_metal_a_kernel_past_its_buffer_arguments_is_never_launched(spec: str, limit: int, declined: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kvcache.kernels import backend

    monkeypatch.setattr(backend, "METAL_MAX_BUFFERS", limit)
    cache = _cache_on_metal(spec, monkeypatch)
    reason = cache._kernel_unsupported(rows=4)
    if declined:
        assert reason is not None and "buffer arguments" in reason
        cache.config = replace(cache.config, options={**cache.config.options, "kernels": "require"})
        cache._plan_cache = None
        with pytest.raises(ConfigError, match="buffer arguments"):
            cache._decode_plan(4)
    else:
        assert reason is None
        plan = cache._decode_plan(4)
        assert plan is not None and buffer_arguments(plan.source) <= limit, plan.source.name


def test_on_metal_key_widths_and_the_levels_history_decode_take_the_kernels() -> None:
    from engine.kvcache.kernels import decode, dequantize

    widths = Codec("kivi_keys", 3, widths=(2, 3, 4, 5), outliers=True)
    assert decode.unverified_on(widths, "metal") is None
    for key in (Codec("kivi_keys", 4), Codec("kivi_keys", 3, widths=(2, 3, 4, 5))):
        assert dequantize.supported(key, Codec("affine", 4), 128, "metal")  # the tiled history decode: 22
        source = dequantize.dequantize_source(key, Codec("affine", 4))
        assert buffer_arguments(source) <= METAL_MAX_BUFFERS


def test_threadgroup_memory_past_an_apple_gpus_is_refused() -> None:
    assert _errors("  SHARED float sh[8192];\n  sh[TID] = 1.0f;\n  out[TID] = sh[0];\n") == ()  # 32 KB exactly
    errors = _errors("  SHARED float sh[8192];\n  SHARED float more[1];\n  sh[TID] = more[0];\n  out[TID] = sh[0];\n")
    assert any("32772 bytes of threadgroup memory" in error for error in errors), errors


def test_the_committed_buffer_counts_are_the_kernels_own() -> None:
    import json
    from pathlib import Path

    committed = json.loads((Path(__file__).parents[1] / "benchmarks/results/metal-buffers.json").read_text())
    from tests.test_kvcache_kernels import ALL_SOURCES

    assert committed["limit"] == METAL_MAX_BUFFERS
    assert {row["kernel"]: row["buffers"] for row in committed["rows"]} == {
        source.name: buffer_arguments(source) for source in ALL_SOURCES}, "run benchmarks/metal_buffers.py"


def test_no_two_kernel_texts_share_a_name() -> None:
    # MLX's front ends keyed compiled kernels by name alone until August 2026 (Metal #3833, CUDA #4273): a second
    # text of the same name would have run the first one's code
    from tests.test_kvcache_kernels import ALL_SOURCES

    texts: dict[str, set[tuple[str, str]]] = {}
    for source in ALL_SOURCES:
        texts.setdefault(source.name, set()).add(source.for_backend("metal"))
    assert {name: len(found) for name, found in texts.items() if len(found) > 1} == {}
