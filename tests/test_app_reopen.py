"""Instant reopen through the app's controller, with the real SmolLM2 model: a conversation's compressed KV
cache is saved beside the database when a reply is stored, and taken over when the conversation is opened
again (after a restart or a switch), so the next question prefills only its own tokens. Anything wrong with
the file is said in one line and the conversation is re-read from its text."""

from __future__ import annotations

import stat

import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from app.controller import ChatController
from app.settings import Settings, load_settings, save_settings
from app.store import ConversationStore, saved_caches_folder
from tests.app_helpers import WAIT_MS, reply


@pytest.fixture()
def make_controller(tmp_path, smollm, qtbot):
    """Build controllers on one store file (a second call is a restart); all are shut down afterwards."""
    made: list[ChatController] = []

    def make(level: str = "4") -> ChatController:
        settings_file = tmp_path / "settings.json"
        settings = load_settings(settings_file) if settings_file.exists() else Settings(max_tokens=12)
        settings.compression = level
        save_settings(settings, settings_file)
        controller = ChatController(ConversationStore(tmp_path / "velox.sqlite3"), None, settings_file)
        controller.statuses = []
        controller.notices = []
        controller.savedCacheChanged.connect(controller.statuses.append)
        controller.noticeRaised.connect(controller.notices.append)
        made.append(controller)
        controller.start(loaded=smollm)
        qtbot.waitUntil(lambda: controller.model is not None and not controller.busy, timeout=WAIT_MS)
        return controller

    yield make
    for controller in made:
        controller.shutdown()
        controller.store.close()


def wait_for(qtbot, controller: ChatController, action: str, conversation_id: int | None = None):
    """The next SavedCacheStatus with `action` (for `conversation_id`, default the open one)."""
    wanted = conversation_id if conversation_id is not None else controller.conversation_id

    def arrived():
        return next((s for s in controller.statuses if s.action == action and s.conversation_id == wanted), None)

    qtbot.waitUntil(lambda: arrived() is not None and not controller.busy, timeout=WAIT_MS)
    status = arrived()
    controller.statuses.remove(status)
    return status


def test_restart_reuses_the_saved_cache_and_a_level_switch_re_encodes_it(make_controller, qtbot):
    first = make_controller("4")
    reply(qtbot, first, "What is the capital of France?")
    saved = wait_for(qtbot, first, "saved")
    path = first.saved_caches.path_for(first.conversation_id)
    assert path.parent == saved_caches_folder(first.store.path) and path.stat().st_size == saved.file_bytes
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert saved.tokens == len(first.engine.worker.session.cached_tokens)
    first.refresh_memory()
    assert first.last_memory.saved_cache_bytes == saved.file_bytes <= first.last_memory.saved_caches_bytes
    first.shutdown()

    restarted = make_controller("4")
    restored = wait_for(qtbot, restarted, "restored")
    assert restored.tokens == saved.tokens and not restarted.notices
    reply(qtbot, restarted, "And of Germany?")
    stats = restarted.last_stats
    # Only the new question ran through the model: everything the saved cache held was reused.
    assert stats.reused_tokens == saved.tokens
    assert stats.prefilled_tokens == stats.prompt_tokens - saved.tokens < 20
    assert restarted.entries[-1].text
    wait_for(qtbot, restarted, "saved")

    # Switching level after reopening re-encodes the held cache as it does live: nothing is re-read.
    reports = []
    restarted.compressionChanged.connect(reports.append)
    restarted.set_compression("8")
    qtbot.waitUntil(lambda: bool(reports) and not restarted.busy, timeout=WAIT_MS)
    assert reports[-1].available and reports[-1].tokens >= saved.tokens and "Re-encoded" in reports[-1].note
    reply(qtbot, restarted, "And of Italy?")
    assert restarted.last_stats.prefilled_tokens < 20
    assert wait_for(qtbot, restarted, "saved").tokens == len(restarted.engine.worker.session.cached_tokens)


def test_a_cache_saved_at_another_level_is_re_encoded_on_reopen(make_controller, qtbot):
    first = make_controller("4")
    reply(qtbot, first, "Name a colour.")
    saved = wait_for(qtbot, first, "saved")
    first.shutdown()

    restarted = make_controller("2")  # the level was changed since: the file is re-encoded, not re-read
    restored = wait_for(qtbot, restarted, "restored")
    assert restored.tokens == saved.tokens and "kivi:k4v4:g64" in restored.message
    session = restarted.engine.worker.session
    assert session.compression.key_bits == 2 and len(session.cached_tokens) == saved.tokens
    reply(qtbot, restarted, "Another one?")
    assert restarted.last_stats.reused_tokens == saved.tokens


def _rewrite_metadata(path, **changes: str) -> None:
    cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    save_prompt_cache(str(path), cache, {**metadata, **changes})


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda path: _rewrite_metadata(path, model="0" * 64), "another model"),
        (lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]), "damaged or truncated"),
        (lambda path: _rewrite_metadata(path, format="velox-conversation-cache/99"), "unknown format"),
    ],
    ids=["model-changed", "truncated", "unknown-version"],
)
def test_a_file_that_does_not_fit_is_refused_in_one_line_and_the_text_re_read(make_controller, qtbot, damage,
                                                                              reason):
    first = make_controller("4")
    reply(qtbot, first, "What is the capital of France?")
    wait_for(qtbot, first, "saved")
    conversation = first.conversation_id
    first.shutdown()
    damage(first.saved_caches.path_for(conversation))

    restarted = make_controller("4")
    refused = wait_for(qtbot, restarted, "refused", conversation)
    assert reason in refused.message
    (notice,) = [n for n in restarted.notices if reason in n]
    assert "re-read" in notice and "\n" not in notice
    reply(qtbot, restarted, "And of Germany?")
    stats = restarted.last_stats
    assert stats.reused_tokens == 0 and stats.prefilled_tokens == stats.prompt_tokens > 30  # read again
    assert restarted.entries[-1].text
    # The reply is saved again, and the next reopen uses the new file.
    assert wait_for(qtbot, restarted, "saved").tokens > stats.prompt_tokens


def test_budget_evicts_the_least_recently_used_and_delete_removes_the_file(make_controller, qtbot):
    controller = make_controller("4")
    ids = []
    for _ in range(2):
        controller.new_chat()
        reply(qtbot, controller, "Name a colour.")  # the same greedy turn: files of the same size
        wait_for(qtbot, controller, "saved")
        ids.append(controller.conversation_id)
    size = controller.saved_caches.path_for(ids[0]).stat().st_size
    controller.set_saved_cache_budget(int(2.5 * size))
    assert load_settings(controller.settings_file).saved_cache_budget_bytes == int(2.5 * size)

    controller.open_conversation(ids[0])  # the first is now more recent than the second
    wait_for(qtbot, controller, "restored", ids[0])
    controller.new_chat()
    reply(qtbot, controller, "Name a colour.")
    wait_for(qtbot, controller, "saved")
    ids.append(controller.conversation_id)
    on_disk = {path.name for path in controller.saved_caches.files()}
    assert on_disk == {controller.saved_caches.path_for(i).name for i in (ids[0], ids[2])}
    controller.refresh_memory()
    assert controller.last_memory.saved_caches_bytes <= controller.last_memory.saved_cache_budget == int(2.5 * size)

    controller.delete_conversation(ids[2])  # the open one
    assert not controller.saved_caches.path_for(ids[2]).exists()
    controller.delete_conversation(ids[0])
    assert not controller.saved_caches.path_for(ids[0]).exists()
    assert controller.saved_caches.files() == []
