"""The memory and throughput panel: live gauges for the machine, this process, MLX and the KV cache, a plot
of prefill/decode speed, and the last reply's time to first token."""

from __future__ import annotations

from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from app.payloads import MemoryReading
from app.views.widgets.gauge import Gauge
from app.views.widgets.theme import colors
from app.views.widgets.throughput_plot import ThroughputPlot
from engine.chat.session import GenerationStats
from engine.planning.units import format_bytes


def section_title(text: str) -> QLabel:
    label = QLabel(text.upper())
    label.setObjectName("sectionTitle")
    return label


def saved_cache_text(m: MemoryReading) -> str:
    """'12.3 MB on disk · all 40.1 MB of 2.1 GB', or why there is none."""
    if m.saved_cache_budget <= 0:
        return "not kept (budget 0)"
    mine = f"{format_bytes(m.saved_cache_bytes)} on disk" if m.saved_cache_bytes else "none yet"
    return f"{mine} · all {format_bytes(m.saved_caches_bytes)} of {format_bytes(m.saved_cache_budget)}"


class MemoryPanel(QWidget):
    """Fed by ChatController.memoryUpdated (about once a second) and throughputSample / statsChanged."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(10)
        layout.addWidget(section_title("Memory"))
        self.system_gauge = Gauge("System memory")
        self.process_gauge = Gauge("Velox")
        self.mlx_gauge = Gauge("MLX active")
        self.kv_gauge = Gauge("KV cache")
        for gauge in (self.system_gauge, self.process_gauge, self.mlx_gauge, self.kv_gauge):
            layout.addWidget(gauge)
        layout.addSpacing(8)
        layout.addWidget(section_title("Throughput"))
        self.plot = ThroughputPlot()
        layout.addWidget(self.plot)
        facts = QGridLayout()
        facts.setHorizontalSpacing(8)
        facts.setVerticalSpacing(3)
        self.ttft_value = QLabel("—")
        self.prompt_value = QLabel("—")
        self.peak_value = QLabel("—")
        self.saved_value = QLabel("—")
        self.saved_value.setToolTip("This conversation's KV cache saved on disk, so reopening it reads nothing "
                                    "again; and all saved caches against their disk budget.")
        for row, (name, value) in enumerate((("First token", self.ttft_value), ("Last prompt", self.prompt_value),
                                             ("Peak memory", self.peak_value), ("Saved cache", self.saved_value))):
            caption = QLabel(name)
            caption.setObjectName("caption")
            value.setObjectName("caption")
            # Wrap rather than widen: the inspector has a fixed width, and one long line (the saved caches'
            # "… on disk · all … of …") made the whole panel wider than it, clipping every gauge on the right.
            value.setWordWrap(True)
            facts.addWidget(caption, row, 0)
            facts.addWidget(value, row, 1)
        facts.setColumnStretch(1, 1)
        layout.addLayout(facts)
        self.last_reading: MemoryReading | None = None

    def update_memory(self, m: MemoryReading) -> None:
        c = colors()
        self.last_reading = m
        total = max(m.system_total, 1)
        pressure_color = {"normal": c.good, "warning": c.warn, "critical": c.bad}.get(m.pressure, c.accent)
        self.system_gauge.set_value(
            m.system_used / total, f"{format_bytes(m.system_used)} of {format_bytes(total)}",
            f"{format_bytes(m.system_available)} available · pressure {m.pressure}", pressure_color)
        self.process_gauge.set_value(m.process_rss / total, format_bytes(m.process_rss),
                                     "resident in RAM", c.accent)
        self.mlx_gauge.set_value(m.mlx_active / total, format_bytes(m.mlx_active),
                                 f"peak {format_bytes(m.mlx_peak)} · free-list {format_bytes(m.mlx_cache)}",
                                 c.accent)
        held, fp16 = m.kv_held, m.kv_fp16
        scale = max(held, fp16, 1)
        if fp16 > 0:
            detail = f"16-bit would need {format_bytes(fp16)}"
            if held and fp16 >= held:
                detail += f" · {fp16 / held:.1f}× smaller" if fp16 > held * 1.05 else ""
        else:
            detail = "empty"
        self.kv_gauge.set_value(held / scale, format_bytes(held), detail, c.plot_prefill,
                                marker=fp16 / scale if fp16 else None)
        self.saved_value.setText(saved_cache_text(m))

    def add_throughput(self, phase: str, tokens_per_second: float) -> None:
        self.plot.add_sample(phase, tokens_per_second)

    def update_stats(self, stats: GenerationStats) -> None:
        self.ttft_value.setText(f"{stats.time_to_first_token:.2f} s")
        self.prompt_value.setText(f"{stats.prompt_tokens} tokens ({stats.reused_tokens} reused)")
        self.peak_value.setText(format_bytes(stats.peak_memory_bytes))
