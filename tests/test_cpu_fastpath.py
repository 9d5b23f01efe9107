"""The optional Linux CPU fast path: OpenBLAS behind MLX, and fp32 dequantization of mlx-lm models.

The BLAS switch is process-wide and must precede ``import mlx.core``, so everything that enables it runs
in a fresh subprocess; the subprocesses share one data dir so the shim is built and self-tested once.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from engine.runtime.cpu import fastpath as cpu_fastpath

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
from engine.runtime.cpu.fastpath import enable_fast_blas, prefer_fp32_weights
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
    from engine.runtime.cpu.fastpath import enable_fast_blas
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


# ---------------------------------------------------------------------------------------------------
# The cblas_sgemm dispatcher: one-row RowMajor products go to sgemv, everything else to sgemm.


def _openblas_or_skip() -> Path:
    openblas = cpu_fastpath._find_scipy_openblas32()
    if openblas is None:
        pytest.skip("scipy-openblas32 is not installed: the fast path cannot be enabled here")
    return openblas


# Calls the shim's cblas_sgemm on operands stored in either order, transposed or not, with leading
# dimensions larger than needed (the padding holds sentinels that must survive), against numpy in float64.
SGEMM_CASES_SCRIPT = """
import ctypes, json, sys
import numpy as np
shim = ctypes.CDLL(sys.argv[1])  # RTLD_LOCAL: the shim's DT_NEEDED brings OpenBLAS in
openblas = ctypes.CDLL(sys.argv[2])
ROW, COL, NO, T, CONJ_T = 101, 102, 111, 112, 113
rng = np.random.default_rng(17)
pointer = lambda array: array.ctypes.data_as(ctypes.c_void_p)

def stored(order, trans, rows, cols, pad):
    # Storage for an operand whose op() is rows x cols: (buffer, leading dimension, op() in float64).
    r, c = (rows, cols) if trans == NO else (cols, rows)
    if order == COL:
        r, c = c, r
    buffer = rng.standard_normal((r, c + pad)).astype(np.float32)
    matrix = buffer[:, :c] if order == ROW else buffer[:, :c].T
    return buffer, c + pad, (matrix if trans == NO else matrix.T).astype(np.float64)

def sgemm(order, trans_a, trans_b, m, n, k, alpha, beta, pads=(0, 0, 0), lda=None):
    a, default_lda, op_a = stored(order, trans_a, m, k, pads[0])
    b, ldb, op_b = stored(order, trans_b, k, n, pads[1])
    c, ldc, _ = stored(order, NO, m, n, pads[2])
    result = c[:, : c.shape[1] - pads[2]]
    if order == COL:
        result = result.T
    before = result.astype(np.float64)
    if beta == 0:
        result[...] = np.nan  # MLX's C is uninitialised when beta == 0
    padding = c[:, c.shape[1] - pads[2]:].copy()
    shim.cblas_sgemm(order, trans_a, trans_b, m, n, k, ctypes.c_float(alpha), pointer(a),
                     default_lda if lda is None else lda, pointer(b), ldb, ctypes.c_float(beta), pointer(c), ldc)
    expected = alpha * (op_a @ op_b) + beta * before
    error = float(np.max(np.abs(result - expected), initial=0.0))
    return {"error": error if np.all(np.isfinite(result)) else None,
            "padding_kept": bool(np.array_equal(c[:, c.shape[1] - pads[2]:], padding)),
            "untouched": bool(np.all(np.isnan(result)))}

CASES = {
    # name: (order, trans_a, trans_b, m, n, k, alpha, beta, pads); the first ones take the sgemv route
    "x @ W.T": (ROW, NO, T, 1, 1536, 576, 1.0, 0.0, (0, 0, 0)),
    "x @ W": (ROW, NO, NO, 1, 1536, 576, 1.0, 0.0, (0, 0, 0)),
    "x @ W.T, beta 0.5": (ROW, NO, T, 1, 300, 64, -0.5, 0.5, (0, 0, 0)),
    "x @ W, beta 0.5": (ROW, NO, NO, 1, 300, 64, 2.0, 0.5, (0, 0, 0)),
    "x @ W.T, padded": (ROW, NO, T, 1, 70, 33, 1.0, 0.0, (5, 7, 9)),
    "x @ W, padded": (ROW, NO, NO, 1, 70, 33, 1.0, 0.0, (5, 7, 9)),
    "x @ W.T, padded, beta 0.5": (ROW, NO, T, 1, 70, 33, 1.5, 0.5, (5, 7, 9)),
    "x @ W, padded, beta 1": (ROW, NO, NO, 1, 70, 33, 1.0, 1.0, (5, 7, 9)),
    "tall x @ W.T": (ROW, NO, T, 1, 49152, 64, 1.0, 0.0, (0, 0, 0)),
    "1x1 output": (ROW, NO, T, 1, 1, 9, 1.0, 0.0, (0, 0, 0)),
    # these must fall back to sgemm
    "two rows": (ROW, NO, T, 2, 300, 64, 1.0, 0.0, (3, 3, 3)),
    "one column": (ROW, NO, NO, 3, 1, 64, 1.0, 0.0, (0, 0, 2)),
    "column-major, one row": (COL, NO, T, 1, 300, 64, 1.0, 0.0, (2, 2, 2)),
    "column-major, one row, B not transposed": (COL, NO, NO, 1, 300, 64, 1.0, 0.5, (2, 2, 2)),
    "A transposed, one row": (ROW, T, T, 1, 300, 64, 1.0, 0.0, (2, 2, 2)),
    "B conjugate-transposed": (ROW, NO, CONJ_T, 1, 50, 20, 1.0, 0.0, (0, 0, 0)),
    "K = 0": (ROW, NO, T, 1, 20, 0, 1.0, 0.0, (1, 1, 0)),  # sgemm still sets C = beta * C
}
results = {}
for threads in (1, 2):
    openblas.scipy_openblas_set_num_threads(threads)
    for name, case in CASES.items():
        *arguments, pads = case
        results[f"{name}, {threads} thread(s)"] = sgemm(*arguments, pads=pads)
# Which routine ran: sgemm rejects lda = 0 (xerbla, C untouched), sgemv never reads lda.
routes = {
    name: "sgemv" if sgemm(*CASES[name][:-1], lda=0)["error"] is not None else
    "sgemm" if sgemm(*CASES[name][:-1], lda=0)["untouched"] else "?"
    for name in ("x @ W.T", "x @ W", "two rows", "column-major, one row", "A transposed, one row")
}
print(json.dumps({"results": results, "routes": routes}))
"""


@linux_x86_64_only
def test_shim_sgemm_dispatcher_matches_numpy_and_falls_back(tmp_path: Path) -> None:
    openblas = _openblas_or_skip()
    shim_path = tmp_path / "shim.so"
    shim = cpu_fastpath.build_forwarding_shim(str(openblas), cpu_fastpath.FORWARDED_CBLAS_SYMBOLS)
    shim_path.write_bytes(shim)
    result = run_python(SGEMM_CASES_SCRIPT, str(shim_path), str(openblas), data_dir=tmp_path)

    for name, outcome in result["results"].items():
        # None: a NaN or inf in the output, e.g. a NaN-filled C leaking through with beta == 0.
        assert outcome["error"] is not None and outcome["error"] < 1e-3, (name, outcome)
        assert outcome["padding_kept"], name
    assert result["routes"] == {
        "x @ W.T": "sgemv",
        "x @ W": "sgemv",
        "two rows": "sgemm",
        "column-major, one row": "sgemm",
        "A transposed, one row": "sgemm",
    }


@linux_x86_64_only
def test_one_row_sgemv_route_can_be_turned_off(tmp_path: Path) -> None:
    openblas = _openblas_or_skip()
    shim_path = tmp_path / "plain.so"
    plain = cpu_fastpath.build_forwarding_shim(
        str(openblas), cpu_fastpath.FORWARDED_CBLAS_SYMBOLS, dispatch_single_row_sgemm=False
    )
    shim_path.write_bytes(plain)
    result = run_python(SGEMM_CASES_SCRIPT, str(shim_path), str(openblas), data_dir=tmp_path)
    assert set(result["routes"].values()) == {"sgemm"}
    for outcome in result["results"].values():
        assert outcome["error"] is not None and outcome["error"] < 1e-3


def _elf_sections(image: bytes) -> dict[str, tuple[int, int]]:
    """{section name: (file offset, size)} of one of our shims (file offset == address)."""
    (section_offset,) = struct.unpack_from("<Q", image, 0x28)
    count, names_index = struct.unpack_from("<HH", image, 0x3C)
    headers = [struct.unpack_from("<IIQQQQIIQQ", image, section_offset + 64 * i) for i in range(count)]
    names_offset = headers[names_index][4]

    def name(offset: int) -> str:
        start = names_offset + offset
        return image[start : image.index(b"\0", start)].decode()

    return {name(header[0]): (header[4], header[5]) for header in headers}


def _dynamic_symbols(image: bytes) -> list[tuple[str, int, int]]:
    """[(name, value, size)] of the .dynsym table, the null symbol first."""
    sections = _elf_sections(image)
    (symbols_offset, symbols_size), (strings_offset, _) = sections[".dynsym"], sections[".dynstr"]
    symbols = []
    for offset in range(symbols_offset, symbols_offset + symbols_size, 24):
        name_offset, _, _, _, value, size = struct.unpack_from("<IBBHQQ", image, offset)
        start = strings_offset + name_offset
        symbols.append((image[start : image.index(b"\0", start)].decode(), value, size))
    return symbols


EXPORT_SETS = [cpu_fastpath.FORWARDED_CBLAS_SYMBOLS, ("cblas_sgemm",), ("cblas_dgemm",)]


@pytest.mark.parametrize("exported", EXPORT_SETS)
def test_shim_layout_has_one_got_slot_per_import_and_the_dispatcher(exported: tuple[str, ...]) -> None:
    image = cpu_fastpath.build_forwarding_shim("/opt/libopenblas.so", exported)
    symbols = _dynamic_symbols(image)
    sections = _elf_sections(image)
    imported = [name for name, value, _ in symbols[1:] if value == 0]
    defined = {name: (value, size) for name, value, size in symbols[1:] if value != 0}
    expected_imports = {"scipy_" + name for name in exported}
    if "cblas_sgemm" in exported:
        expected_imports.add("scipy_cblas_sgemv")  # the dispatcher's target, once even if also exported
    assert sorted(imported) == sorted(expected_imports)
    assert set(defined) == set(exported)

    # Each GLOB_DAT relocation fills one GOT slot with one imported symbol.
    rela_offset, rela_size = sections[".rela.dyn"]
    slot_of = {}
    for offset in range(rela_offset, rela_offset + rela_size, 24):
        slot, info, addend = struct.unpack_from("<QQq", image, offset)
        assert info & 0xFFFFFFFF == 6 and addend == 0  # R_X86_64_GLOB_DAT
        slot_of[symbols[info >> 32][0]] = slot
    got_offset, got_size = sections[".got"]
    assert sorted(slot_of.values()) == list(range(got_offset, got_offset + got_size, 8))

    def jump_target(address: int) -> str:
        """The imported symbol whose GOT slot a ``jmp *disp32(%rip)`` at ``address`` reads."""
        assert image[address : address + 2] == b"\xff\x25"
        (displacement,) = struct.unpack_from("<i", image, address + 2)
        return {slot: name for name, slot in slot_of.items()}[address + 6 + displacement]

    text_offset, text_size = sections[".text"]
    for name, (address, size) in defined.items():
        assert text_offset <= address and address + size <= text_offset + text_size
        if name == "cblas_sgemm":
            code = image[address : address + size]
            assert size == cpu_fastpath._program_size(cpu_fastpath._SGEMM_DISPATCHER)
            assert code.startswith(b"\x83\xff\x65")  # cmp $101, %edi
            # It ends with the two tail calls: sgemv for one row, else sgemm.
            assert jump_target(address + size - 12) == "scipy_cblas_sgemv"
            assert jump_target(address + size - 6) == "scipy_cblas_sgemm"
        else:
            assert size == 6 and jump_target(address) == "scipy_" + name
    # The read+execute segment covers .text; the writable one starts on a later page.
    (_, _, _, _, _, text_segment_size, _, _) = struct.unpack_from("<IIQQQQQQ", image, 64)
    assert text_segment_size >= text_offset + text_size
    assert sections[".dynamic"][0] % 0x1000 == 0 and sections[".dynamic"][0] >= text_segment_size


def test_dispatcher_short_jumps_land_on_their_labels() -> None:
    program = cpu_fastpath._SGEMM_DISPATCHER
    code = cpu_fastpath._assemble(program, 0x480, {"scipy_cblas_sgemv": 0x1000, "scipy_cblas_sgemm": 0x1008})
    assert len(code) == cpu_fastpath._program_size(program)
    position, labels, jumps = 0x480, {}, []
    for item, _ in program:
        if isinstance(item, cpu_fastpath._Label):
            labels[item.name] = position
        elif isinstance(item, cpu_fastpath._ShortJump):
            jumps.append((position, item.label))
        position += cpu_fastpath._instruction_size(item)
    assert {label for _, label in jumps} == {"sgemm", "sgemv", "b_is_n_by_k"}
    for address, label in jumps:
        displacement = struct.unpack_from("<b", code, address - 0x480 + 1)[0]
        assert address + 2 + displacement == labels[label]


def test_shim_cache_name_changes_with_the_generated_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path))
    library = tmp_path / "libfake.so"
    library.write_bytes(b"\0")
    first = cpu_fastpath._shim_cache_path(library)
    assert first == cpu_fastpath._shim_cache_path(library)
    original = cpu_fastpath.build_forwarding_shim
    monkeypatch.setattr(cpu_fastpath, "build_forwarding_shim", lambda *args: original(*args) + b"\0")
    assert cpu_fastpath._shim_cache_path(library) != first


@linux_x86_64_only
def test_one_row_products_through_mlx_match_numpy(shared_data_dir: Path) -> None:
    _openblas_or_skip()
    script = """
    import json
    import numpy as np
    from engine.runtime.cpu.fastpath import enable_fast_blas
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
    from engine.runtime.cpu.fastpath import enable_fast_blas, prefer_fp32_weights
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
    from engine.runtime.cpu.fastpath import enable_fast_blas, fast_blas_status
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
    # A generator that writes garbage (a planted file is simply rewritten: tests/hostile/test_native_shim.py):
    # the self-test must reject what it produced.
    script = """
    import json
    from pathlib import Path
    from engine.runtime.cpu import fastpath as cpu_fastpath
    cpu_fastpath.build_forwarding_shim = lambda *arguments: b"not an ELF file"
    path = cpu_fastpath._shim_cache_path(cpu_fastpath._find_scipy_openblas32())
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
    linear_class, embedding_class = cpu_fastpath._transposed_classes()
    assert isinstance(converted.model.embed_tokens, embedding_class)
    assert isinstance(converted.model.layers[0].mlp.down_proj, linear_class)
    if not tie_word_embeddings:
        assert isinstance(converted.lm_head, linear_class)
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
    assert type(converted).__name__ == "TransposedLinear"
    assert converted.weight_t.shape == (64, 48)  # stored transposed: [input dims, output dims]
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


def test_transposed_layers_equal_plain_products_for_one_and_many_rows():
    """Weights stored transposed (fast one-token products): the same numbers as nn.Linear/nn.Embedding."""
    code = (
        "from engine.runtime.cpu.fastpath import enable_fast_blas, _transposed_classes\n"
        "enable_fast_blas()\n"
        "import mlx.core as mx\n"
        "Linear, Embedding = _transposed_classes()\n"
        "w = mx.random.normal((1536, 576)); b = mx.random.normal((1536,))\n"
        "layer = Linear(mx.contiguous(w.T), b)\n"
        "for rows in (1, 9, 300):\n"
        "    x = mx.random.normal((1, rows, 576))\n"
        "    assert mx.allclose(layer(x), x @ w.T + b, atol=1e-4).item(), rows\n"
        "assert mx.array_equal(layer.weight, w).item()\n"
        "table = mx.random.normal((5000, 64))\n"
        "emb = Embedding(mx.contiguous(table.T))\n"
        "ids = mx.array([[0, 4999, 17, 17]])\n"
        "assert mx.array_equal(emb(ids), table[ids]).item()\n"
        "for rows in (1, 40):\n"
        "    h = mx.random.normal((1, rows, 64))\n"
        "    assert mx.allclose(emb.as_linear(h), h @ table.T, atol=1e-4).item(), rows\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
