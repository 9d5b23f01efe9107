"""`mx.compile` for the encode's chains of small operations, where a GPU runs them.

A prefill chunk's encode is mostly element-wise work on a few megabytes (the symmetric values' scales and codes, the
bit packing, each key block's outlier and its residual, the 2-bit level's clip search): on a GPU each MLX operation
is a launch of a few microseconds of work, so the count of operations, not their arithmetic, sets the time. One
8B-shaped layer's 2,048-token encode took 1.72 ms at the 3-bit level against 0.25 ms at the 4-bit level, whose
encode is one `mx.quantize` per width (H200, `benchmarks/results/prefill-layer-3bit-h200.json`). Compiled, MLX fuses
each run of element-wise operations into one kernel; the reductions between them stay launches of their own.

Only on a GPU: on the CPU `mx.compile` needs a C++ compiler at run time (`engine/runtime/cpu/attention.py` checks
for one), there the launch count costs little, and the CPU path is the reference every test reads. Non-array
arguments (a role's name, bits, group size) are compile-time constants: a new value traces the function again, as
does a new input shape (a prompt's last, shorter chunk). The first call of each form on a process pays the trace and
MLX's compile of its fused kernels (once; later chunks and prompts reuse them). mlx-lm compiles its own activations
the same way; what a fresh process's first prompt pays for these has not been measured yet, on CUDA (NVRTC) or on
Metal (BENCHMARKS.md, round 17).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import mlx.core as mx

# decode.py's SPEC#COMPILE_ENCODE=false times the eager form beside the compiled one in the same run.
COMPILE_ENCODE = True

Function = TypeVar("Function", bound=Callable[..., object])


def compiled_on_gpu(function: Function) -> Function:
    """`function` through `mx.compile` while the default device is a GPU (and COMPILE_ENCODE holds), as written
    elsewhere. Its arguments must be positional: arrays, and constants that select a form."""
    compiled = mx.compile(function)

    @functools.wraps(function)
    def call(*args: object) -> object:
        if COMPILE_ENCODE and mx.default_device() == mx.gpu:
            return compiled(*args)
        return function(*args)

    call.eager = function  # type: ignore[attr-defined]  # for tests comparing the two forms
    return call  # type: ignore[return-value]
