"""Acceptance: a fleet node restarted under another ownership than the one
its saved counts were taken under keeps its input law (issue 18; docs/
accounting.md, "After a restart of the keeper"; docs/fleet.md, "A restart
counts what moved"). Two real nodes on one PostgreSQL database; the first
stops, the second holds every row alone and saves its counts so, then
stops too; the first comes back alone (it owns every row), then the
second joins. Before the fix the first loaded the second's due rows
without counting them received and dropped them as withdrawn when the
second joined (gaps.input −1 a row, for good), and the second came back
with the first's rows still in its received (+1 a row); the fleet's sum
balanced, neither node did. The in-process cases (writes while a node is
down, a rolling restart, a change during the load) are in
tests/integration/test_keeper_restart_moves.py.
"""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from tests import pg
from tests.acceptance.test_fleet_node import _settled, _split

pytestmark = pytest.mark.timeout(180)

ENV = {
    "QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": "3",
    "QUEUE_NODE_HEARTBEAT_S": "0.2",
    "QUEUE_NODE_STATE_INTERVAL_S": "1",  # counts saved every second
}
ROWS = 30  # two thirds due


def _balanced(node: NodeProcess, live: list[str], since: float) -> dict | None:
    """The node's /accounting once it is settled over ``live`` with counts
    taken after ``since`` and balanced; None until then."""
    state = _settled(node, live)
    if state is None or not state["counters"]["at"] > since:
        return None
    status, doc = node.request("GET", "/accounting")
    assert status == 200, doc
    _LAST[node.name] = {"accounting": doc, "counters": state["counters"]}
    return doc if doc["balanced"] and doc["gaps"]["input"] == 0 else None


_LAST: dict[str, dict] = {}  # what _balanced saw last: a failure shows it


def _wait_balanced(nodes: list[NodeProcess], live: list[str], what: str) -> None:
    since = time.time()
    _LAST.clear()
    try:
        wait_for(lambda: all(_balanced(n, live, since) for n in nodes), 30, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {_LAST}") from None


def test_a_node_back_alone_first_and_its_peer_after_both_balance(tmp_path, pg_url):
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    now = time.time()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT 'k' || i, 'r', 86400, CASE WHEN i %% 3 = 0 THEN %s ELSE %s END"
            " FROM generate_series(1, %s) AS i",
            (now + 86400, now - 3600, ROWS),
        )
    names = sorted(f"t-{uuid.uuid4().hex[:10]}" for _ in range(2))
    first, second = (NodeProcess(tmp_path / n, n, "--store", pg_url, env=ENV) for n in names)
    try:
        first.start()
        second.start()
        wait_for(lambda: _split([first, second], pg_url), 60, "the rows split")
        _wait_balanced([first, second], names, "both balanced")
        # The first stops; the second holds every row and saves so.
        assert first.stop() == 0
        wait_for(lambda: _split([second], pg_url), 60, "every row held by the second")
        _wait_balanced([second], [second.name], "the second balanced alone")
        assert second.stop() == 0
        # The first comes back alone: every row is its own now.
        first.start()
        wait_for(lambda: _split([first], pg_url), 60, "every row held by the first")
        _wait_balanced([first], [first.name], "the first balanced alone")
        # The second joins: the first drops its rows, the second takes them.
        second.start()
        wait_for(lambda: _split([first, second], pg_url), 60, "the rows split again")
        _wait_balanced([first, second], names, "both balanced after both came back")
    finally:
        finish([first], names[0])
        finish([second], names[1])


def _store_after(node: NodeProcess, seq: int) -> dict | None:
    """The node's ``trust.store`` once its feed has applied ``seq``."""
    status, doc = node.request("GET", "/queue-state")
    trust = doc.get("trust") or {}
    return trust.get("store") if status == 200 and trust.get("feed_seq", 0) >= seq else None


def test_a_node_restarted_while_the_other_trims_under_writes_replays_them_all(tmp_path, pg_url):
    """A rolling restart under writes: while the first is down the second
    trims the shared log every 5 s, and the writes move the first's rows in
    and out of the due state. The log keeps what the first had not applied
    for ``trim_hold_s`` after it left, so its replay sees every change and
    its law balances; with no hold the trim takes them (it fails so:
    ``QUEUE_NODE_TRIM_HOLD_S=0``, the gap said in ``trust.store.gaps``)."""
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    now = time.time()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT 'k' || i, 'r', 86400, %s FROM generate_series(1, %s) AS i",
            (now - 3600, ROWS),
        )
    names = sorted(f"t-{uuid.uuid4().hex[:10]}" for _ in range(2))
    first, second = (NodeProcess(tmp_path / n, n, "--store", pg_url, env=ENV) for n in names)
    try:
        first.start()
        second.start()
        wait_for(lambda: _split([first, second], pg_url), 60, "the rows split")
        _wait_balanced([first, second], names, "both balanced")
        assert first.stop() == 0
        with psycopg.connect(pg_url, autocommit=True) as conn:
            # Every row out of the due state, back, and out again: each a
            # change the first's replay must see (its rows end not due, so
            # the counts differ from the save's).
            for round_ in range(3):
                due = now + 86400 if round_ % 2 == 0 else now - 1800 - round_
                conn.execute("UPDATE schedule SET due_at = %s", (due,))
            last = int(conn.execute("SELECT max(seq) FROM changes").fetchone()[0])
        # The second has applied them all, then trimmed once more: with no
        # hold that trim would take them.
        store = wait_for(lambda: _store_after(second, last), 30, "the second applied the writes")
        wait_for(lambda: _store_after(second, last)["trims"] > store["trims"], 30,
                 "the second trimmed after the writes")  # fmt: skip
        first.start()
        wait_for(lambda: _split([first, second], pg_url), 60, "the rows split again")
        _wait_balanced([first, second], names, "both balanced after the restart")
        assert first.request("GET", "/queue-state")[1]["trust"]["store"]["gaps"] == 0
    finally:
        finish([first], names[0])
        finish([second], names[1])
