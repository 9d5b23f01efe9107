"""Render the PNG icons from the hand-drawn SVGs next to this file (run after editing an SVG).

    QT_QPA_PLATFORM=offscreen python resources/make_icons.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

HERE = Path(__file__).resolve().parent
OUTPUTS = {
    "velox-icon.svg": [("velox-icon.png", 512), ("velox-icon-256.png", 256), ("velox-icon-64.png", 64)],
    # macOS wants 18 pt menu-bar images (16 px drawing area); "Template" in the name marks them as masks.
    "tray-template.svg": [("VeloxTrayTemplate.png", 18), ("VeloxTrayTemplate@2x.png", 36), ("tray-64.png", 64)],
    "chevron-down.svg": [("chevron-down.png", 24)],
}


def render(svg: Path, png: Path, size: int) -> None:
    renderer = QSvgRenderer(str(svg))
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter, QRectF(0, 0, size, size))
    painter.end()
    image.save(str(png))


def main() -> int:
    QGuiApplication(sys.argv[:1])
    for svg_name, targets in OUTPUTS.items():
        for png_name, size in targets:
            render(HERE / svg_name, HERE / png_name, size)
            print(f"{png_name} ({size}x{size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
