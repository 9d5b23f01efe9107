"""Saved conversation caches: bit-exact round trips of the compressed cache, refusal of every mismatch
with one sentence, an LRU disk budget, and atomic writes that survive kill -9."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from engine.chat.saved_cache import (
    CacheFolder,
    CacheIdentity,
    SavedCacheError,
    load_cache_file,
    model_identity,
    read_cache_metadata,
    restore_session_cache,
    save_cache_file,
    save_session_cache,
    template_identity,
)
from engine.chat.session import ChatSession, GenerationSettings
from engine.kvcache import KVCacheBuilder, KVCacheConfig
from engine.planning.memory import kv_cache_bytes

PROSE = Path(__file__).parent / "data" / "prose_sample.txt"
KIVI4 = KVCacheConfig(method="kivi", key_bits=4, value_bits=4, group_size=64)


def _filled_cache(smollm, n_tokens: int, config: KVCacheConfig = KIVI4) -> tuple[list, list[int]]:
    model, tokenizer, _ = smollm
    ids = tokenizer.encode(PROSE.read_text(encoding="utf-8"), add_special_tokens=False)
    ids = (ids * (n_tokens // len(ids) + 1))[:n_tokens]
    cache = KVCacheBuilder(config).for_model(model).build()
    for start in range(0, n_tokens, 256):
        model(mx.array(ids[start:start + 256])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache, ids


@pytest.fixture(scope="module")
def filled(smollm):
    return _filled_cache(smollm, 700)


@pytest.fixture(scope="module")
def identity(smollm, default_model_path):
    _model, tokenizer, _ = smollm
    return CacheIdentity(model_identity(default_model_path), template_identity(tokenizer, None), str(KIVI4))


def _leaves(cache) -> list[mx.array]:
    def walk(value):
        if isinstance(value, mx.array):
            yield value
        elif isinstance(value, dict):
            for key in sorted(value):
                yield from walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from walk(item)
    return [leaf for layer in cache for leaf in walk(layer.state)]


def test_round_trip_is_bit_exact_private_and_the_size_of_the_held_bytes(filled, identity, tmp_path) -> None:
    cache, tokens = filled
    path = tmp_path / "conversation-1.safetensors"
    size = save_cache_file(path, cache, tokens, identity)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded, loaded_tokens = load_cache_file(path, identity)
    # The file holds the filled part of every array (the live cache also holds growth room), plus the
    # token list: within 5 % of what the reloaded cache holds, and never more than the live cache.
    assert abs(size - kv_cache_bytes(loaded)) <= 0.05 * kv_cache_bytes(loaded)
    assert size <= 1.05 * kv_cache_bytes(cache)
    assert loaded_tokens == tokens
    assert [type(layer).__name__ for layer in loaded] == [type(layer).__name__ for layer in cache]
    for before, after in zip(_leaves(cache), _leaves(loaded), strict=True):
        assert before.dtype == after.dtype and mx.array_equal(before, after).item()
    assert kv_cache_bytes(loaded) <= kv_cache_bytes(cache)


def test_a_reloaded_cache_continues_exactly_like_the_live_one(smollm, identity, tmp_path) -> None:
    model = smollm[0]
    live, tokens = _filled_cache(smollm, 300)
    save_cache_file(tmp_path / "c.safetensors", live, tokens, identity)
    reloaded, _ = load_cache_file(tmp_path / "c.safetensors", identity)
    step = mx.array([[tokens[5], tokens[9], tokens[2]]])
    assert mx.array_equal(model(step, cache=live), model(step, cache=reloaded)).item()
    assert not list(tmp_path.glob(".*partial*")), "no temporary file left behind"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model": "0" * 64}, "another model"),
        ({"template": "1" * 64}, "another chat template"),
        ({"config": "kivi:k2v2:g64"}, "another compression setting"),
    ],
)
def test_any_mismatch_is_refused_with_its_reason(filled, identity, tmp_path, change, reason) -> None:
    cache, tokens = filled
    path = tmp_path / "c.safetensors"
    save_cache_file(path, cache, tokens, identity)
    expected = CacheIdentity(**{**identity.as_metadata(), **change})
    with pytest.raises(SavedCacheError, match=reason):
        load_cache_file(path, expected)


def test_truncated_corrupt_and_missing_files_are_refused(filled, identity, tmp_path) -> None:
    cache, tokens = filled
    path = tmp_path / "c.safetensors"
    save_cache_file(path, cache, tokens, identity)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SavedCacheError, match="damaged or truncated"):
        load_cache_file(path, identity)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(SavedCacheError, match="damaged or truncated"):
        load_cache_file(path, identity)
    with pytest.raises(SavedCacheError, match="no saved cache"):
        load_cache_file(tmp_path / "absent.safetensors", identity)


def test_a_cache_saved_with_the_wrong_token_list_is_refused(filled, identity, tmp_path) -> None:
    cache, tokens = filled
    with pytest.raises(SavedCacheError, match="not the"):
        save_cache_file(tmp_path / "c.safetensors", cache, tokens[:-3], identity)


def test_model_identity_changes_when_a_weight_file_changes(tmp_path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"a" * 100)
    before = model_identity(folder)
    assert model_identity(folder) == before
    (folder / "model.safetensors").write_bytes(b"b" * 101)
    assert model_identity(folder) != before


def test_budget_evicts_least_recently_used_first(filled, identity, tmp_path) -> None:
    cache, tokens = filled
    one_file = save_cache_file(tmp_path / "probe.safetensors", cache, tokens, identity)
    folder = CacheFolder(tmp_path / "caches", budget_bytes=int(2.5 * one_file))
    for conversation in (1, 2):
        folder.save(conversation, cache, tokens, identity)
        time.sleep(0.01)
    folder.load(1, identity)  # 1 is now more recent than 2
    time.sleep(0.01)
    folder.save(3, cache, tokens, identity)
    assert [p.name for p in folder.files()] == ["conversation-1.safetensors", "conversation-3.safetensors"]
    assert folder.bytes_on_disk() <= folder.budget_bytes
    assert folder.delete(3) and not folder.path_for(3).exists() and not folder.delete(3)
    tiny = CacheFolder(tmp_path / "tiny", budget_bytes=one_file // 2)
    with pytest.raises(SavedCacheError, match="larger than the disk budget"):
        tiny.save(9, cache, tokens, identity)
    assert tiny.files() == []


_SAVER = """
import sys
from engine.runtime import prepare_runtime
prepare_runtime()
from pathlib import Path
import mlx.core as mx
from engine.chat.saved_cache import CacheIdentity, save_cache_file
from engine.kvcache import KVCacheBuilder, KVCacheConfig
from engine.models.catalog import load_model
model, tokenizer, _ = load_model(sys.argv[1])
cache = KVCacheBuilder(KVCacheConfig(method="kivi", key_bits=4, value_bits=4, group_size=64)).for_model(model).build()
ids = list(range(100, 1100))
model(mx.array(ids)[None], cache=cache)
mx.eval([c.state for c in cache])
saves = 0
while True:
    save_cache_file(sys.argv[2], cache, ids, CacheIdentity("m", "t", "c"))
    saves += 1
    print(f"saved {saves}", flush=True)
"""


def test_kill_during_a_save_leaves_the_previous_file_intact(filled, identity, tmp_path, default_model_path) -> None:
    cache, tokens = filled
    path = tmp_path / "conversation-7.safetensors"
    save_cache_file(path, cache, tokens, identity)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for delay in (0.0, 0.004, 0.011):  # kill at several points of a save in flight
        saver = subprocess.Popen([sys.executable, "-c", _SAVER, str(default_model_path), str(path)],
                                 stdout=subprocess.PIPE, text=True, env=env)
        while saver.stdout.readline().strip() != "saved 3":
            assert saver.poll() is None, "the saver died on its own"
        time.sleep(delay)
        saver.send_signal(signal.SIGKILL)
        saver.wait()
        # Whatever moment it died at, the file is a whole cache: ours, or a complete one from the saver.
        try:
            _cache, held = load_cache_file(path, identity)
            assert held == tokens
        except SavedCacheError as refusal:
            assert "another model" in str(refusal)  # the saver's complete file, with its own identity
            _cache, held = load_cache_file(path, CacheIdentity("m", "t", "c"))
            assert held == list(range(100, 1100))
    assert [p.name for p in tmp_path.glob("conversation-*")] == [path.name]
    # A killed saver may leave its temporary file; the folder sweeps such leftovers once they are old.
    leftovers = list(tmp_path.glob(".*partial*"))
    for leftover in leftovers:
        os.utime(leftover, (time.time() - 3600, time.time() - 3600))
    CacheFolder(tmp_path).enforce_budget()
    assert not list(tmp_path.glob(".*partial*")) and path.exists()


def _turn(session: ChatSession, question: str) -> None:
    for _event in session.send(question):
        pass


def test_a_session_restores_its_cache_re_encoding_one_saved_at_another_level(smollm, default_model_path,
                                                                             tmp_path) -> None:
    model, tokenizer, _ = smollm
    settings = GenerationSettings(max_tokens=6)
    live = ChatSession(model, tokenizer, settings=settings)
    live.set_compression(KIVI4)
    _turn(live, "Name a colour.")
    folder = CacheFolder(tmp_path)
    size = save_session_cache(folder, 5, live, default_model_path)
    metadata = read_cache_metadata(folder.path_for(5))  # the header only
    assert metadata["config"] == "kivi:k4v4:g64" and size == folder.path_for(5).stat().st_size

    same = ChatSession(model, tokenizer, settings=settings)
    same.set_compression(KIVI4)
    assert restore_session_cache(folder, 5, same, default_model_path).tokens == len(live.cached_tokens)
    assert same.cached_tokens == live.cached_tokens

    lower = ChatSession(model, tokenizer, settings=settings)
    lower.set_compression(KVCacheConfig(method="kivi", key_bits=2, value_bits=2, group_size=64))
    restored = restore_session_cache(folder, 5, lower, default_model_path)
    assert restored.tokens == len(live.cached_tokens) and restored.reencoded_from == "kivi:k4v4:g64"
    assert lower.compression.key_bits == 2 and lower.cached_tokens == live.cached_tokens
    lower.history = list(live.history)  # the conversation, as a reopened session gets it from the store
    _turn(lower, "Another one?")
    assert lower.last_stats.reused_tokens == restored.tokens

    other_template = ChatSession(model, tokenizer, system_prompt="Answer in French.", settings=settings)
    other_template.set_compression(KIVI4)
    refused = restore_session_cache(folder, 5, other_template, default_model_path)
    assert refused.tokens == 0 and "another chat template" in refused.refusal
    assert other_template.cached_tokens == []
    assert restore_session_cache(folder, 6, same, default_model_path).refusal == ""  # no file: nothing to say
    (tmp_path / "conversation-7.safetensors").write_bytes(b"\x01" * 4)
    assert "damaged or truncated" in restore_session_cache(folder, 7, same, default_model_path).refusal
