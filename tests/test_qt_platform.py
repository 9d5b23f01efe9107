"""The check that runs before Qt starts: a missing X11 library or display becomes one line with the fix."""

from __future__ import annotations

from app.qt_platform import XCB_LIBRARIES, library_loads, qt_platform_problem, uses_xcb


def test_missing_xcb_libraries_name_the_apt_packages() -> None:
    missing = {"libxcb-cursor.so.0", "libxcb-icccm.so.4"}
    problem = qt_platform_problem({"DISPLAY": ":0"}, "linux", loads=lambda soname: soname not in missing)
    assert problem is not None
    assert problem.endswith("sudo apt install libxcb-cursor0 libxcb-icccm4")


def test_no_problem_when_everything_loads_or_off_linux() -> None:
    assert qt_platform_problem({"DISPLAY": ":0"}, "linux", loads=lambda _soname: True) is None
    assert qt_platform_problem({}, "darwin", loads=lambda _soname: False) is None


def test_no_display_says_how_to_run_headless() -> None:
    problem = qt_platform_problem({}, "linux", loads=lambda _soname: True)
    assert problem is not None and "QT_QPA_PLATFORM=offscreen" in problem and "velox chat" in problem


def test_only_the_xcb_plugin_is_checked() -> None:
    never_loads = lambda _soname: False  # noqa: E731
    assert qt_platform_problem({"QT_QPA_PLATFORM": "offscreen"}, "linux", loads=never_loads) is None
    assert qt_platform_problem({"WAYLAND_DISPLAY": "wayland-0", "DISPLAY": ":0"}, "linux", loads=never_loads) is None
    assert qt_platform_problem({"QT_QPA_PLATFORM": "xcb"}, "linux", loads=never_loads) is not None
    assert uses_xcb({"QT_QPA_PLATFORM": "xcb:dpi=96"})


def test_library_probe_is_real() -> None:
    assert library_loads("libc.so.6")
    assert not library_loads("libvelox-does-not-exist.so.9")
    assert all(soname.startswith("lib") and ".so." in soname for soname in XCB_LIBRARIES)
