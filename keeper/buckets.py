"""The keeper's in-memory schedule: key → (due minute, class, version), and per
class the rows in due-minute order. This is the hot path: every change of the
feed goes through ``apply`` or ``remove``, and the ready set is ``best``.

Layout, chosen for memory (``bench/bench_buckets.py`` measures it against a
plain dict-and-sets layout; the numbers are in its docstring):

- A row lives in a **slot**, an index into four parallel columns:
  ``_keys`` (list of str), ``_vers`` (int64), ``_mins`` (int32 due minute)
  and ``_cids`` (int32 class id). No Python object is made per row except
  the key string itself, which every structure shares.
- ``_table`` maps a key to its slot: an open-addressing hash table (linear
  probing, deletion by backward shift, so no tombstones) of int32 slot
  numbers, kept at most 2/3 full. A dict would cost a per-row int object
  for the slot on top of its own entry; this costs 8 to 16 bytes a row.
- Each class keeps its rows as a sorted sequence of ``minute << 32 | slot``
  in blocks of int64 arrays (``_Order``, a SortedList with no per-item
  objects). Sorted by minute, a class is already in rank order, so ``best``
  merges class heads and never rescores a row; a count of rows between two
  minutes is two bisections, so counting follows classes, not rows.

Counting: each class keeps a running count of its rows due through minute
``_through``; ``advance`` moves ``_through`` forward (or back, if the clock
steps back) counting only the rows it crosses, and ``apply``/``remove`` keep
the counts in step.

Hazards:

- Slots and table cells are not returned to the allocator: the columns keep
  their largest size (a freed slot is reused by the next insert).
- Growing the hash table rehashes every row in Python (about 0.4 µs a row,
  once per doubling); ``reserve`` or ``capacity`` sizes it ahead of a load.
- ``items`` walks the live columns: do not apply or remove while iterating.
- Minutes must fit in int32 (due times 0 to year 3000 do) and a node holds
  fewer than 2**31 rows.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Container, Iterable, Iterator
from heapq import heapify, heappop, heapreplace
from itertools import chain, islice
from math import ceil
from operator import itemgetter
from typing import Any

from keeper.classes import ClassTable
from node.config import Config
from node.errors import TooManyClasses

# Entries per block of a class's order: inserting shifts at most 2x this many
# int64s (~16 KB), a block split or join copies as much; larger blocks cost
# less per block, smaller ones less per insert.
BLOCK_LOAD = 1000
# ``best`` takes a class's rows in runs of RUN_MIN, doubling to RUN_MAX while
# the class keeps winning: a heap step is paid per run, not per row, and where
# classes interleave row by row a run wastes at most RUN_MAX rows that lose.
RUN_MIN = 16
RUN_MAX = 64
# The low bits of an order entry hold the slot, the high bits the due minute.
SLOT_BITS = 32
SLOT_MASK = (1 << SLOT_BITS) - 1
# Smallest hash table (cells); it doubles when more than 2/3 full.
MIN_TABLE = 8
_EMPTY = -1

# The ``coming`` windows, in minutes after the current one.
COMING_15M = 15
COMING_HOURS = 24

Entry = tuple[str, int, int, int, float]  # (key, version, minute, class id, rank)


def minute_of(t: float) -> int:
    """The due minute of a unix time: ``floor(t / 60)``."""
    return int(t // 60)


class _Order:
    """One class's rows, ``minute << SLOT_BITS | slot`` ascending, in blocks of
    int64 arrays with each block's last value in ``maxes`` (the layout of
    sortedcontainers.SortedList, minus the per-item int objects)."""

    __slots__ = ("blocks", "maxes", "size", "load")

    def __init__(self, load: int) -> None:
        self.blocks: list[array[int]] = []
        self.maxes: list[int] = []
        self.size = 0
        self.load = load

    @classmethod
    def from_sorted(cls, values: Iterable[int], load: int) -> _Order:
        order = cls(load)
        flat = array("q", values)
        for start in range(0, len(flat), load):
            block = flat[start : start + load]
            order.blocks.append(block)
            order.maxes.append(block[-1])
        order.size = len(flat)
        return order

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self.blocks)

    def add(self, value: int) -> None:
        maxes = self.maxes
        self.size += 1
        if not maxes:
            self.blocks.append(array("q", (value,)))
            maxes.append(value)
            return
        i = bisect_left(maxes, value)
        if i == len(maxes):
            i -= 1
            block = self.blocks[i]
            block.append(value)
            maxes[i] = value
        else:
            block = self.blocks[i]
            block.insert(bisect_left(block, value), value)
        if len(block) > 2 * self.load:
            self._split(i)

    def remove(self, value: int) -> None:
        """Remove a value the order holds (the caller knows it does)."""
        maxes = self.maxes
        i = bisect_left(maxes, value)
        block = self.blocks[i]
        j = bisect_left(block, value)
        del block[j]
        self.size -= 1
        n = len(block)
        if n == 0:
            del self.blocks[i]
            del maxes[i]
            return
        if j == n:
            maxes[i] = block[n - 1]
        if n < self.load >> 1 and len(maxes) > 1:
            self._join(i)

    def _split(self, i: int) -> None:
        block = self.blocks[i]
        half = len(block) >> 1
        self.blocks.insert(i + 1, block[half:])
        del block[half:]
        self.maxes.insert(i, block[-1])

    def _join(self, i: int) -> None:
        """Join small block ``i`` with a neighbour, so blocks stay large enough
        that their per-block cost stays small per row."""
        if i + 1 == len(self.blocks):
            i -= 1
        left = self.blocks[i]
        left.extend(self.blocks[i + 1])
        del self.blocks[i + 1]
        self.maxes[i] = self.maxes[i + 1]
        del self.maxes[i + 1]
        if len(left) > 2 * self.load:
            self._split(i)

    def count_range(self, lo: int, hi: int) -> int:
        """How many values are in ``[lo, hi)``: two bisections plus a sum over
        the blocks in between (each block holds hundreds of rows)."""
        maxes = self.maxes
        if hi <= lo or not maxes or maxes[-1] < lo or self.blocks[0][0] >= hi:
            return 0
        blocks = self.blocks
        i = bisect_left(maxes, lo)
        j = bisect_left(maxes, hi, i)
        start = bisect_left(blocks[i], lo)
        if i == j:
            return bisect_left(blocks[i], hi, start) - start
        n = len(blocks[i]) - start + sum(map(len, islice(blocks, i + 1, j)))
        if j < len(blocks):
            n += bisect_left(blocks[j], hi)
        return n

    def positions(self, bounds: list[int]) -> list[int]:
        """For ascending ``bounds``, how many values are below each one."""
        maxes, blocks = self.maxes, self.blocks
        nblocks = len(maxes)
        out: list[int] = []
        bi = 0
        before = 0  # values in blocks[:bi]
        for bound in bounds:
            i = bisect_left(maxes, bound, bi)
            if i == nblocks:
                out.extend([self.size] * (len(bounds) - len(out)))
                break
            if i > bi:
                before += sum(map(len, islice(blocks, bi, i)))
                bi = i
            out.append(before + bisect_left(blocks[i], bound))
        return out


class Buckets:
    """The keeper's rows by class and due minute. See the module docstring."""

    def __init__(
        self, classes: ClassTable, *, capacity: int = 0, block_load: int = BLOCK_LOAD
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
        self._order: dict[int, _Order] = {}
        self._due: dict[int, int] = {}  # rows with minute <= _through, per class
        self._through = -1

    # -- the hash table ---------------------------------------------------------

    def reserve(self, rows: int) -> None:
        """Size the key table for ``rows`` rows now, instead of doubling (and
        rehashing in Python) while they arrive."""
        cells = len(self._table)
        while rows * 3 > cells * 2:
            cells <<= 1
        if cells != len(self._table):
            self._rehash(cells)

    def _rehash(self, cells: int) -> None:
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
        self._table[i] = slot
        self._live += 1
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
        self._keys[slot] = None
        self._free.append(slot)
        self._live -= 1
        self._clear_cell(i)
        return True

    def _place(self, slot: int, cid: int, minute: int) -> None:
        order = self._order.get(cid)
        if order is None:
            order = self._order[cid] = _Order(self._block_load)
            self._due[cid] = 0
        order.add(minute << SLOT_BITS | slot)
        if minute <= self._through:
            self._due[cid] += 1

    def _unplace(self, slot: int, cid: int, minute: int) -> None:
        self._order[cid].remove(minute << SLOT_BITS | slot)
        if minute <= self._through:
            self._due[cid] -= 1

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
            if order is None or not order.size:
                self._order.pop(cid, None)
                self._due.pop(cid, None)
                self.classes.retire(cid)
                retired += 1
        return retired

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
        id, rank)`` with rank = (now − minute·60) / cadence_s + boost.

        A merge over class heads: within a class the earliest minute ranks
        highest, so no row is rescored. Each class is taken a run at a time
        (runs double while the class keeps winning) and the merge stops once
        no class head can beat the k-th best rank taken; one sort of the runs
        taken orders the answer. Classes of paused routes are skipped whole,
        keys in ``exclude`` one by one. Ties come in any order.
        """
        if k <= 0:
            return []
        limit = (int(now // 60) + 1) << SLOT_BITS  # entries below it are due
        heap = self._heads(now, limit, paused_routes)
        out: list[Entry] = []
        floor: list[float] | None = None  # min-heap of the k best ranks taken
        while heap:
            head = heap[0]
            if floor is not None and -head[0] <= floor[0]:
                break  # nothing left untaken beats the k-th best (ties: any order)
            taken, end = self._take_run(head, now, limit, k - len(out), floor, exclude)
            out.extend(taken)
            _neg, cid, blocks, bi, _pos, cadence_s, boost, run = head
            if end == len(blocks[bi]):
                bi += 1
                end = 0
            if bi == len(blocks) or blocks[bi][end] >= limit:
                heappop(heap)
            else:
                rank = (now - (blocks[bi][end] >> SLOT_BITS) * 60) / cadence_s + boost
                heapreplace(
                    heap, (-rank, cid, blocks, bi, end, cadence_s, boost, min(run * 2, RUN_MAX))
                )
            if floor is not None:
                for entry in taken:
                    if entry[4] > floor[0]:
                        heapreplace(floor, entry[4])
            elif len(out) >= k:
                # Runs are each in rank order, so this sort is mostly merging.
                out.sort(key=itemgetter(4), reverse=True)
                del out[k:]  # none of these can beat the k-th (ties: any order)
                floor = [entry[4] for entry in reversed(out)]  # ascending: a min-heap
        out.sort(key=itemgetter(4), reverse=True)
        del out[k:]
        return out

    def _heads(
        self, now: float, limit: int, paused_routes: Container[str]
    ) -> list[tuple[Any, ...]]:
        """A heap of the classes with due rows: ``(-rank of the head row, class
        id, blocks, block index, position, cadence_s, boost, run length)``."""
        heap = []
        for cid, order in self._order.items():
            if not order.size:
                continue
            head = order.blocks[0][0]
            if head >= limit:
                continue
            info = self.classes.info(cid)
            if info.route in paused_routes:
                continue
            rank = (now - (head >> SLOT_BITS) * 60) / info.cadence_s + info.boost
            heap.append((-rank, cid, order.blocks, 0, 0, info.cadence_s, info.boost, RUN_MIN))
        heapify(heap)
        return heap

    def _take_run(
        self,
        head: tuple[Any, ...],
        now: float,
        limit: int,
        wanted: int,
        floor: list[float] | None,
        exclude: Container[str] | None,
    ) -> tuple[list[Entry], int]:
        """The next run of due rows of the class at ``head``, within one block:
        up to ``wanted`` rows while fewer than k are taken, then only the rows
        that beat the k-th best rank so far; less the excluded keys. Returns
        them and where the run ended."""
        _neg, cid, blocks, bi, pos, cadence_s, boost, run = head
        block = blocks[bi]
        if floor is None:
            end = min(pos + min(run, max(RUN_MIN, wanted)), len(block))
            if block[end - 1] >= limit:
                end = bisect_left(block, limit, pos, end)
        else:
            # rank > floor[0] holds below this minute; the head row beats it,
            # so take at least that one whatever the rounding.
            beat = ceil((now - (floor[0] - boost) * cadence_s) / 60)
            stop = min(pos + RUN_MAX, len(block))
            end = max(pos + 1, bisect_left(block, min(beat << SLOT_BITS, limit), pos, stop))
        keys, vers = self._keys, self._vers
        if exclude is None:
            taken = [
                (
                    keys[(slot := value & SLOT_MASK)],
                    vers[slot],
                    (minute := value >> SLOT_BITS),
                    cid,
                    (now - minute * 60) / cadence_s + boost,
                )
                for value in block[pos:end]
            ]
        else:
            taken = [
                (
                    key,
                    vers[slot],
                    (minute := value >> SLOT_BITS),
                    cid,
                    (now - minute * 60) / cadence_s + boost,
                )
                for value in block[pos:end]
                if (key := keys[(slot := value & SLOT_MASK)]) not in exclude
            ]
        return taken, end

    # -- counting (costs classes, not rows) -----------------------------------------

    def advance(self, now_minute: int) -> None:
        """Bring the per-class due counts to ``now_minute``, counting only the
        rows whose minute lies between the last call's and this one's."""
        through = self._through
        if now_minute == through:
            return
        due = self._due
        if now_minute > through:
            lo, hi = (through + 1) << SLOT_BITS, (now_minute + 1) << SLOT_BITS
            for cid, order in self._order.items():
                due[cid] += order.count_range(lo, hi)
        else:
            lo, hi = (now_minute + 1) << SLOT_BITS, (through + 1) << SLOT_BITS
            for cid, order in self._order.items():
                due[cid] -= order.count_range(lo, hi)
        self._through = now_minute

    def counts(self, now: float) -> dict[str, Any]:
        """``{"due": {"sitemap", "discovered", "total"}, "per_class": {cid:
        (rows, due)}, "rows", "classes"}``; classes without rows are left out
        of ``per_class``."""
        self.advance(int(now // 60))
        info = self.classes.info
        sitemap = discovered = 0
        per_class: dict[int, tuple[int, int]] = {}
        for cid, order in self._order.items():
            if not order.size:
                continue
            due = self._due[cid]
            per_class[cid] = (order.size, due)
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
        first = int(now // 60) + 1  # the first minute not yet due
        offsets = [0, COMING_15M, *range(60, 60 * COMING_HOURS + 1, 60)]
        bounds = [(first + off) << SLOT_BITS for off in offsets]
        lo, hi = bounds[0], bounds[-1]
        soon = 0
        by_hour = [0] * COMING_HOURS
        for order in self._order.values():
            if not order.size or order.maxes[-1] < lo or order.blocks[0][0] >= hi:
                continue
            p = order.positions(bounds)
            soon += p[1] - p[0]
            by_hour[0] += p[2] - p[0]
            for h in range(1, COMING_HOURS):
                by_hour[h] += p[h + 2] - p[h + 1]
        return {"15m": soon, "60m": by_hour[0], "24h": sum(by_hour), "by_hour": by_hour}

    def oldest_due(self, now: float) -> dict[int, int]:
        """The head (earliest) minute of each class that has due rows."""
        limit = (int(now // 60) + 1) << SLOT_BITS
        return {
            cid: order.blocks[0][0] >> SLOT_BITS
            for cid, order in self._order.items()
            if order.size and order.blocks[0][0] < limit
        }

    # -- configuration ----------------------------------------------------------

    def reconfigure(self, config: Config) -> None:
        """Take a new configuration (SIGHUP): classes relabel in place, and the
        rows of a class that merged into another move there. No store reads."""
        for old, new in self.classes.reconfigure(config):
            src = self._order.pop(old, None)
            moved_due = self._due.pop(old, 0)
            if src is None or not src.size:
                continue
            cids = self._cids
            for value in src:
                cids[value & SLOT_MASK] = new
            dst = self._order.get(new)
            values = sorted(chain(src, dst)) if dst is not None else list(src)
            self._order[new] = _Order.from_sorted(values, self._block_load)
            self._due[new] = self._due.get(new, 0) + moved_due
