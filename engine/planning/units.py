"""Units for people, with no MLX: byte counts in decimal units (1 MB = 1,000,000 bytes), the way macOS's
Finder and Activity Monitor show them, so the numbers a person sees match the ones their system shows."""

from __future__ import annotations

_DECIMAL_UNITS = ("B", "KB", "MB", "GB", "TB")


def format_bytes(n: int | float) -> str:
    """A byte count in decimal units like macOS shows them: '512 B', '1.6 MB', '310 MB', '1.2 GB'.

    One decimal below 10 units and always from GB on, whole numbers otherwise; the unit is chosen after
    rounding, so 999.7 MB is shown as '1.0 GB', never '1000 MB'.
    """
    sign = "-" if n < 0 else ""
    magnitude = abs(float(n))
    last = len(_DECIMAL_UNITS) - 1
    for index, unit in enumerate(_DECIMAL_UNITS):
        value = magnitude / 1000**index
        decimals = 1 if index > 0 and (index >= 3 or value < 10) else 0
        rounded = round(value, decimals)
        if rounded < 1000 or index == last:
            return f"{sign}{rounded:.{decimals}f} {unit}"
    raise AssertionError("unreachable: the last unit always returns")
