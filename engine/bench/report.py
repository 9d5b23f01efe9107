"""BENCHMARKS.md and the figures, generated only from the JSON results (never from hand-typed numbers).

Figures need matplotlib (the optional `bench` extra); without it the markdown is still written and says so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from engine.bench.common import pareto_front, read_result

FIGURE_NAMES = ("quality_vs_bits.png", "bytes_vs_context.png", "tokps_vs_context.png", "gpu_attention.png")
HEADLINE_CONTEXT = 2048
FAMILY_COLOURS = {"affine": "#1f77b4", "rotated": "#2ca02c", "kivi": "#9467bd", "turboquant": "#d62728",
                  "rvq": "#ff7f0e", "mlx-lm": "#7f7f7f", "veloxquant": "#8c564b", "fp16": "#000000", "fp32": "#000000"}


def _colour(row: dict[str, Any]) -> str:
    family = row.get("family", "velox")
    if family in ("mlx-lm", "veloxquant"):
        return FAMILY_COLOURS[family]
    return FAMILY_COLOURS.get(row.get("method", ""), "#17becf")


def _mb(n: float | None) -> str:
    return "—" if n is None else f"{n / 1e6:,.1f} MB"


def _gb(n: float | None) -> str:
    return "—" if n is None else f"{n / 1e9:,.2f} GB"


def _fmt(value: float | None, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _machine_line(result: dict[str, Any] | None) -> str:
    if not result:
        return ""
    machine = result.get("machine", {})
    model = result.get("model", {})
    return (
        f"{result.get('created', '?')}, {machine.get('platform', '?')}, {machine.get('cpu_count', '?')} CPU cores, "
        f"MLX {machine.get('mlx', '?')} ({machine.get('device', '?')}), mlx-lm {machine.get('mlx_lm', '?')}, "
        f"commit {machine.get('git_commit', '?') or '?'}, load average at the start "
        f"{machine.get('load_average_1_5_15', '?')}; model {model.get('name', '?')} "
        f"({model.get('layers', '?')} layers, {model.get('kv_heads', '?')} kv heads, head_dim {model.get('head_dim', '?')})"
        f"{' — QUICK run' if result.get('quick') else ''}"
    )


# ----- sections ---------------------------------------------------------------------------------------------


def _memory_at(memory: dict[str, Any] | None, spec: str, tokens: int) -> int | None:
    if not memory:
        return None
    rows = memory.get("model_kv", {}).get("results", {}).get(spec)
    if rows is None:
        rows = (memory.get("peers", {}).get("model", {}) or {}).get("results", {}).get(spec)
    for row in rows or []:
        if row["tokens"] == tokens:
            return row["held_bytes"]
    return None


def _speed_row(speed: dict[str, Any] | None, spec: str) -> dict[str, Any] | None:
    for row in (speed or {}).get("rows", []):
        if row["spec"] == spec and "decode" in row:
            return row
    return None


def headline(quality: dict[str, Any] | None, memory: dict[str, Any] | None, speed: dict[str, Any] | None) -> list[str]:
    rows = (quality or {}).get("perplexity", {}).get("rows", [])
    if not rows:
        return ["No quality results yet (`velox bench quality`).", ""]
    front = {rows[i]["spec"] for i in pareto_front([(r["effective_bits"], r["mean_kl"]) for r in rows])}
    fp16_bytes = _memory_at(memory, "fp16", HEADLINE_CONTEXT)
    fp16_speed = _speed_row(speed, "fp16")
    fp16_tps = fp16_speed["decode"].get(str(HEADLINE_CONTEXT), {}).get("tokens_per_second") if fp16_speed else None
    body = []
    for row in sorted(rows, key=lambda r: (-r["effective_bits"], r["mean_kl"])):
        held = _memory_at(memory, row["spec"], HEADLINE_CONTEXT)
        speed_row = _speed_row(speed, row["spec"])
        tps = speed_row["decode"].get(str(HEADLINE_CONTEXT), {}).get("tokens_per_second") if speed_row else None
        body.append([
            ("**" + row["label"] + "** ★" if row["spec"] in front else row["label"]),
            _fmt(row["effective_bits"], ".2f"),
            _mb(held),
            f"{held / fp16_bytes:.2f}×" if held and fp16_bytes else "—",
            f"{row['delta_nll']:+.4f} ± {row['delta_nll_se']:.4f}",
            f"{(row['ppl_ratio'] - 1) * 100:+.2f} %",
            _fmt(row["mean_kl"], ".4f"),
            f"{row['top1_agreement'] * 100:.1f} %",
            _fmt(tps, ".1f"),
            f"{tps / fp16_tps:.2f}×" if tps and fp16_tps else "—",
        ])
    settings = quality["perplexity"]["settings"]
    windows = ", ".join(f"{w['text']}@{w['start']}" for w in settings["windows"])
    lines = [
        f"SmolLM2-135M on this CPU. Quality: teacher-forced through each cache in chunks of {settings['chunk']} "
        f"tokens over {len(settings['windows'])} windows of {settings['window']} tokens ({windows}), the second "
        f"half of each scored ({rows[0]['scored_tokens']} tokens in all); Δ NLL is paired with fp16 on the same "
        f"tokens, ± one standard error ({settings['se']}). KL is mean KL(fp16 ‖ cache) per token, nats. "
        f"Effective bits = bytes the cache holds at the end of a window × 8 / cached values. Bytes and tok/s at "
        f"{HEADLINE_CONTEXT} tokens come from `velox bench memory` and `velox bench speed` (— = not in that run). "
        "★ = on the Pareto front of KL against effective bits (nothing else is both smaller and closer to fp16).",
        "",
    ]
    return lines + _table(
        ["cache", "eff. bits", f"bytes @{HEADLINE_CONTEXT // 1024}k", "vs fp16", "Δ NLL ± SE", "Δ ppl", "KL",
         "top-1 = fp16", f"decode tok/s @{HEADLINE_CONTEXT // 1024}k", "vs fp16"],
        body,
    )


def level_section(quality: dict[str, Any] | None) -> list[str]:
    from engine.recommend import LEVELS

    rows = {(r["method"], r.get("spec")): r for r in (quality or {}).get("perplexity", {}).get("rows", [])}
    by_config = {}
    for row in rows.values():
        if row.get("family") != "velox":
            continue
        by_config[row["spec"]] = row
    body = []
    for level in LEVELS:
        candidates = [
            row for spec, row in by_config.items()
            if _spec_matches_level(spec, level)
        ]
        row = candidates[0] if candidates else None
        dense = level.method in ("fp16", "fp32")
        body.append([
            level.label, level.method if dense else f"{level.method} K{level.key_bits}/V{level.value_bits} g{level.group_size}",
            _fmt(level.effective_bits, ".3f"),
            _fmt(row["mean_kl"], ".4f") if row else "not measured",
            f"{(row['ppl_ratio'] - 1) * 100:+.2f} %" if row else "—",
            level.quality_note,
        ])
    return [
        "The app's compression slider (`engine/recommend.py`, `LEVEL_TABLE`): each level is the measured-best "
        "configuration within its memory budget in the table above (see the rule under it).",
        "",
        *_table(["level", "configuration", "eff. bits (d=128)", "KL on SmolLM2", "Δ ppl", "note"], body),
    ]


def _spec_matches_level(spec: str, level: Any) -> bool:
    from engine.bench.specs import parse_spec

    try:
        parsed = parse_spec(spec)
    except Exception:  # a spec of a method no longer registered
        return False
    if parsed.method != level.method:
        return False
    if level.method in ("fp16", "fp32"):
        return True
    group = parsed.group_size or 64
    return (parsed.key_bits, parsed.value_bits, group, parsed.residual_window) == (
        level.key_bits, level.value_bits, level.group_size, level.residual_window)


def needle_section(quality: dict[str, Any] | None) -> list[str]:
    needle = (quality or {}).get("needle")
    if not needle:
        return ["Not run yet (`velox bench quality --parts needle`).", ""]
    settings = needle["settings"]
    lengths = [str(n) for n in settings["lengths"]]
    depths = [f"{d:g}" for d in settings["depths"]]
    body = []
    for row in needle["summary"]:
        body.append([
            row["label"], f"{row['recall'] * 100:.0f} %",
            *[f"{row['by_length'][n]['recall'] * 100:.0f} %" for n in lengths],
            *[f"{row['by_depth'][d]['recall'] * 100:.0f} %" for d in depths],
            f"{row['answer_logprob']:.2f}", f"{row['delta_logprob']:+.2f} ± {row['delta_logprob_se']:.2f}",
        ])
    return [
        f"A sentence \"The special magic number for <city> is <7 digits>.\" at depths {', '.join(depths)} of a prose "
        f"haystack of {', '.join(lengths)} tokens, asked for at the end; {len(settings['seeds'])} seed(s) "
        f"({needle['summary'][0]['trials']} trials per cache). Recall = {settings['recall']}. The teacher-forced "
        "log-probability of the 7-digit answer (sum over its tokens, nats) still separates caches where recall "
        "saturates; Δ is paired with fp16 trial by trial (± SE).",
        "",
        *_table(["cache", "recall", *[f"@{n}" for n in lengths], *[f"depth {d}" for d in depths],
                 "answer log p", "Δ vs fp16"], body),
    ]


def agreement_section(quality: dict[str, Any] | None) -> list[str]:
    agreement = (quality or {}).get("agreement")
    if not agreement:
        return ["Not run yet (`velox bench quality --parts agreement`).", ""]
    settings = agreement["settings"]
    body = [[r["label"], f"{r['match_rate'] * 100:.1f} %", f"{r['mean_first_divergence']:.1f}",
             f"{r['identical'] * 100:.0f} %", f"{r['positionwise_agreement'] * 100:.1f} %"] for r in agreement["rows"]]
    return [
        f"Greedy continuations of {settings['prompts']} prose excerpts of {settings['prompt_tokens']} tokens, "
        f"{settings['new_tokens']} new tokens each, compared with fp16's. Match rate = {settings['match_rate']}.",
        "",
        *_table(["cache", "match rate", "first divergence (tokens)", "identical", "same token at same position"], body),
    ]


def memory_section(memory: dict[str, Any] | None) -> list[str]:
    if not memory:
        return ["Not run yet (`velox bench memory`).", ""]
    model_kv = memory["model_kv"]
    checkpoints = model_kv["checkpoints"]
    results = dict(model_kv["results"])
    peers = memory.get("peers", {})
    results |= (peers.get("model") or {}).get("results", {})
    fp16 = {row["tokens"]: row["held_bytes"] for row in results.get("fp16", [])}
    body = []
    for spec, rows in results.items():
        by_tokens = {row["tokens"]: row for row in rows}
        last = by_tokens[checkpoints[-1]]
        body.append([
            _label(spec), *[_mb(by_tokens[c]["held_bytes"]) for c in checkpoints],
            f"{last['held_bytes'] / fp16[checkpoints[-1]]:.3f}×" if fp16 else "—",
            f"{last['effective_bits']:.3f}", _mb(last["mlx_peak_delta_bytes"]),
        ])
    lines = [
        f"Bytes actually held (every array reachable from the cache objects) after feeding SmolLM2's own keys and "
        f"values of {checkpoints[-1]} prose tokens through `update_and_fetch` in 1024-token chunks (fp32 inputs, as "
        "the CPU model makes them). MLX peak = the most MLX memory alive at once while filling, above what was "
        "alive before (transient encode buffers included).",
        "",
        *_table(["cache", *[f"@{c}" for c in checkpoints], "vs fp16", "eff. bits", "MLX peak while filling"], body),
    ]
    large = memory.get("large_shapes")
    if large:
        checkpoints = large["checkpoints"]
        big = dict(large["models"])
        peer_large = peers.get("large") or {}
        body = []
        for spec in large["per_layer"]:
            row = [_label(spec)]
            for shape in large["shapes"]:
                by_tokens = {r["tokens"]: r for r in big[shape["model"]][spec]}
                row += [_gb(by_tokens[c]["held_bytes"]) for c in (checkpoints[0], checkpoints[-1])]
            row.append(f"{big[large['shapes'][0]['model']][spec][-1]['effective_bits']:.3f}")
            body.append(row)
        for spec, rows in (peer_large.get("per_layer") or {}).items():
            row = [_label(spec)]
            for shape in large["shapes"]:
                row += [_gb(r["held_bytes"] * shape["layers"]) for r in rows if r["tokens"] in (checkpoints[0], checkpoints[-1])]
            row.append(f"{rows[-1]['effective_bits']:.3f}")
            body.append(row)
        header = ["cache"]
        for shape in large["shapes"]:
            header += [f"{shape['model']} @{checkpoints[0] // 1024}k", f"@{checkpoints[-1] // 1024}k"]
        layer_counts = ", ".join(f"{shape['model']}: {shape['layers']} layers" for shape in large["shapes"])
        lines += [
            f"The same code path on random {large['input_dtype']} keys/values with the attention shape of the larger "
            f"models ({layer_counts}; 8 kv heads, "
            f"head_dim 128), {large['note']}.",
            "",
            *_table([*header, "eff. bits"], body),
        ]
    if peers.get("note"):
        lines += [f"veloxquant-mlx: {peers['note']}.", ""]
    return lines


def _label(spec: str) -> str:
    from engine.bench.specs import parse_spec

    try:
        return parse_spec(spec).label
    except Exception:  # unknown method name in an old result
        return spec


def speed_section(speed: dict[str, Any] | None) -> list[str]:
    if not speed:
        return ["Not run yet (`velox bench speed`).", ""]
    settings = speed["settings"]
    contexts = [str(c) for c in settings["contexts"]]
    fp16 = _speed_row(speed, "fp16")
    body = []
    for row in speed["rows"]:
        if "decode" not in row:
            body.append([row["label"], *(["—"] * (len(contexts) + 2)), row.get("error", "")[:80]])
            continue
        cells = []
        for c in contexts:
            d = row["decode"].get(c)
            if not d:
                cells.append("—")
                continue
            ms = d["ms_per_token"]
            cells.append(f"{d['tokens_per_second']:.1f} ({ms['median']:.0f} ms, {ms['min']:.0f}–{ms['max']:.0f})")
        top = row["decode"].get(contexts[-1])
        ref = fp16["decode"].get(contexts[-1]) if fp16 else None
        prefill = row["prefill_tokens_per_second"]
        body.append([row["label"], *cells,
                     f"{top['tokens_per_second'] / ref['tokens_per_second']:.2f}×" if top and ref else "—",
                     f"{prefill['median']:.0f} ({prefill['min']:.0f}–{prefill['max']:.0f})", ""])
    loads = [x for row in speed["rows"] for pair in row.get("load_average", []) for x in pair[:1]]
    lines = [
        f"Greedy decode on SmolLM2, tok/s (median ms/token over {settings['rounds']} rounds, min–max of the round "
        f"medians), {settings['timed_steps']} timed steps after {settings['warmup_steps']} warm-up steps at each "
        f"context; prefill tok/s over {settings['prefill_tokens']} tokens in {settings['prefill_chunk']}-token chunks. "
        f"{settings['note']}; 1-minute load averages seen: {min(loads, default=0):.2f}–{max(loads, default=0):.2f} "
        "(this 2-core machine ran other jobs at the same time, so absolute numbers are noisy; compare within a "
        "column).",
        "",
        *_table(["cache", *[f"@{c}" for c in contexts], f"vs fp16 @{contexts[-1]}", "prefill tok/s", "error"], body),
    ]
    switch = speed.get("switch") or {}
    if switch:
        targets = list(next(iter(switch.values())).keys())
        body = [[switch[next(iter(switch))][t]["label"],
                 *[f"{switch[c][t]['seconds']['median']:.2f} s" for c in switch]] for t in targets]
        lines += [
            "Live switch: seconds to re-encode a held fp16 cache into each configuration "
            "(`reencode_caches`, as `ChatSession.set_compression` does; no model call), median of the repeats.",
            "",
            *_table(["into", *[f"@{c} tokens" for c in switch]], body),
        ]
    if speed.get("peer_note"):
        lines += [f"veloxquant-mlx: {speed['peer_note']}.", ""]
    return lines


def gpu_section(gpu: dict[str, Any] | None) -> list[str]:
    if not gpu:
        return ["Not run yet (`python -m engine.bench.gpu` on a GPU machine).", ""]
    contexts = gpu["contexts"]
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for row in gpu["rows"]:
        rows.setdefault(row["spec"], {})[row["context"]] = row
    body = []
    for spec, by_context in rows.items():
        cells = []
        for c in contexts:
            r = by_context.get(c)
            if r is None:
                cells.append("—")
            elif "error" in r:
                cells.append("fails: " + r["error"][:60])
            else:
                cells.append(f"{r['ms_median']:.2f} / {r['bound_ms']:.2f}")
        body.append([_label(spec), *cells])
    bw = gpu["bandwidth"]
    failures = [r for r in gpu["rows"] if "error" in r]
    return [
        f"{gpu.get('gpu', gpu['device'])}, MLX {gpu['mlx']} CUDA backend. One decode step = attention of one token "
        f"in {gpu['shape']['layers']} layers ({gpu['shape']['heads']} query heads on {gpu['shape']['kv_heads']} kv "
        f"heads, head_dim {gpu['shape']['head_dim']}, {gpu['shape']['dtype']}) over random caches; median of "
        f"{gpu['steps']} steps after {gpu['warmup']} warm-ups. Each cell: measured ms / physical bound ms, the bound "
        f"being the bytes the 32 caches hold ÷ the read bandwidth measured on the device "
        f"({bw['read_bytes_per_second'] / 1e12:.2f} TB/s by a 4 GiB reduction; copy {bw['copy_bytes_per_second'] / 1e12:.2f} TB/s). "
        "Attention only (no projections or MLP).",
        "",
        *_table(["cache", *[f"{c // 1024}k" for c in contexts]], body),
        f"Failures: {len(failures)} of {len(gpu['rows'])} runs"
        + (": " + "; ".join(f"{r['spec']}@{r['context']}: {r['error']}" for r in failures[:5]) if failures else "")
        + ".",
        "",
    ]


# ----- figures -------------------------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_quality(quality: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    rows = [r for r in quality["perplexity"]["rows"] if r["spec"] != "fp16"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for axis, key, title in ((axes[0], "mean_kl", "mean KL(fp16 ‖ cache), nats / token"),
                             (axes[1], "delta_nll", "Δ mean NLL vs fp16, nats / token")):
        points = [(r["effective_bits"], max(r[key], 1e-5)) for r in rows]
        for row, (x, y) in zip(rows, points, strict=True):
            axis.scatter(x, y, color=_colour(row), s=28, zorder=3)
            if key == "delta_nll":
                axis.errorbar(x, y, yerr=row["delta_nll_se"], color=_colour(row), alpha=0.5, zorder=2)
            axis.annotate(row["label"], (x, y), fontsize=6.5, xytext=(3, 2), textcoords="offset points")
        front = pareto_front(points)
        axis.step([points[i][0] for i in front], [points[i][1] for i in front], where="post", color="#444", lw=1,
                  ls="--", label="Pareto front")
        axis.set_yscale("log")
        axis.set_xlabel("effective bits per cached value (bytes held × 8 / values)")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
    families = sorted({(r.get("family"), r.get("method")) for r in rows})
    handles = [plt.Line2D([], [], marker="o", ls="", color=_colour({"family": f, "method": m}),
                          label=m if f == "velox" else f) for f, m in families]
    unique = {h.get_label(): h for h in handles}
    fig.legend(unique.values(), unique.keys(), loc="lower center", ncol=len(unique), fontsize=8, frameon=False)
    fig.suptitle("KV cache quality against memory — SmolLM2-135M, teacher-forced through the compressed cache", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def figure_memory(memory: dict[str, Any], path: Path, chosen: list[str]) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    results = dict(memory["model_kv"]["results"]) | ((memory.get("peers", {}).get("model") or {}).get("results", {}))
    for spec in chosen:
        rows = results.get(spec)
        if not rows:
            continue
        axes[0].plot([r["tokens"] for r in rows], [r["held_bytes"] / 1e6 for r in rows], marker="o", label=_label(spec))
    axes[0].set_title("SmolLM2-135M: bytes held (its own keys/values)", fontsize=10)
    axes[0].set_ylabel("MB")
    large = memory.get("large_shapes")
    if large:
        model = large["shapes"][0]["model"]
        for spec in chosen:
            rows = large["models"][model].get(spec)
            if rows:
                axes[1].plot([r["tokens"] for r in rows], [r["held_bytes"] / 1e9 for r in rows], marker="o", label=_label(spec))
        axes[1].set_title(f"{model} shape (random bf16 keys/values, 32 layers)", fontsize=10)
        axes[1].set_ylabel("GB")
    for axis in axes:
        axis.set_xscale("log", base=2)
        ticks = sorted({int(x) for line in axis.get_lines() for x in line.get_xdata()})
        axis.set_xticks(ticks, [f"{t // 1024}k" for t in ticks])
        axis.set_xlabel("tokens in the cache")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def figure_speed(speed: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(8.5, 5))
    for row in speed["rows"]:
        if "decode" not in row:
            continue
        contexts = sorted(int(c) for c in row["decode"])
        medians = [row["decode"][str(c)]["tokens_per_second"] for c in contexts]
        low = [m - 1000 / row["decode"][str(c)]["ms_per_token"]["max"] for m, c in zip(medians, contexts, strict=True)]
        high = [1000 / row["decode"][str(c)]["ms_per_token"]["min"] - m for m, c in zip(medians, contexts, strict=True)]
        axis.errorbar(contexts, medians, yerr=[low, high], marker="o", capsize=3, label=row["label"],
                      ls="--" if row.get("family") != "velox" else "-")
    axis.set_xscale("log", base=2)
    contexts = sorted({int(c) for row in speed["rows"] for c in row.get("decode", {})})
    axis.set_xticks(contexts, [f"{c // 1024}k" for c in contexts])
    axis.set_xlabel("tokens in the cache")
    axis.set_ylabel("decode tokens / s (median, min–max over rounds)")
    axis.set_title("SmolLM2-135M greedy decode on the 2-core CPU (shared machine)", fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def figure_gpu(gpu: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(8.5, 5))
    by_spec: dict[str, list[dict[str, Any]]] = {}
    for row in gpu["rows"]:
        if "error" not in row:
            by_spec.setdefault(row["spec"], []).append(row)
    for spec, rows in by_spec.items():
        line = axis.plot([r["context"] for r in rows], [r["ms_median"] for r in rows], marker="o", label=_label(spec))[0]
        if spec in ("fp16", "affine:4:64", "turboquant:3"):
            axis.plot([r["context"] for r in rows], [r["bound_ms"] for r in rows], ls=":", color=line.get_color())
    axis.set_xscale("log", base=2)
    axis.set_xticks(gpu["contexts"], [f"{c // 1024}k" for c in gpu["contexts"]])
    axis.set_yscale("log")
    axis.set_xlabel("tokens in each layer's cache")
    axis.set_ylabel("ms per decode step (32 layers, attention only)")
    axis.set_title(f"{gpu.get('gpu', 'GPU').split(',')[0]}: Llama-3.1-8B-shaped attention (dotted: bytes ÷ bandwidth)",
                   fontsize=10)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----- the document ------------------------------------------------------------------------------------------------


def write_report(results_dir: Path, markdown: Path, figures_dir: Path) -> list[Path]:
    """Write BENCHMARKS.md (and the figures when matplotlib is installed) from the results in `results_dir`."""
    quality = read_result(results_dir, "quality")
    memory = read_result(results_dir, "memory")
    speed = read_result(results_dir, "speed")
    gpu = read_result(results_dir, "gpu")
    written: list[Path] = []
    figure_note = ""
    try:
        _pyplot()
        have_matplotlib = True
    except ImportError:
        have_matplotlib = False
        figure_note = "(figures not drawn: install the `bench` extra, i.e. matplotlib)"
    if have_matplotlib:
        figures_dir.mkdir(parents=True, exist_ok=True)
        if quality and quality.get("perplexity"):
            figure_quality(quality, figures_dir / FIGURE_NAMES[0])
            written.append(figures_dir / FIGURE_NAMES[0])
        if memory:
            chosen = ["fp16", "mlx-kv", "mlx-q:8", "mlx-q:4", "affine:8:64", "rotated:4:64", "kivi:4:32",
                      "turboquant:3", "rotated:3/2:32", "turboquant:2", "vq:kivi:4", "vq:turboquant_rvq:2"]
            figure_memory(memory, figures_dir / FIGURE_NAMES[1], chosen)
            written.append(figures_dir / FIGURE_NAMES[1])
        if speed:
            figure_speed(speed, figures_dir / FIGURE_NAMES[2])
            written.append(figures_dir / FIGURE_NAMES[2])
        if gpu:
            figure_gpu(gpu, figures_dir / FIGURE_NAMES[3])
            written.append(figures_dir / FIGURE_NAMES[3])

    def figure(name: str, alt: str) -> list[str]:
        target = figures_dir / name
        if not target.is_file():
            return [figure_note, ""] if figure_note else []
        try:
            relative = target.resolve().relative_to(markdown.resolve().parent)
        except ValueError:
            relative = target.resolve()
        return [f"![{alt}]({relative.as_posix()})", ""]

    lines = [
        "# Benchmarks",
        "",
        "Generated by `velox bench report` from the JSON files in `benchmarks/results/` — do not edit by hand; "
        "rerun `velox bench all` (or one of `quality`, `memory`, `speed`) and `velox bench report`. Every number "
        "below is read from those files. Compare caches by their paired differences against fp16 on the same "
        "tokens, never by absolute perplexity (the prose is likely in the model's training data).",
        "",
        "Runs: ",
        *[f"- {kind}: {_machine_line(result)}" for kind, result in (("quality", quality), ("memory", memory),
                                                                     ("speed", speed)) if result],
        "",
        "## Headline: quality, memory and speed per cache",
        "",
        *headline(quality, memory, speed),
        *figure(FIGURE_NAMES[0], "quality against effective bits"),
        "## Compression levels in the app",
        "",
        *level_section(quality),
        "## Quality details",
        "",
        "### Harness check: chunk size 1 against 64",
        "",
        *_chunk_check(quality),
        "### Needle in a haystack",
        "",
        *needle_section(quality),
        "### Greedy generation agreement",
        "",
        *agreement_section(quality),
        "## Memory",
        "",
        *memory_section(memory),
        *figure(FIGURE_NAMES[1], "bytes held against context"),
        "## Speed (CPU)",
        "",
        *speed_section(speed),
        *figure(FIGURE_NAMES[2], "decode tok/s against context"),
        "## Speed (GPU, synthetic Llama-3.1-8B attention)",
        "",
        *gpu_section(gpu),
        *figure(FIGURE_NAMES[3], "GPU attention decode step against context"),
        "## Peers",
        "",
        *peers_section(quality, memory, speed),
    ]
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    written.insert(0, markdown)
    return written


def _chunk_check(quality: dict[str, Any] | None) -> list[str]:
    check = (quality or {}).get("chunking_check") or {}
    if not check:
        return ["Not run yet.", ""]
    body = [[_label(spec), str(r["tokens"]), f"{r['max_abs_nll_gap']:.2e}", f"{r['mean_nll'][0]:.6f}",
             f"{r['mean_nll'][1]:.6f}"] for spec, r in check.items()]
    return [
        "The same tokens scored feeding one token at a time and 64 at a time. With fp32 storage the two agree to "
        "float rounding; fp16 storage rounds each key/value to fp16, so the last-bit differences between the "
        "one-token and the chunked matrix products upstream flip a few of those roundings (a ~1e-3 effect on a "
        "token's NLL, invisible in the mean).",
        "",
        *_table(["cache", "tokens", "largest ΔNLL of a token", "mean NLL (chunk 1)", "mean NLL (chunk 64)"], body),
    ]


def peers_section(quality: dict[str, Any] | None, memory: dict[str, Any] | None, speed: dict[str, Any] | None) -> list[str]:
    notes = []
    ppl = (quality or {}).get("perplexity", {})
    if ppl.get("peer_note"):
        notes.append(f"- quality: {ppl['peer_note']}")
    if memory and memory.get("peers", {}).get("note"):
        notes.append(f"- memory: {memory['peers']['note']}")
    if speed and speed.get("peer_note"):
        notes.append(f"- speed: {speed['peer_note']}")
    return [
        "mlx-lm's own `QuantizedKVCache` (specs `mlx-q:BITS`, group 64) runs in the same processes as Velox's "
        "caches. The PyPI package `veloxquant-mlx` runs in a throwaway venv made by `engine/bench/peers.py` with "
        "the same mlx, mlx-lm and OpenBLAS versions, driven through its own `KVCacheBuilder.for_model`; its rows "
        "above carry its name. Its bytes are walked the same way as ours (every mx.array its cache objects hold).",
        "",
        *notes,
        "",
    ]
