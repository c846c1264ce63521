"""``POST /complete`` with ``{"items": [...]}``: many results in one request.

Over real HTTP (aiohttp's test server) in this process, against a real
ledger (``workers.ledger.process.Ledger`` on a SQLite store, a lease table
and a completion log on disk) for the outcomes and their durability, and
against a fake ledger for what is refused before anything is sent. Waits
are deadlines, never sleeps.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer

from node.config import Config
from node.core.rows import RowWrite
from node.ipc import IpcError
from shm.leases import LeaseTable, Outcome
from workers.http.app import MAX_BODY_BYTES, WorkerContext, make_app
from workers.http.errors import ERROR_CODES
from workers.http.openapi import spec
from workers.http.results import routes as results_routes
from workers.http.work import MAX_COMPLETE_ITEMS, WorkPath
from workers.http.work import routes as work_routes

pytestmark = pytest.mark.timeout(60)

CADENCE_S = 600


class InProcessLedger:
    """The ledger's IPC as the routes see it, answered by a real ``Ledger``
    in this process (its group commit runs as a task on this loop)."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.ops: list[str] = []

    async def call(self, op: str, timeout_s: float = 30.0, **fields: Any) -> dict[str, Any]:
        self.ops.append(op)
        return await asyncio.wait_for(self.ledger.handle({"op": op, **fields}), timeout_s)


class FakeLedger:
    """Answers ``complete`` with ``answer(items)`` (or raises it); records calls."""

    def __init__(self, answer: Any = None) -> None:
        self.answer = answer or (lambda items: [{"status": "ok", "id": 7}] * len(items))
        self.calls: list[list[dict]] = []

    async def call(self, op: str, timeout_s: float = 30.0, **fields: Any) -> dict[str, Any]:
        assert op == "complete"
        self.calls.append(fields["items"])
        if isinstance(self.answer, BaseException):
            raise self.answer
        return {"outcomes": self.answer(fields["items"])}


def _ctx(ledger: Any, leases: Any = None) -> WorkerContext:
    from node.store import open_store

    return WorkerContext(
        config=Config(name="t", workers=1),
        store=open_store("memory://"),
        name="t",
        started_at=time.time() - 100,
        work=WorkPath(None, leases, ledger),  # type: ignore[arg-type]  # no claims here
    )


@contextlib.asynccontextmanager
async def serve(ctx: WorkerContext) -> AsyncIterator[TestClient]:
    routes = [*work_routes, *results_routes]
    async with TestClient(TestServer(make_app(ctx, extra_routes=routes))) as client:
        yield client


async def error_of(resp: Any, status: int, code: str, field: str | None = "") -> dict:
    assert resp.status == status, await resp.text()
    doc = await resp.json()
    assert set(doc) == {"error"} and set(doc["error"]) == {"code", "message", "field"}
    assert doc["error"]["code"] == code, doc
    assert ERROR_CODES[code][0] == status
    if field != "":
        assert doc["error"]["field"] == field, doc
    return doc["error"]


class World:
    """A node's durable parts without its processes: the lease table, the
    SQLite store and a ledger over a completion log in ``data_dir``."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        from node.store import open_store

        self.name = name
        self.data_dir = tmp_path / "data"
        self.data_dir.mkdir()
        self.config = Config(
            data_dir=self.data_dir, name=name, store=f"sqlite:///{self.data_dir}/schedule.db"
        )
        self.store = open_store(self.config.store_url)
        self.table = LeaseTable.create(name, capacity=1024)

    def seed(self, keys: list[str], job: str = "j") -> None:
        now = time.time()
        rows = [RowWrite(k, "r", cadence_s=CADENCE_S, due_at=now - 5, job=job) for k in keys]
        self.store.upsert(rows, now=now)

    def grant(self, key: str, now: float | None = None) -> Any:
        row = self.store.get(key)
        at = time.time() if now is None else now
        lease = self.table.grant(key, "gpu-0", 60, at, CADENCE_S, row.version)
        assert lease, lease
        return lease

    @contextlib.asynccontextmanager
    async def ledger(self) -> AsyncIterator[InProcessLedger]:
        """A ledger recovered from the log on disk, committing while open."""
        from workers.ledger.process import open_ledger

        ledger = open_ledger(self.config)
        try:
            ledger.recover(time.time())
            committer = asyncio.create_task(ledger.run_committer())
            try:
                yield InProcessLedger(ledger)
            finally:
                committer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await committer
        finally:
            ledger.close()

    def close(self) -> None:
        self.store.close()
        self.table.close()
        LeaseTable.unlink(self.name)


@pytest.fixture
def world(tmp_path, node_name):
    w = World(tmp_path, node_name)
    yield w
    w.close()


def _item(lease: Any, result: Any = None, **extra: Any) -> dict[str, Any]:
    return {"lease_id": lease.lease_id, "key": lease.key, "result": result, **extra}


async def _poll_until(client: TestClient, n: int, job: str = "j") -> list[dict]:
    """Poll (long polls, up to a deadline) until ``n`` results were offered."""
    found: list[dict] = []
    deadline = time.monotonic() + 20
    while len(found) < n and time.monotonic() < deadline:
        resp = await client.get(f"/jobs/{job}/results?max=100&wait_s=1")
        assert resp.status == 200, await resp.text()
        found += (await resp.json())["results"]
    return found


def test_items_answer_an_outcome_each_and_the_ok_ones_are_durable(world):
    keys = ["a", "b", "c", "d", "e"]
    world.seed(keys)
    now = time.time()
    la, lb, lc, le = (world.grant(k, now) for k in ("a", "b", "c", "e"))  # d: no lease
    # c's lease is released and the key granted again: c's first lease conflicts.
    assert world.table.release("c", lc.lease_id, now) is Outcome.RELEASED
    assert world.table.unhold(["c"]) == 1
    lc2 = world.grant("c")
    assert lc2.lease_id != lc.lease_id

    async def complete() -> tuple[int, dict]:
        async with world.ledger() as ledger, serve(_ctx(ledger, world.table)) as client:
            resp = await client.post("/complete", json=_item(la, {"first": True}))
            assert resp.status == 200
            first_id = (await resp.json())["id"]
            items = [
                _item(la, {"first": True}),  # a repeat of the completion above
                _item(lb, {"html": "<p>b</p>"}),
                _item(lc, "late"),  # c was granted again since
                {"lease_id": 987_654_321, "key": "d", "result": 1},  # no lease at all
                _item(le, base64.b64encode(b"\x00\xffpng").decode(), encoding="base64"),
            ]
            before = dict(ledger.ledger.stats.statuses)
            resp = await client.post("/complete", json={"items": items})
            assert resp.status == 200, await resp.text()
            doc = await resp.json()
            statuses = dict(ledger.ledger.stats.statuses)
            return first_id, {"doc": doc, "before": before, "after": statuses}

    first_id, got = asyncio.run(complete())
    answers = got["doc"]["items"]
    assert [x["outcome"] for x in answers] == ["repeat", "ok", "conflict", "unknown", "ok"]
    assert answers[0] == {"id": first_id, "outcome": "repeat"}
    assert answers[2] == {"outcome": "conflict"} and answers[3] == {"outcome": "unknown"}
    ids = {"a": first_id, "b": answers[1]["id"], "e": answers[4]["id"]}
    assert all(isinstance(v, int) for v in ids.values()) and len(set(ids.values())) == 3
    for status, n in (("ok", 2), ("repeat", 1), ("conflict", 1), ("unknown", 1)):
        assert got["after"].get(status, 0) - got["before"].get(status, 0) == n, got
    # The accepted leases ended; c's new lease is untouched; d has none.
    assert world.table.peek("b", lb.lease_id)[0] is Outcome.REPEAT
    assert world.table.peek("c", lc2.lease_id)[0] is Outcome.COMPLETED  # still live
    assert world.store.get("b").due_at > now + CADENCE_S - 60  # written back
    assert world.store.get("c").due_at < now  # not written back

    async def poll_after_reopen() -> list[dict]:
        # A ledger opened afresh reads only what is on disk.
        async with world.ledger() as ledger, serve(_ctx(ledger, world.table)) as client:
            return await _poll_until(client, 3)

    found = {r["key"]: r for r in asyncio.run(poll_after_reopen())}
    assert set(found) == {"a", "b", "e"}
    assert {k: r["id"] for k, r in found.items()} == ids
    assert found["b"]["result"] == {"html": "<p>b</p>"}
    assert found["e"]["encoding"] == "base64"
    assert base64.b64decode(found["e"]["result"]) == b"\x00\xffpng"


def test_items_in_msgpack_carry_raw_bytes(world):
    world.seed(["m1", "m2"])
    l1, l2 = world.grant("m1"), world.grant("m2")
    headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}

    async def run() -> tuple[dict, list[dict]]:
        async with world.ledger() as ledger, serve(_ctx(ledger, world.table)) as client:
            body = {"items": [_item(l1, b"\x00raw"), _item(l2, [1.5, "x"])]}
            resp = await client.post("/complete", data=msgpack.packb(body), headers=headers)
            assert resp.status == 200, await resp.text()
            assert resp.content_type == "application/msgpack"
            doc = msgpack.unpackb(await resp.read())
            resp = await client.get("/jobs/j/results?max=10&wait_s=5", headers=headers)
            return doc, msgpack.unpackb(await resp.read())["results"]

    doc, results = asyncio.run(run())
    assert [x["outcome"] for x in doc["items"]] == ["ok", "ok"]
    by_key = {r["key"]: r for r in results}
    assert by_key["m1"]["result"] == b"\x00raw" and by_key["m1"]["id"] == doc["items"][0]["id"]
    assert by_key["m2"]["result"] == [1.5, "x"]


def test_a_bad_item_changes_nothing_at_the_real_ledger(world):
    world.seed(["x", "y"])
    lx, ly = world.grant("x"), world.grant("y")

    async def run() -> tuple[dict, dict, dict, list[str]]:
        async with world.ledger() as ledger, serve(_ctx(ledger, world.table)) as client:
            before = ledger.ledger.accounting()
            items = [_item(lx, 1), {"lease_id": ly.lease_id, "key": "y", "result": 2, "x": 0}]
            resp = await client.post("/complete", json={"items": items})
            error = await error_of(resp, 400, "unknown_field", "items[1].x")
            return error, before, ledger.ledger.accounting(), ledger.ops

    error, before, after, ops = asyncio.run(run())
    assert "items[1]" in error["message"]
    assert ops == [] and before == after  # nothing sent; the counters as they were
    assert world.table.peek("x", lx.lease_id)[0] is Outcome.COMPLETED  # still live
    assert world.table.peek("y", ly.lease_id)[0] is Outcome.COMPLETED


GOOD = {"lease_id": 3, "key": "a", "result": {"v": 1}}


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({"items": []}, "invalid_body", "items"),
        ({"items": "a"}, "invalid_body", "items"),
        ({"items": None}, "invalid_body", "items"),
        ({"items": [GOOD, 5]}, "invalid_body", "items[1]"),
        ({"items": [GOOD, {"key": "a", "result": 1}]}, "missing_field", "items[1].lease_id"),
        ({"items": [GOOD, {**GOOD, "lease_id": "3"}]}, "invalid_lease_id", "items[1].lease_id"),
        ({"items": [GOOD, {**GOOD, "lease_id": 0}]}, "invalid_lease_id", "items[1].lease_id"),
        ({"items": [GOOD, {**GOOD, "lease_id": True}]}, "invalid_lease_id", "items[1].lease_id"),
        ({"items": [{"lease_id": 3, "result": 1}]}, "missing_field", "items[0].key"),
        ({"items": [GOOD, {**GOOD, "key": ""}]}, "invalid_key", "items[1].key"),
        ({"items": [GOOD, {**GOOD, "key": 5}]}, "invalid_key", "items[1].key"),
        ({"items": [GOOD, {**GOOD, "key": "k" * 1025}]}, "invalid_key", "items[1].key"),
        ({"items": [GOOD, GOOD, {"lease_id": 3, "key": "a"}]}, "missing_field", "items[2].result"),
        (
            {"items": [GOOD, {**GOOD, "result": "!!", "encoding": "base64"}]},
            "invalid_result",
            "items[1].result",
        ),
        ({"items": [GOOD, {**GOOD, "encoding": "hex"}]}, "invalid_result", "items[1].encoding"),
        ({"items": [GOOD, {**GOOD, "extra": 1}]}, "unknown_field", "items[1].extra"),
        ({"items": [GOOD], "lease_id": 3}, "unknown_field", "lease_id"),
        ({"items": [GOOD], "nope": 3}, "unknown_field", "nope"),
        ({"items": [GOOD] * (MAX_COMPLETE_ITEMS + 1)}, "too_many_items", "items"),
    ],
)
def test_bad_items_are_refused_whole_naming_the_item(body, code, field):
    async def run() -> None:
        ledger = FakeLedger()
        async with serve(_ctx(ledger)) as client:
            error = await error_of(await client.post("/complete", json=body), 400, code, field)
        if field.startswith("items["):
            assert field.split(".")[0] in error["message"]
        assert ledger.calls == []  # nothing was sent

    asyncio.run(run())


def test_msgpack_items_that_json_cannot_carry_are_400():
    headers = {"Content-Type": "application/msgpack"}
    bodies = [
        ({"items": [GOOD, {**GOOD, b"key": "a"}]}, "invalid_body", "items[1]"),
        ({"items": [GOOD], b"more": 1}, "invalid_body", None),
        ({"items": [{**GOOD, "result": b"x", "encoding": "base64"}]}, "invalid_result", None),
    ]

    async def run() -> None:
        ledger = FakeLedger()
        async with serve(_ctx(ledger)) as client:
            for body, code, field in bodies:
                data = msgpack.packb(body, use_bin_type=True)
                resp = await client.post("/complete", data=data, headers=headers)
                await error_of(resp, 400, code, field if field else "")
        assert ledger.calls == []

    asyncio.run(run())


def test_the_item_limit_and_the_body_limit():
    async def run() -> None:
        ledger = FakeLedger()
        async with serve(_ctx(ledger)) as client:
            items = [{**GOOD, "key": f"k{i}"} for i in range(MAX_COMPLETE_ITEMS)]
            resp = await client.post("/complete", json={"items": items})
            assert resp.status == 200, await resp.text()
            assert len((await resp.json())["items"]) == MAX_COMPLETE_ITEMS
            assert len(ledger.calls) == 1 and len(ledger.calls[0]) == MAX_COMPLETE_ITEMS
            big = {"items": [{**GOOD, "result": "x" * MAX_BODY_BYTES}]}
            data = io.BytesIO(json.dumps(big).encode())
            headers = {"Content-Type": "application/json"}
            resp = await client.post("/complete", data=data, headers=headers)
            await error_of(resp, 413, "body_too_large")
        assert len(ledger.calls) == 1

    asyncio.run(run())


def test_the_ledger_failing_answers_the_request_503():
    def some_log_unavailable(items: list) -> list:
        return [{"status": "ok", "id": 1}, {"status": "log_unavailable"}]

    async def run() -> None:
        body = {"items": [GOOD, GOOD]}
        for answer, code in (
            (some_log_unavailable, "log_unavailable"),
            (lambda items: [{"status": "error"}, {"status": "ok", "id": 1}], "ledger_unavailable"),
            (lambda items: [{"status": "ok", "id": 1}], "ledger_unavailable"),  # short
            (IpcError("no ledger"), "ledger_unavailable"),
        ):
            async with serve(_ctx(FakeLedger(answer))) as client:
                await error_of(await client.post("/complete", json=body), 503, code)

    asyncio.run(run())


def test_a_repeat_the_ledger_no_longer_names_has_no_id():
    def answer(items: list) -> list:
        return [{"status": "repeat", "id": None}, {"status": "repeat", "id": 4}]

    async def run() -> dict:
        async with serve(_ctx(FakeLedger(answer))) as client:
            resp = await client.post("/complete", json={"items": [GOOD, GOOD]})
            assert resp.status == 200
            return await resp.json()

    assert asyncio.run(run()) == {"items": [{"outcome": "repeat"}, {"id": 4, "outcome": "repeat"}]}


def test_openapi_describes_both_bodies():
    body = spec()["paths"]["/complete"]["post"]["requestBody"]["content"]
    for media in ("application/json", "application/msgpack"):
        single, batch = body[media]["schema"]["oneOf"]
        assert single["required"] == ["lease_id", "key", "result"]
        assert batch["required"] == ["items"]
        items = batch["properties"]["items"]
        assert items["maxItems"] == MAX_COMPLETE_ITEMS and items["minItems"] == 1
        assert items["items"] is single and single["additionalProperties"] is False


def test_the_limit_is_the_ledgers():
    from workers.ledger.process import MAX_ITEMS

    assert MAX_COMPLETE_ITEMS == MAX_ITEMS
