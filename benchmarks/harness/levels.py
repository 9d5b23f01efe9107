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
key blocks and skips its sinks' stream copies) is not eligible: on a GPU it would decode without the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # engine.kvcache loads MLX (see benchmarks/harness/cli.py)
    from engine.kvcache.config import KVCacheConfig

LEVEL_BUDGET_BITS = {"8": 8.5, "4": 4.5, "3": 3.5, "2": 2.5}
TIE_NATS = 0.001
# Where budgets are counted: the values of engine.planning.recommend.BUDGET_* (not imported: that module loads
# MLX, which the harness must not before the runtime is prepared; tests/test_bench.py checks they agree).
REFERENCE_HEAD_DIM = 128
REFERENCE_TOKENS = 4096
REFERENCE_KV_HEADS = 8
# Extra work per decode step beyond reading the codes (ties are broken towards less).
_ATTENTION_EXTRA = {"affine": 0, "kivi": 0, "rotated": 1}


def level_specs() -> list[str]:
    """The spec of every compressed level of engine.planning.recommend.LEVEL_TABLE (the app's slider)."""
    from engine.planning.recommend import LEVELS

    return [str(level.config) for level in LEVELS if level.config.method not in ("fp16", "fp32")]


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
    return method.kernel_declines(read_result_spec(row["spec"]).velox_config()) is None


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


def level_config(row: dict[str, Any]) -> KVCacheConfig:
    """The KVCacheConfig a level built from a chosen row holds: the row's cache, validated, without the
    harness's own prefill setting (benchmarks.harness.specs adds prefill_attention=auto)."""
    from benchmarks.harness.specs import read_result_spec

    config = read_result_spec(row["spec"]).velox_config().validate(REFERENCE_HEAD_DIM)
    return replace(config, options={k: v for k, v in config.options.items() if k != "prefill_attention"})


def measured_figures(row: dict[str, Any]) -> str:
    """A level's figures as LEVEL_TABLE records them (and `velox levels` prints them) from its quality row."""
    return (
        f"ppl {100 * (row['ppl_ratio'] - 1):+.2f}% (±{100 * row['delta_nll_se']:.2f}) KL {row['mean_kl']:.4f} "
        f"top1 {100 * row['top1_agreement']:.1f}% ({row['scored_tokens']} scored tokens)"
    )
