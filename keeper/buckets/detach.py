"""Detached rows of ``Buckets`` (keeper/buckets/__init__.py): the keys the
keeper keeps out of ``best`` while leased, held or parked, and the granted keys
remembered from the last ``best``.

Detached rows: ``detach(key)`` hides a row from ``best`` (the keeper
detaches a key while it is leased, held or parked) and ``attach(key)``
brings it back. A detached row keeps its slot and its place in every count
(``get``, ``items``, ``len``, ``counts``, ``coming``, ``oldest_due``,
``lateness``, ``count_due_between``, ``came_due``); its order value lives in
its class's *detached* order, with its own due count, which ``best`` never
reads: ``best`` costs the same with 130,000 keys detached at the class heads
as with none, where an ``exclude`` set of them costs a set lookup per
excluded head per call (about 100 ms at 250,000 rows; ``bench_buckets.py
--detached``). Detach and attach cost about what ``apply`` does (5 µs);
``detach_many`` and ``attach_many`` move each class's share at once.

Granted keys: the keys the keeper detaches are nearly all ones it has just
published, a head of their class. With ``remember_best`` each ``best`` (or
``best_columns``) keeps its candidates' order values, class run by class
run, and a dict of key → position; ``detach_many`` finds those keys there
(a dict lookup, no probe of the key table), picks their values out in order
with a few passes in C (no sort), and each class's share leaves the head of
its order as one slice (``Order.remove_sorted``) and joins the end of the
detached order (``Order.add_sorted``): about 1 µs a granted key in all
(``bench/bench_publish.py``). A remembered key is dropped when its row is
unplaced (moved, removed: ``_unplace``) and all are on ``reconfigure``, so a
remembered value is always the row's value now; a key detached since (in
bulk, or repeated) is skipped by its flag. Other keys take the probe.
``apply``, ``load_rows`` and ``reconfigure`` move a detached row and keep it
detached; ``remove`` forgets the flag. Detached orders never hold pending
values (``detach`` merges them first, ``load_rows`` places a detached row's
new value at once). Every class with a detached order has an attached one
(maybe empty), so the read paths walk ``_order`` and look the other up.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from itertools import compress, repeat
from operator import is_, is_not, itemgetter, not_

from keeper.buckets.table import _SLOT_HALF, Entry, KeyTable
from keeper.order import SLOT_BITS

try:  # the key loop of detach_many and attach_many; the Python below does the same
    from keeper import _best  # type: ignore[attr-defined]  # C, built by setup.py
except ImportError:
    _best = None  # type: ignore[assignment]


class Detach(KeyTable):
    def detach(self, key: str) -> bool:
        """Hide a row from ``best`` (a leased, held or parked key) until
        ``attach``; it stays in every count and in ``get``/``items``. False
        when the key is absent or detached already. A few µs: its order value
        moves to the class's detached order."""
        slot = self._table[self._cell(key)]
        if slot < 0 or self._det[slot]:
            return False
        if self._dirty:
            self._flush()  # else finding the value means scanning the pending runs
        cid, minute = self._cids[slot], self._mins[slot]
        self._unplace(slot, cid, minute)
        self._det[slot] = 1
        self._detached += 1
        self._place(slot, cid, minute)
        return True

    def attach(self, key: str) -> bool:
        """Undo ``detach``: ``best`` sees the row again. False when the key is
        absent or not detached."""
        slot = self._table[self._cell(key)]
        if slot < 0 or not self._det[slot]:
            return False
        cid, minute = self._cids[slot], self._mins[slot]
        self._unplace(slot, cid, minute)
        self._det[slot] = 0
        self._detached -= 1
        self._place(slot, cid, minute)
        return True

    def detach_many(self, keys: Iterable[str]) -> int:
        """``detach`` for many keys at once (how many were detached): the
        values of each class move in one removal and one merge, about a
        third of the cost of one ``detach`` a key."""
        return self._move_many(keys, detached=True)

    def attach_many(self, keys: Iterable[str]) -> int:
        """``attach`` for many keys at once (how many were attached)."""
        return self._move_many(keys, detached=False)

    def _move_many(self, keys: Iterable[str], detached: bool) -> int:
        if self._dirty:
            self._flush()
        by_class: dict[int, list[int]] = {}
        if detached and self._best_at:
            keys = self._take_remembered(keys, by_class)
        table, mask, held = self._table, self._mask, self._keys
        det, cids, mins = self._det, self._cids, self._mins
        flag = 1 if detached else 0
        if _best is not None and self._old is None:  # the same loop in C (it reads
            # only the current table: while the table grows, the loop below)
            _best.move_keys(keys, table, mask, held, det, cids, mins, flag, by_class)
            return self._move_classes(by_class, detached)
        for key in keys:
            slot = table[held.find(key, table, mask)]
            if slot < 0 and self._old is not None:  # the table grows
                slot = table[self._cell(key)]
            if slot < 0 or det[slot] == flag:
                continue
            det[slot] = flag
            cid = cids[slot]
            values = by_class.get(cid)
            if values is None:
                values = by_class[cid] = []
            values.append(mins[slot] << SLOT_BITS | slot)
        return self._move_classes(by_class, detached)

    def _move_classes(self, by_class: dict[int, list[int]], detached: bool) -> int:
        """Move each class's values (flagged already) between its orders."""
        due_below = (self._through + 1) << SLOT_BITS
        moved = 0
        for cid, values in by_class.items():
            values.sort()  # ascending already when all came from _take_remembered
            if detached:
                src, src_due = self._order[cid], self._due
                dst = self._order_detached.get(cid) or self._new_detached_order(cid)
                dst_due = self._due_detached
            else:
                src, src_due = self._order_detached[cid], self._due_detached
                dst, dst_due = self._order[cid], self._due
            src.remove_sorted(values)
            dst.add_sorted(values)
            due = bisect_left(values, due_below)
            src_due[cid] -= due
            dst_due[cid] += due
            moved += len(values)
        self._detached += moved if detached else -moved
        return moved

    def _take_remembered(self, keys: Iterable[str], by_class: dict[int, list[int]]) -> list[str]:
        """``detach_many``'s first step for the keys among the last ``best``'s
        candidates (the keys claimers were just granted, nearly always): no
        probe of the key table, no sort. Their positions are marked, the
        marked values picked out class run by class run (ascending), the
        attached ones flagged detached, and each class's share put in
        ``by_class``; a pass of C a step. Returns the other keys."""
        keys = keys if isinstance(keys, list) else list(keys)
        at = list(map(self._best_at.get, keys))
        rest: list[str] = []
        if None in at:
            rest = list(compress(keys, map(is_, at, repeat(None))))
            at = list(compress(at, map(is_not, at, repeat(None))))
        if not at:
            return rest
        values = self._best_values
        marks = bytearray(len(values))
        deque(map(marks.__setitem__, at, repeat(1)), maxlen=0)  # type: ignore[arg-type]
        picked = list(compress(values, marks))  # class by class, each ascending
        slots = list(compress(self._best_slots, marks))
        det = self._det
        flags = bytes(map(det.__getitem__, slots))
        if 1 in flags:  # detached already (a key twice, or detached since): left as they are
            where = list(compress(range(len(values)), marks))
            deque(map(marks.__setitem__, compress(where, flags), repeat(0)), maxlen=0)
            keep = list(map(not_, flags))
            picked, slots = list(compress(picked, keep)), list(compress(slots, keep))
        deque(map(det.__setitem__, slots, repeat(1)), maxlen=0)
        self._by_class(picked, marks, self._best_starts, self._best_cids, by_class)
        return rest

    @staticmethod
    def _by_class(
        picked: list[int],
        marks: bytearray,
        starts: list[int],
        cids: list[int],
        by_class: dict[int, list[int]],
    ) -> None:
        """Split ``picked`` (the marked candidates, class run by class run)
        into ``by_class``: class ``cids[c]``'s run starts at ``starts[c]``
        and ends where the next starts."""
        taken = 0
        for c, cid in enumerate(cids):
            n = marks.count(1, starts[c], starts[c + 1])
            if n:
                by_class[cid] = picked[taken : taken + n]
                taken += n

    def _remember(
        self,
        values: array[int],
        slots: array[int],
        starts: list[int],
        cids: list[int],
        at: dict[str, int],
    ) -> None:
        """Keep the candidates of a ``best`` for ``_take_remembered``: their
        order values and slots, class ``cids[i]``'s run ascending from
        ``starts[i]`` up to ``starts[i + 1]`` (the last entry is where the
        last run ends), and ``at``, key → position in ``values``."""
        self._best_values, self._best_slots = values, slots
        self._best_starts, self._best_cids = starts, cids
        self._best_at = at

    def _remember_runs(self, runs: list[tuple[int, array[int]]], candidates: list[Entry]) -> None:
        """``_remember`` for ``best``: ``runs`` are each class's head taken,
        ``candidates`` their entries in the same order."""
        values = array("q")
        starts, cids = [], []
        for cid, run in runs:
            starts.append(len(values))
            cids.append(cid)
            values += run
        starts.append(len(values))
        slots = array("i", values.tobytes())[_SLOT_HALF::2]
        at = dict(zip(map(itemgetter(0), candidates), range(len(candidates)), strict=True))
        self._remember(values, slots, starts, cids, at)

    def is_detached(self, key: str) -> bool:
        slot = self._table[self._cell(key)]
        return slot >= 0 and bool(self._det[slot])

    @property
    def detached(self) -> int:
        """How many rows are detached."""
        return self._detached
