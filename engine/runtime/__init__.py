"""Process-level setup that must happen before MLX is first imported, and facts about the runtime."""

from __future__ import annotations

import logging
import os
from typing import Any

_fast_blas_status: Any = None


def prepare_runtime() -> None:
    """Call once, first thing, from an entry point (CLI, app, benchmark).

    On Linux the optional CPU fast path routes MLX's BLAS calls to an optimized library; it has to be
    loaded before `mlx.core`. Everywhere else, and whenever it cannot be enabled, this does nothing."""
    global _fast_blas_status
    _quiet_library_chatter()
    if _fast_blas_status is not None:
        return
    try:
        from engine.runtime.cpu.fastpath import enable_fast_blas
    except ImportError:
        _fast_blas_status = "not available"
        return
    _fast_blas_status = enable_fast_blas()


def _quiet_library_chatter() -> None:
    """Keep transformers' messages for developers off the user's terminal: "PyTorch was not found" at
    import (Velox needs only its tokenizers) and "... will result in indexing errors" when a long document
    is counted (Velox checks lengths against the context itself and says what to do)."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)


def runtime_status() -> dict[str, str]:
    import mlx.core as mx

    status = {
        "mlx": getattr(mx, "__version__", "unknown"),
        "device": str(mx.default_device()),
        "cpu fast path": str(_fast_blas_status if _fast_blas_status is not None else "not requested"),
    }
    import mlx_lm

    status["mlx-lm"] = getattr(mlx_lm, "__version__", "unknown")
    return status
