"""A CPU emulator of the kernel dialect: runs a kernel body as host C++, so kernel parity is testable without
a GPU (`backend.kernel(source, "emulate")`, never chosen by `available_backend()`).

The body, its header and defines are assembled as for MLX's CUDA front end (one pointer per input, a
`name_shape` array where the body names it, template ints as `constexpr int`, template dtypes as `using`
aliases), with a host prelude for the dialect, compiled by g++ into a shared library (cached by the text's
hash) and called through ctypes.

How the GPU is imitated. The blocks of the grid run one after another. The threads of a block are fibers
(ucontext) of one OS thread, switched only where a GPU thread synchronises: at BARRIER() (released when every
thread of the block waits there) and at LANE_XOR (released when the 32 threads of its warp, TID / 32, wait
there: a warp's shuffle needs only its own lanes, and the staged KIVI keys do shuffle in some warps only,
one warp per query row). This is the GPU's semantics for code that synchronises only through barriers and
shuffles, deterministic, and ~100x cheaper on a small CPU than one OS thread per GPU thread (each barrier
would cost a context switch per thread). To keep a missing barrier from hiding behind a fixed order, each
round runs the runnable threads in a different (seeded) shuffled order. SHARED is `static`: the fibers of a
block share it, and blocks run sequentially so they never overlap.

LANE_XOR(x, m) writes x to the thread's slot of a per-block buffer, waits for its warp, and reads the slot of
TID ^ m (m < 32: the same warp). Two alternating buffers make one synchronisation per exchange enough: a lane
can only rewrite a buffer after its warp's next exchange, which every lane reaches only after reading it.

Checks a GPU would not make: a barrier must be reached by every thread of the block, and a shuffle by every
thread of the warp, at the same line of the body (anything else is undefined behaviour on the GPU); a
thread's stack must not overflow; float outputs start as NaN (integer outputs as all ones), so an output
element no thread writes shows up; every input must be as it was when the launch ends (MLX treats inputs as
immutable: a kernel may use one as scratch only if it restores it). A read or write out of bounds is not caught
(it may crash the process).

Inputs of a 16-bit float dtype (bfloat16, float16) are passed to the emulator as float32, and template dtypes
of those types become `float`: the bodies only convert with `(float)x` and `static_cast<TO>(...)`, so this
changes nothing but the rounding of the 16-bit values themselves. 16-bit outputs are computed as float32
and rounded to the requested dtype by MLX afterwards. Threadgroups are one-dimensional (x), as the dialect
has only TID; the grid, as in MLX's front ends, counts threads per axis and must be a multiple of the block.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kvcache.kernels.backend import KernelSource, template_constants

EMULATE = "emulate"
MAX_DIMS = 8

# mx dtype -> (numpy dtype the emulator receives, its C++ type)
_TYPES: dict[mx.Dtype, tuple[type, str]] = {
    mx.float32: (np.float32, "float"),
    mx.float16: (np.float32, "float"),
    mx.bfloat16: (np.float32, "float"),
    mx.uint8: (np.uint8, "uint8_t"),
    mx.uint16: (np.uint16, "uint16_t"),
    mx.uint32: (np.uint32, "uint32_t"),
    mx.uint64: (np.uint64, "uint64_t"),
    mx.int8: (np.int8, "int8_t"),
    mx.int16: (np.int16, "int16_t"),
    mx.int32: (np.int32, "int32_t"),
    mx.int64: (np.int64, "int64_t"),
    mx.bool_: (np.bool_, "bool"),
}

# Only C headers: the C++ containers' headers would double each unit's compile time (~1 s vs ~0.5 s).
_HEADER = r"""
#undef _FORTIFY_SOURCE  // its checked longjmp refuses to jump between fiber stacks
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ucontext.h>

namespace emu {
// Switches between fibers use _setjmp/_longjmp (no signal mask saved: swapcontext's system call per switch
// made launches ~15x slower); ucontext only starts a fiber on its own stack.
constexpr int STACK = 1 << 16;  // per thread; its lowest GUARD bytes must stay untouched (checked)
constexpr int GUARD = 256;
enum State { RUNNABLE, AT_BARRIER, AT_SHUFFLE, DONE };
struct Fiber {
  ucontext_t start;
  jmp_buf resume;
  int state, line;  // line: where it waits
  bool started;
};
struct Block {
  jmp_buf scheduler;
  Fiber* fibers;
  int tid, group_x, group_y, groups_x;
  uint64_t* exchange[2];  // LANE_XOR's two alternating buffers, one word per thread
  int* exchanges;         // per thread: how many LANE_XORs it has done
};
inline Block block;

inline void wait(int state, int line) {
  Fiber& self = block.fibers[block.tid];
  self.state = state;
  self.line = line;
  if (!_setjmp(self.resume)) _longjmp(block.scheduler, 1);
}

inline void barrier(int line) { wait(AT_BARRIER, line); }

template <typename T>
inline T lane_xor(T x, int mask, int line) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "LANE_XOR of a value wider than 64 bits");
  const int me = block.tid;
  const int parity = block.exchanges[me]++ & 1;
  uint64_t word = 0;
  std::memcpy(&word, &x, sizeof(T));
  block.exchange[parity][me] = word;
  wait(AT_SHUFFLE, line);
  const int partner = me ^ mask;  // mask < 32: the partner is in the same warp (TID / 32)
  T out;
  std::memcpy(&out, &block.exchange[parity][partner], sizeof(T));
  return out;
}

inline float as_f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t as_u32(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float u2f(uint32_t c) {
  const uint32_t bits = 0x4B000000u | c;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f - 8388608.0f;
}
}  // namespace emu

#define SHARED static
#define BARRIER() emu::barrier(__LINE__)
#define LANE_XOR(x, m) emu::lane_xor((x), (m), __LINE__)
#define EXP(x) expf(x)
#define FMAX(a, b) fmaxf((a), (b))
#define U32 uint32_t
#define U64 uint64_t
#define GLOBAL
#define THREAD
#define INLINE inline
#define U2F(c) emu::u2f(c)
#define AS_F32(u) emu::as_f32(u)
#define AS_U32(x) emu::as_u32(x)
#define SINCOS_PI(x, s, c) { (s) = sinf(x); (c) = cosf(x); }
#define RINT(x) rintf(x)
#define FMA(a, b, c) fmaf((a), (b), (c))
#define ATAN2(y, x) atan2f((y), (x))
#define SHARED_ADD(p, v) (*(p) += (v))  // fibers switch only at barriers and shuffles: a plain add is atomic here
// The warp's matrix ops: every lane holds the whole 16×8 accumulator and computes it alone, after its warp has met
// (as a shuffle does: every lane must call the op at the same line); tiles round to bfloat16 as CUDA's do.
#define MMA_T float
#define MMA_SHARED alignas(16) static
#define MMA_CAST(x) emu::bf16_round(x)
#define MMA_ACC emu::MmaAcc
#define MMA_ZERO(acc) { for (int i_ = 0; i_ < 128; ++i_) (acc).v[i_] = 0.0f; }
#define MMA_16X8X16(acc, a, lda, b, ldb) emu::mma_16x8x16((acc), (a), (lda), (b), (ldb), __LINE__)
#define MMA_STORE(c, ldc, acc) emu::mma_store((c), (ldc), (acc), __LINE__)
namespace emu {
struct MmaAcc { float v[128]; };
inline float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline void mma_16x8x16(MmaAcc& acc, const float* a, int lda, const float* b, int ldb, int line) {
  lane_xor(0u, 0, line);  // the warp meets here, as the instruction needs every lane
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) sum += a[m * lda + k] * b[n * ldb + k];
      acc.v[m * 8 + n] += sum;
    }
}
inline void mma_store(float* c, int ldc, const MmaAcc& acc, int line) {
  lane_xor(0u, 0, line);
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) c[m * ldc + n] = acc.v[m * 8 + n];
}
}  // namespace emu
"""

_PRELUDE = """
  const int TID = emu::block.tid;
  const int GROUP_X = emu::block.group_x;
  const int GROUP_Y = emu::block.group_y;
  const int GROUPS_X = emu::block.groups_x;
"""

# Runs the kernel over the grid: blocks in order, the threads of a block as fibers switched at barriers.
_LAUNCHER = r"""
static void emu_entry() {
  emu_kernel();
  emu::block.fibers[emu::block.tid].state = emu::DONE;
  _longjmp(emu::block.scheduler, 1);
}

// Releases the waits that are complete: a warp whose lanes all wait at one shuffle, or the whole block at one
// barrier. Returns how many threads it released, or -1 (and `error`) when nothing can run any more.
static int emu_release(int threads, char* error, int error_size) {
  emu::Fiber* f = emu::block.fibers;
  int released = 0;
  for (int w = 0; w < threads; w += 32) {
    const int end = w + 32 < threads ? w + 32 : threads;
    bool whole = true;
    for (int t = w; t < end; ++t) whole = whole && f[t].state == emu::AT_SHUFFLE && f[t].line == f[w].line;
    for (int t = w; whole && t < end; ++t, ++released) f[t].state = emu::RUNNABLE;
  }
  if (released) return released;
  int done = 0, first = -1, other = -1;
  for (int t = 0; t < threads; ++t) {
    if (f[t].state == emu::DONE) { ++done; continue; }
    if (first < 0) first = t;
    if (f[t].state != f[first].state || f[t].line != f[first].line) other = t;
  }
  if (done == threads) return 0;
  if (other >= 0) {
    std::snprintf(error, error_size, "threads %d and %d wait at different barriers or shuffles (lines %d and %d)",
                  first, other, f[first].line, f[other].line);
    return -1;
  }
  const bool barrier = f[first].state == emu::AT_BARRIER;
  if (done || !barrier) {
    std::snprintf(error, error_size, "%d of %d threads wait at a %s (line %d) the others never reach",
                  threads - done, threads, barrier ? "barrier" : "shuffle", f[first].line);
    return -1;
  }
  for (int t = 0; t < threads; ++t) f[t].state = emu::RUNNABLE;
  return threads;
}

// Runs block (x, y): rounds of every runnable thread (in a shuffled order) up to its next wait or its end.
static int emu_block(int threads, char* stacks, int* order, uint32_t* rng, char* error, int error_size) {
  emu::Block& b = emu::block;
  for (int t = 0; t < threads; ++t) {
    emu::Fiber& f = b.fibers[t];
    f.state = emu::RUNNABLE;
    f.started = false;
    getcontext(&f.start);
    f.start.uc_stack.ss_sp = stacks + (size_t)t * emu::STACK;
    f.start.uc_stack.ss_size = emu::STACK;
    f.start.uc_link = nullptr;  // emu_entry never returns: it jumps back to the scheduler
    makecontext(&f.start, emu_entry, 0);
    std::memset(stacks + (size_t)t * emu::STACK, 0xA5, emu::GUARD);
    b.exchanges[t] = 0;
  }
  for (;;) {
    int n = 0;
    for (int t = 0; t < threads; ++t)
      if (b.fibers[t].state == emu::RUNNABLE) order[n++] = t;
    if (n == 0) break;
    for (int i = n - 1; i > 0; --i) {  // Fisher-Yates with xorshift32
      *rng ^= *rng << 13; *rng ^= *rng >> 17; *rng ^= *rng << 5;
      const int j = (int)(*rng % (uint32_t)(i + 1));
      const int swap = order[i]; order[i] = order[j]; order[j] = swap;
    }
    for (int i = 0; i < n; ++i) {
      emu::Fiber& f = b.fibers[order[i]];
      b.tid = order[i];
      if (!_setjmp(b.scheduler)) {
        if (f.started) _longjmp(f.resume, 1);
        f.started = true;
        setcontext(&f.start);
      }
    }
    if (emu_release(threads, error, error_size) < 0) return 1;
  }
  for (int t = 0; t < threads; ++t) {
    for (int i = 0; i < emu::GUARD; ++i) {
      if ((unsigned char)stacks[(size_t)t * emu::STACK + i] != 0xA5u) {
        std::snprintf(error, error_size, "thread %d overflowed its %d-byte stack", t, emu::STACK);
        return 1;
      }
    }
  }
  return 0;
}

extern "C" int emu_launch(void** pointers, const int32_t* shapes, const int32_t* blocks, int threads,
                          unsigned seed, char* error, int error_size) {
  for (int i = 0; i < EMU_ARRAYS; ++i) {
    emu_pointers[i] = pointers[i];
    std::memcpy(emu_shapes[i], shapes + i * EMU_MAX_DIMS, sizeof(emu_shapes[i]));
  }
  emu::Block& b = emu::block;
  b.fibers = new emu::Fiber[threads];
  char* stacks = new char[(size_t)threads * emu::STACK];
  b.exchange[0] = new uint64_t[threads];
  b.exchange[1] = new uint64_t[threads];
  b.exchanges = new int[threads];
  int* order = new int[threads];
  uint32_t rng = seed * 2654435761u + 1u;
  int status = 0;
  b.groups_x = blocks[0];
  for (int z = 0; z < blocks[2] && !status; ++z)
  for (int y = 0; y < blocks[1] && !status; ++y)
  for (int x = 0; x < blocks[0] && !status; ++x) {
    b.group_x = x;
    b.group_y = y;
    status = emu_block(threads, stacks, order, &rng, error, error_size);
    if (status) {
      const int used = (int)std::strlen(error);
      std::snprintf(error + used, error_size - used, " in block (%d, %d, %d)", x, y, z);
    }
  }
  delete[] order;
  delete[] b.exchanges;
  delete[] b.exchange[1];
  delete[] b.exchange[0];
  delete[] stacks;
  delete[] b.fibers;
  return status;
}
"""


def _arrays(source: KernelSource) -> tuple[str, ...]:
    return (*source.input_names, *source.output_names)


def assemble_unit(source: KernelSource, types: dict[str, str], template: Sequence[tuple[str, Any]]) -> str:
    """The host C++ translation unit of `source`, with C++ `types` per array and the template arguments."""
    code = source.defines + source.body
    lines = []
    for index, name in enumerate(_arrays(source)):
        const = "const " if name in source.input_names else ""
        lines.append(f"  {const}{types[name]}* {name} = ({const}{types[name]}*)emu_pointers[{index}];")
        if name + "_shape" in code and name in source.input_names:  # as MLX: shapes of inputs only
            lines.append(f"  const int32_t* {name}_shape = emu_shapes[{index}];")
    lines += template_constants(template, lambda dtype: _TYPES[dtype][1])
    return (
        _HEADER
        + f"#define EMU_ARRAYS {len(_arrays(source))}\n#define EMU_MAX_DIMS {MAX_DIMS}\n"
        + "static void* emu_pointers[EMU_ARRAYS];\nstatic int32_t emu_shapes[EMU_ARRAYS][EMU_MAX_DIMS];\n"
        + source.header
        + "\nstatic void emu_kernel() {\n" + "\n".join(lines) + "\n" + _PRELUDE
        + f'#line 1 "{source.name}"\n'  # barrier lines in errors count from the defines + body
        + code + "\n}\n"
        + _LAUNCHER
    )


def cache_dir() -> Path:
    """Where compiled units are kept (VELOX_EMULATE_CACHE, else a folder in the system's temp dir)."""
    return Path(os.environ.get("VELOX_EMULATE_CACHE") or Path(tempfile.gettempdir()) / "velox-emulate")


def compiler() -> str | None:
    """The C++ compiler the emulator uses (CXX, else g++), or None if there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


# Called with (source, inputs, output_dtypes, template) before every emulated launch; one raises to refuse it. The
# tests add the check that the launch's Metal text compiles (tests/metal_model.py), so every launch the emulator
# makes is also a Metal one a Mac could build.
LAUNCH_CHECKS: list[Callable[[KernelSource, Sequence[mx.array], Sequence[mx.Dtype], Sequence[tuple[str, Any]]],
                             None]] = []

_LIBRARIES: dict[str, ctypes.CDLL] = {}
# A launch keeps its state in the library's globals and ctypes releases the GIL: one launch at a time.
_LAUNCH = threading.Lock()


# Without the vectorizer: g++ 12.2 at plain -O2 computed a wrong per-lane sum in the warp-per-vector encode kernel
# (kernels/encode.py: a residual's Σ c² came out as if some coordinates were missing), where -O0, -O1 and -O2
# without tree vectorization all agree with the reference; the cause was not narrowed down further. The flags are
# part of a compiled unit's cache key.
_CXX_FLAGS = ("-O2", "-fno-tree-vectorize", "-std=c++20", "-pthread", "-shared", "-fPIC", "-Wno-unknown-pragmas")


def _library(unit: str) -> ctypes.CDLL:
    """The loaded shared library of `unit`, compiled once per text (on disk across processes)."""
    digest = hashlib.sha256((" ".join(_CXX_FLAGS) + "\n" + unit).encode()).hexdigest()[:24]
    library = _LIBRARIES.get(digest)
    if library is not None:
        return library
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}.so"
    if not path.exists():
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("The kernel emulator needs a C++ compiler (g++ or CXX) on PATH.")
        source = folder / f"{digest}.{os.getpid()}.cpp"
        source.write_text(unit)
        partial = folder / f"{digest}.{os.getpid()}.so"
        result = subprocess.run(
            [cxx, *_CXX_FLAGS, "-o", str(partial), str(source)],
            capture_output=True, text=True,
        )
        if result.returncode:
            raise RuntimeError(f"Compiling the emulated kernel failed ({source}):\n{result.stderr[-4000:]}")
        source.unlink()
        os.replace(partial, path)  # atomic: a concurrent process sees no half-written library
    library = ctypes.CDLL(str(path))
    library.emu_launch.restype = ctypes.c_int
    library.emu_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int32),
                                   ctypes.POINTER(ctypes.c_int32), ctypes.c_int, ctypes.c_uint,
                                   ctypes.c_char_p, ctypes.c_int]
    _LIBRARIES[digest] = library
    return library


def _empty(shape: Sequence[int], dtype: mx.Dtype, init_value: float | None) -> np.ndarray:
    np_type = _TYPES[dtype][0]
    if init_value is not None:
        return np.full(shape, init_value, dtype=np_type)
    if np.issubdtype(np_type, np.floating):
        return np.full(shape, np.nan, dtype=np_type)  # an element no thread writes stays visible
    return np.full(shape, -1).astype(np_type) if np_type is not np.bool_ else np.ones(shape, dtype=np_type)


class EmulatedKernel:
    """Called like an MLX kernel object (inputs, template, grid, threadgroup, output_shapes, output_dtypes)."""

    def __init__(self, source: KernelSource, seed: int = 0) -> None:
        self.source = source
        self.seed = seed

    def __call__(
        self,
        *,
        inputs: Sequence[mx.array],
        template: Sequence[tuple[str, Any]] = (),
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        init_value: float | None = None,
        **_: Any,  # verbose, stream: nothing to do on the host
    ) -> list[mx.array]:
        source = self.source
        if len(inputs) != len(source.input_names) or len(output_shapes) != len(source.output_names):
            raise ValueError(f"{source.name}: {len(source.input_names)} inputs and "
                             f"{len(source.output_names)} outputs expected")
        if tuple(threadgroup[1:]) != (1, 1):
            raise ValueError(f"The dialect's threadgroups are one-dimensional, not {threadgroup}.")
        if any(g % t for g, t in zip(grid, threadgroup, strict=True)):
            # Metal would launch a partial last threadgroup, CUDA a whole one: the kernels never rely on either
            raise ValueError(f"The grid {grid} is not a whole number of threadgroups {threadgroup}.")
        for check in LAUNCH_CHECKS:
            check(source, inputs, output_dtypes, template)
        arrays = [np.ascontiguousarray(np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16)
                                                else a)) for a in inputs]
        outputs = [_empty(shape, dtype, init_value) for shape, dtype in zip(output_shapes, output_dtypes,
                                                                              strict=True)]
        dtypes = [a.dtype for a in inputs] + list(output_dtypes)
        types = {name: _TYPES[dtype][1] for name, dtype in zip(_arrays(source), dtypes, strict=True)}
        library = _library(assemble_unit(source, types, template))

        unchanged = [a.copy() for a in arrays]
        every = arrays + outputs
        if any(a.ndim > MAX_DIMS for a in every):
            raise ValueError(f"The emulator passes shapes of at most {MAX_DIMS} dimensions.")
        pointers = (ctypes.c_void_p * len(every))(*(a.ctypes.data for a in every))
        shapes = np.zeros((len(every), MAX_DIMS), dtype=np.int32)
        for row, a in zip(shapes, every, strict=True):
            row[: a.ndim] = a.shape
        blocks = np.array([g // t for g, t in zip(grid, threadgroup, strict=True)], dtype=np.int32)
        error = ctypes.create_string_buffer(1024)
        with _LAUNCH:
            status = library.emu_launch(pointers, shapes.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                        blocks.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                        int(threadgroup[0]), self.seed, error, len(error))
        if status:
            raise RuntimeError(f"Emulated kernel {source.name}: {error.value.decode()}")
        for name, array, before in zip(source.input_names, arrays, unchanged, strict=True):
            if not np.array_equal(array, before, equal_nan=True):
                raise RuntimeError(f"Emulated kernel {source.name} left its input {name!r} changed (MLX holds inputs "
                                   "as immutable arrays: a kernel may use one as scratch only if it restores it).")
        return [mx.array(out).astype(dtype) for out, dtype in zip(outputs, output_dtypes, strict=True)]


def emulated_kernel(source: KernelSource) -> EmulatedKernel:
    """A callable with the call signature of `mx.fast.cuda_kernel(...)`'s object that runs `source` on the CPU."""
    return EmulatedKernel(source)
