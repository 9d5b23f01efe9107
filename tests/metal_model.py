"""Does a kernel's Metal text compile? A model of MLX's Metal front end and of MSL's typing, checked on Linux.

conftest.py adds `check_launch` to the kernel emulator's launch checks (`emulate.LAUNCH_CHECKS`) wherever libclang
loads, which the test extras make everywhere the suite runs: every launch an emulator test makes is checked.

No Metal compiler runs off a Mac, and every kernel here runs on a Mac as Metal by construction (backend.py), so a
Metal-only spelling error would first show on a user's machine, at the first decode step. This checks each launch's
Metal translation unit with clang's front end (libclang, the `libclang` wheel), as MLX's `mx.fast.metal_kernel` would
build it for that launch (mlx/backend/common/metal_kernel.cpp, `write_signature`):

- every input `const constant T*` if it holds fewer than 8 elements and `const device T*` otherwise (`&` for a
  0-dimensional one), a `const constant int* <name>_shape` after an input whose shape the body names, outputs
  `device T*`, then each thread-position attribute the source names; template arguments as constants;
- the dtypes spelled as MLX's `get_type_string` spells them (`bfloat16_t`, `float16_t`, `uint32_t`, ...);
- the text MLX receives: `backend.assemble(..., "metal")` after `backend.compact`.

clang parses it as C++ for OpenCL, whose address spaces follow MSL's rules where the bodies use them: a pointer into
one named space (device = __global, constant = __constant, threadgroup = __local, thread = __private) never converts
to another without a cast, so a small input (constant) handed to a helper that takes device memory, or threadgroup
memory handed where a thread's pointer is expected, fails here as it fails on a Mac. The MSL library the bodies use
(`_SHIM`) is declared with MSL's signatures, in a conservative subset: `metal::max`/`min` take two values of one
type, `simd_shuffle_xor` takes 32-bit or narrower scalars only, `as_type` converts between types of one size.

Two of OpenCL's own rules are not MSL's and are left out: OpenCL declares threadgroup (__local) variables only in a
kernel's outermost block, MSL in any block of a kernel (MLX's own sort and column-reduce kernels do), and OpenCL's
unqualified pointers are generic, where MSL's are the thread's; so a pointer declared without a space is refused here
outright (the bodies spell every pointer's space: GLOBAL, SHARED, THREAD).

What this cannot see: Apple's compiler's own limits and code generation, threadgroup memory beyond a GPU's limit
(decode.py plans within 32 KB for Metal), and behaviour, which only a Mac's GPU parity tests show.
"""

from __future__ import annotations

import atexit
import re
import threading
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine.kvcache.kernels.backend import (
    KernelSource,
    buffer_arguments,
    compact,
    over_buffer_limit,
    template_constants,
)

# MLX's get_type_string for the dtypes a kernel takes
_TYPE_STRINGS: dict[mx.Dtype, str] = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
}

# Inputs with fewer elements MLX passes in the constant address space (metal_kernel.cpp's max_constant_array_size).
CONSTANT_BELOW = 8

# The kernel arguments MLX's Metal front end adds when the source names them (metal_kernel.cpp), with their types.
_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# What <metal_stdlib> and MLX's utils.h give a custom kernel, as far as the bodies use it, with MSL's signatures.
_SHIM = r"""
#define device __global
#define constant __constant
#define threadgroup __local
#define thread __private
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef uchar uint8_t;
typedef ushort uint16_t;
typedef uint uint32_t;
typedef ulong uint64_t;
// OpenCL's words that MSL leaves free for names (a variable may be called `local` in MSL)
#define global msl_name_global
#define local msl_name_local
#define generic msl_name_generic
#define read_only msl_name_read_only
#define write_only msl_name_write_only
#define read_write msl_name_read_write
#define pipe msl_name_pipe
// MSL's vectors, as far as the bodies and the kernel arguments use them: built from scalars, read by component
struct uint3 { uint x, y, z; uint3() = default; uint3(uint a, uint b, uint c); };
struct ulong2 { ulong x, y; ulong2() = default; ulong2(ulong all); ulong2(ulong a, ulong b); };
// 16-bit floats: half is a type name in MSL as in OpenCL (a variable may not be called `half`); bfloat (Metal 3.1)
// is only converted to and from float by the bodies ((float)x, static_cast<T>(f))
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
struct bfloat { ushort bits; bfloat() = default; bfloat(float); operator float() const; };
typedef half float16_t;
typedef bfloat bfloat16_t;

template <class T, class U> struct msl_same { static constexpr bool value = false; };
template <class T> struct msl_same<T, T> { static constexpr bool value = true; };
template <class T> struct msl_shuffles {  // simd_shuffle_xor's scalar types
  static constexpr bool value = msl_same<T, float>::value || msl_same<T, int>::value || msl_same<T, uint>::value ||
      msl_same<T, short>::value || msl_same<T, ushort>::value || msl_same<T, half>::value;
};
template <class T> T simd_shuffle_xor(T x, ushort mask) {
  static_assert(msl_shuffles<T>::value, "simd_shuffle_xor of a type MSL does not shuffle");
  return x;
}
template <class T, class U> T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type between types of different sizes");
  return T();
}

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

// atomic_uint and atomic_int: OpenCL's own types stand for MSL's
enum memory_order { memory_order_relaxed };
uint atomic_load_explicit(threadgroup atomic_uint* object, memory_order order);
uint atomic_load_explicit(device atomic_uint* object, memory_order order);
bool atomic_compare_exchange_weak_explicit(threadgroup atomic_uint* object, thread uint* expected, uint desired,
                                           memory_order success, memory_order failure);
bool atomic_compare_exchange_weak_explicit(device atomic_uint* object, thread uint* expected, uint desired,
                                           memory_order success, memory_order failure);
uint atomic_fetch_add_explicit(threadgroup atomic_uint* object, uint operand, memory_order order);
uint atomic_fetch_add_explicit(device atomic_uint* object, uint operand, memory_order order);

namespace metal {
template <class T> T max(T x, T y);
template <class T> T min(T x, T y);
template <class T> T abs(T x);
template <class T> T clamp(T x, T lo, T hi);
float fma(float a, float b, float c);
float rint(float x);
float floor(float x);
float ceil(float x);
float sqrt(float x);
float rsqrt(float x);
float exp(float x);
float exp2(float x);
float log(float x);
float sin(float x);
float cos(float x);
float atan2(float y, float x);
namespace fast {
float exp(float x);
float exp2(float x);
float log(float x);
float sin(float x);
float cos(float x);
}
namespace precise {
float exp(float x);
float sin(float x);
float cos(float x);
float atan2(float y, float x);
float sqrt(float x);
}
template <class T> struct numeric_limits { static T max(); static T min(); static T infinity(); };
}
using namespace metal;

// <metal_simdgroup_matrix>, for the sources with matrix ops
struct simdgroup_float8x8 { float v[2]; simdgroup_float8x8() = default; explicit simdgroup_float8x8(float); };
void simdgroup_load(thread simdgroup_float8x8& d, const threadgroup float* src, ulong elements_per_row = 8,
                    ulong2 matrix_origin = 0, bool transpose_matrix = false);
void simdgroup_load(thread simdgroup_float8x8& d, const device float* src, ulong elements_per_row = 8,
                    ulong2 matrix_origin = 0, bool transpose_matrix = false);
void simdgroup_store(thread const simdgroup_float8x8& a, threadgroup float* dst, ulong elements_per_row = 8,
                     ulong2 matrix_origin = 0, bool transpose_matrix = false);
void simdgroup_store(thread const simdgroup_float8x8& a, device float* dst, ulong elements_per_row = 8,
                     ulong2 matrix_origin = 0, bool transpose_matrix = false);
void simdgroup_multiply_accumulate(thread simdgroup_float8x8& d, thread const simdgroup_float8x8& a,
                                   thread const simdgroup_float8x8& b, thread const simdgroup_float8x8& c);
"""

_FIRST_LINE = _SHIM.count("\n") + 1


def _includes_removed(header: str) -> str:
    # <metal_stdlib> and <metal_simdgroup_matrix> are what the shim stands for
    return "\n".join(line for line in header.splitlines() if not line.startswith("#include <metal"))


def metal_unit(source: KernelSource, inputs: Sequence[tuple[mx.Dtype, int, int]], output_dtypes: Sequence[mx.Dtype],
               template: Sequence[tuple[str, Any]]) -> str:
    """The translation unit (shim first) of `source` launched with `inputs` (dtype, size, ndim each) and
    `output_dtypes`, as MLX's Metal front end writes it (see the module docstring)."""
    header, body = (compact(text) for text in source.for_backend("metal"))
    params = []
    for name, (dtype, size, ndim) in zip(source.input_names, inputs, strict=True):
        location = "constant" if size < CONSTANT_BELOW else "device"
        params.append(f"  const {location} {_TYPE_STRINGS[dtype]}{'&' if ndim == 0 else '*'} {name}")
        if ndim > 0:
            if f"{name}_shape" in body:
                params.append(f"  const constant int* {name}_shape")
            if f"{name}_strides" in body:
                params.append(f"  const constant int64_t* {name}_strides")
            if f"{name}_ndim" in body:
                params.append(f"  const constant int& {name}_ndim")
    params += [f"  device {_TYPE_STRINGS[dtype]}* {name}"
               for name, dtype in zip(source.output_names, output_dtypes, strict=True)]
    params = [f"{param} [[buffer({index})]]" for index, param in enumerate(params)]  # MLX's numbering
    params += [f"  {kind} {attribute}" for attribute, kind in _ATTRIBUTES if attribute in body]
    constants = template_constants(template, _TYPE_STRINGS.__getitem__)
    return (
        _SHIM + _includes_removed(header)
        + f"\n__kernel void custom_kernel_{source.name}(\n" + ",\n".join(params) + ") {\n"
        + "\n".join(constants) + "\n" + body + "\n}\n"
    )


# OpenCL's rule, not MSL's (see the module docstring)
_NOT_MSL_RULES = ("can only be declared in the outermost scope of a kernel function",)

_CHECKED: dict[str, tuple[str, ...]] = {}
_LOCK = threading.Lock()


def available() -> bool:
    """Whether libclang (the `libclang` wheel) can be loaded here."""
    try:
        _index()
    except Exception:  # noqa: BLE001 - ImportError, or the library failing to load
        return False
    return True


_INDEX: list[Any] = []


def _index() -> Any:
    if not _INDEX:
        import clang.cindex  # the `libclang` wheel: a test extra, never needed at run time

        _INDEX.append(clang.cindex.Index.create())
        atexit.register(_INDEX.clear)  # disposed of while cindex can still do it (not in interpreter teardown)
    return _INDEX[0]


def check_unit(unit: str) -> tuple[str, ...]:
    """The Metal model's errors in `unit` (empty: it compiles), each with its line of the unit. Memoised."""
    with _LOCK:
        found = _CHECKED.get(unit)
        if found is not None:
            return found
        import clang.cindex as ci

        tu = _index().parse(
            "kernel.clcpp", args=["-x", "cl", "-cl-std=clc++2021", "-cl-no-stdinc", "-fsyntax-only",
                                  "-Wno-unknown-attributes"],
            unsaved_files=[("kernel.clcpp", unit)],
        )
        lines = unit.splitlines()
        errors = []
        for diagnostic in tu.diagnostics:
            if diagnostic.severity < ci.Diagnostic.Error or any(rule in diagnostic.spelling for rule in _NOT_MSL_RULES):
                continue
            errors.append(_located(diagnostic.spelling, diagnostic.location.line, lines))
        errors += [_located(message, line, lines) for message, line in _unqualified_pointers(tu.cursor)]
        shared = _threadgroup_bytes(tu.cursor)
        if shared > MAX_THREADGROUP_BYTES:
            errors.append(f"{shared} bytes of threadgroup memory, past the {MAX_THREADGROUP_BYTES} an Apple GPU gives")
        found = _CHECKED[unit] = tuple(errors)
        return found


def buffers_in(unit: str) -> int:
    """The buffer arguments of a unit's kernel, as MLX numbers them."""
    return unit.count("[[buffer(")


def _located(message: str, line: int, lines: list[str]) -> str:
    where = "the shim" if line < _FIRST_LINE else "the kernel"
    text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return f"{message} ({where}, line {line}: {text})"


# Threadgroup memory an Apple GPU gives a threadgroup (decode.TILED_SHARED_LIMIT plans the tiled pass within it).
MAX_THREADGROUP_BYTES = 32768


def _threadgroup_bytes(root: Any) -> int:
    """The threadgroup memory the kernel declares: every threadgroup variable's size, blocks that never overlap
    counted together (an upper bound, as a compiler may not share them)."""
    import clang.cindex as ci

    return sum(cursor.type.get_size() for cursor in root.walk_preorder()
               if cursor.kind == ci.CursorKind.VAR_DECL and cursor.location.line >= _FIRST_LINE
               and cursor.type.spelling.startswith("__local"))


def _unqualified_pointers(root: Any) -> list[tuple[str, int]]:
    """Declarations in the kernel part whose pointer or reference has no address space (generic in OpenCL, the
    thread's in MSL: refused, see the module docstring)."""
    import clang.cindex as ci

    kinds = (ci.CursorKind.VAR_DECL, ci.CursorKind.PARM_DECL, ci.CursorKind.FIELD_DECL)
    found = []
    for cursor in root.walk_preorder():
        if cursor.kind not in kinds or cursor.location.line < _FIRST_LINE or cursor.location.file is None:
            continue
        spelling = cursor.type.spelling
        if "__generic" in spelling:
            found.append((f"a pointer without an address space ({spelling} {cursor.spelling})", cursor.location.line))
    return found


def _long_tile_only(source: KernelSource, template: Sequence[tuple[str, Any]]) -> bool:
    """Whether this is a tiled decode launch at a tile past decode.TILED_MAX_TILE, which only a backend's long tile
    (decode.TILED_LONG_TILES, which names no Metal) chooses: its threadgroup memory is held to that backend's limit."""
    from engine.kvcache.kernels import decode

    if source.name != decode.tiled_source().name or "metal" in decode.TILED_LONG_TILES:
        return False
    # the plan's constants are in the source's defines (decode.PLAN_CONSTANTS_IN_SOURCE) or in the template
    found = re.search(r"constexpr int CT = (\d+);", source.defines)
    tile = int(found[1]) if found else dict(template).get("CT", 0)
    return int(tile) > decode.TILED_MAX_TILE


def check_launch(source: KernelSource, inputs: Sequence[mx.array], output_dtypes: Sequence[mx.Dtype],
                 template: Sequence[tuple[str, Any]]) -> None:
    """Raise RuntimeError with the Metal model's errors if `source` launched so would not compile as Metal."""
    unit = metal_unit(source, [(a.dtype, a.size, a.ndim) for a in inputs], output_dtypes, template)
    errors = check_unit(unit)
    if over_buffer_limit(source, "metal") is not None or _long_tile_only(source, template):
        # never launched so on Metal (its other limits do not apply)
        errors = tuple(error for error in errors if "threadgroup memory" not in error)
    # Past Metal's 31 buffer arguments a launch cannot be built; the engine declines such a kernel on Metal by its
    # own count (backend.over_buffer_limit), which must be the count MLX's signature makes.
    bound = buffers_in(unit)
    if bound != buffer_arguments(source):
        errors += (f"MLX binds {bound} buffers, the engine counts {buffer_arguments(source)}",)
    if errors:
        raise RuntimeError(f"Kernel {source.name} would not compile as Metal (the Metal model of "
                           "tests/metal_model.py):\n  " + "\n  ".join(errors))
