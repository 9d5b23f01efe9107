"""Issue 10, items 4, 5 and 9: a damaged converted default model repairs itself; a bad
VELOX_DEFAULT_MODEL_FILE is one line.

Each test works in its own data folder whose GGUF is a symbolic link to the verified one already cached,
so the repair converts (under a second) but never downloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models import default_model
from engine.models.default_model import (
    MARKER_FILE,
    default_gguf_path,
    default_model_dir,
    default_model_problem,
    ensure_default_model,
    is_default_model_ready,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def private_default_model(default_model_path, tmp_path, monkeypatch):
    """A converted default model in a fresh data folder, sharing only the (read-only) cached GGUF."""
    real_gguf = default_gguf_path()
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("VELOX_DEFAULT_MODEL_FILE", raising=False)
    default_gguf_path().parent.mkdir(parents=True)
    default_gguf_path().symlink_to(real_gguf)
    folder = ensure_default_model()
    assert default_model_problem(folder) is None
    return folder


def test_conversion_records_size_and_checksum_of_every_file(private_default_model):
    record = json.loads((private_default_model / MARKER_FILE).read_text())
    names = {entry.name for entry in private_default_model.iterdir() if entry.name != MARKER_FILE}
    assert set(record["files"]) == names and "model.safetensors" in names
    weights = record["files"]["model.safetensors"]
    assert weights["size"] == (private_default_model / "model.safetensors").stat().st_size
    assert len(weights["sha256"]) == 64


@pytest.mark.parametrize("damage", ["truncate", "delete", "overwrite"])
def test_damaged_default_model_is_converted_again(private_default_model, damage):
    weights = private_default_model / "model.safetensors"
    original = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(original[: len(original) // 2])
    elif damage == "delete":
        weights.unlink()
    else:  # same size, 40 MB of it overwritten: only the checksum can tell
        with weights.open("r+b") as stream:
            stream.seek(20_000_000)
            stream.write(b"\xff" * 40_000_000)
    problem = default_model_problem(private_default_model)
    assert problem is not None and "model.safetensors" in problem
    if damage != "overwrite":
        assert not is_default_model_ready()  # the picker's cheap check already sees it
    messages = []
    folder = ensure_default_model(lambda message, fraction: messages.append(message))
    assert folder == private_default_model == default_model_dir()
    assert messages[0].startswith("Repairing the default model (model.safetensors")
    assert weights.read_bytes() == original  # the conversion is deterministic: the same bytes come back
    assert default_model_problem(folder) is None and is_default_model_ready()


def test_marker_from_an_older_velox_without_checksums_is_converted_again(private_default_model):
    marker = private_default_model / MARKER_FILE
    old = json.loads(marker.read_text())
    del old["files"]
    marker.write_text(json.dumps(old))
    assert not is_default_model_ready()
    ensure_default_model()
    assert "files" in json.loads(marker.read_text())


def test_damaged_cached_gguf_is_fetched_again(private_default_model, tmp_path, monkeypatch):
    # The cached GGUF itself is damaged (a real copy here, not the shared link); the local wheel or GGUF
    # named by VELOX_DEFAULT_MODEL_FILE stands in for the network.
    real_gguf = default_gguf_path().resolve()
    default_gguf_path().unlink()
    default_gguf_path().write_bytes(b"GGUF" + b"\0" * 1000)
    (private_default_model / "model.safetensors").unlink()
    monkeypatch.setattr(default_model, "_download_wheel", _no_network)
    monkeypatch.setenv("VELOX_DEFAULT_MODEL_FILE", str(real_gguf))
    folder = ensure_default_model()
    assert default_model_problem(folder) is None
    assert default_gguf_path().stat().st_size == real_gguf.stat().st_size


def _no_network(*_args):
    raise AssertionError("no download may happen in this test")


def test_missing_velox_default_model_file_is_one_line(tmp_path):
    environment = {**os.environ, "VELOX_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(REPO_ROOT),
                   "VELOX_DEFAULT_MODEL_FILE": str(tmp_path / "nowhere" / "smollm.gguf")}
    result = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--prompt", "hi"], capture_output=True,
                            text=True, env=environment, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "VELOX_DEFAULT_MODEL_FILE names" in lines[0] and "not a file" in lines[0]
