"""Shared helpers for the CPU fast path tests (no tests here): fresh interpreters for anything that must
set up MLX's BLAS before MLX loads, and the Linux x86-64 marker."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.runtime.cpu import blas

REPO_ROOT = Path(__file__).resolve().parent.parent
linux_x86_64_only = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the OpenBLAS shim is a Linux x86-64 feature",
)


def run_python(script: str, *arguments: str, data_dir: Path, extra_env: dict[str, str] | None = None) -> dict:
    """Run ``script`` in a fresh interpreter from the repo root; it must print one JSON line last."""
    environment = {**os.environ, "VELOX_DATA_DIR": str(data_dir), "PYTHONPATH": str(REPO_ROOT)}
    # The thread-count variables would override the counts the tests check.
    for name in (blas.ENV_SWITCH, blas.ENV_THREADS, "OPENBLAS_NUM_THREADS"):
        environment.pop(name, None)
    environment.update(extra_env or {})
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *arguments],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=environment,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def openblas_or_skip() -> Path:
    openblas = blas._find_scipy_openblas32()
    if openblas is None:
        pytest.skip("scipy-openblas32 is not installed: the fast path cannot be enabled here")
    return openblas
