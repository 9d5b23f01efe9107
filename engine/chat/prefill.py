"""Chunked prefill that records the next chunk while the device runs the current one.

A prompt is fed through the model a chunk at a time (its attention scores and activations then stay one chunk's
size). Recording a chunk — every layer's cache update and attention built into MLX's graph — is host work, and a
compressed cache records more of it than the 16-bit one (its encode, its history decode, its store's appends): on an
H200 the app's levels took 15-20 ms a 512-token chunk to record against ~3.5 ms for the 16-bit cache
(benchmarks/results/prefill-chunks-512-h200.json). Fed one chunk after another, as mlx-lm's generate does, the
device waits while the host records each chunk. Here, on a GPU, chunk i+1 is recorded while chunk i runs.

Chunk i+1 is only recorded, not submitted, until chunk i is done (`mx.synchronize`): when it is submitted nothing but
the caches holds chunk i's arrays, so its appends may write into chunk i's buffers in place (MLX donates an input
buffer only while nothing else references it; a list of chunk i's states kept to wait on would force a copy of every
store array).

The caches' bookkeeping (offsets, segments) moves when a chunk is recorded, before it is evaluated: a caller that
counts the tokens a cache holds reads the counts this generator yields, which are those of evaluated chunks. On a
cancel no new chunk is recorded, and one already recorded is evaluated and counted, so the cache never holds a chunk
that was not counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx


def pipelined_by_default(device: mx.Device) -> bool:
    """Whether a prefill on `device` records the next chunk while the current one runs: on a GPU. On a CPU the host
    and the device are the same cores, and pipelining (its first form, which submitted the next chunk at once) gained
    nothing measurable there (SmolLM2, 1,024 tokens in 256-token chunks: 164 against 163 tok/s at 16 bits, 159 against
    158 at the 4-bit level), while a cancel would wait for one more chunk. On the H200, a 32k-token prompt of the 8B
    shape: the 16-bit cache 8,012-8,091 tok/s pipelined against 7,198-7,289 fed chunk by chunk, the app's levels
    6,518-7,096 against 5,737-6,178 (benchmarks/results/prefill-pipelined-warm-h200.json). The 16-bit cache's
    pipelined figure had looked erratic (4,048-5,654 tok/s) only where it was the first pipelined prefill on a fresh
    machine, which compiles kernels the other way had not (the same run's second one: 8,056)."""
    return device == mx.gpu


def prefill_chunks(model: Any, cache: list[Any], tokens: Sequence[int] | mx.array, chunk: int,
                   cancel: threading.Event | None = None, pipelined: bool | None = None) -> Iterator[int]:
    """Feeds `tokens` (a list of ids, or an int array of shape [N]) through `model` into `cache`, `chunk` tokens at a
    time; after each chunk is evaluated, yields how many tokens have been evaluated so far. Stops recording chunks
    once `cancel` is set (pipelined, a chunk already recorded is still evaluated and counted). `pipelined` (default:
    `pipelined_by_default`) records the next chunk while the current one runs."""
    prompt = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int32)
    total = int(prompt.shape[0])
    step = max(1, chunk)
    if not (pipelined_by_default(mx.default_device()) if pipelined is None else pipelined):
        for start in range(0, total, step):
            if cancel is not None and cancel.is_set():
                return
            model(prompt[None, start:start + step], cache=cache)
            mx.eval([c.state for c in cache])
            yield min(start + step, total)
        return
    recorded = 0
    running: int | None = None  # tokens evaluated once the chunk submitted last is done
    while True:
        states = None
        if recorded < total and not (cancel is not None and cancel.is_set()):
            end = min(recorded + step, total)
            model(prompt[None, recorded:end], cache=cache)  # recorded while the chunk before runs
            states = [c.state for c in cache]
            recorded = end
        if running is not None:
            mx.synchronize()
            yield running
        if states is None:
            return
        mx.async_eval(states)
        del states  # the caches alone hold the chunk's arrays when the next one is submitted
        running = recorded
