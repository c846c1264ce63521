"""Acceptance: pausing in a fleet (issue 18, item 1; docs/fleet.md,
"Pausing"). A route paused through one node is paused on every node (one
fleet-wide entry); a node paused pauses that node only, and every node shows
it. Two real nodes on one PostgreSQL database."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from shm.ready import ReadySet
from shm.state import read_state
from tests import pg

pytestmark = pytest.mark.timeout(180)

FLEET_ENV = {"QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": "3", "QUEUE_NODE_HEARTBEAT_S": "0.2"}


def _now(node: NodeProcess, live: list[str]) -> dict | None:
    """The node's ``now`` once it vouches, exact, with ``live`` as its list."""
    try:
        state = read_state(node.name)
    except Exception:  # noqa: BLE001 - not up yet
        return None
    trust = state.get("trust") or {}
    if not (trust.get("vouched") and trust.get("exact")):
        return None
    if (trust.get("membership") or {}).get("live") != live:
        return None
    return state["now"]


def _paused(node: NodeProcess, live: list[str]) -> dict | None:
    return (_now(node, live) or {}).get("paused")


def _offered_routes(node: NodeProcess) -> set[str]:
    """The routes of the keys in the node's ready set (keys are route + i)."""
    ready = ReadySet.attach(node.name)
    try:
        keys = [entry.key for entry in ready.snapshot().entries]
    finally:
        ready.close()
    return {"docs" if key.startswith("docs") else "pages" for key in keys}


def test_a_route_paused_through_one_node_is_paused_on_every_node(tmp_path, pg_url):
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT r || i, r, 86400, %s FROM generate_series(1, 200) AS i,"
            " unnest(ARRAY['pages', 'docs']) AS r",
            (time.time() - 3600,),
        )
    names = sorted(f"p-{uuid.uuid4().hex[:10]}" for _ in range(2))
    a, b = (NodeProcess(tmp_path / n, n, "--store", pg_url, env=FLEET_ENV) for n in names)
    try:
        a.start()
        b.start()
        wait_for(lambda: _now(a, names) and _now(b, names), 60, "both nodes exact")
        wait_for(lambda: _offered_routes(b) == {"pages", "docs"}, 30, "b offers both routes")

        status, body = a.request("POST", "/admin/pause", {"route": "docs"})
        assert status == 200 and body["paused"]["routes"] == ["docs"], body
        wait_for(lambda: _paused(b, names) == {"node": False, "routes": ["docs"]}, 15,
                 "b reads the route paused through a")  # fmt: skip
        # Read, then published at once: b's set offers no key of the route.
        assert _offered_routes(b) == {"pages"}
        assert b.request("POST", "/admin/pause", {})[0] == 200  # b itself, not a
        wait_for(lambda: (_now(a, names) or {}).get("paused_nodes") == [b.name], 15,
                 "a shows b paused")  # fmt: skip
        assert _paused(a, names) == {"node": False, "routes": ["docs"]}
        assert _offered_routes(a) == {"pages"}

        status, body = b.request("POST", "/admin/resume", {"route": "docs"})
        assert status == 200 and body["paused"] == {"node": True, "routes": []}, body
        wait_for(lambda: _paused(a, names) == {"node": False, "routes": []}, 15,
                 "a reads the route resumed through b")  # fmt: skip
        wait_for(lambda: _offered_routes(a) == {"pages", "docs"}, 15, "a offers docs again")
    finally:
        finish([a], names[0])
        finish([b], names[1])
