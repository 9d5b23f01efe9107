"""BENCHMARKS.md, the figures and README's benchmark block, generated only from the JSON results.

Every number comes from a result file; nothing is typed by hand. Each section reads the best file there is
for it (a full run over a quick one: `Results.best`) and says which file that was. Files are found in the
results folder and in its `quick/` subfolder by the `kind` they record, so a new run lands in the report by
being written there and rerunning `velox bench report`.

    data.py        the result files, the best one per section, and the facts read from them
    formatting.py  how numbers, tables and source citations print
    sections.py    the quality sections' values and tables; runs.py the memory, speed, GPU, peer ones
    markdown.py    BENCHMARKS.md and README's block from templates/*.md.j2 (the prose lives there)
    figures.py     the PNG figures (matplotlib, the optional `bench` extra)

A new section is a function returning its values, a template, and an include line in
templates/benchmarks.md.j2. Without matplotlib the markdown is still written and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchmarks.harness.common import ROOT
from benchmarks.harness.report import figures as draw
from benchmarks.harness.report.data import (
    Results,
    Source,
    app_levels,
    best_within,
    gpu_rows_at,
    large_shape_bits,
    level_matches,
    load_results,
    mlx_budgets,
    quality_rows,
    row_by_label,
    row_by_spec,
)
from benchmarks.harness.report.formatting import fmt_bits, fmt_delta, rel
from benchmarks.harness.report.markdown import (
    README_END,
    README_START,
    document,
    readme_block,
    readme_section,
    update_readme,
)
from benchmarks.harness.report.sections import compare_loss

__all__ = [
    "FIGURE_NAMES", "NO_MATPLOTLIB", "README_END", "README_START", "Results", "Source", "app_levels", "best_within", "compare_loss",
    "fmt_bits", "fmt_delta", "gpu_rows_at", "large_shape_bits", "level_matches", "load_results", "mlx_budgets",
    "quality_rows", "readme_block", "readme_section", "row_by_label", "row_by_spec", "update_readme", "write_report",
]

FIGURE_NAMES = (
    "quality_vs_bits.png", "vs_mlx_lm.png", "bytes_vs_context.png", "tokps_vs_context.png", "gpu_attention.png",
)
ALT_TEXT = {
    "quality_vs_bits.png": "quality against bits held, with the Pareto front",
    "vs_mlx_lm.png": "Velox against mlx-lm's QuantizedKVCache at equal or fewer bits",
    "bytes_vs_context.png": "bytes held against context",
    "tokps_vs_context.png": "decode tok/s against context",
    "gpu_attention.png": "GPU attention only (not whole-model decode): time per step against context",
}
NO_MATPLOTLIB = "*(Figure not drawn: matplotlib is not installed; install the `bench` extra and rerun the report.)*"


def _figure_jobs(results: Results, base: Path) -> list[tuple[str, object, Callable[[Path], None]]]:
    """(file name, the data it needs (nothing drawn when falsy), how to draw it), in FIGURE_NAMES order."""
    quality = results.best("quality", "perplexity")
    memory = results.best("memory")
    speeds = results.preferred("speed")
    gpu = results.best("gpu")
    return [
        (FIGURE_NAMES[0], quality, lambda p: draw.figure_quality(quality, p, base)),
        (FIGURE_NAMES[1], quality, lambda p: draw.figure_vs_mlx(quality, p, base)),
        (FIGURE_NAMES[2], memory, lambda p: draw.figure_memory(memory, p, base)),
        (FIGURE_NAMES[3], speeds, lambda p: draw.figure_speed(speeds, p, base)),
        (FIGURE_NAMES[4], gpu, lambda p: draw.figure_gpu(gpu, p, base)),
    ]


def write_figures(results: Results, figures_dir: Path, base: Path) -> dict[str, str]:
    """Draw every figure there is data for; return each figure's markdown line ('' when there is nothing to
    show, the reason when matplotlib is missing)."""
    try:
        draw.pyplot()
    except ImportError:
        return dict.fromkeys(FIGURE_NAMES, NO_MATPLOTLIB)
    figures_dir.mkdir(parents=True, exist_ok=True)
    lines = dict.fromkeys(FIGURE_NAMES, "")
    for name, needed, figure in _figure_jobs(results, base):
        target = figures_dir / name
        if not needed:
            continue
        figure(target)
        if target.is_file():
            lines[name] = f"![{ALT_TEXT[name]}]({rel(target, base)})"
    return lines


# Sections after this line in BENCHMARKS.md are written by other scripts (e.g. benchmarks/serve_ttft.py) and are
# carried over unchanged when the report is regenerated.
HAND_WRITTEN_MARKER = "<!-- hand-written sections below: kept as they are by `velox bench report` -->"


def _hand_written_part(markdown: Path) -> str:
    text = markdown.read_text(encoding="utf-8") if markdown.is_file() else ""
    return "\n" + text[text.index(HAND_WRITTEN_MARKER):] if HAND_WRITTEN_MARKER in text else ""


def write_report(results_dir: Path, markdown: Path, figures_dir: Path, readme: Path | None = None) -> list[Path]:
    """Write BENCHMARKS.md (and the figures when matplotlib is installed) from the results in `results_dir`.

    README's benchmark block is refreshed too when `readme` is given, or when `markdown` is the checkout's own
    BENCHMARKS.md (then README.md beside it, if it has the markers)."""
    results = load_results(results_dir)
    base = markdown.resolve().parent
    figure_lines = write_figures(results, figures_dir, base)
    drawn = [figures_dir / name for name in FIGURE_NAMES if figure_lines[name].startswith("![")]
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(document(results, base, figure_lines) + _hand_written_part(markdown), encoding="utf-8")
    written = [markdown, *drawn]
    if readme is None and markdown.resolve() == (ROOT / "BENCHMARKS.md").resolve():
        readme = ROOT / "README.md"
    if readme is not None and update_readme(readme, results):
        written.append(readme)
    return written
