"""Issue 10, item 7: conversations and documents must not be readable by other users."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from app.store import ConversationStore

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
REPO_ROOT = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_new_store_is_private_even_with_a_permissive_umask(tmp_path):
    data = tmp_path / "data"
    previous = os.umask(0o022)
    try:
        with ConversationStore(data / "velox.sqlite3") as store:
            conversation = store.create_conversation("secret")
            store.append_message(conversation, "user", "my whole document")
            # WAL mode: the -wal and -shm files exist while the connection is open.
            assert mode(data) == 0o700
            for name in ("velox.sqlite3", "velox.sqlite3-wal", "velox.sqlite3-shm"):
                assert mode(data / name) == 0o600, name
    finally:
        os.umask(previous)


def test_store_left_readable_by_an_older_version_is_tightened_and_keeps_its_messages(tmp_path):
    data = tmp_path / "data"
    with ConversationStore(data / "velox.sqlite3") as store:
        conversation = store.create_conversation("old")
        store.append_message(conversation, "user", "kept")
    data.chmod(0o755)
    (data / "velox.sqlite3").chmod(0o644)
    with ConversationStore(data / "velox.sqlite3") as store:
        assert mode(data) == 0o700
        assert mode(data / "velox.sqlite3") == 0o600
        assert mode(data / "velox.sqlite3-wal") == 0o600
        _meta, messages = store.load_conversation(conversation)
        assert [m.content for m in messages] == ["kept"]


def test_data_dir_is_created_private_and_tightened(tmp_path):
    data = tmp_path / "velox-data"
    script = "from engine.paths import data_dir; print(data_dir())"
    environment = {**os.environ, "VELOX_DATA_DIR": str(data), "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", script], check=True, env=environment, capture_output=True)
    assert mode(data) == 0o700
    data.chmod(0o755)
    subprocess.run([sys.executable, "-c", script], check=True, env=environment, capture_output=True)
    assert mode(data) == 0o700
