"""The chat window offscreen against the real engine: typing and Enter, streamed bubbles, documents with fit
verdicts, a bad document, restart, the model picker offline and downloading from a loopback hub, and an event
loop that never stalls."""

from __future__ import annotations

import time

import pytest
from PySide6.QtCore import QElapsedTimer, Qt, QTimer
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QApplication, QDialog, QMessageBox

from app.main import build_app, qt_binding_problem
from app.settings import Settings, save_settings
from tests.app_helpers import WAIT_MS, reply, wait_idle

DOCUMENT = """# Project Falcon status

The Falcon team moved the launch to **March 14** after the battery supplier changed.
The budget stays at 2.4 million euros. Risks: the new supplier's cells are untested in cold weather.
"""


@pytest.fixture()
def make_window(tmp_path, smollm, qtbot):
    """Open the app's window on a store in tmp_path (calling it again is a restart); closed afterwards."""
    opened = []

    def make(max_tokens: int = 12):
        settings_path = tmp_path / "settings.json"
        if not settings_path.exists():
            save_settings(Settings(max_tokens=max_tokens, compression="16"), settings_path)
        controller, window, tray = build_app(loaded=smollm, store_path=tmp_path / "velox.sqlite3",
                                             settings_path=settings_path, use_tray=False)
        assert tray is None and window.quit_on_close
        opened.append((controller, window))
        window.resize(1100, 720)
        window.show()
        qtbot.waitUntil(lambda: controller.model is not None and not controller.busy, timeout=WAIT_MS)
        return controller, window

    yield make
    for controller, window in opened:
        controller.shutdown()
        for dialog in window.findChildren(QDialog):
            dialog.close()
        window.close()
        controller.store.close()


def test_installed_qt_binding_does_not_leak_references():
    assert qt_binding_problem() is None


def test_enter_sends_shift_enter_adds_a_line_and_the_reply_streams_into_a_bubble(make_window, qtbot):
    controller, window = make_window()
    field = window.composer.input
    qtbot.keyClicks(field, "What is the capital")
    qtbot.keyClick(field, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    assert field.toPlainText() == "What is the capital\n"
    assert controller.entries == []
    field.setPlainText("What is the capital of France?")
    qtbot.keyClick(field, Qt.Key.Key_Return)
    assert field.toPlainText() == ""
    assert window.composer.busy, "the send button became Stop"
    wait_idle(qtbot, controller)

    texts = window.messages.texts()
    assert texts[0] == ("user", "What is the capital of France?")
    assert texts[1][0] == "assistant" and "Paris" in texts[1][1]
    assert "tok/s" in window.messages.bubbles[-1].caption.text()
    assert not window.composer.busy
    # Copy puts the reply's text on the clipboard.
    window.messages.bubbles[-1].copy_button.click()
    assert QApplication.clipboard().text() == texts[1][1]
    assert window.conversation_list.ids() == [controller.conversation_id]


def test_event_loop_stays_responsive_while_generating(make_window, qtbot):
    controller, window = make_window(max_tokens=24)
    gaps: list[float] = []
    clock = QElapsedTimer()
    clock.start()
    last = [clock.elapsed()]

    def tick() -> None:
        now = clock.elapsed()
        gaps.append(now - last[0])
        last[0] = now

    timer = QTimer()
    timer.setInterval(10)
    timer.timeout.connect(tick)
    timer.start()
    assert controller.send("Tell me about the history of the bicycle.")
    started = time.perf_counter()
    wait_idle(qtbot, controller)
    timer.stop()
    elapsed = time.perf_counter() - started
    assert controller.entries[-1].stats.generated_tokens > 5
    assert elapsed > 0.5 and len(gaps) > 20
    print(f"event loop: {len(gaps)} ticks, max gap {max(gaps)} ms over {elapsed:.1f} s")
    assert max(gaps) < 200, f"the GUI stalled for {max(gaps)} ms while the model was generating"


def test_attach_document_shows_fit_verdicts_reads_it_and_the_answer_uses_it(make_window, qtbot, tmp_path):
    controller, window = make_window(max_tokens=16)
    path = tmp_path / "falcon.md"
    path.write_text(DOCUMENT, encoding="utf-8")
    window.attach_paths([str(path)])
    qtbot.waitUntil(lambda: window.document_dialog is not None and window.document_dialog.isVisible(),
                    timeout=WAIT_MS)
    dialog = window.document_dialog
    report = dialog.report
    assert report.tokens > 40 and report.fits_context
    assert [v.key for v in report.verdicts] == ["16", "8", "4", "3", "2"]
    assert all(v.fits for v in report.verdicts)
    assert dialog.verdict_labels["4"].text().startswith("Fits at 4-bit:")
    assert dialog.read_button.isEnabled()

    dialog.read_button.click()
    qtbot.waitUntil(lambda: dialog.finished_report is not None, timeout=WAIT_MS)
    assert not dialog.finished_report.cancelled
    assert dialog.progress.value() == dialog.progress.maximum()
    assert window.pending_names == ["falcon.md"] and window.chips.isVisible()

    reply(qtbot, controller, "When is the launch?")
    # The view is drawn from the controller's signals; on a loaded machine the last ones may still be queued.
    qtbot.waitUntil(lambda: len(window.messages.bubbles) == 2, timeout=WAIT_MS)
    assert window.messages.bubbles[0].documents_row.count() > 0
    stats = controller.entries[-1].stats
    # The document read beforehand was reused from the cache, not read again ...
    assert stats.reused_tokens >= report.tokens
    # ... and the reply draws on it (only the document mentions Falcon or March).
    assert "Falcon" in controller.entries[-1].text or "March" in controller.entries[-1].text
    _meta, stored = controller.store.load_conversation(controller.conversation_id)
    assert stored[0].documents[0].name == "falcon.md" and "Falcon" in stored[0].documents[0].text
    assert not window.chips.isVisible()


def test_document_that_does_not_fit_the_context_needs_a_choice(make_window, qtbot, tmp_path):
    controller, window = make_window()
    qtbot.waitUntil(lambda: controller.engine.worker.session is not None, timeout=WAIT_MS)
    controller.engine.worker.session.context_length = 64
    path = tmp_path / "falcon.md"
    path.write_text(DOCUMENT * 3, encoding="utf-8")
    window.attach_paths([str(path)])
    qtbot.waitUntil(lambda: window.document_dialog is not None and window.document_dialog.isVisible(),
                    timeout=WAIT_MS)
    dialog = window.document_dialog
    assert not dialog.report.fits_context
    assert dialog.overflow_widget.isVisible()
    assert not dialog.read_button.isEnabled(), "no silent overflow: a choice is required"
    dialog.truncate_choice.setChecked(True)
    assert dialog.read_button.isEnabled()
    assert dialog.choice().overflow_policy == "truncate-middle"
    dialog.cancel_choice.setChecked(True)
    dialog.read_button.click()  # "Close": the document is dropped, nothing was read
    assert not dialog.isVisible() and controller.pending_documents == []


def test_overflow_dialog_shows_only_the_choices_that_can_work(make_window, qtbot):
    """A single question too long for the context: the box says so and has one button, no 'drop' offer;
    OK puts the question back in the composer."""
    controller, window = make_window()
    controller.engine.worker.session.context_length = 40
    question = "Please summarise the history of the Roman Empire in great detail for me."
    window.composer.input.setPlainText(question)
    assert controller.send(question)
    window.composer.input.clear()
    qtbot.waitUntil(lambda: window.overflow_box is not None and window.overflow_box.isVisible(), timeout=WAIT_MS)
    box = window.overflow_box
    assert [button.text() for button in box.buttons()] == ["OK"]
    assert "Shorten the message" in box.informativeText() and "drop" not in box.informativeText().lower()
    box.buttons()[0].click()
    assert window.overflow_box is None and window.composer.input.toPlainText() == question
    wait_idle(qtbot, controller)
    assert controller.entries == [] and controller.store.list_conversations() == []


def test_bad_document_shows_an_error_and_loses_nothing(make_window, qtbot, tmp_path, monkeypatch):
    controller, window = make_window()
    # A modal box would block the test; the window reports errors in a non-modal banner instead.
    monkeypatch.setattr(QMessageBox, "exec", lambda *_: pytest.fail("no modal dialog expected"))
    reply(qtbot, controller, "What is 2 + 2?")
    before = window.messages.texts()
    window.composer.input.setPlainText("a draft the user is still typing")
    bad = tmp_path / "notes.txt"
    bad.write_bytes(b"\x00\x01\x02binary\x00junk" * 50)

    window.attach_paths([str(bad)])
    qtbot.waitUntil(lambda: bool(window.banner.text()), timeout=WAIT_MS)

    assert "notes.txt" in window.banner.text() and "binary" in window.banner.text()
    assert window.document_dialog is None
    assert window.messages.texts() == before
    assert window.composer.input.toPlainText() == "a draft the user is still typing"
    assert controller.pending_documents == []
    window.banner.close_button.click()
    assert not window.banner.isVisible()
    # The chat goes on.
    reply(qtbot, controller, "And 3 + 3?")
    assert len(window.messages.bubbles) == 4


def test_restart_shows_the_same_chat_in_a_new_window(make_window, qtbot):
    controller, window = make_window()
    reply(qtbot, controller, "What is the capital of France?")
    shown = window.messages.texts()
    title = window.title_label.text()
    controller.shutdown()
    window.close()

    controller2, window2 = make_window()
    assert window2.messages.texts() == shown
    assert window2.title_label.text() == title
    assert window2.conversation_list.ids() == [controller2.conversation_id]


def test_compression_slider_switches_live_and_the_panel_shows_the_drop(make_window, qtbot):
    controller, window = make_window()
    reply(qtbot, controller, "What is the capital of France?")
    controller.refresh_memory()
    held_16 = window.memory_panel.last_reading.kv_held
    window.compression.choose("4")
    qtbot.waitUntil(lambda: controller.level_key == "4" and not controller.busy, timeout=WAIT_MS)
    reading = controller.refresh_memory()
    assert 0 < reading.kv_held < held_16 / 2
    from engine.planning.memory import format_bytes

    gauge = window.memory_panel.kv_gauge
    assert gauge.value_text == format_bytes(reading.kv_held)
    assert gauge.detail_text.startswith(f"16-bit would need {format_bytes(reading.kv_fp16)}")
    scale = max(reading.kv_held, reading.kv_fp16)
    assert gauge.fraction == pytest.approx(reading.kv_held / scale)
    assert gauge.marker == pytest.approx(reading.kv_fp16 / scale)
    assert "Switched live to 4-bit" in window.compression.status.text()
    assert "→" in window.compression.status.text()
    checked = [a.data() for a in window.compression_actions.actions() if a.isChecked()]
    assert checked == ["4"]


def test_model_picker_lists_the_default_and_explains_offline_downloads(make_window, qtbot, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    controller, window = make_window()
    window.open_model_picker()
    picker = window.model_picker
    names = [picker.table.item(row, 0).text() for row in range(picker.table.rowCount())]
    assert any(name.startswith("SmolLM2-135M-Instruct") for name in names)
    picker.repo_field.setText("SmolLM2-360M-Instruct")
    picker.download_button.click()
    assert picker.download_button.text() == "Cancel"
    qtbot.waitUntil(lambda: not picker.downloading, timeout=60_000)
    assert "offline" in picker.download_status.text()
    assert "mlx-community/SmolLM2-360M-Instruct" in picker.download_status.text()
    picker.reject()


def test_model_picker_shows_download_progress_and_its_cancel_button_stops_it(make_window, qtbot, tmp_path,
                                                                          monkeypatch):
    from engine.models.catalog import hf_cached_snapshot
    from tests.hub_server import HubState, make_model_folder, serve_hub

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    controller, window = make_window()
    state = HubState("mlx-community/Tiny-Test-4bit", make_model_folder(tmp_path / "remote", 8 * 1024 * 1024),
                     delay_per_chunk_s=0.01)
    with serve_hub(state) as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        window.open_model_picker()
        picker = window.model_picker
        picker.repo_field.setText("Tiny-Test-4bit")
        picker.download_button.click()
        qtbot.waitUntil(lambda: picker.download_progress.value() > 100, timeout=WAIT_MS)  # of 1000
        assert picker.download_progress.isVisible() and picker.download_button.text() == "Cancel"
        assert "Downloading mlx-community/Tiny-Test-4bit:" in picker.download_status.text()
        picker.download_button.click()
        qtbot.waitUntil(lambda: not picker.downloading, timeout=WAIT_MS)
    assert "cancelled" in picker.download_status.text() and picker.download_button.text() == "Download"
    assert hf_cached_snapshot("mlx-community/Tiny-Test-4bit") is None
    assert controller.model.name == "SmolLM2-135M-Instruct"  # the loaded model stays
    picker.reject()


def test_drag_and_drop_a_document_opens_its_fit_dialog_and_stop_cancels_reading(make_window, qtbot, tmp_path):
    from PySide6.QtCore import QMimeData, QPoint, QPointF, QUrl
    from PySide6.QtGui import QDragEnterEvent, QDropEvent

    controller, window = make_window()
    path = tmp_path / "long-notes.txt"
    path.write_text(" ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(400)),
                    encoding="utf-8")
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    enter = QDragEnterEvent(QPoint(20, 20), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    window.dragEnterEvent(enter)
    assert enter.isAccepted()
    window.dropEvent(QDropEvent(QPointF(20, 20), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                                Qt.KeyboardModifier.NoModifier))
    qtbot.waitUntil(lambda: window.document_dialog is not None and window.document_dialog.isVisible(),
                    timeout=WAIT_MS)
    dialog = window.document_dialog
    assert dialog.report.tokens > 2000  # several 512-token prefill chunks

    dialog.read_button.click()
    assert controller.busy and controller.busy_what == "reading"
    qtbot.waitUntil(lambda: dialog.progress.value() > 0, timeout=WAIT_MS)
    dialog.cancel_button.click()  # "Stop"
    qtbot.waitUntil(lambda: dialog.finished_report is not None and not controller.busy, timeout=WAIT_MS)
    assert dialog.finished_report.cancelled and not dialog.finished_report.failed
    assert "cancelled" in dialog.progress_label.text()
    assert controller.pending_documents == [] and window.pending_names == []
    assert controller.engine.worker.session.pending_documents == []
    # Nothing is left half-attached: the next question has no document.
    reply(qtbot, controller, "Hello!")
    assert controller.entries[0].documents == []


def test_tray_mode_keeps_running_when_the_window_closes(tmp_path, smollm, qtbot):
    save_settings(Settings(max_tokens=8, compression="16"), tmp_path / "settings.json")
    controller, window, tray = build_app(loaded=smollm, store_path=tmp_path / "velox.sqlite3",
                                         settings_path=tmp_path / "settings.json", use_tray=True)
    try:
        assert tray is not None and not window.quit_on_close
        window.show()
        qtbot.waitUntil(lambda: controller.model is not None, timeout=WAIT_MS)
        window.close()
        assert not window.isVisible(), "closing hides the window; the app stays in the tray"
        tray.toggle_window()
        assert window.isVisible()
        # The status item's menu (on macOS the only menu of an LSUIElement app) has the essentials.
        texts = [action.text() for action in tray.menu.actions()]
        for wanted in ("Open Velox", "New Chat", "Attach Document…", "Reveal Log", "Quit Velox"):
            assert wanted in texts
        controller.refresh_memory()
        tray._refresh_menu()
        assert tray.model_action.text() == "Model: SmolLM2-135M-Instruct"
        assert "free" in tray.memory_action.text() and "KV cache" in tray.memory_action.text()
        assert [a.data() for a in tray.compression_group.actions() if a.isChecked()] == ["16"]
        # Cmd/Ctrl-W and Cmd/Ctrl-Q live on the window itself, so they work with no menu bar shown.
        shortcuts = {action.text(): action.shortcut() for action in window.actions()}
        assert shortcuts["Close Window"] == QKeySequence(QKeySequence.StandardKey.Close)
        assert shortcuts["Quit Velox"] == QKeySequence(QKeySequence.StandardKey.Quit)
        window.hide()
        next(a for a in tray.menu.actions() if a.text() == "New Chat").trigger()
        assert window.isVisible() and controller.entries == []
    finally:
        controller.shutdown()
        window.quit_on_close = True
        window.close()
        tray.hide()
        controller.store.close()


def test_a_level_that_calibrates_shows_its_progress(make_window, qtbot, tmp_path, monkeypatch):
    """A wide level on a model without a cached or bundled calibration measures its layers once, on the
    worker: the window says so with a progress bar, and the switch then completes with the measured layers. The
    4-bit level's key widths are measured after them (for those layers' bits), and the window says so too."""
    from engine.kvcache import layer_sensitivity as sensitivity

    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(sensitivity, "BUNDLED_DIR", tmp_path / "no-bundle")

    def fake_layer_kl(model, ids, probe, chunk_tokens, progress=None):  # the real one takes ~3 minutes here
        n = len(model.layers)
        for layer in range(n):
            if progress:
                progress(f"layer {layer + 1}/{n}", (layer + 1) / n)
        return [1.0 if layer in (2, 5, 7) else 0.1 for layer in range(n)]

    monkeypatch.setattr(sensitivity, "layer_kl", fake_layer_kl)
    controller, window = make_window()
    shown = []
    monkeypatch.setattr(window.status_label, "setText", lambda text: shown.append(text))
    window.compression.choose("4")
    qtbot.waitUntil(lambda: controller.level_key == "4" and not controller.busy, timeout=WAIT_MS)
    calibrating = [text for text in shown if text.startswith("Calibrating for this model")]
    assert any(text.endswith("layer 30/30") for text in calibrating)
    assert calibrating[-1].endswith("measuring the key channels' importance")
    assert "Switched live to 4-bit" in window.compression.status.text()
    caches = controller.engine.worker.session.prompt_cache
    assert [i for i, cache in enumerate(caches) if cache.config.key_bits == 5] == [2, 5, 7]
