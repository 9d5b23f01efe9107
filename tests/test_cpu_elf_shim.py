"""The forwarding shim's bytes (engine.runtime.cpu.elf_shim): ELF layout, the hand-assembled sgemm
dispatcher, and, in child processes (a malformed ELF crashes only the child), calls through it."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest

from engine.runtime.cpu import blas, elf_shim
from tests.fastpath_helpers import linux_x86_64_only, openblas_or_skip, run_python


@linux_x86_64_only
def test_generated_shim_forwards_cblas_sgemm_to_openblas(tmp_path: Path) -> None:
    openblas = blas._find_scipy_openblas32()
    assert openblas is not None, "scipy-openblas32 is a Linux dependency of Velox"
    shim_path = tmp_path / "shim.so"
    shim_path.write_bytes(elf_shim.build_forwarding_shim(str(openblas), ("cblas_sgemm",)))
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
    openblas = openblas_or_skip()
    shim_path = tmp_path / "shim.so"
    shim = elf_shim.build_forwarding_shim(str(openblas), blas.FORWARDED_CBLAS_SYMBOLS)
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
    openblas = openblas_or_skip()
    shim_path = tmp_path / "plain.so"
    plain = elf_shim.build_forwarding_shim(
        str(openblas), blas.FORWARDED_CBLAS_SYMBOLS, dispatch_single_row_sgemm=False
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


EXPORT_SETS = [blas.FORWARDED_CBLAS_SYMBOLS, ("cblas_sgemm",), ("cblas_dgemm",)]


@pytest.mark.parametrize("exported", EXPORT_SETS)
def test_shim_layout_has_one_got_slot_per_import_and_the_dispatcher(exported: tuple[str, ...]) -> None:
    image = elf_shim.build_forwarding_shim("/opt/libopenblas.so", exported)
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
            assert size == elf_shim._program_size(elf_shim._SGEMM_DISPATCHER)
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
    program = elf_shim._SGEMM_DISPATCHER
    code = elf_shim._assemble(program, 0x480, {"scipy_cblas_sgemv": 0x1000, "scipy_cblas_sgemm": 0x1008})
    assert len(code) == elf_shim._program_size(program)
    position, labels, jumps = 0x480, {}, []
    for item, _ in program:
        if isinstance(item, elf_shim._Label):
            labels[item.name] = position
        elif isinstance(item, elf_shim._ShortJump):
            jumps.append((position, item.label))
        position += elf_shim._instruction_size(item)
    assert {label for _, label in jumps} == {"sgemm", "sgemv", "b_is_n_by_k"}
    for address, label in jumps:
        displacement = struct.unpack_from("<b", code, address - 0x480 + 1)[0]
        assert address + 2 + displacement == labels[label]



def test_sysv_hash_matches_the_abi_reference_values() -> None:
    # Reference values computed with the System V ABI's C routine (as in glibc's _dl_elf_hash).
    assert elf_shim._sysv_elf_hash(b"") == 0
    assert elf_shim._sysv_elf_hash(b"printf") == 0x077905A6
    assert elf_shim._sysv_elf_hash(b"cblas_sgemm") == 0x09004ABD
    # A long name exercises the folding of the high nibble.
    assert elf_shim._sysv_elf_hash(b"scipy_cblas_zgemm") == 0x0850EACD



# sha256 of the shim for "/opt/libopenblas.so" and every forwarded name, with and without the one-row
# dispatcher, as generated before the split of engine/runtime/cpu/fastpath.py (format version 2).
PINNED_SHIM_SHA256 = {
    True: "7a5c3caf099d6bcdde5c7c8dd9427d48a73cc055a11b961757e55f30fbd6ae29",
    False: "e4ce794c52df408f134837751899faa4df96cf58bfabd441de8fb34651e61fc9",
}


@pytest.mark.parametrize("dispatch", [True, False])
def test_generated_bytes_change_only_with_the_format_version(dispatch: bool) -> None:
    """A refactoring must not change a single byte; a deliberate change updates the pin and bumps
    blas._SHIM_FORMAT_VERSION, so cached shims from the old generator are not reused."""
    image = elf_shim.build_forwarding_shim(
        "/opt/libopenblas.so", blas.FORWARDED_CBLAS_SYMBOLS, dispatch_single_row_sgemm=dispatch
    )
    assert (hashlib.sha256(image).hexdigest(), blas._SHIM_FORMAT_VERSION) == (PINNED_SHIM_SHA256[dispatch], 2)
