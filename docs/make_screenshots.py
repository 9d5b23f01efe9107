"""Reproduce the screenshots in docs/screenshots/ by driving the real app on the embedded default model.

    Xvfb :99 -screen 0 1600x1000x24 &            # any X server; without DISPLAY Qt renders offscreen
    DISPLAY=:99 python docs/make_screenshots.py [--theme light|dark] [--out docs/screenshots]

Conversations and settings go to a temporary folder, never to the user's own data.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SAMPLE_DOCUMENT = """# Velox field notes: keeping long documents in memory

## Why the KV cache matters
When a language model reads a document, it keeps a *key* and a *value* vector for every token in every
layer. This **KV cache** grows linearly with the document: for a 7-billion-parameter model a 100-page report
can need several gigabytes, more than the weights themselves.

## What compression does
Velox stores the cache with fewer bits per number. At 8 bits the answers are practically unchanged; at 4 bits
the cache is about four times smaller with a small loss of quality; 3 and 2 bits trade more quality for memory.
Keys are more sensitive than values, because their errors are amplified by the softmax.

## How to choose
- Short chats: leave compression off.
- Long PDFs on a laptop: 4-bit is the sweet spot.
- When nothing else fits: 3-bit keys with 2-bit values.

## Measured on a MacBook Air (16 GB)
Reading a 60,000-token contract took 41 seconds; answering a question about it took 2.3 seconds to the first
token and then ran at 28 tokens per second. With the 4-bit cache, memory pressure stayed green.
"""


def wait_until(app, condition: Callable[[], bool], timeout: float, what: str) -> None:  # noqa: ANN001
    from PySide6.QtCore import QEventLoop

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Timed out waiting for {what}.")
        app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)


def settle(app, seconds: float = 0.4) -> None:  # noqa: ANN001
    end = time.monotonic() + seconds
    wait_until(app, lambda: time.monotonic() > end, seconds + 1, "a pause")


def save(widget, path: Path) -> None:  # noqa: ANN001
    pixmap = widget.grab()
    pixmap.save(str(path))
    print(f"wrote {path} ({pixmap.width()}x{pixmap.height()})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--theme", choices=["light", "dark"], default="light")
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    parser.add_argument("--max-tokens", type=int, default=140)
    args = parser.parse_args()
    if not os.environ.get("DISPLAY") and not os.environ.get("QT_QPA_PLATFORM"):
        os.environ["QT_QPA_PLATFORM"] = "offscreen"

    from engine.runtime import prepare_runtime

    prepare_runtime()
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication

    from app.assets import asset_path
    from app.main import apply_theme, build_app
    from app.settings import Settings, save_settings
    from engine.models.catalog import load_model
    from engine.models.default_model import ensure_default_model

    app = QApplication(sys.argv[:1])
    app.setApplicationName("Velox")
    app.setWindowIcon(QIcon(str(asset_path("velox-icon.png"))))
    apply_theme(app, args.theme)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.theme == "light" else "-dark"

    work = Path(tempfile.mkdtemp(prefix="velox-screens-"))
    save_settings(Settings(max_tokens=args.max_tokens, compression="16", theme=args.theme), work / "settings.json")
    document_path = work / "velox-field-notes.md"
    document_path.write_text(SAMPLE_DOCUMENT, encoding="utf-8")

    loaded = load_model(ensure_default_model())
    controller, window, _tray = build_app(loaded=loaded, store_path=work / "velox.sqlite3",
                                          settings_path=work / "settings.json", use_tray=False)
    window.resize(1280, 820)
    window.show()
    wait_until(app, lambda: controller.model is not None, 120, "the model")
    settle(app)

    # 1. A chat with a streamed Markdown reply.
    controller.send("Give me three short tips for writing a clear email, as a Markdown list.")
    wait_until(app, lambda: not controller.busy, 600, "the first reply")
    controller.send("Which of them matters most?")
    wait_until(app, lambda: not controller.busy, 600, "the second reply")
    settle(app, 1.2)
    save(window, out / f"chat{suffix}.png")

    # 2. A document: token count and a fit verdict per compression level, before reading it.
    controller.new_chat()
    window.attach_paths([str(document_path)])
    wait_until(app, lambda: window.document_dialog is not None and window.document_dialog.isVisible(), 120,
               "the document dialog")
    settle(app)
    save(window.document_dialog, out / f"document-fit{suffix}.png")
    window.document_dialog.read_button.click()
    wait_until(app, lambda: window.document_dialog.finished_report is not None, 600, "reading the document")
    settle(app)
    controller.send("According to the notes, which compression level should I use for long PDFs on a laptop?")
    wait_until(app, lambda: not controller.busy, 600, "the document answer")

    # 3. Switch compression live mid-conversation and show the memory panel's bytes drop.
    window.compression.choose("4")
    # The switch is queued to the worker: wait for its report, not just for an idle worker.
    wait_until(app, lambda: controller.level_key == "4" and not controller.busy, 300, "the compression switch")
    settle(app, 2.5)  # two memory polls after the switch, so the panel shows the compressed cache
    save(window, out / f"document-chat{suffix}.png")
    save(window.inspector, out / f"memory-panel{suffix}.png")

    controller.shutdown()
    window.quit_on_close = True
    window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
