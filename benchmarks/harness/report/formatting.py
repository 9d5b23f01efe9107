"""How numbers, tables and source citations are printed in BENCHMARKS.md and README (no I/O, no MLX)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.harness.report.data import Source

FAMILY_NAMES = {"velox": "Velox", "mlx-lm": "mlx-lm", "veloxquant": "veloxquant-mlx (peer)"}
QUICK_RUN_NOTE = (" A quick run is small (fewer tokens, rounds and trials): read its numbers as indicative; the full "
                  "run replaces it here once its file exists.")


def mb(n: float | None) -> str:
    """Bytes as MB (10⁶), or '—' when unknown."""
    return "—" if n is None else f"{n / 1e6:,.1f}"


def gb(n: float | None) -> str:
    """Bytes as GB (10⁹), or '—' when unknown."""
    return "—" if n is None else f"{n / 1e9:,.2f}"


def fmt(value: float | None, spec: str = ".3f") -> str:
    """A number in `spec`, or '—' when missing or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return format(value, spec)


def fmt_delta(row: dict[str, Any]) -> str:
    """Δ NLL ± its standard error, as every table and README print it."""
    return f"{row['delta_nll']:+.4f} ± {row['delta_nll_se']:.4f}"


def fmt_bits(row: dict[str, Any]) -> str:
    return f"{row['effective_bits']:.2f}"


def ppl(row: dict[str, Any]) -> str:
    """Δ perplexity in percent (exp(Δ NLL) − 1, from the recorded ratio)."""
    return f"{(row['ppl_ratio'] - 1) * 100:+.2f} %"


def count(value: Any) -> str:
    """A count with thousands separators, or '?' when the file does not record it."""
    return f"{value:,}" if isinstance(value, int) else "?"


def signed(value: float) -> str:
    return f"{value:+.4f}" if abs(value) >= 1e-4 else f"{value:+.1e}"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f} %"


def ms(value: float) -> str:
    """Milliseconds with as many decimals as a reader needs at that size."""
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms" if value >= 1 else f"{value:.2f} ms"


def capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table (the template puts the blank line after it)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def rel(path: Path, base: Path) -> str:
    """`path` relative to `base` when it lies under it, else as given."""
    try:
        return path.resolve().relative_to(base.resolve()).as_posix()
    except ValueError:
        return str(path)


def cite(source: Source | None, base: Path) -> str:
    """`path` (full run of DATE) or `path` (QUICK run of DATE)."""
    if source is None:
        return "no result file"
    created = source.data.get("created")
    when = f" of {created}" if created else ", no date recorded"
    run = "**quick run**" if source.quick else "full run"
    return f"`{rel(source.path, base)}` ({run}{when})"


def source_line(sources: Source | list[Source] | None, base: Path) -> str:
    """The italic 'Source: ...' paragraph of a section ('' when there is no file)."""
    if sources is None or sources == []:
        return ""
    items = sources if isinstance(sources, list) else [sources]
    tail = QUICK_RUN_NOTE if any(s.quick for s in items) else ""
    return f"*Source: {', '.join(cite(s, base) for s in items)}.*{tail}"


def model_name(source: Source | None) -> str:
    return (source.data.get("model", {}) if source else {}).get("name", "the model")


def family_name(family: str) -> str:
    return FAMILY_NAMES.get(family, family)


def machine_short(source: Source | None) -> str:
    """'Linux x86_64 CPU, 2 cores, MLX ..., mlx-lm ...' of a run ('' without one)."""
    if source is None:
        return ""
    machine = source.data.get("machine", {})
    if isinstance(machine, str):
        return machine
    return (f"{machine.get('platform', '?')} CPU, {machine.get('cpu_count', '?')} cores, MLX {machine.get('mlx', '?')}, "
            f"mlx-lm {machine.get('mlx_lm', '?')}")


def machine_line(source: Source) -> str:
    """Everything a run recorded about its machine, software and model, on one line."""
    data = source.data
    machine = data.get("machine", {})
    if isinstance(machine, str):
        return machine
    model = data.get("model", {})
    if not machine:
        return f"{data.get('gpu', data.get('device', '?'))}, MLX {data.get('mlx', '?')}, {data.get('platform', '?')}"
    return (
        f"{machine.get('platform', '?')}, {machine.get('cpu_count', '?')} CPU cores, MLX {machine.get('mlx', '?')} "
        f"({machine.get('device', '?')}), mlx-lm {machine.get('mlx_lm', '?')}, commit "
        f"{machine.get('git_commit', '?') or '?'}, load average at the start {machine.get('load_average_1_5_15', '?')}; "
        f"model {model.get('name', '?')} ({model.get('layers', '?')} layers, {model.get('kv_heads', '?')} kv heads, "
        f"head_dim {model.get('head_dim', '?')})"
    )
