"""Acceptance: a PostgreSQL node's keeper is woken by LISTEN/NOTIFY (issue
18, item 1; docs/postgres.md, "NOTIFY: waking the keeper").

Every timed wake of the keeper is set far off: the fallback poll
(``QUEUE_NODE_KEEPER_POLL_S``) and the publish at 60 s, the state at 300 s,
the heartbeat at 600 s. A write by another program posts nothing the
node knows of; only the keeper's LISTEN thread can wake it before those
deadlines. So each outside write is applied (the keeper's own lag histogram,
read through ``GET /metrics``, which wakes nothing) long before any timed
tick could have come: without the thread each would wait for the next
publish, a minute after the last. The second test ends the LISTEN session
from the server's side (``pg_terminate_backend``); the thread reconnects and
wakes the keeper again."""

from __future__ import annotations

import re
import time
import urllib.request

import psycopg
import pytest

from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from tests import pg

pytestmark = pytest.mark.timeout(120)

# Every timed tick of the keeper this far off (or further).
TIMED_TICK_S = 60.0
ENV = {
    "QUEUE_NODE_KEEPER_POLL_S": str(TIMED_TICK_S),
    "QUEUE_NODE_PUBLISH_INTERVAL_S": str(TIMED_TICK_S),
    "QUEUE_NODE_STATE_INTERVAL_S": "300",
    "QUEUE_NODE_HEARTBEAT_S": "600",
    "QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": "1500",
}
# A write must be applied within this: a tenth of the time to the next
# timed tick (a loaded machine applies in milliseconds).
APPLIED_WITHIN_S = TIMED_TICK_S / 10

_LAG = re.compile(r'^queue_node_keeper_lag_seconds_(count|sum)\{origin="outside"\} (\S+)$', re.M)


@pytest.fixture
def node(tmp_path, node_name, pg_url):
    PostgresStore(pg_url).close()  # the schema, in a database new to this run
    pg.reset(pg_url)
    proc = NodeProcess(tmp_path / "data", node_name, "--store", pg_url, env=ENV)
    yield proc
    finish([proc], node_name)


def _outside_lag(node: NodeProcess) -> tuple[int, float]:
    """How many outside changes the keeper observed in its lag histogram
    (one a feed batch: the oldest), and the sum of their lags."""
    with urllib.request.urlopen(node.base_url + "/metrics", timeout=10) as resp:
        found = dict(_LAG.findall(resp.read().decode()))
    return int(float(found.get("count", 0))), float(found.get("sum", 0.0))


def _write_outside(pg_url: str, key: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at) VALUES (%s, 'r', 3600, %s)",
            (key, time.time() + 3600),
        )


def _applied_promptly(node: NodeProcess, pg_url: str, key: str) -> float:
    """Write ``key`` from outside the node; return the keeper's own
    commit-to-applied lag of it, once applied, which must come within
    APPLIED_WITHIN_S of the write (HarnessError otherwise)."""
    count, total = _outside_lag(node)
    _write_outside(pg_url, key)

    def applied() -> tuple[int, float] | None:
        now = _outside_lag(node)
        return now if now[0] > count else None

    new_count, new_total = wait_for(applied, APPLIED_WITHIN_S, f"{key} applied by the keeper")
    assert new_count == count + 1
    return new_total - total


def _listener_pids(pg_url: str, node_name: str) -> list[int]:
    """The backends of the keeper's LISTEN thread, LISTEN in place and idle."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        found = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND state = 'idle'"
            " AND query IN ('LISTEN queue_node_changes', 'SELECT 1')",
            (f"queue-node listen {node_name}",),
        ).fetchall()
    return [pid for (pid,) in found]


def test_an_outside_write_wakes_the_keeper_before_any_timed_tick(node, pg_url):
    node.start()
    wait_for(lambda: _listener_pids(pg_url, node.name), 10, "the keeper's LISTEN session")
    lags = [_applied_promptly(node, pg_url, f"outside{i}") for i in range(3)]
    assert max(lags) < APPLIED_WITHIN_S, lags


def test_a_write_held_back_by_one_that_rolls_back_is_applied_without_a_notification(node, pg_url):
    # A transaction takes a seq and stays open; a later write commits (its
    # NOTIFY wakes the keeper, whose feed stops at the open seq: it may
    # still commit). The open one rolls back, which notifies nobody: the
    # keeper polls while its feed waits on a hole (``holes_pending``), or
    # the later write would wait for the next timed tick.
    node.start()
    wait_for(lambda: _listener_pids(pg_url, node.name), 10, "the keeper's LISTEN session")
    count, _total = _outside_lag(node)
    held = psycopg.connect(pg_url)
    try:
        held.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at) VALUES ('held', 'r', 3600, %s)",
            (time.time() + 3600,),
        )
        _write_outside(pg_url, "behind")
        held.rollback()
    finally:
        held.close()
    wait_for(lambda: _outside_lag(node)[0] > count, APPLIED_WITHIN_S, "the write behind the hole")


def test_a_dropped_listen_session_is_reconnected_and_wakes_again(node, pg_url):
    node.start()
    first = wait_for(lambda: _listener_pids(pg_url, node.name), 10, "the LISTEN session")
    _applied_promptly(node, pg_url, "before")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute("SELECT pg_terminate_backend(%s)", (first[0],)).fetchone()[0]
    again = wait_for(
        lambda: [p for p in _listener_pids(pg_url, node.name) if p not in first],
        10, "a new LISTEN session",
    )  # fmt: skip
    assert len(again) == 1
    # While it was down the keeper polled fast; back, only NOTIFY wakes it.
    # Two writes, so the second comes after the keeper has seen LISTEN back
    # (the thread posts the wake once it listens) and waits long again.
    lags = [_applied_promptly(node, pg_url, f"after{i}") for i in range(2)]
    assert max(lags) < APPLIED_WITHIN_S, lags
    assert "keeper_listen_failed" in node.log() and "keeper_listen_resumed" in node.log()
