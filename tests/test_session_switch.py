"""Live compression switch on the real model: re-encode without re-prefill, bytes drop, chat goes on."""

from __future__ import annotations

import pytest

from engine.chat.session import ChatSession, GenerationSettings, GenerationStats, TextChunk
from engine.errors import ConfigError
from engine.kvcache import KVCacheConfig
from engine.planning.memory import kv_cache_bytes


def run(session: ChatSession, text: str) -> tuple[str, GenerationStats]:
    reply, stats = "", None
    for event in session.send(text):
        if isinstance(event, TextChunk):
            reply += event.text
        elif isinstance(event, GenerationStats):
            stats = event
    return reply, stats


@pytest.fixture()
def session(smollm):
    model, tokenizer, info = smollm
    return ChatSession(model, tokenizer, settings=GenerationSettings(max_tokens=20))


def test_switch_down_reencodes_without_prefill_and_bytes_drop(session):
    run(session, "What is the capital of France?")
    held = session.cache_offset
    report = session.set_compression(KVCacheConfig(method="rotated", key_bits=4, value_bits=4))
    assert not report.reprefilled and report.tokens == held
    assert report.bytes_after < report.bytes_before / 3
    assert report.bytes_after == kv_cache_bytes(session.prompt_cache) == session.kv_cache_bytes()
    assert session.cache_offset == held == len(session.cached_tokens)
    reply, stats = run(session, "And what is the capital of Italy?")
    assert stats.reused_tokens >= held - 1  # nothing was re-prefilled
    assert "Rome" in reply


def test_switch_up_says_what_it_did_and_can_reprefill(session):
    run(session, "Name a planet.")
    session.set_compression(KVCacheConfig(method="affine", key_bits=2, value_bits=2, group_size=32))
    up = session.set_compression(KVCacheConfig(method="affine", key_bits=8, value_bits=8))
    assert not up.reprefilled and "reprefill" in up.note
    exact = session.set_compression(None, reprefill=True)
    assert exact.reprefilled and exact.tokens == session.cache_offset
    # Rebuilt exactly: the same as a cache built from scratch on these tokens.
    model, tokenizer = session.model, session.tokenizer
    fresh = ChatSession(model, tokenizer, settings=session.settings)
    fresh.history = list(session.history)
    a, _ = run(session, "Name another one.")
    b, _ = run(fresh, "Name another one.")
    assert a == b


def test_switch_mid_generation_is_applied_between_turns(session):
    stream = session.send("Count from one to twenty in words.")
    for event in stream:
        if isinstance(event, TextChunk) and len(session.history) >= 1:
            session.cancel()  # the worker stops the reply, then switches
    report = session.set_compression(KVCacheConfig(method="rotated", key_bits=3, value_bits=3, group_size=32))
    assert report.tokens == session.cache_offset
    reply, stats = run(session, "What is the capital of France?")
    assert stats.finish_reason in {"stop", "length"} and reply


def test_invalid_config_is_refused_before_touching_the_cache(session):
    run(session, "Hello!")
    before = session.kv_cache_bytes()
    with pytest.raises(ConfigError):
        session.set_compression(KVCacheConfig(method="nope"))
    with pytest.raises(ConfigError):
        session.set_compression(KVCacheConfig(method="affine", key_bits=7, value_bits=7))
    assert session.kv_cache_bytes() == before and session.compression is None
