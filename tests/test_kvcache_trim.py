"""Trimming for reuse, for every registered method: a cache trimmed with `trim_for_reuse` and fed the trimmed
tokens again holds exactly what a cache that was never trimmed holds (the contract a prompt cache relies on
when it trims a stored cache back to a new prompt's shared prefix and runs the rest)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.kvcache import KVCacheConfig, get_method, known_methods
from engine.kvcache.trim import reuse_trim_length, trim_for_reuse
from tests.kvcache_helpers import filled, random_kv, tiny_vq_codebooks

N_TOKENS = 300
CHUNK = 37  # uneven chunks, as prefill and decoding feed them


def _configs() -> dict[str, KVCacheConfig]:
    configs = {}
    for method in known_methods():
        configs[method] = KVCacheConfig(method)
        if get_method(method).attention_path != "dense":  # dense caches take no window or sinks
            configs[f"{method}-window-sinks"] = KVCacheConfig(method, residual_window=16, sink_tokens=4)
    return configs


CONFIGS = _configs()
# Cuts into the window, at and across KIVI's 64-token block boundaries, into the sinks, and everything.
CUTS = [1, 20, 44, 45, 100, 250, 297, N_TOKENS]


def _state(cache) -> dict[str, object]:
    return dict(tree_flatten(cache.state))


def _assert_same_cache(actual, expected) -> None:
    assert actual.offset == expected.offset
    if hasattr(expected, "n_compressed"):
        assert (actual.n_sink, actual.n_compressed, actual.n_window) == (
            expected.n_sink, expected.n_compressed, expected.n_window,
        )
    actual_state, expected_state = _state(actual), _state(expected)
    assert sorted(actual_state) == sorted(expected_state)
    for key, value in expected_state.items():
        if isinstance(value, mx.array):
            assert actual_state[key].dtype == value.dtype and mx.array_equal(actual_state[key], value), key
        else:
            assert actual_state[key] == value, key


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_trim_for_reuse_then_extend_equals_an_untrimmed_cache(name: str, cut: int) -> None:
    config = CONFIGS[name]
    if config.method == "vq":  # calibrated codebooks are part of a vq config; made once, on first use
        config = KVCacheConfig(config.method, residual_window=config.residual_window, sink_tokens=config.sink_tokens,
                               options={"codebooks": tiny_vq_codebooks(2)})
    keys, values = random_kv(n_tokens=N_TOKENS, head_dim=64, seed=1)
    untrimmed = filled(get_method(config.method)(config), keys, values, chunk=CHUNK)
    cache = filled(get_method(config.method)(config), keys, values, chunk=CHUNK)
    trimmed = trim_for_reuse([cache], cut)
    assert cut <= trimmed <= N_TOKENS and cache.offset == N_TOKENS - trimmed
    filled(cache, keys[..., N_TOKENS - trimmed :, :], values[..., N_TOKENS - trimmed :, :], chunk=CHUNK)
    _assert_same_cache(cache, untrimmed)


def test_only_kivi_widens_and_only_to_the_start_of_the_cut_key_block() -> None:
    keys, values = random_kv(n_tokens=N_TOKENS, head_dim=64, seed=2)
    for method in known_methods():
        config = KVCacheConfig(method, options={"codebooks": tiny_vq_codebooks(2)} if method == "vq" else {})
        cache = filled(get_method(method)(config), keys, values, chunk=CHUNK)
        lengths = [reuse_trim_length([cache], cut) for cut in (0, 1, 44, 45, 100, 300, 400)]
        if method != "kivi":
            assert lengths == [0, 1, 44, 45, 100, 300, 300], method
            continue
        # 300 tokens in 64-token blocks: 256 quantized (four blocks), 44 in the 16-bit window.
        assert (cache.n_compressed, cache.n_window) == (256, 44)
        # Window tokens go one by one; a cut into block 4 (tokens 192-255) goes back to token 192.
        assert lengths == [0, 1, 44, 108, 108, 300, 300]


def test_plain_trim_into_a_kivi_block_then_extend_differs_from_untrimmed() -> None:
    """Why `trim_for_reuse` exists: `trim` keeps a cut block's first tokens decoded, and refilled they are
    quantized a second time, so the cache no longer equals one that never held the trimmed tokens."""
    config = KVCacheConfig("kivi")
    keys, values = random_kv(n_tokens=N_TOKENS, head_dim=64, seed=3)
    untrimmed = filled(get_method("kivi")(config), keys, values, chunk=CHUNK)
    cache = filled(get_method("kivi")(config), keys, values, chunk=CHUNK)
    cache.trim(100)  # 200 kept: blocks 0-2 and 8 tokens of block 3, decoded into the window
    assert (cache.n_compressed, cache.n_window) == (192, 8)
    filled(cache, keys[..., 200:, :], values[..., 200:, :], chunk=CHUNK)
    assert cache.n_compressed == untrimmed.n_compressed == 256
    assert not mx.array_equal(_state(cache)["compressed.key_codes"], _state(untrimmed)["compressed.key_codes"])
