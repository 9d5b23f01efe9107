"""Speed: decode ms/token and tok/s against context length, prefill tok/s, and live-switch re-encode time.

Each (config, round) runs in a fresh subprocess (MLX caches compiled graphs and allocator state, so a
config measured after another in one process would inherit them); rounds visit the configs in a rotated
order, so slow drifts of a shared machine spread over all configs rather than landing on one. Inside a run:
a warm-up prefill, a timed prefill of real prose in 512-token chunks, then for each context length a cache
filled with the model's own keys/values of that many prose tokens (the snapshot of `memory.py`, fed through
`update_and_fetch` like a prefill), a few warm-up decode steps and the timed greedy decode steps. The load
average is read before and after every run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.harness.common import load_average, summarize
from benchmarks.harness.specs import CacheSpec

PREFILL_CHUNK = 512


def _model_dtype(model: Any) -> mx.Dtype:
    return model.model.embed_tokens.weight.dtype if hasattr(model, "model") else mx.float32


def speed_run(
    model: Any, spec: CacheSpec, prose: list[int], snapshot: Path, contexts: Sequence[int], prefill_tokens: int,
    warmup_steps: int, timed_steps: int,
) -> dict[str, Any]:
    """One config's timings in this (fresh) process."""
    from benchmarks.harness.memory import fill, load_kv_snapshot
    from benchmarks.harness.quality import prefill
    from engine.planning.memory import array_bytes

    record: dict[str, Any] = {"spec": spec.text, "label": spec.label, "pid": os.getpid(),
                              "load_average_before": load_average()}
    factory = spec.factory(model)
    prefill(model, factory(), prose[:PREFILL_CHUNK])  # warm-up: first calls pay for kernel set-up

    caches = factory()
    chunk_seconds = []
    for start in range(0, prefill_tokens, PREFILL_CHUNK):
        piece = prose[start : start + PREFILL_CHUNK]
        began = time.perf_counter()
        model(mx.array(piece)[None], cache=caches)
        mx.eval([getattr(cache, "state", cache) for cache in caches])
        chunk_seconds.append(time.perf_counter() - began)
    total = sum(chunk_seconds)
    record["prefill"] = {
        "tokens": prefill_tokens,
        "chunk": PREFILL_CHUNK,
        "seconds": total,
        "tokens_per_second": prefill_tokens / total,
        "chunk_seconds": chunk_seconds,
    }
    del caches

    keys, values = load_kv_snapshot(snapshot)
    dtype = _model_dtype(model)
    decode = {}
    for context in contexts:
        if context > keys[0].shape[-2]:
            continue
        caches = factory()
        fill(caches, keys, values, 0, context, dtype)
        token = mx.array(prose[context : context + 1])
        step_ms = []
        for step in range(warmup_steps + timed_steps):
            began = time.perf_counter()
            logits = model(token[None], cache=caches)[0, -1]
            token = mx.argmax(logits, axis=-1, keepdims=True)
            mx.eval(token)
            if step >= warmup_steps:
                step_ms.append((time.perf_counter() - began) * 1000)
        stats = summarize(step_ms)
        decode[str(context)] = {
            "ms_per_token": stats,
            "tokens_per_second": 1000 / stats["median"],
            "held_bytes": array_bytes(caches),
            "samples_ms": step_ms,
        }
        del caches
    record["decode"] = decode
    record["load_average_after"] = load_average()
    return record


def combine_speed(runs: list[dict[str, Any]], specs: Sequence[CacheSpec]) -> list[dict[str, Any]]:
    """Per spec and context: median (min, max) over rounds of each run's median ms/token; prefill likewise."""
    rows = []
    for spec in specs:
        mine = [r for r in runs if r.get("spec") == spec.text and "decode" in r]
        if not mine:
            failures = [r.get("error", "") for r in runs if r.get("spec") == spec.text]
            rows.append({"spec": spec.text, "label": spec.label, "error": failures[0] if failures else "not run"})
            continue
        contexts = sorted({int(c) for r in mine for c in r["decode"]})
        decode = {}
        for context in contexts:
            medians = [r["decode"][str(context)]["ms_per_token"]["median"] for r in mine if str(context) in r["decode"]]
            stats = summarize(medians)
            decode[str(context)] = {
                "ms_per_token": stats,
                "tokens_per_second": 1000 / stats["median"],
                "held_bytes": mine[0]["decode"][str(context)]["held_bytes"],
            }
        prefill = summarize([r["prefill"]["tokens_per_second"] for r in mine])
        rows.append({
            "spec": spec.text,
            "label": spec.label,
            "family": spec.family,
            "rounds": len(mine),
            "prefill_tokens_per_second": prefill,
            "prefill_tokens": mine[0]["prefill"]["tokens"],
            "decode": decode,
            "load_average": [r["load_average_before"] + r["load_average_after"] for r in mine],
        })
    return rows


def switch_times(snapshot: Path, targets: Sequence[CacheSpec], contexts: Sequence[int], repeats: int, dtype: mx.Dtype) -> dict[str, Any]:
    """Seconds to re-encode a held fp16 cache of each context into each target config (the live switch of
    ChatSession.set_compression: layer by layer, 1024 tokens at a time, no model call)."""
    from benchmarks.harness.memory import fill, load_kv_snapshot
    from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape, reencode_caches

    keys, values = load_kv_snapshot(snapshot)
    shape = ModelShape(n_layers=len(keys), n_heads=1, n_kv_heads=keys[0].shape[1], head_dim=keys[0].shape[-1])
    out: dict[str, Any] = {}
    for context in contexts:
        if context > keys[0].shape[-2]:
            continue
        source = KVCacheBuilder(KVCacheConfig("fp16")).for_shape(shape).build()
        fill(source, keys, values, 0, context, dtype)
        per_target = {}
        for spec in targets:
            config = KVCacheBuilder(spec.velox_config()).for_shape(shape).config  # validated, as the session does
            seconds = []
            for _ in range(repeats + 1):  # the first is a warm-up
                began = time.perf_counter()
                new = reencode_caches(source, config)
                mx.eval([cache.state for cache in new])
                seconds.append(time.perf_counter() - began)
                del new
            per_target[spec.text] = {"label": spec.label, "seconds": summarize(seconds[1:])}
        out[str(context)] = per_target
        del source
    return out
