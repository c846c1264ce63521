"""The completion store's interface, and the bookkeeping both backends share.

Two implementations sit behind ``CompletionStore``: ``segments`` (append-only
files, the default) and ``memory`` (the in-memory twin, for unit tests of the
ledger). Both derive from ``BufferedLog``, which owns everything that is not
storage: id assignment, the group-commit buffer, the pending index, the
per-segment accounting that decides compaction, and the lifetime counters.
A backend supplies five storage calls (``_commit``, ``_load``, ``_read``,
``_remove``, ``_close``). ``tests/test_completion.py`` holds the two together.

Rules every backend keeps (``docs/completion-log.md`` says why):

- A result is *durable* once ``flush()`` returned after appending it; only
  then is it pending (offerable) and counted. A crash loses the buffer, and
  nobody was told about it.
- ``ack`` and ``discard`` take effect in memory at once (a retired result is
  never offered again by this process) and become durable at the next flush;
  a crash before it re-offers them, which is at-least-once, never loss.
- Counters count records that are durable, so after ``flush()`` they equal
  what ``recover()`` rebuilds from the disk, exactly.
- Which lease each result answered stays on disk for ``keep_retired_s``
  after the result is retired (``retired_leases``): in its segment, or, once
  compaction removed that, in the segment's lease summary. The ledger answers
  a repeated completion from it after a restart (``docs/delivery.md``).
- Not thread-safe: the ledger process is the single writer, on one thread.
"""

from __future__ import annotations

import abc
import bisect
import json
import time
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import itemgetter, not_, rshift
from typing import Any, NamedTuple

from node.core.errors import NodeError, ValidationError

# -- tunables -------------------------------------------------------------------------

FSYNC_ALWAYS = "always"  # every call is its own commit: append/ack return durable
FSYNC_BATCH = "batch"  # group commit: one write + one fsync per flush()
FSYNC_NEVER = "never"  # write at flush, never fsync: survives kill -9, not power loss
FSYNC_POLICIES = (FSYNC_ALWAYS, FSYNC_BATCH, FSYNC_NEVER)
# Big enough that a segment holds ~60k results of 1 KiB (few files, few
# fsyncs of directories), small enough that one long-pending result pins
# little disk.
DEFAULT_SEGMENT_BYTES = 64 << 20
# A result is at most a request body (16 MiB, docs CONTRACT); anything above
# this in a length field is garbage, which recovery must tell from data.
MAX_RECORD_BYTES = 32 << 20
# ids per ACK/DISCARD record: keeps one record under ~1 MiB.
MAX_IDS_PER_RECORD = 100_000
# Recovery applies retire records in bulk once this many ids (or half the
# pending count) have piled up: bounds the memory they hold while each pass,
# which costs O(pending), stays amortised O(1) per id.
RETIRE_PASS_MIN_IDS = 65_536

ENCODING_BYTES = "bytes"
ENCODING_JSON = "json"
ENCODINGS = (ENCODING_BYTES, ENCODING_JSON)

# A result's place: segment number in the high bits, byte offset of its record
# in the low 40 (a segment may grow to 1 TiB). Never 0 (offset 0 is a header).
LOC_OFFSET_BITS = 40
LOC_OFFSET_MASK = (1 << LOC_OFFSET_BITS) - 1

RETIRE_ACK = "ack"
RETIRE_DISCARD = "discard"


# -- errors ---------------------------------------------------------------------------


class CompletionError(NodeError):
    """Base of the completion store's errors."""


class LogUnavailable(CompletionError):
    """The log cannot take writes now (full disk, I/O error). Nothing already
    durable is lost; the failed batch was not recorded. Retry later:
    ``/complete`` answers 503 ``log_unavailable``."""


class LogCorrupt(CompletionError):
    """The log holds something recovery must not guess about (a segment of
    an unknown format version, a header that does not parse in the middle of
    the log). Nothing was changed on disk."""


class LogLocked(CompletionError):
    """Another process holds the log directory: there is one writer."""


class LogStateError(CompletionError):
    """A call in the wrong state: before ``recover()`` or after ``close()``."""


class UnknownResult(CompletionError, KeyError):
    """No pending result has this id (never durable, or already retired)."""


# -- values ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    """One finished lease's result, as appended and as read back.

    ``data`` is what the handler returned: raw bytes (``encoding="bytes"``) or
    a JSON value encoded as UTF-8 JSON text (``encoding="json"``); build one
    with ``Result.of(value, ...)`` and get the value back with ``value()``.
    ``id`` is 0 until the log assigns one."""

    key: str
    job: str
    lease_id: int | str
    version: int  # the row's version when it was leased (write-back guard)
    finished_at: float  # wall time, stored
    cadence_s: float  # next due = finished_at + cadence_s
    data: bytes
    encoding: str = ENCODING_BYTES
    id: int = 0

    @classmethod
    def of(
        cls,
        value: Any,
        *,
        key: str,
        job: str,
        lease_id: int | str,
        version: int,
        finished_at: float,
        cadence_s: float,
    ) -> Result:
        if isinstance(value, bytes | bytearray | memoryview):
            data, encoding = bytes(value), ENCODING_BYTES
        else:
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
            data, encoding = text.encode(), ENCODING_JSON
        return cls(key, job, lease_id, version, finished_at, cadence_s, data, encoding)

    def value(self) -> Any:
        return json.loads(self.data) if self.encoding == ENCODING_JSON else self.data


# (result id, lease id, key): what a result's lease evidence is.
LeaseEntry = tuple[int, int | str, str]


class RetiredLease(NamedTuple):
    """A retired result as ``retired_leases`` gives it back: which lease it
    answered, for which key, and (at the latest) when it was retired."""

    id: int
    lease_id: int | str
    key: str
    retired_at: float


class Pending(NamedTuple):
    """A durable, unretired result as the index holds it: no payload, no
    lease. ``read_result(id)`` reads the rest back from the log."""

    id: int
    job: str
    key: str
    finished_at: float
    segment: int
    offset: int


@dataclass(frozen=True, slots=True)
class Counters:
    """Lifetime counts. ``durable``, ``acked`` and ``discarded`` are rebuilt
    exactly by ``recover()`` (records, plus the checkpoint of compacted
    segments). ``appended`` restarts at ``durable`` (an append that never
    became durable left no evidence and was never promised to anyone);
    ``rejected`` (results of failed flushes) counts since this open only."""

    appended: int = 0
    durable: int = 0
    acked: int = 0
    discarded: int = 0
    rejected: int = 0

    @property
    def awaiting_ack(self) -> int:
        return self.durable - self.acked - self.discarded


@dataclass(frozen=True, slots=True)
class TailCut:
    """A torn tail cut off the last segment: bytes from ``offset`` to its end."""

    segment: int
    offset: int
    bytes: int
    records: int  # frames that started in the cut region (at least 1)
    reason: str


@dataclass(frozen=True, slots=True)
class CorruptSpan:
    """A bad record that is *not* a torn tail. ``skipped``: the frame chain
    went on after it, so only this record is lost; otherwise the rest of the
    segment (``bytes``) is unreadable. The file is left as it is."""

    segment: int
    offset: int
    bytes: int
    reason: str
    skipped: bool


@dataclass(slots=True)
class RecoveryReport:
    segments: int = 0
    records: int = 0
    results: int = 0  # RESULT records read from the segments now on disk
    pending: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    next_id: int = 1
    cuts: list[TailCut] = field(default_factory=list)
    corrupt: list[CorruptSpan] = field(default_factory=list)
    # Segments recovery deleted: already compacted (a crash between the
    # checkpoint and the unlink), or created but torn before its first record.
    removed_segments: list[int] = field(default_factory=list)
    counters: Counters = field(default_factory=Counters)
    summaries: int = 0  # lease summaries of removed segments, still within keep_retired_s

    @property
    def exact(self) -> bool:
        """True when nothing durable was unreadable: counters are exact."""
        return not self.corrupt


@dataclass(frozen=True, slots=True)
class CompletionConfig:
    fsync: str = FSYNC_BATCH
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    # How long after a result is retired the log keeps the evidence of which
    # lease it answered (``retired_leases``): a removed segment leaves a lease
    # summary for that long. 0: none (the ledger sets its repeat window).
    keep_retired_s: float = 0.0

    def __post_init__(self) -> None:
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(
                f"fsync must be one of {', '.join(FSYNC_POLICIES)}, not {self.fsync!r}"
            )
        if self.segment_bytes < 4096:
            raise ValueError(f"segment_bytes must be at least 4096, not {self.segment_bytes}")
        if not 0 <= self.keep_retired_s < float("inf"):
            raise ValueError(f"keep_retired_s must be 0 or more, not {self.keep_retired_s}")


# -- the interface --------------------------------------------------------------------


class CompletionStore(abc.ABC):
    """The completion log as the ledger sees it."""

    config: CompletionConfig

    @abc.abstractmethod
    def recover(self) -> RecoveryReport:
        """Rebuild everything from what is durable (dropping any buffer); must
        be called once before anything else. Cuts a torn tail."""

    @abc.abstractmethod
    def append_results(self, results: Sequence[Result]) -> list[int]:
        """Assign ids and buffer the results; durable only after ``flush()``
        returns (at once under ``fsync="always"``)."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Write the buffer and fsync it per policy: one group commit. Raises
        ``LogUnavailable``: then every result buffered since the last flush is
        rejected (retire records stay buffered and are retried)."""

    @abc.abstractmethod
    def ack(self, ids: Iterable[int], now: float | None = None) -> int:
        """Retire pending results as delivered; returns how many were pending
        (idempotent: other ids count 0). ``now`` (wall time, default the
        clock's) is written in the record: when they were retired."""

    @abc.abstractmethod
    def discard(self, ids: Iterable[int], reason: str, now: float | None = None) -> int:
        """Retire pending results without delivery (retention, an operator);
        counted as discarded. Returns how many were pending."""

    @abc.abstractmethod
    def discard_expired(
        self, job: str, finished_before: float, reason: str = "retention", now: float | None = None
    ) -> int:
        """Discard the job's oldest pending results finished before the given
        time, in id order up to the first one that is not. Returns how many."""

    @abc.abstractmethod
    def expired(self, job: str, finished_before: float, limit: int | None = None) -> list[int]:
        """The ids ``discard_expired`` would discard (at most ``limit``),
        without discarding them: costs what it returns."""

    @abc.abstractmethod
    def pending(self, job: str | None = None, limit: int | None = None) -> list[Pending]:
        """Pending results in id order (of one job, or all); a snapshot."""

    @abc.abstractmethod
    def pending_count(self, job: str | None = None) -> int: ...

    @abc.abstractmethod
    def get_pending(self, result_id: int) -> Pending | None: ...

    @abc.abstractmethod
    def read_result(self, result_id: int) -> Result:
        """The pending result with its payload, read back from the log."""

    @abc.abstractmethod
    def compact(self, now: float | None = None) -> int:
        """Flush, then remove segments whose results are all retired (never the
        active one), leaving a lease summary of each one retired less than
        ``keep_retired_s`` before ``now``; drop the summaries older than that.
        Returns how many segments were removed."""

    @abc.abstractmethod
    def retired_leases(self, since: float) -> list[RetiredLease]:
        """The durable results retired at or after ``since`` (wall time),
        with the lease each answered, in id order (never one still pending)."""

    @abc.abstractmethod
    def counters(self) -> Counters: ...

    @abc.abstractmethod
    def close(self, flush: bool = True) -> None:
        """Flush what is buffered (unless ``flush`` is false: then the buffer
        is dropped, as a crash would) and release files. Idempotent."""

    def __enter__(self) -> CompletionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the pending index ----------------------------------------------------------------

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
        n, locs = len(self.ids), self.locs
        while self.head < n and not locs[self.head]:
            self.head += 1
            self.dead -= 1
        if self.dead > max(_SETTLE_MIN, self.live) or self.head > max(_SETTLE_MIN, n // 2):
            keep = [i for i in range(self.head, n) if locs[i]]
            self.ids = array("Q", [self.ids[i] for i in keep])
            self.fins = array("d", [self.fins[i] for i in keep])
            self.keys = [self.keys[i] for i in keep]
            self.locs = array("Q", [locs[i] for i in keep])
            self.head = self.dead = 0
        return loc


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

    def _settle(self) -> None:
        n, codes = len(self._ids), self._codes
        while self._head < n and codes[self._head] == _DEAD:
            self._head += 1
            self._dead -= 1
        if self._dead > max(_SETTLE_MIN, len(self)) or self._head > max(_SETTLE_MIN, n // 2):
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


# -- per-segment accounting and the checkpoint ----------------------------------------


@dataclass(slots=True)
class SegmentStats:
    """What the log knows about one segment on disk."""

    number: int
    first_id: int
    results: int = 0  # RESULT records read or written here
    live: int = 0  # of those, not retired (in memory)
    acked: int = 0  # of those, retired by a durable ACK record (wherever it lies)
    discarded: int = 0  # of those, retired by a durable DISCARD record
    # Earlier segments whose results this segment's retire records retire:
    # while one of them is on disk, this segment's records are still evidence.
    refs: set[int] = field(default_factory=set)
    damaged: bool = False  # recovery could not read all of it: kept for an operator
    # The latest retirement of any of its results (wall time; 0: none). One
    # time for the whole segment: what the lease evidence is kept by.
    retired_at: float = 0.0


@dataclass(slots=True)
class Checkpoint:
    """Lifetime counts of segments removed by compaction (their records are
    gone, so they cannot be recounted), which segments those were (so a
    crash between writing this and unlinking them cannot count them twice),
    and floors for the next id and segment number."""

    results: int = 0
    acked: int = 0
    discarded: int = 0
    removed: list[list[int]] = field(default_factory=list)  # [first, last] segment ranges
    next_id: int = 1
    next_segment: int = 1

    def covers(self, segment: int) -> bool:
        return any(lo <= segment <= hi for lo, hi in self.removed)

    def with_removed(
        self, stats: Sequence[SegmentStats], next_id: int, next_segment: int
    ) -> Checkpoint:
        ranges = sorted([list(r) for r in self.removed] + [[s.number, s.number] for s in stats])
        merged: list[list[int]] = []
        for lo, hi in ranges:
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return Checkpoint(
            results=self.results + sum(s.results for s in stats),
            acked=self.acked + sum(s.acked for s in stats),
            discarded=self.discarded + sum(s.discarded for s in stats),
            removed=merged,
            next_id=max(self.next_id, next_id),
            next_segment=max(self.next_segment, next_segment),
        )

    def to_dict(self) -> dict:
        return {
            "results": self.results,
            "acked": self.acked,
            "discarded": self.discarded,
            "removed": self.removed,
            "next_id": self.next_id,
            "next_segment": self.next_segment,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Checkpoint:
        return cls(
            results=int(d["results"]),
            acked=int(d["acked"]),
            discarded=int(d["discarded"]),
            removed=[[int(lo), int(hi)] for lo, hi in d["removed"]],
            next_id=int(d["next_id"]),
            next_segment=int(d["next_segment"]),
        )


# -- what both backends share ---------------------------------------------------------


class _Retire:
    """A buffered ACK or DISCARD: already applied to the index, not yet durable.
    ``by_segment`` counts the retired results per segment they live in; ``at``
    is when (wall time; None writes a record without it, as format 2 did)."""

    __slots__ = ("kind", "ids", "reason", "by_segment", "at")

    def __init__(
        self,
        kind: str,
        ids: list[int],
        reason: str,
        by_segment: dict[int, int],
        at: float | None = None,
    ) -> None:
        self.kind = kind
        self.ids = ids
        self.reason = reason
        self.by_segment = by_segment
        self.at = at


def _check_result(r: Result) -> None:
    """Refuse at append what could not be encoded at flush (a bad result
    would otherwise fail every later flush of the buffer it sits in)."""
    if not (
        isinstance(r.key, str)
        and isinstance(r.job, str)
        and isinstance(r.lease_id, (int, str))  # noqa: UP038 - a tuple is 3x faster here
        and isinstance(r.version, int)
        and isinstance(r.finished_at, (float, int))  # noqa: UP038
        and isinstance(r.cadence_s, (float, int))  # noqa: UP038
        and isinstance(r.data, bytes)
        and r.encoding in ENCODINGS
    ):
        raise ValidationError(
            "bad_result",
            "a result needs str key and job, int or str lease_id, int version, numeric "
            f"finished_at and cadence_s, bytes data and an encoding in {ENCODINGS}: {r!r:.200}",
            "result",
        )
    if len(r.data) + len(r.key) + len(r.job) + 256 > MAX_RECORD_BYTES:
        raise ValidationError(
            "result_too_large", f"a result is at most {MAX_RECORD_BYTES} bytes", "result"
        )


class BufferedLog(CompletionStore):
    """Everything but storage. Subclasses implement:

    - ``_commit(results, retires, first_id) -> (segment, offsets)``: make the
      (id, result) pairs and retire records durable per policy, all in one
      segment (rolling over first if they do not fit); offsets of the results
      in order. On failure raise ``LogUnavailable`` with nothing of the batch
      left to be recovered.
    - ``_load(report)``: rebuild ``_index``, ``_segments``, ``_checkpoint``
      from storage (retire records via ``_loaded_retire``).
    - ``_read(result_id, segment, offset) -> Result``.
    - ``_remove(segments, checkpoint)``: make the checkpoint durable, then
      delete the segments.
    - ``_results_of(segment) -> [(id, lease_id, key)]``: every durable RESULT
      record of a segment on disk, read back (the retired ones too).
    - ``_keep(summaries)``: make lease summaries ``(segment, retired_at,
      entries)`` durable (before the checkpoint that removes the segments);
      ``_kept_entries(segment)`` reads one back, ``_drop_kept(segments)``
      deletes them. ``_load`` fills ``_kept`` (segment -> retired_at) with the
      summaries of segments the checkpoint covers.
    - ``_close()``.
    """

    def __init__(self, config: CompletionConfig | None = None) -> None:
        self.config = config or CompletionConfig()
        self._recovered = False
        self._closed = False
        self._reset()

    def _reset(self) -> None:
        self._index = PendingIndex()
        self._segments: dict[int, SegmentStats] = {}
        self._checkpoint = Checkpoint()
        self._active = 0  # the segment appends go to (0: none yet)
        self._next_id = 1
        self._buffered: list[tuple[int, Result]] = []  # (id, result)
        self._retires: list[_Retire] = []
        self._appended = 0
        self._durable = 0
        self._acked = 0
        self._discarded = 0
        self._rejected = 0
        self._loaded_retires: list[tuple[str, Sequence[int], int, float | None]] = []
        self._loaded_retire_ids = 0
        # Lease summaries of removed segments: segment -> its retired_at.
        self._kept: dict[int, float] = {}
        # A retire record without a time (format 1 or 2) counts as retired now.
        self._loaded_at = time.time()

    # -- storage hooks --------------------------------------------------------------

    @abc.abstractmethod
    def _commit(
        self, results: list[tuple[int, Result]], retires: list[_Retire], first_id: int
    ) -> tuple[int, list[int]]: ...

    @abc.abstractmethod
    def _load(self, report: RecoveryReport) -> None: ...

    @abc.abstractmethod
    def _read(self, result_id: int, segment: int, offset: int) -> Result: ...

    @abc.abstractmethod
    def _remove(self, segments: list[int], checkpoint: Checkpoint) -> None: ...

    @abc.abstractmethod
    def _results_of(self, segment: int) -> Iterable[LeaseEntry]: ...

    @abc.abstractmethod
    def _keep(self, summaries: list[tuple[int, float, list[LeaseEntry]]]) -> None: ...

    @abc.abstractmethod
    def _kept_entries(self, segment: int) -> list[LeaseEntry]: ...

    @abc.abstractmethod
    def _drop_kept(self, segments: list[int]) -> None: ...

    @abc.abstractmethod
    def _close(self) -> None: ...

    # -- recovery -------------------------------------------------------------------

    def _add_segment(self, number: int, first_id: int) -> SegmentStats:
        """Register a segment (created by a commit, or found by recovery); the
        newest one is where appends go."""
        stats = self._segments[number] = SegmentStats(number, first_id)
        self._active = max(self._active, number)
        return stats

    def _loaded_retire(
        self, kind: str, ids: Sequence[int], segment: int, at: float | None = None
    ) -> None:
        """Note a durable retire record found in ``segment`` (``at``: when,
        None in a record of format 1 or 2). Applied in bulk by
        ``_apply_loaded_retires`` (a record only ever retires results written
        before it, so applying later changes nothing)."""
        self._loaded_retires.append((kind, ids, segment, at))
        self._loaded_retire_ids += len(ids)

    def _apply_loaded_retires(self, force: bool) -> None:
        """Apply the noted retire records. Called after each segment, so the
        ids held meanwhile stay under one segment's worth or half the pending
        count (each pass costs O(pending): amortised O(1) per id)."""
        if not self._loaded_retires:
            return
        pending = self._loaded_count()
        if not force and self._loaded_retire_ids < max(RETIRE_PASS_MIN_IDS, pending // 2):
            return
        any_discard = any(kind == RETIRE_DISCARD for kind, _, _, _ in self._loaded_retires)
        if any_discard:
            retired: dict[int, bool] = {}
            for kind, ids, _, _ in reversed(self._loaded_retires):  # the first retirement wins
                retired.update(dict.fromkeys(ids, kind == RETIRE_DISCARD))
        else:  # acks only, the common case: one dict, no copies
            every_id = chain.from_iterable(ids for _, ids, _, _ in self._loaded_retires)
            retired = dict.fromkeys(every_id, False)
        records, self._loaded_retires, self._loaded_retire_ids = self._loaded_retires, [], 0
        stats = self._segments
        for (number, is_discard), n in self._retire_loaded(retired, any_discard).items():
            target = stats[number]
            target.live -= n
            if is_discard:
                target.discarded += n
            else:
                target.acked += n
        # Which segments a record's ids live in, from the id ranges of the
        # segments: per record, not per id. May name a segment none of its ids
        # were pending in, which only keeps the record's segment a little
        # longer (refs delay compaction, never hasten it), and that segment's
        # lease evidence (retired_at: kept longer, never shorter).
        numbers = sorted(stats)
        first_ids = [stats[n].first_id for n in numbers]
        for _, ids, by, at in records:
            if not ids:
                continue
            when = self._loaded_at if at is None else at
            lo, hi = min(ids), max(ids)
            i = max(0, bisect.bisect_right(first_ids, lo) - 1)
            while i < len(numbers) and first_ids[i] <= hi:
                target = stats[numbers[i]]
                if when > target.retired_at:
                    target.retired_at = when
                if numbers[i] != by:
                    stats[by].refs.add(numbers[i])
                i += 1

    def _loaded_count(self) -> int:
        """Results loaded so far and not retired (the pass rule's "pending")."""
        return len(self._index)

    def _retire_loaded(self, retired: dict[int, bool], any_discard: bool) -> Counter:
        """Retire ``retired`` from what has been loaded: the index, and
        whatever a backend holds back from it until its load ends."""
        return self._index.retire_bulk(retired, any_discard)

    def recover(self) -> RecoveryReport:
        if self._closed:
            raise LogStateError("the completion store is closed")
        t0 = time.perf_counter()
        self._reset()
        report = RecoveryReport()
        self._load(report)
        self._apply_loaded_retires(force=True)
        ck = self._checkpoint
        self._durable = ck.results + sum(s.results for s in self._segments.values())
        self._acked = ck.acked + sum(s.acked for s in self._segments.values())
        self._discarded = ck.discarded + sum(s.discarded for s in self._segments.values())
        self._appended = self._durable
        self._next_id = max(
            self._next_id,
            ck.next_id,
            self._index.last_id + 1,
            *(s.first_id for s in self._segments.values()),
        )
        self._recovered = True
        self._drop_expired_kept(self._loaded_at)
        report.summaries = len(self._kept)
        report.pending = len(self._index)
        report.next_id = self._next_id
        report.counters = self.counters()
        report.seconds = time.perf_counter() - t0
        return report

    # -- writes ---------------------------------------------------------------------

    def _check(self) -> None:
        if self._closed:
            raise LogStateError("the completion store is closed")
        if not self._recovered:
            raise LogStateError("call recover() before using the completion store")

    def append_results(self, results: Sequence[Result]) -> list[int]:
        self._check()
        for r in results:
            _check_result(r)  # all of them first: a batch is taken whole or not at all
        first = self._next_id
        ids = list(range(first, first + len(results)))
        self._next_id += len(results)
        self._buffered.extend(zip(ids, results, strict=True))
        self._appended += len(ids)
        if self.config.fsync == FSYNC_ALWAYS:
            self.flush()
        return ids

    def flush(self) -> None:
        self._check()
        results, retires = self._buffered, self._retires
        if not results and not retires:
            return
        first_id = results[0][0] if results else self._next_id
        try:
            segment, offsets = self._commit(results, retires, first_id)
        except LogUnavailable:
            # The results' callers hear 503 and retry with a new append; the
            # retirements are already in effect here, so they must still land.
            self._rejected += len(results)
            self._buffered = []
            raise
        self._buffered, self._retires = [], []
        seg = self._segments[segment]
        add, base = self._index.add, segment << LOC_OFFSET_BITS
        for (rid, r), off in zip(results, offsets, strict=True):
            add(rid, r.job, r.key, r.finished_at, base | off)
        seg.results += len(results)
        seg.live += len(results)
        self._durable += len(results)
        for rt in retires:
            for number, n in rt.by_segment.items():
                target = self._segments[number]
                if rt.kind == RETIRE_ACK:
                    target.acked += n
                else:
                    target.discarded += n
                if number != segment:
                    seg.refs.add(number)
            if rt.kind == RETIRE_ACK:
                self._acked += len(rt.ids)
            else:
                self._discarded += len(rt.ids)

    def _retire(self, kind: str, ids: Iterable[int], reason: str, now: float | None) -> int:
        self._check()
        at = time.time() if now is None else float(now)
        done: list[int] = []
        by_segment: dict[int, int] = {}
        remove = self._index.remove
        for rid in ids:
            loc = remove(int(rid))
            if loc:
                done.append(int(rid))
                number = loc >> LOC_OFFSET_BITS
                by_segment[number] = by_segment.get(number, 0) + 1
                self._segments[number].live -= 1
        if done:
            for number in by_segment:
                seg = self._segments[number]
                if at > seg.retired_at:
                    seg.retired_at = at
            self._retires.append(_Retire(kind, done, reason, by_segment, at))
            if self.config.fsync == FSYNC_ALWAYS:
                self.flush()
        return len(done)

    def ack(self, ids: Iterable[int], now: float | None = None) -> int:
        return self._retire(RETIRE_ACK, ids, "", now)

    def discard(self, ids: Iterable[int], reason: str, now: float | None = None) -> int:
        return self._retire(RETIRE_DISCARD, ids, reason, now)

    def discard_expired(
        self, job: str, finished_before: float, reason: str = "retention", now: float | None = None
    ) -> int:
        self._check()
        expired = self._index.older_than(job, finished_before)
        return self._retire(RETIRE_DISCARD, expired, reason, now)

    def expired(self, job: str, finished_before: float, limit: int | None = None) -> list[int]:
        self._check()
        return self._index.older_than(job, finished_before, limit)

    # -- reads ----------------------------------------------------------------------

    def pending(self, job: str | None = None, limit: int | None = None) -> list[Pending]:
        self._check()
        return self._index.entries(job, limit)

    def pending_count(self, job: str | None = None) -> int:
        self._check()
        return self._index.count(job)

    def get_pending(self, result_id: int) -> Pending | None:
        self._check()
        return self._index.get(result_id)

    def read_result(self, result_id: int) -> Result:
        self._check()
        p = self._index.get(result_id)
        if p is None:
            raise UnknownResult(result_id)
        return self._read(result_id, p.segment, p.offset)

    def counters(self) -> Counters:
        return Counters(self._appended, self._durable, self._acked, self._discarded, self._rejected)

    @property
    def buffered(self) -> int:
        """Results appended and not yet flushed."""
        return len(self._buffered)

    # -- compaction -----------------------------------------------------------------

    def removable_segments(self) -> list[int]:
        """Segments compaction may remove now: every result retired, not the
        active one, not damaged, and every segment their retire records point
        at already gone or going with them."""
        going: set[int] = set()
        for number in sorted(self._segments):
            s = self._segments[number]
            if number == self._active or s.damaged or s.live:
                continue
            if all(r in going or r not in self._segments for r in s.refs):
                going.add(number)
        return sorted(going)

    def compact(self, now: float | None = None) -> int:
        self.flush()
        now = time.time() if now is None else now
        numbers = self.removable_segments()
        if numbers:
            stats = [self._segments[n] for n in numbers]
            # The lease evidence of results retired less than keep_retired_s
            # ago outlives their segment: its summary is durable before the
            # checkpoint that removes the segment (a crash between the two
            # leaves both; recovery drops the summary of a segment still live).
            keep = self.config.keep_retired_s
            kept = {s.number: s.retired_at for s in stats if keep and s.retired_at + keep > now}
            if kept:
                self._keep([(n, at, list(self._results_of(n))) for n, at in kept.items()])
            checkpoint = self._checkpoint.with_removed(stats, self._next_id, self._active + 1)
            self._remove(numbers, checkpoint)
            self._checkpoint = checkpoint
            for n in numbers:
                del self._segments[n]
            self._kept.update(kept)
        self._drop_expired_kept(now)
        return len(numbers)

    def expired_summaries(self, now: float) -> list[int]:
        """The lease summaries whose results were all retired at least
        ``keep_retired_s`` before ``now``: ``compact`` drops them."""
        keep = self.config.keep_retired_s
        return [n for n, at in self._kept.items() if at + keep <= now]

    def _drop_expired_kept(self, now: float) -> None:
        gone = self.expired_summaries(now)
        if gone:
            self._drop_kept(gone)
            for n in gone:
                del self._kept[n]

    def retired_leases(self, since: float) -> list[RetiredLease]:
        """From the segments on disk whose latest retirement is at or after
        ``since``, and from the summaries of removed ones. The time is the
        segment's latest retirement, so this may name results retired before
        ``since`` (never leave one out). Reads the records back: costs the
        results of those segments (the ledger calls it once, at start)."""
        self._check()
        out: list[RetiredLease] = []
        pending = self._index._slot
        for number in sorted(self._segments):
            s = self._segments[number]
            if s.retired_at < since or s.live >= s.results:
                continue
            at = s.retired_at
            out += [
                RetiredLease(rid, lease_id, key, at)
                for rid, lease_id, key in self._results_of(number)
                if pending(rid) < 0
            ]
        for number, at in self._kept.items():
            if at >= since:
                out += [RetiredLease(rid, lease_id, key, at)
                        for rid, lease_id, key in self._kept_entries(number)]  # fmt: skip
        out.sort(key=itemgetter(0))
        return out

    def close(self, flush: bool = True) -> None:
        if self._closed:
            return
        try:
            if flush and self._recovered:
                self.flush()
        finally:
            self._closed = True
            self._close()
