"""Chunked prefill that records the next chunk while the device runs the current one.

A prompt is fed through the model a chunk at a time (its attention scores and activations then stay one chunk's
size). Recording a chunk — every layer's cache update and attention built into MLX's graph — is host work, and a
compressed cache records more of it than the 16-bit one (its encode, its history decode, its store's appends). Fed
one chunk after another, as mlx-lm's generate does, the device waits while the host records each chunk. Here chunk
i+1 is recorded while chunk i is evaluated (`mx.async_eval`), as mlx-lm's decode loop overlaps its steps.

The caches' bookkeeping (offsets, segments) moves when a chunk is recorded, before it is evaluated: a caller that
counts the tokens a cache holds reads the counts this generator yields, which are those of evaluated chunks. On a
cancel no new chunk is recorded and the one in flight is finished, so the cache never holds a chunk that was not
counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx


def prefill_chunks(model: Any, cache: list[Any], tokens: Sequence[int] | mx.array, chunk: int,
                   cancel: threading.Event | None = None) -> Iterator[int]:
    """Feeds `tokens` (a list of ids, or an int array of shape [N]) through `model` into `cache`, `chunk` tokens at a
    time; after each chunk is evaluated, yields how many tokens have been evaluated so far. Stops recording chunks
    once `cancel` is set (the chunk in flight is still finished and counted)."""
    prompt = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int32)
    total = int(prompt.shape[0])
    step = max(1, chunk)
    recorded = 0
    in_flight: tuple[int, list[Any]] | None = None  # (tokens evaluated once it is done, its arrays)
    while True:
        recording = None
        if recorded < total and not (cancel is not None and cancel.is_set()):
            end = min(recorded + step, total)
            model(prompt[None, recorded:end], cache=cache)
            states = [c.state for c in cache]
            mx.async_eval(states)
            recorded = end
            recording = (end, states)
        if in_flight is not None:
            done, states = in_flight
            mx.eval(states)
            yield done
        if recording is None:
            return
        in_flight = recording
