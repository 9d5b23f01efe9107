"""The figure of a `velox bench decode` run, drawn as SVG by hand (no matplotlib: it is an optional extra).

    python benchmarks/plot_decode.py [--rows benchmarks/results/decode-h200.json] [--out docs/figures/decode-h200.svg]

Top panel: tok/s of one whole-model decode step (or, with `--series loop`, of mlx-lm's own decode loop, the
`gen_tok_s` of a run made without --no-generate: what the app and `velox serve` run), bars grouped by context,
one colour per cache (fp16, the reference, in black with a dashed line across its group so every other bar reads
against it). Bottom panel, when the rows carry `bound_tok_s`: each bar's share of its memory bound (the speed of a
step that reads the weights and the cache once at the measured bandwidth), the bound drawn as the 100 % line. A
cache that failed is an × in its slot and says so in the legend. Every number comes from the rows file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROWS = ROOT / "benchmarks" / "results" / "decode-h200.json"
DEFAULT_OUT = ROOT / "docs" / "figures" / "decode-h200.svg"

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
REFERENCE = "fp16"
REFERENCE_COLOUR = "#111111"
# One hue per family, shades in order of appearance, so kivi's four rows read as one family.
FAMILY_SHADES = {
    "mlx-kv": ["#a6a6a6"],
    "mlx-q": ["#6e6e6e", "#8c8c8c"],
    "affine": ["#1f63b4", "#6a9fd8"],
    "rotated": ["#7b4fa0", "#b190d0"],
    "kivi": ["#0b6b3a", "#2fa05a", "#74c476", "#b5dfa0", "#00441b"],
    "turboquant": ["#d35400", "#f5a65b"],
    "rvq": ["#b2182b", "#ef8a8a"],
}
OTHER_SHADES = ["#17becf", "#bcbd22", "#e377c2", "#8c564b", "#9467bd", "#ff7f0e"]
LABELS = {
    "fp16": "fp16 (Velox 16-bit cache, reference)",
    "mlx-kv": "mlx-kv (mlx-lm KVCache)",
    "no-history": "no-history (no cache: the ceiling)",
}

LEGEND_CHARS = 40  # a legend line's length before it wraps (the legend column is ~270 px of 12 px text)


def legend_lines(spec: str) -> list[str]:
    """A spec's legend entry: its name (or LABELS'), the model's RoPE that the builder writes after `rope=pre`
    left out (the same for every row of a run), wrapped at ':' into lines of at most LEGEND_CHARS where it can."""
    if spec in LABELS:
        return [LABELS[spec]]
    if spec.startswith("mlx-q:"):
        return [f"{spec} (mlx-lm QuantizedKVCache)"]
    parts = [p for p in spec.split(":") if not p.startswith(("rope_dims=", "rope_base=", "rope_scale=",
                                                                  "rope_traditional="))]
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + 1 + len(part) <= LEGEND_CHARS:
            lines[-1] += ":" + part
        else:
            lines.append(":" + part)
    return lines


# Layout, in SVG user units (px).
WIDTH = 1240
LEFT, PLOT_WIDTH, LEGEND_X = 80, 830, 945
TOP_Y, TOP_HEIGHT = 104, 380
BOTTOM_GAP, BOTTOM_HEIGHT = 70, 180


def spec_colours(specs: list[str]) -> dict[str, str]:
    """A colour per spec: fp16 black, each family its own hue (shades by order of appearance)."""
    colours: dict[str, str] = {}
    used: dict[str, int] = {}
    others = 0
    for spec in specs:
        if spec == REFERENCE:
            colours[spec] = REFERENCE_COLOUR
            continue
        family = spec.split(":")[0].split("+")[0].split("@")[0]
        shades = FAMILY_SHADES.get(family)
        index = used.get(family, 0)
        if shades and index < len(shades):
            colours[spec] = shades[index]
            used[family] = index + 1
        else:
            colours[spec] = OTHER_SHADES[others % len(OTHER_SHADES)]
            others += 1
    return colours


def nice_ticks(top: float, target: int = 6) -> list[float]:
    """Round tick values from 0 to at least `top` (steps of 1, 2, 2.5 or 5 times a power of ten)."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / target
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    count = math.ceil(top / step - 1e-9)
    return [i * step for i in range(count + 1)]


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 or value == int(value) else f"{value:,.1f}"


def _text(x: float, y: float, body: str, size: int = 12, anchor: str = "start", weight: str = "normal",
          colour: str = "#222", rotate: bool = False, extra: str = "") -> str:
    transform = f' transform="rotate(-90 {x:.1f} {y:.1f})"' if rotate else ""
    bold = f' font-weight="{weight}"' if weight != "normal" else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{colour}"'
            f'{bold}{transform}{extra}>{escape(body)}</text>')


def default_title(record: dict[str, Any]) -> str:
    """"Whole-model decode, H200, 8B-shaped model, 4-bit weights" from the run's own record."""
    gpu = str(record.get("gpu", "")).split(",")[0].strip()
    device = gpu.removeprefix("NVIDIA ").strip() if gpu and not gpu.startswith("unknown") else record.get("device", "?")
    shape = record.get("shape", {})
    model = "8B-shaped model" if shape.get("layers") == 32 and shape.get("hidden") == 4096 else \
        f"{shape.get('layers', '?')}-layer model"
    return f"Whole-model decode, {device}, {model}, {shape.get('weight_bits', '?')}-bit weights"


# What a figure's bars show: the row fields of its speed and of its ratio to fp16, and the subtitle's words for it.
SERIES = {
    "step": ("tok_s", "vs_fp16", "tok/s of one step, model(token, cache=caches), median of {steps} after {warmup} "
                                 "warm-ups"),
    "loop": ("gen_tok_s", "gen_vs_fp16", "tok/s of mlx-lm's decode loop (generate_step, as the app runs it), mean over "
                                         "{steps} tokens after {warmup}"),
}


def render_svg(record: dict[str, Any], source: str, title: str | None = None, series: str = "step") -> str:
    """The SVG text of one decode run (`record` as benchmarks/decode.py writes it); `series` one of SERIES."""
    speed, ratio_key, measure = SERIES[series]
    if series != "step":
        if not any(speed in row for row in record["rows"]):
            raise ValueError(f"This run has no {speed} (it was made with --no-generate): draw its steps instead.")
        record = {**record, "rows": [
            {key: value for key, value in row.items() if key not in ("tok_s", "vs_fp16")}
            | ({"tok_s": row[speed]} if speed in row else {"error": row.get("error", f"no {speed} in this run")})
            | ({"vs_fp16": row[ratio_key]} if ratio_key in row else {})
            for row in record["rows"]]}
    rows = record["rows"]
    specs = list(dict.fromkeys(row["spec"] for row in rows))
    contexts = sorted({row["context"] for row in rows})
    by_key = {(row["spec"], row["context"]): row for row in rows}
    colours = spec_colours(specs)
    measured = [row for row in rows if "tok_s" in row]
    has_bound = any("bound_tok_s" in row for row in measured)

    top_ticks = nice_ticks(max((row["tok_s"] for row in measured), default=1.0) * 1.12)
    top_max = top_ticks[-1]
    shares = [100 * row["tok_s"] / row["bound_tok_s"] for row in measured if row.get("bound_tok_s")]
    bottom_ticks = nice_ticks(max([100.0, *shares]), target=4)
    bottom_max = bottom_ticks[-1]
    bottom_y = TOP_Y + TOP_HEIGHT + BOTTOM_GAP
    height = (bottom_y + BOTTOM_HEIGHT if has_bound else TOP_Y + TOP_HEIGHT) + 62

    group_width = PLOT_WIDTH / len(contexts)
    bar_width = group_width * 0.86 / len(specs)

    def bar_x(spec_index: int, context_index: int) -> float:
        return LEFT + context_index * group_width + group_width * 0.07 + spec_index * bar_width

    def top_y(value: float) -> float:
        return TOP_Y + TOP_HEIGHT * (1 - value / top_max)

    def bottom_of(value: float) -> float:
        return bottom_y + BOTTOM_HEIGHT * (1 - value / bottom_max)

    shape = record.get("shape", {})
    rounds = record.get("rounds", 1)
    subtitle = (measure.format(steps=record.get("steps", "?"), warmup=record.get("warmup", "?"))
                + (f", of {rounds} rounds" if rounds > 1 else "")
                + f"; {shape.get('layers', '?')} layers, "
                f"{shape.get('heads', '?')} query / {shape.get('kv_heads', '?')} KV heads, head_dim "
                f"{shape.get('head_dim', '?')}, {shape.get('dtype', '?')}, {shape.get('weight_bits', '?')}-bit "
                f"g{shape.get('weight_group', '?')} weights")
    where = f"MLX {record.get('mlx', '?')} on {record.get('gpu') or record.get('device', '?')}. Data: {source}"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family={quoteattr(FONT)}>',
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        _text(LEFT, 34, title or default_title(record), size=20, weight="bold", extra=' class="title"'),
        _text(LEFT, 58, subtitle, size=12, colour="#555"),
        _text(LEFT, 76, where, size=12, colour="#555"),
    ]

    # Axes, grid and labels of both panels.
    out.append('<g class="axes">')
    for tick in top_ticks:
        y = top_y(tick)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + PLOT_WIDTH}" y2="{y:.1f}" stroke="#e3e3e3"/>')
        out.append(_text(LEFT - 8, y + 4, _fmt(tick), size=11, anchor="end", colour="#444"))
    out.append(_text(24, TOP_Y + TOP_HEIGHT / 2, "tokens per second (higher is faster)", size=12, anchor="middle",
                     rotate=True))
    if has_bound:
        for tick in bottom_ticks:
            y = bottom_of(tick)
            out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + PLOT_WIDTH}" y2="{y:.1f}" stroke="#e3e3e3"/>')
            out.append(_text(LEFT - 8, y + 4, f"{tick:.0f} %", size=11, anchor="end", colour="#444"))
        out.append(_text(24, bottom_y + BOTTOM_HEIGHT / 2, "% of the memory bound", size=12, anchor="middle",
                         rotate=True))
        bound_y = bottom_of(100)
        out.append(f'<line class="bound" x1="{LEFT}" y1="{bound_y:.1f}" x2="{LEFT + PLOT_WIDTH}" y2="{bound_y:.1f}" '
                   f'stroke="#c0392b" stroke-width="2" stroke-dasharray="7 4"/>')
        out.append(_text(LEFT + 6, bound_y - 6, "memory bound = read bandwidth ÷ (weight bytes + cache bytes), "
                         "measured on the device", size=11, colour="#c0392b"))
    for index, context in enumerate(contexts):
        centre = LEFT + (index + 0.5) * group_width
        for panel_bottom in [TOP_Y + TOP_HEIGHT] + ([bottom_y + BOTTOM_HEIGHT] if has_bound else []):
            out.append(_text(centre, panel_bottom + 18, f"{context:,} tokens", size=12, anchor="middle"))
        if index:
            x = LEFT + index * group_width
            out.append(f'<line x1="{x:.1f}" y1="{TOP_Y}" x2="{x:.1f}" y2="{TOP_Y + TOP_HEIGHT}" stroke="#cccccc"/>')
    axis_bottom = (bottom_y + BOTTOM_HEIGHT) if has_bound else TOP_Y + TOP_HEIGHT
    out.append(_text(LEFT + PLOT_WIDTH / 2, axis_bottom + 42, "context: tokens in every layer's cache", size=12,
                     anchor="middle"))
    for panel_top, panel_height in [(TOP_Y, TOP_HEIGHT)] + ([(bottom_y, BOTTOM_HEIGHT)] if has_bound else []):
        out.append(f'<line x1="{LEFT}" y1="{panel_top}" x2="{LEFT}" y2="{panel_top + panel_height}" stroke="#333"/>')
        out.append(f'<line x1="{LEFT}" y1="{panel_top + panel_height}" x2="{LEFT + PLOT_WIDTH}" '
                   f'y2="{panel_top + panel_height}" stroke="#333"/>')
    out.append("</g>")

    # The fp16 level across each group, under the bars' labels.
    for index, context in enumerate(contexts):
        row = by_key.get((REFERENCE, context))
        if row and "tok_s" in row:
            y = top_y(row["tok_s"])
            x0, x1 = bar_x(0, index), bar_x(len(specs), index)
            out.append(f'<line class="reference" x1="{x0:.1f}" y1="{y:.1f}" x2="{x1:.1f}" y2="{y:.1f}" '
                       f'stroke="{REFERENCE_COLOUR}" stroke-width="1.2" stroke-dasharray="4 3"/>')

    # One group per spec: its bars in both panels (or its failure marks), then its legend entry.
    legend_y = TOP_Y + 4
    out.append(_text(LEGEND_X, legend_y, "cache (decode.py spec)", size=12, weight="bold"))
    legend_y += 12
    for spec_index, spec in enumerate(specs):
        colour = colours[spec]
        out.append(f'<g class="series" data-spec={quoteattr(spec)}>')
        errors = []
        for context_index, context in enumerate(contexts):
            row = by_key.get((spec, context))
            x = bar_x(spec_index, context_index)
            width = bar_width * 0.9
            if row is None:
                continue
            if "tok_s" not in row:
                errors.append(row.get("error", "failed"))
                cx, cy = x + width / 2, TOP_Y + TOP_HEIGHT - 8
                out.append(f'<path d="M{cx - 4:.1f},{cy - 4:.1f} L{cx + 4:.1f},{cy + 4:.1f} M{cx - 4:.1f},'
                           f'{cy + 4:.1f} L{cx + 4:.1f},{cy - 4:.1f}" stroke="{colour}" stroke-width="2">'
                           f'<title>{escape(spec)} at {context:,}: {escape(row.get("error", "failed"))}</title></path>')
                out.append(_text(cx + 4, cy - 10, "failed", size=9, colour="#555", rotate=True))
                continue
            tok_s = row["tok_s"]
            y = top_y(tok_s)
            ratio = f", {row['vs_fp16']:.2f}× fp16" if "vs_fp16" in row else ""
            stroke = ' stroke="#000" stroke-width="1.5"' if spec == REFERENCE else ""
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{TOP_Y + TOP_HEIGHT - y:.1f}" '
                       f'fill="{colour}"{stroke}><title>{escape(spec)} at {context:,} tokens: {tok_s:.1f} tok/s'
                       f'{ratio}</title></rect>')
            out.append(_text(x + width / 2 + 3.5, y - 4, f"{tok_s:.0f}", size=10,
                             weight="bold" if spec == REFERENCE else "normal", colour="#333", rotate=True))
            if has_bound and row.get("bound_tok_s"):
                share = 100 * tok_s / row["bound_tok_s"]
                by = bottom_of(share)
                out.append(f'<rect x="{x:.1f}" y="{by:.1f}" width="{width:.1f}" '
                           f'height="{bottom_y + BOTTOM_HEIGHT - by:.1f}" fill="{colour}"{stroke}>'
                           f'<title>{escape(spec)} at {context:,} tokens: {share:.1f} % of its bound '
                           f'({row["bound_tok_s"]:.0f} tok/s)</title></rect>')
        legend_y += 22
        out.append(f'<rect x="{LEGEND_X}" y="{legend_y - 11}" width="14" height="14" fill="{colour}"'
                   f'{" stroke=" + chr(34) + "#000" + chr(34) if spec == REFERENCE else ""}/>')
        for line_index, line in enumerate(legend_lines(spec)):
            legend_y += 15 if line_index else 0
            out.append(_text(LEGEND_X + 22, legend_y, line, size=12, weight="bold" if spec == REFERENCE else "normal"))
        if errors:
            legend_y += 16
            how = "every context" if len(errors) == len(contexts) else f"{len(errors)} of {len(contexts)} contexts"
            reason = errors[0].split(":")[0]
            out.append(_text(LEGEND_X + 22, legend_y, f"× failed at {how} ({reason})", size=10, colour="#555"))
        out.append("</g>")
    legend_y += 30
    out.append(f'<line x1="{LEGEND_X}" y1="{legend_y - 4}" x2="{LEGEND_X + 28}" y2="{legend_y - 4}" '
               f'stroke="{REFERENCE_COLOUR}" stroke-width="1.2" stroke-dasharray="4 3"/>')
    out.append(_text(LEGEND_X + 36, legend_y, "fp16's speed, across its group", size=11, colour="#333"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=str(DEFAULT_ROWS), help="a decode.py JSON file (default: %(default)s)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the SVG to write (default: %(default)s)")
    parser.add_argument("--title", default=None, help="instead of the title made from the run's record")
    parser.add_argument("--series", choices=tuple(SERIES), default="step",
                        help="the bars: one synchronous step (default) or mlx-lm's decode loop (gen_tok_s)")
    args = parser.parse_args(argv)
    rows_path = Path(args.rows)
    record = json.loads(rows_path.read_text())
    try:
        source = str(rows_path.resolve().relative_to(ROOT))
    except ValueError:
        source = rows_path.name
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_svg(record, source, args.title, args.series), encoding="utf-8")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
