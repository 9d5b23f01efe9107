"""Issue 10, item 9: a chat template that refuses the conversation or trips the Jinja sandbox is one line."""

from __future__ import annotations

import json

import pytest

from tests.hostile.builders import model_folder_copy

# Gemma's templates refuse a system turn with their own raise_exception().
REJECTS_SYSTEM = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template reaching for Python internals: transformers renders in Jinja's sandbox, which refuses it.
ESCAPES_SANDBOX = "{{ messages.__class__.__mro__[1].__subclasses__() }}"


def folder_with_template(default_model_path, target, template):
    folder = model_folder_copy(default_model_path, target, copied=("tokenizer_config.json",))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_template_rejecting_the_system_role_is_one_line_in_the_cli(default_model_path, tmp_path, capsys):
    from app.cli import main

    folder = folder_with_template(default_model_path, tmp_path / "model", REJECTS_SYSTEM)
    code = main(["chat", "--model", str(folder), "--prompt", "hi", "--max-tokens", "4", "--system", "Be brief."])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert "System role not supported. This model takes no system prompt" in errors[0]


@pytest.mark.parametrize(("template", "system", "expected"), [
    (REJECTS_SYSTEM, "Be brief.", "System role not supported"),
    (ESCAPES_SANDBOX, None, "cannot render this conversation: access to attribute '__class__'"),
])
def test_session_turns_template_failures_into_one_velox_error(smollm, default_model_path, tmp_path, template,
                                                              system, expected):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine.chat.session import ChatSession, Message
    from engine.errors import VeloxError

    folder = folder_with_template(default_model_path, tmp_path / "model", template)
    model, _tokenizer, _info = smollm
    session = ChatSession(model, load_tokenizer(folder), system_prompt=system)
    with pytest.raises(VeloxError, match=expected) as error:
        list(session.send("hi"))
    assert "\n" not in str(error.value)
    assert session.history == []  # the refused turn left nothing behind
    if template == REJECTS_SYSTEM:
        session.system_prompt = None
        assert session.render_tokens([Message("user", "hi")])  # the same template renders without one
