"""The app's "Local server" switch, offscreen: a real `velox serve` child process, and the menu items."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pytest

pytest.importorskip("pytestqt")
openai = pytest.importorskip("openai")

BAD_MODEL = "/nonexistent/velox-model-folder"


def test_switch_serves_the_chat_model_and_switches_off(qtbot):
    from app.server_control import LocalServerControl

    control = LocalServerControl(port=0)
    assert control.state == "off" and control.summary()["line"] == "Local server: off"
    with qtbot.waitSignal(control.changed, timeout=5000):
        control.set_enabled(True, model=None, level="4")
    assert control.state == "starting"
    try:
        qtbot.waitUntil(lambda: control.state == "on", timeout=240_000)
        address = control.address
        assert address.startswith("http://127.0.0.1:") and address.endswith("/v1")
        assert control.summary()["line"] == f"Local server: {address}"
        assert f'base_url="{address}"' in control.example()
        client = openai.OpenAI(base_url=address, api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16
        )
        assert "Paris" in reply.choices[0].message.content
    finally:
        control.set_enabled(False)
    assert control.state == "off" and control.process is None
    url = urlsplit(address)
    with pytest.raises(OSError):
        socket.create_connection((url.hostname, url.port), timeout=5).close()


def test_a_server_that_cannot_start_reports_one_line(qtbot):
    from app.server_control import LocalServerControl

    control = LocalServerControl(port=0)
    with qtbot.waitSignal(control.failed, timeout=120_000) as failed:
        control.start(model=BAD_MODEL)
    assert failed.args == [f"The model folder {BAD_MODEL} does not exist."]
    assert control.state == "off" and control.error == failed.args[0]


def test_menu_items_follow_the_switch(qtbot):
    from PySide6.QtWidgets import QMenu

    from app.server_control import LocalServerControl
    from app.views.widgets.server_menu import ServerMenuItems

    menu = QMenu()
    control = LocalServerControl(port=0)
    items = ServerMenuItems(menu, control, lambda: (BAD_MODEL, "4"))
    assert [a.text() for a in menu.actions()] == ["Local Server", "Local server: off", "Copy Python Example"]
    assert not items.switch.isChecked() and not items.copy.isEnabled()
    with qtbot.waitSignal(control.failed, timeout=120_000):
        items.switch.trigger()  # switches on: the child starts, with the chosen (missing) model
        assert items.switch.isChecked() and items.address.text() == "Local server: starting…"
    assert not items.switch.isChecked() and items.address.text() == "Local server: off"
