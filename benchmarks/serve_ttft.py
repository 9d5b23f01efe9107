"""Time to first token of `velox serve` against mlx-lm's own server, on the embedded model.

Each server runs in its own process on a free localhost port and gets the same two streamed chat requests
through the `openai` client: a ~4k-token prompt (prose + a question), then a follow-up that extends it (the
first prompt, the reply, and a new question), so the follow-up can reuse the first request's prompt cache.
TTFT = from sending the request to the first streamed text.

    python benchmarks/serve_ttft.py [--prose PATH] [--tokens 4096] [--servers velox-4,velox-16,mlx-lm] [--add]
    python benchmarks/serve_ttft.py --report    # only rewrite BENCHMARKS.md's section from the JSON

Writes benchmarks/results/serve_ttft.json and the "Local server" section of BENCHMARKS.md (between its
markers, in the hand-written part that `velox bench report` keeps).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The benchmark prose beside the checkout (../shared/data, as the harness), or beside its parent folder.
DEFAULT_PROSE = next(
    (path for path in (folder / "shared" / "data" / "areopagitica.txt" for folder in (ROOT.parent, ROOT.parent.parent))
     if path.is_file()),
    ROOT.parent / "shared" / "data" / "areopagitica.txt",
)
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "serve_ttft.json"
PREFILL_STEP_RESULTS = ROOT / "benchmarks" / "results" / "serve_prefill_step.json"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
HAND_WRITTEN_MARKER = "<!-- hand-written sections below: kept as they are by `velox bench report` -->"
SECTION_START = "<!-- serve_ttft:start: written by `python benchmarks/serve_ttft.py` from benchmarks/results/serve_ttft.json -->"
SECTION_END = "<!-- serve_ttft:end -->"
QUESTION = "In one sentence, what does the author of this passage argue?"
FOLLOW_UP = "Name one example the author gives."
STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 1800

# mlx-lm's server with the model loaded the way Velox loads it (CPU fast path: BLAS shim, fp32 weights),
# its request handling untouched: separates what the server and cache do from what the runtime does.
MLX_LM_ON_VELOX_RUNTIME = """
import sys
from engine.runtime import prepare_runtime
prepare_runtime()
import mlx_lm.server as server
from engine.models.catalog import load_model

def velox_load(path, adapter_path=None, tokenizer_config=None, return_config=False, **kwargs):
    model, tokenizer, info = load_model(path)
    return (model, tokenizer, {}) if return_config else (model, tokenizer)

server.load = velox_load
sys.argv = ["mlx_lm.server", *sys.argv[1:]]
server.main()
"""


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _servers(model_dir: Path) -> dict[str, dict[str, Any]]:
    python = sys.executable
    return {
        "velox-4": {
            "label": "velox serve, app's 4-bit level (kivi:k4v4:g64:s4:key_block=128:rotate_values=true)",
            "command": [python, "-m", "app.cli", "serve", "--level", "4"],
        },
        "velox-16": {
            "label": "velox serve, uncompressed level",
            "command": [python, "-m", "app.cli", "serve", "--level", "16"],
        },
        "mlx-lm-velox-runtime": {
            "label": "mlx_lm.server (its KVCache, uncompressed), model loaded on Velox's CPU fast path",
            "command": [python, "-c", MLX_LM_ON_VELOX_RUNTIME, "--model", str(model_dir)],
        },
        "mlx-lm": {
            "label": "mlx_lm.server (its KVCache, uncompressed), stock MLX",
            "command": [python, "-m", "mlx_lm", "server", "--model", str(model_dir)],
        },
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_healthy(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before answering")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not answer within the start-up timeout")


def _streamed(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    first = None
    text, usage = "", None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    end = time.perf_counter()
    cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None) if usage else None
    return {
        "ttft_s": round((first or end) - start, 3),
        "total_s": round(end - start, 3),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": cached,
        "completion_tokens": usage.completion_tokens if usage else None,
        "reply": text,
    }


def measure(key: str, spec: dict[str, Any], document: str, max_tokens: int) -> dict[str, Any]:
    import openai

    port = _free_port()
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_ttft-{key}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [*spec["command"], "--port", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            started = time.perf_counter()
            _wait_healthy(port, process)
            startup = time.perf_counter() - started
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
            )
            model = "default" if key.startswith("velox") else "default_model"
            messages = [{"role": "user", "content": f"{document}\n\n{QUESTION}"}]
            first = _streamed(client, model, messages, max_tokens)
            messages += [{"role": "assistant", "content": first["reply"]}, {"role": "user", "content": FOLLOW_UP}]
            follow_up = _streamed(client, model, messages, max_tokens)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    return {"label": spec["label"], "startup_s": round(startup, 1), "first": first, "follow_up": follow_up}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _document(prose: Path, tokens: int) -> tuple[str, int]:
    """`tokens` tokens of prose, from 5% into the text (past the title pages)."""
    from tokenizers import Tokenizer

    from engine.models.default_model import ensure_default_model

    tokenizer = Tokenizer.from_file(str(ensure_default_model() / "tokenizer.json"))
    ids = tokenizer.encode(prose.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False).ids
    start = len(ids) // 20
    return tokenizer.decode(ids[start:start + tokens]), tokens


def prefill_step_lines(results: dict[str, Any] | None) -> list[str]:
    """The prefill-step comparison (benchmarks/serve_prefill_step.py's JSON) as a paragraph and a table."""
    if not results or not results.get("runs"):
        return []
    machine = results["machine"]
    rows = [
        "| cache | prefill step | prompt tokens | prefill tok/s | peak MLX memory | load average (1 min) at start, end |",
        "|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        loads = ", ".join(str(x) for x in run["load_average_1min"])
        rows.append(
            f"| {run['cache']} | {run['prefill_step']:,} | {run['prompt_tokens']:,} | {run['prompt_tokens_per_s']:.1f} "
            f"| {run['peak_memory_mb']:,.0f} MB | {loads} |"
        )
    return [
        "",
        "### Prefill step (`--prefill-step-size`)",
        "",
        f"How many prompt tokens `velox serve` runs through the model at once, measured with the server's own "
        f"caches and mlx-lm's `stream_generate` on {machine['platform']} ({machine['mlx_device']}, "
        f"{results['date']}; load average {', '.join(str(x) for x in machine['load_average_1_5_15'])} at the "
        f"start, {', '.join(str(x) for x in machine.get('load_average_1_5_15_at_end', []))} at the end). Peak "
        "memory is MLX's, weights included (about 540 MB of fp32 weights on the CPU fast path). Reproduce: "
        "`python benchmarks/serve_prefill_step.py` (writes `benchmarks/results/serve_prefill_step.json`).",
        "",
        *rows,
    ]


def write_section(results: dict[str, Any], markdown: Path = BENCHMARKS_MD) -> None:
    """BENCHMARKS.md's "Local server" section, from the results, between its markers."""
    rows = [
        "| server | first request: prompt tokens | TTFT | follow-up: prompt tokens (reused) | TTFT "
        "| run began (UTC) | load average 1/5/15 min at start → end |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in results["runs"].values():
        when = entry.get("date", results["date"]).replace("T", " ").rstrip("Z")
        loads = " → ".join(
            ", ".join(str(x) for x in entry.get(name, results["machine"].get(name, [])))
            for name in ("load_average_1_5_15", "load_average_1_5_15_at_end")
        )
        if "error" in entry:
            rows.append(f"| {entry['label']} | {entry['error']} | | | | {when} | {loads} |")
            continue
        first, follow = entry["first"], entry["follow_up"]
        reused = "?" if follow["cached_tokens"] is None else f"{follow['cached_tokens']:,}"
        rows.append(
            f"| {entry['label']} | {first['prompt_tokens']:,} | {first['ttft_s']:.2f} s | "
            f"{follow['prompt_tokens']:,} ({reused}) | {follow['ttft_s']:.2f} s | {when} | {loads} |"
        )
    machine = results["machine"]
    section = [
        SECTION_START,
        "## Local server: time to first token (`velox serve`)",
        "",
        f"{results['model']} on {machine['platform']}, {machine['cpu_count']} cores shared with other jobs, one "
        "run per server, each with the load average around it. TTFT is wall time, so on this loaded machine it "
        "is several times what an idle one gives; compare the rows with each other (and mind their loads), not "
        "with the CPU speeds above. Each server, in its own process, gets a streamed chat request "
        f"with {results['document_tokens']:,} tokens of prose and a question, then a follow-up that extends it "
        "(the first prompt, the reply, a new question); both servers prefill 2,048 prompt tokens per step "
        "(their default). TTFT is from sending to the first streamed text, "
        "through the `openai` client; *reused* is the server's own `usage.prompt_tokens_details.cached_tokens`.",
        "",
        *rows,
        "",
        "Both servers serve these requests one at a time: Velox's caches have no batched form (see "
        "`engine/serve/provider.py`), and a lone request is not batched by mlx-lm either. "
        "Reproduce: `python benchmarks/serve_ttft.py` "
        "(writes `benchmarks/results/serve_ttft.json` and this section; `--servers` picks some, `--add` keeps "
        "the others' runs).",
        *prefill_step_lines(_read_json(PREFILL_STEP_RESULTS)),
        SECTION_END,
    ]
    text = markdown.read_text(encoding="utf-8") if markdown.is_file() else ""
    if SECTION_START in text and SECTION_END in text:
        before, rest = text.split(SECTION_START, 1)
        after = rest.split(SECTION_END, 1)[1]
        text = before + "\n".join(section) + after
    else:
        if HAND_WRITTEN_MARKER not in text:
            text = text.rstrip() + "\n\n" + HAND_WRITTEN_MARKER + "\n"
        text = text.rstrip() + "\n\n" + "\n".join(section) + "\n"
    markdown.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prose", type=Path, default=DEFAULT_PROSE)
    parser.add_argument("--tokens", type=int, default=4096, help="prose tokens in the first prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--servers", default="velox-4,velox-16,mlx-lm")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--report", action="store_true", help="only rewrite BENCHMARKS.md's section from --out")
    parser.add_argument("--add", action="store_true",
                        help="keep the other servers' runs already in --out (each run records its own time and load)")
    args = parser.parse_args(argv)
    if args.report:
        write_section(json.loads(args.out.read_text(encoding="utf-8")))
        return 0
    if not args.prose.is_file():
        print(f"error: no prose at {args.prose}; pass --prose PATH", file=sys.stderr)
        return 1
    from engine.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = ensure_default_model()
    document, n_tokens = _document(args.prose, args.tokens)
    servers = _servers(model_dir)
    chosen = [key.strip() for key in args.servers.split(",") if key.strip()]
    unknown = [key for key in chosen if key not in servers]
    if unknown:
        print(f"error: unknown server(s) {', '.join(unknown)}; known: {', '.join(servers)}", file=sys.stderr)
        return 1
    earlier = _read_json(args.out) if args.add else None
    if earlier is not None and earlier.get("document_tokens") != n_tokens:
        print(f"error: {args.out} was measured with {earlier.get('document_tokens')} prose tokens, not {n_tokens}",
              file=sys.stderr)
        return 1
    results: dict[str, Any] = {
        "schema": "velox-serve-ttft/1",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": DEFAULT_MODEL_NAME,
        "machine": {
            "platform": f"{platform.system()} {platform.machine()}",
            "cpu_count": os.cpu_count(),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
        },
        "document_tokens": n_tokens,
        "max_tokens": args.max_tokens,
        "question": QUESTION,
        "follow_up": FOLLOW_UP,
        "runs": dict(earlier["runs"]) if earlier else {},
    }
    for key in chosen:
        print(f"{key}: {servers[key]['label']} …", file=sys.stderr, flush=True)
        began, load_before = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), _load()
        try:
            run = measure(key, servers[key], document, args.max_tokens)
        except Exception as error:  # record and go on: one server failing should not lose the others
            run = {"label": servers[key]["label"], "error": f"{type(error).__name__}: {error}"}
        run.update(date=began, load_average_1_5_15=load_before, load_average_1_5_15_at_end=_load())
        results["runs"][key] = run
        if "first" in run:
            print(f"  TTFT first {run['first']['ttft_s']:.2f} s ({run['first']['prompt_tokens']} tokens), "
                  f"follow-up {run['follow_up']['ttft_s']:.2f} s ({run['follow_up']['cached_tokens']} reused)",
                  file=sys.stderr, flush=True)
        else:
            print(f"  failed: {run['error']}", file=sys.stderr, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    write_section(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
