"""Build Velox.app, the double-clickable macOS bundle, with py2app.

    python3 tasks.py bundle          # the usual way: sets up .venv with the `mac` extra, then runs this
    python setup_app.py bundle       # build dist/Velox.app, sign it ad hoc, pack dist/Velox.dmg and .zip

What goes in, and why:
- The app is an accessory (LSUIElement): it lives in the menu bar, with no Dock icon and no app menu bar.
- mlx, mlx_lm, PySide6, engine and app are copied as plain packages, never zipped: mlx looks for
  `mlx.metallib` beside `libmlx.dylib` at run time, which fails inside a zip (a known launch failure), and
  Qt loads its plugins from real folders.
- The checksum-verified SmolLM2 GGUF goes into Contents/Resources, so the first launch converts it offline
  (engine.models.default_model reads it in place through RESOURCEPATH) and never needs pip or the network.
- The icon is resources/Velox.icns (written by resources/make_icons.py from resources/velox-icon.svg).

Importing this module builds nothing: tests read PLIST and py2app_options() without py2app installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
APP_NAME = "Velox"
BUNDLE_ID = "app.velox.Velox"
MIN_MACOS = "13.5"  # MLX's Metal backend needs macOS 13.5 or newer on Apple silicon
ENTRY_SCRIPT = ROOT / "app" / "__main__.py"
ICON_FILE = ROOT / "resources" / "Velox.icns"
# Packages copied as folders (see the module docstring); the rest of the dependencies may be zipped.
UNZIPPED_PACKAGES = ["mlx", "mlx_lm", "PySide6", "shiboken6", "engine", "app", "transformers", "tokenizers"]


def project_version() -> str:
    """The version in pyproject.toml: the bundle's version is the package's."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


PLIST: dict[str, Any] = {
    "CFBundleName": APP_NAME,
    "CFBundleDisplayName": APP_NAME,
    "CFBundleIdentifier": BUNDLE_ID,
    "CFBundleShortVersionString": project_version(),
    "CFBundleVersion": project_version(),
    "CFBundleIconFile": ICON_FILE.name,
    "LSUIElement": True,  # menu-bar app: no Dock icon (app/main.py hides it likewise when run unbundled)
    "LSMinimumSystemVersion": MIN_MACOS,
    "LSApplicationCategoryType": "public.app-category.productivity",
    "NSHighResolutionCapable": True,
    "NSRequiresAquaSystemAppearance": False,  # follow dark mode
    "NSHumanReadableCopyright": "Apache-2.0",
}


def py2app_options(model_file: Path | None) -> dict[str, Any]:
    """py2app's options; `model_file` is the verified GGUF placed in Contents/Resources (None: none)."""
    return {
        "argv_emulation": False,  # it would swallow the first Apple event; the app takes no file arguments
        "iconfile": str(ICON_FILE),
        "plist": PLIST,
        "packages": UNZIPPED_PACKAGES,
        "resources": [str(model_file)] if model_file else [],
        "semi_standalone": False,
        "site_packages": False,
        "strip": True,
        "excludes": ["tkinter", "PySide6.Qt3DCore", "PySide6.QtWebEngineCore", "PySide6.QtMultimedia"],
    }


def verified_model_file() -> Path:
    """The SmolLM2 GGUF, downloaded and checksum-verified once (the same code the app runs)."""
    sys.path.insert(0, str(ROOT))
    from engine.models.default_model import ensure_default_gguf

    return ensure_default_gguf(lambda message, _fraction: print(message, flush=True))


def build() -> int:
    """py2app, then an ad-hoc signature and the .dmg and .zip that people download."""
    from setuptools import setup

    model_file = verified_model_file()
    for stale in (ROOT / "build", ROOT / "dist" / f"{APP_NAME}.app"):
        shutil.rmtree(stale, ignore_errors=True)
    setup(
        name=APP_NAME,
        app=[str(ENTRY_SCRIPT)],
        options={"py2app": py2app_options(model_file)},
        script_args=["py2app"],
    )
    bundle = ROOT / "dist" / f"{APP_NAME}.app"
    # Ad-hoc signature: Apple silicon refuses to run unsigned arm64 code; a Developer ID would replace "-".
    subprocess.check_call(["codesign", "--force", "--deep", "--sign", "-", str(bundle)])
    subprocess.check_call(["codesign", "--verify", "--deep", "--strict", str(bundle)])
    dmg = ROOT / "dist" / f"{APP_NAME}.dmg"
    dmg.unlink(missing_ok=True)
    subprocess.check_call(["hdiutil", "create", "-volname", APP_NAME, "-srcfolder", str(bundle), "-ov",
                           "-format", "UDZO", str(dmg)])
    archive = ROOT / "dist" / f"{APP_NAME}.zip"
    subprocess.check_call(["ditto", "-c", "-k", "--keepParent", str(bundle), str(archive)])
    print(f"Built {bundle}, {dmg.name} and {archive.name}")
    return 0


def main(argv: list[str]) -> int:
    if argv != ["bundle"]:
        print(__doc__)
        return 2
    if sys.platform != "darwin":
        print("Velox.app is built on macOS: py2app makes Mac bundles only.", file=sys.stderr)
        return 2
    return build()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
