"""pyproject declares exactly what engine/ and app/ import: every third-party import has a declared
distribution (so a clean install runs), and every declared runtime dependency is imported (nothing dead)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Imported on purpose without being declared, each for a stated reason.
UNDECLARED_OK = {
    "AppKit": "PyObjC, optional: hides the Dock icon when run unbundled on macOS (app/main.py)",
}


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in ("cpu", "cuda"):  # the Linux MLX backends: exactly one of them is installed
        specs += project["optional-dependencies"][extra]
    return {_normalise(re.split(r"[\s<>=!;\[~]", spec, maxsplit=1)[0]) for spec in specs}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_top_level_modules() -> set[str]:
    modules: set[str] = set()
    for path in [*ROOT.joinpath("engine").rglob("*.py"), *ROOT.joinpath("app").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    # `benchmarks` is the checkout's harness, found beside the package by `velox bench` (never installed).
    local = {"engine", "app", "benchmarks", "__future__"}
    return {m for m in modules if m not in sys.stdlib_module_names and m not in local}


def test_every_third_party_import_is_declared() -> None:
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    undeclared = []
    for module in sorted(_imported_top_level_modules()):
        if module in UNDECLARED_OK:
            continue
        owners = {_normalise(name) for name in distributions.get(module, [])}
        if not owners & declared:
            undeclared.append(f"{module} (from {sorted(owners) or 'no installed distribution'})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_every_declared_dependency_is_used() -> None:
    distributions = importlib.metadata.packages_distributions()
    provided = {_normalise(dist) for module in _imported_top_level_modules() for dist in distributions.get(module, [])}
    provided |= {_normalise(module) for module in _imported_top_level_modules()}
    # The MLX backend wheels and OpenBLAS are loaded as libraries, not imported by name; cryptography is
    # imported by pypdf to open AES-encrypted PDFs (tests/hostile/test_documents_hostile.py).
    loaded_not_imported = {"mlx-cpu", "mlx-cuda-13", "scipy-openblas32", "cryptography"}
    unused = sorted(_declared() - provided - loaded_not_imported)
    assert not unused, f"declared in pyproject.toml but never imported by engine/ or app/: {unused}"
