"""The GPU kernels run on the CPU emulator (engine/kvcache/kernels/emulate.py): parity of the fused decode and
encode kernels with the pure-MLX reference, on a machine without a GPU.

The caches take the very code path a GPU decode step takes (`attention` -> `_decode_plan` -> `plan_decode`
-> `decode_attention`, and for the codebook methods the fused encode), with `available_backend()` patched to
name the emulator; only the kernels' host C++ stands in for the device. Float32 throughout (the emulator
takes 16-bit arrays as float32 anyway). Needs g++; compiled kernels are cached across runs by text hash.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

import engine.kvcache.kernels as kernels
from engine.errors import ConfigError
from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape
from engine.kvcache.kernels.backend import KernelSource, kernel
from engine.kvcache.kernels.decode import Codec
from engine.kvcache.kernels.emulate import EMULATE, compiler
from engine.kvcache.methods import turboquant
from tests.kvcache_helpers import filled_then_stepped, kivi_chunk, mma_gemm, registered_width_table

pytestmark = pytest.mark.skipif(compiler() is None, reason="the kernel emulator compiles kernels with g++, "
                                                          "which is not on PATH")

# Every decode codec the methods use (KIVI at 4/3/2 bits and the app's 4-bit level), with sinks and windows.
SPECS = (
    "kivi:k4v4:g64:s4:key_block=128:rotate_values=true",  # the app's 4-bit level
    # A wide layer of it (option wide: the one layer here stores k5v5): the kernel reads the layer's 5-bit codes.
    "kivi:k4v4:g64:s4:key_block=128:rotate_values=true:wide=1:wide_layers=L0",
    "kivi:k4v4:g64",
    "kivi:k3v3:g32:w9:s4",
    "kivi:k2v2:g64",
    # Wider codes than a word holds for a thread's run of 8 tokens (phase 1 of the tiled pass reads two words).
    "kivi:k8v8:g64",
    "kivi:k6v6:g32:s4",
    "kivi:k2v2:g64:s4:key_block=128:key_grid=lloyd:rotate_values=true",  # the best 2-bit candidate (issue 12)
    "kivi:k3v3:g64:w5:key_grid=lloyd:value_grid=lloyd_ends",
    # Scale-only values: the affine codec reads biases derived from the scales (-h·s) per step.
    "kivi:k3v3:g64:s4:key_block=128:rotate_values=true:symmetric_values=true",
    "affine:k4v4:g64",
    "affine:k3v3:g32:w5:s3",
    "rotated:k4v4:g64",
    "turboquant:k4v4:g64",
    "turboquant:k3v3:g64:w7:s2",
    "rvq:k4v4:g64",
    "rvq:k3v3:g64:w3:s1",
    # Keys with a sign sketch: a second, sketched query (codecs "prod" and "qjl").
    "turboquant_prod:k4v4:g64",
    "turboquant_prod:k2v2:g64:w5:s2",
    "qjl:k1v4:g64",
    "qjl:k4v4:g64:w3:s1",
    "qjl:k2v2:g32",
    # PolarQuant: each lane rebuilds its 8 channels from the angles on their path (codec "polar").
    "polarquant:k4v4:g64",
    "polarquant:k3v3:g64:w5:s2",
    "polarquant:k2v2:g64",
)
TOKENS = (1, 5, 130, 300)
# (head_dim, query heads per kv head): 2 rows leave warps of the staged KIVI keys without a row to reduce
# (they skip its shuffles while the other warps run them)
SHAPES = ((64, 4), (128, 4), (64, 2))
N_KV = 2


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel backend "emulate" for the decode kernel (looked up through the package) and the encode kernel."""
    monkeypatch.setattr(kernels, "available_backend", lambda: EMULATE)
    monkeypatch.setattr(turboquant, "available_backend", lambda: EMULATE)


def _filled(spec: str, tokens: int, head_dim: int, rows: int, seed: int, spiked: bool = False):
    """A one-layer cache of `spec` (kernels required) holding `tokens` random tokens: an untidy chunk, then
    token by token, as a prefill and decode steps would fill it. `spiked`: 1 % of the key entries 12 larger or
    smaller, so each block's outlier (KIVI's key_outliers) weighs in the scores."""
    config = KVCacheConfig.parse(spec)
    config = replace(config, options={**config.options, "kernels": "require"})
    shape = ModelShape(n_layers=1, n_heads=rows * N_KV, n_kv_heads=N_KV, head_dim=head_dim)
    cache = KVCacheBuilder(config).for_shape(shape).build()[0]
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((1, N_KV, tokens, head_dim), dtype=np.float32)
    if spiked:
        keys += (rng.random(keys.shape) < 0.01) * rng.choice([-12.0, 12.0], size=keys.shape).astype(np.float32)
    values = rng.standard_normal((1, N_KV, tokens, head_dim), dtype=np.float32)
    return filled_then_stepped(cache, mx.array(keys), mx.array(values))


def _reference_of(cache):
    """The same cache contents (shared arrays) with kernels off: the pure-MLX reference path."""
    reference = copy.copy(cache)
    reference.config = replace(cache.config, options={**cache.config.options, "kernels": "off"})
    return reference


def _attend_both(cache, tokens: int, rows: int):
    """One query token's attention (head_dim 128, `rows` query heads per kv head, seeded by `tokens`) through the
    decode kernel and through the reference path over the same arrays, checked to agree within 2e-3; at 1,200 tokens
    the work must span several splits. Returns (the plan, the queries, the reference cache, its output)."""
    from engine.kvcache.kernels import decode

    queries = mx.array(np.random.default_rng(tokens).standard_normal((1, rows * N_KV, 1, 128), dtype=np.float32))
    out = cache.attention(queries, None, None, scale=0.088, mask=None)
    reference = _reference_of(cache)
    ref = reference.attention(queries, None, None, scale=0.088, mask=None)
    plan = cache._decode_plan(rows)
    assert plan is not None
    if tokens == 1200:
        assert decode.split_count(cache._n_compressed, N_KV, plan.tile, plan.target_groups) > 1
    error = float(mx.max(mx.abs(out - ref)))
    assert error <= 2e-3, (str(cache.config), tokens, error)
    return plan, queries, reference, ref


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", SPECS)
def test_emulated_decode_kernel_matches_reference(spec: str) -> None:
    launched = 0
    for head_dim, rows in SHAPES:
        for tokens in TOKENS:
            cache = _filled(spec, tokens, head_dim, rows, seed=tokens + head_dim)
            assert "wide=" not in spec or (cache.config.key_bits, cache.config.value_bits) == (5, 5)
            queries = mx.array(np.random.default_rng(tokens).standard_normal((1, rows * N_KV, 1, head_dim),
                                                                                dtype=np.float32))
            scale = head_dim**-0.5
            out = cache.attention(queries, None, None, scale=scale, mask=None)
            ref = _reference_of(cache).attention(queries, None, None, scale=scale, mask=None)
            if cache.n_compressed:  # with nothing compressed both sides are the reference path
                assert cache._decode_plan(rows) is not None, "the kernel path was not taken"
                launched += 1
            error = float(mx.max(mx.abs(out - ref)))
            assert out.shape == ref.shape and out.dtype == mx.float32
            assert np.isfinite(error) and error <= 2e-3, (
                f"{spec} tokens={tokens} D={head_dim} R={rows}: max abs err {error}")
    assert launched >= 2 * len(SHAPES), "too few cases reached the kernel"


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("bits,window,sinks", [(2, 0, 0), (3, 5, 2), (1, 0, 0), (4, 0, 3)])
def test_emulated_decode_kernel_reads_vq_codes(bits: int, window: int, sinks: int) -> None:
    """Product VQ's codes (whole sub-vectors of 8, 4 or 2 channels per lane's 8; index codes of 6 or 8 bits)
    through the decode pass and the history decode, against the lookup-table reference path."""
    from tests.kvcache_helpers import tiny_vq_codebooks

    for head_dim, rows in ((64, 4), (128, 2)):
        config = KVCacheConfig("vq", bits, residual_window=window, sink_tokens=sinks,
                               options={"codebooks": tiny_vq_codebooks(bits, head_dim=head_dim), "kernels": "require"})
        shape = ModelShape(n_layers=1, n_heads=rows * N_KV, n_kv_heads=N_KV, head_dim=head_dim)
        for tokens in (5, 130, 300):
            cache = KVCacheBuilder(config).for_shape(shape).build()[0]
            rng = np.random.default_rng(tokens + bits)
            keys = mx.array(rng.standard_normal((1, N_KV, tokens, head_dim), dtype=np.float32))
            values = mx.array(rng.standard_normal((1, N_KV, tokens, head_dim), dtype=np.float32))
            cache = filled_then_stepped(cache, keys, values)
            reference = _reference_of(cache)
            queries = mx.array(rng.standard_normal((1, rows * N_KV, 1, head_dim), dtype=np.float32))
            out = cache.attention(queries, None, None, scale=head_dim**-0.5, mask=None)
            ref = reference.attention(queries, None, None, scale=head_dim**-0.5, mask=None)
            if cache.n_compressed:
                assert cache._decode_plan(rows) is not None, "the kernel path was not taken"
                store = cache._compressed_view()
                # the kernel decodes into the cache's 16-bit dtype (as a prefill attends), vq's reference in float32
                for got, want in zip(cache._decoded_history(store, mx.float32),
                                     reference._decoded_history(store, mx.float32), strict=True):
                    assert float(mx.max(mx.abs(got - want) / (mx.abs(want) + 1e-3))) <= 2**-10
            error = float(mx.max(mx.abs(out - ref)))
            assert np.isfinite(error) and error <= 2e-3, (bits, head_dim, tokens, error)


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", ["kivi:k4v4:g64:s4:key_block=128:rotate_values=true", "kivi:k3v3:g32:w9:s4"])
def test_kivi_tiled_and_per_subgroup_passes_both_match_reference(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KIVI keys + affine values take the tiled pass by default; its variants (tiles loaded ahead or not,
    64- or 128-token tiles) and the per-subgroup pass
    (decode.TILED = False) stay selectable and must stay right too. Each plan names the pass it launched."""
    from engine.kvcache.kernels import decode

    for tiled, prefetch, max_tile in ((True, True, 64), (True, False, 64), (True, True, 128), (False, True, 64)):
        monkeypatch.setattr(decode, "TILED", tiled)
        monkeypatch.setattr(decode, "TILED_PREFETCH", prefetch)
        monkeypatch.setattr(decode, "TILED_MAX_TILE", max_tile)
        for tokens in (200, 301, 1200):  # past the first 128-token key block; 1200: several splits to merge
            plan, *_ = _attend_both(_filled(spec, tokens, 128, 4, seed=tokens), tokens, 4)
            assert (("KB", 4 if "k4" in spec else 3) if tiled else ("U", decode.UNROLL)) in plan.constants
            assert not tiled or ("PF", int(prefetch)) in plan.constants


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", ["kivi:k4v4:g64:s4:key_block=128:rotate_values=true", "qjl:k4v4:g64:w3:s1"])
def test_plan_constants_compiled_into_the_source_give_the_same_attention(spec: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """decode.PLAN_CONSTANTS_IN_SOURCE: a plan's constant launch arguments become `constexpr int` lines of its kernel's
    source and a call passes only the four that vary; the tiled and the per-subgroup pass give the same output,
    exactly, as with the arguments passed per call."""
    from engine.kvcache.kernels import decode

    outputs = []
    for in_source in (False, True):
        monkeypatch.setattr(decode, "PLAN_CONSTANTS_IN_SOURCE", in_source)
        cache = _filled(spec, 1200, 128, 4, seed=5)
        plan, queries, *_ = _attend_both(cache, 1200, 4)
        assert plan.template == (() if in_source else plan.constants) and ("D", 128) in plan.constants
        assert ("constexpr int D = 128;" in plan.attend.source.defines) == in_source  # type: ignore[attr-defined]
        outputs.append(cache.attention(queries, None, None, scale=0.088, mask=None))
    assert mx.array_equal(outputs[0], outputs[1])


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", ["turboquant:k4v4:g64", "rvq:k3v3:g64:w5:s2", "turboquant_prod:k4v4:g64"])
def test_staged_centroid_tables_give_the_same_attention(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """decode.STAGED_TABLE_BACKENDS: the per-subgroup pass reads the codebook codecs' centroids from threadgroup
    memory where the backend is admitted, else from the device tables: the same output, exactly."""
    from engine.kvcache.kernels import decode

    outputs = []
    for staged in ((), (EMULATE,)):
        monkeypatch.setattr(decode, "STAGED_TABLE_BACKENDS", staged)
        cache = _filled(spec, 1200, 128, 4, seed=9)
        plan, queries, *_ = _attend_both(cache, 1200, 4)
        assert ("#define STAGE_TABLES 1" in plan.attend.source.defines) == bool(staged)  # type: ignore[attr-defined]
        outputs.append(cache.attention(queries, None, None, scale=0.088, mask=None))
    assert mx.array_equal(outputs[0], outputs[1])


ROPE_SPEC = "rope=pre:rope_dims=128:rope_base=10000.0:rope_scale=1.0:rope_traditional={}"


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", [
    "kivi:k4v4:g64:s4:key_block=128:rotate_values=true:" + ROPE_SPEC.format("false"),
    "kivi:k3v3:g64:s4:key_block=128:" + ROPE_SPEC.format("true"),
    "kivi:k2v2:g64:s4:key_block=128:key_grid=lloyd:" + ROPE_SPEC.format("false"),
    # rope_scale 64: angles up to ~77,000 rad at 1,200 tokens, as at ~77,000 positions (many whole turns to reduce)
    "kivi:k4v4:g64:s4:key_block=128:" + ROPE_SPEC.format("false").replace("rope_scale=1.0", "rope_scale=64.0"),
])
@pytest.mark.parametrize("by_step", [False, True], ids=["each_token", "by_step"])
def test_tiled_pass_turns_keys_stored_before_rope_like_the_reference(spec: str, by_step: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """KIVI's rope=pre: the tiled pass decodes each key pair and turns it by its position (ROPE = 1) and matches
    the reference path, which decodes the keys and applies mx.fast.rope; positions run past several key blocks
    and splits (1,200 tokens). Both forms: each token's angle as the reference computes it (what CUDA and Metal run)
    and a run's later tokens turned by their pair's step (decode.ROPE_STEP_BACKENDS)."""
    from engine.kvcache.kernels import decode

    monkeypatch.setattr(decode, "ROPE_STEP_BACKENDS", ("emulate",) if by_step else ())
    for tokens in (200, 301, 1200):
        plan, *_ = _attend_both(_filled(spec, tokens, 128, 4, seed=tokens), tokens, 4)
        assert ("ROPE", 1) in plan.constants
        assert ("TRAD", int("traditional=true" in spec)) in plan.constants
        assert ("#define ROPE_STEP 1" in plan.source.defines) == by_step


@pytest.mark.usefixtures("emulated")
def test_rope_kernel_waits_for_parity_on_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend not in ROPE_BACKENDS (one whose GPU parity run has not passed) declines the kernel for a
    rope=pre cache: with kernels=require that is an error saying why, with auto the reference path runs."""
    from engine.kvcache.kernels import decode

    monkeypatch.setattr(decode, "ROPE_BACKENDS", ())
    cache = _filled("kivi:k4v4:g64:s4:key_block=128:" + ROPE_SPEC.format("false"), 300, 128, 4, seed=1)
    queries = mx.zeros((1, 4 * N_KV, 1, 128))
    with pytest.raises(ConfigError, match="parity"):
        cache.attention(queries, None, None, scale=0.088, mask=None)
    automatic = _reference_of(cache)
    automatic.config = replace(cache.config, options={**cache.config.options, "kernels": "auto"})
    assert automatic._decode_plan(4) is None


def _assert_encoded_alike(fused: dict[str, mx.array], reference: dict[str, mx.array]) -> None:
    """The fused encode's entries against the reference's: the same names, shapes and dtypes; packed codes equal but
    for at most 1 word in 1,000 (a value within float rounding of a boundary takes the neighbouring code); norms and
    scales, stored in 16 bits and summed in another order, within one float16 step (2^-10 relative)."""
    assert list(fused) == list(reference)
    for name, ref in reference.items():
        got = fused[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        if ref.dtype == mx.uint32:
            assert float(mx.mean((got != ref).astype(mx.float32))) <= 1e-3, name
        else:
            error = float(mx.max(mx.abs(got - ref) / mx.maximum(mx.abs(ref), 1e-3)))
            assert error <= 2**-10, (name, error)


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec,head_dim", [("turboquant:k4v4:g64", 128), ("turboquant:k1v1:g64", 128),
                                           ("turboquant:k3v3:g64", 64), ("rvq:k3v3:g64", 128), ("rvq:k4v4:g64", 64),
                                           ("rvq:k2v2:g64", 256), ("turboquant_prod:k4v4:g64", 128),
                                           ("turboquant_prod:k2v2:g64", 64)])
def test_emulated_encode_kernel_matches_reference(spec: str, head_dim: int) -> None:
    """The fused encode's codes, norms and residual scales (a code may differ where a value sits within
    float rounding of a boundary: at most 1 in 1,000 packed words); 3-bit codes straddle words, and 301 tokens of
    2 heads leave the last threadgroup part-empty."""
    cache = KVCacheBuilder(KVCacheConfig.parse(spec)).for_shape(ModelShape(1, 8, 2, head_dim)).build()[0]
    keys = mx.array(np.random.default_rng(3).standard_normal((1, 2, 301, head_dim), dtype=np.float32))
    cache._setup_from(keys, keys)
    rotated = cache._keys_in(keys)
    fused = cache._encode(rotated, rotated)
    reference = {**cache._encode_role(rotated, "key"), **cache._encode_role(rotated, "value")}
    _assert_encoded_alike(fused, reference)


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec,head_dim", [("turboquant:k4v4:g64", 128), ("turboquant:k3v3:g64", 64),
                                           ("rvq:k2v2:g64", 256), ("rvq:k4v4:g64", 32),
                                           ("turboquant_prod:k4v4:g64", 128)])
def test_emulated_encode_kernel_applies_the_rotation(spec: str, head_dim: int) -> None:
    """encode.ROTATE_ENCODE_BACKENDS: new tokens reach the encode kernel before the method's Hadamard rotation,
    which its warp applies (shuffles for the lane bits of a coordinate, register pairs for the rest): the same
    arrays as the reference encode of the rotated tokens, within float rounding (the transform sums in another
    order than MLX's; the emulator keeps float32 where a GPU rounds to the 16-bit dtype, as the reference does
    before it encodes, so the reference is taken unrounded too)."""
    cache = KVCacheBuilder(KVCacheConfig.parse(spec)).for_shape(ModelShape(1, 8, 2, head_dim)).build()[0]
    rng = np.random.default_rng(head_dim + 1)
    keys = mx.array(rng.standard_normal((1, 2, 301, head_dim), dtype=np.float32))
    values = mx.array(rng.standard_normal((1, 2, 301, head_dim), dtype=np.float32)) * 2.0 + 0.5
    cache._setup_from(keys, values)
    fused = cache._encode_incoming(keys, values)
    reference = {**cache._encode_role(cache._keys_in(keys), "key"),
                 **cache._encode_role(cache._values_in(values), "value")}
    _assert_encoded_alike(fused, reference)


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("admitted", [True, False])
def test_rotation_moves_into_the_encode_kernel_only_where_admitted(admitted: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A window-less rotated codebook cache's decode steps hand the model's tokens to the encode kernel unrotated
    where encode.ROTATE_ENCODE_BACKENDS has the backend (no Rotation.forward of keys or values in update_and_fetch),
    and rotate them first elsewhere; the attention after either is the reference path's. A cache with a 16-bit
    window stores rotated tokens there, so it rotates them first either way."""
    from engine.kvcache.kernels import encode
    from engine.kvcache.quant.rotation import Rotation

    monkeypatch.setattr(encode, "ROTATE_ENCODE_BACKENDS", ("emulate",) if admitted else ())
    calls = []
    forward = Rotation.forward
    monkeypatch.setattr(Rotation, "forward", lambda self, x: calls.append(x.shape) or forward(self, x))
    for spec, windowed in (("rvq:k4v4:g64", False), ("turboquant:k4v4:g64:w16", True)):
        cache = _filled(spec, 300, 128, 4, seed=9)  # a chunk, then token by token (kernels required)
        rng = np.random.default_rng(4)
        token = mx.array(rng.standard_normal((1, N_KV, 1, 128), dtype=np.float32))
        calls.clear()
        cache.update_and_fetch(token, token)
        assert len(calls) == (2 if windowed or not admitted else 0), (spec, calls)
        queries = mx.array(rng.standard_normal((1, 4 * N_KV, 1, 128), dtype=np.float32))
        out = cache.attention(queries, None, None, scale=0.088, mask=None)
        expected = _reference_of(cache).attention(queries, None, None, scale=0.088, mask=None)
        assert out.dtype == queries.dtype
        assert float(mx.max(mx.abs(out - expected))) <= 2e-3, spec


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec,head_dim", [("polarquant:k4v4:g64", 128), ("polarquant:k3v3:g64", 64),
                                           ("polarquant:k2v2:g64", 256), ("polarquant:k4v2:g64", 64)])
def test_emulated_polar_encode_kernel_matches_reference(spec: str, head_dim: int) -> None:
    """PolarQuant's norms, level-1 codes and higher-level codes encoded in one launch, against the reference
    encode (an angle within float rounding of a boundary may take the neighbouring code: at most 1 in 1,000 packed
    words). 5- and 3-bit level-1 codes straddle words; 301 tokens of 2 heads leave the last threadgroup part-empty;
    key and value bits differ in the last case (each role its own widths and boundaries)."""
    cache = KVCacheBuilder(KVCacheConfig.parse(spec)).for_shape(ModelShape(1, 8, 2, head_dim)).build()[0]
    rng = np.random.default_rng(head_dim)
    keys = mx.array(rng.standard_normal((1, 2, 301, head_dim), dtype=np.float32))
    # A few vectors of zeros and of one nonzero coordinate: angles at 0, π/2 and atan2(0, 0) on both paths
    keys[0, 0, :3] = 0.0
    keys[0, 1, 3, 5] = 2.0
    cache._setup_from(keys, keys)
    rotated = cache._keys_in(keys)
    values = rotated * 0.5 + 0.25
    fused = cache._encode(rotated, values)
    reference = {**cache._encode_role(rotated, "key"), **cache._encode_role(values, "value")}
    _assert_encoded_alike(fused, reference)
    # Decoded, the kernel's codes give the reference's vectors (a flipped code moves one angle by one cell)
    decoded, expected = cache._decode(fused), cache._decode(reference)
    for got, ref in zip(decoded, expected, strict=True):
        assert float(mx.mean(mx.abs(got - ref) > 1e-3)) <= 1e-3


def test_polar_encode_kernel_is_used_only_where_admitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where encode.POLAR_ENCODE_BACKENDS lacks the backend, PolarQuant encodes through MLX operations (the same
    arrays as the reference, bit for bit); where it has it, through one launch of the polar kernel."""
    from engine.kvcache.kernels import encode

    monkeypatch.setattr(turboquant, "available_backend", lambda: EMULATE)
    cache = KVCacheBuilder(KVCacheConfig.parse("polarquant:k3v3:g64")).for_shape(ModelShape(1, 8, 2, 64)).build()[0]
    keys = mx.array(np.random.default_rng(0).standard_normal((1, 2, 9, 64), dtype=np.float32))
    cache._setup_from(keys, keys)
    launches = []
    real_polar_encode = encode.polar_encode
    monkeypatch.setattr("engine.kvcache.methods.polarquant.polar_encode",
                        lambda *a, **k: launches.append(1) or real_polar_encode(*a, **k))
    monkeypatch.setattr(encode, "POLAR_ENCODE_BACKENDS", ())
    declined = cache._encode(keys, keys)
    reference = {**cache._encode_role(keys, "key"), **cache._encode_role(keys, "value")}
    assert launches == [] and all(mx.array_equal(declined[n], reference[n]) for n in reference)
    monkeypatch.setattr(encode, "POLAR_ENCODE_BACKENDS", (EMULATE,))
    assert list(cache._encode(keys, keys)) == list(reference) and launches == [1, 1]


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec,head_dim", [("qjl:k4v4:g64", 128), ("qjl:k1v2:g32", 64), ("qjl:k3v4:g64", 64)])
def test_emulated_qjl_encode_kernel_matches_reference(spec: str, head_dim: int) -> None:
    """qjl's keys encoded in one launch (norms and the signs of the key_bits·D-row sketch; a sign may differ where
    S k is within float rounding of 0) and its values as before, against the reference encode (kernels off)."""
    cache = KVCacheBuilder(KVCacheConfig.parse(spec)).for_shape(ModelShape(1, 8, 2, head_dim)).build()[0]
    keys = mx.array(np.random.default_rng(5).standard_normal((1, 2, 301, head_dim), dtype=np.float32))
    cache._setup_from(keys, keys)
    fused = cache._encode(keys, keys)
    reference = _reference_of(cache)._encode(keys, keys)
    assert list(fused) == list(reference)
    for name, ref in reference.items():
        got = fused[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        if name == "key_codes":
            assert float(mx.mean((got != ref).astype(mx.float32))) <= 1e-3, name
        else:
            error = float(mx.max(mx.abs(got - ref) / mx.maximum(mx.abs(ref), 1e-3)))
            assert error <= 2**-10, (name, error)


@pytest.mark.parametrize("rows,head_dim", [(512, 128), (64, 64)])
def test_sign_pack_kernel_packs_as_sketch_signs(rows: int, head_dim: int) -> None:
    """The sign-packing launch (a long chunk's qjl keys) gives sketch_signs' words exactly, and each bit is its
    projection's sign (1 = non-negative: a zero vector's projections pack to all ones), read back with numpy."""
    from engine.kvcache.kernels import encode
    from engine.kvcache.quant.sketch import sketch_signs

    rng = np.random.default_rng(rows)
    sketch = mx.array(rng.standard_normal((rows, head_dim)).astype(np.float16))
    vectors = rng.standard_normal((1, 3, 37, head_dim), dtype=np.float32)
    vectors[0, 1, 5] = 0.0
    vectors = mx.array(vectors)
    got = encode.sketch_signs_packed(vectors, sketch, EMULATE)
    assert got.shape == (1, 3, 37, rows // 32) and got.dtype == mx.uint32
    assert mx.array_equal(got, sketch_signs(vectors, sketch))
    projected = np.array(vectors.astype(mx.float32) @ sketch.astype(mx.float32).T)
    bits = (np.array(got)[..., :, None] >> np.arange(32, dtype=np.uint32)) & 1
    assert np.array_equal(bits.reshape(projected.shape), (projected >= 0).astype(np.uint32))
    assert bool(np.all(bits[0, 1, 5] == 1)) and 0.3 < float(bits.mean()) < 0.7
    with pytest.raises(ValueError, match="multiple of 32"):
        encode.sketch_signs_packed(vectors, sketch[:48], EMULATE)


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", ["qjl:k4v4:g64", "qjl:k1v4:g64", "turboquant_prod:k4v4:g64"])
def test_sketch_encode_kernel_takes_long_chunks_only_of_small_sketches(spec: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk longer than SKETCH_ENCODE_MAX_TOKENS encodes qjl's keys through MLX where its sketch has more rows than
    a key has channels (key_bits > 1: the reference encode, exactly), a decode step's through the kernel; qjl at one
    sketch row per channel and turboquant_prod (m = D) keep the kernel; with the limit unset every chunk takes it."""
    from engine.kvcache.kernels import encode

    launches = []
    packs = []
    module = "qjl" if spec.startswith("qjl") else "turboquant_prod"
    real = encode.codebook_encode
    monkeypatch.setattr(f"engine.kvcache.methods.{module}.codebook_encode",
                        lambda *a, **k: launches.append(a[0].shape[-2]) or real(*a, **k))
    real_pack = encode.sketch_signs_packed
    monkeypatch.setattr(encode, "sketch_signs_packed", lambda *a, **k: packs.append(a[0].shape[-2]) or real_pack(*a, **k))
    cache = KVCacheBuilder(KVCacheConfig.parse(spec)).for_shape(ModelShape(1, 8, 2, 128)).build()[0]
    keys = mx.array(np.random.default_rng(3).standard_normal((1, 2, 100, 128), dtype=np.float32))
    cache._setup_from(keys, keys)
    reference = _reference_of(cache)._encode(keys, keys)
    monkeypatch.setattr(encode, "SKETCH_ENCODE_MAX_TOKENS", 64)
    kernel_launches = 1 if module == "qjl" else 2  # turboquant_prod's values have their own launch
    long_chunk = cache._encode(keys, keys)
    if spec == "qjl:k4v4:g64":
        assert launches == [] and packs == [100]  # S·k by MLX's matmul, the signs packed in one launch
        assert all(mx.array_equal(long_chunk[n], reference[n]) for n in reference), spec
    else:
        assert launches == [100] * kernel_launches
    cache._encode(keys[..., :1, :], keys[..., :1, :])
    assert launches[-1] == 1
    monkeypatch.setattr(encode, "SKETCH_ENCODE_MAX_TOKENS", None)
    before = len(launches)
    cache._encode(keys, keys)
    assert launches[before:] == [100] * kernel_launches


def _record_history_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of every history-decode launch from now on (kernels.dequantize_history wrapped)."""
    launches: list[int] = []
    real = kernels.dequantize_history
    monkeypatch.setattr(kernels, "dequantize_history", lambda *a, **k: launches.append(a[4]) or real(*a, **k))
    return launches


def _history_pairs(cache, dtype: mx.Dtype, head_dim: int) -> list[tuple[mx.array, mx.array]]:
    """(the cache's, the reference path's) decoded history keys, then values, in `dtype`; shapes and dtypes checked."""
    store = cache._compressed_view()
    got = cache._decoded_history(store, dtype)
    want = _reference_of(cache)._decoded_history(store, dtype)
    for out, ref in zip(got, want, strict=True):
        assert out.shape == ref.shape == (1, N_KV, cache.n_compressed, head_dim)
        assert out.dtype == ref.dtype == dtype
    return list(zip(got, want, strict=True))


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", ["turboquant:k4v4:g64", "turboquant:k3v3:g64:w7:s2", "turboquant:k1v1:g64", "rvq:k4v4:g64",
                                  "rvq:k3v3:g64:w3:s1", "affine:k4v4:g64", "affine:k3v3:g32:w5:s3", "rotated:k2v2:g64",
                                  "polarquant:k4v4:g64", "polarquant:k2v2:g64:w5:s2", "turboquant_prod:k4v4:g64",
                                  "turboquant_prod:k2v3:g64:w5:s2", "qjl:k4v4:g64", "qjl:k1v2:g32:w3:s1"])
def test_history_decode_kernel_matches_reference(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole compressed history decoded in one launch (what a prefill chunk attends over on a GPU) equals the
    reference decode (codebooks: the same products in float32, then the same casts; affine codes within one unit
    of the 16-bit dtype), and a prefill chunk's attention through the cache takes it."""
    launches = _record_history_launches(monkeypatch)
    for head_dim in (64, 128):
        for tokens in (70, 301):
            cache = _filled(spec, tokens, head_dim, 2, seed=tokens + head_dim)
            reference = _reference_of(cache)
            for dtype in (mx.float32, mx.float16):
                for out, ref in _history_pairs(cache, dtype, head_dim):
                    error = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))
                    if spec.startswith(("turboquant_prod", "qjl")):
                        # Sᵀ·sign summed in another order than MLX's (a float32 matmul, or the kernel's own sums)
                        assert float(mx.max(error / (mx.abs(ref.astype(mx.float32)) + 1e-2))) <= 2**-10, spec
                    elif spec.startswith(("turboquant", "rvq")):
                        assert float(mx.max(error)) <= 1e-6, spec
                    elif spec.startswith("polarquant"):  # sines and cosines of the same angles, in another library
                        assert float(mx.max(error / (mx.abs(ref.astype(mx.float32)) + 1e-3))) <= 2**-10, spec
                    else:  # MLX's dequantize rounds scale·code + bias in 16 bits, the kernel once at the end
                        assert float(mx.max(error / (mx.abs(ref.astype(mx.float32)) + 1e-3))) <= 2**-10, spec
            assert launches[-1] == cache.n_compressed
            queries = mx.array(np.random.default_rng(tokens).standard_normal((1, 2 * N_KV, 40, head_dim),
                                                                                dtype=np.float32))
            before = len(launches)
            out = cache.attention(queries, None, None, scale=head_dim**-0.5, mask=None)
            assert len(launches) == before + 1, "a prefill chunk did not decode the history with the kernel"
            ref = reference.attention(queries, None, None, scale=head_dim**-0.5, mask=None)
            assert float(mx.max(mx.abs(out - ref))) <= 2e-3, spec


@pytest.mark.parametrize("rows,head_dim,tokens,capacity", [(512, 128, 77, 100), (128, 128, 301, 320),
                                                          (128, 64, 130, 130), (64, 64, 1, 64)])
def test_sketch_projection_on_matrix_ops_equals_the_sign_rows_matmul(rows: int, head_dim: int, tokens: int,
                                                                      capacity: int) -> None:
    """Σ sign·S on the warp matrix ops (S split into two bfloat16 tiles that sum to it exactly) against the ±1 rows'
    float32 matmul: within float32 summation order, for the first `tokens` of a larger buffer (a partial last tile)."""
    from engine.kvcache.kernels import dequantize

    rng = np.random.default_rng(tokens)
    sketch = mx.array(rng.standard_normal((rows, head_dim)).astype(np.float16))
    signs = mx.array(rng.integers(0, 2**32, size=(1, 3, capacity, rows // 32), dtype=np.uint64).astype(np.uint32))
    got = dequantize.sketch_projection_mma(signs, sketch, tokens, EMULATE)
    want = dequantize.sign_rows(signs, tokens, rows, EMULATE) @ sketch.astype(mx.float32)
    assert got.shape == want.shape == (1, 3, tokens, head_dim) and got.dtype == mx.float32
    # float32 sums of `rows` terms of size ~1 in another order: relative to the partial sums' size, sqrt(rows)
    error = float(mx.max(mx.abs(got - want) / (mx.abs(want) + rows**0.5)))
    assert error <= 1e-6
    # a bfloat16 copy of S alone (no second tile) is off by far more: the split is what makes it exact
    coarse = dequantize.sign_rows(signs, tokens, rows, EMULATE) @ sketch.astype(mx.bfloat16).astype(mx.float32)
    assert float(mx.max(mx.abs(coarse - want) / (mx.abs(want) + rows**0.5))) > 100 * max(error, 1e-7)


def test_sketch_projection_on_matrix_ops_declines_more_than_128_channels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past 128 channels (16 accumulator tiles a warp; S's tiles in an Apple GPU's 32 KB) the projection takes the ±1
    rows even where SKETCH_MMA_BACKENDS admits the backend, with the same result."""
    from engine.kvcache.kernels import dequantize

    rng = np.random.default_rng(2)
    signs = mx.array(rng.integers(0, 2**32, size=(1, 1, 40, 32), dtype=np.uint64).astype(np.uint32))
    calls = []
    real = dequantize.sketch_projection_mma
    monkeypatch.setattr(dequantize, "sketch_projection_mma", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    for head_dim in (128, 256):
        sketch = mx.array(rng.standard_normal((1024, head_dim)).astype(np.float16))
        got = dequantize._sketch_projection(signs, sketch, 40, EMULATE)
        want = dequantize.sign_rows(signs, 40, 1024, EMULATE) @ sketch.astype(mx.float32)
        assert float(mx.max(mx.abs(got - want) / (mx.abs(want) + 32.0))) <= 1e-6
    assert calls == [(1024, 128)]


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", ["qjl:k4v4:g64", "turboquant_prod:k4v4:g64"])
@pytest.mark.parametrize("path", ["matrix ops", "float16 rows"])
def test_sketch_history_faster_paths_match_the_float32_rows(spec: str, path: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Sketched keys' history through a faster projection where its backend list admits it, within 2^-10 of the
    float32 ±1 rows' history (values unchanged): on the matrix ops (SKETCH_MMA_BACKENDS: one launch, no rows) for both
    methods; float16 rows (SKETCH_HALF_BACKENDS, the history decoded into the cache's 16-bit dtype) only for qjl, whose
    keys are the projection scaled: turboquant_prod keeps float32 rows."""
    from engine.kvcache.kernels import dequantize

    seen = []
    for name in ("sketch_projection_mma", "sign_rows"):
        real = getattr(dequantize, name)
        monkeypatch.setattr(dequantize, name, lambda *a, _name=name, _real=real, **k:
                            seen.append(a[4] if _name == "sign_rows" else _name) or _real(*a, **k))
    if path == "float16 rows":
        monkeypatch.setattr(dequantize, "SKETCH_MMA_BACKENDS", ())
    cache = _filled(spec, 301, 128, 2, seed=6)
    store = cache._compressed_view()
    fast = cache._decoded_history(store, mx.float16)
    if path == "matrix ops":
        assert seen == ["sketch_projection_mma"]
    else:
        assert seen == [mx.float16 if spec.startswith("qjl") else mx.float32]
    monkeypatch.setattr(dequantize, "SKETCH_MMA_BACKENDS", ())
    monkeypatch.setattr(dequantize, "SKETCH_HALF_BACKENDS", ())
    rows = cache._decoded_history(store, mx.float16)
    assert seen[1:] == [mx.float32]
    error = mx.abs(fast[0].astype(mx.float32) - rows[0].astype(mx.float32)) / (mx.abs(rows[0].astype(mx.float32)) + 1e-2)
    assert float(mx.max(error)) <= 2**-10 and mx.array_equal(fast[1], rows[1])


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", ["qjl:k4v4:g64", "turboquant_prod:k3v3:g64:w5:s2"])
def test_sketch_history_in_blocks_equals_one_block(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sketched keys' history rebuilt SKETCH_HISTORY_BLOCK tokens at a time (a partial last block included) equals the
    same rebuilt at once, and the per-thread sums of the kernel's other form within float rounding."""
    from engine.kvcache.kernels import dequantize

    monkeypatch.setattr(dequantize, "SKETCH_MMA_BACKENDS", ())  # the ±1 rows' path, in blocks
    cache = _filled(spec, 301, 128, 2, seed=11)
    store = cache._compressed_view()
    whole = cache._decoded_history(store, mx.float32)
    monkeypatch.setattr(dequantize, "SKETCH_HISTORY_BLOCK", 64)
    blocks = cache._decoded_history(store, mx.float32)
    assert cache.n_compressed > 4 * 64 and cache.n_compressed % 64
    assert all(mx.array_equal(a, b) for a, b in zip(whole, blocks, strict=True))
    monkeypatch.setattr(dequantize, "SKETCH_HISTORY_MATMUL", False)
    summed = cache._decoded_history(store, mx.float32)
    error = mx.abs(summed[0] - whole[0]) / (mx.abs(whole[0]) + 1e-2)
    assert float(mx.max(error)) <= 2**-10 and mx.array_equal(summed[1], whole[1])


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec,head_dim", [
    ("kivi:k4v4:g64", 64), ("kivi:k2v2:g32:w5:s2", 128), ("kivi:k3v3:g64:s4:key_block=128", 128),
    ("kivi:k3v3:g64:s4:key_block=128:key_outliers=1:rotate_values=true:symmetric_values=true", 128),
    (f"kivi:k4v4:g64:s4:key_block=128:rotate_values=true:{ROPE_SPEC.format('false')}", 128),
    (f"kivi:k3v3:g64:s4:key_block=128:key_outliers=1:symmetric_values=true:{ROPE_SPEC.format('false')}", 128),
    (f"kivi:k6v6:g32:w3:s1:key_outliers=1:{ROPE_SPEC.format('true')}", 128),
    # key channels at different widths (TABLE: a registered table of widths 2-5, one class empty at head_dim 64)
    ("kivi:k3v3:g64:s4:key_block=128:key_outliers=1:rotate_values=true:symmetric_values=true:key_widths=TABLE", 128),
    ("kivi:k3v3:g64:w5:key_widths=TABLE", 64),
    ("kivi:k3v3:g64:s4:key_block=128:key_outliers=1:key_widths=FLAT", 128),
    (f"kivi:k3v3:g64:s4:key_block=128:key_outliers=1:key_widths=TABLE:{ROPE_SPEC.format('false')}", 128),
    (f"kivi:k3v3:g64:w5:key_widths=TABLE:{ROPE_SPEC.format('true').replace('128', '64')}", 64),
    # the 2-bit level's layout with widths 1-4 (TABLE1), keys as given and before RoPE
    ("kivi:k2v2:g64:s4:key_block=128:clip_search=true:rotate_values=true:key_widths=TABLE1", 128),
    (f"kivi:k2v2:g64:s4:key_block=128:clip_search=true:rotate_values=true:key_widths=TABLE1:"
     f"{ROPE_SPEC.format('false')}", 128)])
def test_kivi_history_decode_kernel_matches_reference(spec: str, head_dim: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """KIVI's history decoded in one launch (keys per channel block, their outliers, keys before RoPE turned by
    position; values with or without biases; key channels at different widths, each written at its channel) equals
    the reference decode within float32 rounding and the sines' (MLX's RoPE against the kernel's reduced angle) and
    the 16-bit dtype it is written in, and a prefill chunk's attention through the cache takes it."""
    if "FLAT" in spec:  # every channel at the key bits: class 0 (2 bits) empty, its arrays placeholders
        spec = spec.replace("FLAT", _width_table(head_dim, (0, 128, 0, 0), seed=0))
    if "TABLE1" in spec:
        spec = spec.replace("TABLE1", _width_table(head_dim, (48, 48, 16, 16), seed=head_dim + 1, narrowest=1))
    if "TABLE" in spec:
        spec = spec.replace("TABLE", _width_table(head_dim, (48, 48, 16, 16) if head_dim == 128 else (16, 32, 16, 0),
                                                  seed=head_dim))
    launches = _record_history_launches(monkeypatch)
    for tokens in (200, 1100):
        cache = _filled(spec, tokens, head_dim, 2, seed=tokens, spiked="key_outliers" in spec)
        reference = _reference_of(cache)
        for dtype in (mx.float32, mx.bfloat16):
            for out, ref in _history_pairs(cache, dtype, head_dim):
                ref32 = ref.astype(mx.float32)
                # Keys before RoPE: the kernel's angle is position x each pair's angle at position 1 read back from
                # MLX's RoPE (as the decode pass turns them), ~1e-7 rad off per position: an error relative to the
                # pair's size (~1 here), not to a small turned component
                floor = 1.0 if "rope=pre" in spec else 1e-2
                error = mx.abs(out.astype(mx.float32) - ref32) / (mx.abs(ref32) + floor)
                # the kernel writes the cache's 16-bit dtype (as every history decode), the reference float32: one
                # 16-bit unit, and for bfloat16 the second rounding
                assert float(mx.max(error)) <= (2**-10 if dtype == mx.float32 else 2**-7), (spec, tokens, dtype)
        assert launches[-1] == cache.n_compressed
        queries = mx.array(np.random.default_rng(tokens).standard_normal((1, 2 * N_KV, 40, head_dim),
                                                                            dtype=np.float32))
        before = len(launches)
        out = cache.attention(queries, None, None, scale=head_dim**-0.5, mask="causal")
        assert len(launches) == before + 1, "a prefill chunk did not decode the history with the kernel"
        ref = reference.attention(queries, None, None, scale=head_dim**-0.5, mask="causal")
        assert float(mx.max(mx.abs(out - ref))) <= 2e-3, spec


@pytest.mark.usefixtures("emulated")
def test_history_decode_kernel_is_left_to_methods_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kvcache.kernels import decode

    keys = mx.array(np.random.default_rng(0).standard_normal((1, N_KV, 200, 64), dtype=np.float32))
    assert _fed("kivi:k4v4:g64", "require", keys, keys)._dequantize_launch()[0] == EMULATE
    assert _fed("kivi:k4v4:g64:key_grid=lloyd", "auto", keys, keys)._dequantize_launch() is None  # grids: no kernel
    assert _fed("turboquant:k4v4:g64", "off", keys, keys)._dequantize_launch() is None
    assert _fed("turboquant:k4v4:g64", "auto", keys, keys)._dequantize_launch()[0] == EMULATE
    assert _fed("qjl:k4v4:g64", "auto", keys, keys)._dequantize_launch()[0] == EMULATE
    monkeypatch.setattr(kernels.dequantize, "KIVI_BACKENDS", ())  # a backend where KIVI's has not passed parity
    assert _fed("kivi:k4v4:g64", "auto", keys, keys)._dequantize_launch() is None
    assert _fed("polarquant:k4v4:g64", "auto", keys, keys)._dequantize_launch()[0] == EMULATE
    monkeypatch.setattr(decode, "POLAR_BACKENDS", ())  # a backend where the polar codec has not passed parity
    assert _fed("polarquant:k4v4:g64", "auto", keys, keys)._dequantize_launch() is None
    monkeypatch.setattr(kernels.dequantize, "SKETCH_HISTORY_BACKENDS", ())  # nor the sketched keys' history decode
    assert _fed("qjl:k4v4:g64", "auto", keys, keys)._dequantize_launch() is None
    assert _fed("turboquant_prod:k4v4:g64", "auto", keys, keys)._dequantize_launch() is None
    assert _fed("turboquant:k4v4:g64", "auto", keys, keys)._dequantize_launch()[0] == EMULATE


def _fed(spec: str, mode: str, keys: mx.array, values: mx.array):
    config = KVCacheConfig.parse(spec)
    config = replace(config, options={**config.options, "kernels": mode})
    shape = ModelShape(n_layers=1, n_heads=2 * N_KV, n_kv_heads=N_KV, head_dim=keys.shape[-1])
    return filled_then_stepped(KVCacheBuilder(config).for_shape(shape).build()[0], keys, values)


# ----- the emulator itself ----------------------------------------------------------------------------------

_SHUFFLE = KernelSource(
    name="emulate_shuffle",
    input_names=("x",),
    output_names=("out", "total"),
    body="""
  const float mine = x[GROUP_X * NT + TID];
  out[GROUP_X * NT + TID] = -1.0f;
  if (TID / 32 != SKIP) out[GROUP_X * NT + TID] = LANE_XOR(mine, M);  // a whole warp may skip a shuffle
  SHARED float partial[NT];
  partial[TID] = mine;
  BARRIER();
  if (TID == 0) { float s = 0.0f; for (int i = 0; i < NT; ++i) s += partial[i]; total[GROUP_X] = s; }
""",
)


def test_lane_xor_barrier_and_shared_memory_per_block() -> None:
    run = kernel(_SHUFFLE, EMULATE)
    x = np.arange(3 * 64, dtype=np.float32)
    lanes = np.arange(x.size)
    for mask, skip in ((1, -1), (16, 1)):
        out, total = run(inputs=[mx.array(x)], template=[("NT", 64), ("M", mask), ("SKIP", skip)],
                         grid=(3 * 64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[x.shape, (3,)],
                         output_dtypes=[mx.float32, mx.float32])
        expected = x[(lanes & ~31) | ((lanes % 32) ^ mask)]
        expected[(lanes % 64) // 32 == skip] = -1.0
        assert np.array_equal(np.array(out), expected)
        assert np.array_equal(np.array(total), x.reshape(3, 64).sum(axis=1))


@pytest.mark.parametrize("body,message", [
    ("  if (TID < 16) BARRIER();\n  out[TID] = x[TID];\n", "16 of 32 threads wait at a barrier"),
    ("  out[TID] = (TID < 16) ? LANE_XOR(x[TID], 1) : x[TID];\n", "16 of 32 threads wait at a shuffle"),
])
def test_a_barrier_or_shuffle_not_every_thread_reaches_is_an_error(body: str, message: str) -> None:
    divergent = KernelSource(name="emulate_divergent", input_names=("x",), output_names=("out",), body=body)
    with pytest.raises(RuntimeError, match=message):
        kernel(divergent, EMULATE)(inputs=[mx.zeros((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                                   output_shapes=[(32,)], output_dtypes=[mx.float32])


def test_a_kernel_that_leaves_an_input_changed_is_an_error() -> None:
    """MLX treats a kernel's inputs as immutable (another array may share the buffer): the emulator fails a kernel
    that writes one and does not set it back; one that restores it passes."""
    body = "  GLOBAL float* scratch = (GLOBAL float*)x;  // inputs are const: only a cast writes one\n  scratch[TID] += 1.0f;\n  out[TID] = x[TID];\n"
    for restores, outcome in ((False, pytest.raises(RuntimeError, match="left its input 'x' changed")),
                              (True, contextlib.nullcontext())):
        source = KernelSource(name=f"emulate_writes_input_{int(restores)}", input_names=("x",), output_names=("out",),
                              body=body + ("  scratch[TID] -= 1.0f;\n" if restores else ""))
        with outcome:
            (out,) = kernel(source, EMULATE)(inputs=[mx.zeros((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                                             output_shapes=[(32,)], output_dtypes=[mx.float32])
            assert np.array_equal(np.array(out), np.ones(32))


def test_tiled_pass_fits_a_threadgroup_and_shrinks_its_tile_to_fit() -> None:
    """The tiled pass's shared arrays stay within TILED_SHARED_LIMIT (Apple GPUs: 32 KB a threadgroup) for every
    layout it takes; the app's shape keeps 64-token tiles; a shape over the limit at 64 gets a smaller tile."""
    from engine.kvcache.kernels import decode

    assert decode.tiled_tile(Codec("kivi_keys", 4), Codec("affine", 4), 64, 128, 128, rows=4) == 64
    assert decode.tiled_tile(Codec("kivi_keys", 8), Codec("affine", 8), 64, 128, 128, rows=8) == 32
    for head_dim in (64, 128, 256):
        for rows in (1, 2, 4, 8, 16):
            for bits in (2, 3, 4, 5, 6, 8):
                tile = decode.tiled_tile(Codec("kivi_keys", bits), Codec("affine", bits), 64, head_dim, 128, rows)
                if tile is not None:
                    assert tile >= decode.TILED_MIN_TILE
                    used = decode.tiled_shared_bytes(head_dim, rows, decode.threads_for(head_dim), tile, bits, bits, 64)
                    assert used <= decode.TILED_SHARED_LIMIT, (head_dim, rows, bits, tile, used)


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", ["kivi:k4v4:g64:s4:key_block=128:rotate_values=true", "kivi:k8v8:g64"])
def test_tiled_pass_with_eight_query_rows_per_kv_head(spec: str) -> None:
    """GQA of 8 (the partial scores of a tile grow with the rows; 8-bit codes take 32-token tiles there)."""
    from engine.kvcache.kernels import decode

    for tokens in (150, 700):
        plan, *_ = _attend_both(_filled(spec, tokens, 128, 8, seed=tokens), tokens, 8)
        assert ("CT", 64 if "k4" in spec else 32) in plan.constants
        assert ("R", 8) in plan.constants
    assert decode.TILED


@pytest.mark.usefixtures("emulated")
def test_keys_before_rope_without_a_tile_at_the_models_rows_take_the_reference_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiled pass's tile depends on the query rows per kv head (threadgroup memory); where there is none at
    a model's rows, a rope=pre cache attends through the reference path (right, slower) rather than failing, and
    rope=auto's check, given those rows, declines."""
    from engine.kvcache.kernels import decode
    from engine.kvcache.methods.kivi import VeloxKIVIKVCache
    from engine.kvcache.quant.rope import RopeParameters

    spec = "kivi:k4v4:g64:s4:key_block=128:" + ROPE_SPEC.format("false")
    cache = _filled(spec, 300, 128, 16, seed=3)
    limit = decode.tiled_shared_bytes(128, 8, 128, 32, 4, 4, 64)  # room for 8 rows, not 16
    monkeypatch.setattr(decode, "TILED_SHARED_LIMIT", limit)
    assert decode.tiled_tile(Codec("kivi_keys", 4), Codec("affine", 4), 64, 128, 128, 16) is None
    assert decode.tiled_tile(Codec("kivi_keys", 4), Codec("affine", 4), 64, 128, 128, 8) is not None
    queries = mx.array(np.random.default_rng(3).standard_normal((1, 16 * N_KV, 1, 128), dtype=np.float32))
    with pytest.raises(ConfigError, match="no tile for 16 query heads per kv head"):
        cache.attention(queries, None, None, scale=0.088, mask=None)  # kernels=require
    cache.config = replace(cache.config, options={**cache.config.options, "kernels": "auto"})
    out = cache.attention(queries, None, None, scale=0.088, mask=None)
    ref = _reference_of(cache).attention(queries, None, None, scale=0.088, mask=None)
    assert cache._decode_plan(16) is None
    assert float(mx.max(mx.abs(out - ref))) <= 2e-3
    rope = RopeParameters(dims=128, base=10000.0, scale=1.0, traditional=False)
    config = KVCacheConfig.parse("kivi:k4v4:g64:s4:key_block=128")
    assert VeloxKIVIKVCache._rope_kernel_declines(config, rope, 128, 16) is not None
    assert VeloxKIVIKVCache._rope_kernel_declines(config, rope, 128, 8) is None


@pytest.mark.usefixtures("emulated")
def test_keys_on_a_grid_without_a_tile_at_the_models_rows_take_the_reference_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the tiled pass reads keys on a grid: with no tile at a model's rows the reference path serves."""
    from engine.kvcache.kernels import decode

    cache = _filled("kivi:k2v2:g64:s4:key_block=128:key_grid=lloyd", 300, 128, 16, seed=5)
    cache.config = replace(cache.config, options={**cache.config.options, "kernels": "auto"})
    monkeypatch.setattr(decode, "TILED_SHARED_LIMIT", decode.tiled_shared_bytes(128, 8, 128, 32, 2, 2, 64))
    assert decode.tiled_tile(Codec("kivi_keys", 2, grid=True), Codec("affine", 2), 64, 128, 128, 16) is None
    queries = mx.array(np.random.default_rng(5).standard_normal((1, 16 * N_KV, 1, 128), dtype=np.float32))
    out = cache.attention(queries, None, None, scale=0.088, mask=None)
    ref = _reference_of(cache).attention(queries, None, None, scale=0.088, mask=None)
    assert cache._decode_plan(16) is None
    assert float(mx.max(mx.abs(out - ref))) <= 2e-3


OUTLIER_SPECS = (
    # The 3-bit candidate of issue 12 (scale-only rotated values, key outliers), keys as given and before RoPE
    "kivi:k3v3:g64:s4:key_block=128:rotate_values=true:symmetric_values=true:key_outliers=1",
    "kivi:k3v3:g64:s4:key_block=128:rotate_values=true:symmetric_values=true:key_outliers=1:" + ROPE_SPEC.format("false"),
    "kivi:k4v4:g64:w5:key_outliers=1:" + ROPE_SPEC.format("true"),
    "kivi:k2v2:g32:s2:key_outliers=1",
)


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("spec", OUTLIER_SPECS)
def test_tiled_pass_adds_key_outliers_like_the_reference(spec: str) -> None:
    """key_outliers: the tiled pass adds each block's outlier share q_c·residual to its token's score (keys before
    RoPE: the residual turned at its position) and matches the reference path, which adds them after
    quantized_matmul (or decodes the keys, before RoPE); the shares matter here (without them the reference moves
    well past the tolerance), over several key blocks, tiles and splits."""
    for tokens in (200, 301, 1200):
        plan, queries, reference, ref = _attend_both(_filled(spec, tokens, 128, 4, seed=tokens, spiked=True), tokens, 4)
        assert ("KO", 1) in plan.constants
        assert ("ROPE", int("rope=pre" in spec)) in plan.constants
        # The same cache with every residual zero: the outliers' shares are what the kernel matched
        assert reference._store is not None
        reference._store = {**reference._store,
                            "key_outlier_residuals": mx.zeros_like(reference._store["key_outlier_residuals"])}
        without = reference.attention(queries, None, None, scale=0.088, mask=None)
        assert float(mx.max(mx.abs(without - ref))) > 20 * 2e-3, (spec, tokens)


@pytest.mark.usefixtures("emulated")
def test_key_outliers_wait_for_parity_on_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend not in OUTLIER_BACKENDS declines the kernel for a key_outliers cache (kernels=require: an error
    saying why; auto: the reference path), keys as given or before RoPE (rope=auto then keeps them as given)."""
    from engine.kvcache.kernels import decode
    from engine.kvcache.methods.kivi import VeloxKIVIKVCache
    from engine.kvcache.quant.rope import RopeParameters

    monkeypatch.setattr(decode, "OUTLIER_BACKENDS", ())
    for spec in OUTLIER_SPECS[:2]:
        cache = _filled(spec, 300, 128, 4, seed=1, spiked=True)
        queries = mx.zeros((1, 4 * N_KV, 1, 128))
        with pytest.raises(ConfigError, match="key outliers .* parity"):
            cache.attention(queries, None, None, scale=0.088, mask=None)
        automatic = _reference_of(cache)
        automatic.config = replace(cache.config, options={**cache.config.options, "kernels": "auto"})
        assert automatic._decode_plan(4) is None
    rope = RopeParameters(dims=128, base=10000.0, scale=1.0, traditional=False)
    config = KVCacheConfig.parse(OUTLIER_SPECS[0])
    assert "parity" in VeloxKIVIKVCache._rope_kernel_declines(config, rope, 128, 4)
    monkeypatch.setattr(decode, "OUTLIER_BACKENDS", (EMULATE,))
    assert VeloxKIVIKVCache._rope_kernel_declines(config, rope, 128, 4) is None


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("spec", ["kivi:k3v3:g64:s4:key_block=128:rotate_values=true:symmetric_values=true",
                                  "kivi:k3v3:g64:s4:key_block=128:rotate_values=true:symmetric_values=true:key_outliers=1"])
def test_a_decode_plan_kept_while_blocks_are_appended_reads_them(spec: str, tiled: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode plan lives as long as the store's buffers (blocks are appended into spare capacity in place), so it
    must hold the store's own arrays, never ones derived from them when it was built: with scale-only values the
    kernel derives each bias from the scales (a plan holding biases derived at its first step read zero scales for
    every block appended after it, an error of ~0.07 here)."""
    from engine.kvcache.kernels import decode

    if not tiled:
        if "key_outliers" in spec:
            pytest.skip("only the tiled pass adds key outliers")
        monkeypatch.setattr(decode, "TILED", False)
    config = replace(KVCacheConfig.parse(spec), options={**KVCacheConfig.parse(spec).options, "kernels": "require"})
    cache = KVCacheBuilder(config).for_shape(ModelShape(n_layers=1, n_heads=4 * N_KV, n_kv_heads=N_KV,
                                                        head_dim=128)).build()[0]
    rng = np.random.default_rng(3)
    cache.update_and_fetch(mx.array(rng.standard_normal((1, N_KV, 1200, 128), dtype=np.float32)),
                           mx.array(rng.standard_normal((1, N_KV, 1200, 128), dtype=np.float32)))
    assert cache.capacity >= cache.n_compressed + 128  # room for the next block: it is appended in place
    queries = mx.array(rng.standard_normal((1, 4 * N_KV, 1, 128), dtype=np.float32))
    cache.attention(queries, None, None, scale=0.088, mask=None)
    store, plan = cache._store, cache._decode_plan(4)
    for _ in range(200):
        cache.update_and_fetch(mx.array(rng.standard_normal((1, N_KV, 1, 128), dtype=np.float32)),
                               mx.array(rng.standard_normal((1, N_KV, 1, 128), dtype=np.float32)))
    out = cache.attention(queries, None, None, scale=0.088, mask=None)
    assert cache._store is store and cache._decode_plan(4) is plan  # the same plan served both steps
    ref = _reference_of(cache).attention(queries, None, None, scale=0.088, mask=None)
    assert float(mx.max(mx.abs(out - ref))) <= 2e-3


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("tiled", [True, False])
def test_a_step_that_empties_the_window_launches_the_kernel_every_step_launches(tiled: bool,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A key block's encode empties KIVI's window, and the kernel then reads a window count of 0: the launch's
    template arguments are those of every other step. As a template argument of its own, the empty window made a kernel
    of its own, which MLX's CUDA backend compiled at the first such step of a process: on an H200 that step took 2.8-4.8
    s in mlx-lm's loop, 128 tokens into the first answer (loop-stall-profile-32k-h200.json)."""
    from engine.kvcache.kernels import decode

    if not tiled:
        monkeypatch.setattr(decode, "TILED", False)
    config = replace(KVCacheConfig.parse("kivi:k4v4:g64:s4:key_block=128"),
                     options={"key_block": 128, "kernels": "require"})
    cache = KVCacheBuilder(config).for_shape(ModelShape(n_layers=1, n_heads=4 * N_KV, n_kv_heads=N_KV,
                                                        head_dim=128)).build()[0]
    rng = np.random.default_rng(5)

    def step(n: int) -> None:
        cache.update_and_fetch(mx.array(rng.standard_normal((1, N_KV, n, 128), dtype=np.float32)),
                               mx.array(rng.standard_normal((1, N_KV, n, 128), dtype=np.float32)))

    templates: list[tuple] = []

    def attend_once() -> None:
        plan = cache._decode_plan(4)
        real = getattr(plan.attend, "real", plan.attend)  # the kernel, where the plan kept is already spied on

        def spy(**arguments: object) -> object:
            templates.append(tuple(arguments["template"]))  # type: ignore[arg-type]
            return real(**arguments)

        spy.real = real  # type: ignore[attr-defined]
        cache._plan_cache = (*cache._plan_cache[:4], replace(plan, attend=spy))
        queries = mx.array(rng.standard_normal((1, 4 * N_KV, 1, 128), dtype=np.float32))
        out = cache.attention(queries, None, None, scale=0.088, mask=None)
        ref = _reference_of(cache).attention(queries, None, None, scale=0.088, mask=None)
        assert float(mx.max(mx.abs(out - ref))) <= 2e-3

    step(255)  # the sinks, and a block compressed (the sinks' copies lead its stream), 127 tokens in the window
    step(1)  # the window's 128th token: its block is encoded, and the window is empty
    assert cache._window_keys is None and cache.n_compressed == 256
    attend_once()
    step(1)
    assert cache._window_keys is not None
    attend_once()
    assert len(templates) == 2 and templates[0] == templates[1]


def _width_table(head_dim: int, counts: tuple[int, ...], seed: int, narrowest: int = 2) -> str:
    """`registered_width_table` for one layer of N_KV heads of `head_dim` channels."""
    assert sum(counts) == head_dim
    return registered_width_table(counts, N_KV, seed, narrowest)


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("bits,options", [
    (4, ":s4:key_block=128:rotate_values=true"),  # the 4-bit level's layout, widths 3-6
    (3, ":s4:key_block=128:rotate_values=true:symmetric_values=true:key_outliers=1:" + ROPE_SPEC.format("false")),
])
def test_long_caches_take_the_backends_long_tile(bits: int, options: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's long tile (decode.TILED_LONG_TILES: CUDA's 128 tokens within 48 KB, from 24k slots) is taken
    once the cache holds that many compressed slots and not before, its threadgroup memory past the default limit
    at the levels' key widths (why only CUDA has one), and the attention stays the reference's."""
    from engine.kvcache.kernels import decode

    monkeypatch.setitem(decode.TILED_LONG_TILES, "emulate", (128, 48 * 1024, 512))
    digest = _width_table(128, (48, 48, 16, 16), seed=128, narrowest=bits - 1)
    spec = f"kivi:k{bits}v{bits}:g64{options}:key_widths={digest}"
    for tokens, tile in ((300, 64), (1200, 128)):
        cache = _filled(spec, tokens, 128, 4, seed=tokens, spiked="outliers" in options)
        assert (cache.capacity >= 512) == (tile == 128), cache.capacity
        plan, *_ = _attend_both(cache, tokens, 4)
        assert ("CT", tile) in plan.constants and plan.tile == tile
    assert decode.tiled_shared_bytes(128, 4, 128, 128, bits + 2, bits, 64, bits == 3, True) > decode.TILED_SHARED_LIMIT


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize("options,counts", [
    # the 3-bit level's layout with every width present, then a layer without 5-bit channels and one without 4-bit
    # ones (between two classes it has)
    (":s4:key_block=128:rotate_values=true:symmetric_values=true:key_outliers=1", (48, 48, 16, 16)),
    (":w9:s4", (32, 64, 32, 0)),
    (":key_block=128:key_outliers=1", (16, 104, 0, 8)),
    # a layer whose channels all kept the key bits: only class 1, class 0's codes a placeholder
    (":s4:key_block=128:key_outliers=1", (0, 128, 0, 0)),
    # keys before RoPE: each channel of a pair read at its own row and width (outliers turned with their pair)
    (":s4:key_block=128:key_outliers=1:symmetric_values=true:" + ROPE_SPEC.format("false"), (48, 48, 16, 16)),
    (":w9:s4:" + ROPE_SPEC.format("true"), (32, 64, 32, 0)),
    # the 2-bit level's layout: widths 1-4 averaging 2 (1-bit codes: 32 a word), as given and before RoPE
    ("@2:s4:key_block=128:clip_search=true:rotate_values=true", (48, 48, 16, 16)),
    ("@2:s4:key_block=128:clip_search=true:rotate_values=true:" + ROPE_SPEC.format("false"), (24, 88, 8, 8)),
    # the 4-bit level's layout: widths 3-6 averaging 4
    ("@4:s4:key_block=128:rotate_values=true", (48, 48, 16, 16)),
    ("@4:s4:key_block=128:rotate_values=true:" + ROPE_SPEC.format("false"), (24, 88, 8, 8)),
])
@pytest.mark.parametrize("uniform", [False, True])
def test_tiled_pass_reads_key_channels_at_different_widths(options: str, counts: tuple[int, ...], uniform: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """key_widths: each class's codes at its width, the query's channels gathered into the keys' storage order
    (and the 16-bit sinks and window read through it), against the reference path (one quantized_matmul per width
    on the gathered queries), over several key blocks, tiles and splits; a class a layer lacks is skipped. Phase 1
    class by class and in its uniform form (decode.WIDTH_UNIFORM_RUNS; keys as given only)."""
    from engine.kvcache.kernels import decode

    monkeypatch.setattr(decode, "WIDTH_UNIFORM_RUNS", uniform)
    bits = int(options[1]) if options.startswith("@") else 3
    options = options[2:] if options.startswith("@") else options
    for head_dim in (128, 64):
        scaled = tuple(c * head_dim // 128 for c in counts)
        digest = _width_table(head_dim, scaled, seed=sum(scaled), narrowest=bits - 1)
        spec = f"kivi:k{bits}v{bits}:g64{options}:key_widths={digest}".replace("rope_dims=128", f"rope_dims={head_dim}")
        for tokens in (200, 301, 1200):
            cache = _filled(spec, tokens, head_dim, 4, seed=tokens, spiked="outliers" in options)
            plan = cache._decode_plan(4)
            assert plan is not None and ("KCLS", 4) in plan.constants and ("KBLO", bits - 1) in plan.constants
            assert ("ROPE", int("rope=pre" in spec)) in plan.constants and ("KUNI", int(uniform)) in plan.constants
            queries = mx.array(np.random.default_rng(tokens).standard_normal((1, 4 * N_KV, 1, head_dim),
                                                                              dtype=np.float32))
            out = cache.attention(queries, None, None, scale=head_dim**-0.5, mask=None)
            ref = _reference_of(cache).attention(queries, None, None, scale=head_dim**-0.5, mask=None)
            error = float(mx.max(mx.abs(out - ref)))
            assert np.isfinite(error) and error <= 2e-3, (spec, head_dim, tokens, error)


# KIVI's chunk encode in one launch (kernels/kivi_encode.py): (spec, key width counts from the narrowest width or None,
# its narrowest width, head_dim, dtype). The 3-bit level's layout (widths 2-5, outliers, symmetric values), the 4-bit
# one's (MLX's affine rule for both roles), min..max keys in float16, 1-bit channels among widths 1-4, an empty middle
# width class, and the clip search (the 2-bit level's layout, 1-bit channels with their two means; outliers in float16).
KIVI_ENCODE_CASES = (
    ("kivi:k3v3:g64:s4:key_block=128:rotate_values=true:symmetric_values=true:key_outliers=1", (40, 56, 24, 8), 2,
     128, mx.bfloat16),
    ("kivi:k4v4:g64:key_block=128:rotate_values=true", None, 0, 128, mx.bfloat16),
    ("kivi:k4v4:g32:key_block=64:minmax_keys=true:key_outliers=1", None, 0, 64, mx.float16),
    ("kivi:k2v2:g64:key_block=128:key_outliers=1", (40, 56, 24, 8), 1, 128, mx.bfloat16),
    ("kivi:k3v3:g64:key_block=128", (64, 0, 64), 2, 128, mx.bfloat16),
    ("kivi:k2v2:g64:s4:clip_search=true:key_block=128:rotate_values=true", (40, 56, 24, 8), 1, 128, mx.bfloat16),
    ("kivi:k3v3:g32:key_block=64:clip_search=true:key_outliers=1", None, 0, 64, mx.float16),
)


@pytest.mark.usefixtures("emulated")
@pytest.mark.parametrize(("spec", "counts", "narrowest", "head_dim", "dtype"), KIVI_ENCODE_CASES)
def test_emulated_kivi_encode_kernel_matches_reference(spec: str, counts, narrowest: int, head_dim: int,  # noqa: ANN001
                                                       dtype: mx.Dtype) -> None:
    """Every store entry of a chunk encoded in one launch equals the reference's (the operations of
    `quantize_key_blocks` and `quantize_value_groups` on the CPU): codes, 16-bit scales and biases, outlier indices;
    outlier residuals within one float16 step (the decoded entry they subtract may round once more or less)."""
    from engine.kvcache.kernels import kivi_encode

    if counts is not None:
        spec += f":key_widths={registered_width_table(counts, N_KV, seed=5, narrowest=narrowest)}"
    cache = KVCacheBuilder(KVCacheConfig.parse(spec)).for_shape(ModelShape(1, 2 * N_KV, N_KV, head_dim)).build()[0]
    keys, values = kivi_chunk(N_KV, 3 * cache.token_block, head_dim, dtype, seed=len(spec))
    cache._setup_from(keys, values)
    values = cache._values_in(values).astype(dtype)
    launches = []
    real = kivi_encode.kivi_encode
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.kvcache.methods.kivi.kivi_encode", lambda *a: launches.append(1) or real(*a))
        fused = cache._encode(keys, values)
    reference = _reference_of(cache)._encode(keys, values)
    assert launches == [1]
    assert list(fused) == list(reference)
    for name, ref in reference.items():
        got = fused[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        if "residuals" in name:
            step = mx.abs(ref.astype(mx.float32)) * 2**-10 + 2**-24
            assert bool(mx.all(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)) <= step)), name
        elif "clip_search" in spec:
            # the candidates' errors are summed in another order than MLX's: a near tie may go the other way
            assert float(mx.mean((got != ref).astype(mx.float32))) <= 1e-3, name
        else:
            assert bool(mx.array_equal(got, ref)), (name, float(mx.mean((got != ref).astype(mx.float32))))


def test_emulated_matrix_ops_multiply_bfloat16_tiles() -> None:
    """The dialect's warp matrix ops (MMA_*) on the emulator: a 16×K by K×(8·NW) product of tiles rounded to
    bfloat16, accumulated in float32, as CUDA's instruction computes it (to float rounding of the sum's order); each
    warp its own 8 columns."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 64), dtype=np.float32)
    b = rng.standard_normal((24, 64), dtype=np.float32)
    got = np.array(mma_gemm(mx.array(a), mx.array(b), EMULATE))
    rounded = [np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)) for x in (a, b)]
    want = rounded[0].astype(np.float64) @ rounded[1].astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - a.astype(np.float64) @ b.astype(np.float64).T).max() > 1e-3  # the tiles were rounded
