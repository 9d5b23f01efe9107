"""setup_app.py's plist and py2app options are what a menu-bar app bundle needs (read without py2app)."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "resources"))
from make_icons import ICNS_TYPES, read_icns  # noqa: E402


def _load_setup_app():
    spec = importlib.util.spec_from_file_location("setup_app", ROOT / "setup_app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plist_makes_a_menu_bar_app_with_the_package_version() -> None:
    setup_app = _load_setup_app()
    plist = setup_app.PLIST
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert plist["LSUIElement"] is True and plist["NSHighResolutionCapable"] is True
    assert plist["CFBundleShortVersionString"] == version == plist["CFBundleVersion"]
    assert plist["CFBundleIdentifier"].count(".") >= 2
    major, minor = map(int, plist["LSMinimumSystemVersion"].split("."))
    assert (major, minor) >= (13, 5)
    assert plist["CFBundleIconFile"] == "Velox.icns"


def test_mlx_and_qt_are_copied_unzipped_and_the_model_is_a_resource(tmp_path) -> None:
    setup_app = _load_setup_app()
    model = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    options = setup_app.py2app_options(model)
    for package in ("mlx", "mlx_lm", "PySide6", "engine", "app"):
        assert package in options["packages"]
    assert options["resources"] == [str(model)]
    assert options["argv_emulation"] is False and options["semi_standalone"] is False
    assert Path(options["iconfile"]).is_file()
    assert setup_app.ENTRY_SCRIPT.is_file()


def test_the_icon_is_a_valid_icns_with_every_size() -> None:
    entries = read_icns((ROOT / "resources" / "Velox.icns").read_bytes())
    assert [kind for kind, _payload in entries] == [kind.decode() for kind, _size in ICNS_TYPES]
    for (_kind, payload), (_type, size) in zip(entries, ICNS_TYPES, strict=True):
        assert payload[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = int.from_bytes(payload[16:20], "big"), int.from_bytes(payload[20:24], "big")
        assert (width, height) == (size, size)


def test_read_icns_rejects_a_truncated_file() -> None:
    data = (ROOT / "resources" / "Velox.icns").read_bytes()
    with pytest.raises(ValueError):
        read_icns(data[:-10])


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the message given off macOS")
def test_building_off_macos_says_why(capsys) -> None:
    assert _load_setup_app().main(["bundle"]) == 2
    assert "macOS" in capsys.readouterr().err
