#!/usr/bin/env python3
"""Set up Velox in a local virtual environment and run it, or run its tests.

    python3 tasks.py run [ARGS...]    # set up, then start the app (ARGS go to the `velox` command line)
    python3 tasks.py test [ARGS...]   # set up (with test extras), then lint and run the test suite

Only Python 3.11+ is needed beforehand; everything else is installed into ./.venv.
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


def _venv_python() -> Path:
    if os.name == "nt":
        return VENV / "Scripts" / "python.exe"
    return VENV / "bin" / "python"


def _fingerprint(extras: str) -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(extras.encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()


def setup(extras: str) -> Path:
    """Create ./.venv and install the project (editable) with the given extras, once per pyproject."""
    if sys.version_info < (3, 11):  # noqa: UP036 - tasks.py may be run by an older python3
        sys.exit(f"Velox needs Python 3.11 or newer; this is {sys.version.split()[0]}.")
    python = _venv_python()
    if not python.exists():
        print("Creating virtual environment in .venv ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp = VENV / ".velox-installed"
    wanted = _fingerprint(extras)
    if not stamp.exists() or stamp.read_text() != wanted:
        print(f"Installing velox-chat[{extras}] into .venv ...", flush=True)
        subprocess.check_call([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
        target = f".[{extras}]" if extras else "."
        subprocess.check_call([str(python), "-m", "pip", "install", "--quiet", "-e", target], cwd=ROOT)
        stamp.write_text(wanted)
    return python


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"run", "test"}:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        python = setup("")
        args = rest or ["app"]
        return subprocess.call([str(python), "-m", "app.cli", *args], cwd=ROOT)
    python = setup("test")
    lint = subprocess.call([str(python), "-m", "ruff", "check", "engine", "app", "tests", "benchmarks", "tasks.py"], cwd=ROOT)
    if lint != 0:
        return lint
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    return subprocess.call([str(python), "-m", "pytest", *(rest or ["-q"])], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
