"""The CPU fast path's BLAS routing (engine.runtime.cpu.blas): OpenBLAS behind MLX through the cached shim.

The BLAS switch is process-wide and must precede ``import mlx.core``; `import engine` makes it, so
everything that checks it runs in a fresh subprocess; the subprocesses share one data dir so the shim is
built and self-tested once.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.runtime.cpu import blas
from tests.fastpath_helpers import linux_x86_64_only, openblas_or_skip, run_python

# Inputs shared by the stock and fast subprocesses: nn.Linear-style x @ W.T (decode and prefill
# shapes), a plain product, a batched one and a float64 one (cblas_dgemm goes through the shim too).
MATMUL_SCRIPT = """
import json, sys, time
import numpy as np
from engine.runtime.cpu.blas import fast_blas_status
from engine.runtime.cpu.weights import prefer_fp32_weights
status = fast_blas_status()  # `import engine` enabled the fast path, unless VELOX_FAST_BLAS=0
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
    "enabled": status.enabled,
    "threads": status.threads,
    "reason": status.reason,
    "prefer_fp32": prefer_fp32_weights(),
    "gemm_seconds": min(timings),
}))
"""



@pytest.fixture(scope="module")
def shared_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fastpath-data")


@linux_x86_64_only
def test_fast_matmul_matches_stock_and_is_faster(shared_data_dir: Path, tmp_path: Path) -> None:
    stock = run_python(MATMUL_SCRIPT, "stock", str(tmp_path / "stock.npz"), data_dir=shared_data_dir,
                       extra_env={blas.ENV_SWITCH: "0"})
    fast = run_python(MATMUL_SCRIPT, "fast", str(tmp_path / "fast.npz"), data_dir=shared_data_dir)

    assert fast["enabled"], fast["reason"]
    assert "OpenBLAS" in fast["reason"]
    assert fast["threads"] == blas.default_blas_threads(len(os.sched_getaffinity(0)))
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
    from engine.runtime.cpu.blas import enable_fast_blas
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
    result = run_python(script, data_dir=shared_data_dir, extra_env={blas.ENV_THREADS: "3"})
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
    assert imported_cblas <= set(blas.FORWARDED_CBLAS_SYMBOLS)



def test_shim_cache_name_changes_with_the_generated_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path))
    library = tmp_path / "libfake.so"
    library.write_bytes(b"\0")
    first = blas._shim_cache_path(library)
    assert first == blas._shim_cache_path(library)
    original = blas.build_forwarding_shim
    monkeypatch.setattr(blas, "build_forwarding_shim", lambda *args: original(*args) + b"\0")
    assert blas._shim_cache_path(library) != first



@linux_x86_64_only
def test_one_row_products_through_mlx_match_numpy(shared_data_dir: Path) -> None:
    openblas_or_skip()
    script = """
    import json
    import numpy as np
    from engine.runtime.cpu.blas import enable_fast_blas
    status = enable_fast_blas()
    import mlx.core as mx
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(99)
    errors = {}
    for k, n in [(576, 1536), (1536, 576), (576, 576), (64, 49152), (7, 1)]:
        x = rng.standard_normal((1, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32)
        expected = x.astype(np.float64) @ w.T.astype(np.float64)
        products = {
            "x @ W.T": mx.array(x) @ mx.array(w).T,
            "x @ W": mx.array(x) @ mx.array(np.ascontiguousarray(w.T)),
            "x[1,1,K] @ W.T": (mx.array(x).reshape(1, 1, k) @ mx.array(w).T).reshape(1, n),
            "addmm (beta 1)": mx.addmm(mx.array(bias), mx.array(x), mx.array(w).T) - mx.array(bias),
        }
        for name, product in products.items():
            errors[f"{name} {k}x{n}"] = float(np.max(np.abs(np.array(product) - expected)))
    print(json.dumps({"enabled": status.enabled, "reason": status.reason, "errors": errors}))
    """
    result = run_python(script, data_dir=shared_data_dir)
    assert result["enabled"], result["reason"]
    for name, error in result["errors"].items():
        assert error < 1e-3, (name, error)  # NaN fails too


@linux_x86_64_only
def test_env_switch_disables_the_fast_path(shared_data_dir: Path) -> None:
    script = """
    import json
    from engine.runtime.cpu.blas import enable_fast_blas
    from engine.runtime.cpu.weights import prefer_fp32_weights
    status = enable_fast_blas()
    import mlx.core as mx
    value = (mx.array([[1.0, 2.0]]) @ mx.array([[3.0], [4.0]])).item()
    print(json.dumps({"enabled": status.enabled, "reason": status.reason, "value": value,
                      "prefer_fp32": prefer_fp32_weights()}))
    """
    result = run_python(script, data_dir=shared_data_dir, extra_env={blas.ENV_SWITCH: "0"})
    assert result["enabled"] is False
    assert blas.ENV_SWITCH in result["reason"]
    assert result["prefer_fp32"] is False
    assert result["value"] == 11.0


@linux_x86_64_only
def test_too_late_after_mlx_import_is_reported_not_applied(shared_data_dir: Path) -> None:
    script = """
    import json
    import mlx.core as mx
    from engine.runtime.cpu.blas import enable_fast_blas, fast_blas_status
    first, second = enable_fast_blas(), enable_fast_blas()
    print(json.dumps({"enabled": first.enabled, "reason": first.reason, "same": first is second,
                      "recorded": fast_blas_status() is first}))
    """
    result = run_python(script, data_dir=shared_data_dir)
    assert result["enabled"] is False
    assert "before" in result["reason"] and "mlx.core" in result["reason"]
    assert result["same"] and result["recorded"]


@linux_x86_64_only
def test_garbage_in_the_shim_cache_is_rewritten_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    openblas = openblas_or_skip()
    # Plant garbage where the shim is cached, before the child's `import engine` runs the bootstrap: the
    # byte check replaces it with freshly generated bytes, which pass the self-test. The cache key is the
    # same in both interpreters.
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path))
    path = blas._shim_cache_path(openblas)
    path.write_bytes(b"not an ELF file")
    script = """
    import json
    import engine
    from engine.runtime.cpu.blas import fast_blas_status
    status = fast_blas_status()
    import mlx.core as mx
    value = (mx.array([[1.0, 2.0]]) @ mx.array([[3.0], [4.0]])).item()
    print(json.dumps({"enabled": status.enabled, "reason": status.reason, "value": value}))
    """
    result = run_python(script, data_dir=tmp_path)
    assert result["enabled"] is True, result["reason"]
    assert path.read_bytes().startswith(b"\x7fELF")
    assert path.with_suffix(".verified").exists()
    assert result["value"] == 11.0


@pytest.mark.parametrize("first_import", ["engine.kvcache.base", "engine.planning.recommend", "app.store"])
def test_whichever_module_is_imported_first_the_runtime_is_prepared_before_mlx(
    shared_data_dir: Path, first_import: str
) -> None:
    """Every engine module imports mlx at the top; `engine/__init__` runs the bootstrap before any of them."""
    script = f"""
    import json, sys
    import {first_import}
    from engine.runtime.cpu.blas import fast_blas_status
    status = fast_blas_status()
    print(json.dumps({{"decided": status is not None, "reason": status.reason if status else "",
                      "enabled": bool(status and status.enabled), "mlx_loaded": "mlx.core" in sys.modules}}))
    """
    result = run_python(script, data_dir=shared_data_dir)
    assert result["decided"] and "imported before" not in result["reason"], result
    if sys.platform == "linux" and platform.machine() == "x86_64" and blas._find_scipy_openblas32() is not None:
        assert result["enabled"], result["reason"]


def test_default_thread_count_leaves_half_the_cores_free() -> None:
    assert [blas.default_blas_threads(cores) for cores in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 8, 8]


def test_not_linux_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    status = blas._enable()
    assert status.enabled is False
    assert "Not Linux" in status.reason
    assert status.shim_path is None

