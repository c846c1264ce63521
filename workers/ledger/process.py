# Over 650 lines: the ledger's completion path, which issue 16 (batching) rewrites and splits.
"""``python -m workers.ledger``: the ledger process, started by the supervisor.

The single writer of the completion log. It takes results over local IPC
(``node/ipc.py`` framing) on the abstract UNIX socket
``\\0queue-node.<name>.ledger``, makes them durable with group commit, then
writes back each row's next due time and ends its lease; it holds the job
ready queues (``workers/ledger/delivery.py``) and serves polls and acks; it runs the
lease expiry sweep; it answers for the lifetime counters
(``workers/ledger/accounting.py``). Ops and their order: ``docs/internals.md``, "the
work path"; what can be delivered or run twice: ``docs/delivery.md``.

One thread, one event loop. The completion store is not thread-safe, and a
flush blocks the loop on purpose: completions that arrive meanwhile wait in
the socket buffers and make up the next group, which is what group commit
needs. Signal handlers only set an event: the first SIGTERM stops accepting,
finishes what was taken, flushes and exits 0 with a one-line summary; a
second one exits at once (nothing durable is lost: replies follow the fsync).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import time
from collections import Counter, deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from operator import add, attrgetter, itemgetter
from pathlib import Path
from typing import Any

from node.core import log
from node.core.config import LOG_DIR, Config, load_run_config
from node.core.errors import NodeError
from node.core.names import ledger_address
from node.core.proc import RET_ERROR, RET_OK, child_signals, die_with_parent, set_title
from node.ipc import MAX_FRAME, IpcError, RemoteError, pack, peer_uid, read_frame
from node.store import WriteBack
from workers.ledger.acks import HeldAcks
from workers.ledger.fleet_number import FleetNumber
from workers.ledger.intake import Batch as _Batch
from workers.ledger.intake import Item as _Item
from workers.ledger.intake import check as _intake_check
from workers.ledger.requests import MAX_ITEMS, MAX_WAIT_S
from workers.ledger.requests import bad as _bad
from workers.ledger.requests import check_items as _check_items
from workers.ledger.requests import int_in as _int_in
from workers.ledger.requests import job_or_none as _job_or_none
from workers.ledger.requests import num_in as _num_in

# Expiry sweep, retries of write-backs and lease ends, accounting checkpoint.
SWEEP_INTERVAL_S = 0.1
# The schedule's WAL is checkpointed (on the checkpointer thread) once it
# holds this much: about 1,000 pages, SQLite's own default.
CHECKPOINT_WAL_BYTES = 4 << 20
# Job retention ([jobs.NAME] retention_s): how often the ledger discards the
# results that outlived it, and at most how many per job at a time (the rest
# go at the next sweep: a long backlog never stalls the loop).
RETENTION_INTERVAL_S = 1.0
RETENTION_MAX_PER_SWEEP = 50_000
RETENTION_REASON = "retention"
# How often the ledger reads the held and parked keys of the lease table to
# write the last_error of the leases released since (an expiry's is written
# by the sweep that makes it).
OUTCOME_SCAN_INTERVAL_S = 1.0
# How often the ledger looks for segments it can remove (a cheap check over
# the segments' counts; the removal itself only when there is one).
COMPACT_INTERVAL_S = 1.0
# /accounting's input side: the keeper's state document is read at most this
# often (it is rewritten every state_interval_s, 5 s, and 0.5 s after one whose
# input law did not close; decoding it costs a few milliseconds of the loop).
KEEPER_COUNTERS_REREAD_S = 1.0
# Test hooks only (QUEUE_NODE_TEST_HOOKS=1): a file whose content injects disk
# faults into the completion log (node/completion/faults.py).
ENV_LOG_FAULTS = "QUEUE_NODE_TEST_LOG_FAULTS"
# At most this many results per fsync (a request is never split).
GROUP_MAX_ITEMS = 1024
# The group commit's fsync runs on the loop's thread: a hop to the fsync
# thread and back costs more than the loop gains meanwhile (docs/performance.md,
# "Every process's CPU a completed item"). After an fsync slower than
# FSYNC_SLOW_S (a slow disk: far above a preempted one's), groups go to the
# fsync thread for FSYNC_SLOW_HOLD_S, so that polls, acks and new completions
# are answered while the disk works; then the loop tries again.
FSYNC_SLOW_S = 0.05
FSYNC_SLOW_HOLD_S = 1.0
# A poll's reply stops growing past this (frames are at most 32 MiB).
REPLY_BYTES = 24 << 20
# On SIGTERM, how long requests in flight get to finish.
STOP_GRACE_S = 5.0


_DATA, _KEY = attrgetter("data"), attrgetter("key")
_FIRST, _SECOND, _THIRD, _KEY_LEASE = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(0, 1)
# An intake item's job, version and cadence (workers/ledger/intake.py, Item).
_JOB, _VERSION, _CADENCE = itemgetter(4), itemgetter(5), itemgetter(6)
_new_tuple = tuple.__new__


def _make_results_py(items: list[_Item], now: float) -> list[Any]:
    """The Python reference of ``_records.c``'s ``make_results``: each
    accepted item's Result, finished at ``now``."""
    from node.completion.base import make_result

    return [
        make_result(key, job, lease_id, version, now, cadence_s, data, encoding)
        for key, lease_id, data, encoding, job, version, cadence_s in items
    ]


def _offer_dicts_py(ids: list[int], results: list[Any]) -> list[dict]:
    """The Python reference of ``_records.c``'s ``offer_dicts``."""
    return [{"id": rid, "key": r.key, "job": r.job, "result": r.data,
             "encoding": r.encoding, "finished_at": r.finished_at}
            for rid, r in zip(ids, results, strict=True)]  # fmt: skip


_make_results: Any
_offer_dicts: Any
try:  # built by setup.py, optional: the references above do the same
    from node.completion.base import Result as _Result
    from node.completion.segments._records import make_results as _make_results_c
    from node.completion.segments._records import offer_dicts as _offer_dicts

    _make_results = partial(_make_results_c, _Result)
except ImportError:  # pragma: no cover - a build without the extension
    _make_results = _make_results_py
    _offer_dicts = _offer_dicts_py
# A lease to end once its result's write-back is written: key, lease id,
# result id, job.
_End = tuple[str, int, int, str]


@dataclass
class _Stats:
    started_at: float = field(default_factory=time.time)
    statuses: dict[str, int] = field(default_factory=dict)
    groups: int = 0
    group_items_max: int = 0
    flush_s: float = 0.0
    flush_s_max: float = 0.0
    polls: int = 0
    offered: int = 0
    acks: int = 0
    acked: int = 0
    expired: int = 0
    discarded: int = 0  # by retention, since this process started
    segments_removed: int = 0  # by compaction, since this process started
    sweeps: int = 0
    writeback_skipped: int = 0  # the row moved on or is gone: the newer write wins
    writeback_failed: int = 0
    last_errors: int = 0  # rows whose last_error was written (a release, an expiry, a parking)
    last_errors_failed: int = 0
    superseded_after_durable: int = 0
    unreadable: int = 0
    recovery: dict[str, Any] = field(default_factory=dict)


class Ledger:
    """The ledger's state and ops. ``serve`` runs it; tests may drive the
    sync parts directly with the in-memory twins."""

    def __init__(self, config: Config, leases: Any, store: Any, completion: Any) -> None:
        from workers.ledger.accounting import AccountingFile
        from workers.ledger.delivery import Delivery, RepeatIndex

        self.config = config
        self.leases = leases
        self.store = store
        self.log = completion
        # An ack is durable only after the write-backs before it: a power loss
        # cannot leave a result acknowledged and its row due again, since the
        # write-back was written before the result was offered (a pending
        # result's write-back is done again at start, from the log). Acks wait
        # for the schedule's sync on the fsync thread (workers/ledger/acks.py);
        # other retires (retention's discards) sync it on the loop first.
        self.log.before_retires = self._sync_before_retires
        self._retire_gen = 0  # the write-backs the log's retires so far need synced
        self._loop: asyncio.AbstractEventLoop | None = None
        self.delivery = Delivery(config.offer_timeout_s)
        # config.repeat_window_s: the log keeps the evidence as long
        # (keep_retired_s), so a restart answers the same (docs/delivery.md).
        self.repeats = RepeatIndex(config.repeat_window_s)
        self.acct = AccountingFile.open(config.data_dir)
        self.stats = _Stats()
        # (key, lease id) -> the batch taking it and its place there.
        self._inflight: dict[tuple[str, int], tuple[_Batch, int]] = {}
        self._queue: list[_Batch] = []  # requests' accepted items, in arrival order
        self._waiters: list[asyncio.Future] = []  # settled by the next flush
        self._kick = asyncio.Event()
        self._stopping = asyncio.Event()
        # The group commit's fsync runs here, off the event loop's thread.
        self._fsync = ThreadPoolExecutor(1, thread_name_prefix="ledger-fsync")
        self.acks = HeldAcks(self.store.sync, self._fsync, self._kick_soon)
        self._fsync_slow_until = float("-inf")  # monotonic: the fsync thread until then
        # And the schedule's WAL checkpoints here (its commits run none).
        self._checkpointer = ThreadPoolExecutor(1, thread_name_prefix="ledger-checkpoint")
        self._checkpointing: Future | None = None
        self._unended: list[_End] = []
        # Write-backs the store refused to take (StoreError), retried every
        # sweep, each with the lease to end once it is written (None: none).
        self._writebacks: list[tuple[Any, _End | None]] = []
        self._checkpointed: dict[str, int] = {}
        # The misses whose last_error is written: key -> (lease id, misses)
        # of its held or parked slot. None until the first scan, which only
        # learns them (the process before wrote what it saw).
        self._missed: dict[str, tuple[int, int]] | None = None
        self._outcome_due = 0.0
        self._checkpoint_due = 0.0
        self._retention_due = 0.0
        self._compact_due = 0.0
        self._retention = {
            job: jc.retention_s for job, jc in config.jobs.items() if jc.retention_s is not None
        }
        # A fleet node's number: the high bits of its result ids.
        self.fleet = FleetNumber(config)
        self.delivery.never_given = self.fleet.never_given
        self._state: Any = None  # the keeper's state buffer, attached on first use
        self._keeper_counters: dict = {}  # the last counters read from it
        self._keeper_counters_read_at = float("-inf")
        self._connections: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()  # requests being answered, all connections
        self.accounting_at_stop: dict[str, Any] = {}

    # -- start: recovery ----------------------------------------------------------

    def recover(self, now: float) -> dict[str, Any]:
        """Rebuild from evidence: the log's segments, then the lease table.

        A pending result whose lease the table still shows live or ended
        without a result (COMPLETED / LATE from peek) was made durable by a
        ledger that died before ending its lease: end it now, after the
        write-back. Every pending result joins its job's ready queue, and
        the repeat index, with the results retired within ``repeat_window_s``."""
        from node.completion import CompletionError
        from shm.leases import Outcome

        report = self.log.recover()
        self.log.raise_next_id(self.fleet.first_id())
        restored = self.acct.restore(self.leases.counters(), now)
        if restored:
            log.warn("accounting_restored", added=restored, checkpoint_at=self.acct.checkpoint_at)
        fixed = 0
        answered: list[tuple[int, Any, str]] = []  # (id, lease id, key) for the repeat index
        # Every pending result's write-back is done again, from the log's
        # evidence: the version guard refuses those already done, and one a
        # failed store refused before the crash is written now.
        redo: list[tuple[Any, _End | None]] = []
        # Every pending result is read once (its lease id is not in the
        # index): about 10 µs each, 1 s per 100,000 pending (docs/delivery.md).
        readable: list[tuple[Any, Any]] = []  # (pending, result)
        for p in self.log.pending():
            try:
                result = self.log.read_result(p.id)
            except CompletionError as exc:  # offered, and reported unreadable then
                log.error("result_unreadable", id=p.id, error=str(exc))
                self.delivery.add(p.id, p.job)
                continue
            answered.append((p.id, result.lease_id, p.key))  # the log's index holds p.key
            readable.append((p, result))
        # Their leases, in one call into C a group (peek_many).
        peeks: list[Any] = []
        for i in range(0, len(readable), GROUP_MAX_ITEMS):
            peeks += self.leases.peek_many(
                [(r.key, int(r.lease_id)) for _, r in readable[i : i + GROUP_MAX_ITEMS]]
            )
        for (p, result), (outcome, _) in zip(readable, peeks, strict=True):
            wb = WriteBack(
                result.key,
                result.finished_at + result.cadence_s,
                result.version,
                p.id,
                result.finished_at,
            )
            if outcome in (Outcome.COMPLETED, Outcome.LATE):
                # Durable, its lease not ended: the ledger died between the
                # fsync and the lease's end, or while the store refused the
                # write-back. Written back, then ended and offered.
                redo.append((wb, (result.key, int(result.lease_id), p.id, p.job)))
                fixed += 1
                continue
            # Ended (or the table was lost with the host, or granted again
            # since): offered now; the write-back is repeated all the same.
            redo.append((wb, None))
            self.delivery.add(p.id, p.job)
        for i in range(0, len(redo), GROUP_MAX_ITEMS):
            self._write_backs(redo[i : i + GROUP_MAX_ITEMS], now)
        self.delivery.assume_offered_through(report.next_id - 1)
        self._load_repeats(answered, now)
        gap = 0
        if restored:
            # The events between the last checkpoint and the crash are lost
            # (docs/accounting.md): say by how much the law is off now.
            a = self.accounting()
            gap = a["routed"] - a["finished"] - a["expired"] - a["released"] - a["in_flight"]
            log.warn("accounting_gap", gap=gap, **{k: a[k] for k in ("routed", "finished")})
        if not report.exact:
            log.warn("accounting_not_exact", corrupt=len(report.corrupt))
        self.stats.recovery = {
            "segments": report.segments,
            "results": report.results,
            "pending": report.pending,
            "cuts": [dataclasses.asdict(c) for c in report.cuts],
            "corrupt": len(report.corrupt),
            "exact": report.exact,
            "seconds": round(report.seconds, 3),
            "leases_ended": fixed,
            "accounting_restored": restored or {},
            "accounting_gap": gap,
            "summaries": report.summaries,
            "repeats": len(self.repeats),
        }
        return self.stats.recovery

    def _load_repeats(self, pending: list[tuple[int, Any, str]], now: float) -> None:
        """The repeat index from evidence: the pending results (read above)
        and the results retired within the window, from the log's segments
        and the lease summaries of removed ones. A retired result counts as
        retired when its segment last was (never earlier than it was)."""
        retired = self.log.retired_leases(now - self.config.repeat_window_s)
        answered = pending + [(r.id, r.lease_id, r.key) for r in retired]
        answered.sort(key=itemgetter(0))
        add = self.repeats.add
        for rid, lease_id, key in answered:
            # Every lease id the ledger writes is one; a record from elsewhere
            # (a test, a tool) may hold anything, and answers no completion.
            if type(lease_id) is int and 0 < lease_id < 1 << 64:
                add(lease_id, key, rid)
        by_time: dict[float, list[int]] = {}
        for r in retired:
            by_time.setdefault(r.retired_at, []).append(r.id)
        for at in sorted(by_time):
            self.repeats.retire(by_time[at], at)

    # -- complete -----------------------------------------------------------------

    def check(self, items: list[dict]) -> tuple[list[dict | None], list[int], _Batch, list]:
        """Peek every item before anything is written (``intake.check``)."""
        return _intake_check(items, self.repeats, self.leases, self.store, self._inflight,
                             self.config)  # fmt: skip

    def commit_begin(
        self, items: list[_Item], now: float, executor: Executor | None = None
    ) -> tuple[list[int], Any, float] | None:
        """Append the group and write it (its fsync on ``executor`` when
        given): (ids, the flush's handle, when it began), or None when the
        log refused it (the caller answers every item)."""
        from node.completion import LogUnavailable

        results = _make_results(items, now)
        t0 = time.perf_counter()
        try:
            ids = self.log.append_results(results)
            handle = self.log.flush_begin(executor)
        except LogUnavailable as exc:
            log.warn("log_unavailable", results=len(items), error=str(exc))
            return None
        return ids, handle, t0

    def commit_end(self, items: list[_Item], now: float, ids: list[int], handle: Any,
                   t0: float) -> bool:  # fmt: skip
        """Once the group's fsync is done: count it durable, then write back
        each result's next due time, end its lease, offer it, all a group at
        a time. False when the log refused the group (nothing of it durable)."""
        from node.completion import LogUnavailable

        try:
            if handle is not None:
                inline, t_sync = handle.future is None, time.perf_counter()
                self.log.flush_end(handle)  # the fsync itself when inline
                if inline and time.perf_counter() - t_sync > FSYNC_SLOW_S:
                    self._fsync_slow_until = time.monotonic() + FSYNC_SLOW_HOLD_S
        except LogUnavailable as exc:
            log.warn("log_unavailable", results=len(items), error=str(exc))
            return False
        flush_s = time.perf_counter() - t0
        self.stats.groups += 1
        self.stats.group_items_max = max(self.stats.group_items_max, len(items))
        self.stats.flush_s += flush_s
        self.stats.flush_s_max = max(self.stats.flush_s_max, flush_s)

        keys, lease_ids = list(map(_FIRST, items)), list(map(_SECOND, items))
        # Durable: a repeat gets these ids from now on.
        self.repeats.add_many(lease_ids, keys, ids)
        # WriteBack (a NamedTuple) made by tuple.__new__, its own __new__ being
        # Python: (key, due_at, if_version, result_id, finished_at) each. Not
        # strict: repeat(now) is endless, the other columns all len(items).
        dues = map(add, repeat(now), map(_CADENCE, items))
        rows = zip(keys, dues, map(_VERSION, items), ids, repeat(now))  # noqa: B905
        wbs = map(_new_tuple, repeat(WriteBack), rows)
        ends = zip(keys, lease_ids, ids, map(_JOB, items), strict=True)
        self._write_backs(list(zip(wbs, ends, strict=True)), now, fresh=True)
        return True

    def _settle(self, batches: list[_Batch], status: str, ids: list[int] | None) -> None:
        """Answer each batch of a group: ``ids`` (the group's, in order) with
        ``ok``, none with a failure."""
        pop, at = self._inflight.pop, 0
        for b in batches:
            n = len(b.items)
            deque(map(pop, map(_KEY_LEASE, b.items), repeat(None)), 0)
            if not b.done.done():
                b.done.set_result((status, None if ids is None else ids[at : at + n]))
            at += n

    def _sync_before_retires(self) -> None:
        """The log's hook before it writes acks or discards: the schedule
        synced if they need a write-back it has not synced (acks come to the
        log synced already: ``HeldAcks``)."""
        if self._retire_gen > self.acks.synced_gen:
            self.acks.sync_now()

    def _kick_soon(self, delay: float) -> None:
        """Wake the committer after ``delay`` seconds, from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if delay > 0:
            loop.call_soon_threadsafe(loop.call_later, delay, self._kick.set)
        else:
            loop.call_soon_threadsafe(self._kick.set)

    def _release_acks(self) -> None:
        """Hand the held acks whose write-backs are synced to the log: they
        join the next group commit, and their callers hear after it."""
        for ids, at, gen, waiter in self.acks.release():
            self.log.ack(ids, at)
            self._retire_gen = max(self._retire_gen, gen)
            if waiter is not None:
                self._waiters.append(waiter)

    def _write_backs(
        self, group: list[tuple[Any, _End | None]], now: float, fresh: bool = False
    ) -> None:
        """A group's write-backs in one store transaction, then their leases
        ended (and their results offered; ``fresh``: see ``_end_leases``).

        Before the lease ends: a crash between the two leaves the lease
        live, and recovery does both again (the repeat write is refused by
        its version, harmlessly). A store that refuses the batch leaves
        every lease of it live and the results unoffered: the batch is
        retried every sweep and the leases end once it is written, so the
        key is never granted again with its old due time; a crash meanwhile
        leaves the result pending in the log and its lease live, and
        recovery writes it back from there. (A store down for longer than a
        lease plus its hold: the lease expires, is a miss, and the key can
        be granted again; the late write-back then ends nothing.)"""
        from node.core.errors import StoreError

        try:
            versions = self.store.write_back_many(list(map(_FIRST, group)))
            self.acks.written_gen += 1
        except Exception as exc:  # noqa: BLE001 - nothing lost: every item is retried
            self.stats.writeback_failed += len(group)
            self._writebacks += group
            if isinstance(exc, StoreError):
                log.warn("writeback_failed", results=len(group), error=str(exc),
                         retrying=len(self._writebacks))  # fmt: skip
            else:
                log.error("writeback_failed", exc_info=True, results=len(group), error=repr(exc),
                          retrying=len(self._writebacks))  # fmt: skip
            return
        self.stats.writeback_skipped += versions.count(None)
        self._end_leases(list(filter(None, map(_SECOND, group))), now, fresh)

    def _end_leases(self, ends: list[_End], now: float, fresh: bool = False) -> None:
        """End the leases of durable, written-back results, in one call
        into C for the group (``complete_many``), and offer each result
        whose lease ended. A failure of the group call (NodeRestarted when
        the table is sealed, say) is retried item by item, as before: the
        items it ended answer REPEAT then, and every item that fails again
        is logged and retried every sweep (durable already: it answered ok).

        ``fresh``: the results were made durable in this same synchronous
        step (``commit_end``), so none can have been acked or discarded since:
        a COMPLETED one is offered without asking the log again."""
        from shm.leases import Outcome

        if not ends:
            return
        try:
            outcomes = self.leases.complete_many(list(map(_KEY_LEASE, ends)), now)
        except Exception:  # noqa: BLE001 - each item again, on its own, below
            for end in ends:
                try:
                    self._end_lease(*end, now)
                except Exception as exc:  # noqa: BLE001 - durable already: answer ok, retry the end
                    log.error("lease_end_failed", exc_info=True, key=end[0], id=end[2],
                              error=repr(exc))  # fmt: skip
                    self._unended.append(end)
            return
        completed, add = Outcome.COMPLETED, self.delivery.add
        job = ends[0][3]
        if fresh and outcomes.count(completed) == len(ends) == [e[3] for e in ends].count(job):
            self.delivery.add_many(list(map(_THIRD, ends)), job)  # the usual group
            return
        for end, outcome in zip(ends, outcomes, strict=True):
            if fresh and outcome is completed:
                add(end[2], end[3])
            else:
                self._ended(end, outcome)

    def _end_lease(self, key: str, lease_id: int, rid: int, job: str, now: float) -> None:
        self._ended((key, lease_id, rid, job), self.leases.complete(key, lease_id, now))

    def _ended(self, end: _End, outcome: Any) -> None:
        """What ``complete`` answered for a durable result: offer it, unless
        another live process held the key's slot (BUSY: retried every sweep,
        and offered once ended, since an ack before would leave a live lease)."""
        from shm.leases import Outcome

        key, lease_id, rid, job = end
        if outcome is Outcome.BUSY:
            self._unended.append(end)
            return
        if outcome in (Outcome.SUPERSEDED, Outcome.UNKNOWN):
            # Granted again between the peek and now (docs/delivery.md):
            # the result is durable, so it is delivered all the same.
            self.stats.superseded_after_durable += 1
            log.warn("complete_superseded_after_durable", key=key, lease_id=lease_id, id=rid)
        if self.log.get_pending(rid) is not None:  # not discarded while its lease was busy
            self.delivery.add(rid, job)

    async def complete(self, request: dict) -> dict:
        items = _check_items(request.get("items"))
        if self.fleet.missing and not self._learn_number():
            raise RemoteError("not_joined", "this node has not joined its fleet yet: retry")
        outcomes, accepted, batch, dups = self.check(items)
        if len(accepted) == len(items):
            # The usual request: every item taken. Its answer in one pass.
            self._queue.append(batch)
            self._kick.set()
            status, ids = await batch.done
            statuses = self.stats.statuses
            statuses[status] = statuses.get(status, 0) + len(items)
            if ids is None:
                return {"outcomes": [{"status": status} for _ in items]}
            return {"outcomes": [{"status": status, "id": rid} for rid in ids]}
        if accepted:
            self._queue.append(batch)
            self._kick.set()
            status, ids = await batch.done
            if ids is None:
                for i in accepted:
                    outcomes[i] = {"status": status}
            else:
                for i, rid in zip(accepted, ids, strict=True):
                    outcomes[i] = {"status": status, "id": rid}
        for i, (first, at) in dups:
            status, ids = await first.done
            outcomes[i] = {"status": "repeat", "id": ids[at]} if ids else {"status": status}
        statuses = self.stats.statuses
        for status, n in Counter(map(itemgetter("status"), outcomes)).items():  # type: ignore
            statuses[status] = statuses.get(status, 0) + n
        return {"outcomes": outcomes}

    async def run_committer(self) -> None:
        """Group commit: take what is queued (whole requests, up to
        GROUP_MAX_ITEMS results), one flush, replies; again."""
        self._loop = asyncio.get_running_loop()
        while True:
            await self._kick.wait()
            self._kick.clear()
            if self.config.ledger_group_window_s > 0:
                await asyncio.sleep(self.config.ledger_group_window_s)
            self._release_acks()
            while self._queue or self._waiters:
                batches: list[_Batch] = []
                group: list[_Item] = []
                while self._queue and (
                    not group or len(group) + len(self._queue[0].items) <= GROUP_MAX_ITEMS
                ):
                    batches.append(self._queue.pop(0))
                    group += batches[-1].items
                waiters, self._waiters = self._waiters, []
                try:
                    now = time.time()
                    # (An empty group still flushes: the acks buffered meanwhile.)
                    # The fsync on the loop, or on its thread while the disk is
                    # slow (and for acks alone: they are no claimer's cycle).
                    thread = not group or time.monotonic() < self._fsync_slow_until
                    begun = self.commit_begin(group, now, self._fsync if thread else None)
                    if begun is None:
                        self._settle(batches, "log_unavailable", None)
                    else:
                        # On its thread, the fsync runs while polls, acks and
                        # new completions are answered (none of this group is
                        # offered or answered before it is durable).
                        handle = begun[1]
                        if handle is not None and handle.future is not None:
                            try:
                                await asyncio.wrap_future(handle.future)
                            except Exception:  # noqa: BLE001 - flush_end takes it from the future
                                pass  # (a failed fsync: log_unavailable, the batch cut back)
                        ids = begun[0]
                        if self.commit_end(group, now, *begun):
                            self._settle(batches, "ok", ids)  # durable: ok, whatever the store said
                        else:
                            self._settle(batches, "log_unavailable", None)
                except Exception as exc:  # noqa: BLE001 - a bug must not wedge every completion
                    log.error("commit_failed", exc_info=True, results=len(group), error=repr(exc))
                    self._settle(batches, "error", None)
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)
                self._release_acks()  # those a sync finished for meanwhile

    # -- poll and ack ---------------------------------------------------------------

    async def poll(self, request: dict) -> dict:
        job = _job_or_none(request.get("job"))
        max_n = _int_in(request.get("max", 100), "max", 1, MAX_ITEMS)
        wait_s = _num_in(request.get("wait_s", 0), "wait_s", 0, MAX_WAIT_S)
        self.stats.polls += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            results = self.offer(job, max_n, time.time())
            left = deadline - loop.time()
            if results or left <= 0 or self._stopping.is_set():
                return {"results": results}
            due = self.delivery.next_deadline(job)
            if due is not None:
                left = min(left, max(0.001, due - time.time()))
            with self.delivery.waiting(job) as event:
                try:
                    await asyncio.wait_for(event.wait(), left)
                except TimeoutError:
                    pass

    def offer(self, job: str | None, max_n: int, now: float) -> list[dict]:
        from node.completion import CompletionError

        ids = self.delivery.poll(job, max_n, now)
        recent = self.log.recent_results(ids)
        if all(recent) and sum(map(len, map(_DATA, recent))) + sum(
            map(len, map(_KEY, recent))) + 64 * len(recent) < REPLY_BYTES:  # fmt: skip
            # All in memory and the reply under its size: one pass, no checks.
            self.stats.offered += len(ids)
            return _offer_dicts(ids, recent)
        out: list[dict] = []
        size = 0
        for n, (rid, r) in enumerate(zip(ids, recent, strict=True)):
            if size >= REPLY_BYTES:
                self.delivery.return_offers(ids[n:], now)
                break
            if r is None:
                try:
                    r = self.log.read_result(rid)
                except CompletionError as exc:
                    # Not offered again: it cannot be read (reported, never silent).
                    self.stats.unreadable += 1
                    self.delivery.remove([rid])
                    log.error("result_unreadable", id=rid, error=str(exc))
                    continue
            size += len(r.data) + len(r.key) + 64
            out.append({"id": rid, "key": r.key, "job": r.job, "result": r.data,
                        "encoding": r.encoding, "finished_at": r.finished_at})  # fmt: skip
        self.stats.offered += len(out)
        return out

    async def ack(self, request: dict) -> dict:
        from workers.ledger.delivery import NeverOffered

        job = request.get("job")
        if not isinstance(job, str) or not job:
            raise _bad("ack needs a job")
        ids = request.get("ids")
        if not isinstance(ids, list) or len(ids) > MAX_ITEMS:
            raise _bad(f"ids must be a list of at most {MAX_ITEMS} integers")
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0):  # in C: ints, no bools
            raise _bad("ids must be non-negative integers")
        now = time.time()
        check_only = request.get("check") is True
        try:  # an id pending for another job is named, whatever this job holds
            retired = self.delivery.retire(job, ids, now, self.log.pending_job, check_only)
        except NeverOffered as exc:
            raise _NeverOfferedReply(exc) from None
        if check_only:
            return {"acked": 0, "checked": len(retired)}
        self.repeats.retire(retired, now)
        self.stats.acks += 1
        self.stats.acked += len(retired)
        if retired and self.acks.needs_sync():
            waiter = asyncio.get_running_loop().create_future()
            self.acks.hold(retired, now, waiter)  # until the schedule has synced
            await waiter
        else:
            self.log.ack(retired, now)
            await self.flushed()
        return {"acked": len(retired)}

    async def flushed(self) -> None:
        """Until what is buffered now (acks) has been through a flush: it
        joins the next group commit. A failed flush leaves the acks in
        effect here and buffered: the sweep retries them."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._kick.set()
        await waiter

    # -- the rest of the ops ----------------------------------------------------------

    def accounting(self) -> dict:
        from node.completion import LogUnavailable
        from workers.ledger.accounting import LogCounts, build

        try:
            self.log.flush()
        except LogUnavailable:
            pass  # then the second law shows what is not durable yet
        c = self.log.counters()
        counts = LogCounts(c.durable, c.acked, c.discarded, self.log.pending_count())
        totals = self.acct.totals(self.leases.counters())
        return build(
            totals,
            self.leases.live_count(),
            counts,
            self.acct.since,
            self.keeper_counters(),
            self.acct.base,
        )

    def _learn_number(self) -> bool:
        """Read this fleet node's number from the keeper's state; True once known."""
        doc = self._keeper_doc()
        membership = ((doc or {}).get("trust") or {}).get("membership")
        next_id = self.log.raise_next_id(0)  # the log's next id (a floor of 0 changes nothing)
        if self.fleet.learn(membership, next_id):
            self.log.raise_next_id(self.fleet.first_id())
        return self.fleet.number is not None

    def _keeper_doc(self) -> dict | None:
        """The keeper's state document now; None when it cannot be read."""
        from shm.state import StateBuffer

        try:
            if self._state is None:
                self._state = StateBuffer.attach(self.config.name, read_only=True)
            doc = self._state.read()["doc"]
        except Exception:  # noqa: BLE001 - absent, being rebuilt, unstable
            if self._state is not None:
                try:
                    self._state.close()
                except Exception:  # noqa: BLE001
                    pass
                self._state = None
            return None
        return doc if isinstance(doc, dict) else None

    def keeper_counters(self) -> dict:
        """The input side of the books as the keeper last wrote it
        (``counters`` in the state buffer's document: received, withdrawn,
        waiting and the lease counters of the same moment): the last one
        read, when the buffer cannot be read now; empty before the keeper
        first wrote it."""
        now = time.monotonic()
        if now - self._keeper_counters_read_at < KEEPER_COUNTERS_REREAD_S:
            return self._keeper_counters
        self._keeper_counters_read_at = now
        doc = self._keeper_doc()
        if doc is None:  # absent, being rebuilt, unstable: keep the last
            return self._keeper_counters
        counters = doc.get("counters") or {}
        if isinstance(counters, dict) and isinstance(counters.get("received"), int):
            self._keeper_counters = counters
        return self._keeper_counters

    def unhold(self, request: dict) -> dict:
        keys = request.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise _bad("keys must be a list of strings")
        try:
            return {"unheld": self.leases.unhold(keys)}
        except ValueError as exc:
            raise _bad(str(exc)) from None

    def stats_reply(self) -> dict:
        c = self.log.counters()
        s = self.stats
        poll_waiters, poll_waiter_jobs = self.delivery.waiters()
        return {
            "pid": os.getpid(),
            "poll_waiters": poll_waiters,
            "poll_waiter_jobs": poll_waiter_jobs,
            "up_s": round(time.time() - s.started_at, 3),
            "statuses": dict(s.statuses),
            "groups": s.groups,
            "group_items_max": s.group_items_max,
            "flush_ms_mean": round(1000 * s.flush_s / s.groups, 3) if s.groups else 0.0,
            "flush_ms_max": round(1000 * s.flush_s_max, 3),
            "polls": s.polls,
            "offered": s.offered,
            "acks": s.acks,
            "acked": s.acked,
            "sweeps": s.sweeps,
            "expired": s.expired,
            "discarded": s.discarded,
            "segments_removed": s.segments_removed,
            "retention_s": dict(self._retention),
            "writeback_skipped": s.writeback_skipped,
            "writeback_failed": s.writeback_failed,
            "writeback_retrying": len(self._writebacks),
            "last_errors": s.last_errors,
            "last_errors_failed": s.last_errors_failed,
            "unended": len(self._unended),
            "superseded_after_durable": s.superseded_after_durable,
            "unreadable": s.unreadable,
            "pending": self.delivery.pending(),
            "offered_now": self.delivery.offered(),
            "repeats": len(self.repeats),
            "jobs": len(self.delivery.jobs()),
            "log": dataclasses.asdict(c),
            "recovery": s.recovery,
        }

    # -- every SWEEP_INTERVAL_S -----------------------------------------------------

    def sweep(self, now: float) -> None:
        """Expire leases (the table counts each expiry once), retry what
        could not be done at commit, checkpoint the counters."""
        self.stats.sweeps += 1
        if self.fleet.missing:
            self._learn_number()
        expired = self.leases.expire(now)
        self.stats.expired += len(expired)
        if expired:
            self._expired_errors(expired, now)
        self.repeats.expire(now)
        if self._unended:
            todo, self._unended = self._unended, []
            for i in range(0, len(todo), GROUP_MAX_ITEMS):
                self._end_leases(todo[i : i + GROUP_MAX_ITEMS], now)
        if self._writebacks:
            todo_wb, self._writebacks = self._writebacks, []
            for i in range(0, len(todo_wb), GROUP_MAX_ITEMS):
                self._write_backs(todo_wb[i : i + GROUP_MAX_ITEMS], now)
        if now >= self._outcome_due:
            self.scan_misses(now)
        if self._retention and now >= self._retention_due:
            self.retain(now)
        if now >= self._compact_due:
            self.compact(now)
        if now >= self._checkpoint_due:
            self.checkpoint(now)
        ckpt = self._checkpointing
        if (ckpt is None or ckpt.done()) and self.store.wal_bytes() >= CHECKPOINT_WAL_BYTES:
            self._checkpointing = self._checkpointer.submit(self._checkpoint_wal)

    def _checkpoint_wal(self) -> None:
        """On the checkpointer thread: the write-backs' commits copied into
        the schedule's file (a failure is said and tried again next sweep)."""
        try:
            self.store.checkpoint_wal()
        except NodeError as exc:
            log.warn("wal_checkpoint_failed", error=str(exc))

    def _expired_errors(self, expired: list, now: float) -> None:
        """The rows' last_error for the leases this sweep expired."""
        from node.store import LastError

        errors = []
        for e in expired:
            text = "expired: no result within the lease"
            if e.parked:
                text += f"; parked after {e.misses} misses in a row"
            errors.append(LastError(e.key, text, now))
            if self._missed is not None:
                self._missed[e.key] = (e.lease_id, e.misses)
        self._write_last_errors(errors)

    def scan_misses(self, now: float) -> None:
        """Releases happen in the claimers (HTTP workers, LocalClaimer), in
        shared memory: the ledger learns of them here, from the held and
        parked slots, and writes the rows' last_error. A slot it has not
        seen with this lease id and miss count is a release (expiries are
        recorded by the sweep that makes them)."""
        from node.store import LastError

        self._outcome_due = now + OUTCOME_SCAN_INTERVAL_S
        holds = self.leases.held(limit=self.leases.capacity)
        seen = {h.key: (h.lease_id, h.misses) for h in holds}
        missed, self._missed = self._missed, seen
        if missed is None:
            return
        errors = []
        for h in holds:
            if missed.get(h.key) == seen[h.key]:
                continue
            text = f"released: {h.last_error}" if h.last_error else "released"
            if h.parked:
                text += f"; parked after {h.misses} misses in a row"
            errors.append(LastError(h.key, text, now))
        if errors:
            self._write_last_errors(errors)

    def _write_last_errors(self, errors: list) -> None:
        """Informational: a store that refuses them now loses them (counted
        and logged; the lease table keeps the error of a held key)."""
        from node.core.errors import StoreError

        try:
            self.stats.last_errors += self.store.write_last_errors(errors)
        except StoreError as exc:
            self.stats.last_errors_failed += len(errors)
            log.warn("last_error_failed", rows=len(errors), error=str(exc))

    def retain(self, now: float) -> dict[str, int]:
        """Job retention: discard each job's results not acked within its
        ``retention_s`` of finishing, oldest first (the cost follows what is
        dropped, not the backlog). The DISCARD records are made durable by
        the flush that follows every sweep. One log line when anything went."""
        self._retention_due = now + RETENTION_INTERVAL_S
        dropped: dict[str, int] = {}
        for job, keep_s in self._retention.items():
            ids = self.log.expired(job, now - keep_s, RETENTION_MAX_PER_SWEEP)
            if ids and len(self.acks):  # acknowledged already, their records to come
                held = self.acks.holding()
                ids = [rid for rid in ids if rid not in held]
            if not ids:
                continue
            self._retire_gen = self.acks.written_gen  # synced before the discards are written
            dropped[job] = self.log.discard(ids, RETENTION_REASON, now)
            self.delivery.remove(ids, job)  # an offer out now: its ack counts 0
            self.repeats.retire(ids, now)
        if dropped:
            total = sum(dropped.values())
            self.stats.discarded += total
            log.log("retention_discarded", total=total, jobs=dropped)
        return dropped

    def compact(self, now: float) -> int:
        """Remove the segments whose every result is retired (acknowledged
        or discarded): the log's disk use follows what awaits delivery (plus
        a lease summary of each for ``repeat_window_s``: about 16 bytes and the
        key a result). One log line when any went; a log that cannot write
        now tries again at the next interval."""
        from node.completion import LogUnavailable

        self._compact_due = now + COMPACT_INTERVAL_S
        if not self.log.removable_segments() and not self.log.expired_summaries(now):
            return 0
        try:
            removed = self.log.compact(now)
        except LogUnavailable as exc:
            log.warn("compact_failed", error=str(exc))
            return 0
        if removed:
            self.stats.segments_removed += removed
            log.log("segments_removed", count=removed)
        return removed

    def checkpoint(self, now: float) -> None:
        from workers.ledger.accounting import CHECKPOINT_INTERVAL_S

        self._checkpoint_due = now + CHECKPOINT_INTERVAL_S
        counters = self.leases.counters()
        if counters != self._checkpointed:
            self.acct.save_checkpoint(counters, now)
            self._checkpointed = counters

    async def run_sweeper(self) -> None:
        from node.completion import LogUnavailable

        while not self._stopping.is_set():
            self.sweep(time.time())
            if len(self.acks):  # held after a failed sync: the committer tries again
                self._kick.set()
            try:
                self.log.flush()  # acks whose flush failed; a no-op otherwise
            except LogUnavailable:
                pass
            try:
                await asyncio.wait_for(self._stopping.wait(), SWEEP_INTERVAL_S)
            except TimeoutError:
                pass

    # -- serving ----------------------------------------------------------------------

    async def handle(self, request: dict) -> dict:
        op = request.get("op")
        if self._stopping.is_set() and op in ("complete", "ack"):
            raise RemoteError("stopping", "the ledger is stopping: retry")
        if op == "complete":
            return await self.complete(request)
        if op == "poll":
            return await self.poll(request)
        if op == "ack":
            return await self.ack(request)
        if op == "accounting":
            return self.accounting()
        if op == "unhold":
            return self.unhold(request)
        if op == "stats":
            return self.stats_reply()
        raise RemoteError("unknown_op", f"no op {op!r}: complete, poll, ack, accounting, "
                          "unhold, stats")  # fmt: skip

    async def serve(self, address: str) -> asyncio.AbstractServer:
        """Listen on ``address`` (abstract when it starts with NUL).

        ``node.ipc.serve`` is not used: it unlinks the path first (a NUL in
        a path is a ValueError) and cannot check the peer. The framing and
        the per-request tasks are the same."""
        return await asyncio.start_unix_server(self._connection, path=address, limit=MAX_FRAME)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid = peer_uid(writer.get_extra_info("socket"))
        if uid != os.getuid():
            log.warn("ipc_peer_refused", pid=pid, uid=uid)
            writer.close()
            return
        lock = asyncio.Lock()
        tasks: set[asyncio.Task] = set()

        async def one(request: dict) -> None:
            reply = await self._reply(request)
            reply["id"] = request.get("id")
            async with lock:
                try:
                    writer.write(pack(reply))
                    await writer.drain()
                except ConnectionError:
                    # The caller died (an HTTP worker killed) or hung up: its
                    # reply is lost, as with any dropped connection, and what
                    # the request did stands. Not an error of this task: left
                    # raised, asyncio logs it as an unretrieved traceback.
                    pass

        self._connections.add(writer)
        try:
            while not self._stopping.is_set():
                request = await read_frame(reader)
                if request is None:
                    break
                task = asyncio.create_task(one(request))
                for pool in (tasks, self._tasks):
                    pool.add(task)
                    task.add_done_callback(pool.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=STOP_GRACE_S)
        except (IpcError, ConnectionError):
            pass
        finally:
            self._connections.discard(writer)
            for task in tasks:
                task.cancel()
            writer.close()
            try:
                # A reply that met a closed connection left the error on the
                # stream's close future too; awaiting it here takes it, where
                # left unawaited asyncio may log it as never retrieved.
                await asyncio.wait_for(writer.wait_closed(), STOP_GRACE_S)
            except (ConnectionError, TimeoutError):
                pass

    async def _reply(self, request: dict) -> dict:
        try:
            return await self.handle(request)
        except _NeverOfferedReply as exc:
            return {"error": {"code": "never_offered", "message": str(exc.inner),
                              "ids": exc.inner.ids}}  # fmt: skip
        except RemoteError as exc:
            return {"error": {"code": exc.code, "message": exc.message}}
        except NodeError as exc:  # the store or the log failed under this request
            log.warn("op_failed", op=request.get("op"), error=str(exc))
            return {"error": {"code": "unavailable", "message": str(exc)}}
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the ledger
            log.error("op_crashed", exc_info=True, op=request.get("op"), error=repr(exc))
            return {"error": {"code": "internal", "message": repr(exc)}}

    async def run(self, address: str) -> None:
        """Serve until SIGTERM; then stop accepting, finish, flush."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_term)
        committer = asyncio.create_task(self.run_committer())
        sweeper = asyncio.create_task(self.run_sweeper())
        server = await self.serve(address)
        log.log("ledger_serving", address=address.replace("\0", "@"), **self.stats.recovery)
        await self._stopping.wait()
        server.close()
        self.delivery.wake_all()  # long polls answer what they have
        if self._tasks:  # completions taken are committed and answered
            await asyncio.wait(list(self._tasks), timeout=STOP_GRACE_S)
        for writer in list(self._connections):
            writer.close()
        committer.cancel()
        await sweeper
        await asyncio.gather(committer, return_exceptions=True)
        self.accounting_at_stop = self.accounting()

    def _on_term(self) -> None:
        if self._stopping.is_set():
            log.warn("ledger_kill", reason="second SIGTERM")
            os._exit(RET_ERROR)
        self._stopping.set()

    def close(self) -> None:
        """Flush, checkpoint, close: the log, the store, this process's view
        of the lease table (only the supervisor unlinks it)."""
        try:
            self.checkpoint(time.time())
            if len(self.acks):  # held acks: synced now, then into the log's last flush
                try:
                    self.acks.sync_now()
                except OSError as exc:
                    log.warn("schedule_sync_failed", error=str(exc), acks=len(self.acks))
                else:
                    for ids, at, _gen, _waiter in self.acks.release():
                        self.log.ack(ids, at)
        finally:
            try:
                self.log.close()
            finally:
                self._fsync.shutdown()
                self._checkpointer.shutdown()
                self.store.close()
                self.leases.close()
                if self._state is not None:
                    self._state.close()


class _NeverOfferedReply(Exception):
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        super().__init__(str(inner))


# -- the process ------------------------------------------------------------------------


def open_ledger(config: Config) -> Ledger:
    from node.completion import CompletionConfig, open_completion_store
    from node.store import open_store
    from shm.leases import LeaseTable

    leases = LeaseTable.attach(config.name)
    # Its writes (write-backs, last errors) are synced with NORMAL: the log
    # holds the evidence to write a result back again (docs/delivery.md).
    # Nor does a commit of its run the WAL's checkpoint: the sweep has one
    # run on a thread of its own (Ledger.sweep).
    store = open_store(config.store_url, durable=False, autocheckpoint=False, node_name=config.name)
    log_dir = Path(config.data_dir).resolve() / LOG_DIR
    log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    file_ops = None
    faults = os.environ.get(ENV_LOG_FAULTS)
    if faults and os.environ.get("QUEUE_NODE_TEST_HOOKS") == "1":
        from node.completion.faults import ControlledFileOps

        file_ops = ControlledFileOps(Path(faults))
        log.warn("test_hook_log_faults", control=faults)
    completion = open_completion_store(
        f"segments:///{log_dir}",
        CompletionConfig(
            fsync=config.log_fsync,
            segment_bytes=config.log_segment_bytes,
            keep_retired_s=config.repeat_window_s,
            preallocate_bytes=config.log_preallocate_bytes,
        ),
        file_ops=file_ops,
    )
    return Ledger(config, leases, store, completion)


async def _amain(config: Config) -> Ledger:
    ledger = open_ledger(config)
    try:
        delay = os.environ.get("QUEUE_NODE_TEST_LEDGER_START_DELAY_S")
        if delay and os.environ.get("QUEUE_NODE_TEST_HOOKS") == "1":
            # Test hook: a slow recovery (tests/integration/test_power_loss.py).
            log.warn("test_hook_ledger_start_delay", seconds=float(delay))
            await asyncio.sleep(float(delay))
        ledger.recover(time.time())
        await ledger.run(ledger_address(config.name))
    finally:
        ledger.close()
    return ledger


def main() -> int:
    die_with_parent()
    child_signals()
    set_title("qn-ledger")
    log.setup("ledger", verbose=bool(os.environ.get("QUEUE_NODE_VERBOSE")))
    try:
        config = load_run_config("ledger")
        ledger = asyncio.run(_amain(config))
    except (NodeError, OSError) as exc:  # a second ledger of this name; a missing segment
        log.error("ledger_failed", error=str(exc))
        return RET_ERROR
    s = ledger.stats
    acct = ledger.accounting_at_stop
    log.log(
        "ledger_stop",
        up_s=round(time.time() - s.started_at, 1),
        completions=sum(s.statuses.values()),
        ok=s.statuses.get("ok", 0),
        groups=s.groups,
        offered=s.offered,
        acked=s.acked,
        expired=s.expired,
        balanced=acct.get("balanced"),
    )
    return RET_OK


if __name__ == "__main__":
    sys.exit(main())
