"""POST /admin/pause and /admin/resume: per route and per node, stored, applied
by the keeper at once, kept over a restart."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from node.client import Client
from node.config import Config
from node.store import open_store
from node.testing import NodeProcess, finish, wait_for
from shm.state import read_state
from workers.http.app import WorkerContext, make_app
from workers.http.state import routes as state_routes

# -- the endpoint alone: a memory store, no keeper ------------------------------------


def _ctx() -> WorkerContext:
    return WorkerContext(
        config=Config(name="t-pause-nokeeper", workers=1),
        store=open_store("memory://"),
        name="t-pause-nokeeper",
        started_at=1.0,
    )


async def _post(ctx: WorkerContext, calls: list[tuple[str, Any]]) -> list[tuple[int, Any]]:
    out = []
    async with TestClient(TestServer(make_app(ctx, extra_routes=state_routes))) as client:
        for path, body in calls:
            if isinstance(body, bytes):
                resp = await client.post(
                    path, data=body, headers={"Content-Type": "application/json"}
                )
            else:
                resp = await client.post(path, json=body)
            out.append((resp.status, await resp.json()))
    return out


BAD_BODIES = [
    ([], "invalid_body", None),
    ("pages", "invalid_body", None),
    (b"null", "invalid_body", None),
    ({"route": ""}, "invalid_route", "route"),
    ({"route": None}, "invalid_route", "route"),
    ({"route": 7}, "invalid_route", "route"),
    ({"route": ["a"]}, "invalid_route", "route"),
    ({"route": "r" * 129}, "invalid_route", "route"),
    ({"route": "pages", "nodes": True}, "unknown_field", "nodes"),
    ({"node": True}, "invalid_node", "node"),
    ({"node": ""}, "invalid_node", "node"),
    ({"node": "a/b"}, "invalid_node", "node"),
    ({"node": "n" * 65}, "invalid_node", "node"),
    ({"node": "t-pause-nokeeper", "route": "pages"}, "invalid_body", "node"),
    ({"routes": ["pages"]}, "unknown_field", "routes"),
    (b"{not json", "invalid_json", None),
    (b"", "invalid_json", None),
]


@pytest.mark.parametrize("path", ["/admin/pause", "/admin/resume"])
def test_a_bad_body_is_400_and_changes_nothing(path):
    ctx = _ctx()
    ctx.store.set_meta("paused_routes", ["kept"])
    answers = asyncio.run(_post(ctx, [(path, body) for body, _, _ in BAD_BODIES]))
    for (body, code, field), (status, answer) in zip(BAD_BODIES, answers, strict=True):
        assert status == 400, (body, answer)
        assert answer["error"]["code"] == code, (body, answer)
        assert answer["error"]["field"] == field, (body, answer)
    assert ctx.store.get_meta("paused_routes") == ["kept"]
    assert ctx.store.get_meta("paused_node") is None


def test_pause_and_resume_write_the_store_meta():
    ctx = _ctx()
    answers = asyncio.run(_post(ctx, [
        ("/admin/pause", {"route": "b"}),
        ("/admin/pause", {"route": "a"}),
        ("/admin/pause", {"route": "a"}),  # again: no change
        ("/admin/pause", {"route": "r" * 128}),  # the longest route allowed
        ("/admin/resume", {"route": "r" * 128}),
        ("/admin/pause", {}),
        ("/admin/resume", {"route": "not-paused"}),
        ("/admin/resume", {}),  # the node; paused routes stay paused
    ]))  # fmt: skip
    assert all(status == 200 for status, _ in answers), answers
    paused = [answer["paused"] for _, answer in answers]
    assert paused == [
        {"node": False, "routes": ["b"]},
        {"node": False, "routes": ["a", "b"]},
        {"node": False, "routes": ["a", "b"]},
        {"node": False, "routes": ["a", "b", "r" * 128]},
        {"node": False, "routes": ["a", "b"]},
        {"node": True, "routes": ["a", "b"]},
        {"node": True, "routes": ["a", "b"]},
        {"node": False, "routes": ["a", "b"]},
    ]
    # No keeper to confirm: stored, not applied (a keeper applies it at its
    # next state write).
    assert not any(answer["applied"] for _, answer in answers)
    assert ctx.store.get_meta("paused_routes") == ["a", "b"]
    assert ctx.store.get_meta("paused_node") is False


def test_a_node_outside_a_fleet_pauses_itself_by_name_and_no_other():
    ctx = _ctx()
    answers = asyncio.run(_post(ctx, [
        ("/admin/pause", {"node": "t-pause-nokeeper"}),
        ("/admin/pause", {"node": "another-node"}),
        ("/admin/resume", {"node": "another-node"}),
        ("/admin/resume", {"node": "t-pause-nokeeper"}),
    ]))  # fmt: skip
    (s1, own), (s2, other), (s3, other_resume), (s4, resumed) = answers
    assert s1 == 200 and own["paused"]["node"] is True and own["node"] == "t-pause-nokeeper"
    for status, answer in ((s2, other), (s3, other_resume)):
        assert status == 404, answer
        assert answer["error"]["code"] == "unknown_node" and answer["error"]["field"] == "node"
        assert "another-node" in answer["error"]["message"]
    assert s4 == 200 and resumed["paused"]["node"] is False
    assert ctx.store.get_meta("paused_node") is False


# -- a real node ----------------------------------------------------------------------


@pytest.fixture
def node(tmp_path, node_name):
    proc = NodeProcess(
        tmp_path / "data", node_name, "--lease-s", "3600",
        env={"QUEUE_NODE_STATE_INTERVAL_S": "0.3"},
    )  # fmt: skip
    yield proc
    finish([proc], node_name)


def _claim_all(node: NodeProcess, max_n: int = 100) -> list[str]:
    status, body = node.request("POST", "/claim", {"max": max_n, "consumer": "pause-test"})
    assert status == 200, body
    return [lease["key"] for lease in body["leases"]]


def _claim_until(node: NodeProcess, n: int, what: str) -> list[str]:
    """Claim until ``n`` keys are granted (the keeper's next publish may be
    needed), then once more: nothing else is granted."""
    granted: list[str] = []

    def enough() -> bool:
        granted.extend(_claim_all(node))
        return len(granted) >= n

    wait_for(enough, 20, what)
    granted.extend(_claim_all(node))
    return granted


def _state_when(node: NodeProcess, check, what: str) -> dict:
    def ok():
        try:
            state = read_state(node.name)
        except Exception:  # noqa: BLE001 - the node is (re)starting
            return False
        return state if state["trust"]["vouched"] and check(state) else False

    return wait_for(ok, 30, what)


def _due(total: int):
    return lambda state: state["now"]["due"]["total"] == total


def _rows(route: str, n: int) -> list[dict[str, Any]]:
    now = time.time()
    return [{"key": f"{route}-{i}", "route": route, "due_at": now - 600 - i} for i in range(n)]


@pytest.mark.timeout(240)
def test_pause_a_route_then_the_node_over_a_restart(node):
    node.start()
    client = Client(node.base_url)
    client.upsert(_rows("a", 10) + _rows("b", 10))
    _state_when(node, _due(20), "20 due rows counted")

    # A paused route's rows are not granted; the other route's are.
    answer = client.pause("a")
    assert answer == {
        "paused": {"node": False, "routes": ["a"]},
        "applied": True,
        "node": node.name,
    }
    granted = _claim_until(node, 10, "every row of b")
    assert sorted(granted) == sorted(f"b-{i}" for i in range(10))
    assert _claim_all(node) == []
    assert client.row("a-0")["lease"]["why_not"] == "paused"
    state = _state_when(node, lambda s: s["now"]["paused"]["routes"] == ["a"], "paused in state")
    assert state["now"]["paused"] == {"node": False, "routes": ["a"]}
    assert state["now"]["in_flight"] == 10

    # Pausing the node grants nothing, even rows written after the pause.
    assert client.pause() == {
        "paused": {"node": True, "routes": ["a"]},
        "applied": True,
        "node": node.name,
    }
    client.upsert(_rows("c", 5))
    _state_when(node, _due(25), "the new rows counted (and published) while paused")
    assert _claim_all(node) == []
    client.close()

    # Both survive a restart of the node.
    assert node.stop() == 0
    node.start()
    client = Client(node.base_url)
    state = _state_when(node, _due(25), "the schedule loaded again")
    assert state["now"]["paused"] == {"node": True, "routes": ["a"]}
    assert client.queue_state()["now"]["paused"] == {"node": True, "routes": ["a"]}
    assert _claim_all(node) == []

    # Resuming the node brings back every row but the paused route's.
    assert client.resume() == {
        "paused": {"node": False, "routes": ["a"]},
        "applied": True,
        "node": node.name,
    }
    granted = _claim_until(node, 5, "the rows of c")
    assert sorted(granted) == sorted(f"c-{i}" for i in range(5))
    # ... and resuming the route brings back its rows.
    assert client.resume("a") == {
        "paused": {"node": False, "routes": []},
        "applied": True,
        "node": node.name,
    }
    granted = _claim_until(node, 10, "the rows of a")
    assert sorted(granted) == sorted(f"a-{i}" for i in range(10))
    state = _state_when(
        node, lambda s: s["now"]["paused"] == {"node": False, "routes": []}, "resumed in state"
    )
    assert state["now"]["paused"] == {"node": False, "routes": []}
    assert state["now"]["in_flight"] == 25
    client.close()
    assert node.stop() == 0
