"""The claim path in C with its rows handed in (``shm/_claim_rows.c``: a node
on PostgreSQL, whose claimers read their rows through the node's row
service) against the Python path over the same rows.

Two nodes' segments side by side over one PostgreSQL schedule and one row
service in process: the same set published into both ready sets, the same
leases, holds and parkings in both lease tables; one Claimer takes the C
path, the other the Python path (``c_path=False``). Every claim must answer
the same grants in the same order, leave the same counters and the same set
behind. The rows cover what a claim must skip or pass through: rows gone,
rows another program made unschedulable (a cadence under the least, a
sitemap flag of 2, a due time that is not a number), versions moved, rows
not due, payloads that are not JSON, a row's own cadence and job, keys the
lease table refuses, non-ASCII keys and a long key (which the C grant hands
to the Python grant). A read that fails hands back what the claim granted
before it, as the Python path does.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from node.core.errors import StoreUnavailable
from node.core.rows import RowWrite
from node.store.postgres import PostgresStore
from shm.leases import LeaseTable
from shm.ready import ReadySet
from tests.integration import test_claim_c, test_rows_service
from tests.integration.test_claim_c import LONG, NOW, entries_of, refusals, row_writes
from workers.claim import Claimer, Grant
from workers.rows import RowsClient

pytestmark = pytest.mark.timeout(60)

# This run's database emptied, a PostgresStore on it; a row service over a
# store, in a thread; two node names, their segments unlinked after
# (test_rows_service.py's and test_claim_c.py's fixtures).
store, serve = test_rows_service.store, test_rows_service.serve
names = test_claim_c.names


@pytest.fixture
def service(store, serve):
    """A row service over this run's database, in a thread: its node name."""
    return serve(store).name


def _schedule(store: PostgresStore, url: str) -> list[str]:
    """Rows of every kind; the keys in the order they are published."""
    plain = [f"k{i:03d}" for i in range(90)]  # more than a run of 64
    store.upsert(row_writes(plain, ("raw", "spaced", "extra", "bad-due")), now=NOW)
    with psycopg.connect(url, autocommit=True) as conn:  # what another program might store
        for key, payload in (
            ("raw", "not json"),
            ("spaced", ' \n{"a": [1, 2]} \t'),
            ("extra", '{"a": 1} trailing'),
        ):
            conn.execute("UPDATE schedule SET payload = %s WHERE key = %s", (payload, key))
        conn.execute("UPDATE schedule SET cadence_s = 5 WHERE key = 'bad-cadence'")
        conn.execute("UPDATE schedule SET sitemap = 2 WHERE key = 'bad-sitemap'")
        conn.execute("UPDATE schedule SET due_at = 'NaN' WHERE key = 'bad-due'")
    return [
        "k000", "ключ-1", "gone", "not-due", "moved", "leased", LONG, "own-cadence",
        "held", "no-payload", "raw", "spaced", "extra", "bad-cadence", "parked",
        "bad-sitemap", "bad-due", "other-route", *plain[1:],
    ]  # fmt: skip


def _entries(url: str, keys: list[str]) -> list[tuple]:
    with psycopg.connect(url, autocommit=True) as conn:
        versions = dict(conn.execute("SELECT key, version FROM schedule").fetchall())
    return entries_of(versions, keys)


def _strip(g: Grant) -> tuple:
    """A grant, its lease id aside (the long key's comes later on the C path)."""
    return (g.key, g.payload, g.job, g.due_at, g.expires_at, g.route, g.misses)


def _sides(names: list[str], service: str, entries: list[tuple]) -> list[tuple]:
    sides = []
    for node, c_path in zip(names, (True, False), strict=True):
        ready = ReadySet.create(node, capacity=200)
        leases = LeaseTable.create(node, capacity=512, max_misses=3, now=NOW)
        refusals(leases)
        ready.publish(entries, NOW)
        rows = RowsClient(service, timeout_s=5)
        claimer = Claimer(test_claim_c._config(), rows, ready, leases, c_path=c_path)
        sides.append((claimer, ready, leases, rows))
    return sides


def _plain(n: int, names: list[str], store: PostgresStore, service: str, url: str) -> tuple:
    """``n`` plain rows, due in key order, and both sides over them: (keys, sides)."""
    keys = [f"k{i:03d}" for i in range(n)]
    store.upsert([RowWrite(key=k, route="r", due_at=NOW - 600) for k in keys], now=NOW)
    return keys, _sides(names, service, _entries(url, keys))


def _close(sides: list[tuple]) -> None:
    for claimer, ready, leases, rows in sides:
        claimer.close()
        leases.close()
        ready.close()
        rows.close()


def test_the_c_path_with_rows_handed_in_claims_what_the_python_path_claims(
    names, store, service, pg_url
):
    keys = _schedule(store, pg_url)
    sides = _sides(names, service, _entries(pg_url, keys))
    (fast, fast_ready, fast_leases, _), (slow, slow_ready, _, _) = sides
    try:
        assert fast.on_c_path and not slow.on_c_path
        for n in (1, 3, 5, 2, 7, 70, 10, 40):
            a, b = fast.claim(n, 30.0, "consumer", NOW), slow.claim(n, 30.0, "consumer", NOW)
            # The same grants: the long key's (granted by the Python grant
            # after the C path's run) may come last.
            assert sorted(map(_strip, a), key=repr) == sorted(map(_strip, b), key=repr)
            assert [g.key for g in a if g.key != LONG] == [g.key for g in b if g.key != LONG]
            assert fast_ready.remaining() == slow_ready.remaining()
        assert fast.stats.as_dict() == slow.stats.as_dict()
        stats = fast.stats.as_dict()
        assert stats["gone"] == 4  # no row, a bad cadence, a bad sitemap, a bad due time
        assert (stats["moved"], stats["not_due"]) == (1, 1)
        assert stats["refused"] == {"leased": 1, "held": 1, "parked": 1}
        assert stats["granted"] == len(keys) - 9
        live = {lease.key: lease.lease_id for lease in fast_leases.live(limit=1000)}
        assert LONG in live and "ключ-1" in live
        # The cadence each lease caps its hold at: the row's own, else the route's.
        assert fast_leases.peek("own-cadence", live["own-cadence"])[1].cadence_s == 120
        assert fast_leases.peek("k000", live["k000"])[1].cadence_s == 3600
    finally:
        _close(sides)


def test_payloads_come_through_as_the_python_path_reads_them(names, store, service, pg_url):
    keys = _schedule(store, pg_url)
    sides = _sides(names, service, _entries(pg_url, keys))
    try:
        grants = {g.key: g for g in sides[0][0].claim(200, 30.0, "c", NOW)}
        assert grants["raw"].payload == "not json"
        assert grants["spaced"].payload == {"a": [1, 2]}
        assert grants["extra"].payload == '{"a": 1} trailing'
        assert grants["no-payload"].payload is None
        assert grants["ключ-1"].payload == ["ü", 1]
        assert grants["other-route"].payload == 7.5
        assert grants["other-route"].route == "unconfigured"
        assert grants["own-cadence"].job == "j2" and grants["k000"].job == "default"
        assert all(type(g) is Grant for g in grants.values())
    finally:
        _close(sides)


def test_a_failed_read_hands_back_what_the_claim_granted_before_it(
    names, store, service, pg_url, monkeypatch
):
    """A claim of 90 reads two runs (64, then 26). When the second read fails
    (the row service gone), the first run's 64 leases are live and handed
    out; a claim whose first read fails is StoreUnavailable and grants
    nothing, on the C path as on the Python path."""
    keys, sides = _plain(90, names, store, service, pg_url)
    (fast, *_), (slow, *_) = sides
    try:
        reads: list[int] = []
        real = fast.store.raw_rows

        def second_fails(keys: list[str], until: int = 0) -> list:
            reads.append(len(keys))
            if len(reads) >= 2:
                raise StoreUnavailable("the row service went away")
            return real(keys, until)

        monkeypatch.setattr(fast.store, "raw_rows", second_fails)
        got = fast.claim(90, 30.0, "c", NOW)
        assert reads == [64, 26]
        assert [g.key for g in got] == keys[:64]
        mine = {lease.key for lease in sides[0][2].live(limit=1000) if lease.consumer == "c"}
        assert mine == set(keys[:64])
        sides[0][1].publish(_entries(pg_url, keys), NOW)  # the 26 not granted, again
        with pytest.raises(StoreUnavailable):
            fast.claim(5, 30.0, "c", NOW)
        monkeypatch.setattr(slow.store, "get_many", second_fails)
        reads[:] = [1]
        with pytest.raises(StoreUnavailable):
            slow.claim(5, 30.0, "c", NOW)
        assert fast.stats.granted == 64 and slow.stats.granted == 0
    finally:
        _close(sides)


def test_a_deadline_that_passes_during_the_read_grants_nothing_of_that_run(
    names, store, service, pg_url, monkeypatch
):
    """The grant deadline (a fleet's) passes while a run's rows are read (a
    heartbeat that did not come): nothing of that run is granted, the runs
    before it are handed out, and a claim that granted nothing is
    NotGranting; both paths alike."""
    from node.core.errors import NotGranting

    keys, sides = _plain(90, names, store, service, pg_url)
    try:
        for (claimer, ready, leases, rows), read in zip(
            sides, ("raw_rows", "get_many_until"), strict=True
        ):
            ready.set_grant_until(time.monotonic_ns() + 60 * 10**9)
            calls: list[int] = []
            real = getattr(rows, read)

            def lapses(keys: list[str], until: int, real=real, calls=calls, ready=ready) -> Any:
                calls.append(len(keys))
                if len(calls) == 2:  # the second run's read outlasts the deadline
                    ready.set_grant_until(time.monotonic_ns() - 1)
                return real(keys, until)

            monkeypatch.setattr(rows, read, lapses)
            got = claimer.claim(64, 30.0, "c", NOW)
            assert len(got) == 64  # the first run, before the deadline
            ready.set_grant_until(time.monotonic_ns() + 60 * 10**9)
            with pytest.raises(NotGranting):
                claimer.claim(26, 30.0, "c", NOW)
            mine = {lease.key for lease in leases.live(limit=1000) if lease.consumer == "c"}
            assert mine == {g.key for g in got}
            assert claimer.stats.not_granting == 1
    finally:
        _close(sides)


def test_a_malformed_answer_hands_back_what_the_claim_granted_before_it(
    names, store, service, pg_url, monkeypatch
):
    """An answer the C path cannot take (a row of the wrong length, not a
    sequence): the claim ends there, and the leases of the runs before are
    handed out, not left leased to nobody; the entries taken count."""
    keys, sides = _plain(90, names, store, service, pg_url)
    fast, _ready, leases, rows = sides[0]
    try:
        real = rows.raw_rows
        for bad in ([["k064", "r"]], 7):
            answers: list[int] = []

            def malformed(keys: list[str], until: int, bad: Any = bad, answers=answers) -> Any:
                answers.append(len(keys))
                return real(keys, until) if len(answers) == 1 else bad

            monkeypatch.setattr(rows, "raw_rows", malformed)
            got = fast.claim(90, 30.0, "c", NOW)
            assert len(got) == 64 and answers == [64, 26]
            mine = {lease.key for lease in leases.live(limit=1000) if lease.consumer == "c"}
            assert {g.key for g in got} <= mine
            sides[0][1].publish(_entries(pg_url, keys), NOW)  # the 26 not granted, again
            with pytest.raises((ValueError, TypeError)):
                fast.claim(1, 30.0, "c", NOW)  # its one read answers badly: nothing granted
            sides[0][1].publish(_entries(pg_url, keys), NOW)
            for g in got:
                assert leases.complete(g.key, g.lease_id, NOW).value == "completed"
        assert fast.stats.taken >= 2 * 90
    finally:
        _close(sides)


def test_a_claim_from_within_a_read_is_refused_and_a_close_waits_for_the_claim(
    names, store, service, pg_url, monkeypatch
):
    """The read releases the GIL for as long as the row service takes: a
    second claim of the same Claimer meanwhile (from the reader itself here;
    another thread alike) is refused, never run over the first one's entries,
    and a close meanwhile takes effect when the claim ends."""
    keys, sides = _plain(10, names, store, service, pg_url)
    fast, _ready, leases, rows = sides[0]
    try:
        real = rows.raw_rows
        seen: list[str] = []

        def reenter(keys: list[str], until: int) -> Any:
            try:
                fast.claim(5, 30.0, "inner", NOW)
            except RuntimeError as exc:
                seen.append(str(exc))
            fast.close()  # waits for this claim to end
            return real(keys, until)

        monkeypatch.setattr(rows, "raw_rows", reenter)
        got = fast.claim(3, 30.0, "outer", NOW)
        assert seen == ["a claim of this Claimer is running: one at a time"]
        assert [g.key for g in got] == keys[:3]
        holders = {lease.key: lease.consumer for lease in leases.live(limit=1000)}
        assert {k: holders[k] for k in keys[:3]} == dict.fromkeys(keys[:3], "outer")
        assert "inner" not in holders.values()
        monkeypatch.setattr(rows, "raw_rows", real)
        assert [g.key for g in fast.claim(2, 30.0, "after", NOW)] == keys[3:5]  # reopened
    finally:
        _close(sides)
