"""The keeper's output: the best K due keys written into the ready set, once a
second and, under claim load, the next set ahead while claimers drain the
active one (``publish``); and the lease following that keeps the leased,
held and parked keys, and the keys of live sets, out of every publish.
"""

from __future__ import annotations

import time
from itertools import filterfalse
from typing import Any

from keeper.base import KeeperBase
from keeper.verify import TOP_CHECK
from node.core import metrics

# Claimers ask for the next set; after a set less than half full (a few
# keys due: claimers would drain each at once), honoured at most this often.
LOW_WATER_MIN_S = 0.01


class Publish(KeeperBase):
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
            if self.fenced or self.missed_out:
                # A fenced lease that ended leaves the set before its key
                # (held here again after a lapse) can be offered and leased
                # anew: a new lease on it is this node's own.
                self.fenced_in_flight()
            self._retire(self.ready.active_slot if ahead else None)
        # The best K straight from the class orders into the ready set: the
        # merge gives C arrays of slots, minutes, classes and ranks, and the
        # writer reads keys and versions by slot (no Python object a row).
        # Nothing while paused, or while a fleet node waits for its peers.
        waiting = self.fleet is not None and (
            self.fleet.waiting_for_peers or self.handover_left_s() > 0
        )
        if waiting != self._published_waiting:  # readiness reads it in the state
            self._published_waiting = waiting
            self.next_state = 0.0
        k = 0 if self.paused_node or waiting else self.config.ready_size
        picked = self.buckets.best_gathered(now, k, paused_routes=self.paused_routes)
        written = self.ready.publish_gathered(*picked[:7], now, ahead=ahead)
        # The live set's keys, made once it is published (the buckets hold
        # no str a row: keeper/_keys.c).
        keys = picked.keys_written(written)
        if keep_out:  # the keys written (fewer when the heap was full) leave the orders
            self.buckets.detach_gathered(picked, written)
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

    # -- lease following ------------------------------------------------------

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
                self.buckets.attach_many(list(filterfalse(self.exclude.__contains__, keys)))

    # -- pause and resume -----------------------------------------------------

    def reload_paused(self, now: float) -> dict[str, Any]:
        """Re-read pause and resume from the store and publish at once."""
        self._read_paused()
        self.publish(now)
        self.next_state = 0.0  # queue-state shows it at the next tick
        return {"ok": True, "paused_routes": sorted(self.paused_routes),
                "paused_node": self.paused_node}
