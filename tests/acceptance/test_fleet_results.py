"""Acceptance: results from the whole fleet (issue 19, item 2; docs/fleet.md,
"Results from the whole fleet"). A fleet node's result ids carry its number
in their high bits (below 2**53), across a restart of the node; a receiver
polls through any node for the whole fleet (``?scope=cluster``), and an ack
through any node is routed to the nodes its ids name, every id checked on
its node before any is acked. Two real nodes on one PostgreSQL database."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

from node.client import FleetClient
from node.core.ids import MAX_ID, number_of
from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from tests import pg

pytestmark = pytest.mark.timeout(180)

FLEET_ENV = {"QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": "4", "QUEUE_NODE_HEARTBEAT_S": "0.2"}
ROWS = 40


def _seed(pg_url: str, prefix: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT %s || i, 'r', 3600, %s FROM generate_series(1, %s) AS i",
            (prefix, time.time() - 600, ROWS),
        )


def _summed(node: NodeProcess, names: list[str]) -> dict | None:
    status, doc = node.request("GET", "/queue-state?scope=cluster")
    return doc if status == 200 and doc.get("nodes") == names else None


def _number(node: NodeProcess) -> int:
    status, doc = node.request("GET", "/queue-state")
    assert status == 200, doc
    return int(doc["trust"]["membership"]["number"])


def _acknowledged(node: NodeProcess) -> int:
    return int(node.request("GET", "/accounting")[1]["acknowledged"])


def _complete_all(node: NodeProcess) -> int:
    """Claim what the node grants and complete it all; how many."""
    status, body = node.request("POST", "/claim", {"max": 100, "consumer": "t", "lease_s": 300})
    assert status == 200, body
    items = [{"lease_id": g["lease_id"], "key": g["key"], "result": {"k": g["key"]}}
             for g in body["leases"]]  # fmt: skip
    if items:
        status, done = node.request("POST", "/complete", {"items": items})
        assert status == 200 and all(i["outcome"] == "ok" for i in done["items"]), done
    return len(items)


def _finish_everything(node: NodeProcess) -> list[dict]:
    """Claim what the node grants, complete it all, and poll its results."""
    _complete_all(node)
    status, polled = node.request("GET", "/jobs/default/results?max=1000")
    assert status == 200, polled
    return polled["results"]


def test_a_fleet_nodes_result_ids_carry_its_number_across_a_restart(tmp_path, pg_url):
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    _seed(pg_url, "a")
    names = sorted(f"r-{uuid.uuid4().hex[:10]}" for _ in range(2))
    a, b = (NodeProcess(tmp_path / n, n, "--store", pg_url, env=FLEET_ENV) for n in names)
    try:
        a.start()
        b.start()
        wait_for(lambda: _summed(a, names), 60, "both nodes summed")
        numbers = {n.name: _number(n) for n in (a, b)}
        assert sorted(numbers.values()) == [1, 2]
        offered: dict[str, list[int]] = {}
        for node in (a, b):
            results = _finish_everything(node)
            assert results, f"{node.name} finished nothing"
            ids = [r["id"] for r in results]
            assert all(number_of(i) == numbers[node.name] and 0 < i <= MAX_ID for i in ids), ids
            offered[node.name] = ids
        assert sum(map(len, offered.values())) == ROWS
        mine, theirs = offered[a.name], offered[b.name]

        # An ack through a naming an id b never gave: refused whole, nothing acked.
        bogus = max(theirs) + 1000
        status, body = a.request("POST", "/jobs/default/ack", {"ids": [mine[0], bogus]})
        assert status == 409 and body["error"]["code"] == "never_offered", body
        assert b.name in body["error"]["message"]
        assert _acknowledged(a) == 0 and _acknowledged(b) == 0
        # Every id never offered is named: a's own, b's, a number no node
        # holds, and one past 64 bits; still nothing acked.
        unheld = (9 << 45) | 1
        for extra in ([], [1 << 70]):
            asked = [mine[0], max(mine) + 1000, bogus, unheld, *extra]
            status, body = a.request("POST", "/jobs/default/ack", {"ids": asked})
            assert status == 409 and body["error"]["code"] == "never_offered", body
            parts = body["error"]["message"].split("; ")
            named = {int(n) for part in parts for n in part.split("offered: ")[1].split(", ")}
            assert named == set(asked[1:]), body
        assert _acknowledged(a) == 0 and _acknowledged(b) == 0
        # A check changes nothing.
        status, body = a.request("POST", "/jobs/default/ack", {"ids": mine + theirs, "check": True})
        assert (status, body) == (200, {"acked": 0, "checked": len(mine) + len(theirs)})
        # Through a, a's and all but one of b's: each node acks its own.
        status, body = a.request("POST", "/jobs/default/ack", {"ids": mine + theirs[:-1]})
        assert (status, body) == (200, {"acked": len(mine) + len(theirs) - 1})
        assert _acknowledged(a) == len(mine) and _acknowledged(b) == len(theirs) - 1
        # Again: idempotent.
        assert a.request("POST", "/jobs/default/ack", {"ids": mine + theirs[:-1]})[0] == 200

        # b down: its last result waits on its disk; the ack says so, acks nothing.
        b.kill()
        status, body = a.request("POST", "/jobs/default/ack", {"ids": [theirs[-1]]})
        assert status == 503 and body["error"]["code"] == "peer_unavailable", body
        assert b.name in body["error"]["message"]
        status, polled = a.request("GET", "/jobs/default/results?scope=cluster&max=10")
        assert status == 200 and polled["results"] == [], polled
        assert [u["node"] for u in polled["unavailable"]] == [b.name]
        # b back: the fleet poll offers b's result again, and the ack through a lands.
        b.start()
        wait_for(lambda: _summed(a, names), 60, "both nodes summed again")

        def polled_b() -> list[dict]:
            status, doc = a.request("GET", "/jobs/default/results?scope=cluster&max=10&wait_s=1")
            assert status == 200, doc
            return doc["results"]

        # Offered to the receiver before the restart: offered again by b's new ledger.
        again_b = wait_for(polled_b, 60, "b's result offered through a")
        assert [r["id"] for r in again_b] == [theirs[-1]]
        status, body = a.request("POST", "/jobs/default/ack", {"ids": [theirs[-1]]})
        assert (status, body) == (200, {"acked": 1})
        assert _acknowledged(b) == len(theirs)

        # Fresh results on both nodes, all polled through b.
        _seed(pg_url, "more")
        done = [0]

        def all_completed() -> bool:
            done[0] += _complete_all(a) + _complete_all(b)
            return done[0] == ROWS

        wait_for(all_completed, 60, "the new rows completed on both nodes")
        got: list[dict] = []

        def collected() -> bool:
            status, doc = b.request("GET", "/jobs/default/results?scope=cluster&max=7")
            assert status == 200 and doc["unavailable"] == [], doc
            got.extend(doc["results"])
            return len(got) >= ROWS

        wait_for(collected, 30, "every new result polled through b")
        assert len({r["id"] for r in got}) == ROWS  # none twice
        assert {number_of(r["id"]) for r in got} == set(numbers.values())
        status, body = b.request("POST", "/jobs/default/ack", {"ids": [r["id"] for r in got]})
        assert (status, body) == (200, {"acked": ROWS})

        # The fleet client: from a list of URLs (the first one dead), and
        # from the node list in the database.
        _seed(pg_url, "client")
        done[0] = 0
        wait_for(all_completed, 60, "the client's rows completed on both nodes")
        with FleetClient(["http://127.0.0.1:9", b.base_url]) as fleet:
            taken: list[dict] = []
            wait_for(lambda: taken.extend(fleet.poll("default", 1000, wait_s=1)) or
                     len(taken) >= ROWS, 30, "the fleet client's poll")  # fmt: skip
            assert fleet.ack("default", [r["id"] for r in taken]) == ROWS
        with FleetClient(database=pg_url, membership_timeout_s=4) as fleet:
            assert fleet.queue_state()["nodes"] == names
            assert fleet.accounting()["acknowledged"] == 3 * ROWS

        # Restarted, a keeps giving ids above its number's base.
        assert a.stop() == 0
        _seed(pg_url, "again")
        a.start()
        wait_for(lambda: _summed(a, names), 60, "both nodes summed again")
        again = [r["id"] for r in wait_for(lambda: _finish_everything(a), 30, "a finishes")]
        fresh = [i for i in again if i not in offered[a.name]]
        assert fresh and all(number_of(i) == numbers[a.name] for i in fresh), again
        assert min(fresh) > max(offered[a.name])
    finally:
        finish([a, b], names[0])
        finish([a, b], names[1])
