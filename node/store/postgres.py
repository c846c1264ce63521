"""The fleet's store: the schedule in PostgreSQL, through psycopg 3 and its pool.

Same interface and behaviour as the SQLite store (``tests/integration/
test_store.py`` runs both, and the in-memory twin); the schema, its
triggers and migrations are in ``node/store/postgres_schema.py``, the feed's
horizon and LISTEN in ``node/store/postgres_feed.py``, the operator's view
in ``docs/postgres.md``.

Hazards this module handles:

- **Origin.** Each write transaction starts with ``SET LOCAL`` of
  ``queue_node.origin`` (``set_config(…, true)``), read by the triggers; it
  ends with the transaction, so a pooled connection never carries it over.
- **Out-of-order commits.** ``changes`` never steps past a seq whose
  transaction may still commit (``postgres_feed.Horizon``); ``last_seq`` waits
  until every seq up to the one it returns is settled, so a keeper that takes
  it before its load walk misses nothing written during the walk.
- **Fork.** A pool holds sockets and threads; neither crosses a fork. A
  child opens its own pool and leaves the inherited one untouched (closing
  it would end the parent's sessions: libpq says goodbye on the socket).
- **The password.** ``url`` (what is shown) is redacted; the driver alone
  gets the URL as given.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import groupby
from typing import Any

from node.core.errors import StoreError, StoreUnavailable
from node.core.names import host_node_name
from node.core.rows import (
    ORIGIN_EXTERNAL,
    ORIGIN_NODE,
    ORIGIN_WRITEBACK,
    ORIGINS,
    Change,
    Row,
    RowWrite,
    stored_key_is_valid,
    stored_row_is_valid,
)
from node.core.urls import redact_url
from node.store import postgres_schema as q
from node.store.base import (
    BadRow,
    DueChange,
    LastError,
    Store,
    WriteBack,
    due_now_query,
    due_or_none,
)
from node.store.postgres_feed import Horizon, Listener
from node.store.postgres_values import check_origin, columns, distinct_runs, due_value
from node.store.values import bad_reason, stored_row

try:
    import psycopg
    import psycopg_pool
except ImportError as exc:  # pragma: no cover - the extra is installed in tests
    raise StoreUnavailable(
        "the PostgreSQL store needs psycopg 3 and psycopg_pool: pip install 'queue-node[fleet]'"
    ) from exc

# Connections per store object. Each object is used by one thread in the
# node's processes (an HTTP worker opens one per thread that reads rows), so
# one is open most of the time; the second serves a caller that shares an
# object across threads. The fleet's budget against max_connections is in
# docs/postgres.md.
POOL_MAX = 2
# How long an operation waits for a pooled connection (or a new one) before
# the store is reported unavailable.
CONNECT_TIMEOUT_S = 5.0
# A connection whose server stopped answering (a cut network drops packets:
# nothing is refused) fails instead of waiting on TCP's own timeout of many
# minutes: unacknowledged data for 10 s (``tcp_user_timeout``), or an idle
# wait for a reply that keepalives find dead in about 11 s. Every process's
# store (the ledger's write-backs, the row service's reads) then answers
# with a store error its caller retries (docs/postgres.md).
NETWORK_BOUNDS: dict[str, Any] = {
    "tcp_user_timeout": 10_000,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}


def network_bounds(timeout_s: float | None) -> dict[str, Any]:
    """NETWORK_BOUNDS, or bounds that fail a connection whose server stopped
    answering within about ``timeout_s`` (a keeper's, keeper/loop.py)."""
    if timeout_s is None:
        return dict(NETWORK_BOUNDS)
    idle = max(1, int(timeout_s))
    return {"tcp_user_timeout": max(1, int(timeout_s * 1000)), "keepalives": 1,
            "keepalives_idle": idle, "keepalives_interval": 1, "keepalives_count": 1}
# How long ``last_seq`` waits for the writers that hold seqs below the top of
# the log to finish; past it the store is reported unavailable.
SETTLE_WAIT_S = 30.0
# The snapshot is polled at these intervals, doubling: writers usually end
# within a millisecond, a long one is not asked about 1,000 times a second.
SETTLE_POLL_FIRST_S = 0.0002
SETTLE_POLL_MAX_S = 0.01


def _wrap(exc: BaseException, action: str) -> StoreError:
    """A driver failure as the store's error: StoreUnavailable when the server
    cannot be reached now (a lost or refused connection, a full pool), else
    StoreError."""
    # The first line: libpq's hints and a statement's caret lines follow it,
    # and a command line prints an error as one line.
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    if isinstance(exc, psycopg_pool.PoolTimeout | psycopg.OperationalError):
        return StoreUnavailable(f"PostgreSQL store: {action}: {lines[0]}")
    return StoreError(f"PostgreSQL store: {action}: {lines[0]}")


# Public: a program that runs its own statements (node/migrate.py) words a
# driver failure as the store does.
wrap_error = _wrap


def _top_and_xid(conn: Any) -> tuple[int, int]:
    """The top of the log and an xid assigned after it was read
    (``TOP_AND_XID``): BEGIN, the statement and COMMIT in one round trip."""
    with conn.pipeline():
        with conn.transaction():
            cur = conn.execute(q.TOP_AND_XID)
    _off, top, xid = cur.fetchone()
    return int(top), int(xid)


def migrate(conn: Any, shown_url: str) -> None:
    """Bring the database on ``conn`` (autocommit) to SCHEMA_VERSION, under
    an advisory lock held for the transaction: processes starting at once on
    an empty database take turns, and the later ones find nothing to do.
    The store runs it on open, and a fleet's membership before it joins
    (node/fleet/). Driver errors pass through (the caller wraps them)."""
    try:
        found = conn.execute(q.READ_SCHEMA_VERSION).fetchone()
        if found is not None and found[0] == q.SCHEMA_VERSION:
            return
    except psycopg.errors.UndefinedTable:
        pass  # a new database
    with conn.transaction():
        conn.execute(q.LOCK_MIGRATIONS, (q.MIGRATION_LOCK,))
        conn.execute(q.CREATE_MIGRATIONS)
        current = conn.execute(q.READ_SCHEMA_VERSION).fetchone()[0]
        if current > q.SCHEMA_VERSION:
            raise StoreError(
                f"PostgreSQL store: {shown_url} has schema version {current}, newer "
                f"than this build's {q.SCHEMA_VERSION}; upgrade queue-node"
            )
        for version, name, statements in q.MIGRATIONS:
            if version <= current:
                continue
            for statement in statements:
                conn.execute(statement)
            conn.execute(q.RECORD_MIGRATION, (version, name, time.time()))


class PostgresStore(Store):
    """The schedule in a PostgreSQL database (created and migrated on open)."""

    def __init__(
        self,
        url: str,
        *,
        durable: bool = True,
        node_name: str | None = None,
        pool_max: int = POOL_MAX,
        network_timeout_s: float | None = None,
    ) -> None:
        """``url``: a libpq URL (``postgresql://user@host:port/db``; a password
        may come from ``PGPASSWORD``). ``durable`` False: a commit does not
        wait for its WAL flush (``synchronous_commit = off`` for the
        transaction), and ``sync`` makes every commit so far durable, as the
        SQLite store's NORMAL (the ledger's store). ``node_name``: whose meta
        this store reads and writes (the host's node name by default).
        ``network_timeout_s``: a connection whose server stops answering
        fails within about this long (default: NETWORK_BOUNDS, about 10 s)."""
        self._conninfo = url
        self._network_timeout_s = network_timeout_s
        self._bounds = network_bounds(network_timeout_s)
        self.durable = durable
        self.url = redact_url(url)
        self.node_name = node_name or host_node_name()
        # A write-back is logged with the node that wrote it: read back, this
        # node's is ``writeback`` and another node's is, for this node, a
        # write like any outside program's (a lease of that node ending on a
        # key a membership change moved here: docs/fleet.md).
        self._writeback_origin = f"{ORIGIN_WRITEBACK}@{self.node_name}"
        self._pool_max = pool_max
        # How long ``last_seq`` waits for older transactions to end: a
        # keeper sets it below its heartbeat's margin (keeper/loop.py).
        self.settle_wait_s = SETTLE_WAIT_S
        self._closed = False
        self._listener: Listener | None = None
        self._horizon = Horizon()
        self._trimmed_at_read = 0  # the trim watermark as of the last ``changes`` read
        # The last seq ``changes`` handed out (or read after): the pending
        # settlements above it are what holds the feed back.
        self._fed_through = 0
        self._open()

    # -- lifecycle -------------------------------------------------------------

    def _open(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()  # the horizon's
        self._listen_lock = threading.Lock()
        try:
            # One connection first: a server that refuses fails at once (a
            # pool would retry until its timeout), and it runs the migrations.
            with psycopg.connect(
                self._conninfo, autocommit=True, connect_timeout=int(CONNECT_TIMEOUT_S)
            ) as conn:
                self._migrate(conn)
        except psycopg.Error as exc:
            raise _wrap(exc, f"opening {self.url}") from exc
        pool = psycopg_pool.ConnectionPool(
            self._conninfo,
            min_size=1,
            max_size=self._pool_max,
            kwargs={"autocommit": True, **self._bounds},
            timeout=CONNECT_TIMEOUT_S,
            open=False,
            name="queue-node",
        )
        try:
            pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            pool.close()  # its threads would go on trying
            raise _wrap(exc, f"opening {self.url}") from exc
        self._pool = pool

    def _migrate(self, conn: Any) -> None:
        migrate(conn, self.url)

    @contextmanager
    def _conn(self, action: str) -> Iterator[Any]:
        """A pooled connection for one operation; driver errors as the store's."""
        if self._closed:
            raise StoreError(f"PostgreSQL store: {action}: the store is closed")
        if self._pid != os.getpid():
            self.check_fork()
        try:
            with self._pool.connection() as conn:
                yield conn
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise _wrap(exc, action) from exc

    def _fetch(self, action: str, sql: Any, params: Any, one: bool = False) -> Any:
        """A read's rows (``one``: its first row, or None).

        The pool hands out an idle connection unchecked, so after the server
        closed it (a restart, a network cut since healed,
        ``pg_terminate_backend``) the first statement on it fails. A read
        that fails on a connection then found ``broken`` runs once more on a
        connection of its own, opened within ``CONNECT_TIMEOUT_S`` (a cut
        still under way fails it that fast, not after another
        ``tcp_user_timeout``); once that worked the server is back, and the
        pool's other idle connections, closed with the first, are checked
        and replaced. A read changes nothing, so running it again is safe;
        writes are not retried here (their callers retry from evidence)."""
        with self._conn(action) as conn:
            try:
                cursor = conn.execute(sql, params)
                return cursor.fetchone() if one else cursor.fetchall()
            except psycopg.OperationalError:
                if not conn.broken:
                    raise
        try:
            with psycopg.connect(
                self._conninfo, autocommit=True, connect_timeout=int(CONNECT_TIMEOUT_S),
                **self._bounds,
            ) as fresh:  # fmt: skip
                cursor = fresh.execute(sql, params)
                found = cursor.fetchone() if one else cursor.fetchall()
            self._pool.check()
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise _wrap(exc, action) from exc
        return found

    @contextmanager
    def _write(self, action: str, origin: str | None) -> Iterator[Any]:
        """One write transaction, its origin set for the triggers first (SET
        LOCAL: it ends with the transaction)."""
        with self._conn(action) as conn, conn.transaction():
            if origin is not None:
                conn.execute(q.SET_ORIGIN if self.durable else q.SET_ORIGIN_ASYNC, (origin,))
            elif not self.durable:
                conn.execute(q.SET_ASYNC)
            yield conn

    def sync(self) -> None:
        """Every commit so far made durable (a store opened not durable
        commits without waiting for the WAL flush): one synchronous commit
        of a transaction with an xid flushes the WAL up to it. Raises
        OSError, as the base says."""
        try:
            with self._conn("sync") as conn, conn.transaction():
                conn.execute(q.SYNC)
        except StoreError as exc:
            raise OSError(str(exc)) from exc

    def check_fork(self) -> None:
        if self._pid == os.getpid() or self._closed:
            return
        # The parent's pool is left alone: closing it here would end the
        # parent's sessions (libpq says goodbye on the shared socket). Once
        # collected in the child it does not (psycopg finishes a connection
        # only in the process that opened it).
        self._listener = None
        self._horizon = Horizon()
        self._trimmed_at_read = 0  # the trim watermark as of the last ``changes`` read
        self._fed_through = 0
        self._open()

    def schema_version(self) -> int:
        with self._conn("schema_version") as conn:
            return conn.execute(q.READ_SCHEMA_VERSION).fetchone()[0]

    reopen_off_loop = True  # its connect may wait on a cut network (keeper/outage.py)

    def reopen(self) -> PostgresStore:
        store = PostgresStore(
            self._conninfo, durable=self.durable, node_name=self.node_name,
            pool_max=self._pool_max, network_timeout_s=self._network_timeout_s,
        )  # fmt: skip
        store.settle_wait_s = self.settle_wait_s
        return store

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pid != os.getpid():
            return  # the parent's pool: never closed in a child (check_fork)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._pool.close()

    # claim_source(): None (the base's): no file for the claim path in C to
    # open; a node's claims read their rows through its row service.

    # -- writes ----------------------------------------------------------------

    def upsert(self, rows: Sequence[RowWrite], *, now: float, origin: str = ORIGIN_NODE) -> int:
        """Insert or update rows in one transaction; returns ``len(rows)``.
        Consecutive writes carrying the same fields go in multi-row
        statements, cut where a key repeats, so a later write of a key in
        the batch wins and seqs follow the batch's order."""
        check_origin(origin)
        if not rows:
            return 0
        statements = [
            (q.upsert_sql(present), columns(run, now))
            for present, group in groupby(rows, key=RowWrite.present)
            for run in distinct_runs(list(group))
        ]
        with self._write("upsert", origin) as conn:
            for sql, cols in statements:
                conn.execute(sql, cols)
        return len(rows)

    def delete(self, keys: Sequence[str], *, origin: str = ORIGIN_NODE) -> int:
        check_origin(origin)
        if not keys:
            return 0
        with self._write("delete", origin) as conn:
            cur = conn.cursor()
            cur.executemany(q.DELETE_ROW, [(k,) for k in keys])
            return cur.rowcount

    def due_now(
        self, *, route: str | None = None, job: str | None = None, now: float,
        origin: str = ORIGIN_NODE,
    ) -> int:  # fmt: skip
        check_origin(origin)
        sql, value = due_now_query(route, job, q.DUE_NOW_ROUTE, q.DUE_NOW_JOB)
        with self._write("due_now", origin) as conn:
            return conn.execute(sql, (due_value(now, "due_now"), value)).rowcount

    def write_next_due(self, key: str, due_at: float, *, if_version: int) -> int | None:
        due = due_value(due_at, "write_next_due")
        with self._write("write_next_due", self._writeback_origin) as conn:
            found = conn.execute(q.WRITE_NEXT_DUE, (due, key, if_version)).fetchone()
        return None if found is None else found[0]

    def write_back_many(self, items: Sequence[WriteBack]) -> list[int | None]:
        """One transaction, one statement: a server-side loop runs the
        guarded UPDATE per item, in order (a key twice in the group sees
        its first write-back), and returns the new versions."""
        if not items:
            return []
        dues = [due_value(it.due_at, "write_back_many") for it in items]
        params = (
            [it.key for it in items], dues, [it.if_version for it in items],
            [it.result_id for it in items], [it.finished_at for it in items],
        )  # fmt: skip
        with self._write("write_back_many", self._writeback_origin) as conn:
            found = conn.execute(q.WRITE_BACK_MANY, params).fetchone()[0]
        return list(found)

    def write_last_errors(self, items: Sequence[LastError]) -> int:
        if not items:
            return 0
        with self._write("write_last_errors", None) as conn:
            cur = conn.cursor()
            cur.executemany(q.WRITE_LAST_ERROR, [(it.error, it.key, it.at) for it in items])
            return cur.rowcount

    # -- reads -----------------------------------------------------------------

    def get(self, key: str) -> Row | BadRow | None:
        stored = self._fetch("get", q.GET_ROW, (key,), one=True)
        return None if stored is None else stored_row(stored)

    def get_many(self, keys: Iterable[str]) -> dict[str, Row | BadRow]:
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        found = self._fetch("get_many", q.GET_MANY, (wanted,))
        return {stored[0]: stored_row(stored) for stored in found}

    def claim_rows(self, keys: list[str]) -> list[tuple]:
        """The claim path's columns of ``keys``' rows as stored (``CLAIM_ROWS``:
        ``stored_row``'s first eight), in one statement: what the node's row
        service (``workers/rows``) hands to claimers, which decode them."""
        if not keys:
            return []
        return self._fetch("claim_rows", q.CLAIM_ROWS, (keys,))

    def jobs_of(self, keys: Iterable[str]) -> dict[str, tuple[str, float | None, str]]:
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        found = self._fetch("jobs_of", q.JOBS_OF, (wanted,))
        return {
            key: (job, cadence_s, route)
            for key, job, cadence_s, route, sitemap, due_at in found
            if stored_row_is_valid(route, cadence_s, sitemap, due_at)
        }

    def walk(self, after: str | None, limit: int) -> list[Row | BadRow]:
        if limit <= 0:
            return []
        with self._conn("walk") as conn:
            if after is None:
                found = conn.execute(q.WALK_ALL, (limit,)).fetchall()
            else:
                found = conn.execute(q.WALK_AFTER, (after, limit)).fetchall()
        return [stored_row(stored) for stored in found]

    def walk_schedule(
        self, after: str | None, limit: int
    ) -> tuple[list[tuple], list[BadRow], str | None]:
        if limit <= 0:
            return [], [], after
        with self._conn("walk") as conn:
            if after is None:
                found = conn.execute(q.WALK_SCHEDULE_ALL, (limit,)).fetchall()
            else:
                found = conn.execute(q.WALK_SCHEDULE_AFTER, (after, limit)).fetchall()
        rows: list[tuple] = []
        bad: list[BadRow] = []
        valid, key_ok = stored_row_is_valid, stored_key_is_valid
        for key, version, route, cadence_s, sitemap, due_at in found:
            if key_ok(key) and valid(route, cadence_s, sitemap, due_at):
                rows.append((key, version, route, cadence_s, sitemap == 1, due_at))
            else:
                bad.append(BadRow(key, version, bad_reason(key, route, cadence_s, sitemap, due_at)))
        last = found[-1][0] if len(found) >= limit else None
        return rows, bad, last

    def classes_in_use(self, limit: int | None = None) -> list[tuple[str, int | None, bool]]:
        # (Always oldest first: PostgreSQL hashes the GROUP BY.)
        with self._conn("classes") as conn:
            found = conn.execute(q.CLASSES_IN_USE).fetchall()
        return list(dict.fromkeys(
            (route, cadence_s, sitemap == 1)
            for route, cadence_s, sitemap, _oldest in found
            if stored_row_is_valid(route, cadence_s, sitemap, 0.0)
        ))  # fmt: skip

    def count(self) -> int:
        with self._conn("count") as conn:
            return conn.execute(q.COUNT_ROWS).fetchone()[0]

    # -- change log ------------------------------------------------------------

    def changes(self, after_seq: int, limit: int) -> list[Change]:
        """Change-log entries after ``after_seq`` in seq order, up to the
        first seq whose transaction may still commit (postgres_feed)."""
        if limit <= 0:
            return []
        with self._conn("changes") as conn:
            found = conn.execute(q.CHANGES_AFTER, (after_seq, limit)).fetchall()
            if not found:
                self._fed_through = after_seq
                return []
            with self._lock:
                horizon = self._horizon
                self._trimmed_at_read = found[0][10]
                horizon.settle(found[0][9])
                n = horizon.passable(after_seq, [r[0] for r in found], found[0][10])
                if n < len(found):
                    hole = after_seq + 1 if n == 0 else found[n - 1][0] + 1
                    if horizon.needs_settling(hole):
                        _top, xid = _top_and_xid(conn)
                        horizon.wait_on(found[-1][0], xid)
            self._fed_through = found[n - 1][0] if n else after_seq
        valid, key_ok = stored_row_is_valid, stored_key_is_valid
        origin_of = self._origin_of
        return [
            Change(seq, op, key, origin_of(origin), route, cadence_s, sitemap == 1, due_at, at)
            if op == "D" or (key_ok(key) and valid(route, cadence_s, sitemap, due_at))
            else Change(seq, op, key, origin_of(origin), None, None, False, None, at, False)
            for seq, op, key, origin, route, cadence_s, sitemap, due_at, at, _x, _t in found[:n]
        ]

    def _origin_of(self, stored: str) -> str:
        """A logged origin as this node reads it: ``writeback@NAME`` is
        ``writeback`` when NAME is this store's node, else ``external``; a
        plain ``writeback`` (logged before write-backs named their node) is
        taken as this node's."""
        if stored in ORIGINS:
            return stored
        return ORIGIN_WRITEBACK if stored == self._writeback_origin else ORIGIN_EXTERNAL

    def last_seq(self) -> int:
        """The top of the log (0 when none; it stays put after a trim), once
        every seq up to it is settled: the writers that may hold one have
        all ended, so a walk started now sees each of their writes."""
        deadline = time.monotonic() + self.settle_wait_s
        delay = SETTLE_POLL_FIRST_S
        with self._conn("last_seq") as conn:
            top, xid = _top_and_xid(conn)
            while conn.execute(q.SNAPSHOT_XMIN).fetchone()[0] < xid:
                if time.monotonic() >= deadline:
                    raise StoreUnavailable(
                        f"PostgreSQL store: last_seq: a transaction older than xid {xid} "
                        f"has been open for over {self.settle_wait_s:g} s"
                    )
                time.sleep(delay)  # polling the server's snapshot, bounded
                delay = min(delay * 2, SETTLE_POLL_MAX_S)
        with self._lock:
            self._horizon.settled_through = max(self._horizon.settled_through, top)
        return top

    def top_seq(self) -> int:
        """The top of the log now, settled or not (no wait): for figures
        (the keeper's ``unapplied``), never for a walk's position."""
        with self._conn("top_seq") as conn:
            return _top_and_xid(conn)[0]

    def skip_is_loss(self, after_seq: int, first_seq: int) -> bool:
        """Seqs commit out of order and a rolled-back (or crash-lost) one
        leaves a hole no change will fill; ``changes`` hands out past a hole
        only once it is settled. So a skip is a loss only when the log was
        trimmed past ``after_seq`` as of the read that skipped (the trim
        watermark comes with the rows, from the same snapshot)."""
        return self._trimmed_at_read > after_seq

    def first_seq_after(self, after_seq: int) -> int | None:
        with self._conn("first_seq_after") as conn:
            first, trimmed = conn.execute(q.FIRST_SEQ_AFTER, (after_seq,)).fetchone()
        with self._lock:
            self._trimmed_at_read = trimmed
        return first

    def trim_changes(self, through_seq: int) -> int:
        """At most ``TRIM_CHUNK`` rows a call (the oldest first), and none
        while another node trims (a tried advisory lock): the keeper calls
        again soon while the log holds more below its position."""
        with self._write("trim_changes", None) as conn:
            if not conn.execute(q.TRY_TRIM_LOCK, (q.TRIM_LOCK,)).fetchone()[0]:
                return 0  # another node trims now
            return conn.execute(q.TRIM_CHANGES, (through_seq, q.TRIM_CHUNK)).fetchone()[0]

    def due_history(self, after_seq: int, through_seq: int, limit: int) -> list[DueChange]:
        with self._conn("due_history") as conn:
            found = conn.execute(q.DUE_HISTORY, (after_seq, through_seq, limit)).fetchall()
        return [
            DueChange(
                seq,
                op,
                key,
                self._origin_of(origin),
                due_or_none(due_at),
                due_or_none(old),
                float(at),
            )  # fmt: skip
            for seq, op, key, origin, due_at, old, at in found
        ]

    def holes_pending(self) -> bool:
        """Whether the last reads stopped at a hole not yet settled (its
        writer may roll back, and a rollback notifies nobody)."""
        horizon = self._horizon
        return any(through > self._fed_through for through, _xid in horizon.pending)

    def wait_for_changes(self, timeout_s: float) -> bool:
        """Block until a write to the schedule commits (a NOTIFY from its
        statement's trigger) or ``timeout_s`` passes; True when one came.
        The first call opens a dedicated LISTEN connection; a notification
        that arrived since the last call returns at once."""
        with self._listen_lock:
            try:
                if self._listener is None:
                    conn = psycopg.connect(
                        self._conninfo, autocommit=True, connect_timeout=int(CONNECT_TIMEOUT_S)
                    )
                    conn.execute(q.LISTEN)
                    self._listener = Listener(conn)
                return self._listener.wait(timeout_s)
            except psycopg.Error as exc:
                if self._listener is not None:
                    self._listener.close()
                    self._listener = None
                raise _wrap(exc, "wait_for_changes") from exc

    # -- meta: this node's, or the fleet's -----------------------------------------

    def _meta_owner(self, name: str) -> str:
        return q.FLEET_SCOPE if name in q.FLEET_META else self.node_name

    def get_meta(self, name: str, default: Any = None) -> Any:
        with self._conn("get_meta") as conn:
            found = conn.execute(q.GET_META, (self._meta_owner(name), name)).fetchone()
        return default if found is None else json.loads(found[0])

    def set_meta(self, name: str, value: Any) -> None:
        encoded = json.dumps(value, separators=(",", ":"), allow_nan=False)
        with self._conn("set_meta") as conn:
            conn.execute(q.SET_META, (self._meta_owner(name), name, encoded))

    def meta_of_every_node(self, name: str) -> dict[str, Any]:
        with self._conn("meta_of_every_node") as conn:
            found = conn.execute(q.META_OF_EVERY_NODE, (name,)).fetchall()
        return {node: json.loads(value) for node, value in found}
