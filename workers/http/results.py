"""Results and the books over HTTP: the result polls, acks and
``GET /accounting`` (the rest of the work path is workers/http/work.py, whose
helpers these share).

All of them go to the ledger over its socket. On a fleet node,
``?scope=cluster`` asks every live node (workers/http/cluster.py), and an
ack whose ids carry another node's number is routed to it
(docs/fleet.md, "Results from the whole fleet").

``routes`` is added to the API app beside ``workers.http.work.routes``.
"""

from __future__ import annotations

import base64
from typing import Any

from aiohttp import web

from node.core.errors import ValidationError
from node.core.ids import number_of, shown_ids
from node.core.rows import check_job
from node.fleet.cluster import sum_accounting
from workers.claim import decode_result
from workers.http import cluster
from workers.http.app import CTX
from workers.http.errors import ApiError, reply, wants_msgpack
from workers.http.state import CLUSTER, parse_scope
from workers.http.work import (
    DEFAULT_POLL,
    LEDGER_TIMEOUT_S,
    MAX_IDS,
    MAX_POLL,
    MAX_RESULT_ID,
    WAITERS_RETRY_AFTER_S,
    WorkPath,
    _int_query,
    _ledger,
    _object,
    _required,
    _wait_query,
    _work,
)

routes = web.RouteTableDef()


def _results(request: web.Request, found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    raw = wants_msgpack(request)
    out = []
    for item in found:
        encoding = item.get("encoding", "json")
        doc = {
            "id": item["id"],
            "key": item["key"],
            "job": item["job"],
            "finished_at": item["finished_at"],
        }
        if encoding == "json":
            doc["result"] = decode_result(item["result"], "json")
        elif raw:
            doc["result"] = bytes(item["result"])
        else:
            doc["result"] = base64.b64encode(item["result"]).decode("ascii")
            doc["encoding"] = "base64"
        out.append(doc)
    return out


async def _poll(request: web.Request, job: str | None) -> web.Response:
    work = _work(request)
    scope = parse_scope(request, "max", "wait_s")
    max_n = _int_query(request, "max", DEFAULT_POLL, MAX_POLL, "invalid_max")
    wait_s = _wait_query(request)
    if scope == CLUSTER and cluster.in_a_fleet(request.app[CTX]):
        return await _poll_fleet(request, work, job, max_n, wait_s)
    if wait_s == 0:
        answer = await _ledger(work, "poll", job=job, max=max_n, wait_s=0)
    else:
        answer = await _long_poll(request, work, job, max_n, wait_s)
    return reply(request, {"results": _results(request, answer.get("results") or [])})


async def _poll_fleet(
    request: web.Request, work: WorkPath, job: str | None, max_n: int, wait_s: float
) -> web.Response:
    """``?scope=cluster``: results from every live node of the fleet."""

    async def local(left: int) -> list[dict[str, Any]]:
        answer = await _ledger(work, "poll", job=job, max=left, wait_s=0)
        return _results(request, answer.get("results") or [])

    path = "/results" if job is None else f"/jobs/{job}/results"
    if wait_s > 0:
        _wait_here(request, work)
    work.waiting += wait_s > 0
    try:
        answer = await cluster.poll_fleet(request, path, max_n, wait_s, local)
    finally:
        work.waiting -= wait_s > 0
    if wants_msgpack(request):  # the other nodes answered JSON: their bytes as bytes
        for item in answer["results"]:
            if item.pop("encoding", None) == "base64":
                item["result"] = base64.b64decode(item["result"])
    return reply(request, answer)


def _wait_here(request: web.Request, work: WorkPath) -> None:
    """Refuse a long poll past ``max_poll_waiters`` in this worker (429)."""
    limit = request.app[CTX].config.max_poll_waiters
    if work.waiting >= limit:
        raise ApiError(
            429,
            "too_many_waiters",
            f"{limit} long polls already wait in this worker (max_poll_waiters); "
            "retry later, or poll with wait_s=0",
            "wait_s",
            headers={"Retry-After": str(WAITERS_RETRY_AFTER_S)},
        )


async def _long_poll(
    request: web.Request, work: WorkPath, job: str | None, max_n: int, wait_s: float
) -> dict[str, Any]:
    """A poll that waits: one waiter at the ledger until it answers, so the
    ledger holds at most workers x max_poll_waiters of them."""
    _wait_here(request, work)
    work.waiting += 1
    try:
        return await _ledger(
            work, "poll", timeout_s=LEDGER_TIMEOUT_S + wait_s, job=job, max=max_n, wait_s=wait_s
        )
    finally:
        work.waiting -= 1


@routes.get("/jobs/{job}/results")
async def job_results(request: web.Request) -> web.Response:
    return await _poll(request, check_job(request.match_info["job"], "job"))


@routes.get("/results")
async def all_results(request: web.Request) -> web.Response:
    return await _poll(request, None)


async def _never_offered(
    request: web.Request, job: str, ids: list[int], beyond: list[int], local: Any
) -> ApiError:
    """The 409 of an ack naming ids past 64 bits (none was ever offered): it
    names them, and every other id never offered as the ack of the rest
    would (asked with ``check``: nothing is acked; on any other failure of
    that check, the ids past 64 bits alone)."""
    ctx = request.app[CTX]
    rest = [value for value in ids if value <= MAX_RESULT_ID]
    named = [f"job {job!r}: ids never offered: {shown_ids(list(dict.fromkeys(beyond)))}"]
    try:
        if cluster.in_a_fleet(ctx) and not _all_mine(rest, cluster.my_number(ctx)):
            await cluster.route_ack(request, job, rest, True, local)
        elif rest:
            await local(rest, True)
    except ApiError as exc:
        if exc.code == "never_offered":
            named.insert(0, str(exc))
    return ApiError(409, "never_offered", "; ".join(named), "ids")


@routes.post("/jobs/{job}/ack")
async def ack(request: web.Request) -> web.Response:
    work = _work(request)
    job = check_job(request.match_info["job"], "job")
    body = await _object(request, ("ids", "check"))
    ids = _required(body, "ids")
    check = body.get("check", False)
    if not isinstance(check, bool):
        raise ValidationError("invalid_body", "check is true or false", "check")
    if not isinstance(ids, list):
        raise ValidationError("invalid_ids", "ids must be a list of result ids", "ids")
    if len(ids) > MAX_IDS:
        raise ApiError(400, "too_many_ids", f"{len(ids)} ids; at most {MAX_IDS}", "ids")
    for i, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValidationError(
                "invalid_ids", "a result id is a non-negative integer", f"ids[{i}]"
            )
    # JSON carries integers of any size; the ledger's socket (msgpack) and its
    # ids (SQLite rowids) stop at 2**63. No id past that was ever offered.
    beyond = [value for value in ids if value > MAX_RESULT_ID]
    ctx = request.app[CTX]

    async def local(rids: list[int], check_only: bool) -> dict[str, Any]:
        return dict(await _ledger(work, "ack", job=job, ids=rids, check=check_only))

    if beyond:
        raise await _never_offered(request, job, ids, beyond, local)
    if cluster.in_a_fleet(ctx) and not _all_mine(ids, cluster.my_number(ctx)):
        # Ids with another node's number: each to the node whose log holds it.
        return reply(request, await cluster.route_ack(request, job, ids, check, local))
    answer = await _ledger(work, "ack", job=job, ids=ids, check=check)
    if check:
        return reply(request, {"acked": 0, "checked": answer.get("checked", 0)})
    return reply(request, {"acked": answer.get("acked", 0)})


def _all_mine(ids: list[int], mine: int | None) -> bool:
    """Every id this node's (its fleet number, or none: a node's ids from
    before it joined a fleet)."""
    return all(number_of(i) in (0, mine) for i in ids)


@routes.get("/accounting")
async def accounting(request: web.Request) -> web.Response:
    scope = parse_scope(request)
    work = _work(request)
    ctx = request.app[CTX]
    if scope == CLUSTER and cluster.in_a_fleet(ctx):
        return await _cluster_accounting(request, work)
    answer = dict(await _ledger(work, "accounting"))
    answer.pop("id", None)
    if scope == CLUSTER:
        answer.update(scope=CLUSTER, nodes=[ctx.name])  # a fleet of one
    return reply(request, answer)


async def _cluster_accounting(request: web.Request, work: WorkPath) -> web.Response:
    async def local() -> tuple[int, dict[str, Any]]:
        try:
            answer = dict(await _ledger(work, "accounting"))
        except ApiError as exc:
            return exc.status, {"error": {"code": exc.code, "message": exc.message}}
        answer.pop("id", None)
        return 200, answer

    try:
        got = await cluster.gather(request, "/accounting", local, queue_state=False)
    except cluster.Refused as exc:
        error = {"code": "peer_unavailable", "message": exc.reason, "field": None}
        return reply(request, {"error": error, **exc.document(queue_state=False)}, 503)
    return reply(request, sum_accounting(got.docs))


__all__ = ["routes"]
