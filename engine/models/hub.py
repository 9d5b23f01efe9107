"""Download an MLX model folder from the Hugging Face hub, with progress, cancel and resume.

Used by the app's model picker and by `velox models download` / `velox chat --download`; nothing in Velox
downloads a model unless the user asked for it.

It speaks the hub's two plain HTTP endpoints (the ones huggingface_hub itself calls), so it needs no extra
package and every byte is under our control:
  GET {endpoint}/api/models/{org}/{name}/revision/{revision}?blobs=true   the commit and its file list, with
                                                                          sizes and, for LFS files, sha256
  GET {endpoint}/{org}/{name}/resolve/{commit}/{file}                     the file (a redirect to a CDN for
                                                                          LFS files), resumable with Range
`HF_ENDPOINT` points it elsewhere (a mirror, or the tests' loopback server), `HF_TOKEN` authenticates, and
`HF_HUB_OFFLINE=1` forbids it, as with huggingface_hub.

The result lands in huggingface_hub's cache layout (`models--org--name/snapshots/<commit>/` and
`refs/<revision>`), where `engine.models.catalog` and mlx-lm find it. Only safe files are fetched:
configuration, tokenizer and weights (`.json`, `.safetensors`, `.txt`, `.model`, `.tiktoken`, `.jinja`) at
the repository's top level; never code (`.py`) or pickles. Files are written under
`models--org--name/.velox-partial/<commit>/` first and moved into the snapshot only when every file is
complete and checked (size, and sha256 where the hub gives one), config.json last: a cancelled or broken
download is never taken for a model, and running it again resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path

from engine.errors import CancelledError, DownloadError
from engine.models.catalog import hf_hub_cache_dir
from engine.models.transfer import CONNECTION_ERRORS, PartialFile, fetch_resumable, is_transient

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

DEFAULT_ENDPOINT = "https://huggingface.co"
MLX_COMMUNITY = "mlx-community"
# File kinds an MLX model folder needs; nothing executable or unpickled is ever fetched.
SAFE_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".tiktoken", ".jinja")
PARTIAL_DIR = ".velox-partial"
INCOMPLETE_SUFFIX = ".incomplete"
# Progress callbacks at most this often (plus at the start and the end): a GUI signal per chunk would flood.
PROGRESS_INTERVAL_S = 0.1
# A dropped connection is retried from the byte where it stopped, this many times per file.
ATTEMPTS_PER_FILE = 4
RETRY_PAUSE_S = 0.5
TIMEOUT_S = 30.0
_REPO_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT_PATTERN = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class DownloadProgress:
    """Where a download stands: bytes of the whole model folder, and the file being fetched."""

    repo_id: str
    file: str
    done_bytes: int
    total_bytes: int

    @property
    def fraction(self) -> float:
        return min(self.done_bytes / self.total_bytes, 1.0) if self.total_bytes > 0 else 0.0


ProgressHandler = Callable[[DownloadProgress], None]


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str  # '' when the hub gives no content hash (small non-LFS files)


def normalize_repo_id(name: str) -> str:
    """'org/name' as typed (or pasted as a huggingface.co URL); a bare name is taken from mlx-community."""
    repo = name.strip().rstrip("/")  # a leading '/' is a folder path, never a model name
    for prefix in ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/"):
        if repo.startswith(prefix):
            repo = repo[len(prefix):].strip("/")
    if "/" not in repo:
        repo = f"{MLX_COMMUNITY}/{repo}"
    if not _REPO_PATTERN.match(repo) or ".." in repo:
        raise DownloadError(f"{name.strip()!r} is not a Hugging Face model name; use org/name, "
                            f"e.g. {MLX_COMMUNITY}/SmolLM2-360M-Instruct.")
    return repo


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def repo_cache_dir(repo_id: str, cache_dir: Path | None = None) -> Path:
    """huggingface_hub's folder for a model repo: 'org/name' → `models--org--name`."""
    return (cache_dir or hf_hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


class _NoTokenAcrossHosts(urllib.request.HTTPRedirectHandler):
    """Follow the hub's redirects to its CDN, without sending the user's token to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


_opener = urllib.request.build_opener(_NoTokenAcrossHosts())


def _request(url: str, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    request = urllib.request.Request(url, headers={"User-Agent": "velox", **(headers or {})})
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    return _opener.open(request, timeout=TIMEOUT_S)


def _unreachable(repo_id: str, endpoint: str) -> DownloadError:
    host = urllib.parse.urlsplit(endpoint).netloc or endpoint
    return DownloadError(f"Velox could not reach {host} to download {repo_id}: this computer seems to be offline. "
                         "Connect to the internet and try again, or pick a model that is already on disk.")


def list_remote_files(repo_id: str, revision: str = "main") -> tuple[str, list[RemoteFile]]:
    """(commit, the safe top-level files with sizes) of `repo_id` at `revision`, from the hub's API."""
    endpoint = hub_endpoint()
    url = (f"{endpoint}/api/models/{repo_id}/revision/{urllib.parse.quote(revision, safe='')}?blobs=true")
    try:
        with _request(url, {"Accept": "application/json"}) as response:
            listing = json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as error:
        if error.code in (401, 403, 404):
            raise DownloadError(f"There is no model named {repo_id} on Hugging Face (or it is private or gated; "
                                "set HF_TOKEN for a gated one).") from error
        raise DownloadError(f"Hugging Face answered {error.code} for {repo_id}; try again later.") from error
    except (urllib.error.URLError, OSError, HTTPException) as error:
        raise _unreachable(repo_id, endpoint) from error
    except ValueError as error:
        raise DownloadError(f"Hugging Face sent an unreadable file list for {repo_id}.") from error
    commit = str(listing.get("sha") or "") if isinstance(listing, dict) else ""
    if not _COMMIT_PATTERN.match(commit):
        raise DownloadError(f"Hugging Face sent no commit for {repo_id} at {revision!r}.")
    files = []
    for sibling in listing.get("siblings") or []:
        name = str(sibling.get("rfilename", ""))
        # Top level only: an MLX folder keeps everything there, and it rules out paths like '../x'.
        if "/" in name or "\\" in name or name.startswith(".") or not name.endswith(SAFE_SUFFIXES):
            continue
        lfs = sibling.get("lfs") or {}
        size = lfs.get("size", sibling.get("size"))
        if not isinstance(size, int) or size < 0:
            raise DownloadError(f"Hugging Face sent no size for {repo_id}/{name}; cannot check the download.")
        files.append(RemoteFile(name, size, str(lfs.get("sha256") or "")))
    names = {f.name for f in files}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise DownloadError(f"{repo_id} is not an MLX model folder (it has no config.json with .safetensors "
                            f"weights); pick a model from {MLX_COMMUNITY}.")
    return commit, sorted(files, key=lambda f: (f.name == "config.json", f.name))


class _Download:
    """One model folder's download: the running byte count, progress throttling and the cancel check."""

    def __init__(self, repo_id: str, total: int, progress: ProgressHandler | None,
                 cancel: threading.Event | None) -> None:
        self.repo_id, self.total, self.progress, self.cancel = repo_id, total, progress, cancel
        self.done = 0
        self._last_report = 0.0

    def check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise CancelledError(f"The download of {self.repo_id} was cancelled; run it again to resume.")

    def report(self, file: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.progress is not None and (force or now - self._last_report >= PROGRESS_INTERVAL_S):
            self._last_report = now
            self.progress(DownloadProgress(self.repo_id, file, self.done, self.total))

    def fetch(self, url: str, part: PartialFile, remote: RemoteFile) -> None:
        """Bring `part` to `remote.size` bytes, appending from where it stopped; retry dropped connections.
        The bytes `part` already holds are counted in `done` by the caller."""
        part.expected_size = remote.size

        def counted(delta: int) -> None:
            self.done += delta
            self.report(remote.name)

        try:
            fetch_resumable(lambda first: _request(url, {"Range": f"bytes={first}-"} if first else {}), part,
                            name=f"{remote.name} of {self.repo_id}", attempts=ATTEMPTS_PER_FILE,
                            pause_s=RETRY_PAUSE_S, on_bytes=counted, check_cancel=self.check_cancel)
        except urllib.error.HTTPError as error:
            if is_transient(error):
                raise DownloadError(f"The download of {self.repo_id} broke off in {remote.name} (Hugging Face "
                                    f"answered {error.code}); run it again to resume where it stopped.") from error
            raise DownloadError(f"Hugging Face answered {error.code} for {remote.name} of {self.repo_id}.") from error
        except CONNECTION_ERRORS as error:
            raise DownloadError(f"The download of {self.repo_id} broke off in {remote.name} ({error}); run it "
                                "again to resume where it stopped.") from error


def _complete(path: Path, remote: RemoteFile) -> bool:
    return path.is_file() and path.stat().st_size == remote.size


@contextmanager
def _exclusive(lock_path: Path, repo_id: str) -> Iterator[None]:
    """One download of a repo at a time across processes (the app and `velox models download` share files)."""
    if fcntl is None:  # no flock (Windows): Velox's supported systems all have it
        yield
        return
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            raise DownloadError(f"{repo_id} is already being downloaded by another Velox; wait for it to "
                                "finish, or stop it first.") from error
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def download_model(repo_id: str, *, revision: str = "main", progress: ProgressHandler | None = None,
                   cancel: threading.Event | None = None, cache_dir: Path | None = None) -> Path:
    """Download `repo_id` ('org/name', or a bare mlx-community name) and return its snapshot folder.

    Files already in the snapshot are kept; a download that stopped (cancel, Ctrl-C, a dropped connection)
    resumes from its last byte. Raises DownloadError with one sentence, or CancelledError when `cancel` is set.
    """
    repo_id = normalize_repo_id(repo_id)
    if _offline():
        raise DownloadError(
            f"{repo_id} is not downloaded and Hugging Face offline mode is on (HF_HUB_OFFLINE=1), so Velox cannot "
            "fetch it; unset HF_HUB_OFFLINE to download.")
    if progress is not None:
        progress(DownloadProgress(repo_id, "", 0, 0))
    commit, files = list_remote_files(repo_id, revision)
    repo_dir = repo_cache_dir(repo_id, cache_dir)
    staging = repo_dir / PARTIAL_DIR / commit
    try:
        staging.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DownloadError(f"Velox cannot write to the Hugging Face cache at {repo_dir.parent}: {error}") from error
    with _exclusive(repo_dir / PARTIAL_DIR / f"{commit}.lock", repo_id):
        return _download_files(repo_id, revision, commit, files, repo_dir, _Download(repo_id, 0, progress, cancel))


def _download_files(repo_id: str, revision: str, commit: str, files: list[RemoteFile], repo_dir: Path,
                    job: _Download) -> Path:
    snapshot = repo_dir / "snapshots" / commit
    staging = repo_dir / PARTIAL_DIR / commit
    missing = [f for f in files if not _complete(snapshot / f.name, f)]
    job.total = sum(f.size for f in files)
    try:
        free = shutil.disk_usage(staging).free
        # What an earlier, stopped run already brought (complete files, and the start of the one it was on).
        job.done = sum(f.size for f in files if f not in missing)
        for remote in missing:
            partial = staging / (remote.name + INCOMPLETE_SUFFIX)
            if _complete(staging / remote.name, remote):
                job.done += remote.size
            elif partial.is_file():
                if partial.stat().st_size > remote.size:
                    partial.unlink()  # not this commit's file: start it again
                else:
                    job.done += partial.stat().st_size
    except OSError as error:
        raise DownloadError(f"Velox cannot write to the Hugging Face cache at {repo_dir.parent}: {error}") from error
    if job.total - job.done > free:
        raise DownloadError(f"{repo_id} needs {(job.total - job.done) / 1e9:.2f} GB more disk space than the "
                            f"{free / 1e9:.2f} GB free at {repo_dir.parent}.")
    job.report("", force=True)
    endpoint = hub_endpoint()
    for remote in missing:
        done_file = staging / remote.name
        if _complete(done_file, remote):
            continue
        part = PartialFile(staging / (remote.name + INCOMPLETE_SUFFIX))
        job.fetch(f"{endpoint}/{repo_id}/resolve/{commit}/{urllib.parse.quote(remote.name)}", part, remote)
        if remote.sha256 and part.digest.hexdigest() != remote.sha256:
            part.path.unlink()
            raise DownloadError(f"{remote.name} of {repo_id} arrived damaged (its sha256 does not match); "
                                "run the download again.")
        os.replace(part.path, done_file)
        job.report(remote.name, force=True)
    job.check_cancel()
    try:
        snapshot.mkdir(parents=True, exist_ok=True)
        for remote in missing:  # config.json is last: a snapshot without it is never taken for a model
            os.replace(staging / remote.name, snapshot / remote.name)
        if revision != commit:
            (repo_dir / "refs").mkdir(exist_ok=True)
            (repo_dir / "refs" / revision).write_text(commit, encoding="utf-8")
        shutil.rmtree(repo_dir / PARTIAL_DIR, ignore_errors=True)  # with any stale run of an older commit
    except OSError as error:
        raise DownloadError(f"Velox could not finish writing {repo_id} into {repo_dir}: {error}") from error
    job.report("", force=True)
    return snapshot
