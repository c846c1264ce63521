"""The keeper's self checks. After each publish the top of the set is re-read
from the store (``_check_top``), and every ``verify_interval_s`` a slow walk
compares the whole table with the buckets, then the buckets' own keys with
the table (``start_verify``, a chunk a tick). Both repair what differs, and
**versions decide**: a held version newer than the row read means an event
came after the read, and the event wins.
"""

from __future__ import annotations

from typing import Any

from keeper.base import KeeperBase
from node.core.errors import TooManyClasses
from node.store.base import BadRow

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


class VerifyWalk:
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
        # The doubt this walk answers (keeper/outage.py): a gap found after
        # it started needs another walk.
        self.doubt_gen = 0


class Verify(KeeperBase):
    # -- the top of each publish ------------------------------------------------

    def _check_top(self, top: list[str], now: float) -> None:
        if self._outage is not None:
            return  # no store to re-read: the copy is served as it is
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

    # -- the verification walk --------------------------------------------------

    def start_verify(self, now: float) -> None:
        if self._verify is None and not self._loading:
            self._verify = VerifyWalk(now, self.store.count() + len(self.buckets))
            self._verify.doubt_gen = self._doubt_gen
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
        if self._doubt is not None and walk.doubt_gen == self._doubt_gen:
            self._doubt = None  # the walk after a store error or a gap: exact again
            if self._caught_up:
                self.exact = True
        self.state.heartbeat(now, self.status, self.exact, self._phase())
