"""Issue 10, item 5: damaged weights in a user's model folder are reported, not printed as an answer."""

from __future__ import annotations

import pytest

from app.controller import ChatController
from app.settings import Settings, save_settings
from app.store import ConversationStore
from engine.chat.reply_check import degenerate_reply
from tests.hostile.builders import model_folder_copy

WAIT_MS = 180_000


def damaged_copy(default_model_path, target):
    """The default model as a user folder (no conversion record) with 40 MB of its weights overwritten."""
    folder = model_folder_copy(default_model_path, target, copied=("model.safetensors",))
    (folder / "velox_converted.json").unlink()
    with (folder / "model.safetensors").open("r+b") as stream:
        stream.seek(20_000_000)
        stream.write(b"\xff" * 40_000_000)  # 0xffff is NaN in float16 and a big scale in the packed weights
    return folder


def test_cli_says_the_reply_is_degenerate_and_exits_non_zero(default_model_path, tmp_path, capsys):
    from app.cli import main

    folder = damaged_copy(default_model_path, tmp_path / "damaged")
    code = main(["chat", "--model", str(folder), "--prompt", "What is the capital of France?",
                 "--max-tokens", "20"])
    captured = capsys.readouterr()
    assert code == 1, captured
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "weights may be damaged" in errors[0], captured.err


def test_the_app_says_the_reply_is_degenerate_and_keeps_it(default_model_path, tmp_path, qtbot):
    """The same damaged folder opened in the app: the reply is shown and saved as it came, and a notice says
    the weights may be damaged (the worker's check, not only the CLI's)."""
    folder = damaged_copy(default_model_path, tmp_path / "damaged")
    settings_file = tmp_path / "settings.json"
    save_settings(Settings(max_tokens=20, compression="16"), settings_file)
    controller = ChatController(ConversationStore(tmp_path / "velox.sqlite3"), None, settings_file)
    notices: list[str] = []
    controller.noticeRaised.connect(notices.append)
    try:
        controller.start(model=str(folder))
        qtbot.waitUntil(lambda: controller.model is not None and not controller.busy, timeout=WAIT_MS)
        assert controller.send("What is the capital of France?")
        qtbot.waitUntil(lambda: not controller.busy and controller._turn is None, timeout=WAIT_MS)
        assert [n for n in notices if "weights may be damaged" in n], notices
        _meta, stored = controller.store.load_conversation(controller.conversation_id)
        assert [m.role for m in stored] == ["user", "assistant"]
    finally:
        controller.shutdown()
        controller.store.close()


def test_healthy_model_reply_is_not_flagged(smollm):
    from engine.chat.session import ChatSession, GenerationSettings

    model, tokenizer, _info = smollm
    session = ChatSession(model, tokenizer, settings=GenerationSettings(max_tokens=12))
    stats = list(session.send("What is the capital of France?"))[-1]
    assert stats.generated_tokens > 0
    assert degenerate_reply(session.history[-1].content, stats.generated_tokens, tokenizer) is None


@pytest.mark.parametrize(("text", "tokens", "flagged"), [
    ("<|endoftext|>" * 20, 20, True),
    ("<|im_end|>\n<|endoftext|> ", 3, True),
    ("!" * 40, 40, True),
    ("the " * 20, 20, True),
    ("Paris.", 2, False),
    ("", 0, False),  # nothing generated (e.g. an immediate end of turn) is not damage
    ("ha ha ha", 3, False),
])
def test_degenerate_reply_rules(smollm, text, tokens, flagged):
    _model, tokenizer, _info = smollm
    assert (degenerate_reply(text, tokens, tokenizer) is not None) is flagged
