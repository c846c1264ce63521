"""The keeper: worker 0, the one process that holds the node's schedule.

It does nothing but keep. One ``tick(now)`` at a time it

1. applies the change feed (every insert, update and delete, in seq order:
   keeper/feed.py);
2. while loading, walks the table one chunk further (keeper/feed.py);
3. once a second writes the best K due keys into the ready set, and under
   claim load the next K ahead, then re-reads the top of what it published
   (keeper/publish.py, keeper/verify.py);
4. every few seconds writes its counts into the state buffer
   (keeper/report.py);
5. walks the table slowly to verify itself, every ``verify_interval_s``
   (keeper/verify.py);
6. between ticks answers questions from workers (``answer``: explain a key,
   dump, verify now; the channel is keeper/ask.py);
7. through a store error keeps serving from memory, reopens the store with
   backoff and resumes the feed, or walks what it may have missed
   (keeper/outage.py).

Time is passed in (``tick(now)``), so every timing path is testable without
sleeping; keeper/loop.py (``python -m keeper``) is the loop that feeds it the
wall clock.

The keeper's state is set in keeper/base.py; ``Keeper`` combines it with each
concern's methods (a class a module: the split costs no call anything).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack

from keeper.feed import LOAD_CHUNK, Feed
from keeper.outage import Outage
from keeper.owned import Owned
from keeper.publish import LOW_WATER_MIN_S, Publish
from keeper.report import FLOW_FIELDS, LATENESS_EDGES, RECEIVED_META, Report
from keeper.verify import Verify
from node.core.errors import StoreError

# What ``dump`` writes, in <data-dir>/run (tests compare it with the table).
DUMP_FILE = "keeper-dump.msgpack"
# Writes made by other programs do not post the wake semaphore; polling the
# feed this often sees them within the contract's 50 ms. On PostgreSQL a
# LISTEN thread wakes the keeper instead (keeper/loop.py), and the poll is a
# fallback ``Keeper.outside_poll_s`` long, kept at this pace while a walk
# steps or a backlog drains.
OUTSIDE_POLL_S = 0.02


# With Keeper, the names other code imports from here (where they were
# before the split into feed, publish, verify and report).
__all__ = ["FLOW_FIELDS", "LATENESS_EDGES", "LOAD_CHUNK", "LOW_WATER_MIN_S", "OUTSIDE_POLL_S",
           "Keeper"]


class Keeper(Feed, Publish, Verify, Report, Outage, Owned):
    """Worker 0: the state of keeper/base.py with the methods of each concern."""

    # How long the loop may wait for a write it is not told of. The loop of a
    # keeper that a LISTEN thread wakes sets it longer (keeper/loop.py).
    outside_poll_s = OUTSIDE_POLL_S

    # -- start -----------------------------------------------------------

    def start(self, now: float) -> None:
        """Subscribe first, then walk: the feed position is taken before the
        first row is read, so nothing written during the walk is missed."""
        self.feed_seq = self.store.last_seq()
        self.state.note_applied(0)  # a killed keeper's figure no longer holds: nothing yet
        self.buckets.reserve(self.store.count())
        self.stats.load["started_at"] = now
        self._t_start = time.perf_counter()
        self._read_paused()
        if self.leases is not None:
            self.leases.forget_changes()  # the first publish learns every key out
        saved = self.store.get_meta(RECEIVED_META)
        if isinstance(saved, dict):
            self._received_saved = saved
            self._saved_ownership = self._ownership_saved_under(saved)
        self.restore_counts()
        self.next_verify = now + self.config.verify_interval_s
        self.state.heartbeat(now, "loading", False, "walking 0 rows")

    # -- one step -------------------------------------------------------------

    def tick(self, now: float) -> float:
        """Do what is due at ``now``; return how long the caller may wait
        (on the wake semaphore) before the next tick. A store error starts
        an outage (keeper/outage.py) instead of ending the keeper."""
        try:
            if self._outage is not None:
                return self._outage_tick(now)
            wait_s = self._tick(now)
            if self._outage is None:
                self.save_counts(now)  # a repair or a store event counted: kept at once
            return wait_s
        except StoreError as exc:
            self._store_failed(exc, now)
            return 0.0
        finally:
            if self.fleet is not None:
                # The deadline a heartbeat earned, once this tick has
                # republished for the list read after it (keeper/fleet.py).
                self.fleet.grant()

    def _tick(self, now: float) -> float:
        if now >= self._next_store_check:
            self._check_store(now)
        self.drain_feed(now)
        self.fleet_tick(now)
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
        elif not self._loading and (now >= self.next_verify or self._doubt is not None):
            self.start_verify(now)
        if now >= self.next_trim:
            self._trim(now)
        if self._loading or self._doubt is not None:
            return 0.0  # loading, or walking what a store error may have missed
        if self.outside_poll_s <= OUTSIDE_POLL_S or self._verify is not None or not self._caught_up:
            # Polling (SQLite), or a walk that steps or a backlog that drains
            # a batch a tick: the old pace.
            wait_s = min(self.next_publish - now, OUTSIDE_POLL_S)
        else:
            # Woken by NOTIFY: until the next timed duty, or the fallback poll.
            wait_s = min(self.next_publish, self.next_state, now + self.outside_poll_s) - now
        if self.ready.low_water:
            # A request that came within _low_water_min_s of the last publish
            # stays pending (its claimer posted the wake once): honour it as
            # soon as it may be, not at the next poll.
            wait_s = min(wait_s, self._published_at + self._low_water_min_s() - now)
        return max(0.0, wait_s)

    # -- questions from workers -----------------------------------------------------

    def answer(self, request: dict[str, Any], now: float) -> dict[str, Any]:
        try:
            return self._answer(request, now)
        except StoreError as exc:
            self._store_failed(exc, now)
            return {"error": f"the store is unreachable: {exc}"}

    def _answer(self, request: dict[str, Any], now: float) -> dict[str, Any]:
        op = request.get("op")
        if op in ("reload_paused", "verify") and self._outage is not None:
            return {"error": f"the store is unreachable: {self._outage.error}"}
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
                    "lag": self.stats.lag_figures(), "store": self.stats.store}
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
