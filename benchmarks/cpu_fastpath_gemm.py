"""Measure MLX on the Linux CPU with and without the fast path of engine.runtime.cpu (blas, weights).

The fast BLAS is a process-level switch (it must be loaded before mlx.core), so each configuration runs
in its own subprocess of this script and reports JSON back to the parent, which prints the tables.

    python benchmarks/cpu_fastpath_gemm.py                 # GEMM / matvec GFLOP/s, stock vs fast
    python benchmarks/cpu_fastpath_gemm.py --model [PATH]  # plus prefill/decode tok/s of a real model

Shapes are (tokens M, input K, output N) computed like nn.Linear: x[M, K] @ W[N, K].T. The sizes are
those of SmolLM2-135M (hidden 576, MLP 1536, vocab 49152) for a 2k-token prefill and for decode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
GEMM_SHAPES: list[tuple[int, int, int]] = [
    (2048, 576, 576),
    (2048, 576, 1536),
    (2048, 1536, 576),
    (1, 576, 576),
    (1, 576, 1536),
    (1, 1536, 576),
    (1, 576, 49152),
]
MIN_SECONDS_PER_SHAPE = 0.5
MIN_REPEATS = 3


def _prepare(config: str) -> dict[str, Any]:
    """Set up the process for one configuration; must run before mlx.core is imported."""
    sys.path.insert(0, str(REPO_ROOT))
    if config == "stock":
        os.environ["VELOX_FAST_BLAS"] = "0"  # `import engine` would otherwise enable the fast path
    from engine.runtime.cpu.blas import enable_fast_blas

    if config == "stock":
        return {"enabled": False, "reason": "stock MLX"}
    status = enable_fast_blas()
    if not status.enabled:
        raise SystemExit(f"fast path unavailable: {status.reason}")
    return {"enabled": True, "reason": status.reason}


def _seconds_per_call(run: Any) -> float:
    run()  # warm-up: first call allocates and may pick kernels
    timings: list[float] = []
    started = time.perf_counter()
    while len(timings) < MIN_REPEATS or time.perf_counter() - started < MIN_SECONDS_PER_SHAPE:
        begin = time.perf_counter()
        run()
        timings.append(time.perf_counter() - begin)
    return min(timings)


def gemm_worker(config: str, output_dir: Path) -> dict[str, Any]:
    status = _prepare(config)
    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    rows = []
    for m, k, n in GEMM_SHAPES:
        x_np = rng.standard_normal((m, k)).astype(np.float32)
        w_np = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        x, w = mx.array(x_np), mx.array(w_np)
        mx.eval(x, w)
        flops = 2.0 * m * k * n
        seconds = _seconds_per_call(lambda x=x, w=w: mx.eval(x @ w.T))
        result = np.array(x @ w.T)
        np.save(output_dir / f"{config}-{m}x{k}x{n}.npy", result)
        row = {"shape": [m, k, n], "mlx_fp32_gflops": flops / seconds / 1e9}
        if config == "stock":
            # What the stock path would run instead: 4-bit quantized_matmul with fp32 activations.
            packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
            seconds_q = _seconds_per_call(
                lambda x=x, p=packed, s=scales, b=biases: mx.eval(
                    mx.quantized_matmul(x, p, s, b, transpose=True, group_size=32, bits=4)
                )
            )
            row["mlx_q4_fp32_act_gflops"] = flops / seconds_q / 1e9
            seconds_np = _seconds_per_call(lambda x_np=x_np, w_np=w_np: x_np @ w_np.T)
            row["numpy_fp32_gflops"] = flops / seconds_np / 1e9
        rows.append(row)
    return {"status": status, "rows": rows}


def model_worker(config: str, model_path: str, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    status = _prepare(config)
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from engine.runtime.cpu.weights import dequantize_model_to_fp32, prefer_fp32_weights

    mx.set_default_device(mx.cpu)
    load_started = time.perf_counter()
    model, tokenizer = load(model_path)
    if config == "fast":
        if not prefer_fp32_weights():
            raise SystemExit("prefer_fp32_weights() is False with the fast path on")
        dequantize_model_to_fp32(model)
    load_seconds = time.perf_counter() - load_started

    # A deterministic chat prompt of exactly prompt_tokens tokens: a document-like text (cut to fit)
    # followed by a question, in the model's chat template.
    paragraph = (
        "The committee reviewed the quarterly report on water quality in the northern district. "
        "Samples from twelve sites showed nitrate levels within limits, except at the river mouth, "
        "where runoff after heavy rain raised them for two weeks in March. "
    )
    question = "\n\nWhich site exceeded the nitrate limits, and when? Explain in detail."

    def chat_ids(document: str) -> list[int]:
        messages = [{"role": "user", "content": document + question}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    document_ids = tokenizer.encode(paragraph * (prompt_tokens // 20 + 1), add_special_tokens=False)
    overhead = len(chat_ids("")) + 2
    prompt = chat_ids(tokenizer.decode(document_ids[: prompt_tokens - overhead]))

    # generate_step rather than stream_generate: it does not stop at end-of-sequence, so every run
    # decodes exactly max_tokens tokens. Time to the first token is the prefill (as mlx_lm reports it).
    # CPU time is also recorded: on a machine shared with other work the wall-clock rates drop with
    # the load, while rates per CPU-second approximate an idle machine (exactly so with one thread).
    tokens: list[int] = []
    started, started_cpu = time.perf_counter(), time.process_time()
    first_token_at, first_token_cpu = started, started_cpu
    for token, _logprobs in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if not tokens:
            first_token_at, first_token_cpu = time.perf_counter(), time.process_time()
        tokens.append(token)
    finished, finished_cpu = time.perf_counter(), time.process_time()
    return {
        "status": status,
        "load_seconds": load_seconds,
        "prompt_tokens": len(prompt),
        "prefill_tps": len(prompt) / (first_token_at - started),
        "generated_tokens": len(tokens),
        "decode_tps": (len(tokens) - 1) / (finished - first_token_at),
        "prefill_tokens_per_cpu_second": len(prompt) / (first_token_cpu - started_cpu),
        "decode_tokens_per_cpu_second": (len(tokens) - 1) / (finished_cpu - first_token_cpu),
        "threads": os.environ.get("VELOX_FAST_BLAS_THREADS", "default"),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "tokens": tokens,
        "text": tokenizer.decode(tokens),
    }


def _run_worker(arguments: list[str]) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, __file__, "--worker", *arguments],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    if completed.returncode != 0:
        raise SystemExit(f"worker {arguments} failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def print_gemm_table() -> None:
    import numpy as np

    with tempfile.TemporaryDirectory() as scratch:
        stock = _run_worker(["gemm", "stock", scratch])
        fast = _run_worker(["gemm", "fast", scratch])
        print(f"fast path: {fast['status']['reason']}")
        print(f"{'M x K x N':>18} | {'stock fp32':>10} | {'stock q4':>8} | {'fast fp32':>9} | "
              f"{'numpy':>7} | {'speed-up':>8} | {'max |fast-stock|':>16}")  # fmt: skip
        print("-" * 98)
        for stock_row, fast_row in zip(stock["rows"], fast["rows"], strict=True):
            m, k, n = stock_row["shape"]
            stock_out = np.load(Path(scratch) / f"stock-{m}x{k}x{n}.npy")
            fast_out = np.load(Path(scratch) / f"fast-{m}x{k}x{n}.npy")
            difference = float(np.max(np.abs(stock_out - fast_out)))
            speed_up = fast_row["mlx_fp32_gflops"] / stock_row["mlx_fp32_gflops"]
            print(
                f"{f'{m} x {k} x {n}':>18} | {stock_row['mlx_fp32_gflops']:10.1f} | "
                f"{stock_row['mlx_q4_fp32_act_gflops']:8.1f} | {fast_row['mlx_fp32_gflops']:9.1f} | "
                f"{stock_row['numpy_fp32_gflops']:7.1f} | {speed_up:7.1f}x | {difference:16.2e}"
            )
        print("GFLOP/s; stock q4 = MLX 4-bit quantized_matmul (group 32) with fp32 activations.")


def print_model_table(model_path: str, prompt_tokens: int, max_tokens: int, configs: list[str]) -> None:
    results = {}
    for config in configs:
        results[config] = _run_worker(["model", config, model_path, str(prompt_tokens), str(max_tokens)])
    print(f"\nmodel: {model_path}")
    print(f"{'config':>8} | {'prompt':>6} | {'prefill tok/s':>13} | {'decode tok/s':>12} | "
          f"{'prefill tok/cpu-s':>17} | {'decode tok/cpu-s':>16} | {'load s':>6} | {'peak GB':>7}")  # fmt: skip
    print("-" * 110)
    for config, result in results.items():
        print(
            f"{config:>8} | {result['prompt_tokens']:6d} | {result['prefill_tps']:13.1f} | "
            f"{result['decode_tps']:12.1f} | {result['prefill_tokens_per_cpu_second']:17.1f} | "
            f"{result['decode_tokens_per_cpu_second']:16.1f} | {result['load_seconds']:6.1f} | "
            f"{result['peak_memory_gb']:7.2f}"
        )
    print(f"load average now: {os.getloadavg()[0]:.2f} (wall-clock rates fall when other work shares the CPU)")
    if len(results) > 1:
        reference_name, reference = next(iter(results.items()))
        for config, result in list(results.items())[1:]:
            same = result["tokens"] == reference["tokens"]
            first_difference = next(
                (i for i, (a, b) in enumerate(zip(result["tokens"], reference["tokens"], strict=False)) if a != b), None
            )
            print(f"greedy tokens {config} vs {reference_name}: "
                  f"{'identical' if same else f'differ from token {first_difference}'}")  # fmt: skip
    for config, result in results.items():
        print(f"--- {config} text: {result['text']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", nargs="?", const="default", help="model folder; no value = default")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--configs", default="stock,fast", help="comma-separated: stock, fast")
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    arguments = parser.parse_args()

    if arguments.worker:
        kind, config, *rest = arguments.worker
        if kind == "gemm":
            result = gemm_worker(config, Path(rest[0]))
        else:
            result = model_worker(config, rest[0], int(rest[1]), int(rest[2]))
        print(json.dumps(result))
        return

    if os.cpu_count():
        print(f"CPU cores: {os.cpu_count()}")
    if not arguments.skip_gemm:
        print_gemm_table()
    if arguments.model:
        model_path = arguments.model
        if model_path == "default":
            sys.path.insert(0, str(REPO_ROOT))
            from engine.models.default_model import ensure_default_model

            model_path = str(ensure_default_model())
        configs = [c.strip() for c in arguments.configs.split(",") if c.strip()]
        print_model_table(model_path, arguments.prompt_tokens, arguments.max_tokens, configs)


if __name__ == "__main__":
    main()
