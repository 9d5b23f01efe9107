"""Render the app's icons from the hand-drawn SVGs next to this file (run after editing an SVG).

    QT_QPA_PLATFORM=offscreen python resources/make_icons.py

The PNGs the running app loads go to `app/assets/` (installed with the package); the macOS bundle's icon
`resources/Velox.icns` is written here, beside its sources, for `setup_app.py`.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ASSETS = HERE.parent / "app" / "assets"
OUTPUTS = {
    "velox-icon.svg": [("velox-icon.png", 512), ("velox-icon-256.png", 256), ("velox-icon-64.png", 64)],
    # macOS wants 18 pt menu-bar images (16 px drawing area); "Template" in the name marks them as masks.
    "tray-template.svg": [("VeloxTrayTemplate.png", 18), ("VeloxTrayTemplate@2x.png", 36), ("tray-64.png", 64)],
    "chevron-down.svg": [("chevron-down.png", 24)],
}
ICNS_FILE = HERE / "Velox.icns"
# The PNG-carrying icon types of Apple's icns format and their pixel sizes (Retina variants included).
ICNS_TYPES = [
    (b"icp4", 16), (b"icp5", 32), (b"icp6", 64), (b"ic07", 128), (b"ic08", 256), (b"ic09", 512),
    (b"ic10", 1024), (b"ic11", 32), (b"ic12", 64), (b"ic13", 256), (b"ic14", 512),
]


def render_png(svg: Path, size: int) -> bytes:
    """The SVG drawn into a size x size RGBA PNG (Qt's SVG renderer; needs a QGuiApplication)."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QRectF, Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(svg))
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter, QRectF(0, 0, size, size))
    painter.end()
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    buffer.close()
    return bytes(data.data())


def icns_bytes(pngs: dict[int, bytes]) -> bytes:
    """An Apple icns container holding one PNG per icon type: 'icns' + total length, then for each entry
    its 4-byte type, its length (8 header bytes included) and the PNG. Big-endian throughout."""
    entries = b"".join(
        kind + struct.pack(">I", len(pngs[size]) + 8) + pngs[size] for kind, size in ICNS_TYPES
    )
    return b"icns" + struct.pack(">I", len(entries) + 8) + entries


def read_icns(data: bytes) -> list[tuple[str, bytes]]:
    """(type, payload) of each entry of an icns file; ValueError if the container is malformed."""
    if data[:4] != b"icns" or struct.unpack(">I", data[4:8])[0] != len(data):
        raise ValueError("not an icns file (bad magic or length)")
    entries, offset = [], 8
    while offset < len(data):
        kind, length = data[offset:offset + 4], struct.unpack(">I", data[offset + 4:offset + 8])[0]
        if length < 8 or offset + length > len(data):
            raise ValueError(f"icns entry {kind!r} overruns the file")
        entries.append((kind.decode("ascii"), data[offset + 8:offset + length]))
        offset += length
    return entries


def main() -> int:
    from PySide6.QtGui import QGuiApplication

    QGuiApplication(sys.argv[:1])
    ASSETS.mkdir(parents=True, exist_ok=True)
    for svg_name, targets in OUTPUTS.items():
        for png_name, size in targets:
            (ASSETS / png_name).write_bytes(render_png(HERE / svg_name, size))
            print(f"app/assets/{png_name} ({size}x{size})")
    sizes = sorted({size for _kind, size in ICNS_TYPES})
    ICNS_FILE.write_bytes(icns_bytes({size: render_png(HERE / "velox-icon.svg", size) for size in sizes}))
    print(f"resources/{ICNS_FILE.name} ({', '.join(map(str, sizes))} px)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
