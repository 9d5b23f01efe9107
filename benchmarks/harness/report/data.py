"""The report's data: the result files of a results folder, the best one per section, and the facts the
markdown, the figures, README and the tests all read from them (which cache is best within a budget, which
row is an app level, ...). Nothing here formats text or draws."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.harness.common import log
from benchmarks.harness.levels import (
    REFERENCE_HEAD_DIM,
    budget_bits,
    eligible,
    level_specs,
    without_device_options,
)
from benchmarks.harness.specs import CacheSpec, parse_spec, read_result_spec, same_cache
from engine.errors import ConfigError
from engine.kvcache import get_method
from engine.planning.recommend import LEVELS

QUICK_FOLDER = "quick"
DENSE = ("fp16", "fp32")
BUDGET_SLACK = 1e-9


@dataclass(frozen=True)
class Source:
    """One result file and its parsed JSON."""

    path: Path
    data: dict[str, Any]

    @property
    def quick(self) -> bool:
        return bool(self.data.get("quick"))

    @property
    def kind(self) -> str:
        return str(self.data.get("kind") or self.path.stem)


class Results:
    """Every result file of a results folder (and its quick/ subfolder), grouped by kind, best first."""

    def __init__(self, results_dir: Path) -> None:
        self.dir = Path(results_dir)
        self.by_kind: dict[str, list[Source]] = {}
        for path in sorted(self.dir.glob("*.json")) + sorted((self.dir / QUICK_FOLDER).glob("*.json")):
            source = _read_source(path)
            if source is not None:
                self.by_kind.setdefault(source.kind, []).append(source)
        for kind, sources in self.by_kind.items():
            sources.sort(key=lambda s: str(s.data.get("created", "")), reverse=True)  # newest first, then:
            sources.sort(key=lambda s, k=kind: (s.quick, s.path.name != canonical_name(k, s.quick),
                                                s.path.parent != self.dir))

    def sources(self, kind: str, part: str | None = None) -> list[Source]:
        """The files of `kind` (holding `part`, if given), best first: full runs, then quick ones."""
        return [s for s in self.by_kind.get(kind, []) if part is None or s.data.get(part)]

    def best(self, kind: str, part: str | None = None) -> Source | None:
        found = self.sources(kind, part)
        return found[0] if found else None

    def preferred(self, kind: str, part: str | None = None) -> list[Source]:
        """The best full run alone when there is one, else every quick run (the canonically named first)."""
        found = self.sources(kind, part)
        full = [s for s in found if not s.quick]
        return full[:1] if full else found


def _read_source(path: Path) -> Source | None:
    """One result file, or None (and a line saying why it is left out) when it is not a result."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        log(f"report: skipped {path}: not readable JSON ({error})")
        return None
    if not isinstance(data, dict):
        log(f"report: skipped {path}: holds a {type(data).__name__}, not a result object")
        return None
    return Source(path, data)


def canonical_name(kind: str, quick: bool) -> str:
    return f"{kind}{'-quick' if quick else ''}.json"


def load_results(results_dir: Path) -> Results:
    return Results(results_dir)


# ----- what a spec string names ------------------------------------------------------------------------------


@cache
def cache_spec(text: str) -> CacheSpec | None:
    """The parsed spec, or None for one this checkout cannot read (a method no longer registered in an old
    result); said once per spec, and the report then shows the spec as written."""
    try:
        return read_result_spec(text)
    except ConfigError as error:
        log(f"report: cache spec {text!r} shown as written: {error}")
        return None


def canonical(spec: str) -> str:
    """A result row's spec in today's syntax, so rows written in either syntax compare (the text if unreadable)."""
    parsed = cache_spec(spec)
    return parsed.canonical if parsed else spec


def is_mlx_4bit(spec: str) -> bool:
    """Whether a result row is mlx-lm's 4-bit QuantizedKVCache (old `mlx-q:4` or new `mlx-q:k4v4`)."""
    parsed = cache_spec(spec)
    return parsed is not None and parsed.family == "mlx-lm" and parsed.key_bits == 4


def label_of(spec: str) -> str:
    parsed = cache_spec(spec)
    return parsed.label if parsed else spec


def family_of(spec: str) -> str:
    parsed = cache_spec(spec)
    return parsed.family if parsed else "velox"


def method_of(spec: str) -> str:
    parsed = cache_spec(spec)
    return parsed.method if parsed else spec


def attention_path(spec: str) -> str:
    """'fused', 'dequantize-per-step' or 'dense' for a Velox cache, '' for another family's (or an unknown one)."""
    if family_of(spec) != "velox":
        return ""
    try:
        return str(get_method(method_of(spec)).attention_path)
    except ConfigError:  # a method no longer registered: cache_spec has said so already
        return ""


def decodes_by_dequantizing(spec: str) -> bool:
    return attention_path(spec) == "dequantize-per-step"


# ----- quality facts (shared by BENCHMARKS.md, README and the tests) ------------------------------------------


def quality_rows(source: Source | None) -> list[dict[str, Any]]:
    return (source.data if source else {}).get("perplexity", {}).get("rows", [])


def row_by_spec(rows: list[dict[str, Any]], spec: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["spec"] == spec), None)


def row_by_label(rows: list[dict[str, Any]], label: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["label"] == label), None)


def compressed_velox(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("family") == "velox" and r.get("method") not in DENSE]


def mlx_quantized(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """mlx-lm's QuantizedKVCache rows (not its plain KVCache)."""
    return [r for r in rows if r.get("family") == "mlx-lm" and r.get("method") not in ("kv",) + DENSE]


def best_within(rows: list[dict[str, Any]], budget: float, fused_only: bool = False) -> dict[str, Any] | None:
    """The Velox cache with the lowest mean KL among those holding at most `budget` bits per value
    (measured), optionally only those that decode on the packed codes."""
    fits = [r for r in compressed_velox(rows) if r["effective_bits"] <= budget + BUDGET_SLACK
            and (not fused_only or eligible(r))]
    return min(fits, key=lambda r: (r["mean_kl"], r["effective_bits"]), default=None)


def mlx_budgets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per mlx-lm QuantizedKVCache row, most bits first: the budget is the bits mlx-lm's cache holds,
    and beside it the best Velox cache within that budget (lowest KL), the best one that decodes on packed
    codes, and Velox's affine cache with mlx-lm's bits and group size (the same quantizer, fp16 scales)."""
    out = []
    for mlx in sorted(mlx_quantized(rows), key=lambda r: -r["effective_bits"]):
        spec = read_result_spec(mlx["spec"])
        budget = mlx["effective_bits"]
        affine = f"affine:k{spec.key_bits}v{spec.key_bits}:g{spec.group_size}"
        same = next((r for r in rows if canonical(r["spec"]) == affine), None)
        out.append({"budget": budget, "mlx": mlx, "best": best_within(rows, budget),
                    "best_fused": best_within(rows, budget, fused_only=True), "same_quantizer": same})
    return out


def level_matches(spec: str, level: Any) -> bool:
    """Whether a Velox spec builds the cache of an app level (engine.planning.recommend.LEVELS)."""
    parsed = cache_spec(spec)
    config = level.config
    if parsed is None or parsed.family != "velox" or parsed.method != config.method:
        return False
    if config.method in DENSE:
        return True
    # The whole configuration (sinks and method options too), without the harness's prefill setting, against the
    # level as the rule chose it (without the options it takes on a GPU: levels.DEVICE_OPTIONS).
    built = parsed.velox_config().validate(REFERENCE_HEAD_DIM)
    plain = replace(built, options={k: v for k, v in built.options.items() if k != "prefill_attention"})
    return plain == without_device_options(config)


def app_levels(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each compressed level of the app (LEVEL_TABLE) with its measured quality row (or None) and the
    cheapest mlx-lm QuantizedKVCache holding at least as many bits per value."""
    mlx_rows = sorted(mlx_quantized(rows), key=lambda r: r["effective_bits"])
    out = []
    for level in LEVELS:
        if level.config.method in DENSE:
            continue
        row = next((r for r in rows if level_matches(r["spec"], level)), None)
        mlx = None
        if row is not None:
            mlx = next((m for m in mlx_rows if m["effective_bits"] >= row["effective_bits"] - BUDGET_SLACK), None)
        out.append({"level": level, "row": row, "mlx": mlx})
    return out


def level_labels(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Spec → app level label, for the rows that are an app level."""
    return {e["row"]["spec"]: e["level"].label for e in app_levels(rows) if e["row"]}


def budget_bits_or_inf(spec: str) -> float:
    """The level rule's bits of `spec` at head_dim 128, or infinity for a config that does not suit it."""
    try:
        return float(budget_bits(spec))
    except ConfigError:  # e.g. a group size head_dim 128 cannot hold: it fits no budget
        return float("inf")


def missing_levels(specs: list[str]) -> list[CacheSpec]:
    """The app's current compressed levels that none of `specs` builds."""
    current = [parse_spec(s) for s in level_specs()]
    ran = [parsed for parsed in map(cache_spec, specs) if parsed is not None]
    return [c for c in current if not any(same_cache(c, r) for r in ran)]


# ----- other runs ----------------------------------------------------------------------------------------------


def gpu_rows_at(gpu: Source | None, context: int | None = None) -> tuple[int | None, list[dict[str, Any]]]:
    """The successful GPU rows at `context` (default: the longest context measured)."""
    if gpu is None:
        return None, []
    rows = [r for r in gpu.data.get("rows", []) if "error" not in r]
    if not rows:
        return None, []
    context = context or max(r["context"] for r in rows)
    return context, [r for r in rows if r["context"] == context]


def gpu_headline(gpu: Source | None) -> dict[str, Any] | None:
    """fp16, the fastest and the slowest Velox cache at the longest context of the GPU run."""
    context, rows = gpu_rows_at(gpu)
    fp16 = next((r for r in rows if r["spec"] == "fp16"), None)
    velox = [r for r in rows if family_of(r["spec"]) == "velox" and method_of(r["spec"]) not in DENSE]
    if fp16 is None or not velox:
        return None
    return {"context": context, "fp16": fp16, "fastest": min(velox, key=lambda r: r["ms_median"]),
            "slowest": max(velox, key=lambda r: r["ms_median"])}


def large_shape_bits(memory: Source | None, spec: str) -> tuple[str, float] | None:
    """(model, effective bits) of `spec` on the first large (16-bit) shape of a memory run."""
    large = (memory.data if memory else {}).get("large_shapes") or {}
    if not large.get("shapes"):
        return None
    model = large["shapes"][0]["model"]
    rows = large.get("models", {}).get(model, {}).get(spec)
    return (model, rows[-1]["effective_bits"]) if rows else None


def memory_results(source: Source) -> dict[str, list[dict[str, Any]]]:
    """Spec → checkpoints on the model's own keys/values, the peer's included."""
    results = dict(source.data["model_kv"]["results"])
    results |= (source.data.get("peers", {}).get("model") or {}).get("results", {})
    return results


def large_results(source: Source, model: str) -> dict[str, list[dict[str, Any]]]:
    """Spec → checkpoints on the random large `model` shape, the peer's included."""
    large = source.data.get("large_shapes") or {}
    results = dict(large.get("models", {}).get(model, {}))
    results |= (source.data.get("peers", {}).get("large") or {}).get("models", {}).get(model, {})
    return results


def speed_row(speed: dict[str, Any] | None, spec: str) -> dict[str, Any] | None:
    """The row of `spec` in a speed run, if it decoded."""
    for row in (speed or {}).get("rows", []):
        if row["spec"] == spec and "decode" in row:
            return row
    return None
