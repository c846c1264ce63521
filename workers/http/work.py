"""The work path over HTTP: claims, completions, releases, renewals, the lease
lists (the results, acks and accounting: workers/http/results.py).

``routes`` is added to the API app by ``make_app(ctx, extra_routes=routes)``;
every handler finds what it needs in ``ctx.work`` (a ``WorkPath``), which
``workers.http.__main__`` builds from shared memory and the ledger's socket, and
tests build from plain objects.

Where each request goes:

- ``POST /claim`` of up to INLINE_CLAIM_MAX keys runs on the event loop
  (tens of microseconds a grant: cheaper than a thread hop); a larger one on
  the claim thread, so it never stalls the loop for milliseconds. Its answer
  stops growing at ``claim_answer_bytes`` (see ``_claim_into``).
- Long polls (``wait_s`` > 0) waiting at once in this worker are bounded by
  ``max_poll_waiters``; one more is 429 ``too_many_waiters``.
- ``POST /release``, ``POST /renew``, ``POST /admin/unhold`` go straight to the
  lease table (microseconds; a slot another live process holds mid-change is
  waited for up to ``shm.leases.BUSY_WAIT_S``, then answered 503).
- ``GET /leases`` and ``GET /held`` scan the whole lease table: on a thread.
- ``POST /complete`` (and workers/http/results.py's polls, acks and
  ``GET /accounting``) go to the ledger over its socket
  (``node.ipc.AsyncIpcClient``). A ledger that cannot be reached is 503
  ``ledger_unavailable``: the caller retries, nothing is lost (a completion
  is answered only once it is durable).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import msgpack
from aiohttp import web

from node.core import log, metrics
from node.core.errors import NodeError, ValidationError, WorkRefused
from node.core.rows import check_key
from node.ipc import IpcError, RemoteError
from workers.claim import (
    MAX_CLAIM,
    Claimer,
    Grant,
    check_claim,
    check_lease_id,
    check_lease_s,
    complete_outcome,
    encode_result,
    lease_view,
    ledger_error,
    refuse,
    why_not_granted,
)
from workers.http.app import CTX, known_query, query_value, read_body
from workers.http.errors import (
    ERROR_CODES,
    MSGPACK_TYPES,
    ApiError,
    Unsendable,
    encode_answer,
    reply,
    wants_msgpack,
)

# Contract limits and defaults.
MAX_POLL = 10_000
DEFAULT_POLL = 100
MAX_WAIT_S = 60.0
MAX_LIST = 10_000
DEFAULT_LIST = 1_000
MAX_IDS = 10_000
MAX_UNHOLD_KEYS = 10_000
# Completions in one POST /complete {"items": [...]}: the ledger's MAX_ITEMS
# (workers/ledger/process.py), so a request the HTTP worker lets through is
# never refused whole by the ledger.
MAX_COMPLETE_ITEMS = 10_000
COMPLETE_FIELDS = ("lease_id", "key", "result", "encoding")
# The outcomes of a batch's items; any other status the ledger answers (the
# log cannot take results, a slot busy, a failure) answers the request 503,
# and sending it again is safe (what was accepted answers repeat).
ITEM_OUTCOMES = frozenset(("ok", "repeat", "conflict", "unknown"))
# The largest result id the ledger can have handed out (a SQLite rowid).
MAX_RESULT_ID = (1 << 63) - 1
# A claim of at most this many runs on the event loop: it costs about 30 us
# a grant (point reads from SQLite's page cache, a CAS per lease), less than
# the hop to the claim thread and back. Larger claims go to that thread, so a
# big one never stalls the loop for milliseconds.
INLINE_CLAIM_MAX = 16
# A ledger call that is not a long poll should answer in well under this; a
# long poll gets its wait on top.
LEDGER_TIMEOUT_S = 30.0
# A claim takes its leases this many at a time and stops once its answer is
# full (claim_answer_bytes): the leases granted past the bound, at most this
# many however large their payloads (up to 1 MiB each), are handed back at
# once. Small enough to bound that waste, large enough that a claim of
# 10,000 small leases pays for 157 takes, not 10,000.
CLAIM_CHUNK = 64
# What a long poll refused for too many waiters is told to wait.
WAITERS_RETRY_AFTER_S = 1
# The error a handed-back lease is released with (its key is then unheld).
NOT_SENT = "not sent: the claim answer was full"

routes = web.RouteTableDef()


@dataclass
class WorkPath:
    """What the work routes need. ``ledger`` has ``async call(op, timeout_s,
    **fields)`` (``node.ipc.AsyncIpcClient``). ``claimer`` runs on the event loop
    (small claims, renew, release); ``big_claimer``, with a store connection
    of its own, runs on ``claim_executor`` for claims over INLINE_CLAIM_MAX
    (None: every claim inline, as in tests). A Claimer is used from one
    thread only."""

    claimer: Claimer
    leases: Any  # shm.leases.LeaseTable
    ledger: Any
    claim_executor: Executor | None = None
    big_claimer: Claimer | None = None
    waiting: int = 0  # long polls of this worker waiting now (max_poll_waiters)

    def explain(self, key: str, row: Any, keeper: dict[str, Any] | None, now: float) -> dict:
        """``lease`` of ``GET /rows?key=``: the lease table's view and why a
        claim would not grant the row now (``why_not``; null: it would)."""
        view = lease_view(self.leases, key, now)
        view["why_not"] = why_not_granted(row, view, keeper, now)
        return view


def _work(request: web.Request) -> WorkPath:
    work = request.app[CTX].work
    if work is None:
        raise ApiError(503, "not_ready", "the work path is not running in this worker")
    return work


def _refused(exc: WorkRefused | ValidationError) -> ApiError:
    """A refusal of the work path (``workers.claim.rules``) as the API's
    error: its code's status in ``ERROR_CODES``."""
    return ApiError(ERROR_CODES[exc.code][0], exc.code, exc.message, exc.field)


async def _object(request: web.Request, allowed: Iterable[str]) -> dict[str, Any]:
    body = await read_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_body", "the body must be a JSON object")
    _field_names(body, None)
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ValidationError("unknown_field", f"unknown field {unknown[0]!r}", unknown[0])
    return body


def _field_names(doc: dict[Any, Any], where: str | None) -> None:
    """Refuse a map whose field names are not all strings (msgpack can
    carry bytes names; they would not even sort with the others)."""
    if not all(isinstance(name, str) for name in doc):
        raise ApiError(400, "invalid_body", "field names must be strings", where)


def _required(body: dict[str, Any], name: str) -> Any:
    if name not in body:
        raise ValidationError("missing_field", f"the body needs {name}", name)
    return body[name]


def _int_query(request: web.Request, name: str, default: int, high: int, code: str) -> int:
    raw = query_value(request, name, code)
    if raw is None:
        return default
    # Plain decimal digits only: int() would also take "1_000", " 5" and
    # 4,300-digit numbers, none of which a client means.
    value = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 9 else 0
    if not 1 <= value <= high:
        raise ValidationError(code, f"{name} must be an integer from 1 to {high}", name)
    return value


def _wait_query(request: web.Request) -> float:
    raw = query_value(request, "wait_s", "invalid_wait_s")
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_WAIT_S:  # also refuses NaN
        raise ValidationError(
            "invalid_wait_s", f"wait_s must be a number from 0 to {MAX_WAIT_S:.0f}", "wait_s"
        )
    return value


async def _ledger(work: WorkPath, op: str, timeout_s: float = LEDGER_TIMEOUT_S, **fields: Any):
    """One call to the ledger; its failures as the API's errors."""
    try:
        return await work.ledger.call(op, timeout_s=timeout_s, **fields)
    except IpcError as exc:
        log.warn("ledger_unreachable", op=op, error=str(exc))
        raise ApiError(
            503, "ledger_unavailable", f"the ledger cannot be reached; retry ({exc})"
        ) from None
    except RemoteError as exc:
        error = ledger_error(exc.code, exc.message)
        if error.code == "ledger_unavailable":
            log.warn("ledger_error", op=op, code=exc.code, error=exc.message)
        raise _refused(error) from None


# -- claims and leases --------------------------------------------------------------


@routes.post("/claim")
async def claim(request: web.Request) -> web.Response:
    started = time.perf_counter()  # claim latency, for queue_node_claim_seconds
    ctx = request.app[CTX]
    work = _work(request)
    body = await _object(request, ("max", "lease_s", "consumer"))
    max_n, lease_s, consumer = check_claim(
        _required(body, "max"),
        body.get("lease_s", ctx.config.lease_s),
        _required(body, "consumer"),
    )
    claimer = work.claimer
    if not claimer.ready_now():
        raise ApiError(503, "not_ready", "the keeper has not published since the node started")
    now = ctx.clock()
    answer = _LeaseAnswer(wants_msgpack(request), ctx.config.claim_answer_bytes)
    big = work.big_claimer
    args = (work.leases, max_n, lease_s, consumer, now, answer)
    try:
        if big is None or work.claim_executor is None or max_n <= INLINE_CLAIM_MAX:
            _claim_into(claimer, *args)
        else:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(work.claim_executor, _claim_into, big, *args)
    except WorkRefused as exc:  # not_granting: the grant deadline passed (a fleet)
        raise _refused(exc) from None
    metrics.observe_claim(time.perf_counter() - started, answer.count)
    return answer.response()


# What _LeaseAnswer.add did with a lease.
ADDED, FULL, LATER = "added", "full", "later"


class _LeaseAnswer:
    """A claim's answer, built lease by lease in the encoding the request
    accepts, up to ``limit`` bytes; the same bytes ``reply`` would make of
    ``{"leases": [...]}``. The first lease always goes in (a payload is at
    most 1 MiB, so a row is never too large to be claimed).

    As ``reply`` does, an answer asked for in msgpack that msgpack cannot
    carry (a payload another program stored with an integer past 64 bits)
    comes in JSON, its content type saying so, when JSON carries every lease
    of it within the bound. A lease an encoding the request accepts would
    carry, but not this answer's (a blob once the answer is in JSON, such an
    integer beside a blob), waits for a later answer (``LATER``)."""

    ENVELOPE = 16  # '{"leases": [' and ']}', or msgpack's map and array headers

    def __init__(self, raw: bool, limit: int) -> None:
        self.raw = raw  # the answer in msgpack (else JSON)
        self.msgpack_ok = raw  # the request accepts msgpack
        self.limit = limit
        self.pieces: list[bytes] = []
        self.size = self.ENVELOPE

    @property
    def count(self) -> int:
        return len(self.pieces)

    def add(self, grant: Grant) -> str:
        """ADDED; FULL (nothing added: it would pass the bound); LATER
        (nothing added: an encoding the request accepts carries it, not this
        answer's); Unsendable (nothing added) when no encoding the request
        accepts carries it."""
        lease = _lease_json(grant)
        try:
            piece = encode_answer(lease, self.raw)
        except Unsendable:
            if not self.msgpack_ok:
                raise  # JSON alone was asked for
            if self.raw:
                encode_answer(lease, False)  # Unsendable: neither carries it
                if not self._to_json(lease):
                    return LATER
            else:
                encode_answer(lease, True)  # Unsendable: neither carries it
                return LATER
            piece = encode_answer(lease, False)
        size = self.size + len(piece) + (0 if self.raw else 2)  # ", " between JSON items
        if self.pieces and size > self.limit:
            return FULL
        self.pieces.append(piece)
        self.size = size
        return ADDED

    def _to_json(self, lease: dict[str, Any]) -> bool:
        """Turn the answer into JSON, if JSON carries every lease added before
        ``lease`` (which it carries: the earlier ones read back from their
        msgpack) and they and it stay within the bound."""
        earlier = [msgpack.unpackb(piece, raw=False) for piece in self.pieces]
        try:
            pieces = [encode_answer(x, False) for x in [*earlier, lease]]
        except Unsendable:
            return False
        size = self.ENVELOPE + sum(map(len, pieces)) + 2 * len(pieces)
        if len(pieces) > 1 and size > self.limit:
            return False
        self.raw, self.pieces = False, pieces[:-1]
        self.size = size - len(pieces[-1]) - 2
        return True

    def response(self) -> web.Response:
        if self.raw:
            packer = msgpack.Packer()
            head = packer.pack_map_header(1) + packer.pack("leases")
            body = head + packer.pack_array_header(len(self.pieces)) + b"".join(self.pieces)
            return web.Response(body=body, content_type=MSGPACK_TYPES[0])
        body = b'{"leases": [' + b", ".join(self.pieces) + b"]}"
        return web.Response(body=body, content_type="application/json", charset="utf-8")


def _claim_into(
    claimer: Claimer,
    leases: Any,
    max_n: int,
    lease_s: float,
    consumer: str,
    now: float,
    answer: _LeaseAnswer,
) -> None:
    """Claim up to ``max_n`` leases into ``answer``, CLAIM_CHUNK at a time,
    until the ready set runs out or the answer is full. A lease granted past
    the bound never reaches a holder: it is handed back at once, so its key
    is claimable again at the keeper's next publish instead of sitting
    leased for ``lease_s`` and then counting a miss; so is one that an
    encoding the request accepts carries, but not the answer's (``LATER``).
    A lease no encoding the request accepts carries (``Unsendable``) is
    released with that error: a miss, so a row no claimer can be sent ends
    parked, as an item that always fails does, and the rest of the claim is
    answered. Runs on the claimer's own thread."""
    granted = 0
    while granted < max_n:
        want = min(CLAIM_CHUNK, max_n - granted)
        try:
            grants = claimer.claim(want, lease_s, consumer, now)
        except NodeError as exc:
            if not granted:
                raise
            # The leases granted before the failure are live: hand them out.
            log.warn("claim_cut_short", sent=answer.count, error=str(exc))
            return
        granted += len(grants)
        for i, grant in enumerate(grants):
            try:
                added = answer.add(grant)
            except Unsendable as exc:  # (a payload another program stored)
                error = f"its payload {exc}"
                outcome = claimer.release(grant.key, grant.lease_id, now, error)
                log.warn("claim_unsendable", key=grant.key, outcome=outcome.value, error=error)
                continue
            if added == LATER:
                _hand_back(claimer, leases, [grant], now)
            elif added == FULL:
                _hand_back(claimer, leases, grants[i:], now)
                return
        if len(grants) < want:
            return  # the ready set ran out


def _hand_back(claimer: Claimer, leases: Any, grants: list[Grant], now: float) -> None:
    """End leases no holder ever saw, leaving their keys as if never granted.

    The lease table has no such operation yet, so: a release (the lease ends
    now, counted as ``released``), then an unhold of the miss the release
    recorded. The unhold also clears misses the key had before this lease (a
    key that had failed starts its count again); a key the release did not
    end (BUSY: a slot held mid-change by another process) stays leased until
    it expires."""
    for grant in grants:
        outcome = claimer.release(grant.key, grant.lease_id, now, NOT_SENT)
        if outcome.value == "released":
            leases.unhold([grant.key])
        else:
            log.warn("claim_hand_back_failed", key=grant.key, outcome=outcome.value)


def _lease_json(grant: Grant) -> dict[str, Any]:
    """A granted lease as the contract answers it (route and misses stay local)."""
    return {
        "lease_id": grant.lease_id,
        "key": grant.key,
        "payload": grant.payload,
        "job": grant.job,
        "due_at": grant.due_at,
        "expires_at": grant.expires_at,
    }


def _lease_args(body: dict[str, Any]) -> tuple[int, str]:
    return check_lease_id(_required(body, "lease_id")), check_key(_required(body, "key"))


@routes.post("/release")
async def release(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    work = _work(request)
    body = await _object(request, ("lease_id", "key", "error"))
    lease_id, key = _lease_args(body)
    error = body.get("error")
    if error is not None and not isinstance(error, str):
        raise ValidationError("invalid_error", "error must be a string (or absent)", "error")
    outcome = work.claimer.release(key, lease_id, ctx.clock(), error)
    if outcome.value != "released":
        raise _refused(refuse(outcome, key))
    return reply(request, {"released": True})


@routes.post("/renew")
async def renew(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    work = _work(request)
    body = await _object(request, ("lease_id", "key", "lease_s"))
    lease_id, key = _lease_args(body)
    lease_s = check_lease_s(_required(body, "lease_s"))
    now = ctx.clock()
    outcome = work.claimer.renew(key, lease_id, lease_s, now)
    if outcome.value != "renewed":
        raise _refused(refuse(outcome, key))
    return reply(request, {"expires_at": now + lease_s})


async def _listed(request: web.Request, scan: str) -> list[Any]:
    """What the lease table's ``scan`` (``live`` or ``held``) finds, up to
    the request's ``limit``, read off the event loop."""
    work = _work(request)
    known_query(request, "limit")
    limit = _int_query(request, "limit", DEFAULT_LIST, MAX_LIST, "invalid_limit")
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, getattr(work.leases, scan), limit)


@routes.get("/leases")
async def list_leases(request: web.Request) -> web.Response:
    leases = [
        {
            "key": lease.key,
            "lease_id": lease.lease_id,
            "consumer": lease.consumer,
            "granted_at": lease.granted_at,
            "expires_at": lease.expires_at,
        }
        for lease in await _listed(request, "live")
    ]
    return reply(request, {"leases": leases})


@routes.get("/held")
async def list_held(request: web.Request) -> web.Response:
    held = [
        {
            "key": hold.key,
            "misses": hold.misses,
            "held_until": hold.held_until,
            "parked": hold.parked,
            "last_error": hold.last_error or None,
        }
        for hold in await _listed(request, "held")
    ]
    return reply(request, {"held": held})


@routes.post("/admin/unhold")
async def unhold(request: web.Request) -> web.Response:
    work = _work(request)
    body = await _object(request, ("keys",))
    keys = _required(body, "keys")
    if not isinstance(keys, list):
        raise ApiError(400, "invalid_body", "keys must be a list of keys", "keys")
    if len(keys) > MAX_UNHOLD_KEYS:
        raise ApiError(400, "too_many_keys", f"{len(keys)} keys; at most {MAX_UNHOLD_KEYS}", "keys")
    checked = [check_key(key, f"keys[{i}]") for i, key in enumerate(keys)]
    return reply(request, {"unheld": work.leases.unhold(checked)})


# -- completions and results: the ledger ----------------------------------------------


@routes.post("/complete")
async def complete(request: web.Request) -> web.Response:
    work = _work(request)
    body = await _object(request, (*COMPLETE_FIELDS, "items"))
    from_msgpack = request.content_type in MSGPACK_TYPES
    if "items" in body:
        return await _complete_items(request, work, _check_items(body, from_msgpack))
    lease_id, key = _lease_args(body)
    data, encoding = encode_result(body, from_msgpack)
    item = {"lease_id": lease_id, "key": key, "result": data, "encoding": encoding}
    answer = await _ledger(work, "complete", items=[item])
    outcomes = answer.get("outcomes") or [{"status": None}]
    try:
        result_id = complete_outcome(outcomes[0], key)
    except WorkRefused as exc:
        raise _refused(exc) from None
    return reply(request, {"id": result_id})


def _check_items(body: dict[str, Any], from_msgpack: bool) -> list[dict[str, Any]]:
    """The batch form's items as the ledger takes them, every one checked
    before any is sent: the first bad one refuses the request (400, its
    field named ``items[i].field``) and nothing is written."""
    others = sorted(set(body) - {"items"})
    if others:
        raise ValidationError(
            "unknown_field", f"a body with items has no {others[0]!r}: each item has its own",
            others[0],
        )  # fmt: skip
    items = body["items"]
    if not isinstance(items, list) or not items:
        raise ApiError(
            400, "invalid_body", "items must be a non-empty list of {lease_id, key, result}",
            "items",
        )  # fmt: skip
    if len(items) > MAX_COMPLETE_ITEMS:
        raise ApiError(
            400, "too_many_items", f"{len(items)} items; at most {MAX_COMPLETE_ITEMS}", "items"
        )
    checked = []
    for i, item in enumerate(items):
        where = f"items[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, "invalid_body", f"{where} must be an object", where)
        _field_names(item, where)
        try:
            unknown = sorted(set(item) - set(COMPLETE_FIELDS))
            if unknown:
                raise ValidationError("unknown_field", f"unknown field {unknown[0]!r}", unknown[0])
            lease_id, key = _lease_args(item)
            data, encoding = encode_result(item, from_msgpack)
        except ValidationError as exc:
            field = f"{where}.{exc.field}" if exc.field else where
            raise ValidationError(exc.code, f"{where}: {exc.message}", field) from None
        checked.append({"lease_id": lease_id, "key": key, "result": data, "encoding": encoding})
    return checked


async def _complete_items(
    request: web.Request, work: WorkPath, items: list[dict[str, Any]]
) -> web.Response:
    """One ledger request for the batch (one group commit); an outcome per
    item. A status that is not an item's outcome (``log_unavailable``, the
    ledger failing) answers the whole request as the single form would."""
    answer = await _ledger(work, "complete", items=items)
    outcomes = answer.get("outcomes") or []
    if len(outcomes) != len(items):
        raise ApiError(
            503, "ledger_unavailable", f"the ledger answered {len(outcomes)} outcomes "
            f"for {len(items)} items; send them again",
        )  # fmt: skip
    out = []
    for item, outcome in zip(items, outcomes, strict=True):
        status = outcome.get("status")
        if status not in ITEM_OUTCOMES:
            try:
                complete_outcome(outcome, item["key"])
            except WorkRefused as exc:
                raise _refused(exc) from None
        rid = outcome.get("id") if status in ("ok", "repeat") else None
        out.append({"id": rid, "outcome": status} if rid is not None else {"outcome": status})
    return reply(request, {"items": out})


__all__ = ["MAX_CLAIM", "WorkPath", "routes"]
