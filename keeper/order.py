"""One class's rows in due-minute order: ``Order``, the sorted sequence the
keeper's buckets (``keeper/buckets/``) keep per class, and the minute
arithmetic of lateness bounds.

A value is ``minute << SLOT_BITS | slot``: sorted by value, a class is sorted
by due minute (and so by rank), and the slot finds the row's columns. Blocks
of int64 arrays with each block's last value in ``maxes`` (SortedList's
layout, without a Python object per value): a count between two minutes is
two bisections, an insert shifts at most one block.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice, repeat

try:  # the merges in C (keeper/_best_order.c); the Python below does the same
    from keeper import _best  # type: ignore[attr-defined]  # C, built by setup.py
except ImportError:
    _best = None  # type: ignore[assignment]

# Entries per block of a class's order: inserting shifts at most 2x this many
# int64s (~16 KB), a block split or join copies as much; larger blocks cost
# less per block, smaller ones less per insert.
BLOCK_LOAD = 1000
# ``Order.flush``: rebuild the whole order (one sort that merges two runs)
# when it holds fewer than MERGE_REBUILD values per value added, else work
# block by block, merging a block whose share is more than 1/MERGE_BLOCK of
# it and inserting into the others.
MERGE_REBUILD = 8
MERGE_BLOCK = 10
# ``Order.remove_sorted``: a block's share that is not one run goes by one
# filter of the span it covers when that span is under SPAN_FILTER values a
# value removed (a filter costs the span, a ``del`` the rest of the block).
SPAN_FILTER = 8
# The low bits of an order entry hold the slot, the high bits the due minute.
SLOT_BITS = 32
SLOT_MASK = (1 << SLOT_BITS) - 1


def last_minute(now: float, ratio: float, cadence_s: int) -> int:
    """The latest minute whose lateness ratio ``(now - minute * 60) /
    cadence_s`` is at least ``ratio``, as that float expression computes it
    (the ranks use the same one). The floor of the exact bound can be one off
    at a boundary in floats, so the guess is corrected against the
    expression itself, which never rises with the minute."""
    minute = int((now - ratio * cadence_s) // 60)
    while (now - (minute + 1) * 60) / cadence_s >= ratio:
        minute += 1
    while (now - minute * 60) / cadence_s < ratio:
        minute -= 1
    return minute


def _merge_into(block: array[int], part: list[int]) -> None:
    """Merge ascending ``part`` (none held) into ``block``: appended when it
    lies past the block's end; else merged with the block's tail from where
    it starts (one sort of two runs) or, when it is small for that tail,
    inserted from the right, so the positions found first stay valid."""
    at = bisect_left(block, part[0])
    tail = len(block) - at
    if not tail:
        block.fromlist(part)
    elif len(part) * MERGE_BLOCK > tail:
        values = block[at:].tolist()
        values += part
        values.sort()  # two runs: a merge
        del block[at:]
        block.fromlist(values)
    else:
        pos = list(map(bisect_left, repeat(block), part, repeat(at)))
        deque(map(block.insert, reversed(pos), reversed(part)), maxlen=0)


class Order:
    """One class's rows, ``minute << SLOT_BITS | slot`` ascending, in blocks of
    int64 arrays with each block's last value in ``maxes`` (the layout of
    sortedcontainers.SortedList, minus the per-item int objects).

    ``pending`` holds values added in bulk (``load_rows``) and not merged in
    yet: runs of them in no order, one exact-size int64 array a chunk (a list
    of ints would keep an int object a value alive, scattered over the heap
    by the time the flush sorts them, at a third more cost; one array grown
    by appends leaves its old copies behind, about 2 bytes a row of memory
    the process keeps). ``size`` counts them. Everything that reads the
    blocks runs after ``flush``, which ``Buckets`` calls before any read."""

    __slots__ = ("blocks", "maxes", "size", "load", "pending")

    def __init__(self, load: int) -> None:
        self.blocks: list[array[int]] = []
        self.maxes: list[int] = []
        self.size = 0
        self.load = load
        self.pending: list[array[int]] = []

    @classmethod
    def from_sorted(cls, values: Iterable[int], load: int) -> Order:
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

    def remove(self, value: int) -> bool:
        """Remove a value the order holds (the caller knows it does). False
        when it was still pending."""
        for run in self.pending:
            if value in run:
                run.remove(value)
                self.size -= 1
                return False
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
            return True
        if j == n:
            maxes[i] = block[n - 1]
        if n < self.load >> 1 and len(maxes) > 1:
            self._join(i)
        return True

    def add_sorted(self, values: list[int]) -> None:
        """Add many values (ascending, none held yet) with one merge."""
        if not values:
            return
        if self.pending:  # merged together with the pending runs
            self.pending.append(array("q", values))
            self.size += len(values)
            self.flush()
            return
        self.size += len(values)
        self._merge(values)

    def remove_sorted(self, values: list[int]) -> None:
        """Remove many values the order holds, ascending, none pending (the
        caller flushes first). Each block's share is found with one
        bisection, then goes in one slice deletion when it is one run of the
        block (the usual case: the keeper detaches the keys just granted, a
        class's head), or else by one filter of the span it covers when that
        span is short for its share, or else one ``del`` a value. Only the
        blocks touched are tidied."""
        blocks, maxes = self.blocks, self.maxes
        n = len(values)
        k = i = 0
        touched: list[int] = []
        while k < n:
            i = bisect_left(maxes, values[k], i)
            end = bisect_right(values, maxes[i], k)
            block = blocks[i]
            first = bisect_left(block, values[k])
            m = end - k
            if m == 1:
                del block[first]
            else:
                last = bisect_left(block, values[end - 1], first)
                if last - first == m - 1:  # the share is block[first:last + 1]
                    del block[first : last + 1]
                elif last - first < SPAN_FILTER * m:
                    drop = set(values[k:end])
                    block[first : last + 1] = array(
                        "q", [v for v in block[first : last + 1] if v not in drop]
                    )
                else:
                    for j in range(end - 1, k, -1):
                        del block[bisect_left(block, values[j], first)]
                    del block[first]
            touched.append(i)
            k = end
            i += 1
        self.size -= n
        half = self.load >> 1
        small = False
        for i in touched:
            block = blocks[i]
            if len(block) < half:
                small = True
            else:
                maxes[i] = block[-1]
        if small:
            self._tidy()

    def _tidy(self) -> None:
        """Drop empty blocks, join runs of small ones, recompute ``maxes``."""
        half, most = self.load >> 1, 2 * self.load
        out: list[array[int]] = []
        for block in self.blocks:
            if not block:
                continue
            if out and (len(out[-1]) < half or len(block) < half) and (
                len(out[-1]) + len(block) <= most
            ):
                out[-1].extend(block)
            else:
                out.append(block)
        self.blocks = out
        self.maxes = [block[-1] for block in out]

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
        """For ascending ``bounds``, how many values are below each one (in
        C: one walk over the blocks, no Python call a bound)."""
        if _best is not None:
            return _best.positions(self.blocks, bounds)  # type: ignore[no-any-return]
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

    def count_below(self, bound: int) -> int:
        """How many values are below ``bound``; cheapest near the head."""
        blocks = self.blocks
        if not blocks:
            return 0
        first = blocks[0]
        if first[-1] >= bound:
            return bisect_left(first, bound)
        i = bisect_left(self.maxes, bound)
        n = sum(map(len, islice(blocks, i)))
        if i < len(blocks):
            n += bisect_left(blocks[i], bound)
        return n

    def head(self, n: int) -> array[int]:
        """The first ``n`` values (at most ``size``)."""
        first = self.blocks[0]
        if n <= len(first):
            return first[:n]
        out = array("q")
        for block in self.blocks:
            if n <= len(block):
                out += block[:n]
                break
            out += block
            n -= len(block)
        return out

    def at(self, pos: int) -> int:
        """The value at position ``pos`` (< ``size``)."""
        for block in self.blocks:
            if pos < len(block):
                return block[pos]
            pos -= len(block)
        raise IndexError(pos)

    def flush(self) -> Sequence[int]:
        """Merge the pending values in (``_merge``); returns them, ascending.
        In C: one radix sort of the runs' int64s and a merge block by block,
        no int object a value (~40 ms for 1,000,000 values, where the
        Python below took ~200 ms: the first publish during a load)."""
        if not self.pending:
            return []
        if _best is not None:
            runs, self.pending = self.pending, []
            values = _best.sort_runs(runs)
            if values:
                _best.merge_blocks(self.blocks, self.maxes, values, self.load)
            return values  # type: ignore[no-any-return]
        new: list[int] = []
        for run in self.pending:
            new += run  # fresh ints, side by side: a sort with fewer misses
        self.pending = []
        if not new:
            return new
        new.sort()
        self._merge(new)
        return new

    def _merge(self, new: list[int]) -> None:
        """Merge ``new`` (ascending, not held; ``size`` counts them already).

        Few values for the order's size go in block by block: each block's
        share is found with one bisection per block and merged in
        (``_merge_into``: values past a block's end, as granted keys join a
        detached order, cost no more than their own number). Many values for
        the order's size rebuild it with one sort of two runs. No bisection
        of ``maxes`` per value, no split per value. In C, each block with a
        share is rebuilt as the merge of the two (``keeper._best.merge_blocks``)."""
        if _best is not None:
            _best.merge_blocks(self.blocks, self.maxes, array("q", new), self.load)
            return
        m = len(new)
        held = self.size - m
        if held < MERGE_REBUILD * m:
            if held:
                values: list[int] = []
                for block in self.blocks:
                    values += block
                values += new
                values.sort()  # two runs: a merge
                self._rebuild(values)
            else:
                self._rebuild(new)
            return
        blocks, maxes = self.blocks, self.maxes
        if len(blocks) == 1:
            cuts = [m]
        else:
            cuts = list(map(bisect_right, repeat(new), maxes))
            cuts[-1] = m  # above the last block's max: the last block
        start = 0
        split = False
        most = 2 * self.load
        for i, cut in enumerate(cuts):
            if cut == start:
                continue
            block = blocks[i]
            _merge_into(block, new[start:cut] if start or cut < m else new)
            start = cut
            maxes[i] = block[-1]
            if len(block) > most:
                split = True
        if split:
            for i in range(len(blocks) - 1, -1, -1):
                if len(blocks[i]) > most:
                    self._split_even(i)

    def _rebuild(self, values: list[int]) -> None:
        load = self.load
        self.blocks = [
            array("q", values[start : start + load]) for start in range(0, len(values), load)
        ]
        self.maxes = [block[-1] for block in self.blocks]

    def _split_even(self, i: int) -> None:
        """Split block ``i`` (over twice the load) into blocks of about the
        load each."""
        block = self.blocks[i]
        n = len(block)
        step = -(-n // (n // self.load))
        pieces = [block[start : start + step] for start in range(0, n, step)]
        self.blocks[i : i + 1] = pieces
        self.maxes[i : i + 1] = [piece[-1] for piece in pieces]
