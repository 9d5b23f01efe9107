"""The layers, read statically from the source (nothing is imported): engine never imports Qt, app never
imports MLX itself (only through engine), module-level imports among engine/ and app/ form no cycle, the
modules `import engine` runs before MLX loads never import MLX, and every import left inside a function
says why in a comment. Each check is also run on a planted violation, so none of them can pass vacuously.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = ("engine", "app")
QT_MODULES = ("PySide6", "PyQt5", "PyQt6", "shiboken6")
MLX_MODULES = ("mlx", "mlx_lm")


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name as written (a relative import resolved)
    names: tuple[str, ...]  # the names of `from module import a, b`; () for `import module`
    line: int
    module_level: bool  # runs when the file is imported (not inside a function, not under TYPE_CHECKING)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path, packages: tuple[str, ...] = PROJECT_PACKAGES) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the packages under `root`."""
    return {
        module_name(root, path): path
        for package in packages
        if (root / package).is_dir()
        for path in sorted((root / package).rglob("*.py"))
    }


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import statement in the file, marked module-level or not."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(statements: list[ast.stmt], module_level: bool) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.extend(Import(alias.name, (), node.lineno, module_level) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    package_parts = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = package_parts[: len(package_parts) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                found.append(Import(base, tuple(alias.name for alias in node.names), node.lineno, module_level))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(node.body, False)
            elif isinstance(node, ast.If):
                visit(node.body, module_level and not _is_type_checking(node.test))
                visit(node.orelse, module_level)
            elif isinstance(node, ast.Try | ast.TryStar):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block, module_level)
            elif isinstance(node, ast.ClassDef | ast.With | ast.For | ast.While):
                visit(node.body, module_level)
                visit(getattr(node, "orelse", []), module_level)

    visit(ast.parse(path.read_text(encoding="utf-8")).body, True)
    return found


def _ancestors(module: str) -> Iterator[str]:
    parts = module.split(".")
    for end in range(1, len(parts)):
        yield ".".join(parts[:end])


def import_graph(root: Path, packages: tuple[str, ...] = PROJECT_PACKAGES) -> dict[str, set[str]]:
    """{module: project modules its module-level imports run}. Importing `a.b.c` from outside package `a.b`
    also runs `a/b/__init__.py` (and `a/__init__.py`), so those count as edges too; a package's own
    modules do not depend on it that way (it is already being imported when they run)."""
    modules = project_modules(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for item in imports_of(module, path):
            if not item.module_level:
                continue
            candidates = [f"{item.module}.{name}" for name in item.names] or [item.module]
            for candidate in candidates:
                target = candidate if candidate in modules else item.module
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if not target:
                    continue
                targets.add(target)
                own_packages = set(_ancestors(module)) | ({module} if path.name == "__init__.py" else set())
                targets.update(a for a in _ancestors(target) if a in modules and a not in own_packages)
        targets.discard(module)
        graph[module] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = lowlink[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                lowlink[node] = min(lowlink[node], lowlink[target])
            elif target in on_stack:
                lowlink[node] = min(lowlink[node], index[target])
        if lowlink[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(cycles)


def forbidden_imports(root: Path, package: str, forbidden: tuple[str, ...]) -> list[str]:
    """'file:line module' for each import in `package` (at any depth, even inside functions) of a
    module in `forbidden` or below it."""
    problems = []
    for module, path in project_modules(root, (package,)).items():
        for item in imports_of(module, path):
            if item.module.split(".")[0] in forbidden:
                problems.append(f"{path.relative_to(root)}:{item.line} {item.module}")
    return problems


def loaded_before_mlx(root: Path, first: str = "engine") -> set[str]:
    """The project modules `import engine` runs at module level, transitively, `engine` included."""
    graph = import_graph(root)
    seen, todo = set(), [first]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def mlx_imports_before_the_bootstrap(root: Path) -> list[str]:
    """'module: mlx module' for each module-level MLX import among the modules `import engine` runs
    before it has prepared the runtime (they must not load MLX: the CPU fast path needs to come first)."""
    modules = project_modules(root)
    return [
        f"{module}: {item.module}"
        for module in sorted(loaded_before_mlx(root))
        for item in imports_of(module, modules[module])
        if item.module_level and item.module.split(".")[0] in MLX_MODULES
    ]


def uncommented_function_imports(root: Path) -> list[str]:
    """'file:line' for each import inside a function with no comment on its line, nor on the line just
    above the run of imports it belongs to."""
    problems = []
    for module, path in project_modules(root).items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for item in imports_of(module, path):
            if item.module_level or "TYPE_CHECKING" in "".join(lines[max(0, item.line - 3) : item.line]):
                continue
            number = item.line - 1  # 0-based
            while number > 0 and lines[number - 1].lstrip().startswith(("import ", "from ")):
                number -= 1
            nearby = lines[number - 1 : item.line] if number > 0 else lines[: item.line]
            # the statement may span lines: its own first line counts too
            if not any("#" in line for line in [*nearby, lines[item.line - 1]]):
                problems.append(f"{path.relative_to(root)}:{item.line}")
    return problems


# ------------------------------------------------------------------------------------------ the real tree


def test_engine_never_imports_qt() -> None:
    assert forbidden_imports(REPO_ROOT, "engine", QT_MODULES) == []


def test_app_reaches_mlx_only_through_engine() -> None:
    assert forbidden_imports(REPO_ROOT, "app", MLX_MODULES) == []


def test_no_import_cycles_among_engine_and_app_modules() -> None:
    graph = import_graph(REPO_ROOT)
    assert "engine.kvcache.base" in graph and "app.main" in graph  # the walk found the tree
    assert import_cycles(graph) == []


def test_what_import_engine_runs_before_mlx_never_imports_mlx() -> None:
    assert {"engine", "engine.runtime", "engine.runtime.cpu.blas"} <= loaded_before_mlx(REPO_ROOT)
    assert mlx_imports_before_the_bootstrap(REPO_ROOT) == []


def test_imports_left_inside_functions_say_why() -> None:
    assert uncommented_function_imports(REPO_ROOT) == []


# ------------------------------------------------------------------------------- planted violations


def _plant(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for package in ("engine", "app"):
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").touch()
    return root


def test_planted_qt_import_in_engine_is_found(tmp_path: Path) -> None:
    root = _plant(tmp_path, {"engine/view.py": "def show():\n    from PySide6.QtWidgets import QLabel\n"})
    assert forbidden_imports(root, "engine", QT_MODULES) == ["engine/view.py:2 PySide6.QtWidgets"]


def test_planted_mlx_import_in_app_is_found(tmp_path: Path) -> None:
    root = _plant(tmp_path, {"app/panel.py": "import os\nimport mlx.core as mx\n", "app/ok.py": "import engine\n"})
    assert forbidden_imports(root, "app", MLX_MODULES) == ["app/panel.py:2 mlx.core"]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # two modules importing each other, one of them relatively
        ({"engine/a.py": "from engine.b import thing\n", "engine/b.py": "from . import a\nthing = 1\n"},
         [["engine.a", "engine.b"]]),
        # a cycle through a package's __init__: importing engine.kv.masks from outside runs engine/kv/__init__
        ({"engine/kv/__init__.py": "from engine.kv.base import Cache\n",
          "engine/kv/base.py": "from engine.attn import attend\nclass Cache: ...\n",
          "engine/kv/masks.py": "mask = None\n",
          "engine/attn.py": "from engine.kv.masks import mask\ndef attend(): ...\n"},
         [["engine.attn", "engine.kv", "engine.kv.base"]]),
    ],
)
def test_planted_cycles_are_found(tmp_path: Path, files: dict[str, str], expected: list[list[str]]) -> None:
    assert import_cycles(import_graph(_plant(tmp_path, files))) == expected


def test_function_and_type_checking_imports_make_no_cycle(tmp_path: Path) -> None:
    root = _plant(tmp_path, {
        "engine/a.py": "from engine.b import thing\n",
        "engine/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.a import x\n"
                       "def late():\n    from engine.a import y  # why\nthing = 1\n",
        "engine/pkg/__init__.py": "from engine.pkg.leaf import z\n",
        "engine/pkg/leaf.py": "from engine.pkg import other\nz = 1\n",
        "engine/pkg/other.py": "o = 1\n",
    })
    graph = import_graph(root)
    assert graph["engine.b"] == set()
    assert graph["engine.pkg.leaf"] == {"engine.pkg.other"}  # its own package is no edge
    assert import_cycles(graph) == []


def test_planted_mlx_import_before_the_bootstrap_is_found(tmp_path: Path) -> None:
    root = _plant(tmp_path, {
        "engine/__init__.py": "from engine.runtime import prepare\n",
        "engine/runtime.py": "from engine.helpers import h\ndef prepare(): ...\n",
        "engine/helpers.py": "import mlx.core as mx\nh = 1\n",
        "engine/later.py": "import mlx.core as mx\n",
    })
    assert loaded_before_mlx(root) == {"engine", "engine.runtime", "engine.helpers"}
    assert mlx_imports_before_the_bootstrap(root) == ["engine.helpers: mlx.core"]


def test_planted_uncommented_function_import_is_found(tmp_path: Path) -> None:
    root = _plant(tmp_path, {"engine/m.py": (
        "def a():\n    import json\n"  # no reason given: reported
        "def b():\n    import csv  # lazily: rarely needed\n"
        "def c():\n    # optional dependencies\n    import pypdf\n    import pypdf.errors\n"
    )})
    assert uncommented_function_imports(root) == ["engine/m.py:2"]
