"""Facts about the runtime of this process, for `velox info` and benchmark records."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm

from engine.runtime.cpu.blas import fast_blas_status


def on_gpu() -> bool:
    """Whether MLX computes on a GPU in this process (Metal on a Mac, CUDA on NVIDIA): the default device."""
    return mx.default_device() == mx.gpu


def runtime_status() -> dict[str, str]:
    """MLX and mlx-lm versions, the default device, and what the CPU fast path did (one line each)."""
    status = fast_blas_status()
    return {
        "mlx": getattr(mx, "__version__", "unknown"),
        "device": str(mx.default_device()),
        "cpu fast path": str(status if status is not None else "not requested"),
        "mlx-lm": getattr(mlx_lm, "__version__", "unknown"),
    }
