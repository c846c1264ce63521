"""``python -m node migrate --from sqlite:///FILE --to postgresql://…``: one
node's schedule, out of its SQLite file into a fleet's PostgreSQL database.

What moves: every row, column for column (key, route, cadence_s, sitemap,
due_at, the payload's stored text, job, and the outcome of its last lease),
except ``version``: a version is the seq of the row's last change in *its*
store's change log, so the target's triggers give each row its own, as for
any insert (and log its ``'I'``, which a fleet's live keepers apply). The
node's meta (``meta``: the lifetime counters, the paused routes and node)
goes to ``node_meta`` under the node's name, where the node reads it on
PostgreSQL; the saved ``received`` count's change-log position is set to the
target's, so its next keeper replays none of the copy's inserts as new
occurrences. The source file is only read.

One transaction (REPEATABLE READ): a failure or a refusal part-way commits
nothing, so a run is repeated as it was, and a fleet never sees half a
node. A long one holds back the live keepers' feeds above its first seq
until it commits (docs/postgres.md), about a minute a million rows.

Refused (``ConfigError``: one line, exit 2, nothing written): a source that
is not ``sqlite:///`` or not there, a target that is not ``postgresql://``,
a target that holds rows (without ``--merge``) or any of the source's keys
(with it) or meta under the node's name, and a source a node runs on
(``node.json`` in its data directory names a live pid, or a node of its
name runs on this host), or that anyone wrote while it was being copied.

Operators' page: docs/postgres.md, "Moving a node's schedule into a fleet".
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from node.core.errors import ConfigError, NodeError, StoreError
from node.core.names import check_name, host_node_name
from node.core.rows import ORIGIN_NODE
from node.core.urls import redact_url

# Rows per INSERT statement (ten arrays of this length), as the store's bulk
# upsert (node/store/postgres_values.py, UPSERT_CHUNK).
CHUNK_ROWS = 5_000
# ... and at most this many bytes of payload in one (a payload may be 1 MiB:
# 5,000 of them would be 5 GiB in this process and in the statement).
CHUNK_BYTES = 64 << 20
# A progress line on stderr at most this often (none for a run shorter).
PROGRESS_EVERY_S = 2.0
# The schema the copy reads: the outcome columns came with migration 2.
MIN_SOURCE_SCHEMA = 2


@dataclass
class Plan:
    """What a run copies, from where, to where, for whom."""

    source_path: Path
    target_url: str  # as given (no password: the command line moved it to PGPASSWORD)
    data_dir: Path
    name: str
    merge: bool = False
    progress_every_s: float = PROGRESS_EVERY_S


@dataclass
class Summary:
    """The one-line summary (JSON on stdout)."""

    rows: int = 0
    seconds: float = 0.0
    node: str = ""
    meta: list[str] = field(default_factory=list)
    checksum: str = ""
    uncounted_changes: int | None = None
    leases_outstanding: int | None = None

    def to_json(self, plan: Plan) -> dict[str, Any]:
        return {
            "migrated": self.rows,
            "seconds": round(self.seconds, 2),
            "rows_per_s": round(self.rows / self.seconds) if self.seconds > 0 else None,
            "node": self.node,
            "meta": self.meta,
            "checksum": self.checksum,
            "uncounted_changes": self.uncounted_changes,
            "leases_outstanding": self.leases_outstanding,
            "from": f"sqlite:///{plan.source_path}",
            "to": redact_url(plan.target_url),
        }


# -- the plan: URLs, the node's name, whether it runs --------------------------------


def plan(source: str, target: str, *, name: str | None, data_dir: str | None, merge: bool) -> Plan:
    """Check what the command line gave and resolve the rest; ConfigError
    (one line) for anything that refuses the run. Reads nothing of the target."""
    if not source.startswith("sqlite:///") or len(source) == len("sqlite:///"):
        raise ConfigError(
            f"--from must be a SQLite store, sqlite:///FILE (got {redact_url(source)!r})"
        )
    if not target.startswith(("postgresql://", "postgres://")):
        raise ConfigError(
            "--to must be a PostgreSQL store, postgresql://user@host/db "
            f"(got {redact_url(target)!r})"
        )
    path = Path(source[len("sqlite:///") :])
    if not path.is_file():
        raise ConfigError(f"--from {source}: no such file")
    path = path.resolve()
    where = Path(data_dir).resolve() if data_dir else path.parent
    return Plan(path, target, where, _node_name(name, where, path), merge)


def _node_name(given: str | None, data_dir: Path, path: Path) -> str:
    """Whose meta the source holds: ``--name``; else the name the data
    directory's last run had (``run/config.json``, kept after a stop) when
    that run's store was this file; else the default a node takes
    (``QUEUE_NODE_NAME``, the host name)."""
    if given:
        return check_name(given)
    try:
        doc = json.loads((data_dir / "run" / "config.json").read_text())
    except (OSError, ValueError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("name"), str):
        store = doc.get("store") or f"sqlite:///{data_dir}/schedule.db"
        ran_on = Path(store[len("sqlite:///") :]) if store.startswith("sqlite:///") else None
        if ran_on is not None and ran_on.exists() and os.path.samefile(ran_on, path):
            return check_name(doc["name"])
    from node.core.config import ENV_PREFIX

    return check_name(os.environ.get(ENV_PREFIX + "NAME") or host_node_name())


def refuse_if_running(plan: Plan) -> None:
    """A node that runs on the source keeps writing it (write-backs, the
    keeper's counts): what it writes after the copy would be lost. Its
    evidence: ``node.json`` (written at start, removed at a clean stop) with
    a live pid, or a state buffer of its name whose writer lives."""
    from shm.segment import pid_alive

    try:
        doc = json.loads((plan.data_dir / "node.json").read_text())
    except (OSError, ValueError):
        doc = None
    pid = doc.get("pid") if isinstance(doc, dict) else None
    if isinstance(pid, int) and pid_alive(pid):
        raise ConfigError(
            f"a node runs on {plan.data_dir} (pid {pid}, node.json): stop it (SIGTERM) "
            "and run migrate again; a live store's writes after the copy would be lost"
        )
    from shm.state import StateBuffer

    try:
        state = StateBuffer.attach(plan.name, read_only=True)
    except (NodeError, OSError):  # no buffer of that name: no node of it here
        return
    try:
        owner = state.read().get("owner_pid")
    finally:
        state.close()
    if isinstance(owner, int) and pid_alive(owner):
        raise ConfigError(
            f"node {plan.name!r} runs on this host (pid {owner}): stop it (SIGTERM) "
            "and run migrate again; a live store's writes after the copy would be lost"
        )


# -- the source: the SQLite file, read only, in one snapshot -------------------------


class Source:
    """The SQLite file opened read-only (``mode=ro``: never made, never
    migrated, never written)."""

    def __init__(self, path: Path) -> None:
        from node.store import queries as q

        self.path = path
        self.q = q
        try:
            self.conn = sqlite3.connect(
                f"file:{quote(str(path))}?mode=ro", uri=True, isolation_level=None
            )
            version = self.conn.execute(q.READ_SCHEMA_VERSION).fetchone()[0]
        except sqlite3.Error as exc:
            raise ConfigError(f"--from {path}: not a queue-node store ({exc})") from None
        if not MIN_SOURCE_SCHEMA <= version <= q.SCHEMA_VERSION:
            raise ConfigError(
                f"--from {path}: schema version {version}; this build migrates "
                f"{MIN_SOURCE_SCHEMA} to {q.SCHEMA_VERSION} (start the node on it once "
                "with this build, or use the build that wrote it)"
            )
        self.data_version = self.conn.execute(q.DATA_VERSION).fetchone()[0]
        # One read transaction from here to ``end``: the count, the rows and
        # the meta are one state of the file.
        self.conn.execute("BEGIN")
        self.count = self.conn.execute(q.COUNT_ROWS).fetchone()[0]
        self.meta = self.conn.execute(q.ALL_META).fetchall()
        found = self.conn.execute(q.LAST_SEQ).fetchone()
        self.last_seq = 0 if found is None else found[0]

    def rows(self) -> Iterator[list[tuple]]:
        """The rows in key order, CHUNK_ROWS (or CHUNK_BYTES) at a time, raw as stored, each
        with a flag: whether its values need no conversion (``target_row``)."""
        cur = self.conn.execute(self.q.MIGRATE_ROWS)
        chunk: list[tuple] = []
        size = 0
        while fetched := cur.fetchmany(500):
            for stored in fetched:
                chunk.append(stored)
                payload = stored[5]
                size += len(payload) if isinstance(payload, str | bytes) else 0
                if len(chunk) >= CHUNK_ROWS or size >= CHUNK_BYTES:
                    yield chunk
                    chunk, size = [], 0
        if chunk:
            yield chunk

    def check_values(self) -> None:
        """ConfigError naming the first row a PostgreSQL column cannot hold
        (SQLite keeps any type in any column), found before the target is
        touched. One scan in SQLite: only the rows its flag calls unusual
        reach Python."""
        for stored in self.conn.execute(self.q.MIGRATE_ROWS_NOT_READY):
            target_row(stored)

    def uncounted_after(self, seq: int) -> int:
        """A producer's changes after the keeper's last save (``seq``)."""
        return self.conn.execute(self.q.CHANGES_NOT_WRITEBACK_AFTER, (seq,)).fetchone()[0]

    def written_since_open(self) -> bool:
        """Whether another connection committed since the file was opened
        (asked once the read transaction is over)."""
        if self.conn.in_transaction:
            self.conn.execute("COMMIT")
        return self.conn.execute(self.q.DATA_VERSION).fetchone()[0] != self.data_version

    def close(self) -> None:
        self.conn.close()


# Per column of MIGRATE_ROWS: its name and the PostgreSQL type that holds it.
_COLUMNS = (
    ("key", "text"), ("route", "text"), ("cadence_s", "bigint"), ("sitemap", "smallint"),
    ("due_at", "float8"), ("payload", "text"), ("job", "text"),
    ("last_result_id", "bigint"), ("last_finished_at", "float8"), ("last_error", "text"),
)  # fmt: skip


def _pg_value(value: Any, pg_type: str) -> Any:
    """A stored SQLite value as the target's column takes it, or ValueError:
    SQLite keeps any type in any column, PostgreSQL does not."""
    if value is None:
        return None
    if pg_type == "text":
        if isinstance(value, str) and "\x00" not in value:
            return value
    elif pg_type == "float8":
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    else:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            bits = 16 if pg_type == "smallint" else 64
            if -(1 << (bits - 1)) <= value < 1 << (bits - 1):
                return value
    raise ValueError(pg_type)


def target_row(stored: tuple) -> tuple:
    """One row as the target will hold it (ConfigError naming the row and
    column a PostgreSQL column cannot hold)."""
    try:
        return tuple(_pg_value(v, t) for v, (_n, t) in zip(stored, _COLUMNS, strict=True))
    except ValueError:
        for value, (column, pg_type) in zip(stored, _COLUMNS, strict=True):
            try:
                _pg_value(value, pg_type)
            except ValueError:
                shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
                raise ConfigError(
                    f"row {stored[0]!r}: {column} holds {shown}, which PostgreSQL's "
                    f"{pg_type} column cannot; fix or delete it in the source and run "
                    "migrate again"
                ) from None
        raise


def _checked(row: tuple) -> tuple:
    """The columns the checksum covers (MIGRATED_ROWS: all but the payload)."""
    key, route, cadence_s, sitemap, due_at, _payload, job, rid, finished, error = row
    return key, route, cadence_s, sitemap, due_at, job, rid, finished, error


def _digest(h: Any, row: tuple) -> None:
    h.update(repr(row).encode("utf-8", "surrogatepass"))
    h.update(b"\x1e")


# -- the copy --------------------------------------------------------------------------


def run(plan: Plan, say: Callable[[str], None]) -> Summary:
    """Copy, verify, commit; the summary. ConfigError for a refusal (nothing
    written), StoreError for a store that failed (nothing written either)."""
    started = time.monotonic()
    refuse_if_running(plan)
    source = Source(plan.source_path)
    try:
        source.check_values()
        return _run(plan, source, say, started)
    finally:
        source.close()


def _run(plan: Plan, source: Source, say: Callable[[str], None], started: float) -> Summary:
    import psycopg

    from keeper.report import RECEIVED_META
    from node.store import postgres_schema as pq
    from node.store.postgres import CONNECT_TIMEOUT_S, migrate, wrap_error

    shown = redact_url(plan.target_url)
    summary = Summary(node=plan.name)
    try:
        conn = psycopg.connect(
            plan.target_url, autocommit=True, connect_timeout=int(CONNECT_TIMEOUT_S)
        )
    except psycopg.Error as exc:
        raise wrap_error(exc, f"opening {shown}") from exc
    with conn:
        try:
            _refuse_target(conn, plan, shown)
            migrate(conn, shown)  # a new database gets the schema, as a node's first open
            with conn.transaction():
                conn.execute(pq.REPEATABLE_READ)
                before = _scalar(conn, pq.SEQ_TAKEN)
                _refuse_target(conn, plan, shown)  # again, in the transaction's view
                conn.execute(pq.SET_ORIGIN, (ORIGIN_NODE,))
                expected = _copy_rows(conn, plan, source, before, say, started)
                summary.rows = source.count
                summary.checksum = _verify(conn, before, source.count, expected)
                top = _scalar(conn, pq.SEQ_TAKEN)
                for name, value in source.meta:
                    owner = plan.name
                    if name == RECEIVED_META:
                        value, summary.uncounted_changes = _received(source, value, top)
                    elif name in pq.FLEET_META:
                        owner, value = pq.FLEET_SCOPE, _fleet_union(conn, name, value)
                    conn.execute(pq.SET_META, (owner, name, value))
                    summary.meta.append(name)
                if source.written_since_open():
                    raise ConfigError(
                        f"{plan.source_path} was written while it was copied (a node or a "
                        "program writes it): stop it and run migrate again; nothing was "
                        "committed"
                    )
        except psycopg.Error as exc:
            raise wrap_error(exc, "migrate") from exc
    summary.leases_outstanding = leases_outstanding(plan.data_dir)
    summary.seconds = time.monotonic() - started
    return summary


def _fleet_union(conn: Any, name: str, value: str) -> str:
    """A fleet-wide entry (the paused routes) joined with what the fleet has:
    a route the node had paused stays paused, now on every node (the
    conservative reading: nothing the operator stopped starts running)."""
    from node.store import postgres_schema as pq

    found = conn.execute(pq.GET_META, (pq.FLEET_SCOPE, name)).fetchone()
    routes = set(json.loads(value) or []) | set(json.loads(found[0]) if found else [])
    return json.dumps(sorted(routes), separators=(",", ":"))


def leases_outstanding(data_dir: Path) -> int | None:
    """The leases a clean stop saved in the data directory (``leases.msgpack``)
    that a node restarted on it puts back: each was granted on the row's
    version in the SQLite file, so its result's write-back loses to the
    target's version guard and the row runs once more (its result is still
    kept and delivered). None when the file cannot be read."""
    from shm.leases.persist import read_lease_file
    from shm.leases.protocol import LEASED

    path = data_dir / "leases.msgpack"
    if not path.exists():
        return 0
    try:
        _next, _counters, entries = read_lease_file(path)
    except NodeError:
        return None
    return sum(1 for _key, code, _rec in entries if code == LEASED)


def _scalar(conn: Any, sql: str) -> Any:
    """The one value a statement answers."""
    return conn.execute(sql).fetchone()[0]


def _refuse_target(conn: Any, plan: Plan, shown: str) -> None:
    from node.store import postgres_schema as pq

    if not conn.execute(pq.SCHEDULE_EXISTS).fetchone()[0]:
        return  # a new database: nothing in it
    if not plan.merge and conn.execute(pq.ANY_ROW).fetchone()[0]:
        raise ConfigError(
            f"--to {shown} holds rows already: give a database of its own, or --merge "
            "to add this node's rows to a fleet's (refused then if any key is there)"
        )
    names = [r[0] for r in conn.execute(pq.META_NAMES_OF_NODE, (plan.name,)).fetchall()]
    if names:
        raise ConfigError(
            f"--to {shown} holds meta of node {plan.name!r} already ({', '.join(names)}): "
            "that name has run on this database; give the node's own with --name"
        )


def _copy_rows(
    conn: Any, plan: Plan, source: Source, before: int, say: Callable[[str], None],
    started: float,
) -> bytes:  # fmt: skip
    """Insert the rows chunk by chunk; the digest the target must match."""
    from node.store import postgres_schema as pq

    h = hashlib.blake2b(digest_size=16)
    done = 0
    next_say = started + plan.progress_every_s
    for chunk in source.rows():
        rows = [stored[:10] if stored[10] else target_row(stored[:10]) for stored in chunk]
        for row in rows:
            _digest(h, _checked(row))
        inserted = conn.execute(pq.MIGRATE_INSERT, [list(c) for c in zip(*rows, strict=True)])
        if inserted.rowcount != len(rows):
            keys = [row[0] for row in rows]
            held = conn.execute(pq.KEYS_HELD_BEFORE, (keys, before)).fetchone()
            raise ConfigError(
                f"--to {redact_url(plan.target_url)} holds key "
                f"{held[0] if held else '?'!r} already (and maybe more of the source's): "
                "a key lives in one place; delete it from one side and run migrate again "
                "(nothing was committed)"
            )
        done += len(rows)
        now = time.monotonic()
        if now >= next_say:
            rate = done / max(now - started, 1e-9)
            share = 100 * done // max(source.count, 1)
            say(f"migrate: {done:,} of {source.count:,} rows ({share}%), {rate:,.0f} rows/s")
            next_say = now + plan.progress_every_s
    if done != source.count:
        raise StoreError(f"the source gave {done} rows, its count said {source.count}")
    return h.digest()


def _verify(conn: Any, before: int, count: int, expected: bytes) -> str:
    """Read back what this transaction inserted, in key order: its count and
    checksum must be the source's. The checksum (hex) for the summary."""
    from node.store import postgres_schema as pq

    h = hashlib.blake2b(digest_size=16)
    n = 0
    with conn.cursor(name="migrated") as cur:
        cur.itersize = 10 * CHUNK_ROWS
        cur.execute(pq.MIGRATED_ROWS, (before,))
        for row in cur:
            _digest(h, tuple(row))
            n += 1
    if n != count or h.digest() != expected:
        raise StoreError(
            f"the target reads back {n} rows where the source has {count}, or other "
            "values (checksum); nothing was committed"
        )
    return h.hexdigest()


def _received(source: Source, value: str, top: int) -> tuple[str, int | None]:
    """The saved received count with the target's change-log position: the
    copy's inserts are rows restored, not occurrences, and the source's own
    changes after the save are not in the target's log to be replayed (how
    many a producer made is said, as ``uncounted_changes``)."""
    try:
        saved = json.loads(value)
    except ValueError:
        return value, None
    if not isinstance(saved, dict):
        return value, None
    uncounted = None
    if isinstance(saved.get("seq"), int):
        uncounted = source.uncounted_after(saved["seq"])
    saved["seq"] = top
    return json.dumps(saved, separators=(",", ":")), uncounted


def main(args: Any) -> int:
    """The ``migrate`` command (node/cli.py parses its arguments)."""
    from node.core.proc import RET_ERROR, RET_OK

    the_plan = plan(
        args.source, args.target, name=args.name, data_dir=args.data_dir, merge=args.merge
    )
    if args.progress_s is not None:  # the tests' (hidden) option
        the_plan.progress_every_s = args.progress_s

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        summary = run(the_plan, say)
    except StoreError as exc:  # a refusal (ConfigError) is the command line's: exit 2
        if args.verbose:
            raise
        print(f"node migrate: {' '.join(str(exc).split())}", file=sys.stderr)
        return RET_ERROR
    print(json.dumps(summary.to_json(the_plan)), flush=True)
    return RET_OK
