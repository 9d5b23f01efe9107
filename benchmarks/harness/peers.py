"""The PyPI package `veloxquant-mlx` as a peer: installed into a venv that this module creates (never a Velox
dependency; under the user cache dir unless `velox bench --peer-venv DIR` says where), then driven through its
own `KVCacheBuilder` by the same worker tasks that measure Velox, on the same model, text and machine.

The venv gets the same mlx, mlx-lm and OpenBLAS versions as Velox's environment (so differences are the
caches', not the runtime's) plus the few packages `engine` needs to load the model (psutil, platformdirs).
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import platformdirs

from benchmarks.harness.common import log
from engine.paths import APP_NAME

VELOXQUANT_PACKAGE = "veloxquant-mlx"
VELOXQUANT_VERSION = "0.94.15"


def default_venv() -> Path:
    """Where the peer's venv lives unless told otherwise: the user cache dir (rebuildable at any time)."""
    cache = Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))
    return cache / "bench" / f"{VELOXQUANT_PACKAGE}-{VELOXQUANT_VERSION}-venv"


def _pinned(name: str) -> str:
    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        return name


def requirements() -> list[str]:
    mlx = _pinned("mlx")
    mlx_requirement = mlx.replace("mlx==", "mlx[cpu]==") if sys.platform == "linux" else mlx
    wanted = [f"{VELOXQUANT_PACKAGE}=={VELOXQUANT_VERSION}", mlx_requirement, _pinned("mlx-lm"), "psutil", "platformdirs"]
    try:
        version("scipy-openblas32")
        wanted.append(_pinned("scipy-openblas32"))
    except PackageNotFoundError:
        pass
    return wanted


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def ensure_veloxquant_venv(venv: Path | None = None) -> tuple[str | None, str]:
    """(python of a venv with veloxquant-mlx, note) or (None, the reason it could not be made); `venv`
    defaults to `default_venv()`."""
    venv = Path(venv).expanduser() if venv is not None else default_venv()
    python = venv_python(venv)
    wanted = requirements()
    if python.is_file():
        check = subprocess.run(
            [str(python), "-c", f"from importlib.metadata import version; print(version('{VELOXQUANT_PACKAGE}'))"],
            capture_output=True, text=True,
        )
        if check.returncode == 0 and check.stdout.strip() == VELOXQUANT_VERSION:
            return str(python), f"reused {venv} ({VELOXQUANT_PACKAGE} {VELOXQUANT_VERSION})"
    log(f"peers: creating {venv} with {' '.join(wanted)}")
    try:
        if not python.is_file():
            venv.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *wanted], capture_output=True, text=True, timeout=1800,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"could not create the venv {venv}: {error}"
    if done.returncode != 0:
        return None, f"pip could not install {' '.join(wanted)}: {done.stderr.strip()[-1500:]}"
    return str(python), f"created {venv} with {' '.join(wanted)}"
