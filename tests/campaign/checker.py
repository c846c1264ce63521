"""The campaign's checker: a plain function over what was written down.

``check(evidence)`` reads the producer's log, the consumers' logs (every
claim, run, completion, offer and ack), the handler's runs, the rows left in
the table, ``GET /accounting``, the nemesis's faults and the node's log, and
counts every item (Jepsen's queue checker, in this node's words):

- **written**: a write answered 200, or a "maybe" write (dropped connection,
  503) whose row is in the table at the end;
- **finished**: a result for it was offered to the receiver;
- **acknowledged**: an ack covering one of its results was answered;
- **lost**: written, and not finished and acknowledged; also a completion
  answered with a result id that was never offered;
- **unexpected**: a result for an item never written (not even "maybe"), or
  whose result names another item;
- **duplicated**: a result offered again (delivered twice) or a second result
  for one item (finished twice); each is put in the docs/delivery.md window
  its evidence shows, or counted as unexplained;
- **recovered**: a result offered, not acknowledged before the ledger
  restarted, offered again by the new ledger and then acknowledged.

Pass: nothing lost, nothing unexpected, no unexplained duplicate, every
finished row written back (not due again), and the ledger balanced with
nothing left in flight or awaiting an ack.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.campaign.workload import item_of

# The windows of docs/delivery.md the checker can name, by evidence.
W_OFFER_TIMEOUT = "the receiver does not ack in time (offered again after offer_timeout_s)"
W_LEDGER_RESTART = "the ledger dies after offering, before the ack (every unacked result again)"
W_ACK_NOT_DURABLE = "the log cannot write (full disk) when an ack is flushed, then a restart"
W_SUPERSEDED = "a result durable, but the key granted again before its lease could be ended"
W_WRITEBACK = "the write-back fails (store error), then the ledger dies: the item runs again"
W_CUT_BACK = "a failed write whose cut-back also failed, then a crash"
UNEXPLAINED = "UNEXPLAINED"
# Clocks: the offer timeout is measured by the ledger, the offers' times by
# the receiver (after its poll's answer came back).
TIMEOUT_SLACK_S = 0.5
DISK_FAULTS = ("enospc", "eio")
# An ack answered while the log could not write is retried every 100 ms; a
# second is far more than the first retry after the fault needs.
ACK_RETRY_SLACK_S = 1.0
_LOG_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ (\w+)\[(\d+)\] action=(\w+)(.*)$"
)


@dataclass
class Evidence:
    producer: list[dict[str, Any]]
    consumer: list[dict[str, Any]]  # outside and receiver events, by time
    runs: list[dict[str, Any]]  # the inference handler's runs
    table: dict[str, float]  # key -> due_at of every row at the end
    accounting: dict[str, Any]
    faults: list[dict[str, Any]]  # the nemesis: {"kind", "t0", "t1"}
    node_events: list[tuple[float, str, str, str]]  # (time, role, action, rest)
    offer_timeout_s: float
    ended_at: float
    cadence_s: float = 30 * 86400


@dataclass
class Duplicate:
    item: int
    what: str  # "delivered twice" | "finished twice"
    rids: list[int]
    window: str
    why: str


@dataclass
class Verdict:
    counts: dict[str, int]
    duplicates: list[Duplicate] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    accounting: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def table(self) -> str:
        c = self.counts
        lines = [
            f"{'items written':<28}{c['written']:>8}   (accepted {c['accepted']}, maybe-written "
            f"and in the table {c['maybe_in_table']}, maybe-written and not {c['maybe_absent']})",
            f"{'finished':<28}{c['finished']:>8}",
            f"{'acknowledged':<28}{c['acknowledged']:>8}",
            f"{'lost':<28}{c['lost']:>8}",
            f"{'unexpected':<28}{c['unexpected']:>8}",
            f"{'duplicated':<28}{c['duplicated']:>8}   (delivered twice {c['delivered_twice']}, "
            f"finished twice {c['finished_twice']})",
        ]
        by_window: dict[str, int] = defaultdict(int)
        for d in self.duplicates:
            by_window[d.window] += 1
        for window, n in sorted(by_window.items(), key=lambda x: -x[1]):
            lines.append(f"{'':<4}{n:>6}  {window}")
        lines += [
            f"{'recovered':<28}{c['recovered']:>8}",
            f"{'runs (handler + outside)':<28}{c['runs']:>8}   (items run more than once "
            f"{c['run_again']}: a lease expired or a result refused; not duplicates)",
        ]
        a = self.accounting
        if a:
            lines.append("ledger  " + " ".join(
                f"{k}={a.get(k)}" for k in ("balanced", "routed", "finished", "expired",
                                            "released", "in_flight", "acknowledged",
                                            "awaiting_ack")))  # fmt: skip
        lines.append("PASS" if self.ok else "FAIL")
        lines += [f"  problem: {p}" for p in self.problems[:40]]
        if len(self.problems) > 40:
            lines.append(f"  ... and {len(self.problems) - 40} more")
        return "\n".join(lines)


def parse_node_log(text: str) -> list[tuple[float, str, str, str]]:
    """(time, role, action, rest) of every ``action=`` line of the node log."""
    out = []
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if m:
            t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
            out.append((t, m.group(3), m.group(5), m.group(6)))
    return out


# -- the parts -------------------------------------------------------------------------


def _written(ev: Evidence) -> tuple[set[int], set[int], dict[str, int]]:
    """(written, maybe-written-but-absent, counts)."""
    accepted: set[int] = set()
    maybe: set[int] = set()
    for rec in ev.producer:
        if rec.get("ev") != "write":
            continue
        (accepted if rec["outcome"] == "ok" else maybe).update(rec["ids"])
    maybe -= accepted
    in_table = {x for x in maybe if _key(x) in ev.table}
    counts = {"accepted": len(accepted), "maybe_in_table": len(in_table),
              "maybe_absent": len(maybe - in_table)}  # fmt: skip
    return accepted | in_table, maybe - in_table, counts


def _key(item: int) -> str:
    return f"c/{item:06d}"


class _Timeline:
    """Offers and acks by result id, ledger starts and disk faults by time."""

    def __init__(self, ev: Evidence) -> None:
        self.offers: dict[int, list[float]] = defaultdict(list)
        self.acks: dict[int, list[float]] = defaultdict(list)  # answered acks
        self.item_rids: dict[int, set[int]] = defaultdict(set)
        self.rid_item: dict[int, int | None] = {}
        self.unexpected: list[str] = []
        self.completed: dict[int, str] = {}  # rid -> key, answered by /complete
        for rec in ev.consumer:
            kind = rec.get("ev")
            if kind == "offer":
                self._offer(rec)
            elif kind == "ack":
                for rid in rec["ids"]:
                    self.acks[rid].append(rec["t"])
            elif kind == "complete" and isinstance(rec.get("rid"), int):
                self.completed[rec["rid"]] = rec["key"]
        self.ledger_starts = sorted(t for t, role, action, _ in ev.node_events
                                    if role == "ledger" and action == "ledger_serving")  # fmt: skip
        self.disk = [(f["t0"], f["t1"]) for f in ev.faults if f["kind"] in DISK_FAULTS]

    def _offer(self, rec: dict[str, Any]) -> None:
        rid, key = rec["rid"], rec["key"]
        item = item_of(key)
        result = rec.get("result")
        named = result.get("id") if isinstance(result, dict) else None
        if item is None or named != item:
            self.unexpected.append(f"result {rid} for {key!r} names item {named!r}")
        self.offers[rid].append(rec["t"])
        if rid not in self.rid_item:
            self.rid_item[rid] = item
            if item is not None:
                self.item_rids[item].add(rid)

    def restart_between(self, t0: float, t1: float) -> bool:
        return any(t0 < s < t1 for s in self.ledger_starts)

    def disk_fault_at(self, t: float) -> bool:
        """A disk fault on at ``t``, or just over (its ACK retried every 100 ms)."""
        return any(f0 <= t <= f1 + ACK_RETRY_SLACK_S for f0, f1 in self.disk)


def _redelivery_window(
    tl: _Timeline, rid: int, before: float, again: float, timeout_s: float
) -> tuple[str, str]:
    """Why result ``rid``, offered at ``before``, was offered again at ``again``."""
    answered = [t for t in tl.acks.get(rid, []) if t < again]
    if not answered:
        if tl.restart_between(before, again):
            return W_LEDGER_RESTART, "no ack answered; a new ledger started in between"
        if again - before >= timeout_s - TIMEOUT_SLACK_S:
            return W_OFFER_TIMEOUT, f"no ack answered for {again - before:.1f} s"
        return UNEXPLAINED, f"offered again after {again - before:.2f} s, no ack, no restart"
    acked_at = min(answered)
    if tl.restart_between(acked_at, again) and tl.disk_fault_at(acked_at):
        return W_ACK_NOT_DURABLE, "ack answered during/after a disk fault, then a restart"
    return UNEXPLAINED, f"offered again {again - acked_at:.2f} s after its ack was answered"


def _second_result_window(ev: Evidence, key: str) -> tuple[str, str]:
    actions = {action for _, _, action, rest in ev.node_events if f"key={key}" in rest}
    if "complete_superseded_after_durable" in actions:
        return W_SUPERSEDED, "complete_superseded_after_durable in the node log"
    if "writeback_failed" in actions:
        return W_WRITEBACK, "writeback_failed in the node log"
    if any(a == "log_unavailable" and "cannot cut" in rest for _, _, a, rest in ev.node_events):
        return W_CUT_BACK, "a cut-back failed (log_unavailable: cannot cut) before a restart"
    return UNEXPLAINED, "two durable results and no window's evidence"


def _duplicates(ev: Evidence, tl: _Timeline) -> list[Duplicate]:
    out = []
    for rid, times in tl.offers.items():
        times = sorted(times)
        for before, again in zip(times, times[1:], strict=False):
            window, why = _redelivery_window(tl, rid, before, again, ev.offer_timeout_s)
            item = tl.rid_item.get(rid)
            out.append(Duplicate(-1 if item is None else item, "delivered twice", [rid], window,
                                 why))  # fmt: skip
    for item, rids in tl.item_rids.items():
        if len(rids) > 1:
            window, why = _second_result_window(ev, _key(item))
            out.append(Duplicate(item, "finished twice", sorted(rids), window, why))
    return out


def _recovered(tl: _Timeline) -> int:
    n = 0
    for rid, times in tl.offers.items():
        times = sorted(times)
        acks = tl.acks.get(rid, [])
        if (
            len(times) > 1
            and acks
            and any(
                tl.restart_between(a, b) and not any(t < b for t in acks)
                for a, b in zip(times, times[1:], strict=False)
            )
        ):
            n += 1
    return n


def _runs(ev: Evidence) -> tuple[int, int]:
    per_item: dict[str, int] = defaultdict(int)
    for rec in [*ev.runs, *ev.consumer]:
        if rec.get("ev") == "run":
            per_item[rec["key"]] += 1
    return sum(per_item.values()), sum(1 for n in per_item.values() if n > 1)


def _check_accounting(ev: Evidence, tl: _Timeline, superseded: int) -> list[str]:
    a = ev.accounting
    if not a:
        return ["no /accounting answer at the end"]
    problems = []
    law = a["finished"] + a["expired"] + a["released"] + a["in_flight"]
    if not a.get("balanced") and not superseded:
        problems.append(f"the ledger is not balanced: {a}")
    # A superseded result counts its lease as released and the result as
    # finished: the law is off by one each (docs/accounting.md).
    if a["routed"] + superseded != law:
        problems.append(f"routed {a['routed']} (+{superseded} superseded) != finished + "
                        f"expired + released + in_flight {law}")  # fmt: skip
    # The input law (docs/accounting.md), on the keeper's snapshot: work that
    # came due and was neither routed, withdrawn nor left waiting.
    gaps = a.get("gaps") or {}
    if gaps.get("input") != 0:
        problems.append(f"the input side does not balance: gap {gaps.get('input')}, "
                        f"bound {gaps.get('input_bound')}: {a}")  # fmt: skip
    if a["in_flight"] or a["awaiting_ack"]:
        problems.append(f"not drained: in_flight {a['in_flight']}, "
                        f"awaiting_ack {a['awaiting_ack']}")  # fmt: skip
    if a["finished"] != len(tl.offers):
        problems.append(f"/accounting finished {a['finished']} but {len(tl.offers)} distinct "
                        "results were offered")  # fmt: skip
    return problems


# -- the verdict -----------------------------------------------------------------------


def check(ev: Evidence) -> Verdict:
    written, maybe_absent, counts = _written(ev)
    tl = _Timeline(ev)
    problems: list[str] = list(tl.unexpected)
    tried = written | maybe_absent
    for item in tl.item_rids:
        if item not in tried:
            problems.append(f"unexpected: item {item} was never written")
    unexpected = len(problems)

    finished = {i for i, rids in tl.item_rids.items() if i in written}
    acked = {i for i in finished if any(tl.acks.get(r) for r in tl.item_rids[i])}
    lost = sorted(written - acked)
    for item in lost[:20]:
        problems.append(
            f"lost: item {item} "
            + ("finished, never acknowledged" if item in finished else "never finished")
        )
    never_offered = sorted(set(tl.completed) - set(tl.offers))
    for rid in never_offered[:20]:
        problems.append(f"lost: result {rid} ({tl.completed[rid]}) answered ok, never offered")

    stale = [i for i in sorted(acked) if ev.table.get(_key(i), 0) < ev.ended_at
             + ev.cadence_s / 2]  # fmt: skip
    for item in stale[:20]:
        problems.append(f"item {item} finished but its row is due again (not written back)")

    dups = _duplicates(ev, tl)
    for d in dups:
        if d.window == UNEXPLAINED:
            problems.append(f"unexplained duplicate: item {d.item} {d.what} {d.rids}: {d.why}")
    superseded = sum(1 for d in dups if d.window == W_SUPERSEDED)
    problems += _check_accounting(ev, tl, superseded)

    runs, run_again = _runs(ev)
    counts.update(
        written=len(written), finished=len(finished), acknowledged=len(acked),
        lost=len(lost) + len(never_offered), unexpected=unexpected,
        duplicated=len(dups), delivered_twice=sum(d.what == "delivered twice" for d in dups),
        finished_twice=sum(d.what == "finished twice" for d in dups),
        recovered=_recovered(tl), runs=runs, run_again=run_again,
    )  # fmt: skip
    return Verdict(counts, dups, problems, dict(ev.accounting))
