"""The inspector: the memory panel fits its fixed width whatever its figures say (offscreen Qt), and a
compression level says what it keeps besides its codes."""

from __future__ import annotations

import pytest

pytest.importorskip("PySide6")

from app.payloads import MemoryReading  # noqa: E402
from app.views.chat_window import INSPECTOR_WIDTH  # noqa: E402
from app.views.widgets.memory_panel import MemoryPanel, saved_cache_text  # noqa: E402

GB = 1_000_000_000


def test_long_figures_wrap_inside_the_inspector(qtbot) -> None:
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    reading = MemoryReading(
        system_total=137 * GB, system_available=12 * GB, system_used=125 * GB, pressure="warning",
        process_rss=96 * GB, mlx_active=88 * GB, mlx_peak=101 * GB, mlx_cache=7 * GB, kv_held=23 * GB,
        kv_fp16=91 * GB, read_seconds=0.01,
        saved_cache_bytes=1_234 * 1_000_000, saved_caches_bytes=123 * GB, saved_cache_budget=200 * GB,
    )
    panel.update_memory(reading)
    assert "on disk · all" in saved_cache_text(reading)
    # The inspector lays the panel out with 16-pixel margins on each side.
    assert panel.minimumSizeHint().width() <= INSPECTOR_WIDTH - 32


def test_level_summary_names_what_a_level_keeps_besides_its_codes() -> None:
    from app.payloads import LevelSummary
    from engine.kvcache.config import KVCacheConfig
    from engine.planning.recommend import CompressionLevel

    config = KVCacheConfig.parse("kivi:k4v4:g64:w32:s4:key_block=128")
    summary = LevelSummary.from_level(CompressionLevel("4", "4-bit", config, "small quality loss"))
    assert summary.extras == "4 sink tokens in 16 bits, last 32 tokens in 16 bits, keys in blocks of 128 tokens"
    plain = LevelSummary.from_level(CompressionLevel("4", "4-bit", KVCacheConfig.parse("kivi:k4v4:g64"), ""))
    assert plain.extras == ""
    level = LevelSummary.from_level(CompressionLevel(
        "4", "4-bit", KVCacheConfig.parse("kivi:k4v4:g64:s4:key_block=128:rope=auto:wide=0.1"), ""))
    assert level.extras == ("4 sink tokens in 16 bits, keys in blocks of 128 tokens, one bit more on the 10% most "
                            "sensitive layers, keys stored before RoPE on a GPU")
    widths = LevelSummary.from_level(CompressionLevel(
        "2", "2-bit", KVCacheConfig.parse("kivi:k2v2:g64:key_widths=calibrated:rope=auto"), ""))
    assert widths.extras == "key channels at calibrated widths, keys stored before RoPE on a GPU"
