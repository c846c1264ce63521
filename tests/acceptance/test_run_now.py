"""POST /admin/run-now: every row of a route or job due now (docs/fleet.md,
"Run again now"). The endpoint alone on the memory store (what it answers,
what it refuses), then a real node on SQLite: the rows are due at once, and
the keeper counts the write in its flow. A fleet on PostgreSQL runs it in
tests/acceptance/test_console_fleet.py; the store's query, on all three
stores, in tests/integration/test_store.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from node.client import Client
from node.config import Config
from node.core.rows import ORIGIN_NODE, RowWrite
from node.store import open_store
from node.testing import NodeProcess, finish, wait_for
from workers.http.app import WorkerContext, make_app
from workers.http.state import routes as state_routes

NOW = 1_700_000_000.0


def _ctx() -> WorkerContext:
    return WorkerContext(
        config=Config(name="t-run-now", workers=1),
        store=open_store("memory://"),
        name="t-run-now",
        started_at=1.0,
        clock=lambda: NOW,
    )


async def _post(ctx: WorkerContext, calls: list[tuple[str, Any]]) -> list[tuple[int, Any]]:
    out = []
    async with TestClient(TestServer(make_app(ctx, extra_routes=state_routes))) as client:
        for path, body in calls:
            if isinstance(body, bytes):
                resp = await client.post(path, data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            else:
                resp = await client.post(path, json=body)
            out.append((resp.status, await resp.json()))
    return out


BAD_BODIES = [
    ([], "invalid_body", None),
    ("pages", "invalid_body", None),
    (b"null", "invalid_body", None),
    ({}, "missing_field", "route"),
    ({"route": "pages", "job": "j"}, "invalid_body", "job"),
    ({"route": ""}, "invalid_route", "route"),
    ({"route": 7}, "invalid_route", "route"),
    ({"job": "no spaces"}, "invalid_job", "job"),
    ({"job": None}, "invalid_job", "job"),
    ({"key": "k"}, "unknown_field", "key"),
    (b"{not json", "invalid_json", None),
]


def test_a_bad_body_is_400_and_changes_nothing():
    ctx = _ctx()
    ctx.store.upsert([RowWrite("k", "pages", due_at=NOW + 60)], now=NOW)
    seq = ctx.store.last_seq()
    answers = asyncio.run(_post(ctx, [("/admin/run-now", body) for body, _, _ in BAD_BODIES]))
    for (body, code, field), (status, answer) in zip(BAD_BODIES, answers, strict=True):
        assert status == 400, (body, answer)
        assert answer["error"]["code"] == code, (body, answer)
        assert answer["error"]["field"] == field, (body, answer)
    assert ctx.store.last_seq() == seq


def test_run_now_answers_how_many_rows_it_made_due():
    ctx = _ctx()
    ctx.store.upsert(
        [RowWrite("a", "pages", due_at=NOW + 600, job="j1"),
         RowWrite("b", "pages", due_at=NOW - 60, job="j2"),
         RowWrite("c", "docs", due_at=NOW + 600, job="j1")],
        now=NOW,
    )  # fmt: skip
    seq = ctx.store.last_seq()
    answers = asyncio.run(_post(ctx, [
        ("/admin/run-now", {"route": "pages"}),
        ("/admin/run-now", {"job": "j1"}),
        ("/admin/run-now", {"route": "none-such"}),
    ]))  # fmt: skip
    assert answers == [(200, {"rescheduled": 2}), (200, {"rescheduled": 2}),
                       (200, {"rescheduled": 0})]  # fmt: skip
    assert [ctx.store.get(k).due_at for k in "abc"] == [NOW, NOW - 60, NOW]
    assert {c.origin for c in ctx.store.changes(seq, 100)} == {ORIGIN_NODE}


# -- a real node ----------------------------------------------------------------------


@pytest.fixture
def node(tmp_path, node_name):
    proc = NodeProcess(tmp_path / "data", node_name, env={"QUEUE_NODE_STATE_INTERVAL_S": "0.3"})
    yield proc
    finish([proc], node_name)


@pytest.mark.timeout(60)
def test_run_now_on_a_node_makes_the_rows_due_and_is_counted_in_the_flow(node):
    node.start()
    now = time.time()
    later = [{"key": f"p-{i}", "route": "pages", "cadence_s": 86400, "due_at": now + 3600}
             for i in range(12)]  # fmt: skip
    later += [{"key": f"d-{i}", "route": "docs", "due_at": now + 3600} for i in range(5)]
    with Client(node.base_url) as client:
        client.upsert(later)

        def state_when(check: Any) -> Any:
            doc = client.queue_state()
            return doc if doc["trust"]["vouched"] and check(doc) else None

        before = wait_for(lambda: state_when(lambda d: d["now"]["rows"] == 17), 30, "17 rows")
        assert before["now"]["due"]["total"] == 0
        updated = before["flow"]["last_hour"]["updated"]

        assert client.run_now(route="pages") == {"rescheduled": 12}
        after = wait_for(
            lambda: state_when(lambda d: d["now"]["due"]["total"] == 12), 15, "12 due now"
        )
        assert after["flow"]["last_hour"]["updated"] == updated + 12
        assert after["coming"]["60m"] + after["coming"]["24h"] > 0  # docs still later
        granted: list[str] = []

        def claimed_all() -> bool:  # the ready set follows at the keeper's next publish
            granted.extend(g.key for g in client.claim(100, consumer="run-now-test"))
            return len(granted) >= 12

        wait_for(claimed_all, 15, "the 12 rows granted")
        assert sorted(granted) == sorted(f"p-{i}" for i in range(12))
