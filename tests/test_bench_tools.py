"""The GPU profiling scripts' own logic, on the CPU: benchmarks/launch_count.py counts a recorded step's operations
by primitive from MLX's DOT export, benchmarks/update_profile.py splits a one-token update into its parts, and
benchmarks/gpu_timeline.py sums the GPU's kernel record per step, benchmarks/host_profile.py's stand-in kernels take the
GPU's kernel path on a CPU."""

from __future__ import annotations

import mlx.core as mx
import pytest

from benchmarks import decode, host_profile
from benchmarks.gpu_timeline import busy_time, idle_gaps, longest_kernels, short_name, summarize
from benchmarks.launch_count import count_operations, step_operations
from benchmarks.update_profile import profile


def test_operations_are_counted_by_primitive_from_the_dot_export(tmp_path) -> None:  # noqa: ANN001
    a = mx.ones((4, 4))
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), (a @ a + 1).sum(), a * 2)
    counts = count_operations(path.read_text())
    assert counts["Matmul"] == 1 and counts["Add"] == 1 and counts["Sum"] == 1 and counts["Multiply"] == 1
    assert "A" not in counts  # arrays are not operations


def test_a_step_of_the_tiny_model_holds_its_layers_attention_and_the_cache_updates() -> None:
    """The tiny shape's 2 layers (on the CPU, attention as MLX's composed ops: one softmax a layer): fp16 appends keys
    and values; affine:k4v4 quantizes the new token's keys and values and appends their codes, scales and biases."""
    shape = decode.SHAPES["tiny"]
    model = decode.build_model(shape)
    fp16 = step_operations("fp16", 40, shape, model)
    affine = step_operations("affine:k4v4:g64", 40, shape, model)
    layers = shape["layers"]
    assert fp16["Softmax"] == affine["Softmax"] == layers
    assert fp16["SliceUpdate"] == 2 * layers and "Quantize" not in fp16
    assert affine["Quantize"] == 2 * layers and affine["SliceUpdate"] == 6 * layers
    assert sum(affine.values()) > sum(fp16.values())


def test_update_profile_times_the_direct_encode_only_where_a_cache_has_it() -> None:
    """A window-less per-token cache has every part timed, its direct encode too; a KIVI cache (tokens wait in its
    16-bit window) has only the update and its transform; fp16 only the update."""
    shape = decode.SHAPES["tiny"]
    rows = {spec: profile(spec, 50, shape, repeats=1)
            for spec in ("fp16", "turboquant:k4v4:g64", "kivi:k4v4:g64:s4:key_block=128:rotate_values=true")}
    assert set(rows["fp16"]) == {"spec", "context", "update"}
    assert {"transform", "encode", "append", "incoming"} <= set(rows["turboquant:k4v4:g64"])
    assert rows["turboquant:k4v4:g64"]["arrays_appended"] == 4
    kivi = rows["kivi:k4v4:g64:s4:key_block=128:rotate_values=true"]
    assert "transform" in kivi and "encode" not in kivi


def test_gpu_busy_time_is_the_union_of_kernel_intervals() -> None:
    """Overlapping kernels (several streams) count once, gaps not at all, in any order of the record."""
    events = [("b", 5.0, 8.0), ("a", 0.0, 4.0), ("c", 3.0, 6.0), ("d", 10.0, 11.0)]
    assert busy_time(events) == 9.0  # [0, 8] and [10, 11]
    assert busy_time([]) == 0.0


def test_kernel_names_are_shortened_to_the_function_and_velox_kernels_to_their_source() -> None:
    assert short_name("void mlx::core::cu::qmv_kernel<__nv_bfloat16, 4, 64>(const float*, int)") == "qmv_kernel"
    assert short_name("custom_kernel_velox_decode_tiled_kivi_affine_128_4_bfloat16") == "velox_decode_tiled_kivi_affine"
    assert short_name("custom_kernel_velox_decode_merge") == "velox_decode_merge"
    assert short_name("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn") == "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn"


def test_a_timeline_summary_is_per_step_and_ranks_kernels_by_time() -> None:
    """Two steps of 10 ms wall each (20 ms host time in all): kernel time and calls are halved, idle is wall less
    busy, and the kernel with the most time comes first."""
    events = [("void mlx::core::cu::rms_norm<float>(float*)", 0.0, 1000.0),
              ("custom_kernel_velox_decode_merge", 1000.0, 1500.0),
              ("void mlx::core::cu::rms_norm<float>(float*)", 10000.0, 12000.0),
              ("custom_kernel_velox_decode_merge", 12000.0, 12500.0)]
    summary = summarize(events, steps=2, wall_s=0.020)
    assert summary["wall_ms"] == 10.0 and summary["busy_ms"] == 2.0 and summary["idle_ms"] == 8.0
    assert summary["kernels"] == 2.0
    assert list(summary["by_kernel"]) == ["rms_norm", "velox_decode_merge"]
    assert summary["by_kernel"]["rms_norm"] == {"calls": 1.0, "ms": 1.5}
    assert summary["gaps"] == [{"ms": 8.5, "at_ms": 1.5, "after": "velox_decode_merge", "before": "rms_norm"}]
    assert summary["longest"][0] == {"name": "rms_norm", "ms": 2.0, "at_ms": 10.0}
    assert summary["weights_busy_ms"] == 0.0 and summary["ratio_ceiling"] is None


def test_the_weights_busy_time_is_the_union_of_the_weight_matmuls_only() -> None:
    """Two weight matmuls overlapping each other count once, the attention kernel not at all: 3 ms of weights a
    step against 8 ms of wall time puts the ceiling at 8 / 3."""
    events = [("void mlx::core::cu::qmv_kernel<__nv_bfloat16, 4, 64>(const float*)", 0.0, 2000.0),
              ("void mlx::core::cu::qmv_kernel<__nv_bfloat16, 4, 64>(const float*)", 1000.0, 3000.0),
              ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop", 3000.0, 7000.0)]
    summary = summarize(events, steps=1, wall_s=0.008)
    assert summary["weights_busy_ms"] == 3.0 and summary["busy_ms"] == 7.0
    assert summary["ratio_ceiling"] == 8.0 / 3.0


def test_idle_gaps_are_measured_from_the_latest_end_so_far() -> None:
    """A kernel that ends inside a longer one opens no gap; the gap after both runs from the longer one's end; the
    longest gap comes first."""
    events = [("a", 0.0, 5000.0), ("b", 1000.0, 2000.0), ("c", 6000.0, 7000.0), ("d", 9000.0, 9500.0)]
    gaps = idle_gaps(events)
    assert [(g["ms"], g["after"], g["before"]) for g in gaps] == [(2.0, "c", "d"), (1.0, "a", "c")]
    assert gaps[0]["at_ms"] == 7.0 and idle_gaps([]) == [] and idle_gaps(events, top=1) == gaps[:1]
    assert [k["name"] for k in longest_kernels(events, top=2)] == ["a", "b"]


def test_kernel_phase_cuts_still_find_their_text_in_the_tiled_pass() -> None:
    """benchmarks/kernel_phases.py cuts parts out of the tiled pass by text; each text must occur exactly once in the
    body as it stands (its cuts went stale twice when the body changed, and the tool only failed on a GPU)."""
    from benchmarks.kernel_phases import VARIANTS, variant_body
    from engine.kvcache.kernels.decode import tiled_source

    body = tiled_source().body
    for name, cuts in VARIANTS:
        assert variant_body(body, cuts) != body or not cuts, name


def test_token_latency_counts_the_stalls_a_mean_hides() -> None:
    """decode.py's per-token record of mlx-lm's loop: 127 tokens of 10 ms and one of 60 ms average 10.4 ms, which a
    mean reports as a steady loop; the record names the stall and the 50 ms it added."""
    from benchmarks.decode import STALL_FACTOR, token_latency

    seconds = [0.010] * 127 + [0.060]
    latency = token_latency(seconds)
    assert latency["gen_token_ms_median"] == pytest.approx(10.0) and latency["gen_token_ms_max"] == pytest.approx(60.0)
    assert latency["gen_stalls"] == 1 and latency["gen_stall_ms"] == pytest.approx(50.0)
    assert "gen_stall_offsets" not in latency
    placed = token_latency(seconds, list(range(1000, 1128)))  # the stall is the last token, at cache length 1127
    assert placed["gen_stall_offsets"] == [1127] and placed["gen_stalls"] == 1
    edge = token_latency([0.010] * 9 + [0.010 * STALL_FACTOR])  # exactly the factor: not a stall
    assert edge["gen_stalls"] == 0 and edge["gen_stall_ms"] == 0.0
    assert token_latency([]) == {}
    # each token's peak memory rise (time_generate's): the median token's and the stall's, in MB
    peaked = token_latency(seconds, list(range(1000, 1128)), [2_000_000] * 127 + [300_000_000])
    assert peaked["gen_token_peak_mb_median"] == 2.0 and peaked["gen_stall_peak_mb"] == [300.0]


def test_stand_in_kernels_take_the_gpu_kernel_path_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """host_profile.py --stub-kernels: a KIVI cache on the CPU plans the CUDA decode kernels, and its attention is the
    stand-in merge's zeros (the reference path's output would not be); the module's switches are restored after."""
    from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape, kernel_check
    from engine.kvcache.kernels import backend

    for module, name in ((backend, "device_backend"), (backend, "build"), (kernel_check, "CHECKED_BACKENDS")):
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(backend, "_BUILT", {})
    host_profile.stub_kernels()
    shape = ModelShape(n_layers=1, n_heads=8, n_kv_heads=2, head_dim=64)
    (cache,) = KVCacheBuilder(KVCacheConfig.parse("kivi:k4v4:g64:s4:key_block=128")).for_shape(shape).build()
    keys = mx.random.normal((1, 2, 300, 64)).astype(mx.bfloat16)
    cache.update_and_fetch(keys, keys)
    cache.update_and_fetch(keys[..., :1, :], keys[..., :1, :])
    queries = mx.random.normal((1, 8, 1, 64)).astype(mx.bfloat16)
    assert cache._decode_plan(4) is not None
    output = cache.attention(queries, None, None, scale=0.125, mask=None)
    assert output.shape == queries.shape and not mx.any(output).item()
