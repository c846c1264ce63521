"""Job ready queues: which durable results to offer, and to whom, next.

Two phases (``docs/delivery.md``): ``poll`` *offers* results and starts each
offer's clock; ``ack`` retires offered results. An offer not acked within
``offer_timeout_s`` is offered again, to any poll of its job (or across
jobs), ahead of the job's newer results.

Only ids live here (the payloads stay in the completion log), and every
structure is sized by what a poll returns, not by the backlog (invariant 7):

- per job, the ready ids in id order: an ``array('Q')`` with a head index
  (8 bytes an id; ids arrive in increasing order, so it is a queue that
  ``bisect`` can search);
- per job, a heap of ``(deadline, id)`` for its offers, plus one dict
  ``id -> (job, deadline)`` of every offer (ack and re-offer in O(1)); an
  entry the heap still holds after its id was acked is skipped when it
  surfaces: each such entry is touched once, paid for by its ack;
- a ring of the jobs that have ready ids (round-robin for polls across
  jobs) and a heap of at most one wake-up per job for jobs whose only
  offerable results are offers coming due again.

``touched`` counts the entries a call examined; tests assert on it instead
of on wall time. Time is passed in (``now``, wall seconds). Not thread-safe:
the ledger owns one, on its event loop.

``RepeatIndex`` (below) is the other half of answering a caller twice: which
result answered each lease, so that a repeated completion gets its id back.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat
from operator import itemgetter

from node.core.errors import NodeError
from node.core.ids import shown_ids

# Below this many consumed slots the head of a ready array is not cut off
# (cutting costs a copy of what is left; amortised O(1) per id above it).
_COMPACT_MIN = 4096
_first = itemgetter(0)


class NeverOffered(NodeError):
    """An ack named ids this delivery never offered to that job; nothing in
    that ack was retired. HTTP 409 ``never_offered``."""

    def __init__(self, job: str, ids: list[int]) -> None:
        self.job = job
        self.ids = ids
        super().__init__(f"job {job!r}: ids never offered: {shown_ids(ids)}")


class _Job:
    __slots__ = ("name", "ready", "head", "offers", "n_offered", "latest")

    def __init__(self, name: str) -> None:
        self.name = name
        self.ready = array("Q")  # ready ids, increasing, from ``head`` on
        self.head = 0
        self.offers: list[tuple[float, int]] = []  # heap of (deadline, id)
        self.n_offered = 0
        self.latest = float("-inf")  # the latest deadline ever pushed

    @property
    def n_ready(self) -> int:
        return len(self.ready) - self.head

    def find_ready(self, rid: int) -> int:
        i = bisect.bisect_left(self.ready, rid, self.head)
        return i if i < len(self.ready) and self.ready[i] == rid else -1

    def drop_ready(self, i: int) -> None:
        if i == self.head:
            self.head += 1
            self._compact()
        else:
            del self.ready[i]  # rare (discards, recovered acks): one memmove

    def take_ready(self, n: int) -> list[int]:
        out = self.ready[self.head : self.head + n].tolist()
        self.head += len(out)
        self._compact()
        return out

    def _compact(self) -> None:
        if self.head >= _COMPACT_MIN and self.head * 2 >= len(self.ready):
            del self.ready[: self.head]
            self.head = 0


class Delivery:
    def __init__(self, offer_timeout_s: float = 30.0) -> None:
        if not offer_timeout_s > 0:
            raise ValueError(f"offer_timeout_s {offer_timeout_s} must be positive")
        self.offer_timeout_s = offer_timeout_s
        self._jobs: dict[str, _Job] = {}
        self._offers: dict[int, tuple[_Job, float]] = {}
        self._ring: OrderedDict[str, None] = OrderedDict()  # jobs with ready ids
        self._wakes: list[tuple[float, str]] = []  # heap: (deadline, job)
        self._wake_at: dict[str, float] = {}  # the job's entry in _wakes
        self._events: dict[str | None, asyncio.Event] = {}
        self._waiting: dict[str | None, int] = {}  # long polls waiting, per job
        self._max_id = 0
        self._offered_before = 0
        self.touched = 0
        # Ids this node's log can never hold (another fleet node's, or the
        # range skipped to its number's base: workers/ledger/fleet_number.py).
        self.never_given: Callable[[int], bool] = lambda _rid: False

    # -- filling ------------------------------------------------------------------

    def add(self, rid: int, job: str) -> None:
        """A result became durable (its lease ended): ready for ``job``.
        Adding an id this delivery already holds changes nothing."""
        if rid in self._offers:
            return
        q = self._jobs.get(job)
        if q is None:
            q = self._jobs[job] = _Job(job)
        if not q.n_ready or rid > q.ready[-1]:
            q.ready.append(rid)
        elif q.find_ready(rid) >= 0:
            return
        else:
            # Out of order (a lease that could only be ended after later
            # ones): rare, one memmove.
            q.ready.insert(bisect.bisect_left(q.ready, rid, q.head), rid)
        self._max_id = max(self._max_id, rid)
        self._ring[job] = None
        for name in (job, None):
            event = self._events.pop(name, None)
            if event is not None:
                event.set()

    def add_many(self, rids: list[int], job: str) -> None:
        """``add`` of each of ``rids`` for one job. Fresh ids (above every
        id held, increasing: a group just made durable) are one extend."""
        if not rids:
            return
        if rids[0] <= self._max_id or (len(rids) > 1 and rids != sorted(set(rids))):
            for rid in rids:
                self.add(rid, job)
            return
        q = self._jobs.get(job)
        if q is None:
            q = self._jobs[job] = _Job(job)
        q.ready.extend(rids)
        self._max_id = rids[-1]
        self._ring[job] = None
        for name in (job, None):
            event = self._events.pop(name, None)
            if event is not None:
                event.set()

    def assume_offered_through(self, rid: int) -> None:
        """Ids up to ``rid`` may have been offered by an earlier ledger
        process (they were recovered from the log): an ack of one of them is
        taken even if this process has not offered it yet. Also: ids up to
        it that this delivery does not hold were retired (a repeat ack of
        one counts 0)."""
        self._offered_before = max(self._offered_before, rid)
        self._max_id = max(self._max_id, rid)

    # -- offering -------------------------------------------------------------------

    def poll(self, job: str | None, max_n: int, now: float) -> list[int]:
        """Offer up to ``max_n`` results of ``job`` (None: across every job,
        round-robin over the jobs that have something offerable). Offers
        that came due again go first, then ready ids in id order."""
        if max_n <= 0:
            return []
        if job is not None:
            q = self._jobs.get(job)
            return [] if q is None else self._take(q, max_n, now)
        self._wake_due(now)
        out: list[int] = []
        while len(out) < max_n and self._ring:
            # One round: each job in the ring gets an equal share of what is left.
            for left in range(len(self._ring), 0, -1):
                if len(out) >= max_n or not self._ring:
                    break
                name, _ = self._ring.popitem(last=False)
                self.touched += 1
                q = self._jobs.get(name)
                if q is not None:
                    # _take puts the job back at the end if it has more to offer.
                    out += self._take(q, max(1, (max_n - len(out)) // left), now)
        return out

    def _take(self, q: _Job, n: int, now: float) -> list[int]:
        out = self._due_offers(q, n, now)
        if len(out) < n and q.n_ready:
            fresh = q.take_ready(n - len(out))
            self.touched += len(fresh)
            out += fresh
        older = self._next_offer(q)  # the earliest offer not taken now
        if q.n_ready or (older is not None and older <= now):
            self._ring[q.name] = None  # to the back: the next job's turn
        else:
            self._ring.pop(q.name, None)
        if not out:
            return out
        deadline = now + self.offer_timeout_s
        offers, heap = self._offers, q.offers
        q.n_offered += len(out) - sum(map(offers.__contains__, out))
        offers.update(zip(out, repeat((q, deadline))))
        if not heap or deadline > q.latest:
            # Later than every entry: appended in order, the heap stays one.
            heap += zip(repeat(deadline), sorted(out))
        else:
            for rid in out:
                heapq.heappush(heap, (deadline, rid))
        q.latest = max(q.latest, deadline)
        self._schedule_wake(q.name, deadline if older is None else min(older, deadline))
        return out

    def _schedule_wake(self, name: str, at: float) -> None:
        """Keep one wake-up per job at (or before) its earliest offer deadline."""
        if self._wake_at.get(name, float("inf")) > at:
            self._wake_at[name] = at
            heapq.heappush(self._wakes, (at, name))

    def _due_offers(self, q: _Job, n: int, now: float) -> list[int]:
        """Up to ``n`` of the job's offers whose deadline has passed, oldest first."""
        out: list[int] = []
        heap = q.offers
        while heap and len(out) < n and heap[0][0] <= now:
            deadline, rid = heapq.heappop(heap)
            self.touched += 1
            live = self._offers.get(rid)
            if live is not None and live[1] == deadline:
                out.append(rid)
        return out

    def _wake_due(self, now: float) -> None:
        """Put jobs whose offers came due again into the ring (polls across jobs)."""
        while self._wakes and self._wakes[0][0] <= now:
            at, name = heapq.heappop(self._wakes)
            self.touched += 1
            if self._wake_at.get(name) != at:
                continue  # superseded by an earlier wake-up, or the job is gone
            del self._wake_at[name]
            q = self._jobs.get(name)
            head = None if q is None else self._next_offer(q)
            if head is None:
                continue
            if head <= now:
                self._ring[name] = None
                self._ring.move_to_end(name, last=False)  # re-offers go first
            else:
                self._schedule_wake(name, head)

    def _next_offer(self, q: _Job) -> float | None:
        """The earliest live deadline of the job's offers (dropping acked ones)."""
        heap = q.offers
        while heap:
            deadline, rid = heap[0]
            live = self._offers.get(rid)
            if live is not None and live[1] == deadline:
                return deadline
            heapq.heappop(heap)
            self.touched += 1
        return None

    def next_deadline(self, job: str | None) -> float | None:
        """When an offer of ``job`` (None: of any job) next comes due again,
        for a long poll's wait; None when nothing is offered."""
        if job is not None:
            q = self._jobs.get(job)
            return None if q is None else self._next_offer(q)
        return self._wakes[0][0] if self._wakes else None

    def return_offers(self, rids: Iterable[int], now: float) -> None:
        """Offers that were taken but not sent (the reply was full): due again
        at once, ahead of newer results."""
        for rid in rids:
            live = self._offers.get(rid)
            if live is None:
                continue
            q = live[0]
            self._offers[rid] = (q, now)
            heapq.heappush(q.offers, (now, rid))
            q.latest = max(q.latest, now)
            self._ring[q.name] = None
            self._ring.move_to_end(q.name, last=False)

    # -- retiring -------------------------------------------------------------------

    def retire(
        self,
        job: str,
        rids: Iterable[int],
        now: float,
        owner: Callable[[int], str | None] | None = None,
        check_only: bool = False,
    ) -> list[int]:
        """Ack: retire offered ids of ``job``; the ids retired now. An id
        already retired counts nothing (idempotent). An id this delivery has
        not offered to ``job`` (ready and never offered, offered to another
        job, or above every id it has held) raises NeverOffered, and then
        nothing is retired. ``owner``: the job an id is pending for in the
        log (None: not pending), asked only of the ids not retired here; one
        pending for another job is named first.
        ``check_only``: the same verdict, nothing retired (a fleet's ack
        checks every node's ids before any is acked)."""
        q = self._jobs.get(job)
        distinct = dict.fromkeys(map(int, rids))
        self.touched += len(distinct)
        if not check_only and self._retire_offered(q, distinct):
            return list(distinct)
        todo, recovered = self._sort_out(job, q, distinct, owner)
        if check_only:
            return todo + recovered
        for rid in todo:
            del self._offers[rid]
        if q is not None:
            q.n_offered -= len(todo)
            for rid in recovered:
                q.drop_ready(q.find_ready(rid))
            self._forget_if_empty(q)
            self._drop_dead_offers(q)
        return todo + recovered

    def _sort_out(
        self,
        job: str,
        q: _Job | None,
        distinct: dict[int, None],
        owner: Callable[[int], str | None] | None,
    ) -> tuple[list[int], list[int]]:
        """``retire``'s verdict, id by id: (offered to ``job`` now, offered
        by an earlier process); raises NeverOffered naming every other id
        (those pending for another job first)."""
        todo: list[int] = []
        recovered: list[int] = []
        bad: list[int] = []
        other: list[int] = []
        offers = self._offers
        for rid in distinct:
            live = offers.get(rid)
            if live is not None and live[0] is q:
                todo.append(rid)
                continue
            if live is not None:
                bad.append(rid)
            elif q is not None and q.find_ready(rid) >= 0:
                (recovered if rid <= self._offered_before else bad).append(rid)
            elif rid > self._max_id or rid <= 0 or self.never_given(rid):
                bad.append(rid)
            if owner is not None and (o := owner(rid)) is not None and o != job:
                other.append(rid)
        if other or bad:  # every id named, those pending for another job first
            raise NeverOffered(job, list(dict.fromkeys(other + bad)))
        return todo, recovered

    def _retire_offered(self, q: _Job | None, rids: dict[int, None]) -> bool:
        """The usual ack: every id offered to this job and not yet acked.
        Told and retired with C loops (no Python step an id); False, and
        nothing changed, for any other (``retire`` goes id by id)."""
        if q is None:
            return False
        offers = self._offers
        lives: list = list(map(offers.get, rids))
        if not lives or None in lives or set(map(_first, lives)) != {q}:
            return False
        deque(map(offers.__delitem__, rids), 0)
        q.n_offered -= len(lives)
        self._forget_if_empty(q)
        self._drop_dead_offers(q)
        return True

    def _drop_dead_offers(self, q: _Job) -> None:
        """A job with no offer out holds only dead heap entries, each of
        which ``_next_offer`` would pop on its own: dropped at once, none
        examined (each was paid for by its ack)."""
        if not q.n_offered and q.offers:
            q.offers = []

    def ack(self, job: str, rids: Iterable[int], now: float) -> int:
        """``retire``, counted."""
        return len(self.retire(job, rids, now))

    def remove(self, rids: Iterable[int], job: str | None = None) -> int:
        """Discards (retention, an operator): drop ids whatever their phase;
        how many were held. Without ``job`` a ready id is looked for in every
        job (a bisect each)."""
        n = 0
        for rid in rids:
            rid = int(rid)
            live = self._offers.pop(rid, None)
            if live is not None:
                live[0].n_offered -= 1
                self._forget_if_empty(live[0])
                n += 1
                continue
            jobs = [self._jobs[job]] if job in self._jobs else []
            for q in jobs if job is not None else list(self._jobs.values()):
                i = q.find_ready(rid)
                if i >= 0:
                    # It stays in the ring: offers of its that came due again
                    # may be waiting there (their wake-up already spent); a
                    # poll that finds nothing to take drops it (``_take``).
                    q.drop_ready(i)
                    self._forget_if_empty(q)
                    n += 1
                    break
        return n

    def _forget_if_empty(self, q: _Job) -> None:
        if not q.n_ready and not q.n_offered:
            self._jobs.pop(q.name, None)
            self._ring.pop(q.name, None)
            # Its wake-up entry, if any, is skipped when it surfaces.

    # -- reading --------------------------------------------------------------------

    def pending(self, job: str | None = None) -> int:
        """Results not yet acked: ready plus offered."""
        if job is None:
            return sum(q.n_ready for q in self._jobs.values()) + len(self._offers)
        q = self._jobs.get(job)
        return 0 if q is None else q.n_ready + q.n_offered

    def offered(self, job: str | None = None) -> int:
        """Results offered and not yet acked (past their deadline included)."""
        if job is None:
            return len(self._offers)
        q = self._jobs.get(job)
        return 0 if q is None else q.n_offered

    def jobs(self) -> list[str]:
        """Jobs with results not yet acked."""
        return list(self._jobs)

    @contextlib.contextmanager
    def waiting(self, job: str | None) -> Iterator[asyncio.Event]:
        """For a long poll's wait: an event set when a result for ``job``
        (None: any job) is added (a fresh one after each add). Poll, and if
        nothing came back, wait on this (bounded by ``next_deadline``), then
        poll again. The job's entry lives while some poll waits on it: a
        caller polling made-up job names cannot grow the table."""
        event = self._events.get(job)
        if event is None:
            event = self._events[job] = asyncio.Event()
        self._waiting[job] = self._waiting.get(job, 0) + 1
        try:
            yield event
        finally:
            left = self._waiting[job] - 1
            if left:
                self._waiting[job] = left
            else:
                del self._waiting[job]
                self._events.pop(job, None)

    def waiters(self) -> tuple[int, int]:
        """(long polls waiting, jobs they wait on)."""
        return sum(self._waiting.values()), len(self._events)

    def wake_all(self) -> None:
        """Set every waiter (shutdown: long polls answer what they have)."""
        events, self._events = self._events, {}
        for event in events.values():
            event.set()


# -- repeats ----------------------------------------------------------------------

# Below this many dead slots (or consumed retirements) the repeat index's
# arrays are not rebuilt: a rebuild copies what is left, amortised O(1) above.
_REPEAT_COMPACT_MIN = 4096


class RepeatIndex:
    """Which result answered each lease: a repeat of an accepted completion
    is answered ``repeat`` with that result's id whatever the lease table's
    slot for the key holds by then (reused by other keys, or the key granted
    again). Consulted before the lease table, for every completion.

    It holds every accepted result until it is retired (acked or discarded)
    and for ``window_s`` after that; ``expire`` then drops it, costing what it
    drops (the sweep calls it). Layout, for memory (figure: docs/delivery.md):

    - ``_rid_of``: lease id -> result id, the lookup;
    - per result, in id order: parallel arrays of result ids and lease ids
      and a list of keys (None marks a dropped slot), from ``_head`` on;
      rebuilt when dropped slots outnumber live ones;
    - retirements in the order they came: when each may be dropped, and its
      result id, consumed from ``_next`` on.

    A lease with two results (the at-least-once windows of docs/delivery.md)
    answers with the later one. Time is passed in, wall seconds: the window
    counts across restarts (the ledger rebuilds the index from the log)."""

    def __init__(self, window_s: float) -> None:
        if not window_s >= 0:
            raise ValueError(f"window_s {window_s} must be 0 or more")
        self.window_s = window_s
        self._rid_of: dict[int, int] = {}
        self._ids = array("Q")
        self._leases = array("Q")
        self._keys: list[str | None] = []
        self._head = 0
        self._dead = 0  # dropped slots at or after _head
        self._until = array("d")  # when each retirement may be dropped
        self._retired = array("Q")  # ... and its result id
        self._next = 0

    def __len__(self) -> int:
        """Results held (accepted and not yet dropped)."""
        return len(self._ids) - self._head - self._dead

    def find(self, lease_id: int, key: str) -> int:
        """The id of the result that answered ``lease_id`` for ``key``; 0 when
        there is none here, or it answered another key."""
        rid = self._rid_of.get(lease_id)
        if rid is None:
            return 0
        i = self._slot(rid)
        return rid if i >= 0 and self._keys[i] == key else 0

    def find_many(self, lease_ids: list[int], keys: list[str]) -> list[int] | None:
        """``find`` of each (lease id, key); None when none is here (fresh
        completions: one dict lookup each, in C)."""
        rids = list(map(self._rid_of.get, lease_ids))
        if not any(rids):
            return None
        return [self.find(lease_id, key) if rid else 0
                for rid, lease_id, key in zip(rids, lease_ids, keys, strict=True)]  # fmt: skip

    def add_many(self, lease_ids: list[int], keys: list[str], rids: list[int]) -> None:
        """``add`` of each; ids above every id held, increasing (a group
        just made durable), are a few extends."""
        ids = self._ids
        if rids and (not len(ids) or rids[0] > ids[-1]) and rids == sorted(set(rids)):
            ids.extend(rids)
            self._leases.extend(lease_ids)
            self._keys.extend(keys)
            self._rid_of.update(zip(lease_ids, rids, strict=True))
            return
        for lease_id, key, rid in zip(lease_ids, keys, rids, strict=True):
            self.add(lease_id, key, rid)

    def add(self, lease_id: int, key: str, rid: int) -> None:
        """Result ``rid`` (durable) answered ``lease_id`` for ``key``. Ids come
        in increasing order (the log assigns them so); one out of order is
        placed by a bisect."""
        ids = self._ids
        if not len(ids) or rid > ids[-1]:
            ids.append(rid)
            self._leases.append(lease_id)
            self._keys.append(key)
        else:
            i = bisect.bisect_left(ids, rid, self._head)
            if i < len(ids) and ids[i] == rid:
                return
            ids.insert(i, rid)
            self._leases.insert(i, lease_id)
            self._keys.insert(i, key)
        self._rid_of[lease_id] = rid

    def retire(self, rids: Iterable[int], now: float) -> None:
        """Results acked or discarded at ``now``: dropped once ``window_s``
        has passed. An id not held here is skipped when its time comes."""
        before = len(self._retired)
        self._retired.extend(rids)
        self._until.extend(repeat(now + self.window_s, len(self._retired) - before))

    def expire(self, now: float) -> int:
        """Drop the results retired at least ``window_s`` before ``now``; how
        many. Retirements are consumed in the order they came, so a clock
        stepped back only delays the ones behind it."""
        until, retired, keys, leases = self._until, self._retired, self._keys, self._leases
        rid_of = self._rid_of
        i, n, dropped = self._next, len(until), 0
        k = bisect.bisect_right(until, now, i)
        head, m = self._head, k - i
        if (
            m > 1
            and (k == n or until[k] > now)
            and max(until[i:k]) <= now
            and not self._dead
            and self._ids[head : head + m] == retired[i:k]
        ):
            # The usual expiry: retired in the order they were added, so the
            # due ones are the live head. A lease a later result answered
            # keeps its entry (as below); the rest go in C.
            run = dict(zip(leases[head : head + m], retired[i:k], strict=True))
            if rid_of.items() >= run.items():
                deque(map(rid_of.__delitem__, run), 0)
            else:
                for lease_id, rid in run.items():
                    if rid_of.get(lease_id) == rid:
                        del rid_of[lease_id]
            keys[head : head + m] = repeat(None, m)
            self._head += m
            i, cut = k, m
        else:
            cut = 0
        while i < n and until[i] <= now:
            rid = retired[i]
            i += 1
            j = self._slot(rid)
            if j < 0:
                continue
            lease_id = leases[j]
            if rid_of.get(lease_id) == rid:
                del rid_of[lease_id]
            keys[j] = None
            dropped += 1
        self._next = i
        if i >= _REPEAT_COMPACT_MIN and i * 2 >= n:
            del until[:i], retired[:i]
            self._next = 0
        if dropped or cut:
            self._dead += dropped
            self._settle()
        return dropped + cut

    def _slot(self, rid: int) -> int:
        i = bisect.bisect_left(self._ids, rid, self._head)
        if i < len(self._ids) and self._ids[i] == rid and self._keys[i] is not None:
            return i
        return -1

    def _settle(self) -> None:
        keys, n = self._keys, len(self._ids)
        while self._head < n and keys[self._head] is None:
            self._head += 1
            self._dead -= 1
        floor = _REPEAT_COMPACT_MIN
        if self._dead > max(floor, len(self)) or self._head > max(floor, n // 2):
            if not self._dead:  # only the head to cut: slices
                h, self._head = self._head, 0
                del self._ids[:h], self._leases[:h], self._keys[:h]
                return
            keep = [i for i in range(self._head, n) if keys[i] is not None]
            self._ids = array("Q", map(self._ids.__getitem__, keep))
            self._leases = array("Q", map(self._leases.__getitem__, keep))
            self._keys = list(map(keys.__getitem__, keep))
            self._head = self._dead = 0
