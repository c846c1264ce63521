"""The HTTP API served by workers 1..N.

``make_app(ctx)`` builds the aiohttp application; ``workers.http.__main__`` serves
it on the listening socket the supervisor passes down, and tests serve it with
aiohttp's test server. Everything the app needs from the rest of the node
comes through ``WorkerContext``, so tests pass plain callables where
production passes shared memory and the keeper's ask queue.

Hazards, and what we do about them:

- The store is blocking (SQLite). ``ctx.store_executor``, when given, is the
  one thread the store was opened on and is used from; every store call goes
  through ``_in_store`` so a slow write never stalls the event loop. Without
  one (tests, the memory store) calls are made inline.
- ``explain`` waits on the keeper's ask queue for up to half a second. It
  runs on its own single thread: ``keeper.ask`` keeps one reply queue per
  process, so two questions in flight at once would take each other's answers.
- A batch is validated whole before anything is written: one bad row refuses
  the batch, with the row's index in ``field`` (``rows[3].cadence_s``).

Routes live in ``routes`` (a RouteTableDef); the work path's own table
(``workers.http.work.routes``) is added through ``make_app``'s
``extra_routes`` and finds its objects in ``WorkerContext.work``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
import urllib.parse
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from node.core import log
from node.core.classes import carried
from node.core.config import Config
from node.core.errors import ValidationError
from node.core.rows import ORIGIN_NODE, RowWrite, check_key, parse_row
from node.ipc import IpcError, RemoteError
from node.store.base import BadRow, Store
from shm.ready.take import not_granting
from workers.classes import ClassId, check_class_limit, needs_stored, write_classes
from workers.http import openapi
from workers.http.errors import (
    MSGPACK_TYPES,
    SERVED,
    TOKEN,
    ApiError,
    Served,
    auth_middleware,
    error_middleware,
    reply,
    unsendable,
    wants_msgpack,
)

# Limits from the contract.
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_ROWS = 10_000
MAX_KEYS = 10_000

KEEPER_SILENT = {"available": False, "reason": "keeper did not answer"}
# /readyz asks the ledger a question answered from its memory ("stats"): it
# answers in microseconds once it listens, and a probe must not hang on it.
READY_LEDGER_TIMEOUT_S = 2.0

T = TypeVar("T")


def _nothing() -> None:
    return None


def _no_state() -> dict[str, Any] | None:
    return None


def _no_answer(key: str) -> dict[str, Any] | None:
    return None


def _no_classes() -> set[ClassId]:
    return set()


@dataclass
class WorkerContext:
    """What the HTTP app needs from the node. Production wiring is in
    ``workers.http.__main__``; tests pass plain callables."""

    config: Config
    store: Store
    name: str  # the node name
    started_at: float  # the node's start, wall seconds (QUEUE_NODE_STARTED_AT)
    # Post the keeper's wake semaphore after a committed write.
    wake: Callable[[], None] = _nothing
    # The state buffer as a dict ("first_publish_at", "started_at", "status",
    # "doc", …), or None when it cannot be read.
    keeper_state: Callable[[], dict[str, Any] | None] = _no_state
    # The keeper's view of one key, or None when the keeper did not answer.
    explain: Callable[[str], dict[str, Any] | None] = _no_answer
    # The class identities (route, cadence_s, source, sitemap) the keeper
    # reports: what the class check uses when there is no shared table.
    known_classes: Callable[[], set[ClassId]] = _no_classes
    # The node's shared class table (shm.classes.SharedClasses), used on the
    # store's thread only: a write reserves its new classes there.
    classes: Any = None
    # The thread the store lives on; None: call the store inline.
    store_executor: Executor | None = None
    # The work path (workers.http.work.WorkPath): claims, leases, the ledger.
    # None: those routes answer 503 not_ready, and GET /rows has no lease.
    work: Any = None
    clock: Callable[[], float] = field(default=time.time)
    # The ready set's grant deadline (CLOCK_MONOTONIC ns; 0: none, a node
    # outside a fleet): what /readyz reads of a fleet node's membership.
    grant_until_ns: Callable[[], int] = field(default=lambda: 0)


CTX = web.AppKey("ctx", WorkerContext)
ASK_POOL = web.AppKey("ask_pool", ThreadPoolExecutor)
# What a route opens at its first use (workers/http/cluster.py's way to the
# other nodes), by name: the app is frozen once it serves, this dict is not.
# Each value's ``close()`` is awaited at cleanup.
LAZY = web.AppKey("lazy", dict)

routes = web.RouteTableDef()


def make_app(
    ctx: WorkerContext, extra_routes: Iterable[web.AbstractRouteDef] = ()
) -> web.Application:
    """The API app. ``extra_routes`` (a RouteTableDef) adds endpoints; with
    a token configured every one of them needs it, unless it is named in
    ``workers.http.errors.OPEN_ROUTES``."""
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=[error_middleware, auth_middleware],
    )
    app[CTX] = ctx
    app[SERVED] = Served()
    if ctx.config.token:
        app[TOKEN] = ctx.config.token
    app[ASK_POOL] = ThreadPoolExecutor(1, thread_name_prefix="keeper-ask")
    app[LAZY] = {}
    app.router.add_routes(routes)
    app.router.add_routes(extra_routes)
    app.on_cleanup.append(_cleanup)
    return app


async def _cleanup(app: web.Application) -> None:
    app[ASK_POOL].shutdown(wait=False, cancel_futures=True)
    for opened in app[LAZY].values():
        await opened.close()


async def _in_store(ctx: WorkerContext, fn: Callable[..., T], *args: Any) -> T:
    if ctx.store_executor is None:
        return fn(*args)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(ctx.store_executor, functools.partial(fn, *args))


def _safely(what: str, fn: Callable[..., T], *args: Any) -> T | None:
    """Call into the keeper's side (shared memory, the ask queue). Its failure
    is the node's problem, never the caller's: log it and answer without it."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - see docstring
        log.warn("keeper_read_failed", what=what, error=repr(exc))
        return None


def _wake(ctx: WorkerContext) -> None:
    # The write is committed; a failed nudge only delays the keeper to its
    # next poll, so it must not turn a 200 into an error.
    _safely("wake", ctx.wake)


# -- bodies --------------------------------------------------------------------------


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def read_body(request: web.Request) -> Any:
    """The decoded body: msgpack when Content-Type says so, JSON otherwise."""
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:
        raise ApiError(413, "body_too_large", "the request body is over 16 MiB")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, "body_too_large", "the request body is over 16 MiB") from None
    except (
        web.RequestPayloadError,  # a broken chunked or compressed body
        HttpProcessingError,
        ConnectionError,
        asyncio.IncompleteReadError,
    ) as exc:
        raise ApiError(400, "bad_request", f"the request body could not be read: {exc}") from None
    if request.content_type in MSGPACK_TYPES:
        try:
            return msgpack.unpackb(raw, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            detail = str(exc) or type(exc).__name__  # StackError has no message
            raise ApiError(
                400, "invalid_msgpack", f"the body is not valid msgpack: {detail}"
            ) from None
    if not raw.strip():
        raise ApiError(400, "invalid_json", "the request body is empty")
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise ApiError(400, "invalid_json", "the body nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, huge ints
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {exc}") from None


def _expect(body: Any, kind: type, what: str, field_name: str | None) -> None:
    if not isinstance(body, kind):
        raise ApiError(400, "invalid_body", f"the body must be {what}", field_name)


def parse_rows(body: Any) -> list[RowWrite]:
    """Validate a POST /rows body whole; the first bad row refuses the batch."""
    _expect(body, list, "a list of rows", "rows")
    if len(body) > MAX_ROWS:
        raise ApiError(
            400, "too_many_rows", f"{len(body)} rows; at most {MAX_ROWS} per request", "rows"
        )
    writes = []
    for i, obj in enumerate(body):
        where = f"rows[{i}]"
        if not isinstance(obj, dict):
            raise ValidationError("invalid_row", "a row must be a JSON object", where)
        try:
            writes.append(parse_row(obj, f"{where}."))
        except RecursionError:
            # check_payload encodes the payload; a deep enough one (msgpack
            # decodes deeper than JSON) runs out of stack there.
            raise ValidationError(
                "invalid_payload", "payload nests too deeply", f"{where}.payload"
            ) from None
    return writes


def parse_delete(body: Any) -> list[str]:
    _expect(body, dict, 'an object {"keys": [...]}', None)
    unknown = sorted(set(body) - {"keys"})
    if unknown:
        raise ValidationError("unknown_field", f"unknown field {unknown[0]!r}", unknown[0])
    if "keys" not in body:
        raise ValidationError("missing_field", "the body needs keys", "keys")
    keys = body["keys"]
    _expect(keys, list, "a list of keys in keys", "keys")
    if len(keys) > MAX_KEYS:
        raise ApiError(
            400, "too_many_keys", f"{len(keys)} keys; at most {MAX_KEYS} per request", "keys"
        )
    return [check_key(k, f"keys[{i}]") for i, k in enumerate(keys)]


def known_query(request: web.Request, *allowed: str) -> None:
    """Refuse a query parameter the endpoint does not know, as an unknown
    body field is refused: ``?maxx=5`` would otherwise poll the default 100
    and the typo would go unnoticed."""
    unknown = sorted(set(request.query) - set(allowed))
    if unknown:
        raise ValidationError(
            "unknown_field", f"unknown query parameter {unknown[0]!r}", unknown[0]
        )


def query_value(request: web.Request, name: str, code: str) -> str | None:
    """Query parameter ``name``'s value (None when absent). One given more
    than once (``?wait_s=0&wait_s=soon``) is refused with ``code``, the
    code of a bad value of it: which value was meant is the caller's to
    say, and taking the first would pass over it without a word."""
    values = request.query.getall(name, ())
    if len(values) > 1:
        raise ValidationError(
            code, f"query parameter {name!r} is given more than once; give it once", name
        )
    return values[0] if values else None


def strict_query(request: web.Request, name: str, code: str) -> str:
    """The first value of query parameter ``name``, its percent-encoding
    decoded as strict UTF-8. aiohttp decodes bytes that are not UTF-8 as
    U+FFFD, which would turn ``?key=%FF`` into a different, valid key; that
    is the caller's mistake (``code``), not a lookup of some other row;
    so is the parameter given more than once."""
    query_value(request, name, code)
    for pair in request.rel_url.raw_query_string.split("&"):
        raw_name, _, raw_value = pair.partition("=")
        if urllib.parse.unquote_plus(raw_name) != name:
            continue
        try:
            return urllib.parse.unquote_plus(raw_value, errors="strict")
        except UnicodeDecodeError:
            raise ValidationError(
                code, f"{name} is not valid UTF-8 once percent-decoded", name
            ) from None
    return request.query[name]


# -- writes (run on the store's thread) ----------------------------------------------


def write_rows(ctx: WorkerContext, writes: list[RowWrite], known: set[ClassId]) -> int:
    """Reserve the write's classes (or, with no shared table, check the
    limit against ``known``), then upsert. Nothing is written when the
    reservation or the check refuses; a reservation whose upsert then fails
    keeps its slot (shm/classes.py)."""
    stored = ctx.store.get_many(needs_stored(writes))
    batch = write_classes(ctx.config, writes, stored)
    if ctx.classes is not None:
        ctx.classes.reserve(map(carried, batch))
    else:
        check_class_limit(known, batch, ctx.config.max_classes)
    return ctx.store.upsert(writes, now=ctx.clock(), origin=ORIGIN_NODE)


# -- handlers ------------------------------------------------------------------------


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return reply(request, {"ok": True, "pid": os.getpid(), "name": request.app[CTX].name})


def readiness(ctx: WorkerContext) -> tuple[bool, str]:
    state = _safely("state", ctx.keeper_state)
    if state is None:
        return False, "the keeper's state buffer cannot be read"
    first = state.get("first_publish_at") or 0
    if not isinstance(first, int | float) or first <= 0:
        return False, "the keeper has not published yet"
    if first < ctx.started_at:
        return False, "the keeper has not published since the node started"
    doc = state.get("doc") or {}
    member = (doc.get("trust") or {}).get("membership") or {}
    if (member.get("peers") or {}).get("state") == "waiting":
        # It published an empty set: nothing to claim until a peer shows.
        return False, "waiting for its fleet peers (docs/fleet.md)"
    if member.get("handover_left_s"):
        # Joined: it offers nothing until no other node can grant its rows.
        return False, f"joining the fleet: grants in {member['handover_left_s']} s (docs/fleet.md)"
    until = _safely("grant deadline", ctx.grant_until_ns) or 0
    now_ns = time.monotonic_ns()
    if until and now_ns >= until:
        return False, f"not_granting: {not_granting(until, now_ns)}"
    return True, "the keeper has published"


async def ledger_readiness(ctx: WorkerContext) -> tuple[bool, str]:
    """Whether this worker's ledger connection takes a request now. After a
    restart the ledger listens only once it has recovered its log, which
    can be after the keeper's first publish: until then a completion would
    be 503 ``ledger_unavailable``, so the node is not ready."""
    if ctx.work is None:
        return False, "the work path is not running in this worker"
    try:
        await ctx.work.ledger.call("stats", timeout_s=READY_LEDGER_TIMEOUT_S)
    except (IpcError, RemoteError) as exc:
        return False, f"the ledger does not answer yet: {exc}"
    return True, "the keeper has published and the ledger answers"


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """Ready means the node can take a claim and its completion: the keeper
    has published since the node started and the ledger answers."""
    ctx = request.app[CTX]
    ready, reason = readiness(ctx)
    if ready:
        ready, reason = await ledger_readiness(ctx)
    return reply(request, {"ready": ready, "reason": reason}, 200 if ready else 503)


@routes.post("/rows")
async def post_rows(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    writes = parse_rows(await read_body(request))
    if not writes:
        return reply(request, {"upserted": 0})
    known = set() if ctx.classes is not None else _safely("classes", ctx.known_classes) or set()
    n = await _in_store(ctx, write_rows, ctx, writes, known)
    if n:
        _wake(ctx)
    return reply(request, {"upserted": n})


@routes.post("/rows/delete")
async def delete_rows(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    keys = parse_delete(await read_body(request))
    if not keys:
        return reply(request, {"deleted": 0})
    n = await _in_store(ctx, functools.partial(ctx.store.delete, origin=ORIGIN_NODE), keys)
    if n:
        _wake(ctx)
    return reply(request, {"deleted": n})


@routes.get("/rows")
async def get_row(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    known_query(request, "key")
    if "key" not in request.query:
        raise ValidationError("missing_field", "give the row's key: /rows?key=K", "key")
    key = check_key(strict_query(request, "key", "invalid_key"), "key")
    row = await _in_store(ctx, ctx.store.get, key)
    if row is None:
        raise ApiError(404, "not_found", "no row with this key", "key")
    if isinstance(row, BadRow):
        # Written by another program with values the keeper cannot schedule.
        row_doc: dict[str, Any] = {"key": row.key, "version": row.version, "invalid": row.reason}
    else:
        row_doc = row.to_json()
        unsent = {}
        for name in ("payload", "job", "last_error"):  # what another program stored: why, not 500
            problem = unsendable(row_doc[name], wants_msgpack(request))
            if problem is not None:
                row_doc[name] = None
                unsent[name] = f"the {name} is stored, but {problem}"
        if unsent:
            row_doc["unsendable"] = unsent
    loop = asyncio.get_running_loop()
    view = await loop.run_in_executor(request.app[ASK_POOL], _safely, "explain", ctx.explain, key)
    lease = None
    if ctx.work is not None:
        lease = _safely("lease", ctx.work.explain, key, row, view, ctx.clock())
    return reply(request, {"row": row_doc, "keeper": view or KEEPER_SILENT, "lease": lease})


@routes.get("/openapi.json")
async def openapi_json(request: web.Request) -> web.Response:
    # Describe what this app serves: the work path's routes only when mounted.
    spec = openapi.spec(token=bool(request.app.get(TOKEN)))  # type: ignore[arg-type]
    served = {
        (r.resource.canonical, r.method.lower())
        for r in request.app.router.routes()
        if r.resource is not None
    }
    spec["paths"] = {
        path: kept
        for path, ops in spec["paths"].items()
        if (kept := {m: op for m, op in ops.items() if (path, m) in served})
    }
    return web.json_response(spec)
