"""What only the PostgreSQL store can show: seqs that commit out of order,
outside programs' writes, NOTIFY, migrations raced by several processes, a
fork, and a password that is never shown. The shared suite is
test_store.py (its ``store`` fixture runs PostgreSQL too); the database is
this run's own (tests/pg.py)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import psycopg
import pytest

from node.core.errors import StoreError, StoreUnavailable, UnsupportedStore
from node.core.rows import ORIGIN_EXTERNAL, ORIGIN_NODE, RowWrite
from node.core.urls import redact_url
from node.store import BadRow, check_store_url, open_store
from node.store import postgres_schema as schema
from node.store.postgres import PostgresStore
from node.testing import wait_for
from tests import pg

NOW = 1_700_000_000.0


@pytest.fixture
def db(pg_url):
    pg.reset(pg_url)
    s = PostgresStore(pg_url)
    yield s
    s.close()


@pytest.fixture
def outside(pg_url):
    """Another program's connection: autocommit, no origin set."""
    conn = psycopg.connect(pg_url, autocommit=True)
    yield conn
    conn.close()


def _seqs(store, after=0):
    return [c.seq for c in store.changes(after, 100)]


def _naive(conn, after):
    """A reader that tails by ``seq > after`` alone."""
    return [s for (s,) in conn.execute("SELECT seq FROM changes WHERE seq > %s ORDER BY seq",
                                       (after,))]


def _eventually(read, want, timeout_s=30.0):
    """``read()`` until it gives ``want`` or the deadline passes. Generous:
    a hole settles when the server's oldest running writer ends, and xids
    are the whole server's (another database's writers count too)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = read()
        if got == want or time.monotonic() >= deadline:
            return got
        time.sleep(0.01)  # polling the store's answer to a deadline


# -- out-of-order commits ----------------------------------------------------------


def test_a_change_that_commits_late_is_not_stepped_past(db, pg_url, outside):
    db.upsert([RowWrite("first", "r")], now=NOW)
    assert _seqs(db) == [1]
    a = psycopg.connect(pg_url)  # A: takes seq 2 and stays open
    try:
        a.execute("INSERT INTO schedule (key, route, due_at) VALUES ('a', 'r', 1)")
        outside.execute("INSERT INTO schedule (key, route, due_at) VALUES ('b', 'r', 1)")
        # B's seq 3 is committed and visible; A's 2 is not.
        assert _naive(outside, 1) == [3]  # a tail by seq would move to 3 here
        for _ in range(3):
            assert _seqs(db, after=1) == []  # not B's without A's
        a.commit()
    finally:
        a.close()
    assert [(c.seq, c.key) for c in db.changes(1, 10)] == [(2, "a"), (3, "b")]
    assert _naive(outside, 3) == []  # ... and it would never have seen A's change


def test_a_rolled_back_seq_is_passed_once_settled(db, pg_url, outside):
    db.upsert([RowWrite("first", "r")], now=NOW)
    c = psycopg.connect(pg_url)
    try:
        c.execute("INSERT INTO schedule (key, route, due_at) VALUES ('c', 'r', 1)")  # seq 2
        outside.execute("INSERT INTO schedule (key, route, due_at) VALUES ('d', 'r', 1)")  # 3
        assert _seqs(db, after=1) == []
        c.rollback()
    finally:
        c.close()
    assert _eventually(lambda: _seqs(db, after=1), [3]) == [3]
    assert db.get("c") is None


def test_holes_pending_while_the_feed_waits_on_a_seq_that_may_roll_back(db, pg_url, outside):
    # What makes a keeper woken by NOTIFY poll (keeper/loop.py): a rollback
    # notifies nobody, and only a later read settles its hole.
    db.upsert([RowWrite("first", "r")], now=NOW)
    assert _seqs(db) == [1] and not db.holes_pending()
    c = psycopg.connect(pg_url)
    try:
        c.execute("INSERT INTO schedule (key, route, due_at) VALUES ('c', 'r', 1)")  # seq 2
        outside.execute("INSERT INTO schedule (key, route, due_at) VALUES ('d', 'r', 1)")  # 3
        assert _seqs(db, after=1) == [] and db.holes_pending()
        c.rollback()
    finally:
        c.close()
    assert db.holes_pending()  # nothing read since
    assert _eventually(lambda: _seqs(db, after=1), [3]) == [3]
    assert not db.holes_pending()
    assert _seqs(db, after=3) == [] and not db.holes_pending()


def test_last_seq_waits_for_the_writers_below_the_top(db, pg_url, outside):
    db.upsert([RowWrite("first", "r")], now=NOW)
    a = psycopg.connect(pg_url)
    got: list[int] = []
    try:
        a.execute("INSERT INTO schedule (key, route, due_at) VALUES ('a', 'r', 1)")  # seq 2
        outside.execute("INSERT INTO schedule (key, route, due_at) VALUES ('b', 'r', 1)")  # 3
        reader = threading.Thread(target=lambda: got.append(db.last_seq()), daemon=True)
        reader.start()
        reader.join(timeout=0.5)
        assert reader.is_alive() and got == []  # a walk started now could miss 'a'
        a.commit()
        reader.join(timeout=10)
    finally:
        a.close()
    assert got == [3]
    assert db.count() == 3


def test_a_reader_tailing_concurrent_writers_gets_every_change_once_in_order(db, pg_url):
    """Four writers commit (and some roll back) at once while the store's
    reader tails the log: it hands out every committed change exactly once,
    in seq order, and no seq that rolled back."""
    writers, txns = 4, 150
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            with psycopg.connect(pg_url) as conn:
                for t in range(txns):
                    for r in range(1 + t % 3):
                        conn.execute(
                            "INSERT INTO schedule (key, route, due_at) VALUES (%s, 'r', 1)"
                            " ON CONFLICT (key) DO UPDATE SET due_at = excluded.due_at + 1",
                            (f"w{n}-{(t * 7 + r) % 40}",),
                        )
                    if t % 10 == 3:
                        conn.rollback()
                    else:
                        conn.commit()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    for t in threads:
        t.start()
    got: list[int] = []
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        got += [c.seq for c in db.changes(got[-1] if got else 0, 50)]
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    after = got[-1] if got else 0
    while time.monotonic() < deadline:  # the rest, once every writer is done
        page = [c.seq for c in db.changes(after, 1000)]
        if not page and after == db.last_seq():
            break
        got += page
        after = got[-1] if got else 0
    with psycopg.connect(pg_url) as conn:
        committed = [s for (s,) in conn.execute("SELECT seq FROM changes ORDER BY seq")]
    assert got == committed  # each once, in order, none missed
    assert len(committed) == sum(1 + t % 3 for t in range(txns) if t % 10 != 3) * writers


# -- outside programs ---------------------------------------------------------------


def test_an_outside_programs_writes_are_logged_as_external(db, outside):
    db.upsert([RowWrite("node-row", "r")], now=NOW)
    outside.execute(
        "INSERT INTO schedule (key, route, cadence_s, due_at, payload) VALUES (%s, %s, %s, %s, %s)",
        ("ext", "pages", 3600, NOW, '{"a":1}'),
    )
    outside.execute("UPDATE schedule SET due_at = %s WHERE key = 'ext'", (NOW + 5,))
    outside.execute("DELETE FROM schedule WHERE key = 'node-row'")
    assert [(c.seq, c.op, c.key, c.origin) for c in db.changes(0, 10)] == [
        (1, "I", "node-row", ORIGIN_NODE),
        (2, "I", "ext", ORIGIN_EXTERNAL),
        (3, "U", "ext", ORIGIN_EXTERNAL),
        (4, "D", "node-row", ORIGIN_EXTERNAL),
    ]
    assert db.get("ext").payload == {"a": 1} and db.get("ext").version == 3
    # The node's origin was SET LOCAL: nothing of it outlives its transaction.
    assert outside.execute("SELECT current_setting('queue_node.origin', true)").fetchone()[0] in (
        None, "",
    )  # fmt: skip


def test_an_outside_program_cannot_set_a_version(db, outside):
    outside.execute("INSERT INTO schedule (key, route, due_at, version) VALUES ('k', 'r', 1, 999)")
    assert db.get("k").version == 1
    with pytest.raises(psycopg.errors.IntegrityConstraintViolation, match="version"):
        outside.execute("UPDATE schedule SET due_at = 2, version = 999 WHERE key = 'k'")
    assert (db.get("k").due_at, db.get("k").version) == (1.0, 1)


def test_a_key_renamed_outside_is_logged_as_delete_and_insert(db, outside):
    db.upsert([RowWrite("old", "r", cadence_s=600)], now=NOW)
    outside.execute("UPDATE schedule SET key = 'new' WHERE key = 'old'")
    assert [(c.seq, c.op, c.key) for c in db.changes(1, 10)] == [(2, "D", "old"), (3, "I", "new")]
    assert db.get("new").version == 3


def test_outcome_columns_alone_and_garbage_outside(db, outside):
    db.upsert([RowWrite("k", "r")], now=NOW)
    outside.execute("UPDATE schedule SET last_error = 'x', last_result_id = 3 WHERE key = 'k'")
    assert (db.get("k").version, db.last_seq()) == (1, 1)
    outside.execute(
        "INSERT INTO schedule (key, route, cadence_s, due_at) VALUES ('bad', 'r', 5, 1)"
    )
    assert isinstance(db.get("bad"), BadRow)
    assert [c.valid for c in db.changes(1, 10)] == [False]
    assert db.jobs_of(["k", "bad"]) == {"k": ("default", None, "r")}


# -- NOTIFY --------------------------------------------------------------------------


def test_wait_for_changes_wakes_on_a_commit(db, outside):
    assert db.wait_for_changes(0.05) is False  # nothing written: the timeout
    outside.execute("INSERT INTO schedule (key, route, due_at) VALUES ('k', 'r', 1)")
    assert db.wait_for_changes(10.0) is True
    db.upsert([RowWrite("j", "r")], now=NOW)  # the node's own writes notify too
    assert db.wait_for_changes(10.0) is True
    quiet = [db.wait_for_changes(0.05) for _ in range(3)]
    assert quiet[-1] is False  # with nothing written, it times out again


# -- migrations, lifecycle ---------------------------------------------------------


def test_processes_starting_at_once_on_an_empty_database_migrate_it_once():
    url = pg.create_database()
    try:
        script = (
            "import sys\n"
            "from node.core.rows import RowWrite\n"
            "from node.store.postgres import PostgresStore\n"
            "from node.fleet import Membership\n"
            "if sys.argv[2] in ('k1', 'k3'):  # a fleet node's membership migrates too\n"
            "    with Membership(sys.argv[1], sys.argv[2], 'h:1') as m:\n"
            "        m.join()\n"
            "with PostgresStore(sys.argv[1]) as s:\n"
            "    s.upsert([RowWrite(sys.argv[2], 'r')], now=1.0)\n"
        )
        procs = [
            subprocess.Popen([sys.executable, "-c", script, url, f"k{i}"]) for i in range(4)
        ]
        assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
        with PostgresStore(url) as s:
            assert s.count() == 4
            assert sorted(_seqs(s)) == [1, 2, 3, 4]
            assert s.schema_version() == schema.SCHEMA_VERSION
        with psycopg.connect(url) as conn:
            applied = conn.execute("SELECT version FROM schema_migrations").fetchall()
            joined = conn.execute("SELECT name FROM fleet_nodes ORDER BY name").fetchall()
        assert applied == [(v,) for v, _, _ in schema.MIGRATIONS]
        assert joined == [("k1",), ("k3",)]
    finally:
        pg.drop_database(url)


def test_a_database_from_a_newer_build_is_refused(db, pg_url, outside):
    outside.execute(
        "INSERT INTO schema_migrations VALUES (%s, 'future', 0)", (schema.SCHEMA_VERSION + 1,)
    )
    try:
        with pytest.raises(StoreError, match="newer"):
            PostgresStore(pg_url)
    finally:
        outside.execute("DELETE FROM schema_migrations WHERE version > %s",
                        (schema.SCHEMA_VERSION,))


def test_meta_is_the_nodes_own(db, pg_url):
    db.set_meta("paused", ["pages"])
    with PostgresStore(pg_url, node_name="other") as other:
        assert other.get_meta("paused") is None
        other.set_meta("paused", ["docs"])
    assert db.get_meta("paused") == ["pages"]


def test_a_trim_is_bounded_and_one_node_trims_at_a_time(db, pg_url, outside, monkeypatch):
    """A trim runs in a keeper's loop between its heartbeats: it deletes at
    most TRIM_CHUNK rows, the oldest first, and skips while another node
    holds the trim lock (it would wait on that node's row locks)."""
    monkeypatch.setattr(schema, "TRIM_CHUNK", 3)
    db.upsert([RowWrite(f"k{i}", "r") for i in range(10)], now=NOW)  # seqs 1..10
    assert db.trim_changes(8) == 3
    assert db.first_seq_after(0) == 4 and not db.skip_is_loss(3, 4)
    with psycopg.connect(pg_url) as other:  # another node trimming
        other.execute("SELECT pg_advisory_xact_lock(%s)", (schema.TRIM_LOCK,))
        assert db.trim_changes(8) == 0
    assert db.trim_changes(8) == 3 and db.trim_changes(8) == 2 and db.trim_changes(8) == 0
    assert db.first_seq_after(0) == 9


def test_a_paused_route_is_the_fleets_and_every_nodes_pause_is_seen(db, pg_url):
    db.set_meta("paused_routes", ["docs"])
    db.set_meta("paused_node", True)
    with PostgresStore(pg_url, node_name="other") as other:
        assert other.get_meta("paused_routes") == ["docs"]  # one entry, the fleet's
        assert other.get_meta("paused_node") is None  # a node's own
        other.set_meta("paused_node", False)
        assert other.meta_of_every_node("paused_node") == {db.node_name: True, "other": False}
    assert db.meta_of_every_node("paused_routes") == {}  # no node holds the fleet's


@pytest.mark.parametrize(("durable", "setting"), [(True, "on"), (False, "off")])
def test_a_store_opened_not_durable_commits_without_waiting_for_the_flush(
    pg_url, durable, setting
):
    """The ledger opens its store not durable (as SQLite's NORMAL) and
    calls ``sync`` before it writes acks."""
    pg.reset(pg_url)
    with PostgresStore(pg_url, durable=durable, pool_max=1) as s:
        with s._conn("test") as conn:
            conn.execute("SET synchronous_commit = on")  # this session's own default
        with s._write("test", ORIGIN_NODE) as conn:
            assert conn.execute("SHOW synchronous_commit").fetchone()[0] == setting
        s.upsert([RowWrite("k", "r")], now=NOW)
        s.sync()
        assert s.get("k").version == 1


def test_a_forked_child_that_drops_the_store_leaves_the_parents_sessions(pg_url):
    """A child that closes an inherited store and lets go of it must not end
    the parent's sessions: libpq's goodbye on a socket the two share would
    close the parent's."""
    pg.reset(pg_url)
    store = PostgresStore(pg_url)
    store.upsert([RowWrite("before", "r")], now=NOW)
    pid = os.fork()
    if pid == 0:  # the child: close it, drop every reference, collect, leave
        code = 1
        try:
            store.close()
            del store
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    try:
        store.upsert([RowWrite("after", "r")], now=NOW)  # the same pooled session
        assert store.get("after").version == 2
    finally:
        store.close()


# -- the password ---------------------------------------------------------------------


def test_a_read_on_a_connection_the_server_closed_runs_again_on_another(db, outside):
    """The pool hands out its idle connection unchecked: once the server has
    closed it (here ``pg_terminate_backend``; a restart or a healed network
    cut does the same), a read runs once more on a new connection instead of
    failing its caller (the ledger's intake answered 503 once after a cut).
    A second failure is the caller's: the read is not retried twice."""
    db.upsert([RowWrite("k1", "r", due_at=NOW)], now=NOW)

    def terminate_the_pools_sessions() -> int:
        return outside.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()[0]

    ended: list[int] = []
    for read in (
        lambda: db.jobs_of(["k1"]),
        lambda: db.get("k1"),
        lambda: db.get_many(["k1"]),
        lambda: db.claim_rows(["k1"]),
    ):
        # The pool replaces a connection it dropped in the background: wait
        # for its session to be there, then end it under the pool.
        wait_for(lambda: ended.append(terminate_the_pools_sessions()) or ended[-1] >= 1, 10,
                 "a session of the pool to end")  # fmt: skip
        assert read(), "the read came back empty"
    assert db.jobs_of(["k1"]) == {"k1": ("default", None, "r")}


def test_a_password_is_never_shown():
    url = "postgresql://someone:s3cret-pw@127.0.0.1:1/nowhere"
    assert check_store_url(url) == url
    assert redact_url(url) == "postgresql://someone:***@127.0.0.1:1/nowhere"
    with pytest.raises(StoreUnavailable) as exc:
        open_store(url)
    assert "s3cret-pw" not in str(exc.value) and "***" in str(exc.value)
    with pytest.raises(UnsupportedStore) as bad:
        check_store_url("mysql://someone:s3cret-pw@host/db")
    assert "s3cret-pw" not in str(bad.value)


def test_the_store_shows_its_url_without_the_password(pg_url):
    with_password = pg_url.replace("postgres@", "postgres:unused-pw@", 1)
    with open_store(with_password) as s:  # trust authentication ignores it
        assert s.url == pg_url.replace("postgres@", "postgres:***@", 1)
