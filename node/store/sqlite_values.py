"""The SQLite store's pieces that are not the store itself: a write's bound
values (a stored row's values out are node/store/values.py's, shared with
PostgreSQL), SQLite's errors as the store's, WAL mode, and the write transaction
with its origin for the triggers, text another program stored that is not
UTF-8, and the power-loss tests' snapshot hook. ``sqlite.py`` is the store."""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import time
from typing import Any

from node.core.errors import StoreError, StoreUnavailable
from node.core.rows import (
    DEFAULT_JOB,
    MISSING,
    ORIGINS,
    RowWrite,
)
from node.store import queries as q
from node.store.values import encode_payload

# A writer holding the file's write lock (another node process, an importer)
# is waited for this long before the operation fails as unavailable.
BUSY_TIMEOUT_S = 5.0

# A test hook: where ``Store.sync`` leaves a copy of what is durable, for a
# test that drops everything after it, as a power loss would.
SNAPSHOT_HOOK = (
    os.environ.get("QUEUE_NODE_STORE_SYNCED")
    if os.environ.get("QUEUE_NODE_TEST_HOOKS") == "1"
    else None
)


def snapshot(conn: sqlite3.Connection, target: str) -> None:
    """Test hook (QUEUE_NODE_TEST_HOOKS=1, QUEUE_NODE_STORE_SYNCED=path): copy
    what ``conn`` sees committed now to ``target``, which then holds what a
    power loss would leave at most (tests/integration/test_power_loss.py).
    The caller holds the connection's lock."""
    tmp = target + ".tmp"
    dest = sqlite3.connect(tmp)
    try:
        conn.backup(dest)
    finally:
        dest.close()
    os.replace(tmp, target)


# -- text that is not UTF-8 -------------------------------------------------------


class NotUtf8(bytes):
    """A key stored as text that is not UTF-8, as a walk's cursor: the next
    chunk binds it as text (``bytes`` would bind as a blob). Hashable, as
    every key is."""


def undecodable(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` is sqlite3's refusal of stored text that is not UTF-8
    (another program may store any bytes as TEXT): a read that fails so is
    read again by ``read_raw``."""
    return isinstance(exc, sqlite3.OperationalError) and "decode to UTF-8" in str(exc)


def read_raw(
    conn: sqlite3.Connection, sql: str, params: Any, ok_at: int | None, texts: tuple[int, ...]
) -> list[tuple]:
    """``sql``'s rows with a TEXT value that is not UTF-8 as its bytes (a
    blob is bytes anyway), and the row's validity flag (column ``ok_at``,
    the SQL's, which cannot see the encoding) false when a column of
    ``texts`` (a key, a route) is bytes: the keeper skips the row, and the
    feed and the walk go on past it. The slow path, after ``undecodable``."""
    conn.text_factory = _text
    try:
        found = conn.execute(sql, params).fetchall()
    finally:
        conn.text_factory = str
    if ok_at is None:
        return found
    rows = []
    for stored in found:
        if stored[ok_at] and any(type(stored[i]) is bytes for i in texts):
            stored = (*stored[:ok_at], 0, *stored[ok_at + 1 :])
        rows.append(stored)
    return rows


def _text(value: bytes) -> str | bytes:
    """sqlite3's text factory for ``read_raw``: UTF-8, else the bytes."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value

# -- values in ------------------------------------------------------------------


def _params(w: RowWrite, now: float) -> tuple:
    cadence_s, sitemap, due_at, payload, job = w.cadence_s, w.sitemap, w.due_at, w.payload, w.job
    return (
        w.key,
        w.route,
        None if cadence_s is MISSING else cadence_s,
        0 if sitemap is MISSING else sitemap,
        now if due_at is MISSING else due_at,
        None if payload is MISSING else encode_payload(payload),
        DEFAULT_JOB if job is MISSING else job,
    )


# Primary result codes that mean "not reachable now" rather than "broken".
_UNAVAILABLE_CODES = frozenset(
    (
        sqlite3.SQLITE_PERM,
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_CANTOPEN,
    )
)


def store_error(code: int | None, message: str, action: str) -> StoreError:
    """A SQLite failure (its result code, when known, and message) as the
    store's error: StoreUnavailable when it means "not reachable now", else
    StoreError. The claim path in C reports its failures through this too."""
    if code is not None and code & 0xFF in _UNAVAILABLE_CODES:
        return StoreUnavailable(f"SQLite store: {action}: {message}")
    return StoreError(f"SQLite store: {action}: {message}")


def wrap_error(exc: sqlite3.Error, action: str) -> StoreError:
    """A SQLite error raised by Python's sqlite3 as the store's (store_error)."""
    return store_error(getattr(exc, "sqlite_errorcode", None), str(exc), action)


_wrap = wrap_error


def _set_wal(conn: sqlite3.Connection) -> str:
    """Switch to WAL, retrying while another process does the same: changing
    the journal mode of a new file needs an exclusive lock, and SQLite answers
    "database is locked" at once there instead of calling the busy handler."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    delay = 0.001
    while True:
        try:
            return conn.execute(q.JOURNAL_WAL).fetchone()[0]
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)  # backing off from another opener's lock, bounded
        delay = min(delay * 2, 0.05)


def _check_origin(origin: str) -> None:
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, not {origin!r}")


class _WriteTransaction:
    """BEGIN IMMEDIATE, rolled back on any error. With an origin, the origin
    is set for the triggers first and put back to 'external' before COMMIT,
    so the committed value is always 'external'."""

    __slots__ = ("conn", "origin")

    def __init__(self, conn: sqlite3.Connection, origin: str | None) -> None:
        self.conn = conn
        self.origin = origin

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute(q.BEGIN_WRITE)
        if self.origin is not None:
            try:
                self.conn.execute(q.SET_ORIGIN, (self.origin,))
            except BaseException:
                self.conn.execute(q.ROLLBACK)
                raise
        return self.conn

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            try:
                if self.origin is not None:
                    self.conn.execute(q.RESET_ORIGIN)
                self.conn.execute(q.COMMIT)
                return
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute(q.ROLLBACK)
                raise
        if self.conn.in_transaction:
            self.conn.execute(q.ROLLBACK)


def _check_file(path: str, create: bool = False) -> None:
    """Raise as opening ``path`` read-write would (missing, a directory, no
    permission), without opening it: closing a descriptor of a file drops
    every POSIX lock the process holds on it, its SQLite connections'
    included (docs/schema.md, "No descriptor of the file outside SQLite").
    ``create``: a missing file is created (with its directory), mode 0600,
    never with umask's (SQLite gives the -wal and -shm files its mode)."""
    if create:
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            return  # new: no process holds it
        except FileExistsError:
            pass
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not os.access(path, os.R_OK | os.W_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
