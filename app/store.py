"""Conversations kept across restarts: one SQLite file, `data_dir()/velox.sqlite3`, written message by message.

Durability. Every call that changes something is one transaction, committed before the call returns, so
a message is on disk as soon as it completes ("written as each message completes"). A reply is also
written while it streams (state 'streaming', updated at most once a second by the controller), so a crash
keeps what was shown; the next start marks such replies 'interrupted' (`mark_interrupted_replies`). The file uses WAL
journaling (readers never block the writer, a second window or process can read while a reply is saved)
with `synchronous=FULL`: in WAL mode NORMAL is also corruption-safe, but the last transactions before a
power loss or OS crash may be rolled back; FULL syncs the WAL at every commit so a message the app showed as
saved stays saved. That costs one fsync per message, milliseconds against the seconds a reply takes.

Documents. A message stores its attached documents in full (name, path, kind, character count and the
text itself) in `documents_json`. The text is kept, not just the name, so a restored conversation can be
continued: the model sees exactly the prompt it saw before, even if the file has since moved or changed,
and the prompt cache prefix is reused. The cost is disk space (a 300-page book is ~1 MB of text).

Schema versions live in `PRAGMA user_version`; `MIGRATIONS[i]` upgrades version i to i + 1. A file from a
newer Velox is refused with a clear error and left untouched. A file SQLite reports as damaged is moved
aside (renamed with a timestamp, never deleted) and a fresh one is started; `notice` says where it went.

Nothing here imports Qt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.chat.documents import Document
from engine.chat.session import Message
from engine.errors import VeloxError
from engine.paths import PRIVATE_FILE_MODE, data_dir, make_private_file, private_dir

DATABASE_FILE_NAME = "velox.sqlite3"
SAVED_CACHES_FOLDER_NAME = "caches"  # conversations' saved KV caches, beside the database
TITLE_LENGTH = 48
SCHEMA_VERSION = 2
ROLES = ("system", "user", "assistant")
# A message's life: 'complete' once written whole; a reply is 'streaming' while it is saved as it arrives,
# and 'interrupted' when the app found it still streaming after a crash (`mark_interrupted_replies`).
MESSAGE_STATES = ("complete", "streaming", "interrupted")
# How long a write waits for another connection (a second window) to finish its transaction.
BUSY_TIMEOUT_SECONDS = 10.0
# SQLite primary result codes that mean the file is damaged or not a database at all.
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
# Files SQLite keeps next to the database in WAL mode; moved aside together with it.
_SIDECAR_SUFFIXES = ("-wal", "-shm")


class StoreError(VeloxError):
    """The conversation database cannot be opened, read or written; the message says why."""


class _CorruptDatabase(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class StoredDocument:
    """A document as saved with the message it was attached to (text included)."""

    name: str
    path: str
    kind: str
    n_chars: int
    text: str


@dataclass(frozen=True)
class ConversationMeta:
    id: int
    title: str
    created: float  # seconds since the epoch
    updated: float  # time of the last message added or changed
    model: str
    compression: str
    message_count: int


@dataclass(frozen=True)
class StoredMessage:
    id: int
    conversation_id: int
    position: int  # 0, 1, 2 ... within its conversation
    role: str
    content: str
    documents: tuple[StoredDocument, ...]
    cancelled: bool
    created: float
    compression: str | None  # the KV cache setting the reply was generated with
    stats: dict[str, Any] | None  # engine.chat.session.GenerationStats as a dict
    state: str = "complete"  # one of MESSAGE_STATES

    @property
    def interrupted(self) -> bool:
        return self.state == "interrupted"


# ------------------------------------------------------------------------------------------------ schema


def _create_version_1(connection: sqlite3.Connection) -> None:
    connection.execute(
        """CREATE TABLE conversations (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            title TEXT NOT NULL,
            created REAL NOT NULL,
            updated REAL NOT NULL,
            model TEXT NOT NULL DEFAULT '',
            compression TEXT NOT NULL DEFAULT ''
        )"""
    )
    connection.execute(
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL,
            documents_json TEXT NOT NULL DEFAULT '[]',
            cancelled INTEGER NOT NULL DEFAULT 0,
            created REAL NOT NULL,
            compression TEXT,
            stats_json TEXT,
            UNIQUE (conversation_id, position)
        )"""
    )
    connection.execute("CREATE INDEX conversations_by_update ON conversations (updated DESC, id DESC)")


def _add_message_state(connection: sqlite3.Connection) -> None:
    """Version 2: replies are saved while they stream, so a crash keeps what was already shown."""
    connection.execute(
        "ALTER TABLE messages ADD COLUMN state TEXT NOT NULL DEFAULT 'complete' "
        "CHECK (state IN ('complete', 'streaming', 'interrupted'))"
    )


# MIGRATIONS[i] takes a database from schema version i to i + 1 (version 0 is an empty file).
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_create_version_1, _add_message_state)
assert len(MIGRATIONS) == SCHEMA_VERSION


def default_database_path() -> Path:
    return data_dir() / DATABASE_FILE_NAME


def saved_caches_folder(database_path: str | Path) -> Path:
    """The folder of conversations' saved KV caches (engine.chat.saved_cache) kept with a database."""
    return Path(database_path).parent / SAVED_CACHES_FOLDER_NAME


def conversation_title(text: str) -> str:
    """A conversation's title: its first question on one line, cut to TITLE_LENGTH characters."""
    line = " ".join(text.split())
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


def _is_corruption(error: sqlite3.DatabaseError) -> bool:
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(error).lower()
    return "not a database" in text or "malformed" in text


def _documents_json(documents: Iterable[Any]) -> str:
    entries = []
    for document in documents:
        text = str(document.text)
        entries.append(
            {
                "name": str(document.name),
                "path": str(getattr(document, "path", "") or ""),
                "kind": str(getattr(document, "kind", "") or "text"),
                "n_chars": int(getattr(document, "n_chars", len(text))),
                "text": text,
            }
        )
    return json.dumps(entries, ensure_ascii=False)


def _stats_json(stats: Any) -> str | None:
    if stats is None:
        return None
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        stats = dataclasses.asdict(stats)
    if not isinstance(stats, dict):
        raise TypeError(f"stats must be a GenerationStats, a dict or None, not {type(stats).__name__}.")
    return json.dumps(stats)


def _check_state(state: str) -> None:
    if state not in MESSAGE_STATES:
        raise ValueError(f"A message's state must be one of {', '.join(MESSAGE_STATES)}, not {state!r}.")


def _rollback(connection: sqlite3.Connection) -> None:
    # After some failures (an I/O error during COMMIT) SQLite has already rolled back by itself.
    if connection.in_transaction:
        connection.execute("ROLLBACK")


_UNSET: Any = object()


class ConversationStore:
    """Conversations and their messages in one SQLite file. Safe to share between threads (calls are
    serialised); several stores, in this process or others, may use the same file at once."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_database_path()
        # Set when a damaged file was moved aside on opening: one sentence to show the user.
        self.notice: str | None = None
        self.moved_aside_to: Path | None = None
        self._lock = threading.RLock()
        self._connection = self._open()

    # ----- opening --------------------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        try:
            self._make_private()
            connection = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as error:
            raise StoreError(f"The conversation database {self.path} cannot be opened: {error}.") from error
        connection.row_factory = sqlite3.Row
        return connection

    def _make_private(self) -> None:
        """Conversations hold whole documents: the folder is 0700 and the database and its WAL files 0600,
        for a new file and for one an older Velox left readable by others. SQLite gives the -wal and -shm
        files it creates later the database file's mode, so creating that file 0600 covers them too."""
        private_dir(self.path.parent)
        try:
            descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, PRIVATE_FILE_MODE)
        except FileExistsError:
            pass
        else:
            os.close(descriptor)  # an empty file is a valid, empty SQLite database
        for path in (self.path, *(self.path.with_name(self.path.name + suffix) for suffix in _SIDECAR_SUFFIXES)):
            make_private_file(path)

    def _prepare(self, connection: sqlite3.Connection) -> None:
        """Configure the connection, check the file and bring its schema up to date."""
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=FULL")
            connection.execute("PRAGMA foreign_keys=ON")
            version = connection.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"The conversation database {self.path} was written by a newer version of Velox (schema "
                    f"version {version}; this version understands up to {SCHEMA_VERSION}). Update Velox to "
                    "open it; the file was left untouched."
                )
            # quick_check reads every page once (it skips only the index-to-table cross checks), so damage
            # is found now, when the file can still be moved aside, rather than halfway through a session.
            problems = [row[0] for row in connection.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise _CorruptDatabase(problems[0])
            if version < SCHEMA_VERSION:
                connection.execute("BEGIN IMMEDIATE")
                try:
                    # Re-read under the write lock: another process may have migrated meanwhile.
                    version = connection.execute("PRAGMA user_version").fetchone()[0]
                    for migrate in MIGRATIONS[version:]:
                        migrate(connection)
                    connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                    connection.execute("COMMIT")
                except BaseException:
                    _rollback(connection)
                    raise
        except sqlite3.DatabaseError as error:
            if _is_corruption(error):
                raise _CorruptDatabase(str(error)) from error
            raise StoreError(f"The conversation database {self.path} cannot be used: {error}.") from error

    def _open(self) -> sqlite3.Connection:
        connection = self._connect()
        try:
            self._prepare(connection)
            return connection
        except _CorruptDatabase as corrupt:
            connection.close()
            moved_to = self._move_aside()
            self.moved_aside_to = moved_to
            self.notice = (
                f"The conversation database was damaged ({corrupt.reason}); it was moved to {moved_to} so "
                "nothing in it is lost, and a new, empty one was started."
            )
        except BaseException:
            connection.close()
            raise
        connection = self._connect()
        try:
            self._prepare(connection)
        except _CorruptDatabase as corrupt:
            connection.close()
            raise StoreError(f"A new conversation database at {self.path} could not be created: {corrupt.reason}.") from corrupt
        except BaseException:
            connection.close()
            raise
        return connection

    def _move_aside(self) -> Path:
        """Rename the damaged file (and its WAL files) to '<name>.corrupt-<timestamp>'; return the new path."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        counter = 1
        while target.exists():
            counter += 1
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{counter}")
        try:
            self.path.rename(target)
            for suffix in _SIDECAR_SUFFIXES:
                sidecar = self.path.with_name(self.path.name + suffix)
                if sidecar.exists():
                    sidecar.rename(target.with_name(target.name + suffix))
        except OSError as error:
            raise StoreError(
                f"The conversation database {self.path} is damaged and could not be moved aside: {error}."
            ) from error
        return target

    # ----- plumbing ---------------------------------------------------------------------------------------

    @contextmanager
    def _transaction(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed on success and rolled back on any error.

        `durable=False` commits without the fsync (synchronous=NORMAL for this one transaction): the write
        still survives the app being killed, only an OS crash or power loss may roll it back. Used for the
        snapshots of a streaming reply, which are written on the GUI thread once a second and must not
        stall it waiting for the disk; the completed reply is then written durably."""
        with self._lock:
            connection = self._require_open()
            if not durable:
                connection.execute("PRAGMA synchronous=NORMAL")  # outside a transaction, as SQLite requires
            try:
                try:
                    # IMMEDIATE takes the write lock up front, so reading the next position and inserting
                    # cannot interleave with another connection's insert.
                    connection.execute("BEGIN IMMEDIATE")
                except sqlite3.Error as error:
                    raise StoreError(f"The conversation database {self.path} is busy or unwritable: {error}.") from error
                try:
                    yield connection
                    connection.execute("COMMIT")
                except sqlite3.Error as error:
                    _rollback(connection)
                    raise StoreError(f"The conversation database {self.path} could not be written: {error}.") from error
                except BaseException:
                    _rollback(connection)
                    raise
            finally:
                if not durable:
                    connection.execute("PRAGMA synchronous=FULL")

    def _read(self, sql: str, parameters: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            connection = self._require_open()
            try:
                return connection.execute(sql, parameters).fetchall()
            except sqlite3.Error as error:
                raise StoreError(f"The conversation database {self.path} could not be read: {error}.") from error

    def _require_open(self) -> sqlite3.Connection:
        if self._connection is None:
            raise StoreError("The conversation store is closed.")
        return self._connection

    @staticmethod
    def _require_conversation(connection: sqlite3.Connection, conversation_id: int) -> None:
        if connection.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)).fetchone() is None:
            raise StoreError(f"Conversation {conversation_id} does not exist (it may have been deleted).")

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- conversations ------------------------------------------------------------------------------------

    def create_conversation(self, title: str, model: str = "", compression: str = "") -> int:
        """A new, empty conversation; returns its id."""
        now = time.time()
        with self._transaction() as connection:
            cursor = connection.execute(
                "INSERT INTO conversations (title, created, updated, model, compression) VALUES (?, ?, ?, ?, ?)",
                (title, now, now, model, compression),
            )
            return int(cursor.lastrowid or 0)

    def rename(self, conversation_id: int, title: str) -> None:
        """Change the title (the conversation keeps its place in the list: `updated` is not touched)."""
        with self._transaction() as connection:
            self._require_conversation(connection, conversation_id)
            connection.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def set_conversation_settings(
        self, conversation_id: int, *, model: str | None = None, compression: str | None = None
    ) -> None:
        """Record the model and/or compression setting the conversation now uses."""
        with self._transaction() as connection:
            self._require_conversation(connection, conversation_id)
            if model is not None:
                connection.execute("UPDATE conversations SET model = ? WHERE id = ?", (model, conversation_id))
            if compression is not None:
                connection.execute(
                    "UPDATE conversations SET compression = ? WHERE id = ?", (compression, conversation_id)
                )

    def delete(self, conversation_id: int) -> bool:
        """Delete a conversation and its messages; False if there was no such conversation."""
        with self._transaction() as connection:
            cursor = connection.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            return cursor.rowcount > 0

    def list_conversations(self) -> list[ConversationMeta]:
        """Every conversation, the most recently updated first, with its message count."""
        rows = self._read(
            """SELECT c.id, c.title, c.created, c.updated, c.model, c.compression,
                      (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS message_count
               FROM conversations c ORDER BY c.updated DESC, c.id DESC"""
        )
        return [self._meta(row) for row in rows]

    def load_conversation(self, conversation_id: int) -> tuple[ConversationMeta, list[StoredMessage]]:
        """The conversation and its messages in order; StoreError if it does not exist."""
        with self._lock:  # one consistent view: no message may be added between the two reads
            meta_rows = self._read(
                """SELECT c.id, c.title, c.created, c.updated, c.model, c.compression,
                          (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS message_count
                   FROM conversations c WHERE c.id = ?""",
                (conversation_id,),
            )
            if not meta_rows:
                raise StoreError(f"Conversation {conversation_id} does not exist (it may have been deleted).")
            message_rows = self._read(
                "SELECT * FROM messages WHERE conversation_id = ? ORDER BY position", (conversation_id,)
            )
        messages = [self._message(row) for row in message_rows]
        meta = dataclasses.replace(self._meta(meta_rows[0]), message_count=len(messages))
        return meta, messages

    # ----- messages --------------------------------------------------------------------------------------------

    def append_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        documents: Iterable[Any] = (),
        cancelled: bool = False,
        stats: Any = None,
        compression: str | None = None,
        state: str = "complete",
        durable: bool = True,
    ) -> int:
        """Add a message at the end of the conversation, committed to disk before returning; its id.

        `state='streaming'` starts a reply that `update_message` fills in as it arrives and completes;
        `durable=False` skips the fsync (see `_transaction`), for those in-between snapshots.

        `documents`: engine.chat.documents.Document or StoredDocument objects (anything with name and text).
        `stats`: an engine.chat.session.GenerationStats, a dict, or None.
        """
        if role not in ROLES:
            raise ValueError(f"A message's role must be one of {', '.join(ROLES)}, not {role!r}.")
        _check_state(state)
        documents_json = _documents_json(documents)
        stats_json = _stats_json(stats)
        now = time.time()
        with self._transaction(durable) as connection:
            self._require_conversation(connection, conversation_id)
            (position,) = connection.execute(
                "SELECT COALESCE(MAX(position), -1) + 1 FROM messages WHERE conversation_id = ?",
                (conversation_id,),
            ).fetchone()
            cursor = connection.execute(
                """INSERT INTO messages (conversation_id, position, role, content, documents_json, cancelled,
                                         created, compression, stats_json, state)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                (conversation_id, position, role, content, documents_json, int(cancelled), now, compression,
                 stats_json, state),
            )
            connection.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
            return int(cursor.lastrowid or 0)

    def update_message(
        self,
        message_id: int,
        *,
        content: str = _UNSET,
        documents: Iterable[Any] = _UNSET,
        cancelled: bool = _UNSET,
        stats: Any = _UNSET,
        compression: str | None = _UNSET,
        state: str = _UNSET,
        durable: bool = True,
    ) -> None:
        """Change the given fields of a message (e.g. a regenerated reply); the others stay as they are.
        `durable=False`: a snapshot of a streaming reply, committed without the fsync."""
        assignments: list[str] = []
        values: list[Any] = []
        if state is not _UNSET:
            _check_state(state)
            assignments.append("state = ?")
            values.append(state)
        if content is not _UNSET:
            assignments.append("content = ?")
            values.append(content)
        if documents is not _UNSET:
            assignments.append("documents_json = ?")
            values.append(_documents_json(documents))
        if cancelled is not _UNSET:
            assignments.append("cancelled = ?")
            values.append(int(cancelled))
        if stats is not _UNSET:
            assignments.append("stats_json = ?")
            values.append(_stats_json(stats))
        if compression is not _UNSET:
            assignments.append("compression = ?")
            values.append(compression)
        with self._transaction(durable) as connection:
            row = connection.execute("SELECT conversation_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                raise StoreError(f"Message {message_id} does not exist (its conversation may have been deleted).")
            if not assignments:
                return
            connection.execute(f"UPDATE messages SET {', '.join(assignments)} WHERE id = ?", (*values, message_id))
            connection.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), row[0]))

    def mark_interrupted_replies(self) -> int:
        """Mark every reply still 'streaming' as 'interrupted' (and cancelled, so a restored session treats it
        as a partial reply): the app that was writing it died. Called when the app starts; returns how many."""
        with self._transaction() as connection:
            cursor = connection.execute(
                "UPDATE messages SET state = 'interrupted', cancelled = 1 WHERE state = 'streaming'"
            )
            return cursor.rowcount

    def delete_messages_from(self, conversation_id: int, position: int) -> int:
        """Delete the messages at `position` and after (e.g. before regenerating); how many were deleted."""
        with self._transaction() as connection:
            self._require_conversation(connection, conversation_id)
            cursor = connection.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND position >= ?", (conversation_id, position)
            )
            connection.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conversation_id))
            return cursor.rowcount

    # ----- rows to objects ---------------------------------------------------------------------------------------

    @staticmethod
    def _meta(row: sqlite3.Row) -> ConversationMeta:
        return ConversationMeta(
            id=row["id"], title=row["title"], created=row["created"], updated=row["updated"], model=row["model"],
            compression=row["compression"], message_count=row["message_count"],
        )

    @staticmethod
    def _message(row: sqlite3.Row) -> StoredMessage:
        documents = tuple(StoredDocument(**entry) for entry in json.loads(row["documents_json"] or "[]"))
        return StoredMessage(
            id=row["id"], conversation_id=row["conversation_id"], position=row["position"], role=row["role"],
            content=row["content"], documents=documents, cancelled=bool(row["cancelled"]), created=row["created"],
            compression=row["compression"],
            stats=json.loads(row["stats_json"]) if row["stats_json"] else None, state=row["state"],
        )

    @staticmethod
    def to_session_history(messages: Iterable[StoredMessage]) -> list[Message]:
        """The user and assistant messages as engine.chat.session.Message objects, documents included, ready
        to become a ChatSession's `history`. System messages are skipped: a session keeps its system
        prompt separately (ChatSession.system_prompt)."""
        history = []
        for message in messages:
            if message.role == "system":
                continue
            documents = [
                Document(path=Path(doc.path), name=doc.name, kind=doc.kind, text=doc.text, n_chars=doc.n_chars)
                for doc in message.documents
            ]
            history.append(Message(message.role, message.content, documents, message.cancelled))
        return history


to_session_history = ConversationStore.to_session_history
