"""Issue 10, item 10: the minor holes (a notice that faded too soon, advice that cannot help, library
chatter on the user's terminal)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ContextOverflowError

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_sticky_notice_outlives_the_fade_and_keeps_its_place(qtbot, monkeypatch):
    from app.views.widgets import error_banner
    from app.views.widgets.error_banner import Banner

    monkeypatch.setattr(error_banner, "NOTICE_SECONDS", 0.05)
    banner = Banner()
    qtbot.addWidget(banner)
    banner.show_message("The conversation database was damaged; it was moved to X.", "notice", sticky=True)
    banner.show_message("Loading the model…", "notice")  # what used to replace it
    qtbot.wait(300)
    assert banner.isVisible()
    assert banner.text().startswith("The conversation database was damaged") and "Loading the model" in banner.text()
    banner.close_button.click()
    assert not banner.isVisible()
    banner.show_message("An ordinary notice.", "notice")
    qtbot.waitUntil(lambda: not banner.isVisible(), timeout=2000)  # ordinary notices still fade


def test_damaged_database_notice_in_the_app_is_sticky(qapp, qtbot, tmp_path, smollm):
    from app.main import build_app

    database = tmp_path / "velox.sqlite3"
    database.write_bytes(b"this is not a database" * 100)
    controller, window, _tray = build_app(store_path=database, settings_path=tmp_path / "settings.json",
                                          loaded=smollm, use_tray=False)
    try:
        window.show()
        qtbot.wait(300)
        assert "damaged" in window.banner.text()
        assert not window.banner._timer.isActive()  # it does not fade while the model loads
    finally:
        controller.shutdown()
        controller.store.close()
        window.close()


def test_single_turn_overflow_with_drop_oldest_suggests_only_what_can_help(smollm, tmp_path):
    from engine.chat.documents import Document
    from engine.chat.session import ChatSession, GenerationSettings

    model, tokenizer, _info = smollm
    text = "The harbour was quiet that morning. " * 80
    document = Document(tmp_path / "doc.txt", "doc.txt", "text", text, len(text))
    settings = GenerationSettings(max_tokens=16, overflow_policy="drop-oldest")
    session = ChatSession(model, tokenizer, context_length=200, settings=settings)
    session.attach_document(document)
    with pytest.raises(ContextOverflowError) as error:
        list(session.send("Summarise it."))
    message = str(error.value)
    assert "only turn" in message and "'truncate-middle'" in message
    assert "'drop-oldest'" not in message
    # Without documents there is no policy left to suggest, only a shorter question.
    session = ChatSession(model, tokenizer, context_length=40, settings=settings)
    with pytest.raises(ContextOverflowError) as error:
        list(session.send("word " * 60))
    assert "truncate-middle" not in str(error.value) and "shorter question" in str(error.value)


def test_no_transformers_chatter_on_the_terminal(default_model_path, tmp_path):
    # A document longer than the model's 8,192-token limit: transformers warned "indexing errors" when it
    # was counted, and printed "PyTorch was not found" on import.
    document = tmp_path / "long.txt"
    document.write_text("The harbour was quiet that morning. " * 1200)
    script = (
        "from engine.runtime import prepare_runtime; prepare_runtime()\n"
        "from engine.chat.documents import count_tokens, load_document\n"
        "from mlx_lm.tokenizer_utils import load\n"
        "from pathlib import Path\n"
        f"tokenizer = load(Path({str(default_model_path)!r}))\n"
        f"print(count_tokens(load_document({str(document)!r}), tokenizer))\n"
    )
    environment = {key: value for key, value in os.environ.items() if key != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    environment["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment,
                            timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 8192
    assert "indexing errors" not in result.stderr and "PyTorch" not in result.stderr, result.stderr
