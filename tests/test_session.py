"""ChatSession on the real SmolLM2 model: answers, cross-turn cache reuse, cancel, overflow."""

from __future__ import annotations

import pytest

from engine.chat.documents import Document
from engine.chat.session import ChatSession, GenerationSettings, GenerationStats, PrefillProgress, TextChunk
from engine.errors import ContextOverflowError


def run(session: ChatSession, text: str, **kwargs) -> tuple[str, GenerationStats]:
    reply = ""
    stats = None
    for event in session.send(text, **kwargs):
        if isinstance(event, TextChunk):
            reply += event.text
        elif isinstance(event, GenerationStats):
            stats = event
    assert stats is not None
    return reply, stats


@pytest.fixture()
def session(smollm):
    model, tokenizer, info = smollm
    return ChatSession(model, tokenizer, context_length=info.max_context,
                       settings=GenerationSettings(max_tokens=40))


def test_capital_of_france_mentions_paris(session):
    reply, stats = run(session, "What is the capital of France?")
    assert "Paris" in reply
    assert stats.finish_reason == "stop"
    assert stats.generated_tokens > 0 and stats.decode_tokens_per_second > 0
    assert stats.peak_memory_bytes > 0 and stats.kv_cache_bytes > 0


def test_second_turn_prefills_only_new_tokens(session):
    _, first = run(session, "What is the capital of France?")
    assert first.reused_tokens == 0 and first.prefilled_tokens == first.prompt_tokens
    cached_after_first = session.cache_offset
    reply, second = run(session, "And what is the capital of Germany?")
    # Everything up to the end of the first reply is reused; only the new user turn is run.
    assert second.reused_tokens >= cached_after_first - 1
    assert second.prefilled_tokens == second.prompt_tokens - second.reused_tokens
    assert second.prefilled_tokens < 25
    assert "Berlin" in reply
    # The cache holds exactly the tokens the session believes it holds.
    assert session.cache_offset == len(session.cached_tokens)
    rendered = session.render_tokens()
    assert rendered[: second.prompt_tokens - 1] == session.cached_tokens[: second.prompt_tokens - 1]


def test_reused_cache_gives_same_answer_as_fresh_prefill(smollm):
    model, tokenizer, info = smollm
    settings = GenerationSettings(max_tokens=24)
    warm = ChatSession(model, tokenizer, settings=settings)
    run(warm, "Name a large mammal.")
    warm_reply, warm_stats = run(warm, "How heavy can it get?")
    assert warm_stats.reused_tokens > 0
    cold = ChatSession(model, tokenizer, settings=settings)
    cold.history = [m for m in warm.history[:2]]
    cold_reply, cold_stats = run(cold, "How heavy can it get?")
    assert cold_stats.reused_tokens == 0
    assert cold_reply == warm_reply


def test_cancel_mid_stream_leaves_consistent_cache_and_history(session):
    pieces = 0
    for event in session.send("Write a long story about a dragon who learns to read."):
        if isinstance(event, TextChunk):
            pieces += 1
            if pieces == 5:
                session.cancel()
        if isinstance(event, GenerationStats):
            stats = event
    assert stats.finish_reason == "cancelled"
    assert session.history[-1].role == "assistant" and session.history[-1].cancelled
    assert session.cache_offset == len(session.cached_tokens)
    # The next turn works and reuses the cache up to the partial reply.
    reply, next_stats = run(session, "What is the capital of France?")
    assert "Paris" in reply
    assert next_stats.reused_tokens > 20


def test_abandoning_the_stream_also_settles_the_cache(session):
    stream = session.send("Tell me about the sea.")
    for event in stream:
        if isinstance(event, TextChunk):
            break
    stream.close()  # what happens on Ctrl-C or when a consumer stops iterating
    assert session.cache_offset == len(session.cached_tokens)
    assert session.history[-1].role == "assistant"


def test_overflow_is_an_error_that_says_by_how_much(smollm):
    model, tokenizer, _ = smollm
    session = ChatSession(model, tokenizer, context_length=256, settings=GenerationSettings(max_tokens=32))
    long_text = "The quick brown fox jumps over the lazy dog. " * 60
    session.attach_document(Document(None, "fox.txt", "txt", long_text, len(long_text)))
    with pytest.raises(ContextOverflowError) as caught:
        list(session.send("What does the fox do?"))
    error = caught.value
    assert error.overflow_tokens > 0 and str(error.overflow_tokens) in str(error)
    assert session.history == []  # nothing half-done is recorded


def test_truncate_middle_policy_fits_and_says_so(smollm):
    model, tokenizer, _ = smollm
    settings = GenerationSettings(max_tokens=16, overflow_policy="truncate-middle")
    session = ChatSession(model, tokenizer, context_length=256, settings=settings)
    text = "Alpha starts here. " + "Filler sentence about nothing. " * 80 + "Omega ends here."
    session.attach_document(Document(None, "long.txt", "txt", text, len(text)))
    notices = []
    for event in session.send("What word starts the document?"):
        if type(event).__name__ == "Notice":
            notices.append(event.text)
        if isinstance(event, GenerationStats):
            assert event.prompt_tokens <= 256 - 16
    assert notices and "middle" in notices[0]


def test_drop_oldest_policy_drops_turns(smollm):
    model, tokenizer, _ = smollm
    settings = GenerationSettings(max_tokens=16, overflow_policy="drop-oldest")
    session = ChatSession(model, tokenizer, context_length=160, settings=settings)
    notices = []
    for question in ["Say hello.", "Say goodbye.", "Name a colour.", "Name a fruit.", "Name a city."]:
        for event in session.send(question):
            if type(event).__name__ == "Notice":
                notices.append(event.text)
    assert any("oldest" in n for n in notices)
    assert len(session.history) == 10  # the visible history is kept whole


def test_document_prefill_reports_progress_and_is_reused(smollm):
    model, tokenizer, _ = smollm
    session = ChatSession(model, tokenizer, settings=GenerationSettings(max_tokens=12, prefill_chunk=64))
    text = "The lighthouse keeper's name was Ingrid Solberg. " + "She kept the lamp lit every night. " * 20
    session.attach_document(Document(None, "keeper.txt", "txt", text, len(text)))
    progress = [event for event in session.prefill_pending() if isinstance(event, PrefillProgress)]
    assert progress[-1].done == progress[-1].total and len(progress) > 3
    ingested = session.cache_offset
    _, stats = run(session, "What was the keeper's name?")
    assert stats.reused_tokens >= ingested - 2


def test_regenerate_at_the_4_bit_level_reuses_whole_key_blocks_and_answers_the_same(smollm):
    """Regenerating cuts the cache back to the question. At the 4-bit level (KIVI key blocks, 128 tokens) a cut
    inside a quantized block goes back to the block's start and runs the question's tail again, so the
    question is read as in the first turn (16-bit) and, greedily, the reply is the same."""
    from engine.kvcache import KVCacheBuilder
    from engine.planning.recommend import level_by_key

    model, tokenizer, _ = smollm
    config = level_by_key("4").config
    session = ChatSession(
        model, tokenizer, settings=GenerationSettings(max_tokens=64),
        cache_factory=lambda m: KVCacheBuilder(config).for_model(m).build(),
    )
    question = ("Here is a list of fruits: apples, pears, plums, cherries, figs, dates, grapes, lemons, limes, "
                "oranges, peaches and quinces. They grow in orchards and gardens, on trees and on vines, in warm "
                "valleys and on cool hillsides; some are picked in early summer, others only when the first "
                "frosts come, and each has its own colour, scent and season. Farmers sell them at markets in "
                "town squares, children eat them straight from the branch, and cooks turn them into jams, pies, "
                "juices and preserves that last through the winter. In the old days every village had its own "
                "varieties, grafted by hand and handed down in families, and travellers carried seeds and "
                "cuttings along the roads from one valley to the next. Write a short poem that names four of them.")
    first_reply, first = run(session, question)
    replies, again = "", None
    for event in session.regenerate():
        if isinstance(event, TextChunk):
            replies += event.text
        elif isinstance(event, GenerationStats):
            again = event
    cut = first.prompt_tokens - 1  # the regenerated turn reuses at most the question less its last token
    block = session.prompt_cache[0].token_block
    block_start = cut // block * block
    # cut inside a quantized block, past the first one, and in its second half (a cut back to a 64-token
    # boundary would still split it)
    assert block_start and cut % block >= 64 and first.prompt_tokens + first.generated_tokens > block_start + block
    assert again.reused_tokens == block_start
    assert replies == first_reply
