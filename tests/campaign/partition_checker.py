"""The partition campaign's checker: the single-node campaign's pass rule
(tests/campaign/checker.py) extended for a fleet, as plain functions over
what was written down (docs/reliability.md, "Partitions").

- ``check_fleet(FleetEvidence)``: every item written (an item whose batch
  was "maybe written" may appear or not), finished, acknowledged, lost,
  unexpected, duplicated; a duplicate is put in a docs/delivery.md window
  by the evidence of the node that made it: "delivered twice" after an
  offer timeout or a restart of *that* node's ledger (a result id's node is
  ``id >> 45``); "finished twice" as the single-node checker says, or, when
  the results come from two nodes and the live list changed while the
  first lease was live, "Two nodes, one key" (``W_MOVED``). Then both laws
  on every node (``/accounting`` balanced, input gap 0, nothing in flight
  or awaiting an ack, ``finished`` equal to the distinct results that node
  made and were offered) and for the fleet (``?scope=cluster``); every
  row held by exactly one keeper after the heal;
- ``judge_cluster_poll``: one answer of ``GET /queue-state?scope=cluster``:
  a 503 without counts, or a 200 whose sums are its nodes' figures added
  up, over the database's live list, its rows within the table's;
- ``judge_cut``: a node cut from the database refused a claim before it
  dropped out of the live list (while the list still held it), within
  ``0.8 × membership_timeout_s`` and a slack, and granted nothing after;
- ``judge_skew``: a skewed node reports its skew (the database's clock
  minus its own) and flags it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.campaign import checker
from tests.campaign.checker import (
    UNEXPLAINED,
    W_LEDGER_RESTART,
    W_OFFER_TIMEOUT,
    Duplicate,
    Verdict,
)
from tests.campaign.workload import item_of

W_MOVED = (
    "two nodes, one key: a lease live when its key moved to another node "
    "(fenced there, granted by the new owner too)"
)
NODE_SHIFT = 45  # a result id's node number: id >> 45 (node/core/ids.py)
GRANT_FRACTION = 0.8  # the grant deadline: 0.8 x membership_timeout_s after a heartbeat
# A refused claim after the deadline: the probe's pace, a claim that was
# waiting on the cut, a loaded 2-core host.
REFUSAL_SLACK_S = 1.5
# How far a 200's count time may lag the rows it counted (a skewed node's
# clock, up to 6 s here, and a second).
COUNT_SLACK_S = 7.0
SKEW_TOLERANCE_S = 0.5
MAX_SKEW_S = 1.0  # node/fleet: flagged beyond it


def node_of(rid: int) -> int:
    return rid >> NODE_SHIFT


# -- the cluster's queue state ------------------------------------------------------------


def judge_cluster_poll(
    status: int,
    doc: Any,
    live_before: list[str],
    live_after: list[str],
    rows_before: int,
    rows_after: int,
    history: list[tuple[float, int]],
) -> str | None:
    """None when the answer is a 503 without counts or an exact 200; else
    what is wrong. ``history``: (time, rows in the table), in time order;
    rows are only ever added in the campaign, so a count taken at ``t``
    is at least the table's at ``t``."""
    if not isinstance(doc, dict):
        return f"status {status}: not a document: {str(doc)[:200]}"
    now = doc.get("now") or {}
    trust = doc.get("trust") or {}
    if status == 503:
        if trust.get("vouched") is not False:
            return "a 503 that vouches"
        if "due" in now or "rows" in now:
            return f"a 503 with counts: due {now.get('due')} rows {now.get('rows')}"
        return None
    if status != 200:
        return f"status {status}: {str(doc)[:200]}"
    nodes = doc.get("nodes") or []
    per = trust.get("nodes") or {}
    if trust.get("vouched") is not True:
        return "a 200 that does not vouch"
    if sorted(per) != sorted(nodes):
        return f"a 200 whose trust.nodes {sorted(per)} are not its nodes {nodes}"
    if not all(p.get("vouched") for p in per.values()):
        return f"a 200 summing a node that does not vouch: {per}"
    if live_before == live_after and sorted(nodes) != live_before:
        return f"a 200 over {nodes} while the database's live list was {live_before}"
    return _judge_sums(now, per, rows_after, history)


def _judge_sums(
    now: dict[str, Any], per: dict[str, Any], rows_after: int, history: list[tuple[float, int]]
) -> str | None:
    """A 200's sums: its nodes' figures added up, its rows within the table's."""
    due = (now.get("due") or {}).get("total")
    if due != sum(p.get("due") or 0 for p in per.values()):
        return f"a 200 whose due {due} is not its nodes' {[p.get('due') for p in per.values()]}"
    rows = now.get("rows")
    if rows != sum(p.get("rows") or 0 for p in per.values()):
        return f"a 200 whose rows {rows} are not its nodes' {[p.get('rows') for p in per.values()]}"
    if rows is None or rows > rows_after:
        return f"a 200 counting {rows} rows, the table had {rows_after} after it"
    at = now.get("at")
    if isinstance(at, (int, float)):
        floor = [n for t, n in history if t <= at - COUNT_SLACK_S]
        if floor and rows < floor[-1]:
            return (f"a 200 counting {rows} rows at {at:.1f}, the table had {floor[-1]} "
                    f"{COUNT_SLACK_S} s before")  # fmt: skip
    if due is not None and due > rows:
        return f"a 200 with due {due} over its rows {rows}"
    return None


# -- a cut from the database --------------------------------------------------------------


def judge_cut(fields: dict[str, Any], timeout_s: float, lapsing: bool) -> list[str]:
    """What a cut from the database must show (``fields`` from
    ``Fleet.measure_cut``); ``lapsing``: the cut was long enough for the
    node to drop out of the list."""
    out = []
    refused, gone = fields.get("refused_s"), fields.get("out_s")
    if fields.get("granted_after_out"):
        out.append(f"{fields['granted_after_out']} claims granted after the node was out of "
                   "the live list")  # fmt: skip
    if not lapsing:
        return out
    if refused is None:
        out.append("no claim refused not_granting during the cut")
        return out
    if refused > GRANT_FRACTION * timeout_s + REFUSAL_SLACK_S:
        out.append(f"refused {refused} s after the cut, past the deadline "
                   f"({GRANT_FRACTION} x {timeout_s} s + {REFUSAL_SLACK_S} s)")  # fmt: skip
    if fields.get("live_at_refusal") is False:
        out.append("refused only after the database counted it out")
    if gone is not None and gone < refused:
        out.append(f"out of the list {gone} s after the cut, before it refused ({refused} s)")
    return out


def judge_skew(fields: dict[str, Any]) -> list[str]:
    skew = fields.get("skew_s") or 0.0
    seen = fields.get("reported_skew_s") or {}
    got = seen.get("skew_s") if isinstance(seen, dict) else None
    if got is None:
        return [f"a clock skewed {skew:+} s: no skew reported in trust.membership"]
    out = []
    if abs(got + skew) > SKEW_TOLERANCE_S:
        out.append(f"a clock skewed {skew:+} s reported skew_s {got} (expected about {-skew})")
    if abs(skew) > MAX_SKEW_S and not seen.get("flagged"):
        out.append(f"a clock skewed {skew:+} s not flagged")
    return out


def judge_faults(faults: list[dict[str, Any]], timeout_s: float) -> list[str]:
    """Every action's own rule: it ran (no error), and what it measured."""
    out = []
    for f in faults:
        kind, target = f["kind"], f.get("target")
        if "error" in f:
            out.append(f"{kind} on {target} failed: {f['error']}")
            continue
        lapsing = kind in ("cut_db", "lease_cut") or (
            kind == "one_way" and (f.get("action") or {}).get("other", 0) < 0
        )
        if kind in ("cut_db", "blip_db", "lease_cut") or "refused_s" in f:
            out += [f"{kind} on {target}: {p}" for p in judge_cut(f, timeout_s, lapsing)]
        if kind == "skew":
            out += [f"skew on {target}: {p}" for p in judge_skew(f)]
        if kind == "cut_peers" and f.get("all_live") is False:
            out.append(f"cut_peers on {target}: the live list lost a node ({f})")
    return out


# -- the items ----------------------------------------------------------------------------


@dataclass
class FleetEvidence:
    producer: list[dict[str, Any]]
    consumer: list[dict[str, Any]]  # outside, receiver and the nemesis's leases
    runs: list[dict[str, Any]]  # the inference handlers' runs, every node
    table: dict[str, float]
    accounting: dict[str, dict[str, Any]]  # node name -> its /accounting
    cluster_accounting: dict[str, Any]
    input_gaps: dict[str, Any]  # node name -> counters.input_gap after the heal
    numbers: dict[int, str]  # node number -> name
    node_events: dict[str, list[tuple[float, str, str, str]]]  # name -> its log's actions
    faults: list[dict[str, Any]]
    live_changes: list[tuple[float, list[str]]]  # the database's live list, when it changed
    offer_timeout_s: float
    lease_s_max: float
    ended_at: float
    cadence_s: float = 30 * 86400
    extra_problems: list[str] = field(default_factory=list)


def _ledger_starts(ev: FleetEvidence) -> dict[str, list[float]]:
    return {
        name: sorted(t for t, role, action, _ in events
                     if role == "ledger" and action == "ledger_serving")
        for name, events in ev.node_events.items()
    }  # fmt: skip


def _first_claims(ev: FleetEvidence) -> dict[str, list[float]]:
    """key -> the times it was claimed, run or offered (any consumer)."""
    out: dict[str, list[float]] = {}
    for rec in [*ev.consumer, *ev.runs]:
        if rec.get("ev") in ("claim", "run", "offer") and isinstance(rec.get("key"), str):
            out.setdefault(rec["key"], []).append(rec["t"])
    return out


def reclassify(ev: FleetEvidence, dups: list[Duplicate], tl: Any) -> list[Duplicate]:
    """The single-node checker's duplicates, judged again with each
    node's own evidence (module docstring)."""
    starts = _ledger_starts(ev)
    touched = _first_claims(ev)
    # When the poll that brought each offer was sent (the node offered it
    # after that): an offer timeout is measured from there.
    sent_at = {
        (rec["rid"], rec["t"]): rec["sent"]
        for rec in ev.consumer
        if rec.get("ev") == "offer" and isinstance(rec.get("sent"), (int, float))
    }
    out = []
    for d in dups:
        if d.what == "delivered twice":
            (rid,) = d.rids
            name = ev.numbers.get(node_of(rid), "?")
            times = sorted(tl.offers.get(rid, []))
            pairs = list(zip(times, times[1:], strict=False))
            window, why = d.window, d.why
            if d.window in (W_LEDGER_RESTART, UNEXPLAINED):
                window, why = UNEXPLAINED, d.why
                for before, again in pairs:
                    answered = [t for t in tl.acks.get(rid, []) if t < again]
                    if answered:
                        continue
                    if any(before < s < again for s in starts.get(name, [])):
                        window, why = W_LEDGER_RESTART, f"{name}'s ledger started in between"
                    elif again - sent_at.get((rid, before), before) >= (
                        ev.offer_timeout_s - checker.TIMEOUT_SLACK_S
                    ):
                        since = again - sent_at.get((rid, before), before)
                        window, why = W_OFFER_TIMEOUT, f"no ack answered for {since:.1f} s"
            out.append(Duplicate(d.item, d.what, d.rids, window, why))
            continue
        if d.window != UNEXPLAINED:
            out.append(d)
            continue
        makers = sorted({ev.numbers.get(node_of(r), str(node_of(r))) for r in d.rids})
        key = checker._key(d.item)
        seen = sorted(touched.get(key, []))
        moved = False
        if len(makers) > 1 and seen:
            lo, hi = seen[0] - ev.lease_s_max, seen[-1]
            moved = any(lo <= t <= hi for t, _ in ev.live_changes[1:])
        if moved:
            out.append(Duplicate(d.item, d.what, d.rids, W_MOVED,
                                 f"results by {makers}; the live list changed while it was "
                                 "leased"))  # fmt: skip
        else:
            out.append(Duplicate(d.item, d.what, d.rids, UNEXPLAINED,
                                 f"{d.why}; results by {makers}"))  # fmt: skip
    return out


def _per_node_books(ev: FleetEvidence, tl: Any, superseded: dict[str, int]) -> list[str]:
    problems = []
    made: dict[str, int] = {}
    for rid in tl.offers:
        name = ev.numbers.get(node_of(rid), "?")
        made[name] = made.get(name, 0) + 1
    for name, a in sorted(ev.accounting.items()):
        problems += _node_books(name, a, made.get(name, 0), superseded.get(name, 0))
    for name, gap in sorted(ev.input_gaps.items()):
        if gap != 0:
            problems.append(f"{name}: counters.input_gap {gap} after the heal")
    c = ev.cluster_accounting
    if not c:
        problems.append("no /accounting?scope=cluster answer at the end")
    elif not c.get("balanced"):
        problems.append(f"the fleet's /accounting is not balanced: {c.get('by_node')}")
    return problems


def _node_books(name: str, a: dict[str, Any], made: int, superseded: int) -> list[str]:
    """One node's books at the end: both laws, drained, its results."""
    if not a:
        return [f"{name}: no /accounting answer at the end"]
    problems = []
    gaps = a.get("gaps") or {}
    if not a.get("balanced") and not superseded:
        problems.append(f"{name}: /accounting not balanced: gaps {gaps}")
    if gaps.get("input") != 0:
        problems.append(f"{name}: the input law is off: gap {gaps.get('input')} (received "
                        f"{a.get('received')}, requeued {a.get('requeued')}, routed "
                        f"{a.get('routed')}, waiting {a.get('waiting')}, withdrawn "
                        f"{a.get('withdrawn')})")  # fmt: skip
    law = a["finished"] + a["expired"] + a["released"] + a["in_flight"]
    if a["routed"] + superseded != law:
        problems.append(f"{name}: the output law is off: routed {a['routed']} != finished "
                        f"+ expired + released + in_flight {law}")  # fmt: skip
    if a["in_flight"] or a["awaiting_ack"]:
        problems.append(f"{name}: not drained: in_flight {a['in_flight']}, awaiting_ack "
                        f"{a['awaiting_ack']}")  # fmt: skip
    if a["finished"] != made:
        problems.append(f"{name}: /accounting finished {a['finished']} but {made} distinct "
                        "results of it were offered")  # fmt: skip
    return problems


def check_fleet(ev: FleetEvidence) -> Verdict:
    """The verdict (module docstring)."""
    merged = sorted(e for events in ev.node_events.values() for e in events)
    single = checker.Evidence(
        producer=ev.producer, consumer=ev.consumer, runs=ev.runs, table=ev.table,
        accounting=ev.cluster_accounting, faults=[], node_events=merged,
        offer_timeout_s=ev.offer_timeout_s, ended_at=ev.ended_at, cadence_s=ev.cadence_s,
    )  # fmt: skip
    verdict = checker.check(single)
    tl = checker._Timeline(single)
    dups = reclassify(ev, verdict.duplicates, tl)
    # The single checker's accounting and duplicate rules are replaced by
    # the per-node ones here; its item rules stay.
    keep = [p for p in verdict.problems if not p.startswith((
        "unexplained duplicate", "the ledger is not balanced", "routed ", "the input side",
        "not drained", "/accounting finished", "no /accounting"))]  # fmt: skip
    for d in dups:
        if d.window == UNEXPLAINED:
            keep.append(f"unexplained duplicate: item {d.item} {d.what} {d.rids}: {d.why}")
    superseded: dict[str, int] = {}
    for d in dups:
        if d.window == checker.W_SUPERSEDED:
            for r in d.rids:
                name = ev.numbers.get(node_of(r), "?")
                superseded[name] = superseded.get(name, 0) + 1
    keep += _per_node_books(ev, tl, superseded)
    keep += ev.extra_problems
    verdict.problems = keep
    verdict.duplicates = dups
    return verdict


def items_maybe(ev: FleetEvidence) -> tuple[int, int]:
    """(maybe-written items in the table, maybe-written items absent)."""
    accepted: set[int] = set()
    maybe: set[int] = set()
    for rec in ev.producer:
        if rec.get("ev") == "write":
            (accepted if rec["outcome"] == "ok" else maybe).update(rec["ids"])
    maybe -= accepted
    present = {x for x in maybe if checker._key(x) in ev.table}
    return len(present), len(maybe - present)


__all__ = [
    "FleetEvidence",
    "W_MOVED",
    "check_fleet",
    "item_of",
    "judge_cluster_poll",
    "judge_cut",
    "judge_faults",
    "judge_skew",
    "reclassify",
]
