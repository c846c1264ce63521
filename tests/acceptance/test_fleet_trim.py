"""Acceptance: a fleet's shared change log is trimmed only below the lowest
position every live node has applied and saved (issue 18; docs/fleet.md,
"The shared change log"). Two real nodes on one database: writes flow, both
apply, the log is trimmed below both; a node whose keeper is stopped
(SIGSTOP) holds the log back until it lapses from the live list, and then
it does not; back (SIGCONT), it finds its gap, walks, and is exact again."""

from __future__ import annotations

import os
import signal
import time
import uuid

import psycopg
import pytest

from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from tests import pg

pytestmark = pytest.mark.timeout(240)

TIMEOUT_S = 8.0  # membership_timeout_s: longer than one trim interval (5 s)
FLEET_ENV = {
    "QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": str(TIMEOUT_S),
    "QUEUE_NODE_HEARTBEAT_S": "0.2",
    "QUEUE_NODE_STATE_INTERVAL_S": "0.5",  # the saved position moves on often
    "QUEUE_NODE_TRIM_HOLD_S": "0",  # a node out of the list holds nothing back
}

# In one statement: how far the log was trimmed, and each node's reported
# position and whether it is live (by the database's clock).
POSITIONS = """SELECT (SELECT through FROM changes_trimmed), name, applied_seq,
                      heartbeat_at > now() - make_interval(secs => %s) AND left_at IS NULL
                 FROM fleet_nodes ORDER BY name"""


def _positions(pg_url: str) -> tuple[int, dict[str, tuple[int | None, bool]]]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(POSITIONS, (TIMEOUT_S,)).fetchall()
        if not rows:
            return conn.execute("SELECT through FROM changes_trimmed").fetchone()[0], {}
    return rows[0][0], {name: (seq, live) for _t, name, seq, live in rows}


def _no_heartbeat_in_flight(pg_url: str) -> bool:
    """No session of the run's database is inside a statement or transaction
    on the node list: a heartbeat sent before its keeper stopped has landed."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        busy = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND state IN ('active', 'idle in transaction')"
            " AND query ILIKE '%fleet_nodes%'"
        ).fetchone()[0]
    return busy == 0


def _write(node: NodeProcess, start: int, n: int) -> None:
    rows = [{"key": f"k{i}", "route": "r", "cadence_s": 3600, "due_at": time.time() + 600}
            for i in range(start, start + n)]  # fmt: skip
    assert node.request("POST", "/rows", rows) == (200, {"upserted": n})


def _never_past_a_live_node(pg_url: str) -> tuple[int, dict]:
    """The log's trim position, checked against every live node's."""
    through, nodes = _positions(pg_url)
    for name, (seq, live) in nodes.items():
        if live:
            assert seq is not None and through <= seq, (name, through, nodes)
    return through, nodes


def _trust(node: NodeProcess) -> dict:
    from shm.state import read_state

    try:
        return read_state(node.name).get("trust") or {}
    except Exception:  # noqa: BLE001 - not written yet
        return {}


def _exact(node: NodeProcess, live: list[str]) -> bool:
    trust = _trust(node)
    member = trust.get("membership") or {}
    return bool(trust.get("exact")) and member.get("live") == live


def test_the_shared_log_is_trimmed_below_every_live_node_and_a_stalled_one_holds_it_until_it_lapses(
    tmp_path, pg_url
):
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    names = sorted(f"t-{uuid.uuid4().hex[:10]}" for _ in range(2))
    nodes = [NodeProcess(tmp_path / n, n, "--store", pg_url, env=FLEET_ENV) for n in names]
    fast, slow = nodes
    try:
        for node in nodes:
            node.start()
        wait_for(lambda: all(_exact(n, names) for n in nodes), 60, "both nodes exact")

        # Writes flow, both apply; the log is trimmed below both positions.
        for round_ in range(4):
            _write(fast, round_ * 50, 50)
        top = 4 * 50

        def trimmed_below_both() -> bool:
            through, seen = _never_past_a_live_node(pg_url)
            return through > 0 and all(seq and seq >= top for seq, _live in seen.values())

        wait_for(trimmed_below_both, 60, "both nodes applied every write and the log trimmed")

        # The slow node's keeper stops: its position stays where it was.
        keeper = slow.pids()["keeper"]
        os.kill(keeper, signal.SIGSTOP)
        stopped = True
        try:
            wait_for(lambda: _no_heartbeat_in_flight(pg_url), 10,
                     "a heartbeat in flight when it stopped landed")  # fmt: skip
            held = _positions(pg_url)[1][slow.name][0]
            assert held is not None
            for round_ in range(4, 8):
                _write(fast, round_ * 50, 50)
            wait_for(lambda: (_positions(pg_url)[1][fast.name][0] or 0) > held + 150, 30,
                     "the fast node applied and saved the new writes")  # fmt: skip
            # While the slow node is live, the log is not trimmed past it.
            while _positions(pg_url)[1][slow.name][1]:
                through, _seen = _never_past_a_live_node(pg_url)
                assert through <= held
                time.sleep(0.2)  # sampling the trim position until the lapse
            # Lapsed: it holds the log back no more.
            wait_for(lambda: _positions(pg_url)[0] > held, 30,
                     "the log trimmed past the lapsed node")  # fmt: skip
            assert _positions(pg_url)[1][slow.name][0] == held
        finally:
            if stopped:
                os.kill(keeper, signal.SIGCONT)

        # Back: it heartbeats into the list again, finds the gap the trim
        # left in its feed, walks, and is exact; its position moves on.
        through = _positions(pg_url)[0]
        wait_for(lambda: all(_exact(n, names) for n in nodes), 60, "both nodes exact again")
        wait_for(lambda: (_positions(pg_url)[1][slow.name][0] or 0) >= through, 30,
                 "the slow node's position past the trim")  # fmt: skip
        _never_past_a_live_node(pg_url)
        assert _trust(slow)["store"]["gaps"] >= 1  # it found the gap the trim left
    finally:
        finish(nodes, names[0])
        finish([], names[1])
