"""One suite for every store backend, then what only the SQLite file can show.

The shared tests run against the in-memory twin, the SQLite file and the
PostgreSQL database alike (the ``store`` fixture; the database is this run's
own, tests/pg.py); a property test drives all three with the same random
operations and requires the same answers, versions and change log.
What only PostgreSQL can show is in test_store_pg.py.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import stat
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.core.errors import StoreError, StoreUnavailable
from node.core.rows import (
    ORIGIN_EXTERNAL,
    ORIGIN_NODE,
    ORIGIN_WRITEBACK,
    ORIGINS,
    Change,
    Row,
    RowWrite,
)
from node.store import BadRow, LastError, WriteBack, open_store
from node.store import sqlite as sqlite_store
from node.store.memory import MemoryStore
from node.store.postgres import PostgresStore
from node.store.sqlite import SCHEMA_VERSION, SQLiteStore
from tests import pg

NOW = 1_700_000_000.0


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "sqlite":
        s = SQLiteStore(tmp_path / "schedule.db")
    else:
        url = request.getfixturevalue("pg_url")
        pg.reset(url)
        s = PostgresStore(url)
    yield s
    s.close()


def ops(store, after=0):
    """The change log without wall times, as (seq, op, key, origin)."""
    return [(c.seq, c.op, c.key, c.origin) for c in store.changes(after, 10_000)]


# -- upsert ------------------------------------------------------------------------


def test_insert_takes_defaults_for_missing_fields(store):
    assert store.upsert([RowWrite("k", "pages")], now=NOW) == 1
    row = store.get("k")
    assert row == Row("k", "pages", None, False, NOW, None, "default", row.version)
    assert row.version == store.last_seq() == 1


def test_insert_keeps_every_field_it_carries(store):
    w = RowWrite(
        "k", "pages", cadence_s=3600, sitemap=True, due_at=5.5, payload={"a": [1]}, job="j"
    )
    store.upsert([w], now=NOW)
    assert store.get("k") == Row("k", "pages", 3600, True, 5.5, {"a": [1]}, "j", 1)


def test_update_changes_only_the_fields_it_carries(store):
    store.upsert(
        [RowWrite("k", "pages", cadence_s=3600, sitemap=True, due_at=5.0, payload=[1], job="j")],
        now=NOW,
    )
    store.upsert([RowWrite("k", "other", due_at=7.0)], now=NOW + 100)
    assert store.get("k") == Row("k", "other", 3600, True, 7.0, [1], "j", 2)
    store.upsert([RowWrite("k", "other", cadence_s=None, payload=None)], now=NOW)
    assert store.get("k") == Row("k", "other", None, True, 7.0, None, "j", 3)


def test_later_write_of_a_key_in_one_batch_wins(store):
    batch = [
        RowWrite("k", "r1", due_at=1.0),
        RowWrite("k", "r2", job="j"),  # another shape between two of the first
        RowWrite("k", "r3", due_at=3.0),
        RowWrite("x", "r1"),
    ]
    assert store.upsert(batch, now=NOW) == 4
    assert store.get("k") == Row("k", "r3", None, False, 3.0, None, "j", 3)
    assert [op for _, op, _, _ in ops(store)] == ["I", "U", "U", "I"]


def test_empty_batches_write_nothing(store):
    assert store.upsert([], now=NOW) == 0
    assert store.delete([]) == 0
    assert store.last_seq() == 0


def test_payload_is_stored_as_json_and_read_back_as_a_copy(store):
    payload = {"nested": {"list": [1, 2.5, "é", None, True]}, "n": -3}
    store.upsert([RowWrite("k", "pages", payload=payload)], now=NOW)
    first = store.get("k").payload
    assert first == payload
    first["nested"]["list"].append("mutated")
    assert store.get("k").payload == payload


def test_a_no_op_update_is_still_logged_with_a_new_version(store):
    store.upsert([RowWrite("k", "pages")], now=NOW)
    store.upsert([RowWrite("k", "pages")], now=NOW)
    assert store.get("k").version == 2
    assert [op for _, op, _, _ in ops(store)] == ["I", "U"]


def test_a_refused_batch_writes_nothing(store):
    store.upsert([RowWrite("a", "pages")], now=NOW)
    with pytest.raises(StoreError):
        store.upsert([RowWrite("b", "pages"), RowWrite("a", "pages", due_at=None)], now=NOW)
    assert store.count() == 1
    assert store.last_seq() == 1
    assert store.get("b") is None


def test_an_unknown_origin_is_refused(store):
    with pytest.raises(ValueError):
        store.upsert([RowWrite("k", "pages")], now=NOW, origin="nobody")
    with pytest.raises(ValueError):
        store.delete(["k"], origin="nobody")


# -- delete ------------------------------------------------------------------------


def test_delete_counts_only_rows_that_existed(store):
    store.upsert([RowWrite("a", "r"), RowWrite("b", "r")], now=NOW)
    assert store.delete(["a", "missing", "a"], origin=ORIGIN_EXTERNAL) == 1
    assert store.get("a") is None
    assert store.count() == 1
    (change,) = store.changes(2, 10)
    assert change == Change(3, "D", "a", ORIGIN_EXTERNAL, None, None, False, None, change.at)


# -- change log --------------------------------------------------------------------


def test_every_write_is_logged_with_its_origin_and_fields(store):
    store.upsert([RowWrite("k", "pages", cadence_s=600, sitemap=True, due_at=9.0)], now=NOW)
    store.upsert([RowWrite("k", "pages", due_at=10.0)], now=NOW, origin=ORIGIN_EXTERNAL)
    store.write_next_due("k", 11.0, if_version=2)
    store.delete(["k"])
    before = time.time()
    log = store.changes(0, 100)
    assert [(c.seq, c.op, c.origin) for c in log] == [
        (1, "I", ORIGIN_NODE),
        (2, "U", ORIGIN_EXTERNAL),
        (3, "U", ORIGIN_WRITEBACK),
        (4, "D", ORIGIN_NODE),
    ]
    assert (log[1].route, log[1].cadence_s, log[1].sitemap, log[1].due_at) == (
        "pages",
        600,
        True,
        10.0,
    )
    assert all(c.valid for c in log)
    assert all(abs(c.at - before) < 60 for c in log)


def test_a_rows_version_is_the_seq_of_its_last_change(store):
    store.upsert([RowWrite(k, "r") for k in "abc"], now=NOW)
    store.upsert([RowWrite("b", "r", due_at=1.0)], now=NOW)
    log = store.changes(0, 100)
    last = {c.key: c.seq for c in log}
    assert {k: store.get(k).version for k in "abc"} == last == {"a": 1, "b": 4, "c": 3}


def test_changes_pages_by_seq(store):
    store.upsert([RowWrite(f"k{i}", "r") for i in range(10)], now=NOW)
    assert [c.seq for c in store.changes(0, 4)] == [1, 2, 3, 4]
    assert [c.seq for c in store.changes(4, 4)] == [5, 6, 7, 8]
    assert [c.seq for c in store.changes(8, 4)] == [9, 10]
    assert store.changes(10, 4) == []
    assert store.changes(0, 0) == []


def test_trim_drops_consumed_entries_and_last_seq_stays(store):
    assert store.last_seq() == 0
    store.upsert([RowWrite(f"k{i}", "r") for i in range(5)], now=NOW)
    assert store.trim_changes(3) == 3
    assert [c.seq for c in store.changes(0, 10)] == [4, 5]
    assert store.trim_changes(5) == 2
    assert store.changes(0, 10) == []
    assert store.last_seq() == 5
    store.upsert([RowWrite("k0", "r")], now=NOW)
    assert [c.seq for c in store.changes(0, 10)] == [6]


def test_an_unschedulable_write_is_logged_as_not_valid(store):
    # RowWrite built directly skips parse_row's checks, as another program would.
    store.upsert([RowWrite("k", "pages", cadence_s=0)], now=NOW)
    (change,) = store.changes(0, 10)
    assert change == Change(1, "I", "k", ORIGIN_NODE, None, None, False, None, change.at, False)


# -- write-back --------------------------------------------------------------------


def test_write_next_due_writes_when_the_version_matches(store):
    store.upsert([RowWrite("k", "r", cadence_s=600, due_at=1.0)], now=NOW)
    assert store.write_next_due("k", 601.0, if_version=1) == 2
    row = store.get("k")
    assert (row.due_at, row.version, row.cadence_s) == (601.0, 2, 600)


def test_write_next_due_loses_to_a_newer_write(store):
    store.upsert([RowWrite("k", "r", due_at=1.0)], now=NOW)
    store.upsert([RowWrite("k", "r", due_at=50.0)], now=NOW)
    assert store.write_next_due("k", 601.0, if_version=1) is None
    assert store.get("k").due_at == 50.0
    assert store.last_seq() == 2


def test_write_next_due_on_a_deleted_row_does_nothing(store):
    store.upsert([RowWrite("k", "r")], now=NOW)
    store.delete(["k"])
    assert store.write_next_due("k", 601.0, if_version=1) is None
    assert store.get("k") is None
    assert store.last_seq() == 2


def test_write_back_many_writes_each_item_under_its_version_in_one_go(store):
    store.upsert([RowWrite(k, "r", cadence_s=600, due_at=1.0) for k in "abcd"], now=NOW)
    store.upsert([RowWrite("b", "r", due_at=50.0)], now=NOW)  # b moved on: version 5
    store.delete(["c"])  # c is gone
    got = store.write_back_many(
        [
            WriteBack("a", 601.0, 1, 11, NOW),
            WriteBack("b", 602.0, 2, 12, NOW),
            WriteBack("c", 603.0, 3, 13, NOW),
            WriteBack("d", 604.0, 4, 14, NOW + 1),
        ]
    )
    assert got == [7, None, None, 8]
    a, b, d = store.get("a"), store.get("b"), store.get("d")
    assert (a.due_at, a.version, a.last_result_id, a.last_finished_at) == (601.0, 7, 11, NOW)
    assert (b.due_at, b.version, b.last_result_id) == (50.0, 5, None)  # the newer write won
    assert (d.due_at, d.version, d.last_result_id, d.last_finished_at) == (604.0, 8, 14, NOW + 1)
    # Logged as write-backs, one change each, as write_next_due's are.
    assert ops(store, after=6) == [(7, "U", "a", ORIGIN_WRITEBACK), (8, "U", "d", ORIGIN_WRITEBACK)]
    assert store.write_back_many([]) == []


def test_write_back_many_with_a_key_twice_takes_the_first_and_refuses_the_stale(store):
    store.upsert([RowWrite("k", "r", due_at=1.0)], now=NOW)
    assert store.write_back_many(
        [WriteBack("k", 601.0, 1, 1, NOW), WriteBack("k", 602.0, 1, 2, NOW)]
    ) == [2, None]
    assert store.write_back_many(
        [WriteBack("k", 603.0, 1, 3, NOW), WriteBack("k", 604.0, 2, 4, NOW)]
    ) == [None, 3]
    row = store.get("k")
    assert (row.due_at, row.version, row.last_result_id) == (604.0, 3, 4)


def test_the_outcome_columns_are_no_change_and_a_write_keeps_them(store):
    store.upsert([RowWrite("k", "r", due_at=1.0), RowWrite("other", "r")], now=NOW)
    assert store.write_last_errors([LastError("k", "released: oom", NOW)]) == 1
    row = store.get("k")
    assert (row.version, row.last_error, row.last_result_id) == (1, "released: oom", None)
    assert store.last_seq() == 2  # not logged, no new version
    assert store.write_back_many([WriteBack("k", 601.0, 1, 9, NOW + 5)]) == [3]
    assert (store.get("k").last_error, store.get("k").last_result_id) == (None, 9)
    # An older miss than the last result keeps the result's outcome; a newer one is written.
    assert store.write_last_errors([LastError("k", "expired", NOW + 4)]) == 0
    assert store.get("k").last_error is None
    assert store.write_last_errors([LastError("k", "expired", NOW + 6)]) == 1
    assert store.write_last_errors([LastError("gone", "expired", NOW)]) == 0
    # A producer's update keeps the outcome; the outcome is in the row's document.
    store.upsert([RowWrite("k", "r", due_at=2.0)], now=NOW)
    row = store.get("k")
    assert (row.last_result_id, row.last_finished_at, row.last_error) == (9, NOW + 5, "expired")
    doc = row.to_json()
    assert (doc["last_result_id"], doc["last_finished_at"], doc["last_error"]) == (
        9, NOW + 5, "expired",
    )  # fmt: skip
    assert store.get("other").to_json()["last_result_id"] is None
    assert store.last_seq() == 4


# -- run again now -----------------------------------------------------------------


def test_due_now_makes_every_row_of_a_route_due_and_keeps_earlier_due_times(store):
    store.upsert(
        [
            RowWrite("later", "pages", due_at=NOW + 3600),
            RowWrite("late", "pages", due_at=NOW - 600),
            RowWrite("other", "docs", due_at=NOW + 3600),
        ],
        now=NOW,
    )
    granted_on = store.get("late").version
    seq = store.last_seq()
    assert store.due_now(route="pages", now=NOW) == 2
    assert store.get("later").due_at == NOW
    assert store.get("late").due_at == NOW - 600  # already due: its lateness kept
    assert store.get("other").due_at == NOW + 3600
    # Every row written and logged as the node's write, so a write-back of a
    # lease granted before loses and the row runs again.
    assert sorted((c.op, c.key, c.origin, c.due_at) for c in store.changes(seq, 100)) == [
        ("U", "late", ORIGIN_NODE, NOW - 600),
        ("U", "later", ORIGIN_NODE, NOW),
    ]
    assert store.write_next_due("late", NOW + 86400, if_version=granted_on) is None
    assert store.due_now(route="nothing", now=NOW) == 0


def test_due_now_by_job(store):
    store.upsert(
        [RowWrite("a", "pages", due_at=NOW + 60, job="j1"),
         RowWrite("b", "docs", due_at=NOW + 60, job="j1"),
         RowWrite("c", "pages", due_at=NOW + 60, job="j2")],
        now=NOW,
    )  # fmt: skip
    assert store.due_now(job="j1", now=NOW) == 2
    assert [store.get(k).due_at for k in "abc"] == [NOW, NOW, NOW + 60]


def test_due_now_takes_a_route_or_a_job(store):
    with pytest.raises(ValueError):
        store.due_now(now=NOW)
    with pytest.raises(ValueError):
        store.due_now(route="pages", job="j", now=NOW)
    with pytest.raises(ValueError):
        store.due_now(route="pages", now=NOW, origin="nobody")


# -- reads -------------------------------------------------------------------------


def test_walk_goes_in_key_order_from_after(store):
    keys = ["b", "a", "é", "c/1", "c", "Z", "a0"]
    store.upsert([RowWrite(k, "r") for k in keys], now=NOW)
    ordered = sorted(keys, key=lambda k: k.encode())
    assert [r.key for r in store.walk(None, 100)] == ordered
    assert [r.key for r in store.walk("a", 3)] == ordered[2:5]
    walked, after = [], None
    while page := store.walk(after, 2):
        walked += [r.key for r in page]
        after = page[-1].key
    assert walked == ordered
    assert store.walk(None, 0) == []


def test_unschedulable_rows_come_back_as_bad_rows(store):
    store.upsert(
        [
            RowWrite("bad", "r", cadence_s=0),
            RowWrite("ok", "r"),
            RowWrite("inf", "r", due_at=1e300),
        ],
        now=NOW,
    )
    walked = store.walk(None, 10)
    assert [type(r) for r in walked] == [BadRow, BadRow, Row]
    assert [(r.key, r.version) for r in walked[:2]] == [("bad", 1), ("inf", 3)]
    assert "cadence_s=0" in walked[0].reason
    assert isinstance(store.get("bad"), BadRow)
    assert isinstance(store.get_many(["inf"])["inf"], BadRow)


def test_classes_in_use_come_oldest_first_past_the_limit_and_all_within_it(store):
    store.upsert(
        [
            RowWrite("k1", "late"),
            RowWrite("k2", "first", cadence_s=60),
            RowWrite("k3", "mid", sitemap=True),
            RowWrite("k4", "first", cadence_s=60),
            RowWrite("bad", "never", cadence_s=0),
        ],
        now=NOW,
    )
    store.upsert([RowWrite("k1", "late")], now=NOW)  # its class's oldest row is now the newest
    oldest_first = [("first", 60, False), ("mid", None, True), ("late", None, False)]
    assert store.classes_in_use() == oldest_first
    assert store.classes_in_use(2) == oldest_first  # past the limit: the order decides
    assert sorted(store.classes_in_use(3)) == sorted(oldest_first)
    store.delete(["k2", "k4"])
    assert store.classes_in_use() == oldest_first[1:]


def test_get_many_answers_present_keys_across_chunks(store):
    keys = [f"k{i:05d}" for i in range(1_200)]
    store.upsert([RowWrite(k, "r", due_at=float(i)) for i, k in enumerate(keys)], now=NOW)
    asked = keys[::-1] + ["missing", keys[0]]
    found = store.get_many(asked)
    assert set(found) == set(keys)
    assert all(found[k].due_at == float(i) for i, k in enumerate(keys))
    assert store.get_many([]) == {}
    assert store.get("missing") is None


def test_count(store):
    assert store.count() == 0
    store.upsert([RowWrite(k, "r") for k in "abcd"], now=NOW)
    store.delete(["a"])
    assert store.count() == 3


# -- meta and lifecycle ------------------------------------------------------------


def test_meta_round_trips_json_and_is_not_logged(store):
    assert store.get_meta("paused", default=[]) == []
    store.set_meta("paused", ["pages"])
    store.set_meta("counters", {"routed": 5, "ratio": 0.5})
    store.set_meta("paused", ["pages", "docs"])
    assert store.get_meta("paused") == ["pages", "docs"]
    assert store.get_meta("counters") == {"routed": 5, "ratio": 0.5}
    assert store.get_meta("nothing") is None
    assert store.last_seq() == 0


def test_close_is_idempotent_and_later_use_fails(store):
    store.close()
    store.close()
    with pytest.raises(StoreError):
        store.get("k")


# -- the three backends agree ------------------------------------------------------

_KEYS = st.sampled_from(["a", "b", "c", "dé", "e/1"])
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-1e6, 1e6) | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "cadence_s": st.sampled_from([None, 60, 3600, 0]),
        "sitemap": st.booleans(),
        "due_at": st.sampled_from([0.0, NOW, NOW + 0.25, float("inf")]),
        "payload": _JSON,
        "job": st.sampled_from(["default", "j1"]),
    },
)
_WRITE = st.builds(
    lambda key, route, fields: RowWrite(key, route, **fields),
    _KEYS,
    st.sampled_from(["r1", "r2"]),
    _FIELDS,
)
_OP = st.one_of(
    st.tuples(st.just("upsert"), st.lists(_WRITE, max_size=4), st.sampled_from(ORIGINS)),
    st.tuples(st.just("delete"), st.lists(_KEYS, max_size=3), st.sampled_from(ORIGINS)),
    st.tuples(st.just("writeback"), _KEYS, st.booleans()),
    st.tuples(st.just("writebacks"), st.lists(st.tuples(_KEYS, st.booleans()), max_size=4)),
    st.tuples(st.just("errors"), st.lists(_KEYS, max_size=3), st.sampled_from([NOW, NOW + 100])),
    st.tuples(st.just("trim"), st.integers(0, 30)),
)


def _view(row):
    if isinstance(row, BadRow):
        return ("bad", row.key, row.version, row.reason)
    return row


def _state(s):
    changes = [dataclasses.replace(c, at=0.0) for c in s.changes(0, 10_000)]
    return [_view(r) for r in s.walk(None, 100)], changes, s.last_seq(), s.count()


def _apply(s, op):
    kind = op[0]
    if kind == "upsert":
        return s.upsert(op[1], now=NOW, origin=op[2])
    if kind == "delete":
        return s.delete(op[1], origin=op[2])
    if kind == "writeback":
        row = s.get(op[1])
        version = 0 if row is None else row.version - (0 if op[2] else 1)
        return s.write_next_due(op[1], NOW + 60.0, if_version=version)
    if kind == "writebacks":
        items = []
        for n, (key, current) in enumerate(op[1]):
            row = s.get(key)
            version = 0 if row is None else row.version - (0 if current else 1)
            items.append(WriteBack(key, NOW + 60.0 + n, version, n + 1, NOW + n))
        return s.write_back_many(items)
    if kind == "errors":
        return s.write_last_errors([LastError(k, f"e{n}", op[2]) for n, k in enumerate(op[1])])
    return s.trim_changes(op[1])


@settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.lists(_OP, max_size=12))
def test_memory_sqlite_and_postgresql_agree_on_random_operations(
    tmp_path_factory, pg_url, operations
):
    memory = MemoryStore()
    pg.reset(pg_url)
    with (
        SQLiteStore(tmp_path_factory.mktemp("agree") / "s.db") as sql,
        PostgresStore(pg_url) as postgres,
    ):
        for op in operations:
            done = _apply(memory, op)
            assert done == _apply(sql, op) == _apply(postgres, op), op
            state = _state(memory)
            assert state == _state(sql) == _state(postgres), op
        keys = ["a", "b", "c", "dé", "e/1"]
        expected = {k: _view(r) for k, r in memory.get_many(keys).items()}
        for other in (sql, postgres):
            assert {k: _view(r) for k, r in other.get_many(keys).items()} == expected


# -- SQLite only: the file as a contract -------------------------------------------


@pytest.fixture
def db(tmp_path):
    s = SQLiteStore(tmp_path / "schedule.db")
    yield s
    s.close()


@pytest.fixture
def outside(db):
    """Another program's plain connection to the same file."""
    conn = sqlite3.connect(db.path, isolation_level=None)
    yield conn
    conn.close()


def test_an_outside_program_writes_are_logged_as_external_with_versions(db, outside):
    db.upsert([RowWrite("node-row", "r")], now=NOW)
    outside.execute(
        "INSERT INTO schedule (key, route, cadence_s, due_at, payload) VALUES (?, ?, ?, ?, ?)",
        ("ext", "pages", 3600, NOW, '{"a":1}'),
    )
    outside.execute("UPDATE schedule SET due_at = ? WHERE key = ?", (NOW + 5, "ext"))
    outside.execute("DELETE FROM schedule WHERE key = 'node-row'")
    assert ops(db) == [
        (1, "I", "node-row", ORIGIN_NODE),
        (2, "I", "ext", ORIGIN_EXTERNAL),
        (3, "U", "ext", ORIGIN_EXTERNAL),
        (4, "D", "node-row", ORIGIN_EXTERNAL),
    ]
    assert db.get("ext") == Row("ext", "pages", 3600, False, NOW + 5, {"a": 1}, "default", 3)
    assert outside.execute("SELECT origin FROM write_origin").fetchall() == [("external",)]


def test_an_outside_program_cannot_set_a_version(db, outside):
    outside.execute("INSERT INTO schedule (key, route, due_at, version) VALUES ('k', 'r', 1, 999)")
    assert db.get("k").version == 1
    with pytest.raises(sqlite3.IntegrityError, match="version"):
        outside.execute("UPDATE schedule SET due_at = 2, version = 999 WHERE key = 'k'")
    assert (db.get("k").due_at, db.get("k").version) == (1.0, 1)


def test_a_key_renamed_outside_is_logged_as_delete_and_insert(db, outside):
    db.upsert([RowWrite("old", "r", cadence_s=600)], now=NOW)
    outside.execute("UPDATE schedule SET key = 'new' WHERE key = 'old'")
    assert ops(db, after=1) == [(2, "D", "old", ORIGIN_EXTERNAL), (3, "I", "new", ORIGIN_EXTERNAL)]
    assert db.get("new").version == 3
    assert db.changes(2, 1)[0].cadence_s == 600


def test_garbage_written_outside_is_reported_not_raised(db, outside):
    outside.executemany(
        "INSERT INTO schedule (key, route, cadence_s, sitemap, due_at, payload)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        [
            ("cadence", "r", 0, 0, NOW, None),
            ("due", "r", None, 0, "soon", None),
            ("sitemap", "r", None, 7, NOW, None),
            ("route", "", None, 0, NOW, None),
            ("text-payload", "r", None, 0, NOW, "not json {"),
        ],
    )
    walked = {r.key: r for r in db.walk(None, 10)}
    assert {k for k, r in walked.items() if isinstance(r, BadRow)} == {
        "cadence",
        "due",
        "sitemap",
        "route",
    }
    assert walked["text-payload"].payload == "not json {"
    assert isinstance(db.get("due"), BadRow)
    assert [c.valid for c in db.changes(0, 10)] == [False, False, False, False, True]


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_keys_the_node_cannot_hold_written_outside_are_bad_rows_and_invalid_changes(
    kind, tmp_path, request
):
    """Another program's keys that are no key of the node's: bad rows on the
    walk, invalid changes in the feed, nothing in a restart's replay. (A blob
    key made the keeper's load compare str with bytes and exit, for good:
    tests/acceptance/test_unsendable_payloads.py.)"""
    bad: list = ["", "k" * 1025, "é" * 513]  # empty, 1,025 and 1,026 bytes
    if kind == "sqlite":
        store = SQLiteStore(tmp_path / "schedule.db")
        bad.append(b"\xff\xfe")  # SQLite keeps a blob in a TEXT column

        def write(sql: str, rows: list) -> None:
            conn = sqlite3.connect(store.path, isolation_level=None)
            conn.executemany(sql.replace("%s", "?"), rows)
            conn.close()
    else:
        import psycopg

        url = request.getfixturevalue("pg_url")
        pg.reset(url)
        store = PostgresStore(url)

        def write(sql: str, rows: list) -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.cursor().executemany(sql, rows)
    try:
        store.upsert([RowWrite("good", "r", due_at=NOW)], now=NOW)
        write("INSERT INTO schedule (key, route, due_at) VALUES (%s, 'r', %s)",
              [(key, NOW) for key in bad])  # fmt: skip
        rows, bad_rows, last = store.walk_schedule(None, 100)
        assert [row[0] for row in rows] == ["good"] and last is None
        assert sorted(map(repr, (b.key for b in bad_rows))) == sorted(map(repr, bad))
        assert all(b.reason.startswith("the key is not text") for b in bad_rows)
        assert [c.key for c in store.changes(0, 100) if c.valid] == ["good"]
        assert [c.key for c in store.due_history(0, store.last_seq(), 100)] == ["good"]
    finally:
        store.close()


def test_text_that_is_not_utf8_written_outside_is_read_as_bytes_and_walked_past(db, outside):
    """SQLite keeps any bytes as TEXT; Python's read of one that is not
    UTF-8 raises. The walk (in chunks of every size, one ending on such a
    key), the feed, the replay and point reads go on past it: its key or
    route makes a bad row and an invalid change, its job and payload come
    back as bytes."""
    db.upsert([RowWrite(k, "r", due_at=NOW) for k in ("a", "b", "d", "e")], now=NOW)
    insert = "INSERT INTO schedule (key, route, job, payload, due_at) VALUES ({}, 1)"
    for values in (
        "CAST(X'63FF' AS TEXT), 'r', 'default', NULL",  # a key that is not UTF-8
        "X'0102', 'r', 'default', NULL",  # a blob
        "X'63FF', 'r', 'default', NULL",  # a blob with the same bytes as the text above
        "'f', CAST(X'FF' AS TEXT), 'default', NULL",
        "'g', 'r', CAST(X'FF01' AS TEXT), CAST(X'FF02' AS TEXT)",
    ):
        outside.execute(insert.format(values))
    for limit in (1, 2, 3, 100):
        after, good, bad, chunks = None, [], [], 0
        while True:
            rows, bad_rows, after = db.walk_schedule(after, limit)
            good += [row[0] for row in rows]
            bad += [bytes(b.key) if isinstance(b.key, bytearray) else b.key for b in bad_rows]
            chunks += 1
            if after is None:
                break
            assert chunks < 20
        assert good == ["a", "b", "d", "e", "g"], limit
        want_bad = [b"c\xff", "f", b"\x01\x02", b"c\xff"]
        assert sorted(map(repr, bad)) == sorted(map(repr, want_bad)), limit
        after, keys = None, []  # the same through walk(), Row and BadRow
        while chunk := db.walk(after, limit):
            keys += [bytes(r.key) if isinstance(r.key, bytearray) else r.key for r in chunk]
            after = chunk[-1].key
            assert len(keys) < 20
        assert keys == ["a", "b", b"c\xff", "d", "e", "f", "g", b"\x01\x02", b"c\xff"], limit
    assert [c.key for c in db.changes(0, 100) if c.valid] == ["a", "b", "d", "e", "g"]
    assert [c.key for c in db.due_history(0, db.last_seq(), 100)] == [
        "a", "b", "d", "e", b"c\xff", "f", "g"]  # fmt: skip  (blobs never logged as keys)
    row = db.get("g")
    assert (row.job, row.payload) == (b"\xff\x01", b"\xff\x02")
    assert db.jobs_of(["g"]) == {"g": (b"\xff\x01", None, "r")}
    assert db.classes_in_use() == [("r", None, False)]


def test_the_committed_origin_is_external_after_a_failed_batch(db, outside):
    with pytest.raises(StoreError):
        db.upsert([RowWrite("a", "r"), RowWrite("b", None)], now=NOW)
    assert outside.execute("SELECT origin FROM write_origin").fetchall() == [("external",)]
    outside.execute("INSERT INTO schedule (key, route, due_at) VALUES ('x', 'r', 1)")
    assert ops(db) == [(1, "I", "x", ORIGIN_EXTERNAL)]


def test_an_empty_file_is_migrated_on_open_and_reopening_is_a_no_op(tmp_path):
    path = tmp_path / "empty.db"
    path.touch()
    with SQLiteStore(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        s.upsert([RowWrite("k", "r")], now=NOW)
    with SQLiteStore(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        assert s.get("k").version == 1
    conn = sqlite3.connect(path)
    try:
        tables = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        migrations = conn.execute("SELECT version FROM schema_migrations").fetchall()
        journal = conn.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        conn.close()
    assert {"schedule", "changes", "write_origin", "meta", "schema_migrations"} <= tables
    assert migrations == [(v,) for v, _, _ in sqlite_store.MIGRATIONS]
    assert journal == "wal"


def test_a_file_of_schema_1_gains_the_outcome_columns_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(sqlite_store.q.CREATE_MIGRATIONS)
    version, name, statements = sqlite_store.MIGRATIONS[0]
    for statement in statements:
        conn.execute(statement)
    conn.execute(sqlite_store.q.RECORD_MIGRATION, (version, name, NOW))
    conn.execute("INSERT INTO schedule (key, route, due_at) VALUES ('k', 'r', 1)")
    conn.close()
    with SQLiteStore(path) as s:
        assert s.schema_version() == SCHEMA_VERSION >= 2
        row = s.get("k")
        assert (row.version, row.last_result_id, row.last_finished_at, row.last_error) == (
            1, None, None, None,
        )  # fmt: skip
        assert s.write_back_many([WriteBack("k", 601.0, 1, 5, NOW)]) == [2]
    with SQLiteStore(path) as s:  # reopening migrates nothing again
        assert s.get("k").last_result_id == 5


def test_an_outside_write_of_the_outcome_columns_alone_is_not_logged(db, outside):
    db.upsert([RowWrite("k", "r")], now=NOW)
    outside.execute("UPDATE schedule SET last_error = 'x', last_result_id = 3 WHERE key = 'k'")
    assert (db.get("k").version, db.last_seq()) == (1, 1)


def test_a_file_from_a_newer_build_is_refused(tmp_path):
    path = tmp_path / "s.db"
    SQLiteStore(path).close()
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("INSERT INTO schema_migrations VALUES (?, 'future', 0)", (SCHEMA_VERSION + 1,))
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        SQLiteStore(path)


def test_the_file_is_created_mode_0600_in_a_new_directory(tmp_path):
    path = tmp_path / "data" / "deeper" / "schedule.db"
    old = os.umask(0o022)
    try:
        with open_store(f"sqlite:///{path}") as s:
            s.upsert([RowWrite("k", "r")], now=NOW)
            for name in ("schedule.db", "schedule.db-wal", "schedule.db-shm"):
                assert stat.S_IMODE(os.stat(path.parent / name).st_mode) == 0o600, name
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


def test_reopening_keeps_last_seq_after_a_full_trim(tmp_path):
    path = tmp_path / "s.db"
    with SQLiteStore(path) as s:
        s.upsert([RowWrite(k, "r") for k in "abc"], now=NOW)
        s.trim_changes(s.last_seq())
    with SQLiteStore(path) as s:
        assert s.last_seq() == 3
        assert s.changes(0, 10) == []
        s.upsert([RowWrite("d", "r")], now=NOW)
        assert s.get("d").version == 4


def test_an_unopenable_path_is_unavailable(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(StoreUnavailable):
        SQLiteStore(tmp_path / "a-file" / "s.db")


# Another process asks who holds SQLite's SHARED lock bytes of the file (a
# connection in WAL mode keeps them for as long as it is open).
_SHARED_LOCK_PROBE = """
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR)
probe = struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0x40000002, 510, 0)
kind, _, _, _, pid = struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, probe))
print(0 if kind == fcntl.F_UNLCK else pid)
"""


def _shared_lock_holder(path) -> int:
    out = subprocess.run([sys.executable, "-c", _SHARED_LOCK_PROBE, str(path)],
                         capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    return int(out.stdout)


@pytest.mark.timeout(60)
def test_a_second_store_of_the_file_keeps_the_first_ones_lock(tmp_path):
    """Closing any descriptor of a file drops every POSIX lock the process
    holds on it, its SQLite connections' included: opening a second store of
    the same file (an HTTP worker's two, a claimer's after a restart) must
    not open and close one, or another process may take the file for its
    last connection and reset the WAL under the first."""
    path = tmp_path / "s.db"
    with SQLiteStore(path) as first:
        first.upsert([RowWrite("k", "r")], now=NOW)
        assert _shared_lock_holder(path) == os.getpid()
        with SQLiteStore(path, create=False) as second:
            assert second.get("k") is not None
            assert _shared_lock_holder(path) == os.getpid()
        assert _shared_lock_holder(path) == os.getpid()
        with SQLiteStore(path) as third:  # create=True on a file that is there
            third.sync()
        first.sync()
        assert _shared_lock_holder(path) == os.getpid()
        assert first.get("k") is not None


_READ_AND_CLOSE = (
    "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]);"
    " print(sorted(k for (k,) in c.execute('SELECT key FROM schedule'))); c.close()"
)


@pytest.mark.timeout(60)
def test_a_write_after_a_second_store_is_opened_is_seen_by_other_processes(tmp_path):
    """What the lock is for. Without it, another process that closes its
    last connection takes the file as its last user: it checkpoints and
    removes the WAL, and the first store's next commit goes to the removed
    file, where no other process ever reads it (a write answered, lost)."""
    path = tmp_path / "s.db"

    def keys_seen_elsewhere() -> str:
        return subprocess.run([sys.executable, "-c", _READ_AND_CLOSE, str(path)],
                              capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()  # fmt: skip

    with SQLiteStore(path) as first:
        first.upsert([RowWrite("a", "r")], now=NOW)
        with SQLiteStore(path, create=False):
            assert keys_seen_elsewhere() == "['a']"
            first.upsert([RowWrite("b", "r")], now=NOW)
            assert keys_seen_elsewhere() == "['a', 'b']"
        first.upsert([RowWrite("c", "r")], now=NOW)
        assert keys_seen_elsewhere() == "['a', 'b', 'c']"


def test_a_store_of_a_directory_or_a_missing_file_is_unavailable(tmp_path):
    with pytest.raises(StoreUnavailable, match="Is a directory"):
        SQLiteStore(tmp_path, create=False)
    with pytest.raises(StoreUnavailable, match="No such file"):
        SQLiteStore(tmp_path / "missing.db", create=False)


def test_a_write_lock_held_too_long_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(sqlite_store, "BUSY_TIMEOUT_S", 0.05)
    with SQLiteStore(tmp_path / "s.db") as s:
        other = sqlite3.connect(s.path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(StoreUnavailable):
                s.upsert([RowWrite("k", "r")], now=NOW)
            other.execute("ROLLBACK")
        finally:
            other.close()
        assert s.upsert([RowWrite("k", "r")], now=NOW) == 1


@pytest.mark.parametrize("store", ["sqlite", "postgresql"], indirect=True)
def test_a_forked_child_opens_its_own_connection(store):
    """A child forked with the store open writes through a connection (a pool,
    on PostgreSQL) of its own, and the parent's go on working."""
    db = store
    db.upsert([RowWrite("parent", "r")], now=NOW)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            db.check_fork()
            db.upsert([RowWrite("child", "r")], now=NOW)
            code = 0 if db.get("parent") is not None else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert db.get("child").version == 2
    db.upsert([RowWrite("parent", "r2")], now=NOW)  # the parent's sessions still work
    assert db.get("parent").version == 3


def test_processes_opening_a_new_file_at_once_migrate_it_once(tmp_path):
    path = tmp_path / "race.db"
    script = (
        "import sys\n"
        "from node.core.rows import RowWrite\n"
        "from node.store.sqlite import SQLiteStore\n"
        "with SQLiteStore(sys.argv[1]) as s:\n"
        "    s.upsert([RowWrite(sys.argv[2], 'r')], now=1.0)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), f"k{i}"]) for i in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    with SQLiteStore(path) as s:
        assert s.count() == 4
        assert sorted(c.seq for c in s.changes(0, 10)) == [1, 2, 3, 4]
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT count(*) FROM schema_migrations").fetchone()[0] == len(
            sqlite_store.MIGRATIONS
        )
    finally:
        conn.close()


def test_walk_schedule_matches_walk(store):
    """The keeper's load walk sees the same rows as walk(), in chunks."""
    from node.core.rows import RowWrite

    store.upsert(
        [
            RowWrite(
                key=f"k{i:04d}",
                route="r",
                cadence_s=None if i % 2 else 3600,
                sitemap=i % 3 == 0,
                due_at=1000.0 + i,
            )
            for i in range(250)
        ],
        now=1000.0,
    )
    seen, after = [], None
    while True:
        rows, bad, after = store.walk_schedule(after, 100)
        seen += rows
        assert bad == []
        if after is None:
            break
    expected = [
        (r.key, r.version, r.route, r.cadence_s, r.sitemap, r.due_at)
        for r in store.walk(None, 1000)
    ]
    assert [tuple(s) for s in seen] == expected


def test_walk_schedule_sets_bad_rows_apart(tmp_path):
    import sqlite3

    from node.core.rows import RowWrite
    from node.store.base import BadRow
    from node.store.sqlite import SQLiteStore

    store = SQLiteStore(str(tmp_path / "s.db"))
    store.upsert([RowWrite(key=k, route="r", due_at=5.0) for k in "abc"], now=5.0)
    other = sqlite3.connect(tmp_path / "s.db")
    with other:
        other.execute("UPDATE schedule SET cadence_s = 5 WHERE key = 'b'")
    other.close()
    rows, bad, after = store.walk_schedule(None, 10)
    assert [r[0] for r in rows] == ["a", "c"]
    assert len(bad) == 1 and isinstance(bad[0], BadRow) and bad[0].key == "b"
    assert after is None
    store.close()


@pytest.mark.parametrize("field", ["last_result_id", "last_finished_at", "last_error", "version"])
def test_a_write_cannot_carry_an_outcome_column(field):
    from node.core.errors import ValidationError
    from node.core.rows import parse_row

    with pytest.raises(ValidationError) as exc:
        parse_row({"key": "k", "route": "r", field: None}, "rows[0].")
    assert (exc.value.code, exc.value.field) == ("unknown_field", f"rows[0].{field}")


def _synchronous(store: SQLiteStore) -> int:
    return store._c().execute("PRAGMA synchronous").fetchone()[0]


def test_a_write_answered_is_synced_but_the_ledgers_write_backs_are_not(tmp_path):
    """What a caller is told is written is on disk: every connection syncs
    each commit (FULL, 2) unless opened not durable, as the ledger opens its
    own (NORMAL, 1: its log holds what it would write back again)."""
    url = f"sqlite:///{tmp_path}/s.db"
    durable, ledgers = open_store(url), open_store(url, durable=False)
    try:
        assert isinstance(durable, SQLiteStore) and isinstance(ledgers, SQLiteStore)
        assert (_synchronous(durable), _synchronous(ledgers)) == (2, 1)
    finally:
        durable.close()
        ledgers.close()


def test_a_connection_without_autocheckpoint_leaves_the_wal_to_checkpoint_wal(tmp_path):
    """The ledger's connection never checkpoints inside a commit; its
    ``checkpoint_wal`` (on another thread in the ledger) copies the WAL home."""
    url = f"sqlite:///{tmp_path}/s.db"
    store = open_store(url, durable=False, autocheckpoint=False)
    try:
        assert store._c().execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        now = time.time()
        for n in range(40):  # well past 1,000 pages of WAL: an automatic one would have run
            store.upsert(
                [RowWrite(f"k{n}-{i}", "r", payload="x" * 2000) for i in range(100)], now=now
            )
        assert store.wal_bytes() > 4 << 20
        home = os.path.getsize(f"{tmp_path}/s.db")
        assert home < 1 << 20  # every page still in the WAL only
        store.checkpoint_wal()
        assert os.path.getsize(f"{tmp_path}/s.db") > 4 << 20  # copied home
        assert store.get("k39-99") is not None
    finally:
        store.close()


def test_the_keeper_opens_its_store_with_a_small_page_cache_a_reopen_keeps(tmp_path):
    """Every process's connection keeps a 16 MiB page cache for point reads;
    the keeper's walks fill its own with pages it does not read again
    (about 15 bytes a row of its memory at 1,000,000 rows), so its store is
    opened with ``KEEPER_CACHE_KIB``, and a reopen after a store error keeps it."""
    from keeper.outage import KEEPER_CACHE_KIB, open_when_there

    url = f"sqlite:///{tmp_path / 'schedule.db'}"
    open_store(url).close()  # made, as the supervisor makes it

    def cache_kib(store: SQLiteStore) -> int:
        return -store._c().execute("PRAGMA cache_size").fetchone()[0]

    plain = open_store(url)
    try:
        assert isinstance(plain, SQLiteStore) and cache_kib(plain) == sqlite_store.CACHE_KIB
    finally:
        plain.close()
    keeper = open_when_there(url, None, lambda _s: None, lambda: False)  # the file is there
    try:
        assert KEEPER_CACHE_KIB < sqlite_store.CACHE_KIB and cache_kib(keeper) == KEEPER_CACHE_KIB
        again = keeper.reopen()
    finally:
        keeper.close()
    try:
        assert cache_kib(again) == KEEPER_CACHE_KIB
    finally:
        again.close()


@pytest.mark.parametrize("cache_kib", [0, -5, 1.5, True, "16"])
def test_a_page_cache_size_that_is_not_a_whole_positive_kib_is_refused(tmp_path, cache_kib):
    """``cache_kib`` goes into ``PRAGMA cache_size = -N``: a negative one would
    make ``--N``, which SQLite reads as a comment (the cache left at its
    default without a word). Refused before any file is made."""
    path = tmp_path / "s.db"
    with pytest.raises(ValueError, match="cache_kib"):
        open_store(f"sqlite:///{path}", cache_kib=cache_kib)
    assert not path.exists()
    store = open_store(f"sqlite:///{path}", cache_kib=64)
    try:
        assert store._c().execute("PRAGMA cache_size").fetchone()[0] == -64
    finally:
        store.close()
