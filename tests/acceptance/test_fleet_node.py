"""Acceptance: a node on PostgreSQL is a fleet member (issue 18, item 2;
docs/fleet.md). Its keeper joins the node list at start and heartbeats; the
grant deadline each heartbeat earns lets it grant; a stalled keeper (SIGSTOP)
stops granting, over HTTP and to a LocalClaimer, before the database counts
it out; a clean stop (SIGTERM) leaves the list at once. A SQLite node has no
membership and no deadline."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import msgpack
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.client import LocalClaimer
from node.core.errors import ClientError
from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from shm.ready import ReadySet
from tests import pg

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 4.0  # membership_timeout_s: the deadline lapses 0.8 s before it
HEARTBEAT_S = 0.2
FLEET_ENV = {
    "QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": str(TIMEOUT_S),
    "QUEUE_NODE_HEARTBEAT_S": str(HEARTBEAT_S),
}

ROW = """SELECT number, left_at IS NOT NULL,
                extract(epoch FROM now() - heartbeat_at)::float8,
                heartbeat_at > now() - make_interval(secs => %s) AND left_at IS NULL
           FROM fleet_nodes WHERE name = %s"""


@pytest.fixture
def node(tmp_path, node_name, pg_url):
    PostgresStore(pg_url).close()  # the schema, in a database new to this run
    pg.reset(pg_url)
    proc = NodeProcess(tmp_path / "data", node_name, "--store", pg_url, env=FLEET_ENV)
    yield proc
    finish([proc], node_name)


def _row(pg_url: str, name: str) -> tuple | None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        return conn.execute(ROW, (TIMEOUT_S, name)).fetchone()


def _heartbeat_at(pg_url: str, name: str) -> float:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        sql = "SELECT extract(epoch FROM heartbeat_at)::float8 FROM fleet_nodes WHERE name = %s"
        return conn.execute(sql, (name,)).fetchone()[0]


def _fleet_gauges(node: NodeProcess) -> dict[str, float]:
    """The node's view of the node list on GET /metrics (docs/metrics.md, "A fleet")."""
    with urllib.request.urlopen(node.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        f.name: f.samples[0].value
        for f in text_string_to_metric_families(text)
        if f.name.startswith("queue_node_fleet_")
    }


def _due_rows(node: NodeProcess, n: int) -> None:
    rows = [{"key": f"k{i}", "route": "r", "cadence_s": 3600, "due_at": time.time() - 60}
            for i in range(n)]  # fmt: skip
    assert node.request("POST", "/rows", rows) == (200, {"upserted": n})


def _claim(node: NodeProcess, n: int = 1) -> tuple[int, dict]:
    return node.request("POST", "/claim", {"max": n, "consumer": "t", "lease_s": 600})


def test_a_postgresql_node_joins_heartbeats_grants_and_leaves_at_once_on_sigterm(node, pg_url):
    node.start()
    number, left, age_s, live = wait_for(lambda: _row(pg_url, node.name), 10, "joined")
    assert number == 1 and not left and live and age_s < 1.0
    # The address listed is the one bound (the node was given port 0).
    with psycopg.connect(pg_url, autocommit=True) as conn:
        (address,) = conn.execute("SELECT address FROM fleet_nodes WHERE name = %s",
                                  (node.name,)).fetchone()  # fmt: skip
    assert address == node.node_json()["http"] and not address.endswith(":0"), address
    # The heartbeat goes on: a later one is written. (Its time itself, not the
    # row's age: an age read just after a beat is smaller than almost any later.)
    first = _heartbeat_at(pg_url, node.name)
    wait_for(lambda: _heartbeat_at(pg_url, node.name) > first, 10, "a newer heartbeat")

    _due_rows(node, 5)
    wait_for(lambda: _claim(node)[1].get("leases"), 30, "a grant")

    status, doc = node.request("GET", "/queue-state")
    assert status == 200, doc
    member = doc["trust"]["membership"]
    assert member["name"] == node.name and member["number"] == 1
    assert member["state"] == "member" and member["live"] == [node.name]
    assert 0 <= member["last_heartbeat_age_s"] < 2.0
    assert 0 < member["grant_deadline_left_s"] <= TIMEOUT_S
    assert member["skew_flagged"] is False and abs(member["skew_s"]) < 1.0
    assert member["heartbeats"] >= 1
    assert _fleet_gauges(node) == {"queue_node_fleet_member": 1, "queue_node_fleet_live_nodes": 1}

    # SIGTERM: out of the list by a clean leave (left_at), long before the
    # membership timeout could count the node out.
    sent = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _row(pg_url, node.name)[1], TIMEOUT_S, "left at once")
    left_after_s = time.monotonic() - sent
    assert left_after_s < TIMEOUT_S
    assert node.proc.wait(30) == 0
    assert not _row(pg_url, node.name)[3]


def test_a_stalled_keeper_stops_granting_before_it_drops_from_the_live_list(node, pg_url):
    node.start()
    wait_for(lambda: _row(pg_url, node.name), 10, "joined")
    _due_rows(node, 200)
    wait_for(lambda: _claim(node)[1].get("leases"), 30, "a grant")
    keeper = node.pids()["keeper"]
    with LocalClaimer(node.name, data_dir=str(node.data_dir), consumer="local") as local:
        assert local.claim(1, lease_s=600, wait_s=1.0)  # it grants while the keeper beats
        os.kill(keeper, signal.SIGSTOP)
        try:
            def refused() -> bool:
                try:
                    local.claim(1, lease_s=600)
                except ClientError as exc:
                    assert (exc.status, exc.code) == (503, "not_granting"), exc
                    return True
                return False

            wait_for(refused, 10, "a LocalClaimer refused")
            status, body = node.request("GET", "/readyz")
            assert status == 503 and body["reason"].startswith("not_granting"), body
            # At that moment the database still counts the node live: the
            # deadline lapsed first.
            assert _row(pg_url, node.name)[3], "dropped from the list before it stopped granting"
            status, body = _claim(node)
            assert status == 503 and "not_granting" in str(body), (status, body)
            wait_for(lambda: not _row(pg_url, node.name)[3], 10, "out of the live list")
            # Its own view says so too: its last heartbeat is past the
            # timeout, so it is no member and its list is no count.
            out = {"queue_node_fleet_member": 0}
            wait_for(lambda: _fleet_gauges(node) == out, 2, "metrics: not a member")
        finally:
            os.kill(keeper, signal.SIGCONT)
    # Back: its next heartbeat renews the membership and the grants.
    wait_for(lambda: _row(pg_url, node.name)[3], 10, "live again")
    wait_for(lambda: _fleet_gauges(node)["queue_node_fleet_member"] == 1, 10, "metrics: member")
    wait_for(lambda: _claim(node)[1].get("leases"), 30, "granting again")
    assert node.stop() == 0


def test_a_sqlite_node_has_no_membership_and_no_deadline(tmp_path, node_name):
    node = NodeProcess(tmp_path / "data", node_name, env=FLEET_ENV)
    try:
        node.start()
        status, doc = node.request("GET", "/queue-state")
        assert status == 200, doc
        assert doc["trust"]["membership"] is None
        assert _fleet_gauges(node) == {}
        with ReadySet.attach(node.name) as ready:
            assert ready.grant_until_ns == 0
        assert node.stop() == 0
    finally:
        finish([node], node_name)


# -- two nodes on one database: ownership ------------------------------------------

ROWS = 3000  # a third due an hour ago, the rest due in an hour or more


def _dump(node: NodeProcess) -> dict[str, int]:
    """The keeper's held rows as key -> due minute (the ask channel's dump)."""
    from keeper.ask import ask

    reply = ask(node.name, {"op": "dump"}, timeout_s=5)
    assert reply["ok"], reply
    doc = msgpack.unpackb(Path(reply["path"]).read_bytes())
    return {key: minute for key, minute, _cid, _version in doc["rows"]}


def _settled(node: NodeProcess, live: list[str]) -> dict | None:
    """The node's state once it vouches with ``live`` as its node list and
    no walk left (exact)."""
    from shm.state import read_state

    try:
        state = read_state(node.name)
    except Exception:  # noqa: BLE001 - not up yet
        return None
    trust = state.get("trust") or {}
    member = trust.get("membership") or {}
    if not trust.get("vouched") or not trust.get("exact") or member.get("live") != live:
        return None
    return state


def _split(nodes: list[NodeProcess], pg_url: str) -> bool:
    """Every row held by exactly one keeper, and the due counts adding up to
    a count over the table."""
    names = sorted(n.name for n in nodes)
    states = [_settled(n, names) for n in nodes]
    if not all(states):
        return False
    held = [_dump(n) for n in nodes]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        keys = {k for (k,) in conn.execute("SELECT key FROM schedule")}
        due = conn.execute("SELECT count(*) FROM schedule WHERE due_at < %s",
                           (time.time() - 600,)).fetchone()[0]  # fmt: skip
    union = set().union(*held)
    if union != keys or sum(map(len, held)) != len(keys):
        return False
    return sum(s["now"]["due"]["total"] for s in states) == due  # type: ignore[index]


def _balanced(nodes: list[NodeProcess], live: list[str], since: float) -> bool:
    """The input law balanced on every node, by counts taken after ``since``."""
    states = [_settled(n, live) for n in nodes]
    return all(
        s and s["counters"]["at"] > since and s["counters"]["input_gap"] == 0 for s in states
    )


def test_two_nodes_on_one_database_each_hold_their_own_and_a_clean_stop_hands_over(
    tmp_path, pg_url
):
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    now = time.time()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT 'k' || i, 'r', 86400, CASE WHEN i %% 3 = 0 THEN %s ELSE %s + i END"
            " FROM generate_series(1, %s) AS i",
            (now - 3600, now + 3600, ROWS),
        )
    names = [f"t-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    nodes = [NodeProcess(tmp_path / n, n, "--store", pg_url, env=FLEET_ENV) for n in names]
    try:
        for node in nodes:
            node.start()
        wait_for(lambda: _split(nodes, pg_url), 60, "the rows split between the two keepers")
        for node in nodes:  # the input law balances on each node
            assert _settled(node, sorted(names))["counters"]["input_gap"] == 0  # type: ignore[index]
        held = [_dump(n) for n in nodes]
        assert all(held), "each node holds a share"
        assert set(held[0]).isdisjoint(held[1])
        for node in nodes:
            assert _fleet_gauges(node)["queue_node_fleet_live_nodes"] == 2

        # One stops cleanly: the other holds every row, exact.
        survivor, leaving = nodes
        assert leaving.stop() == 0
        wait_for(lambda: _split([survivor], pg_url), 60, "every row held by the survivor")
        state = _settled(survivor, [survivor.name])
        assert state is not None
        assert state["trust"]["repairs"]["membership"] >= len(held[1])
        # The rows gained were received here; the law still balances.
        assert state["counters"]["input_gap"] == 0, state["counters"]
        assert len(_dump(survivor)) == ROWS
        assert _fleet_gauges(survivor) == {
            "queue_node_fleet_member": 1, "queue_node_fleet_live_nodes": 1,
        }  # fmt: skip
    finally:
        finish(nodes, names[0])
        finish([], names[1])


def test_a_node_joining_takes_its_share_and_a_leased_key_it_takes_stays_fenced(tmp_path, pg_url):
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    now = time.time()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT 'k' || i, 'r', 86400, %s FROM generate_series(1, 400) AS i",
            (now - 3600,),
        )
    names = sorted(f"t-{uuid.uuid4().hex[:10]}" for _ in range(2))
    first, second = (NodeProcess(tmp_path / n, n, "--store", pg_url, env=FLEET_ENV)
                     for n in names)  # fmt: skip
    try:
        first.start()
        wait_for(lambda: _split([first], pg_url), 60, "the first node holds every row")
        leases: dict[str, int] = {}

        def claim() -> bool:
            status, body = first.request(
                "POST", "/claim", {"max": 64, "consumer": "t", "lease_s": 600}
            )
            assert status == 200, body
            leases.update({x["key"]: x["lease_id"] for x in body["leases"]})
            return len(leases) >= 100

        wait_for(claim, 30, "100 leases on the first node")
        second.start()
        wait_for(lambda: _split([first, second], pg_url), 60, "the rows split")
        held = _dump(first)
        moved = [k for k in leases if k not in held]
        assert moved, "some leased keys moved to the second node"
        # In flight on the first node, not held there: fenced, not waiting.
        split_at = time.time()
        wait_for(lambda: _balanced([first, second], names, split_at), 30,
                 "the input law balanced with the moved leases in flight")  # fmt: skip
        counters = _settled(first, names)["counters"]  # type: ignore[index]
        assert counters["fenced"] == len(moved), counters
        # The leases granted before the change complete normally on the
        # first node: accepted once, delivered, the law balanced on each.
        for key, lease_id in leases.items():
            status, body = first.request(
                "POST", "/complete", {"lease_id": lease_id, "key": key, "result": key}
            )
            assert status == 200, (key, status, body)

        def delivered() -> list:
            status, body = first.request("GET", "/jobs/default/results?max=200")
            assert status == 200, body
            return body["results"] if len(body["results"]) == len(leases) else []

        results = wait_for(delivered, 30, "every result offered")
        assert sorted(r["key"] for r in results) == sorted(leases)

        done = time.time()
        wait_for(lambda: _balanced([first, second], names, done), 30,
                 "the input law balanced on both nodes")  # fmt: skip
        assert _settled(first, names)["counters"]["fenced"] == 0  # type: ignore[index]
        wait_for(lambda: _split([first, second], pg_url), 60, "still split, exact")
    finally:
        finish([first], names[0])
        finish([second], names[1])
