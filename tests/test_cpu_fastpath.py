"""The optional Linux CPU fast path: OpenBLAS behind MLX, and fp32 dequantization of mlx-lm models.

The BLAS switch is process-wide and must precede ``import mlx.core``, so everything that enables it runs
in a fresh subprocess; the subprocesses share one data dir so the shim is built and self-tested once.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from engine import cpu_fastpath

REPO_ROOT = Path(__file__).resolve().parent.parent
linux_x86_64_only = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the OpenBLAS shim is a Linux x86-64 feature",
)

# Inputs shared by the stock and fast subprocesses: nn.Linear-style x @ W.T (decode and prefill
# shapes), a plain product, a batched one and a float64 one (cblas_dgemm goes through the shim too).
MATMUL_SCRIPT = """
import json, sys, time
import numpy as np
from engine.cpu_fastpath import enable_fast_blas, prefer_fp32_weights
status = enable_fast_blas() if sys.argv[1] == "fast" else None
import mlx.core as mx
mx.set_default_device(mx.cpu)
rng = np.random.default_rng(1234)
results = {}
for m, k, n in [(1, 576, 1536), (7, 64, 33), (300, 576, 192)]:
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    results[f"linear{m}x{k}x{n}"] = np.array(mx.array(x) @ mx.array(w).T)
a = rng.standard_normal((3, 40, 50)).astype(np.float32)
b = rng.standard_normal((3, 50, 20)).astype(np.float32)
results["batched"] = np.array(mx.matmul(mx.array(a), mx.array(b)))
d1, d2 = rng.standard_normal((20, 30)), rng.standard_normal((30, 10))
results["float64"] = np.array(mx.matmul(mx.array(d1, dtype=mx.float64), mx.array(d2, dtype=mx.float64)))
np.savez(sys.argv[2], **results)
big_a, big_b = mx.random.normal((768, 768)), mx.random.normal((768, 768))
mx.eval(big_a, big_b, big_a @ big_b)
timings = []
for _ in range(3):
    start = time.perf_counter()
    mx.eval(big_a @ big_b)
    timings.append(time.perf_counter() - start)
print(json.dumps({
    "enabled": status.enabled if status else False,
    "threads": status.threads if status else None,
    "reason": status.reason if status else "",
    "prefer_fp32": prefer_fp32_weights(),
    "gemm_seconds": min(timings),
}))
"""


def run_python(script: str, *arguments: str, data_dir: Path, extra_env: dict[str, str] | None = None) -> dict:
    """Run ``script`` in a fresh interpreter from the repo root; it must print one JSON line last."""
    environment = {**os.environ, "VELOX_DATA_DIR": str(data_dir), "PYTHONPATH": str(REPO_ROOT)}
    # The thread-count variables would override the counts the tests check.
    for name in (cpu_fastpath.ENV_SWITCH, cpu_fastpath.ENV_THREADS, "OPENBLAS_NUM_THREADS"):
        environment.pop(name, None)
    environment.update(extra_env or {})
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *arguments],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=environment,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def shared_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fastpath-data")


@linux_x86_64_only
def test_fast_matmul_matches_stock_and_is_faster(shared_data_dir: Path, tmp_path: Path) -> None:
    stock = run_python(MATMUL_SCRIPT, "stock", str(tmp_path / "stock.npz"), data_dir=shared_data_dir)
    fast = run_python(MATMUL_SCRIPT, "fast", str(tmp_path / "fast.npz"), data_dir=shared_data_dir)

    assert fast["enabled"], fast["reason"]
    assert "OpenBLAS" in fast["reason"]
    assert fast["threads"] == cpu_fastpath.default_blas_threads(len(os.sched_getaffinity(0)))
    assert fast["prefer_fp32"] is True
    assert stock["prefer_fp32"] is False
    stock_results, fast_results = np.load(tmp_path / "stock.npz"), np.load(tmp_path / "fast.npz")
    assert sorted(stock_results.files) == sorted(fast_results.files)
    for name in stock_results.files:
        tolerance = 1e-10 if name == "float64" else 2e-4
        np.testing.assert_allclose(fast_results[name], stock_results[name], rtol=tolerance, atol=tolerance)
    # The reference BLAS runs a 768^3 GEMM at a few GFLOP/s, OpenBLAS at tens: 3x is a loose floor.
    assert fast["gemm_seconds"] * 3 < stock["gemm_seconds"], (fast, stock)


@linux_x86_64_only
def test_libmlx_binds_its_blas_symbols_to_the_shim(shared_data_dir: Path) -> None:
    script = """
    import ctypes, json, sys
    from engine.cpu_fastpath import enable_fast_blas
    status = enable_fast_blas()
    import mlx.core as mx
    mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
    scope = ctypes.CDLL(None)
    shim = ctypes.CDLL(status.shim_path)
    address = lambda library, name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    from pathlib import Path
    import mlx.core
    libmlx = str(Path(mlx.core.__file__).parent / "lib" / "libmlx.so")
    print(json.dumps({
        "enabled": status.enabled,
        "threads": status.threads,
        "libmlx": libmlx,
        "same": {n: address(scope, n) == address(shim, n) for n in ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")},
    }))
    """
    result = run_python(script, data_dir=shared_data_dir, extra_env={cpu_fastpath.ENV_THREADS: "3"})
    assert result["enabled"]
    assert result["threads"] == 3  # the override reached OpenBLAS (it reports the count it now uses)
    assert all(result["same"].values()), result["same"]

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed: cannot list libmlx.so's imports")
    undefined = subprocess.run(
        [nm, "-D", "--undefined-only", result["libmlx"]], capture_output=True, text=True, check=True
    ).stdout.split()
    imported_cblas = {symbol.split("@")[0] for symbol in undefined if symbol.startswith("cblas_")}
    assert imported_cblas, "libmlx.so no longer imports any cblas_ symbol"
    # Every CBLAS routine MLX calls must be forwarded, or that routine would still hit the reference BLAS.
    assert imported_cblas <= set(cpu_fastpath.FORWARDED_CBLAS_SYMBOLS)


@linux_x86_64_only
def test_generated_shim_forwards_cblas_sgemm_to_openblas(tmp_path: Path) -> None:
    openblas = cpu_fastpath._find_scipy_openblas32()
    assert openblas is not None, "scipy-openblas32 is a Linux dependency of Velox"
    shim_path = tmp_path / "shim.so"
    shim_path.write_bytes(cpu_fastpath.build_forwarding_shim(str(openblas), ("cblas_sgemm",)))
    # Call the shim directly (no MLX) in a child process: a malformed ELF would crash only the child.
    script = """
    import ctypes, json, sys
    import numpy as np
    shim = ctypes.CDLL(sys.argv[1])  # RTLD_LOCAL: DT_NEEDED must bring OpenBLAS in by itself
    rng = np.random.default_rng(5)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal((7, 3)).astype(np.float32)
    c = np.zeros((5, 3), dtype=np.float32)
    pointer = lambda array: array.ctypes.data_as(ctypes.c_void_p)
    row_major, no_transpose = 101, 111
    shim.cblas_sgemm(row_major, no_transpose, no_transpose, 5, 3, 7, ctypes.c_float(1.0), pointer(a), 7,
                     pointer(b), 3, ctypes.c_float(0.0), pointer(c), 3)
    print(json.dumps({"max_error": float(np.max(np.abs(c - a.astype(np.float64) @ b)))}))
    """
    result = run_python(script, str(shim_path), data_dir=tmp_path)
    assert result["max_error"] < 1e-5


@linux_x86_64_only
def test_env_switch_disables_the_fast_path(shared_data_dir: Path) -> None:
    script = """
    import json
    from engine.cpu_fastpath import enable_fast_blas, prefer_fp32_weights
    status = enable_fast_blas()
    import mlx.core as mx
    value = (mx.array([[1.0, 2.0]]) @ mx.array([[3.0], [4.0]])).item()
    print(json.dumps({"enabled": status.enabled, "reason": status.reason, "value": value,
                      "prefer_fp32": prefer_fp32_weights()}))
    """
    result = run_python(script, data_dir=shared_data_dir, extra_env={cpu_fastpath.ENV_SWITCH: "0"})
    assert result["enabled"] is False
    assert cpu_fastpath.ENV_SWITCH in result["reason"]
    assert result["prefer_fp32"] is False
    assert result["value"] == 11.0


@linux_x86_64_only
def test_too_late_after_mlx_import_is_reported_not_applied(shared_data_dir: Path) -> None:
    script = """
    import json
    import mlx.core as mx
    from engine.cpu_fastpath import enable_fast_blas, fast_blas_status
    first, second = enable_fast_blas(), enable_fast_blas()
    print(json.dumps({"enabled": first.enabled, "reason": first.reason, "same": first is second,
                      "recorded": fast_blas_status() is first}))
    """
    result = run_python(script, data_dir=shared_data_dir)
    assert result["enabled"] is False
    assert "before" in result["reason"] and "mlx.core" in result["reason"]
    assert result["same"] and result["recorded"]


@linux_x86_64_only
def test_broken_cached_shim_falls_back_to_stock(tmp_path: Path) -> None:
    openblas = cpu_fastpath._find_scipy_openblas32()
    assert openblas is not None
    # Plant garbage where the shim is cached (and no .verified marker): the self-test must reject it.
    script = """
    import json
    from pathlib import Path
    from engine import cpu_fastpath
    path = cpu_fastpath._shim_cache_path(cpu_fastpath._find_scipy_openblas32())
    path.write_bytes(b"not an ELF file")
    status = cpu_fastpath.enable_fast_blas()
    import mlx.core as mx
    value = (mx.array([[1.0, 2.0]]) @ mx.array([[3.0], [4.0]])).item()
    print(json.dumps({"enabled": status.enabled, "reason": status.reason, "value": value,
                      "verified": path.with_suffix(".verified").exists()}))
    """
    result = run_python(script, data_dir=tmp_path)
    assert result["enabled"] is False
    assert "self-test" in result["reason"]
    assert result["verified"] is False
    assert result["value"] == 11.0


def test_default_thread_count_leaves_half_the_cores_free() -> None:
    assert [cpu_fastpath.default_blas_threads(cores) for cores in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 8, 8]


def test_not_linux_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_fastpath.sys, "platform", "darwin")
    status = cpu_fastpath._enable()
    assert status.enabled is False
    assert "Not Linux" in status.reason
    assert status.shim_path is None


def test_sysv_hash_matches_the_abi_reference_values() -> None:
    # Reference values computed with the System V ABI's C routine (as in glibc's _dl_elf_hash).
    assert cpu_fastpath._sysv_elf_hash(b"") == 0
    assert cpu_fastpath._sysv_elf_hash(b"printf") == 0x077905A6
    assert cpu_fastpath._sysv_elf_hash(b"cblas_sgemm") == 0x09004ABD
    # A long name exercises the folding of the high nibble.
    assert cpu_fastpath._sysv_elf_hash(b"scipy_cblas_zgemm") == 0x0850EACD


# ---------------------------------------------------------------------------------------------------
# dequantize_model_to_fp32


def _tiny_llama(tie_word_embeddings: bool):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
        tie_word_embeddings=tie_word_embeddings,
    )
    mx.random.seed(3)
    model = llama.Model(args)
    # Like a converted checkpoint: fp16 weights, then 4-bit affine quantization with fp16 scales.
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model, args


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_dequantized_model_matches_quantized_model_in_fp32(tie_word_embeddings: bool) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    quantized, args = _tiny_llama(tie_word_embeddings)
    assert isinstance(quantized.model.embed_tokens, nn.QuantizedEmbedding)
    # The reference: the same quantized weights, run with fp32 activations (scales upcast to fp32).
    reference = llama.Model(args)
    nn.quantize(reference, group_size=32, bits=4)
    reference.update(quantized.parameters())
    reference.set_dtype(mx.float32)
    # The model under test gets its own copy of the parameters, then is converted.
    converted = llama.Model(args)
    nn.quantize(converted, group_size=32, bits=4)
    converted.update(quantized.parameters())
    returned = cpu_fastpath.dequantize_model_to_fp32(converted)
    assert returned is converted

    modules = [module for _, module in converted.named_modules()]
    assert not any(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for m in modules)
    assert isinstance(converted.model.embed_tokens, nn.Embedding)
    assert isinstance(converted.model.layers[0].mlp.down_proj, nn.Linear)
    if not tie_word_embeddings:
        assert isinstance(converted.lm_head, nn.Linear)
    assert {value.dtype for _, value in tree_flatten(converted.parameters())} == {mx.float32}

    tokens = mx.array([[5, 17, 200, 3, 99, 42, 7, 255]])
    expected = reference(tokens)
    actual = converted(tokens)
    assert actual.dtype == mx.float32 and expected.dtype == mx.float32
    assert actual.shape == (1, 8, 256)
    np.testing.assert_allclose(np.array(actual), np.array(expected), rtol=1e-4, atol=1e-4)


def test_dequantized_weights_are_exactly_what_quantized_matmul_uses() -> None:
    import mlx.core as mx
    import mlx.nn as nn

    mx.random.seed(11)
    float_layer = nn.Linear(64, 48, bias=True)
    float_layer.set_dtype(mx.float16)
    layer = nn.QuantizedLinear.from_linear(float_layer, 32, 4)
    model = nn.Sequential(layer)
    inputs = mx.random.normal((3, 64))
    # Multiplying by the identity makes quantized_matmul return its (transposed) effective weight.
    effective_weight = mx.quantized_matmul(
        mx.eye(64),
        layer.weight,
        layer.scales.astype(mx.float32),
        layer.biases.astype(mx.float32),
        transpose=True,
        group_size=32,
        bits=4,
    ).T
    bias = layer.bias.astype(mx.float32)
    cpu_fastpath.dequantize_model_to_fp32(model)
    converted = model.layers[0]
    assert isinstance(converted, nn.Linear)
    assert mx.array_equal(converted.weight, effective_weight)
    assert mx.array_equal(converted.bias, bias)
    np.testing.assert_allclose(
        np.array(converted(inputs)), np.array(inputs @ effective_weight.T + bias), rtol=1e-5, atol=1e-5
    )


def test_prefer_fp32_weights_is_false_without_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_fastpath, "_status", cpu_fastpath.FastBlasStatus(False, "off for the test"))
    assert cpu_fastpath.prefer_fp32_weights() is False
    monkeypatch.setattr(cpu_fastpath, "_status", None)
    assert cpu_fastpath.prefer_fp32_weights() is False


def test_row_chunked_matvec_equals_the_single_product():
    """One-token products with wide weights go through row slices (faster in OpenBLAS); same numbers."""
    code = (
        "from engine.cpu_fastpath import enable_fast_blas, _row_chunked_classes\n"
        "enable_fast_blas()\n"
        "import mlx.core as mx\n"
        "Linear, Embedding = _row_chunked_classes()\n"
        "layer = Linear(576, 1536, bias=True)\n"
        "x = mx.random.normal((1, 1, 576))\n"
        "ref = x @ layer.weight.T + layer.bias\n"
        "assert mx.allclose(layer(x), ref, atol=1e-4).item()\n"
        "emb = Embedding(5000, 64)\n"
        "h = mx.random.normal((1, 1, 64))\n"
        "assert mx.allclose(emb.as_linear(h), h @ emb.weight.T, atol=1e-4).item()\n"
        "many = mx.random.normal((1, 9, 576))\n"
        "assert mx.allclose(layer(many), many @ layer.weight.T + layer.bias, atol=1e-4).item()\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
