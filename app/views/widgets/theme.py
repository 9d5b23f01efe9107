"""Colours, fonts and the style sheet: one place that makes the app look like a quiet native Mac app.

Colours follow the system palette: a dark palette (macOS dark mode, a dark Linux theme) gets the dark set.
On macOS the system font and accent colour are kept; elsewhere the nearest clean sans-serif is chosen.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from PySide6.QtGui import QColor, QFont, QFontDatabase, QGuiApplication, QPalette

from app.assets import asset_path

# Fonts tried in order off macOS; the first one installed wins (Qt's "Sans Serif" otherwise).
_PREFERRED_FAMILIES = ("Inter", "SF Pro Text", "Cantarell", "Noto Sans", "Segoe UI", "Ubuntu", "DejaVu Sans")
MONO_FAMILIES = ("SF Mono", "Menlo", "JetBrains Mono", "Noto Sans Mono", "DejaVu Sans Mono", "Consolas")


@dataclass(frozen=True)
class Colors:
    dark: bool
    window: str  # chat area
    sidebar: str
    inspector: str
    separator: str
    text: str
    secondary: str  # captions, hints
    accent: str
    accent_text: str
    user_bubble: str
    user_text: str
    assistant_bubble: str
    assistant_text: str
    field: str  # input background
    field_border: str
    selection: str  # selected list row
    good: str
    warn: str
    bad: str
    plot_prefill: str
    plot_decode: str
    banner: str
    banner_text: str


LIGHT = Colors(
    dark=False, window="#ffffff", sidebar="#f2f2f4", inspector="#f7f7f8", separator="#e1e1e4",
    text="#1d1d1f", secondary="#86868b", accent="#0a7aff", accent_text="#ffffff",
    user_bubble="#0a7aff", user_text="#ffffff", assistant_bubble="#f0f0f2", assistant_text="#1d1d1f",
    field="#ffffff", field_border="#d2d2d7", selection="#dcdce1", good="#30b158", warn="#f5a623",
    bad="#ff3b30", plot_prefill="#af52de", plot_decode="#0a7aff", banner="#fff1f0", banner_text="#a1140b",
)
DARK = Colors(
    dark=True, window="#1e1e1e", sidebar="#262628", inspector="#232325", separator="#38383a",
    text="#f5f5f7", secondary="#98989d", accent="#0a84ff", accent_text="#ffffff",
    user_bubble="#0a84ff", user_text="#ffffff", assistant_bubble="#2c2c2e", assistant_text="#f5f5f7",
    field="#2a2a2c", field_border="#3a3a3c", selection="#3a3a3e", good="#32d74b", warn="#ffd60a",
    bad="#ff453a", plot_prefill="#bf5af2", plot_decode="#0a84ff", banner="#3a1d1b", banner_text="#ff9f97",
)


def is_dark(palette: QPalette | None = None) -> bool:
    palette = palette or QGuiApplication.palette()
    return palette.color(QPalette.ColorRole.Window).lightness() < 128


def colors() -> Colors:
    """The colour set for the current palette (macOS keeps the user's accent colour)."""
    base = DARK if is_dark() else LIGHT
    if sys.platform == "darwin":
        accent = QGuiApplication.palette().color(QPalette.ColorRole.Accent).name()
        base = replace(base, accent=accent, user_bubble=accent, plot_decode=accent)
    return base


def ui_font() -> QFont:
    """The system font on macOS; elsewhere the first preferred family installed, at a Mac-like size."""
    font = QGuiApplication.font()
    if sys.platform == "darwin":
        return font
    families = set(QFontDatabase.families())
    for family in _PREFERRED_FAMILIES:
        if family in families:
            font = QFont(family)
            break
    font.setPointSizeF(10.0)  # 13 px at 96 dpi: the size of macOS body text
    return font


def mono_family() -> str:
    families = set(QFontDatabase.families())
    return next((family for family in MONO_FAMILIES if family in families), "monospace")


def qcolor(value: str, alpha: float = 1.0) -> QColor:
    color = QColor(value)
    color.setAlphaF(alpha)
    return color


CHEVRON = asset_path("chevron-down.png").as_posix()


def style_sheet(c: Colors) -> str:
    """The application style sheet. Widgets opt in to roles with object names (#sidebar, #inspector...)."""
    return f"""
    QMainWindow, QDialog {{ background: {c.window}; color: {c.text}; }}
    QWidget {{ color: {c.text}; }}
    QToolTip {{ background: {c.field}; color: {c.text}; border: 1px solid {c.separator}; padding: 4px; }}

    #sidebar {{ background: {c.sidebar}; border-right: 1px solid {c.separator}; }}
    #inspector {{ background: {c.inspector}; border-left: 1px solid {c.separator}; }}
    #chatArea, #messageColumn {{ background: {c.window}; }}
    #header {{ background: {c.window}; border-bottom: 1px solid {c.separator}; }}
    #headerTitle {{ font-weight: 600; }}
    #sectionTitle {{ color: {c.secondary}; font-size: 8pt; font-weight: 600; letter-spacing: 0.5px; }}
    #caption {{ color: {c.secondary}; font-size: 8.5pt; }}
    #hint {{ color: {c.secondary}; }}

    QScrollArea {{ border: none; background: transparent; }}
    QScrollBar:vertical {{ background: transparent; width: 10px; margin: 2px; }}
    QScrollBar::handle:vertical {{ background: {c.secondary}; border-radius: 3px; min-height: 30px; }}
    QScrollBar::add-line, QScrollBar::sub-line {{ height: 0; }}
    QScrollBar::add-page, QScrollBar::sub-page {{ background: transparent; }}

    QListWidget {{ background: transparent; border: none; outline: none; }}
    QListWidget::item {{ border-radius: 6px; padding: 6px 8px; margin: 1px 0; }}
    QListWidget::item:selected {{ background: {c.selection}; color: {c.text}; }}

    QPushButton {{
        background: {c.field}; border: 1px solid {c.field_border}; border-radius: 6px;
        padding: 4px 12px; min-height: 18px;
    }}
    QPushButton:hover {{ border-color: {c.secondary}; }}
    QPushButton:pressed {{ background: {c.selection}; }}
    QPushButton:disabled {{ color: {c.secondary}; }}
    QPushButton#primary {{ background: {c.accent}; color: {c.accent_text}; border: none; font-weight: 600; }}
    QPushButton#primary:disabled {{ background: {c.selection}; color: {c.secondary}; }}
    QPushButton#flat, QToolButton#flat {{ background: transparent; border: none; padding: 4px 8px; }}
    QPushButton#flat:hover, QToolButton#flat:hover {{ background: {c.selection}; border-radius: 6px; }}
    QPushButton#link {{ background: transparent; border: none; color: {c.accent}; padding: 0 2px; }}
    QToolButton {{ background: transparent; border: none; border-radius: 6px; padding: 4px; }}
    QToolButton:hover {{ background: {c.selection}; }}

    #composer {{ background: {c.field}; border: 1px solid {c.field_border}; border-radius: 18px; }}
    #composer QPlainTextEdit {{ background: transparent; border: none; padding: 0; }}

    QLineEdit, QComboBox, QSpinBox {{
        background: {c.field}; border: 1px solid {c.field_border}; border-radius: 6px; padding: 3px 6px;
    }}
    QComboBox::drop-down {{ border: none; width: 20px; }}
    QComboBox::down-arrow {{ image: url({CHEVRON}); width: 12px; height: 12px; }}

    QProgressBar {{
        background: {c.selection}; border: none; border-radius: 3px; height: 6px; max-height: 6px;
        text-align: center; color: transparent;
    }}
    QProgressBar::chunk {{ background: {c.accent}; border-radius: 3px; }}

    QSlider::groove:horizontal {{ height: 4px; background: {c.selection}; border-radius: 2px; }}
    QSlider::sub-page:horizontal {{ background: {c.accent}; border-radius: 2px; }}
    QSlider::handle:horizontal {{
        background: #ffffff; border: 1px solid {c.field_border}; width: 16px; height: 16px;
        margin: -7px 0; border-radius: 8px;
    }}

    QTableWidget {{
        background: {c.field}; border: 1px solid {c.separator}; border-radius: 6px;
        gridline-color: transparent; selection-background-color: {c.accent}; selection-color: {c.accent_text};
        alternate-background-color: {c.sidebar};
    }}
    QHeaderView::section {{
        background: {c.window}; color: {c.secondary}; border: none; border-bottom: 1px solid {c.separator};
        padding: 4px 6px; font-weight: 600;
    }}
    QCheckBox, QRadioButton {{ spacing: 6px; }}
    QMenu {{ background: {c.field}; border: 1px solid {c.separator}; padding: 4px; border-radius: 6px; }}
    QMenu::item {{ padding: 4px 18px; border-radius: 4px; }}
    QMenu::item:selected {{ background: {c.accent}; color: {c.accent_text}; }}
    QMenu::separator {{ height: 1px; background: {c.separator}; margin: 4px 6px; }}
    QMenuBar {{ background: {c.window}; }}

    #banner {{ background: {c.banner}; border: 1px solid {c.bad}; border-radius: 8px; }}
    #banner QLabel {{ color: {c.banner_text}; }}
    #chip {{ background: {c.assistant_bubble}; border-radius: 8px; }}
    """
