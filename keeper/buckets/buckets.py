"""The keeper's in-memory schedule: key → (due minute, class, version), and per
class the rows in due-minute order. This is the hot path: every change of the
feed goes through ``apply`` or ``remove``, the load walk through
``load_rows``, and the ready set is ``best`` (or ``best_columns``).

Layout, chosen for memory (``bench/bench_buckets.py`` measures it against a
plain dict-and-sets layout; the numbers are in its docstring: about 156 to
160 bytes a row at 1,000,000 rows with 54-character keys, where the plain
layout takes 380 to 515, and 4 to 5 µs an applied change):

- A row lives in a **slot**, an index into five parallel columns:
  ``_keys`` (list of str), ``_vers`` (int64), ``_mins`` (int32 due minute),
  ``_cids`` (int32 class id) and ``_det`` (a bytearray: 1 when the row is
  detached, see below). No Python object is made per row except the key
  string itself, which every structure shares.
- ``_table`` maps a key to its slot: an open-addressing hash table (linear
  probing, deletion by backward shift, so no tombstones) of int32 slot
  numbers, kept at most 2/3 full. A dict would cost a per-row int object
  for the slot on top of its own entry; this costs 8 to 16 bytes a row.
- Each class keeps its rows as a sorted sequence of ``minute << 32 | slot``
  in blocks of int64 arrays (``keeper.order.Order``, a SortedList with no per-item
  objects). Sorted by minute, a class is already in rank order, so the best
  rows are a head of each class and no row is rescored; a count of rows
  between two minutes is two bisections, so counting follows classes, not
  rows.

Loading: ``load_rows`` takes the walk a chunk at a time (about 1 µs a row
here, against 2.5 to 3.5 by ``apply``). It enters the rows with one plain
loop and leaves their order values *pending*, unsorted, per class; the next
read (``best``, ``counts``, ``coming``, ``oldest_due``, ``lateness``,
``count_due_between``, ``reconfigure``, ``detach``; ``remove`` finds a
pending value where it is) merges each class's pending
values in with one sort, so a load pays one sort a class per publish instead
of a bisection and a block insert a row.

Best: a few counting passes over the classes find a rank threshold that
takes the k best rows or a few more; the heads above it become entries in one
comprehension a class and one sort orders them (about 2 ms for 5,000 here:
making the 5,000 entries is most of it). ``best_columns``, the keeper's, makes
only their ranks a row (floats), sorts an index by them and gathers each
column: no tuple a row, so no transpose for the ready set and no pass of the
collector over 5,000 fresh tuples.

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

Hazards:

- Slots and table cells are not returned to the allocator: the columns keep
  their largest size (a freed slot is reused by the next insert;
  ``load_rows`` appends).
- Growing the hash table rehashes every row in Python (about 0.3 µs a row,
  once per doubling: a 200 ms pause when it passes 699,050 rows);
  ``reserve`` or ``capacity`` sizes it ahead of a load.
- Until the first read after a load, its order values take 8 more bytes a
  row (the pending runs); the keeper publishes while it loads, which merges
  them.
- ``items`` walks the live columns: do not apply or remove while iterating.
- Minutes must fit in int32 (due times 0 to year 3000 do) and a node holds
  fewer than 2**31 rows.
- A class whose rows are all detached is not empty: it is not retired to
  make room under max_classes.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from itertools import chain, compress, islice, pairwise, repeat
from math import floor, isfinite
from operator import ge, is_, is_not, itemgetter, lt, not_
from typing import Any

from keeper.classes import ClassTable
from keeper.order import BLOCK_LOAD, SLOT_BITS, SLOT_MASK, Order, last_minute
from node.config import Config
from node.core.errors import TooManyClasses

try:  # the k-way merge best_columns ranks with; the Python below does the same
    from keeper import _best  # type: ignore[attr-defined]  # C, built by setup.py
except ImportError:
    _best = None  # type: ignore[assignment]

# ``best`` looks for a rank threshold that takes between k and
# k + max(BEST_SLACK_MIN, k >> BEST_SLACK_SHIFT) rows, in at most
# BEST_STEPS counting passes over the classes (then it takes more).
BEST_SLACK_MIN = 32
BEST_SLACK_SHIFT = 5
BEST_STEPS = 40
# Smallest hash table (cells); it doubles when more than 2/3 full.
MIN_TABLE = 8
_EMPTY = -1

# The ``coming`` windows, in minutes after the current one.
COMING_15M = 15
COMING_HOURS = 24

Entry = tuple[str, int, int, int, float]  # (key, version, minute, class id, rank)
# (keys, versions, due minutes, class ids, ranks): ``best_columns``.
Columns = tuple[list[str], list[int], list[int], list[int], list[float]]
# A walked row: (key, version, route, cadence_s, sitemap, due_at).
WalkedRow = tuple[str, int, str, "int | None", bool, float]

# Class ids in ``load_rows``' working column for rows it will not place.
_LATER = -1  # from the first row whose class would pass max_classes: row by row
_STALE = -2  # the row held is as new or newer
_CLASS_FIELDS = itemgetter(2, 3, 4)  # (route, cadence_s, sitemap) of a walked row
# ``best_columns`` reads the slots and minutes of order values as the two
# int32 halves of each int64 (``minute << SLOT_BITS | slot``, the minute
# signed), not by a shift and a mask a value: which half is which follows
# the byte order.
_SLOT_HALF, _MINUTE_HALF = (0, 1) if sys.byteorder == "little" else (1, 0)


def minute_of(t: float) -> int:
    """The due minute of a unix time: ``floor(t / 60)``."""
    return int(t // 60)


def _enter_probing(
    table: array[int],
    mask: int,
    held: list[str | None],
    rows: Sequence[WalkedRow],
    cids: list[int],
    add: dict[int, Any],
    version_of: Any,
    minute_of: Any,
) -> list[tuple[int, int]]:
    """``Buckets._enter``'s loop when a walked key may be held already."""
    slot = len(held)
    append = held.append
    found = []
    for j, ((key, version, _route, _cadence, _sitemap, due_at), cid) in enumerate(
        zip(rows, cids, strict=True)
    ):
        i = hash(key) & mask
        held_at = table[i]
        while held_at >= 0:
            if held[held_at] == key:
                found.append((j, held_at))
                break
            i = (i + 1) & mask
            held_at = table[i]
        else:
            minute = floor(due_at) // 60
            table[i] = slot
            append(key)
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


def _merge(
    values: array[int],
    starts: list[int],
    rates: list[tuple[float, float]],
    cids: list[int],
    now: float,
    k: int,
) -> tuple[list[int], list[float], list[int], list[int], list[int], bytearray]:
    """``keeper._best.merge`` in Python, for a build without it: every
    candidate's rank, one stable index sort, and a gather a column. The k
    best of the class runs in ``values`` (class ``cids[c]``'s from
    ``starts[c]``, its ``(cadence_s, boost)`` in ``rates[c]``), best first:
    ``(positions, ranks, slots, minutes, class ids, marks)``, marks a
    bytearray with 1 at each position picked."""
    # Each value's slot and minute, as the two int32 halves of its int64.
    halves = array("i", values.tobytes())
    slot_of, minute_of = halves[_SLOT_HALF::2], halves[_MINUTE_HALF::2]
    ranks: list[float] = []
    class_of: list[int] = []
    ends = [*starts[1:], len(values)] if starts else []
    for (cadence_s, boost), cid, start, end in zip(rates, cids, starts, ends, strict=True):
        ranks += [(now - m * 60) / cadence_s + boost for m in minute_of[start:end]]
        class_of += repeat(cid, end - start)
    picks = sorted(range(len(ranks)), key=ranks.__getitem__, reverse=True)
    del picks[k:]
    at = _getter(picks)
    marks = bytearray(len(values))
    deque(map(marks.__setitem__, picks, repeat(1)), maxlen=0)
    return picks, at(ranks), at(slot_of), at(minute_of), at(class_of), marks


def _getter(positions: list[int]):
    """A function taking a sequence to the list of its items at
    ``positions``: one ``itemgetter`` call, about half the time of a ``map``
    over an array's ``__getitem__`` (the publish gathers five columns of
    5,000 so)."""
    if len(positions) > 1:
        get = itemgetter(*positions)
        return lambda seq: list(get(seq))
    return lambda seq: [seq[i] for i in positions]

class Buckets:
    """The keeper's rows by class and due minute. See the module docstring."""

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
        self._keys: list[str | None] = []
        self._vers = array("q")
        self._mins = array("i")
        self._cids = array("i")
        self._free = array("i")  # slots whose key is None, reused first
        self._live = 0
        self._table = array("i", [_EMPTY]) * MIN_TABLE
        self._mask = MIN_TABLE - 1
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

    # -- the hash table ---------------------------------------------------------

    def reserve(self, rows: int) -> None:
        """Size the key table for ``rows`` rows now, instead of doubling (and
        rehashing in Python) while they arrive: no insert rehashes until more
        than ``rows`` rows are held. Call it with the table's row count before
        a load."""
        cells = len(self._table)
        while rows * 3 > cells * 2:
            cells <<= 1
        if cells != len(self._table):
            self._rehash(cells)

    def _rehash(self, cells: int) -> None:
        # A plain loop: passes of ``map`` over the table cost three times
        # as much here (each pass misses the cache again).
        table = array("i", [_EMPTY]) * cells
        mask = cells - 1
        for slot, key in enumerate(self._keys):
            if key is None:
                continue
            i = hash(key) & mask
            while table[i] >= 0:
                i = (i + 1) & mask
            table[i] = slot
        self._table = table
        self._mask = mask

    def _cell(self, key: str) -> int:
        """The table cell holding ``key``'s slot, or the empty cell ending its
        probe sequence."""
        table, mask, keys = self._table, self._mask, self._keys
        i = hash(key) & mask
        slot = table[i]
        while slot >= 0 and keys[slot] != key:
            i = (i + 1) & mask
            slot = table[i]
        return i

    def _clear_cell(self, i: int) -> None:
        """Empty cell ``i`` and shift later members of its cluster back, so
        every key stays reachable from its home cell without tombstones."""
        table, mask, keys = self._table, self._mask, self._keys
        j = i
        while True:
            j = (j + 1) & mask
            slot = table[j]
            if slot < 0:
                break
            home = hash(keys[slot]) & mask
            # The entry at j may fill the hole at i unless its home lies in
            # the cyclic range (i, j].
            if (i < home <= j) if i < j else (home > i or home <= j):
                continue
            table[i] = slot
            i = j
        table[i] = _EMPTY

    # -- changes (hot path) --------------------------------------------------------

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
        table, mask, keys = self._table, self._mask, self._keys
        i = hash(key) & mask
        slot = table[i]
        while slot >= 0 and keys[slot] != key:
            i = (i + 1) & mask
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
        if self._free:
            slot = self._free.pop()
            keys[slot] = key
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
        # Walked rows are restored state, not new occurrences: undo what
        # ``apply`` counted as coming due.
        self.came_due = came_due
        return applied, refused

    def _find_held(
        self, rows: Sequence[WalkedRow], keys: list[str], cids: list[int | None]
    ) -> list[tuple[int, int]]:
        """The rows of a chunk whose key is held: ``(row index, slot)``. Marks
        those held as new or newer ``_STALE`` in ``cids``."""
        table, mask, held, vers = self._table, self._mask, self._keys, self._vers
        found = []
        for j, key in enumerate(keys):
            i = hash(key) & mask
            slot = table[i]
            while slot >= 0 and held[slot] != key:
                i = (i + 1) & mask
                slot = table[i]
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
        pending: dict[int, list[int]] = {cid: [] for cid in set(cids)}
        add = {cid: values.append for cid, values in pending.items()}
        slot = len(held)
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
            held += keys
        else:
            found = _enter_probing(table, mask, held, rows, cids, add, version_of, minute_of)
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

    # -- detached rows --------------------------------------------------------------

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
        for key in keys:
            i = hash(key) & mask
            slot = table[i]
            while slot >= 0 and held[slot] != key:
                i = (i + 1) & mask
                slot = table[i]
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

    # -- reading ----------------------------------------------------------------

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

    def items(self) -> Iterator[tuple[str, int, int, int]]:
        """``(key, due minute, class id, version)`` of every row, in no order."""
        mins, cids, vers = self._mins, self._cids, self._vers
        for slot, key in enumerate(self._keys):
            if key is not None:
                yield key, mins[slot], cids[slot], vers[slot]

    def best(
        self,
        now: float,
        k: int,
        paused_routes: Container[str] = (),
        exclude: Container[str] | None = None,
    ) -> list[Entry]:
        """The best ``k`` due rows, best first: ``(key, version, minute, class
        id, rank)`` with rank = (now − minute·60) / cadence_s + boost. Classes
        of paused routes are skipped whole, keys in ``exclude`` one by one.
        Ties come in any order. ``best_columns`` gives the same rows as the
        columns the ready set publishes.

        Within a class the earliest minute ranks highest, so the answer is a
        head of each class and no row is rescored. A few counting passes over
        the classes (two bisections each) find a rank threshold that takes k
        rows or a few more (``_threshold``); each class's head above it is
        made into entries in one comprehension, and one sort of those runs
        (each already in rank order) orders them."""
        if k <= 0:
            return []
        now_minute, active, total = self._active(now, paused_routes)
        target = k + self._best_excluded if exclude is not None else k
        keys, vers = self._keys, self._vers
        remember = self._remember_best and exclude is None
        while True:
            counts, slack = self._counts(active, now, now_minute, total, target)
            out: list[Entry] = []
            runs = []
            taken = 0
            for (order, cid, cadence_s, boost, _n, _head), n in zip(active, counts, strict=True):
                if not n:
                    continue
                run = order.head(n)
                taken += n
                if remember:
                    runs.append((cid, run))
                if exclude is None:
                    out += [
                        (
                            keys[(slot := value & SLOT_MASK)],
                            vers[slot],
                            (minute := value >> SLOT_BITS),
                            cid,
                            (now - minute * 60) / cadence_s + boost,
                        )
                        for value in run
                    ]
                else:
                    out += [
                        (
                            key,
                            vers[slot],
                            (minute := value >> SLOT_BITS),
                            cid,
                            (now - minute * 60) / cadence_s + boost,
                        )
                        for value in run
                        if (key := keys[(slot := value & SLOT_MASK)]) not in exclude
                    ]
            if exclude is not None:
                self._best_excluded = taken - len(out)
            candidates = out[:] if remember else out
            out.sort(key=itemgetter(4), reverse=True)
            del out[k:]
            if self._enough(active, counts, total, now, out[-1][4] if len(out) == k else None):
                if remember:
                    self._remember_runs(runs, candidates)
                return out
            target += max(k - len(out), 0) + slack

    def best_columns(
        self,
        now: float,
        k: int,
        paused_routes: Container[str] = (),
        exclude: Container[str] | None = None,
        detach: bool = False,
    ) -> Columns:
        """``best`` as the columns ``ReadySet.publish_columns`` takes: ``(keys,
        versions, due minutes, class ids, ranks)``, best first.

        ``detach``: detach the keys returned, as ``detach_many`` would (the
        keeper's live sets stay out of the next): their values are at hand,
        so no key is looked up, and nothing is remembered for a later
        ``detach_many``.

        Built as columns: each class's head run is copied out of its order
        into one array, and a k-way merge of the runs by rank (in C,
        ``keeper._best.merge``: within a run the ranks never rise; in Python
        without it, every rank and one stable index sort) gives the k best
        with their slots, minutes and classes; a gather a column takes the
        keys and versions. No
        tuple a row: with the publish that takes the columns as they are, it
        measured 0.6 to 0.8 of ``best`` and ``ReadySet.publish`` in the
        keeper's loop (no transpose, and no collector passes over 5,000 fresh
        tuples). With an ``exclude`` set, which needs every candidate's key
        before the sort, it is ``best`` transposed."""
        if exclude is not None:
            entries = self.best(now, k, paused_routes, exclude)
            if not entries:
                return [], [], [], [], []
            keys, versions, minutes, cids, ranks = map(list, zip(*entries, strict=True))
            return keys, versions, minutes, cids, ranks
        if k <= 0:
            return [], [], [], [], []
        now_minute, active, total = self._active(now, paused_routes)
        target = k
        while True:
            counts, slack = self._counts(active, now, now_minute, total, target)
            values = array("q")  # the heads taken, class by class
            starts: list[int] = []  # where each class's run starts in ``values``
            cids: list[int] = []  # type: ignore[no-redef]  # the other branch returned
            rates = []
            for (order, cid, cadence_s, boost, _n, _head), n in zip(active, counts, strict=True):
                if n:
                    starts.append(len(values))
                    cids.append(cid)
                    rates.append((cadence_s, boost))
                    values += order.head(n)
            if _best is not None:
                cadences, boosts = [float(r[0]) for r in rates], [float(r[1]) for r in rates]
                merged = _best.merge(values, starts, cadences, boosts, cids, now, k)
            else:
                merged = _merge(values, starts, rates, cids, now, k)
            picks, picked_ranks, picked_slots, picked_minutes, picked_cids, marks = merged
            kth = picked_ranks[-1] if len(picks) == k else None
            if self._enough(active, counts, total, now, kth):
                break
            target += max(k - len(picks), 0) + slack
        at_slots = _getter(picked_slots)
        keys = at_slots(self._keys)
        columns = (keys, at_slots(self._vers), picked_minutes, picked_cids, picked_ranks)
        starts.append(len(values))
        if detach:
            self._detach_picked(values, starts, cids, picked_slots, marks)
        elif self._remember_best:
            slot_of = array("i", values.tobytes())[_SLOT_HALF::2]
            self._remember(values, slot_of, starts, cids, dict(zip(keys, picks, strict=True)))
        return columns

    def _detach_picked(
        self,
        values: array[int],
        starts: list[int],
        cids: list[int],
        slots: list[int],
        marks: bytearray,
    ) -> None:
        """``best_columns(detach=True)``'s last step: detach the candidates
        ``marks`` picks (their ``slots``), all attached (best reads the
        attached orders only), and forget any remembered best."""
        if self._dirty:
            self._flush()
        if _best is not None:
            _best.flag(self._det, slots, 1)
        else:
            deque(map(self._det.__setitem__, slots, repeat(1)), maxlen=0)
        by_class: dict[int, list[int]] = {}
        self._by_class(list(compress(values, marks)), marks, starts, cids, by_class)
        self._move_classes(by_class, detached=True)
        self._best_at = {}

    def _active(
        self, now: float, paused_routes: Container[str]
    ) -> tuple[int, list[tuple[Any, ...]], int]:
        """``(now minute, active classes, their due rows)``: each class with due
        rows, not paused, as ``(order, class id, cadence_s, boost, due rows,
        head value)``."""
        now_minute = int(now // 60)
        self.advance(now_minute)  # the per-class due counts, exact now
        info = self.classes.info
        due = self._due
        active = []
        for cid, order in self._order.items():
            n = due[cid]
            if n > 0:
                c = info(cid)
                if c.route not in paused_routes:
                    active.append((order, cid, c.cadence_s, c.boost, n, order.blocks[0][0]))
        return now_minute, active, sum(a[4] for a in active)

    def _counts(
        self, active: list[tuple[Any, ...]], now: float, now_minute: int, total: int, target: int
    ) -> tuple[list[int], int]:
        """How many head rows to take of each active class: at least
        ``target`` in all (or every due row), at most ``slack`` more."""
        slack = max(BEST_SLACK_MIN, target >> BEST_SLACK_SHIFT)
        if total <= target + slack:
            return [a[4] for a in active], slack
        return self._threshold(active, now, now_minute, total, target), slack

    def _enough(
        self,
        active: list[tuple[Any, ...]],
        counts: list[int],
        total: int,
        now: float,
        floor: float | None,
    ) -> bool:
        """Whether the answer taken (``floor``: its k-th rank, None when it
        has fewer than k rows) is the best k: every due row was taken, or k
        were and no row left out ranks above the k-th (each class's first
        row not taken is its best one left; a check against rounding in the
        threshold)."""
        if sum(counts) == total:
            return True
        if floor is None:
            return False
        for (order, _cid, cadence_s, boost, n, _head), taken in zip(active, counts, strict=True):
            if taken < n:
                value = order.at(taken)
                if (now - (value >> SLOT_BITS) * 60) / cadence_s + boost > floor:
                    return False
        return True

    def _threshold(
        self, active: list[tuple[Any, ...]], now: float, now_minute: int, total: int, target: int
    ) -> list[int]:
        """Per active class, how many head rows rank at or above a threshold
        that takes ``target`` rows or a few more (at least ``target``). The
        threshold is found by regula falsi (Illinois) on the count, starting
        from the last call's."""
        slack = max(BEST_SLACK_MIN, target >> BEST_SLACK_SHIFT)
        mid = target + slack / 2

        def counts_at(threshold: float) -> list[int]:
            out = []
            for order, _cid, cadence_s, boost, n, head in active:
                # rank >= threshold  <=>  minute <= last
                last = (now - (threshold - boost) * cadence_s) // 60
                if last >= now_minute:
                    out.append(n)
                else:
                    bound = (int(last) + 1) << SLOT_BITS
                    out.append(order.count_below(bound) if bound > head else 0)
            return out

        # Bracket: at ``low`` every due row ranks above, at ``high`` none does.
        low = min((now - now_minute * 60) / a[2] + a[3] for a in active) - 1.0
        high = max((now - (a[5] >> SLOT_BITS) * 60) / a[2] + a[3] for a in active) + 1.0
        f_low, f_high = total - mid, -mid
        low_counts = [a[4] for a in active]
        hint = self._best_hint
        guess = hint if hint is not None and low < hint < high else None
        side = 0
        for _ in range(BEST_STEPS):
            threshold = (
                guess if guess is not None else low + (high - low) * f_low / (f_low - f_high)
            )
            guess = None
            if not low < threshold < high:
                threshold = (low + high) / 2
                if not low < threshold < high:
                    break  # the bracket is down to one float: a tie at the edge
            counts = counts_at(threshold)
            f = sum(counts)
            if target <= f <= target + slack:
                self._best_hint = threshold
                return counts
            if f > target:
                low, f_low, low_counts = threshold, f - mid, counts
                if side > 0:
                    f_high /= 2
                side = 1
            else:
                high, f_high = threshold, f - mid
                if side < 0:
                    f_low /= 2
                side = -1
        self._best_hint = low
        return low_counts

    # -- counting (costs classes, not rows) -----------------------------------------

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
        soon = 0
        by_hour = [0] * COMING_HOURS
        for order in chain(self._order.values(), self._order_detached.values()):
            if not order.size or order.maxes[-1] < lo or order.blocks[0][0] >= hi:
                continue
            p = order.positions(bounds)
            soon += p[1] - p[0]
            by_hour[0] += p[2] - p[0]
            for h in range(1, COMING_HOURS):
                by_hour[h] += p[h + 2] - p[h + 1]
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
        for cid, order in self._order.items():
            orders = [o for o in self._orders_of(cid, order) if o.size and o.blocks[0][0] < limit]
            if not orders:
                continue
            cadence_s = info(cid).cadence_s
            # ratio >= edge  <=>  minute <= last: bounds ascend as edges descend.
            lasts = [min(last_minute(now, edge, cadence_s), now_minute) for edge in edges]
            bounds = [(last + 1) << SLOT_BITS for last in reversed(lasts)]
            at_least = list(map(sum, zip(*(o.positions(bounds) for o in orders), strict=True)))
            at_least.reverse()  # at_least[i]: due rows with ratio >= edges[i]
            at_least.append(0)
            out[cid] = [a - b for a, b in pairwise(at_least)]
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

    # -- configuration ----------------------------------------------------------

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
