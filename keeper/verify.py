"""The keeper's self checks. After each publish the top of the set is re-read
from the store (``_check_top``), and every ``verify_interval_s`` a slow walk
compares the whole table with the buckets, then the buckets' own keys with
the table (``start_verify``, a chunk a tick). Both repair what differs, and
**versions decide**: a held version newer than the row read means an event
came after the read, and the event wins.
"""

from __future__ import annotations

from array import array
from itertools import compress
from operator import not_
from typing import Any, NamedTuple

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
# Rows a step of the repair walk (after a store error or a gap) reads: the
# load's chunk, read as the load reads it, without waiting between steps.
REPAIR_CHUNK = 10_000
# Rows of the copy taken into the repair walk's record a step (~40 ms).
HELD_CHUNK = 50_000
# A repair walk's mark of a slot (``VerifyWalk.met``).
HELD, NO_ROW, MET = 0, 1, 2  # (NO_ROW: Buckets.free_flags' mark of a free slot)


class _Walked(NamedTuple):
    """A row of ``walk_schedule`` as ``_reconcile`` reads one."""

    key: str
    version: int
    route: str
    cadence_s: int | None
    sitemap: bool
    due_at: float


class VerifyWalk:
    """Progress of one verification walk: the table in key order, then the
    keeper's own keys (to find rows the table no longer has)."""

    def __init__(self, started_at: float, total: int) -> None:
        self.started_at = started_at
        self.total = max(total, 1)
        self.after: str | None = None
        self.table_done = False
        # The slots holding a row when the table walk ended (their keys are
        # made a chunk at a time: a str a row for all at once would take
        # about as much memory again as the keys held).
        self.own_slots: array[int] | None = None
        self.own_pos = 0
        self.compared = 0
        self.repairs = 0
        # The doubt this walk answers (keeper/outage.py): a gap found after
        # it started needs another walk.
        self.doubt_gen = 0
        # The walk after a membership change (keeper/owned.py): the rows it
        # adds were gained, counted received and in repairs.membership.
        self.membership = False
        # A repair walk (``_repair_step``): what the copy held at its start,
        # by slot: each slot's version and due minute (``start_vers``,
        # ``start_mins``) and a mark (``met``: HELD, MET once the walk met
        # the key that holds the slot, NO_ROW for a slot free at the start).
        # The keys of the slots still HELD at the end are looked for in the
        # table. 13 bytes a row, where a dict by key took about 63 (and the
        # buckets hold no str a key to share with it).
        self.start_vers: array[int] | None = None
        self.start_mins = array("i")
        self.met = bytearray()
        # The next slot to copy, a step at a time (HELD_CHUNK, so that no
        # step stalls); None once all are.
        self.filling: int | None = None


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
        snap_seq = self._begin_read()
        try:
            rows = self.store.get_many(keys)
            self.drain_feed(now)
            gone_ok = self._fed_through_reads()
            repaired = sum(
                self._reconcile(key, rows.get(key), snap_seq, gone_ok=gone_ok) for key in keys
            )
        finally:
            self._end_read()
        self.stats.verify["top_checked"] += len(keys)
        self.stats.verify["top_repairs"] += repaired

    def _begin_read(self) -> int:
        """Start a self check's read: the seq it is read after, and the feed
        keeps its deletes as tombstones until ``_end_read``."""
        self._tombstones = {}
        self._reading = True
        return self.store.last_seq()

    def _end_read(self) -> None:
        self._reading = False
        self._tombstones = {}

    def _fed_through_reads(self) -> bool:
        """Whether the feed, drained after a check's read, has applied every
        change the read could see: it reached the end of the log (a drain
        stops after its time budget, keeper/feed.py) and no seq it stopped
        at may still commit (PostgreSQL). Otherwise a row the read missed
        may be a delete the feed has still to apply, and count."""
        return self._caught_up and not self.store.holes_pending()

    def _reconcile(
        self, key: str, row: Any, snap_seq: int, gained: bool = False, gone_ok: bool = True
    ) -> bool:
        """Make the buckets agree with ``row`` (read after ``snap_seq`` was
        taken, and before the feed was drained). Returns True on a repair.

        Versions decide: a held version newer than the row means an event
        arrived after the read, and the event wins. ``gone_ok`` False: a
        row the read did not find is left to the feed (its delete may be
        behind the feed's position: the feed applies it, and counts it as
        the input law's withdrawal, which a repair would not)."""
        held = self.buckets.get(key)
        if row is None and not gone_ok:
            return False
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
        if held is None and self._tombstones.get(key, 0) > row.version:
            return False  # deleted after the read, by a change the feed applied since
        try:
            cid = self.classes.class_of(row.route, row.cadence_s, row.sitemap)
        except TooManyClasses:
            return False
        if held is not None and held == (int(row.due_at // 60), cid, row.version):
            return False
        came_due = self.buckets.came_due
        self.buckets.remove(key)
        self.buckets.apply(key, row.version, row.route, row.cadence_s, row.sitemap, row.due_at)
        # A repair puts back what the table held all along: restored state,
        # not an occurrence coming due (docs/accounting.md, the input law).
        # A row a membership change gained (``gained``) comes due here for
        # the first time: received.
        if not gained or held is not None:
            self.buckets.came_due = came_due
        if key in self.exclude or key in self._out:
            self.buckets.detach(key)
        return True

    # -- the verification walk --------------------------------------------------

    def start_verify(self, now: float) -> None:
        if self._verify is None and not self._loading:
            walk = self._verify = VerifyWalk(now, self.store.count() + len(self.buckets))
            walk.doubt_gen = self._doubt_gen
            # A membership change not yet walked counts what the walk adds as
            # gained (received), even when a later doubt (a gap) took its place.
            walk.membership = self._doubt == "membership" or self._reown_pending
            if self._doubt is not None:
                # One pass over the copy (a few tenths of a second at 1M
                # rows, while nothing vouches anyway) spares the walk a
                # reconcile of each row and a read of each own key back from
                # the table.
                walk.start_vers = array("q")
                walk.met = self.buckets.free_flags()
                walk.filling = 0
                walk.total = max(walk.total - len(self.buckets), 1)  # the table alone
            self.status = "verifying"
            self.state.heartbeat(now, self.status, self.exact, self._phase())

    def _verify_step(self, now: float) -> None:
        walk = self._verify
        assert walk is not None
        if walk.start_vers is not None:
            self._repair_step(walk, now)
            return
        if not walk.table_done:
            snap_seq = self._begin_read()
            try:
                rows = self.store.walk(walk.after, VERIFY_CHUNK)
                self.drain_feed(now)
                # A key another program stored that is no text (a blob, text
                # not UTF-8): never held, nothing to compare.
                keyed = [row for row in rows if type(row.key) is str]
                mine = self._owned([row.key for row in keyed])  # a fleet node's own rows only
                for row in keyed if mine is None else [r for r in keyed if r.key in mine]:
                    if self._reconcile(row.key, row, snap_seq):
                        walk.repairs += 1
            finally:
                self._end_read()
            walk.compared += len(rows)
            if rows:
                walk.after = rows[-1].key
            if len(rows) < VERIFY_CHUNK:
                walk.table_done = True
                walk.own_slots = self.buckets.held_slots()
            return
        assert walk.own_slots is not None
        slots = walk.own_slots[walk.own_pos : walk.own_pos + VERIFY_CHUNK]
        walk.own_pos += len(slots)
        # (a slot emptied since holds no key; one taken again holds a key
        # held now, as worth checking)
        keys = self.buckets.keys_at(slots)
        snap_seq = self.store.last_seq()
        found = self.store.get_many(keys)
        self.drain_feed(now)
        gone_ok = self._fed_through_reads()
        for key in keys:
            if key not in found and self._reconcile(key, None, snap_seq, gone_ok=gone_ok):
                walk.repairs += 1
        walk.compared += len(keys)
        if walk.own_pos >= len(walk.own_slots):
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
        v["repairs_membership" if walk.membership else "repairs_feed_missed"] += walk.repairs
        v["last_repairs"] = walk.repairs
        self._verify = None
        self.status = "live"
        self.next_verify = now + self.config.verify_interval_s
        if self._doubt is not None and walk.doubt_gen == self._doubt_gen:
            self._doubt = None  # the walk after a store error or a gap: exact again
            self._reown_pending = False  # started after the last change: the rows are its own
            if self._caught_up:
                self.exact = True
                self.write_state(now)  # its counts with the first 200
        self.state.heartbeat(now, self.status, self.exact, self._phase())

    def _repair_step(self, walk: VerifyWalk, now: float) -> None:
        """One step of the repair walk: the table a chunk in key order, as the
        load reads it; a row the copy held at the walk's start with its
        version and minute is not looked at further, the others are
        reconciled (versions decide); at the end, the keys held at the start
        that the table did not have."""
        assert walk.start_vers is not None
        if walk.filling is not None:
            end = min(walk.filling + HELD_CHUNK, len(walk.met))
            vers, mins = self.buckets.columns_at(walk.filling, end)
            walk.start_vers += vers
            walk.start_mins += mins
            walk.filling = None if end >= len(walk.met) else end
            return
        snap_seq = self._begin_read()
        try:
            rows, bad, after = self.store.walk_schedule(walk.after, REPAIR_CHUNK)
            self.drain_feed(now)
            repairs = self._repair_rows(walk, rows, bad, snap_seq)
        finally:
            self._end_read()
        walk.after = after
        if after is None:
            repairs += self._repair_gone(walk, now)
        walk.repairs += repairs
        if after is None:
            self._finish_verify(now)

    def _repair_rows(
        self, walk: VerifyWalk, rows: list[Any], bad: list[Any], snap_seq: int
    ) -> int:
        """A repair step's chunk reconciled: the rows that differ from what
        the copy held at the walk's start. Returns the repairs."""
        vers, mins, met = walk.start_vers, walk.start_mins, walk.met
        assert vers is not None
        slot_of, copied = self.buckets.slot_of, len(met)

        def take(key: str) -> tuple[int, int] | None:
            """What the copy held at the start in the slot that holds ``key``
            now, the first time it is met (None: no row then, met before, or
            the key held nowhere: those are reconciled)."""
            slot = slot_of(key)
            if slot < 0 or slot >= copied or met[slot] != HELD:
                return None
            met[slot] = MET
            return vers[slot], mins[slot]

        mine = self._owned([row[0] for row in rows] + [b.key for b in bad])
        if mine is not None:  # a fleet node's own rows only
            rows = [row for row in rows if row[0] in mine]
            bad = [b for b in bad if b.key in mine]
        gained = walk.membership
        reconcile = self._reconcile
        repairs = 0
        differ = [j for j, row in enumerate(rows) if take(row[0]) != (row[1], int(row[5] // 60))]  # noqa: E501 - one comprehension: the hot loop of the walk
        for j in differ:
            key, version, route, cadence_s, sitemap, due_at = rows[j]
            row = _Walked(key, version, route, cadence_s, bool(sitemap), due_at)
            repairs += reconcile(key, row, snap_seq, gained)
        for bad_row in bad:
            if type(bad_row.key) is not str:
                continue  # a blob, text that is not UTF-8: never held
            take(bad_row.key)
            repairs += reconcile(bad_row.key, bad_row, snap_seq)
        walk.compared += len(rows) + len(bad)
        return repairs

    def _repair_gone(self, walk: VerifyWalk, now: float) -> int:
        """The end of a repair walk: the keys held at its start that it did
        not meet, gone from the table or written again after the walk passed
        them. Read now, as the verification walk reads its own keys (few,
        unless rows went). Returns the repairs."""
        vers, met = walk.start_vers, walk.met
        assert vers is not None
        # The slots that held a row at the start, not met, and whose row has
        # not changed since (one that has came through the feed, which has
        # its key in hand: a delete it has yet to apply is its to count).
        version_at = self.buckets.version_at
        unmet = compress(range(len(met)), map(not_, met))
        left = self.buckets.keys_at(slot for slot in unmet if version_at(slot) == vers[slot])
        walk.start_vers, walk.start_mins, walk.met = array("q"), array("i"), bytearray()
        repairs = 0
        for at in range(0, len(left), VERIFY_CHUNK):
            keys = left[at : at + VERIFY_CHUNK]
            snap_seq = self.store.last_seq()
            found = self.store.get_many(keys)
            self.drain_feed(now)
            repairs += sum(self._reconcile(key, None, snap_seq) for key in keys if key not in found)
        return repairs
