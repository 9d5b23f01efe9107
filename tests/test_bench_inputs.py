"""The benchmark harness's inputs and its report's plumbing: where the prose comes from (--text,
$VELOX_BENCH_DATA, a developer checkout's ../shared/data), the git record, the peer's venv location, one-line
errors from `python benchmarks/bench.py`, result files the report skips, and BENCHMARKS.md being exactly what
the report generates from the committed results."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import platformdirs
import pytest

from benchmarks.harness import common
from engine.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _prose_folder(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("It was the best of times. " * 20, encoding="utf-8")
    return folder


# ----- prose ------------------------------------------------------------------------------------------------------


def test_text_files_given_are_used_and_a_missing_one_is_named(tmp_path: Path) -> None:
    given = _prose_folder(tmp_path, "a.txt") / "a.txt"
    assert common.prose_paths([str(given)]) == [given]
    with pytest.raises(ConfigError, match=r"Benchmark prose not found: .*nowhere\.txt"):
        common.prose_paths([str(given), str(tmp_path / "nowhere.txt")])


def test_the_data_folder_comes_from_the_environment_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _prose_folder(tmp_path / "data", "areopagitica.txt")
    checkout = _prose_folder(tmp_path / "checkout-data", *common.PROSE_FILES)
    monkeypatch.setattr(common, "CHECKOUT_DATA_DIR", checkout)
    monkeypatch.setenv(common.DATA_DIR_ENV, str(folder))
    assert common.prose_paths() == [folder / "areopagitica.txt"]  # only the files that are there
    monkeypatch.delenv(common.DATA_DIR_ENV)
    assert common.prose_paths() == [checkout / name for name in common.PROSE_FILES]  # a checkout's default


def test_an_empty_data_folder_says_which_folder_and_how_to_choose_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(common.DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(ConfigError) as raised:
        common.prose_paths()
    message = str(raised.value)
    assert str(tmp_path) in message and "$VELOX_BENCH_DATA" in message and "--text" in message
    assert "\n" not in message


def test_outside_a_checkout_there_is_no_default_prose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(common.DATA_DIR_ENV, raising=False)
    monkeypatch.setattr(common, "CHECKOUT_DATA_DIR", _prose_folder(tmp_path, *common.PROSE_FILES))
    monkeypatch.setattr(common, "in_checkout", lambda: False)
    assert common.prose_dir() == (None, "")
    with pytest.raises(ConfigError, match="pass --text FILE, or set VELOX_BENCH_DATA"):
        common.prose_paths()


def test_bench_py_prints_one_line_for_missing_prose(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench.py"), "quality", "--parts", "perplexity", "--no-peers",
         "--out", str(tmp_path), "--text", str(tmp_path / "missing.txt")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: Benchmark prose not found: {tmp_path / 'missing.txt'}."


# ----- the git record and the peer's venv -------------------------------------------------------------------------


def test_git_state_of_this_checkout() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    state = common.git_state()
    assert "git_commit_missing" not in state
    head = state["git_commit"].removesuffix("+uncommitted")
    assert len(head) >= 7 and all(c in "0123456789abcdef" for c in head)


def test_git_state_says_why_there_is_no_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "in_checkout", lambda: False)
    assert common.git_state()["git_commit_missing"].startswith("not run from a source checkout")
    monkeypatch.setattr(common, "in_checkout", lambda: True)
    monkeypatch.setattr(common, "ROOT", tmp_path)  # a checkout without .git (an unpacked archive)
    state = common.git_state()
    assert state["git_commit"] == "" and state["git_commit_missing"].startswith("git failed: ")
    assert "not a git repository" in state["git_commit_missing"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on PATH
    assert common.git_state() == {"git_commit": "", "git_commit_missing": "git is not installed"}


def test_the_peer_venv_lives_in_the_user_cache_dir_or_where_told(tmp_path: Path) -> None:
    from benchmarks.harness.peers import VELOXQUANT_VERSION, default_venv, ensure_veloxquant_venv

    venv = default_venv()
    assert venv.is_relative_to(platformdirs.user_cache_dir("Velox", appauthor=False))
    assert VELOXQUANT_VERSION in venv.name
    if sys.platform == "win32":
        return
    # A venv given by path is reused when its python reports the pinned version (nothing is installed).
    python = tmp_path / "peer" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho {VELOXQUANT_VERSION}\n")
    python.chmod(0o755)
    found, note = ensure_veloxquant_venv(tmp_path / "peer")
    assert found == str(python) and note.startswith(f"reused {tmp_path / 'peer'}")


def test_peer_venv_is_a_bench_option() -> None:
    import argparse

    from benchmarks.harness.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["speed", "--peer-venv", "/x/venv"]).peer_venv == "/x/venv"
    assert parser.parse_args(["speed"]).peer_venv is None


# ----- the report ---------------------------------------------------------------------------------------------------


def test_the_report_does_not_import_the_cli() -> None:
    """report -> cli -> report was a cycle (level_specs); the report now needs nothing from the command line."""
    code = "import sys, benchmarks.harness.report; print('benchmarks.harness.cli' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_report_says_which_result_files_it_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.harness.report import load_results, write_report

    (tmp_path / "broken.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "list.json").write_text("[1, 2]", encoding="utf-8")
    results = load_results(tmp_path)
    assert results.by_kind == {}
    err = capsys.readouterr().err
    assert f"report: skipped {tmp_path / 'broken.json'}: not readable JSON" in err
    assert f"report: skipped {tmp_path / 'list.json'}: holds a list, not a result object" in err
    write_report(tmp_path, tmp_path / "BENCHMARKS.md", tmp_path / "figures")
    assert "Not run yet (`velox bench memory`)." in (tmp_path / "BENCHMARKS.md").read_text()


def test_an_unknown_cache_spec_is_shown_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.harness.report.data import attention_path, label_of, level_matches
    from engine.planning.recommend import LEVELS

    assert label_of("retired-method:4:64") == "retired-method:4:64"
    assert attention_path("retired-method:4:64") == ""
    assert not any(level_matches("retired-method:4:64", level) for level in LEVELS)
    assert "report: cache spec 'retired-method:4:64' shown as written: Unknown KV cache method" in capsys.readouterr().err


def test_benchmarks_md_is_what_the_report_generates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """BENCHMARKS.md, regenerated from the committed results in a copy of the checkout's layout, is byte for byte
    the committed file (without matplotlib, each figure line becomes the note saying why it is not drawn)."""
    import re

    from benchmarks.harness.report import NO_MATPLOTLIB, write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    shutil.copytree(REPO / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    markdown = tmp_path / "BENCHMARKS.md"
    shutil.copy(REPO / "BENCHMARKS.md", markdown)  # its hand-written tail (after the marker) is carried over
    write_report(tmp_path / "benchmarks" / "results", markdown, tmp_path / "docs" / "figures")
    committed = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    expected = re.sub(r"^!\[[^\]]*\]\(docs/figures/[\w.]+\.png\)$", lambda _: NO_MATPLOTLIB, committed, flags=re.M)
    assert expected != committed  # the committed file has figures
    assert markdown.read_text(encoding="utf-8") == expected, (
        "BENCHMARKS.md is stale: run `python benchmarks/bench.py report`")
