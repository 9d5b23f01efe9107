"""The `velox` command line, run as a user would: in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def velox(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_one_shot_chat_answers(default_model_path):
    result = velox("chat", "--prompt", "What is the capital of France?", "--max-tokens", "24", "--stats")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr and "KV cache" in result.stderr


def test_chat_with_document(default_model_path, tmp_path):
    doc = tmp_path / "note.md"
    doc.write_text("# Shopping\n\nThe secret ingredient of the soup is saffron.\n")
    result = velox("chat", "--doc", str(doc), "--prompt", "What is the secret ingredient of the soup?",
                   "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert "saffron" in result.stdout.lower()


def test_interactive_chat_reads_stdin(default_model_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--max-tokens", "16"],
                            input="What is the capital of France?\n\n", capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_errors_are_one_line_without_traceback(tmp_path):
    missing = velox("chat", "--doc", str(tmp_path / "nope.txt"), "--prompt", "hi")
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    bad_model = velox("chat", "--model", str(tmp_path), "--prompt", "hi")
    assert bad_model.returncode == 1 and "Traceback" not in bad_model.stderr
    assert "config.json" in bad_model.stderr


def test_models_and_info(default_model_path):
    models = velox("models")
    assert models.returncode == 0, models.stderr
    assert "SmolLM2-135M-Instruct" in models.stdout and "ready" in models.stdout
    info = velox("info")
    assert info.returncode == 0, info.stderr
    assert "mlx" in info.stdout and "available" in info.stdout


def test_no_command_prints_usage():
    result = velox()
    assert result.returncode == 2 and "usage" in result.stdout.lower()


def test_methods_lists_every_registered_method_with_effective_bits():
    from engine.kvcache import known_methods

    result = velox("methods")
    assert result.returncode == 0, result.stderr
    for name in known_methods():
        assert f"\n{name}: " in "\n" + result.stdout
    assert "rotated" in result.stdout and "4→4.50" in result.stdout  # 4-bit codes + fp16 scale/bias per 64


def test_levels_print_bits_a_parsable_spec_and_figures():
    from engine.kvcache import KVCacheConfig
    from engine.planning.recommend import LEVELS

    result = velox("levels")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(LEVELS)
    for line, level in zip(lines, LEVELS, strict=True):
        key, bits, spec, *figures = line.split()
        assert key == level.key and float(bits) == round(level.bits_per_value(128, 4096, 8), 3)
        assert KVCacheConfig.parse(spec) == level.to_config()
        assert figures
    assert all("KL" in line for line in lines[1:])  # every compressed level is in the committed sweep


def test_precompute_refuses_unsupported_bits_before_loading(tmp_path):
    result = velox("precompute", "default", "--bits", "5", "--out", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "supports 1, 2, 3, 4 bits" in result.stderr
