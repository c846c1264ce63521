"""Every SQL statement of the PostgreSQL store, by name.

The schema (``MIGRATIONS``) is a contract for programs that write the
database directly (``docs/postgres.md``): append new migrations, never edit
an applied one. ``node/store/postgres.py`` runs these statements and nothing
else.

How the triggers keep SQLite's rules (``docs/schema.md``) on PostgreSQL:

- **Versions.** A row's version is the seq of the change its last write
  logged. BEFORE ROW triggers take the seq (``nextval``) and put it in
  ``NEW.version``, so ``RETURNING version`` gives the new version; AFTER ROW
  triggers log the change under that seq, so only what happened is logged
  (an ``INSERT … ON CONFLICT`` that turns into an update logs one 'U').
  The insert trigger locks an existing row of the key (``FOR KEY SHARE``)
  and takes no seq when there is one: the statement is then going to
  conflict, and a seq taken for it would be a hole in the log.
- **Origin.** The node's write transaction runs
  ``set_config('queue_node.origin', 'node', true)`` (``SET LOCAL``); the
  triggers read ``current_setting('queue_node.origin', true)``, which is
  empty or NULL in any other program's transaction (logged 'external'). No
  shared row is written, so writers do not serialise on one.
- **The feed's horizon.** Before taking a seq, a trigger makes sure its
  transaction has an xid (``pg_current_xact_id()``): every seq is taken
  after its writer's xid was assigned. ``postgres_feed.Horizon`` builds on
  that to never hand out a change past a seq whose writer may still commit.
- **NOTIFY.** One statement-level trigger notifies ``CHANNEL`` once per
  statement that wrote the table: the keeper can sleep on LISTEN.
"""

from __future__ import annotations

# The channel every statement that writes ``schedule`` notifies (NOTIFY is
# scoped to the database, so one name serves every fleet on a server).
CHANNEL = "queue_node_changes"
# The advisory lock migrations run under: processes that start at once on
# an empty database take turns, and the second finds nothing to do.
MIGRATION_LOCK = 0x71_6E_6F_64_65  # "qnode"
# A fleet node's number: 1 to this, unique in the fleet (the high bits of its
# result ids; 0 is a node outside any fleet). keeper/owners.py holds at most
# 255 nodes in one list. node/fleet/ uses the table.
FLEET_MAX_NUMBER = 255
# The advisory lock a trim of the shared change log runs under, tried, not
# waited for: one node trims at a time, and the others skip (each would
# delete the same rows, and wait on the first's row locks to find them gone).
TRIM_LOCK = 0x71_6E_74_72_6D  # "qntrm"
# The most change-log rows one trim deletes: a trim runs in the keeper's
# loop, between its heartbeats, so it is bounded; the keeper trims again
# soon while a trim stops short (keeper/feed.py).
TRIM_CHUNK = 50_000

_ORIGIN_SQL = "COALESCE(NULLIF(current_setting('queue_node.origin', true), ''), 'external')"
_NOW_SQL = "extract(epoch FROM clock_timestamp())::float8"
_LOGGED = "key, route, cadence_s, sitemap, due_at, payload, job"

MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (
        1,
        "schedule, change log, meta, triggers, notify",
        [
            # COLLATE "C": keys order by their UTF-8 bytes, as SQLite's BINARY.
            """CREATE TABLE schedule (
                key              text COLLATE "C" PRIMARY KEY,
                route            text NOT NULL,
                cadence_s        bigint,
                sitemap          smallint NOT NULL DEFAULT 0,
                due_at           float8 NOT NULL,
                payload          text,
                job              text NOT NULL DEFAULT 'default',
                version          bigint NOT NULL DEFAULT 0,
                last_result_id   bigint,
                last_finished_at float8,
                last_error       text
            )""",
            # CACHE 1 (the default): seqs are handed out in the order they are taken.
            "CREATE SEQUENCE changes_seq AS bigint",
            """CREATE TABLE changes (
                seq        bigint PRIMARY KEY,
                op         text NOT NULL,
                key        text COLLATE "C" NOT NULL,
                origin     text NOT NULL,
                route      text,
                cadence_s  bigint,
                sitemap    smallint,
                due_at     float8,
                at         float8 NOT NULL,
                old_due_at float8,
                xid        xid8 NOT NULL DEFAULT pg_current_xact_id()
            )""",
            # The highest seq a trim removed: last_seq() after a full trim.
            """CREATE TABLE changes_trimmed (
                id      int PRIMARY KEY CHECK (id = 0),
                through bigint NOT NULL
            )""",
            "INSERT INTO changes_trimmed (id, through) VALUES (0, 0)",
            # One node's values by name (paused routes, lifetime counters).
            """CREATE TABLE node_meta (
                node  text NOT NULL,
                name  text NOT NULL,
                value text NOT NULL,
                PRIMARY KEY (node, name)
            )""",
            """CREATE FUNCTION queue_node_take_seq() RETURNS bigint
            LANGUAGE plpgsql AS $$
            BEGIN
                -- The writer's xid first, then its seq (postgres_feed.Horizon).
                PERFORM pg_current_xact_id();
                RETURN nextval('changes_seq');
            END $$""",
            """CREATE FUNCTION queue_node_before_insert() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM 1 FROM schedule WHERE key = NEW.key FOR KEY SHARE;
                IF FOUND THEN
                    NEW.version := 0;  -- it will conflict: the update takes the seq
                ELSE
                    PERFORM pg_current_xact_id();  -- the xid first (take_seq)
                    NEW.version := nextval('changes_seq');
                END IF;
                RETURN NEW;
            END $$""",
            f"""CREATE FUNCTION queue_node_before_update() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                -- A key renamed in place (only another program can) is logged
                -- as the old key's delete, then the new key's insert.
                PERFORM pg_current_xact_id();  -- the xid before the seq (take_seq)
                IF NEW.key IS DISTINCT FROM OLD.key THEN
                    INSERT INTO changes (seq, op, key, origin, at, old_due_at)
                    VALUES (nextval('changes_seq'), 'D', OLD.key, {_ORIGIN_SQL},
                            {_NOW_SQL}, OLD.due_at);
                END IF;
                NEW.version := nextval('changes_seq');
                RETURN NEW;
            END $$""",
            """CREATE FUNCTION queue_node_version_guard() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                RAISE EXCEPTION 'schedule.version is set by triggers, never by writers'
                    USING ERRCODE = 'integrity_constraint_violation';
            END $$""",
            f"""CREATE FUNCTION queue_node_log_write() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO changes (seq, op, key, origin, route, cadence_s, sitemap, due_at,
                                     at, old_due_at)
                VALUES (NEW.version,
                        CASE WHEN TG_OP = 'UPDATE' AND OLD.key = NEW.key THEN 'U' ELSE 'I' END,
                        NEW.key, {_ORIGIN_SQL}, NEW.route, NEW.cadence_s, NEW.sitemap,
                        NEW.due_at, {_NOW_SQL},
                        CASE WHEN TG_OP = 'UPDATE' AND OLD.key = NEW.key THEN OLD.due_at END);
                RETURN NULL;
            END $$""",
            f"""CREATE FUNCTION queue_node_log_inserts() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO changes (seq, op, key, origin, route, cadence_s, sitemap, due_at, at)
                SELECT version, 'I', key, {_ORIGIN_SQL}, route, cadence_s, sitemap, due_at,
                       {_NOW_SQL}
                  FROM inserted;
                RETURN NULL;
            END $$""",
            f"""CREATE FUNCTION queue_node_log_delete() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO changes (seq, op, key, origin, at, old_due_at)
                VALUES (queue_node_take_seq(), 'D', OLD.key, {_ORIGIN_SQL}, {_NOW_SQL},
                        OLD.due_at);
                RETURN NULL;
            END $$""",
            f"""CREATE FUNCTION queue_node_notify() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM pg_notify('{CHANNEL}', '');
                RETURN NULL;
            END $$""",
            # A completion group's write-backs in one statement, item by item
            # in order (a key twice sees its first write-back; seqs follow the
            # group): the new version per item, NULL where the guard refused.
            # Measured against a pipelined executemany of the UPDATE: about a
            # third less time a row at 64 a group (bench/bench_pg_store.py).
            """CREATE FUNCTION queue_node_write_back(
                keys text[], dues float8[], versions bigint[], result_ids bigint[],
                finished float8[]) RETURNS bigint[]
            LANGUAGE plpgsql AS $$
            DECLARE
                out bigint[] := '{}';
                v bigint;
            BEGIN
                FOR i IN 1 .. COALESCE(array_length(keys, 1), 0) LOOP
                    UPDATE schedule SET due_at = dues[i], last_result_id = result_ids[i],
                           last_finished_at = finished[i], last_error = NULL
                     WHERE key = keys[i] AND version = versions[i]
                    RETURNING version INTO v;  -- NULL when no row took it
                    out := out || v;
                END LOOP;
                RETURN out;
            END $$""",
            # Triggers of one event fire in name order: the guard first.
            """CREATE TRIGGER schedule_a_version_guard BEFORE UPDATE OF version ON schedule
            FOR EACH ROW WHEN (NEW.version IS DISTINCT FROM OLD.version)
            EXECUTE FUNCTION queue_node_version_guard()""",
            """CREATE TRIGGER schedule_b_version_insert BEFORE INSERT ON schedule
            FOR EACH ROW EXECUTE FUNCTION queue_node_before_insert()""",
            # UPDATE OF: a write of the outcome columns alone is no change.
            f"""CREATE TRIGGER schedule_b_version_update BEFORE UPDATE OF {_LOGGED} ON schedule
            FOR EACH ROW EXECUTE FUNCTION queue_node_before_update()""",
            # Inserts are logged once a statement, from its transition table
            # (an import's rows in one INSERT … SELECT).
            """CREATE TRIGGER schedule_log_insert AFTER INSERT ON schedule
            REFERENCING NEW TABLE AS inserted
            FOR EACH STATEMENT EXECUTE FUNCTION queue_node_log_inserts()""",
            f"""CREATE TRIGGER schedule_log_update AFTER UPDATE OF {_LOGGED} ON schedule
            FOR EACH ROW EXECUTE FUNCTION queue_node_log_write()""",
            """CREATE TRIGGER schedule_log_delete AFTER DELETE ON schedule
            FOR EACH ROW EXECUTE FUNCTION queue_node_log_delete()""",
            """CREATE TRIGGER schedule_notify AFTER INSERT OR UPDATE OR DELETE ON schedule
            FOR EACH STATEMENT EXECUTE FUNCTION queue_node_notify()""",
        ],
    ),
    (
        2,
        "fleet_nodes: a fleet's node list (node/fleet/)",
        [
            # IF NOT EXISTS: a database where an earlier build's membership
            # made the table itself (under its own lock) keeps it as it is.
            f"""CREATE TABLE IF NOT EXISTS fleet_nodes (
                name          text        PRIMARY KEY,
                address       text        NOT NULL,
                number        smallint    NOT NULL UNIQUE
                              CHECK (number BETWEEN 1 AND {FLEET_MAX_NUMBER}),
                started_at    timestamptz NOT NULL,
                heartbeat_at  timestamptz NOT NULL,
                left_at       timestamptz
            )""",
        ],
    ),
    (
        3,
        "fleet_nodes.applied_seq: the change-log position each node may resume from",
        [
            # NULL until the node's first heartbeat reports it (and again at
            # each join): a live node with NULL holds the whole log (keeper/feed.py).
            "ALTER TABLE fleet_nodes ADD COLUMN IF NOT EXISTS applied_seq bigint",
        ],
    ),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]

# -- migrations ----------------------------------------------------------------------

CREATE_MIGRATIONS = """CREATE TABLE IF NOT EXISTS schema_migrations (
        version int PRIMARY KEY, name text NOT NULL, applied_at float8 NOT NULL)"""
READ_SCHEMA_VERSION = "SELECT COALESCE(MAX(version), 0) FROM schema_migrations"
RECORD_MIGRATION = "INSERT INTO schema_migrations (version, name, applied_at) VALUES (%s, %s, %s)"
LOCK_MIGRATIONS = "SELECT pg_advisory_xact_lock(%s)"

# -- the write transaction -------------------------------------------------------------

# SET LOCAL by function: the value is a bound parameter, and it ends with the
# transaction (committed or not).
SET_ORIGIN = "SELECT set_config('queue_node.origin', %s, true)"
# A store opened not durable (the ledger's, docs/delivery.md): its commits do
# not wait for their WAL to be flushed; ``SYNC`` flushes everything so far.
SET_ORIGIN_ASYNC = (
    "SELECT set_config('queue_node.origin', %s, true),"
    " set_config('synchronous_commit', 'off', true)"
)
SET_ASYNC = "SELECT set_config('synchronous_commit', 'off', true)"
# A transaction with an xid, committed synchronously: its commit waits for
# the WAL to be flushed up to its record, so every commit before it is durable.
SYNC = "SELECT pg_current_xact_id()"

# -- the schedule -------------------------------------------------------------------

_ROW_COLUMNS = (
    "key, route, cadence_s, sitemap, due_at, payload, job, version,"
    " last_result_id, last_finished_at, last_error"
)
DELETE_ROW = "DELETE FROM schedule WHERE key = %s"
WRITE_NEXT_DUE = "UPDATE schedule SET due_at = %s WHERE key = %s AND version = %s RETURNING version"
# An operator's "run again now" (Store.due_now): as node/store/queries.py's.
DUE_NOW_ROUTE = "UPDATE schedule SET due_at = LEAST(due_at, %s) WHERE route = %s"
DUE_NOW_JOB = "UPDATE schedule SET due_at = LEAST(due_at, %s) WHERE job = %s"
# A group's write-backs under the version guard (queue_node_write_back, five
# arrays); the new versions come back (the BEFORE trigger set them).
WRITE_BACK_MANY = "SELECT queue_node_write_back(%s, %s, %s, %s, %s)"
WRITE_LAST_ERROR = (
    "UPDATE schedule SET last_error = %s"
    " WHERE key = %s AND (last_finished_at IS NULL OR last_finished_at <= %s)"
)
GET_ROW = f"SELECT {_ROW_COLUMNS} FROM schedule WHERE key = %s"
GET_MANY = f"SELECT {_ROW_COLUMNS} FROM schedule WHERE key = ANY(%b)"
# The claim path's read (the row service, workers/rows): the columns a grant
# checks and hands out, without the outcome columns (an error text can be long).
# The keys go as a binary text[] (``%b``, as in GET_MANY and JOBS_OF): psycopg
# dumps a list to the text form in Python, quoting each key (a tenth of the
# row service's time); the binary form costs about a fifth less a 64-key read.
CLAIM_ROWS = (
    "SELECT key, route, cadence_s, sitemap, due_at, payload, job, version"
    " FROM schedule WHERE key = ANY(%b)"
)
JOBS_OF = "SELECT key, job, cadence_s, route, sitemap, due_at FROM schedule WHERE key = ANY(%b)"
WALK_ALL = f"SELECT {_ROW_COLUMNS} FROM schedule ORDER BY key LIMIT %s"
WALK_AFTER = f"SELECT {_ROW_COLUMNS} FROM schedule WHERE key > %s ORDER BY key LIMIT %s"
_SCHEDULE_COLUMNS = "key, version, route, cadence_s, sitemap, due_at"
WALK_SCHEDULE_ALL = f"SELECT {_SCHEDULE_COLUMNS} FROM schedule ORDER BY key LIMIT %s"
WALK_SCHEDULE_AFTER = (
    f"SELECT {_SCHEDULE_COLUMNS} FROM schedule WHERE key > %s ORDER BY key LIMIT %s"
)
COUNT_ROWS = "SELECT count(*) FROM schedule"
CLASSES_IN_USE = (
    "SELECT route, cadence_s, sitemap, MIN(version) AS oldest FROM schedule"
    " GROUP BY route, cadence_s, sitemap ORDER BY oldest"
)

_UPSERT_SQL: dict[tuple[str, ...], str] = {}


def upsert_sql(present: tuple[str, ...]) -> str:
    """A multi-row upsert of writes carrying ``present`` optional fields, the
    rows as seven arrays (``unnest`` keeps their order, so seqs follow the
    batch): an insert binds every column, a conflict updates only the route
    and the fields the write carries. Keys must be distinct in one statement."""
    sql = _UPSERT_SQL.get(present)
    if sql is None:
        sets = ", ".join(f"{f} = excluded.{f}" for f in ("route", *present))
        sql = (
            "INSERT INTO schedule (key, route, cadence_s, sitemap, due_at, payload, job)"
            " SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::smallint[],"
            " %s::float8[], %s::text[], %s::text[])"
            f" ON CONFLICT (key) DO UPDATE SET {sets}"
        )
        _UPSERT_SQL[present] = sql
    return sql


# -- the change log -----------------------------------------------------------------

# The reader's snapshot horizon comes with the rows, from the same snapshot
# (scalar subqueries: computed once a statement, measured 4.6 -> 3.6 us a
# change against once a row).
CHANGES_AFTER = """SELECT seq, op, key, origin, route, cadence_s, sitemap, due_at, at,
        (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint),
        (SELECT through FROM changes_trimmed)
        FROM changes WHERE seq > %s ORDER BY seq LIMIT %s"""
# An xid assigned now (every writer whose seq was taken before is older),
# with the top of the log (the highest seq in it, or trimmed from it) as of
# the statement's snapshot, taken before the xid. Run in a transaction of its
# own that writes nothing, so its commit need not wait for a WAL flush.
TOP_AND_XID = """SELECT set_config('synchronous_commit', 'off', true),
        GREATEST((SELECT COALESCE(MAX(seq), 0) FROM changes),
                 (SELECT through FROM changes_trimmed)),
        pg_current_xact_id()::text::bigint"""
SNAPSHOT_XMIN = "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
FIRST_SEQ_AFTER = """SELECT (SELECT MIN(seq) FROM changes WHERE seq > %s),
        (SELECT through FROM changes_trimmed)"""
TRY_TRIM_LOCK = "SELECT pg_try_advisory_xact_lock(%s)"
TRIM_CHANGES = """WITH gone AS (DELETE FROM changes WHERE seq <= LEAST(%s,
            (SELECT MIN(seq) FROM changes) + %s - 1) RETURNING seq)
        UPDATE changes_trimmed
        SET through = GREATEST(through, COALESCE((SELECT MAX(seq) FROM gone), 0))
        RETURNING (SELECT count(*) FROM gone)"""
# (A key the node cannot hold, empty or over 1,024 bytes, was never received.)
DUE_HISTORY = """SELECT seq, op, key, origin, due_at, old_due_at, at FROM changes
        WHERE seq > %s AND seq <= %s AND key <> '' AND octet_length(key) <= 1024
        ORDER BY seq LIMIT %s"""

# -- meta ---------------------------------------------------------------------------

# Meta by intent: a route paused is paused for the whole fleet (every node
# reads the one entry, under FLEET_SCOPE, a name no node can have); the rest
# (a node paused, its lifetime counters) is each node's own.
FLEET_META = frozenset({"paused_routes"})
FLEET_SCOPE = ""

GET_META = "SELECT value FROM node_meta WHERE node = %s AND name = %s"
META_OF_EVERY_NODE = "SELECT node, value FROM node_meta WHERE name = %s AND node <> ''"
SET_META = """INSERT INTO node_meta (node, name, value) VALUES (%s, %s, %s)
        ON CONFLICT (node, name) DO UPDATE SET value = excluded.value"""

# -- LISTEN -------------------------------------------------------------------------

LISTEN = f"LISTEN {CHANNEL}"

# -- python -m node migrate (node/migrate.py) -------------------------------------------

SCHEDULE_EXISTS = "SELECT to_regclass('schedule') IS NOT NULL"
ANY_ROW = "SELECT EXISTS (SELECT 1 FROM schedule)"
META_NAMES_OF_NODE = "SELECT name FROM node_meta WHERE node = %s ORDER BY name"
# All-or-nothing and one view: rows another session commits meanwhile are not
# seen, so "ours" below is exactly what this transaction wrote.
REPEATABLE_READ = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"
# The highest seq taken so far (0 on a new sequence). Read as the first
# statement of the transaction: every row it can see has a version at or
# below it, so the rows with a higher one are the ones it inserts.
SEQ_TAKEN = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM changes_seq"
# The rows as the source holds them, ten arrays of one chunk (sent binary:
# psycopg escapes a text array's every element with a regex, which took 40 %
# of a run); the triggers
# give each its version and log its 'I' as for any insert. A key the target
# holds already is left alone (and counted missing: the run is refused).
MIGRATE_INSERT = (
    "INSERT INTO schedule (key, route, cadence_s, sitemap, due_at, payload, job,"
    " last_result_id, last_finished_at, last_error)"
    " SELECT * FROM unnest(%b::text[], %b::text[], %b::bigint[], %b::smallint[],"
    " %b::float8[], %b::text[], %b::text[], %b::bigint[], %b::float8[], %b::text[])"
    " ON CONFLICT (key) DO NOTHING"
)
# Which of a chunk's keys the target held before this transaction.
KEYS_HELD_BEFORE = (
    "SELECT key FROM schedule WHERE key = ANY(%s) AND version <= %s ORDER BY key LIMIT 1"
)
# What this transaction inserted, read back for the checksum (payload left
# out: it would be the whole table over the wire a second time).
MIGRATED_ROWS = (
    "SELECT key, route, cadence_s, sitemap, due_at, job, last_result_id, last_finished_at,"
    " last_error FROM schedule WHERE version > %s ORDER BY key"
)
