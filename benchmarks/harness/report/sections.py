"""What the quality sections of BENCHMARKS.md show (summary, every cache, the app's levels, needle, agreement,
chunking check): one function per section turns the result files into the values and tables its template
(templates/<section>.md.j2) prints. A section without a result
file gets None, and its template says how to make one. The prose lives in the templates; number formats in
formatting.py; the facts (best per budget, app levels, ...) in data.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.harness.common import log, pareto_front
from benchmarks.harness.levels import (
    LEVEL_BUDGET_BITS,
    NEEDLE_POINTS,
    REFERENCE_HEAD_DIM,
    REFERENCE_KV_HEADS,
    REFERENCE_TOKENS,
    TIE_NATS,
    eligible,
    select_levels,
)
from benchmarks.harness.report import formatting as f
from benchmarks.harness.report.data import (
    BUDGET_SLACK,
    DENSE,
    Results,
    Source,
    budget_bits_or_inf,
    compressed_velox,
    is_mlx_4bit,
    label_of,
    large_shape_bits,
    level_labels,
    level_matches,
    missing_levels,
    mlx_budgets,
    quality_rows,
    row_by_spec,
)
from engine.errors import ConfigError
from engine.planning.recommend import LEVELS


def _quality(results: Results) -> tuple[Source | None, list[dict[str, Any]]]:
    quality = results.best("quality", "perplexity")
    return quality, quality_rows(quality)


# ----- summary: the best cache per mlx-lm budget ----------------------------------------------------------------


def compare_loss(velox: dict[str, Any], mlx: dict[str, Any]) -> str:
    """How a Velox row's Δ NLL compares with an mlx-lm row's, allowing two standard errors of the difference
    (the two SEs combined as if independent, which overstates the SE of a paired difference)."""
    diff = mlx["delta_nll"] - velox["delta_nll"]
    se = math.hypot(mlx["delta_nll_se"], velox["delta_nll_se"])
    if abs(diff) <= 2 * se:
        return "no difference beyond two standard errors"
    if diff > 0 and velox["delta_nll"] > 2 * velox["delta_nll_se"]:
        return f"{mlx['delta_nll'] / velox['delta_nll']:.1f}× less loss"
    return "less loss" if diff > 0 else "more loss"


def _brief(row: dict[str, Any], mlx: dict[str, Any] | None = None) -> dict[str, str]:
    brief = {"label": row["label"], "bits": f.fmt_bits(row), "delta": f.fmt_delta(row)}
    return brief | ({"compare": compare_loss(row, mlx)} if mlx is not None else {})


def _budget_bullet(entry: dict[str, Any]) -> dict[str, Any]:
    mlx, fused, best = entry["mlx"], entry["best_fused"], entry["best"]
    shows_best = best is not None and (fused is None or best["spec"] != fused["spec"])
    return {"bits": f.fmt_bits(mlx), "mlx": _brief(mlx), "fused": _brief(fused, mlx) if fused else None,
            "best": _brief(best, mlx) if shows_best else None}


SUMMARY_ROLES = (("best", "best Velox (lowest KL)"), ("best_fused", "best Velox that decodes on packed codes"),
                 ("same_quantizer", "Velox, mlx-lm's quantizer with fp16 scales"))


def _budget_picks(entry: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """The mlx-lm row of a budget, then each distinct Velox row beside it with its role."""
    mlx = entry["mlx"]
    shown = {mlx["spec"]}
    picks = [(mlx, "mlx-lm QuantizedKVCache")]
    for key, role in SUMMARY_ROLES:
        row = entry[key]
        if row is None or row["spec"] in shown:
            continue
        if key == "best" and entry["best_fused"] is not None and row["spec"] == entry["best_fused"]["spec"]:
            role = "best Velox (lowest KL; decodes on packed codes)"
        shown.add(row["spec"])
        picks.append((row, role))
    return picks


def _summary_table(budgets: list[dict[str, Any]]) -> str:
    body = []
    for entry in budgets:
        budget = f"**≤ {f.fmt_bits(entry['mlx'])}**"
        for index, (row, role) in enumerate(_budget_picks(entry)):
            name = f"**{row['label']}**" if row["family"] == "velox" and index == 1 else row["label"]
            body.append([budget if index == 0 else "", role, name, f.fmt_bits(row), f.fmt_delta(row), f.ppl(row),
                         f.fmt(row["mean_kl"], ".4f"), f.pct(row["top1_agreement"])])
    return f.table(["budget: bits held per value ≤", "role", "cache", "bits held", "Δ NLL ± SE (nats/token)",
                    "Δ perplexity", "KL (nats/token)", "top-1 = fp16"], body)


def summary(results: Results, base: Path) -> dict[str, Any] | None:
    quality, rows = _quality(results)
    if not rows:
        return None
    settings = quality.data["perplexity"]["settings"]
    budgets = mlx_budgets(rows)
    mlx4 = next((e["mlx"] for e in budgets if is_mlx_4bit(e["mlx"]["spec"])), None)
    scales = None
    if mlx4:
        scales = {"label": mlx4["label"], "bits": f.fmt_bits(mlx4),
                  "large": large_shape_bits(results.best("memory"), mlx4["spec"])}
    return {"model": f.model_name(quality), "machine": f.machine_short(quality),
            "scored_tokens": f.count(rows[0].get("scored_tokens")), "n_windows": len(settings["windows"]),
            "window": settings["window"], "source": f.source_line(quality, base),
            "budgets": [_budget_bullet(e) for e in budgets], "table": _summary_table(budgets), "scales": scales}


# ----- every cache, and the app's levels ------------------------------------------------------------------------


def quality_table(results: Results, base: Path) -> dict[str, Any] | None:
    quality, rows = _quality(results)
    if not rows:
        return None
    settings = quality.data["perplexity"]["settings"]
    front = {rows[i]["spec"] for i in pareto_front([(r["effective_bits"], r["mean_kl"]) for r in rows])}
    levels = level_labels(rows)
    body = []
    for row in sorted(rows, key=lambda r: (-r["effective_bits"], r["mean_kl"])):
        name = "**" + row["label"] + "** ★" if row["spec"] in front else row["label"]
        if row["spec"] in levels:
            name += f" (app {levels[row['spec']]})"
        body.append([
            name, f.fmt_bits(row), f.mb(row.get("held_bytes")), f"{row['effective_bits'] / 16:.2f}×", f.fmt_delta(row),
            f.ppl(row), f.fmt(row["mean_kl"], ".4f"), f.pct(row["top1_agreement"]), f.family_name(row.get("family", "velox")),
        ])
    tokens = rows[0].get("window_tokens", settings["window"] - 1)
    table = f.table(["cache", "bits held", f"MB held @{tokens:,} tokens", "bytes vs fp16", "Δ NLL ± SE (nats/token)",
                     "Δ perplexity", "KL (nats/token)", "top-1 = fp16", "family"], body)
    return {"settings": settings, "tokens": tokens, "scored_tokens": f.count(rows[0].get("scored_tokens")),
            "windows": ", ".join(f"{w['text']} from token {w['start']:,}" for w in settings["windows"]),
            "source": f.source_line(quality, base), "has_fp16": row_by_spec(rows, "fp16") is not None, "table": table}


def _table_config(level: Any) -> str:
    """A level as LEVEL_TABLE holds it, e.g. 'rotated K4/V4 g64' (+ ' w128' with a residual window, ' s4' with
    sink tokens, ' key_block=128' for each method option)."""
    config = level.config
    text = f"{config.method} K{config.key_bits}/V{config.value_bits} g{config.group_size}"
    text += f" w{config.residual_window}" if config.residual_window else ""
    text += f" s{config.sink_tokens}" if config.sink_tokens else ""
    return text + "".join(f" {name}={value}" for name, value in sorted(config.options.items()))


def _needle_text(verdict: dict[str, Any] | None) -> str:
    """A candidate's needle shortfall against fp16 in points ± SE, pooled then per haystack length."""
    if not verdict:
        return "—"
    if not verdict["measured"]:
        return "not measured"
    groups = verdict["by_group"]
    pooled = groups["all"]
    lengths = sorted((k for k in groups if k != "all"), key=int)
    each = " / ".join(f"{round(-100 * groups[k]['shortfall']) + 0:+d}" for k in lengths)  # + 0: no "-0"
    return (f"{round(-100 * pooled['shortfall'], 1) + 0.0:+.1f} ± {100 * pooled['se']:.1f} ({pooled['trials']} trials; "
            f"{'/'.join(f'{int(k) // 1024}k' for k in lengths)}: {each})")


def _agreement_text(verdict: dict[str, Any] | None) -> str:
    if not verdict:
        return "—"
    if not verdict["measured"]:
        return "not measured"
    se = "no per-prompt SE" if math.isinf(verdict["se"]) else f"± {100 * verdict['se']:.1f}"
    if verdict["best"] is not None and verdict["behind"] == 0:
        return f"{100 * verdict['match_rate']:.1f} % (the best measured)"
    return f"{100 * verdict['match_rate']:.1f} % ({round(-100 * verdict['behind'], 1) + 0.0:+.1f} {se} vs the best)"


def _levels_table(chosen: dict[str, dict[str, Any]]) -> str:
    body = []
    for level in LEVELS:
        if level.config.method in DENSE:
            continue
        choice = chosen.get(level.key)
        if choice is None:
            body.append([level.label, "—", "nothing eligible fits", _table_config(level), "—", "—", "—", "—", "—"])
            continue
        row = choice["row"]
        agrees = "✓" if level_matches(row["spec"], level) else "✗ differs: rerun the rule"
        use = choice["use"].get(row["spec"], {})
        points = NEEDLE_POINTS.get(level.key)
        verdict = use.get("needle")
        needle = _needle_text(verdict)
        if points is None:  # shown where measured, but not weighed at this level
            needle = f"{needle}, not weighed" if verdict and verdict["measured"] else "not weighed"
        needle += "" if choice["meets_use"] else " **misses the use targets: lowest KL kept**"
        body.append([level.label, f"{choice['budget']:g}", f"**{row['label']}**", f"{_table_config(level)} {agrees}",
                     f.fmt_bits(row), f.fmt(row["mean_kl"], ".4f"), f.fmt_delta(row), needle,
                     _agreement_text(use.get("agreement"))])
    return f.table(["level", "budget (bits/value, formula)", "chosen by the rule", "LEVEL_TABLE has",
                    "bits held", "KL (nats/token)", "Δ NLL ± SE (nats/token)",
                    "needle recall − fp16's (points ± SE)", "greedy match rate"], body)


def _ranking_why(row: dict[str, Any], choice: dict[str, Any], best_kl: float) -> str:
    if row["spec"] == choice["row"]["spec"]:
        return "**chosen**"
    use = choice["use"].get(row["spec"], {})
    if choice["meets_use"] and use:
        if "needle" in use and not use["needle"]["passes"]:
            return "turned away: needle " + ("not measured" if not use["needle"]["measured"] else "recall")
        if "agreement" in use and not use["agreement"]["passes"]:
            return "turned away: greedy agreement behind"
    if row["mean_kl"] <= best_kl + TIE_NATS:
        return f"tied within {TIE_NATS:g} nats; loses on attention cost or size"
    return ""


def _level_ranking(level: Any, choice: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The closest eligible caches within one level's budget, and the closer ones the rule excludes."""
    ranked = choice["ranked"]
    best_kl = ranked[0]["mean_kl"]
    shown = ranked[:6]
    if choice["row"] not in shown:
        shown.append(choice["row"])
    body = [[str(ranked.index(row) + 1), row["label"], f"{row['bits_d128']:.3f}", f.fmt_bits(row),
             f.fmt(row["mean_kl"], ".4f"), f.fmt_delta(row),
             _needle_text(choice["use"].get(row["spec"], {}).get("needle")),
             _agreement_text(choice["use"].get(row["spec"], {}).get("agreement")),
             _ranking_why(row, choice, best_kl)] for row in shown]
    excluded = [r for r in compressed_velox(rows) if not eligible(r) and r["mean_kl"] < choice["row"]["mean_kl"]
                and budget_bits_or_inf(r["spec"]) <= choice["budget"] + BUDGET_SLACK]
    return {
        "label": level.label, "budget": f"{choice['budget']:g}", "n_eligible": len(ranked), "n_shown": len(shown),
        "meets_use": choice["meets_use"],
        "table": f.table(["rank", "cache", f"bits at d={REFERENCE_HEAD_DIM} (budget test)", "bits held",
                          "KL (nats/token)", "Δ NLL ± SE (nats/token)", "needle recall − fp16's (points ± SE)",
                          "greedy match rate", ""], body),
        "excluded": [f"{r['label']} ({budget_bits_or_inf(r['spec']):.3f} bits at d={REFERENCE_HEAD_DIM}, KL "
                     f"{r['mean_kl']:.4f})" for r in sorted(excluded, key=lambda r: r["mean_kl"])],
    }


def levels(results: Results, base: Path) -> dict[str, Any] | None:
    quality, rows = _quality(results)
    if not rows:
        return None
    needle_source, agreement_source = results.best("quality", "needle"), results.best("quality", "agreement")
    needle = needle_source.data["needle"] if needle_source else None
    agreement = agreement_source.data["agreement"] if agreement_source else None
    chosen = select_levels(rows, needle, agreement)
    per_level = [_level_ranking(level, chosen[level.key], rows) for level in LEVELS
                 if level.config.method not in DENSE and chosen.get(level.key) is not None]
    sources = [quality]
    for source in (needle_source, agreement_source):
        if source is not None and all(source.path != known.path for known in sources):
            sources.append(source)
    return {
        "head_dim": REFERENCE_HEAD_DIM, "tie": f"{TIE_NATS:g}",
        "budget_tokens": f"{REFERENCE_TOKENS:,}", "budget_kv_heads": REFERENCE_KV_HEADS,
        "budgets": ", ".join(f"{k}-bit ≤ {v:g}" for k, v in LEVEL_BUDGET_BITS.items()),
        "needle_points": ", ".join(f"{k}-bit {v:g}" for k, v in NEEDLE_POINTS.items() if v is not None),
        "unweighed": ", ".join(f"{k}-bit" for k, v in NEEDLE_POINTS.items() if v is None),
        "weighs_use": needle is not None or agreement is not None,
        "model": f.model_name(quality), "model_head_dim": quality.data.get("model", {}).get("head_dim", "?"),
        "window_tokens": f.count(rows[0].get("window_tokens")), "source": f.source_line(sources, base),
        "table": _levels_table(chosen), "per_level": per_level,
    }


# ----- needle, agreement, chunking check ------------------------------------------------------------------------


def missing_level_labels(specs: list[str]) -> list[str]:
    """Labels of the app's current levels a run lacks ([] when it has them all, or when that cannot be told)."""
    try:
        return [spec.label for spec in missing_levels(specs)]
    except ConfigError as error:
        log(f"report: left out the note on levels missing from a run: {error}")
        return []


def _run_note(source: Source) -> str:
    machine = source.data.get("machine", {})
    return (machine.get("note") if isinstance(machine, dict) else None) or ""


def _failures(failures: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, message) of each cache that could not run on that backend."""
    return [(label_of(spec), failure["error"] if isinstance(failure, dict) else str(failure))
            for spec, failure in failures.items()]


def _run_notes(source: Source, part: dict[str, Any], specs: list[str], base: Path) -> dict[str, Any]:
    return {"source": f.source_line(source, base), "run_note": _run_note(source),
            "failures": _failures(part.get("failures", {})), "missing_levels": missing_level_labels(specs)}


def needle(results: Results, base: Path) -> dict[str, Any] | None:
    source = results.best("quality", "needle")
    if source is None:
        return None
    part = source.data["needle"]
    settings = part["settings"]
    lengths = [str(n) for n in settings["lengths"]]
    depths = [f"{d:g}" for d in settings["depths"]]
    body = [[
        row["label"], f"{row['recall'] * 100:.0f} %",
        *[f"{row['by_length'][n]['recall'] * 100:.0f} %" for n in lengths],
        *[f"{row['by_depth'][d]['recall'] * 100:.0f} %" for d in depths],
        f"{row['answer_logprob']:.2f}", f"{row['delta_logprob']:+.2f} ± {row['delta_logprob_se']:.2f}",
    ] for row in part["summary"]]
    table = f.table(["cache", "recall", *[f"recall @{n} tokens" for n in lengths],
                     *[f"recall at depth {d}" for d in depths], "answer log p (nats)", "Δ log p vs fp16 (nats)"], body)
    return {"depths": depths, "lengths": lengths, "n_seeds": len(settings["seeds"]),
            "trials": part["summary"][0]["trials"], "recall": settings["recall"], "table": table,
            **_run_notes(source, part, [r["spec"] for r in part["summary"]], base)}


def agreement(results: Results, base: Path) -> dict[str, Any] | None:
    source = results.best("quality", "agreement")
    if source is None:
        return None
    part = source.data["agreement"]
    body = [[r["label"], f"{r['match_rate'] * 100:.1f} %", f"{r['mean_first_divergence']:.1f}",
             f"{r['identical'] * 100:.0f} %", f"{r['positionwise_agreement'] * 100:.1f} %"] for r in part["rows"]]
    table = f.table(["cache", "match rate", "first divergence (tokens)", "identical continuations",
                     "same token at same position"], body)
    return {"settings": part["settings"], "table": table,
            **_run_notes(source, part, [r["spec"] for r in part["rows"]], base)}


def chunk_check(results: Results, base: Path) -> dict[str, Any] | None:
    source = results.best("quality", "perplexity")
    check = (source.data if source else {}).get("chunking_check") or {}
    if not check:
        return None
    sizes = next(iter(check.values()))["chunk_sizes"]
    body = [[label_of(spec), str(r["tokens"]), f"{r['max_abs_nll_gap']:.2e}", f"{r['mean_nll'][0]:.6f}",
             f"{r['mean_nll'][1]:.6f}", f.signed(r["mean_nll"][0] - r["mean_nll"][1])] for spec, r in check.items()]
    table = f.table(["cache", "tokens", "largest ΔNLL of a token, either sign (nats)",
                     f"mean NLL, chunk {sizes[0]} (nats/token)", f"mean NLL, chunk {sizes[1]} (nats/token)",
                     "difference (nats/token)"], body)
    return {"sizes": sizes, "source": f.source_line(source, base), "table": table}
