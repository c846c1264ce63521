"""``Buckets``, the keeper's in-memory schedule (keeper/buckets/__init__.py):
changes, the load walk, classes and reconfiguration, on the key table
(keeper/buckets/table.py), with best, detach and counts mixed in.

Loading: ``load_rows`` takes the walk a chunk at a time (about 1 µs a row
here, against 2.5 to 3.5 by ``apply``). It enters the rows with one plain
loop and leaves their order values *pending*, unsorted, per class; the next
read (``best``, ``counts``, ``coming``, ``oldest_due``, ``lateness``,
``count_due_between``, ``reconfigure``, ``detach``; ``remove`` finds a
pending value where it is) merges each class's pending
values in with one sort, so a load pays one sort a class per publish instead
of a bisection and a block insert a row.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain, compress, islice, repeat
from math import floor
from operator import ge, is_, itemgetter, lt
from typing import Any

from keeper.buckets.best import Best
from keeper.buckets.counts import Counts
from keeper.buckets.detach import Detach
from keeper.buckets.table import PyKeyColumn, new_key_column
from keeper.order import SLOT_BITS, SLOT_MASK, Order

try:  # _enter's loop in C (keeper/_best_order.c); the Python below does the same
    from keeper import _best  # type: ignore[attr-defined]  # C, built by setup.py
except ImportError:
    _best = None  # type: ignore[assignment]
from node.core.config import Config
from node.core.errors import TooManyClasses

# A walked row: (key, version, route, cadence_s, sitemap, due_at).
WalkedRow = tuple[str, int, str, "int | None", bool, float]

# Class ids in ``load_rows``' working column for rows it will not place.
_LATER = -1  # from the first row whose class would pass max_classes: row by row
_STALE = -2  # the row held is as new or newer
_CLASS_FIELDS = itemgetter(2, 3, 4)  # (route, cadence_s, sitemap) of a walked row


def _enter_probing(
    table: array[int],
    mask: int,
    held: PyKeyColumn,
    rows: Sequence[WalkedRow],
    cids: list[int],
    add: dict[int, Any],
    version_of: Any,
    minute_of: Any,
    old_slot: Any,
) -> list[tuple[int, int]]:
    """``Buckets._enter``'s loop when a walked key may be held already
    (``old_slot``: ``KeyTable._old_slot`` while the key table grows, else None)."""
    slot = len(held)
    append, find = held.append, held.find
    found = []
    for j, ((key, version, _route, _cadence, _sitemap, due_at), cid) in enumerate(
        zip(rows, cids, strict=True)
    ):
        i = find(key, table, mask)
        held_at = table[i]
        if held_at >= 0:
            found.append((j, held_at))
        else:
            if old_slot is not None and (held_at := old_slot(key)) >= 0:
                found.append((j, held_at))
                continue
            minute = floor(due_at) // 60
            append(key)  # first: a key the column refuses leaves the table as it was
            table[i] = slot
            add[cid](minute << SLOT_BITS | slot)
            version_of(version)
            minute_of(minute)
            slot += 1
    return found


def _drop(
    found: list[tuple[int, int]], cids: list[Any], *columns: list[Any]
) -> tuple[list[Any], ...]:
    """``columns`` less the rows in ``found`` and those whose class id is
    below 0 (stale, or left to go row by row)."""
    keep = (
        list(map(ge, cids, repeat(0))) if _LATER in cids or _STALE in cids else [True] * len(cids)
    )
    for j, _slot in found:
        keep[j] = False
    return tuple(list(compress(column, keep)) for column in columns)


class Buckets(Best, Detach, Counts):
    """The keeper's rows by class and due minute. See keeper/buckets/__init__.py."""

    # -- changes (hot path) ----------------------------------------------------

    def apply(
        self,
        key: str,
        version: int,
        route: str,
        cadence_s: int | None,
        sitemap: bool,
        due_at: float,
    ) -> bool:
        """Insert or move a row. False (and nothing changed) when the row held
        is as new or newer: versions decide, so a repair or a walked row never
        overwrites a newer event. Raises TooManyClasses with nothing changed."""
        table, keys = self._table, self._keys
        i = keys.find(key, table, self._mask)
        slot = table[i]
        if slot < 0 and self._old is not None:  # the table grows: look in the old one
            i = self._cell(key)
            slot = table[i]
        if slot >= 0:
            vers = self._vers
            if vers[slot] >= version:
                return False
            cid = self._class_of(route, cadence_s, sitemap)
            minute = int(due_at // 60)
            vers[slot] = version
            old_cid = self._cids[slot]
            old_minute = self._mins[slot]
            if old_cid != cid or old_minute != minute:
                if minute <= self._through < old_minute:
                    self.came_due += 1
                self._unplace(slot, old_cid, old_minute)
                self._mins[slot] = minute
                self._cids[slot] = cid
                self._place(slot, cid, minute)
            return True
        cid = self._class_of(route, cadence_s, sitemap)
        minute = int(due_at // 60)
        if (self._live + 1) * 3 > len(table) * 2:
            self._rehash(len(table) * 2)
            i = self._cell(key)
        elif self._old is not None:
            self._drain(self.DRAIN_STEP)
            i = self._cell(key)
        if self._free:
            slot = self._free[-1]
            keys[slot] = key  # first: a key the column refuses changes nothing
            self._free.pop()
            self._vers[slot] = version
            self._mins[slot] = minute
            self._cids[slot] = cid
        else:
            slot = len(keys)
            keys.append(key)
            self._vers.append(version)
            self._mins.append(minute)
            self._cids.append(cid)
            self._det.append(0)
        self._table[i] = slot
        self._live += 1
        self._strays += 1
        if minute <= self._through:
            self.came_due += 1
        self._place(slot, cid, minute)
        return True

    def remove(self, key: str, version: int | None = None) -> bool:
        """Remove a row, unless the row held is newer than ``version`` (None:
        remove whatever is held). False when nothing was removed."""
        i = self._cell(key)
        slot = self._table[i]
        if slot < 0:
            return False
        if version is not None and self._vers[slot] > version:
            return False
        self._unplace(slot, self._cids[slot], self._mins[slot])
        if self._det[slot]:
            self._det[slot] = 0  # a freed slot is attached when reused
            self._detached -= 1
        self._keys[slot] = None
        self._free.append(slot)
        self._live -= 1
        self._clear_cell(i)
        return True

    # -- loading ---------------------------------------------------------------

    def load_rows(
        self, rows: Sequence[WalkedRow], tombstones: Mapping[str, int] | None = None
    ) -> tuple[int, int]:
        """Apply one chunk of the load walk: ``(key, version, route, cadence_s,
        sitemap, due_at)`` rows as the store's walk gives them (validated: due
        times from 0 to the year 3000). Returns ``(applied, refused)``.

        The same outcome as ``apply`` row by row (versions decide: a row held
        as new or newer stays; a key in ``tombstones`` with a seq at least the
        row's version is skipped; a row whose class would pass max_classes is
        counted as refused and skipped, never raised), at a fraction of the
        cost: classes resolve in one C-level pass, one plain loop enters the
        rows, and their order values wait, unsorted, in their class's
        ``pending`` runs until the next read (``best``, ``counts``, …) merges
        each class's share in with one sort: no bisection or block insert a
        row. Between calls the buckets are whole and every method works.
        ``reserve`` the walk's size first so the key table never grows during
        it (each call reserves its own chunk on top of the rows held). Rows in
        ascending key order (as the walk gives them) take the fast path, and
        skip the search for a held key while every row held came from this
        walk; a chunk with a key twice goes row by row."""
        if tombstones:
            rows = [
                row for row in rows if (dead := tombstones.get(row[0])) is None or dead < row[1]
            ]
        n = len(rows)
        if not n:
            return 0, 0
        keys = list(map(itemgetter(0), rows))
        if all(map(lt, keys, islice(keys, 1, None))):
            first, last = keys[0], keys[-1]
        elif len(set(keys)) < n:
            return self._load_one_by_one(rows)
        else:
            first, last = min(keys), max(keys)
        fields = (map(itemgetter(i), rows) for i in (2, 3, 4))
        cids = self.classes.known(zip(*fields, strict=True))  # zip reuses its tuple
        self.reserve(self._live + n)
        if self._old is not None:  # the key table grows: a share of its rows move
            self._drain(self.DRAIN_PER_ROW * n)
        # A key of this chunk can be held only if some row came another way
        # than this walk, or the walk started over.
        walked = self._walk_last
        probe = bool(self._strays) or (walked is not None and first <= walked)
        self._walk_last = last if walked is None else max(walked, last)
        applied = 0
        cut = None
        if None in cids:  # new classes: made in row order, as apply would
            found = self._find_held(rows, keys, cids) if probe else []
            probe = False
            cut = self._resolve_classes(rows, cids)
            if cut is not None:
                tail = rows[cut:]
                cids[cut:] = repeat(_LATER, n - cut)
            if found or cut is not None:
                applied += self._settle(rows, found, cids)
                rows, keys, cids = _drop(found, cids, rows, keys, cids)  # type: ignore[arg-type]
        found = self._enter(rows, keys, cids, probe)  # type: ignore[arg-type]  # all resolved
        applied += len(rows) - len(found)
        if found:
            applied += self._settle(rows, found, cids)
        if cut is None:
            return applied, 0
        later, refused = self._load_one_by_one(tail)
        return applied + later, refused

    def _load_one_by_one(self, rows: Iterable[WalkedRow]) -> tuple[int, int]:
        applied = refused = 0
        came_due = self.came_due
        for row in rows:
            try:
                applied += self.apply(*row)
            except TooManyClasses:
                refused += 1
                self.refused_keys.append(row[0])
        # Walked rows are restored state, not new occurrences: undo what
        # ``apply`` counted as coming due.
        self.came_due = came_due
        return applied, refused

    def _find_held(
        self, rows: Sequence[WalkedRow], keys: list[str], cids: list[int | None]
    ) -> list[tuple[int, int]]:
        """The rows of a chunk whose key is held: ``(row index, slot)``. Marks
        those held as new or newer ``_STALE`` in ``cids``."""
        table, mask, find, vers = self._table, self._mask, self._keys.find, self._vers
        growing = self._old is not None
        found = []
        for j, key in enumerate(keys):
            slot = table[find(key, table, mask)]
            if slot < 0 and growing:
                slot = self._old_slot(key)
            if slot >= 0:
                found.append((j, slot))
                if vers[slot] >= rows[j][1]:
                    cids[j] = _STALE
        return found

    def _enter(
        self, rows: Sequence[WalkedRow], keys: list[str], cids: list[int], probe: bool
    ) -> list[tuple[int, int]]:
        """Enter the rows as new ones: the next slot each, the key table, the
        columns, and the order value into the class's pending values. With
        ``probe`` a key may be held already: those rows are returned as ``(row
        index, slot)`` and left alone. Plain loops: cheaper here than passes
        of ``map``, each of which would miss the cache again."""
        table, mask, held = self._table, self._mask, self._keys
        first = len(held)
        if not probe:
            # The keys first, all or none: a key the column refuses (not
            # UTF-8) leaves the table as it was.
            held += keys
            if _best is not None:  # the loop below, in C
                try:
                    versions_c, minutes_c, groups = _best.enter_rows(rows, cids, table, mask, first)
                except BaseException:
                    held.truncate(first)
                    raise
                self._vers += versions_c
                self._mins += minutes_c
                self._cids += array("i", cids)
                self._det += bytes(len(versions_c))
                self._live += len(versions_c)
                for cid, run in groups:
                    self._pend(cid, run)
                return []
        pending: dict[int, list[int]] = {cid: [] for cid in set(cids)}
        add = {cid: values.append for cid, values in pending.items()}
        slot = first
        versions: list[int] = []
        minutes: list[int] = []
        version_of, minute_of = versions.append, minutes.append
        found: list[tuple[int, int]] = []
        if not probe:
            for (key, version, _route, _cadence, _sitemap, due_at), cid in zip(
                rows, cids, strict=True
            ):
                minute = floor(due_at) // 60  # = due_at // 60, at half the cost
                i = hash(key) & mask
                while table[i] >= 0:
                    i = (i + 1) & mask
                table[i] = slot
                add[cid](minute << SLOT_BITS | slot)
                version_of(version)
                minute_of(minute)
                slot += 1
        else:
            new_key_column().extend(keys)  # a key the column refuses: nothing changed
            old_slot = None if self._old is None else self._old_slot
            found = _enter_probing(
                table, mask, held, rows, cids, add, version_of, minute_of, old_slot
            )
            if found:
                cids = _drop(found, cids, cids)[0]
        # array(list) converts at twice the speed of array.extend(list).
        self._vers += array("q", versions)
        self._mins += array("i", minutes)
        self._cids += array("i", cids)
        self._det += bytes(len(versions))
        self._live += len(versions)
        for cid, values in pending.items():
            if values:
                self._pend(cid, values)
        return found

    def _settle(
        self, rows: Sequence[WalkedRow], found: list[tuple[int, int]], cids: list[int | None]
    ) -> int:
        """Apply the chunk's rows whose key is held (``(row index, slot)``),
        unless held as new or newer; returns how many moved."""
        vers = self._vers
        moved = 0
        values: dict[int, list[int]] = {}
        for j, slot in found:
            cid = cids[j]
            version = rows[j][1]
            if cid is not None and cid >= 0 and vers[slot] < version:
                self._move(slot, version, cid, floor(rows[j][5]) // 60, values)
                moved += 1
        for cid, run in values.items():
            self._pend(cid, run)
        return moved

    def _resolve_classes(self, rows: Sequence[WalkedRow], cids: list[int | None]) -> int | None:
        """Create the classes of the rows whose class is new (None in
        ``cids``), in row order, and fill in their ids. At the first row whose
        class would pass max_classes, returns its index: from there the chunk
        goes row by row, since which classes ``apply`` retires to make room
        depends on every row before."""
        classes = self.classes
        missing = list(compress(range(len(cids)), map(is_, cids, repeat(None))))
        fields = list(map(_CLASS_FIELDS, map(rows.__getitem__, missing)))
        cut = None
        for triple in dict.fromkeys(fields):
            try:
                classes.class_of(*triple)
            except TooManyClasses:
                cut = missing[fields.index(triple)]
                break
        deque(map(cids.__setitem__, missing, classes.known(fields)), maxlen=0)
        return cut

    def _move(
        self, slot: int, version: int, cid: int, minute: int, values: dict[int, list[int]]
    ) -> None:
        """``apply`` to a held row; its new order value goes to ``values`` by
        class, for the caller to leave pending (a detached row's goes to its
        detached order at once: those hold no pending values)."""
        self._vers[slot] = version
        old_cid, old_minute = self._cids[slot], self._mins[slot]
        if old_cid != cid or old_minute != minute:
            self._unplace(slot, old_cid, old_minute)
            self._mins[slot] = minute
            self._cids[slot] = cid
            if self._det[slot]:
                self._place(slot, cid, minute)
            else:
                values.setdefault(cid, []).append(minute << SLOT_BITS | slot)

    # -- classes ---------------------------------------------------------------

    def _class_of(self, route: str, cadence_s: int | None, sitemap: bool) -> int:
        try:
            return self.classes.class_of(route, cadence_s, sitemap)
        except TooManyClasses:
            # Classes whose rows have all gone still count until retired;
            # retire them only now, so ids stay stable while there is room.
            if not self._retire_empty_classes():
                raise
            return self.classes.class_of(route, cadence_s, sitemap)

    def _retire_empty_classes(self) -> int:
        retired = 0
        for cid in self.classes.ids():
            order = self._order.get(cid)
            detached = self._order_detached.get(cid)
            if (order is None or not order.size) and (detached is None or not detached.size):
                self._order.pop(cid, None)
                self._due.pop(cid, None)
                self._order_detached.pop(cid, None)
                self._due_detached.pop(cid, None)
                self.classes.retire(cid)
                retired += 1
        return retired

    # -- configuration ---------------------------------------------------------

    def reconfigure(self, config: Config) -> None:
        """Take a new configuration (SIGHUP): classes relabel in place, and the
        rows of a class that merged into another move there. No store reads."""
        if self._dirty:
            self._flush()
        self._best_at = {}  # class ids change under the remembered values
        cids = self._cids
        for old, new in self.classes.reconfigure(config):
            for orders, due in self._both:
                src = orders.pop(old, None)
                moved_due = due.pop(old, 0)
                if src is None or not src.size:
                    continue
                for value in src:
                    cids[value & SLOT_MASK] = new
                dst = orders.get(new)
                values = sorted(chain(src, dst)) if dst is not None else list(src)
                orders[new] = Order.from_sorted(values, self._block_load)
                due[new] = due.get(new, 0) + moved_due
            if new not in self._order:  # only detached rows moved: keep the invariant
                self._order[new] = Order(self._block_load)
                self._due[new] = 0
