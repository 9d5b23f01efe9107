"""Worker processes: `python -m benchmarks.harness.worker TASK ARGS.json OUT.json` runs one task in a fresh
process and writes its result as JSON. `run_tasks` starts them (up to `jobs` at a time) and collects results.

A fresh process per task keeps measurements independent (MLX's compiled graphs and allocator state) and
lets the same code run under another interpreter: the veloxquant-mlx peer runs these tasks in its own venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

STDERR_TAIL_CHARS = 3000


def engine_pythonpath() -> str:
    """A folder holding only a link to this `engine` package, for interpreters of other venvs (they must
    not see this venv's site-packages)."""
    import engine

    folder = Path(tempfile.gettempdir()) / f"velox-bench-{os.getuid()}" / "pythonpath"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "engine"
    target = Path(engine.__file__).resolve().parent
    if not link.is_symlink() or link.resolve() != target:
        # Made aside and renamed over the link: workers started together (--jobs) each may get here at once.
        aside = folder / f"engine.{os.getpid()}.{threading.get_ident()}"
        aside.unlink(missing_ok=True)
        aside.symlink_to(target, target_is_directory=True)
        os.replace(aside, link)
    return str(folder)


def run_task(task: str, args: dict[str, Any], python: str | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Run one task in a fresh process; the result dict, or {"error": ...} with the end of its stderr."""
    python = python or sys.executable
    env = dict(os.environ)
    if python != sys.executable:
        env["PYTHONPATH"] = engine_pythonpath()
    else:
        env["PYTHONPATH"] = os.pathsep.join([engine_pythonpath(), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="velox-bench-") as tmp:
        args_path, out_path = Path(tmp) / "args.json", Path(tmp) / "out.json"
        args_path.write_text(json.dumps(args), encoding="utf-8")
        began = time.perf_counter()
        try:
            done = subprocess.run(
                [python, "-m", "benchmarks.harness.worker", task, str(args_path), str(out_path)],
                env=env, capture_output=True, text=True, timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"{task} did not finish within {timeout:.0f} s"}
        except OSError as error:
            return {"error": f"could not start {python}: {error}"}
        if done.returncode != 0 or not out_path.is_file():
            return {"error": f"{task} failed (exit {done.returncode}): {done.stderr[-STDERR_TAIL_CHARS:].strip()}"}
        result = json.loads(out_path.read_text(encoding="utf-8"))
        result.setdefault("worker_seconds", time.perf_counter() - began)
        return result


def run_tasks(tasks: list[tuple[str, dict[str, Any], str | None]], jobs: int = 1) -> list[dict[str, Any]]:
    """Run (task, args, python) tuples, `jobs` at a time; results in the order given."""
    if jobs <= 1:
        return [run_task(*task) for task in tasks]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda task: run_task(*task), tasks))


# ----- inside the worker ---------------------------------------------------------------------------------------


def _load_model(path: str) -> Any:
    from engine.models.catalog import load_model

    model, tokenizer, _ = load_model(path)
    return model, tokenizer


def _task_snapshot(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.harness.memory import make_kv_snapshot

    model, _ = _load_model(args["model"])
    path = make_kv_snapshot(model, args["tokens"], Path(args["path"]))
    return {"path": str(path), "tokens": len(args["tokens"])}


def _task_perplexity(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.harness.quality import chunking_check, perplexity_window
    from benchmarks.harness.specs import parse_specs

    model, tokenizer = _load_model(args["model"])
    specs = parse_specs(args["specs"])
    result: dict[str, Any] = {
        "window": perplexity_window(model, specs, args["tokens"], args["chunk"], args["score_from"], tokenizer)
    }
    if args.get("check_specs"):
        result["chunking_check"] = chunking_check(model, parse_specs(args["check_specs"]), args["check_tokens"])
    return result


def _task_needle(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.harness.quality import needle_prompt, needle_trial
    from benchmarks.harness.specs import parse_specs

    model, tokenizer = _load_model(args["model"])
    factories = {spec.text: spec.factory(model, tokenizer) for spec in parse_specs(args["specs"])}
    trials = []
    for trial in args["trials"]:
        prompt, answer, facts = needle_prompt(tokenizer, trial["haystack"], trial["length"], trial["depth"], trial["seed"])
        results = needle_trial(model, factories, prompt, answer)
        trials.append({key: trial[key] for key in ("length", "depth", "seed", "text")} | {"facts": facts, "results": results})
    return {"trials": trials}


def _task_agreement(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.harness.quality import agreement_prompts
    from benchmarks.harness.specs import parse_specs

    model, tokenizer = _load_model(args["model"])
    return {"generations": agreement_prompts(model, parse_specs(args["specs"]), args["prompts"], args["n_tokens"],
                                             tokenizer)}


def _task_memory_model(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.harness.memory import model_memory
    from benchmarks.harness.specs import parse_specs

    return model_memory(parse_specs(args["specs"]), Path(args["snapshot"]), args["checkpoints"])


def _task_memory_large(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.harness.memory import large_shape_memory
    from benchmarks.harness.specs import parse_specs

    return large_shape_memory(parse_specs(args["specs"]), args["checkpoints"])


def _task_speed(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.harness.specs import parse_spec
    from benchmarks.harness.speed import speed_run

    model, _ = _load_model(args["model"])
    return speed_run(model, parse_spec(args["spec"]), args["prose"], Path(args["snapshot"]), args["contexts"],
                     args["prefill_tokens"], args["warmup_steps"], args["timed_steps"])


def _task_switch(args: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    from benchmarks.harness.specs import parse_specs
    from benchmarks.harness.speed import switch_times

    return {"switch": switch_times(Path(args["snapshot"]), parse_specs(args["targets"]), args["contexts"],
                                   args["repeats"], mx.float32)}


def _task_environment(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.harness.common import machine_info

    info = machine_info()
    for name in args.get("packages", []):
        try:
            from importlib.metadata import version

            info[f"package:{name}"] = version(name)
        except Exception as error:  # the record says why instead of failing
            info[f"package:{name}"] = f"not installed ({type(error).__name__})"
    return info


TASKS = {
    "snapshot": _task_snapshot,
    "perplexity": _task_perplexity,
    "needle": _task_needle,
    "agreement": _task_agreement,
    "memory_model": _task_memory_model,
    "memory_large": _task_memory_large,
    "speed": _task_speed,
    "switch": _task_switch,
    "environment": _task_environment,
}


def main(argv: list[str]) -> int:
    task, args_path, out_path = argv
    from engine.runtime import prepare_runtime

    prepare_runtime()  # before MLX is first imported: the Linux CPU fast path
    args = json.loads(Path(args_path).read_text(encoding="utf-8"))
    result = TASKS[task](args)
    Path(out_path).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
