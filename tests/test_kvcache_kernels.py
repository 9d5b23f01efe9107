"""The kernel layer (engine/kvcache/kernels): sources for both backends, the mode switch, CPU fallback, and
parity of the fused decode kernel with the pure-MLX reference where a GPU kernel backend exists.

The parity tests need MLX's CUDA or Metal build on a GPU default device and are skipped elsewhere (the CPU
CI keeps running the reference path through every other test). Where `nvcc` and MLX's CUDA device headers
are installed, the CUDA translation units are compiled for sm_90 exactly as MLX would generate them, so a
syntax error in a kernel shows up on a machine without a GPU.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.errors import ConfigError
from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape
from engine.kvcache.kernels import available_backend, check_kernel_mode, resolve_backend
from engine.kvcache.kernels.backend import BACKENDS, KernelSource, cuda_unit, names_are_distinct
from engine.kvcache.kernels.decode import (
    MERGE_SOURCE,
    TABLE_SLOTS,
    TILED_RUN,
    Codec,
    attend_source,
    staged_tables,
    tiled_source,
)
from engine.kvcache.kernels.dequantize import (
    KIVI_TILE_TOKENS,
    SIGNS_SOURCE,
    SKETCH_MMA_SOURCE,
    dequantize_source,
)
from engine.kvcache.kernels.encode import SIGN_PACK_SOURCE, encode_source, sketch_signs_packed
from engine.kvcache.kernels.kivi_encode import encode_source as kivi_encode_source
from engine.kvcache.quant.bitpack import unpack_bits
from tests.kvcache_helpers import (
    filled_then_stepped,
    kivi_chunk,
    kivi_group_errors,
    mma_gemm,
    mma_gemm_source,
    registered_width_table,
)

# Every (key codec, value codec) pair a method uses, at every width it supports.
CODEC_PAIRS = (
    *[(Codec("affine", b), Codec("affine", b)) for b in (2, 3, 4, 5, 6, 8)],
    *[(Codec("kivi_keys", b), Codec("affine", b)) for b in (2, 3, 4, 8)],
    *[(Codec("kivi_keys", b), Codec("affine", b, symmetric=True)) for b in (3, 4)],  # symmetric_values
    *[(Codec("codebook", b), Codec("codebook", b)) for b in (1, 2, 3, 4)],
    *[(Codec("rvq", (b + 1) // 2, b // 2), Codec("rvq", (b + 1) // 2, b // 2)) for b in (2, 3, 4)],
    *[(Codec("prod", b - 1), Codec("codebook", b)) for b in (2, 3, 4)],  # turboquant_prod
    *[(Codec("qjl", b), Codec("affine", 4)) for b in (1, 2, 4)],
    *[(Codec("polar", b + 1, b - 1, levels=levels), Codec("polar", b + 1, b - 1, levels=levels))
      for b in (2, 3, 4) for levels in (6, 7)],
    *[(Codec("vq", index, g), Codec("vq", index, g)) for index, g in ((8, 8), (8, 4), (6, 2), (8, 2))],  # 1-4 bits
)
ALL_SOURCES = (
    MERGE_SOURCE, tiled_source(), encode_source(1), encode_source(2), encode_source(1, sketch=True), encode_source(0, sketch=True),
    encode_source(1, rotate=True), encode_source(2, rotate=True), encode_source(1, sketch=True, rotate=True),
    *(attend_source(k, v) for k, v in CODEC_PAIRS),
    *(dequantize_source(k, v) for k, v in CODEC_PAIRS),
    *(dequantize_source(k, v, proj=True) for k, v in CODEC_PAIRS if k.kind in ("prod", "qjl")), SIGNS_SOURCE,
    *(kivi_encode_source(classes, outliers, symmetric) for classes in (1, 4) for outliers in (False, True)
      for symmetric in (False, True)),
    mma_gemm_source(), SIGN_PACK_SOURCE, SKETCH_MMA_SOURCE,
)

# The specs the parity tests cover: every method, untidy windows and sinks, several widths.
PARITY_SPECS = (
    ("affine", 4, 64, 0, 0),
    ("affine", 3, 32, 5, 3),
    ("affine", 8, 128, 0, 4),
    ("rotated", 4, 64, 0, 0),
    ("rotated", 2, 64, 17, 0),
    ("kivi", 4, 64, 0, 0),
    ("kivi", 3, 32, 9, 4),
    ("kivi", 4, 64, 0, 4, {"key_block": 128}),
    ("kivi", 4, 64, 0, 4, {"key_block": 128, "rotate_values": True}),  # the app's 4-bit level
    ("kivi", 5, 64, 0, 4, {"key_block": 128, "rotate_values": True}),  # a wide layer of it (option wide)
    ("kivi", 4, 32, 0, 0, {"key_block": 128}),
    ("kivi", 2, 64, 0, 0),
    ("turboquant", 4, 64, 0, 0),
    ("turboquant", 3, 64, 7, 2),
    ("turboquant", 1, 64, 0, 0),
    ("rvq", 4, 64, 0, 0),
    ("rvq", 3, 64, 3, 1),
)


# ----- sources (string level, every backend) ---------------------------------------------------------------


@pytest.mark.parametrize("source", ALL_SOURCES, ids=lambda s: s.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_kernel_assembles_for_both_backends(source: KernelSource, backend: str) -> None:
    header, body = source.for_backend(backend)
    # The dialect is fully defined by the prelude: no CUDA-only or Metal-only spelling leaks into a body.
    assert "__shfl" not in source.body and "simd_" not in source.body and "threadIdx" not in source.body
    if backend == "cuda":
        assert "__shfl_xor_sync" in header and "threadIdx.x" in body and "__syncthreads" in header
        assert "threadgroup_barrier" not in header + body and "simd_shuffle" not in header + body
    else:
        # MLX's Metal front end adds the attributes a body names; the prelude must name them in the body.
        assert "thread_position_in_threadgroup" in body and "threadgroups_per_grid" in body
        assert "simd_shuffle_xor" in header and "threadgroup_barrier" in header
        assert "__syncthreads" not in header + body and "__device__" not in header + body
    # Every macro the body uses is defined by the header or the defines.
    used = set(re.findall(r"\b(LOAD_KEY|LOAD_VALUE|LANE_XOR|BARRIER|EXP|FMAX|SHARED|GLOBAL|THREAD|U32|U64|U2F)\b", body))
    for macro in used:
        assert f"#define {macro}" in header + body, macro
    assert names_are_distinct(source.input_names + source.output_names)
    # Balanced braces: a stray macro edit would show here first.
    assert body.count("{") == body.count("}") and header.count("{") == header.count("}")


def test_shape_names_are_found_only_for_their_own_input() -> None:
    assert names_are_distinct(("k0", "v0", "sink_k", "win_k"))
    assert not names_are_distinct(("k", "sink_k"))  # "k_shape" would be found inside "sink_k_shape"


# ----- the CUDA translation units compile (needs nvcc and MLX's CUDA device headers; no GPU) -------------


def _mlx_include() -> Path | None:
    """MLX's include folder with the CUDA device headers: the installed wheel's (CUDA builds ship them) or
    VELOX_MLX_CUDA_INCLUDE (e.g. `git archive v0.32.1 mlx/backend/cuda/device` of MLX's repository)."""
    for root in (os.environ.get("VELOX_MLX_CUDA_INCLUDE"), Path(mx.__file__).parent / "include"):
        if root and (Path(root) / "mlx/backend/cuda/device/utils.cuh").exists():
            return Path(root)
    return None


def _cuda_type(dtype: mx.Dtype) -> str:
    return {
        mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
        mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.int32: "int32_t",
    }[dtype]


def _cuda_unit(source: KernelSource, inputs: dict[str, mx.Dtype], outputs: dict[str, mx.Dtype],
               template: dict[str, object]) -> str:
    """The translation unit MLX's `cuda_kernel` builds, with MLX's own device header."""
    types = {name: _cuda_type(dtype) for name, dtype in {**inputs, **outputs}.items()}
    constants = [(k, _cuda_type(v) if isinstance(v, mx.Dtype) else int(v)) for k, v in template.items()]
    return cuda_unit(source, types, constants, '#include "mlx/backend/cuda/device/utils.cuh"')


def _attend_dtypes(key: Codec, value: Codec) -> dict[str, mx.Dtype]:
    dtypes = {"qry": mx.bfloat16, "qscale": mx.float32, "n_comp_r": mx.uint8, "n_win_r": mx.uint8}
    dtypes |= {n: mx.bfloat16 for n in ("sink_k", "sink_v", "win_k", "win_v")}
    for prefix, codec in (("k", key), ("v", value)):
        kinds = {
            "affine": (mx.uint32, mx.bfloat16, mx.bfloat16),
            "kivi_keys": (mx.uint32, mx.bfloat16, mx.bfloat16),
            "codebook": (mx.uint32, mx.bfloat16, mx.float32),
            "rvq": (mx.uint32, mx.bfloat16, mx.float32, mx.uint32, mx.bfloat16, mx.float32),
            "prod": (mx.uint32, mx.bfloat16, mx.float32, mx.bfloat16, mx.uint32),
            "qjl": (mx.uint32, mx.bfloat16),
            "polar": (mx.uint32, mx.bfloat16, mx.uint32, mx.float32),
            "vq": (mx.uint32, mx.bfloat16, mx.float16),
        }[codec.kind]
        dtypes |= {f"{prefix}{i}": dtype for i, dtype in enumerate(kinds)}
    if key.kind in ("prod", "qjl"):
        dtypes["qry2"] = mx.float32
    return dtypes


# The key widths' inputs (decode.WIDTH_INPUTS) of the kernels reading KIVI keys, as the caches pass them.
_WIDTH_DTYPES = {"kends": mx.int32, "kord": mx.uint8, "kinv": mx.uint8} | {f"w{c}c": mx.uint32 for c in (1, 2, 3)}


@pytest.mark.skipif(shutil.which("nvcc") is None or _mlx_include() is None,
                    reason="needs nvcc and MLX's CUDA device headers (mlx/include) to compile CUDA sources")
def test_cuda_sources_compile_for_sm90(tmp_path: Path) -> None:
    # One pair per codec kind (nvcc takes ~30 s a unit on a small CPU); every pair assembles above.
    kinds_seen: set[str] = set()
    pairs = [p for p in CODEC_PAIRS if not (p[0].kind in kinds_seen or kinds_seen.add(p[0].kind))]
    units = []
    for key, value in pairs:
        source = attend_source(key, value)
        # and the centroid tables in threadgroup memory (decode.STAGED_TABLE_BACKENDS) where the codec has any
        staged = (staged_tables(source),) if key.kind in TABLE_SLOTS else ()
        for variant in (source, *staged):
            units.append(_cuda_unit(variant, _attend_dtypes(key, value),
                                    {"part_m": mx.float32, "part_l": mx.float32, "part_o": mx.float32},
                                    {"D": 128, "R": 4, "NT": 128, "G": 64, "GK": 64, "CT": 64, "U": 2, "CS": 4, "NS": 4,
                                     "TD": mx.bfloat16}))
    for stages, rotate in ((1, False), (2, False), (2, True)):  # and the rotation applied in the kernel (ROTATE)
        source = encode_source(stages, rotate=rotate)
        names = source.input_names + source.output_names
        dtypes = {n: mx.float32 for n in names} | {"xin": mx.bfloat16, "norms": mx.bfloat16,
                                                    "rscales": mx.bfloat16, "packed": mx.uint32, "residual": mx.uint32}
        units.append(_cuda_unit(source, dtypes, dtypes, {"D": 128, "NT": 128, "TN": mx.bfloat16, "B1": 2, "NB1": 3,
                                                         "B2": 2, "NB2": 3, "TR": mx.bfloat16}))
    kivi, affine = Codec("kivi_keys", 4), Codec("affine", 4)
    # keys as given; keys stored before RoPE (KIVI's rope=pre); each with block outliers (key_outliers); key channels at
    # widths 2-5 (key_widths: KCLS), class by class and uniform, as given and before RoPE; then CUDA's long tile
    # (decode.TILED_LONG_TILES) and keys before RoPE turned a run at a time (decode.ROPE_STEP_BACKENDS)
    from engine.kvcache.kernels.decode import rope_by_step

    for rope, outliers, classes, uniform, tile, step in (
            (0, 0, 0, 0, 64, 0), (1, 0, 0, 0, 64, 0), (0, 1, 0, 0, 64, 0), (1, 1, 0, 0, 64, 0), (0, 1, 4, 0, 64, 0),
            (0, 1, 4, 1, 64, 0), (1, 1, 4, 0, 64, 0), (0, 1, 4, 0, 128, 0), (1, 1, 4, 0, 128, 1)):
        units.append(_cuda_unit(rope_by_step(tiled_source()) if step else tiled_source(),
                                _attend_dtypes(kivi, affine) | _WIDTH_DTYPES
                                | {"grids": mx.float32, "rfreq": mx.float32, "kout": mx.float16,
                                   "kidx": mx.uint8},
                                {"part_m": mx.float32, "part_l": mx.float32, "part_o": mx.float32},
                                {"D": 128, "R": 4, "NT": 128, "G": 64, "GK": 128, "CT": tile, "KB": 5 if classes else 4,
                                 "VB": 4, "KGRID": int(not outliers and not classes), "PF": 1, "VGRID": 0, "ROPE": rope,
                                 "TRAD": 0, "KO": outliers, "VSYM": outliers, "TT": TILED_RUN, "CS": 4, "NS": 4,
                                 "KCLS": classes, "KBLO": 2 if classes else 4, "KUNI": uniform,
                                 "KMEAN": 3 if classes else 4, "TD": mx.bfloat16}))
    # KIVI's history decode: keys before RoPE with block outliers; values with(out) biases; key widths 2-5
    for symmetric, classes in ((0, 0), (1, 0), (1, 4)):
        value = Codec("affine", 3, symmetric=bool(symmetric))
        dtypes = {"k0": mx.uint32, "k1": mx.bfloat16, "k2": mx.bfloat16, "kout": mx.float16, "kidx": mx.uint8,
                  "rfreq": mx.float32, "v0": mx.uint32, "v1": mx.bfloat16, "v2": mx.bfloat16, "n_comp_r": mx.uint8}
        key = Codec("kivi_keys", 3, outliers=True, widths=(2, 3, 4, 5) if classes else ())
        units.append(_cuda_unit(dequantize_source(key, value), dtypes | _WIDTH_DTYPES,
                                {"keys": mx.bfloat16, "values": mx.bfloat16},
                                {"D": 128, "G": 64, "NT": 128, "TD": mx.bfloat16, "GK": 128, "KB": 5 if classes else 3,
                                 "ROPE": 1, "TRAD": 0, "KO": 1, "KCLS": classes, "KBLO": 2 if classes else 3,
                                 "TT": KIVI_TILE_TOKENS}))
    for key, value in pairs:
        if key.kind != "kivi_keys":
            dtypes = {name: dtype for name, dtype in _attend_dtypes(key, value).items() if name[0] in "kv" and name[1:].isdigit()}
            units.append(_cuda_unit(dequantize_source(key, value), dtypes | {"n_comp_r": mx.uint8, "sk": mx.float16},
                                    {"keys": mx.bfloat16, "values": mx.bfloat16},
                                    {"D": 128, "G": 64, "NT": 128, "TD": mx.bfloat16}))
    # KIVI's chunk encode: four key width classes with outliers and symmetric values (the 3-bit level), one class
    # without either (the 4-bit level's values keep biases)
    for classes, outliers, symmetric in ((4, True, True), (1, False, False)):
        source = kivi_encode_source(classes, outliers, symmetric)
        dtypes = {"keys": mx.bfloat16, "values": mx.bfloat16, "kord": mx.uint8, "kends": mx.int32, "kwid": mx.int32}
        dtypes |= {name: {"c": mx.uint32, "s": mx.bfloat16, "b": mx.bfloat16, "r": mx.float16, "i": mx.uint8}[name[1]]
                   for name in source.output_names if name[0] == "k"}
        dtypes |= {"vc": mx.uint32, "vs": mx.bfloat16, "vb": mx.bfloat16}
        units.append(_cuda_unit(source, dtypes, dtypes,
                                {"D": 128, "GK": 128, "NCL": classes, "ORD": int(classes > 1), "KQ": 0,
                                 "VQ": 2 if symmetric else 0, "G": 64, "VB": 3, "NT": 128, "TD": mx.bfloat16,
                                 "TDK": 1, "TR": mx.float16}))
    # sketched keys: the ±1 rows in float16, their projection on the warp matrix ops, a long chunk's sign packing
    units.append(_cuda_unit(SIGNS_SOURCE, {"n_comp_r": mx.uint8, "signs": mx.uint32}, {"pm": mx.float16},
                            {"W": 16, "NT": 128, "TD": mx.float16}))
    units.append(_cuda_unit(SKETCH_MMA_SOURCE, {"n_comp_r": mx.uint8, "signs": mx.uint32, "sk": mx.float16},
                            {"proj": mx.float32}, {"D": 128, "M": 512, "NT": 128}))
    units.append(_cuda_unit(SIGN_PACK_SOURCE, {"proj": mx.float32}, {"packed": mx.uint32}, {"W": 16, "NT": 128}))
    units.append(_cuda_unit(MERGE_SOURCE, dict.fromkeys(("part_m", "part_l", "part_o", "signs", "oscale"), mx.float32),
                            {"out": mx.bfloat16}, {"D": 128, "R": 4, "NM": 128, "MAXS": 256, "ROT": 1,
                                                   "TO": mx.bfloat16}))
    for index, unit in enumerate(units):
        path = tmp_path / f"kernel{index}.cu"
        path.write_text(unit)
        result = subprocess.run(
            ["nvcc", "-std=c++17", "-arch=sm_90", "-c", "-o", str(tmp_path / f"k{index}.o"),
             f"-I{_mlx_include()}", str(path)],
            capture_output=True, text=True, timeout=600,
        )
        assert result.returncode == 0, result.stderr[-4000:]


# ----- the switch -------------------------------------------------------------------------------------------


def test_kernel_mode_is_checked_with_the_config() -> None:
    for mode in ("auto", "require", "off"):
        assert check_kernel_mode(mode) == mode
    with pytest.raises(ConfigError, match="kernels option"):
        KVCacheConfig(method="kivi", key_bits=4, options={"kernels": "always"}).validate(128)


@pytest.mark.skipif(available_backend() is not None, reason="checks the CPU fallback")
def test_cpu_falls_back_under_auto_and_require_says_why() -> None:
    assert resolve_backend("auto") is None and resolve_backend("off") is None
    with pytest.raises(ConfigError, match="kernels='require' but the default device"):
        resolve_backend("require")
    caches = _filled("kivi", 4, 64, 0, 0, tokens=200, mode="require")
    queries = mx.random.normal((1, 4, 1, 64))
    with pytest.raises(ConfigError, match="require"):
        caches.attention(queries, None, None, scale=0.125, mask=None)
    auto = _filled("kivi", 4, 64, 0, 0, tokens=200, mode="auto")
    off = _filled("kivi", 4, 64, 0, 0, tokens=200, mode="off")
    a = auto.attention(queries, None, None, scale=0.125, mask=None)
    b = off.attention(queries, None, None, scale=0.125, mask=None)
    assert mx.array_equal(a, b)


def test_caches_without_a_kernel_say_why() -> None:
    """What `kernels='require'` reports on a GPU, and `auto` silently falls back on: KIVI's own key blocks and
    sinks' copies, the sketched keys of qjl and turboquant_prod and PolarQuant's angles have variants (a backend not
    in decode.SKETCH_BACKENDS or POLAR_BACKENDS would decline them: next test)."""
    shape = ModelShape(n_layers=1, n_heads=4, n_kv_heads=1, head_dim=64)
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((1, 1, 300, 64), dtype=np.float32))

    def reason(config: KVCacheConfig) -> str | None:
        cache = KVCacheBuilder(config).for_shape(shape).build()[0]
        cache.update_and_fetch(keys, keys)
        return cache._kernel_unsupported(shape.n_heads // shape.n_kv_heads)

    assert reason(KVCacheConfig("kivi", 4, group_size=64)) is None
    # KIVI's own key blocks and its sinks' copies in the block stream have kernel variants too
    assert reason(KVCacheConfig("kivi", 4, group_size=64, options={"key_block": 128}, sink_tokens=4)) is None
    for method in ("polarquant", "qjl", "turboquant_prod"):
        assert reason(KVCacheConfig(method, 4)) is None, method


def test_polar_codec_waits_for_its_parity_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kvcache import kernels
    from engine.kvcache.kernels import decode

    config = KVCacheConfig("polarquant", 4)
    cache = KVCacheBuilder(config).for_shape(ModelShape(n_layers=1, n_heads=4, n_kv_heads=1, head_dim=64)).build()[0]
    keys = mx.array(np.random.default_rng(0).standard_normal((1, 1, 100, 64), dtype=np.float32))
    cache.update_and_fetch(keys, keys)
    monkeypatch.setattr(kernels, "available_backend", lambda: "some-new-backend")
    assert "parity" in cache._kernel_unsupported(4)
    monkeypatch.setattr(decode, "POLAR_BACKENDS", ("some-new-backend",))
    assert cache._kernel_unsupported(4) is None


def test_sketched_keys_wait_for_their_parity_run_and_fit_the_threadgroup() -> None:
    from engine.kvcache.kernels import decode

    qjl, prod = Codec("qjl", 4), Codec("prod", 3)
    assert decode.sketch_declines(prod, 128, 4, "cuda") is None and decode.sketch_declines(qjl, 128, 4, "metal") is None
    assert "parity" in decode.sketch_declines(qjl, 128, 4, "some-new-backend")
    # qjl's 4 sketch rows per channel at 16 query heads per kv head: 32 KB of sketched queries alone
    assert "threadgroup memory" in decode.sketch_declines(qjl, 128, 16, "cuda")
    assert decode.sketch_declines(prod, 128, 16, "cuda") is None


# ----- parity with the reference (GPU backends only) ------------------------------------------------------


def _filled(method: str, bits: int, group: int, window: int, sinks: int, tokens: int, mode: str,
            head_dim: int = 64, n_kv: int = 2, dtype: mx.Dtype = mx.float32, seed: int = 0,
            options: dict | None = None, spiked: bool = False):
    """A one-layer cache of `tokens` random tokens, filled in an untidy chunk and then token by token. `spiked`: 1 %
    of the key entries 12 larger or smaller, so each block's outlier (KIVI's key_outliers) weighs in the scores."""
    config = KVCacheConfig(method=method, key_bits=bits, group_size=group, residual_window=window,
                           sink_tokens=sinks, options={**(options or {}), "kernels": mode})
    shape = ModelShape(n_layers=1, n_heads=4 * n_kv, n_kv_heads=n_kv, head_dim=head_dim)
    cache = KVCacheBuilder(config).for_shape(shape).build()[0]
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((1, n_kv, tokens, head_dim), dtype=np.float32)
    if spiked:
        keys += (rng.random(keys.shape) < 0.01) * rng.choice([-12.0, 12.0], size=keys.shape).astype(np.float32)
    values = rng.standard_normal((1, n_kv, tokens, head_dim), dtype=np.float32)
    return filled_then_stepped(cache, mx.array(keys).astype(dtype), mx.array(values).astype(dtype))


def _error_against_cpu_reference(fused, n_kv: int, repeats: int, head_dim: int, seed: int) -> float:
    """Max abs error of one bf16 query token's attention through `fused` (its kernels as configured) against the
    reference path over the same compressed arrays, in float32 on the CPU stream."""
    queries = mx.array(np.random.default_rng(seed).standard_normal((1, n_kv * repeats, 1, head_dim),
                                                                   dtype=np.float32)).astype(mx.bfloat16)
    out = fused.attention(queries, None, None, scale=head_dim**-0.5, mask=None)
    with mx.stream(mx.cpu):
        ref = _reference_of(fused).attention(queries.astype(mx.float32), None, None, scale=head_dim**-0.5, mask=None)
        mx.eval(ref)
    return float(mx.max(mx.abs(out.astype(mx.float32) - ref)))


def _peaked_excess_over_cpu_reference(fused, seed: int) -> float:
    """How far one bf16 query token's attention through `fused` (kernels required; 8 query heads of 128 channels over
    2 kv heads) strays from the reference path over the same arrays, in float32 on the CPU stream, beyond the bf16
    output's own rounding (half a unit, 2^-8 relative: keys with large entries make attention peaked, so outputs near
    1 are common)."""
    queries = mx.array(np.random.default_rng(seed).standard_normal((1, 8, 1, 128), dtype=np.float32))
    queries = queries.astype(mx.bfloat16)
    out = fused.attention(queries, None, None, scale=128**-0.5, mask=None)
    with mx.stream(mx.cpu):
        ref = _reference_of(fused).attention(queries.astype(mx.float32), None, None, scale=128**-0.5, mask=None)
        mx.eval(ref)
    return float(mx.max(mx.abs(out.astype(mx.float32) - ref) - 2**-8 * mx.abs(ref)))


needs_gpu = pytest.mark.skipif(available_backend() is None,
                               reason="needs MLX's CUDA or Metal build on a GPU default device (kernel backend)")


@pytest.fixture(autouse=True)
def _kernels_on_for_each_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build whose first run of the kernels fails under "auto" turns them off for the process
    (kernel_check.py): each test starts with them on, so one failure stays that test's own instead of turning every
    later test of its process onto the reference path (on the H200 the GPU parity tests share 12 processes)."""
    from engine.kvcache.kernels import backend as kernel_backend

    monkeypatch.setattr(kernel_backend, "_DISABLED", [])


def _reference_of(cache):
    """The same cache contents (shared arrays) with kernels off: the pure-MLX reference path."""
    reference = copy.copy(cache)
    reference.config = replace(cache.config, options={**cache.config.options, "kernels": "off"})
    return reference


@needs_gpu
@pytest.mark.parametrize("spec", PARITY_SPECS, ids=lambda s: "-".join(map(str, s)).replace("{'key_block': ", "kb").replace(", 'rotate_values': True", "-rv").rstrip("}"))
@pytest.mark.parametrize("tokens", (70, 1000, 4097))
def test_decode_kernel_matches_reference(spec: tuple, tokens: int) -> None:
    """bf16 cache and queries; the reference attends over the very same compressed arrays on the CPU
    stream in float32 (MLX's CUDA quantized_matmul has no kernel for most of these untidy shapes)."""
    method, bits, group, window, sinks, *extra = spec
    options = extra[0] if extra else {}
    if tokens <= options.get("key_block", 0):
        pytest.skip("fewer tokens than one KIVI key block: nothing compressed for the kernel to read")
    for head_dim, n_kv, repeats in ((128, 2, 4), (64, 3, 2)):
        if head_dim % group:
            continue
        fused = _filled(method, bits, group, window, sinks, tokens, "require", head_dim, n_kv, mx.bfloat16,
                        options=options,
                        seed=tokens)
        reference = _reference_of(fused)
        rng = np.random.default_rng(tokens + 7)
        queries = mx.array(rng.standard_normal((1, n_kv * repeats, 1, head_dim), dtype=np.float32))
        queries = queries.astype(mx.bfloat16)
        scale = head_dim**-0.5
        assert fused.n_compressed > 0
        out = fused.attention(queries, None, None, scale=scale, mask=None)
        out_causal = fused.attention(queries, None, None, scale=scale, mask="causal")
        mx.eval(out, out_causal)
        with mx.stream(mx.cpu):
            ref = reference.attention(queries.astype(mx.float32), None, None, scale=scale, mask=None)
            mx.eval(ref)
        assert out.shape == ref.shape and out.dtype == mx.bfloat16
        error = float(mx.max(mx.abs(out.astype(mx.float32) - ref)))
        assert np.isfinite(error) and error <= 2e-3, f"{spec} tokens={tokens} D={head_dim}: max abs err {error}"
        assert mx.array_equal(out, out_causal)


@needs_gpu
@pytest.mark.parametrize("spec", [("turboquant", 4, 64, 0, 0), ("turboquant", 2, 64, 5, 2), ("rvq", 4, 64, 0, 0),
                                  ("rvq", 3, 64, 5, 2), ("turboquant_prod", 4, 64, 0, 0)],
                         ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("tokens", (70, 4097))
def test_decode_kernel_with_staged_tables_matches_the_device_tables(spec: tuple, tokens: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The codebook codecs' centroids read from threadgroup memory (this GPU's backend let into
    decode.STAGED_TABLE_BACKENDS) give the same attention, exactly, as read from the device tables, which the parity
    tests above hold to the reference: the parity run behind a backend's place in that list."""
    from engine.kvcache.kernels import decode

    method, bits, group, window, sinks = spec
    if method == "turboquant_prod":
        monkeypatch.setattr(decode, "SKETCH_BACKENDS", (*decode.SKETCH_BACKENDS, available_backend()))
    rng = np.random.default_rng(tokens)
    queries = mx.array(rng.standard_normal((1, 8, 1, 128), dtype=np.float32)).astype(mx.bfloat16)
    outputs = []
    for staged in ((), (available_backend(),)):
        monkeypatch.setattr(decode, "STAGED_TABLE_BACKENDS", staged)
        fused = _filled(method, bits, group, window, sinks, tokens, "require", 128, 2, mx.bfloat16, seed=tokens)
        assert fused._decode_plan(4) is not None
        outputs.append(fused.attention(queries, None, None, scale=128**-0.5, mask=None))
    mx.eval(outputs)
    assert mx.array_equal(outputs[0], outputs[1])


@needs_gpu
@pytest.mark.parametrize("spec", [("turboquant_prod", 4, 64, 0, 0), ("turboquant_prod", 2, 64, 5, 2), ("qjl", 4, 64, 0, 0),
                                  ("qjl", 2, 32, 3, 1), ("polarquant", 4, 64, 0, 0), ("polarquant", 3, 64, 5, 2),
                                  ("polarquant", 2, 64, 0, 0)], ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("tokens", (70, 1000, 4097))
def test_decode_kernel_reads_sketched_keys_and_polar_angles(spec: tuple, tokens: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """turboquant_prod's and qjl's keys (a second, sketched query) and PolarQuant's angles through the attention
    pass on this GPU (its backend let into decode.SKETCH_BACKENDS and POLAR_BACKENDS for the test, in case it is
    not there yet) against the reference path in float32 on the CPU stream: the parity run behind a backend's place
    in those lists."""
    from engine.kvcache.kernels import decode

    monkeypatch.setattr(decode, "SKETCH_BACKENDS", (*decode.SKETCH_BACKENDS, available_backend()))
    monkeypatch.setattr(decode, "POLAR_BACKENDS", (*decode.POLAR_BACKENDS, available_backend()))
    method, bits, group, window, sinks = spec
    for head_dim, n_kv, repeats in ((128, 2, 4), (64, 3, 2)):
        fused = _filled(method, bits, group, window, sinks, tokens, "require", head_dim, n_kv, mx.bfloat16,
                        seed=tokens)
        error = _error_against_cpu_reference(fused, n_kv, repeats, head_dim, seed=tokens + 7)
        plan = fused._decode_plan(repeats)
        assert plan is not None and plan.sketch == (method != "polarquant")
        assert np.isfinite(error) and error <= 2e-3, f"{spec} tokens={tokens} D={head_dim}: max abs err {error}"


@needs_gpu
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("tokens", (1000, 8193, 33000, 131073))
@pytest.mark.parametrize("by_step", [False, True], ids=["each_token", "by_step"])
def test_decode_kernel_turns_keys_stored_before_rope(traditional: bool, tokens: int, by_step: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """KIVI's rope=pre through the tiled pass on this GPU (its backend let into decode.ROPE_BACKENDS for the
    test, in case it is not there yet) against the reference path in float32, which decodes the keys and turns
    them with mx.fast.rope on the same device (no quantized_matmul is involved, so it can run there): the parity
    run behind a backend's place in ROPE_BACKENDS. Positions up to 131k, where float32 angles are coarsest; `by_step`:
    a run's later tokens turned by their pair's step (the backend let into decode.ROPE_STEP_BACKENDS, or kept out)."""
    from engine.kvcache.kernels import decode

    monkeypatch.setattr(decode, "ROPE_BACKENDS", (*decode.ROPE_BACKENDS, available_backend()))
    monkeypatch.setattr(decode, "ROPE_STEP_BACKENDS", (available_backend(),) if by_step else ())
    options = {"key_block": 128, "rotate_values": True, "rope": "pre", "rope_dims": 128, "rope_base": 500000.0,
               "rope_scale": 1.0, "rope_traditional": traditional}
    fused = _filled("kivi", 4, 64, 0, 4, tokens, "require", 128, 2, mx.bfloat16, options=options, seed=tokens)
    queries = mx.array(np.random.default_rng(tokens + 7).standard_normal((1, 8, 1, 128), dtype=np.float32))
    out = fused.attention(queries.astype(mx.bfloat16), None, None, scale=128**-0.5, mask=None)
    plan = fused._decode_plan(4)
    assert plan is not None and ("ROPE", 1) in plan.constants and ("TRAD", int(traditional)) in plan.constants
    assert ("#define ROPE_STEP 1" in plan.source.defines) == by_step
    ref = _reference_of(fused).attention(queries, None, None, scale=128**-0.5, mask=None)
    error = float(mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))))
    assert np.isfinite(error) and error <= 2e-3, f"rope=pre traditional={traditional} tokens={tokens}: {error}"


@needs_gpu
@pytest.mark.parametrize("rope", ["none", "pre", "pre-traditional"])
@pytest.mark.parametrize("tokens", (1000, 8193, 33000))
def test_decode_kernel_adds_key_outliers(rope: str, tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """KIVI's key_outliers through the tiled pass on this GPU (its backend let into decode.OUTLIER_BACKENDS, and
    ROPE_BACKENDS, for the test) against the reference path in float32 on the CPU stream (quantized_matmul plus the
    outliers' scatter-add; keys before RoPE: decoded with their residuals and turned): the parity run behind a
    backend's place in OUTLIER_BACKENDS. Keys with a few large entries, so the outliers weigh in the scores; the
    3-bit layout of issue 12's candidate (scale-only rotated values)."""
    from engine.kvcache.kernels import decode

    monkeypatch.setattr(decode, "OUTLIER_BACKENDS", (*decode.OUTLIER_BACKENDS, available_backend()))
    monkeypatch.setattr(decode, "ROPE_BACKENDS", (*decode.ROPE_BACKENDS, available_backend()))
    options = {"key_block": 128, "rotate_values": True, "symmetric_values": True, "key_outliers": 1}
    if rope != "none":
        options |= {"rope": "pre", "rope_dims": 128, "rope_base": 500000.0, "rope_scale": 1.0,
                    "rope_traditional": rope == "pre-traditional"}
    fused = _filled("kivi", 3, 64, 0, 4, tokens, "require", 128, 2, mx.bfloat16, seed=tokens, options=options,
                    spiked=True)
    plan = fused._decode_plan(4)
    assert plan is not None and ("KO", 1) in plan.constants and ("ROPE", int(rope != "none")) in plan.constants
    excess = _peaked_excess_over_cpu_reference(fused, seed=tokens + 7)
    assert np.isfinite(excess) and excess <= 2e-3, f"key_outliers rope={rope} tokens={tokens}: {excess}"


@needs_gpu
@pytest.mark.parametrize("rope", ["none", "pre"])
@pytest.mark.parametrize("counts", [(3, 48, 48, 16, 16), (3, 16, 104, 0, 8), (3, 0, 128, 0, 0), (2, 48, 48, 16, 16),
                                    (2, 24, 88, 8, 8), (4, 48, 48, 16, 16)], ids=lambda c: ".".join(map(str, c)))
@pytest.mark.parametrize("tokens", (1000, 8193, 33000))
def test_decode_kernel_reads_key_widths(counts: tuple[int, ...], tokens: int, rope: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """KIVI's key_widths through the tiled pass on this GPU (its backend let into decode.WIDTH_BACKENDS for the test)
    against the reference path in float32 on the CPU stream (one quantized_matmul per width on the gathered query): the
    parity run behind a backend's place in WIDTH_BACKENDS. The 3-bit level's layout with key outliers, widths 2-5 at
    random channels per head (the second layout has no 4-bit class), the 2-bit level's (clip search, rotated values)
    at widths 1-4 and the 4-bit level's (rotated values) at widths 3-6; `counts` leads with the key bits."""
    from engine.kvcache.kernels import decode

    monkeypatch.setattr(decode, "WIDTH_BACKENDS", (*decode.WIDTH_BACKENDS, available_backend()))
    monkeypatch.setattr(decode, "WIDTH_ROPE_BACKENDS", (*decode.WIDTH_ROPE_BACKENDS, available_backend()))
    monkeypatch.setattr(decode, "ONE_BIT_BACKENDS", (*decode.ONE_BIT_BACKENDS, available_backend()))
    bits, counts = counts[0], counts[1:]
    digest = registered_width_table(counts, 2, seed=sum(counts), narrowest=bits - 1)
    options = {"key_block": 128, "rotate_values": True, "key_widths": digest} | (
        {"symmetric_values": True, "key_outliers": 1} if bits == 3 else {"clip_search": True} if bits == 2 else {})
    if rope == "pre":
        options |= {"rope": "pre", "rope_dims": 128, "rope_base": 500000.0, "rope_scale": 1.0, "rope_traditional": False}
    fused = _filled("kivi", bits, 64, 0, 4, tokens, "require", 128, 2, mx.bfloat16, seed=tokens, options=options,
                    spiked=True)
    plan = fused._decode_plan(4)
    assert plan is not None and ("KCLS", 4) in plan.constants and ("KO", int(bits == 3)) in plan.constants
    assert ("ROPE", int(rope == "pre")) in plan.constants
    # past the backend's long-tile length (decode.TILED_LONG_TILES: CUDA's 128-token tiles) the plan takes that tile
    long_tile, _, long_from = decode.TILED_LONG_TILES.get(available_backend(), (0, 0, 0))
    assert not long_tile or (("CT", long_tile) in plan.constants) == (fused.capacity >= long_from)
    excess = _peaked_excess_over_cpu_reference(fused, seed=tokens + 7)
    assert np.isfinite(excess) and excess <= 2e-3, f"key_widths {counts} tokens={tokens}: {excess}"


def _bf16_history_pairs(cache) -> list[tuple[mx.array, mx.array]]:
    """(the cache's, the reference path's) decoded history keys, then values, in bf16 on this device; the cache must
    decode it with the history kernel; shapes and dtypes checked."""
    assert cache._dequantize_launch() is not None
    store = cache._compressed_view()
    got = cache._decoded_history(store, mx.bfloat16)
    want = _reference_of(cache)._decoded_history(store, mx.bfloat16)
    for out, ref in zip(got, want, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype == mx.bfloat16
    return list(zip(got, want, strict=True))


@needs_gpu
@pytest.mark.parametrize("spec", [*(s for s in PARITY_SPECS if s[0] in ("affine", "rotated", "turboquant", "rvq")),
                                  ("polarquant", 4, 64, 0, 0), ("polarquant", 2, 64, 5, 2),
                                  ("turboquant_prod", 4, 64, 0, 0), ("qjl", 4, 64, 5, 2),
                                  ("turboquant_prod", 4, 64, 0, 0, "rows"), ("qjl", 4, 64, 5, 2, "rows")],
                         ids=lambda s: "-".join(map(str, s)))
def test_history_decode_kernel_matches_reference(spec: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The history a prefill chunk attends over, decoded in one launch, against the reference decode on the same
    device (bf16): codebooks equal (the same float32 products, one rounding), affine codes and PolarQuant's
    sines and cosines within one bf16 unit (MLX's dequantize rounds in 16 bits on the way; the kernel takes the
    fast sine and cosine). The parity run behind CUDA's and Metal's place in dequantize.BACKENDS (the caches decode
    their history with the kernel as shipped) and, for PolarQuant, in decode.POLAR_BACKENDS, for sketched keys in
    dequantize.SKETCH_HISTORY_BACKENDS (let in for the test; the estimator's Sᵀ·sign summed in another order): their
    projection on the matrix units where dequantize.SKETCH_MMA_BACKENDS admits the GPU, and ("rows") through the ±1
    rows a shape the matrix units decline takes, qjl's in float16 (dequantize.SKETCH_HALF_BACKENDS, let in too)."""
    from engine.kvcache.kernels import decode, dequantize

    monkeypatch.setattr(decode, "POLAR_BACKENDS", (*decode.POLAR_BACKENDS, available_backend()))
    monkeypatch.setattr(dequantize, "SKETCH_HISTORY_BACKENDS",
                        (*dequantize.SKETCH_HISTORY_BACKENDS, available_backend()))
    monkeypatch.setattr(dequantize, "SKETCH_HALF_BACKENDS", (*dequantize.SKETCH_HALF_BACKENDS, available_backend()))
    method, bits, group, window, sinks, *extra = spec
    if "rows" in extra:
        monkeypatch.setattr(dequantize, "SKETCH_MMA_BACKENDS", ())
    for tokens in (70, 4097):
        cache = _filled(method, bits, group, window, sinks, tokens, "auto", 128, 2, mx.bfloat16, seed=tokens)
        for out, ref in _bf16_history_pairs(cache):
            error = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)) / (mx.abs(ref.astype(mx.float32)) + 1e-3)
            assert float(mx.max(error)) <= (1e-6 if method in ("turboquant", "rvq") else 2**-7), (spec, tokens)


@needs_gpu
@pytest.mark.parametrize("layout", ["plain", "level4", "level3-pre", "level3-pre-traditional", "level3-widths",
                                    "level3-widths-flat", "level3-widths-pre", "level2-widths", "level2-widths-pre"])
@pytest.mark.parametrize("tokens", (300, 8193, 33000))
def test_kivi_history_decode_kernel_matches_reference(layout: str, tokens: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """KIVI's history decoded in one launch on this GPU (its backend let into dequantize.KIVI_BACKENDS for the test):
    the 4-bit level's layout, the 3-bit level's (key outliers, scale-only rotated values) with keys before RoPE, and
    plain KIVI, against the reference decode on the same device (float32, then bf16): each entry within one bf16 unit
    plus the angle's error (position x each pair's angle read back from MLX's RoPE) relative to its token's largest,
    and a 40-token prefill chunk's attention through it within 2e-3 and one bf16 unit of the reference path's on the
    same device (both attend in bf16 with MLX's SDPA; against float32 on the CPU, bf16 attention itself differs by up
    to ~1e-2). Positions up to 33k, where float32 angles are coarsest: the parity run behind a backend's place in
    KIVI_BACKENDS."""
    from engine.kvcache.kernels import decode, dequantize

    monkeypatch.setattr(dequantize, "KIVI_BACKENDS", (*dequantize.KIVI_BACKENDS, available_backend()))
    monkeypatch.setattr(decode, "WIDTH_BACKENDS", (*decode.WIDTH_BACKENDS, available_backend()))
    monkeypatch.setattr(dequantize, "WIDTH_HISTORY_BACKENDS", (*dequantize.WIDTH_HISTORY_BACKENDS, available_backend()))
    monkeypatch.setattr(decode, "WIDTH_ROPE_BACKENDS", (*decode.WIDTH_ROPE_BACKENDS, available_backend()))
    monkeypatch.setattr(decode, "ONE_BIT_BACKENDS", (*decode.ONE_BIT_BACKENDS, available_backend()))
    bits, options = 4, {}
    if layout != "plain":
        options = {"key_block": 128, "rotate_values": True}
    if layout.startswith("level3"):
        bits = 3
        options |= {"symmetric_values": True, "key_outliers": 1}
    if layout.startswith("level2"):  # the 2-bit level's layout, widths 1-4
        bits = 2
        options |= {"clip_search": True, "key_widths": registered_width_table((48, 48, 16, 16), 2, seed=tokens,
                                                                            narrowest=1)}
    if layout.startswith("level3-pre") or layout.endswith("widths-pre"):
        options |= {"rope": "pre", "rope_dims": 128, "rope_base": 500000.0, "rope_scale": 1.0,
                    "rope_traditional": layout.endswith("traditional")}
    if layout.startswith("level3-widths"):  # widths 2-5 at random channels per head (or all at 3), keys as given
        counts = (0, 128, 0, 0) if layout.endswith("flat") else (48, 48, 16, 16)  # "-pre": keys before RoPE too
        options |= {"key_widths": registered_width_table(counts, 2, seed=tokens)}
    cache = _filled("kivi", bits, 64, 0, 4 if options else 0, tokens, "auto", 128, 2, mx.bfloat16, seed=tokens,
                    options=options, spiked=bits == 3)
    for out, ref in _bf16_history_pairs(cache):
        ref32 = ref.astype(mx.float32)
        largest = mx.max(mx.abs(ref32), axis=-1, keepdims=True) + 1e-3
        error = mx.abs(out.astype(mx.float32) - ref32) / largest
        assert float(mx.max(error)) <= 2**-6, (layout, tokens, float(mx.max(error)))
    queries = mx.array(np.random.default_rng(tokens + 7).standard_normal((1, 8, 40, 128),
                                                                        dtype=np.float32)).astype(mx.bfloat16)
    out = cache.attention(queries, None, None, scale=128**-0.5, mask="causal")
    ref = _reference_of(cache).attention(queries, None, None, scale=128**-0.5, mask="causal")
    # Both outputs are rounded to bf16: beyond 2e-3, one unit of that rounding (2^-7 relative) may differ
    ref32 = ref.astype(mx.float32)
    excess = float(mx.max(mx.abs(out.astype(mx.float32) - ref32) - 2**-7 * mx.abs(ref32)))
    assert np.isfinite(excess) and excess <= 2e-3, (layout, tokens, excess)


@needs_gpu
@pytest.mark.parametrize("bits", [2, 3, 1, 4])
@pytest.mark.parametrize("tokens", (70, 4097))
def test_decode_kernel_reads_vq_codes(bits: int, tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Product VQ's codes through the attention pass on this GPU (its backend let into decode.VQ_BACKENDS for the
    test) against the lookup-table reference in float32 on the CPU stream: the parity run behind its place there."""
    from engine.kvcache.kernels import decode
    from tests.kvcache_helpers import tiny_vq_codebooks

    monkeypatch.setattr(decode, "VQ_BACKENDS", (*decode.VQ_BACKENDS, available_backend()))
    for head_dim, n_kv, repeats in ((128, 2, 4), (64, 3, 2)):
        options = {"codebooks": tiny_vq_codebooks(bits, head_dim=head_dim)}
        fused = _filled("vq", bits, 64, 3, 2, tokens, "require", head_dim, n_kv, mx.bfloat16, seed=tokens,
                        options=options)
        error = _error_against_cpu_reference(fused, n_kv, repeats, head_dim, seed=tokens + 7)
        assert fused._decode_plan(repeats) is not None
        assert np.isfinite(error) and error <= 2e-3, f"vq {bits} tokens={tokens} D={head_dim}: max abs err {error}"


@needs_gpu
def test_decode_kernel_short_caches_and_sinks_only() -> None:
    """1 token, sinks only, window only, few compressed tokens."""
    for method in ("affine", "kivi", "turboquant"):
        for tokens, window, sinks in ((1, 0, 0), (3, 0, 4), (5, 16, 0), (300, 0, 2)):
            fused = _filled(method, 4, 64, window, sinks, tokens, "auto", 128, 2, mx.bfloat16, seed=tokens)
            reference = _reference_of(fused)
            queries = mx.array(np.random.default_rng(1).standard_normal((1, 8, 1, 128), dtype=np.float32))
            out = fused.attention(queries.astype(mx.bfloat16), None, None, scale=128**-0.5, mask=None)
            with mx.stream(mx.cpu):
                ref = reference.attention(queries.astype(mx.bfloat16).astype(mx.float32), None, None,
                                          scale=128**-0.5, mask=None)
                mx.eval(ref)
            # One or a few tokens: the output is about a value vector itself (|x| up to ~4), and with nothing
            # compressed yet both sides are the bf16 reference path against float32: two bf16 ulps.
            error = float(mx.max(mx.abs(out.astype(mx.float32) - ref) / mx.maximum(mx.abs(ref), 1.0)))
            assert error <= 1.6e-2, (method, tokens, window, sinks, error)


def _assert_encoded_alike_on_the_gpu(fused: dict[str, mx.array], reference: dict[str, mx.array]) -> None:
    """The same entries, shapes and dtypes; at most 1 in 1,000 packed words differ (a value within float rounding
    of a boundary: <= ~1e-4 per code), norms and scales within 1 %."""
    assert list(fused) == list(reference)
    for name, ref in reference.items():
        got = fused[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        if ref.dtype == mx.uint32:
            mismatched = float(mx.mean((got != ref).astype(mx.float32)))
            assert mismatched <= 1e-3, (name, mismatched)
        else:
            error = float(mx.max(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))
                                 / mx.maximum(mx.abs(ref.astype(mx.float32)), 1e-3)))
            assert error <= 1e-2, (name, error)


@needs_gpu
@pytest.mark.parametrize("method,bits", [("turboquant", 4), ("turboquant", 3), ("turboquant", 1), ("rvq", 4),
                                         ("rvq", 3), ("rvq", 2), ("turboquant_prod", 4), ("turboquant_prod", 2),
                                         ("polarquant", 4), ("polarquant", 3), ("polarquant", 2)])
def test_codebook_encode_kernel_matches_reference(method: str, bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused encode gives the reference's codes, norms and residual scales (a code may differ where a
    value sits within float rounding of a boundary: at most 1 in 10,000); turboquant_prod's keys also their
    residual's norm and sketch signs, polarquant its level-1 and higher-level angle codes (their backends let into
    encode.SKETCH_ENCODE_BACKENDS and POLAR_ENCODE_BACKENDS for the test, in case they are not there yet: the parity
    run behind a backend's place there)."""
    from engine.kvcache.kernels import encode

    monkeypatch.setattr(encode, "SKETCH_ENCODE_BACKENDS", (*encode.SKETCH_ENCODE_BACKENDS, available_backend()))
    monkeypatch.setattr(encode, "POLAR_ENCODE_BACKENDS", (*encode.POLAR_ENCODE_BACKENDS, available_backend()))
    config = KVCacheConfig(method=method, key_bits=bits, options={"kernels": "auto"})
    head_dim = 64 if bits == 3 else 128  # 3-bit codes straddle words at either width
    cache = KVCacheBuilder(config).for_shape(ModelShape(1, 8, 2, head_dim)).build()[0]
    rng = np.random.default_rng(bits)
    keys = mx.array(rng.standard_normal((1, 2, 777, head_dim), dtype=np.float32)).astype(mx.bfloat16)
    cache._setup_from(keys, keys)
    rotated = cache._keys_in(keys).astype(mx.bfloat16)
    fused = cache._encode(rotated, rotated)
    with mx.stream(mx.cpu):
        reference = {**cache._encode_role(rotated, "key"), **cache._encode_role(rotated, "value")}
        mx.eval(reference)
    _assert_encoded_alike_on_the_gpu(fused, reference)


@needs_gpu
@pytest.mark.parametrize("method,bits,head_dim", [("turboquant", 4, 128), ("turboquant", 3, 64), ("rvq", 4, 128),
                                                  ("rvq", 2, 256), ("turboquant_prod", 4, 128)])
def test_encode_kernel_rotates_as_the_reference(method: str, bits: int, head_dim: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The rotation applied in the encode kernel (its backend let into encode.ROTATE_ENCODE_BACKENDS for the test:
    the parity run behind a backend's place there): new bfloat16 tokens as the model gives them, encoded with the
    rotation and the rounding to bfloat16 in one launch a role, against the reference on the CPU, which rotates with
    MLX's transform, casts, then encodes. The transform sums in another order, so a coordinate within float rounding
    of a bfloat16 step may round the other way: at most 1 in 1,000 packed words differ, norms and scales by 1 %."""
    from engine.kvcache.kernels import encode
    from engine.kvcache.quant.rotation import Rotation

    monkeypatch.setattr(encode, "ROTATE_ENCODE_BACKENDS", (*encode.ROTATE_ENCODE_BACKENDS, available_backend()))
    config = KVCacheConfig(method=method, key_bits=bits, options={"kernels": "auto"})
    cache = KVCacheBuilder(config).for_shape(ModelShape(1, 8, 2, head_dim)).build()[0]
    rng = np.random.default_rng(bits + head_dim)
    keys = mx.array(rng.standard_normal((1, 2, 777, head_dim), dtype=np.float32)).astype(mx.bfloat16)
    values = (mx.array(rng.standard_normal((1, 2, 777, head_dim), dtype=np.float32)) * 3.0).astype(mx.bfloat16)
    cache._setup_from(keys, values)
    with monkeypatch.context() as patched:  # the fused path must not rotate through MLX
        patched.setattr(Rotation, "forward", lambda self, x: pytest.fail("rotated through MLX"))
        fused = cache._encode_incoming(keys, values)
        mx.eval(fused)
    with mx.stream(mx.cpu):
        reference = {**cache._encode_role(cache._keys_in(keys).astype(mx.bfloat16), "key"),
                     **cache._encode_role(cache._values_in(values).astype(mx.bfloat16), "value")}
        mx.eval(reference)
    _assert_encoded_alike_on_the_gpu(fused, reference)


@needs_gpu
@pytest.mark.parametrize("level", ["level4", "level3", "level3-widths", "level2-widths", "minmax-f16"])
def test_kivi_encode_kernel_matches_reference(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KIVI's chunk encoded in one launch on the GPU (its backend let into KIVI_ENCODE_BACKENDS and
    CLIP_SEARCH_BACKENDS for the test) against the reference's operations on the CPU: codes, 16-bit scales and biases,
    outlier indices and residuals. A GPU may divide a value onto the other side of a code boundary: at most 1 in 1,000
    codes or entries differ (counted by code, not by packed word: a word holds 16 codes at 2 bits), a code only by
    one step, and a scale or bias only by a 16-bit step. The clip search (level2-widths) picks
    the candidate range of least squared error, and two candidates can tie within float rounding (the GPU sums in
    another order and fuses multiply-adds): on the H200 0.29 % of one width's words differed that way. So there every
    group's error, decoded against the chunk, must be within 1e-3 of the reference's (a worse choice fails), and
    at most 1 % of words or entries may differ."""
    from engine.kvcache.kernels import kivi_encode
    from engine.kvcache.quant import fused

    monkeypatch.setattr(kivi_encode, "KIVI_ENCODE_BACKENDS", (available_backend(),))
    monkeypatch.setattr(kivi_encode, "CLIP_SEARCH_BACKENDS", (available_backend(),))
    monkeypatch.setattr(fused, "COMPILE_ENCODE", False)
    level3 = "kivi:k3v3:g64:s4:key_block=128:rotate_values=true:symmetric_values=true:key_outliers=1"
    spec, dtype, rules = {
        "level4": ("kivi:k4v4:g64:s4:key_block=128:rotate_values=true", mx.bfloat16, ("affine", "affine")),
        "level3": (level3, mx.bfloat16, ("affine", "symmetric")),
        "level3-widths": (f"{level3}:key_widths={registered_width_table((40, 56, 24, 8), 2, seed=5)}", mx.bfloat16,
                          ("affine", "symmetric")),
        "level2-widths": ("kivi:k2v2:g64:s4:clip_search=true:key_block=128:rotate_values=true:"
                          f"key_widths={registered_width_table((40, 56, 24, 8), 2, seed=7, narrowest=1)}", mx.bfloat16,
                          ("clipped", "clipped")),
        "minmax-f16": ("kivi:k2v2:g64:key_block=128:minmax_keys=true:key_outliers=1:"
                       f"key_widths={registered_width_table((40, 56, 24, 8), 2, seed=6, narrowest=1)}", mx.float16,
                       ("minmax", "affine")),
    }[level]
    cache = KVCacheBuilder(KVCacheConfig.parse(spec)).for_shape(ModelShape(1, 8, 2, 128)).build()[0]
    keys, values = kivi_chunk(2, 2048, 128, dtype, seed=7)
    cache._setup_from(keys, values)
    # the build's first run of the kernels kept them on (one that fails turns them off: both sides None here, and the
    # GPU's MLX operations compared with the CPU's instead, as an H200 run did once)
    assert available_backend() is not None
    assert cache._encode_backend(*rules) == available_backend()
    fused_store = cache._encode(keys, values)
    mx.eval(fused_store)
    reference_cache = copy.copy(cache)
    reference_cache.config = replace(cache.config, options={**cache.config.options, "kernels": "off"})
    with mx.stream(mx.cpu):
        reference = reference_cache._encode(keys, values)
        mx.eval(reference)
    assert list(fused_store) == list(reference)
    clip_search = "clipped" in rules
    allowed = 1e-2 if clip_search else 1e-3
    for name, ref in reference.items():
        got = fused_store[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        if ref.dtype == mx.uint32:
            # Packed codes compared code by code (a differing word is any of its 32/bits codes: at 2 bits 16): a tie
            # divided onto the other side of a boundary moves its code by one step. The clip search may pick another
            # range for a group, moving its codes further; the group error check below holds it to its choice.
            bits = int(name.rsplit("_w", 1)[1]) if "_w" in name else (
                cache.config.value_bits if name.startswith("value") else cache.config.key_bits)
            n = ref.shape[-1] * 32 // bits
            steps = mx.abs(unpack_bits(got, bits, n).astype(mx.int32) - unpack_bits(ref, bits, n).astype(mx.int32))
            if not clip_search:
                assert int(mx.max(steps)) <= 1, (name, int(mx.max(steps)))
            mismatched = float(mx.mean((steps > 0).astype(mx.float32)))
            assert mismatched <= allowed, (name, mismatched)
        elif ref.dtype == mx.uint8:
            mismatched = float(mx.mean((got != ref).astype(mx.float32)))
            assert mismatched <= allowed, (name, mismatched)
        else:
            ref32, got32 = ref.astype(mx.float32), got.astype(mx.float32)
            off = mx.abs(got32 - ref32) > mx.abs(ref32) * 2**-7 + 1e-6
            assert float(mx.mean(off.astype(mx.float32))) <= allowed, name
    if clip_search:
        with mx.stream(mx.cpu):
            for role, got_error, ref_error in zip(("key", "value"), kivi_group_errors(cache, fused_store, keys, values),
                                                  kivi_group_errors(cache, reference, keys, values), strict=True):
                worse = got_error > ref_error * (1 + 1e-3) + 1e-6
                assert not bool(mx.any(worse)), (role, int(mx.sum(worse)), float(mx.max(got_error - ref_error)))


@needs_gpu
@pytest.mark.parametrize("rows,head_dim,tokens", [(512, 128, 14336), (512, 128, 777), (128, 128, 4097), (128, 64, 33)])
def test_sketch_projection_on_matrix_ops_matches_the_rows_on_the_gpu(rows: int, head_dim: int, tokens: int) -> None:
    """Σ sign·S on this GPU's matrix units (S as two bfloat16 tiles summing to it) against the ±1 rows' float32 matmul
    on the same device, within float32 summation order: the parity run behind a backend's place in
    dequantize.SKETCH_MMA_BACKENDS (with the history parity test, which compares the rows' path with the reference)."""
    from engine.kvcache.kernels import dequantize

    rng = np.random.default_rng(tokens)
    sketch = mx.array(rng.standard_normal((rows, head_dim)).astype(np.float16))
    signs = mx.array(rng.integers(0, 2**32, size=(1, 8, tokens + 5, rows // 32), dtype=np.uint64).astype(np.uint32))
    backend = available_backend()
    got = dequantize.sketch_projection_mma(signs, sketch, tokens, backend)
    want = dequantize.sign_rows(signs, tokens, rows, backend) @ sketch.astype(mx.float32)
    # float32 sums of `rows` terms of size ~1 in another order: relative to the partial sums' size, sqrt(rows)
    assert float(mx.max(mx.abs(got - want) / (mx.abs(want) + rows**0.5))) <= 1e-5


@needs_gpu
@pytest.mark.parametrize("rows,head_dim,tokens", [(512, 128, 2048), (128, 128, 777), (128, 64, 4097)])
def test_sign_pack_kernel_matches_mlx_packing(rows: int, head_dim: int, tokens: int) -> None:
    """The sign-packing launch on this GPU against quant/sketch.py's sketch_signs on the same device (the same float32
    matmul, then MLX's packing): equal word for word, a zero vector's words all ones. The parity run behind a
    backend's place in encode.SIGN_PACK_BACKENDS."""
    from engine.kvcache.quant.sketch import sketch_signs

    rng = np.random.default_rng(tokens)
    sketch = mx.array(rng.standard_normal((rows, head_dim)).astype(np.float16))
    vectors = rng.standard_normal((1, 8, tokens, head_dim), dtype=np.float32)
    vectors[0, 3, 7] = 0.0
    vectors = mx.array(vectors).astype(mx.bfloat16)
    got = sketch_signs_packed(vectors, sketch, available_backend())
    assert mx.array_equal(got, sketch_signs(vectors, sketch))
    assert bool(mx.all(got[0, 3, 7] == 0xFFFFFFFF))


@needs_gpu
@pytest.mark.parametrize("bits,head_dim", [(4, 128), (2, 64)])
def test_qjl_encode_kernel_matches_reference(bits: int, head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """qjl's keys (norms and the signs of the key_bits·D-row sketch) encoded in one launch against the reference on
    the CPU stream (its backend let into encode.SKETCH_ENCODE_BACKENDS for the test: the parity run behind its place).
    Its values are MLX's affine quantization on either path, so they are compared with the same operation on the
    same device: on the H200, MLX's CUDA and CPU quantize of bfloat16 disagreed in 1.3-2.2 % of packed words."""
    from engine.kvcache.kernels import encode
    from engine.kvcache.methods.affine import affine_quantize

    monkeypatch.setattr(encode, "SKETCH_ENCODE_BACKENDS", (*encode.SKETCH_ENCODE_BACKENDS, available_backend()))
    config = KVCacheConfig(method="qjl", key_bits=bits, options={"kernels": "auto"})
    cache = KVCacheBuilder(config).for_shape(ModelShape(1, 8, 2, head_dim)).build()[0]
    keys = mx.array(np.random.default_rng(bits).standard_normal((1, 2, 777, head_dim), dtype=np.float32))
    keys = keys.astype(mx.bfloat16)
    cache._setup_from(keys, keys)
    fused = cache._encode(keys, keys)
    with mx.stream(mx.cpu):
        reference = _reference_of(cache)._encode(keys, keys)
        mx.eval(reference)
    reference.update(affine_quantize(keys, "value", cache.config.group_size, cache.config.value_bits))
    _assert_encoded_alike_on_the_gpu(fused, reference)  # sign bits: a flip only within rounding of a boundary
    for name in (name for name in reference if name.startswith("value")):  # the same operation on the same device
        assert mx.array_equal(fused[name], reference[name]), name


def test_sources_handed_to_mlx_are_compacted_without_changing_the_code() -> None:
    """`build` hands MLX each source without comments, indentation or blank lines (MLX rebuilds and hashes the
    whole text on every launch); what remains is the same code, and preprocessor lines keep their own line."""
    from engine.kvcache.kernels.backend import compact

    for source in ALL_SOURCES:
        for backend in BACKENDS:
            for text in source.for_backend(backend):
                short = compact(text)
                assert "//" not in short and "\n\n" not in short
                assert len(short) < len(text) or "//" not in text
                code = "".join(line.split("//", 1)[0] for line in text.splitlines())
                assert "".join(short.split()) == "".join(code.split())
                directives = [line.strip() for line in text.splitlines() if line.strip().startswith("#")]
                assert all(d.split("//", 1)[0].strip() in short.splitlines() for d in directives)


def test_ruler_reuses_one_slice_per_count() -> None:
    """A count handed to kernels as a slice's length: the same count gives the same (already evaluated) array,
    so a decode step adds no slice to every layer's graph; the lengths stay right when the ruler grows."""
    from engine.kvcache.kernels.backend import Ruler

    ruler = Ruler()
    first = ruler(300)
    assert ruler(300) is first and first.shape == (301,)
    assert ruler(301).shape == (302,)
    grown = ruler(200_000)
    assert grown.shape == (200_001,) and ruler(300) is not first and ruler(300).shape == (301,)


def test_tile_loop_counts_split_the_loop_at_its_barriers() -> None:
    """benchmarks/kernel_resources.py --instructions: the tile loop runs from the first barrier to the branch back
    to it; each stretch between barriers is counted, and phase 1's inner loop by its backward branch."""
    from benchmarks.kernel_resources import tile_loop_counts

    program = ["MOV R1, R2", "BAR.SYNC.DEFER_BLOCKING 0x0", "LDS R3, [R4]", "BAR.SYNC.DEFER_BLOCKING 0x0",
               "IADD3 R5, R5, 0x1, RZ", "FFMA R6, R7, R8, R6", "@!P0 BRA 0x40", "STS [R9], R6",
               "BAR.SYNC.DEFER_BLOCKING 0x0", "FMUL R1, R1, R2", "BAR.SYNC.DEFER_BLOCKING 0x0", "FFMA R1, R2, R3, R1",
               "@P1 BRA 0x10", "EXIT"]
    sass = [f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(program)]
    assert tile_loop_counts(sass) == {"staging": 2, "phase 1": 5, "phase 2": 2, "phase 3": 3, "phase 1 loop body": 3}
    assert tile_loop_counts(sass[:3]) == {}


@needs_gpu
def test_matrix_ops_multiply_tiles_on_the_gpu() -> None:
    """The dialect's warp matrix ops on the GPU (CUDA's mma.sync on bfloat16 tiles, Metal's simdgroup matrices on float
    ones) against the same product in float64 of the tiles as the backend rounds them, within float32 accumulation;
    each warp its own 8 columns of a 16×64 by 64×32 product."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 64), dtype=np.float32)
    b = rng.standard_normal((32, 64), dtype=np.float32)
    backend = available_backend()
    got = np.array(mma_gemm(mx.array(a), mx.array(b), backend))
    tiles = (a, b) if backend == "metal" else [np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)) for x in (a, b)]
    want = tiles[0].astype(np.float64) @ tiles[1].astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
