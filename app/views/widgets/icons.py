"""Line icons drawn from small SVG paths (24x24 grid, SF-Symbols-like strokes), tinted to any colour.

Drawing them at runtime keeps them sharp at every scale and lets them follow light and dark mode.
"""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QRectF, QSize, Qt
from PySide6.QtGui import QIcon, QPainter, QPixmap
from PySide6.QtSvg import QSvgRenderer
from PySide6.QtWidgets import QAbstractButton

_STROKE = 'fill="none" stroke="{color}" stroke-width="{width}" stroke-linecap="round" stroke-linejoin="round"'

# Each entry is the inside of an <svg viewBox="0 0 24 24">; {s} is replaced by the stroke attributes.
_SHAPES: dict[str, str] = {
    "plus": '<path {s} d="M12 5v14M5 12h14"/>',
    "new-chat": '<path {s} d="M4 20l1.2-4.2A8 8 0 1 1 8.4 19z"/><path {s} d="M12 8.5v7M8.5 12h7"/>',
    "attach": '<path {s} d="M20.5 11.5l-8.3 8.3a5 5 0 0 1-7.1-7.1l8.5-8.5a3.4 3.4 0 0 1 4.8 4.8l-8.4 8.4'
              'a1.7 1.7 0 0 1-2.4-2.4l7.7-7.7"/>',
    "send": '<path {s} d="M12 19V5M6 11l6-6 6 6"/>',
    "stop": '<rect x="7" y="7" width="10" height="10" rx="2" fill="{color}"/>',
    "copy": '<rect {s} x="8" y="8" width="12" height="12" rx="2.5"/>'
            '<path {s} d="M16 8V6.5A2.5 2.5 0 0 0 13.5 4h-7A2.5 2.5 0 0 0 4 6.5v7A2.5 2.5 0 0 0 6.5 16H8"/>',
    "regenerate": '<path {s} d="M19.5 12a7.5 7.5 0 1 1-2.2-5.3"/><path {s} d="M19.5 4.5v4h-4"/>',
    "document": '<path {s} d="M14 3H7a2 2 0 0 0-2 2v14a2 2 0 0 0 2 2h10a2 2 0 0 0 2-2V8z"/>'
                '<path {s} d="M14 3v5h5M9 13h6M9 17h4"/>',
    "close": '<path {s} d="M7 7l10 10M17 7L7 17"/>',
    "sidebar": '<rect {s} x="3" y="5" width="18" height="14" rx="2.5"/><path {s} d="M9 5v14"/>',
    "inspector": '<rect {s} x="3" y="5" width="18" height="14" rx="2.5"/><path {s} d="M15 5v14"/>',
    "chip": '<rect {s} x="6" y="6" width="12" height="12" rx="2"/>'
            '<path {s} d="M9 3v3M15 3v3M9 18v3M15 18v3M3 9h3M3 15h3M18 9h3M18 15h3"/>',
    "chevron-down": '<path {s} d="M7 10l5 5 5-5"/>',
    "warning": '<path {s} d="M12 4l9 16H3z"/><path {s} d="M12 10v4M12 17.2v.1"/>',
    "download": '<path {s} d="M12 4v11M7 10.5l5 5 5-5M5 20h14"/>',
}


def svg_markup(name: str, color: str, width: float = 1.8) -> str:
    stroke = _STROKE.format(color=color, width=width)
    body = _SHAPES[name].replace("{s}", stroke).replace("{color}", color)
    return f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24">{body}</svg>'


def pixmap(name: str, color: str, size: int = 18, width: float = 1.8, device_pixel_ratio: float = 2.0) -> QPixmap:
    renderer = QSvgRenderer(QByteArray(svg_markup(name, color, width).encode()))
    image = QPixmap(int(size * device_pixel_ratio), int(size * device_pixel_ratio))
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter, QRectF(0, 0, image.width(), image.height()))
    painter.end()
    image.setDevicePixelRatio(device_pixel_ratio)
    return image


def icon(name: str, color: str, size: int = 18, disabled_color: str | None = None) -> QIcon:
    result = QIcon()
    result.addPixmap(pixmap(name, color, size), QIcon.Mode.Normal)
    if disabled_color:
        result.addPixmap(pixmap(name, disabled_color, size), QIcon.Mode.Disabled)
    return result


def icon_size(size: int = 18) -> QSize:
    return QSize(size, size)


def dress_button(
    button: QAbstractButton, name: str, color: str, size: int, tooltip: str, *, pointing_cursor: bool = True
) -> None:
    """Give a button icon `name` at `size` px, a tooltip and (unless told not to) a pointing-hand cursor."""
    button.setIcon(icon(name, color, size))
    button.setIconSize(icon_size(size))
    button.setToolTip(tooltip)
    if pointing_cursor:
        button.setCursor(Qt.CursorShape.PointingHandCursor)
