"""The images the running app shows (rendered from resources/*.svg by resources/make_icons.py).

They ship inside the `app` package, so a checkout, an installed wheel and the py2app bundle (which copies
the package unzipped) all find them beside this file."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent


def asset_path(name: str) -> Path:
    """The path of the asset `name` (e.g. "velox-icon.png"); FileNotFoundError if it is missing, so a
    packaging mistake shows up at once instead of as a blank icon."""
    path = ASSETS_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"Velox's asset {name} is missing from {ASSETS_DIR}; the installation is incomplete.")
    return path
