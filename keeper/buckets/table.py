"""The key table under ``Buckets`` (keeper/buckets/__init__.py): the rows' slots
and columns, the hash table from key to slot, and how a slot's order value
enters or leaves its class's order. ``KeyTable`` sets every field of the
buckets in one ``__init__``; the other modules add methods.

Layout, chosen for memory (``bench/bench_buckets.py`` measures it against a
plain dict-and-sets layout; the numbers are in its docstring: about 156 to
160 bytes a row at 1,000,000 rows with 54-character keys while the keys were
str objects, 118 since they are UTF-8 in the ``KeyColumn``
(docs/performance.md, "The keeper's keys as UTF-8 by slot"), where the plain
layout takes 380 to 515, and 4 to 5 µs an applied change):

- A row lives in a **slot**, an index into five parallel columns:
  ``_keys`` (a ``KeyColumn``), ``_vers`` (int64), ``_mins`` (int32 due
  minute), ``_cids`` (int32 class id) and ``_det`` (a bytearray: 1 when the
  row is detached, keeper/buckets/detach.py). No Python object is held a
  row: the C ``KeyColumn`` (keeper/_keys.c) keeps each key's UTF-8 in a
  block of its own with the low 32 bits of its hash beside it (76 bytes a
  54-character key, where a str in a list took 120), makes a str only when
  asked for one (``keys[slot]``), and does the key table's probe on the
  bytes (``find``). Without the C build it is a list of str
  (``PyKeyColumn``).
- ``_table`` maps a key to its slot: an open-addressing hash table (linear
  probing, deletion by backward shift, so no tombstones) of int32 slot
  numbers, kept at most 2/3 full. A dict would cost a per-row int object
  for the slot on top of its own entry; this costs 8 to 16 bytes a row.
  It doubles incrementally (``_rehash``, ``_drain``): no call moves more
  than a bounded share of the rows, so the keeper never stops for a rehash
  of every row (over 500 ms at 1,000,000 rows; now the longest call while
  it doubles is the allocation of the larger table, about 11 ms).
- Each class keeps its rows as a sorted sequence of ``minute << 32 | slot``
  in blocks of int64 arrays (``keeper.order.Order``, a SortedList with no per-item
  objects). Sorted by minute, a class is already in rank order, so the best
  rows are a head of each class and no row is rescored; a count of rows
  between two minutes is two bisections, so counting follows classes, not
  rows.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress
from operator import not_
from typing import Any

from keeper.classes import ClassTable
from keeper.order import BLOCK_LOAD, SLOT_BITS, Order

try:
    from keeper import _best  # type: ignore[attr-defined]  # C, built by setup.py
except ImportError:  # pragma: no cover - a build without the C extension
    _best = None  # type: ignore[assignment]

# Refused rows named in the keeper's trust (the newest).
REFUSED_KEYS = 20

# Smallest hash table (cells); it doubles when more than 2/3 full, and a
# table holding more than ``KeyTable.GROW_AT_ONCE`` rows doubles incrementally.
MIN_TABLE = 8
_EMPTY = -1

Entry = tuple[str, int, int, int, float]  # (key, version, minute, class id, rank)
# Order values read as two int32 halves of each int64 (``minute <<
# SLOT_BITS | slot``, the minute signed), not by a shift and a mask a value:
# which half is which follows the byte order.
_SLOT_HALF, _MINUTE_HALF = (0, 1) if sys.byteorder == "little" else (1, 0)


class PyKeyColumn(list[str | None]):
    """``keeper._best.KeyColumn`` in Python, for a build without it: the keys
    as str in a list, with the column's methods."""

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` slots (a list grows as it must)."""

    def truncate(self, slots: int) -> None:
        """Drop the slots from ``slots`` on."""
        del self[slots:]

    def take(self, slots: Any, n: int) -> list[str | None]:
        """The keys of the first ``n`` slots of an int32 buffer."""
        return [self[slot] for slot in memoryview(slots).cast("B").cast("i")[:n]]

    def hash_at(self, slot: int) -> int | None:
        """The hash of the slot's key (None: the slot holds none)."""
        key = self[slot]
        return None if key is None else hash(key)

    def find(self, key: str, table: array[int], mask: int) -> int:
        """The cell of ``table`` holding ``key``'s slot, or the empty cell
        ending its probe (linear, from ``hash(key) & mask``)."""
        i = hash(key) & mask
        slot = table[i]
        while slot >= 0 and self[slot] != key:
            i = (i + 1) & mask
            slot = table[i]
        return i


def new_key_column() -> PyKeyColumn:
    """An empty column of keys by slot: the C one where built."""
    return _best.KeyColumn() if _best is not None else PyKeyColumn()


def _shift_out(table: array[int], mask: int, keys: PyKeyColumn, i: int) -> None:
    """Empty cell ``i`` of an open-addressing ``table`` and shift later members
    of its cluster back, so every key stays reachable from its home cell
    without tombstones."""
    hash_at = keys.hash_at
    j = i
    while True:
        j = (j + 1) & mask
        slot = table[j]
        if slot < 0:
            break
        home = hash_at(slot) & mask  # type: ignore[operator]  # a slot in the table holds a key
        # The entry at j may fill the hole at i unless its home lies in
        # the cyclic range (i, j].
        if (i < home <= j) if i < j else (home > i or home <= j):
            continue
        table[i] = slot
        i = j
    table[i] = _EMPTY


def minute_of(t: float) -> int:
    """The due minute of a unix time: ``floor(t / 60)``."""
    return int(t // 60)


class KeyTable:
    """The state of ``Buckets``, its key table and its class orders."""

    # Growth of the key table (see ``_rehash``): at once up to this many rows
    # held (a few ms), else incrementally: cells of the old table moved an
    # insert by ``apply``, and a row entered by ``load_rows``.
    GROW_AT_ONCE = 16_384
    DRAIN_STEP = 32
    DRAIN_PER_ROW = 2

    def __init__(
        self,
        classes: ClassTable,
        *,
        capacity: int = 0,
        block_load: int = BLOCK_LOAD,
        remember_best: bool = False,
    ) -> None:
        self.classes = classes
        self._block_load = max(2, block_load)
        self._keys = new_key_column()
        self._vers = array("q")
        self._mins = array("i")
        self._cids = array("i")
        self._free = array("i")  # slots whose key is None, reused first
        self._live = 0
        self._table = array("i", [_EMPTY]) * MIN_TABLE
        self._mask = MIN_TABLE - 1
        # While the key table grows (``_rehash``): the table before, whose
        # clusters still hold the rows not moved yet, and how far ``_drain``
        # has come through it (``_drained`` cells on from cell ``_drain_from``).
        self._old: array[int] | None = None
        self._old_mask = 0
        self._drain_from = 0
        self._drained = 0
        self.reserve(capacity)
        self._order: dict[int, Order] = {}
        self._due: dict[int, int] = {}  # rows with minute <= _through, per class
        # Detached rows (``detach``): a flag a slot, and per class their own
        # order and due count, which ``best`` never reads. A class with a
        # detached order always has an attached one too (maybe empty).
        self._det = bytearray()
        self._order_detached: dict[int, Order] = {}
        self._due_detached: dict[int, int] = {}
        self._detached = 0
        self._through = -1
        # Lifetime count of rows entering the due state (see ``advance``),
        # and the highest minute ``advance`` has reached (None: never called).
        self.came_due = 0
        self._high: int | None = None
        # The last rows refused for want of a class slot (``TooManyClasses``),
        # by key, newest last: named in the keeper's trust.
        self.refused_keys: deque[str] = deque(maxlen=REFUSED_KEYS)
        # Where the last ``best`` found its threshold, and how many
        # excluded keys its candidates held: the next call starts from them.
        self._best_hint: float | None = None
        self._best_excluded = 0
        # Rows ever added by ``apply`` (not by ``load_rows``), and the highest key
        # ``load_rows`` took: while no row came another way and the walk
        # ascends, a walked key cannot be held yet.
        self._strays = 0
        self._walk_last: str | None = None
        self._dirty: dict[int, Order] = {}  # classes with pending values
        # The candidates of the last ``best`` (``remember_best``), for
        # ``detach_many``: their order values class by class (each class's
        # run ascending) and their slots, where each class's run starts (and
        # the last ends), the classes, and key → position.
        # A key stays in ``_best_at`` only while its row has not been
        # unplaced since (``_unplace`` drops it; ``reconfigure`` clears all),
        # so its value there is its value now.
        self._remember_best = remember_best
        self._best_values = array("q")
        self._best_slots = array("i")
        self._best_starts: list[int] = [0]
        self._best_cids: list[int] = []
        self._best_at: dict[str, int] = {}

    # -- the hash table --------------------------------------------------------
    #
    # Growth is incremental, so that no one call stops the keeper for a
    # rehash of every row (about 300 ms a million rows in Python). ``_rehash``
    # only allocates the larger table and keeps the old one as ``_old``; the
    # rows then move over a bounded number of cells a call (``_drain``: the
    # inserts of ``apply`` and each ``load_rows`` chunk), a whole cluster at
    # a time. With linear probing a key's probe path lies within its cluster,
    # so emptying whole clusters (and deleting by backward shift within one)
    # leaves every row not moved yet reachable in ``_old``. Meanwhile a key
    # is looked for in the new table and then in ``_old``: ``_cell`` moves a
    # key it finds there into the new table, so callers see one table. The
    # drain finishes long before the next growth is due (it needs about 1.5
    # cells an inserted row; it moves ``DRAIN_STEP`` an insert and
    # ``DRAIN_PER_ROW`` a loaded row).

    def reserve(self, rows: int) -> None:
        """Size the key table for ``rows`` rows now, instead of doubling while
        they arrive: no insert starts a growth until more than ``rows`` rows
        are held. Call it with the table's row count before a load."""
        self._keys.reserve(rows)
        cells = len(self._table)
        while rows * 3 > cells * 2:
            cells <<= 1
        if cells != len(self._table):
            self._rehash(cells)

    def _rehash(self, cells: int) -> None:
        """Grow the key table to ``cells`` cells: at once while it holds at
        most ``GROW_AT_ONCE`` rows, else by starting a drain of the old one."""
        if self._old is not None:  # an explicit reserve mid-drain: end that one
            self._drain(len(self._old))
        old = self._table
        self._table = array("i", [_EMPTY]) * cells
        self._mask = cells - 1
        if self._live > self.GROW_AT_ONCE:
            self._old, self._old_mask = old, len(old) - 1
            # Start at an empty cell, so that no cluster is split at the
            # start (one wrapping from the table's end to its start).
            self._drain_from = old.index(_EMPTY)
            self._drained = 0
            return
        # A plain loop: passes of ``map`` over the table cost three times
        # as much here (each pass misses the cache again).
        table, mask, hash_at = self._table, self._mask, self._keys.hash_at
        for slot in range(len(self._keys)):
            h = hash_at(slot)
            if h is None:
                continue
            i = h & mask
            while table[i] >= 0:
                i = (i + 1) & mask
            table[i] = slot

    def _drain(self, cells: int) -> None:
        """Move the rows of at least the next ``cells`` cells of ``_old`` into
        the table (and on to the end of the cluster reached); drop ``_old``
        when it is all moved."""
        old, old_mask = self._old, self._old_mask
        assert old is not None
        table, mask, hash_at = self._table, self._mask, self._keys.hash_at
        start, done, end = self._drain_from, self._drained, len(old)
        while done < end:
            c = (start + done) & old_mask
            slot = old[c]
            if slot >= 0:
                i = hash_at(slot) & mask  # type: ignore[operator]  # a slot in a cell holds a key
                while table[i] >= 0:
                    i = (i + 1) & mask
                table[i] = slot
                old[c] = _EMPTY
            elif cells <= 0:
                break
            cells -= 1
            done += 1
        if done >= end:
            self._old = None
        else:
            self._drained = done

    def _cell(self, key: str) -> int:
        """The table cell holding ``key``'s slot, or the empty cell ending its
        probe sequence. While the table grows, a key still in ``_old`` moves
        to the table first."""
        table, keys = self._table, self._keys
        i = keys.find(key, table, self._mask)
        if table[i] < 0 and self._old is not None:
            old = self._old
            c = self._old_cell(key)
            if old[c] >= 0:
                table[i] = old[c]
                _shift_out(old, self._old_mask, keys, c)
        return i

    def _old_cell(self, key: str) -> int:
        """``_cell`` in ``_old`` (which must be there)."""
        assert self._old is not None
        return self._keys.find(key, self._old, self._old_mask)

    def _old_slot(self, key: str) -> int:
        """The slot of a key not in the table but maybe still in ``_old``
        (-1: in neither), without moving it."""
        return -1 if self._old is None else self._old[self._old_cell(key)]

    def _clear_cell(self, i: int) -> None:
        """Empty cell ``i`` and shift later members of its cluster back, so
        every key stays reachable from its home cell without tombstones."""
        _shift_out(self._table, self._mask, self._keys, i)

    # -- placing order values --------------------------------------------------

    def _pend(self, cid: int, values: Sequence[int]) -> None:
        """Leave order values of class ``cid`` pending (a run of them, as one
        exact-size array: a chunk's runs side by side in memory, freed
        together by the flush)."""
        order = self._dirty.get(cid)
        if order is None:
            order = self._order.get(cid)
            if order is None:
                order = self._order[cid] = Order(self._block_load)
                self._due[cid] = 0
            self._dirty[cid] = order
        # An int64 array from C is exact already; a list is packed into one.
        if isinstance(values, array) and values.typecode == "q":
            order.pending.append(values)
        else:
            order.pending.append(array("q", values))
        order.size += len(values)

    def _flush(self) -> None:
        """Merge every class's pending values into its order, and count those
        already due (``_through`` has not moved since they came: ``advance``
        flushes first)."""
        due_below = (self._through + 1) << SLOT_BITS
        due = self._due
        for cid, order in self._dirty.items():
            values = order.flush()
            if values and values[0] < due_below:
                due[cid] += bisect_left(values, due_below)
        self._dirty.clear()

    def _place(self, slot: int, cid: int, minute: int) -> None:
        """Enter a slot's order value in its class's attached or detached
        order, as the slot's flag says."""
        if self._det[slot]:
            order, due = self._order_detached.get(cid), self._due_detached
            if order is None:
                order = self._new_detached_order(cid)
        else:
            order, due = self._order.get(cid), self._due
            if order is None:
                order = self._order[cid] = Order(self._block_load)
                due[cid] = 0
        order.add(minute << SLOT_BITS | slot)
        if minute <= self._through:
            due[cid] += 1

    def _unplace(self, slot: int, cid: int, minute: int) -> None:
        if self._best_at:
            self._best_at.pop(self._keys[slot], None)  # type: ignore[arg-type]  # a placed slot has a key
        value = minute << SLOT_BITS | slot
        if self._det[slot]:
            self._order_detached[cid].remove(value)
            if minute <= self._through:
                self._due_detached[cid] -= 1
        # A pending value was not counted as due yet.
        elif self._order[cid].remove(value) and minute <= self._through:
            self._due[cid] -= 1

    def _new_detached_order(self, cid: int) -> Order:
        if cid not in self._order:
            self._order[cid] = Order(self._block_load)
            self._due[cid] = 0
        order = self._order_detached[cid] = Order(self._block_load)
        self._due_detached[cid] = 0
        return order

    # -- reading ---------------------------------------------------------------

    @property
    def due_through(self) -> int:
        """The minute the due counts are at: a row whose minute is at or
        before it is due (``advance`` moves it)."""
        return self._through

    def get(self, key: str) -> tuple[int, int, int] | None:
        """``(due minute, class id, version)`` of a row, or None."""
        slot = self._table[self._cell(key)]
        if slot < 0:
            return None
        return self._mins[slot], self._cids[slot], self._vers[slot]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._table[self._cell(key)] >= 0

    def __len__(self) -> int:
        return self._live

    def slot_of(self, key: str) -> int:
        """The slot holding ``key`` (-1: none)."""
        return self._table[self._cell(key)]

    def version_at(self, slot: int) -> int:
        """The version of the row in ``slot`` (a free slot's is stale)."""
        return self._vers[slot]

    def columns_at(self, lo: int, hi: int) -> tuple[array[int], array[int]]:
        """Copies of the versions and due minutes of the slots from ``lo`` to
        ``hi`` (a free slot's are stale: ``free_flags`` says which)."""
        return self._vers[lo:hi], self._mins[lo:hi]

    def free_flags(self) -> bytearray:
        """A byte a slot: 1 for a slot that holds no row, else 0."""
        flags = bytearray(len(self._keys))
        for slot in self._free:
            flags[slot] = 1
        return flags

    def held_slots(self) -> array[int]:
        """The slots holding a row now, ascending (``keys_at`` makes their
        keys a chunk at a time)."""
        return array("i", compress(range(len(self._keys)), map(not_, self.free_flags())))

    def keys_at(self, slots: Iterable[int]) -> list[str]:
        """The keys ``slots`` hold now, leaving out those that hold none."""
        return [key for key in map(self._keys.__getitem__, slots) if key is not None]

    def items(self) -> Iterator[tuple[str, int, int, int]]:
        """``(key, due minute, class id, version)`` of every row, in no order."""
        mins, cids, vers = self._mins, self._cids, self._vers
        for slot, key in enumerate(self._keys):
            if key is not None:
                yield key, mins[slot], cids[slot], vers[slot]
