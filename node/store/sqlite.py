"""The embedded default store: one SQLite file in WAL mode.

The schedule table, its change log and the triggers that fill the log are a
contract for programs that write the file directly; ``docs/schema.md``
describes them. Every statement run here is named in ``node/store/queries.py``
(the migrations, ``MIGRATIONS``, and one constant per operation).

Hazards this module handles:

- **Origin.** Triggers cannot see who is writing. The one-row table
  ``write_origin`` holds ``'external'`` in every committed state; the node's
  write transaction sets it to ``'node'`` or ``'writeback'`` first and back to
  ``'external'`` before COMMIT. Any other program's write is therefore
  logged as external without it having to know about this.
- **Versions.** A row's version is the seq of the change its last write
  logged; the trigger that logs the change sets it (``last_insert_rowid()``
  inside a trigger is the seq it just inserted). ``RETURNING`` would show
  the value from before AFTER triggers ran, so the write-back reads the new
  version with a SELECT in the same transaction.
- **Fork.** A connection must not cross a fork. Each operation checks the
  pid; a child opens its own connection and leaves the inherited one
  untouched (closing it could act on the parent's locks and WAL).
- **WITHOUT ROWID** was measured and rejected: 12 % faster point reads with
  ~250-byte rows, but 70 % slower with 2 KB payloads (whole rows sit in the
  b-tree's interior pages), and payloads may reach 1 MiB.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from itertools import groupby
from operator import itemgetter
from typing import Any
from urllib.parse import quote

from node.core.errors import StoreError, StoreUnavailable
from node.core.rows import (
    ORIGIN_NODE,
    ORIGIN_WRITEBACK,
    Change,
    Row,
    RowWrite,
    stored_key_is_valid,
    stored_row_is_valid,
)
from node.store import queries as q
from node.store.base import (
    BadRow,
    ClaimSource,
    DueChange,
    LastError,
    Store,
    WriteBack,
    due_now_query,
    due_or_none,
)
from node.store.queries import MIGRATIONS, SCHEMA_VERSION  # also read here by tests
from node.store.sqlite_values import (
    BUSY_TIMEOUT_S,
    SNAPSHOT_HOOK,
    NotUtf8,
    _check_file,
    _check_origin,
    _params,
    _set_wal,
    _wrap,
    _WriteTransaction,
    read_raw,
    snapshot,
    store_error,
    undecodable,
)
from node.store.sqlite_walk import FastWalk
from node.store.values import bad_reason, decode_payload, stored_row

# WriteBack(key, due_at, if_version, result_id, finished_at): its key, and the
# parameters of q.WRITE_BACK in their order (due_at, result_id, finished_at,
# key, if_version).
_WB_KEY, _WB_ROW = itemgetter(0), itemgetter(1, 3, 4, 0, 2)

# Page cache per connection. Every worker process opens one connection, so
# this is paid N times; 16 MiB keeps the upper b-tree levels of a 1M-row table
# hot (measured: ~0.5 us less per point read than the 2 MiB default).
CACHE_KIB = 16 * 1024
# Memory-mapped reads save ~1 us per point read, but an I/O error on a mapped
# page kills the process with SIGBUS instead of raising; off by default.
MMAP_SIZE = 0
# SQLite allows 32,766 bound parameters; smaller IN lists plan as fast and
# keep one cached statement per chunk size.
IN_CHUNK = 500

# Connections a forked child inherited: kept referenced so the garbage
# collector never closes them in the child (see the module docstring).
_INHERITED: list[sqlite3.Connection] = []


class SQLiteStore(Store):
    """The schedule in one SQLite file (created mode 0600 if missing)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        durable: bool = True,
        autocheckpoint: bool = True,
        *,
        create: bool = True,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        cache_kib: int = CACHE_KIB,
    ) -> None:
        """``durable``: every commit is synced (``synchronous = FULL``); the
        ledger opens its connections with False (``docs/delivery.md``).
        ``autocheckpoint`` False: a commit never runs the WAL's checkpoint
        (SQLite's default, at 1,000 pages, copies and fsyncs inside the
        commit); the owner calls ``checkpoint_wal`` instead. ``create``
        False: a missing file is StoreUnavailable, never a new empty store
        (``reopen``). ``busy_timeout_s``: how long a statement waits for
        another connection's lock (the keeper waits little: its writes are
        best-effort and a wait stalls its loop). ``cache_kib``: the page cache
        (an int >= 1, else ValueError: in the PRAGMA, -N of a negative is a comment)."""
        if type(cache_kib) is not int or cache_kib < 1:
            raise ValueError(f"cache_kib must be a whole number of KiB, at least 1: {cache_kib!r}")
        self.path = os.fspath(path)
        self.durable = durable
        self.autocheckpoint = autocheckpoint
        self._create = create
        self._busy_timeout_s, self._cache_kib = busy_timeout_s, cache_kib
        # (st_dev, st_ino) of the file the connection opened: ``replaced``.
        self._identity: tuple[int, int] | None = None
        self._ckpt_lock = threading.Lock()
        self._ckpt_conn: sqlite3.Connection | None = None
        self.url = "sqlite:///" + self.path
        self._closed = False
        self._open()
        self._fast_walk = FastWalk(self.path, int(busy_timeout_s * 1000))

    # -- lifecycle -------------------------------------------------------------

    def _open(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.RLock()
        try:
            _check_file(self.path, self._create)
        except OSError as exc:
            verb = "create" if self._create else "open"
            raise StoreUnavailable(f"SQLite store: cannot {verb} {self.path}: {exc}") from exc
        try:
            # mode=rw: SQLite itself never creates a file that went missing
            # since the check above (``create`` False).
            conn = sqlite3.connect(
                self.path if self._create else f"file:{quote(self.path)}?mode=rw",
                timeout=self._busy_timeout_s,
                isolation_level=None,
                check_same_thread=False,
                uri=not self._create,
            )
            st = os.stat(self.path)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"SQLite store: cannot open {self.path}: {exc}") from exc
        self._identity = (st.st_dev, st.st_ino)
        try:
            mode = _set_wal(conn)
            if mode != "wal":
                raise StoreUnavailable(
                    f"SQLite store: {self.path} cannot use WAL mode (got {mode!r}); "
                    "is it on a network file system?"
                )
            pragmas = q.tuning_pragmas(
                int(self._busy_timeout_s * 1000), self._cache_kib, MMAP_SIZE, self.durable
            )
            for pragma in pragmas:
                conn.execute(pragma)
            if not self.autocheckpoint:
                conn.execute(q.NO_AUTOCHECKPOINT)
            self._migrate(conn)
        except sqlite3.Error as exc:
            conn.close()
            raise _wrap(exc, f"opening {self.path}") from exc
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Bring the file to SCHEMA_VERSION in one transaction; a no-op when
        it is there already. Two processes opening a new file at once
        serialise on BEGIN IMMEDIATE, and the second finds nothing to do.
        A file already there is recognised without the write lock, so that
        opening it works while another program holds that lock."""
        try:
            if conn.execute(q.READ_SCHEMA_VERSION).fetchone()[0] == SCHEMA_VERSION:
                return
        except sqlite3.OperationalError:
            pass  # no migrations table yet: a new file
        with _WriteTransaction(conn, None):
            conn.execute(q.CREATE_MIGRATIONS)
            current = conn.execute(q.READ_SCHEMA_VERSION).fetchone()[0]
            if current > SCHEMA_VERSION:
                raise StoreError(
                    f"SQLite store: {self.path} has schema version {current}, newer than "
                    f"this build's {SCHEMA_VERSION}; upgrade queue-node"
                )
            for version, name, statements in MIGRATIONS:
                if version <= current:
                    continue
                for statement in statements:
                    conn.execute(statement)
                conn.execute(q.RECORD_MIGRATION, (version, name, time.time()))

    def _c(self) -> sqlite3.Connection:
        """This process's connection."""
        if self._pid != os.getpid():
            self.check_fork()
        return self._conn

    def check_fork(self) -> None:
        if self._pid == os.getpid() or self._closed:
            return
        _INHERITED.append(self._conn)
        self._open()

    def replaced(self) -> str | None:
        """Why the file at ``path`` is no longer the one this connection
        reads (gone, or another file under its name), or None. A stat."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            return f"{self.path}: {exc.strerror or exc}"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"{self.path} was replaced (another file now has its name)"
        return None

    def identity(self) -> Any:
        return self._identity

    def reopen(self) -> SQLiteStore:
        return SQLiteStore(
            self.path,
            self.durable,
            self.autocheckpoint,
            create=False,
            busy_timeout_s=self._busy_timeout_s,
            cache_kib=self._cache_kib,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fast_walk.close()
        if self._pid != os.getpid():
            _INHERITED.append(self._conn)
            return
        with self._ckpt_lock:
            if self._ckpt_conn is not None:
                self._ckpt_conn.close()
                self._ckpt_conn = None
        with self._lock:
            try:
                self._conn.close()
            except sqlite3.Error as exc:
                raise _wrap(exc, "close") from exc

    def claim_source(self) -> ClaimSource:
        """The claim path in C reads this file on a connection of its own."""
        return ClaimSource(
            db_path=self.path,
            busy_timeout_ms=int(BUSY_TIMEOUT_S * 1000),
            cache_kib=CACHE_KIB,
            row_sql=q.CLAIM_ROW_SQL,
            rows_sql=q.CLAIM_ROWS_SQL,
            decode_payload=decode_payload,
            error=store_error,
        )

    def schema_version(self) -> int:
        """The schema version recorded in the file."""
        conn = self._c()
        with self._lock:
            try:
                return conn.execute(q.READ_SCHEMA_VERSION).fetchone()[0]
            except sqlite3.Error as exc:
                raise _wrap(exc, "schema_version") from exc

    # -- writes ----------------------------------------------------------------

    def upsert(self, rows: Sequence[RowWrite], *, now: float, origin: str = ORIGIN_NODE) -> int:
        """Insert or update rows in one transaction; returns ``len(rows)``.

        Consecutive rows carrying the same fields share one executemany, in
        order, so a later write of a key in the batch wins. An update that
        changes nothing is still logged (op 'U') and gets a new version."""
        _check_origin(origin)
        if not rows:
            return 0
        # Encode before the transaction: a bad payload fails with nothing written.
        batches = [
            (q.upsert_sql(present), [_params(w, now) for w in group])
            for present, group in groupby(rows, key=RowWrite.present)
        ]
        conn = self._c()
        with self._lock:
            try:
                with _WriteTransaction(conn, origin):
                    for sql, params in batches:
                        conn.executemany(sql, params)
            except sqlite3.Error as exc:
                raise _wrap(exc, "upsert") from exc
        return len(rows)

    def delete(self, keys: Sequence[str], *, origin: str = ORIGIN_NODE) -> int:
        _check_origin(origin)
        if not keys:
            return 0
        conn = self._c()
        with self._lock:
            try:
                with _WriteTransaction(conn, origin):
                    cur = conn.executemany(q.DELETE_ROW, [(k,) for k in keys])
            except sqlite3.Error as exc:
                raise _wrap(exc, "delete") from exc
        return cur.rowcount

    def due_now(
        self, *, route: str | None = None, job: str | None = None, now: float,
        origin: str = ORIGIN_NODE,
    ) -> int:  # fmt: skip
        _check_origin(origin)
        sql, value = due_now_query(route, job, q.DUE_NOW_ROUTE, q.DUE_NOW_JOB)
        conn = self._c()
        with self._lock:
            try:
                with _WriteTransaction(conn, origin):
                    cur = conn.execute(sql, (float(now), value))
            except sqlite3.Error as exc:
                raise _wrap(exc, "due_now") from exc
        return cur.rowcount

    def write_next_due(self, key: str, due_at: float, *, if_version: int) -> int | None:
        conn = self._c()
        with self._lock:
            try:
                with _WriteTransaction(conn, ORIGIN_WRITEBACK):
                    cur = conn.execute(q.WRITE_NEXT_DUE, (due_at, key, if_version))
                    if cur.rowcount == 0:
                        return None
                    return conn.execute(q.READ_VERSION, (key,)).fetchone()[0]
            except sqlite3.Error as exc:
                raise _wrap(exc, "write_next_due") from exc

    def write_back_many(self, items: Sequence[WriteBack]) -> list[int | None]:
        """One transaction for the whole group: one executemany of the
        guarded UPDATE, then the keys it wrote and their new versions from
        the change log (each written row logged one change; RETURNING would
        show the versions from before the triggers ran). When every row of a
        round took (its rowcount), its versions are the seqs that follow, in
        order (each UPDATE's trigger logs one change), and the log is not
        read. A key twice in the batch starts a new round there, so that each
        round's keys are distinct (the log says exactly which items took) and
        the items take their seqs in the batch's order, as one by one."""
        if not items:
            return []
        if len(set(map(_WB_KEY, items))) == len(items):
            rounds = [list(range(len(items)))]  # distinct keys, the usual group: one round
        else:
            rounds = [[]]
            seen: set[str] = set()  # the keys of the round being built
            for i, it in enumerate(items):
                if it.key in seen:
                    rounds.append([])
                    seen = set()
                seen.add(it.key)
                rounds[-1].append(i)
        out: list[int | None] = [None] * len(items)
        conn = self._c()
        with self._lock:
            try:
                with _WriteTransaction(conn, ORIGIN_WRITEBACK):
                    found = conn.execute(q.LAST_SEQ).fetchone()
                    seq = 0 if found is None else found[0]
                    for members in rounds:
                        these = items if len(rounds) == 1 else map(items.__getitem__, members)
                        cur = conn.executemany(q.WRITE_BACK, list(map(_WB_ROW, these)))
                        if cur.rowcount == len(members):
                            # Every row took, in order: each UPDATE logged one
                            # change (its trigger), whose seq is the new version.
                            for n, i in enumerate(members, seq + 1):
                                out[i] = n
                            seq += len(members)
                            continue
                        written = dict(conn.execute(q.CHANGES_SINCE, (seq,)).fetchall())
                        for i in members:
                            out[i] = written.get(items[i].key)
                        if written:
                            seq = max(written.values())
            except sqlite3.Error as exc:
                raise _wrap(exc, "write_back_many") from exc
        return out

    def write_last_errors(self, items: Sequence[LastError]) -> int:
        if not items:
            return 0
        conn = self._c()
        with self._lock:
            try:
                with _WriteTransaction(conn, None):
                    cur = conn.executemany(
                        q.WRITE_LAST_ERROR, [(it.error, it.key, it.at) for it in items]
                    )
            except sqlite3.Error as exc:
                raise _wrap(exc, "write_last_errors") from exc
        return cur.rowcount

    # -- reads -----------------------------------------------------------------

    def get(self, key: str) -> Row | BadRow | None:
        """Point read by key: the Row, a BadRow when another program stored
        values the keeper cannot schedule, or None."""
        conn = self._c()
        with self._lock:
            found = self._read(conn, q.GET_ROW, (key,), "get")
        return stored_row(found[0]) if found else None

    def get_many(self, keys: Iterable[str]) -> dict[str, Row | BadRow]:
        """Batched point read: Row or BadRow (as ``get``) by key; keys with
        no row are absent."""
        found = self._read_keys(keys, q.get_many_sql, "get_many")
        return {stored[0]: stored_row(stored) for stored in found}

    def _read_keys(self, keys: Iterable[str], sql_of: Any, action: str) -> list[tuple]:
        """The rows ``sql_of(n)`` reads for the distinct keys, IN_CHUNK at a time."""
        wanted = list(dict.fromkeys(keys))
        found: list[tuple] = []
        conn = self._c()
        with self._lock:
            for i in range(0, len(wanted), IN_CHUNK):
                chunk = wanted[i : i + IN_CHUNK]
                found += self._read(conn, sql_of(len(chunk)), chunk, action)
        return found

    @staticmethod
    def _read(
        conn: sqlite3.Connection, sql: str, params: Any, action: str,
        ok_at: int | None = None, texts: tuple[int, ...] = (),
    ) -> list[tuple]:  # fmt: skip
        """A read's rows; text another program stored that is not UTF-8 as
        bytes, its row not valid (``read_raw``)."""
        try:
            try:
                return conn.execute(sql, params).fetchall()
            except sqlite3.OperationalError as exc:
                if not undecodable(exc):
                    raise
                return read_raw(conn, sql, params, ok_at, texts)
        except sqlite3.Error as exc:
            raise _wrap(exc, action) from exc

    def wal_bytes(self) -> int:
        try:
            return os.stat(self.path + "-wal").st_size
        except OSError:
            return 0

    def checkpoint_wal(self) -> None:
        """PASSIVE, on a connection of its own (so it may run on another
        thread while this store's connection serves): under NORMAL it syncs
        the WAL first and the database file after, as an automatic one does."""
        with self._ckpt_lock:
            try:
                if self._ckpt_conn is None:
                    conn = sqlite3.connect(
                        self.path,
                        timeout=BUSY_TIMEOUT_S,
                        isolation_level=None,
                        check_same_thread=False,
                    )
                    conn.execute("PRAGMA synchronous = NORMAL")
                    self._ckpt_conn = conn
                self._ckpt_conn.execute(q.CHECKPOINT_WAL).fetchall()
            except sqlite3.Error as exc:
                raise _wrap(exc, "checkpoint_wal") from exc

    def sync(self) -> None:
        """fsync the WAL: every commit so far is on disk, the NORMAL ones of
        this connection included. A checkpoint copies commits into the
        database file and, under NORMAL or FULL, syncs that file before the
        WAL is reused (or removed: then there is nothing to sync). SQLite holds
        no lock on the WAL, so closing this descriptor drops none. Any thread."""
        if SNAPSHOT_HOOK is not None:  # (before: what the fsync covers at least)
            with self._lock:
                snapshot(self._c(), SNAPSHOT_HOOK)
        try:
            fd = os.open(self.path + "-wal", os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def jobs_of(self, keys: Iterable[str]) -> dict[str, tuple[str, float | None, str]]:
        # Unschedulable rows are left out by the query itself (in C).
        found = self._read_keys(keys, q.jobs_of_sql, "jobs_of")
        return {row[0]: row[1:] for row in found}

    def walk(self, after: str | None, limit: int) -> list[Row | BadRow]:
        if limit <= 0:
            return []
        with self._lock:
            found = self._walk(q.WALK_ALL, q.WALK_AFTER, q.WALK_AFTER_TEXT, after, limit, None, ())
        return [stored_row(stored[:-1]) for stored in found]

    def _walk(
        self, all_sql: str, after_sql: str, after_text_sql: str, after: Any, limit: int,
        ok_at: int | None, texts: tuple[int, ...],
    ) -> list[tuple]:  # fmt: skip
        """A chunk of a walk by key, each row's last column its key's type. A
        key another program stored as text that is not UTF-8 reads as bytes;
        a chunk ending on one gives it as ``NotUtf8``, which the next chunk
        binds as text again (bytes bind as a blob, and every text sorts
        before every blob)."""
        sql, params = (
            (all_sql, (limit,)) if after is None
            else (after_text_sql, (bytes(after), limit)) if type(after) is NotUtf8
            else (after_sql, (after, limit))
        )  # fmt: skip
        found = self._read(self._c(), sql, params, "walk", ok_at, texts)
        if len(found) >= limit and type(last := found[-1][0]) is bytes and found[-1][-1] == "text":
            found[-1] = (NotUtf8(last), *found[-1][1:])
        return found

    def walk_schedule(
        self, after: str | None, limit: int
    ) -> tuple[list[tuple], list[BadRow], str | None]:
        # The load walk reads 250k-1M rows at start: in C when it can
        # (sqlite_walk.py), else no payload, no Row objects, the checks inline.
        if limit <= 0:
            return [], [], after
        with self._lock:
            if (fast := self._fast_walk.walk(after, limit)) is not None:
                return fast[0], [], fast[1]
            found = self._walk(q.WALK_SCHEDULE_ALL, q.WALK_SCHEDULE_AFTER,
                               q.WALK_SCHEDULE_AFTER_TEXT, after, limit, 6, (0, 2))  # fmt: skip
        bad: list[BadRow] = []
        if all(stored[6] for stored in found):
            rows = [stored[:6] for stored in found]
        else:
            rows = []
            for stored in found:
                if stored[6]:
                    rows.append(stored[:6])
                else:
                    key, version, *values, _ok, _type = stored
                    bad.append(BadRow(key, version, bad_reason(key, *values)))
        last = found[-1][0] if len(found) >= limit else None
        return rows, bad, last

    def classes_in_use(self, limit: int | None = None) -> list[tuple[str, int | None, bool]]:
        # One pass over the table in SQLite, no row objects: the supervisor
        # fills the shared class table with it at every start. DISTINCT is a
        # third of GROUP BY with MIN: the oldest first only past ``limit``.
        conn = self._c()
        with self._lock:
            found = self._read(conn, q.CLASSES_DISTINCT, (), "classes")
            if limit is None or len(found) > limit:
                found = self._read(conn, q.CLASSES_IN_USE, (), "classes")
        return list(dict.fromkeys(
            (route, cadence_s, sitemap == 1)
            for route, cadence_s, sitemap, *_oldest in found
            if stored_row_is_valid(route, cadence_s, sitemap, 0.0)
        ))  # fmt: skip

    def count(self) -> int:
        conn = self._c()
        with self._lock:
            try:
                return conn.execute(q.COUNT_ROWS).fetchone()[0]
            except sqlite3.Error as exc:
                raise _wrap(exc, "count") from exc

    # -- change log ------------------------------------------------------------

    def changes(self, after_seq: int, limit: int) -> list[Change]:
        """Change-log entries after ``after_seq``, built in one comprehension:
        this is the keeper's hot path (a fetched change costs ~3 us, a third
        of it the frozen dataclass's constructor)."""
        if limit <= 0:
            return []
        conn = self._c()
        with self._lock:
            found = self._read(conn, q.CHANGES_AFTER, (after_seq, limit), "changes")
        valid, key_ok = stored_row_is_valid, stored_key_is_valid
        return [  # (a short text key checked inline: no call for the usual one)
            Change(seq, op, key, origin, route, cadence_s, sitemap == 1, due_at, at)
            if op == "D"
            or ((type(key) is str and 0 < len(key) <= 256 or key_ok(key))
                and valid(route, cadence_s, sitemap, due_at))
            else Change(seq, op, key, origin, None, None, False, None, at, False)
            for seq, op, key, origin, route, cadence_s, sitemap, due_at, at in found
        ]  # fmt: skip

    def last_seq(self) -> int:
        conn = self._c()
        with self._lock:
            try:
                found = conn.execute(q.LAST_SEQ).fetchone()
            except sqlite3.Error as exc:
                raise _wrap(exc, "last_seq") from exc
        return 0 if found is None else found[0]

    def due_history(self, after_seq: int, through_seq: int, limit: int) -> list[DueChange]:
        conn = self._c()
        with self._lock:
            found = self._read(conn, q.DUE_HISTORY, (after_seq, through_seq, limit), "due_history")
        return [
            DueChange(seq, op, key, origin, due_or_none(due_at), due_or_none(old), float(at))
            for seq, op, key, origin, due_at, old, at in found
        ]

    def trim_changes(self, through_seq: int) -> int:
        conn = self._c()
        with self._lock:
            try:
                return conn.execute(q.TRIM_CHANGES, (through_seq,)).rowcount
            except sqlite3.Error as exc:
                raise _wrap(exc, "trim_changes") from exc

    # -- meta ------------------------------------------------------------------

    def get_meta(self, name: str, default: Any = None) -> Any:
        conn = self._c()
        with self._lock:
            try:
                found = conn.execute(q.GET_META, (name,)).fetchone()
            except sqlite3.Error as exc:
                raise _wrap(exc, "get_meta") from exc
        return default if found is None else json.loads(found[0])

    def set_meta(self, name: str, value: Any) -> None:
        encoded = json.dumps(value, separators=(",", ":"), allow_nan=False)
        conn = self._c()
        with self._lock:
            try:
                conn.execute(q.SET_META, (name, encoded))
            except sqlite3.Error as exc:
                raise _wrap(exc, "set_meta") from exc
