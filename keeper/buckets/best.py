"""The best K due rows of ``Buckets`` (keeper/buckets/__init__.py): ``best``,
``best_columns`` and ``best_gathered``, the keeper's publish.

Best: a few counting passes over the classes find a rank threshold that
takes the k best rows or a few more; the heads above it become entries in one
comprehension a class and one sort orders them (about 2 ms for 5,000 here:
making the 5,000 entries is most of it). ``best_gathered``, the keeper's,
makes no Python object a row: each class's head run is copied out of its
order, a k-way merge in C (``keeper._best.pick``) gives the k best as C
arrays of slots, minutes, classes and ranks, and the ready set's writer
(``ReadySet.publish_gathered``) reads each key and version from the
buckets' columns by slot (0.14 ms for the best 5,000 of 250,000, and 0.07
ms to write them: ``bench/bench_publish.py``). ``best_columns`` is the same
picks as lists, for other callers.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Container
from itertools import compress, repeat
from math import isfinite
from operator import itemgetter
from typing import Any, NamedTuple, cast

from keeper.buckets.counts import Counts
from keeper.buckets.detach import Detach
from keeper.buckets.table import _MINUTE_HALF, _SLOT_HALF, Entry, PyKeyColumn
from keeper.order import SLOT_BITS, SLOT_MASK

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
# The smallest cadence the merges take (keeper/_best.c's MIN_CADENCE): every
# rank is then finite. The keeper's classes have 60 s or more.
MIN_CADENCE_S = 1.0

# (keys, versions, due minutes, class ids, ranks): ``best_columns``.
Columns = tuple[list[str], list[int], list[int], list[int], list[float]]


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
    bytearray with 1 at each position picked. Refuses (ValueError) what the
    C merge refuses: a ``now`` or a boost not finite, a cadence under
    ``MIN_CADENCE_S`` (a row not due yet would rank -inf)."""
    if not isfinite(now):
        raise ValueError("now is not a finite number")
    for cadence_s, boost in rates:
        if not (cadence_s >= MIN_CADENCE_S and isfinite(boost)):
            raise ValueError("a cadence (at least 1 s) or a boost (finite) out of range")
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


def _pick(
    values: array[int],
    starts: list[int],
    rates: list[tuple[float, float]],
    cids: list[int],
    now: float,
    k: int,
    keys: list[str | None],
    exclude: Container[str] | None,
) -> tuple[int, float | None, int, array[int], array[int], array[int], array[int], array[float],
           bytearray]:
    """``keeper._best.pick`` in Python, for a build without it: ``_merge``,
    then the keys in ``exclude`` passed over (counted while fewer than ``k``
    are taken), the columns as arrays."""
    merged = _merge(values, starts, rates, cids, now, len(values) if exclude is not None else k)
    picks, ranks, slots, minutes, classes, marks = merged
    skipped = 0
    if exclude is not None:
        keep: list[int] = []
        for i, slot in enumerate(slots):
            if len(keep) == k:
                break
            if keys[slot] in exclude:
                skipped += 1
                marks[picks[i]] = 0
            else:
                keep.append(i)
        for i in range(len(keep) and keep[-1] + 1, len(picks)):
            marks[picks[i]] = 0
        at = _getter(keep)
        picks, ranks, slots, minutes, classes = map(at, (picks, ranks, slots, minutes, classes))
    n = len(picks)
    kth = ranks[-1] if n == k and k > 0 else None
    return (n, kth, skipped, array("i", picks), array("i", slots), array("i", minutes),
            array("i", classes), array("d", ranks), marks)


class Gathered(NamedTuple):
    """``best_gathered``: the best rows as ``ReadySet.publish_gathered``
    takes them (its first seven fields), and what ``detach_gathered`` needs.
    ``keys`` and ``versions`` are the buckets' own columns by slot; the
    picks' columns are buffers of ``n`` int32 (``slots``, ``minutes``,
    ``cids``, ``positions``) or double (``ranks``)."""

    keys: PyKeyColumn
    versions: array[int]
    slots: Any
    minutes: Any
    cids: Any
    ranks: Any
    n: int
    positions: Any  # each pick's position in ``values``
    values: array[int]  # the candidates, class run after class run
    starts: list[int]  # where each run starts in ``values``, and the last ends
    classes: list[int]  # each run's class id
    marks: bytearray  # 1 at each pick's position

    def keys_written(self, count: int) -> list[str]:
        """The keys of the first ``count`` picks (those ``publish_gathered``
        wrote), made now: the column holds no str."""
        return cast(list[str], self.keys.take(self.slots, count))  # a written slot holds a key

    def columns(self) -> Columns:
        """The picks as ``best_columns``' lists."""
        slots = _ints(self.slots)
        at = _getter(slots)
        ranks = cast(list[float], memoryview(self.ranks).cast("B").cast("d").tolist())
        keys = cast(list[str], at(self.keys))  # a picked slot always holds a key
        return keys, at(self.versions), _ints(self.minutes), _ints(self.cids), ranks


def _ints(buffer: Any) -> list[int]:
    """A buffer of int32 as a list."""
    return memoryview(buffer).cast("B").cast("i").tolist()


def _getter(positions: list[int]):
    """A function taking a sequence to the list of its items at
    ``positions``: one ``itemgetter`` call, about half the time of a ``map``
    over an array's ``__getitem__`` (the publish gathers five columns of
    5,000 so)."""
    if len(positions) > 1:
        get = itemgetter(*positions)
        return lambda seq: list(get(seq))
    return lambda seq: [seq[i] for i in positions]


def _empty(keys: PyKeyColumn, vers: array[int]) -> Gathered:
    none = array("i")
    return Gathered(keys, vers, none, none, none, array("d"), 0, none, array("q"), [0], [],
                    bytearray())  # fmt: skip


class Best(Detach, Counts):
    """``best`` reads the due counts (``Counts.advance``) and detaches or
    remembers what it picks (``Detach``)."""

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
        versions, due minutes, class ids, ranks)``, best first:
        ``best_gathered``'s picks as lists.

        ``detach``: detach the keys returned, as ``detach_many`` would (the
        keeper's live sets stay out of the next): their values are at hand,
        so no key is looked up, and nothing is remembered for a later
        ``detach_many``. Else, with ``remember_best`` and no ``exclude``, the
        candidates are remembered for ``detach_many``."""
        picked = self.best_gathered(now, k, paused_routes, exclude)
        columns = picked.columns()
        if detach:
            self.detach_gathered(picked, picked.n)
        elif self._remember_best and exclude is None:
            values = picked.values
            slot_of = array("i", values.tobytes())[_SLOT_HALF::2]
            at = dict(zip(columns[0], _ints(picked.positions), strict=True))
            self._remember(values, slot_of, picked.starts, picked.classes, at)  # type: ignore[arg-type]
        return columns

    def best_gathered(
        self,
        now: float,
        k: int,
        paused_routes: Container[str] = (),
        exclude: Container[str] | None = None,
    ) -> Gathered:
        """The best ``k`` due rows as ``best`` finds them, for the keeper's
        publish: ``ReadySet.publish_gathered(*picked[:7], now)`` writes them
        into the ready set with no Python object made a row, and
        ``detach_gathered(picked, written)`` then detaches those written (call
        it before any other change to the buckets). Remembers nothing for
        ``detach_many``.

        Each class's head run is copied out of its order into one array, and
        a k-way merge of the runs by rank (in C, ``keeper._best.pick``:
        within a run the ranks never rise; in Python without it, every rank
        and one stable index sort) gives the k best as C arrays of their
        slots, minutes, classes and ranks: the keys and versions stay in the
        buckets' columns, which the ready set's writer reads by slot. Keys in
        ``exclude`` are passed over inside the merge (a set lookup a
        candidate reached, in C)."""
        keys, vers = self._keys, self._vers
        if k <= 0:
            return _empty(keys, vers)
        now_minute, active, total = self._active(now, paused_routes)
        target = k + self._best_excluded if exclude is not None else k
        while True:
            counts, slack = self._counts(active, now, now_minute, total, target)
            values = array("q")  # the heads taken, class by class
            starts: list[int] = []  # where each class's run starts in ``values``
            cids: list[int] = []
            cadences: list[float] = []
            boosts: list[float] = []
            for (order, cid, cadence_s, boost, _n, _head), n in zip(active, counts, strict=True):
                if n:
                    starts.append(len(values))
                    cids.append(cid)
                    cadences.append(float(cadence_s))
                    boosts.append(float(boost))
                    values += order.head(n)
            if _best is not None:
                picked = _best.pick(values, starts, cadences, boosts, cids, now, k, keys, exclude)
            else:
                rates = list(zip(cadences, boosts, strict=True))
                picked = _pick(values, starts, rates, cids, now, k, keys, exclude)
            n, kth, skipped, positions, slots, minutes, classes, ranks, marks = picked
            if exclude is not None:
                self._best_excluded = skipped
            if self._enough(active, counts, total, now, kth):
                break
            target += max(k - n, 0) + slack
        starts.append(len(values))
        return Gathered(keys, vers, slots, minutes, classes, ranks, n, positions, values, starts,
                        cids, marks)  # fmt: skip

    def detach_gathered(self, picked: Gathered, count: int) -> None:
        """Detach the first ``count`` rows of ``picked`` (the ones the ready
        set took: ``publish_gathered`` writes fewer when the heap fills), as
        ``detach_many`` would; their values are at hand, so no key is looked
        up. Call it right after ``best_gathered``: the buckets must not have
        changed since."""
        if count <= 0:
            return
        if self._dirty:
            self._flush()
        marks, slots = picked.marks, picked.slots
        if count < picked.n:  # the rest stay attached
            for at in _ints(picked.positions)[count:]:
                marks[at] = 0
            slots = memoryview(slots).cast("B")[: 4 * count]
        if _best is not None:
            _best.flag(self._det, slots, 1)
        else:
            deque(map(self._det.__setitem__, _ints(slots), repeat(1)), maxlen=0)
        by_class: dict[int, list[int]] = {}
        values = picked.values
        self._by_class(list(compress(values, marks)), marks, picked.starts, picked.classes,
                       by_class)  # fmt: skip
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
