"""The claim path in C (``shm._claim.ClaimPath``) against the Python path.

Two nodes' segments side by side over one SQLite schedule: the same set
published into both ready sets, the same leases, holds and parkings in both
lease tables; one Claimer takes the C path, the other the Python path. Every
claim must answer the same grants, leave the same counters and the same set
behind. The rows cover what a claim must skip or pass through: rows gone,
rows another program made unschedulable, versions moved, rows not due, every
payload shape, a row's own cadence, keys the lease table refuses, non-ASCII
keys, and a long key (which the C grant hands to the Python grant).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from node.config import Config, RouteConfig
from node.core.names import shm_segment_name
from node.core.rows import RowWrite
from node.store import open_store
from shm import layout, segment
from shm import leases as leases_mod
from shm.leases import LeaseTable, Refuse, Refused
from shm.ready import RECORD_TAG_SHIFT, ReadySet
from workers.claim import Claimer, Grant

pytestmark = pytest.mark.timeout(60)

NOW = 1_700_000_000.0
ROOT = Path(__file__).resolve().parents[2]
LONG = "https://example.com/" + "long/" * 60  # over the 208 bytes a slot holds inline


@pytest.fixture
def names():
    pair = [f"tcc{uuid.uuid4().hex[:10]}" for _ in range(2)]
    yield pair
    for node in pair:
        ReadySet.unlink(node)
        segment.unlink(shm_segment_name(node, "leases"))


def _config() -> Config:
    return Config(name="t", workers=1, routes={"r": RouteConfig(cadence_s=3600)})


def row_writes(plain: list[str], odd: tuple[str, ...]) -> list[RowWrite]:
    """Rows of every kind: ``plain`` due in order, payloads of each shape, a
    long and a non-ASCII key, a row's own cadence and job, one not due, one
    to be moved, another route; then, due, the ``odd`` ones (for the caller
    to make odd), ``bad-cadence``, ``bad-sitemap`` and the keys ``refusals``
    leases, holds and parks."""
    due = ("bad-cadence", "bad-sitemap", "leased", "held", "parked")
    return [
        RowWrite(key=k, route="r", due_at=NOW - 600 - i, payload={"n": i})
        for i, k in enumerate(plain)
    ] + [
        RowWrite(key="ключ-1", route="r", due_at=NOW - 60, payload=["ü", 1]),
        RowWrite(key=LONG, route="r", due_at=NOW - 60, payload="long"),
        RowWrite(key="own-cadence", route="r", cadence_s=120, due_at=NOW - 60, job="j2"),
        RowWrite(key="no-payload", route="r", due_at=NOW - 60),
        RowWrite(key="not-due", route="r", due_at=NOW + 600),
        RowWrite(key="moved", route="r", due_at=NOW - 60),
        RowWrite(key="other-route", route="unconfigured", due_at=NOW - 60, payload=7.5),
    ] + [RowWrite(key=k, route="r", due_at=NOW - 60) for k in (*odd, *due)]


def _schedule(db: Path) -> list[str]:
    """Rows of every kind; returns the keys in the order they are published."""
    store = open_store(f"sqlite:///{db}")
    plain = [f"k{i:03d}" for i in range(40)]
    store.upsert(row_writes(plain, ("raw", "spaced", "extra", "blob")), now=NOW)
    store.close()
    conn = sqlite3.connect(db)
    with conn:  # what another program might store
        for key, payload in (
            ("raw", "not json"),
            ("spaced", ' \n{"a": [1, 2]} \t'),
            ("extra", '{"a": 1} trailing'),
            ("blob", b'{"b": 2}'),
        ):
            conn.execute("UPDATE schedule SET payload = ? WHERE key = ?", (payload, key))
        conn.execute("UPDATE schedule SET cadence_s = 5 WHERE key = 'bad-cadence'")
        conn.execute("UPDATE schedule SET sitemap = 2 WHERE key = 'bad-sitemap'")
    conn.close()
    return [
        "k000", "ключ-1", "gone", "not-due", "moved", "leased", LONG, "own-cadence",
        "held", "no-payload", "raw", "spaced", "extra", "blob", "bad-cadence", "parked",
        "bad-sitemap", "other-route", *plain[1:],
    ]  # fmt: skip


def _entries(db: Path, keys: list[str]) -> list[tuple]:
    conn = sqlite3.connect(db)
    versions = dict(conn.execute("SELECT key, version FROM schedule"))
    conn.close()
    return entries_of(versions, keys)


def entries_of(versions: dict[str, int], keys: list[str]) -> list[tuple]:
    """The set to publish, best first: each key at its row's version (1 for
    a key with no row), but ``moved``'s, which names the version before."""
    out = []
    for rank, key in enumerate(keys):
        version = versions.get(key, 1)
        if key == "moved":
            version += 1  # the row moved on since this publish
        out.append((key, version, int(NOW // 60) - 10, 1, float(len(keys) - rank)))
    return out


def refusals(table: LeaseTable) -> None:
    """Keys the lease table refuses: ``leased``, ``held`` and ``parked``."""
    table.grant("leased", "other", 600, NOW - 1, 3600)
    held = table.grant("held", "other", 600, NOW - 1, 3600)
    table.release("held", held.lease_id, NOW - 1, "first miss")
    for i in range(3):  # max_misses 3: parked (each hold has passed at the next grant)
        at = NOW - 10**6 + 10**4 * i
        lease = table.grant("parked", "other", 600, at, 3600)
        table.release("parked", lease.lease_id, at, "again")


def _same(a: list[Grant], b: list[Grant]) -> None:
    """Equal grants, lease ids aside (the long key's comes later on the C path)."""

    def strip(g: Grant) -> tuple:
        return (g.key, g.payload, g.job, g.due_at, g.expires_at, g.route, g.misses)

    assert sorted(map(strip, a), key=repr) == sorted(map(strip, b), key=repr)


@contextlib.contextmanager
def _claimer_on(name: str, db: Path, capacity: int, **table: object):
    """A C-path Claimer over ``db`` with a ready set and lease table of its
    own, all closed after."""
    ready = ReadySet.create(name, capacity=capacity)
    leases = LeaseTable.create(name, capacity=256, now=NOW, **table)
    store = open_store(f"sqlite:///{db}")
    claimer = Claimer(_config(), store, ready, leases)
    try:
        yield claimer, ready, leases
    finally:
        claimer.close()
        leases.close()
        ready.close()
        store.close()


def test_the_c_path_claims_what_the_python_path_claims(names, tmp_path):
    db = tmp_path / "schedule.db"
    keys = _schedule(db)
    entries = _entries(db, keys)
    sides = []
    for node, c_path in zip(names, (True, False), strict=True):
        ready = ReadySet.create(node, capacity=100)
        leases = LeaseTable.create(node, capacity=256, max_misses=3, now=NOW)
        refusals(leases)
        ready.publish(entries, NOW)
        store = open_store(f"sqlite:///{db}")
        claimer = Claimer(_config(), store, ready, leases, c_path=c_path)
        sides.append((claimer, ready, leases, store))
    (fast, *_), (slow, *_) = sides
    try:
        assert fast.on_c_path and not slow.on_c_path
        for n in (1, 3, 5, 2, 7, 40, 10):
            a = fast.claim(n, 30.0, "consumer", NOW)
            b = slow.claim(n, 30.0, "consumer", NOW)
            _same(a, b)
            assert sides[0][1].remaining() == sides[1][1].remaining()
        assert fast.stats.as_dict() == slow.stats.as_dict()
        stats = fast.stats.as_dict()
        assert stats["gone"] == 3  # no row, a bad cadence, a bad sitemap
        assert (stats["moved"], stats["not_due"]) == (1, 1)
        assert stats["refused"] == {"leased": 1, "held": 1, "parked": 1}
        assert stats["granted"] == len(keys) - 8
        live = {lease.key for lease in sides[0][2].live(limit=1000)}
        assert LONG in live and "ключ-1" in live
    finally:
        for claimer, ready, leases, store in sides:
            claimer.close()
            leases.close()
            ready.close()
            store.close()


def test_payloads_and_cadences_come_through_as_the_python_path_reads_them(names, tmp_path):
    db = tmp_path / "schedule.db"
    keys = _schedule(db)
    with _claimer_on(names[0], db, 100, max_misses=3) as (claimer, ready, leases):
        ready.publish(_entries(db, keys), NOW)
        grants = {g.key: g for g in claimer.claim(100, 30.0, "c", NOW)}
        assert grants["raw"].payload == "not json"
        assert grants["spaced"].payload == {"a": [1, 2]}
        assert grants["extra"].payload == '{"a": 1} trailing'
        assert grants["blob"].payload == {"b": 2}
        assert grants["no-payload"].payload is None
        assert grants["ключ-1"].payload == ["ü", 1]
        assert (
            grants["other-route"].payload == 7.5 and grants["other-route"].route == "unconfigured"
        )
        assert grants["own-cadence"].job == "j2" and grants["k000"].job == "default"
        assert all(type(g) is Grant for g in grants.values())
        # The cadence each lease caps its hold at: the row's own, else the route's.
        assert leases.peek("own-cadence", grants["own-cadence"].lease_id)[1].cadence_s == 120
        assert leases.peek("k000", grants["k000"].lease_id)[1].cadence_s == 3600
        assert leases.peek("other-route", grants["other-route"].lease_id)[1].cadence_s == 86400
        assert leases.grant("k000", "x", 30.0, NOW, 3600) == Refused(Refuse.LEASED)


ODD_KEYS = [
    'q"uote', "back\\slash", "tab\there", "nl\nx", "nul\x00byte", "del\x7f", "\x01\x1f",
    "emoji-\U0001f680", '"', "\\", '\\"\\u0000', "[1,2]", "ключ",
]


def test_a_run_of_keys_read_in_one_statement_finds_keys_json_must_escape(names, tmp_path):
    """The C path reads a run's rows in one statement, its keys passed as a
    JSON array: every key the contract allows (any UTF-8, control
    characters and quotes included) must find its row."""
    db = tmp_path / "schedule.db"
    store = open_store(f"sqlite:///{db}")
    store.upsert(
        [RowWrite(key=k, route="r", due_at=NOW - 60, payload={"k": k}) for k in ODD_KEYS], now=NOW
    )
    store.close()
    conn = sqlite3.connect(db)
    versions = dict(conn.execute("SELECT key, version FROM schedule"))
    conn.close()
    assert set(versions) == set(ODD_KEYS)
    minute = int(NOW // 60) - 1
    entries = [(k, versions[k], minute, 1, float(100 - i)) for i, k in enumerate(ODD_KEYS)]
    with _claimer_on(names[0], db, 100) as (claimer, ready, _leases):
        assert claimer.on_c_path
        ready.publish(entries, NOW)
        grants = claimer.claim(len(ODD_KEYS), 30.0, "c", NOW)
        assert sorted(g.key for g in grants) == sorted(ODD_KEYS)
        assert all(g.payload == {"k": g.key} for g in grants)
        assert claimer.stats.as_dict()["gone"] == 0


def test_the_c_path_records_where_it_leased_each_entry_for_the_keeper(names, tmp_path):
    """Each entry the C path leases gets a grant record (shm/ready/layout.py): the
    slot and LEASED word of its lease, tagged with the publish. A keeper's
    scan given them settles those keys with its own strs, unread, and finds
    what a scan without them finds."""
    db = tmp_path / "schedule.db"
    keys = _schedule(db)
    with _claimer_on(names[0], db, 100, max_misses=3) as (claimer, ready, leases):
        refusals(leases)
        published = [e[0] for e in _entries(db, keys)]
        assert ready.publish(_entries(db, keys), NOW) == len(published)
        with LeaseTable.attach(names[0]) as plain, LeaseTable.attach(names[0]) as hinted:
            plain.excluded_changes(NOW)
            hinted.excluded_changes(NOW)  # both know the refusals' keys already
            granted = {g.key for g in claimer.claim(100, 30.0, "c", NOW)}
            view, count, tag = ready.grant_records(ready.last_slot)
            assert count == len(published)
            records = view.cast("Q").tolist()[:count]
            for key, rec in zip(published, records, strict=True):
                if key not in granted or key == LONG:  # the long key: the Python grant's
                    assert rec == 0, key
                    continue
                idx = (rec & 0x7FFFFF) - 1
                kb = key.encode()
                found = leases._lookup(kb, leases_mod._hash(kb))
                assert found is not None and found[0] == idx, key
                word = found[1]
                assert rec >> RECORD_TAG_SHIFT == tag
                assert (rec >> 23) & 1 == (word >> 8) & 1
                assert (rec >> 24) & 0xFFFFF == word >> leases_mod.SEQ_SHIFT
            added, removed = hinted.excluded_changes(NOW, [(view, published, count, tag)])
            want, none = plain.excluded_changes(NOW)
            assert sorted(added) == sorted(want) == sorted(granted) and removed == none == []
            mine = {id(key) for key in published}
            assert {key for key in added if id(key) in mine} == granted - {LONG}
            assert set(hinted.excluded) == set(plain.excluded)
            # A new publish zeroes the records it replaces; the older slot's
            # records stay until that slot is published again.
            ready.publish(_entries(db, keys)[:5], NOW)
            ready.publish(_entries(db, keys)[:5], NOW)
            assert not any(view.cast("Q").tolist()[:count])


def test_closing_the_segments_closes_the_c_path_first(names, tmp_path):
    db = tmp_path / "schedule.db"
    _schedule(db)
    ready = ReadySet.create(names[0], capacity=10)
    leases = LeaseTable.create(names[0], capacity=64, now=NOW)
    store = open_store(f"sqlite:///{db}")
    claimer = Claimer(_config(), store, ready, leases)
    assert claimer.on_c_path
    leases.close()  # would raise BufferError if the path still held the mapping
    ready.close()
    store.close()
    assert claimer._path is None


_FORKED = textwrap.dedent(
    """
    import os, sys
    from node.config import Config, RouteConfig
    from node.store import open_store
    from shm.leases import LeaseTable
    from shm.ready import ReadySet
    from workers.claim import Claimer
    name, db, now = sys.argv[1], sys.argv[2], float(sys.argv[3])
    ready, leases = ReadySet.attach(name), LeaseTable.attach(name)
    store = open_store("sqlite:///" + db)
    claimer = Claimer(Config(name="t", workers=1, routes={"r": RouteConfig(cadence_s=3600)}),
                      store, ready, leases)
    first = claimer.claim(1, 30.0, "parent", now)
    pid = os.fork()
    if pid == 0:  # the child opens a path of its own, never the parent's
        got = claimer.claim(1, 30.0, "child", now)
        os._exit(0 if len(got) == 1 and claimer._path is not None else 3)
    _, status = os.waitpid(pid, 0)
    again = claimer.claim(1, 30.0, "parent", now)  # the parent's path still works
    print(len(first), os.waitstatus_to_exitcode(status), len(again))
    """
)


def test_a_child_of_fork_opens_its_own_c_path(names, tmp_path):
    db = tmp_path / "schedule.db"
    keys = _schedule(db)
    ready = ReadySet.create(names[0], capacity=100)
    leases = LeaseTable.create(names[0], capacity=256, now=NOW)
    try:
        ready.publish(_entries(db, [k for k in keys if k.startswith("k")]), NOW)
        out = subprocess.run(
            [sys.executable, "-c", _FORKED, names[0], str(db), repr(NOW)],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.stdout.split() == ["1", "0", "1"], out.stderr
        assert len(leases.live()) == 3
    finally:
        leases.close()
        ready.close()


def test_a_claim_larger_than_the_ready_set_takes_what_the_set_has(names, tmp_path):
    db = tmp_path / "schedule.db"
    keys = [k for k in _schedule(db) if k.startswith("k")]
    with _claimer_on(names[0], db, 10) as (claimer, ready, _leases):
        ready.publish(_entries(db, keys[:10]), NOW)
        got = claimer.claim(10_000, 30.0, "c", NOW)  # the contract's largest max
        assert claimer.on_c_path and [g.key for g in got] == keys[:10]
        assert claimer.claim(10_000, 30.0, "c", NOW) == []


def test_a_sqlite_store_on_the_python_path_says_so_once(names, tmp_path, monkeypatch):
    """Without the C claim path (here: the extension made unavailable) the
    SQLite store's claims still work, on the Python path, and the process
    logs one warning that says why, not one a claim."""
    import logging

    from workers.claim import path as claim_mod

    monkeypatch.setattr(claim_mod, "_claim", None)
    monkeypatch.setattr(claim_mod, "_warned_python_path", False)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("queue-node").addHandler(handler)
    try:
        db = tmp_path / "schedule.db"
        keys = _schedule(db)
        with _claimer_on(names[0], db, 100, max_misses=3) as (claimer, ready, _leases):
            ready.publish(_entries(db, keys), NOW)
            assert not claimer.on_c_path
            assert claimer.claim(5, 30.0, "c", NOW) and claimer.claim(5, 30.0, "c", NOW)
    finally:
        logging.getLogger("queue-node").removeHandler(handler)
    warned = [line for line in lines if "action=claim_python_path" in line]
    assert len(warned) == 1 and "shm._claim is not built" in warned[0]


def test_an_entry_whose_key_lies_outside_the_copied_keys_is_never_read(names, tmp_path):
    """The C take checks every entry's key offset, not only the first and
    last: a take whose middle entry points past the keys it copied (torn, or
    written by something that is not the keeper) is dropped whole, as a torn
    take is, and the claim goes on with the entries after it; nothing is
    granted from it."""
    from shm.ready import ENTRY, SLOT_HEADER_SIZE

    db = tmp_path / "schedule.db"
    keys = _schedule(db)
    with _claimer_on(names[0], db, 100) as (claimer, ready, leases):
        assert claimer.on_c_path
        ready.publish(_entries(db, keys), NOW)
        base = ready._slot_base(ready.active_slot) + SLOT_HEADER_SIZE
        last = ENTRY.unpack_from(ready.segment.mm, base + ENTRY.size * 4)
        middle_at = base + ENTRY.size * 2
        middle = list(ENTRY.unpack_from(ready.segment.mm, middle_at))
        middle[0] = last[0] + last[1]  # starts where the fifth entry's key ends
        ENTRY.pack_into(ready.segment.mm, middle_at, *middle)
        first_five = {e.key for e in ready.snapshot().entries[:5]}
        grants = claimer.claim(5, 30.0, "consumer", NOW)
        granted = {g.key for g in grants}
        assert granted and not granted & first_five, (granted, first_five)
        assert granted <= set(keys)
        assert {lease.key for lease in leases.live(limit=100)} == granted


def test_the_c_modules_layouts_are_checked_against_the_python_ones_at_import():
    """The offsets are written twice (C #defines, Python constants); the C
    module exports what it was built with and the Python side refuses a
    build of another layout at import instead of reading the wrong bytes."""
    from shm import _claim, ready
    from shm import leases as leases_py

    assert {"SEALED", "SHARD_JOURNAL", "STATES", "SLOT_SIZE", "LEASED"} <= set(_claim.LEASE_LAYOUT)
    assert {"FIRST_SLOT", "ENTRY_SIZE", "CLAIM_CURSOR"} <= set(_claim.READY_LAYOUT)
    assert _claim.LEASE_LAYOUT["SEALED"] == leases_py.SEALED
    assert _claim.READY_LAYOUT["ENTRY_SIZE"] == ready.ENTRY_SIZE
    moved = dict(_claim.LEASE_LAYOUT, SEALED=leases_py.SEALED + 4)
    with pytest.raises(ImportError, match="SEALED is 40 there, 36 here.*rebuild"):
        layout.check("shm._claim", moved, vars(leases_py))


def test_a_sqlite_failure_in_the_c_path_is_the_stores_own_error(names, tmp_path):
    """A row read that fails in C raises what the SQLite store raises for
    the same failure on the Python path (the store's error mapping, through
    ``claim_source().error``), not a driver exception."""
    from node.core.errors import StoreError, StoreUnavailable

    db = tmp_path / "schedule.db"
    keys = _schedule(db)
    with _claimer_on(names[0], db, 100) as (claimer, ready, _leases):
        assert claimer.on_c_path
        ready.publish(_entries(db, keys), NOW)
        conn = sqlite3.connect(db)
        with conn:  # another program breaks the file under the node
            conn.execute("ALTER TABLE schedule RENAME TO elsewhere")
        conn.close()
        with pytest.raises(StoreError) as in_c:
            claimer.claim(5, 30.0, "c", NOW)
        with pytest.raises(StoreError) as in_python:
            claimer.store.get_many(keys[:5])
    assert not isinstance(in_c.value, StoreUnavailable)
    assert str(in_c.value) == str(in_python.value) == (
        "SQLite store: get_many: no such table: schedule"
    )
