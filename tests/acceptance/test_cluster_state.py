"""Acceptance: the fleet seen as one (issue 19, item 1; docs/fleet.md, "The
fleet as one"). ``GET /queue-state?scope=cluster`` and ``GET /accounting?
scope=cluster`` on any node ask every live node of the node list (with the
fleet's token) and sum them, or answer 503 naming the node that is missing,
late or not vouching: never a partial sum. Two real nodes on one PostgreSQL
database, with a token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import psycopg
import pytest

from node.client import Client
from node.store.postgres import PostgresStore
from node.testing import ROOT, NodeProcess, finish, wait_for
from tests import pg

pytestmark = pytest.mark.timeout(180)

TOKEN = f"fleet-{uuid.uuid4().hex}"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FLEET_ENV = {
    "QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": "4",
    "QUEUE_NODE_HEARTBEAT_S": "0.2",
    "QUEUE_NODE_TOKEN": TOKEN,
}
DUE, COMING = 300, 100


def _get(node: NodeProcess, path: str) -> tuple[int, dict]:
    try:
        return node.request("GET", path, headers=AUTH, timeout_s=10)
    except OSError as exc:
        return 0, {"error": str(exc)}


def _summed(node: NodeProcess, names: list[str]) -> dict | None:
    """The cluster's queue state once it answers 200 over ``names``."""
    status, doc = _get(node, "/queue-state?scope=cluster")
    return doc if status == 200 and doc.get("nodes") == names else None


def _seed(pg_url: str) -> None:
    now = time.time()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT r || i, r, 3600, %s FROM generate_series(1, %s) AS i,"
            " unnest(ARRAY['pages', 'docs']) AS r",
            (now - 600, DUE // 2),
        )
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT 'later' || i, 'pages', 3600, %s FROM generate_series(1, %s) AS i",
            (now + 1200, COMING),
        )


def test_the_cluster_is_every_live_node_summed_or_a_503_naming_the_node(tmp_path, pg_url):
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    _seed(pg_url)
    names = sorted(f"c-{uuid.uuid4().hex[:10]}" for _ in range(2))
    a, b = (NodeProcess(tmp_path / n, n, "--store", pg_url, env=FLEET_ENV) for n in names)
    try:
        a.start()
        b.start()
        doc = wait_for(lambda: _summed(a, names), 60, "the cluster summed over both nodes")
        # The cluster answer carries every node's figures: the token guards
        # it as it guards the node's own; a bad scope is refused.
        status, body = a.request("GET", "/queue-state?scope=cluster")
        assert status == 401, body
        status, body = a.request("GET", "/accounting?scope=nodes", headers=AUTH)
        assert status == 400 and body["error"]["code"] == "invalid_scope", body

        # The sum is each node's own figures added up, and the table's.
        own = [_get(n, "/queue-state")[1] for n in (a, b)]
        assert all(o["now"]["due"]["total"] > 0 for o in own), "each node holds a share"
        assert doc["now"]["due"]["total"] == DUE == sum(o["now"]["due"]["total"] for o in own)
        assert doc["now"]["rows"] == DUE + COMING
        assert doc["coming"]["60m"] == COMING
        assert sum(doc["lateness"]["total"]) == DUE
        by_route = {c["route"]: c["due"] for c in doc["classes"]["rows"]}
        assert by_route == {"pages": DUE // 2, "docs": DUE // 2}
        assert doc["now"]["classes"] == 2
        assert set(doc["trust"]["nodes"]) == set(names)
        assert doc["trust"]["vouched"] is True and doc["trust"]["down"] == []
        address = doc["trust"]["nodes"][b.name]["address"]
        # Any node answers the same sum.
        assert wait_for(lambda: _summed(b, names), 15, "b sums too")["now"]["due"]["total"] == DUE

        # The ledgers, summed: both laws, per node and for the fleet.
        status, books = _get(a, "/accounting?scope=cluster")
        assert status == 200, books
        singles = [_get(n, "/accounting")[1] for n in (a, b)]
        assert books["nodes"] == names
        assert books["received"] == sum(s["received"] for s in singles)
        assert books["waiting"] == sum(s["waiting"] for s in singles) == DUE
        assert books["balanced"] is True and set(books["by_node"]) == set(names)

        # The Python client and the command line give the same.
        with Client(a.base_url, token=TOKEN) as client:
            assert client.queue_state(scope="cluster")["nodes"] == names
        cli = subprocess.run(
            [sys.executable, "-m", "node", "state", "--name", a.name, "--scope", "cluster"],
            capture_output=True, text=True, timeout=30, cwd=ROOT,
            env=dict(os.environ, QUEUE_NODE_TOKEN=TOKEN),
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["now"]["due"]["total"] == DUE

        # b's HTTP worker stops answering: late, never a partial sum.
        worker = b.pids_by_role()["worker-0"]
        os.kill(worker, signal.SIGSTOP)
        try:
            status, late = _get(a, "/queue-state?scope=cluster")
            assert status == 503, late
            assert late["trust"]["missing"] == [b.name]
            assert b.name in late["trust"]["reason"] and "no answer" in late["trust"]["reason"]
            assert "due" not in late["now"]  # no summed counts at all
            # a answered: its own figures, side by side, as its own answer gives them.
            shown, own = late["trust"]["nodes"][a.name], _get(a, "/queue-state")[1]
            assert shown["own_figures"] is True and shown["vouched"] is True
            assert shown["due"] == own["now"]["due"]["total"] > 0
            assert shown["rows"] == own["now"]["rows"]
            assert shown["lateness"] == own["lateness"]["total"]
            assert late["trust"]["nodes"][b.name]["own_figures"] is False
            assert late["trust"]["down"] == []
            status, books = _get(a, "/accounting?scope=cluster")
            assert status == 503 and books["error"]["code"] == "peer_unavailable", books
            assert list(books["by_node"]) == [a.name] and "received" not in books
            with Client(a.base_url, token=TOKEN) as client:
                assert client.queue_state(scope="cluster")["trust"]["vouched"] is False
        finally:
            os.kill(worker, signal.SIGCONT)
        wait_for(lambda: _summed(a, names), 30, "the sum again once b answers")

        # b dies: 503 while it is on the node list, then a alone holds it all.
        b.kill()
        status, gone = _get(a, "/queue-state?scope=cluster")
        assert status == 503 and gone["trust"]["missing"] == [b.name], gone
        alone = wait_for(lambda: _summed(a, [a.name]), 60, "a alone, exact, once b is out")
        assert alone["now"]["due"]["total"] == DUE
        # b is still on the node list: named as down (lapsed), not summed.
        [down] = alone["trust"]["down"]
        assert (down["name"], down["state"], down["address"]) == (b.name, "lapsed", address)
        assert down["heartbeat_age_s"] >= 4  # the membership timeout
    finally:
        finish([a, b], names[0])
        finish([a, b], names[1])

