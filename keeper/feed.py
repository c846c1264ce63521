"""The keeper's intake: the change feed (every insert, update and delete, in
seq order: the hot path) and, while loading, the walk of the table a chunk a
tick; and the trim of the change log.

Loading follows one rule: **versions decide**. A row's version is the seq of
the change that made it, so a walked row never overwrites what a newer event
already put in the buckets, and a delete seen during the load leaves a
tombstone that an older walked row cannot pass.
"""

from __future__ import annotations

import time
from typing import Any

from keeper.base import KeeperBase
from keeper.owners import Ownership
from node.core import metrics
from node.core.errors import StoreError, TooManyClasses
from node.core.rows import OP_DELETE, OP_INSERT, ORIGIN_EXTERNAL, ORIGIN_WRITEBACK
from node.store.postgres_schema import TRIM_CHUNK

# Rows per load step: large enough that a step's own costs stay small per
# row, small enough that a step (the walk and load_rows, ~2.5 µs a row) stays
# well under the 50 ms a keeper may pause, and the first publish comes within
# tens of milliseconds.
LOAD_CHUNK = 10_000
# Changes read per feed query. A burst larger than this is applied over
# several queries in the same tick.
FEED_BATCH = 5_000
# The most feed batches applied in one tick before the keeper publishes and
# checks in again; a flood of writes must not starve the publish.
FEED_BATCHES_PER_TICK = 40
# And at most this long: a fleet keeper heartbeats between ticks, so a tick
# that drains a flood (on a loaded host a batch can take tenths of a second)
# must not hold the heartbeat past the membership timeout.
FEED_TICK_BUDGET_S = 0.2
# A row the load leaves out that the saved counts' ownership owned is kept
# for the count at the load's end only when it is due within this many
# minutes of its step (a load takes seconds, minutes at 1M rows): one due
# later cannot be due by then, and the rest of the table costs no memory.
LEFT_OUT_AHEAD_MIN = 60
# The change log is trimmed this often (cheap, but not on every tick).
TRIM_INTERVAL_S = 5.0
# A trim that deleted as many rows as PostgreSQL's bound a trim may have
# stopped short: the next one comes after TRIM_SOON_S.
TRIM_SOON_S = 0.5


class Feed(KeeperBase):
    # -- the change feed (hot path) -------------------------------------------

    def drain_feed(self, now: float) -> int:  # noqa: C901 - the hot loop stays in one frame
        """Apply every change logged since the last one applied."""
        t0 = time.perf_counter()
        applied = 0
        changes = self.store.changes
        apply = self.buckets.apply
        remove = self.buckets.remove
        detach = self.buckets.detach
        loading = self._loading
        tombstones = self._tombstones
        exclude = self.exclude if self.leases is not None else ()
        out = self._out
        get = self.buckets.get
        buckets = self.buckets
        refused_due = self.refused_due
        owned = None if self.ownership is None else self._owned
        fenced, fenced_results = self.fenced, self.fenced_results
        for _ in range(FEED_BATCHES_PER_TICK):
            batch = changes(self.feed_seq, FEED_BATCH)
            if not batch:
                self._caught_up = True
                break
            if batch[0].seq != self.feed_seq + 1 and self.store.skip_is_loss(
                self.feed_seq, batch[0].seq
            ):
                self._feed_gap(batch[0].seq, now)  # changes trimmed before they were read
            flow = self._flow_minute(now)
            self._record_lag(batch)
            mine = batch
            any_fenced = bool(fenced or fenced_results)  # the usual case: neither
            if owned is not None:  # a fleet node applies and counts only the keys it owns
                keys = owned([ch.key for ch in batch]) or ()
                mine = [ch for ch in batch if ch.key in keys]
            for ch in mine:
                # The input side (docs/accounting.md): whether a write other
                # than the node's own write-back takes a due row out. In a
                # fleet the log names the node of a write-back; another
                # node's (its lease, granted before a membership change
                # moved the key here, ending) reads as an outside write.
                own_write_back = ch.origin == ORIGIN_WRITEBACK
                # A fenced key held here again (keeper/owned.py): its lease
                # is another list's, and the row held here a new occurrence,
                # which any write, this node's write-back of that lease's
                # result included, takes out as a withdrawal.
                fenced_here = any_fenced and (
                    ch.key in fenced or ch.seq <= fenced_results.get(ch.key, -1)
                )
                if fenced_here and own_write_back:
                    own_write_back = False
                    fenced_results.pop(ch.key, None)
                before = None if loading or own_write_back else get(ch.key)
                leased = (
                    before is not None
                    and not fenced_here
                    and self._leased_now(ch.key, before, exclude)
                )
                if leased:
                    # A write to a row while it is leased: the lease's end
                    # may not follow it (docs/accounting.md, the edges).
                    self.leased_writes += 1
                if refused_due and ch.key in refused_due and not loading:
                    # A row the keeper refused while due (counted received,
                    # never waiting), written again or deleted: it leaves.
                    refused_due.discard(ch.key)
                    self.withdrawn += 1
                if ch.op == OP_DELETE or not ch.valid:
                    remove(ch.key)
                    if before is not None and not leased:
                        self._withdraw(ch.key, before, None)
                    if loading or self._reading:
                        tombstones[ch.key] = ch.seq
                    if ch.op == OP_DELETE:
                        flow["removed"] += 1
                    else:
                        self.stats.apply["invalid"] += 1
                    continue
                try:
                    apply(ch.key, ch.seq, ch.route, ch.cadence_s, ch.sitemap, ch.due_at)  # type: ignore[arg-type]  # an upsert carries both
                except TooManyClasses:
                    remove(ch.key)
                    self.stats.apply["refused_classes"] += 1
                    buckets.refused_keys.append(ch.key)
                    if not loading and int(ch.due_at // 60) <= buckets.due_through:  # type: ignore[operator]  # an upsert carries due_at
                        # Due per the store, and held nowhere: received, never
                        # waiting, so the input law shows it until a write
                        # takes the row out (below).
                        if ch.key not in refused_due:
                            buckets.came_due += before is None or before[0] > buckets.due_through
                            refused_due.add(ch.key)
                else:
                    if before is not None and not leased:
                        self._withdraw(ch.key, before, get(ch.key))
                if ch.key in exclude:
                    # Inserted again while out (deleted and written back
                    # during its lease): it stays out.
                    detach(ch.key)
                    if ch.origin != ORIGIN_WRITEBACK:
                        # A new write of a key with misses clears them.
                        self.leases.clear_on_write(ch.key)
                elif ch.op == OP_INSERT and ch.key in out:
                    detach(ch.key)  # inserted again while a live set holds it
                if ch.op == OP_INSERT:
                    flow["added"] += 1
                elif ch.origin == ORIGIN_WRITEBACK:
                    flow["rescheduled"] += 1
                else:
                    flow["updated"] += 1
            self.feed_seq = batch[-1].seq
            applied += len(batch)
            if len(batch) < FEED_BATCH:
                self._caught_up = True
                break
            if time.perf_counter() - t0 >= FEED_TICK_BUDGET_S:
                self._caught_up = False  # the rest at the next tick (a backlog: polled)
                break
        else:
            self._caught_up = False
        if applied:
            self.state.note_applied(self.feed_seq)  # for a writer timing commit to applied
            spent = time.perf_counter() - t0
            self.stats.apply["changes"] += applied
            self.stats.apply["feed_s"] += spent
            metrics.observe_apply(spent / applied)
        if applied and not self._loading and self._caught_up and self._doubt is None:
            self._set_exact(True, now)
        return applied

    def _withdraw(
        self, key: str, before: tuple[int, int, int], after: tuple[int, int, int] | None
    ) -> None:
        """Count ``withdrawn`` when a write took a row no lease holds out of
        the due state (``before`` and ``after``: its ``(minute, class,
        version)`` in the buckets; ``after`` None: removed). A held or parked
        key is waiting, so it counts; a leased one was routed, and its
        lease's end decides (a result, or requeued): the caller leaves it out.
        A key a miss holds is remembered: a late result takes the withdrawal
        back (keeper/owned.py, ``missed_out``)."""
        through = self.buckets.due_through
        if before[0] <= through and (after is None or after[0] > through):
            self.withdrawn += 1
            self._note_missed_out(key)

    def _record_lag(self, batch: list[Any]) -> None:
        """Each change's commit-to-applied lag into its origin's window, in
        one pass; the histogram gets only the batch's oldest change of each
        (an observation costs a few µs in multiprocess mode)."""
        wall = time.time()
        node: list[float] = []
        outside: list[float] = []
        for ch in batch:
            (outside if ch.origin == ORIGIN_EXTERNAL else node).append(wall - ch.at)
        if node:
            self.stats.lag_node.add_many(node, wall)
            metrics.observe_lag("node", node[0])
        if outside:
            self.stats.lag_outside.add_many(outside, wall)
            metrics.observe_lag("outside", outside[0])

    # -- loading --------------------------------------------------------------

    def _load_step(self, now: float) -> None:
        rows, bad, after = self.store.walk_schedule(self._load_after, LOAD_CHUNK)
        if self.ownership is not None:  # a fleet node loads only the rows it owns
            mine = self._owned([row[0] for row in rows] + [b.key for b in bad]) or set()
            past = self._saved_ownership
            if past is not None and past != self.ownership:
                self._note_left_out(past, [row for row in rows if row[0] not in mine], now)
            rows = [row for row in rows if row[0] in mine]
            bad = [b for b in bad if b.key in mine]
        load = self.stats.load
        load["rows"] += len(rows) + len(bad)
        load["unreadable"] += len(bad)
        _applied, refused = self.buckets.load_rows(rows, self._tombstones)
        self.stats.apply["refused_classes"] += refused
        if self.exclude:  # leased before this keeper started: keep them out
            exclude = self.exclude
            self.buckets.detach_many([row[0] for row in rows if row[0] in exclude])
        self._load_after = after
        walked = load["rows"]
        if after is None:
            self._loading = False
            self._tombstones = {}
            self.drain_feed(now)
            self.state.note_applied(self.feed_seq)  # the whole table held through it
            self.stats.load["done_s"] = round(time.perf_counter() - self._t_start, 4)
            self.status = "live"
            self._start_received(now)
            self._set_exact(self._caught_up and self._doubt is None, now)
            self.next_publish = 0.0  # publish the complete picture at once
            self.next_state = 0.0
        else:
            self.state.heartbeat(now, "loading", False, f"walking {walked} rows")

    def _note_left_out(self, past: Ownership, rows: list[tuple], now: float) -> None:
        """Of the rows a load step leaves out (another node's now), keep
        those the saved counts' ownership owned and that may be due by the
        load's end, for the moves it counts then (keeper/report.py)."""
        if not rows:
            return
        kept = set(past.mine([row[0] for row in rows]))
        through = int(now // 60) + LEFT_OUT_AHEAD_MIN
        left = self._left_out
        for key, version, _route, _cadence_s, _sitemap, due_at in rows:
            minute = int(due_at // 60)
            if key in kept and minute <= through:
                left[key] = (minute, version)

    def resume_seq(self) -> int:
        """The change-log position a keeper starting after this one died
        would resume from: what the saved input counts include (a successor
        replays the rest, ``_start_received``), never past what was applied."""
        return min(self.feed_seq, self._saved_seq)

    def _trim(self, now: float) -> None:
        self.next_trim = now + TRIM_INTERVAL_S
        through = self.resume_seq()
        if self.ownership is not None:
            # A fleet's log is shared: trimmed only through the lowest
            # position every live node reported with its heartbeat
            # (docs/fleet.md). Every node trims so, idempotently: no
            # election, and no trim stops while any node is live.
            through = 0 if self.fleet is None else min(through, self.fleet.trim_through())
        self.stats.store["trims"] += 1
        self.stats.store["trim_through"] = through
        if through:
            try:
                if self.store.trim_changes(through) >= TRIM_CHUNK:
                    self.next_trim = now + TRIM_SOON_S  # stopped short, most likely
            except StoreError as exc:  # locked by another writer: the next trim catches up
                self._write_failed("trim_changes", exc, now)
