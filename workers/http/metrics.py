"""``GET /metrics``: the node in Prometheus text format, every process of it.

A scrape is two parts (``docs/metrics.md`` lists every name):

- what the node's processes recorded (``node.core.metrics``: the keeper's
  histograms, claim latency, requests and grants per worker), summed over
  every process from prometheus_client's multiprocess files;
- what is read now, so that it equals ``/accounting`` and ``/queue-state``
  to the item: the ledger's lifetime counters (asked over its socket, as
  ``GET /accounting`` asks), the lease table's counts, and the state
  buffer's gauges.

When the keeper does not vouch for its counts, a scrape says so
(``queue_node_keeper_vouched 0``) and leaves the due and lateness gauges out
rather than export stale numbers as fresh: a rule over them (KEDA, an alert)
must treat absence as "unknown", not as zero. Likewise the ledger's counters
are left out while the ledger cannot be reached (``queue_node_ledger_up 0``).

Route labels carry the configured routes only; every other route is
``route="other"`` (the maximum over them), so a writer cannot grow the label
set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from node.core import log, metrics
from node.ipc import IpcError, RemoteError
from shm.state import _vouch
from workers.http.app import CTX, WorkerContext

# The ledger's answer to "accounting" flushes the log first: normally
# milliseconds. A scrape that waits longer reports the ledger as down.
LEDGER_TIMEOUT_S = 5.0
OTHER_ROUTE = "other"
# The ledger's lifetime counters, exported as queue_node_<name>_total.
LEDGER_COUNTERS = {
    "received": "Occurrences that came due.",
    "routed": "Leases granted.",
    "finished": "Results made durable.",
    "acknowledged": "Results acknowledged by their receiver.",
    "expired": "Leases that ran out without a result.",
    "released": "Leases handed back without a result.",
    "refused": "Grants the lease table had no slot for.",
    "requeued": "Leases that ended without a result and put their key back (expired + released).",
    "withdrawn": "Occurrences a write took out before a grant (deleted, rescheduled).",
    "discarded": "Results retired without delivery (retention, an operator).",
}
DUE_KINDS = ("sitemap", "discovered")
# queue_node_keeper_repairs_total{kind}: the keeper's verify stats they come from.
REPAIR_KINDS = {
    "top": "top_repairs",
    "feed_missed": "repairs_feed_missed",
    "membership": "repairs_membership",
}

routes = web.RouteTableDef()


@web.middleware
async def count_requests(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Counts every answer in ``queue_node_http_requests_total{method,
    status}``. Best outermost (then every error is already an answer); placed
    further in, an exception is counted with its status (500 for a bug)."""
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        status = getattr(exc, "status", 500)
        metrics.count_request(request.method, status if isinstance(status, int) else 500)
        raise
    metrics.count_request(request.method, response.status)
    return response


@routes.get("/metrics")
async def get_metrics(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    accounting = await _accounting(ctx)
    loop = asyncio.get_running_loop()
    # Reading the files, the state buffer and a lease table scan: milliseconds
    # of blocking work, off the event loop.
    body = await loop.run_in_executor(None, render, ctx, accounting)
    return web.Response(body=body, headers={"Content-Type": metrics.CONTENT_TYPE})


async def _accounting(ctx: WorkerContext) -> dict[str, Any] | None:
    """The ledger's answer to "accounting" (what GET /accounting answers),
    or None when it cannot be had."""
    if ctx.work is None:
        return None
    try:
        return await ctx.work.ledger.call("accounting", timeout_s=LEDGER_TIMEOUT_S)
    except (IpcError, RemoteError) as exc:
        log.warn("metrics_ledger_unreachable", error=str(exc))
        return None


def render(ctx: WorkerContext, accounting: dict[str, Any] | None) -> bytes:
    """The scrape's text: recorded metrics plus what is read now."""
    state = _read_safely("state", ctx.keeper_state)
    leases = ctx.work.leases if ctx.work is not None else None
    lease_counts = _read_safely("leases", _lease_counts, leases) if leases is not None else None
    families = [
        *ledger_families(accounting),
        *lease_families(lease_counts),
        *state_families(state, ctx.config.routes, ctx.clock()),
        *fleet_families(state, ctx.clock()),
    ]
    return metrics.exposition(_Now(families))


class _Now:
    """A collector of families read at this scrape."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _read_safely(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    # A scrape answers with what it could read; a failed part is left out.
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - see above
        log.warn("metrics_read_failed", what=what, error=repr(exc))
        return None


def _lease_counts(leases: Any) -> dict[str, int]:
    """Slots by state (``leased``, ``held``, ``parked``, ...); ``leased`` as
    the ledger counts in flight (``live_count``), so the two agree."""
    try:
        counts = dict(leases.code_counts())  # one pass in C
    except AttributeError:  # a table, or a built extension, without it: a Python scan
        counts = dict(leases.stats()["slots"])
    counts["leased"] = leases.live_count()
    return counts


# -- families ------------------------------------------------------------------------


def ledger_families(accounting: dict[str, Any] | None) -> list[Metric]:
    up = GaugeMetricFamily(
        "queue_node_ledger_up", "1 when the ledger answered this scrape, else 0."
    )
    up.add_metric([], 0 if accounting is None else 1)
    out: list[Metric] = [up]
    if accounting is None:
        return out
    for name, doc in LEDGER_COUNTERS.items():
        out.append(
            CounterMetricFamily(
                f"queue_node_{name}",
                f"{doc} Lifetime, as GET /accounting.",
                value=int(accounting.get(name) or 0),
            )
        )
    if accounting.get("waiting") is not None:
        out.append(
            GaugeMetricFamily(
                "queue_node_waiting",
                "Due rows no lease holds (unclaimed, held, parked, paused), as GET /accounting.",
                value=int(accounting["waiting"]),
            )
        )
    gaps = accounting.get("gaps") or {}
    if gaps.get("input") is not None:
        gap = GaugeMetricFamily(
            "queue_node_ledger_gap",
            "A law's left side minus its right side (0 when it holds), as GET /accounting's gaps.",
            labels=["law"],
        )
        for law in ("input", "output", "finished"):
            gap.add_metric([law], int(gaps.get(law) or 0))
        bound = gaps.get("input_bound")
        out.append(gap)
        if bound is not None:
            out.append(
                GaugeMetricFamily(
                    "queue_node_ledger_input_bound",
                    "Changes committed that the keeper's snapshot did not show yet: "
                    "what the input gap under load is bounded by.",
                    value=int(bound),
                )
            )
    return out


def lease_families(counts: dict[str, int] | None) -> list[Metric]:
    if counts is None:
        return []
    gauges = (
        ("queue_node_in_flight", "Leases live now (expired, not yet swept, included).", "leased"),
        ("queue_node_held", "Keys held after a miss (not grantable until the hold ends).", "held"),
        ("queue_node_parked", "Keys parked after max_misses misses in a row.", "parked"),
    )
    return [
        GaugeMetricFamily(name, doc, value=int(counts.get(code, 0))) for name, doc, code in gauges
    ]


def state_families(
    state: dict[str, Any] | None, configured: Iterable[str], now: float
) -> list[Metric]:
    """queue_node_keeper_vouched always; due and lateness only when vouched."""
    vouched = state is not None and _vouch(state, now)[0]
    gauge = GaugeMetricFamily(
        "queue_node_keeper_vouched",
        "1 when the keeper vouches for its counts; 0: due and lateness are left out.",
    )
    gauge.add_metric([], 1 if vouched else 0)
    out: list[Metric] = [gauge]
    if state is None:
        return out
    doc = state["doc"] or {}
    verify = (doc.get("trust") or {}).get("verify") or {}
    repairs = CounterMetricFamily(
        "queue_node_keeper_repairs",
        "Rows the keeper's self-checks put right in its copy, by check: the top-of-set "
        "re-read (top), the verification walk (feed_missed), a change of the fleet's "
        "membership (membership). Lifetime: kept over keeper restarts.",
        labels=["kind"],
    )
    for kind, field in REPAIR_KINDS.items():
        repairs.add_metric([kind], int(verify.get(field) or 0))
    out.append(repairs)
    if not vouched:
        return out
    due = (doc.get("now") or {}).get("due") or {}
    due_gauge = GaugeMetricFamily(
        "queue_node_due", "Rows due now (as of the keeper's last counts).", labels=["kind"]
    )
    for kind in DUE_KINDS:
        due_gauge.add_metric([kind], int(due.get(kind) or 0))
    out.append(due_gauge)
    ratio = GaugeMetricFamily(
        "queue_node_oldest_lateness_ratio",
        "Lateness / cadence of the route's most late due row (max over its classes).",
        labels=["route"],
    )
    for route, value in sorted(oldest_ratios(doc, set(configured)).items()):
        ratio.add_metric([route], value)
    out.append(ratio)
    return out


def fleet_families(state: dict[str, Any] | None, now: float) -> list[Metric]:
    """A fleet node's view of the node list (``trust.membership``), for the
    alerts on a node missing from it (deploy/prometheus/fleet.yml). Nothing
    on a node without a fleet (SQLite).

    The view is the live list the keeper read after its last heartbeat. It
    is current while that heartbeat is younger than the membership timeout
    at this scrape (its age in the document plus the document's own age):
    past it, the database may have counted this node out, and another
    node's rows may have moved, without this node having read so. A node
    that left has no current view, nor has a keeper that says it cannot
    reach its store (``trust.store.state``): while it waits for the store
    at start, the document it stamps is its predecessor's."""
    membership = _membership(state)
    if membership is None:
        return []
    live = membership.get("live") or []
    current = _view_current(state, membership, now)
    member = GaugeMetricFamily(
        "queue_node_fleet_member",
        "1 while this node is in the fleet's node list as it last read it, within the "
        "membership timeout; 0: joining, left, heartbeats failing, or not in the list.",
        value=int(
            current and membership.get("state") == "member" and membership.get("name") in live
        ),
    )
    out: list[Metric] = [member]
    if current:
        out.append(
            GaugeMetricFamily(
                "queue_node_fleet_live_nodes",
                "Nodes in the fleet's live list as this node last read it; left out "
                "while that read is older than the membership timeout.",
                value=len(live),
            )
        )
    return out


def _membership(state: dict[str, Any] | None) -> dict[str, Any] | None:
    doc = (state or {}).get("doc") or {}
    return (doc.get("trust") or {}).get("membership")


def _view_current(state: Any, membership: dict[str, Any], now: float) -> bool:
    """Whether the node's view of the list is current now (``fleet_families``)."""
    trust = state["doc"]["trust"]
    hb_age = membership.get("last_heartbeat_age_s")
    timeout_s = membership.get("membership_timeout_s")
    if (
        membership.get("state") == "left"
        or (trust.get("store") or {}).get("state") == "unreachable"
    ):
        return False
    if not isinstance(hb_age, int | float) or not isinstance(timeout_s, int | float):
        return False  # no heartbeat yet
    return hb_age + max(0.0, now - (state.get("counts_at") or 0.0)) < timeout_s


def route_label(route: Any, configured: set[str]) -> str:
    return route if route in configured else OTHER_ROUTE


def oldest_ratios(doc: dict[str, Any], configured: set[str]) -> dict[str, float]:
    """Per route label, the largest oldest-lateness ratio over its classes.

    Two lists of the document may hold a class: "classes" (every class, most
    due first) and "lateness.oldest" (classes with due rows, most late
    first); each may be cut short. While either is whole, a label with no
    due row is 0. When both are cut, only "oldest" can be trusted (a label
    in it has its maximum there, as it is sorted by lateness); a label
    absent from it is left out: unknown, not 0."""
    lateness = doc.get("lateness") or {}
    classes = doc.get("classes") or []
    oldest = lateness.get("oldest") or []
    whole = not doc.get("classes_truncated") or (
        "oldest" in lateness and not lateness.get("oldest_truncated")
    )
    entries = [(c.get("route"), c.get("oldest_lateness_ratio")) for c in classes] if whole else []
    entries += [(h.get("route"), h.get("lateness_ratio")) for h in oldest]
    ratios: dict[str, float] = {}
    for route, value in entries:
        if not isinstance(value, int | float):
            continue  # a class with no due row
        label = route_label(route, configured)
        ratios[label] = max(ratios.get(label, float(value)), float(value))
    if whole:
        for label in (*configured, OTHER_ROUTE):
            ratios.setdefault(label, 0.0)
    return ratios


__all__ = ["count_requests", "fleet_families", "oldest_ratios", "render", "routes"]
