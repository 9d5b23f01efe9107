"""The app's controller and engine worker, without a window, against the real SmolLM2 model.

Every test drives ChatController exactly as the window does (send, stop, regenerate, switch compression,
reopen) and checks what a person would see and what is on disk.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.controller import ChatController, overflow_question, reply_caption
from app.settings import Settings, load_settings, save_settings
from app.store import ConversationStore
from engine.chat.session import GenerationStats, Message
from engine.models.catalog import hf_cached_snapshot
from engine.planning.recommend import level_by_key
from tests.app_helpers import WAIT_MS, attach_and_ingest, reply, wait_idle
from tests.hub_server import HubState, serve_hub


@pytest.fixture()
def make_controller(tmp_path, smollm, qtbot):
    """Build controllers on one store file (a second call is a restart); all are shut down afterwards."""
    made: list[ChatController] = []

    def make(max_tokens: int = 12) -> ChatController:
        store = ConversationStore(tmp_path / "velox.sqlite3")
        settings_file = tmp_path / "settings.json"
        if not settings_file.exists():  # the first start; a restart reads what the last run saved
            save_settings(Settings(max_tokens=max_tokens, compression="16"), settings_file)
        controller = ChatController(store, None, settings_file)
        made.append(controller)
        controller.start(loaded=smollm)
        qtbot.waitUntil(lambda: controller.model is not None and not controller.busy, timeout=WAIT_MS)
        return controller

    yield make
    for controller in made:
        controller.shutdown()
        controller.store.close()


def test_send_streams_a_reply_and_saves_both_messages(make_controller, qtbot):
    controller = make_controller()
    streamed: list[str] = []
    controller.replyStreaming.connect(streamed.append)
    finished = []
    controller.replyFinished.connect(finished.append)

    reply(qtbot, controller, "What is the capital of France?")

    assert streamed, "the reply arrived in pieces while it was generated"
    assert finished and finished[0].text == streamed[-1]
    assert "Paris" in finished[0].text
    assert [e.role for e in controller.entries] == ["user", "assistant"]
    assert "tok/s" in controller.entries[-1].caption
    _meta, stored = controller.store.load_conversation(controller.conversation_id)
    assert [(m.role, m.content) for m in stored] == [("user", "What is the capital of France?"),
                                                     ("assistant", finished[0].text)]
    assert stored[1].stats["generated_tokens"] > 0 and stored[1].compression == "Off (16-bit)"


def test_stop_keeps_the_partial_reply_marked_as_stopped(make_controller, qtbot):
    controller = make_controller(max_tokens=24)
    chunks: list[str] = []

    def stop_after_two(text: str) -> None:
        chunks.append(text)
        if len(chunks) == 2:
            controller.stop()

    controller.replyStreaming.connect(stop_after_two)
    reply(qtbot, controller, "Write a long story about a dragon who learns to read.")

    entry = controller.entries[-1]
    assert entry.cancelled and entry.caption.endswith("stopped")
    assert entry.stats.finish_reason == "cancelled"
    assert entry.stats.generated_tokens < 24
    _meta, stored = controller.store.load_conversation(controller.conversation_id)
    assert stored[-1].cancelled and stored[-1].content == entry.text
    # The session is consistent: the next question works and reuses the cache.
    reply(qtbot, controller, "Thanks. What is 2 + 2?")
    assert controller.last_stats.reused_tokens > 0
    assert not controller.entries[-1].cancelled


def test_regenerate_replaces_the_last_reply_on_disk(make_controller, qtbot):
    controller = make_controller()
    reply(qtbot, controller, "Name a colour.")
    first_reply = controller.entries[-1].text
    assert controller.regenerate()
    wait_idle(qtbot, controller)
    _meta, stored = controller.store.load_conversation(controller.conversation_id)
    assert [m.role for m in stored] == ["user", "assistant"]
    # Greedy decoding of the same prompt gives the same reply, now stored once.
    assert stored[-1].content == controller.entries[-1].text == first_reply
    assert len(controller.entries) == 2


def test_compression_switch_mid_chat_shrinks_the_held_cache(make_controller, qtbot):
    controller = make_controller()
    reply(qtbot, controller, "What is the capital of France?")
    held_before = controller.kv_held
    assert held_before > 0
    reports = []
    controller.compressionChanged.connect(reports.append)

    controller.set_compression("4")
    qtbot.waitUntil(lambda: bool(reports) and not controller.busy, timeout=WAIT_MS)

    report = reports[-1]
    assert report.available, report.message
    assert report.after < report.before / 2
    assert controller.kv_held == report.after < held_before
    assert controller.level_key == "4" and controller.settings.compression == "4"
    # The conversation goes on in the compressed cache without re-reading it.
    reply(qtbot, controller, "And of Germany?")
    assert controller.last_stats.reused_tokens > 0
    assert controller.entries[-1].text
    _meta, stored = controller.store.load_conversation(controller.conversation_id)
    assert stored[-1].compression.startswith("4-bit")


def test_a_compression_switch_that_would_not_fit_is_refused_and_the_chat_goes_on(make_controller, qtbot, monkeypatch):
    """A live switch re-encodes the held cache while it is still held, so it is checked against the memory free now
    (engine.planning.recommend.check_switch_fits) before anything is re-encoded: refused with the reason, the level and
    the cache are as they were, and the conversation goes on at that level."""
    import app.worker

    controller = make_controller()
    reply(qtbot, controller, "What is the capital of France?")
    held_before = controller.kv_held
    level_before = controller.level_key
    reports = []
    controller.compressionChanged.connect(reports.append)
    tiny = {"total": 8_000_000_000, "available": 1_000_000, "used": 7_999_000_000, "percent": 99.9,
            "pressure": "critical"}
    with monkeypatch.context() as patched:
        patched.setattr(app.worker, "system_memory", lambda: dict(tiny))
        controller.set_compression("16")
        qtbot.waitUntil(lambda: bool(reports) and not controller.busy, timeout=WAIT_MS)
    report = reports[-1]
    assert not report.available
    assert report.message.startswith("Switching") and "free can be used safely" in report.message, report.message
    assert controller.level_key == level_before and controller.kv_held == held_before
    reply(qtbot, controller, "And of Germany?")  # the memory back: the chat goes on in the cache it had
    assert controller.last_stats.reused_tokens > 0 and controller.entries[-1].text


def test_restart_reopens_the_last_conversation(make_controller, qtbot):
    first = make_controller()
    reply(qtbot, first, "What is the capital of France?")
    texts = [(e.role, e.text) for e in first.entries]
    first.shutdown()

    restarted = make_controller()
    assert [(e.role, e.text) for e in restarted.entries] == texts
    # The saved reply keeps its figures: the same GenerationStats, so the same caption.
    assert restarted.entries[-1].stats == first.entries[-1].stats is not None
    assert restarted.entries[-1].caption == first.entries[-1].caption and "tok/s" in first.entries[-1].caption
    assert restarted.conversation_id == first.conversation_id
    # The engine got the history back: a follow-up sees the earlier turn.
    qtbot.waitUntil(lambda: restarted.engine.worker.session is not None
                    and len(restarted.engine.worker.session.history) == 2, timeout=WAIT_MS)
    reply(qtbot, restarted, "And of Germany?")
    assert restarted.last_stats.prompt_tokens > 40  # both turns were in the prompt
    assert len(restarted.store.load_conversation(restarted.conversation_id)[1]) == 4


def test_settings_are_remembered_and_applied_after_a_restart(make_controller, qtbot, tmp_path):
    first = make_controller()
    first.set_compression("8")
    qtbot.waitUntil(lambda: first.level_key == "8" and not first.busy, timeout=WAIT_MS)
    first.shutdown()
    saved = load_settings(tmp_path / "settings.json")
    assert saved.compression == "8" and saved.max_tokens == 12
    assert saved.last_model.endswith("SmolLM2-135M-Instruct")

    restarted = make_controller()
    # the worker applies the saved compression after it loads the model: the level shows "8" before that
    qtbot.waitUntil(lambda: restarted.level_key == "8" and not restarted.busy
                    and restarted.engine.worker.session is not None
                    and restarted.engine.worker.session.compression is not None, timeout=WAIT_MS)
    session = restarted.engine.worker.session
    assert session.compression.key_bits == 8
    assert session.settings.max_tokens == 12
    assert restarted.compression_label() == f"8-bit ({level_by_key('8').config.method})"


def test_context_overflow_asks_instead_of_failing_silently(make_controller, qtbot):
    controller = make_controller()
    qtbot.waitUntil(lambda: controller.engine.worker.session is not None, timeout=WAIT_MS)
    controller.engine.worker.session.context_length = 40  # a tiny context, so one question overflows
    asked = []
    controller.overflowChoiceNeeded.connect(asked.append)

    assert controller.send("Please summarise the history of the Roman Empire in great detail for me now.")
    qtbot.waitUntil(lambda: bool(asked) and not controller.busy, timeout=WAIT_MS)

    assert "overflows" in asked[0].message and asked[0].needed > asked[0].limit == 40
    assert asked[0].text.startswith("Please summarise") and not asked[0].regenerate
    assert controller.entries == []  # the unsent question is not shown as sent ...
    assert controller.conversation_id is None  # ... nor saved
    notices = []
    controller.noticeRaised.connect(notices.append)
    controller.resolve_overflow(asked[0], None)
    assert notices and "Nothing was sent" in notices[0]


def test_a_regenerate_that_overflows_keeps_the_conversation(make_controller, qtbot):
    """The session refuses the turn before changing anything, so the worker has nothing to repair."""
    controller = make_controller()
    reply(qtbot, controller, "Name a colour.")
    session = controller.engine.worker.session
    history, cached = list(session.history), list(session.cached_tokens)
    question = session.render_tokens(history[:-1])
    session.context_length = len(question) + 11  # the question fits, room for a 12-token reply does not
    asked = []
    controller.overflowChoiceNeeded.connect(asked.append)
    assert controller.regenerate()
    qtbot.waitUntil(lambda: bool(asked) and not controller.busy, timeout=WAIT_MS)
    assert asked[0].regenerate is True and asked[0].needed == asked[0].limit + 1
    assert session.history == history and session.cached_tokens == cached and session.pending_documents == []
    assert [e.role for e in controller.entries] == ["user", "assistant"]
    assert controller.entries[-1].text == history[-1].content


def overflow_of(qtbot, controller: ChatController, text: str):
    """Send `text` and return the Overflow the controller asked about (the turn must overflow)."""
    asked = []
    controller.overflowChoiceNeeded.connect(asked.append)
    try:
        assert controller.send(text)
        qtbot.waitUntil(lambda: bool(asked) and not controller.busy, timeout=WAIT_MS)
    finally:
        controller.overflowChoiceNeeded.disconnect(asked.append)
    return asked[0]


def test_a_single_turn_that_overflows_is_offered_nothing_that_cannot_work(make_controller, qtbot):
    """One question, no document: dropping older turns cannot help, so it is not offered; the dialog says plainly
    that the message does not fit, and a forced 'drop-oldest' answer sends nothing."""
    controller = make_controller()
    controller.engine.worker.session.context_length = 40
    info = overflow_of(qtbot, controller, "Please summarise the history of the Roman Empire in great detail for me.")

    assert info.remedies == () and not info.has_documents
    question = overflow_question(info)
    assert question.choices == ()
    assert "overflows by" in question.detail and "Shorten the message" in question.detail
    assert "drop" not in question.detail.lower()
    notices = []
    controller.noticeRaised.connect(notices.append)
    controller.resolve_overflow(info, "drop-oldest")
    assert notices == ["Nothing was sent: 'drop-oldest' cannot make this conversation fit."]
    assert not controller.busy and controller.entries == [] and controller.store.list_conversations() == []


def test_an_overflow_after_earlier_turns_offers_dropping_them_and_that_answers(make_controller, qtbot):
    controller = make_controller()
    reply(qtbot, controller, "Name a colour.")
    session = controller.engine.worker.session
    question = "Name a fruit."
    alone = len(session.render_tokens([Message("user", question)]))
    session.context_length = alone + 12 + 4  # the question alone fits with room for its reply; the history not
    info = overflow_of(qtbot, controller, question)

    assert info.remedies == ("drop-oldest",)
    assert overflow_question(info).choices == (("drop-oldest", "Drop the oldest turns"),)
    finished = []
    controller.replyFinished.connect(finished.append)
    controller.resolve_overflow(info, "drop-oldest")
    qtbot.waitUntil(lambda: bool(finished) and not controller.busy, timeout=WAIT_MS)
    answered = session.tokenizer.decode(session.cached_tokens)
    assert finished[0].text and question in answered and "colour" not in answered  # the older turn left out
    _meta, stored = controller.store.load_conversation(controller.conversation_id)
    assert [m.content for m in stored if m.role == "user"] == ["Name a colour.", question]  # nothing lost on disk


def test_a_single_turn_with_a_document_that_overflows_is_offered_only_the_cut(make_controller, qtbot, tmp_path):
    controller = make_controller()
    path = tmp_path / "harbour.txt"
    path.write_text(" ".join(f"On day {day} the harbour master counted {day * 7} boats and wrote it down."
                             for day in range(1, 40)), encoding="utf-8")
    ingested = attach_and_ingest(qtbot, controller, path)
    assert not ingested.cancelled and ingested.tokens > 300
    session = controller.engine.worker.session
    question = "How many boats were counted on day 3?"
    whole = len(session.render_tokens([Message("user", question, list(session.pending_documents))]))
    session.context_length = whole + 12 - 100  # 100 tokens too many: the document's middle can give them

    info = overflow_of(qtbot, controller, question)
    assert info.has_documents and info.remedies == ("truncate-middle",)
    assert overflow_question(info).choices == (("truncate-middle", "Leave out the middle of the document"),)
    assert controller.entries == [] and controller.pending_documents  # nothing sent, the document still waits
    finished = []
    controller.replyFinished.connect(finished.append)
    controller.resolve_overflow(info, "truncate-middle")
    qtbot.waitUntil(lambda: bool(finished) and not controller.busy, timeout=WAIT_MS)
    assert finished[0].text and not finished[0].cancelled
    assert "tokens omitted" in session.tokenizer.decode(session.cached_tokens)  # the answer read the cut document
    _meta, stored = controller.store.load_conversation(controller.conversation_id)
    assert stored[0].documents[0].name == "harbour.txt" and "day 39" in stored[0].documents[0].text


def test_a_document_too_long_even_when_cut_says_so_and_offers_nothing(make_controller, qtbot, tmp_path):
    controller = make_controller()
    path = tmp_path / "harbour.txt"
    path.write_text(" ".join(f"Boat {n} came in." for n in range(1, 60)), encoding="utf-8")
    attach_and_ingest(qtbot, controller, path)
    session = controller.engine.worker.session
    question = "Which boat came in last? " * 8
    bare = len(session.render_tokens([Message("user", question)]))
    session.context_length = bare + 12 + 20  # the question fits, but even a cut document (64 tokens kept) not

    info = overflow_of(qtbot, controller, question)
    assert info.has_documents and info.remedies == ()
    question_shown = overflow_question(info)
    assert question_shown.choices == () and "shorten the message or the document" in question_shown.detail


def test_reply_caption_reads_like_a_status_line():
    stats = GenerationStats(prompt_tokens=60, prefilled_tokens=60, reused_tokens=0, generated_tokens=42,
                            prefill_tokens_per_second=300.0, decode_tokens_per_second=31.46,
                            time_to_first_token=0.4213, peak_memory_bytes=1, kv_cache_bytes=1, finish_reason="stop")
    assert reply_caption(stats) == "42 tokens · 31.5 tok/s · first token 0.42 s"
    assert reply_caption(replace(stats, finish_reason="cancelled")).endswith("· stopped")
    assert reply_caption(None, cancelled=True) == "stopped"


def test_a_reply_that_would_not_fit_in_memory_is_refused_with_the_reason(make_controller, qtbot, monkeypatch):
    import app.worker

    controller = make_controller()
    tiny = {"total": 8_000_000_000, "available": 50_000_000, "used": 7_950_000_000, "percent": 99.4,
            "pressure": "critical"}
    monkeypatch.setattr(app.worker, "system_memory", lambda: dict(tiny))
    errors = []
    controller.errorRaised.connect(errors.append)
    assert controller.send("What is the capital of France?")
    qtbot.waitUntil(lambda: bool(errors) and not controller.busy, timeout=WAIT_MS)
    assert "would need" in errors[0] and "free can be used safely" in errors[0]
    assert controller.entries == [] and controller.conversation_id is None
    assert controller.store.list_conversations() == []


@pytest.mark.parametrize("gpu", [False, True])
def test_prefill_chunks_are_larger_on_a_gpu_where_memory_allows(make_controller, qtbot, monkeypatch, tmp_path, gpu):
    """A document and a turn are prefilled in 512-token chunks on a CPU and, on a GPU (the engine's device check
    answered here), in the largest chunk the memory check lets through (2,048 for SmolLM2); the session's own
    setting is left as it was after a document read."""
    import app.worker
    import engine.chat.session

    monkeypatch.setattr(app.worker, "on_gpu", lambda: gpu)
    chunks: list[int] = []
    real = engine.chat.session.prefill_chunks
    monkeypatch.setattr(engine.chat.session, "prefill_chunks",
                        lambda model, cache, tokens, chunk, *rest: chunks.append(chunk) or real(model, cache, tokens,
                                                                                               chunk, *rest))
    controller = make_controller()
    path = tmp_path / "harbour.txt"
    path.write_text(" ".join(f"On day {day} the harbour master counted {day * 7} boats." for day in range(1, 60)),
                    encoding="utf-8")
    assert not attach_and_ingest(qtbot, controller, path).cancelled
    assert controller.engine.worker.session.settings.prefill_chunk == 512
    reply(qtbot, controller, "How many boats were counted on day 3?")
    assert controller.entries[-1].role == "assistant"
    assert chunks and set(chunks) == {2048 if gpu else 512}, chunks


def test_download_job_fetches_a_model_through_the_hub_then_loads_it(make_controller, qtbot, default_model_path,
                                                                    tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    controller = make_controller()
    repo = "mlx-community/SmolLM2-135M-Instruct"
    state = HubState(repo, default_model_path)
    progress: list[tuple[str, float]] = []
    finished: list[str] = []
    failed: list[str] = []
    loaded = []
    controller.downloadProgress.connect(lambda message, fraction: progress.append((message, fraction)))
    controller.downloadFinished.connect(finished.append)
    controller.downloadFailed.connect(failed.append)
    controller.modelChanged.connect(loaded.append)
    with serve_hub(state) as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        # Stop once part of the weights arrived: the download fails with a sentence, and nothing usable is left.
        state.delay_per_chunk_s = 0.002

        def cancel_midway(_message: str, fraction: float) -> None:
            if 0.1 < fraction < 0.9:
                controller.cancel_download()

        controller.downloadProgress.connect(cancel_midway)
        controller.download_model("SmolLM2-135M-Instruct")
        qtbot.waitUntil(lambda: bool(failed), timeout=WAIT_MS)
        assert "cancelled" in failed[0] and not finished and hf_cached_snapshot(repo) is None
        controller.downloadProgress.disconnect(cancel_midway)

        # Asked again, it resumes, reports its progress, and the app loads the downloaded model.
        state.delay_per_chunk_s = 0.0
        progress.clear()
        controller.download_model(repo)
        qtbot.waitUntil(lambda: bool(loaded) and not controller.busy, timeout=WAIT_MS)
    assert finished == [str(hf_cached_snapshot(repo))]
    assert progress[0][1] < 0 and "Contacting" in progress[0][0]  # size not known yet
    fractions = [fraction for _message, fraction in progress if fraction >= 0]
    assert fractions[0] > 0.1 and fractions[-1] == 1.0  # it started where the cancelled run stopped
    assert any(rng.startswith("bytes=") and rng != "bytes=0-" for _path, rng in state.requests)
    assert loaded[-1].path == finished[0] and controller.settings.last_model == finished[0]
    assert loaded[-1].parameters == controller.model.parameters > 100_000_000


def test_a_failure_inside_a_job_is_one_line_and_the_worker_is_idle_again(make_controller, qtbot, monkeypatch,
                                                                          caplog):
    from app.logs import log_path

    controller = make_controller()
    session = controller.engine.worker.session

    def broken_send(text, settings):
        raise RuntimeError("metal kernel exploded\nTraceback line that must not reach the user")
        yield  # a generator, like ChatSession.send

    monkeypatch.setattr(session, "send", broken_send)
    busy_changes: list[tuple[bool, str]] = []
    controller.engine.worker.busyChanged.connect(lambda busy, what: busy_changes.append((busy, what)))
    errors: list[str] = []
    controller.errorRaised.connect(errors.append)
    assert controller.send("What is the capital of France?")
    qtbot.waitUntil(lambda: bool(errors) and not controller.busy, timeout=WAIT_MS)
    assert len(errors) == 1 and "\n" not in errors[0]
    assert errors[0].startswith("The reply failed. Unexpected error (RuntimeError: metal kernel exploded).")
    assert errors[0].endswith(f"The details are in {log_path()}.")
    assert "Traceback line that must not reach the user" in caplog.text  # the whole error is in the log
    assert busy_changes == [(True, "thinking"), (False, "")]
    assert controller.entries == []  # the question was never accepted
    monkeypatch.undo()
    reply(qtbot, controller, "What is 2 + 2?")  # the worker thread is alive and answers
    assert controller.entries[-1].text


def test_gpu_kernels_turned_off_are_reported_once(qtbot, monkeypatch):
    """A kernel that failed its first run on the GPU turned the kernels off (engine/kvcache/kernel_check.py): the job
    that found it ends with one notice saying so, and later jobs say nothing more."""
    import app.worker as worker_module

    worker = worker_module.EngineWorker()
    notices: list[str] = []
    worker.notice.connect(notices.append)
    reason: list[str | None] = [None]
    monkeypatch.setattr(worker_module, "gpu_kernels_off", lambda: reason[0])
    with worker._job("loading"):
        pass
    assert notices == []
    reason[0] = "the metal kernels of kivi:k4v4:g64 failed their first run on this GPU: RuntimeError: ..."
    for _ in range(2):
        with worker._job("thinking"):
            pass
    assert len(notices) == 1 and "turned off for this session" in notices[0] and "kivi:k4v4:g64" in notices[0]
