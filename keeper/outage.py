"""The keeper through a store error: it keeps serving, reopens, and checks
what it may have missed instead of dying into a full reload.

A read of the store that fails (an I/O or SQLite error, the file locked past
the keeper's short busy timeout), or a file that is no longer the one the
keeper's connection reads (renamed away, deleted, replaced: checked with a
stat every ``STORE_CHECK_S``), starts an **outage**:

- the connection is closed and reopened with capped exponential backoff
  (``RETRY_FIRST_S``, 0.1 s, doubling to ``RETRY_MAX_S``, 1 s), never
  creating a missing file; a log line names the error, at most every ``LOG_EVERY_S``;
- meanwhile the keeper serves its in-memory copy: claimers drain the last
  ready set and the keeper publishes the next from its copy (no top check),
  heartbeats, and writes its counts with ``trust.store`` saying
  ``unreachable`` (since, attempts, error); its copy is not exact, so it does
  not vouch (queue-state answers 503, as for any keeper that cannot vouch);
- once reopened, the change log decides: if it still holds every change
  after the keeper's ``feed_seq`` (the next seq is ``feed_seq + 1``, or none
  came), the feed resumes where it stopped and the keeper is exact once
  caught up; if changes are missing (a gap: the log was trimmed by someone
  else) or another file has the name (same sequence, or further on), a
  verification walk (keeper/verify.py) repairs the copy, and the keeper
  is exact when it ends; if the sequence went backwards (an older copy of
  the file restored), the rows' versions no longer compare, and the keeper
  exits so that the supervisor starts one that loads the file afresh.

Writes the keeper makes are best-effort (trimming the change log, saving the
received count): one that fails is counted in ``trust.store.write_failures``
and retried at its next interval; it starts no outage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from keeper.base import KeeperBase
from node.core import log
from node.core.errors import StoreError

# How often the keeper checks that the file at the store's path is the one
# its connection reads (a stat).
STORE_CHECK_S = 0.25
# Reopen attempts: the first this soon after the error, each next one twice
# as late, at most RETRY_MAX_S apart. A failed attempt costs an open() that
# fails or one short query, so the cap is low: it bounds how long the keeper
# stays apart after the store is back (bench/bench_keeper_store_error.py).
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 1.0
# A retry is logged at most this often (the first and the last always).
LOG_EVERY_S = 5.0
# A reopen under way on its thread is looked at this often.
REOPEN_LOOK_S = 0.05
# The keeper's connection waits this long for another connection's lock (the
# default is 5 s): its reads in WAL mode never wait, and its writes are
# best-effort, so a long wait would only stall its loop.
KEEPER_BUSY_TIMEOUT_S = 0.25
# The keeper's page cache (SQLite): its reads walk the table in order (the
# load, the verification) or read the change log's newest pages, so the 16
# MiB every other process's connection keeps for point reads would only hold
# pages of the walk, about 15 bytes a row of the keeper's memory at 1,000,000
# rows (docs/performance.md, "The keeper's page cache").
KEEPER_CACHE_KIB = 2048


class KeeperReload(Exception):
    """The store came back as another file whose sequence went backwards: the
    keeper's copy cannot be repaired by versions; it exits for a fresh load."""


class StoreOutage:
    """One spell of the store being unreachable."""

    def __init__(self, now: float, error: str, identity: Any) -> None:
        self.since = now
        self.error = error
        self.identity = identity  # the file the keeper read before the error
        self.attempts = 0
        self.reopening: Future | None = None  # a reopen on its thread (_reopened)
        self.delay = RETRY_FIRST_S
        self.next_try = now + RETRY_FIRST_S
        self.logged_at = now


class Outage(KeeperBase):
    # -- noticing -------------------------------------------------------------

    def _check_store(self, now: float) -> None:
        """StoreError when the file at the store's path is not the one the
        keeper reads (every STORE_CHECK_S)."""
        self._next_store_check = now + STORE_CHECK_S
        why = self.store.replaced()
        if why is not None:
            raise StoreError(f"store file changed: {why}")

    def _store_failed(self, exc: BaseException, now: float) -> None:
        """Start an outage (or note the error of the one under way)."""
        if self._outage is not None:
            self._outage.error = str(exc)
            return
        self._outage = StoreOutage(now, str(exc), self.store.identity())
        figures = self.stats.store
        figures.update(state="unreachable", since=now, attempts=0, error=str(exc))
        figures["outages"] += 1
        log.warn("keeper_store_error", error=str(exc), feed_seq=self.feed_seq,
                 serving="last ready set and in-memory copy")
        try:
            self.store.close()
        except StoreError:
            pass  # the connection is gone either way
        self._set_exact(False, now)
        self.next_state = 0.0  # say so in queue-state at once

    def _write_failed(self, what: str, exc: Exception, now: float) -> None:
        """A best-effort write failed: counted, logged at most every LOG_EVERY_S."""
        figures = self.stats.store
        figures["write_failures"] += 1
        figures["last_write_error"] = f"{what}: {exc}"
        if now - self._write_failure_logged >= LOG_EVERY_S:
            self._write_failure_logged = now
            log.warn("keeper_store_write_failed", what=what, error=str(exc),
                     failures=figures["write_failures"])

    def _feed_gap(self, first_seq: int, now: float) -> None:
        """The change log skips from feed_seq to ``first_seq``: someone else
        trimmed changes the keeper had not read (seqs are gapless in SQLite:
        AUTOINCREMENT, one writer at a time, a rollback takes its seq back).
        The batch is applied (versions decide) and a walk repairs the rest."""
        log.warn("keeper_feed_gap", expected=self.feed_seq + 1, got=first_seq)
        self.stats.store["gaps"] += 1
        self._doubt = "gap"
        self._doubt_gen += 1
        self._set_exact(False, now)

    # -- while it lasts ---------------------------------------------------------

    def _outage_tick(self, now: float) -> float:
        """One tick without a store: retry when due, else serve from memory."""
        outage = self._outage
        assert outage is not None
        if now >= outage.next_try and self._try_reopen(outage, now):
            return 0.0
        self._sample_flow(now)
        if now >= self.next_publish or self.ready_low(now):
            self.publish(now)
        if now >= self.next_state:
            self.write_state(now)
        wait_s = min(self.next_publish, self.next_state, outage.next_try) - now
        return max(0.0, min(wait_s, self._low_water_wait(now)))

    def _low_water_wait(self, now: float) -> float:
        if self.ready.low_water:
            return max(0.0, self._published_at + self._low_water_min_s() - now)
        return RETRY_MAX_S

    def _try_reopen(self, outage: StoreOutage, now: float) -> bool:
        try:
            store = self._reopened(outage, now)
        except StoreError as exc:
            self._retry_later(outage, exc, now)
            return False
        if store is None:
            return False  # a reopen under way on its thread
        try:
            verdict, last = self._feed_verdict(store, outage)
        except StoreError as exc:
            store.close()
            self._retry_later(outage, exc, now)
            return False
        self.store = store
        self._store_back(outage, verdict, last, now)
        return True

    def _reopened(self, outage: StoreOutage, now: float) -> Any | None:
        """The store opened again; StoreError when that failed. A store
        over the network (``reopen_off_loop``: PostgreSQL) is opened on a
        thread of its own, since its connect waits on a network that may
        still be cut, and the loop must go on heartbeating and publishing
        meanwhile: None while that is under way (looked at again
        ``REOPEN_LOOK_S`` later)."""
        off_loop = getattr(self.store, "reopen_off_loop", False)
        if not off_loop or outage.reopening is None:
            outage.attempts += 1
            self.stats.store["attempts"] = outage.attempts
            if not off_loop:
                return self.store.reopen()
            outage.reopening = _reopen_in_thread(self.store)
        if not outage.reopening.done():
            outage.next_try = now + REOPEN_LOOK_S
            return None
        reopening, outage.reopening = outage.reopening, None
        return reopening.result()  # the store, or its StoreError raised here

    def _retry_later(self, outage: StoreOutage, exc: StoreError, now: float) -> None:
        outage.error = str(exc)
        self.stats.store["error"] = str(exc)
        outage.next_try = now + outage.delay
        if now - outage.logged_at >= LOG_EVERY_S or outage.attempts == 1:
            outage.logged_at = now
            log.warn("keeper_store_retry", attempts=outage.attempts, error=str(exc),
                     next_in_s=round(outage.delay, 3), down_s=round(now - outage.since, 3))
        outage.delay = min(outage.delay * 2, RETRY_MAX_S)

    # -- back -----------------------------------------------------------------

    def _feed_verdict(self, store: Any, outage: StoreOutage) -> tuple[str, int]:
        """What the reopened store's change log says: ``intact`` (it holds
        every change after feed_seq, same file), ``gap`` (changes missing),
        ``replaced`` (another file, its log consistent), ``backwards``; and
        the store's last seq."""
        last = store.last_seq()
        if last < self.feed_seq:
            return "backwards", last
        if last > self.feed_seq:
            first = store.first_seq_after(self.feed_seq)
            if first is None or (
                first != self.feed_seq + 1 and store.skip_is_loss(self.feed_seq, first)
            ):
                return "gap", last
        if store.identity() != outage.identity:
            return "replaced", last
        return "intact", last

    def _store_back(self, outage: StoreOutage, verdict: str, last: int, now: float) -> None:
        down_s = round(now - outage.since, 3)
        figures = self.stats.store
        log.log("keeper_store_back", verdict=verdict, down_s=down_s, attempts=outage.attempts,
                feed_seq=self.feed_seq, error=outage.error)
        if verdict == "backwards":
            figures["reloads"] += 1
            self.save_counts(now, periodic=True)  # into the file the next keeper loads
            raise KeeperReload(
                f"the store's change sequence went backwards ({last} < "
                f"{self.feed_seq}): another copy of the file; the keeper reloads"
            )
        self._outage = None
        figures.update(state="ok", since=None, attempts=0, error=None, last_down_s=down_s,
                       last_verdict=verdict)
        self._next_store_check = now + STORE_CHECK_S
        if verdict == "intact":
            figures["resumed"] += 1
        else:
            # The change log cannot say what was missed: walk the table. The
            # keeper is exact again when the walk ends (``_finish_verify``).
            figures["walks"] += 1
            if verdict == "gap":
                # Subscribe first, then walk (as the load does): the feed goes
                # on from the store's last seq, and the walk brings every row
                # written up to it, those the trimmed log no longer shows too.
                self.feed_seq = last
            self._doubt_copy(verdict, now)
            if not self._loading:
                self.start_verify(now)
        self.drain_feed(now)
        if self._caught_up and not self._loading and self._doubt is None:
            self._set_exact(True, now)
        self.write_state(now)  # queue-state shows the store back with the first 200
        self.next_publish = 0.0


def _reopen_in_thread(store: Any) -> Future:
    """``store.reopen()`` on a daemon thread of its own: its future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(store.reopen())
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises it
            future.set_exception(exc)

    threading.Thread(target=run, name="keeper-reopen", daemon=True).start()
    return future


# -- a keeper that starts without its store ---------------------------------------


def open_when_there(url: str, state: Any, wait: Callable[[float], Any],
                    stopping: Callable[[], bool], node_name: str | None = None,
                    network_timeout_s: float | None = None) -> Any:  # fmt: skip
    """The keeper's store at its start, never made anew (``create=False``,
    node/store/made.py): a keeper restarted while the store is away (its
    volume not mounted, its directory renamed) waits for it with the
    outage's backoff, ``wait(seconds)`` between tries (the wake semaphore:
    a signal ends it early), instead of serving an empty new file. Meanwhile
    it heartbeats ``loading`` with the phase ``store unreachable, try N``
    and keeps its predecessor's document in the state buffer with
    ``trust.store`` saying ``unreachable`` (the ledger's accounting goes on
    reading the counters in it; nobody vouches for them). None when
    ``stopping()`` turns true first. ``node_name``: whose meta a PostgreSQL
    store keeps; ``network_timeout_s``: how soon its connections fail when
    the server stops answering (``open_store``)."""
    from node.store import open_store

    since = time.time()
    delay = RETRY_FIRST_S
    attempts = 0
    logged_at = float("-inf")
    while not stopping():
        try:
            return open_store(
                url, busy_timeout_s=KEEPER_BUSY_TIMEOUT_S, create=False, node_name=node_name,
                network_timeout_s=network_timeout_s, cache_kib=KEEPER_CACHE_KIB,
            )  # fmt: skip
        except StoreError as exc:
            attempts += 1
            now = time.time()
            _say_unreachable(state, now, since, attempts, str(exc))
            if now - logged_at >= LOG_EVERY_S:
                logged_at = now
                log.warn("keeper_store_missing_at_start", attempts=attempts, error=str(exc),
                         next_in_s=round(delay, 3), down_s=round(now - since, 3))  # fmt: skip
        # A write through a worker posts the wake: the next try is still
        # only after the backoff.
        next_try = time.monotonic() + delay
        while not stopping() and (left := next_try - time.monotonic()) > 0:
            wait(left)
        delay = min(delay * 2, RETRY_MAX_S)
    return None


def _say_unreachable(state: Any, now: float, since: float, attempts: int, error: str) -> None:
    phase = f"store unreachable, try {attempts}"
    state.heartbeat(now, "loading", False, phase)
    doc = state.read()["doc"]
    trust = dict(doc.get("trust") or {})
    store = dict(trust.get("store") or {})
    store.update(state="unreachable", since=since, attempts=attempts, error=error)
    trust.update(phase=phase, store=store)
    state.write_doc({**doc, "trust": trust}, now)
