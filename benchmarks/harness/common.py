"""Things every benchmark shares: where files are, the machine record, prose, JSON, and the statistics."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ConfigError

SCHEMA = "velox-bench/1"
# The repository root when running from a checkout (benchmarks/harness/common.py -> parents[2]).
ROOT = Path(__file__).resolve().parents[2]
PROSE_FILES = ("botchan.txt", "areopagitica.txt")
# The folder of PROSE_FILES: $VELOX_BENCH_DATA, else (only in a developer checkout, which sits beside the
# project's shared folder) CHECKOUT_DATA_DIR. `--text FILE` overrides both.
DATA_DIR_ENV = "VELOX_BENCH_DATA"
CHECKOUT_DATA_DIR = ROOT.parent / "shared" / "data"
# Paired differences are averaged in blocks of this many consecutive scored tokens before the standard
# error is taken: neighbouring tokens' errors are correlated, so a per-token SE would be too small.
SE_BLOCK_TOKENS = 64


def in_checkout() -> bool:
    return (ROOT / "pyproject.toml").is_file() and (ROOT / "engine").is_dir()


def default_out_dir() -> Path:
    """benchmarks/results of the checkout, or ./velox-bench when Velox runs from an installed package."""
    return ROOT / "benchmarks" / "results" if in_checkout() else Path.cwd() / "velox-bench"


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on every platform
        return []


def machine_info() -> dict[str, Any]:
    """Facts recorded with every run, so a number can be traced to the machine and code that made it."""
    import mlx.core as mx

    info: dict[str, Any] = {
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": load_average(),
        "mlx": getattr(mx, "__version__", "unknown"),
        "device": str(mx.default_device()),
    }
    try:
        import mlx_lm

        info["mlx_lm"] = getattr(mlx_lm, "__version__", "unknown")
    except ImportError:
        pass
    try:
        from engine.runtime.status import runtime_status

        info["cpu_fast_path"] = runtime_status().get("cpu fast path", "")
    except Exception as error:  # the record must not fail the run
        info["cpu_fast_path"] = f"unknown ({type(error).__name__})"
    try:
        import psutil

        info["memory_total_bytes"] = int(psutil.virtual_memory().total)
    except ImportError:
        pass
    info.update(git_state())
    return info


def git_state() -> dict[str, str]:
    """{"git_commit": short hash (+uncommitted)} of the checkout the harness runs from; when there is none,
    or git cannot say, an empty commit and `git_commit_missing` saying why (the run goes on)."""
    if not in_checkout():
        return {"git_commit": "", "git_commit_missing": f"not run from a source checkout ({ROOT})"}
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except FileNotFoundError:
        return {"git_commit": "", "git_commit_missing": "git is not installed"}
    except (OSError, subprocess.SubprocessError) as error:
        return {"git_commit": "", "git_commit_missing": f"git failed: {_last_line(error)}"}
    return {"git_commit": head + ("+uncommitted" if dirty else "")}


def _git(*args: str) -> str:
    """git's output in ROOT (CalledProcessError, with git's message, when it fails: e.g. not a repository)."""
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10, check=True)
    return done.stdout.strip()


def _last_line(error: BaseException) -> str:
    stderr = getattr(error, "stderr", None)
    text = stderr.strip() if isinstance(stderr, str) and stderr.strip() else str(error)
    return text.splitlines()[-1]


def now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def result_name(kind: str, quick: bool) -> str:
    return f"{kind}{'-quick' if quick else ''}.json"


def write_result(out_dir: Path, kind: str, quick: bool, payload: dict[str, Any]) -> Path:
    """Write one run's JSON (schema, kind, time and machine added) and return its path."""
    folder = _result_folder(out_dir, quick)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"schema": SCHEMA, "kind": kind, "quick": quick, "created": now(), **payload}
    path = folder / result_name(kind, quick)
    path.write_text(json.dumps(record, indent=1, default=_json_default) + "\n", encoding="utf-8")
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"Cannot write {type(value).__name__} to JSON.")


def _result_folder(out_dir: Path, quick: bool) -> Path:
    """Quick runs live in `quick/` under the results folder, so they never sit beside the full ones."""
    return out_dir / "quick" if quick else out_dir


def read_result(out_dir: Path, kind: str, prefer_full: bool = True) -> dict[str, Any] | None:
    """The full run's JSON of `kind` if present (else the quick one), or None."""
    order = (False, True) if prefer_full else (True, False)
    for quick in order:
        path = _result_folder(out_dir, quick) / result_name(kind, quick)
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
    return None


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----- prose ------------------------------------------------------------------------------------------


def prose_paths(text_paths: Sequence[str | Path] = ()) -> list[Path]:
    """The prose to benchmark on: the files given (--text), else PROSE_FILES in `prose_dir()`.
    ConfigError, in one line that says what to pass, when there is none."""
    if text_paths:
        paths = [Path(p).expanduser() for p in text_paths]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ConfigError(f"Benchmark prose not found: {', '.join(missing)}.")
        return paths
    folder, origin = prose_dir()
    if folder is None:
        raise ConfigError(f"No benchmark prose: pass --text FILE, or set {DATA_DIR_ENV} to a folder holding "
                          f"{' and '.join(PROSE_FILES)}.")
    paths = [folder / name for name in PROSE_FILES if (folder / name).is_file()]
    if not paths:
        raise ConfigError(f"No benchmark prose in {folder} ({origin}): it has neither {' nor '.join(PROSE_FILES)}; "
                          f"pass --text FILE, or set {DATA_DIR_ENV} to the folder that holds them.")
    log(f"prose: {', '.join(p.name for p in paths)} from {folder} ({origin})")
    return paths


def prose_dir() -> tuple[Path | None, str]:
    """The folder of the default prose and where that choice comes from; (None, '') outside a checkout
    without VELOX_BENCH_DATA."""
    configured = os.environ.get(DATA_DIR_ENV)
    if configured:
        return Path(configured).expanduser(), f"${DATA_DIR_ENV}"
    if in_checkout():
        return CHECKOUT_DATA_DIR, "a developer checkout's default, ../shared/data"
    return None, ""


def prose_token_streams(tokenizer: Any, paths: Sequence[Path]) -> dict[str, list[int]]:
    """Each text's token ids (no special tokens), keyed by file name."""
    streams = {}
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        streams[path.name] = list(tokenizer.encode(text, add_special_tokens=False))
    return streams


def windows(streams: dict[str, list[int]], length: int, per_text: int) -> list[tuple[str, int, list[int]]]:
    """`per_text` windows of `length` tokens from each text, evenly spaced after its first 5%
    (past licence headers and title pages): (text name, start, tokens)."""
    chosen = []
    for name, ids in streams.items():
        first = len(ids) // 20
        room = len(ids) - first - length
        if room < 0:
            continue
        for index in range(per_text):
            start = first + (room * index // max(per_text - 1, 1) if per_text > 1 else room // 2)
            chosen.append((name, start, ids[start : start + length]))
    return chosen


# ----- statistics ---------------------------------------------------------------------------------------


def paired_difference(values: np.ndarray, reference: np.ndarray, block: int = SE_BLOCK_TOKENS) -> dict[str, float]:
    """Mean of values - reference and its standard error from non-overlapping block means (batch means).

    With fewer than two whole blocks the per-token SE is returned instead (flagged by `blocks` = 0)."""
    diff = np.asarray(values, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    if diff.size == 0:
        raise ValueError("No paired values.")
    n_blocks = diff.size // block
    if n_blocks >= 2:
        means = diff[: n_blocks * block].reshape(n_blocks, block).mean(axis=1)
        se = float(means.std(ddof=1) / np.sqrt(n_blocks))
    else:
        se = float(diff.std(ddof=1) / np.sqrt(diff.size)) if diff.size > 1 else float("nan")
        n_blocks = 0
    return {"mean": float(diff.mean()), "se": se, "n": int(diff.size), "blocks": int(n_blocks)}


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes, where lower is better on both
    (x = bits per value, y = quality loss), sorted by x. Ties: the first of identical points is kept."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1], i))
    front: list[int] = []
    best_y = float("inf")
    for index in order:
        if points[index][1] < best_y:
            front.append(index)
            best_y = points[index][1]
    return front


def prompt_spans(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """Token spans [s, e) that feed tokens [start, end) into caches as mlx-lm's generate_step feeds a prompt: `chunk`
    tokens at a time, then the last token on its own. A compressed store grows room ahead for the next chunks while a
    prefill runs and gives it back at an update of one token (engine.kvcache.base.PREFILL_AHEAD_CHUNKS), so bytes read
    after these spans are what a cache holds while it decodes."""
    if end <= start:
        return []
    bounds = [*range(start, end - 1, chunk), end - 1, end]
    return list(zip(bounds, bounds[1:], strict=False))


def effective_bits_from_bytes(held_bytes: float, n_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int) -> float:
    """Bits per cached key/value element implied by the bytes a cache holds for `n_tokens` tokens."""
    values = n_tokens * 2 * n_layers * n_kv_heads * head_dim
    if values <= 0:
        raise ValueError("Need a positive number of cached values.")
    return held_bytes * 8 / values


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min and max of timing samples (and how many)."""
    array = np.asarray(list(samples), dtype=np.float64)
    if array.size == 0:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {
        "median": float(np.median(array)),
        "min": float(array.min()),
        "max": float(array.max()),
        "n": int(array.size),
    }


def median_ms(run: Callable[[], Any], repeats: int, *, warmup: int = 0, after: Callable[[], None] | None = None) -> float:
    """Median wall milliseconds of `run()` and the evaluation of what it returns (if anything), device synchronized
    before and after, over `repeats` timed runs after `warmup` untimed ones; `after`, untimed, follows each run (to
    undo what the run changed)."""
    import mlx.core as mx

    times = []
    for i in range(warmup + repeats):
        mx.synchronize()
        began = time.perf_counter()
        result = run()
        if result is not None:
            mx.eval(result)
        mx.synchronize()
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - began))
        if after is not None:
            after()
    return sorted(times)[len(times) // 2]
