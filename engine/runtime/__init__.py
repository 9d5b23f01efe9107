"""Process-level setup that must happen before MLX is first imported.

`import engine` calls `prepare_runtime()` (see engine/__init__.py), so nothing else needs to. This
package and `engine.runtime.cpu` are imported before MLX: their `__init__` modules, `cpu/blas.py` and
`cpu/elf_shim.py` must never import mlx (tests/test_layering.py checks it). Facts about the runtime
(versions, device, what the fast path did) are in `engine.runtime.status`.
"""

from __future__ import annotations

import logging
import os

from engine.runtime.cpu.blas import FastBlasStatus, enable_fast_blas


def prepare_runtime() -> FastBlasStatus:
    """Enable the optional CPU fast path; idempotent, never raises, returns what it did.

    On Linux x86-64 the fast path routes MLX's BLAS calls to OpenBLAS; it has to be loaded before
    `mlx.core`. Everywhere else, and whenever it cannot be enabled, this does nothing but say why."""
    _quiet_library_chatter()
    return enable_fast_blas()


def _quiet_library_chatter() -> None:
    """Keep transformers' messages for developers off the user's terminal: "PyTorch was not found" at
    import (Velox needs only its tokenizers) and "... will result in indexing errors" when a long document
    is counted (Velox checks lengths against the context itself and says what to do)."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)
