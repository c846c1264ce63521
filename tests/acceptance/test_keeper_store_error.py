"""Acceptance: the keeper through a store error (keeper/outage.py), on a live node.

Real faults, no seam: the database file renamed away and back (the keeper's
reopen finds no file, then the same one), a second process holding SQLite's
write lock past the keeper's busy timeout, and the change log trimmed by
another program while the file was away (a gap the feed cannot bridge).
In each the keeper process must live on (same pid: no restart, no reload),
claims must keep working, ``trust.store`` must say what happened, and the
keeper must end exact with every write made meanwhile.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from node.testing import HarnessError, NodeProcess, finish, wait_for

ENV = {
    "QUEUE_NODE_STATE_INTERVAL_S": "0.5",  # queue-state follows within a second
    "QUEUE_NODE_VERIFY_INTERVAL_S": "3600",  # no scheduled walk repairs for us
}


@pytest.fixture
def node(tmp_path: Path, node_name: str):
    proc = NodeProcess(tmp_path / "data", node_name, env=ENV)
    yield proc
    finish([proc], node_name)


def _rows(prefix: str, n: int, due_at: float) -> list[dict[str, Any]]:
    return [{"key": f"{prefix}{i:04d}", "route": "r", "due_at": due_at} for i in range(n)]


def _write(node: NodeProcess, rows: list[dict[str, Any]]) -> None:
    status, body = node.request("POST", "/rows", rows)
    assert status == 200, body


def _state(node: NodeProcess) -> tuple[int, dict[str, Any]]:
    status, doc = node.request("GET", "/queue-state")
    assert status in (200, 503), (status, doc)
    return status, doc


def _store(node: NodeProcess) -> dict[str, Any]:
    return _state(node)[1]["trust"].get("store") or {}


def _vouched_with(node: NodeProcess, rows: int) -> dict[str, Any]:
    """Wait until the keeper vouches for exactly ``rows`` rows."""

    def check() -> dict[str, Any] | None:
        status, doc = _state(node)
        return doc if status == 200 and doc["now"]["rows"] == rows else None

    try:
        return wait_for(check, 30, f"queue-state 200 with {rows} rows")
    except HarnessError as exc:
        raise HarnessError(f"{exc}; last: {_state(node)}\n{node.log()}") from None


def _started(node: NodeProcess, rows: int) -> tuple[Path, int]:
    node.start()
    _write(node, _rows("k", rows, time.time() - 600))
    _vouched_with(node, rows)
    return node.data_dir / "schedule.db", node.pids()["keeper"]


def _claim(node: NodeProcess, n: int) -> list[dict[str, Any]]:
    status, body = node.request("POST", "/claim", {"max": n, "consumer": "t", "lease_s": 600})
    assert status == 200, body
    return body["leases"]


def test_database_renamed_away_and_back_keeper_serves_then_resumes_the_feed(node):
    db, keeper_pid = _started(node, 200)
    away = db.with_name("schedule.db.away")
    os.rename(db, away)
    try:
        # The keeper notices within a stat interval, serves on, and says so.
        wait_for(lambda: _store(node).get("state") == "unreachable", 10, "trust.store unreachable")
        status, doc = _state(node)
        assert status == 503 and doc["trust"]["vouched"] is False, doc
        assert doc["trust"]["live"] is True, doc["trust"]
        assert "store unreachable" in doc["trust"]["phase"], doc["trust"]
        assert "schedule.db" in doc["trust"]["store"]["error"], doc["trust"]["store"]
        # Claims work meanwhile: the keeper publishes from its copy once a
        # second (the workers' own connections still read the file); and
        # writes work.
        assert len(wait_for(lambda: _claim(node, 20), 10, "claims during the outage")) == 20
        _write(node, _rows("new", 30, time.time() - 60))
        wait_for(lambda: _store(node).get("attempts", 0) >= 3, 10, "three reopen attempts")
    finally:
        os.rename(away, db)
    doc = _vouched_with(node, 230)
    store = doc["trust"]["store"]
    assert store["state"] == "ok" and store["outages"] == 1, store
    assert store["resumed"] == 1 and store["last_verdict"] == "intact", store
    assert store["walks"] == 0 and doc["trust"]["repairs"]["total"] == 0, doc["trust"]
    assert node.pids()["keeper"] == keeper_pid  # the same process: no restart, no reload
    assert "keeper_store_error" in node.log() and "keeper_store_back" in node.log()
    # The rows written while the keeper was away are claimable from its copy.
    keys = {lease["key"] for lease in _claim(node, 1000)}
    assert {f"new{i:04d}" for i in range(30)} <= keys


HOLD_LOCK = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
conn.execute("INSERT INTO schedule (key, route, due_at) VALUES ('locked-writer', 'r', 0)")
print("held", flush=True)
sys.stdin.readline()  # the test says when
conn.execute("COMMIT")
"""


def test_a_writer_holding_the_lock_past_the_busy_timeout_does_not_end_the_keeper(node):
    db, keeper_pid = _started(node, 100)
    with subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(db)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:  # fmt: skip
        try:
            assert holder.stdout is not None and holder.stdin is not None
            assert holder.stdout.readline().strip() == "held"
            # The keeper's change-log trim (every 5 s) meets the lock: counted,
            # not fatal (it was: a 5 s stall, then the keeper died into a reload).
            wait_for(lambda: _store(node).get("write_failures", 0) >= 1
                     or node.pids()["keeper"] != keeper_pid, 20, "a failed trim")  # fmt: skip
            assert node.pids()["keeper"] == keeper_pid, node.log()
            assert "locked" in _store(node)["last_write_error"]
            # Claims never needed the write lock.
            assert len(wait_for(lambda: _claim(node, 10), 10, "claims under the lock")) == 10
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.wait(10) == 0
        finally:
            if holder.poll() is None:
                holder.kill()
    _vouched_with(node, 101)  # the locked writer's row, once committed
    assert node.pids()["keeper"] == keeper_pid
    assert _store(node)["outages"] == 0


def test_a_gap_in_the_change_log_forces_a_walk_that_repairs_a_planted_difference(
    tmp_path: Path, node_name: str
):
    """The store in a directory of its own, taken away as an unmounted
    volume would be: the test opens the file there, under the same directory
    name as the node's workers (SQLite names the WAL after the path), so
    its write and trim go into the same database."""
    from keeper.ask import ask

    db_dir = tmp_path / "volume"
    db_dir.mkdir()
    db = db_dir / "schedule.db"
    node = NodeProcess(tmp_path / "data", node_name, "--store", f"sqlite:///{db}", env=ENV)
    try:
        node.start()
        _write(node, _rows("k", 100, time.time() - 600))
        _vouched_with(node, 100)
        keeper_pid = node.pids()["keeper"]
        # Planted: the keeper's copy moves k0005 10,000 minutes late; nothing
        # in the feed will ever say otherwise.
        reply = wait_for(lambda: ask(node.name, {"op": "corrupt", "key": "k0005", "mode": "move"},
                                     timeout_s=2), 10, "corrupt")  # fmt: skip
        assert reply["ok"]
        away = tmp_path / "volume.away"
        os.rename(db_dir, away)
        try:
            wait_for(lambda: _store(node).get("state") == "unreachable", 10, "store unreachable")
            # Another program writes the file meanwhile and trims the whole
            # change log: what it wrote is nowhere in the feed.
            conn = sqlite3.connect(away / "schedule.db", isolation_level=None)
            try:
                conn.execute("INSERT INTO schedule (key, route, due_at) VALUES ('gap-row', 'r', 0)")
                conn.execute("DELETE FROM changes")
            finally:
                conn.close()
        finally:
            os.rename(away, db_dir)
        doc = _vouched_with(node, 101)
        store = doc["trust"]["store"]
        assert store["walks"] == 1 and store["last_verdict"] == "gap", store
        assert doc["trust"]["repairs"]["feed_missed"] >= 2, doc["trust"]  # gap-row and k0005
        assert node.pids()["keeper"] == keeper_pid
        status, body = node.request("GET", "/rows?key=k0005")
        assert status == 200, body
        assert body["keeper"]["due_minute"] == int(body["row"]["due_at"] // 60), body
    finally:
        finish([node], node_name)


def test_changes_trimmed_unread_are_a_gap_the_walk_repairs(node):
    """No outage: another program writes a row and deletes its change in one
    transaction, so the keeper never reads it; the next change's seq skips
    one, and the keeper walks the table."""
    from keeper.ask import ask

    db, keeper_pid = _started(node, 100)
    reply = wait_for(lambda: ask(node.name, {"op": "corrupt", "key": "k0007", "mode": "drop"},
                                 timeout_s=2), 10, "corrupt")  # fmt: skip
    assert reply["ok"]
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO schedule (key, route, due_at) VALUES ('hidden', 'r', 0)")
        conn.execute("DELETE FROM changes WHERE key = 'hidden'")
        conn.execute("COMMIT")
    finally:
        conn.close()
    _write(node, _rows("after", 1, time.time() - 60))
    doc = _vouched_with(node, 102)  # k0007 back, hidden and after0000 held
    assert doc["trust"]["store"]["gaps"] == 1, doc["trust"]["store"]
    assert doc["trust"]["repairs"]["feed_missed"] >= 2, doc["trust"]  # hidden and k0007
    assert node.pids()["keeper"] == keeper_pid
    assert "keeper_feed_gap" in node.log()
