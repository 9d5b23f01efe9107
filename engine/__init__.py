"""Velox engine: local LLM chat with a compressed KV cache. Never imports Qt.

Importing `engine` first prepares the runtime (`engine.runtime.prepare_runtime`): on Linux x86-64 the
CPU fast path routes MLX's BLAS calls to OpenBLAS, which works only if it happens before `mlx.core` is
loaded. This package's `__init__` is the one place that runs before any engine module can import MLX,
whoever imports what first (the CLI, the app, a test, a notebook doing `import engine.kvcache`), so
every other module imports mlx at the top, as mlx-lm does. The side effect is deliberate and visible:
on first use it writes a small cached shim under the data directory and self-tests it in a subprocess;
`VELOX_FAST_BLAS=0` turns it off, and `engine.runtime.status.runtime_status()` says what it did. It never
raises and never touches macOS or non-x86 machines. Importing mlx yourself before `engine` leaves MLX's
stock BLAS in place (the status says so).
"""

from engine.runtime import prepare_runtime

__version__ = "0.1.0"

prepare_runtime()
