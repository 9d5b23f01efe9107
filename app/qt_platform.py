"""Can Qt open a window here? Checked before Qt starts, because when it cannot, Qt aborts the whole process
with "Could not load the Qt platform plugin" and no hint of what to install.

No Qt and no MLX imports here, so the check costs nothing and is testable anywhere.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping

# The shared libraries Qt 6's xcb platform plugin (libqxcb.so / libQt6XcbQpa) loads that a minimal Linux
# desktop often lacks, each with the Debian/Ubuntu package that provides it (read off `ldd` of PySide6's
# plugin; libxcb.so.1 itself comes with every X11 desktop).
XCB_LIBRARIES: dict[str, str] = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
}


def library_loads(soname: str) -> bool:
    """True if the dynamic loader finds `soname` (the same search Qt's plugin will make)."""
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def uses_xcb(environ: Mapping[str, str]) -> bool:
    """Whether Qt will pick its X11 (xcb) plugin: asked for explicitly, or an X display without Wayland."""
    platform = environ.get("QT_QPA_PLATFORM", "").split(":")[0].strip()
    if platform:
        return platform == "xcb"
    return bool(environ.get("DISPLAY")) and not environ.get("WAYLAND_DISPLAY")


def qt_platform_problem(
    environ: Mapping[str, str] | None = None,
    platform: str = sys.platform,
    loads: Callable[[str], bool] = library_loads,
) -> str | None:
    """One message saying why Qt cannot open a window here and how to fix it, or None if it can (or if we
    cannot tell: Qt then reports for itself). Linux only; macOS and Windows always have their plugin."""
    if not platform.startswith("linux"):
        return None
    environ = os.environ if environ is None else environ
    if not environ.get("QT_QPA_PLATFORM") and not environ.get("DISPLAY") and not environ.get("WAYLAND_DISPLAY"):
        return ("There is no display to open a window on (neither DISPLAY nor WAYLAND_DISPLAY is set). "
                "Use `velox chat` in a terminal, or set QT_QPA_PLATFORM=offscreen to run the app headless.")
    if not uses_xcb(environ):
        return None
    missing = [package for soname, package in XCB_LIBRARIES.items() if not loads(soname)]
    if not missing:
        return None
    return ("Qt cannot open a window: system libraries for X11 are missing. "
            f"Install them with: sudo apt install {' '.join(missing)}")
