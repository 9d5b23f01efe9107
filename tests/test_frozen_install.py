"""The installed app, as a user gets it: a wheel installed (not editable) into a fresh environment with no
pip and no network, the model taken from a bundled resource, answering a real question; and the desktop
app opening its window on an X display."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

from engine.models.default_model import default_gguf_path

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
# No route out: proxies and the model's address point at a closed local port.
NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1",
              "VELOX_DEFAULT_MODEL_URL": "http://127.0.0.1:9/offline.whl", "no_proxy": ""}


@pytest.fixture(scope="module")
def installed(tmp_path_factory, default_model_path) -> dict[str, Path]:
    """A fresh venv holding the built wheel and (linked) the test environment's dependencies, minus pip,
    setuptools and the editable install of this checkout."""
    work = tmp_path_factory.mktemp("frozen")
    # Build from a copy: setuptools writes build/ and *.egg-info into the source tree, and those must not
    # appear in the checkout the rest of the suite runs from.
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "engine", "app"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (ROOT / name).is_dir() else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(work / "dist"), str(source)], check=True, capture_output=True, cwd=work)
    wheel = next((work / "dist").glob("velox_chat-*.whl"))
    fresh = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    with zipfile.ZipFile(wheel) as archive:  # a pure-Python wheel: installing is unpacking into purelib
        archive.extractall(target)
    ours = Path(sysconfig.get_paths()["purelib"])
    blocked = ("pip", "setuptools", "_distutils_hack", "distutils-precedence.pth", "__editable__", "velox_chat",
               "engine", "app", "benchmarks")
    for entry in ours.iterdir():
        if not entry.name.startswith(blocked) and not (target / entry.name).exists():
            (target / entry.name).symlink_to(entry)
    resources = work / "Velox.app" / "Contents" / "Resources"  # where the bundle keeps the model
    resources.mkdir(parents=True)
    (resources / default_gguf_path().name).symlink_to(default_gguf_path())
    env = {**os.environ, **NO_NETWORK, "RESOURCEPATH": str(resources), "VELOX_DATA_DIR": str(work / "data"),
           "VELOX_LOG_DIR": str(work / "logs"), "PYTHONPATH": "", "PYTHONNOUSERSITE": "1"}
    return {"python": python, "work": work, "site": target, "env": env}  # type: ignore[dict-item]


def _run(installed: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(installed["python"]), *args], cwd=installed["work"], env=installed["env"],
                          capture_output=True, text=True, timeout=timeout)


def test_the_installed_package_is_the_one_that_runs(installed) -> None:
    where = _run(installed, "-c", "import engine, app, app.assets; print(engine.__file__); "
                 "print(app.assets.asset_path('velox-icon.png'))")
    assert where.returncode == 0, where.stderr
    for line in where.stdout.split():
        assert Path(line).is_relative_to(installed["site"]), line
    assert _run(installed, "-m", "pip", "--version").returncode != 0, "pip must not be available"


def test_the_installed_cli_answers_from_the_bundled_model(installed) -> None:
    result = _run(installed, "-m", "app.cli", "chat", "--prompt", "What is the capital of France?",
                  "--max-tokens", "16")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout
    assert (installed["work"] / "data" / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file()
    assert not (installed["work"] / "data" / "downloads").exists(), "the bundled file is used, nothing fetched"


def _x_display_tools() -> str | None:
    missing = [tool for tool in ("Xvfb", "xwininfo") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (Debian: xvfb, x11-utils)"
    from app.qt_platform import qt_platform_problem

    return qt_platform_problem({"DISPLAY": ":0"}, sys.platform)


@pytest.mark.skipif(_x_display_tools() is not None, reason=str(_x_display_tools()))
def test_the_installed_app_shows_its_window_on_an_x_display(installed) -> None:
    display = ":97"
    xvfb = subprocess.Popen(["Xvfb", display, "-screen", "0", "1280x800x24", "-nolisten", "tcp"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**installed["env"], "DISPLAY": display, "QT_QPA_PLATFORM": "xcb"}
    app = subprocess.Popen([str(installed["python"]), "-m", "app"], cwd=installed["work"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, tree = time.monotonic() + 120, ""
        while time.monotonic() < deadline and app.poll() is None:
            tree = subprocess.run(["xwininfo", "-root", "-tree"], env=env, capture_output=True, text=True).stdout
            if '"Velox"' in tree:
                break
            time.sleep(1)
        assert app.poll() is None, f"the app exited: {app.stdout.read()[-2000:]}"
        assert '"Velox"' in tree, "no window titled Velox appeared"
    finally:
        app.terminate()
        app.wait(timeout=30)
        xvfb.terminate()
        xvfb.wait(timeout=10)
