"""`velox bench` command line: quality | memory | speed | all | report | decode.

    velox bench quality [--quick] [--out DIR] [--parts perplexity,needle,agreement] [--jobs N]
    velox bench memory  [--quick] [--out DIR]
    velox bench speed   [--quick] [--out DIR]
    velox bench all     [--quick] [--out DIR]      (quality, memory, speed, then the report)
    velox bench report  [--out DIR] [--markdown PATH] [--figures DIR]
    velox bench decode  --out FILE [decode's own options: velox bench decode --help]

Results go to DIR (default: benchmarks/results of the checkout) as one JSON per kind (`quality.json`,
`quality-quick.json`, ...). The report (BENCHMARKS.md and PNG figures) is generated from those files only;
it prefers full runs and falls back to quick ones. `decode` is benchmarks/decode.py (whole-model decode of an
8B-shaped model, meant for a GPU) with its own options and output file. Module-level imports stay free of MLX,
because the CLI builds its parser before the CPU fast path is prepared.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.harness import specs as spec_lists
from benchmarks.harness.common import (
    DATA_DIR_ENV,
    PROSE_FILES,
    ROOT,
    default_out_dir,
    in_checkout,
    log,
    machine_info,
    now,
    prose_paths,
    read_result,
    windows,
    write_result,
)
from benchmarks.harness.levels import level_specs
from engine.errors import VeloxError


class BenchmarkError(VeloxError):
    """A benchmark step failed (its worker's error is in the message)."""


KINDS = ("quality", "memory", "speed", "all", "report", "decode")
QUALITY_PARTS = ("perplexity", "needle", "agreement")


# How far the fp16 reference's mean NLL may move between an earlier run and an `--add` run (nats/token).
FP16_REFERENCE_TOLERANCE = 1e-4


def reference_nll(rows: list[dict[str, Any]]) -> float:
    """The fp16 reference's mean NLL of a perplexity run: its fp16 row, or else what every row's paired
    difference implies (mean_nll - delta_nll; runs may keep no fp16 row). BenchmarkError when the run has no
    rows, or rows that disagree on their reference (they were not measured on the same tokens)."""
    for row in rows:
        if row["spec"] == "fp16":
            return float(row["mean_nll"])
    implied = [float(row["mean_nll"]) - float(row["delta_nll"]) for row in rows if row.get("family") == "velox"]
    if not implied:
        raise BenchmarkError("The earlier perplexity run has no fp16 row and no Velox rows to read its reference "
                             "from; rerun the whole sweep instead of --add.")
    if max(implied) - min(implied) > FP16_REFERENCE_TOLERANCE:
        raise BenchmarkError(f"The earlier perplexity run's rows imply different fp16 references "
                             f"({min(implied):.6f} to {max(implied):.6f}); rerun the whole sweep instead of --add.")
    return sum(implied) / len(implied)


@dataclass
class Plan:
    """Every size knob of a run; `quick()` is the under-20-minutes version of the full one."""

    quick: bool = False
    # perplexity
    window: int = 4096
    windows_per_text: int = 1
    chunk: int = 64
    check_tokens: int = 192
    # fp32 storage must agree across chunk sizes to float rounding; fp16 storage re-rounds K/V, so tiny
    # upstream differences between the one-token and the chunked GEMM paths flip some fp16 roundings.
    check_specs: tuple[str, ...] = ("fp32", "fp16", "affine:k4v4:g64")
    quality_specs: tuple[str, ...] = spec_lists.QUALITY_SPECS
    # needle
    needle_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    needle_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    needle_seeds: tuple[int, ...] = (0, 1)
    # agreement
    agreement_prompts: int = 16
    agreement_prompt_tokens: int = 512
    agreement_new_tokens: int = 48
    # memory
    memory_specs: tuple[str, ...] = spec_lists.MEMORY_SPECS
    memory_checkpoints: tuple[int, ...] = (1024, 2048, 4096, 8192)
    large_checkpoints: tuple[int, ...] = (4096, 8192, 16384, 32768)
    # speed
    speed_specs: tuple[str, ...] = spec_lists.SPEED_SPECS
    contexts: tuple[int, ...] = (1024, 2048, 4096, 8192)
    rounds: int = 3
    warmup_steps: int = 4
    timed_steps: int = 24
    prefill_tokens: int = 2048
    switch_contexts: tuple[int, ...] = (2048, 8192)
    switch_repeats: int = 3
    # peers
    veloxquant_specs: tuple[str, ...] = spec_lists.VELOXQUANT_SPECS
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick_plan(cls) -> Plan:
        return cls(
            quick=True, window=1024, windows_per_text=1, check_tokens=96, check_specs=("fp32", "fp16"),
            quality_specs=spec_lists.QUALITY_SPECS_QUICK, needle_lengths=(1024,), needle_depths=(0.0, 0.5, 1.0),
            needle_seeds=(0,), agreement_prompts=4, agreement_prompt_tokens=256, agreement_new_tokens=24,
            memory_specs=spec_lists.MEMORY_SPECS_QUICK, memory_checkpoints=(1024, 2048),
            large_checkpoints=(4096, 8192), speed_specs=spec_lists.SPEED_SPECS_QUICK, contexts=(1024, 2048),
            rounds=1, warmup_steps=2, timed_steps=12, prefill_tokens=1024, switch_contexts=(2048,),
            switch_repeats=1, veloxquant_specs=spec_lists.VELOXQUANT_SPECS_QUICK,
        )

    @property
    def snapshot_tokens(self) -> int:
        return max(max(self.memory_checkpoints), max(self.contexts), max(self.switch_contexts))


# ----- shared set-up ----------------------------------------------------------------------------------------

def _weights_note() -> str:
    """How engine.models.catalog.load_model holds the weights on this machine (recorded beside every run)."""
    import mlx.core as mx

    from engine.runtime.cpu.weights import prefer_fp32_weights

    if prefer_fp32_weights():
        return "weights dequantized to fp32 on the Linux CPU (engine.models.catalog.load_model)"
    if mx.default_device() == mx.gpu:
        return "quantized weights as stored, other parameters in the model's declared 16-bit dtype (GPU)"
    return "quantized weights as stored, run by MLX's quantized kernels on the CPU (no fast BLAS)"


class Context:
    """What every sub-benchmark needs: the plan, where to write, the model, its tokenizer, prose tokens."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.plan = Plan.quick_plan() if args.quick else Plan()
        if getattr(args, "rounds", None):
            self.plan = replace(self.plan, rounds=args.rounds)
        # A denser needle grid, so a recall difference the level rule acts on can clear its standard error.
        if getattr(args, "needle_seeds", None):
            self.plan = replace(self.plan, needle_seeds=tuple(range(args.needle_seeds)))
        if getattr(args, "needle_lengths", None):
            self.plan = replace(self.plan, needle_lengths=tuple(int(n) for n in args.needle_lengths.split(",")))
        self.out = Path(args.out) if args.out else default_out_dir()
        self.jobs = max(1, args.jobs)
        self._model_path: str | None = args.model
        self._tokenizer: Any = None
        self._streams: dict[str, list[int]] | None = None
        self._shape: dict[str, int] | None = None
        self._peer: tuple[str | None, str] | None = None

    @property
    def model_path(self) -> str:
        if self._model_path is None:
            from engine.models.catalog import resolve_model

            self._model_path = str(resolve_model(None))
        return self._model_path

    def model_record(self) -> dict[str, Any]:
        from engine.models.catalog import inspect_model_folder

        info = inspect_model_folder(self.model_path)
        return {
            "name": info.name, "path": self.model_path, "layers": info.layers, "attention_heads": info.attention_heads,
            "kv_heads": info.kv_heads, "head_dim": info.head_dim, "quantization": info.quantization,
            "note": _weights_note(),
        }

    @property
    def shape(self) -> dict[str, int]:
        if self._shape is None:
            record = self.model_record()
            self._shape = {k: record[k] for k in ("layers", "kv_heads", "head_dim")}
        return self._shape

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from mlx_lm.utils import load_tokenizer

            self._tokenizer = load_tokenizer(Path(self.model_path))
        return self._tokenizer

    @property
    def streams(self) -> dict[str, list[int]]:
        if self._streams is None:
            from benchmarks.harness.common import prose_token_streams

            paths = prose_paths(self.args.text or ())  # before loading anything: a missing file fails at once
            self._streams = prose_token_streams(self.tokenizer, paths)
        return self._streams

    def first_stream(self) -> list[int]:
        return next(iter(self.streams.values()))

    def peer_python(self) -> tuple[str | None, str]:
        """The veloxquant-mlx venv's python (created on first use), or None and why not."""
        if self.args.no_peers:
            return None, "peers skipped (--no-peers)"
        if self._peer is None:
            from benchmarks.harness.peers import ensure_veloxquant_venv

            self._peer = ensure_veloxquant_venv(self.args.peer_venv)
            log(f"peers: {self._peer[1]}")
        return self._peer

    def snapshot(self) -> Path:
        """The model's own keys/values of the first prose tokens (made once, in a worker, then reused)."""
        import hashlib
        import tempfile

        from benchmarks.harness.memory import kv_snapshot_path
        from benchmarks.harness.worker import run_task

        n_tokens = self.plan.snapshot_tokens
        stream = self.first_stream()
        start = len(stream) // 20
        tokens = stream[start : start + n_tokens]
        cache_dir = Path(tempfile.gettempdir()) / "velox-bench-kv"
        digest = hashlib.sha256(repr((self.model_path, tokens)).encode()).hexdigest()[:12]
        name = f"{Path(self.model_path).name}-{digest}"
        path = kv_snapshot_path(cache_dir, name, len(tokens))
        if not path.is_file():
            log(f"snapshot: prefilling {len(tokens)} tokens once to record the model's keys/values")
            result = run_task("snapshot", {"model": self.model_path, "tokens": tokens, "path": str(path)})
            if "error" in result:
                raise BenchmarkError(result["error"])
        return path

    def record(self, kind: str, payload: dict[str, Any]) -> Path:
        from benchmarks.harness.common import machine_info

        payload = {"machine": machine_info(), "model": self.model_record(), **payload}
        path = write_result(self.out, kind, self.plan.quick, payload)
        log(f"wrote {path}")
        return path


# ----- quality ----------------------------------------------------------------------------------------------------


def run_quality(ctx: Context) -> dict[str, Any]:
    """The quality sweep: teacher-forced perplexity over windows of prose, needle recall and greedy agreement
    with fp16; `--parts` reruns some of them and keeps the others' earlier results."""
    from benchmarks.harness.specs import parse_specs

    parts = set(ctx.args.parts.split(",")) if ctx.args.parts else set(QUALITY_PARTS)
    if ctx.args.add:
        # --add joins rows to the perplexity sweep; the needle and agreement parts would be rerun for the named
        # specs alone and replace the committed runs of every level (made on a GPU), so they are refused.
        if ctx.args.parts and parts - {"perplexity"}:
            raise BenchmarkError("--add adds perplexity rows only; rerun needle or agreement without --add.")
        parts = {"perplexity"}
    previous = read_result(ctx.out, "quality", prefer_full=not ctx.plan.quick) or {}
    if previous.get("quick") != ctx.plan.quick:
        previous = {}
    payload: dict[str, Any] = {key: previous[key] for key in QUALITY_PARTS + ("chunking_check",) if key in previous}
    began = time.perf_counter()
    if "perplexity" in parts:
        payload.update(_quality_perplexity(ctx, payload.get("perplexity")))
    follow_specs = parse_specs(ctx.args.specs or ["fp16", *level_specs(), "mlx-q:k4v4"])
    if "needle" in parts:
        payload["needle"] = _quality_needle(ctx, follow_specs)
    if "agreement" in parts:
        payload["agreement"] = _quality_agreement(ctx, follow_specs)
    if ctx.args.add:
        # The file stays the earlier run's (its time, machine and load describe most rows); the added run is
        # recorded under perplexity.additions.
        payload.update({key: previous[key] for key in ("created", "machine", "seconds") if key in previous})
    else:
        payload["seconds"] = time.perf_counter() - began
    ctx.record("quality", payload)
    return payload


def _quality_perplexity(ctx: Context, previous_ppl: dict[str, Any] | None) -> dict[str, Any]:
    """{'perplexity': ...} (and 'chunking_check' for a whole run): Δ NLL of every cache against fp16 on the
    same windows; with --add, the new rows join an earlier run made on exactly the same windows."""
    from benchmarks.harness.quality import combine_perplexity
    from benchmarks.harness.specs import parse_spec, parse_specs, read_result_spec, same_cache, with_extra
    from benchmarks.harness.worker import run_tasks

    plan = ctx.plan
    payload: dict[str, Any] = {}
    specs = parse_specs(ctx.args.specs or plan.quality_specs)
    chosen = windows(ctx.streams, plan.window, plan.windows_per_text)
    score_from = plan.window // 2
    settings = {"window": plan.window, "score_from": score_from, "chunk": plan.chunk,
                "windows": [{"text": n, "start": s, "tokens": len(t)} for n, s, t in chosen],
                "se": "batch means over blocks of 64 scored tokens, paired with fp16 on the same tokens"}
    if ctx.args.add:
        # Add (or replace) rows of an earlier run on exactly the same windows; fp16 is rerun as the
        # reference (deterministic, so it reproduces the earlier reference).
        if not previous_ppl or previous_ppl["settings"] != settings:
            raise BenchmarkError("--add needs an earlier perplexity run with the same windows and settings.")
        specs = with_extra(parse_specs("fp16"), specs)
    log(f"quality: {len(specs)} caches x {len(chosen)} windows of {plan.window} tokens "
        f"(second half scored, chunks of {plan.chunk})")
    common = {"model": ctx.model_path, "chunk": plan.chunk, "score_from": score_from}
    tasks = []
    for index, (_, _, tokens) in enumerate(chosen):
        args = {**common, "specs": [s.text for s in specs], "tokens": tokens}
        if index == 0 and not ctx.args.add:
            args |= {"check_specs": list(plan.check_specs), "check_tokens": tokens[: plan.check_tokens]}
        tasks.append(("perplexity", args, None))
    peer_python, peer_note = (None, "") if ctx.args.add else ctx.peer_python()
    peer_specs = parse_specs(plan.veloxquant_specs) if peer_python else []
    for _, _, tokens in chosen if peer_python else []:
        tasks.append(("perplexity", {**common, "specs": ["fp16", *plan.veloxquant_specs], "tokens": tokens},
                      peer_python))
    results = run_tasks(tasks, ctx.jobs)
    failures = [r["error"] for r in results if "error" in r]
    ours = [r["window"] for r in results[: len(chosen)] if "window" in r]
    if len(ours) != len(chosen):
        raise BenchmarkError(f"quality windows failed: {failures}")
    rows = combine_perplexity(ours, specs, ctx.shape["layers"], ctx.shape["kv_heads"], ctx.shape["head_dim"])
    peer_windows = [r["window"] for r in results[len(chosen) :] if "window" in r]
    peer_rows = []
    if peer_windows and len(peer_windows) == len(chosen):
        peer_rows = combine_perplexity(peer_windows, [parse_specs("fp16")[0], *peer_specs], ctx.shape["layers"],
                                       ctx.shape["kv_heads"], ctx.shape["head_dim"])
        # The peer ran its own fp16 reference in its own venv: it must match ours token for token.
        ours_fp16 = next(r for r in rows if r["spec"] == "fp16")["mean_nll"]
        theirs_fp16 = next(r for r in peer_rows if r["spec"] == "fp16")["mean_nll"]
        peer_note += f"; fp16 mean NLL here {ours_fp16:.6f}, in the peer venv {theirs_fp16:.6f}"
        peer_rows = [r for r in peer_rows if r["spec"] != "fp16"]
    elif peer_python:
        peer_note += f"; the peer's quality run failed: {failures[-1] if failures else 'unknown'}"
    if ctx.args.add:
        assert previous_ppl is not None
        old_fp16 = reference_nll(previous_ppl["rows"])
        new_fp16 = reference_nll(rows)
        # Each row's Δ is paired with the fp16 reference of its own run; across runs the reference may move
        # by float rounding only (e.g. a faster softmax), far below any row's standard error.
        if abs(old_fp16 - new_fp16) > FP16_REFERENCE_TOLERANCE:
            raise BenchmarkError(f"The fp16 reference moved ({old_fp16} -> {new_fp16}); rerun the whole sweep.")
        # The earlier rows may name their caches in the old spec syntax: compare the caches, not the text.
        if not any(r["spec"] == "fp16" for r in previous_ppl["rows"]):
            rows = [r for r in rows if r["spec"] != "fp16"]  # the reference row only where the run kept one
        added = [parse_spec(r["spec"]) for r in rows]
        addition = {"created": now(), "machine": machine_info(), "specs": [r["spec"] for r in rows]}
        rows = [r for r in previous_ppl["rows"]
                if not any(same_cache(read_result_spec(r["spec"]), spec) for spec in added)] + rows
        payload["perplexity"] = {**previous_ppl, "rows": rows,
                                 "additions": [*previous_ppl.get("additions", []), addition]}
    else:
        payload["perplexity"] = {"settings": settings, "rows": rows + peer_rows, "peer_note": peer_note}
        payload["chunking_check"] = results[0].get("chunking_check", {})
    return payload


def _quality_needle(ctx: Context, follow_specs: list[Any]) -> dict[str, Any]:
    """Recall of a fact hidden at several depths in several lengths of prose, per cache."""
    from benchmarks.harness.quality import REFERENCE, combine_needle
    from benchmarks.harness.worker import run_tasks

    if REFERENCE not in [s.text for s in follow_specs]:
        # Checked before the trials (minutes each on a GPU): recall is reported against the 16-bit cache's own trials.
        raise BenchmarkError(f"The needle grid needs {REFERENCE!r} among the specs: recall is reported against it.")
    plan = ctx.plan
    texts = list(ctx.streams.items())
    trials = []
    for seed in plan.needle_seeds:
        name, stream = texts[seed % len(texts)]
        start = len(stream) // 20 + seed * 9973 % max(1, len(stream) // 2)
        haystack = stream[start : start + max(plan.needle_lengths)]
        for length in plan.needle_lengths:
            for depth in plan.needle_depths:
                trials.append({"length": length, "depth": depth, "seed": seed, "text": name, "haystack": haystack})
    # Balance the work: longest trials first, dealt round-robin to `jobs` workers.
    trials.sort(key=lambda t: -t["length"])
    shards = [trials[i :: ctx.jobs] for i in range(ctx.jobs)]
    log(f"needle: {len(trials)} trials x {len(follow_specs)} caches over {ctx.jobs} worker(s)")
    results = run_tasks([("needle", {"model": ctx.model_path, "specs": [s.text for s in follow_specs],
                                     "trials": shard}, None) for shard in shards if shard], ctx.jobs)
    failures = [r["error"] for r in results if "error" in r]
    if failures:
        raise BenchmarkError(f"needle trials failed: {failures}")
    done = [t for r in results for t in r["trials"]]
    return {
        "settings": {"lengths": list(plan.needle_lengths), "depths": list(plan.needle_depths),
                     "seeds": list(plan.needle_seeds), "prefill_chunk": 512,
                     "recall": "exact greedy answer (every teacher-forced argmax along the answer is right)"},
        **combine_needle(done, follow_specs),
        "trials": done,
    }


def _quality_agreement(ctx: Context, follow_specs: list[Any]) -> dict[str, Any]:
    """How long each cache's greedy continuation of a prose prompt stays equal to fp16's."""
    from benchmarks.harness.quality import combine_agreement
    from benchmarks.harness.worker import run_tasks

    plan = ctx.plan
    prompts = []
    texts = list(ctx.streams.values())
    for index in range(plan.agreement_prompts):
        stream = texts[index % len(texts)]
        start = len(stream) // 10 + (index // len(texts)) * 1511
        prompts.append(stream[start : start + plan.agreement_prompt_tokens])
    shards = [prompts[i :: ctx.jobs] for i in range(ctx.jobs)]
    log(f"agreement: {len(prompts)} prompts x {len(follow_specs)} caches, {plan.agreement_new_tokens} greedy tokens")
    results = run_tasks([("agreement", {"model": ctx.model_path, "specs": [s.text for s in follow_specs],
                                        "prompts": shard, "n_tokens": plan.agreement_new_tokens}, None)
                         for shard in shards if shard], ctx.jobs)
    failures = [r["error"] for r in results if "error" in r]
    if failures:
        raise BenchmarkError(f"agreement failed: {failures}")
    errors = {name: message for r in results for name, message in r["generations"].get("errors", {}).items()}
    generations = {s.text: [g for r in results for g in r["generations"][s.text]] for s in follow_specs
                   if s.text not in errors}
    return {
        "failures": errors,
        "settings": {"prompts": len(prompts), "prompt_tokens": plan.agreement_prompt_tokens,
                     "new_tokens": plan.agreement_new_tokens,
                     "match_rate": "tokens before the first divergence from fp16 / tokens generated, averaged"},
        "rows": combine_agreement(generations, follow_specs),
    }


# ----- memory ------------------------------------------------------------------------------------------------------


def run_memory(ctx: Context) -> dict[str, Any]:
    from benchmarks.harness.worker import run_task

    plan = ctx.plan
    snapshot = ctx.snapshot()
    specs = list(ctx.args.specs.split(",")) if ctx.args.specs else list(plan.memory_specs)
    log(f"memory: {len(specs)} caches on the model's keys/values at {list(plan.memory_checkpoints)} tokens")
    model_part = run_task("memory_model", {"specs": specs, "snapshot": str(snapshot),
                                           "checkpoints": list(plan.memory_checkpoints)})
    log(f"memory: {len(specs)} caches on random 8B-shaped layers at {list(plan.large_checkpoints)} tokens")
    large_part = run_task("memory_large", {"specs": specs, "checkpoints": list(plan.large_checkpoints)})
    peer_python, peer_note = ctx.peer_python()
    peers: dict[str, Any] = {"note": peer_note}
    if peer_python:
        peer_specs = list(plan.veloxquant_specs)
        peers["model"] = run_task("memory_model", {"specs": peer_specs, "snapshot": str(snapshot),
                                                   "checkpoints": list(plan.memory_checkpoints)}, peer_python)
        peers["large"] = run_task("memory_large", {"specs": peer_specs, "checkpoints": list(plan.large_checkpoints)},
                                  peer_python)
    for part in (model_part, large_part):
        if "error" in part:
            raise BenchmarkError(part["error"])
    payload = {"model_kv": model_part, "large_shapes": large_part, "peers": peers}
    ctx.record("memory", payload)
    return payload


# ----- speed --------------------------------------------------------------------------------------------------------


def run_speed(ctx: Context) -> dict[str, Any]:
    from benchmarks.harness.common import load_average
    from benchmarks.harness.specs import parse_specs, with_extra
    from benchmarks.harness.speed import combine_speed
    from benchmarks.harness.worker import run_task

    plan = ctx.plan
    snapshot = ctx.snapshot()
    specs = parse_specs(ctx.args.specs or plan.speed_specs)
    if not ctx.args.specs:  # every level of the app's slider is timed, whatever the default list holds
        specs = with_extra(specs, parse_specs(level_specs()))
    peer_python, peer_note = ctx.peer_python()
    peer_specs = parse_specs(plan.veloxquant_specs) if peer_python else []
    everyone = specs + peer_specs
    prose = ctx.first_stream()[len(ctx.first_stream()) // 20 :][: max(plan.prefill_tokens, max(plan.contexts)) + 1]
    common = {"model": ctx.model_path, "prose": prose, "snapshot": str(snapshot), "contexts": list(plan.contexts),
              "prefill_tokens": plan.prefill_tokens, "warmup_steps": plan.warmup_steps, "timed_steps": plan.timed_steps}
    runs = []
    log(f"speed: {len(everyone)} caches x {plan.rounds} round(s), contexts {list(plan.contexts)}, "
        f"one subprocess each, load average now {load_average()}")
    for round_index in range(plan.rounds):
        # Rotate the order each round so no config always runs first (or right after a heavy one).
        shift = round_index * max(1, len(everyone) // max(plan.rounds, 1))
        order = everyone[shift:] + everyone[:shift]
        for spec in order:
            python = peer_python if spec.family == "veloxquant" else None
            result = run_task("speed", {**common, "spec": spec.text}, python)
            result.setdefault("spec", spec.text)
            result["round"] = round_index
            runs.append(result)
            status = result.get("error", "")[:200] or ", ".join(
                f"{c}: {v['ms_per_token']['median']:.1f} ms" for c, v in result["decode"].items())
            log(f"  round {round_index + 1} {spec.text}: {status}")
    targets = [s for s in specs if s.family == "velox" and s.method not in ("fp16", "fp32")]
    log(f"speed: live-switch re-encode into {len(targets)} configs at {list(plan.switch_contexts)} tokens")
    switch = run_task("switch", {"snapshot": str(snapshot), "targets": [s.text for s in targets],
                                 "contexts": list(plan.switch_contexts), "repeats": plan.switch_repeats})
    payload = {
        "settings": {"contexts": list(plan.contexts), "rounds": plan.rounds, "warmup_steps": plan.warmup_steps,
                     "timed_steps": plan.timed_steps, "prefill_tokens": plan.prefill_tokens, "prefill_chunk": 512,
                     "note": ("each (config, round) in its own subprocess; rounds rotate the order; the machine "
                              "is shared with other jobs, so the load average is recorded with every run")},
        "rows": combine_speed(runs, everyone),
        "runs": [{k: v for k, v in r.items() if k != "samples_ms"} for r in runs],
        "switch": switch.get("switch", {}),
        "switch_error": switch.get("error"),
        "peer_note": peer_note,
    }
    ctx.record("speed", payload)
    return payload


# ----- report and entry points ---------------------------------------------------------------------------------------


def run_report(ctx: Context) -> None:
    from benchmarks.harness.report import write_report

    if ctx.args.markdown:
        markdown = Path(ctx.args.markdown)
    else:
        markdown = ROOT / "BENCHMARKS.md" if in_checkout() and ctx.out == default_out_dir() else ctx.out / "BENCHMARKS.md"
    if ctx.args.figures:
        figures = Path(ctx.args.figures)
    else:
        figures = ROOT / "docs" / "figures" if in_checkout() and ctx.out == default_out_dir() else ctx.out / "figures"
    written = write_report(ctx.out, markdown, figures)
    for path in written:
        log(f"wrote {path}")


KIND_HELP = {
    "quality": "perplexity against fp16, needle recall and greedy agreement of every cache",
    "memory": "bytes each cache holds, on the model's keys/values and on 8B-shaped layers",
    "speed": "decode speed of every cache on the default model (this machine's CPU or GPU)",
    "all": "quality, memory, speed, then the report",
    "report": "BENCHMARKS.md and its figures from the JSON results alone",
    "decode": "whole-model decode speed of an 8B-shaped model with every cache (benchmarks/decode.py, for a GPU)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One sub-command per kind: the harness's kinds share the options below; `decode` takes decode.py's own
    (its --out is a file and its --specs another syntax, so the two sets cannot share one parser)."""
    from benchmarks import decode  # MLX-free at import: only its options are needed here

    shared = argparse.ArgumentParser(add_help=False)
    _add_harness_arguments(shared)
    kinds = parser.add_subparsers(dest="what", metavar="{" + ",".join(KINDS) + "}", required=True,
                                  help="which benchmark to run")
    for kind in KINDS:
        if kind == "decode":
            decode.add_arguments(kinds.add_parser(kind, help=KIND_HELP[kind], description=decode.__doc__,
                                                  formatter_class=argparse.RawDescriptionHelpFormatter))
        else:
            kinds.add_parser(kind, parents=[shared], help=KIND_HELP[kind], description=KIND_HELP[kind] + ".")


def _add_harness_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the small version (velox bench all --quick: < 20 min)")
    parser.add_argument("--out", default=None, help="folder for the JSON results (default: benchmarks/results)")
    parser.add_argument("--model", default=None, help="mlx-lm model folder (default: the embedded default model)")
    parser.add_argument("--text", action="append", default=[],
                        help=f"prose file, repeatable (default: {' and '.join(PROSE_FILES)} in the folder "
                             f"${DATA_DIR_ENV} names, else, in a developer checkout, in ../shared/data)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes for the quality runs (timings always run one at a time)")
    parser.add_argument("--specs", default=None, help="comma-separated cache specs instead of the defaults")
    parser.add_argument("--parts", default=None, help=f"quality parts to run ({','.join(QUALITY_PARTS)})")
    parser.add_argument("--rounds", type=int, default=None, help="speed: rounds per config (default 3, quick 1)")
    parser.add_argument("--needle-seeds", type=int, default=None,
                        help="needle: seeds 0..N-1, 5 depths x each length per seed (default 2, quick 1)")
    parser.add_argument("--needle-lengths", default=None,
                        help="needle: comma-separated prompt lengths (default 1024,2048,4096,8192)")
    parser.add_argument("--no-peers", action="store_true", help="skip the veloxquant-mlx peer (no venv is made)")
    parser.add_argument("--peer-venv", default=None,
                        help="folder of the veloxquant-mlx peer's venv, made on first use (default: under the user "
                             "cache dir)")
    parser.add_argument("--add", action="store_true",
                        help="quality: add the --specs rows to an earlier perplexity run on the same windows")
    parser.add_argument("--markdown", default=None, help="report: where to write BENCHMARKS.md")
    parser.add_argument("--figures", default=None, help="report: folder for the PNG figures")


def run(args: argparse.Namespace) -> int:
    if args.what == "decode":
        from benchmarks import decode

        return decode.run(args)
    ctx = Context(args)
    began = time.perf_counter()
    if args.what in ("quality", "all"):
        run_quality(ctx)
    if args.what in ("memory", "all"):
        run_memory(ctx)
    if args.what in ("speed", "all"):
        run_speed(ctx)
    if args.what in ("report", "all"):
        run_report(ctx)
    log(f"velox bench {args.what}{' --quick' if args.quick else ''}: {time.perf_counter() - began:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="velox bench", description="Quality, memory and speed of the KV caches.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    from engine.runtime import prepare_runtime

    prepare_runtime()
    try:
        return run(args)
    except VeloxError as error:  # bad input (no prose, an unknown spec, ...): one line, as `velox bench` prints it
        print(f"error: {error}", file=sys.stderr)
        return 1
