"""The chunked prefill that records the next chunk while the current one is evaluated (engine/chat/prefill.py)."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from engine.chat.prefill import prefill_chunks

N_TOKENS = 300
CHUNK = 64


def _caches(smollm, level: str | None) -> list:
    """Fresh caches of the 16-bit cache or an app level, calibrated as the app's are (the bundled prose)."""
    model, tokenizer, _ = smollm
    if level is None:
        return make_prompt_cache(model)
    from engine.kvcache import KVCacheBuilder
    from engine.planning.recommend import level_by_key

    return KVCacheBuilder(level_by_key(level).config).for_model(model, tokenizer=tokenizer).build()


def _tokens() -> list[int]:
    return np.random.default_rng(3).integers(0, 49152, N_TOKENS).tolist()


def _arrays(caches: list) -> list[np.ndarray]:
    return [np.array(v.astype(mx.float32) if v.dtype in (mx.bfloat16, mx.float16) else v)
            for cache in caches for _, v in tree_flatten(cache.state) if isinstance(v, mx.array)]


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("level", [None, "4", "3"])
def test_prefill_fills_the_cache_as_one_chunk_after_another_does(smollm, level: str | None, pipelined: bool) -> None:
    """Every chunk's counts in order, and the caches equal, array for array, those of chunks fed and evaluated one
    after another (the 16-bit cache, and the 4- and 3-bit levels, whose key blocks straddle the chunks), pipelined
    (the next chunk recorded while one runs, as on a GPU) or not (as on a CPU)."""
    model, _, _ = smollm
    tokens = _tokens()
    serial = _caches(smollm, level)
    for start in range(0, N_TOKENS, CHUNK):
        model(mx.array(tokens[start:start + CHUNK])[None], cache=serial)
        mx.eval([c.state for c in serial])
    filled = _caches(smollm, level)
    counts = list(prefill_chunks(model, filled, tokens, CHUNK, pipelined=pipelined))
    assert counts == [*range(CHUNK, N_TOKENS, CHUNK), N_TOKENS]
    assert [c.offset for c in filled] == [N_TOKENS] * len(filled)
    expected, got = _arrays(serial), _arrays(filled)
    assert len(expected) == len(got) > 0
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_array_equal(have, want)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_cancel_records_no_more_chunks(smollm, pipelined: bool) -> None:
    """Cancelled after the first chunk is counted: pipelined, the second, recorded while the first ran, is finished and
    counted, and no third is recorded; else none after the first. The cache holds exactly the tokens counted."""
    model, _, _ = smollm
    cache = _caches(smollm, "4")
    cancel = threading.Event()
    counts = []
    for done in prefill_chunks(model, cache, _tokens(), CHUNK, cancel, pipelined=pipelined):
        counts.append(done)
        cancel.set()
    assert counts == ([CHUNK, 2 * CHUNK] if pipelined else [CHUNK])
    assert [c.offset for c in cache] == [counts[-1]] * len(cache)


@pytest.mark.parametrize("pipelined", [True, False])
def test_nothing_is_recorded_when_cancelled_before_the_first_chunk(smollm, pipelined: bool) -> None:
    model, _, _ = smollm
    cache = _caches(smollm, None)
    cancel = threading.Event()
    cancel.set()
    assert list(prefill_chunks(model, cache, _tokens(), CHUNK, cancel, pipelined=pipelined)) == []
    assert [c.offset for c in cache] == [0] * len(cache)


def test_pipelined_by_default_only_on_a_gpu() -> None:
    """The default: on a GPU every cache records the next chunk while the current one runs; on a CPU (host and device
    the same cores) chunks are fed one after another."""
    from engine.chat.prefill import pipelined_by_default

    assert pipelined_by_default(mx.gpu)
    assert not pipelined_by_default(mx.cpu)
