"""What the memory, speed, GPU, peer and other-results sections of BENCHMARKS.md show: one function per section
turns its result files into the values and tables its template prints (None: no result file yet)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.memory import FILL_CHUNK
from benchmarks.harness.report import formatting as f
from benchmarks.harness.report.data import (
    Results,
    Source,
    attention_path,
    compressed_velox,
    family_of,
    label_of,
    large_results,
    memory_results,
    quality_rows,
    speed_row,
)
from benchmarks.harness.report.sections import missing_level_labels

ATTENTION_READS = {"fused": "on the packed codes", "dequantize-per-step": "dequantizes every step"}


# ----- memory -----------------------------------------------------------------------------------------------------


def _by_bits(results: dict[str, list[dict[str, Any]]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Spec and checkpoints, most bits held first (at the last checkpoint)."""
    return sorted(results.items(), key=lambda item: (-item[1][-1]["effective_bits"], item[0]))


def _model_table(every: dict[str, list[dict[str, Any]]], checkpoints: list[int]) -> str:
    fp16 = {row["tokens"]: row["held_bytes"] for row in every.get("fp16", [])}
    last_checkpoint = checkpoints[-1]
    body = []
    for spec, rows in _by_bits(every):
        by_tokens = {row["tokens"]: row for row in rows}
        last = by_tokens.get(last_checkpoint)
        if last is None:
            continue
        body.append([
            label_of(spec), *[f.mb(by_tokens[c]["held_bytes"]) if c in by_tokens else "—" for c in checkpoints],
            f"{last['held_bytes'] / fp16[last_checkpoint]:.3f}×" if last_checkpoint in fp16 else "—",
            f"{last['effective_bits']:.3f}", f.mb(last.get("mlx_peak_delta_bytes")), f.family_name(family_of(spec)),
        ])
    return f.table(["cache", *[f"MB held @{c:,} tokens" for c in checkpoints], f"bytes vs fp16 @{last_checkpoint:,}",
                    "bits held", "MLX peak while filling (MB)", "family"], body)


def _large_shapes(source: Source) -> tuple[dict[str, Any], list[float]] | None:
    """The random large-shape part of a memory run: its template values, and the peer's bits held there."""
    large = source.data.get("large_shapes")
    if not large:
        return None
    checkpoints, shapes = large["checkpoints"], large["shapes"]
    ends = (checkpoints[0], checkpoints[-1])
    per_model = {shape["model"]: large_results(source, shape["model"]) for shape in shapes}
    body, peer_bits = [], []
    for spec, rows in _by_bits(per_model[shapes[0]["model"]]):
        row = [label_of(spec)]
        for shape in shapes:
            by_tokens = {r["tokens"]: r for r in per_model[shape["model"]].get(spec, [])}
            row += [f.gb(by_tokens[c]["held_bytes"]) if c in by_tokens else "—" for c in ends]
        body.append(row + [f"{rows[-1]['effective_bits']:.3f}", f.family_name(family_of(spec))])
        if family_of(spec) == "veloxquant":
            peer_bits.append(rows[-1]["effective_bits"])
    header = ["cache"]
    for shape in shapes:
        header += [f"{shape['model']} GB @{ends[0] // 1024}k", f"GB @{ends[1] // 1024}k"]
    values = {"input_dtype": large["input_dtype"], "note": large["note"], "kv_heads": shapes[0]["kv_heads"],
              "head_dim": shapes[0]["head_dim"], "table": f.table([*header, "bits held", "family"], body),
              "layer_counts": ", ".join(f"{shape['model']}: {shape['layers']} layers" for shape in shapes)}
    return values, peer_bits


def memory(results: Results, base: Path) -> dict[str, Any] | None:
    source = results.best("memory")
    if source is None:
        return None
    checkpoints = source.data["model_kv"]["checkpoints"]
    every = memory_results(source)
    peer_bits = sorted({rows[-1]["effective_bits"] for spec, rows in every.items() if family_of(spec) == "veloxquant"})
    large, large_peer_bits = _large_shapes(source) or (None, [])
    return {
        "model": f.model_name(source), "last_checkpoint": checkpoints[-1], "fill_chunk": FILL_CHUNK,
        "source": f.source_line(source, base), "table": _model_table(every, checkpoints), "large": large,
        "peer_bits": f"{peer_bits[0]:.2f}–{peer_bits[-1]:.2f}" if peer_bits else "",
        "large_peer_bits": f"{min(large_peer_bits):.2f}–{max(large_peer_bits):.2f}" if large_peer_bits else "",
        "missing_levels": missing_level_labels(list(every)),
        "peer_note": source.data.get("peers", {}).get("note", ""),
    }


# ----- CPU speed --------------------------------------------------------------------------------------------------


def _decode_cell(decode: dict[str, Any] | None) -> str:
    """'tok/s (median ms, min–max ms)' of one context."""
    if not decode:
        return "—"
    ms = decode["ms_per_token"]
    spread = f", {ms['min']:.0f}–{ms['max']:.0f}" if ms.get("n", 1) > 1 else ""
    return f"{decode['tokens_per_second']:.1f} ({ms['median']:.0f} ms{spread})"


def _speed_table_row(row: dict[str, Any], contexts: list[str], fp16: dict[str, Any] | None) -> list[str]:
    if "decode" not in row:
        return [row["label"], *(["—"] * (len(contexts) + 2)), row.get("error", "")[:80]]
    top = row["decode"].get(contexts[-1])
    ref = fp16["decode"].get(contexts[-1]) if fp16 else None
    prefill = row["prefill_tokens_per_second"]
    spread = f" ({prefill['min']:.0f}–{prefill['max']:.0f})" if prefill.get("n", 1) > 1 else ""
    return [row["label"], *[_decode_cell(row["decode"].get(c)) for c in contexts],
            f"{top['tokens_per_second'] / ref['tokens_per_second']:.2f}×" if top and ref else "—",
            f"{prefill['median']:.0f}{spread}", ""]


def _switch_table(switch: dict[str, Any]) -> str:
    """Seconds to re-encode into each target (rows) at each context (columns); '' without a switch run."""
    if not switch:
        return ""
    first = next(iter(switch))
    body = [[switch[first][target]["label"], *[f"{switch[c][target]['seconds']['median']:.2f}" for c in switch]]
            for target in switch[first]]
    return f.table(["into", *[f"seconds @{int(c):,} tokens" for c in switch]], body)


def _speed_run(source: Source, base: Path) -> dict[str, Any]:
    speed = source.data
    settings = speed["settings"]
    contexts = [str(c) for c in settings["contexts"]]
    fp16 = speed_row(speed, "fp16")
    body = [_speed_table_row(row, contexts, fp16) for row in speed["rows"]]
    table = f.table(["cache", *[f"decode tok/s @{int(c):,} tokens (ms/token)" for c in contexts],
                     f"decode vs fp16 @{int(contexts[-1]):,}", "prefill tok/s", "error"], body)
    loads = [x for row in speed["rows"] for pair in row.get("load_average", []) for x in pair[:1]]
    return {
        "settings": settings, "n_caches": len(speed["rows"]), "model": f.model_name(source),
        "note": f.capitalized(settings["note"]), "load_range": f"{min(loads, default=0):.2f}–{max(loads, default=0):.2f}",
        "cpu_count": speed.get("machine", {}).get("cpu_count", "?"), "source": f.source_line(source, base),
        "table": table, "switch_table": _switch_table(speed.get("switch") or {}), "peer_note": speed.get("peer_note"),
    }


def speed(results: Results, base: Path) -> list[dict[str, Any]]:
    """One entry per speed run shown (the full run, else every quick one)."""
    return [_speed_run(source, base) for source in results.preferred("speed")]


# ----- GPU attention ----------------------------------------------------------------------------------------------


def _gpu_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "—"
    if "error" in row:
        return "fails: " + row["error"][:60]
    return f"{row['ms_median']:.2f} / {row['bound_ms']:.2f}"


def _gpu_table(data: dict[str, Any]) -> str:
    contexts = data["contexts"]
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for row in data["rows"]:
        rows.setdefault(row["spec"], {})[row["context"]] = row
    ref = rows.get("fp16", {}).get(contexts[-1])
    body = []
    for spec, by_context in rows.items():
        top = by_context.get(contexts[-1])
        ratio = (f"{top['ms_median'] / ref['ms_median']:.2f}×" if top and ref and "error" not in top
                 and "error" not in ref else "—")
        body.append([label_of(spec), *[_gpu_cell(by_context.get(c)) for c in contexts], ratio,
                     ATTENTION_READS.get(attention_path(spec), "")])
    return f.table(["cache", *[f"@{c // 1024}k tokens: ms / bound ms" for c in contexts],
                    f"attention time vs fp16 @{contexts[-1] // 1024}k", "attention reads"], body)


def gpu(results: Results, base: Path) -> dict[str, Any] | None:
    source = results.best("gpu")
    if source is None:
        return None
    data = source.data
    bandwidth = data["bandwidth"]
    return {
        "device": data.get("gpu", data["device"]), "mlx": data["mlx"], "shape": data["shape"], "steps": data["steps"],
        "warmup": data["warmup"], "read_tb_s": f"{bandwidth['read_bytes_per_second'] / 1e12:.2f}",
        "reduction_gib": f"{bandwidth.get('bytes', 0) / 2**30:.0f}",
        "copy_tb_s": f"{bandwidth['copy_bytes_per_second'] / 1e12:.2f}", "source": f.source_line(source, base),
        "table": _gpu_table(data), "failures": [r for r in data["rows"] if "error" in r], "n_runs": len(data["rows"]),
    }


# ----- peers and other results ------------------------------------------------------------------------------------


PEER_ROLES = ("veloxquant-mlx", "best Velox, same code bits", "mlx-lm, same code bits")


def _peers_table(rows: list[dict[str, Any]], peers: list[dict[str, Any]]) -> str:
    """Each peer row beside the best Velox and the mlx-lm row with the same nominal code bits."""
    body = []
    for peer in sorted(peers, key=lambda r: (r["nominal_bits"], r["spec"])):
        bits = peer["nominal_bits"]
        same_bits = [r for r in compressed_velox(rows) if r.get("nominal_bits") == bits]
        velox = min(same_bits, key=lambda r: r["mean_kl"], default=None)
        mlx = next((r for r in rows if r.get("family") == "mlx-lm" and r.get("nominal_bits") == bits), None)
        for index, (row, role) in enumerate(zip((peer, velox, mlx), PEER_ROLES, strict=True)):
            if row is None:
                continue
            body.append([f"**{bits:g}-bit codes**" if index == 0 else "", role, row["label"], f.fmt_bits(row),
                         f.fmt_delta(row), f.fmt(row["mean_kl"], ".4f"), f.pct(row["top1_agreement"])])
    return f.table(["code bits", "role", "cache", "bits held", "Δ NLL ± SE (nats/token)", "KL (nats/token)",
                    "top-1 = fp16"], body)


def _peer_notes(results: Results, quality: Source | None, base: Path) -> list[dict[str, str]]:
    """How the peer was set up for each run that has it."""
    notes = []
    if quality and quality.data["perplexity"].get("peer_note"):
        notes.append({"what": "quality", "text": quality.data["perplexity"]["peer_note"]})
    memory_source = results.best("memory")
    if memory_source and memory_source.data.get("peers", {}).get("note"):
        notes.append({"what": "memory", "text": memory_source.data["peers"]["note"]})
    for source in results.preferred("speed"):
        if source.data.get("peer_note"):
            notes.append({"what": f"speed (`{f.rel(source.path, base)}`)", "text": source.data["peer_note"]})
    return notes


def peers(results: Results, base: Path) -> dict[str, Any]:
    quality = results.best("quality", "perplexity")
    rows = quality_rows(quality)
    peer_rows = [r for r in rows if r.get("family") == "veloxquant"]
    values: dict[str, Any] = {"table": "", "notes": _peer_notes(results, quality, base)}
    if peer_rows:
        low, high = min(p["effective_bits"] for p in peer_rows), max(p["effective_bits"] for p in peer_rows)
        values |= {"table": _peers_table(rows, peer_rows), "source": f.source_line(quality, base),
                   "bits_range": f"{low:.2f}–{high:.2f}" if low > 16 else ""}
    return values


def _engine_core(core: Source, base: Path) -> dict[str, Any]:
    data = core.data
    body = [[name, str(run.get("prompt_tokens", "—")), f.fmt(run.get("prefill_tok_s"), ".1f"),
             f.fmt(run.get("decode_tok_s"), ".1f"), f.fmt(run.get("ttft_s"), ".1f"), f.mb(run.get("peak_memory_bytes")),
             f.mb(run.get("kv_cache_bytes"))] for name, run in data.get("runs", {}).items()]
    return {"machine": data.get("machine", "?"), "identical": {True: "yes", False: "no"}.get(data.get("identical_text"), "?"),
            "source": f.source_line(core, base),
            "table": f.table(["runtime", "prompt tokens", "prefill tok/s", "decode tok/s", "time to first token (s)",
                              "peak memory (MB)", "KV cache (MB)"], body)}


def other(results: Results, base: Path) -> dict[str, Any]:
    core, older = results.best("engine_core"), results.best("kvcache_quality")
    return {
        "core": _engine_core(core, base) if core else None,
        "older": {"path": f.rel(older.path, base), "tokens": older.data.get("tokens", "?"),
                  "text": older.data.get("text", "?")} if older else None,
    }
