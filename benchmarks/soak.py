"""Soak: send / stop / regenerate / switch-level cycles through the app's controller with the real model.

    QT_QPA_PLATFORM=offscreen python benchmarks/soak.py [--cycles 200] [--max-tokens 8]
                                                       [--out benchmarks/results/soak.json]

Each cycle, on the embedded SmolLM2 model, headless (no window): ask a question and wait for the reply;
ask another and press Stop after its first text; regenerate that reply; switch the compression level
(Off, 8, 4, 3, 2 bits in turn). Every 10 cycles a new chat starts, so the context never overflows.

Checked at the end (exit 1 if any fails):
  * memory: the process's resident memory after the last cycle is within 10 % of what it was after the
    first (warm-up) cycle, and MLX's active memory outside the KV cache (the weights and anything leaked
    beside them) is within 10 % too;
  * no leaks: over the second half of the run, resident memory grows by less than 2 % and the open file
    descriptors, threads and live Python objects do not keep growing (each is also recorded per cycle);
  * the database holds every completed message: each conversation on disk has exactly the messages
    (role, text, stopped or not) the controller showed when it was left, no reply is left 'streaming';
  * no error was shown to the user.

Writes the per-cycle series and the verdicts as JSON. The store and settings live in a temporary folder.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LEVEL_CYCLE = ("8", "4", "3", "2", "16")
CYCLES_PER_CHAT = 10
MEMORY_TOLERANCE = 0.10
# Over the run's second half (memory has settled by then) the process may still grow this much at most,
# and Python objects this much; descriptors and threads may not grow at all.
SECOND_HALF_RSS_GROWTH = 0.02
SECOND_HALF_OBJECT_GROWTH = 0.05
WAIT_SECONDS = 300.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    from engine.runtime import prepare_runtime

    prepare_runtime()
    from PySide6.QtWidgets import QApplication

    application = QApplication.instance() or QApplication([])
    from app.controller import ChatController
    from app.settings import Settings, save_settings
    from app.store import ConversationStore
    from engine.models.catalog import load_model
    from engine.models.default_model import ensure_default_model
    from engine.planning.memory import mlx_memory, process_rss

    this_process = psutil.Process()

    def open_descriptors() -> int:
        return this_process.num_fds() if hasattr(this_process, "num_fds") else this_process.num_handles()

    def wait_until(condition, what: str) -> None:
        deadline = time.monotonic() + WAIT_SECONDS
        while not condition():
            application.processEvents()
            if time.monotonic() > deadline:
                raise TimeoutError(f"soak: {what} did not happen within {WAIT_SECONDS:.0f} s")
            time.sleep(0.005)

    workdir = Path(tempfile.mkdtemp(prefix="velox-soak-"))
    settings_file = workdir / "settings.json"
    save_settings(Settings(max_tokens=args.max_tokens, compression="16", temperature=0.7), settings_file)
    loaded = load_model(ensure_default_model())
    controller = ChatController(ConversationStore(workdir / "velox.sqlite3"), None, settings_file)
    errors: list[str] = []
    controller.errorRaised.connect(errors.append)
    controller.start(loaded=loaded)
    wait_until(lambda: controller.model is not None and not controller.busy, "loading the model")

    def idle() -> bool:
        return not controller.busy and controller._turn is None

    def reply(text: str, stop_early: bool = False) -> None:
        chunks: list[str] = []

        def on_chunk(so_far: str) -> None:
            chunks.append(so_far)
            if stop_early and len(chunks) == 1:
                controller.stop()

        controller.replyStreaming.connect(on_chunk)
        try:
            assert controller.send(text), "send was refused"
            wait_until(idle, "a reply")
        finally:
            controller.replyStreaming.disconnect(on_chunk)

    def switch_level(level: str) -> None:
        switched: list[dict] = []
        controller.compressionChanged.connect(switched.append)
        try:
            controller.set_compression(level, remember=False)
            wait_until(lambda: bool(switched) and not controller.busy, f"switching to level {level}")
        finally:
            controller.compressionChanged.disconnect(switched.append)

    shown: dict[int, list[tuple[str, str, bool]]] = {}  # conversation id -> what the view showed

    def remember_conversation() -> None:
        if controller.conversation_id is not None:
            shown[controller.conversation_id] = [(e.role, e.text, e.cancelled) for e in controller.entries]

    series = []
    gc.collect()
    rss_before_first_cycle = process_rss()
    started = time.perf_counter()
    for cycle in range(1, args.cycles + 1):
        if cycle > 1 and (cycle - 1) % CYCLES_PER_CHAT == 0:
            remember_conversation()
            controller.new_chat()
        reply(f"Question {cycle}: name one animal that lives in the sea.")
        reply(f"Question {cycle}b: write a long story about a lighthouse.", stop_early=True)
        assert controller.regenerate(), "regenerate was refused"
        wait_until(idle, "a regenerated reply")
        level = LEVEL_CYCLE[(cycle - 1) % len(LEVEL_CYCLE)]
        switch_level(level)
        gc.collect()
        counters = mlx_memory()
        series.append({"cycle": cycle, "seconds": round(time.perf_counter() - started, 2), "level": level,
                       "rss_bytes": process_rss(), "mlx_active_bytes": counters["active"],
                       "mlx_cache_bytes": counters["cache"], "kv_held_bytes": controller.kv_held,
                       "open_fds": open_descriptors(), "threads": this_process.num_threads(),
                       "python_objects": len(gc.get_objects())})
        print(f"cycle {cycle:4d}  {series[-1]['seconds']:8.1f} s  level {level:>2}  "
              f"RSS {series[-1]['rss_bytes'] / 1e6:7.1f} MB  MLX active {counters['active'] / 1e6:7.1f} MB  "
              f"fds {series[-1]['open_fds']}  objects {series[-1]['python_objects']}", flush=True)
    remember_conversation()

    # Every completed message is on disk, exactly as shown; nothing is left half-written.
    store = ConversationStore(workdir / "velox.sqlite3")
    mismatches = []
    stored_messages = 0
    for conversation_id, expected in shown.items():
        _meta, messages = store.load_conversation(conversation_id)
        stored_messages += len(messages)
        on_disk = [(m.role, m.content, m.cancelled) for m in messages]
        if on_disk != expected:
            mismatches.append({"conversation": conversation_id, "shown": len(expected), "stored": len(on_disk)})
        mismatches.extend({"conversation": conversation_id, "message": m.id, "state": m.state}
                          for m in messages if m.state != "complete")
    store.close()
    controller.shutdown()
    controller.store.close()

    first, last = series[0], series[-1]
    middle = series[(len(series) - 1) // 2]
    rss_change = (last["rss_bytes"] - first["rss_bytes"]) / first["rss_bytes"]

    def outside_kv(point: dict) -> int:
        return point["mlx_active_bytes"] - point["kv_held_bytes"]

    mlx_change = (outside_kv(last) - outside_kv(first)) / outside_kv(first)
    memory_ok = abs(rss_change) <= MEMORY_TOLERANCE and abs(mlx_change) <= MEMORY_TOLERANCE
    second_half = {
        "from_cycle": middle["cycle"],
        "rss_growth_fraction": round((last["rss_bytes"] - middle["rss_bytes"]) / middle["rss_bytes"], 4),
        "open_fds": [middle["open_fds"], last["open_fds"]],
        "threads": [middle["threads"], last["threads"]],
        "python_objects": [middle["python_objects"], last["python_objects"]],
    }
    no_leaks = (second_half["rss_growth_fraction"] <= SECOND_HALF_RSS_GROWTH
                and last["open_fds"] <= middle["open_fds"] and last["threads"] <= middle["threads"]
                and last["python_objects"] <= middle["python_objects"] * (1 + SECOND_HALF_OBJECT_GROWTH))
    database_ok = not mismatches and stored_messages == sum(len(v) for v in shown.values())
    result = {
        "command": "QT_QPA_PLATFORM=offscreen python benchmarks/soak.py " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "model": loaded[2].name,
        "cycles": args.cycles,
        "max_tokens": args.max_tokens,
        "seconds": round(time.perf_counter() - started, 1),
        "load_average_at_end": list(os.getloadavg()),
        "rss_before_first_cycle_bytes": rss_before_first_cycle,
        "rss_after_first_cycle_bytes": first["rss_bytes"],
        "rss_after_last_cycle_bytes": last["rss_bytes"],
        "rss_change_fraction": round(rss_change, 4),
        "rss_peak_bytes": max(point["rss_bytes"] for point in series),
        "mlx_active_outside_kv_change_fraction": round(mlx_change, 4),
        "memory_within_10_percent": memory_ok,
        "second_half": second_half,
        "no_leaks": no_leaks,
        "conversations": len(shown),
        "messages_shown": sum(len(v) for v in shown.values()),
        "messages_stored": stored_messages,
        "database_mismatches": mismatches,
        "database_holds_every_message": database_ok,
        "errors_shown": errors,
        "series": series,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.cycles} cycles in {result['seconds']:.0f} s; RSS {first['rss_bytes'] / 1e6:.1f} -> "
          f"{last['rss_bytes'] / 1e6:.1f} MB ({rss_change:+.1%}), MLX outside the cache {mlx_change:+.1%} "
          f"(within 10 %: {memory_ok}); second half RSS {second_half['rss_growth_fraction']:+.1%}, "
          f"no leaks: {no_leaks}; "
          f"{stored_messages} of {result['messages_shown']} messages on disk as shown: {database_ok}; "
          f"errors: {len(errors)}. Written to {args.out}")
    return 0 if memory_ok and no_leaks and database_ok and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
