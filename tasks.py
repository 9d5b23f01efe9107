#!/usr/bin/env python3
"""Set up Velox in a local virtual environment and run it, run its tests, or build the macOS app.

    python3 tasks.py run [--cuda] [ARGS...]   # set up, then start the app (ARGS go to the `velox` command line)
    python3 tasks.py test [ARGS...]           # set up (with test extras), then lint and run the test suite
    python3 tasks.py bundle                   # macOS: build dist/Velox.app and dist/Velox.dmg (setup_app.py)
    python3 tasks.py lock                     # rewrite requirements.lock from the current .venv

Only Python 3.11+ is needed beforehand; everything else is installed into ./.venv, with the versions in
requirements.lock (used as pip constraints). On Linux MLX runs on the CPU; `--cuda` (or VELOX_BACKEND=cuda)
installs MLX's CUDA build instead — the two cannot live in one environment, so switching replaces one
with the other.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
LOCK_FILE = ROOT / "requirements.lock"
# The wheel each Linux backend extra brings that carries mlx/lib/libmlx.so (see pyproject's cpu/cuda extras).
BACKEND_WHEELS = {"cpu": ["mlx-cpu"], "cuda": ["mlx-cuda-13", "mlx-cuda-12"]}


def _venv_python() -> Path:
    if os.name == "nt":
        return VENV / "Scripts" / "python.exe"
    return VENV / "bin" / "python"


def backend(argv: list[str]) -> str | None:
    """The Linux MLX backend extra to install ("cpu" or "cuda"); None on macOS, where MLX uses Metal."""
    if sys.platform == "darwin":
        return None
    wanted = "cuda" if "--cuda" in argv else os.environ.get("VELOX_BACKEND", "cpu").strip().lower()
    if wanted not in BACKEND_WHEELS:
        sys.exit(f"VELOX_BACKEND must be 'cpu' or 'cuda', not {wanted!r}.")
    return wanted


def _fingerprint(extras: str) -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    if LOCK_FILE.exists():
        digest.update(LOCK_FILE.read_bytes())
    digest.update(extras.encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()


def setup(extras: list[str], chosen_backend: str | None) -> Path:
    """Create ./.venv and install the project (editable) with the given extras, once per pyproject + lock."""
    if sys.version_info < (3, 11):  # noqa: UP036 - tasks.py may be run by an older python3
        sys.exit(f"Velox needs Python 3.11 or newer; this is {sys.version.split()[0]}.")
    python = _venv_python()
    if not python.exists():
        print("Creating virtual environment in .venv ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    all_extras = ",".join(extras + ([chosen_backend] if chosen_backend else []))
    stamp = VENV / ".velox-installed"
    wanted = _fingerprint(all_extras)
    if not stamp.exists() or stamp.read_text() != wanted:
        print(f"Installing velox-chat[{all_extras}] into .venv ...", flush=True)
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        subprocess.check_call([*pip, "install", "--quiet", "--upgrade", "pip"])
        for other, wheels in BACKEND_WHEELS.items():
            if chosen_backend and other != chosen_backend:  # never two libmlx.so in one environment
                subprocess.call([*pip, "uninstall", "--quiet", "--yes", *wheels],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        constraints = ["-c", str(LOCK_FILE)] if LOCK_FILE.exists() else []
        target = f".[{all_extras}]" if all_extras else "."
        subprocess.check_call([*pip, "install", "--quiet", *constraints, "-e", target], cwd=ROOT)
        stamp.write_text(wanted)
    return python


def lock() -> int:
    """Write requirements.lock: the exact versions installed in .venv (the project itself left out)."""
    python = _venv_python()
    if not python.exists():
        sys.exit("No .venv yet: run `python3 tasks.py test` first.")
    frozen = subprocess.run([str(python), "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout
    pins = sorted((line for line in frozen.splitlines() if "==" in line and not line.startswith("-e")),
                  key=str.lower)
    header = ("# Exact versions for `python3 tasks.py` (pip constraints, not requirements: only what pyproject\n"
              "# asks for is installed). Regenerate with `python3 tasks.py lock` after changing dependencies.\n")
    LOCK_FILE.write_text(header + "\n".join(pins) + "\n")
    print(f"{LOCK_FILE.name}: {len(pins)} pins")
    return 0


def bundle() -> int:
    """Build dist/Velox.app (py2app, ad-hoc signed) and dist/Velox.dmg; macOS only."""
    if sys.platform != "darwin":
        print("The Velox.app bundle is built on macOS (py2app makes Mac bundles only).", file=sys.stderr)
        return 2
    python = setup(["mac"], None)
    return subprocess.call([str(python), "setup_app.py", "bundle"], cwd=ROOT)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"run", "test", "bundle", "lock"}:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "bundle":
        return bundle()
    if command == "lock":
        return lock()
    chosen_backend = backend(rest)
    rest = [arg for arg in rest if arg != "--cuda"]
    if command == "run":
        python = setup([], chosen_backend)
        args = rest or ["app"]
        return subprocess.call([str(python), "-m", "app.cli", *args], cwd=ROOT)
    python = setup(["test"], chosen_backend)
    lint = subprocess.call([str(python), "-m", "ruff", "check", "engine", "app", "tests", "benchmarks", "tasks.py",
                            "setup_app.py", "resources"], cwd=ROOT)
    if lint != 0:
        return lint
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    return subprocess.call([str(python), "-m", "pytest", *(rest or ["-q"])], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
