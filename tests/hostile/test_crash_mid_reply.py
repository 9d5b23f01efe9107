"""Issue 10, item 6: kill -9 in the middle of a reply keeps what was shown, marked interrupted on restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from app.controller import ChatController
from app.store import ConversationStore

REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT_MS = 180_000

# The app's controller, headless, asked for a long story; once the reply has streamed for a few seconds
# the process writes what the user saw and kills itself with SIGKILL (nothing runs after that).
CHILD = r"""
import os, signal, sys, time
from pathlib import Path
from engine.runtime import prepare_runtime
prepare_runtime()
from PySide6.QtWidgets import QApplication
application = QApplication([])
from app.controller import ChatController
from app.settings import Settings, save_settings
from app.store import ConversationStore

database, settings_file, model, shown_file = sys.argv[1:5]
save_settings(Settings(max_tokens=400, compression="16", temperature=0.0), settings_file)
controller = ChatController(ConversationStore(database), None, settings_file)
first_text_at = []

def streaming(text):
    now = time.monotonic()
    if not first_text_at:
        first_text_at.append(now)
    if now - first_text_at[0] > 2.5 and len(text) > 40:
        Path(shown_file).write_text(text)
        os.kill(os.getpid(), signal.SIGKILL)

def finished(entry):
    Path(shown_file).write_text("FINISHED BEFORE THE KILL: " + entry.text)
    os._exit(3)

def send_when_ready():
    if controller.model is not None and not controller.busy and controller._turn is None and not first_text_at:
        if controller.send("Write a long story about a dragon who learns to read, in ten chapters."):
            poll.stop()

from PySide6.QtCore import QTimer
poll = QTimer()
poll.timeout.connect(send_when_ready)
poll.start(100)
QTimer.singleShot(240_000, lambda: (print("watchdog: no reply in 240 s", flush=True), os._exit(5)))
controller.replyStreaming.connect(streaming)
controller.replyFinished.connect(finished)
controller.errorRaised.connect(lambda message: print("error:", message, flush=True))
controller.modelFailed.connect(lambda message: os._exit(4))
controller.start(model=model)
application.exec()
"""


def test_kill_9_mid_reply_keeps_the_partial_reply_and_marks_it_interrupted(default_model_path, smollm, tmp_path,
                                                                            qtbot):
    database = tmp_path / "velox.sqlite3"
    settings_file = tmp_path / "settings.json"
    shown_file = tmp_path / "shown.txt"
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "QT_QPA_PLATFORM": "offscreen",
                   "VELOX_DATA_DIR": str(tmp_path / "data")}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(database), str(settings_file), str(default_model_path), str(shown_file)],
        env=environment, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stdout, child.stderr[-2000:])
    shown = shown_file.read_text()

    with ConversationStore(database) as store:  # what is on disk right after the crash
        (conversation,) = store.list_conversations()
        _meta, messages = store.load_conversation(conversation.id)
        assert [m.role for m in messages] == ["user", "assistant"]
        saved = messages[1]
        assert saved.state == "streaming"
        assert saved.content and shown.startswith(saved.content)  # at most the last second is missing

    controller = ChatController(ConversationStore(database), None, settings_file)
    notices: list[str] = []
    controller.noticeRaised.connect(notices.append)
    try:
        controller.start(loaded=smollm)
        qtbot.waitUntil(lambda: controller.model is not None and not controller.busy, timeout=WAIT_MS)
        assert any("interrupted" in notice for notice in notices)
        assert controller.entries[-1].text == saved.content
        assert controller.entries[-1].caption == "interrupted" and controller.entries[-1].cancelled
        _meta, messages = controller.store.load_conversation(controller.conversation_id)
        assert messages[1].state == "interrupted" and messages[1].content == saved.content
    finally:
        controller.shutdown()
        controller.store.close()


def test_reply_row_is_written_while_streaming_and_completed_at_the_end(default_model_path, smollm, tmp_path,
                                                                       qtbot):
    from app.settings import Settings, save_settings

    settings_file = tmp_path / "settings.json"
    save_settings(Settings(max_tokens=40, compression="16"), settings_file)
    controller = ChatController(ConversationStore(tmp_path / "velox.sqlite3"), None, settings_file)
    seen_states: list[tuple[str, str]] = []

    def look_at_disk(_text: str) -> None:
        with ConversationStore(tmp_path / "velox.sqlite3") as reader:  # another connection: what a crash keeps
            _meta, messages = reader.load_conversation(controller.conversation_id)
            if len(messages) == 2:
                seen_states.append((messages[1].state, messages[1].content))

    try:
        controller.start(loaded=smollm)
        qtbot.waitUntil(lambda: controller.model is not None and not controller.busy, timeout=WAIT_MS)
        controller.replyStreaming.connect(look_at_disk)
        assert controller.send("Tell me about dragons.")
        qtbot.waitUntil(lambda: not controller.busy and controller._turn is None, timeout=WAIT_MS)
        assert seen_states and seen_states[0][0] == "streaming" and seen_states[0][1]
        _meta, messages = controller.store.load_conversation(controller.conversation_id)
        assert [(m.role, m.state) for m in messages] == [("user", "complete"), ("assistant", "complete")]
        assert messages[1].content == controller.entries[-1].text and messages[1].stats["generated_tokens"] > 0
        # Regenerate replaces the reply in place: still one user and one assistant message.
        assert controller.regenerate()
        qtbot.waitUntil(lambda: not controller.busy and controller._turn is None, timeout=WAIT_MS)
        _meta, messages = controller.store.load_conversation(controller.conversation_id)
        assert [(m.role, m.state) for m in messages] == [("user", "complete"), ("assistant", "complete")]
    finally:
        controller.shutdown()
        controller.store.close()
