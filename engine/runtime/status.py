"""Facts about the runtime of this process, for `velox info` and benchmark records."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm

from engine.kvcache.kernels.backend import disabled_reason
from engine.runtime.cpu.blas import fast_blas_status


def on_gpu() -> bool:
    """Whether MLX computes on a GPU in this process (Metal on a Mac, CUDA on NVIDIA): the default device."""
    return mx.default_device() == mx.gpu


def gpu_kernels_off() -> str | None:
    """Why Velox's GPU kernels were turned off in this process (a kernel failed its first run on this GPU:
    engine/kvcache/kernel_check.py), or None while they are on or were never needed."""
    return disabled_reason()


def runtime_status() -> dict[str, str]:
    """MLX and mlx-lm versions, the default device, what the CPU fast path did, and whether the GPU kernels were
    turned off (one line each)."""
    status = fast_blas_status()
    facts = {
        "mlx": getattr(mx, "__version__", "unknown"),
        "device": str(mx.default_device()),
        "cpu fast path": str(status if status is not None else "not requested"),
        "mlx-lm": getattr(mlx_lm, "__version__", "unknown"),
    }
    off = gpu_kernels_off()
    if off is not None:
        facts["gpu kernels"] = f"off: {off}"
    return facts
