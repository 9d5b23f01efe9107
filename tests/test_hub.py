"""engine.models.hub against a loopback hub (tests/hub_server.py): no real network."""

from __future__ import annotations

import logging
import sys
import threading

import pytest

from engine.errors import CancelledError, DownloadError
from engine.models import hub
from engine.models.catalog import hf_cached_snapshot
from tests.hub_server import COMMIT, HubState, make_model_folder, serve_hub

REPO = "mlx-community/Tiny-Test-4bit"


@pytest.fixture(autouse=True)
def private_log(tmp_path, monkeypatch):
    """The CLI tests run `velox` in-process, which sets up its log file: keep it in tmp_path and take its
    handler away afterwards, so later tests (tests/test_logs.py) start without one."""
    monkeypatch.setenv("VELOX_LOG_DIR", str(tmp_path / "log"))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in root.handlers[:]:
        if handler not in before:
            root.removeHandler(handler)
            handler.close()


@pytest.fixture
def hub_folder(tmp_path):
    return make_model_folder(tmp_path / "remote")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return folder


@pytest.fixture
def loopback(hub_folder, cache, monkeypatch):
    state = HubState(REPO, hub_folder)
    with serve_hub(state) as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        yield state


def _same_files(snapshot, remote) -> None:
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (snapshot / name).read_bytes() == (remote / name).read_bytes(), name


def test_download_reports_progress_fetches_only_safe_files_and_lands_in_the_hf_cache(loopback, hub_folder, cache):
    seen: list[hub.DownloadProgress] = []
    snapshot = hub.download_model("Tiny-Test-4bit", progress=seen.append)  # a bare name means mlx-community
    assert snapshot == cache / "models--mlx-community--Tiny-Test-4bit" / "snapshots" / COMMIT
    _same_files(snapshot, hub_folder)
    fetched = [path for path, _range in loopback.requests]
    assert not any(path.endswith((".py", ".bin")) or "nested" in path for path in fetched)
    assert (cache / "models--mlx-community--Tiny-Test-4bit" / "refs" / "main").read_text() == COMMIT
    assert not (cache / "models--mlx-community--Tiny-Test-4bit" / hub.PARTIAL_DIR).exists()
    total = sum((hub_folder / n).stat().st_size for n in ("config.json", "model.safetensors", "tokenizer.json"))
    assert seen[-1].done_bytes == seen[-1].total_bytes == total and seen[-1].fraction == 1.0
    done = [p.done_bytes for p in seen if p.total_bytes]
    assert done == sorted(done) and len(set(done)) >= 3  # it moved in steps, never backwards
    assert hf_cached_snapshot(REPO) == snapshot  # the catalogue (and `velox chat --model`) finds it

    # A second call finds everything in place and downloads nothing.
    loopback.requests.clear()
    assert hub.download_model(REPO) == snapshot
    assert [path for path, _range in loopback.requests] == [f"/api/models/{REPO}/revision/main"]


def test_cancel_stops_mid_file_leaves_no_usable_snapshot_and_a_rerun_resumes(loopback, hub_folder, cache):
    loopback.delay_per_chunk_s = 0.02
    cancel = threading.Event()

    def stop_midway(progress: hub.DownloadProgress) -> None:
        if progress.file == "model.safetensors" and progress.done_bytes > 1024 * 1024:
            cancel.set()

    with pytest.raises(CancelledError, match="cancelled"):
        hub.download_model(REPO, progress=stop_midway, cancel=cancel)
    repo_dir = cache / "models--mlx-community--Tiny-Test-4bit"
    assert not (repo_dir / "snapshots").exists()
    assert hf_cached_snapshot(REPO) is None
    partial = repo_dir / hub.PARTIAL_DIR / COMMIT / "model.safetensors.incomplete"
    kept = partial.stat().st_size
    assert 1024 * 1024 < kept < (hub_folder / "model.safetensors").stat().st_size

    loopback.delay_per_chunk_s = 0.0
    loopback.requests.clear()
    snapshot = hub.download_model(REPO)
    _same_files(snapshot, hub_folder)
    assert ("/cdn/model.safetensors", f"bytes={kept}-") in loopback.requests  # resumed, not restarted


def test_a_dropped_connection_mid_file_is_resumed_with_the_right_bytes(loopback, hub_folder):
    loopback.drop_after["model.safetensors"] = 1_000_000
    snapshot = hub.download_model(REPO)
    _same_files(snapshot, hub_folder)
    ranges = [rng for path, rng in loopback.requests if path == "/cdn/model.safetensors"]
    assert ranges == ["", "bytes=1000000-"]


def test_a_connection_that_keeps_dropping_fails_in_one_sentence_and_the_next_run_completes(
        loopback, hub_folder, monkeypatch):
    monkeypatch.setattr(hub, "RETRY_PAUSE_S", 0.0)
    original = hub._request

    def always_drop(url, headers=None):
        if url.endswith("/model.safetensors"):  # every request for the weights breaks off 100 kB later
            loopback.drop_after["model.safetensors"] = 100_000
        return original(url, headers)

    monkeypatch.setattr(hub, "_request", always_drop)
    with pytest.raises(DownloadError, match="run it again to resume"):
        hub.download_model(REPO)
    ranges = [rng for path, rng in loopback.requests if path == "/cdn/model.safetensors"]
    assert len(ranges) == hub.ATTEMPTS_PER_FILE and ranges[-1] == f"bytes={3 * 100_000}-"
    monkeypatch.setattr(hub, "_request", original)
    loopback.drop_after.clear()
    loopback.requests.clear()
    _same_files(hub.download_model(REPO), hub_folder)
    assert ("/cdn/model.safetensors", f"bytes={4 * 100_000}-") in loopback.requests


def test_the_token_goes_to_the_hub_but_not_to_the_cdn_it_redirects_to(hub_folder, cache, monkeypatch):
    state = HubState(REPO, hub_folder, cdn_host="localhost")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    with serve_hub(state) as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        _same_files(hub.download_model(REPO), hub_folder)
    assert state.authorization[f"/api/models/{REPO}/revision/main"] == "Bearer hf_secret"
    assert state.authorization[f"/{REPO}/resolve/{COMMIT}/model.safetensors"] == "Bearer hf_secret"
    assert state.authorization["/cdn/model.safetensors"] == ""  # another host: the token stays home


def test_a_second_download_of_the_same_model_at_once_is_refused(loopback, cache):
    import fcntl

    partial_dir = cache / "models--mlx-community--Tiny-Test-4bit" / hub.PARTIAL_DIR
    partial_dir.mkdir(parents=True)
    with open(partial_dir / f"{COMMIT}.lock", "a") as held:  # as another process downloading it would
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(DownloadError, match="already being downloaded"):
            hub.download_model(REPO)
    assert hub.download_model(REPO).is_dir()


def test_damaged_weights_are_refused(loopback, hub_folder, monkeypatch):
    listing = loopback.listing

    def wrong_hash():
        data = listing()
        for sibling in data["siblings"]:
            if "lfs" in sibling:
                sibling["lfs"]["sha256"] = "0" * 64
        return data

    monkeypatch.setattr(loopback, "listing", wrong_hash)
    with pytest.raises(DownloadError, match="damaged"):
        hub.download_model(REPO)
    assert hf_cached_snapshot(REPO) is None


@pytest.mark.parametrize("name, message", [
    ("mlx-community/No-Such-Model", "There is no model named mlx-community/No-Such-Model"),
    ("../../etc", "not a Hugging Face model name"),
    ("a/b/c", "not a Hugging Face model name"),
    ("/home/me/models", "not a Hugging Face model name"),
])
def test_bad_names_give_one_sentence(loopback, name, message):
    assert hub.normalize_repo_id("https://huggingface.co/mlx-community/Qwen3-0.6B-4bit/") == "mlx-community/Qwen3-0.6B-4bit"
    with pytest.raises(DownloadError, match=message):
        hub.download_model(name)


def test_offline_mode_and_an_unreachable_hub_are_explained(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match="offline mode is on"):
        hub.download_model(REPO)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(DownloadError, match="seems to be offline"):
        hub.download_model(REPO)


def test_cli_models_download(loopback, hub_folder, capsys):
    from app.cli import main

    assert main(["models", "download", REPO]) == 0
    captured = capsys.readouterr()
    assert str(hf_cached_snapshot(REPO)) in captured.out and "100.0%" in captured.err
    assert main(["models", "download", "org/Missing"]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: There is no model named org/Missing")


def test_cli_ctrl_c_stops_a_download_with_a_resume_hint(loopback, capsys, monkeypatch):
    from app.cli import main

    def interrupt(progress):
        if progress.file == "model.safetensors":
            raise KeyboardInterrupt

    monkeypatch.setattr("app.commands._download_progress", interrupt)
    assert main(["models", "download", REPO]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: The download of {REPO} was stopped; run the same command again to resume.")
    assert hf_cached_snapshot(REPO) is None


def test_cli_chat_download_fetches_the_model_then_answers(default_model_path, cache, monkeypatch, capsys):
    from app.cli import main

    repo = "mlx-community/SmolLM2-135M-Instruct"
    assert main(["chat", "--model", repo, "--prompt", "Hi", "--max-tokens", "3"]) == 1
    assert "velox models download" in capsys.readouterr().err  # without --download nothing is fetched
    state = HubState(repo, default_model_path)
    with serve_hub(state) as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        assert main(["chat", "--model", repo, "--download", "--prompt", "Hi", "--max-tokens", "3"]) == 0
        captured = capsys.readouterr()
        assert captured.out.strip() and "100.0%" in captured.err
        state.requests.clear()
        assert main(["chat", "--model", repo, "--download", "--prompt", "Hi", "--max-tokens", "3"]) == 0
        assert state.requests == []  # already in the cache: --download fetches nothing
