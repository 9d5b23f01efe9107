"""A loopback stand-in for the Hugging Face hub: serves a model folder the way huggingface.co does.

The two endpoints a download uses: `/api/models/{repo}/revision/{rev}?blobs=true` (the commit and its files,
with sizes and an LFS sha256 for weights) and `/{repo}/resolve/{commit}/{file}`, which redirects weights
to a CDN path as the hub does and honours `Range`. Faults on demand: a connection dropped after N bytes of a
file, and a per-chunk delay so a test can cancel mid-file. Every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SEND_CHUNK = 64 * 1024


@dataclass
class HubState:
    repo_id: str
    folder: Path
    commit: str = COMMIT
    drop_after: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before closing, once
    delay_per_chunk_s: float = 0.0
    requests: list[tuple[str, str]] = field(default_factory=list)  # (path, Range header or '')
    authorization: dict[str, str] = field(default_factory=dict)  # path -> Authorization header sent
    cdn_host: str = ""  # weights redirect to this host (e.g. 'localhost:PORT'), else to the same one

    def listing(self) -> dict:
        siblings = []
        for path in sorted(self.folder.iterdir()):
            entry: dict = {"rfilename": path.name, "size": path.stat().st_size, "blobId": "0" * 40}
            if path.suffix == ".safetensors":
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                entry["lfs"] = {"size": path.stat().st_size, "sha256": digest, "pointerSize": 134}
            siblings.append(entry)
        siblings.append({"rfilename": "nested/config.json", "size": 2, "blobId": "1" * 40})
        return {"id": self.repo_id, "sha": self.commit, "private": False, "siblings": siblings}


def _handler(state: HubState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep the test output clean
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = urllib.parse.urlsplit(self.path).path
            state.requests.append((path, self.headers.get("Range", "")))
            state.authorization[path] = self.headers.get("Authorization", "")
            api = f"/api/models/{state.repo_id}/revision/"
            resolve = f"/{state.repo_id}/resolve/{state.commit}/"
            if path.startswith(api):
                self._send_bytes(json.dumps(state.listing()).encode(), "application/json")
            elif path.startswith(resolve):
                name = urllib.parse.unquote(path[len(resolve):])
                if name.endswith(".safetensors"):
                    self.send_response(302)
                    base = f"http://{state.cdn_host}" if state.cdn_host else ""
                    self.send_header("Location", f"{base}/cdn/{name}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self._send_file(name)
            elif path.startswith("/cdn/"):
                self._send_file(path[len("/cdn/"):])
            else:
                self._send_bytes(b'{"error": "Repository not found"}', "application/json", status=404)

        def _send_bytes(self, body: bytes, kind: str, status: int = 200) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _send_file(self, name: str) -> None:
            file = state.folder / name
            if "/" in name or not file.is_file():
                self._send_bytes(b"Entry not found", "text/plain", status=404)
                return
            data = file.read_bytes()
            start = 0
            wanted = self.headers.get("Range", "")
            if wanted.startswith("bytes=") and wanted.endswith("-"):
                start = int(wanted[len("bytes="):-1])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            limit = state.drop_after.pop(name, None)
            sent = 0
            for offset in range(0, len(body), SEND_CHUNK):
                piece = body[offset:offset + SEND_CHUNK]
                if limit is not None and sent + len(piece) > limit:
                    self.wfile.write(piece[: limit - sent])
                    self.wfile.flush()
                    self.close_connection = True  # the connection drops mid-file
                    return
                try:
                    self.wfile.write(piece)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client went away (a cancelled download)
                sent += len(piece)
                if state.delay_per_chunk_s:
                    time.sleep(state.delay_per_chunk_s)

    return Handler


@contextmanager
def serve_hub(state: HubState) -> Iterator[str]:
    """Run the loopback hub in a thread; yields its endpoint URL (for HF_ENDPOINT). Weights are served
    from the same port; with `state.cdn_host = 'localhost'` the redirect names another host for them."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    if state.cdn_host == "localhost":
        state.cdn_host = f"localhost:{server.server_address[1]}"
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="loopback-hub", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def make_model_folder(folder: Path, weight_bytes: int = 3 * 1024 * 1024 + 17) -> Path:
    """A small folder shaped like an MLX model repo, with files a download must skip."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    (folder / "tokenizer.json").write_text('{"version": "1.0"}', encoding="utf-8")
    # Not a constant pattern, so a wrong offset after a resume changes the bytes.
    (folder / "model.safetensors").write_bytes(bytes((i * 7 + i // 251) % 256 for i in range(weight_bytes)))
    (folder / "modeling_evil.py").write_text("raise SystemExit('never fetched')\n", encoding="utf-8")
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    return folder
