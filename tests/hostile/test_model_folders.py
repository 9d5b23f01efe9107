"""Issue 10, item 1: a model folder can never run its own code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ModelError
from engine.models.catalog import inspect_model_folder, load_model
from tests.hostile.builders import model_folder_copy

REPO_ROOT = Path(__file__).resolve().parents[2]

EVIL_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("the model folder's code ran")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def folder_with_custom_tokenizer(default_model_path, target: Path, tokenizer_class: str) -> Path:
    folder = model_folder_copy(default_model_path, target, copied=("tokenizer_config.json",))
    marker = target.parent / f"{target.name}-code-ran"
    (folder / "evil_tokenizer.py").write_text(EVIL_CODE.format(marker=str(marker)))
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = tokenizer_class
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["evil_tokenizer.EvilTokenizer", None]}
    config_path.write_text(json.dumps(tokenizer_config))
    return folder


def test_folder_with_custom_tokenizer_code_is_refused_and_its_code_never_runs(default_model_path, tmp_path):
    folder = folder_with_custom_tokenizer(default_model_path, tmp_path / "evil-model", "EvilTokenizer")
    with pytest.raises(ModelError, match="needs its own Python code to build its tokenizer"):
        inspect_model_folder(folder)
    # What the probe did: the CLI, with the user answering "y" to transformers' question.
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_MODULES_CACHE": str(tmp_path / "modules"),
                   "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "chat", "--model", str(folder), "--prompt", "hi", "--max-tokens", "4"],
        input="y\ny\n", capture_output=True, text=True, env=environment, timeout=300, cwd=REPO_ROOT,
    )
    assert result.returncode == 1, result.stderr
    assert not (tmp_path / "evil-model-code-ran").exists()
    assert "[y/N]" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: The model in") and "does not execute code" in lines[-1]
    assert "Traceback" not in result.stderr


def test_auto_map_beside_a_builtin_tokenizer_class_loads_without_running_the_code(default_model_path, tmp_path):
    # transformers ignores the auto_map when it implements the named class itself: such folders stay usable.
    folder = folder_with_custom_tokenizer(default_model_path, tmp_path / "harmless", "PreTrainedTokenizerFast")
    _model, tokenizer, info = load_model(folder)
    assert info.ready and tokenizer.encode("hello")
    assert not (tmp_path / "harmless-code-ran").exists()
