"""Conversation persistence (app/store.py) and remembered settings (app/settings.py)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.settings import Settings, load_settings, save_settings, settings_path
from app.store import SCHEMA_VERSION, ConversationStore, StoreError, to_session_history
from engine.chat.documents import Document
from engine.chat.session import GenerationStats, Message

REPO_ROOT = Path(__file__).parent.parent

STATS = GenerationStats(
    prompt_tokens=120, prefilled_tokens=100, reused_tokens=20, generated_tokens=42,
    prefill_tokens_per_second=812.5, decode_tokens_per_second=31.25, time_to_first_token=0.19,
    peak_memory_bytes=123_456_789, kv_cache_bytes=2_359_296, finish_reason="stop",
)
REPORT = Document(Path("/docs/report.md"), "report.md", "markdown", "# Q3\n\nRevenue grew 12 %. Café ☕.", 32)


@pytest.fixture()
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "velox.sqlite3"


def _filled_store(path: Path) -> tuple[ConversationStore, int]:
    store = ConversationStore(path)
    conversation = store.create_conversation("Quarterly report", "SmolLM2-135M-Instruct", "4")
    store.append_message(conversation, "user", "How much did revenue grow?", documents=[REPORT])
    store.append_message(conversation, "assistant", "It grew 12 %.", stats=STATS, compression="4")
    store.append_message(conversation, "user", "And costs?")
    store.append_message(conversation, "assistant", "Cos", cancelled=True, compression="4")
    return store, conversation


# --------------------------------------------------------------------------------------------- round trip


def test_round_trip(db_path: Path) -> None:
    store, conversation = _filled_store(db_path)
    meta, messages = store.load_conversation(conversation)
    assert (meta.id, meta.title, meta.model, meta.compression, meta.message_count) == (
        conversation, "Quarterly report", "SmolLM2-135M-Instruct", "4", 4,
    )
    assert [m.position for m in messages] == [0, 1, 2, 3]
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0].content == "How much did revenue grow?"
    (document,) = messages[0].documents
    assert (document.name, document.path, document.kind, document.text, document.n_chars) == (
        "report.md", "/docs/report.md", "markdown", REPORT.text, 32,
    )
    assert messages[1].stats == {
        "prompt_tokens": 120, "prefilled_tokens": 100, "reused_tokens": 20, "generated_tokens": 42,
        "prefill_tokens_per_second": 812.5, "decode_tokens_per_second": 31.25, "time_to_first_token": 0.19,
        "peak_memory_bytes": 123_456_789, "kv_cache_bytes": 2_359_296, "finish_reason": "stop",
    }
    assert messages[1].compression == "4" and messages[0].compression is None
    assert messages[3].cancelled and not messages[1].cancelled
    assert messages[0].created <= messages[3].created <= meta.updated
    with sqlite3.connect(db_path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    store.close()


def test_restored_history_renders_the_same_prompt(db_path: Path, smollm) -> None:
    """A conversation restored from disk gives the model exactly the prompt it saw before."""
    from engine.chat.session import ChatSession

    model, tokenizer, _ = smollm
    original = [
        Message("user", "How much did revenue grow?", [REPORT]),
        Message("assistant", "It grew 12 %."),
        Message("user", "And costs?"),
    ]
    store = ConversationStore(db_path)
    conversation = store.create_conversation("t")
    for message in original:
        store.append_message(conversation, message.role, message.content, documents=message.documents)
    store.append_message(conversation, "system", "You are terse.")  # kept apart from the history
    _, stored = store.load_conversation(conversation)
    restored = to_session_history(stored)
    assert restored == original  # Message and Document compare by value
    session = ChatSession(model, tokenizer)
    assert session.render_tokens(restored) == session.render_tokens(original)


def test_update_rename_delete(db_path: Path) -> None:
    store, conversation = _filled_store(db_path)
    _, messages = store.load_conversation(conversation)
    store.update_message(messages[3].id, content="Costs fell 3 %.", cancelled=False, stats=STATS)
    store.update_message(messages[1].id, stats=None)
    _, messages = store.load_conversation(conversation)
    assert (messages[3].content, messages[3].cancelled, messages[3].stats["generated_tokens"]) == (
        "Costs fell 3 %.", False, 42,
    )
    assert messages[3].compression == "4"  # untouched fields stay
    assert messages[1].stats is None
    store.rename(conversation, "Q3 numbers")
    store.set_conversation_settings(conversation, compression="8")
    meta, _ = store.load_conversation(conversation)
    assert (meta.title, meta.compression, meta.model) == ("Q3 numbers", "8", "SmolLM2-135M-Instruct")

    assert store.delete_messages_from(conversation, 2) == 2
    _, messages = store.load_conversation(conversation)
    assert [m.position for m in messages] == [0, 1]
    assert store.append_message(conversation, "user", "again") and store.load_conversation(conversation)[1][-1].position == 2

    assert store.delete(conversation) is True
    assert store.delete(conversation) is False
    assert store.list_conversations() == []
    with sqlite3.connect(db_path) as raw:  # the messages went with it (ON DELETE CASCADE)
        assert raw.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    with pytest.raises(StoreError, match="does not exist"):
        store.load_conversation(conversation)
    with pytest.raises(StoreError, match="does not exist"):
        store.append_message(conversation, "user", "lost?")
    with pytest.raises(StoreError, match="does not exist"):
        store.update_message(messages[0].id, content="x")
    with pytest.raises(ValueError, match="role"):
        store.append_message(store.create_conversation("x"), "robot", "beep")
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.list_conversations()


def test_conversations_are_listed_newest_first_with_counts(db_path: Path) -> None:
    store = ConversationStore(db_path)
    first = store.create_conversation("first")
    second = store.create_conversation("second")
    third = store.create_conversation("third")
    assert [c.id for c in store.list_conversations()] == [third, second, first]
    store.append_message(first, "user", "bump")
    store.append_message(first, "assistant", "bumped")
    listed = store.list_conversations()
    assert [c.id for c in listed] == [first, third, second]
    assert [c.message_count for c in listed] == [2, 0, 0]
    store.rename(second, "renamed")  # renaming does not reorder
    assert [c.id for c in store.list_conversations()] == [first, third, second]
    store.close()


# ------------------------------------------------------------------------------------- restarts and crashes


def test_a_new_store_on_the_same_file_restores_everything(db_path: Path) -> None:
    store, conversation = _filled_store(db_path)
    before = store.load_conversation(conversation)
    # No close(): each message was committed when appended.
    reopened = ConversationStore(db_path)
    assert reopened.notice is None
    assert reopened.load_conversation(conversation) == before
    assert [c.id for c in reopened.list_conversations()] == [conversation]
    reopened.close()
    store.close()


def test_messages_survive_a_killed_process(db_path: Path) -> None:
    """The process writing a message dies right after append_message returns: the message is there."""
    code = (
        "import os, sys\n"
        "from app.store import ConversationStore\n"
        f"store = ConversationStore({str(db_path)!r})\n"
        "conversation = store.create_conversation('crash')\n"
        "store.append_message(conversation, 'user', 'saved before the crash')\n"
        "os._exit(0)  # no close, no cleanup\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)
    store = ConversationStore(db_path)
    (meta,) = store.list_conversations()
    _, messages = store.load_conversation(meta.id)
    assert [m.content for m in messages] == ["saved before the crash"]
    store.close()


# --------------------------------------------------------------------------------------- damaged and newer


def test_a_corrupt_file_is_moved_aside_not_lost(db_path: Path) -> None:
    garbage = b"this is not an SQLite database\n" * 200
    db_path.write_bytes(garbage)
    store = ConversationStore(db_path)
    assert store.notice is not None and "moved to" in store.notice and "damaged" in store.notice
    moved = store.moved_aside_to
    assert moved is not None and moved.name.startswith("velox.sqlite3.corrupt-")
    assert moved.read_bytes() == garbage  # nothing lost
    conversation = store.create_conversation("fresh start")
    assert [c.id for c in store.list_conversations()] == [conversation]
    store.close()
    assert ConversationStore(db_path).notice is None  # the new file is healthy


def test_a_damaged_page_is_detected_and_moved_aside(db_path: Path) -> None:
    store, conversation = _filled_store(db_path)
    for index in range(40):  # enough rows to span several pages
        store.append_message(conversation, "user", f"message {index} " + "x" * 500)
    store.close()  # the last connection checkpoints the WAL into the main file
    assert not Path(f"{db_path}-wal").exists() or Path(f"{db_path}-wal").stat().st_size == 0
    data = bytearray(db_path.read_bytes())
    page_size = int.from_bytes(data[16:18], "big")
    assert len(data) >= 4 * page_size
    data[2 * page_size : 3 * page_size] = b"\xa5" * page_size  # overwrite the third page with junk
    db_path.write_bytes(bytes(data))
    store = ConversationStore(db_path)
    assert store.notice is not None and store.moved_aside_to is not None
    assert store.moved_aside_to.read_bytes() == bytes(data)
    assert store.list_conversations() == []
    store.close()


def test_a_database_from_a_newer_version_is_refused_and_left_alone(db_path: Path) -> None:
    ConversationStore(db_path).close()
    with sqlite3.connect(db_path) as raw:
        raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    before = db_path.read_bytes()
    with pytest.raises(StoreError, match="newer version of Velox"):
        ConversationStore(db_path)
    assert db_path.read_bytes() == before
    assert list(db_path.parent.glob("*.corrupt-*")) == []


# ---------------------------------------------------------------------------------------------- concurrency


def test_two_stores_writing_at_once_keep_positions_consistent(db_path: Path) -> None:
    first = ConversationStore(db_path)
    second = ConversationStore(db_path)
    conversation = first.create_conversation("shared")
    per_writer = 30
    errors: list[BaseException] = []

    def write(store: ConversationStore, name: str) -> None:
        try:
            for index in range(per_writer):
                store.append_message(conversation, "user", f"{name} {index}")
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=write, args=(s, n)) for s, n in ((first, "a"), (second, "b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    _, messages = second.load_conversation(conversation)
    assert [m.position for m in messages] == list(range(2 * per_writer))
    for name in "ab":  # each writer's messages are in its own order
        assert [m.content for m in messages if m.content.startswith(name)] == [
            f"{name} {i}" for i in range(per_writer)
        ]
    first.close()
    second.close()


def test_a_write_waits_for_another_connection_to_finish(db_path: Path) -> None:
    store = ConversationStore(db_path)
    conversation = store.create_conversation("waiting")
    other = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    other.execute("UPDATE conversations SET title = 'held' WHERE id = ?", (conversation,))
    release = threading.Timer(0.3, lambda: other.execute("COMMIT"))
    started = time.perf_counter()
    release.start()
    store.append_message(conversation, "user", "after the other writer")
    waited = time.perf_counter() - started
    release.join()
    other.close()
    assert waited >= 0.25
    meta, messages = store.load_conversation(conversation)
    assert meta.title == "held" and [m.content for m in messages] == ["after the other writer"]
    store.close()


def test_a_write_blocked_too_long_is_a_clear_error(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("app.store.BUSY_TIMEOUT_SECONDS", 0.2)
    store = ConversationStore(db_path)
    conversation = store.create_conversation("blocked")
    other = sqlite3.connect(db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(StoreError, match="busy"):
        store.append_message(conversation, "user", "cannot be written now")
    other.execute("ROLLBACK")
    other.close()
    store.append_message(conversation, "user", "written once the lock is gone")
    assert store.load_conversation(conversation)[0].message_count == 1
    store.close()


# ------------------------------------------------------------------------------------------------- settings


def test_settings_defaults_when_there_is_no_file(tmp_path: Path) -> None:
    assert load_settings(tmp_path / "settings.json") == Settings()


def test_settings_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    geometry = bytes(range(256)) + b"\x00\x01"
    chosen = Settings(
        last_model="/models/Llama-3.1-8B", compression="4", method_override="affine", temperature=0.7,
        top_p=0.9, max_tokens=1024, window_geometry=geometry, theme="dark",
    )
    save_settings(chosen, path)
    assert load_settings(path) == chosen
    assert load_settings(path).window_geometry == geometry
    stored = json.loads(path.read_text())
    assert isinstance(stored["window_geometry"], str)  # base64 text, not a list of numbers
    assert [p.name for p in tmp_path.iterdir()] == ["settings.json"]  # no temporary file left behind


def test_settings_default_path_follows_the_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path / "data"))
    assert settings_path() == tmp_path / "data" / "settings.json"
    save_settings(Settings(theme="light"))
    assert load_settings().theme == "light"


def test_settings_tolerate_unknown_missing_and_invalid_values(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({
        "version": 7, "theme": "neon", "temperature": "hot", "top_p": 0.5, "max_tokens": True,
        "compression": "8", "window_geometry": "!!not base64!!", "future_feature": {"x": [1, 2]},
    }))
    loaded = load_settings(path)
    defaults = Settings()
    assert (loaded.theme, loaded.temperature, loaded.max_tokens, loaded.window_geometry) == (
        defaults.theme, defaults.temperature, defaults.max_tokens, None,
    )
    assert (loaded.top_p, loaded.compression, loaded.last_model) == (0.5, "8", None)
    # Settings a newer version wrote survive a save by this one.
    loaded.temperature = 0.3
    save_settings(loaded, path)
    stored = json.loads(path.read_text())
    assert stored["future_feature"] == {"x": [1, 2]} and stored["temperature"] == 0.3
    path.write_text(json.dumps({"temperature": float("nan"), "top_p": 0.0, "compression": "5"}))
    assert load_settings(path) == defaults


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2, 3]", b"\xff\xfe\x00garbage", b""])
def test_a_corrupt_settings_file_gives_defaults_and_is_kept_aside(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "settings.json"
    path.write_bytes(content)
    assert load_settings(path) == Settings()
    (moved,) = tmp_path.glob("settings.json.corrupt-*")
    assert moved.read_bytes() == content
    save_settings(Settings(theme="dark"), path)
    assert load_settings(path).theme == "dark"
