"""The rule that turns the quality sweep into the app's compression levels (engine.planning.recommend.LEVEL_TABLE).

For each compressed level a memory budget in effective bits per value: the level's nominal bits + 0.5
(room for the scales/norms of group-64 quantization), counted with the registry's exact formula at
head_dim 128 and 4096 tokens of 8 kv heads, as `CompressionLevel.budget_bits` counts it, so 16-bit sink and
window tokens and per-layer constants are paid for. Among the measured
Velox configurations within the budget, the level takes the one with the lowest mean KL(fp16 ‖ cache) on
the quality sweep (KL rather than Δ NLL: it is measured on the whole distribution and varies far less
between runs). Configurations within `TIE_NATS` of the best are treated as equal, and the one that is cheaper
to attend with wins (no rotation before attention), then the smaller one.

Only methods whose decoding reads the packed codes directly (`attention_path == "fused"`) are eligible: the
`dequantize-per-step` methods (turboquant, rvq) decoded 3-4x slower than fp16 on the CPU at 1-2k tokens
and 30-60x slower on the H200 at 4k-128k (BENCHMARKS.md), which a person moving the slider would feel. For the
same reason a configuration the GPU decode kernel declines (`kernel_declines`; none today: it reads KIVI's own
key blocks and skips its sinks' stream copies), or whose codes no GPU backend has yet passed the parity tests with
(`gpu_unverified`: KIVI's 1-bit key channels), is not eligible: on a GPU it would decode without the kernel.

A level is also chosen on use, not only on KL (issue 12): where the needle and greedy-agreement parts of the
quality sweep are given, a candidate must
* have been measured on the needle and keep its recall within `NEEDLE_POINTS` of fp16's (4-bit: 5 points, 3-bit:
  15; the 2-bit level has no needle target), pooled over every trial and at each haystack length (1k-8k tokens):
  a candidate is turned away only when its shortfall beyond those points is larger than the shortfall's standard
  error (trials paired with fp16, so a thin grid cannot turn a candidate away on noise);
* not fall behind the best greedy match rate among the measured candidates still standing by more than the
  standard error of that difference (prompts paired). This is a comparison, so only a measured shortfall acts:
  a candidate not measured, or a run that kept no per-prompt figures, passes.
Among those, the lowest KL wins as above. Where no candidate meets them, the level keeps the lowest-KL candidate
and records that it misses them (`meets_use` False), so the slider never loses a level to a thin run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError

if TYPE_CHECKING:  # engine.kvcache loads MLX (see benchmarks/harness/cli.py)
    from engine.kvcache.config import KVCacheConfig

LEVEL_BUDGET_BITS = {"8": 8.5, "4": 4.5, "3": 3.5, "2": 2.5}
TIE_NATS = 0.001
# Needle recall a level may lose against fp16, in points (issue 12's targets); None: not weighed.
NEEDLE_POINTS: dict[str, float | None] = {"8": 5.0, "4": 5.0, "3": 15.0, "2": None}
REFERENCE = "fp16"
# Where budgets are counted: the values of engine.planning.recommend.BUDGET_* (not imported: that module loads
# MLX, which the harness must not before the runtime is prepared; tests/test_bench.py checks they agree).
REFERENCE_HEAD_DIM = 128
REFERENCE_TOKENS = 4096
REFERENCE_KV_HEADS = 8
# Extra work per decode step beyond reading the codes (ties are broken towards less).
_ATTENTION_EXTRA = {"affine": 0, "kivi": 0, "rotated": 1}


# Options a level carries beyond the rule's choice. They build the very cache the rule chose wherever no GPU decode
# kernel runs (the CPU, where the quality sweep runs: tests/test_kvcache_prerope.py builds each level both ways) and
# change it only where one does, so LEVEL_TABLE writes them while the rule, the sweep and the report compare levels without
# them. KIVI's rope=auto stores keys before RoPE where the kernel turns them; since key widths (rounds 15-16) the 3- and
# 2-bit levels carry it, ahead on quality there (the 4-bit level decoded a quarter slower on the H200 before RoPE and
# meets issue 12's targets as given; engine/planning/recommend.py says what each measured).
DEVICE_OPTIONS: dict[str, object] = {"rope": "auto"}


def without_device_options(config: KVCacheConfig) -> KVCacheConfig:
    """`config` without the DEVICE_OPTIONS it carries: the cache the level rule chose and the sweep measured."""
    kept = {k: v for k, v in config.options.items() if not (k in DEVICE_OPTIONS and v == DEVICE_OPTIONS[k])}
    return replace(config, options=kept)


def level_specs() -> list[str]:
    """The spec of every compressed level of engine.planning.recommend.LEVEL_TABLE (the app's slider), as the
    rule chose it (without DEVICE_OPTIONS: the sweep's runs measure these)."""
    from engine.planning.recommend import LEVELS

    return [str(without_device_options(level.config)) for level in LEVELS
            if level.config.method not in ("fp16", "fp32")]


def budget_bits(spec_text: str) -> float:
    """Effective bits per value of a Velox spec at head_dim 128 and 4096 tokens of 8 kv heads, all counted."""
    from benchmarks.harness.specs import read_result_spec
    from engine.kvcache import get_method

    config = read_result_spec(spec_text).velox_config()
    return float(get_method(config.method).effective_bits_per_value(
        config, REFERENCE_HEAD_DIM, REFERENCE_TOKENS, REFERENCE_KV_HEADS))


def eligible(row: dict[str, Any]) -> bool:
    if row.get("family") != "velox":
        return False
    from benchmarks.harness.specs import read_result_spec
    from engine.kvcache import get_method

    method = get_method(row["method"])
    if method.attention_path != "fused":
        return False
    config = read_result_spec(row["spec"]).velox_config()
    return (method.kernel_declines(config) is None and method.gpu_unverified(config) is None
            and method.decodes_history_without_kernel(config) is None)


def _named(names: Sequence[str], spec_text: str) -> str | None:
    """The name among `names` (a result file's spec texts, in either syntax) that builds the cache `spec_text`."""
    from benchmarks.harness.specs import read_result_spec, same_cache

    target = read_result_spec(spec_text)
    for name in names:
        try:
            if same_cache(read_result_spec(name), target):
                return name
        except ConfigError:  # a name of a method no longer registered matches nothing
            continue
    return None


def _shortfall(reference: Sequence[float], mine: Sequence[float]) -> tuple[float, float]:
    """Mean of reference - mine over paired units, and its standard error (inf with one unit)."""
    diff = [a - b for a, b in zip(reference, mine, strict=True)]
    mean = sum(diff) / len(diff)
    if len(diff) < 2:
        return mean, math.inf
    variance = sum((d - mean) ** 2 for d in diff) / (len(diff) - 1)
    return mean, math.sqrt(variance / len(diff))


def needle_verdict(needle: dict[str, Any], spec_text: str, points: float) -> dict[str, Any]:
    """How far a cache's needle recall falls short of fp16's, pooled and per haystack length (trials paired,
    in recall fractions), and whether it passes: no shortfall beyond `points` larger than its standard error."""
    trials = needle.get("trials", [])
    names = sorted({name for t in trials for name in t["results"]})
    name = _named(names, spec_text)
    paired = [t for t in trials if name is not None and "error" not in t["results"].get(name, {"error": 1})
              and "error" not in t["results"].get(REFERENCE, {"error": 1})]
    if not paired:
        return {"measured": False, "passes": False}
    groups: dict[str, list[dict[str, Any]]] = {"all": paired}
    for trial in paired:
        groups.setdefault(str(trial["length"]), []).append(trial)
    figures = {}
    for group, chosen in groups.items():
        shortfall, se = _shortfall([float(t["results"][REFERENCE]["exact"]) for t in chosen],
                                   [float(t["results"][name]["exact"]) for t in chosen])
        figures[group] = {"shortfall": shortfall, "se": se, "trials": len(chosen),
                          "fails": shortfall - points / 100 > se}
    return {"measured": True, "passes": not any(g["fails"] for g in figures.values()), "by_group": figures}


def _agreement_rows(agreement: dict[str, Any], spec_texts: Sequence[str]) -> dict[str, dict[str, Any]]:
    rows = agreement.get("rows", [])
    names = [row["spec"] for row in rows]
    out = {}
    for text in spec_texts:
        name = _named(names, text)
        if name is not None:
            out[text] = next(row for row in rows if row["spec"] == name)
    return out


def agreement_verdicts(agreement: dict[str, Any], spec_texts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per candidate: its greedy match rate, how far it falls behind the best candidate's (paired over prompts)
    with that difference's standard error, and whether it passes (behind by no more than the standard error)."""
    rows = _agreement_rows(agreement, spec_texts)
    # Not measured: nothing shows it behind, so it passes (the needle target, absolute, does need a measurement).
    verdicts: dict[str, dict[str, Any]] = {text: {"measured": False, "passes": True} for text in spec_texts}
    if not rows:
        return verdicts
    best_text = max(rows, key=lambda text: rows[text]["match_rate"])
    best = rows[best_text]
    for text, row in rows.items():
        behind = best["match_rate"] - row["match_rate"]
        if "match_by_prompt" in row and "match_by_prompt" in best:
            behind, se = _shortfall(best["match_by_prompt"], row["match_by_prompt"])
        else:
            se = math.inf  # no per-prompt figures: the difference cannot be told from noise
        verdicts[text] = {"measured": True, "match_rate": row["match_rate"], "best": best_text, "behind": behind,
                          "se": se, "passes": behind <= se}
    return verdicts


def _kl_choice(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The lowest-KL row; rows within TIE_NATS of it tie, and the one cheaper to attend with, then smaller, wins."""
    best_kl = min(row["mean_kl"] for row in rows)
    tied = [row for row in rows if row["mean_kl"] <= best_kl + TIE_NATS]
    tied.sort(key=lambda r: (_ATTENTION_EXTRA.get(r["method"], 2), r["bits_d128"], r["mean_kl"]))
    return tied[0]


def select_levels(
    rows: Sequence[dict[str, Any]], needle: dict[str, Any] | None = None, agreement: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """For each level key: the chosen quality row, its bits at d=128, the runner-up candidates and, where the
    quality sweep's `needle` and `agreement` parts are given, each candidate's verdicts on them (`use`) and
    whether the chosen row meets them (`meets_use`)."""
    candidates = [dict(row, bits_d128=budget_bits(row["spec"])) for row in rows if eligible(row)]
    chosen: dict[str, dict[str, Any]] = {}
    for key, budget in LEVEL_BUDGET_BITS.items():
        fitting = [row for row in candidates if row["bits_d128"] <= budget + 1e-9]
        if not fitting:
            continue
        ranked = sorted(fitting, key=lambda r: r["mean_kl"])
        choice: dict[str, Any] = {"budget": budget, "ranked": ranked, "use": {}, "meets_use": True}
        standing = fitting
        points = NEEDLE_POINTS.get(key)
        if needle is not None:
            # Measured at every level, so its figures are shown; it turns candidates away only where it is weighed
            # (elsewhere every candidate passes it, measured or not).
            for row in fitting:
                verdict = needle_verdict(needle, row["spec"], math.inf if points is None else points)
                choice["use"].setdefault(row["spec"], {})["needle"] = (
                    verdict if points is not None else {**verdict, "passes": True})
            standing = [row for row in standing if choice["use"][row["spec"]]["needle"]["passes"]]
        if agreement is not None:
            # Compared with the best of those still standing; where none is, with the best of all (shown only).
            verdicts = agreement_verdicts(agreement, [row["spec"] for row in standing or fitting])
            for text, verdict in verdicts.items():
                choice["use"].setdefault(text, {})["agreement"] = verdict
            standing = [row for row in standing if verdicts[row["spec"]]["passes"]]
        if not standing:
            standing, choice["meets_use"] = fitting, False
        chosen[key] = {"row": _kl_choice(standing), **choice}
    return chosen


def level_config(row: dict[str, Any]) -> KVCacheConfig:
    """The KVCacheConfig a level built from a chosen row holds: the row's cache, validated, without the
    harness's own prefill setting (benchmarks.harness.specs adds prefill_attention=auto)."""
    from benchmarks.harness.specs import read_result_spec

    config = read_result_spec(row["spec"]).velox_config().validate(REFERENCE_HEAD_DIM)
    return replace(config, options={k: v for k, v in config.options.items() if k != "prefill_attention"})


def measured_figures(row: dict[str, Any], use: dict[str, Any] | None = None) -> str:
    """A level's figures as LEVEL_TABLE records them (and `velox levels` prints them) from its quality row and,
    where measured, its verdicts on use (select_levels' `use` entry for it: needle recall against fp16's,
    greedy match rate)."""
    text = (
        f"ppl {100 * (row['ppl_ratio'] - 1):+.2f}% (±{100 * row['delta_nll_se']:.2f}) KL {row['mean_kl']:.4f} "
        f"top1 {100 * row['top1_agreement']:.1f}% ({row['scored_tokens']} scored tokens)"
    )
    needle = (use or {}).get("needle", {})
    if needle.get("measured"):
        pooled = needle["by_group"]["all"]
        text += f"; needle {0.0 - 100 * pooled['shortfall']:+.1f} points vs fp16 ({pooled['trials']} trials)"
    agreement = (use or {}).get("agreement", {})
    if agreement.get("measured"):
        text += f"; greedy match {100 * agreement['match_rate']:.1f}%"
    # Said outright, so a line without them does not read as a level that passed them.
    missing = [name for name, part in (("needle", needle), ("greedy match", agreement)) if not part.get("measured")]
    if missing:
        text += f"; {' and '.join(missing)} not measured"
    return text
