"""The Metal model (tests/metal_model.py) that checks every emulated launch's Metal text: it loads wherever the test
extras are installed, it refuses what Apple's compiler refuses in the ways the kernels could go wrong, and it takes
what MSL allows that OpenCL, whose front end it borrows, does not."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.kvcache.kernels import emulate
from engine.kvcache.kernels.backend import KernelSource
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
