"""Shared fixtures: the real embedded default model, loaded once per test session.

The optional CPU fast path must be set up before MLX is imported: `import engine` does it, here, first."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Tests log to a throwaway folder, never into the user's own Velox log.
os.environ.setdefault("VELOX_LOG_DIR", tempfile.mkdtemp(prefix="velox-test-logs-"))

import pytest  # noqa: E402

import engine  # noqa: E402, F401  (importing it prepares the CPU fast path before any test loads MLX)
from engine.paths import data_dir, models_dir  # noqa: E402

# `velox chat` and the app save conversations and their KV caches in the data folder: the tests (and the
# commands they start) get a folder of their own, which shares the user's converted models and the verified
# GGUF download through links (made before they exist, on a fresh machine), so no test writes into the user's
# conversations and the embedded model is fetched and converted once.
if "VELOX_DATA_DIR" not in os.environ:
    _test_data = tempfile.mkdtemp(prefix="velox-test-data-")
    for _shared in (models_dir(), data_dir() / "downloads"):
        _shared.mkdir(parents=True, exist_ok=True)
        os.symlink(_shared, os.path.join(_test_data, _shared.name), target_is_directory=True)
    os.environ["VELOX_DATA_DIR"] = _test_data


def _check_metal_text_of_every_emulated_launch() -> None:
    """Every launch the kernel emulator makes is also checked as Metal (tests/metal_model.py), unless
    VELOX_METAL_CHECK=0; test_metal_model.py fails where the test extras' libclang does not load."""
    if os.environ.get("VELOX_METAL_CHECK") == "0":
        return
    from tests import metal_model

    if metal_model.available():
        from engine.kvcache.kernels import emulate

        emulate.LAUNCH_CHECKS.append(metal_model.check_launch)


_check_metal_text_of_every_emulated_launch()


@pytest.fixture(scope="session")
def default_model_path():
    """The converted SmolLM2 folder (fetched and converted on first use, then cached in the data dir)."""
    from engine.models.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm(default_model_path):
    """(model, tokenizer, info) of the real default model, loaded once for the whole run."""
    from engine.models.catalog import load_model

    return load_model(default_model_path)
