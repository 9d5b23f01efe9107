"""Where a decode step's GPU time goes, kernel by kernel: the GPU's own record of whole-model steps.

    python benchmarks/gpu_timeline.py --specs fp16,kivi:k4v4:g64:s4:key_block=128 [--context 8193] [--steps 10]
        [--shape 8b|tiny] [--out timeline.json]

decode.py times a step from the host, and launch_count.py counts what a step records; neither says what the GPU
does meanwhile. This asks the GPU: for each spec (decode.py's spec syntax, `#NAME=VALUE` variants included) the
8B-shaped model's caches are filled with `--context` random tokens, then `--steps` synchronous steps (each evaluated
before the next is recorded, as decode.py times them) and `--steps` tokens of mlx-lm's own loop (`generate_step`,
which records step n+1 while the GPU runs step n: what the app and `velox serve` run) are run under torch's profiler.
Its CUPTI tracing records every CUDA kernel of the process, MLX's included, with its start and end on the GPU.

Per spec and mode (`step`, `loop`), per step: `wall_ms` (host time), `busy_ms` (the union of the kernels' intervals:
the GPU at work), `idle_ms` (wall less busy: the GPU waiting for the host to record, encode and launch), `kernels`
(launches), and `by_kernel`: calls and ms by kernel (MLX's names shortened to the function, Velox's kernels as
`velox_*`); over the whole record, `gaps` (the longest stretches with the GPU idle, with the kernels either side)
and `longest` (the longest single launches). `weights_busy_ms` is the union of the model's weight matmuls' intervals
(MLX's quantized matrix-vector kernels, `WEIGHT_KERNELS`): GPU time every cache's token pays whatever the cache, so
for the 16-bit row `ratio_ceiling` = wall / weights_busy is the most any cache could reach against it in that mode
(a cache whose attention and updates took no time at all, with the host keeping up). `--loop-steps 300` records a loop long enough to cross key-block
encodes and a growth of the buffers (`loop_from`: the cache's length when it starts). A GPU tool that needs torch with CUDA beside MLX's CUDA build (the lent machine has both); on a CPU it
says so and stops. The aggregation (`summarize`) is plain Python and tested on its own.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A kernel event: (name, start µs, end µs) on the GPU's clock.
Event = tuple[str, float, float]

_VELOX = re.compile(r"(velox_[a-z0-9_]*?)(?:_[0-9]|_t_|_f_|_bfloat|_float|_half|_uint|_int|$)")


# The weights' kernels: MLX's quantized matrix-vector products (qmv; the 4-bit weights at one token) and, should a
# step take that path, its matrix-matrix and gather forms.
WEIGHT_KERNELS = re.compile(r"^(qmv|qmm|qvm|gather_qmv|gather_qmm)")


def short_name(name: str) -> str:
    """A kernel's name without its C++ return type, namespaces, template arguments and parameters; a Velox kernel
    (MLX names it `custom_kernel_<source name><template arguments>`) by its source name."""
    velox = _VELOX.search(name)
    if velox and "custom_kernel_" in name:
        return velox.group(1)
    text = name.removeprefix("void ")
    for stop in "<(":
        text = text.split(stop, 1)[0]
    return text.rsplit("::", 1)[-1].strip() or name


def busy_time(events: Iterable[Event]) -> float:
    """The length of the union of the events' intervals (kernels of several streams may overlap)."""
    total = 0.0
    end = None
    start = None
    for _, begin, finish in sorted(events, key=lambda e: e[1]):
        if end is None or begin > end:
            if end is not None:
                total += end - start
            start, end = begin, finish
        else:
            end = max(end, finish)
    if end is not None:
        total += end - start
    return total


def idle_gaps(events: Iterable[Event], top: int = 5) -> list[dict[str, Any]]:
    """The `top` longest stretches with no kernel running, longest first: each one's length (ms), where it starts
    (ms after the first kernel) and the kernels on either side (the one that ended it last, the one after). A host
    stall inside a loop of steps shows here as one gap far longer than the rest, and its neighbours say in which part
    of a step it fell."""
    ordered = sorted(events, key=lambda e: e[1])
    if not ordered:
        return []
    first = ordered[0][1]
    found = []
    end_name, end = ordered[0][0], ordered[0][2]
    for name, begin, finish in ordered[1:]:
        if begin > end:
            found.append({"ms": (begin - end) / 1000, "at_ms": (end - first) / 1000, "after": short_name(end_name),
                          "before": short_name(name)})
        if finish > end:
            end_name, end = name, finish
    return sorted(found, key=lambda gap: -gap["ms"])[:top]


def longest_kernels(events: Iterable[Event], top: int = 5) -> list[dict[str, Any]]:
    """The `top` longest single launches, longest first: name, ms and start (ms after the first kernel)."""
    events = list(events)
    if not events:
        return []
    first = min(begin for _, begin, _ in events)
    ranked = sorted(events, key=lambda e: (e[1] - e[2], e[1]))[:top]
    return [{"name": short_name(name), "ms": (finish - begin) / 1000, "at_ms": (begin - first) / 1000}
            for name, begin, finish in ranked]


def summarize(events: list[Event], steps: int, wall_s: float) -> dict[str, Any]:
    """Per-step figures of `steps` steps whose kernels are `events`, run in `wall_s` seconds of host time."""
    busy_ms = busy_time(events) / 1000 / steps
    wall_ms = wall_s * 1000 / steps
    by_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, begin, finish in events:
        entry = by_kernel[short_name(name)]
        entry[0] += 1
        entry[1] += finish - begin
    ranked = sorted(by_kernel.items(), key=lambda item: -item[1][1])
    weights_busy_ms = busy_time(e for e in events if WEIGHT_KERNELS.match(short_name(e[0]))) / 1000 / steps
    return {
        "wall_ms": wall_ms, "busy_ms": busy_ms, "idle_ms": max(wall_ms - busy_ms, 0.0),
        "weights_busy_ms": weights_busy_ms,
        "ratio_ceiling": wall_ms / weights_busy_ms if weights_busy_ms else None,
        "kernels": len(events) / steps,
        "by_kernel": {name: {"calls": calls / steps, "ms": us / 1000 / steps} for name, (calls, us) in ranked},
        "gaps": idle_gaps(events), "longest": longest_kernels(events),
    }


def _kernel_events(profiler: Any) -> list[Event]:
    """The CUDA kernels torch's profiler recorded (kineto's raw events: name, start and duration in ns)."""
    events = []
    for event in profiler.profiler.kineto_results.events():
        if str(event.device_type()).endswith("CUDA"):
            start = event.start_ns() / 1000 if hasattr(event, "start_ns") else float(event.start_us())
            length = event.duration_ns() / 1000 if hasattr(event, "duration_ns") else float(event.duration_us())
            events.append((event.name(), start, start + length))
    return events


def profiled(run: Any, steps: int) -> dict[str, Any]:
    """`run()` (which runs `steps` steps and returns when the GPU is done) under torch's CUDA profiler, summarized."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        began = time.perf_counter()
        run()
        wall = time.perf_counter() - began
    events = _kernel_events(profiler)
    if not events:
        raise RuntimeError("torch's profiler recorded no CUDA kernel (CUPTI did not see MLX's launches)")
    return summarize(events, steps, wall)


def timeline(model: Any, spec: str, context: int, steps: int, shape: dict[str, Any],
             loop_steps: int | None = None) -> dict[str, Any]:
    """The `step` and `loop` summaries of one spec at one context (`loop_steps` tokens of the loop, else `steps`)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from benchmarks.decode import fill, make_caches, spec_constants, spec_row, time_decode

    row = spec_row(spec, context)
    with spec_constants(spec) as text:
        caches = make_caches(text, shape["layers"], shape)
        fill(caches, context, shape)
        time_decode(model, caches, steps=0, warmup=3)

        def synchronous() -> None:
            time_decode(model, caches, steps=steps, warmup=0)

        tokens = loop_steps or steps

        def loop(count: int = tokens) -> None:
            prompt = mx.array([128], dtype=mx.int32)
            for _ in generate_step(prompt, model, max_tokens=count, prompt_cache=caches):
                pass
            mx.synchronize()

        loop(steps)  # the loop's own first tokens (its prompt step, compiled sampling) outside the record
        row["step"] = profiled(synchronous, steps)
        # The loop's first token is its prompt's step, one more forward pass than tokens: tokens + 1 passes.
        row["loop_from"] = int(caches[0].offset)
        row["loop"] = profiled(loop, tokens + 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default="fp16", help="comma-separated cache specs (decode.py's)")
    parser.add_argument("--context", type=int, default=8193)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--loop-steps", type=int, help="tokens of mlx-lm's loop recorded (default: --steps); "
                        "over 128 they cross key-block encodes and the buffers' growth")
    parser.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--top", type=int, default=12, help="kernels printed per row")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        raise SystemExit("gpu_timeline.py needs torch (its profiler reads the GPU's kernel record)") from None
    if not torch.cuda.is_available():
        raise SystemExit("gpu_timeline.py needs a CUDA GPU (torch sees none)")

    from benchmarks.decode import SHAPES, build_model

    shape = SHAPES[args.shape]
    model = build_model(shape)
    rows = []
    for spec in [s.strip() for s in args.specs.split(",") if s.strip()]:
        row = timeline(model, spec, args.context, args.steps, shape, args.loop_steps)
        rows.append(row)
        for mode in ("step", "loop"):
            figures = row[mode]
            print(f"{spec} @ {args.context} {mode}: wall {figures['wall_ms']:.2f} ms, GPU busy {figures['busy_ms']:.2f}, "
                  f"idle {figures['idle_ms']:.2f}, {figures['kernels']:.0f} kernels; weights {figures['weights_busy_ms']:.2f} ms "
                  f"(wall / weights {figures['ratio_ceiling'] or float('nan'):.2f})", flush=True)
            for name, entry in list(figures["by_kernel"].items())[: args.top]:
                print(f"    {entry['ms']:7.3f} ms  {entry['calls']:5.0f}x  {name}")
            for gap in figures["gaps"][:3]:
                print(f"    idle {gap['ms']:.2f} ms at {gap['at_ms']:.1f} ms, after {gap['after']}, before {gap['before']}")
        if args.out:
            args.out.write_text(json.dumps({"context": args.context, "steps": args.steps, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
