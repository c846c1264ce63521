"""The HTTP API of the workers, over real HTTP (aiohttp's test server) against
the in-memory store. Each test runs its own event loop with ``asyncio.run``
(no pytest-asyncio): ``async_test`` below."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer

from node.config import Config, RouteConfig
from node.core.errors import StoreError
from node.core.rows import RowWrite
from node.ipc import IpcError, RemoteError
from node.store import open_store
from node.store.memory import MemoryStore
from workers.http.app import MAX_BODY_BYTES, MAX_KEYS, MAX_ROWS, WorkerContext, make_app
from workers.http.errors import ERROR_CODES

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]

STARTED_AT = 1_700_000_000.0
NOW = 1_700_000_100.0


def async_test(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run an async test body in a fresh event loop."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return run


class Calls:
    """A callable that counts its calls and answers ``value``."""

    def __init__(self, value: Any = None) -> None:
        self.value = value
        self.args: list[tuple] = []

    def __call__(self, *args: Any) -> Any:
        self.args.append(args)
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value

    @property
    def count(self) -> int:
        return len(self.args)


def make_ctx(config: Config | None = None, store: Any = None, **kw: Any) -> WorkerContext:
    kw.setdefault("wake", Calls())
    kw.setdefault("clock", lambda: NOW)
    return WorkerContext(
        config=config or Config(name="t", workers=1),
        store=store if store is not None else open_store("memory://"),
        name="t",
        started_at=STARTED_AT,
        **kw,
    )


@contextlib.asynccontextmanager
async def serve(ctx: WorkerContext) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(make_app(ctx))) as client:
        yield client


async def error_of(resp: Any, status: int, code: str, field: str | None = "") -> dict:
    """Assert the error shape, status and code (and field, unless "")."""
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    doc = await resp.json()
    assert set(doc) == {"error"}
    assert set(doc["error"]) == {"code", "message", "field"}
    assert doc["error"]["code"] == code, doc
    assert code in ERROR_CODES
    assert ERROR_CODES[code][0] == status
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    if field != "":
        assert doc["error"]["field"] == field, doc
    return doc["error"]


JSON_HEADERS = {"Content-Type": "application/json"}
MSGPACK_HEADERS = {"Content-Type": "application/msgpack"}


def big(data: bytes) -> io.BytesIO:
    """A large body as a stream (aiohttp's client warns about large bytes)."""
    return io.BytesIO(data)


def snapshot(store: MemoryStore) -> tuple[int, int]:
    return store.count(), store.last_seq()


# -- health and readiness ----------------------------------------------------------


@async_test
async def test_healthz() -> None:
    async with serve(make_ctx()) as client:
        resp = await client.get("/healthz")
        assert resp.status == 200
        assert await resp.json() == {"ok": True, "pid": os.getpid(), "name": "t"}


@pytest.mark.parametrize(
    ("state", "ready"),
    [
        (None, False),
        ({"first_publish_at": 0.0}, False),
        ({"first_publish_at": STARTED_AT - 5}, False),  # a publish from before this start
        ({"first_publish_at": STARTED_AT}, True),
        ({"first_publish_at": STARTED_AT + 1, "status": "live"}, True),
        (RuntimeError("torn read"), False),
    ],
)
@async_test
async def test_readyz(state: Any, ready: bool) -> None:
    ctx = make_ctx(keeper_state=Calls(state), work=_WorkWithLedger(_Ledger()))
    async with serve(ctx) as client:
        resp = await client.get("/readyz")
        doc = await resp.json()
        assert resp.status == (200 if ready else 503)
        assert doc["ready"] is ready
        assert isinstance(doc["reason"], str) and doc["reason"]


class _Ledger:
    """The ledger's IPC as /readyz sees it: answers, or raises ``error``."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.ops: list[str] = []

    async def call(self, op: str, timeout_s: float = 30.0, **fields: Any) -> dict[str, Any]:
        self.ops.append(op)
        if self.error is not None:
            raise self.error
        return {}


class _WorkWithLedger:
    def __init__(self, ledger: _Ledger) -> None:
        self.ledger = ledger


@pytest.mark.parametrize(
    ("work", "why"),
    [
        (None, "the work path is not running"),
        (_WorkWithLedger(_Ledger(IpcError("ledger not reachable"))), "ledger does not answer"),
        (_WorkWithLedger(_Ledger(RemoteError("internal", "x"))), "ledger does not answer"),
    ],
)
@async_test
async def test_readyz_waits_for_the_ledger(work: Any, why: str) -> None:
    """A published keeper is not enough: a completion needs the ledger."""
    state = Calls({"first_publish_at": STARTED_AT + 1})
    async with serve(make_ctx(keeper_state=state, work=work)) as client:
        resp = await client.get("/readyz")
        doc = await resp.json()
        assert resp.status == 503, doc
        assert doc["ready"] is False and why in doc["reason"], doc


# -- POST /rows ----------------------------------------------------------------------


@async_test
async def test_post_rows_upserts_and_wakes() -> None:
    ctx = make_ctx()
    async with serve(ctx) as client:
        rows = [
            {"key": "a", "route": "r"},
            {
                "key": "b",
                "route": "r",
                "cadence_s": 600,
                "sitemap": True,
                "due_at": 5.0,
                "payload": {"x": [1, 2]},
                "job": "j1",
            },
        ]
        resp = await client.post("/rows", json=rows)
        assert resp.status == 200
        assert await resp.json() == {"upserted": 2}
    assert ctx.wake.count == 1
    a, b = ctx.store.get("a"), ctx.store.get("b")
    assert (a.cadence_s, a.sitemap, a.due_at, a.job) == (None, False, NOW, "default")
    assert (b.cadence_s, b.sitemap, b.due_at, b.payload, b.job) == (
        600,
        True,
        5.0,
        {"x": [1, 2]},
        "j1",
    )
    assert {c.origin for c in ctx.store.changes(0, 10)} == {"node"}


@async_test
async def test_update_changes_only_the_fields_it_carries() -> None:
    ctx = make_ctx()
    async with serve(ctx) as client:
        resp = await client.post("/rows", json=[{"key": "a", "route": "r", "cadence_s": 600}])
        assert resp.status == 200
        resp = await client.post("/rows", json=[{"key": "a", "route": "r2", "payload": 1}])
        assert await resp.json() == {"upserted": 1}
    row = ctx.store.get("a")
    assert (row.route, row.cadence_s, row.payload) == ("r2", 600, 1)


@async_test
async def test_empty_batch_writes_nothing() -> None:
    ctx = make_ctx()
    async with serve(ctx) as client:
        resp = await client.post("/rows", json=[])
        assert await resp.json() == {"upserted": 0}
    assert ctx.wake.count == 0
    assert ctx.store.last_seq() == 0


@async_test
async def test_batch_with_one_bad_row_changes_nothing() -> None:
    ctx = make_ctx()
    ctx.store.upsert([RowWrite("old", "r")], now=NOW)
    before = snapshot(ctx.store)
    async with serve(ctx) as client:
        rows = [
            {"key": "a", "route": "r"},
            {"key": "old", "route": "r", "cadence_s": 5},
            {"key": "c", "route": "r"},
        ]
        resp = await client.post("/rows", json=rows)
        await error_of(resp, 400, "invalid_cadence", "rows[1].cadence_s")
    assert snapshot(ctx.store) == before
    assert ctx.store.changes(before[1], 10) == []
    assert ctx.store.get("old").cadence_s is None
    assert ctx.wake.count == 0


@pytest.mark.parametrize(
    ("row", "code", "field"),
    [
        ("not a row", "invalid_row", "rows[0]"),
        ([], "invalid_row", "rows[0]"),
        ({"route": "r"}, "missing_field", "rows[0].key"),
        ({"key": "a"}, "missing_field", "rows[0].route"),
        ({"key": "", "route": "r"}, "invalid_key", "rows[0].key"),
        ({"key": 7, "route": "r"}, "invalid_key", "rows[0].key"),
        ({"key": "k" * 1025, "route": "r"}, "invalid_key", "rows[0].key"),
        ({"key": "\ud800", "route": "r"}, "invalid_key", "rows[0].key"),
        ({"key": "a", "route": ""}, "invalid_route", "rows[0].route"),
        ({"key": "a", "route": "r" * 129}, "invalid_route", "rows[0].route"),
        ({"key": "a", "route": "r", "cadence_s": 59}, "invalid_cadence", "rows[0].cadence_s"),
        ({"key": "a", "route": "r", "cadence_s": 60.5}, "invalid_cadence", "rows[0].cadence_s"),
        ({"key": "a", "route": "r", "cadence_s": "1h"}, "invalid_cadence", "rows[0].cadence_s"),
        ({"key": "a", "route": "r", "cadence_s": True}, "invalid_cadence", "rows[0].cadence_s"),
        ({"key": "a", "route": "r", "sitemap": 1}, "invalid_sitemap", "rows[0].sitemap"),
        ({"key": "a", "route": "r", "due_at": -1}, "invalid_due_at", "rows[0].due_at"),
        ({"key": "a", "route": "r", "due_at": "now"}, "invalid_due_at", "rows[0].due_at"),
        ({"key": "a", "route": "r", "due_at": 1e300}, "invalid_due_at", "rows[0].due_at"),
        (
            {"key": "a", "route": "r", "payload": "x" * (1 << 20)},
            "payload_too_large",
            "rows[0].payload",
        ),
        ({"key": "a", "route": "r", "job": "no spaces"}, "invalid_job", "rows[0].job"),
        ({"key": "a", "route": "r", "job": ""}, "invalid_job", "rows[0].job"),
        ({"key": "a", "route": "r", "version": 3}, "unknown_field", "rows[0].version"),
    ],
)
@async_test
async def test_row_validation_codes(row: Any, code: str, field: str) -> None:
    ctx = make_ctx()
    async with serve(ctx) as client:
        resp = await client.post(
            "/rows", data=big(json.dumps([row]).encode()), headers=JSON_HEADERS
        )
        await error_of(resp, 400, code, field)
    assert snapshot(ctx.store) == (0, 0)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"", "invalid_json"),
        (b"   ", "invalid_json"),
        (b"[{", "invalid_json"),
        (b"[NaN]", "invalid_json"),
        (b'[{"key": "a", "route": "r", "due_at": Infinity}]', "invalid_json"),
        (b"\xff\xfe[]", "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
        (b"[" + b"9" * 5000 + b"]", "invalid_json"),  # past Python's int digit limit
        (b'{"key": "a", "route": "r"}', "invalid_body"),
        (b'"rows"', "invalid_body"),
        (b"null", "invalid_body"),
    ],
)
@async_test
async def test_malformed_bodies(body: bytes, code: str) -> None:
    ctx = make_ctx()
    async with serve(ctx) as client:
        resp = await client.post("/rows", data=body, headers={"Content-Type": "application/json"})
        await error_of(resp, 400, code)
    assert snapshot(ctx.store) == (0, 0)


@async_test
async def test_too_many_rows() -> None:
    ctx = make_ctx()
    rows = [{"key": f"k{i}", "route": "r"} for i in range(MAX_ROWS + 1)]
    async with serve(ctx) as client:
        resp = await client.post("/rows", json=rows)
        await error_of(resp, 400, "too_many_rows", "rows")
        resp = await client.post("/rows", json=rows[:MAX_ROWS])
        assert await resp.json() == {"upserted": MAX_ROWS}
    assert ctx.store.count() == MAX_ROWS


@async_test
async def test_body_over_16_mib_is_413() -> None:
    ctx = make_ctx()
    async with serve(ctx) as client:
        exact = b"[]" + b" " * (MAX_BODY_BYTES - 2)
        resp = await client.post("/rows", data=big(exact), headers=JSON_HEADERS)
        assert await resp.json() == {"upserted": 0}
        resp = await client.post("/rows", data=big(exact + b" "), headers=JSON_HEADERS)
        await error_of(resp, 413, "body_too_large")

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
            yield b"["
            for _ in range(17):
                yield b" " * (1 << 20)
            yield b"]"

        resp = await client.post("/rows", data=chunks())
        await error_of(resp, 413, "body_too_large")
        resp = await client.get("/healthz")  # the worker is fine afterwards
        assert resp.status == 200
    assert ctx.store.last_seq() == 0


# -- msgpack ------------------------------------------------------------------------


@async_test
async def test_msgpack_body_and_answer() -> None:
    ctx = make_ctx()
    rows = [{"key": "a", "route": "r", "payload": {"n": 1}}, {"key": "b", "route": "r"}]
    async with serve(ctx) as client:
        resp = await client.post(
            "/rows",
            data=msgpack.packb(rows),
            headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"},
        )
        assert resp.status == 200
        assert resp.content_type == "application/msgpack"
        assert msgpack.unpackb(await resp.read()) == {"upserted": 2}
        # JSON answer unless the request accepts msgpack
        resp = await client.post(
            "/rows/delete",
            data=msgpack.packb({"keys": ["b"]}),
            headers={"Content-Type": "application/msgpack"},
        )
        assert await resp.json() == {"deleted": 1}
    assert ctx.store.get("a").payload == {"n": 1}
    assert ctx.store.count() == 1


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"\xc1", "invalid_msgpack"),  # never used
        (msgpack.packb([]) + b"\x00", "invalid_msgpack"),  # extra data
        (msgpack.packb([{"key": "a"}])[:-1], "invalid_msgpack"),  # truncated
        (b'[{"key": "a", "route": "r"}]', "invalid_msgpack"),  # JSON sent as msgpack
        (msgpack.packb({1: 2}), "invalid_msgpack"),  # non-string map keys
        (b"\xa2\xff\xfe", "invalid_msgpack"),  # a str that is not UTF-8
        (msgpack.packb({"key": "a"}), "invalid_body"),
        (msgpack.packb([{"key": b"a", "route": "r"}]), "invalid_key"),
        (msgpack.packb([{"key": "a", "route": "r", "payload": b"\x00"}]), "invalid_payload"),
        (
            msgpack.packb([{"key": "a", "route": "r", "payload": msgpack.ExtType(1, b"x")}]),
            "invalid_payload",
        ),
    ],
)
@async_test
async def test_malformed_msgpack(body: bytes, code: str) -> None:
    ctx = make_ctx()
    async with serve(ctx) as client:
        resp = await client.post("/rows", data=body, headers=MSGPACK_HEADERS)
        await error_of(resp, 400, code)
    assert snapshot(ctx.store) == (0, 0)


@pytest.mark.parametrize("depth", [500, 900, 990, 1020, 2000, 100_000])
@async_test
async def test_deep_payload_is_refused_not_500(depth: int) -> None:
    """msgpack decodes deeper than JSON encodes: the payload check runs out of
    stack, which must still be the caller's 400."""
    payload: Any = 0
    for _ in range(min(depth, 1000)):
        payload = [payload]
    body = msgpack.packb([{"key": "a", "route": "r", "payload": payload}])
    if depth > 1000:  # deeper than msgpack-python builds: write the bytes by hand
        body = b"\x91\x83\xa3key\xa1a\xa5route\xa1r\xa7payload" + b"\x91" * depth + b"\x00"
    ctx = make_ctx()
    async with serve(ctx) as client:
        resp = await client.post("/rows", data=body, headers=MSGPACK_HEADERS)
        assert resp.status in (200, 400), await resp.text()
        if resp.status == 400:
            assert (await resp.json())["error"]["code"] in ("invalid_msgpack", "invalid_payload")


# -- max_classes ----------------------------------------------------------------------


def _class_config(max_classes: int) -> Config:
    return Config(
        name="t", workers=1, max_classes=max_classes, routes={"fast": RouteConfig(cadence_s=600)}
    )


@async_test
async def test_too_many_classes_refused_whole() -> None:
    known = {("fast", 600, "route", False)}
    ctx = make_ctx(_class_config(2), known_classes=Calls(known))
    async with serve(ctx) as client:
        rows = [
            {"key": "a", "route": "fast"},
            {"key": "b", "route": "fast", "cadence_s": 60},
            {"key": "c", "route": "fast", "sitemap": True},
        ]
        resp = await client.post("/rows", json=rows)
        await error_of(resp, 400, "too_many_classes", "rows")
        # one new class fits
        resp = await client.post("/rows", json=rows[:2])
        assert await resp.json() == {"upserted": 2}
    assert ctx.store.count() == 2


@async_test
async def test_batch_classes_count_even_without_the_keeper() -> None:
    ctx = make_ctx(_class_config(1))
    async with serve(ctx) as client:
        rows = [{"key": "a", "route": "x"}, {"key": "b", "route": "y"}]
        resp = await client.post("/rows", json=rows)
        await error_of(resp, 400, "too_many_classes")
    assert snapshot(ctx.store) == (0, 0)


@async_test
async def test_update_without_cadence_keeps_the_stored_class() -> None:
    store = open_store("memory://")
    store.upsert([RowWrite("a", "fast", cadence_s=120, sitemap=True)], now=NOW)
    known = {("fast", 120, "row", True)}
    ctx = make_ctx(_class_config(1), store, known_classes=Calls(known))
    async with serve(ctx) as client:
        resp = await client.post("/rows", json=[{"key": "a", "route": "fast", "payload": 1}])
        assert await resp.json() == {"upserted": 1}
        # the same write for a new key is an insert: route default, not a sitemap row
        resp = await client.post("/rows", json=[{"key": "new", "route": "fast"}])
        await error_of(resp, 400, "too_many_classes")
        # a later write in the batch sees what the earlier one set
        rows = [
            {"key": "n2", "route": "fast", "cadence_s": 120, "sitemap": True},
            {"key": "n2", "route": "fast"},
        ]
        resp = await client.post("/rows", json=rows)
        assert await resp.json() == {"upserted": 2}


@async_test
async def test_writes_into_known_classes_pass_when_over_the_limit() -> None:
    known = {("fast", 600, "route", False), ("x", 86400, "route", False)}
    ctx = make_ctx(_class_config(1), known_classes=Calls(known))
    async with serve(ctx) as client:
        resp = await client.post("/rows", json=[{"key": "a", "route": "x"}])
        assert await resp.json() == {"upserted": 1}


@async_test
async def test_known_classes_failing_is_not_the_callers_problem() -> None:
    ctx = make_ctx(known_classes=Calls(OSError("segment gone")), wake=Calls(OSError("gone")))
    async with serve(ctx) as client:
        resp = await client.post("/rows", json=[{"key": "a", "route": "x"}])
        assert await resp.json() == {"upserted": 1}


# -- POST /rows/delete ---------------------------------------------------------------


@async_test
async def test_delete() -> None:
    ctx = make_ctx()
    ctx.store.upsert([RowWrite("a", "r"), RowWrite("b", "r")], now=NOW)
    async with serve(ctx) as client:
        resp = await client.post("/rows/delete", json={"keys": ["a", "zz"]})
        assert await resp.json() == {"deleted": 1}
        assert ctx.wake.count == 1
        resp = await client.post("/rows/delete", json={"keys": ["zz"]})
        assert await resp.json() == {"deleted": 0}
        assert ctx.wake.count == 1  # nothing changed, nothing to wake for
        resp = await client.post("/rows/delete", json={"keys": []})
        assert await resp.json() == {"deleted": 0}
    assert ctx.store.count() == 1


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({}, "missing_field", "keys"),
        ([], "invalid_body", None),
        ({"keys": "a"}, "invalid_body", "keys"),
        ({"keys": ["a", 3]}, "invalid_key", "keys[1]"),
        ({"keys": ["a", ""]}, "invalid_key", "keys[1]"),
        ({"keys": ["a"], "force": True}, "unknown_field", "force"),
        ({"keys": ["k"] * (MAX_KEYS + 1)}, "too_many_keys", "keys"),
    ],
)
@async_test
async def test_delete_validation(body: Any, code: str, field: str | None) -> None:
    ctx = make_ctx()
    ctx.store.upsert([RowWrite("a", "r")], now=NOW)
    async with serve(ctx) as client:
        resp = await client.post("/rows/delete", json=body)
        await error_of(resp, 400, code, field)
    assert snapshot(ctx.store) == (1, 1)


# -- GET /rows ---------------------------------------------------------------------


@async_test
async def test_get_row_with_the_keepers_view() -> None:
    view = {"held": True, "due": True, "status": "live"}
    explain = Calls(view)
    ctx = make_ctx(explain=explain)
    ctx.store.upsert([RowWrite("a b/c", "r", cadence_s=600, payload=[1])], now=NOW)
    async with serve(ctx) as client:
        resp = await client.get("/rows", params={"key": "a b/c"})
        doc = await resp.json()
    assert resp.status == 200
    assert doc == {
        "row": {
            "key": "a b/c",
            "route": "r",
            "cadence_s": 600,
            "sitemap": False,
            "due_at": NOW,
            "payload": [1],
            "job": "default",
            "version": 1,
            # The outcome of the row's last lease: none yet.
            "last_result_id": None,
            "last_finished_at": None,
            "last_error": None,
        },
        "keeper": view,
        "lease": None,
    }
    assert explain.args == [("a b/c",)]


@pytest.mark.parametrize("answer", [None, TimeoutError("slow")])
@async_test
async def test_get_row_when_the_keeper_does_not_answer(answer: Any) -> None:
    ctx = make_ctx(explain=Calls(answer))
    ctx.store.upsert([RowWrite("a", "r")], now=NOW)
    async with serve(ctx) as client:
        resp = await client.get("/rows?key=a")
        doc = await resp.json()
    assert resp.status == 200
    assert doc["keeper"] == {"available": False, "reason": "keeper did not answer"}


@async_test
async def test_get_row_errors() -> None:
    ctx = make_ctx()
    async with serve(ctx) as client:
        await error_of(await client.get("/rows"), 400, "missing_field", "key")
        await error_of(await client.get("/rows?key="), 400, "invalid_key", "key")
        await error_of(await client.get("/rows?key=" + "k" * 1025), 400, "invalid_key", "key")
        await error_of(await client.get("/rows?key=nope"), 404, "not_found", "key")


@async_test
async def test_get_invalid_stored_row() -> None:
    ctx = make_ctx()
    # Another program wrote a cadence the keeper cannot schedule.
    ctx.store.upsert([RowWrite("bad", "r", cadence_s=5)], now=NOW)
    async with serve(ctx) as client:
        resp = await client.get("/rows?key=bad")
        doc = await resp.json()
    assert resp.status == 200
    assert doc["row"]["key"] == "bad"
    assert doc["row"]["version"] == 1
    assert "cadence_s=5" in doc["row"]["invalid"]


# -- HTTP errors --------------------------------------------------------------------


@async_test
async def test_unknown_path_and_wrong_method_are_json() -> None:
    async with serve(make_ctx()) as client:
        await error_of(await client.get("/nope"), 404, "not_found", None)
        await error_of(await client.post("/nope", json=[]), 404, "not_found")
        resp = await client.post("/healthz", json={})
        await error_of(resp, 405, "method_not_allowed")
        assert "GET" in resp.headers["Allow"]
        resp = await client.get("/rows/delete")
        await error_of(resp, 405, "method_not_allowed")
        assert "POST" in resp.headers["Allow"]
        resp = await client.delete("/rows")
        await error_of(resp, 405, "method_not_allowed")


class _Broken(MemoryStore):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def upsert(self, *args: Any, **kwargs: Any) -> int:
        raise self.exc


@async_test
async def test_a_bug_is_500_with_a_logged_traceback(caplog: pytest.LogCaptureFixture) -> None:
    ctx = make_ctx(store=_Broken(ZeroDivisionError("bug")))
    with caplog.at_level(logging.ERROR, logger="queue-node.http"):
        async with serve(ctx) as client:
            resp = await client.post("/rows", json=[{"key": "a", "route": "r"}])
            await error_of(resp, 500, "internal_error")
            assert "bug" not in (await resp.text())  # no internals leak to the caller
    assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)


@async_test
async def test_store_failure_is_503() -> None:
    ctx = make_ctx(store=_Broken(StoreError("disk I/O error")))
    async with serve(ctx) as client:
        resp = await client.post("/rows", json=[{"key": "a", "route": "r"}])
        await error_of(resp, 503, "store_unavailable")


async def _raw_request(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@async_test
async def test_broken_framing_is_never_5xx() -> None:
    ctx = make_ctx()
    async with serve(ctx) as client:
        port = client.port
        assert port is not None
        for request in (
            b"POST /rows HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n",
            b"POST /rows HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n[]",
            b"POST /rows HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: 4\r\n\r\nnope",
            b"GARBAGE\r\n\r\n",
        ):
            answer = await _raw_request(port, request)
            status = int(answer.split(b" ", 2)[1])
            assert 400 <= status < 500, answer[:200]
    assert ctx.store.last_seq() == 0


@async_test
async def test_fuzzed_bodies_are_never_5xx() -> None:
    """Mangled versions of valid bodies, in both encodings, on every POST."""
    rng = random.Random(1234)
    ctx = make_ctx(config=_class_config(50))
    valid_rows = [
        {
            "key": "a",
            "route": "r",
            "cadence_s": 600,
            "sitemap": True,
            "due_at": 1.5,
            "payload": {"x": [1, "y", None]},
            "job": "j",
        }
    ]
    seeds = [json.dumps(valid_rows).encode(), json.dumps({"keys": ["a", "b"]}).encode()]
    values: list[Any] = [
        None,
        True,
        0,
        -1,
        1.5,
        1e308,
        "",
        "x",
        [],
        {},
        [[]],
        {"": None},
        "\u0000",
        2**70,
    ]
    async with serve(ctx) as client:
        for i in range(400):
            seed = rng.choice(seeds)
            kind = i % 4
            if kind == 0:  # flip bytes
                body = bytearray(seed)
                for _ in range(rng.randint(1, 4)):
                    body[rng.randrange(len(body))] = rng.randrange(256)
                body = bytes(body)
            elif kind == 1:  # truncate
                body = seed[: rng.randrange(len(seed))]
            elif kind == 2:  # replace a field's value
                row = dict(valid_rows[0])
                row[rng.choice(list(row))] = rng.choice(values)
                body = json.dumps([row] if rng.random() < 0.8 else row).encode()
            else:  # random msgpack
                packable = values[:-1]  # not 2**70
                obj = rng.choice([valid_rows, {"keys": rng.choice(packable)}, rng.choice(packable)])
                body = msgpack.packb(obj)
                if rng.random() < 0.5:
                    body = body[: rng.randrange(len(body) + 1)]
            ctype = "application/msgpack" if kind == 3 else "application/json"
            path = rng.choice(["/rows", "/rows/delete"])
            resp = await client.post(path, data=body, headers={"Content-Type": ctype})
            assert resp.status < 500, (path, body, await resp.text())
            if resp.status != 200:
                await error_of(resp, resp.status, (await resp.json())["error"]["code"])


# -- token ------------------------------------------------------------------------


@async_test
async def test_token_guards_every_post_and_read() -> None:
    ctx = make_ctx(Config(name="t", workers=1, token="s3cret"))
    async with serve(ctx) as client:
        rows = [{"key": "a", "route": "r"}]
        resp = await client.post("/rows", json=rows)
        await error_of(resp, 401, "unauthorized")
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        for header in (
            "Bearer wrong",
            "Basic s3cret",
            "s3cret",
            "Bearer",
            "Bearer s3cret2",
            "Bearer s3crét",
        ):
            resp = await client.post("/rows", json=rows, headers={"Authorization": header})
            await error_of(resp, 401, "unauthorized")
        resp = await client.post("/rows/delete", json={"keys": ["a"]})
        await error_of(resp, 401, "unauthorized")
        # checked before the body is read
        resp = await client.post("/rows", data=b"{{{")
        await error_of(resp, 401, "unauthorized")
        # an unknown path answers 401 too: no probing of paths without the token
        await error_of(await client.post("/nope"), 401, "unauthorized")
        ok = {"Authorization": "Bearer s3cret"}
        resp = await client.post("/rows", json=rows, headers=ok)
        assert await resp.json() == {"upserted": 1}
        resp = await client.post("/rows", json=rows, headers={"Authorization": "bearer  s3cret "})
        assert resp.status == 200
        # reads need it too, but for liveness and readiness (and a HEAD of them)
        await error_of(await client.get("/rows?key=a"), 401, "unauthorized")
        await error_of(await client.get("/openapi.json"), 401, "unauthorized")
        await error_of(await client.get("/nope"), 401, "unauthorized")
        await error_of(await client.post("/healthz"), 401, "unauthorized")
        assert (await client.get("/rows?key=a", headers=ok)).status == 200
        assert (await client.get("/healthz")).status == 200
        assert (await client.head("/healthz")).status == 200
        assert (await client.get("/readyz")).status in (200, 503)
    assert ctx.store.count() == 1


@async_test
async def test_extra_routes_need_the_token_unless_named_open() -> None:
    from aiohttp import web

    from workers.http.errors import reply

    extra = web.RouteTableDef()

    @extra.get("/jobs/{job}/results")
    async def poll(request: web.Request) -> web.Response:
        return reply(request, {"results": []})

    @extra.get("/metrics")
    async def scrape(request: web.Request) -> web.Response:
        return reply(request, {"ok": True})

    ctx = make_ctx(Config(name="t", workers=1, token="s3cret"))
    async with TestClient(TestServer(make_app(ctx, extra))) as client:
        await error_of(await client.get("/jobs/j/results"), 401, "unauthorized")
        resp = await client.get("/jobs/j/results", headers={"Authorization": "Bearer s3cret"})
        assert await resp.json() == {"results": []}
        assert (await client.get("/metrics")).status == 200  # in OPEN_ROUTES


@async_test
async def test_non_ascii_authorization_is_401_not_500() -> None:
    ctx = make_ctx(Config(name="t", workers=1, token="s3cret"))
    async with serve(ctx) as client:
        port = client.port
        assert port is not None
        answer = await _raw_request(
            port,
            b"POST /rows HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
            b"Content-Length: 2\r\nConnection: close\r\n\r\n[]",
        )
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


# -- OpenAPI -----------------------------------------------------------------------


@async_test
async def test_openapi_describes_every_route() -> None:
    app = make_app(make_ctx())
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/openapi.json")
        spec = await resp.json()
    assert spec["openapi"].startswith("3.1")
    served = {
        (r.resource.canonical, r.method.lower())
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    described = {(p, m) for p, ops in spec["paths"].items() for m in ops}
    assert served == described
    assert set(
        spec["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["code"]["enum"]
    ) == set(ERROR_CODES)


def test_every_error_code_is_documented() -> None:
    doc = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for code in ERROR_CODES:
        assert f"`{code}`" in doc, code


# -- the store thread ---------------------------------------------------------------


@async_test
async def test_store_executor_path(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    store = pool.submit(open_store, f"sqlite:///{tmp_path}/s.db").result()
    try:
        ctx = make_ctx(store=store, store_executor=pool)
        async with serve(ctx) as client:
            resp = await client.post("/rows", json=[{"key": "a", "route": "r"}])
            assert await resp.json() == {"upserted": 1}
            resp = await client.get("/rows?key=a")
            assert (await resp.json())["row"]["key"] == "a"
            resp = await client.post("/rows/delete", json={"keys": ["a"]})
            assert await resp.json() == {"deleted": 1}
    finally:
        pool.submit(store.close).result()
        pool.shutdown()


# -- the worker process -------------------------------------------------------------


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)  # the polling interval of a deadline wait
    return value


def _get(base: str, path: str, data: bytes | None = None) -> tuple[int, dict]:
    import ssl
    import urllib.error
    import urllib.request

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the test's self-signed certificate
    req = urllib.request.Request(base + path, data=data)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())
    except (ConnectionError, urllib.error.URLError):
        return 0, {}


@contextlib.contextmanager
def worker_process(config: Config, tmp_path: Path) -> Any:
    """``python -m workers.http`` on a socket we bind, as the supervisor does.
    Yields (proc, base URL); the test sends SIGTERM itself."""
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config.to_json()))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    scheme = "https" if config.tls_cert else "http"
    base = f"{scheme}://127.0.0.1:{sock.getsockname()[1]}"
    env = dict(
        os.environ, QUEUE_NODE_RUN_CONFIG=str(config_path), QUEUE_NODE_STARTED_AT=repr(STARTED_AT)
    )
    env.pop("QUEUE_NODE_SUPERVISOR_PID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.http", "--index", "1", "--listen-fd",
         str(sock.fileno())],
        cwd=ROOT,
        env=env,
        pass_fds=(sock.fileno(),),
        stderr=subprocess.PIPE,
        text=True,
    )
    sock.close()  # the child has its own copy
    try:
        wait_for(
            lambda: _get(base, "/healthz")[0] == 200 or proc.poll() is not None,
            20,
            "the worker to listen",
        )
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _stop(proc: subprocess.Popen) -> tuple[dict[str, str], str]:
    """SIGTERM; the fields of the one shutdown line, and stderr."""
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    stop_lines = [line for line in err.splitlines() if "action=worker_stop" in line]
    assert len(stop_lines) == 1, err
    assert "Traceback" not in err
    return dict(f.split("=", 1) for f in stop_lines[0].split() if "=" in f), err


def _config(tmp_path: Path, name: str, **kw: Any) -> Config:
    return Config(
        name=name, workers=1, store=f"sqlite:///{tmp_path}/schedule.db", data_dir=tmp_path, **kw
    )


def test_worker_process_serves_and_stops_on_sigterm(tmp_path: Path, node_name: str) -> None:
    config = _config(tmp_path, node_name)
    with worker_process(config, tmp_path) as (proc, base):
        assert _get(base, "/readyz")[0] == 503  # no keeper, no state buffer
        rows = json.dumps([{"key": "a", "route": "r"}]).encode()
        assert _get(base, "/rows", rows) == (200, {"upserted": 1})
        status, doc = _get(base, "/rows?key=a")
        assert status == 200
        assert doc["keeper"] == {"available": False, "reason": "keeper did not answer"}
        served, err = _stop(proc)
    assert int(served["requests"]) >= 4, err
    assert served["internal_errors"] == "0", err
    with open_store(config.store_url) as store:
        assert store.get("a") is not None


def test_worker_process_tls_and_token(tmp_path: Path, node_name: str) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = (
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            capture_output=True,
            timeout=30,
        )
        if shutil.which("openssl")
        else None
    )
    if made is None or made.returncode != 0:
        pytest.skip("openssl cannot make a test certificate here")
    config = _config(tmp_path, node_name, tls_cert=cert, tls_key=key, token="s3cret")
    with worker_process(config, tmp_path) as (proc, base):
        assert _get(base, "/healthz")[0] == 200
        status, doc = _get(base, "/rows", b"[]")
        assert (status, doc["error"]["code"]) == (401, "unauthorized")
        served, err = _stop(proc)
    assert "tls=true" in err


def test_worker_bad_arguments_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "workers.http", "--index", "x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


# keep the application factory importable without the shared-memory package
def test_http_module_does_not_import_shm() -> None:
    code = "import sys, workers.http; print('shm.state' in sys.modules, 'shm.wake' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    ).stdout
    assert out.split() == ["False", "False"]
