"""Queue state and the operator's acts over HTTP: ``GET /queue-state``,
``POST /admin/pause``, ``POST /admin/resume``, ``POST /admin/run-now``.

``routes`` is added to the API app by ``workers.http.__main__`` (``make_app``'s
``extra_routes``); handlers find the node in ``request.app[CTX]``.

- ``GET /queue-state`` never asks the keeper: it reads the state buffer
  (``ctx.keeper_state``) and counts the lease table's states (one pass in C,
  about 0.2 ms for 65,536 slots), and builds the answer with
  ``shm.state.queue_state``, the function ``read_state`` uses, so the
  endpoint and ``python -m node state`` cannot drift. Any worker answers the
  same.
- Pausing is stored in the store's meta (``paused_routes``, ``paused_node``),
  so it survives a restart; the keeper is then asked to re-read it and
  republish at once (``{"op": "reload_paused"}``). A keeper that does not
  answer in time still picks it up at its next state write
  (``state_interval_s``): the answer's ``applied`` says which happened.
  ``{"node": NAME}`` pauses or resumes another node of the fleet: the node
  asked forwards it over HTTP with the fleet's token. A route's pause is
  the fleet's already (one list in the shared store).
- ``POST /admin/run-now`` makes every row of a route or job due now with
  one write in the store: on a fleet every keeper sees its share through
  its feed, as any write (docs/fleet.md, "Run again now").

Hazard: the meta entry is read, changed and written back on this worker's
store thread; two workers pausing different routes in the same instant could
each write back a list without the other's route. Pausing is an operator's
act, rare and easy to check (the answer and ``/queue-state`` show the list);
no lock across workers is worth it.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from aiohttp import web

from node.core.errors import ValidationError
from node.core.names import NAME_RE
from node.core.rows import ORIGIN_NODE, check_job, check_route
from node.fleet.cluster import sum_queue_states
from shm.state import queue_state as build_queue_state
from shm.state import unreadable_state
from workers.http import cluster
from workers.http.app import (
    ASK_POOL,
    CTX,
    WorkerContext,
    _in_store,
    _safely,
    _wake,
    known_query,
    query_value,
    read_body,
)
from workers.http.cluster import in_a_fleet
from workers.http.errors import ApiError, reply

# The scopes GET /queue-state and GET /accounting answer: this node (no
# scope), or the fleet (workers/http/cluster.py; a node outside a fleet is a
# fleet of one).
CLUSTER = "cluster"
# How long a pause waits for the keeper to confirm its republish. The keeper
# answers between ticks (a tick is milliseconds once loaded); a loading or
# stalled keeper does not answer, and the pause still holds (stored) and is
# applied at the keeper's next state write.
RELOAD_TIMEOUT_S = 2.0
PAUSED_ROUTES = "paused_routes"
PAUSED_NODE = "paused_node"

routes = web.RouteTableDef()


# -- GET /queue-state ---------------------------------------------------------------


def parse_scope(request: web.Request, *others: str) -> str | None:
    """``?scope=``: None (this node) or ``cluster``; anything else is 400
    (so is a query parameter other than scope and ``others``)."""
    known_query(request, "scope", *others)
    scope = query_value(request, "scope", "invalid_scope")
    if scope is None:
        return None
    if scope != CLUSTER:
        raise ValidationError(
            "invalid_scope", f"scope {scope!r} is not known; give scope=cluster or none", "scope"
        )
    return scope


def _lease_counts(ctx: WorkerContext) -> dict[str, int] | None:
    if ctx.work is None:
        return None
    return _safely("lease_counts", ctx.work.leases.code_counts)


def current_state(ctx: WorkerContext) -> dict[str, Any]:
    """The queue-state document as this worker sees it now."""
    counts = _lease_counts(ctx)
    state = _safely("state", ctx.keeper_state)
    if state is None:
        return unreadable_state("the keeper's state buffer cannot be read", counts)
    return build_queue_state(state, ctx.clock(), counts)


@routes.get("/queue-state")
async def queue_state(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    scope = parse_scope(request)
    if scope == CLUSTER and in_a_fleet(ctx):
        return await _cluster_state(request, ctx)
    doc = current_state(ctx)
    if scope == CLUSTER:
        # A fleet of one: the same numbers, and who was summed.
        doc = {**doc, "scope": CLUSTER, "nodes": [ctx.name]}
    return reply(request, doc, 200 if doc["trust"]["vouched"] else 503)


async def _cluster_state(request: web.Request, ctx: WorkerContext) -> web.Response:
    async def local() -> tuple[int, dict[str, Any]]:
        doc = current_state(ctx)
        return (200 if doc["trust"]["vouched"] else 503), doc

    try:
        got = await cluster.gather(request, "/queue-state", local, queue_state=True)
    except cluster.Refused as exc:
        return reply(request, exc.document(queue_state=True), 503)
    return reply(request, sum_queue_states(got.docs, got.addresses, got.down))


# -- POST /admin/pause, /admin/resume ------------------------------------------------


def parse_pause(body: Any) -> tuple[str | None, str | None]:
    """The route a pause or resume names (None: the whole node) and the node
    it is for (None: this one)."""
    if not isinstance(body, dict):
        shapes = '{}, {"route": "<route>"} or {"node": "<name>"}'
        raise ApiError(400, "invalid_body", f"the body must be {shapes}")
    unknown = sorted(set(body) - {"route", "node"})
    if unknown:
        raise ValidationError("unknown_field", f"unknown field {unknown[0]!r}", unknown[0])
    node = None
    if "node" in body:
        node = body["node"]
        if not isinstance(node, str) or not NAME_RE.fullmatch(node):
            raise ValidationError(
                "invalid_node", "node must be a node name, [A-Za-z0-9._-]{1,64}", "node"
            )
        if "route" in body:
            # A route's pause is the fleet's (the node list's store keeps one
            # list); naming a node with it would promise what is not done.
            raise ApiError(400, "invalid_body", "give route or node, not both: a route is "
                           "paused on every node of a fleet at once", "node")  # fmt: skip
    if "route" not in body:
        return None, node
    return check_route(body["route"], "route"), node


def write_paused(ctx: WorkerContext, route: str | None, paused: bool) -> dict[str, Any]:
    """Store the change (on the store's thread); what is paused now."""
    store = ctx.store
    routes_now = set(store.get_meta(PAUSED_ROUTES, []) or [])
    node_now = bool(store.get_meta(PAUSED_NODE, False))
    if route is None:
        if node_now != paused:
            store.set_meta(PAUSED_NODE, paused)
            node_now = paused
    else:
        changed = (routes_now | {route}) if paused else (routes_now - {route})
        if changed != routes_now:
            store.set_meta(PAUSED_ROUTES, sorted(changed))
            routes_now = changed
    return {"node": node_now, "routes": sorted(routes_now)}


def ask_reload(name: str) -> dict[str, Any] | None:
    """Ask the keeper to re-read the pause and republish; its answer or None."""
    from keeper.ask import ask

    return ask(name, {"op": "reload_paused"}, timeout_s=RELOAD_TIMEOUT_S)


async def _set_paused(request: web.Request, paused: bool) -> web.Response:
    ctx = request.app[CTX]
    route, node = parse_pause(await read_body(request))
    if node is not None and node != ctx.name:
        path = "/admin/pause" if paused else "/admin/resume"
        if not in_a_fleet(ctx):
            raise ApiError(404, "unknown_node", f"this node is {ctx.name}, and outside a "
                           f"fleet it pauses only itself: no node {node}", "node")  # fmt: skip
        return reply(request, await cluster.ask_node(request, node, path, {}))
    now_paused = await _in_store(ctx, write_paused, ctx, route, paused)
    loop = asyncio.get_running_loop()
    # On the ask thread: keeper.ask keeps one reply queue per question, and
    # the ask pool's single thread keeps questions from one worker in turn.
    answer = await loop.run_in_executor(
        request.app[ASK_POOL], _safely, "reload_paused", ask_reload, ctx.name
    )
    applied = isinstance(answer, dict) and answer.get("ok") is True
    return reply(request, {"paused": now_paused, "applied": applied, "node": ctx.name})


@routes.post("/admin/pause")
async def pause(request: web.Request) -> web.Response:
    return await _set_paused(request, True)


@routes.post("/admin/resume")
async def resume(request: web.Request) -> web.Response:
    return await _set_paused(request, False)


# -- POST /admin/run-now --------------------------------------------------------------


def parse_run_now(body: Any) -> tuple[str | None, str | None]:
    """``{"route": R}`` or ``{"job": J}``, exactly one: (route, job)."""
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_body", 'the body must be {"route": R} or {"job": J}')
    unknown = sorted(set(body) - {"route", "job"})
    if unknown:
        raise ValidationError("unknown_field", f"unknown field {unknown[0]!r}", unknown[0])
    if "route" in body and "job" in body:
        raise ApiError(400, "invalid_body", "give route or job, not both", "job")
    if "route" in body:
        return check_route(body["route"], "route"), None
    if "job" in body:
        return None, check_job(body["job"], "job")
    raise ValidationError("missing_field", "give the route or the job to run again now", "route")


@routes.post("/admin/run-now")
async def run_now(request: web.Request) -> web.Response:
    """Every row of a route or job due now (``Store.due_now``): one write in
    the store, so on a fleet every node's keeper takes its own rows' share
    through its feed, and counts it in its flow as ``updated``."""
    ctx = request.app[CTX]
    route, job = parse_run_now(await read_body(request))
    due_now = functools.partial(ctx.store.due_now, route=route, job=job, origin=ORIGIN_NODE)
    n = await _in_store(ctx, lambda: due_now(now=ctx.clock()))
    if n:
        _wake(ctx)
    return reply(request, {"rescheduled": n})
