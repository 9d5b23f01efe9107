"""The report's PNG figures, drawn with matplotlib (the optional `bench` extra) from the same facts as the
markdown. `pyplot()` raises ImportError without matplotlib; write_report then says so in the markdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.common import pareto_front
from benchmarks.harness.report import formatting as f
from benchmarks.harness.report.data import (
    DENSE,
    Source,
    canonical,
    decodes_by_dequantizing,
    family_of,
    label_of,
    large_results,
    level_labels,
    memory_results,
    method_of,
    mlx_budgets,
    quality_rows,
)

# Colours per Velox method; mlx-lm and the veloxquant-mlx peer get their own colour and marker shape.
METHOD_COLOURS = {"affine": "#1f77b4", "rotated": "#2ca02c", "kivi": "#9467bd", "turboquant": "#d62728",
                  "rvq": "#ff7f0e", "fp16": "#000000", "fp32": "#000000"}
FAMILY_STYLE = {  # colour, marker, label in legends
    "mlx-lm": ("#5f5f5f", "s", "mlx-lm QuantizedKVCache"),
    "veloxquant": ("#8c564b", "D", "veloxquant-mlx (peer)"),
}
APP_LEVEL_COLOUR = "#e6a100"
MEMORY_FIGURE_SPECS = ("fp16", "mlx-kv", "mlx-q:k8v8", "mlx-q:k4v4", "affine:k8v8:g64", "rotated:k4v4:g64",
                       "kivi:k4v4:g32", "turboquant:k3v3", "rotated:k3v2:g32", "turboquant:k2v2", "vq:kivi:k4v4",
                       "vq:turboquant_rvq:k2v2")
# Where a point label may go, tried nearest first: directions (scaled by each radius, in points).
LABEL_RADII = (9, 16, 26, 38, 52, 68)
LABEL_DIRECTIONS = ((1, 0.6), (1, -0.6), (-1, 0.6), (-1, -0.6), (0, 1.2), (0, -1.2), (1.4, 0), (-1.4, 0),
                    (1, 1.4), (-1, 1.4), (1, -1.4), (-1, -1.4))


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend with the report's style (ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.spines.top": False,
                         "axes.spines.right": False, "savefig.facecolor": "white"})
    return plt


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, bbox_inches="tight", pad_inches=0.2)
    plt.close(fig)


def _quick_mark(source: Source) -> str:
    return " (QUICK run)" if source.quick else ""


# ----- styles, ticks, captions ----------------------------------------------------------------------------------


def _style(spec: str, family: str | None = None, method: str | None = None) -> tuple[str, str]:
    """(colour, marker) of a cache: Velox methods by colour as circles, peers in their own colour and shape."""
    family = family or family_of(spec)
    if family in FAMILY_STYLE:
        colour, marker, _ = FAMILY_STYLE[family]
        return colour, marker
    if family == "mlx-lm" or spec == "mlx-kv":
        return FAMILY_STYLE["mlx-lm"][0], "s"
    return METHOD_COLOURS.get(method or method_of(spec), "#17becf"), "o"


def _line_style(spec: str) -> dict[str, Any]:
    colour, marker = _style(spec)
    family = family_of(spec)
    style: dict[str, Any] = {"color": colour, "marker": marker, "markersize": 4.5, "lw": 1.6}
    if family == "veloxquant":
        style |= {"ls": "--", "markerfacecolor": "white"}
    elif family == "mlx-lm":
        style |= {"ls": "-."}
    if spec == "mlx-kv":
        style |= {"color": "#9a9a9a"}
    return style


def _caption(fig: Any, title: str, subtitle: str) -> None:
    fig.text(0.01, 0.985, title, ha="left", va="top", fontsize=13, weight="bold")
    fig.text(0.01, 0.945, subtitle, ha="left", va="top", fontsize=9.5, color="#444444")


def _null_locator() -> Any:
    from matplotlib.ticker import NullLocator

    return NullLocator()


def _log2_ticks(axis: Any, values: list[float], which: str = "x", unit_k: bool = True) -> None:
    ticks = sorted(set(values))
    labels = [f"{int(t) // 1024}k" if unit_k and t >= 1024 else f"{t:g}" for t in ticks]
    if which == "x":
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, labels)
        axis.xaxis.set_minor_locator(_null_locator())
    else:
        axis.set_yscale("log", base=2)
        axis.set_yticks(ticks, labels)


def _wrap(text: str, width: int = 11) -> str:
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "\n".join(lines)


# ----- labels that do not overlap -------------------------------------------------------------------------------


def _boxes_overlap(a: Any, b: Any) -> bool:
    return not (a.x1 < b.x0 or b.x1 < a.x0 or a.y1 < b.y0 or b.y1 < a.y0)


def _obstacles(axis: Any, points: list[tuple[float, float, float]], paths: list[list[tuple[float, float]]]) -> list[Any]:
    """Pixel boxes a label must not cover: each point (x, y, radius in pixels) and small boxes along each path."""
    from matplotlib.transforms import Bbox

    taken = []
    for x, y, pad in points:
        dx, dy = axis.transData.transform((x, y))
        taken.append(Bbox.from_extents(dx - pad, dy - pad, dx + pad, dy + pad))
    for path in paths:
        corners = axis.transData.transform(path)
        for (x0, y0), (x1, y1) in zip(corners[:-1], corners[1:], strict=True):
            steps = max(1, int(max(abs(x1 - x0), abs(y1 - y0)) // 4))
            for i in range(steps + 1):
                x, y = x0 + (x1 - x0) * i / steps, y0 + (y1 - y0) * i / steps
                taken.append(Bbox.from_extents(x - 1.5, y - 1.5, x + 1.5, y + 1.5))
    return taken


def _try_label(axis: Any, renderer: Any, frame: Any, taken: list[Any], item: tuple[float, float, str, dict[str, Any]],
               offset: tuple[float, float], fontsize: float) -> Any | None:
    """Annotate at `offset` (points) and return the label's box, or remove it and return None if it does not fit."""
    from matplotlib.text import Text

    x, y, text, extra = item
    dx, dy = offset
    ha = "left" if dx > 0 else "right" if dx < 0 else "center"
    va = "bottom" if dy > 0 else "top" if dy < 0 else "center"
    label = axis.annotate(
        text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va, fontsize=fontsize,
        arrowprops={"arrowstyle": "-", "color": "#999999", "lw": 0.6, "shrinkA": 1, "shrinkB": 4},
        zorder=6, **extra,
    )
    label.update_positions(renderer)
    box = Text.get_window_extent(label, renderer).expanded(1.04, 1.12)  # the text alone, not its leader
    inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
    if inside and not any(_boxes_overlap(box, other) for other in taken):
        return box
    label.remove()
    return None


def _place_labels(axis: Any, items: list[tuple[float, float, str, dict[str, Any]]],
                  points: list[tuple[float, float, float]], fontsize: float = 8.0,
                  paths: list[list[tuple[float, float]]] = ()) -> None:
    """Label points without overlaps: each label tries positions around its point, nearest first, and takes the
    first that covers no other label, no data point (x, y, radius in pixels) and stays inside the axes; a thin
    leader line ties each label to its point. Labels also keep off the polylines in `paths` (data coordinates)."""
    fig = axis.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = axis.get_window_extent(renderer)
    taken = _obstacles(axis, points, paths)
    offsets = [(dx * radius, dy * radius) for radius in LABEL_RADII for dx, dy in LABEL_DIRECTIONS]
    for item in items:
        placed = next((box for offset in offsets
                       if (box := _try_label(axis, renderer, frame, taken, item, offset, fontsize)) is not None), None)
        if placed is None:  # nowhere free: keep the nearest spot rather than drop the label
            x, y, text, extra = item
            axis.annotate(text, (x, y), xytext=(6, 4), textcoords="offset points", fontsize=fontsize, zorder=6, **extra)
        else:
            taken.append(placed)


def _end_labels(axis: Any, entries: list[tuple[float, str, str]], fontsize: float = 8.0) -> None:
    """Name each line just right of the axes at the height of its last point, spread so no two overlap."""
    fig = axis.figure
    fig.canvas.draw()
    if not entries:
        return
    to_axes = axis.transAxes.inverted()
    frame = axis.get_window_extent()
    gap = fontsize * 1.25 * fig.dpi / 72
    display = sorted(((axis.transData.transform((1.0, y))[1], text, colour) for y, text, colour in entries),
                     key=lambda e: e[0])
    ys = [d[0] for d in display]
    for i in range(1, len(ys)):  # push up
        ys[i] = max(ys[i], ys[i - 1] + gap)
    top = max(frame.y1, ys[-1]) if len(ys) * gap > frame.height else frame.y1
    if ys[-1] > top:  # then down from the top, keeping the gaps
        ys[-1] = top
        for i in range(len(ys) - 2, -1, -1):
            ys[i] = min(ys[i], ys[i + 1] - gap)
    for (y_line, text, colour), y_text in zip(display, ys, strict=True):
        a_line = to_axes.transform((frame.x1, y_line))[1]
        a_text = to_axes.transform((frame.x1, y_text))[1]
        axis.plot([1.0, 1.015, 1.03], [a_line, a_line, a_text], transform=axis.transAxes, color=colour, lw=0.7,
                  clip_on=False)
        axis.text(1.035, a_text, text, transform=axis.transAxes, color=colour, fontsize=fontsize, va="center",
                  ha="left", clip_on=False)


# ----- quality against bits held --------------------------------------------------------------------------------


def _front_line(axis: Any, points: list[tuple[float, float]], front: list[int]) -> list[tuple[float, float]]:
    """Draw the Pareto front as a dashed staircase to the right edge; return its path (for label placement)."""
    fx = [points[i][0] for i in front]
    fy = [points[i][1] for i in front]
    axis.step(fx + [48], fy + [fy[-1]], where="post", color="#222222", lw=1.3, ls="--", zorder=2)
    path = [(fx[0], fy[0])]
    for x, y in zip(fx[1:] + [48], fy[1:] + [fy[-1]], strict=True):
        path += [(x, path[-1][1]), (x, y)]
    return path


def _quality_points(axis: Any, rows: list[dict[str, Any]], points: list[tuple[float, float]],
                    front_specs: set[str], levels: dict[str, str]) -> None:
    for row, (x, y) in zip(rows, points, strict=True):
        colour, marker = _style(row["spec"], row.get("family"), row.get("method"))
        peer = row.get("family") == "veloxquant"
        axis.scatter(x, y, s=52 if row.get("family") != "velox" else 40, marker=marker, zorder=4,
                     facecolor="white" if peer else colour, edgecolor=colour if peer else
                     ("#111111" if row["spec"] in front_specs else "white"), linewidth=1.6 if peer else 0.9)
        if row["spec"] in levels:
            axis.scatter(x, y, s=190, marker="o", facecolor="none", edgecolor=APP_LEVEL_COLOUR, linewidth=2.2, zorder=3)


def _quality_axes(axis: Any, points: list[tuple[float, float]]) -> None:
    axis.set_xlim(1.0, 48)
    _log2_ticks(axis, [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32], unit_k=False)
    axis.set_yscale("log")
    low = min(y for _, y in points)
    axis.set_ylim(low / 2.5, max(y for _, y in points) * 2.5)
    axis.set_xlabel("bits held per cached value (measured bytes × 8 / values; log scale)")
    axis.set_ylabel("mean KL(fp16 ‖ cache), nats per token (log scale; lower is better)")
    axis.grid(alpha=0.25, which="major")


def _quality_labels(axis: Any, rows: list[dict[str, Any]], points: list[tuple[float, float]], front_specs: set[str],
                    levels: dict[str, str], front_path: list[tuple[float, float]]) -> None:
    """Name the app's levels first, then the front, then the peers; other Velox points stay unlabelled."""
    labelled = []
    for row, (x, y) in zip(rows, points, strict=True):
        text = row["label"]
        if row["spec"] in levels:
            text += f"  [app {levels[row['spec']]}]"
        if row["spec"] in front_specs or row.get("family") != "velox" or row["spec"] in levels:
            weight = "bold" if row["spec"] in levels else "normal"
            colour = _style(row["spec"], row.get("family"), row.get("method"))[0]
            priority = 0 if row["spec"] in levels else 1 if row["spec"] in front_specs else 2
            labelled.append((priority, x, y, text, {"color": colour, "weight": weight}))
    labelled.sort(key=lambda item: (item[0], item[1]))
    obstacles = [(x, y, 13.0 if row["spec"] in levels else 6.5) for row, (x, y) in zip(rows, points, strict=True)]
    _place_labels(axis, [(x, y, t, e) for _, x, y, t, e in labelled], obstacles, fontsize=8, paths=[front_path])


def _quality_legend(fig: Any, rows: list[dict[str, Any]]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker="o", ls="", color=colour, markeredgecolor="white", markersize=7, label=method)
               for method, colour in METHOD_COLOURS.items() if any(r.get("method") == method for r in rows)]
    for family, (colour, marker, label) in FAMILY_STYLE.items():
        if any(r.get("family") == family for r in rows):
            face = "white" if family == "veloxquant" else colour
            handles.append(Line2D([], [], marker=marker, ls="", color=colour, markerfacecolor=face,
                                  markeredgewidth=1.6, markersize=7, label=label))
    handles += [
        Line2D([], [], color="#222222", ls="--", lw=1.3, label="Pareto front (★ in the table)"),
        Line2D([], [], marker="o", ls="", markersize=7, markerfacecolor="white", markeredgecolor="#111111",
               label="on the front"),
        Line2D([], [], marker="o", ls="", markersize=12, markerfacecolor="none", markeredgecolor=APP_LEVEL_COLOUR,
               markeredgewidth=2.2, label="level used by the app"),
    ]
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.75, 0.88), frameon=False, fontsize=9,
               title="Velox methods (circles), peers", title_fontsize=9, alignment="left")
    fig.text(0.75, 0.30, "Each point is one cache configuration.\nLeft = less memory, down = closer to fp16.\n"
             "Unlabelled points: other Velox configs,\nall listed in BENCHMARKS.md.", fontsize=8.5, color="#444444",
             va="top")


def figure_quality(quality: Source, path: Path, base: Path) -> None:
    """Mean KL against bits held for every cache, the Pareto front and the app's levels marked."""
    plt = pyplot()
    rows = [r for r in quality_rows(quality) if r["spec"] not in DENSE]
    settings = quality.data["perplexity"]["settings"]
    fig = plt.figure(figsize=(13, 8.2), dpi=130)
    axis = fig.add_axes((0.07, 0.08, 0.66, 0.80))
    points = [(r["effective_bits"], r["mean_kl"]) for r in rows]
    front = pareto_front(points)
    front_specs = {rows[i]["spec"] for i in front}
    levels = level_labels(rows)
    axis.axvspan(16, 48, color="#f1f1f1", zorder=0)
    axis.axvline(16, color="#999999", lw=1, ls=":", zorder=1)
    axis.text(16.4, 0.97, "more than fp16\n(16 bits per value)", transform=axis.get_xaxis_transform(), fontsize=8.5,
              color="#666666", va="top")
    front_path = _front_line(axis, points, front)
    _quality_points(axis, rows, points, front_specs, levels)
    _quality_axes(axis, points)
    _quality_labels(axis, rows, points, front_specs, levels, front_path)
    _quality_legend(fig, rows)
    _caption(fig, f"KV cache quality against memory — {f.model_name(quality)}",
             f"{len(settings['windows'])} × {settings['window']:,}-token prose windows teacher-forced in "
             f"{settings['chunk']}-token chunks, second halves scored; {f.machine_short(quality)}; "
             f"{f.rel(quality.path, base)}{_quick_mark(quality)}")
    _save(fig, path)


# ----- Velox against mlx-lm per budget --------------------------------------------------------------------------


VS_MLX_ROLES = {"best": "best", "best_fused": "best on\npacked codes", "same_quantizer": "same\nquantizer"}


def _budget_bars(entry: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """mlx-lm's row, then each distinct Velox row of the budget with its role (a row that is two roles says so)."""
    bars = [(entry["mlx"], "mlx-lm")]
    for key, role in VS_MLX_ROLES.items():
        row = entry[key]
        if row is None:
            continue
        if any(row["spec"] == b["spec"] for b, _ in bars):
            if key == "best_fused":
                bars = [(b, r + ",\non packed codes" if b["spec"] == row["spec"] else r) for b, r in bars]
            continue
        bars.append((row, role))
    return bars


def _budget_panel(axis: Any, entry: dict[str, Any]) -> None:
    bars = _budget_bars(entry)
    xs = list(range(len(bars)))
    values = [b["delta_nll"] for b, _ in bars]
    errors = [b["delta_nll_se"] for b, _ in bars]
    colours = [_style(b["spec"], b.get("family"), b.get("method"))[0] for b, _ in bars]
    axis.bar(xs, values, yerr=errors, color=colours, width=0.68, capsize=4, ecolor="#333333")
    top = max(max(v + e for v, e in zip(values, errors, strict=True)), 0)
    low = min(min(v - e for v, e in zip(values, errors, strict=True)), 0)
    digits = ".4f" if max(abs(v) for v in values) < 0.01 else ".3f"
    for x, value, error, (bar, _) in zip(xs, values, errors, bars, strict=True):
        axis.text(x, max(value + error, 0) + (top - low) * 0.03, f"{value:+{digits}}\n{f.fmt_bits(bar)} bits",
                  ha="center", va="bottom", fontsize=8)
    axis.set_ylim(low * 1.3, top * 1.35)
    axis.axhline(0, color="#444444", lw=0.8)
    axis.set_xticks(xs, [_wrap(b["label"]) + f"\n({role})" for b, role in bars], fontsize=8)
    axis.set_title(f"≤ {f.fmt_bits(entry['mlx'])} bits per value\n(what {entry['mlx']['label']} holds)", fontsize=10)
    axis.grid(alpha=0.25, axis="y")


def figure_vs_mlx(quality: Source, path: Path, base: Path) -> None:
    """One panel per mlx-lm budget: Δ NLL of mlx-lm's cache and of the Velox caches that hold no more."""
    plt = pyplot()
    budgets = mlx_budgets(quality_rows(quality))
    if not budgets:
        return
    fig, axes = plt.subplots(1, len(budgets), figsize=(3.4 * len(budgets) + 0.6, 5.6), dpi=130, squeeze=False)
    fig.subplots_adjust(left=0.07, right=0.99, top=0.78, bottom=0.3, wspace=0.35)
    for axis, entry in zip(axes[0], budgets, strict=True):
        _budget_panel(axis, entry)
    axes[0][0].set_ylabel("Δ NLL vs fp16, nats per token (± 1 SE)\nlower is better; each panel has its own scale")
    fig.text(0.5, 0.02, "Grey: mlx-lm QuantizedKVCache. Then: the best Velox cache holding no more bits, the best that "
             "decodes on packed codes, and Velox's\naffine cache with mlx-lm's bits and group (the same quantizer, "
             "fp16 scales) — whichever differ. Colours follow the method, as in the other figures.",
             ha="center", fontsize=8.5, color="#444444")
    _caption(fig, f"Velox against mlx-lm's QuantizedKVCache at equal or fewer bits — {f.model_name(quality)}",
             f"{f.machine_short(quality)}; {f.rel(quality.path, base)}{_quick_mark(quality)}")
    _save(fig, path)


# ----- bytes held and decode speed against context --------------------------------------------------------------


def _memory_panel(axis: Any, results: dict[str, list[dict[str, Any]]], scale: float, unit: str,
                  chosen: tuple[str, ...]) -> list[tuple[float, str, str]]:
    """Bytes held against context of each chosen spec; returns the end labels to place."""
    entries = []
    xs: list[int] = []
    by_cache = {canonical(spec): rows for spec, rows in results.items()}
    for spec in chosen:
        rows = by_cache.get(canonical(spec))
        if not rows:
            continue
        x = [r["tokens"] for r in rows]
        xs += x
        y = [r["held_bytes"] / scale for r in rows]
        axis.plot(x, y, **_line_style(spec))
        entries.append((y[-1], f"{label_of(spec)}: {rows[-1]['effective_bits']:.1f} bits", _line_style(spec)["color"]))
    _log2_ticks(axis, xs)
    axis.set_ylim(0, None)
    axis.set_xlabel("tokens in the cache (log scale)")
    axis.set_ylabel(f"{unit} held ({unit} = 10{'⁶' if unit == 'MB' else '⁹'} bytes)")
    return entries


def figure_memory(memory: Source, path: Path, base: Path, chosen: tuple[str, ...] = MEMORY_FIGURE_SPECS) -> None:
    """Bytes held against context: the model's own keys/values, and the first large random shape."""
    plt = pyplot()
    large = memory.data.get("large_shapes") or {}
    panels = [("model", f.model_name(memory), memory_results(memory), 1e6, "MB")]
    if large.get("shapes"):
        model = large["shapes"][0]["model"]
        panels.append(("large", model, large_results(memory, model), 1e9, "GB"))
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 6.6), dpi=130, squeeze=False)
    fig.subplots_adjust(left=0.06, right=0.83, top=0.82, bottom=0.1, wspace=0.75)
    for axis, (kind, name, results, scale, unit) in zip(axes[0], panels, strict=True):
        entries = _memory_panel(axis, results, scale, unit, chosen)
        if kind == "model":
            axis.set_title(f"{name}: its own keys/values (fp32 inputs)", loc="left")
        else:
            shape = large["shapes"][0]
            axis.set_title(f"{name} shape: {shape['layers']} layers × {shape['kv_heads']} kv heads × "
                           f"{shape['head_dim']}, random {large['input_dtype']}", loc="left")
        axis.grid(alpha=0.25)
        _end_labels(axis, entries, fontsize=8)
    _caption(fig, "Bytes a KV cache holds as the context grows",
             f"Every array reachable from the cache objects, walked after filling; labels give the bits held per "
             f"value at the last point. Dashed: veloxquant-mlx (peer); dash-dot: mlx-lm.\n{f.machine_short(memory)}; "
             f"{f.rel(memory.path, base)}{_quick_mark(memory)}")
    _save(fig, path)


def _speed_panel(axis: Any, source: Source, base: Path) -> None:
    entries = []
    xs: list[int] = []
    for row in source.data["rows"]:
        if "decode" not in row:
            continue
        contexts = sorted(int(c) for c in row["decode"])
        xs += contexts
        medians = [row["decode"][str(c)]["tokens_per_second"] for c in contexts]
        spreads = [row["decode"][str(c)]["ms_per_token"] for c in contexts]
        low = [m - 1000 / s["max"] for m, s in zip(medians, spreads, strict=True)]
        high = [1000 / s["min"] - m for m, s in zip(medians, spreads, strict=True)]
        style = _line_style(row["spec"])
        axis.errorbar(contexts, medians, yerr=[low, high], capsize=3, **style)
        entries.append((medians[-1], f"{row['label']}: {medians[-1]:.1f}", style["color"]))
    _log2_ticks(axis, xs)
    axis.set_ylim(0, None)
    axis.set_xlabel("tokens in the cache (log scale)")
    axis.set_ylabel("decode tokens per second (higher is better)")
    settings = source.data["settings"]
    rounds = settings["rounds"]
    axis.set_title(f"{f.rel(source.path, base)}{' — QUICK' if source.quick else ''}: {len(source.data['rows'])} "
                   f"caches, {rounds} round{'s' if rounds > 1 else ''}, {settings['timed_steps']} timed steps",
                   loc="left", fontsize=9.5)
    axis.grid(alpha=0.25)
    _end_labels(axis, entries, fontsize=8)


def figure_speed(sources: list[Source], path: Path, base: Path) -> None:
    """Decode tok/s against context, one panel per speed run shown."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(sources), figsize=(6.8 * len(sources) + 1, 6), dpi=130, squeeze=False)
    fig.subplots_adjust(left=0.07, right=0.85 if len(sources) == 1 else 0.88, top=0.8, bottom=0.11,
                        wspace=0.6)
    for axis, source in zip(axes[0], sources, strict=True):
        _speed_panel(axis, source, base)
    first = sources[0]
    spread = "bars: min–max over rounds" if any(s.data["settings"]["rounds"] > 1 for s in sources) else \
        "one round, so no spread is shown"
    _caption(fig, f"Greedy decode speed on the CPU — {f.model_name(first)}",
             f"{f.machine_short(first)}, shared with other jobs; median tok/s ({spread}); labels: tok/s at the "
             "last context. Dashed: veloxquant-mlx; dash-dot: mlx-lm.")
    _save(fig, path)


# ----- GPU attention --------------------------------------------------------------------------------------------


def _gpu_lines(axes: Any, by_spec: dict[str, list[dict[str, Any]]]) -> tuple[list[Any], list[Any]]:
    """Time per step (left) and time relative to fp16 (right) of each cache; their end labels."""
    fp16 = {r["context"]: r["ms_median"] for r in by_spec.get("fp16", [])}
    left_entries, right_entries = [], []
    for spec, rows in by_spec.items():
        rows = sorted(rows, key=lambda r: r["context"])
        x = [r["context"] for r in rows]
        style = _line_style(spec)
        if decodes_by_dequantizing(spec):
            style |= {"ls": ":"}
        axes[0].plot(x, [r["ms_median"] for r in rows], **style)
        left_entries.append((rows[-1]["ms_median"], f"{label_of(spec)}: {f.ms(rows[-1]['ms_median'])}", style["color"]))
        if fp16:
            ratio = [(c, r["ms_median"] / fp16[c]) for c, r in zip(x, rows, strict=True) if c in fp16]
            axes[1].plot([c for c, _ in ratio], [v for _, v in ratio], **style)
            right_entries.append((ratio[-1][1], f"{label_of(spec)}: {ratio[-1][1]:.2f}×", style["color"]))
    bound = {r["context"]: r["bound_ms"] for r in by_spec.get("fp16", [])}
    if bound:
        axes[0].plot(list(bound), list(bound.values()), color="#000000", lw=1, ls=(0, (1, 2)))
        left_entries.append((list(bound.values())[-1], f"fp16's bound (bytes ÷ bandwidth): "
                             f"{f.ms(list(bound.values())[-1])}", "#000000"))
    return left_entries, right_entries


def _ratio_ticks(axis: Any) -> None:
    """Ticks like 0.5×, 1×, 2×, 5× spanning the ratios drawn."""
    ratios = [line.get_ydata() for line in axis.get_lines()]
    if ratios:
        low, high = min(min(r) for r in ratios), max(max(r) for r in ratios)
        ticks = [t for t in (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500) if low / 1.5 <= t <= high * 1.5]
        axis.set_yticks(ticks, [f"{t:g}×" for t in ticks])
        axis.yaxis.set_minor_locator(_null_locator())


def figure_gpu(gpu: Source, path: Path, base: Path) -> None:
    """Attention-only time of a decode step on the GPU against context, absolute and relative to fp16 (not a
    decode speed: benchmarks/decode.py measures the whole model)."""
    plt = pyplot()
    data = gpu.data
    by_spec: dict[str, list[dict[str, Any]]] = {}
    for row in data["rows"]:
        if "error" not in row:
            by_spec.setdefault(row["spec"], []).append(row)
    fig, axes = plt.subplots(1, 2, figsize=(15.5, 7), dpi=130)
    fig.subplots_adjust(left=0.06, right=0.85, top=0.83, bottom=0.1, wspace=0.72)
    left_entries, right_entries = _gpu_lines(axes, by_spec)
    for axis in axes:
        _log2_ticks(axis, data["contexts"])
        axis.set_yscale("log")
        axis.set_xlabel("tokens in each layer's cache (log scale)")
        axis.grid(alpha=0.25, which="major")
    axes[0].set_ylabel(f"ms per decode step ({data['shape']['layers']} layers, attention only; log scale)")
    axes[0].set_title("attention time per step (lower is better)", loc="left")
    axes[1].axhline(1, color="#000000", lw=0.8)
    _ratio_ticks(axes[1])
    axes[1].set_ylabel("time ÷ fp16's time at the same context (log scale)")
    axes[1].set_title("attention time relative to fp16 (below 1 = faster than fp16)", loc="left")
    _end_labels(axes[0], left_entries, fontsize=8)
    _end_labels(axes[1], right_entries, fontsize=8)
    shape = data["shape"]
    _caption(fig, f"Attention only, not whole-model decode — {data.get('gpu', data.get('device', 'GPU')).split(',')[0]}, "
                  f"Llama-3.1-8B-shaped caches",
             f"{shape['layers']} layers, {shape['heads']} query heads on {shape['kv_heads']} kv heads, head_dim "
             f"{shape['head_dim']}, {shape['dtype']}; median of {data['steps']} steps; MLX {data['mlx']}. Dotted: "
             f"caches that dequantize every step; dash-dot: mlx-lm. {f.rel(gpu.path, base)}")
    _save(fig, path)
