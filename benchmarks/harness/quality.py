"""Quality through the compressed cache: teacher-forced perplexity/KL, needle in a haystack, greedy agreement.

Everything here runs inside one process on one loaded model; `benchmarks.harness.cli` spreads windows, trials and
prompts over worker processes (`benchmarks.harness.worker`) and combines what they return with the `combine_*`
functions below.

* Perplexity: each window of prose goes through every cache in chunks of 64 tokens (as prefill does), so
  each scored token attends over history the cache has already compressed; only the second half of the
  window is scored. Per cache: Δ mean NLL against fp16 on the same tokens with a batch-means standard
  error, the perplexity ratio exp(Δ), mean KL(fp16 ‖ cache) and top-1 agreement with fp16.
* Needle: a sentence "The special magic number for <city> is <7 digits>." is put at a depth of a prose
  haystack, and the question is asked at the end. Recall is exact greedy retrieval; because greedy decoding
  emits the answer exactly when every teacher-forced argmax along the answer is the answer's next token, it
  is read off the same forward pass that gives the teacher-forced log-probability of the answer.
* Agreement: greedy continuations of prose excerpts, compared token by token with fp16's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.harness.common import paired_difference
from benchmarks.harness.specs import CacheSpec

PREFILL_CHUNK = 512
NEEDLE_KEYS = (
    "Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hobart", "Winnipeg", "Marrakesh", "Reykjavik",
    "Valparaiso", "Bergen", "Cusco", "Adelaide", "Tbilisi", "Zanzibar", "Halifax",
)
REFERENCE = "fp16"


def _eval_caches(caches: list[Any]) -> None:
    mx.eval([getattr(cache, "state", cache) for cache in caches])


def prefill(model: Any, caches: list[Any], tokens: Sequence[int], chunk: int = PREFILL_CHUNK) -> None:
    """Run `tokens` into `caches` in chunks; only the caches are evaluated (the logits are never built)."""
    for start in range(0, len(tokens), chunk):
        model(mx.array(tokens[start : start + chunk])[None], cache=caches)
        _eval_caches(caches)


# ----- perplexity ---------------------------------------------------------------------------------------


def perplexity_window(
    model: Any, specs: Sequence[CacheSpec], tokens: list[int], chunk_tokens: int, score_from: int,
    tokenizer: Any = None,
) -> dict[str, dict[str, Any]]:
    """Per-token NLL, KL and top-1 agreement of every spec on one window (lists, for combining)."""
    from engine.kvcache.evaluate import teacher_forced_token_stats

    factories = {spec.text: spec.factory(model, tokenizer) for spec in specs}
    stats = teacher_forced_token_stats(model, tokens, factories, REFERENCE, chunk_tokens, score_from)
    return {
        name: {
            "nll": s.nll.tolist(),
            "kl": s.kl.tolist(),
            "top1": s.top1_agrees.astype(np.int8).tolist(),
            "seconds": s.seconds,
            "held_bytes": s.held_bytes,
            "tokens": len(tokens) - 1,  # the last token is only ever a target, never cached
        }
        for name, s in stats.items()
    }


def chunking_check(model: Any, specs: Sequence[CacheSpec], tokens: list[int], chunks: tuple[int, int] = (1, 64)) -> dict[str, Any]:
    """Score `tokens` with chunk sizes 1 and 64: for a cache whose stored values do not depend on how
    tokens arrive (fp16), the per-token NLLs must agree to float rounding. Returns the largest gaps."""
    from engine.kvcache.evaluate import teacher_forced_token_stats

    out = {}
    for spec in specs:
        runs = [
            teacher_forced_token_stats(model, tokens, {REFERENCE: spec.factory(model)}, REFERENCE, chunk)[REFERENCE]
            for chunk in chunks
        ]
        out[spec.text] = {
            "chunk_sizes": list(chunks),
            "tokens": len(tokens),
            "max_abs_nll_gap": float(np.max(np.abs(runs[0].nll - runs[1].nll))),
            "mean_nll": [float(run.nll.mean()) for run in runs],
        }
    return out


def combine_perplexity(
    windows: list[dict[str, dict[str, Any]]], specs: Sequence[CacheSpec], n_layers: int, n_kv_heads: int, head_dim: int
) -> list[dict[str, Any]]:
    """Pool the scored tokens of every window and compare each spec with fp16 on exactly those tokens."""
    from benchmarks.harness.common import effective_bits_from_bytes

    reference_nll = np.concatenate([np.asarray(w[REFERENCE]["nll"]) for w in windows])
    rows = []
    for spec in specs:
        if not all(spec.text in w for w in windows):
            continue
        nll = np.concatenate([np.asarray(w[spec.text]["nll"]) for w in windows])
        kl = np.concatenate([np.asarray(w[spec.text]["kl"]) for w in windows])
        top1 = np.concatenate([np.asarray(w[spec.text]["top1"]) for w in windows])
        delta = paired_difference(nll, reference_nll)
        # Bytes held at the end of a window (all windows have the same length), per cached value.
        held = [w[spec.text]["held_bytes"] for w in windows]
        n_tokens = windows[0][spec.text]["tokens"]
        rows.append({
            "spec": spec.text,
            "label": spec.label,
            "family": spec.family,
            "method": spec.method,
            "nominal_bits": spec.nominal_bits,
            "effective_bits": effective_bits_from_bytes(float(np.mean(held)), n_tokens, n_layers, n_kv_heads, head_dim),
            "held_bytes": int(np.mean(held)),
            "window_tokens": n_tokens,
            "scored_tokens": int(nll.size),
            "mean_nll": float(nll.mean()),
            "delta_nll": delta["mean"],
            "delta_nll_se": delta["se"],
            "se_blocks": delta["blocks"],
            "ppl_ratio": float(np.exp(delta["mean"])),
            "ppl": float(np.exp(nll.mean())),
            "mean_kl": float(kl.mean()),
            "top1_agreement": float(top1.mean()),
            "seconds": float(sum(w[spec.text]["seconds"] for w in windows)),
        })
    return rows


# ----- needle in a haystack ---------------------------------------------------------------------------------


def needle_prompt(
    tokenizer: Any, haystack: list[int], length: int, depth: float, seed: int
) -> tuple[list[int], list[int], dict[str, Any]]:
    """(prompt ids, answer ids, facts) for one trial: `length` prompt tokens with the needle at `depth`.

    The city and the number depend on `seed` only, so one seed's trials differ only in length and depth.
    The needle goes in just after the first sentence end at or past the depth (within 64 tokens)."""
    rng = np.random.default_rng(seed)
    key = NEEDLE_KEYS[int(rng.integers(len(NEEDLE_KEYS)))]
    number = str(int(rng.integers(1_000_000, 10_000_000)))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    needle = encode(f"\nThe special magic number for {key} is {number}.\n")
    question = encode(
        f"\n\nQuestion: What is the special magic number for {key} mentioned in the text above?\n"
        f"Answer: The special magic number for {key} is"
    )
    answer = encode(f" {number}")
    n_hay = length - len(needle) - len(question)
    if n_hay <= 0 or n_hay > len(haystack):
        raise ValueError(f"A {length}-token needle prompt does not fit this haystack.")
    hay = haystack[:n_hay]
    position = min(n_hay, round(depth * n_hay))
    if 0 < position < n_hay:
        pieces = tokenizer.convert_ids_to_tokens(hay[position : position + 64])
        for offset, piece in enumerate(pieces):
            if "." in piece:
                position = min(n_hay, position + offset + 1)
                break
    prompt = hay[:position] + needle + hay[position:] + question
    facts = {"key": key, "number": number, "needle_token": position, "answer_tokens": len(answer)}
    return prompt, answer, facts


def needle_trial(
    model: Any, factories: dict[str, Callable[[], list[Any]]], prompt: list[int], answer: list[int]
) -> dict[str, dict[str, Any]]:
    """Teacher-forced answer log-probability and exact greedy recall of every cache on one prompt."""
    out = {}
    targets = mx.array(answer)
    for name, factory in factories.items():
        began = time.perf_counter()
        caches = factory()
        try:
            prefill(model, caches, prompt[:-1])
            logits = model(mx.array([prompt[-1], *answer[:-1]])[None], cache=caches)[0].astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
            exact = mx.all(mx.argmax(logprobs, axis=-1) == targets)
            first_rank = (logprobs[0] > picked[0]).sum()  # 0 when the answer's first token is the argmax
            mx.eval(picked, exact, first_rank)
        except RuntimeError as error:  # e.g. a kernel MLX lacks on this backend: recorded, not fatal
            out[name] = {"error": str(error).splitlines()[0][:300]}
            del caches
            continue
        out[name] = {
            "answer_logprob": float(picked.sum().item()),
            "exact": bool(exact.item()),
            "first_token_rank": int(first_rank.item()),
            "seconds": time.perf_counter() - began,
        }
        del caches
    return out


def combine_needle(trials: list[dict[str, Any]], specs: Sequence[CacheSpec]) -> dict[str, Any]:
    """Recall and answer log-probability per spec, overall and per length and depth, with the paired
    difference of log-probabilities against fp16 (trials as the units)."""
    summary = []
    failures = {}
    for spec in specs:
        failed = [t for t in trials if "error" in t["results"].get(spec.text, {})]
        if failed:
            failures[spec.text] = {"trials": len(failed), "lengths": sorted({t["length"] for t in failed}),
                                   "error": failed[0]["results"][spec.text]["error"]}
        rows = [t for t in trials if spec.text in t["results"] and "error" not in t["results"][spec.text]
                and "error" not in t["results"].get(REFERENCE, {})]
        if not rows:
            continue
        logprob = np.array([t["results"][spec.text]["answer_logprob"] for t in rows])
        reference = np.array([t["results"][REFERENCE]["answer_logprob"] for t in rows])
        exact = np.array([t["results"][spec.text]["exact"] for t in rows], dtype=float)
        diff = paired_difference(logprob, reference, block=1)
        by_length = {}
        for length in sorted({t["length"] for t in rows}):
            chosen = [t for t in rows if t["length"] == length]
            by_length[str(length)] = {
                "recall": float(np.mean([t["results"][spec.text]["exact"] for t in chosen])),
                "answer_logprob": float(np.mean([t["results"][spec.text]["answer_logprob"] for t in chosen])),
                "trials": len(chosen),
            }
        by_depth = {}
        for depth in sorted({t["depth"] for t in rows}):
            chosen = [t for t in rows if t["depth"] == depth]
            by_depth[f"{depth:g}"] = {
                "recall": float(np.mean([t["results"][spec.text]["exact"] for t in chosen])),
                "answer_logprob": float(np.mean([t["results"][spec.text]["answer_logprob"] for t in chosen])),
                "trials": len(chosen),
            }
        summary.append({
            "spec": spec.text,
            "label": spec.label,
            "trials": len(rows),
            "recall": float(exact.mean()),
            "answer_logprob": float(logprob.mean()),
            "delta_logprob": diff["mean"],
            "delta_logprob_se": diff["se"],
            "by_length": by_length,
            "by_depth": by_depth,
        })
    return {"summary": summary, "failures": failures}


# ----- greedy agreement ---------------------------------------------------------------------------------------


def greedy_tokens(model: Any, caches: list[Any], prompt: list[int], n_tokens: int) -> list[int]:
    """Greedy continuation of `prompt` (the next token is fed back as an mx.array, never synced to Python)."""
    prefill(model, caches, prompt[:-1])
    token = mx.array(prompt[-1:])
    generated = []
    for _ in range(n_tokens):
        logits = model(token[None], cache=caches)[0, -1]
        token = mx.argmax(logits, axis=-1, keepdims=True)
        mx.async_eval(token)
        generated.append(token)
    return mx.concatenate(generated).tolist()


def agreement_prompts(
    model: Any, specs: Sequence[CacheSpec], prompts: list[list[int]], n_tokens: int, tokenizer: Any = None
) -> dict[str, list[list[int]]]:
    """Greedy continuations of every prompt under every cache."""
    out: dict[str, Any] = {}
    for spec in specs:
        factory = spec.factory(model, tokenizer)
        try:
            out[spec.text] = [greedy_tokens(model, factory(), prompt, n_tokens) for prompt in prompts]
        except RuntimeError as error:  # e.g. a kernel MLX lacks on this backend: recorded, not fatal
            out.setdefault("errors", {})[spec.text] = str(error).splitlines()[0][:300]
    return out


def combine_agreement(generations: dict[str, list[list[int]]], specs: Sequence[CacheSpec]) -> list[dict[str, Any]]:
    """Per spec: the share of positions before the first divergence from fp16 (match rate), the mean
    first divergence (in tokens), identical continuations, and position-wise token agreement."""
    reference = generations[REFERENCE]
    rows = []
    for spec in specs:
        if spec.text not in generations:
            continue
        divergences, identical, positionwise = [], [], []
        for mine, theirs in zip(generations[spec.text], reference, strict=True):
            n = min(len(mine), len(theirs))
            same = np.asarray(mine[:n]) == np.asarray(theirs[:n])
            first = int(np.argmin(same)) if not same.all() else n
            divergences.append(first / n)
            identical.append(first == n)
            positionwise.append(float(same.mean()))
        n_generated = len(reference[0]) if reference else 0
        rows.append({
            "spec": spec.text,
            "label": spec.label,
            "prompts": len(divergences),
            "generated_tokens": n_generated,
            "match_rate": float(np.mean(divergences)),
            # per prompt, in the prompts' order, so two caches' match rates can be compared prompt by prompt
            "match_by_prompt": [float(d) for d in divergences],
            "mean_first_divergence": float(np.mean(divergences) * n_generated),
            "identical": float(np.mean(identical)),
            "positionwise_agreement": float(np.mean(positionwise)),
        })
    return rows
