"""Every SQL statement of the SQLite store, by name.

The schema (``MIGRATIONS``) is a contract for programs that write the file
directly (``docs/schema.md``): append new migrations, never edit an applied
one. ``node/store/sqlite.py`` runs these statements and nothing else; the
claim path in C runs ``CLAIM_ROW_SQL`` and ``CLAIM_ROWS_SQL``, handed to it
through ``SQLiteStore.claim_source()``.
"""

from __future__ import annotations

_NOW_SQL = "(julianday('now') - 2440587.5) * 86400.0"
_ORIGIN_SQL = "COALESCE((SELECT origin FROM write_origin), 'external')"

# -- schema ---------------------------------------------------------------------
# Each migration is a list of statements applied in one transaction with the
# row that records it. Append new migrations; never edit an applied one.

MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (
        1,
        "schedule, change log, origin, meta",
        [
            """CREATE TABLE schedule (
                key       TEXT PRIMARY KEY NOT NULL,
                route     TEXT NOT NULL,
                cadence_s INTEGER,
                sitemap   INTEGER NOT NULL DEFAULT 0,
                due_at    REAL NOT NULL,
                payload   TEXT,
                job       TEXT NOT NULL DEFAULT 'default',
                version   INTEGER NOT NULL DEFAULT 0
            )""",
            """CREATE TABLE changes (
                seq       INTEGER PRIMARY KEY AUTOINCREMENT,
                op        TEXT NOT NULL,
                key       TEXT NOT NULL,
                origin    TEXT NOT NULL,
                route     TEXT,
                cadence_s INTEGER,
                sitemap   INTEGER,
                due_at    REAL,
                at        REAL NOT NULL
            )""",
            """CREATE TABLE write_origin (
                id     INTEGER PRIMARY KEY CHECK (id = 0),
                origin TEXT NOT NULL
            )""",
            "INSERT INTO write_origin (id, origin) VALUES (0, 'external')",
            "CREATE TABLE meta (name TEXT PRIMARY KEY NOT NULL, value TEXT NOT NULL)",
            f"""CREATE TRIGGER schedule_log_insert AFTER INSERT ON schedule
            BEGIN
                INSERT INTO changes (op, key, origin, route, cadence_s, sitemap, due_at, at)
                VALUES ('I', NEW.key, {_ORIGIN_SQL}, NEW.route, NEW.cadence_s,
                        NEW.sitemap, NEW.due_at, {_NOW_SQL});
                UPDATE schedule SET version = last_insert_rowid() WHERE rowid = NEW.rowid;
            END""",
            # A key renamed in place (only another program can) is logged as
            # the old key's delete and the new key's insert.
            f"""CREATE TRIGGER schedule_log_update
            AFTER UPDATE OF key, route, cadence_s, sitemap, due_at, payload, job ON schedule
            BEGIN
                INSERT INTO changes (op, key, origin, at)
                SELECT 'D', OLD.key, {_ORIGIN_SQL}, {_NOW_SQL} WHERE OLD.key IS NOT NEW.key;
                INSERT INTO changes (op, key, origin, route, cadence_s, sitemap, due_at, at)
                VALUES (CASE WHEN OLD.key IS NEW.key THEN 'U' ELSE 'I' END, NEW.key,
                        {_ORIGIN_SQL}, NEW.route, NEW.cadence_s, NEW.sitemap, NEW.due_at,
                        {_NOW_SQL});
                UPDATE schedule SET version = last_insert_rowid() WHERE rowid = NEW.rowid;
            END""",
            f"""CREATE TRIGGER schedule_log_delete AFTER DELETE ON schedule
            BEGIN
                INSERT INTO changes (op, key, origin, at)
                VALUES ('D', OLD.key, {_ORIGIN_SQL}, {_NOW_SQL});
            END""",
            # Versions decide which of two events is newer; a writer that sets
            # one by hand could make an old event win. The logging triggers
            # only ever set the seq they just assigned, which passes.
            # (sqlite_sequence would not do here: inside a trigger it still
            # holds the value from before the outermost statement.)
            """CREATE TRIGGER schedule_version_guard BEFORE UPDATE OF version ON schedule
            WHEN NEW.version IS NOT (SELECT max(seq) FROM changes)
            BEGIN
                SELECT RAISE(ABORT, 'schedule.version is set by triggers, never by writers');
            END""",
        ],
    ),
    (
        2,
        "the outcome of a row's last lease",
        [
            # Written back by the node, read-only for writers. Not in
            # schedule_log_update's column list: a write of these alone is no
            # change (no log entry, no new version, no cleared parking); the
            # completion's write-back sets them in the statement that sets
            # due_at, which is logged as before.
            "ALTER TABLE schedule ADD COLUMN last_result_id INTEGER",
            "ALTER TABLE schedule ADD COLUMN last_finished_at REAL",
            "ALTER TABLE schedule ADD COLUMN last_error TEXT",
        ],
    ),
    (
        3,
        "the due time a change replaced",
        [
            # An update's and a delete's change carries the row's due time
            # before it (NULL for an insert): a keeper that starts after
            # another died counts, from the changes its predecessor had not
            # saved counts through, which rows came due and which were taken
            # out (docs/accounting.md, the input law).
            "ALTER TABLE changes ADD COLUMN old_due_at REAL",
            "DROP TRIGGER schedule_log_update",
            "DROP TRIGGER schedule_log_delete",
            f"""CREATE TRIGGER schedule_log_update
            AFTER UPDATE OF key, route, cadence_s, sitemap, due_at, payload, job ON schedule
            BEGIN
                INSERT INTO changes (op, key, origin, at, old_due_at)
                SELECT 'D', OLD.key, {_ORIGIN_SQL}, {_NOW_SQL}, OLD.due_at
                WHERE OLD.key IS NOT NEW.key;
                INSERT INTO changes (op, key, origin, route, cadence_s, sitemap, due_at, at,
                                     old_due_at)
                VALUES (CASE WHEN OLD.key IS NEW.key THEN 'U' ELSE 'I' END, NEW.key,
                        {_ORIGIN_SQL}, NEW.route, NEW.cadence_s, NEW.sitemap, NEW.due_at,
                        {_NOW_SQL}, CASE WHEN OLD.key IS NEW.key THEN OLD.due_at END);
                UPDATE schedule SET version = last_insert_rowid() WHERE rowid = NEW.rowid;
            END""",
            f"""CREATE TRIGGER schedule_log_delete AFTER DELETE ON schedule
            BEGIN
                INSERT INTO changes (op, key, origin, at, old_due_at)
                VALUES ('D', OLD.key, {_ORIGIN_SQL}, {_NOW_SQL}, OLD.due_at);
            END""",
        ],
    ),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]

# -- the columns read ------------------------------------------------------------

_ROW_COLUMNS = (
    "key, route, cadence_s, sitemap, due_at, payload, job, version,"
    " last_result_id, last_finished_at, last_error"
)
# Whether a stored key is one the node can hold, lease and name in an answer
# (node.rows.stored_key_is_valid): another program may store a blob, a number,
# an empty or a longer text. Blobs sort after every text, numbers before.
_VALID_KEY = "(typeof(key) = 'text' AND key <> '' AND length(CAST(key AS BLOB)) <= 1024)"
# Whether a stored row is schedulable: the rules of node.rows.stored_row_is_valid,
# and its key's.
_VALID_ROW = (
    f"({_VALID_KEY} AND typeof(route) = 'text' AND route <> ''"
    " AND (cadence_s IS NULL OR (typeof(cadence_s) = 'integer'"
    " AND cadence_s BETWEEN 60 AND 31536000))"
    " AND sitemap IN (0, 1)"
    " AND typeof(due_at) IN ('real', 'integer') AND due_at BETWEEN 0 AND 32503680000.0)"
)
_SCHEDULE_COLUMNS = "key, version, route, cadence_s, sitemap = 1, due_at, " + _VALID_ROW
_CHANGE_COLUMNS = "seq, op, key, origin, route, cadence_s, sitemap, due_at, at"

# -- the node's own tables ---------------------------------------------------------

CREATE_MIGRATIONS = """CREATE TABLE IF NOT EXISTS schema_migrations (
        version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"""
READ_SCHEMA_VERSION = "SELECT COALESCE(MAX(version), 0) FROM schema_migrations"
RECORD_MIGRATION = """INSERT INTO schema_migrations (version, name, applied_at)
        VALUES (?, ?, ?)"""
GET_META = "SELECT value FROM meta WHERE name = ?"
SET_META = """INSERT INTO meta (name, value) VALUES (?, ?)
        ON CONFLICT (name) DO UPDATE SET value = excluded.value"""

# -- connections and transactions ----------------------------------------------------

JOURNAL_WAL = "PRAGMA journal_mode = WAL"
# A connection that leaves the WAL's checkpoints to someone else (the ledger's:
# it runs them on a thread of its own, CHECKPOINT_WAL, not inside a commit).
NO_AUTOCHECKPOINT = "PRAGMA wal_autocheckpoint = 0"
CHECKPOINT_WAL = "PRAGMA wal_checkpoint(PASSIVE)"
BEGIN_WRITE = "BEGIN IMMEDIATE"
COMMIT = "COMMIT"
ROLLBACK = "ROLLBACK"
# The node's write sets its origin for the triggers, and puts it back before COMMIT.
SET_ORIGIN = "UPDATE write_origin SET origin = ?"
RESET_ORIGIN = "UPDATE write_origin SET origin = 'external'"


def tuning_pragmas(
    busy_timeout_ms: int, cache_kib: int, mmap_size: int, durable: bool = True
) -> tuple[str, ...]:
    """The settings each connection runs once it is in WAL mode, in order.
    ``durable``: each commit syncs the WAL (FULL: a write answered is on
    disk); else NORMAL (it survives a crash of the process, not a power
    loss; the ledger's write-backs, which it can do again from its log)."""
    return (
        f"PRAGMA synchronous = {'FULL' if durable else 'NORMAL'}",
        f"PRAGMA busy_timeout = {busy_timeout_ms}",
        f"PRAGMA cache_size = -{cache_kib}",
        f"PRAGMA mmap_size = {mmap_size}",
    )


# -- the schedule ---------------------------------------------------------------------

DELETE_ROW = "DELETE FROM schedule WHERE key = ?"
WRITE_NEXT_DUE = "UPDATE schedule SET due_at = ? WHERE key = ? AND version = ?"
# An operator's "run again now" (Store.due_now): every row of a route or job
# due by now, a row already due keeping its due time; every row is written
# (logged, a new version), so a write-back of a lease granted before loses.
DUE_NOW_ROUTE = "UPDATE schedule SET due_at = MIN(due_at, ?) WHERE route = ?"
DUE_NOW_JOB = "UPDATE schedule SET due_at = MIN(due_at, ?) WHERE job = ?"
# A completion's write-back: the next due time (logged, a new version) and
# the outcome columns (not logged by themselves), under the version guard.
WRITE_BACK = (
    "UPDATE schedule SET due_at = ?, last_result_id = ?, last_finished_at = ?, last_error = NULL"
    " WHERE key = ? AND version = ?"
)
# A lease that ended without a result: the outcome only (no log entry, no new
# version). An older miss never overwrites a newer completion's outcome.
WRITE_LAST_ERROR = (
    "UPDATE schedule SET last_error = ?"
    " WHERE key = ? AND (last_finished_at IS NULL OR last_finished_at <= ?)"
)
# The changes a write-back batch logged: the keys it wrote, with their new
# versions (a version is the seq of the row's last change).
CHANGES_SINCE = "SELECT key, seq FROM changes WHERE seq > ?"
READ_VERSION = "SELECT version FROM schedule WHERE key = ?"
GET_ROW = f"SELECT {_ROW_COLUMNS} FROM schedule WHERE key = ?"
# The walks end each row with typeof(key): a key read as bytes is a blob or
# text that is not UTF-8, and the next chunk starts after it bound as what it
# is (bytes bind as a blob, and every text sorts before every blob).
_WALK = f"SELECT {_ROW_COLUMNS}, typeof(key) FROM schedule"
WALK_ALL = f"{_WALK} ORDER BY key LIMIT ?"
WALK_AFTER = f"{_WALK} WHERE key > ? ORDER BY key LIMIT ?"
WALK_AFTER_TEXT = f"{_WALK} WHERE key > CAST(? AS TEXT) ORDER BY key LIMIT ?"
# Scheduling fields only, with a validity flag computed by SQLite (the
# same rules as node.rows.stored_row_is_valid); rows come back as
# (key, version, route, cadence_s, sitemap, due_at, ok, typeof(key)).
_WALK_SCHEDULE = f"SELECT {_SCHEDULE_COLUMNS}, typeof(key) FROM schedule"
WALK_SCHEDULE_ALL = f"{_WALK_SCHEDULE} ORDER BY key LIMIT ?"
WALK_SCHEDULE_AFTER = f"{_WALK_SCHEDULE} WHERE key > ? ORDER BY key LIMIT ?"
WALK_SCHEDULE_AFTER_TEXT = f"{_WALK_SCHEDULE} WHERE key > CAST(? AS TEXT) ORDER BY key LIMIT ?"
# The same walk read in C (node/store/sqlite_walk.py), which checks each row itself.
_FAST_WALK = "SELECT key, version, route, cadence_s, sitemap, due_at FROM schedule"
FAST_WALK_ALL = f"{_FAST_WALK} ORDER BY key LIMIT ?1"
FAST_WALK_AFTER = f"{_FAST_WALK} WHERE key > ?1 ORDER BY key LIMIT ?2"
COUNT_ROWS = "SELECT count(*) FROM schedule"
CLASSES_DISTINCT = "SELECT DISTINCT route, cadence_s, sitemap FROM schedule"
CLASSES_IN_USE = (
    "SELECT route, cadence_s, sitemap, MIN(version) AS oldest FROM schedule "
    "GROUP BY route, cadence_s, sitemap ORDER BY oldest"
)


def get_many_sql(n: int) -> str:
    """The point read of ``n`` keys at once."""
    marks = ", ".join("?" * n)
    return f"SELECT {_ROW_COLUMNS} FROM schedule WHERE key IN ({marks})"


def jobs_of_sql(n: int) -> str:
    """What a completion needs of ``n`` rows (``Store.jobs_of``): key, job,
    cadence_s, route of the schedulable ones (SQLite checks, per row, what
    ``stored_row_is_valid`` would); not the payload."""
    marks = ", ".join("?" * n)
    return (
        f"SELECT key, job, cadence_s, route FROM schedule WHERE key IN ({marks}) AND {_VALID_ROW}"
    )


_UPSERT_SQL: dict[tuple[str, ...], str] = {}


def upsert_sql(present: tuple[str, ...]) -> str:
    """The upsert of a write carrying ``present`` optional fields: an insert
    binds every column (defaults for the missing ones), a conflict updates
    only the route and the fields the write carries."""
    sql = _UPSERT_SQL.get(present)
    if sql is None:
        sets = ", ".join(f"{f} = excluded.{f}" for f in ("route", *present))
        sql = (
            "INSERT INTO schedule (key, route, cadence_s, sitemap, due_at, payload, job)"
            f" VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET {sets}"
        )
        _UPSERT_SQL[present] = sql
    return sql


# -- the change log -------------------------------------------------------------------

CHANGES_AFTER = f"SELECT {_CHANGE_COLUMNS} FROM changes WHERE seq > ? ORDER BY seq LIMIT ?"
LAST_SEQ = "SELECT seq FROM sqlite_sequence WHERE name = 'changes'"
TRIM_CHANGES = "DELETE FROM changes WHERE seq <= ?"
# (A key the node cannot hold was never received: its changes are not replayed.)
DUE_HISTORY = f"""SELECT seq, op, key, origin, due_at, old_due_at, at FROM changes
        WHERE seq > ? AND seq <= ? AND {_VALID_KEY} ORDER BY seq LIMIT ?"""

# -- the claim path (shm/_claim_path.c, on its own connection) -------------------------

# One key's row: the columns the claim reads, in this order.
CLAIM_ROW_SQL = (
    "SELECT route, cadence_s, sitemap, due_at, payload, job, version FROM schedule WHERE key = ?1"
)
# A run of keys in one statement: ?1 is a JSON array of them, and each row
# comes with its key's index in the array (column 0), then the columns of
# CLAIM_ROW_SQL. CROSS JOIN keeps the array the outer loop, so the rows come
# in the array's order and each seek reuses the open cursors.
CLAIM_ROWS_SQL = (
    "SELECT j.key, s.route, s.cadence_s, s.sitemap, s.due_at, s.payload, s.job, s.version"
    " FROM json_each(?1) AS j CROSS JOIN schedule AS s ON s.key = j.value"
)

# -- python -m node migrate (node/migrate.py): the file read as it is ------------------

# Whether a row's values are of the types the target's columns take as they
# are (the usual case: the columns' affinities make them so); the others are
# converted, or refused, one by one.
_PG_READY = (
    "typeof(key) = 'text' AND instr(key, char(0)) = 0"
    " AND typeof(route) = 'text' AND instr(route, char(0)) = 0"
    " AND typeof(cadence_s) IN ('integer', 'null')"
    " AND typeof(sitemap) = 'integer' AND sitemap BETWEEN -32768 AND 32767"
    " AND typeof(due_at) = 'real'"
    " AND typeof(payload) IN ('text', 'null') AND COALESCE(instr(payload, char(0)), 0) = 0"
    " AND typeof(job) = 'text' AND instr(job, char(0)) = 0"
    " AND typeof(last_result_id) IN ('integer', 'null')"
    " AND typeof(last_finished_at) IN ('real', 'null')"
    " AND typeof(last_error) IN ('text', 'null')"
    " AND COALESCE(instr(last_error, char(0)), 0) = 0"
)
_MIGRATE_COLUMNS = (
    "key, route, cadence_s, sitemap, due_at, payload, job,"
    " last_result_id, last_finished_at, last_error"
)
# Every column but version (the target's triggers assign their own), then
# _PG_READY, in key order: the order of PostgreSQL's COLLATE "C", so the two
# sides' checksums are taken over the rows in one order.
MIGRATE_ROWS = f"SELECT {_MIGRATE_COLUMNS}, {_PG_READY} FROM schedule ORDER BY key"
# The others alone, checked before anything is written to the target.
MIGRATE_ROWS_NOT_READY = (
    f"SELECT {_MIGRATE_COLUMNS} FROM schedule WHERE NOT ({_PG_READY}) ORDER BY key"
)
ALL_META = "SELECT name, value FROM meta ORDER BY name"
# Changes with a number since another connection last committed: whether
# anyone wrote the file while it was being copied.
DATA_VERSION = "PRAGMA data_version"
# A producer's changes after the keeper's last save of its counts (every
# change but the node's own write-backs).
CHANGES_NOT_WRITEBACK_AFTER = "SELECT count(*) FROM changes WHERE seq > ? AND origin <> 'writeback'"
