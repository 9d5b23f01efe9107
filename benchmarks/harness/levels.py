"""The rule that turns the quality sweep into the app's compression levels (engine.planning.recommend.LEVEL_TABLE).

For each compressed level a memory budget in effective bits per value: the level's nominal bits + 0.5
(room for the scales/norms of group-64 quantization), counted with the registry's exact formula at
head_dim 128 and 4096 tokens (8 kv heads), so 16-bit sink and window tokens are paid for. Among the measured
Velox configurations within the budget, the level takes the one with the lowest mean KL(fp16 ‖ cache) on
the quality sweep (KL rather than Δ NLL: it is measured on the whole distribution and varies far less
between runs). Configurations within `TIE_NATS` of the best are treated as equal, and the one that is cheaper
to attend with wins (no rotation before attention), then the smaller one.

Only methods whose decoding reads the packed codes directly (`attention_path == "fused"`) are eligible: the
`dequantize-per-step` methods (turboquant, rvq) decoded 3-4x slower than fp16 on the CPU at 1-2k tokens
and 30-60x slower on the H200 at 4k-128k (BENCHMARKS.md), which a person moving the slider would feel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.planning.recommend import BUDGET_HEAD_DIM as REFERENCE_HEAD_DIM
from engine.planning.recommend import BUDGET_KV_HEADS as REFERENCE_KV_HEADS
from engine.planning.recommend import BUDGET_TOKENS as REFERENCE_TOKENS

LEVEL_BUDGET_BITS = {"8": 8.5, "4": 4.5, "3": 3.5, "2": 2.5}
TIE_NATS = 0.001
# Extra work per decode step beyond reading the codes (ties are broken towards less).
_ATTENTION_EXTRA = {"affine": 0, "kivi": 0, "rotated": 1}


def budget_bits(spec_text: str) -> float:
    """Effective bits per value of a Velox spec at head_dim 128 and 4096 tokens, everything counted."""
    from benchmarks.harness.specs import parse_spec
    from engine.kvcache import get_method

    config = parse_spec(spec_text).velox_config()
    return float(
        get_method(config.method).effective_bits_per_value(
            config, REFERENCE_HEAD_DIM, REFERENCE_TOKENS, REFERENCE_KV_HEADS
        )
    )


def eligible(row: dict[str, Any]) -> bool:
    if row.get("family") != "velox":
        return False
    from engine.kvcache import get_method

    return get_method(row["method"]).attention_path == "fused"


def select_levels(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each level key: the chosen quality row, its bits at d=128, and the runner-up candidates."""
    candidates = [dict(row, bits_d128=budget_bits(row["spec"])) for row in rows if eligible(row)]
    chosen: dict[str, dict[str, Any]] = {}
    for key, budget in LEVEL_BUDGET_BITS.items():
        fitting = [row for row in candidates if row["bits_d128"] <= budget + 1e-9]
        if not fitting:
            continue
        best_kl = min(row["mean_kl"] for row in fitting)
        tied = [row for row in fitting if row["mean_kl"] <= best_kl + TIE_NATS]
        tied.sort(key=lambda r: (_ATTENTION_EXTRA.get(r["method"], 2), r["bits_d128"], r["mean_kl"]))
        ranked = sorted(fitting, key=lambda r: r["mean_kl"])
        chosen[key] = {"row": tied[0], "budget": budget, "ranked": ranked}
    return chosen


def level_config(row: dict[str, Any]) -> Any:
    """The KVCacheConfig of a chosen row as a level holds it (validated; without the device's prefill
    choice, which the bench adds to every compressed spec)."""
    from dataclasses import replace

    from benchmarks.harness.specs import parse_spec

    config = parse_spec(row["spec"]).velox_config().validate(REFERENCE_HEAD_DIM)
    options = {k: v for k, v in config.options.items() if k != "prefill_attention"}
    return replace(config, options=options)


def measured_figures(row: dict[str, Any]) -> str:
    """A level's figures as LEVEL_TABLE records them (and `velox levels` prints them) from its quality row."""
    return (
        f"ppl {100 * (row['ppl_ratio'] - 1):+.2f}% (±{100 * row['delta_nll_se']:.2f}) KL {row['mean_kl']:.4f} "
        f"top1 {100 * row['top1_agreement']:.1f}% ({row['scored_tokens']} scored tokens)"
    )
