"""GPU kernels of the compressed caches (Metal and CUDA from one body each; see `backend.py`).

The pure-MLX code in `engine/kvcache/base.py` and the methods stays the reference, the CPU path and the
test oracle; a kernel replaces it only where a GPU backend runs custom kernels. Which one runs is the
cache option `kernels` (`KVCacheConfig(options={"kernels": ...})`):

    "auto"     (default) the fused kernels where the default device is a GPU with a kernel backend and the
               method and shape have a kernel; the reference path elsewhere.
    "require"  the same, but a decode step that cannot use a kernel raises ConfigError saying why (no GPU
               backend, an unsupported head_dim or bit width, a mask array) instead of falling back.
    "off"      always the reference path.

What the kernels cover: single-token decode attention (one new query token per sequence, no mask or
mlx-lm's "causal" string, which for one query masks nothing) over every compressed method's storage; the
decode of a cache's whole compressed history into 16-bit keys and values, which a prefill chunk attends over
(`dequantize.py`: every method's codes without a grid, KIVI's and the sketched keys' included; `dequantize.supported`
says which on which backend); and, for the codebook methods, the encode of new tokens. Prefill chunks (several query tokens) otherwise take the reference path under every setting.

The auto choice on Metal. MLX's Metal `quantized_matmul` has a fast single-row kernel (qmv) for the affine
and KIVI codes, so `kernels="off"` is a reasonable path there too; but that path is ~10 dependent launches
per layer (two quantized matmuls, 16-bit segment matmuls, concatenation, softmax, sums), and it reads the
codes once per query row block rather than once per kv head. The fused kernel is one pass plus a tiny
merge, so "auto" picks it on Metal as on CUDA. This was not measured on a Mac (there is none here); if a
Metal measurement shows quantized_matmul faster for a shape, `kernels="off"` selects it per cache. Nor has a
Metal compiler seen the kernels: the tests check each emulated launch's Metal text with clang against a model of
MSL (tests/metal_model.py), which is what stands between a Metal-only spelling error and a Mac. Where the comments
on the backend lists say a kernel runs on Metal "by construction", that is the claim the model checks.

Metal binds a kernel's arrays to at most 31 buffer arguments (`backend.over_buffer_limit`;
benchmarks/results/metal-buffers.json). The tiled decode pass, which the app's levels decode through, takes 30: KIVI's
key-width classes keep one array of scales, biases and outliers for all of them (only their codes are per class), its
two grids are one input, and it derives its arrays' row lengths from the capacity instead of reading their shapes
(each shape a body reads is one more buffer). It took 47 before, and no Mac could have built it; the polar decode
pass took 35-37 (a centroid table per level, now one array per role) and takes 25. Every kernel fits now; were one
past the limit, a cache would take another kernel that reads its layout, or the reference path.
"""

from __future__ import annotations

import mlx.core as mx

from engine.errors import ConfigError
from engine.kvcache.kernels import backend as backend_module
from engine.kvcache.kernels.backend import BACKENDS, KernelSource, assemble, available_backend
from engine.kvcache.kernels.decode import Codec, DecodePlan, decode_attention, plan_decode
from engine.kvcache.kernels.dequantize import dequantize_history

KERNEL_MODES = ("auto", "require", "off")
DEFAULT_KERNEL_MODE = "auto"


def check_kernel_mode(value: object) -> str:
    """The option's value if it is one of KERNEL_MODES; ConfigError otherwise."""
    if value not in KERNEL_MODES:
        raise ConfigError(f"The kernels option must be {', '.join(map(repr, KERNEL_MODES))}, not {value!r}.")
    return str(value)


def resolve_backend(mode: str, unsupported_reason: str | None = None) -> str | None:
    """The backend a decode step should use under `mode`, or None for the reference path.

    `unsupported_reason` is why the cache itself cannot use a kernel (None when it can). Under "require"
    any reason not to use a kernel is a ConfigError.
    """
    if mode == "off":
        return None
    backend = available_backend()
    reason = unsupported_reason
    if backend is None:
        reason = (
            f"the default device ({mx.default_device()}) has no GPU kernel backend "
            "(MLX's Metal or CUDA build on a GPU device)"
        )
        if backend_module.disabled_reason() is not None:
            reason = f"kernels were turned off in this process: {backend_module.disabled_reason()}"
    if reason is not None:
        if mode == "require":
            raise ConfigError(f"kernels='require' but {reason}.")
        return None
    return backend


__all__ = [
    "BACKENDS",
    "DEFAULT_KERNEL_MODE",
    "KERNEL_MODES",
    "Codec",
    "DecodePlan",
    "KernelSource",
    "assemble",
    "available_backend",
    "check_kernel_mode",
    "decode_attention",
    "dequantize_history",
    "plan_decode",
    "resolve_backend",
]
