"""The keeper's self-checks on a live node (DESIGN: "re-reads top 64 per
publish, hourly verification walk"; "a stalled keeper is still served
from"), each shown doing its work, not only not failing:

- the top-of-set re-read repairs a wrong entry planted in the keeper's copy
  (a key the table has due in two hours held as due since the epoch, and a
  key the table does not have): ``trust.repairs.top`` and
  ``queue_node_keeper_repairs_total{kind="top"}`` count both, and claims
  grant neither (the key is granted once its row really comes due);
- after a mixed load (writes, deletes, reschedules, completions, releases
  with an error that hold their keys, expiries) and a ``kill -9`` of the
  keeper, a verification walk on the live node repairs nothing and the
  keeper's copy equals the table row for row (invariant 6), with both laws
  of ``/accounting`` exact;
- a SIGSTOPped keeper's last set is claimed from until it drains (each grant
  checked against its row: a row deleted or moved since is not granted),
  then claims answer empty, never an error, while ``/queue-state`` answers
  503 naming the stall; after SIGCONT it vouches again and claims resume.

The keeper's test hooks (``QUEUE_NODE_TEST_HOOKS=1``, which
``node.testing.NodeProcess`` sets) plant the wrong entries and start a walk.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest

from keeper.ask import ask
from node.client import Client
from node.testing import NodeProcess, wait_for

pytestmark = pytest.mark.timeout(180)

ENV = {"QUEUE_NODE_STATE_INTERVAL_S": "0.2"}  # the keeper's counts every 0.2 s (default 5 s)


@pytest.fixture
def node(tmp_path: Path) -> Any:
    n = NodeProcess(tmp_path / "data", f"t-{uuid.uuid4().hex[:12]}", env=ENV).start()
    try:
        yield n
    finally:
        assert n.stop() == 0, n.log()


# -- what the node says ---------------------------------------------------------------------


def _balanced(client: Client, **want: int) -> dict[str, Any]:
    """/accounting once both laws hold and it shows ``want``."""
    last: dict[str, Any] = {}

    def ok() -> bool:
        nonlocal last
        last = client.accounting()
        left = last["received"] + last["requeued"]
        return (
            last["balanced"]
            and last["gaps"]["input"] == 0
            and left == last["routed"] + last["waiting"] + last["withdrawn"]
            and all(last[k] == v for k, v in want.items())
        )

    try:
        wait_for(ok, 30, "a balanced /accounting")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: last {last}") from None
    return last


def _repairs_metric(node: NodeProcess) -> dict[str, float]:
    """``queue_node_keeper_repairs_total`` by kind, from ``GET /metrics``."""
    with urllib.request.urlopen(node.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(r'^queue_node_keeper_repairs_total\{kind="(\w+)"\} (\S+)$', text, re.M)
    return {kind: float(value) for kind, value in found}


def _ask(node: NodeProcess, request: dict[str, Any]) -> dict[str, Any]:
    reply = ask(node.name, request, 5.0)
    assert isinstance(reply, dict), f"the keeper did not answer {request}"
    return reply


def _published(node: NodeProcess, keys: list[str]) -> None:
    """Wait until every key is in a set the keeper published."""
    wait_for(lambda: all(_ask(node, {"op": "explain", "key": k})["in_ready_set"] for k in keys),
             30, "the keys published")  # fmt: skip


def _claim_all(client: Client, lease_s: float = 600) -> list[Any]:
    """Claim until a claim comes back empty."""
    grants: list[Any] = []
    while True:
        got = client.claim(10, lease_s=lease_s)
        if not got:
            return grants
        grants += got


# -- 1. the top-of-set re-read ---------------------------------------------------------------


def test_the_top_of_set_re_read_repairs_planted_wrong_entries(node: NodeProcess) -> None:
    now = time.time()
    due = [f"d{i}" for i in range(5)]
    rows = [{"key": k, "route": "r", "due_at": now - 600} for k in due]
    rows += [{"key": k, "route": "r", "due_at": now + 7200} for k in ("later", "control")]
    with Client(node.base_url) as client:
        assert client.upsert(rows) == 7
        _balanced(client, received=5, waiting=5, routed=0)
        _published(node, due)
        before = client.queue_state()["trust"]
        assert before["repairs"]["top"] == 0 and before["verify"]["runs"] == 0, before

        # The keeper's copy made wrong twice: "later" held as due since the
        # epoch (it heads the next publish), and "ghost", which the table
        # does not have, due since the epoch too.
        planted = _ask(node, {"op": "corrupt", "key": "later", "mode": "move",
                              "minutes": -(10**9)})  # fmt: skip
        assert planted["ok"]
        assert _ask(node, {"op": "corrupt", "key": "ghost", "mode": "phantom"})["ok"]

        def repaired() -> dict[str, Any] | None:
            trust = client.queue_state()["trust"]
            return trust if trust["repairs"]["top"] >= 2 else None

        trust = wait_for(repaired, 30, "the top-of-set re-read repairing both")
        assert trust["repairs"]["top"] == 2, trust
        # The re-read did it, not a walk (none runs for an hour).
        assert trust["verify"]["runs"] == 0 and trust["repairs"]["total"] == 0, trust
        assert _repairs_metric(node) == {"top": 2.0, "feed_missed": 0.0, "membership": 0.0}

        # The keeper's copy is the table's again.
        later = _ask(node, {"op": "explain", "key": "later"})
        assert later["due_minute"] == int((now + 7200) // 60) and not later["due"], later
        assert later["version"] == client.row("later")["row"]["version"], later
        # The set it was published in goes on being claimed from (a claim
        # finds its row not due and skips it); the next publish leaves it out.
        wait_for(lambda: not _ask(node, {"op": "explain", "key": "later"})["in_ready_set"], 30,
                 "a publish without the repaired key")  # fmt: skip
        assert not _ask(node, {"op": "explain", "key": "ghost"})["held"]

        # Claims grant the due rows and neither planted key; "later" is
        # granted once its row really comes due.
        grants = _claim_all(client)
        assert sorted(g.key for g in grants) == due
        assert client.upsert([{"key": "later", "route": "r", "due_at": now - 60}]) == 1
        got = wait_for(lambda: client.claim(10, lease_s=600), 30, "the rescheduled key granted")
        assert [g.key for g in got] == ["later"]
        assert _claim_all(client) == []
        _balanced(client, received=6, routed=6, waiting=0, in_flight=6)
        assert client.queue_state()["trust"]["repairs"]["top"] == 2


# -- 2. the verification walk after a mixed load and a kill -9 --------------------------------


def _dump(node: NodeProcess) -> dict[str, tuple[int, int]]:
    """The keeper's copy as key -> (due minute, version)."""
    reply = _ask(node, {"op": "dump"})
    assert reply["ok"], reply
    doc = msgpack.unpackb(Path(reply["path"]).read_bytes())
    return {key: (minute, version) for key, minute, _cid, version in doc["rows"]}


def _table(node: NodeProcess) -> dict[str, tuple[int, int]]:
    conn = sqlite3.connect(f"file:{node.data_dir / 'schedule.db'}?mode=ro", uri=True, timeout=10)
    try:
        rows = conn.execute("SELECT key, due_at, version FROM schedule").fetchall()
    finally:
        conn.close()
    return {key: (int(due_at // 60), version) for key, due_at, version in rows}


def _kill_keeper(node: NodeProcess) -> None:
    keeper = node.pids_by_role()["keeper"]
    os.kill(keeper, signal.SIGKILL)
    wait_for(lambda: node.pids_by_role().get("keeper") not in (None, keeper), 30, "a new keeper")


def test_a_walk_after_a_mixed_load_and_a_keeper_kill_9_repairs_nothing(
    node: NodeProcess,
) -> None:
    now = time.time()
    due = [f"d{i:02}" for i in range(40)]
    rows = [
        {"key": k, "route": "r" if i % 2 else "s", "due_at": now - 600 - i,
         "sitemap": i % 5 == 0, **({"cadence_s": 900} if i % 3 == 0 else {})}
        for i, k in enumerate(due)
    ]  # fmt: skip
    rows += [{"key": f"f{i}", "route": "r", "due_at": now + 3600 + i} for i in range(10)]
    with Client(node.base_url) as client:
        assert client.upsert(rows) == 50
        _balanced(client, received=40, waiting=40)
        _published(node, due)

        long = client.claim(20, lease_s=600, consumer="a")
        short = client.claim(4, lease_s=1, consumer="b")  # they expire: held
        assert (len(long), len(short)) == (20, 4)
        done, failed, live = long[:8], long[8:14], long[14:]
        assert all(isinstance(i, int) for i in client.complete_many(
            [(g.lease_id, g.key, {"n": 1}) for g in done]))  # fmt: skip
        for g in failed:
            client.release(g.lease_id, g.key, error="handler failed")  # held
        granted = {g.key for g in long + short}
        never = [k for k in due if k not in granted]
        assert client.delete(never[:3] + [failed[0].key]) == 4
        assert client.upsert(
            [{"key": k, "route": "r", "due_at": now + 1800} for k in never[3:5]]
            + [{"key": "f0", "route": "r", "due_at": now + 3600, "payload": {"v": 2}}]
        ) == 3

        # The keeper dies with all of that applied or not; more happens
        # while the next one starts, and once it is live.
        _kill_keeper(node)
        assert client.upsert([{"key": f"n{i}", "route": "s", "due_at": now - 30}
                              for i in range(3)]) == 3  # fmt: skip
        assert client.delete(["f1"]) == 1
        wait_for(lambda: client.queue_state()["trust"]["vouched"], 30, "the new keeper live")
        assert client.upsert([{"key": f"n{i}", "route": "s", "due_at": now - 30}
                              for i in range(3, 5)]) == 2  # fmt: skip
        assert client.delete(["f2", never[5]]) == 2
        assert all(isinstance(i, int) for i in client.complete_many(
            [(g.lease_id, g.key, "late") for g in live[:3]]))  # fmt: skip
        client.release(live[3].lease_id, live[3].key)  # no error: not held
        # Moved on while leased, then its result: the write-back loses to the write.
        assert client.upsert([{"key": live[4].key, "route": "r", "due_at": now + 900}]) == 1
        assert isinstance(client.complete(live[4].lease_id, live[4].key, "x"), int)

        # Quiet: the short leases expired, the new keeper caught up.
        wait_for(lambda: client.accounting()["expired"] == 4, 30, "the short leases expired")
        wait_for(lambda: client.accounting()["gaps"]["input_bound"] == 0, 30, "the feed applied")

        # A walk on the live node: it compares every row and repairs nothing.
        assert _ask(node, {"op": "verify"})["ok"]

        def walked() -> dict[str, Any] | None:
            trust = client.queue_state()["trust"]
            return trust if trust["verify"]["runs"] >= 1 else None

        trust = wait_for(walked, 60, "the verification walk to finish")
        table = _table(node)
        verify = trust["verify"]
        assert verify["last_repairs"] == 0, trust
        assert verify["compared"] == 2 * len(table), trust  # the table, then the keeper's keys
        assert trust["repairs"] == {"total": 0, "membership": 0, "feed_missed": 0, "top": 0}
        assert _repairs_metric(node) == {"top": 0.0, "feed_missed": 0.0, "membership": 0.0}
        assert _dump(node) == table
        acct = _balanced(client, routed=24, expired=4, in_flight=len(live) - 5, received=45,
                         withdrawn=7)  # fmt: skip
        assert acct["finished"] == 12 and acct["released"] == 7, acct


def test_repairs_counted_before_a_keeper_kill_9_are_counted_after_it(node: NodeProcess) -> None:
    """trust.repairs, trust.verify and queue_node_keeper_repairs_total are
    lifetime counts: saved in the store's meta as they are counted, so the
    keeper that follows a kill -9 goes on from them (it used to start at 0)."""
    now = time.time()
    rows = [{"key": f"d{i}", "route": "r", "due_at": now - 600} for i in range(5)]
    with Client(node.base_url) as client:
        assert client.upsert(rows) == 5
        _published(node, ["d0"])
        # One repair by the top-of-set re-read (a phantom at the head) and
        # one by a walk (a key dropped from the copy).
        assert _ask(node, {"op": "corrupt", "key": "ghost", "mode": "phantom"})["ok"]
        wait_for(lambda: client.queue_state()["trust"]["repairs"]["top"] == 1, 30, "top repair")
        assert _ask(node, {"op": "corrupt", "key": "d3", "mode": "drop"})["ok"]
        assert _ask(node, {"op": "verify"})["ok"]
        wait_for(lambda: client.queue_state()["trust"]["verify"]["runs"] == 1, 60, "the walk")
        before = client.queue_state()["trust"]
        want = {"total": 1, "membership": 0, "feed_missed": 1, "top": 1}
        assert before["repairs"] == want, before
        metric = {"top": 1.0, "feed_missed": 1.0, "membership": 0.0}
        assert _repairs_metric(node) == metric

        _kill_keeper(node)
        keeper = node.pids_by_role()["keeper"]

        def after() -> dict[str, Any] | None:
            status, doc = node.request("GET", "/queue-state")
            return doc["trust"] if status == 200 else None

        trust = wait_for(after, 30, "the new keeper vouching")
        assert trust["repairs"] == want, trust
        assert trust["verify"]["runs"] == 1 and trust["verify"]["last_repairs"] == 1, trust
        assert trust["verify"]["top_checked"] >= before["verify"]["top_checked"], trust
        assert _repairs_metric(node) == metric
        assert node.pids_by_role()["keeper"] == keeper  # the same new keeper throughout


# -- 3. a stalled keeper ---------------------------------------------------------------------


def test_a_stopped_keepers_last_set_is_claimed_until_it_drains(node: NodeProcess) -> None:
    now = time.time()
    due = [f"d{i:02}" for i in range(30)]
    rows = [{"key": k, "route": "r", "due_at": now - 600 - i} for i in range(30) for k in [due[i]]]
    with Client(node.base_url) as client:
        assert client.upsert(rows) == 30
        _balanced(client, received=30, waiting=30)
        _published(node, due)  # every due key in the set the keeper published last
        keeper = node.pids_by_role()["keeper"]
        os.kill(keeper, signal.SIGSTOP)
        try:
            # Rows changed since the publish: each grant is checked against its row.
            assert client.delete([due[0]]) == 1
            assert client.upsert([{"key": due[1], "route": "r", "due_at": now + 3600},
                                  {"key": "new", "route": "r", "due_at": now - 60}]) == 2
            grants = []
            for _ in range(3):
                got = client.claim(5, lease_s=600)
                assert len(got) == 5
                grants += got
            client.release(grants[0].lease_id, grants[0].key, error="failed")  # held
            assert isinstance(client.complete(grants[1].lease_id, grants[1].key, "ok"), int)
            grants += _claim_all(client)
            keys = [g.key for g in grants]
            # The set drained: everything it held but the two rows changed,
            # once each, and nothing written after it (the keeper never saw it).
            assert sorted(keys) == due[2:], keys
            assert client.claim(5, lease_s=600) == []

            def stalled() -> dict[str, Any] | None:
                status, doc = node.request("GET", "/queue-state")
                assert status in (200, 503), (status, doc)
                return doc if status == 503 else None

            doc = wait_for(stalled, 30, "/queue-state 503")
            trust = doc["trust"]
            assert not trust["vouched"] and not trust["live"], trust
            assert trust["reason"].startswith("keeper stalled: heartbeat"), trust
            assert "counters" not in doc, doc
            assert client.claim(5, lease_s=600) == []  # still an empty answer, not an error
        finally:
            os.kill(keeper, signal.SIGCONT)

        def vouched() -> dict[str, Any] | None:
            status, doc = node.request("GET", "/queue-state")
            return doc if status == 200 and doc["trust"]["vouched"] else None

        wait_for(vouched, 30, "/queue-state 200 again")
        assert node.pids_by_role()["keeper"] == keeper  # the same process, resumed
        # Claims resume with what the stalled keeper had not seen: the new row.
        got = wait_for(lambda: client.claim(5, lease_s=600), 30, "claims resuming")
        assert [g.key for g in got] == ["new"]
        assert _claim_all(client) == []  # the released key is held
        _balanced(client, received=31, withdrawn=2, routed=29, released=1, finished=1,
                  in_flight=27, waiting=1)  # fmt: skip
