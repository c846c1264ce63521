"""The keeper: worker 0, the one process that holds the node's schedule.

It does nothing but keep. One ``tick(now)`` at a time it

1. applies the change feed (every insert, update and delete, in seq order);
2. while loading, walks the table one chunk further;
3. once a second writes the best K due keys into the ready set, and under
   claim load the next K ahead (``publish``), then re-reads the top of what
   it published;
4. every few seconds writes its counts into the state buffer;
5. walks the table slowly to verify itself, every ``verify_interval_s``;
6. answers questions from workers (explain a key, dump, verify now).

Time is passed in (``tick(now)``), so every timing path is testable without
sleeping; ``keeper.__main__`` is the loop that feeds it the wall clock.

Loading and repairs follow one rule: **versions decide**. A row's version is
the seq of the change that made it, so a walked or re-read row never
overwrites what a newer event already put in the buckets, and a delete seen
during the load leaves a tombstone that an older walked row cannot pass.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Set as AbstractSet
from typing import Any

import msgpack

from keeper.buckets import Buckets, Columns
from keeper.classes import ClassTable
from keeper.lag import LagWindow
from node.config import Config
from node.core import log, metrics
from node.core.errors import NodeError, TooManyClasses
from node.core.rows import OP_DELETE, OP_INSERT, ORIGIN_EXTERNAL, ORIGIN_WRITEBACK
from node.store.base import BadRow, Store

# Rows per load step: large enough that 250k rows load in a dozen steps,
# small enough that the first publish comes within tens of milliseconds.
# What ``dump`` writes, in <data-dir>/run (tests compare it with the table).
DUMP_FILE = "keeper-dump.msgpack"
LOAD_CHUNK = 20_000
# Changes read per feed query. A burst larger than this is applied over
# several queries in the same tick.
FEED_BATCH = 5_000
# The most feed batches applied in one tick before the keeper publishes and
# checks in again; a flood of writes must not starve the publish.
FEED_BATCHES_PER_TICK = 40
# Writes made by other programs do not post the wake semaphore; polling the
# feed this often sees them within the contract's 50 ms.
OUTSIDE_POLL_S = 0.02
# The change log is trimmed this often (cheap, but not on every tick).
TRIM_INTERVAL_S = 5.0
# After each publish the top of the set is re-read from the store; each key
# at most once a minute so a stuck head does not cost a read per second.
TOP_CHECK = 64
TOP_CHECK_EVERY_S = 60.0
# Under claim load the keeper publishes dozens of times a second (each set
# drained, low water): the top is checked at most this often, and the record
# of checked keys trimmed at most this often (a trim walks all of it).
TOP_CHECK_MIN_S = 0.25
TOP_TRIM_S = 10.0
# Rows compared per verification step; with a 20 ms tick this walks about
# 100k rows a second while leaving the feed and the publish their time.
VERIFY_CHUNK = 2_000
# Minutes of flow kept (the contract's "last hour").
FLOW_MINUTES = 60
# Claimers ask for the next set; after a set less than half full (a few
# keys due: claimers would drain each at once), honoured at most this often.
LOW_WATER_MIN_S = 0.01
# Class rows in the state document; more are summarised and flagged truncated.
STATE_CLASS_ROWS = 1_000
# Lateness bins of the state document, in lateness / cadence: bin i holds the
# due rows with edges[i] <= ratio < edges[i + 1], the last bin the rest.
LATENESS_EDGES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
LATENESS_LABELS = ("<0.25", "0.25-0.5", "0.5-1", "1-2", "2-4", ">=4")
# Routes listed one by one in the lateness group (the busiest first).
STATE_ROUTE_ROWS = 200
# Flow counts per minute, in the order the document lists them.
FLOW_FIELDS = ("came_due", "added", "updated", "triggered", "rescheduled", "removed")
# The store meta entry that carries the lifetime received count over restarts.
RECEIVED_META = "received"


class _Stats:
    """Figures the keeper reports in the trust group of queue-state."""

    def __init__(self) -> None:
        self.load: dict[str, Any] = {
            "rows": 0,
            "unreadable": 0,
            "started_at": None,
            "first_publish_s": None,
            "done_s": None,
        }
        self.publish: dict[str, Any] = {"count": 0, "last_ms": None, "max_ms": 0.0, "size": 0}
        self.verify: dict[str, Any] = {
            "runs": 0,
            "last_at": None,
            "last_s": None,
            "compared": 0,
            "repairs": 0,
            "repairs_feed_missed": 0,
            "repairs_membership": 0,
            "top_checked": 0,
            "top_repairs": 0,
        }
        self.apply: dict[str, Any] = {
            "changes": 0,
            "invalid": 0,
            "refused_classes": 0,
            "feed_s": 0.0,  # time in drain_feed, reading the feed included
        }
        # Commit-to-applied lag of recent changes, by origin, for p50/p99.
        self.lag_node = LagWindow()
        self.lag_outside = LagWindow()

    def lag_figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, window in (("node", self.lag_node), ("outside", self.lag_outside)):
            figures = window.figures()
            if figures is not None:
                out[name] = figures
        changes = self.apply["changes"]
        out["apply_us"] = round(self.apply["feed_s"] * 1e6 / changes, 3) if changes else None
        return out


class _VerifyWalk:
    """Progress of one verification walk: the table in key order, then the
    keeper's own keys (to find rows the table no longer has)."""

    def __init__(self, started_at: float, total: int) -> None:
        self.started_at = started_at
        self.total = max(total, 1)
        self.after: str | None = None
        self.table_done = False
        self.own_keys: list[str] | None = None
        self.own_pos = 0
        self.compared = 0
        self.repairs = 0


class Keeper:
    def __init__(
        self,
        config: Config,
        store: Store,
        ready: Any,
        state: Any,
        *,
        test_hooks: bool = False,
        leases: Any = None,
    ) -> None:
        self.config = config
        # The lease table (shm/leases.py), once the work path runs: its
        # leased, held and parked keys are left out of every publish.
        self.leases = leases
        self.store = store
        self.ready = ready
        self.state = state
        self.test_hooks = test_hooks
        self.classes = ClassTable(config)
        self.buckets = Buckets(self.classes, remember_best=leases is not None)
        self.status = "loading"
        self.exact = False
        self.feed_seq = 0
        self.stats = _Stats()
        self.paused_routes: frozenset[str] = frozenset()
        self.paused_node = False
        # Occurrences that came due (``received``): the count saved by the
        # last run plus what this run's buckets counted since its load.
        self._received_base = 0
        self._came_due_offset = 0
        self._received_saved: dict[str, int] | None = None
        # Counter values at the last flow sample: the deltas go to the minute.
        self._came_due_mark = 0
        self._grants_mark: int | None = None
        # Keys left out of the last publish because they were leased, held or
        # parked (the lease table's own record of what it reported, kept in
        # step by excluded_changes): a new write of one clears its misses and hold.
        self.exclude: AbstractSet[str] = leases.excluded if leases is not None else frozenset()
        self._load_after: str | None = None
        self._loading = True
        self._tombstones: dict[str, int] = {}
        self._verify: _VerifyWalk | None = None
        self._top_checked: dict[str, float] = {}
        self._top_check_due = 0.0
        self._top_trim_due = 0.0
        # The sets claimers may still take from, by ready-set slot, best first:
        # the active one and the next, published ahead (shm/ready.py), each
        # as written. With a lease table their keys are detached while their
        # set is live (``_out``), so that the next set leaves them out; a set
        # claimers moved on from is retired at the next publish: its keys
        # come back but for those the lease table now keeps out.
        self._sets: dict[int, list[str]] = {}
        self._out: set[str] = set()
        # The keys of ``_out`` the lease table keeps out too (granted from a
        # live set, nearly always): they stay detached when their set retires.
        self._out_excluded: set[str] = set()
        self._flow: deque[tuple[int, dict[str, int]]] = deque(maxlen=FLOW_MINUTES)
        self._caught_up = False
        self.next_publish = 0.0
        self.next_state = 0.0
        self.next_trim = 0.0
        self.next_verify = 0.0
        self._published_at = 0.0

    # -- start -----------------------------------------------------------

    def start(self, now: float) -> None:
        """Subscribe first, then walk: the feed position is taken before the
        first row is read, so nothing written during the walk is missed."""
        self.feed_seq = self.store.last_seq()
        self.buckets.reserve(self.store.count())
        self.stats.load["started_at"] = now
        self._t_start = time.perf_counter()
        self._read_paused()
        if self.leases is not None:
            self.leases.forget_changes()  # the first publish learns every key out
        saved = self.store.get_meta(RECEIVED_META)
        if isinstance(saved, dict):
            self._received_saved = saved
        self.next_verify = now + self.config.verify_interval_s
        self.state.heartbeat(now, "loading", False, "walking 0 rows")

    # -- one step -------------------------------------------------------------

    def tick(self, now: float) -> float:
        """Do what is due at ``now``; return how long the caller may wait
        (on the wake semaphore) before the next tick."""
        self.drain_feed(now)
        if self._loading:
            self._load_step(now)
        self._sample_flow(now)
        low = self.ready_low(now)
        if now >= self.next_publish:
            self.publish(now)
        elif low and (self.leases is None or not self.ready.pending()):
            # Claimers took from the active set: write the next one while
            # they drain it (none without a lease table to keep it apart).
            self.publish(now, ahead=self.leases is not None)
        if now >= self.next_state:
            self.write_state(now)
        if self._verify is not None:
            self._verify_step(now)
        elif not self._loading and now >= self.next_verify:
            self.start_verify(now)
        if now >= self.next_trim:
            self._trim(now)
        if self._loading:
            return 0.0
        wait_s = min(self.next_publish - now, OUTSIDE_POLL_S)
        if self.ready.low_water:
            # A request that came within _low_water_min_s of the last publish
            # stays pending (its claimer posted the wake once): honour it as
            # soon as it may be, not at the next poll.
            wait_s = min(wait_s, self._published_at + self._low_water_min_s() - now)
        return max(0.0, wait_s)

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
        for _ in range(FEED_BATCHES_PER_TICK):
            batch = changes(self.feed_seq, FEED_BATCH)
            if not batch:
                self._caught_up = True
                break
            flow = self._flow_minute(now)
            self._record_lag(batch)
            for ch in batch:
                if ch.op == OP_DELETE or not ch.valid:
                    remove(ch.key)
                    if loading:
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
        else:
            self._caught_up = False
        if applied:
            spent = time.perf_counter() - t0
            self.stats.apply["changes"] += applied
            self.stats.apply["feed_s"] += spent
            metrics.observe_apply(spent / applied)
        if applied and not self._loading and self._caught_up:
            self._set_exact(True, now)
        return applied

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

    def _flow_minute(self, now: float) -> dict[str, int]:
        minute = int(now // 60)
        if not self._flow or self._flow[-1][0] != minute:
            self._flow.append((minute, dict.fromkeys(FLOW_FIELDS, 0)))
        return self._flow[-1][1]

    def _sample_flow(self, now: float) -> None:
        """Move what the buckets and the lease table counted since the last
        sample into the current minute: rows that came due, leases granted."""
        came_due = self.buckets.came_due
        grants = self.leases.counters()["grants"] if self.leases is not None else 0
        if self._grants_mark is None:
            self._grants_mark = grants  # granted before this keeper started: not its flow
        if came_due == self._came_due_mark and grants == self._grants_mark:
            return
        flow = self._flow_minute(now)
        if not self._loading:  # a load's rows are restored, not new occurrences
            flow["came_due"] += came_due - self._came_due_mark
        flow["triggered"] += grants - self._grants_mark
        self._came_due_mark, self._grants_mark = came_due, grants

    # -- loading --------------------------------------------------------------

    def _load_step(self, now: float) -> None:
        rows, bad, after = self.store.walk_schedule(self._load_after, LOAD_CHUNK)
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
            self.stats.load["done_s"] = round(time.perf_counter() - self._t_start, 4)
            self.status = "live"
            self._start_received(now)
            self._set_exact(self._caught_up, now)
            self.next_publish = 0.0  # publish the complete picture at once
            self.next_state = 0.0
        else:
            self.state.heartbeat(now, "loading", False, f"walking {walked} rows")

    def _start_received(self, now: float) -> None:
        """At the end of the load: the lifetime received count is the saved
        one plus the rows that came due while no keeper counted them (due
        minutes after the saved minute, through now). From here the buckets
        count (``came_due``)."""
        minute = int(now // 60)
        self.buckets.advance(minute)
        saved = self._received_saved or {}
        since = int(saved.get("minute", -(2**31)))
        self._received_base = int(saved.get("total", 0)) + (
            self.buckets.count_due_between(since, minute) if since < minute else 0
        )
        self._came_due_offset = self.buckets.came_due
        self._came_due_mark = self.buckets.came_due

    def received(self) -> int:
        """Occurrences that came due, lifetime (counted once the load is done)."""
        if self._loading:
            return int((self._received_saved or {}).get("total", 0))
        return self._received_base + self.buckets.came_due - self._came_due_offset

    def _save_received(self, now: float) -> None:
        """Keep the received count over a restart: the count through the
        current minute (the buckets have advanced to it)."""
        if self._loading:
            return
        value = {"total": self.received(), "minute": int(now // 60)}
        try:
            self.store.set_meta(RECEIVED_META, value)
        except NodeError as exc:  # a locked or full store: the next write catches up
            log.warn("received_save_failed", error=str(exc))

    def _read_paused(self) -> None:
        self.paused_routes = frozenset(self.store.get_meta("paused_routes", []) or [])
        self.paused_node = bool(self.store.get_meta("paused_node", False))

    def reload_paused(self, now: float) -> dict[str, Any]:
        """Re-read pause and resume from the store and publish at once."""
        self._read_paused()
        self.publish(now)
        self.next_state = 0.0  # queue-state shows it at the next tick
        return {"ok": True, "paused_routes": sorted(self.paused_routes),
                "paused_node": self.paused_node}

    # -- publishing -----------------------------------------------------------

    def ready_low(self, now: float) -> bool:
        """Claimers asked for the next set: honoured at once after a set at
        least half full, else at most every LOW_WATER_MIN_S."""
        if self._published_at + self._low_water_min_s() > now:
            return False
        return self.ready.take_low_water()

    def _low_water_min_s(self) -> float:
        """How soon after the last publish a request is honoured: at once
        when that set was at least half full (claimers drain thousands a
        request, and each next set is worth writing: the next set published
        ahead must not wait), else LOW_WATER_MIN_S, against a storm of
        publishes of a few keys each."""
        if self.stats.publish["size"] * 2 >= self.config.ready_size:
            return 0.0
        return LOW_WATER_MIN_S

    def publish(self, now: float, ahead: bool = False) -> None:
        """Publish the best due keys: a fresh set claimers take from at once,
        or (``ahead``, with a lease table) the next set, which leaves the
        active set's keys out and which claimers switch to when the active
        set is drained."""
        t0 = time.perf_counter()
        keep_out = self.leases is not None
        if keep_out:
            self._follow_leases(now)
            self._retire(self.ready.active_slot if ahead else None)
        if self.paused_node:
            columns: Columns = ([], [], [], [], [])
        else:
            columns = self.buckets.best_columns(
                now, self.config.ready_size, paused_routes=self.paused_routes, detach=keep_out
            )
        written = self.ready.publish_columns(*columns, now, ahead=ahead)
        keys = columns[0]
        if written < len(keys):
            if keep_out:  # the heap was full: the rest were not published
                self.buckets.attach_many(keys[written:])
            del keys[written:]
        if keep_out:
            self._out.update(keys)
        self._sets[self.ready.last_slot] = keys
        spent = time.perf_counter() - t0
        metrics.observe_publish(spent)
        ms = spent * 1000
        pub = self.stats.publish
        pub["count"] += 1
        pub["last_ms"] = round(ms, 3)
        pub["max_ms"] = max(pub["max_ms"], round(ms, 3))
        pub["size"] = len(keys)
        if pub["count"] == 1:
            self.stats.load["first_publish_s"] = round(time.perf_counter() - self._t_start, 4)
        self._published_at = now
        self.next_publish = now + self.config.publish_interval_s
        self.state.heartbeat(now, self.status, self.exact, self._phase(), published=True)
        if not self._loading:
            self._check_top(keys[:TOP_CHECK], now)

    def _follow_leases(self, now: float) -> None:
        """Keep the leased, held and parked keys out of the publish: a key
        that became one since the last publish is detached from its class's
        order (it stays in every count), one that no longer is comes back.
        The lease table reports only what changed (``excluded_changes``), so
        the cost follows the keys that changed, not the keys out; the grant
        records claimers left in the live sets name the slots of most of
        those, so the scan need not read them. A key of a live set is
        detached already, and stays so until its set retires."""
        hints = []
        for slot, keys in self._sets.items():
            records = self.ready.grant_records(slot)
            if records is not None and keys:
                view, count, tag = records
                hints.append((view, keys, min(count, len(keys)), tag))
        added, removed = self.leases.excluded_changes(now, hints)
        out, both = self._out, self._out_excluded
        if removed:  # no slot holds these out any more (first: a key can be in both)
            ended = out.intersection(removed)
            if ended:
                both -= ended
                removed = [key for key in removed if key not in ended]
            self.buckets.attach_many(removed)
        if added:
            # The first keys added were settled from the live sets' grant
            # records: the sets' own strs, detached already.
            hinted = self.leases.hinted_added
            both.update(added[:hinted] if hinted < len(added) else added)
            if hinted == len(added):
                return
            rest = added[hinted:]
            granted = out.intersection(rest)
            if granted:
                both |= granted
                rest = [key for key in rest if key not in granted]
            self.buckets.detach_many(rest)

    def _retire(self, keep: int | None) -> None:
        """Retire every live set but the one in slot ``keep``: claimers have
        moved on from it (or a fresh set replaces them all). Its keys leave
        ``_out`` and come back into the orders, but for those the lease table
        keeps out (call after ``_follow_leases``)."""
        out, both = self._out, self._out_excluded
        for slot in [slot for slot in self._sets if slot != keep]:
            keys = self._sets.pop(slot)  # no key twice
            out.difference_update(keys)
            before = len(both)
            both.difference_update(keys)
            if before - len(both) < len(keys):
                # Not all granted (the common case is a set drained and all
                # granted): the rest come back. Of a live set's keys, those
                # in ``both`` are exactly those the lease table keeps out.
                exclude = self.exclude
                self.buckets.attach_many([key for key in keys if key not in exclude])

    def _phase(self) -> str:
        if self._loading:
            return f"walking {self.stats.load['rows']} rows"
        if self._verify is not None:
            done = self._verify.compared * 100 // self._verify.total
            return f"verifying {min(done, 100)}%"
        return "serving" if self.exact else "catching up"

    def _set_exact(self, exact: bool, now: float) -> None:
        if exact != self.exact:
            self.exact = exact
            self.state.heartbeat(now, self.status, self.exact, self._phase())

    # -- self checks ------------------------------------------------------------

    def _check_top(self, top: list[str], now: float) -> None:
        if self._top_check_due - TOP_CHECK_MIN_S <= now < self._top_check_due:
            return  # checked moments ago (a clock stepped back does not count)
        checked = self._top_checked
        keys = [key for key in top if checked.get(key, 0.0) + TOP_CHECK_EVERY_S <= now]
        if not keys:
            return
        self._top_check_due = now + TOP_CHECK_MIN_S
        for key in keys:
            checked[key] = now
        if len(checked) > 50 * TOP_CHECK and now >= self._top_trim_due:
            self._top_trim_due = now + TOP_TRIM_S
            cutoff = now - TOP_CHECK_EVERY_S
            self._top_checked = {k: t for k, t in checked.items() if t > cutoff}
        snap_seq = self.store.last_seq()
        rows = self.store.get_many(keys)
        self.drain_feed(now)
        repaired = sum(self._reconcile(key, rows.get(key), snap_seq) for key in keys)
        self.stats.verify["top_checked"] += len(keys)
        self.stats.verify["top_repairs"] += repaired

    def _reconcile(self, key: str, row: Any, snap_seq: int) -> bool:
        """Make the buckets agree with ``row`` (read after ``snap_seq`` was
        taken, and before the feed was drained). Returns True on a repair.

        Versions decide: a held version newer than the row means an event
        arrived after the read, and the event wins."""
        held = self.buckets.get(key)
        if row is None or isinstance(row, BadRow):
            dead_version = snap_seq if row is None else row.version
            if held is not None and held[2] <= dead_version:
                self.buckets.remove(key)
                return True
            return False
        if row.version > self.feed_seq:
            return False  # the feed will bring it
        if held is not None and held[2] > row.version:
            return False
        try:
            cid = self.classes.class_of(row.route, row.cadence_s, row.sitemap)
        except TooManyClasses:
            return False
        if held is not None and held == (int(row.due_at // 60), cid, row.version):
            return False
        self.buckets.remove(key)
        self.buckets.apply(key, row.version, row.route, row.cadence_s, row.sitemap, row.due_at)
        if key in self.exclude or key in self._out:
            self.buckets.detach(key)
        return True

    def start_verify(self, now: float) -> None:
        if self._verify is None and not self._loading:
            self._verify = _VerifyWalk(now, self.store.count() + len(self.buckets))
            self.status = "verifying"
            self.state.heartbeat(now, self.status, self.exact, self._phase())

    def _verify_step(self, now: float) -> None:
        walk = self._verify
        assert walk is not None
        snap_seq = self.store.last_seq()
        if not walk.table_done:
            rows = self.store.walk(walk.after, VERIFY_CHUNK)
            self.drain_feed(now)
            for row in rows:
                if self._reconcile(row.key, row, snap_seq):
                    walk.repairs += 1
            walk.compared += len(rows)
            if rows:
                walk.after = rows[-1].key
            if len(rows) < VERIFY_CHUNK:
                walk.table_done = True
                walk.own_keys = [item[0] for item in self.buckets.items()]
            return
        assert walk.own_keys is not None
        keys = walk.own_keys[walk.own_pos : walk.own_pos + VERIFY_CHUNK]
        walk.own_pos += len(keys)
        found = self.store.get_many(keys)
        self.drain_feed(now)
        for key in keys:
            if key not in found and self._reconcile(key, None, snap_seq):
                walk.repairs += 1
        walk.compared += len(keys)
        if walk.own_pos >= len(walk.own_keys):
            self._finish_verify(now)

    def _finish_verify(self, now: float) -> None:
        walk = self._verify
        assert walk is not None
        v = self.stats.verify
        v["runs"] += 1
        v["last_at"] = now
        v["last_s"] = round(now - walk.started_at, 3)
        v["compared"] = walk.compared
        v["repairs"] += walk.repairs
        v["repairs_feed_missed"] += walk.repairs
        v["last_repairs"] = walk.repairs
        self._verify = None
        self.status = "live"
        self.next_verify = now + self.config.verify_interval_s
        self.state.heartbeat(now, self.status, self.exact, self._phase())

    def _trim(self, now: float) -> None:
        self.next_trim = now + TRIM_INTERVAL_S
        if self.feed_seq:
            self.store.trim_changes(self.feed_seq)

    # -- reporting --------------------------------------------------------------

    def counts_doc(self, now: float) -> dict[str, Any]:
        counts = self.buckets.counts(now)
        per_class = counts["per_class"]
        oldest = self.buckets.oldest_due(now)
        class_rows = []
        for cid, (rows, due) in per_class.items():
            head = oldest.get(cid)
            class_rows.append(
                {
                    **self._class_identity(cid),
                    "rows": rows,
                    "due": due,
                    "oldest_due_minute": head,
                    "oldest_lateness_ratio": (
                        None
                        if head is None
                        else round((now - head * 60) / self.classes.info(cid).cadence_s, 4)
                    ),
                }
            )
        class_rows.sort(key=lambda c: (-(c["due"]), c["route"]))
        truncated = len(class_rows) > STATE_CLASS_ROWS
        return {
            "now": {
                "due": counts["due"],
                "rows": len(self.buckets),
                "classes": len(self.classes),
                "paused": sorted(self.paused_routes),
                "paused_node": self.paused_node,
            },
            "coming": self.buckets.coming(now),
            "lateness": self._lateness_doc(now, oldest, per_class),
            "classes": class_rows[:STATE_CLASS_ROWS],
            "classes_truncated": truncated,
            "flow": self._flow_doc(),
            "counters": {"received": self.received()},
            "trust": {
                "phase": self._phase(),
                "load": self.stats.load,
                "publish": self.stats.publish,
                "verify": self.stats.verify,
                "apply": self.stats.apply,
                "lag": self.stats.lag_figures(),
                "feed_seq": self.feed_seq,
            },
        }

    def _class_identity(self, cid: int) -> dict[str, Any]:
        info = self.classes.info(cid)
        return {"route": info.route, "cadence_s": info.cadence_s, "source": info.source,
                "sitemap": info.sitemap, "boost": info.boost}

    def _lateness_doc(
        self, now: float, oldest: dict[int, int], per_class: dict[int, tuple[int, int]]
    ) -> dict[str, Any]:
        """Due rows by lateness / cadence (bins of LATENESS_EDGES), by kind
        and by route, and the oldest due row of every class."""
        bins = len(LATENESS_EDGES)
        kinds = {"sitemap": [0] * bins, "discovered": [0] * bins}
        routes: dict[str, list[int]] = {}
        for cid, counts in self.buckets.lateness(now, LATENESS_EDGES).items():
            info = self.classes.info(cid)
            kind = kinds["sitemap" if info.sitemap else "discovered"]
            route = routes.setdefault(info.route, [0] * bins)
            for i, n in enumerate(counts):
                kind[i] += n
                route[i] += n
        busiest = sorted(routes, key=lambda r: (-sum(routes[r]), r))
        heads = []
        for cid, minute in oldest.items():
            info = self.classes.info(cid)
            lateness_s = round(now - minute * 60, 3)
            heads.append({**self._class_identity(cid), "due": per_class.get(cid, (0, 0))[1],
                          "oldest_due_minute": minute, "lateness_s": lateness_s,
                          "lateness_ratio": round(lateness_s / info.cadence_s, 4)})
        heads.sort(key=lambda h: (-h["lateness_ratio"], h["route"]))
        return {
            "edges": list(LATENESS_EDGES),
            "labels": list(LATENESS_LABELS),
            **kinds,
            "total": [a + b for a, b in zip(kinds["sitemap"], kinds["discovered"], strict=True)],
            "by_route": {r: routes[r] for r in busiest[:STATE_ROUTE_ROWS]},
            "by_route_truncated": len(busiest) > STATE_ROUTE_ROWS,
            "oldest": heads[:STATE_CLASS_ROWS],
            "oldest_truncated": len(heads) > STATE_CLASS_ROWS,
        }

    def _flow_doc(self) -> dict[str, Any]:
        minutes = [{"minute": m, **c} for m, c in self._flow]
        last_hour = dict.fromkeys(FLOW_FIELDS, 0)
        for _m, c in self._flow:
            for name in FLOW_FIELDS:
                last_hour[name] += c[name]
        return {"minutes": minutes, "last_hour": last_hour}

    def write_state(self, now: float) -> None:
        self.next_state = now + self.config.state_interval_s
        self._read_paused()  # a pause written while no keeper was asked
        self._sample_flow(now)
        self.state.write_doc(self.counts_doc(now), now)
        self._save_received(now)

    # -- questions from workers -----------------------------------------------------

    def answer(self, request: dict[str, Any], now: float) -> dict[str, Any]:
        op = request.get("op")
        if op == "explain":
            return self.explain(str(request.get("key")), now)
        if op == "reload_paused":
            return self.reload_paused(now)
        if op == "verify":
            self.start_verify(now)
            return {"ok": True, "status": self.status}
        if op == "stats":
            return {"status": self.status, "exact": self.exact, "rows": len(self.buckets),
                    "feed_seq": self.feed_seq, "verify": self.stats.verify,
                    "load": self.stats.load, "apply": self.stats.apply,
                    "lag": self.stats.lag_figures()}
        if op == "dump":
            # Always the one file in the node's own run directory, never a
            # path the request names: the ask queue is the node's, but the
            # keeper writes nothing a message can point elsewhere.
            path = self.config.data_dir.resolve() / "run" / DUMP_FILE
            rows = [list(item) for item in self.buckets.items()]
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(msgpack.packb({"feed_seq": self.feed_seq, "rows": rows}))
            os.replace(tmp, path)
            return {"ok": True, "rows": len(rows), "path": str(path)}
        if op == "corrupt" and self.test_hooks:
            from keeper.test_hooks import corrupt  # only with QUEUE_NODE_TEST_HOOKS=1

            return corrupt(self, request)
        return {"error": f"unknown op {op!r}"}

    def explain(self, key: str, now: float) -> dict[str, Any]:
        held = self.buckets.get(key)
        if held is None:
            return {"held": False, "status": self.status, "exact": self.exact}
        minute, cid, version = held
        info = self.classes.info(cid)
        due = minute <= int(now // 60)
        rank = (now - minute * 60) / info.cadence_s + info.boost if due else None
        active = self.ready.active_slot
        published = list(self._sets.get(active, ()))
        if self.ready.pending():  # claimers take the next set's after the active set's
            published += self._sets.get(1 - active, ())
        position = next((i for i, k in enumerate(published) if k == key), None)
        return {
            "held": True,
            "status": self.status,
            "exact": self.exact,
            "due_minute": minute,
            "version": version,
            "class": {"route": info.route, "cadence_s": info.cadence_s,
                      "source": info.source, "sitemap": info.sitemap, "boost": info.boost},
            "due": due,
            "rank": rank,
            "paused": self.paused_node or info.route in self.paused_routes,
            "in_ready_set": position is not None,
            "left_out": key in self.exclude,
            "ready_position": position,
        }
