"""Waiting on the app's controller in tests (offscreen Qt): one place for the timeout and the idle condition."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.controller import ChatController
from app.payloads import IngestChoice

WAIT_MS = 180_000  # the 2-core CI machine may be shared; a short reply normally takes seconds


def wait_idle(qtbot: Any, controller: ChatController) -> None:
    """Until the controller has no job running and no turn in flight."""
    qtbot.waitUntil(lambda: not controller.busy and controller._turn is None, timeout=WAIT_MS)


def reply(qtbot: Any, controller: ChatController, text: str) -> None:
    """Send `text` once the controller is free (a job's end, e.g. a document read, may still be on its way from
    the worker: a send meanwhile is refused, rightly) and wait for the whole reply."""
    wait_idle(qtbot, controller)
    assert controller.send(text)
    wait_idle(qtbot, controller)


def attach_and_ingest(qtbot: Any, controller: ChatController, path: Path) -> Any:
    """Attach the document at `path`, read it with the default choice, and return the ingest event."""
    inspected, ingested = [], []
    controller.documentInspected.connect(inspected.append)
    controller.documentIngested.connect(ingested.append)
    controller.attach_document(str(path))
    qtbot.waitUntil(lambda: bool(inspected) and not controller.busy, timeout=WAIT_MS)
    assert controller.ingest_document(inspected[0].doc_id, IngestChoice())
    qtbot.waitUntil(lambda: bool(ingested) and not controller.busy, timeout=WAIT_MS)
    return ingested[0]
