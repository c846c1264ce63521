"""The keeper's load walk read in C (node/store/sqlite_walk.py, shm._claim.Walker)
answers exactly what the store's SQL answers, chunk by chunk, or hands the
chunk back to the SQL; and it holds no connection once a walk is done."""

from __future__ import annotations

import os
import random
import sqlite3

import pytest

from node.core.rows import RowWrite
from node.store import BadRow
from node.store import queries as q
from node.store.sqlite import SQLiteStore
from node.store.sqlite_walk import FastWalk

pytestmark = pytest.mark.timeout(60)

NOW = 1_700_000_000.0


def _sql_walk(path: str, after: str | None, limit: int) -> tuple[list, list, str | None]:
    """The store's own SQL, read as its Python path reads it: (rows, bad keys, last)."""
    conn = sqlite3.connect(path)
    try:
        if after is None:
            found = conn.execute(q.WALK_SCHEDULE_ALL, (limit,)).fetchall()
        else:
            found = conn.execute(q.WALK_SCHEDULE_AFTER, (after, limit)).fetchall()
    finally:
        conn.close()
    rows = [r[:6] for r in found if r[6]]
    bad = [r[0] for r in found if not r[6]]
    return rows, bad, (found[-1][0] if len(found) >= limit else None)


def _typed(rows: list[tuple]) -> list[tuple]:
    return [tuple((type(v).__name__, v) for v in row) for row in rows]


def _db_fds(path: str) -> int:
    real = os.path.realpath(path)
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == real:
                n += 1
        except OSError:
            pass
    return n


@pytest.fixture
def store(tmp_path):
    s = SQLiteStore(tmp_path / "schedule.db")
    yield s
    s.close()


def test_every_chunk_is_the_sqls_rows_with_their_types(store):
    rnd = random.Random(5)
    writes = []
    for i in range(3000):
        writes.append(
            RowWrite(
                f"k/{rnd.randrange(10**9):09d}/{'é' if i % 7 == 0 else 'e'}{i}",
                f"route-{rnd.randrange(90)}",  # more routes than the walker keeps
                cadence_s=rnd.choice([None, *range(60, 60 + 100 * 60, 60)]),
                sitemap=rnd.random() < 0.3,
                due_at=rnd.choice([NOW + rnd.uniform(-1e5, 1e5), float(rnd.randrange(10**9))]),
            )
        )
    store.upsert(writes, now=NOW)
    # Due times stored as SQLite integers, as another program may write them.
    conn = sqlite3.connect(store.path)
    conn.execute("UPDATE schedule SET due_at = CAST(due_at AS INTEGER) WHERE rowid % 5 = 0")
    conn.commit()
    conn.close()
    assert _sql_walk(store.path, None, 10)[0][0][5] is not None

    fast = FastWalk(store.path, 1000)
    for limit in (1, 7, 500, 5000):
        after = None
        chunks = 0
        while True:
            got = fast.walk(after, limit)
            assert got is not None, fast.off
            want_rows, want_bad, want_last = _sql_walk(store.path, after, limit)
            assert want_bad == []
            assert _typed(got[0]) == _typed(want_rows)
            assert got[1] == want_last
            # The store answers the same (through the walker: it is on).
            assert store.walk_schedule(after, limit) == (want_rows, [], want_last)
            chunks += 1
            after = got[1]
            if after is None:
                break
        assert chunks == 3000 // limit + 1
    assert fast.off is None and store._fast_walk.off is None
    fast.close()


@pytest.mark.parametrize(
    "stored",
    [
        "cadence_s = 0",
        "cadence_s = 31536001",
        "cadence_s = 'hourly'",
        "cadence_s = 3600.5",
        "route = ''",
        "route = CAST('r' AS BLOB)",
        "sitemap = 2",
        "due_at = -1",
        "due_at = 32503680001.0",
        "due_at = 'soon'",
        "due_at = X'00'",
        "key = CAST('k05' AS BLOB)",
    ],
)
def test_a_chunk_with_a_row_not_as_the_node_writes_it_is_read_by_the_sql(store, stored):
    store.upsert([RowWrite(f"k{i:02d}", "r", cadence_s=3600, due_at=NOW) for i in range(10)],
                 now=NOW)  # fmt: skip
    conn = sqlite3.connect(store.path)
    conn.execute(f"UPDATE schedule SET {stored} WHERE key = 'k05'")
    conn.commit()
    conn.close()
    fast = FastWalk(store.path, 1000)
    after, odd_chunks = None, 0
    while True:
        want_rows, want_bad, want_last = _sql_walk(store.path, after, 4)
        has_odd = any(r[0] in ("k05", b"k05") for r in want_rows) or any(
            key in ("k05", b"k05") for key in want_bad
        )  # (a blob key is a bad row now: no key of the node's)
        got = fast.walk(after, 4)
        if has_odd:  # the chunk is read by the SQL
            odd_chunks += 1
            assert got is None
        else:  # the others by the walker, as the SQL reads them
            assert got is not None and _typed(got[0]) == _typed(want_rows)
        # The store's answer is its SQL's: the odd row a bad row when unschedulable.
        rows, bad, last = store.walk_schedule(after, 4)
        assert (rows, [b.key for b in bad], last) == (want_rows, want_bad, want_last)
        assert all(isinstance(b, BadRow) for b in bad)
        if want_last is None:
            break
        after = want_last
    assert odd_chunks == 1
    fast.close()


def test_a_key_that_is_not_utf8_is_left_to_the_sql(store):
    store.upsert([RowWrite(f"k{i}", "r", due_at=NOW) for i in range(3)], now=NOW)
    conn = sqlite3.connect(store.path)
    conn.execute("UPDATE schedule SET key = CAST(X'6bff' AS TEXT) WHERE key = 'k1'")
    conn.commit()
    conn.close()
    fast = FastWalk(store.path, 1000)
    assert fast.walk(None, 10) is None
    fast.close()


def test_a_finished_walk_closes_its_connection(store):
    store.upsert([RowWrite(f"k{i:03d}", "r", due_at=NOW) for i in range(50)], now=NOW)
    before = _db_fds(store.path)
    fast = FastWalk(store.path, 1000)
    rows, last = fast.walk(None, 20)
    assert len(rows) == 20 and last == "k019"
    assert _db_fds(store.path) == before + 1  # the walker's own connection, mid-walk
    fast.walk(last, 20)
    rows, last = fast.walk("k039", 20)
    assert len(rows) == 10 and last is None
    assert fast._walker is None  # closed. (SQLite may keep the descriptor while the
    # store's connection holds a lock on the file, and reuses it: never more than one.)
    for _ in range(5):
        assert fast.walk(None, 30)[1] == "k029"
        assert fast.walk("k029", 30)[1] is None
        assert _db_fds(store.path) <= before + 1


def test_a_walk_sees_what_was_committed_between_its_chunks(store):
    store.upsert([RowWrite(f"k{i:03d}", "r", due_at=NOW) for i in range(0, 100, 2)], now=NOW)
    fast = FastWalk(store.path, 1000)
    rows, last = fast.walk(None, 10)
    store.upsert([RowWrite("k019", "late", due_at=NOW), RowWrite("k001", "r", due_at=NOW)],
                 now=NOW)  # fmt: skip
    rows, last = fast.walk(last, 10)
    assert rows[0][0] == "k019" and rows[0][2] == "late"  # after the cursor: read
    assert "k001" not in [r[0] for r in rows]  # before it: the feed's to bring
    fast.close()


def test_an_empty_or_over_long_key_is_a_bad_row_not_a_walked_one(store):
    """No blob in the chunk to send it to the SQL: the walker itself must
    leave a key that is no key of the node's (empty, over 1,024 bytes) to
    the SQL, which makes it a bad row. (The walker took both as rows; the
    keeper held them, and a claim of the long one failed after its grant.)"""
    store.upsert([RowWrite(f"k{i:02d}", "r", cadence_s=3600, due_at=NOW) for i in range(10)],
                 now=NOW)  # fmt: skip
    conn = sqlite3.connect(store.path)
    with conn:
        for key in ("", "x" * 1025, "y" * 1024):  # the last one is a key
            conn.execute("INSERT INTO schedule (key, route, due_at) VALUES (?, 'r', ?)", (key, NOW))
    conn.close()
    fast = FastWalk(store.path, 1000)
    assert fast.walk(None, 100) is None
    fast.close()
    rows, bad, last = store.walk_schedule(None, 100)
    assert sorted(b.key for b in bad) == ["", "x" * 1025] and last is None
    assert len(rows) == 11 and "y" * 1024 in {row[0] for row in rows}
