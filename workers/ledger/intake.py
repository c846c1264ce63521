"""A complete request's items before anything is written: which are taken.

``check`` peeks every item (the repeat index first, then the lease table in
one call into C) and reads the rows' job and cadence (``Store.jobs_of``): it
answers the refused ones at once and gathers the accepted ones into the
request's ``Batch``, which the group commit makes durable whole
(``workers/ledger/process.py``, ``Ledger.run_committer``). The usual request
(fresh leases, all live, none in flight twice, every row schedulable) is
taken in a few passes in C (``map``, ``zip``, ``dict.update``); any other
goes item by item.
"""

from __future__ import annotations

import asyncio
import time
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

from node.core.config import Config
from node.core.errors import NodeError
from node.core.rows import not_jobs
from shm.leases import Outcome

# One accepted completion between its peek and its reply: key, lease id,
# data, encoding, job, version, cadence_s (a tuple: one a completion).
Item = tuple[str, int, bytes, str, str, int, float]
# A completion in flight, by (key, lease id): its batch and its place there.
InFlight = dict[tuple[str, int], tuple["Batch", int]]

# A peek's outcome that refuses the item, and its answer (built once: each
# Enum member's hash is a call in Python).
_REFUSED = {
    Outcome.REPEAT: "repeat",
    Outcome.SUPERSEDED: "conflict",
    Outcome.UNKNOWN: "unknown",
    Outcome.BUSY: "busy",
}
_first, _second = itemgetter(0), itemgetter(1)
_key, _lease_id = itemgetter("key"), itemgetter("lease_id")
_result, _encoding = itemgetter("result"), itemgetter("encoding")
_version, _cadence = attrgetter("version"), attrgetter("cadence_s")
# A late result's key is kept from being granted again this long while its
# group commit runs (``LeaseTable.pin_late``): a commit that takes longer (a
# disk stall, a store that refuses the write-back) reopens the window of
# docs/delivery.md, "a result durable, but the key granted again".
LATE_PIN_S = 10.0


class Batch:
    """One request's accepted items, committed in the same group (a group
    holds whole requests): ``done`` gets (status, their ids or None) once."""

    __slots__ = ("items", "done")

    def __init__(self, items: list[Item], done: asyncio.Future) -> None:
        self.items = items
        self.done = done


def check(
    items: list[dict], repeats: Any, leases: Any, store: Any, inflight: InFlight, config: Config
) -> tuple[list[dict | None], list[int], Batch, list[tuple[int, tuple[Batch, int]]]]:
    """(outcomes so far, the indexes of the accepted items, their batch,
    duplicates of completions in flight as (index, (batch, place))). The
    accepted items are in ``inflight`` from now until their batch is
    answered."""
    refused = _REFUSED.get
    n = len(items)
    outcomes: list[dict | None] = [None] * n
    keys, lease_ids = list(map(_key, items)), list(map(_lease_id, items))
    batch = Batch([], asyncio.get_running_loop().create_future())
    # Ours first: the table's slot may hold another key by now, or a
    # newer lease of this one (then it would say unknown or conflict).
    rids = repeats.find_many(lease_ids, keys)
    if rids is None:
        asked: Any = range(n)
        pairs = list(zip(keys, lease_ids, strict=True))
    else:
        asked = [i for i, rid in enumerate(rids) if not rid]
        for i, rid in enumerate(rids):
            if rid:
                outcomes[i] = {"status": "repeat", "id": rid}
        pairs = [(keys[i], lease_ids[i]) for i in asked]
    # One call into C for the group (shm/_complete.c), peek item by item.
    peeks = leases.peek_many(pairs)
    firsts = list(map(_first, peeks))
    if Outcome.LATE in firsts:
        peeks = _pin_late(leases, pairs, peeks)
        firsts = list(map(_first, peeks))
    if (
        rids is None
        and _taken(firsts)
        and len(set(pairs)) == n
        and inflight.keys().isdisjoint(pairs)
    ):
        rows = store.jobs_of(keys)
        found = list(map(rows.get, keys))
        leases_of = list(map(_second, peeks))
        cadences = list(map(_cadence, leases_of))
        # Every row there with a job name, every lease with its cadence.
        if all(found) and all(cadences) and not not_jobs(set(map(_first, found))):
            inflight.update(zip(pairs, zip(repeat(batch), range(n)), strict=True))
            batch.items += zip(keys, lease_ids, map(_result, items), map(_encoding, items),
                               map(_first, found), map(_version, leases_of),
                               map(float, cadences), strict=True)  # fmt: skip
            return outcomes, list(range(n)), batch, []
    peeked = []
    for i, (outcome, lease) in zip(asked, peeks, strict=True):
        status = refused(outcome)
        if status is None:
            peeked.append((i, lease))
        else:
            outcomes[i] = {"status": status}
    rows = store.jobs_of([keys[i] for i, _ in peeked]) if peeked else {}
    taken, accepted = batch.items, []
    dups: list[tuple[int, tuple[Batch, int]]] = []
    for i, lease in peeked:
        key, lease_id = keys[i], lease_ids[i]
        first = inflight.get((key, lease_id))
        if first is not None:
            dups.append((i, first))
            continue
        inflight[(key, lease_id)] = (batch, len(taken))
        job, cadence_s = job_and_cadence(rows.get(key), lease.cadence_s, config)
        item = items[i]
        taken.append((key, lease_id, item["result"], item["encoding"], job, lease.version,
                      cadence_s))  # fmt: skip
        accepted.append(i)
    return outcomes, accepted, batch, dups


def _pin_late(leases: Any, pairs: list[tuple[str, int]], peeks: list) -> list:
    """Keep the keys of late results from being granted again while their
    group commit runs (``LATE_PIN_S``): the hold their miss left may end in
    between, and a claimer waiting on it would take the key (found by the
    partition campaign: a slow holder's result arriving just as its key's
    hold ended). An item whose slot changed since its peek is peeked again
    (granted meanwhile: refused as a conflict). The peeks, updated."""
    until = time.time() + LATE_PIN_S
    late = Outcome.LATE
    out = list(peeks)
    for i, ((key, lease_id), (outcome, _lease)) in enumerate(zip(pairs, peeks, strict=True)):
        if outcome is not late:
            continue
        try:
            pinned = leases.pin_late(key, lease_id, until)
        except NodeError:
            continue  # sealed: the lease's end after the write says what it finds
        if not pinned:
            out[i] = leases.peek(key, lease_id)
    return out


def _taken(outcomes: list) -> bool:
    """Every peek COMPLETED or LATE: counted by identity, in C (a set or a
    dict of them would call ``Enum.__hash__``, in Python, for each)."""
    return outcomes.count(Outcome.COMPLETED) + outcomes.count(Outcome.LATE) == len(outcomes)


def job_and_cadence(
    row: tuple[str, float | None, str] | None, lease_cadence_s: float, config: Config
) -> tuple[str, float]:
    """``row``: (job, cadence_s, route), as ``Store.jobs_of`` answers. A row
    gone, or given a job that is not a job name by another program during
    the lease (its result could never be acked), delivers to the default job."""
    from node.core.rows import DEFAULT_JOB

    if row is None:  # deleted (or unschedulable) while leased: the result is still kept
        return DEFAULT_JOB, lease_cadence_s or config.defaults.cadence_s
    job, row_cadence_s, route = row
    if not_jobs({job}):
        job = DEFAULT_JOB
    cadence_s = lease_cadence_s or row_cadence_s or config.route(route).cadence_s
    return job, float(cadence_s)
