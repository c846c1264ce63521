"""Counting in ``Buckets`` (keeper/buckets/__init__.py): the per-class due
counts and what queue-state reads. Every read here costs classes, not rows.

Counting: each class keeps a running count of its rows due through minute
``_through``; ``advance`` moves ``_through`` forward (or back, if the clock
steps back) counting only the rows it crosses, and ``apply``/``remove`` keep
the counts in step (pending values are counted when they are merged in, and
``advance`` merges first). ``count_due_between`` and ``lateness`` (due rows
per bin of ``(now - minute * 60) / cadence_s``) are bisections a class too;
``lateness`` finds each bin's minute bound from the float expression itself,
since the floor of the bound computed in floats can be a minute off.

Came due: ``came_due`` counts, for the life of the object, rows entering
the due state: ``advance`` adds the rows it crosses in minutes it never
reached before (a high-water minute; its first call only sets the mark, so
rows already due when the buckets were built are not counted, and a clock
stepping back and forward again counts nothing twice), and ``apply`` adds a
row it makes due (minute at or before ``_through``) that was absent or not
due. ``load_rows`` never counts: walked rows are restored state; a walked
row due later counts when ``advance`` crosses it. Limit: a row applied while
the clock is stepped back, with a minute between ``_through`` and the
high-water minute, is never counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, islice, pairwise
from math import isfinite
from operator import add, sub
from typing import Any

from keeper.buckets.table import KeyTable
from keeper.order import SLOT_BITS, Order, last_minute

# The ``coming`` windows, in minutes after the current one.
COMING_15M = 15
COMING_HOURS = 24


class Counts(KeyTable):
    def advance(self, now_minute: int) -> None:
        """Bring the per-class due counts to ``now_minute``, counting only the
        rows whose minute lies between the last call's and this one's.

        Moving past minutes never reached before adds the rows it crosses to
        ``came_due``; the first call only sets that high-water minute (the
        rows due then came due before these buckets counted), and a clock
        that steps back and forward again counts nothing twice."""
        if self._dirty:
            self._flush()
        high = self._high
        if high is None:
            high = self._high = now_minute
        through = self._through
        if now_minute == through:
            return
        if now_minute > through:
            lo, hi = (through + 1) << SLOT_BITS, (now_minute + 1) << SLOT_BITS
            fresh = (max(through, high) + 1) << SLOT_BITS  # never crossed before
            came = 0
            for orders, due in self._both:
                for cid, order in orders.items():
                    n = order.count_range(lo, hi)
                    due[cid] += n
                    if n and fresh < hi:
                        came += n if fresh == lo else order.count_range(fresh, hi)
            self.came_due += came
            self._high = max(high, now_minute)
        else:
            lo, hi = (now_minute + 1) << SLOT_BITS, (through + 1) << SLOT_BITS
            for orders, due in self._both:
                for cid, order in orders.items():
                    due[cid] -= order.count_range(lo, hi)
        self._through = now_minute

    @property
    def _both(self) -> tuple[tuple[dict[int, Order], dict[int, int]], ...]:
        """The attached and the detached orders, each with its due counts."""
        return (self._order, self._due), (self._order_detached, self._due_detached)

    def _orders_of(self, cid: int, order: Order) -> tuple[Order, ...]:
        """A class's attached ``order``, and its detached one if it holds rows."""
        detached = self._order_detached.get(cid)
        return (order, detached) if detached is not None and detached.size else (order,)

    def counts(self, now: float) -> dict[str, Any]:
        """``{"due": {"sitemap", "discovered", "total"}, "per_class": {cid:
        (rows, due)}, "rows", "classes"}``; classes without rows are left out
        of ``per_class``."""
        self.advance(int(now // 60))
        info = self.classes.info
        sitemap = discovered = 0
        per_class: dict[int, tuple[int, int]] = {}
        detached, due_detached = self._order_detached, self._due_detached
        for cid, order in self._order.items():
            rows, due = order.size, self._due[cid]
            if cid in detached:
                rows += detached[cid].size
                due += due_detached[cid]
            if not rows:
                continue
            per_class[cid] = (rows, due)
            if info(cid).sitemap:
                sitemap += due
            else:
                discovered += due
        return {
            "due": {"sitemap": sitemap, "discovered": discovered, "total": sitemap + discovered},
            "per_class": per_class,
            "rows": self._live,
            "classes": len(self.classes),
        }

    def coming(self, now: float) -> dict[str, Any]:
        """Rows not yet due whose due minute falls within the next 15 minutes,
        60 minutes, 24 hours (cumulative), and per hour of the next 24."""
        if self._dirty:
            self._flush()
        first = int(now // 60) + 1  # the first minute not yet due
        offsets = [0, COMING_15M, *range(60, 60 * COMING_HOURS + 1, 60)]
        bounds = [(first + off) << SLOT_BITS for off in offsets]
        lo, hi = bounds[0], bounds[-1]
        # Each class's positions summed bound by bound (a pass of C a class);
        # the windows are differences of the sums.
        p = [0] * len(bounds)
        for order in chain(self._order.values(), self._order_detached.values()):
            if not order.size or order.maxes[-1] < lo or order.blocks[0][0] >= hi:
                continue
            p = list(map(add, p, order.positions(bounds)))
        soon = p[1] - p[0]
        by_hour = [p[2] - p[0], *map(sub, islice(p, 3, None), islice(p, 2, None))]
        return {"15m": soon, "60m": by_hour[0], "24h": sum(by_hour), "by_hour": by_hour}

    def count_due_between(self, lo_minute: int, hi_minute: int) -> int:
        """How many rows have ``lo_minute < minute <= hi_minute``, all classes:
        two bisections a class."""
        if hi_minute <= lo_minute:
            return 0
        if self._dirty:
            self._flush()
        lo, hi = (lo_minute + 1) << SLOT_BITS, (hi_minute + 1) << SLOT_BITS
        orders = chain(self._order.values(), self._order_detached.values())
        return sum(order.count_range(lo, hi) for order in orders)

    def lateness(self, now: float, edges: Sequence[float]) -> dict[int, list[int]]:
        """Per class with due rows, how many of them fall in each bin of
        lateness ratio ``(now - minute * 60) / cadence_s`` (no boost): bin i
        holds ``edges[i] <= ratio < edges[i + 1]``, the last bin ``ratio >=
        edges[-1]``. ``edges`` start at 0 and increase. A bisection per edge
        a class: the cost follows classes, not rows."""
        if not edges or edges[0] != 0 or not all(map(isfinite, edges)):
            raise ValueError(f"lateness edges must start at 0 and be finite, got {edges!r}")
        if any(b <= a for a, b in pairwise(edges)):
            raise ValueError(f"lateness edges must increase, got {edges!r}")
        if self._dirty:
            self._flush()
        now_minute = int(now // 60)
        limit = (now_minute + 1) << SLOT_BITS
        info = self.classes.info
        out: dict[int, list[int]] = {}
        bounds_of: dict[float, list[int]] = {}  # by cadence: classes share a few
        for cid, order in self._order.items():
            orders = [o for o in self._orders_of(cid, order) if o.size and o.blocks[0][0] < limit]
            if not orders:
                continue
            cadence_s = info(cid).cadence_s
            bounds = bounds_of.get(cadence_s)
            if bounds is None:
                # ratio >= edge  <=>  minute <= last: bounds ascend as edges descend.
                lasts = [min(last_minute(now, edge, cadence_s), now_minute) for edge in edges]
                bounds = [(last + 1) << SLOT_BITS for last in reversed(lasts)]
                bounds_of[cadence_s] = bounds
            if len(orders) == 1:
                at_least = orders[0].positions(bounds)
            else:
                at_least = list(map(add, *(o.positions(bounds) for o in orders)))
            at_least.reverse()  # at_least[i]: due rows with ratio >= edges[i]
            at_least.append(0)
            out[cid] = list(map(sub, at_least, islice(at_least, 1, None)))
        return out

    def oldest_due(self, now: float) -> dict[int, int]:
        """The head (earliest) minute of each class that has due rows."""
        if self._dirty:
            self._flush()
        limit = (int(now // 60) + 1) << SLOT_BITS
        out = {}
        for cid, order in self._order.items():
            heads = [o.blocks[0][0] for o in self._orders_of(cid, order) if o.size]
            if heads and min(heads) < limit:
                out[cid] = min(heads) >> SLOT_BITS
        return out
