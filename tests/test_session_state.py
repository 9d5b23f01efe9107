"""ChatSession keeps its own state consistent: a turn or a switch that fails leaves history, attached documents
and cache as they were (real SmolLM2 model; failures inside the model are simulated by a failing layer)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.chat.documents import Document
from engine.chat.session import ChatSession, GenerationSettings, GenerationStats, TextChunk
from engine.errors import ConfigError, ContextOverflowError
from engine.kvcache import KVCacheBuilder, KVCacheConfig, get_method, reencode_caches


def run(events: Any) -> tuple[str, GenerationStats]:
    reply, stats = "", None
    for event in events:
        if isinstance(event, TextChunk):
            reply += event.text
        elif isinstance(event, GenerationStats):
            stats = event
    assert stats is not None
    return reply, stats


@dataclass
class Snapshot:
    """Everything a failed call must leave as it was."""

    history: list[Any]
    pending: list[Document]
    cached_tokens: list[int]
    offsets: list[int]
    cache: list[Any]
    compression: Any

    @classmethod
    def of(cls, session: ChatSession) -> Snapshot:
        return cls([*session.history], [*session.pending_documents], [*session.cached_tokens],
                   [c.offset for c in session.prompt_cache], session.prompt_cache, session.compression)


def assert_unchanged(session: ChatSession, before: Snapshot) -> None:
    assert session.history == before.history
    assert [id(d) for d in session.pending_documents] == [id(d) for d in before.pending]
    assert session.cached_tokens == before.cached_tokens
    assert session.prompt_cache is before.cache and [c.offset for c in session.prompt_cache] == before.offsets
    assert session.compression == before.compression


def assert_cache_consistent(session: ChatSession) -> None:
    """Every layer holds exactly `cached_tokens`, and they are a prefix of what the next turn renders."""
    assert {c.offset for c in session.prompt_cache} == {len(session.cached_tokens)}
    rendered = session.render_tokens()
    assert rendered[: len(session.cached_tokens)] == session.cached_tokens


class FailingLayer:
    """Stands in for one decoder layer: the layers before it have already stored the chunk in their caches."""

    use_sliding = False  # read by mlx-lm's Llama loop before the layer is called

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated failure inside the model (e.g. out of memory)")


@contextmanager
def failing_layer(model: Any, index: int) -> Iterator[None]:
    layers = model.layers  # the model's own list: the shared test model gets its layer back afterwards
    original, layers[index] = layers[index], FailingLayer()
    try:
        yield
    finally:
        layers[index] = original


@pytest.fixture()
def session(smollm):
    model, tokenizer, info = smollm
    return ChatSession(model, tokenizer, context_length=info.max_context, settings=GenerationSettings(max_tokens=16))


def test_regenerate_that_does_not_fit_changes_nothing(session):
    first, _ = run(session.send("Name a colour."))
    before = Snapshot.of(session)
    too_long = GenerationSettings(max_tokens=session.context_length)  # no room left for the prompt
    with pytest.raises(ContextOverflowError):
        run(session.regenerate(too_long))
    assert_unchanged(session, before)
    assert session.history[-1].content == first
    # And the session goes on: a regenerate that fits replaces the reply, reusing the cached question.
    _, stats = run(session.regenerate())
    assert len(session.history) == 2 and session.history[-2] == before.history[-2]
    assert stats.reused_tokens > 0
    assert_cache_consistent(session)


def test_send_that_does_not_fit_keeps_the_attached_document(session, tmp_path):
    run(session.send("Hello!"))
    document = Document(tmp_path / "note.txt", "note.txt", "txt", "The code word is heliotrope.", 28)
    session.attach_document(document)
    before = Snapshot.of(session)
    with pytest.raises(ContextOverflowError):
        run(session.send("What is the code word?", GenerationSettings(max_tokens=session.context_length)))
    assert_unchanged(session, before)
    assert session.pending_documents == [document]


def test_a_failure_inside_the_model_undoes_the_turn(session, tmp_path):
    run(session.send("What is the capital of France?"))
    document = Document(tmp_path / "doc.txt", "doc.txt", "txt", "Some attached text.", 19)
    session.attach_document(document)
    before = Snapshot.of(session)
    with failing_layer(session.model, 10), pytest.raises(RuntimeError, match="simulated failure"):
        run(session.send("And of Italy?"))
    # Layers 0-9 had stored part of the new chunk before layer 10 failed: all are cut back alike.
    assert session.history == before.history and session.pending_documents == [document]
    assert_cache_consistent(session)
    assert session.cached_tokens == before.cached_tokens[: len(session.cached_tokens)]
    reply, stats = run(session.send("And of Italy?"))
    assert "Rome" in reply and stats.reused_tokens > 0
    assert [m.role for m in session.history] == ["user", "assistant"] * 2
    assert session.history[-2].documents == [document]
    assert_cache_consistent(session)


def test_a_failure_while_regenerating_keeps_the_old_reply(session):
    first, _ = run(session.send("Name a fruit."))
    before = Snapshot.of(session)
    with failing_layer(session.model, 3), pytest.raises(RuntimeError):
        run(session.regenerate())
    assert session.history == before.history and session.history[-1].content == first
    assert_cache_consistent(session)


def test_the_live_switch_runs_the_builders_reencode(session):
    """What `velox bench speed` times (builder.reencode_caches) is what the session's switch produces."""
    run(session.send("Tell me about rivers."))
    config = KVCacheConfig.parse("kivi:k4v4:g64")
    resolved = KVCacheBuilder(config).for_model(session.model).config
    expected = reencode_caches(session.prompt_cache, resolved)
    session.set_compression(config)
    assert len(session.prompt_cache) == len(expected)
    for mine, theirs in zip(session.prompt_cache, expected, strict=True):
        assert type(mine) is type(theirs) and mine.offset == theirs.offset
        for a, b in zip(tree_flatten(mine.state), tree_flatten(theirs.state), strict=True):
            assert a[0] == b[0]
            assert mx.array_equal(a[1], b[1]).item() if isinstance(a[1], mx.array) else a[1] == b[1]
        assert mine.config == theirs.config


def test_a_switch_that_fails_half_way_changes_nothing(session, monkeypatch):
    run(session.send("Name a mountain."))
    before = Snapshot.of(session)
    bytes_before = session.kv_cache_bytes()
    kivi = get_method("kivi")
    real_load = kivi.load_dense
    loaded = []

    def fail_on_the_third_layer(self, chunks):
        if len(loaded) == 2:
            raise RuntimeError("simulated failure while re-encoding")
        loaded.append(self.layer_index)
        return real_load(self, chunks)

    monkeypatch.setattr(kivi, "load_dense", fail_on_the_third_layer)
    with pytest.raises(RuntimeError, match="re-encoding"):
        session.set_compression(KVCacheConfig.parse("kivi:k4v4:g64"))
    assert loaded == [0, 1]
    assert_unchanged(session, before)
    assert session.kv_cache_bytes() == bytes_before
    with pytest.raises(ConfigError):  # refused before anything is touched
        session.set_compression(KVCacheConfig.parse("kivi:k7"))
    assert_unchanged(session, before)
    monkeypatch.undo()
    run(session.send("How high is it?"))
    assert_cache_consistent(session)
