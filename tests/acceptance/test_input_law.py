"""The input side of the books on a live node (docs/accounting.md):

    received + requeued = routed + waiting + withdrawn

A mixed load (writes, claims, results, releases, expiries, deletes and
reschedules) ends with the law exact and every term as counted by hand; then
the law is broken on purpose twice, and each time ``/accounting`` says
``balanced: false`` with the input side's gap, and balanced again once the
cause is put right: a key dropped from the keeper's copy without a grant
(repaired by the verification walk), and a due row the keeper refused (too
many classes, written straight into the SQLite file by another program;
balanced again once that row is deleted).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from keeper.ask import ask
from node.client import Client
from node.testing import NodeProcess, wait_for

pytestmark = pytest.mark.timeout(180)

MAX_CLASSES = 3
ENV = {
    "QUEUE_NODE_STATE_INTERVAL_S": "0.2",  # the keeper's counts every 0.2 s (default 5 s)
    "QUEUE_NODE_MAX_CLASSES": str(MAX_CLASSES),
}


@pytest.fixture
def node(tmp_path: Path) -> Any:
    n = NodeProcess(tmp_path / "data", f"t-{uuid.uuid4().hex[:12]}", env=ENV).start()
    try:
        yield n
    finally:
        assert n.stop() == 0, n.log()


def _settled(client: Client, **want: int) -> dict[str, Any]:
    """/accounting once it is balanced with a known input side and shows
    ``want``; the last answer in the failure otherwise."""
    last: dict[str, Any] = {}

    def ok() -> bool:
        nonlocal last
        last = client.accounting()
        return (
            last["balanced"]
            and last["gaps"]["input"] == 0
            and _adds_up(last)
            and all(last[k] == v for k, v in want.items())
        )

    try:
        wait_for(ok, 30, "a balanced /accounting")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: last {last}") from None
    return last


def _claim_exactly(client: Client, n: int, lease_s: float, consumer: str) -> list[Any]:
    """``n`` grants, claimed as the keeper publishes the rows written last."""
    got: list[Any] = []

    def enough() -> bool:
        got.extend(client.claim(n - len(got), lease_s=lease_s, consumer=consumer))
        return len(got) == n

    wait_for(enough, 30, f"{n} grants")
    return got


def _adds_up(acct: dict[str, Any]) -> bool:
    """The law on the terms shown (the keeper's as of its last counts, the
    lease table's live): they agree once the keeper has counted since the
    last lease moved."""
    left = acct["received"] + acct["requeued"]
    return left == acct["routed"] + acct["waiting"] + acct["withdrawn"]


def _off(client: Client, gap: int) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def ok() -> bool:
        nonlocal last
        last = client.accounting()
        return not last["balanced"] and last["gaps"]["input"] == gap

    try:
        wait_for(ok, 30, f"/accounting off by {gap} on the input side")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: last {last}") from None
    return last


def test_the_input_law_holds_after_a_mixed_load_and_names_what_breaks_it(node: Any) -> None:
    with Client(node.base_url) as client:
        _mixed_load_then_broken(node, client)


def _mixed_load_then_broken(node: Any, client: Client) -> None:
    now = time.time()
    due = [f"d{i:02}" for i in range(30)]
    rows = [{"key": k, "route": "r", "due_at": now - 600} for k in due]
    rows += [{"key": f"f{i}", "route": "r", "due_at": now + 7200} for i in range(5)]
    assert client.upsert(rows) == 35
    _settled(client, received=30, waiting=30, routed=0, withdrawn=0)

    # 20 leases for 10 minutes, 3 for a second (they expire).
    long = _claim_exactly(client, 20, 600, "a")
    short = _claim_exactly(client, 3, 1, "b")
    done, released, live = long[:8], long[8:12], long[12:]
    assert all(isinstance(i, int) for i in client.complete_many(
        [(g.lease_id, g.key, {"n": 1}) for g in done]))
    for g in released:
        client.release(g.lease_id, g.key, error="handler failed")
    granted = {g.key for g in long + short}
    never = [k for k in due if k not in granted]
    assert len(never) == 7
    # Withdrawn: two never granted deleted, two moved past now, one held key deleted.
    assert client.delete(never[:2] + [released[0].key]) == 3
    assert client.upsert([{"key": k, "route": "r", "due_at": now + 3600} for k in never[2:4]]) == 2

    # The short leases expire (requeued), results are acked or not: no matter.
    acct = _settled(client, routed=23, requeued=7, withdrawn=5, received=30, in_flight=len(live))
    assert (acct["expired"], acct["released"]) == (3, 4)
    # Due now: 30 - 8 done (moved ahead) - 5 withdrawn = 17, 8 of them leased.
    assert acct["waiting"] == 17 - len(live)
    state = client.queue_state()
    counters = state["counters"]
    assert (counters["received"], counters["withdrawn"], counters["waiting"]) == (30, 5, 9)

    # Broken on purpose: a due key nobody leased dropped from the keeper's copy.
    victim = never[4]
    assert (ask(node.name, {"op": "corrupt", "key": victim, "mode": "drop"}, 5.0) or {})["ok"]
    off = _off(client, 1)
    assert off["waiting"] == 8
    assert ask(node.name, {"op": "verify"}, 5.0) is not None
    _settled(client, waiting=9, received=30, withdrawn=5)

    # A due row the keeper must refuse: a fourth class, written straight into
    # the file (the node refuses such a write itself, too_many_classes).
    assert client.upsert([{"key": "c1", "route": "r1", "due_at": now + 7200},
                          {"key": "c2", "route": "r2", "due_at": now + 7200}]) == 2
    db = sqlite3.connect(node.data_dir / "schedule.db", timeout=10)
    try:
        with db:
            db.execute(
                "INSERT INTO schedule (key, route, due_at) VALUES ('x', 'r-other', ?)",
                (now - 60,),
            )
        off = _off(client, 1)
        assert off["received"] == 31 and off["waiting"] == 9
        refused = client.queue_state()["trust"]["refused"]
        assert refused["keys"] == ["x"] and refused["due"] == 1 and refused["rows"] == 1, refused
        with db:
            db.execute("DELETE FROM schedule WHERE key = 'x'")
    finally:
        db.close()
    _settled(client, received=31, withdrawn=6, waiting=9)


@pytest.fixture
def slow_counts_node(tmp_path: Path) -> Any:
    """A node whose keeper saves its counts once, at the end of its load,
    and not again for 300 s: whatever happens next is in no saved count."""
    env = {**ENV, "QUEUE_NODE_STATE_INTERVAL_S": "300"}
    n = NodeProcess(tmp_path / "data", f"t-{uuid.uuid4().hex[:12]}", env=env).start()
    try:
        yield n
    finally:
        assert n.stop() == 0, n.log()


def test_received_and_withdrawn_survive_a_keeper_kill_9_exactly(slow_counts_node: Any) -> None:
    """Everything happens after the keeper's last save and before its kill
    -9: rows come due, are granted, finished (their write-back moves them
    on), released, deleted and rescheduled. The next keeper counts it all
    from the change log and the books balance, every term as counted by hand."""
    node = slow_counts_node
    with Client(node.base_url) as client:
        wait_for(lambda: client.accounting()["gaps"]["input"] == 0, 30, "the keeper's first count")
        now = time.time()
        due = [f"d{i:02}" for i in range(12)]
        rows = [{"key": k, "route": "r", "due_at": now - 600} for k in due]
        rows += [{"key": f"f{i}", "route": "r", "due_at": now + 7200} for i in range(3)]
        assert client.upsert(rows) == 15

        grants = _claim_exactly(client, 12, 600, "python")
        done, released, live = grants[:4], grants[4:7], grants[7:]
        assert all(isinstance(i, int) for i in client.complete_many(
            [(g.lease_id, g.key, "r") for g in done]))
        for g in released:
            client.release(g.lease_id, g.key, error="no")
        for g in live[:2]:
            client.release(g.lease_id, g.key)  # then moved on (withdrawn) and deleted
        assert client.upsert([{"key": live[0].key, "route": "r", "due_at": now + 3600}]) == 1
        assert client.delete([live[1].key, released[0].key]) == 2
        # A future row moved to due, then deleted: came due and withdrawn.
        assert client.upsert([{"key": "f0", "route": "r", "due_at": now - 60}]) == 1
        assert client.delete(["f0"]) == 1

        keeper = node.pids_by_role()["keeper"]
        os.kill(keeper, signal.SIGKILL)
        wait_for(lambda: node.pids_by_role().get("keeper") not in (None, keeper), 30,
                 "a new keeper")
        # received: 12 written due + f0 = 13. withdrawn: live[0] moved on,
        # live[1] and released[0] deleted (held: not leased), f0 deleted = 4.
        # requeued: 3 + 2 released. routed 12. Due now: 12 - 4 done - 3
        # withdrawn of the twelve = 5, of which 3 leased: waiting 2.
        acct = _settled(client, received=13, withdrawn=4, routed=12, requeued=5, in_flight=3)
        assert acct["waiting"] == 2
