"""One kernel body, two backends: the thin Metal and CUDA preludes and the factory that picks one.

Every kernel in this package is written once, as a body in a small common dialect, and handed to
`mx.fast.metal_kernel` on a Mac or `mx.fast.cuda_kernel` on NVIDIA with a prelude that defines the dialect:

    TID            thread index in its threadgroup / block (x)
    GROUP_X, GROUP_Y   threadgroup / block index in the grid (x, y)
    GROUPS_X       number of threadgroups / blocks along x
    SHARED         threadgroup / __shared__ memory qualifier
    BARRIER()      threadgroup barrier (memory fence included)
    LANE_XOR(x, m) value of `x` in the lane whose index is this lane's xor m (simdgroup / warp of 32)
    EXP, FMAX      float exp and max
    U32, U64       32- and 64-bit unsigned integers
    GLOBAL, THREAD address-space qualifiers of device memory and of a thread's own arrays (empty on CUDA)
    INLINE         qualifier of helper functions in the header
    SINCOS_PI(x,s,c)  s = sin(x), c = cos(x) for |x| <= pi, to ~1e-6 (the hardware's fast sine and cosine on CUDA;
                   a body reduces larger angles itself, with RINT and FMA)
    RINT, FMA      float round-to-nearest-integer and fused multiply-add
    ATAN2(y, x)    float atan2, the accurate one (Metal's precise::, not its fast-math default)
    SHARED_ADD(p, v)  atomically add float v to the shared float at p (CUDA's atomicAdd; on Metal a compare-and-swap
                   loop on the word as an atomic_uint, which threadgroup memory has on every Metal GPU)
    AS_F32(u)      the float whose bits are the unsigned integer u
    AS_U32(x)      the unsigned integer whose bits are the float x
    U2F(c)         float value of an unsigned code c < 2^23, exactly: the bits of 2^23 + c as a float, minus
                   2^23 (one logic op and one add; an integer-to-float conversion runs at a quarter of the
                   float rate on recent NVIDIA GPUs)

A warp's (simdgroup's) matrix multiply-accumulate on tiles in shared memory, for bodies that multiply a tile of
decoded keys or values with the queries on the GPU's matrix units (every lane of a warp calls each op together;
only in sources with `matrix_ops`):

    MMA_T          element type of the tiles (bfloat16 on CUDA, float on Metal and the emulator)
    MMA_SHARED     SHARED aligned to 16 bytes, for the tiles
    MMA_CAST(x)    a float as MMA_T (CUDA and the emulator round to bfloat16; Metal keeps float)
    MMA_ACC        a warp's 16×8 float accumulator (opaque; CUDA: 4 floats a lane, Metal: two 8×8 simdgroup
                   matrices, the emulator: the whole tile in every lane)
    MMA_ZERO(acc)  acc = 0
    MMA_16X8X16(acc, a, lda, b, ldb)   acc += A·B with A 16×16 row-major at a (row stride lda) and B 16×8 stored
                   n-major (element (k, n) at b[n * ldb + k]); a, b even-aligned, lda, ldb even (CUDA reads pairs)
    MMA_STORE(c, ldc, acc)   the accumulator into the row-major 16×8 float tile at c (row stride ldc)
CUDA: `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (sm_80 and later), the operands read from shared memory
in the instruction's register layout. Metal: `simdgroup_multiply_accumulate` on `simdgroup_float8x8` (every Apple
GPU MLX runs on), B loaded transposed.

Both MLX front ends take `grid` as the total number of threads (Metal's dispatch_threads; MLX's CUDA
launcher divides by the block size itself), so a launch is described once for both.

MLX's Metal front end passes a kernel argument such as `thread_position_in_threadgroup` only when the
*body* names it, so the Metal prelude is text at the top of the body, not part of the header. It also
passes inputs of fewer than 8 elements in the `constant` address space, which the helpers' `GLOBAL`
(device) pointers cannot take: only large arrays (codes) go through helpers; small tables (centroids,
boundaries, the scale) are indexed in the body itself, where either address space works.

A third backend, "emulate" (`emulate.py`), runs the same bodies as host C++ on the CPU, for parity tests on
machines without a GPU; `build`/`kernel` accept it, `available_backend()` never picks it. In the tests every
emulated launch's Metal text is also checked by clang's front end against a model of MSL's typing and of MLX's
Metal signature (tests/metal_model.py): a name MSL reserves (`half`), a small input (MLX's `constant`) handed to a
helper taking device memory, or a value MSL does not shuffle fails there, before any Mac sees it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

BACKENDS = ("metal", "cuda")

_CUDA_HEADER = """
#define SHARED __shared__
#define BARRIER() __syncthreads()
#define LANE_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define EXP(x) __expf(x)
#define FMAX(a, b) fmaxf((a), (b))
#define U32 unsigned int
#define U64 unsigned long long
#define GLOBAL
#define THREAD
#define INLINE __device__ __forceinline__
#define U2F(c) (__uint_as_float(0x4B000000u | (c)) - 8388608.0f)
#define AS_F32(u) __uint_as_float(u)
#define AS_U32(x) __float_as_uint(x)
#define SINCOS_PI(x, s, c) __sincosf((x), &(s), &(c))
#define RINT(x) rintf(x)
#define FMA(a, b, c) fmaf((a), (b), (c))
#define ATAN2(y, x) atan2f((y), (x))
#define SHARED_ADD(p, v) atomicAdd((p), (v))
"""

_CUDA_PRELUDE = """
  const int TID = threadIdx.x;
  const int GROUP_X = blockIdx.x;
  const int GROUP_Y = blockIdx.y;
  const int GROUPS_X = gridDim.x;
"""

_METAL_HEADER = """
#define SHARED threadgroup
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define LANE_XOR(x, m) simd_shuffle_xor((x), (ushort)(m))
#define EXP(x) metal::fast::exp(x)
#define FMAX(a, b) metal::max((a), (b))
#define U32 uint
#define U64 ulong
#define GLOBAL device
#define THREAD thread
#define INLINE inline
#define U2F(c) (as_type<float>(0x4B000000u | (c)) - 8388608.0f)
#define AS_F32(u) as_type<float>((uint)(u))
#define AS_U32(x) as_type<uint>((float)(x))
#define SINCOS_PI(x, s, c) { (s) = metal::precise::sin(x); (c) = metal::precise::cos(x); }
#define RINT(x) metal::rint(x)
#define FMA(a, b, c) metal::fma((a), (b), (c))
#define ATAN2(y, x) metal::precise::atan2((y), (x))
#define SHARED_ADD(p, v) { \\
    threadgroup atomic_uint* word_ = (threadgroup atomic_uint*)(p); \\
    uint seen_ = atomic_load_explicit(word_, memory_order_relaxed); \\
    while (!atomic_compare_exchange_weak_explicit(word_, &seen_, as_type<uint>(as_type<float>(seen_) + (v)), \\
                                                  memory_order_relaxed, memory_order_relaxed)) {} }
"""

_METAL_PRELUDE = """
  const int TID = (int)thread_position_in_threadgroup.x;
  const int GROUP_X = (int)threadgroup_position_in_grid.x;
  const int GROUP_Y = (int)threadgroup_position_in_grid.y;
  const int GROUPS_X = (int)threadgroups_per_grid.x;
"""


# The warp matrix ops (MMA_*), in the header only of sources that ask for them (`KernelSource.matrix_ops`): every
# other kernel's text stays as short as it was (MLX's CUDA front end hashes it at every launch).
_CUDA_MMA = """
#define MMA_T __nv_bfloat16
#define MMA_SHARED __shared__ __align__(16)
#define MMA_CAST(x) __float2bfloat16(x)
#define MMA_ACC MmaAcc
#define MMA_ZERO(acc) { (acc).v[0] = 0.0f; (acc).v[1] = 0.0f; (acc).v[2] = 0.0f; (acc).v[3] = 0.0f; }
#define MMA_16X8X16(acc, a, lda, b, ldb) mma_16x8x16((acc), (a), (lda), (b), (ldb))
#define MMA_STORE(c, ldc, acc) mma_store((c), (ldc), (acc))
struct MmaAcc { float v[4]; };
// Two consecutive bfloat16 as one register (the lower address in the low half, as the instruction reads a pair).
__device__ __forceinline__ unsigned mma_pair(const __nv_bfloat16* p) { return *reinterpret_cast<const unsigned*>(p); }
// Lane l holds A rows g = l / 4 and g + 8, columns 2t, 2t + 1 and 2t + 8, 2t + 9 (t = l % 4); B rows (k) 2t, 2t + 1 and
// 2t + 8, 2t + 9 of column g; the accumulator's rows g and g + 8, columns 2t, 2t + 1.
__device__ __forceinline__ void mma_16x8x16(MmaAcc& acc, const __nv_bfloat16* a, int lda, const __nv_bfloat16* b,
                                            int ldb) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const unsigned a0 = mma_pair(a + g * lda + 2 * t), a1 = mma_pair(a + (g + 8) * lda + 2 * t);
  const unsigned a2 = mma_pair(a + g * lda + 2 * t + 8), a3 = mma_pair(a + (g + 8) * lda + 2 * t + 8);
  const unsigned b0 = mma_pair(b + g * ldb + 2 * t), b1 = mma_pair(b + g * ldb + 2 * t + 8);
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(acc.v[0]), "+f"(acc.v[1]), "+f"(acc.v[2]), "+f"(acc.v[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_store(float* c, int ldc, const MmaAcc& acc) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  c[g * ldc + 2 * t] = acc.v[0];
  c[g * ldc + 2 * t + 1] = acc.v[1];
  c[(g + 8) * ldc + 2 * t] = acc.v[2];
  c[(g + 8) * ldc + 2 * t + 1] = acc.v[3];
}
"""

_METAL_MMA = """
#include <metal_simdgroup_matrix>
#define MMA_T float
#define MMA_SHARED threadgroup
#define MMA_CAST(x) ((float)(x))
#define MMA_ACC MmaAcc
#define MMA_ZERO(acc) { (acc).top = simdgroup_float8x8(0.0f); (acc).bottom = simdgroup_float8x8(0.0f); }
#define MMA_16X8X16(acc, a, lda, b, ldb) mma_16x8x16((acc), (a), (lda), (b), (ldb))
#define MMA_STORE(c, ldc, acc) mma_store((c), (ldc), (acc))
struct MmaAcc { simdgroup_float8x8 top; simdgroup_float8x8 bottom; };
// A as four 8×8 blocks; B (stored n-major: its transpose row-major) as two 8×8 blocks of k, loaded transposed.
inline void mma_16x8x16(thread MmaAcc& acc, const threadgroup float* a, int lda, const threadgroup float* b, int ldb) {
  simdgroup_float8x8 a00, a01, a10, a11, b0, b1;
  simdgroup_load(a00, a, lda);
  simdgroup_load(a01, a + 8, lda);
  simdgroup_load(a10, a + 8 * lda, lda);
  simdgroup_load(a11, a + 8 * lda + 8, lda);
  simdgroup_load(b0, b, ldb, ulong2(0, 0), true);
  simdgroup_load(b1, b + 8, ldb, ulong2(0, 0), true);
  simdgroup_multiply_accumulate(acc.top, a00, b0, acc.top);
  simdgroup_multiply_accumulate(acc.top, a01, b1, acc.top);
  simdgroup_multiply_accumulate(acc.bottom, a10, b0, acc.bottom);
  simdgroup_multiply_accumulate(acc.bottom, a11, b1, acc.bottom);
}
inline void mma_store(threadgroup float* c, int ldc, thread const MmaAcc& acc) {
  simdgroup_store(acc.top, c, ldc);
  simdgroup_store(acc.bottom, c + 8 * ldc, ldc);
}
"""


# Why kernels were turned off for this process (engine/kvcache/kernel_check.py: a kernel failed its first run on this
# GPU); empty while they are on.
_DISABLED: list[str] = []


def disable(reason: str) -> None:
    """Turn the kernels off for the rest of the process: `available_backend()` answers None from now on."""
    if not _DISABLED:
        _DISABLED.append(reason)


def disabled_reason() -> str | None:
    """Why `disable` turned the kernels off, or None."""
    return _DISABLED[0] if _DISABLED else None


def available_backend() -> str | None:
    """"cuda" or "metal" when the default device is a GPU whose MLX build runs custom kernels, else None.

    Decided from the default device at call time: a CPU default device (tests, the CPU fast path) means
    no kernels even on a machine with a GPU, because the kernels would run on the GPU stream. None as well once
    `disable` turned them off.
    """
    if _DISABLED:
        return None
    return device_backend()


def device_backend() -> str | None:
    """The default device's kernel backend, whether or not `disable` turned the kernels off."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def assemble(backend: str, body: str, header: str = "", defines: str = "",
             matrix_ops: bool = False) -> tuple[str, str]:
    """(header, source) for `backend`: the dialect's header (with the MMA ops where `matrix_ops`) + `header`, and
    the prelude + `defines` + body."""
    if backend == "cuda":
        return _CUDA_HEADER + (_CUDA_MMA if matrix_ops else "") + header, _CUDA_PRELUDE + defines + body
    if backend == "metal":
        return _METAL_HEADER + (_METAL_MMA if matrix_ops else "") + header, _METAL_PRELUDE + defines + body
    raise ValueError(f"Unknown kernel backend {backend!r}; known are {', '.join(BACKENDS)}.")


@dataclass(frozen=True)
class KernelSource:
    """Everything that defines one kernel, before a backend is chosen."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    body: str
    header: str = ""
    defines: str = ""
    matrix_ops: bool = False  # the body uses the MMA_* ops

    def for_backend(self, backend: str) -> tuple[str, str]:
        return assemble(backend, self.body, self.header, self.defines, self.matrix_ops)


def build(source: KernelSource, backend: str) -> Callable[..., list[mx.array]]:
    """The MLX kernel object of `source` on `backend` (compiled by MLX on first launch, then cached).

    `backend` may also be "emulate": the CPU emulator of `emulate.py`, called like an MLX kernel object. It
    is for tests only; `available_backend()` never returns it.
    """
    if backend == "emulate":
        from engine.kvcache.kernels.emulate import emulated_kernel  # imports this module: import late

        return emulated_kernel(source)
    header, body = (compact(text) for text in source.for_backend(backend))
    common: dict[str, Any] = {
        "name": source.name,
        "input_names": list(source.input_names),
        "output_names": list(source.output_names),
        "source": body,
        "header": header,
        "ensure_row_contiguous": True,
    }
    if backend == "cuda":
        return mx.fast.cuda_kernel(**common)
    return mx.fast.metal_kernel(**common)


def compact(text: str) -> str:
    """`text` without `//` comments, indentation and blank lines (line breaks kept for the preprocessor).

    MLX's CUDA front end rebuilds a kernel's whole source text on every call and hashes it when the launch is
    encoded, so its length is host time in every decode step; the bodies carry long comments for their
    readers, which the compiler never needs. (The bodies hold no string literals, where `//` would matter.)"""
    lines = (line.split("//", 1)[0].strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


# Metal gives a compute function 31 buffer arguments ([[buffer(0)]] to [[buffer(30)]], Apple's feature set tables), and
# MLX's Metal front end binds one to each input, to each `<input>_shape` (`_strides`, `_ndim`) the body names and to
# each output (mlx/backend/common/metal_kernel.cpp, write_signature); CUDA has no such table.
METAL_MAX_BUFFERS = 31


@functools.cache
def buffer_arguments(source: KernelSource) -> int:
    """The buffer arguments MLX's Metal front end gives `source` (every input here has at least one dimension)."""
    body = compact(source.for_backend("metal")[1])
    shapes = sum(f"{name}_{part}" in body for name in source.input_names for part in ("shape", "strides", "ndim"))
    return len(source.input_names) + shapes + len(source.output_names)


def over_buffer_limit(source: KernelSource, backend: str | None) -> str | None:
    """Why `source` cannot be built on `backend` for its buffer arguments (Metal's 31), or None."""
    if backend != "metal":
        return None
    count = buffer_arguments(source)
    if count <= METAL_MAX_BUFFERS:
        return None
    return (f"the {source.name} kernel takes {count} buffer arguments, past the {METAL_MAX_BUFFERS} Metal gives a "
            "kernel")


def template_constants(template: Sequence[tuple[str, Any]], type_name: Callable[[mx.Dtype], str]) -> list[str]:
    """A launch's template arguments as the constants a kernel body reads (the front ends make them template
    parameters; a translation unit written out here declares them): `using` for a dtype, spelled by `type_name`."""
    lines = []
    for name, value in template:
        if isinstance(value, mx.Dtype):
            lines.append(f"  using {name} = {type_name(value)};")
        elif isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {str(value).lower()};")
        else:
            lines.append(f"  constexpr int {name} = {int(value)};")
    return lines


def cuda_unit(source: KernelSource, types: Mapping[str, str], template: Sequence[tuple[str, int | str]],
              includes: str) -> str:
    """The CUDA translation unit MLX's `cuda_kernel` compiles for `source` (mlx/backend/cuda/custom_kernel.cpp,
    build_kernel): a pointer per input (const) and output, `<name>_shape` after an input whose shape the body
    names, template arguments as `constexpr int` or, for a str value (a C++ type), `using`. `types` is the C++
    type of each input and output; `includes` stands for MLX's device header (which defines `Shape`), e.g. to
    compile the kernels offline with nvcc (tests/test_kvcache_kernels.py, benchmarks/kernel_resources.py)."""
    header, body = source.for_backend("cuda")
    params = []
    for name in source.input_names:
        params.append(f"    const {types[name]}* {name}")
        if f"{name}_shape" in body:
            params.append(f"    const __grid_constant__ Shape {name}_shape")
    params += [f"    {types[name]}* {name}" for name in source.output_names]
    constants = "".join(
        f"  using {name} = {value};\n" if isinstance(value, str) else f"  constexpr int {name} = {int(value)};\n"
        for name, value in template
    )
    return (
        includes + "\n#include <cooperative_groups.h>\n" + header
        + "\nnamespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
        + f"__global__ void {source.name}(\n" + ",\n".join(params) + ") {\n" + constants + body + "\n}\n}\n"
    )


_BUILT: dict[tuple[KernelSource, str], Callable[..., list[mx.array]]] = {}


def kernel(source: KernelSource, backend: str) -> Callable[..., list[mx.array]]:
    """`build`, memoised: one MLX kernel object per source and backend for the whole process."""
    key = (source, backend)
    built = _BUILT.get(key)
    if built is None:
        built = _BUILT[key] = build(source, backend)
    return built


class Ruler:
    """Counts handed to kernels as the *length* of a slice of one shared array, not as data.

    A kernel reads `name_shape[0] - 1`. The slice is a view (no copy, no kernel) and the count travels
    with the launch's shape arguments, so a count that changes every step (tokens in a window) neither
    recompiles the kernel (MLX compiles per source and template, shapes are runtime arguments) nor
    uploads a small array from the host each step.
    """

    # Slices kept, one per count: the compressed count changes once per block and the window's every step, cycling
    # through the same few hundred (a KIVI window holds under 128 tokens), and the layers of a model share them, so a
    # step reuses slices that are already evaluated instead of adding a slice to every layer's graph.
    MAX_VIEWS = 1024

    def __init__(self) -> None:
        self._array = mx.zeros((1 << 16,), dtype=mx.uint8)
        self._views: dict[int, mx.array] = {}

    def __call__(self, count: int) -> mx.array:
        view = self._views.get(count)
        if view is not None:
            return view
        if count + 1 > self._array.shape[0]:
            size = self._array.shape[0]
            while size < count + 1:
                size *= 2
            self._array = mx.zeros((size,), dtype=mx.uint8)
            self._views.clear()
        if len(self._views) >= self.MAX_VIEWS:
            self._views.clear()
        view = self._views[count] = self._array[: count + 1]
        return view


RULER = Ruler()


def names_are_distinct(names: Sequence[str]) -> bool:
    """MLX finds `<name>_shape` by substring search in the body: no name may end another's `_shape`."""
    return not any(a != b and (b + "_shape").endswith(a + "_shape") for a in names for b in names)
