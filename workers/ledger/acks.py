"""Acks held until the schedule has synced the write-backs before them.

An ack record must not be durable before the write-backs of the results it
retires: after a power loss the row would be due again while its result is
gone (a pending result's write-back is done again from the log at start; an
acknowledged one's cannot be). The ledger writes its write-backs with
``synchronous = NORMAL``, so the schedule is synced (``Store.sync``, an fsync
of its WAL) before an ack record is written.

That sync ran on the ledger's loop before every group commit that carried
acks: at batch 1 (every completion a group, and the receiver acking every
few) an fsync of the WAL for nearly every fsync of the log, a tenth of the
loop's time, and the two files' fsyncs slowed each other on the disk. Here
an ack waits, off the loop, for a sync on the fsync thread that covers every
write-back committed before it, while the loop goes on committing groups;
then it joins the next group commit, and its caller is answered once that is
durable, as before. Syncs start at most every ``SYNC_INTERVAL_S``, so one
covers every ack of that time: the whole cycle at batch 1 went from about
1,600 to 1,900 completed and acked a second on this project's 2-core host,
at batch 64 up 5 % (docs/performance.md, "Acks wait for the schedule's sync
off the loop"). An ack answers up to ``SYNC_INTERVAL_S`` later than before.

A failed sync (the disk refuses) answers the waiting acks as a failed flush
did (the acks are in effect in memory) and keeps their records for a later
sync, tried again at most every ``RETRY_S``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future

from node.core import log

# After a failed sync, the next is tried no sooner than this.
RETRY_S = 1.0
# Syncs for acks start at most this often (the first after a quiet time at once).
SYNC_INTERVAL_S = 0.02


class HeldAcks:
    """The write-back generations and the acks waiting for a sync of them.

    ``written_gen`` counts the write-back transactions committed,
    ``synced_gen`` those the schedule has synced. An ack made when every
    write-back is synced (and none is held before it) is not held at all."""

    def __init__(self, sync: Callable[[], None], executor: Executor,
                 kick: Callable[[float], None]) -> None:  # fmt: skip
        self.written_gen = 0
        self.synced_gen = 0
        self._sync = sync
        self._executor = executor
        # kick(delay): wake the committer after ``delay`` seconds (thread-safe).
        self._kick = kick
        # (ids, at, gen, waiter or None): in the order the acks came.
        self._held: deque[tuple[list[int], float, int, asyncio.Future | None]] = deque()
        self._running: Future | None = None
        self._running_gen = 0
        self._retry_at = float("-inf")  # monotonic, as the two below
        self._next_at = float("-inf")  # the next sync may start
        self._woken_at = float("-inf")  # the committer is woken then already

    def __len__(self) -> int:
        return len(self._held)

    def holding(self) -> set[int]:
        """The ids of the held acks (still pending in the log until released)."""
        return {rid for ids, _at, _gen, _waiter in self._held for rid in ids}

    def needs_sync(self) -> bool:
        """Whether an ack made now would wait for a sync."""
        return bool(self._held) or self.written_gen > self.synced_gen

    def hold(self, ids: list[int], at: float, waiter: asyncio.Future) -> None:
        """Hold an ack until the write-backs committed so far are synced."""
        self._held.append((ids, at, self.written_gen, waiter))
        self._kick(0.0)

    def release(self) -> list[tuple[list[int], float, int, asyncio.Future | None]]:
        """The held acks whose write-backs are synced, oldest first (the
        caller hands them to the log); starts a sync for the others."""
        self._settle()
        out = []
        held = self._held
        while held and held[0][2] <= self.synced_gen:
            out.append(held.popleft())
        if not held or self._running is not None:
            return out
        now = time.monotonic()
        start_at = max(self._retry_at, self._next_at)
        if now < start_at:
            if self._woken_at != start_at:  # one wake-up for that moment
                self._woken_at = start_at
                self._kick(start_at - now)
            return out
        self._next_at = now + SYNC_INTERVAL_S
        self._running_gen = self.written_gen
        self._running = self._executor.submit(self._sync)
        self._running.add_done_callback(lambda _f: self._kick(0.0))
        return out

    def _settle(self) -> None:
        running = self._running
        if running is None or not running.done():
            return
        self._running = None
        error = running.exception()
        if error is None:
            self.synced_gen = max(self.synced_gen, self._running_gen)
            return
        self._retry_at = time.monotonic() + RETRY_S
        log.warn("schedule_sync_failed", error=str(error), acks=len(self._held))
        # As a failed flush: the acks are in effect here; their callers hear so.
        for i, (ids, at, gen, waiter) in enumerate(self._held):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            self._held[i] = (ids, at, gen, None)

    def sync_now(self) -> None:
        """Sync on this thread, now (at a stop, before the last flush)."""
        gen = self.written_gen
        self._sync()
        self.synced_gen = max(self.synced_gen, gen)
