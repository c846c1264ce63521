"""The fleet seen as one: the sums of ``?scope=cluster`` (docs/fleet.md,
"The fleet as one").

Pure functions over the documents each node answers for itself: one
``GET /queue-state`` or ``GET /accounting`` a node, by name. Asking the nodes
is the HTTP worker's (``workers/http/cluster.py``); deciding whether the
answers may be summed at all is here (``judge``), so that a fleet client or a
test sums them by the same rules.

Never a partial sum: every live node of the node list must answer, vouch for
its counts, be the node the list names at that address, and see the same
live list as the database (a node that has not yet taken in a membership
change still holds rows another node now holds, or misses rows it gained).
One that does not is named, and nothing is summed.

What a sum means, group by group:

- Counts (due, rows, in flight, coming, lateness bins, flow, the input
  counters) add up: each node's count is exact for its own ``now.at``, and the
  nodes hold disjoint rows. ``now.at`` of the sum is the oldest node's
  (``now.at_newest`` the newest): the sum is exact for "each node at its own
  count time", all within the 15 s a vouching keeper's counts may be old.
- Lists of classes and routes merge by identity: a class's rows and due rows
  add up, its oldest due minute is the earliest, its lateness the greatest.
  ``now.classes`` is the number of distinct classes holding rows.
- ``by_hour`` adds hour by hour: each node's hour 0 starts after its own
  current hour, so across an hour boundary a count can sit one hour off for
  the few seconds the nodes' count times straddle it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SCOPE = "cluster"
# The lists of a queue-state document keep their single-node bounds.
MAX_ROUTES = 200  # lateness.by_route
MAX_CLASSES = 1000  # lateness.oldest, classes.rows
FLOW_MINUTES = 60
# A class's identity in classes.rows and lateness.oldest.
CLASS_ID = ("route", "cadence_s", "source", "sitemap", "boost")
# The ledger's counters /accounting?scope=cluster adds up (docs/accounting.md).
ACCOUNTING_COUNTS = (
    "received", "requeued", "routed", "waiting", "withdrawn", "finished",
    "acknowledged", "discarded", "expired", "released", "refused",
    "in_flight", "awaiting_ack",
)  # fmt: skip
ACCOUNTING_GAPS = ("input", "input_bound", "input_edges", "output", "finished")


@dataclass(frozen=True, slots=True)
class Peer:
    """A live node of the node list: its name and where it serves."""

    name: str
    address: str


@dataclass(frozen=True, slots=True)
class Answer:
    """What one node answered: its HTTP status and document, or why none
    came (``error``: refused, timed out, not JSON)."""

    peer: Peer
    status: int | None = None
    doc: Any = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Down:
    """A node on the node list that is not live: it ``left`` (a clean leave)
    or lapsed (no heartbeat within the membership timeout: killed, stopped,
    cut off); ``heartbeat_age_s`` by the database's clock. A node forgotten
    (its row deleted) is on no list."""

    name: str
    address: str
    number: int
    heartbeat_age_s: float
    left: bool

    def doc(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "address": self.address,
            "number": self.number,
            "heartbeat_age_s": round(max(0.0, self.heartbeat_age_s), 1),
            "state": "left" if self.left else "lapsed",
        }


class NotSummable(Exception):
    """The answers cannot be summed; ``reason`` names the first node that
    failed and why, ``missing`` every node that did."""

    def __init__(self, reason: str, missing: Sequence[str]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.missing = list(missing)


def _why_not(answer: Answer, live: Sequence[str], queue_state: bool) -> str | None:
    """Why this node's answer may not go into the sum; None: it may."""
    peer = answer.peer
    if answer.error is not None:
        return answer.error
    doc = answer.doc
    if not isinstance(doc, dict):
        return f"answered {answer.status} without a JSON object"
    if queue_state:
        trust: dict[str, Any] = doc["trust"] if isinstance(doc.get("trust"), dict) else {}
        if not trust.get("vouched"):
            return f"does not vouch: {trust.get('reason') or f'answered {answer.status}'}"
        membership = trust.get("membership") or {}
        if membership.get("name", peer.name) != peer.name:
            return f"answers as node {membership.get('name')!r}, not {peer.name!r}"
        seen = sorted(membership.get("live") or [peer.name])
        if seen != sorted(live):
            listed = sorted(live)
            return f"sees the live nodes {seen}, the node list {listed}: membership is changing"
    elif answer.status != 200:
        error: dict[str, Any] = doc["error"] if isinstance(doc.get("error"), dict) else {}
        return f"answered {answer.status} {error.get('code', '')}".rstrip()
    if answer.status != 200:
        return f"answered {answer.status}"
    return None


def judge(answers: Sequence[Answer], queue_state: bool = True) -> dict[str, Any]:
    """The documents to sum, by node name; raises NotSummable naming every
    node whose answer may not go in (the first one's reason in full)."""
    live = [a.peer.name for a in answers]
    failed: list[tuple[Answer, str]] = []
    for answer in answers:
        why = _why_not(answer, live, queue_state)
        if why is not None:
            failed.append((answer, why))
    if failed:
        first, why = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        reason = f"node {first.peer.name} at {first.peer.address}: {why}{more}"
        raise NotSummable(reason, [a.peer.name for a, _ in failed])
    return {a.peer.name: a.doc for a in answers}


# -- queue state ----------------------------------------------------------------------


def _add(values: Iterable[Any]) -> Any:
    """The sum, or None when any is None (a worker without a lease table)."""
    total = 0
    for value in values:
        if value is None:
            return None
        total += value
    return total


def _add_lists(lists: Iterable[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for counts in lists:
        if len(out) < len(counts):
            out.extend([0] * (len(counts) - len(out)))
        for i, n in enumerate(counts):
            out[i] += n
    return out


def _add_dicts(dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    keys: dict[str, None] = {}
    for d in dicts:
        keys.update(dict.fromkeys(d))
    return {k: _add(d.get(k, 0) for d in dicts) for k in keys}


def _min_none(values: Iterable[Any]) -> Any:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _max_none(values: Iterable[Any]) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _merge_classes(lists: Iterable[Sequence[Mapping[str, Any]]], adds: Sequence[str]) -> list[dict]:
    """Entries of ``classes.rows`` or ``lateness.oldest`` merged by class
    identity: ``adds`` summed, the oldest due minute the earliest, the
    lateness the greatest."""
    merged: dict[tuple, dict[str, Any]] = {}
    for entries in lists:
        for entry in entries:
            ident = tuple(entry.get(k) for k in CLASS_ID)
            into = merged.get(ident)
            if into is None:
                merged[ident] = dict(entry)
                continue
            for key in adds:
                into[key] = into.get(key, 0) + entry.get(key, 0)
            into["oldest_due_minute"] = _min_none(
                (into.get("oldest_due_minute"), entry.get("oldest_due_minute"))
            )
            for key in ("lateness_s", "lateness_ratio", "oldest_lateness_ratio"):
                if key in into or key in entry:
                    into[key] = _max_none((into.get(key), entry.get(key)))
    return list(merged.values())


def _now(docs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    nows = [d["now"] for d in docs]
    ats = [n.get("at") for n in nows]
    paused_nodes = sorted({name for n in nows for name in n.get("paused_nodes") or []})
    routes = sorted({r for n in nows for r in (n.get("paused") or {}).get("routes") or []})
    statuses = {n.get("status") for n in nows}
    return {
        "due": _add_dicts([n.get("due") or {} for n in nows]),
        "rows": _add(n.get("rows", 0) for n in nows),
        "at": _min_none(ats),
        "at_newest": _max_none(ats),
        "in_flight": _add(n.get("in_flight") for n in nows),
        "held": _add(n.get("held") for n in nows),
        "parked": _add(n.get("parked") for n in nows),
        "unclaimed": _add(n.get("unclaimed") for n in nows),
        # Every node paused: the fleet grants nothing.
        "paused": {
            "node": all((n.get("paused") or {}).get("node") for n in nows),
            "routes": routes,
        },  # fmt: skip
        "paused_nodes": paused_nodes,
        "status": statuses.pop() if len(statuses) == 1 else "verifying",
    }


def _lateness(docs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    parts = [d["lateness"] for d in docs if d.get("lateness")]
    if not parts:
        return None
    by_route: dict[str, list[int]] = {}
    for part in parts:
        for route, counts in (part.get("by_route") or {}).items():
            by_route[route] = _add_lists([by_route.get(route, []), counts])
    busiest = sorted(by_route.items(), key=lambda kv: -sum(kv[1]))
    oldest = _merge_classes((p.get("oldest") or [] for p in parts), ("due",))
    oldest.sort(key=lambda e: -(e.get("lateness_ratio") or 0))
    return {
        "edges": parts[0].get("edges"),
        "labels": parts[0].get("labels"),
        **{
            kind: _add_lists(p.get(kind) or [] for p in parts)
            for kind in ("sitemap", "discovered", "total")
        },  # fmt: skip
        "by_route": dict(busiest[:MAX_ROUTES]),
        "by_route_truncated": len(busiest) > MAX_ROUTES
        or any(p.get("by_route_truncated") for p in parts),
        "oldest": oldest[:MAX_CLASSES],
        "oldest_truncated": len(oldest) > MAX_CLASSES
        or any(p.get("oldest_truncated") for p in parts),
    }


def _coming(docs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    parts = [d["coming"] for d in docs if d.get("coming")]
    if not parts:
        return None
    out = _add_dicts([{k: v for k, v in p.items() if k != "by_hour"} for p in parts])
    out["by_hour"] = _add_lists(p.get("by_hour") or [] for p in parts)
    return out


def _flow(docs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    parts = [d["flow"] for d in docs if d.get("flow")]
    if not parts:
        return None
    minutes: dict[int, dict[str, Any]] = {}
    for part in parts:
        for entry in part.get("minutes") or []:
            into = minutes.setdefault(entry["minute"], {"minute": entry["minute"]})
            for key, value in entry.items():
                if key != "minute":
                    into[key] = into.get(key, 0) + value
    kept = [minutes[m] for m in sorted(minutes)][-FLOW_MINUTES:]
    return {"minutes": kept, "last_hour": _add_dicts([p.get("last_hour") or {} for p in parts])}


def _classes(docs: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], int]:
    parts = [d.get("classes") or {} for d in docs]
    rows = _merge_classes((p.get("rows") or [] for p in parts), ("rows", "due"))
    rows.sort(key=lambda e: (-(e.get("due") or 0), -(e.get("rows") or 0)))
    truncated = len(rows) > MAX_CLASSES or any(p.get("truncated") for p in parts)
    return {"rows": rows[:MAX_CLASSES], "truncated": truncated}, len(rows)


def _counters(docs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    parts = [d["counters"] for d in docs if d.get("counters")]
    if not parts:
        return None
    out = _add_dicts([{k: v for k, v in p.items() if k != "at"} for p in parts])
    out["at"] = _min_none(p.get("at") for p in parts)
    return out


def _node_trust(doc: Mapping[str, Any]) -> dict[str, Any]:
    """What the cluster's ``trust.nodes`` shows of one node: its verdict and
    its main figures, side by side with the others' (the console's fleet
    view)."""
    trust = doc.get("trust") or {}
    membership = trust.get("membership") or {}
    now = doc.get("now") or {}
    lateness = doc.get("lateness") or {}
    counters = doc.get("counters") or {}
    return {
        "vouched": bool(trust.get("vouched")),
        "reason": trust.get("reason"),
        "status": trust.get("status"),
        "counts_at": trust.get("counts_at"),
        "number": membership.get("number"),
        "due": (now.get("due") or {}).get("total"),
        "rows": now.get("rows"),
        "in_flight": now.get("in_flight"),
        "unclaimed": now.get("unclaimed"),
        "paused": now.get("paused"),
        "lateness": lateness.get("total"),
        "input_gap": counters.get("input_gap"),
    }


def sum_queue_states(
    docs: Mapping[str, Mapping[str, Any]],
    addresses: Mapping[str, str],
    down: Sequence[Down] = (),
) -> dict:
    """The fleet's queue state from every live node's own (``judge``d);
    ``down``: the nodes on the list that are not live (``trust.down``)."""
    names = sorted(docs)
    ordered = [docs[n] for n in names]
    now = _now(ordered)
    classes, distinct = _classes(ordered)
    now["classes"] = distinct
    trust_nodes = {n: {**_node_trust(docs[n]), "address": addresses.get(n)} for n in names}
    return {
        "scope": SCOPE,
        "nodes": names,
        "now": now,
        "coming": _coming(ordered),
        "lateness": _lateness(ordered),
        "flow": _flow(ordered),
        "classes": classes,
        "counters": _counters(ordered),
        "trust": {
            "vouched": True,
            "live": True,
            "reason": None,
            "status": now["status"],
            "counts_at": now["at"],
            "nodes": trust_nodes,
            "down": [d.doc() for d in down],
        },
    }


def _own_figures(peer: Peer, answer: Answer | None, fit: bool) -> dict[str, Any]:
    """One live node in the 503's ``trust.nodes``: the figures it answered
    for itself (``_node_trust``'s, as on a 200), side by side with the
    others' and never added to them (``own_figures``); a node that gave no
    document has none, and ``reason`` says why (its error)."""
    doc = answer.doc if answer is not None and isinstance(answer.doc, dict) else None
    entry = _node_trust(doc if doc is not None else {})
    if doc is None:
        entry["reason"] = answer.error if answer is not None else None
    return {**entry, "address": peer.address, "summed": fit, "own_figures": doc is not None}


def not_summed(
    reason: str,
    missing: Sequence[str],
    live: Sequence[Peer],
    answers: Sequence[Answer] = (),
    down: Sequence[Down] | None = None,
    queue_state: bool = True,
) -> dict[str, Any]:
    """The 503 document of ``?scope=cluster``: who is live, who failed, why;
    no summed counts at all (a partial sum is never shown). Each node that
    answered is shown by itself: ``trust.nodes`` carries its own figures
    (``queue_state``), or ``by_node`` its own books (the ledger's 503).
    ``trust.down``: the nodes on the list that are not live (None: the list
    could not be read)."""
    by_name = {a.peer.name: a for a in answers}
    nodes: dict[str, Any] = {}
    for p in live:
        fit = p.name not in missing  # its answer could have gone into a sum
        if queue_state:
            nodes[p.name] = _own_figures(p, by_name.get(p.name), fit)
        else:
            nodes[p.name] = {"address": p.address, "summed": fit}
    doc: dict[str, Any] = {
        "scope": SCOPE,
        "nodes": sorted(p.name for p in live),
        "now": {"in_flight": None, "paused": None, "status": None},
        "trust": {
            "vouched": False,
            "live": False,
            "reason": reason,
            "status": None,
            "missing": sorted(missing),
            "nodes": nodes,
            "down": None if down is None else [d.doc() for d in down],
        },
    }
    if not queue_state:
        # Each ledger that answered, by itself (as a 200's by_node): its
        # laws hold or not whatever the other nodes' do.
        doc["by_node"] = {
            name: {"balanced": bool(a.doc.get("balanced")), "gaps": a.doc.get("gaps")}
            for name, a in sorted(by_name.items())
            if a.status == 200 and isinstance(a.doc, dict) and "error" not in a.doc
        }  # fmt: skip
    return doc


# -- accounting -----------------------------------------------------------------------


def sum_accounting(docs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The fleet's ledger: every counter added up; ``balanced`` when every
    node balances (a sum that balances while two nodes are off in opposite
    directions would hide both), each node's verdict under ``nodes``."""
    names = sorted(docs)
    ordered = [docs[n] for n in names]
    out: dict[str, Any] = {"scope": SCOPE, "nodes": names}
    for key in ACCOUNTING_COUNTS:
        out[key] = _add(d.get(key, 0) for d in ordered)
    out["balanced"] = all(d.get("balanced") for d in ordered)
    out["since"] = _min_none(d.get("since") for d in ordered)
    gaps = [d.get("gaps") or {} for d in ordered]
    out["gaps"] = {key: _add(g.get(key, 0) for g in gaps) for key in ACCOUNTING_GAPS}
    out["gaps"]["input_as_of"] = _min_none(g.get("input_as_of") for g in gaps)
    out["by_node"] = {
        n: {"balanced": bool(docs[n].get("balanced")), "gaps": docs[n].get("gaps")} for n in names
    }
    return out
