"""The pending index: durable results not yet retired, by id and by job.

What ``BufferedLog`` (``buffered.py``) offers from, retires from, and
rebuilds in recovery: id -> (job, key, finished_at, segment, offset), in
id order overall and per job, as arrays (payloads stay on disk).
"""

from __future__ import annotations

import bisect
from array import array
from collections import Counter
from itertools import compress, repeat
from operator import not_, rshift

from node.completion.base import Pending

# A result's place: segment number in the high bits, byte offset of its record
# in the low 40 (a segment may grow to 1 TiB). Never 0 (offset 0 is a header).
LOC_OFFSET_BITS = 40
LOC_OFFSET_MASK = (1 << LOC_OFFSET_BITS) - 1

_DEAD = 0xFFFFFFFF  # a job code that marks a retired slot in the global arrays
_SETTLE_MIN = 4096  # do not rebuild arrays for fewer dead slots than this


class _JobQueue:
    """One job's pending results, in id order, as parallel arrays.

    A retired slot keeps its place (``locs[i] == 0``) until the dead slots
    outnumber the live ones; then the arrays are rebuilt. Arrays, not a dict
    of tuples: about 45 bytes an entry against 345 (the key aside), and
    0.6 s less per million results to build in recovery
    (``docs/completion-log.md``)."""

    __slots__ = ("job", "code", "ids", "locs", "fins", "keys", "head", "dead")

    def __init__(self, job: str, code: int) -> None:
        self.job = job
        self.code = code
        self.ids = array("Q")
        self.locs = array("Q")
        self.fins = array("d")
        self.keys: list[str | None] = []
        self.head = 0  # slots before it are all dead
        self.dead = 0  # dead slots at or after head

    @property
    def live(self) -> int:
        return len(self.ids) - self.head - self.dead

    def find(self, rid: int) -> int:
        i = bisect.bisect_left(self.ids, rid, self.head)
        if i < len(self.ids) and self.ids[i] == rid and self.locs[i]:
            return i
        return -1

    def entry(self, i: int) -> Pending:
        loc = self.locs[i]
        return Pending(
            self.ids[i],
            self.job,
            self.keys[i],  # type: ignore[arg-type]
            self.fins[i],
            loc >> LOC_OFFSET_BITS,
            loc & LOC_OFFSET_MASK,
        )

    def kill(self, i: int) -> int:
        loc = self.locs[i]
        self.locs[i] = 0
        self.keys[i] = None
        self.dead += 1
        self.settle()
        return loc

    def settle(self) -> None:
        """Move the head past dead slots; rebuild once they outnumber the live."""
        n, locs = len(self.ids), self.locs
        while self.head < n and not locs[self.head]:
            self.head += 1
            self.dead -= 1
        if self.dead > max(_SETTLE_MIN, self.live) or self.head > max(_SETTLE_MIN, n // 2):
            if not self.dead:  # only the head to cut: slices
                h = self.head
                del self.ids[:h], self.fins[:h], self.keys[:h], self.locs[:h]
                self.head = 0
                return
            keep = [i for i in range(self.head, n) if locs[i]]
            self.ids = array("Q", [self.ids[i] for i in keep])
            self.fins = array("d", [self.fins[i] for i in keep])
            self.keys = [self.keys[i] for i in keep]
            self.locs = array("Q", [locs[i] for i in keep])
            self.head = self.dead = 0


class PendingIndex:
    """Durable, unretired results: id → (job, key, finished_at, segment,
    offset), in id order overall and per job. Memory is about 45 bytes plus
    the key per pending result; payloads stay on disk.

    Ids must be added in increasing order (the log assigns them so)."""

    def __init__(self) -> None:
        self.queues: dict[str, _JobQueue] = {}
        self._by_code: list[_JobQueue] = []
        self._ids = array("Q")  # every pending id, in order
        self._codes = array("I")  # its job's code, or _DEAD
        self._head = 0
        self._dead = 0
        self.last_id = 0  # the highest id ever added

    def __len__(self) -> int:
        return len(self._ids) - self._head - self._dead

    def queue(self, job: str) -> _JobQueue:
        q = self.queues.get(job)
        if q is None:
            q = self.queues[job] = _JobQueue(job, len(self._by_code))
            self._by_code.append(q)
        return q

    def add(self, rid: int, job: str, key: str, finished_at: float, loc: int) -> None:
        if rid <= self.last_id:
            raise ValueError(f"result id {rid} is not above {self.last_id}")
        q = self.queues.get(job) or self.queue(job)
        q.ids.append(rid)
        q.locs.append(loc)
        q.fins.append(finished_at)
        q.keys.append(key)
        self._ids.append(rid)
        self._codes.append(q.code)
        self.last_id = rid

    def add_many(
        self, rids: list[int], jobs: list[str], keys: list[str], fins: list[float], locs: list[int]
    ) -> None:
        """``add`` of a flushed group, ids increasing (the log assigns them
        so): one job's run is a few array extends, not a call an id."""
        if not rids:
            return
        if rids[0] <= self.last_id:
            raise ValueError(f"result id {rids[0]} is not above {self.last_id}")
        job = jobs[0]
        if jobs.count(job) != len(jobs):
            for args in zip(rids, jobs, keys, fins, locs, strict=True):
                self.add(*args)
            return
        q = self.queues.get(job) or self.queue(job)
        q.ids.extend(rids)
        q.locs.extend(locs)
        q.fins.extend(fins)
        q.keys.extend(keys)
        self._ids.extend(rids)
        self._codes.extend(repeat(q.code, len(rids)))
        self.last_id = rids[-1]

    def job_of(self, rid: int) -> str | None:
        """The job of a pending result (None when it is not pending)."""
        i = self._slot(rid)
        return None if i < 0 else self._by_code[self._codes[i]].job

    def loader(self, job: str) -> tuple:
        """Bound appends for bulk loading one job's results, for the recovery
        scan's hot loop: (ids, locs, fins, keys, all ids, all codes, code).
        Call them in the order of ``add``, with ids above ``last_id`` (the
        caller checks and then sets ``last_id``). Stale after ``remove()``."""
        q = self.queues.get(job) or self.queue(job)
        return (
            q.ids.append,
            q.locs.append,
            q.fins.append,
            q.keys.append,
            self._ids.append,
            self._codes.append,
            q.code,
        )

    def retire_bulk(self, retired: dict[int, bool], any_discard: bool) -> Counter:
        """Remove every pending id that is a key of ``retired`` (the value:
        True for a discard, False for an ack) in a few C-speed passes over the
        arrays: recovery meets ACK records by the thousand. Returns a Counter
        of (segment, is_discard) over the ids removed; ids that are not
        pending count nothing."""
        counts: Counter = Counter()
        if not retired or not len(self):
            return counts
        if self._head or self._dead or any(q.head or q.dead for q in self._by_code):
            for rid, is_discard in retired.items():  # after removals: the slow, general way
                loc = self.remove(rid)
                if loc:
                    counts[(loc >> LOC_OFFSET_BITS, is_discard)] += 1
            return counts
        hit_of = retired.__contains__
        for q in self._by_code:
            hit = list(map(hit_of, q.ids))
            if not any(hit):
                continue
            if any_discard:
                segments = map(rshift, compress(q.locs, hit), repeat(LOC_OFFSET_BITS))
                kinds = map(retired.__getitem__, compress(q.ids, hit))
                counts.update(zip(segments, kinds, strict=True))
            else:
                # locs grow with ids: each segment is one run of the queue.
                locs, a = q.locs, 0
                while a < len(locs):
                    number = locs[a] >> LOC_OFFSET_BITS
                    b = bisect.bisect_left(locs, (number + 1) << LOC_OFFSET_BITS, a)
                    n = hit[a:b].count(True)
                    if n:
                        counts[(number, False)] += n
                    a = b
            # Positions of the survivors first: then each array costs what
            # survives (often little), not what it held.
            keep = list(compress(range(len(hit)), map(not_, hit)))
            q.ids = array("Q", map(q.ids.__getitem__, keep))
            q.locs = array("Q", map(q.locs.__getitem__, keep))
            q.fins = array("d", map(q.fins.__getitem__, keep))
            q.keys = list(map(q.keys.__getitem__, keep))
        keep = list(compress(range(len(self._ids)), map(not_, map(hit_of, self._ids))))
        self._ids = array("Q", map(self._ids.__getitem__, keep))
        self._codes = array("I", map(self._codes.__getitem__, keep))
        return counts

    def _slot(self, rid: int) -> int:
        i = bisect.bisect_left(self._ids, rid, self._head)
        if i < len(self._ids) and self._ids[i] == rid and self._codes[i] != _DEAD:
            return i
        return -1

    def get(self, rid: int) -> Pending | None:
        i = self._slot(rid)
        if i < 0:
            return None
        q = self._by_code[self._codes[i]]
        return q.entry(q.find(rid))

    def remove(self, rid: int) -> int:
        """Retire ``rid``; returns its loc, or 0 when it was not pending."""
        i = self._slot(rid)
        if i < 0:
            return 0
        q = self._by_code[self._codes[i]]
        self._codes[i] = _DEAD
        self._dead += 1
        self._settle()
        return q.kill(q.find(rid))

    def remove_many(self, rids: list[int]) -> list[int]:
        """``remove`` of each id: their locs, in order (0: not pending).
        Acks come in id order from the head of a job's queue (its offers,
        oldest first): that run is cut off with a few slice compares and
        moves of the heads; any other id is found by bisects."""
        n = len(rids)
        if not n:
            return []
        head, q = self._head, None
        if n > 1 and not self._dead and self._ids[head : head + n] == array("Q", rids):
            codes = self._codes[head : head + n]
            if codes.count(codes[0]) == n:
                q = self._by_code[codes[0]]
        qh = 0 if q is None else q.head
        if q is not None and not q.dead and q.ids[qh : qh + n] == self._ids[head : head + n]:
            locs = q.locs[qh : qh + n].tolist()
            q.keys[qh : qh + n] = repeat(None, n)
            q.locs[qh : qh + n] = array("Q", bytes(8 * n))
            q.head += n
            q.settle()
            self._codes[head : head + n] = array("I", repeat(_DEAD, n))
            self._head += n
            self._settle()
            return locs
        out = []
        codes, by_code, slot = self._codes, self._by_code, self._slot
        touched = set()
        for rid in rids:
            i = slot(rid)
            if i < 0:
                out.append(0)
                continue
            q = by_code[codes[i]]
            codes[i] = _DEAD
            self._dead += 1
            j = q.find(rid)
            out.append(q.locs[j])
            q.locs[j] = 0
            q.keys[j] = None
            q.dead += 1
            touched.add(q)
        for q in touched:
            q.settle()
        self._settle()
        return out

    def _settle(self) -> None:
        n, codes = len(self._ids), self._codes
        while self._head < n and codes[self._head] == _DEAD:
            self._head += 1
            self._dead -= 1
        if self._dead > max(_SETTLE_MIN, len(self)) or self._head > max(_SETTLE_MIN, n // 2):
            if not self._dead:  # only the head to cut: slices
                del self._ids[: self._head], self._codes[: self._head]
                self._head = 0
                return
            keep = [i for i in range(self._head, n) if codes[i] != _DEAD]
            self._ids = array("Q", [self._ids[i] for i in keep])
            self._codes = array("I", [codes[i] for i in keep])
            self._head = self._dead = 0

    def count(self, job: str | None = None) -> int:
        if job is None:
            return len(self)
        q = self.queues.get(job)
        return q.live if q else 0

    def entries(self, job: str | None = None, limit: int | None = None) -> list[Pending]:
        want = len(self) if limit is None else max(0, limit)
        out: list[Pending] = []
        if job is not None:
            q = self.queues.get(job)
            if q is None:
                return out
            locs = q.locs
            for i in range(q.head, len(q.ids)):
                if len(out) >= want:
                    break
                if locs[i]:
                    out.append(q.entry(i))
            return out
        codes, by_code = self._codes, self._by_code
        for i in range(self._head, len(self._ids)):
            if len(out) >= want:
                break
            code = codes[i]
            if code != _DEAD:
                q = by_code[code]
                out.append(q.entry(q.find(self._ids[i])))
        return out

    def older_than(self, job: str, finished_before: float, limit: int | None = None) -> list[int]:
        """The job's pending ids from the oldest up to the first one finished
        at or after ``finished_before`` (at most ``limit``). Costs what it
        returns, plus retired slots not yet swept."""
        q = self.queues.get(job)
        out: list[int] = []
        if q is None:
            return out
        want = len(q.ids) if limit is None else max(0, limit)
        locs, fins, ids = q.locs, q.fins, q.ids
        for i in range(q.head, len(ids)):
            if len(out) >= want:
                break
            if not locs[i]:
                continue
            if fins[i] >= finished_before:
                break
            out.append(ids[i])
        return out
