"""``BufferedLog``: everything a completion store is but its storage.

It owns id assignment, the group-commit buffer, the pending index
(``pending.py``), the per-segment accounting that decides compaction, the
checkpoint of compacted segments, and the lifetime counters. A backend
(``segments``, ``memory``) supplies the storage calls listed on the class;
the rules both keep are in ``base.py``.
"""

from __future__ import annotations

import abc
import bisect
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future
from itertools import chain, compress, repeat
from operator import attrgetter, itemgetter, rshift

from node.completion.base import (
    FSYNC_ALWAYS,
    RETIRE_ACK,
    RETIRE_DISCARD,
    CompletionConfig,
    CompletionStore,
    Counters,
    LeaseEntry,
    LogStateError,
    LogUnavailable,
    Pending,
    RecoveryReport,
    Result,
    RetiredLease,
    UnknownResult,
    make_result,
)
from node.completion.checkpoint import Checkpoint, SegmentStats
from node.completion.pending import LOC_OFFSET_BITS, PendingIndex
from node.completion.result_checks import check_result, plain_results

# Recovery applies retire records in bulk once this many ids (or half the
# pending count) have piled up: bounds the memory they hold while each pass,
# which costs O(pending), stays amortised O(1) per id.
RETIRE_PASS_MIN_IDS = 65_536


_data_of, _job_of, _key_of = attrgetter("data"), attrgetter("job"), attrgetter("key")
_finished_at_of = attrgetter("finished_at")
_first, _second = itemgetter(0), itemgetter(1)


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


class FlushHandle:
    """A flush begun (``BufferedLog.flush_begin``): the batch written, its
    fsync running (``future``, on an executor) or still to run."""

    __slots__ = ("results", "retires", "segment", "offsets", "future", "ended", "error")

    def __init__(
        self,
        results: list[tuple[int, Result]],
        retires: list[_Retire],
        segment: int,
        offsets: list[int],
    ) -> None:
        self.results = results
        self.retires = retires
        self.segment = segment
        self.offsets = offsets
        self.future: Future[None] | None = None
        self.ended = False
        self.error: LogUnavailable | None = None


class BufferedLog(CompletionStore):
    """Everything but storage. Subclasses implement:

    - ``_write(results, retires, first_id) -> (segment, offsets)``: write the
      (id, result) pairs and retire records, all in one segment (rolling over
      first if they do not fit); offsets of the results in order. On failure
      raise ``LogUnavailable`` with nothing of the batch left to be recovered.
      A backend whose writes are durable at once stops there; one that syncs
      later also implements ``_sync_written`` (the fsync, on any thread) and
      ``_written(error)`` (count the batch durable, or put it back).
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
        # Called before a batch with retire records is written: what must be
        # durable before an ack is (the ledger syncs the schedule's write-backs).
        self.before_retires: Callable[[], None] | None = None
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
        self._open: FlushHandle | None = None  # a flush begun and not ended
        # Durable results still held in memory, oldest first (recent_bytes).
        self._recent: dict[int, Result] = {}
        self._recent_bytes = 0
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
    def _write(
        self, results: list[tuple[int, Result]], retires: list[_Retire], first_id: int
    ) -> tuple[int, list[int]]: ...

    def _sync_written(self) -> None:
        """The fsync of what ``_write`` wrote; may run on another thread
        (it touches no state of the log). Raises ``OSError``."""

    def _written(self, error: OSError | None) -> None:
        """After ``_sync_written``: count the written bytes durable, or (with
        the ``error`` it raised) put the file back and raise ``LogUnavailable``."""

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

    def raise_next_id(self, floor: int) -> int:
        self._check()
        self._next_id = max(self._next_id, floor)
        return self._next_id

    def append_results(self, results: Sequence[Result]) -> list[int]:
        self._check()
        if not plain_results(results):
            for r in results:
                check_result(r)  # all of them first: a batch is taken whole or not at all
        first = self._next_id
        ids = list(range(first, first + len(results)))
        self._next_id += len(results)
        self._buffered.extend(zip(ids, results, strict=True))
        self._appended += len(ids)
        if self.config.fsync == FSYNC_ALWAYS:
            self.flush()
        return ids

    def flush(self) -> None:
        handle = self.flush_begin()
        if handle is not None:
            self.flush_end(handle)

    def flush_begin(self, executor: Executor | None = None) -> FlushHandle | None:
        """The first half of ``flush``: write the buffer (no fsync yet) and
        return its handle, or None when nothing is buffered. With an
        ``executor``, the fsync runs there at once (``handle.future``); call
        ``flush_end(handle)`` when it is done (it blocks for it otherwise).
        Until then nothing of the batch counts as durable: no id is in the
        index, so none can be offered. Appends and acks made meanwhile buffer
        for the next flush, which ends this one first."""
        self._check()
        self._end_open()
        results, retires = self._buffered, self._retires
        if not results and not retires:
            return None
        first_id = results[0][0] if results else self._next_id
        self._buffered, self._retires = [], []
        try:
            if retires and self.before_retires is not None:
                try:
                    self.before_retires()
                except OSError as exc:
                    raise LogUnavailable(f"completion log: cannot retire yet: {exc}") from exc
            segment, offsets = self._write(results, retires, first_id)
        except LogUnavailable:
            self._failed_batch(results, retires)
            raise
        handle = FlushHandle(results, retires, segment, offsets)
        if executor is not None:
            handle.future = executor.submit(self._sync_written)
        self._open = handle
        return handle

    def flush_end(self, handle: FlushHandle) -> None:
        """The second half of ``flush``: wait for the handle's fsync (running
        it here if no executor took it), then count the batch durable and
        index its results. Raises ``LogUnavailable`` as ``flush`` does; a
        handle already ended (by a later ``flush``) answers as it ended."""
        if handle.ended:
            if handle.error is not None:
                raise handle.error
            return
        handle.ended = True
        self._open = None
        try:
            error: OSError | None = None
            if handle.future is None:
                try:
                    self._sync_written()
                except OSError as exc:
                    error = exc
            else:
                failed = handle.future.exception()
                if isinstance(failed, OSError):
                    error = failed
                elif failed is not None:
                    raise failed
            self._written(error)
        except LogUnavailable as exc:
            handle.error = exc
            self._failed_batch(handle.results, handle.retires)
            raise
        self._flushed(handle.results, handle.retires, handle.segment, handle.offsets)

    def _end_open(self) -> None:
        """End a begun flush before anything else is written (its error is
        its own caller's: kept on the handle)."""
        if self._open is not None:
            try:
                self.flush_end(self._open)
            except LogUnavailable:
                pass

    def _failed_batch(self, results: list[tuple[int, Result]], retires: list[_Retire]) -> None:
        # The results' callers hear 503 and retry with a new append; the
        # retirements are already in effect here, so they must still land.
        self._rejected += len(results)
        self._retires = retires + self._retires

    def _flushed(
        self,
        results: list[tuple[int, Result]],
        retires: list[_Retire],
        segment: int,
        offsets: list[int],
    ) -> None:
        seg = self._segments[segment]
        if results:
            rs = list(map(_second, results))
            self._index.add_many(
                list(map(_first, results)),
                list(map(_job_of, rs)),
                list(map(_key_of, rs)),
                list(map(_finished_at_of, rs)),
                list(map((segment << LOC_OFFSET_BITS).__or__, offsets)),
            )
        if self.config.recent_bytes:
            self._keep_recent(results)
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

    def _keep_recent(self, results: list[tuple[int, Result]]) -> None:
        recent = self._recent
        recent.update(results)
        self._recent_bytes += sum(map(len, map(_data_of, map(_second, results))))
        if self._recent_bytes > self.config.recent_bytes:
            limit = self.config.recent_bytes // 2  # evict in bulk, not one a flush
            for rid in list(recent):
                if self._recent_bytes <= limit:
                    break
                self._recent_bytes -= len(recent.pop(rid).data)

    def _forget_recent(self, ids: list[int]) -> None:
        if self._recent:  # in C: pop each, drop the misses, sum the data's lengths
            gone = filter(None, map(self._recent.pop, ids, repeat(None)))
            self._recent_bytes -= sum(map(len, map(_data_of, gone)))

    def _retire(self, kind: str, ids: Iterable[int], reason: str, now: float | None) -> int:
        self._check()
        at = time.time() if now is None else float(now)
        wanted = list(map(int, ids))
        locs = self._index.remove_many(wanted)
        done = list(compress(wanted, locs))
        by_segment: dict[int, int] = {}
        if done:
            # Each retired result's segment (loc >> LOC_OFFSET_BITS), counted in C.
            segments = map(rshift, filter(None, locs), repeat(LOC_OFFSET_BITS))
            for number, n in Counter(segments).items():
                by_segment[number] = n
                self._segments[number].live -= n
            self._forget_recent(done)
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

    def pending_job(self, result_id: int) -> str | None:
        """The job of a pending result; None when it is not pending."""
        self._check()
        return self._index.job_of(result_id)

    def recent_results(self, ids: list[int]) -> list[Result | None]:
        """For an offer: each id's result from the memory cache of recent
        ones (``recent_bytes``) as appended, so with id 0; None where it is
        not there (``read_result`` reads it from the log). Pending ids only."""
        self._check()
        return list(map(self._recent.get, ids))

    def read_result(self, result_id: int) -> Result:
        self._check()
        r = self._recent.get(result_id)
        if r is not None:  # durable and pending: it leaves here when retired
            if r.id == result_id:
                return r
            return make_result(r.key, r.job, r.lease_id, r.version, r.finished_at, r.cadence_s,
                               r.data, r.encoding, result_id)  # fmt: skip
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
            if self._open is not None and self._open.future is not None:
                self._open.future.exception()  # its fsync, on another thread, ends first
            self._close()
