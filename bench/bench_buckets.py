"""Benchmark of the keeper's buckets (keeper/buckets/) against the issue's
targets, and against a plain dict-and-sets layout for comparison:

    .venv/bin/python bench/bench_buckets.py --rows 250000
    .venv/bin/python bench/bench_buckets.py --rows 1000000 --layout packed
    .venv/bin/python bench/bench_buckets.py --rows 250000 --detached

Targets: apply one change <= 10 us; <= 160 B per row at 1,000,000 rows with
~55-character keys (key strings and every structure included); best 5,000
<= 1 ms; counts <= 1 ms at 1,000,000 rows; the load walk <= 1 us a row on
top of the fetch.

Workload: 20 routes x 5 (cadence, sitemap) variants = 100 classes, due times
spread evenly over 30 days around now, so half the rows are a due backlog;
keys like ``https://example.com/items/0000123456/some-slug-text-56`` (54
characters). The change stream mixes 50 % reschedules (new due time, same
class), 10 % class changes, 20 % inserts and 20 % deletes, with fresh key
strings as the feed would deliver them (their hash not yet computed).

The packed layout is loaded as the keeper loads it: ``reserve``, then
``load_rows`` 20,000 rows at a time (the rows built as the store's walk hands
them over, outside the timing), then a first ``best`` (which merges the
values the load left pending). ``--apply-load`` loads it by ``apply`` row by
row instead, as before ``load_rows`` existed. ``load_by_apply_+first_read``
times the same walk fed to ``apply``, for comparison in the same run.

Memory is measured in a fresh subprocess per layout: the growth of RSS, and
separately of tracemalloc's traced bytes, across loading the rows (the key
strings are made inside the load, so they are counted once, as held by the
structure).

Figures (Python 3.11.7, 2 vCPUs shared with other work while measured, so
single figures move by 20-50 % between runs; timed reads are medians, the
fastest repeat in brackets; 100 classes, 30-day spread):

    rows                                  250k packed   1M packed   (before load_rows)
    bytes/row, RSS, loaded by load_rows         166.7       158.1
    bytes/row, RSS, --apply-load                -           155.3    156.6 / 156.3
    bytes/row, tracemalloc                      144.8       145.4    144.5 / 144.6
    load_rows, us/row                           1.16        0.91
    load_rows + first read, us/row              1.54        1.11
    ... and a read after every chunk            2.39        1.96
    load by apply + first read, us/row          3.38        2.67
    load by apply, no reserve (old figure)      2.57*       5.83*    4.8 (250k)
    apply, us/change (mean)                     6.2         4.9      3.7 / 4.7
    apply p99, us                               9.5         10.8     8.0 / 9.6
    best(5000), ms                              2.7 (2.3)   2.5 (2.4)   3.1 / 2.5
    best(5000) excl 3000+2 paused, ms           3.9 (3.0)   3.3 (3.1)   4.7 / 3.3
    best_columns(5000), ms                      3.7 (3.3)   3.5 (3.1)
    best_columns excl 3000+2 paused, ms         5.5 (4.9)   4.1 (3.8)
    best(5000), first call (no hint), ms        3.1 (2.7)   2.7 (2.5)
    counts, next minute, ms                     0.10        0.10
    counts, first call, ms                      0.06**      0.06**   0.36 / 0.44
    coming, ms                                  1.2         1.3
    key-table doubling pause, ms                67          294  (whole rehash)
    ... incremental (longest call), ms          -           11   (was 514-544)

The doubling pause is the longest single call while the key table doubles
(``reserve(2 * rows)`` then inserts until the old table is drained): since
the growth is incremental that is the allocation of the larger table (4M
cells, about 11 ms), and an insert that carries the drain on takes at most a
few ms (``table_doubling_insert_max_ms``, p99 50-80 us; about 63,000 inserts
drain it). ``load_rows_chunk_max_ms`` is the longest 20,000-row chunk of the
load and ``best5000_max_ms`` the slowest of the timed ``best`` calls.
``pending_first_read_ms`` is the first read after a whole load, which merges
every value the load left pending (the best of three loads;
``pending_first_read_max_ms`` the worst): at 1,000,000 rows 26-38 ms with
the merge in C (keeper/_best_order.c), 230-535 ms before.

(*) ``load_us_per_row``: at 250k the bench's own load by load_rows, at 1M the
``--apply-load`` run's. (**) ``best`` now brings the due counts to the
minute itself, so the counts call after it is no longer the first to.
Earlier, less loaded runs of the same code: load_rows 0.90 us/row at 250k
(1.08 with the first read, 2.34 by apply); best(5000) 2.2 ms fastest at 250k.
The naive layout (unchanged): 533 / 515 B/row RSS at 250k / 1M, apply 5.4 /
6.8 us, best(5000) 12.9 / 15.7 ms, counts' first call 30 / 231 ms. With due
times over 1 day instead (denser minute buckets) at 1M: packed 156 B/row,
naive 377 B/row. The naive layout pays a set (216 B and up) per minute
bucket, and here most buckets hold one row.

load_rows meets its 1 us a row for the calls themselves; the merge of the
pending values at the first read adds about 0.2 us a row (one sort a class),
and a read after every chunk, the worst case, about 1 us. The keeper reads
(publishes) once a second while it loads.

best(5000) misses the 1 ms target on this machine, by about 2x: the
threshold search and the sort take little; making the 5,000 answers is most
of it, about 0.4 us an answer, whether as tuples (one comprehension a class)
or as columns (slices, an index sort and a gather per column: measured no
faster, and slower with an exclude set). Those figures are for the call
alone, repeated; in the keeper's loop (``bench/bench_publish.py``, the heads
new each round, the collector's passes over fresh tuples counted)
best_columns, now built as columns, and ReadySet.publish_columns measured
0.7 to 0.8 of best and ReadySet.publish, so the keeper publishes columns.
``--detached`` also times ``detach_many`` of 3,000 granted heads with the
publish's candidates remembered (the keeper's) and by probing the key table.
See keeper/buckets/.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Container
from heapq import heapify, heappop, heapreplace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sortedcontainers import SortedList  # noqa: E402

from bench.common import add_json_option, keep, write_json  # noqa: E402
from keeper.buckets import Buckets  # noqa: E402
from keeper.classes import ClassTable  # noqa: E402
from node.core.config import Config, RouteConfig  # noqa: E402

NOW = 1_700_000_000.0
LOAD_CHUNK = 20_000  # rows per load_rows call, as keeper/feed.py walks
SPREAD_S = 30 * 86400  # --spread-days
ROUTES = [f"route-{i:02d}" for i in range(20)]
# (cadence_s, sitemap): None takes the route default.
VARIANTS = [(None, False), (None, True), (3600, False), (86400, False), (604800, True)]
CONFIG = Config(
    routes={
        name: RouteConfig(cadence_s=(900, 3600, 86400, 604800)[i % 4], sitemap_boost=0.5)
        for i, name in enumerate(ROUTES)
    }
)


def key_of(i: int) -> str:
    return f"https://example.com/items/{i:010d}/some-slug-text-{i % 100:02d}"


# -- the plain layout, for comparison ------------------------------------------------


class NaiveBuckets:
    """key -> (minute, class, version) in a dict; per class a dict minute ->
    set of keys and a SortedList of minutes. Same semantics as Buckets for
    what the benchmark calls."""

    def __init__(self, classes: ClassTable) -> None:
        self.classes = classes
        self.rows: dict[str, tuple[int, int, int]] = {}
        self.sets: dict[int, dict[int, set[str]]] = {}
        self.minutes: dict[int, SortedList] = {}
        self.due: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.through = -1

    def __len__(self) -> int:
        return len(self.rows)

    def apply(self, key, version, route, cadence_s, sitemap, due_at) -> bool:
        held = self.rows.get(key)
        if held is not None and held[2] >= version:
            return False
        cid = self.classes.class_of(route, cadence_s, sitemap)
        minute = int(due_at // 60)
        if held is not None:
            self._unplace(key, held[0], held[1])
        self.rows[key] = (minute, cid, version)
        self._place(key, minute, cid)
        return True

    def remove(self, key: str, version: int | None = None) -> bool:
        held = self.rows.get(key)
        if held is None or (version is not None and held[2] > version):
            return False
        del self.rows[key]
        self._unplace(key, held[0], held[1])
        return True

    def _place(self, key: str, minute: int, cid: int) -> None:
        sets = self.sets.get(cid)
        if sets is None:
            sets = self.sets[cid] = {}
            self.minutes[cid] = SortedList()
            self.due[cid] = 0
            self.size[cid] = 0
        self.size[cid] += 1
        bucket = sets.get(minute)
        if bucket is None:
            bucket = sets[minute] = set()
            self.minutes[cid].add(minute)
        bucket.add(key)
        if minute <= self.through:
            self.due[cid] += 1

    def _unplace(self, key: str, minute: int, cid: int) -> None:
        self.size[cid] -= 1
        bucket = self.sets[cid][minute]
        bucket.discard(key)
        if not bucket:
            del self.sets[cid][minute]
            self.minutes[cid].remove(minute)
        if minute <= self.through:
            self.due[cid] -= 1

    def best(
        self, now: float, k: int, paused_routes: Container[str] = (), exclude=None
    ) -> list[tuple[str, int, int, int, float]]:
        now_minute = int(now // 60)
        heap = []
        for cid, minutes in self.minutes.items():
            if not minutes or minutes[0] > now_minute:
                continue
            info = self.classes.info(cid)
            if info.route in paused_routes:
                continue
            rank = (now - minutes[0] * 60) / info.cadence_s + info.boost
            heap.append((-rank, cid, 0, info))
        heapify(heap)
        out: list[tuple[str, int, int, int, float]] = []
        rows = self.rows
        while heap and len(out) < k:
            neg, cid, index, info = heap[0]
            minutes = self.minutes[cid]
            minute = minutes[index]
            for key in self.sets[cid][minute]:
                if exclude is None or key not in exclude:
                    out.append((key, rows[key][2], minute, cid, -neg))
                    if len(out) >= k:
                        break
            index += 1
            if index < len(minutes) and minutes[index] <= now_minute:
                rank = (now - minutes[index] * 60) / info.cadence_s + info.boost
                heapreplace(heap, (-rank, cid, index, info))
            else:
                heappop(heap)
        return out

    def counts(self, now: float) -> dict[str, Any]:
        now_minute = int(now // 60)
        if now_minute > self.through:  # (the benchmark never steps back)
            for cid, minutes in self.minutes.items():
                sets = self.sets[cid]
                self.due[cid] += sum(
                    len(sets[m]) for m in minutes.irange(self.through + 1, now_minute)
                )
            self.through = now_minute
        per_class = {cid: (self.size[cid], d) for cid, d in self.due.items()}
        return {"due": sum(self.due.values()), "per_class": per_class}

    def coming(self, now: float) -> dict[str, Any]:
        first = int(now // 60) + 1
        by_hour = [0] * 24
        soon = 0
        for cid, minutes in self.minutes.items():
            sets = self.sets[cid]
            for m in minutes.irange(first, first + 24 * 60 - 1):
                n = len(sets[m])
                by_hour[(m - first) // 60] += n
                if m - first < 15:
                    soon += n
        return {"15m": soon, "60m": by_hour[0], "24h": sum(by_hour), "by_hour": by_hour}


LAYOUTS: dict[str, Callable[[ClassTable], Any]] = {"packed": Buckets, "naive": NaiveBuckets}

# -- workload ---------------------------------------------------------------------------


def row_columns(n: int, seed: int = 1) -> tuple[array, array, array]:
    """Route index, variant index and due time of rows 0..n-1 (no key strings)."""
    rnd = random.Random(seed)
    routes = array("b", (rnd.randrange(len(ROUTES)) for _ in range(n)))
    variants = array("b", (rnd.randrange(len(VARIANTS)) for _ in range(n)))
    dues = array("d", (NOW - SPREAD_S / 2 + rnd.random() * SPREAD_S for _ in range(n)))
    return routes, variants, dues


def load(buckets: Any, n: int, columns: tuple[array, array, array]) -> None:
    routes, variants, dues = columns
    apply = buckets.apply
    for i in range(n):
        cadence_s, sitemap = VARIANTS[variants[i]]
        apply(key_of(i), i + 1, ROUTES[routes[i]], cadence_s, sitemap, dues[i])


def walk_chunk(start: int, end: int, columns: tuple[array, array, array]) -> list[tuple]:
    """Rows ``start..end-1`` as the store's load walk hands them over:
    ``(key, version, route, cadence_s, sitemap, due_at)``, keys ascending and
    made fresh (their hash not yet computed), sitemap as SQLite's 0 or 1."""
    routes, variants, dues = columns
    out = []
    for i in range(start, end):
        cadence_s, sitemap = VARIANTS[variants[i]]
        out.append((key_of(i), i + 1, ROUTES[routes[i]], cadence_s, int(sitemap), dues[i]))
    return out


def load_walk(
    buckets: Buckets, n: int, columns: tuple[array, array, array], publish_every: int = 0
) -> tuple[float, float]:
    """The keeper's load: ``reserve``, then ``load_rows`` a chunk at a time,
    then the first read (``best``), which merges the values left pending.
    With ``publish_every``, a ``best(5000)`` after every so many chunks too,
    as the keeper publishes while it loads. Returns (seconds in load_rows,
    seconds in those reads); building the rows (the fetch) is not timed."""
    buckets.reserve(n)
    in_load = in_reads = 0.0
    for number, start in enumerate(range(0, n, LOAD_CHUNK), 1):
        rows = walk_chunk(start, min(start + LOAD_CHUNK, n), columns)
        t0 = time.perf_counter()
        buckets.load_rows(rows)
        t1 = time.perf_counter()
        in_load += t1 - t0
        LONGEST["load_rows_chunk_max_ms"] = max(LONGEST["load_rows_chunk_max_ms"], t1 - t0)
        if publish_every and number % publish_every == 0:
            buckets.best(NOW, 5000)
            in_reads += time.perf_counter() - t1
        del rows  # as the keeper's load step drops its chunk before it publishes
    t0 = time.perf_counter()
    buckets.best(NOW, 5000)
    first_read = time.perf_counter() - t0
    if not publish_every:  # every value the load left pending, merged by one read
        LONGEST["pending_read_max_ms"] = max(LONGEST["pending_read_max_ms"], first_read)
    return in_load, in_reads + first_read


def change_stream(n_rows: int, n_changes: int, seed: int = 2) -> list[tuple]:
    """(key, version, route, cadence_s, sitemap, due_at); route None = delete."""
    rnd = random.Random(seed)
    live = list(range(n_rows))
    next_id = n_rows
    version = n_rows + 1
    out: list[tuple] = []
    for _ in range(n_changes):
        version += 1
        roll = rnd.random()
        if roll < 0.2 or not live:
            key_id, next_id = next_id, next_id + 1
            live.append(key_id)
        else:
            at = rnd.randrange(len(live))
            key_id = live[at]
            if roll < 0.4:
                live[at] = live[-1]
                live.pop()
                out.append((key_of(key_id), version, None, None, False, 0.0))
                continue
        # Reschedules keep the class; one change in ten moves it.
        r = random.Random(key_id)
        route, variant = r.randrange(len(ROUTES)), r.randrange(len(VARIANTS))
        if roll > 0.9:
            variant = rnd.randrange(len(VARIANTS))
        cadence_s, sitemap = VARIANTS[variant]
        due = NOW + rnd.random() * SPREAD_S / 2
        out.append((key_of(key_id), version, ROUTES[route], cadence_s, sitemap, due))
    return out


def run_changes(buckets: Any, changes: list[tuple]) -> float:
    apply, remove = buckets.apply, buckets.remove
    t0 = time.perf_counter()
    for change in changes:
        if change[2] is None:
            remove(change[0])
        else:
            apply(*change)
    return time.perf_counter() - t0


def per_change_ns(buckets: Any, changes: list[tuple]) -> list[int]:
    apply, remove = buckets.apply, buckets.remove
    clock = time.perf_counter_ns
    out = []
    for change in changes:
        t0 = clock()
        if change[2] is None:
            remove(change[0])
        else:
            apply(*change)
        out.append(clock() - t0)
    return out


def median_ms(name: str, fn: Callable[[], Any], repeat: int = 21) -> float:
    """Median of ``repeat`` calls; the fastest is kept in ``FASTEST`` too, since
    on a shared machine it shows the cost with the least interference."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    FASTEST[name] = min(times) * 1000
    SLOWEST[name] = max(times) * 1000
    return statistics.median(times) * 1000


FASTEST: dict[str, float] = {}
# The longest single call seen, in seconds (the keeper's pauses).
LONGEST: dict[str, float] = {"load_rows_chunk_max_ms": 0.0, "pending_read_max_ms": 0.0}
SLOWEST: dict[str, float] = {}
APPLY_LOAD = False  # --apply-load


# -- memory (in a fresh subprocess) ---------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(layout: str, n: int, traced: bool) -> dict[str, float]:
    columns = row_columns(n)
    classes = ClassTable(CONFIG)
    gc.collect()
    if traced:
        import tracemalloc

        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    else:
        base = _rss()
    buckets = LAYOUTS[layout](classes)
    if layout == "packed" and not APPLY_LOAD:
        load_walk(buckets, n, columns)
    else:
        load(buckets, n, columns)
    gc.collect()
    used = (tracemalloc.get_traced_memory()[0] if traced else _rss()) - base
    return {"rows": len(buckets), "bytes_per_row": used / n}


def measure_memory(layout: str, n: int, traced: bool) -> float:
    cmd = [sys.executable, __file__, "--memory-child", layout, "--rows", str(n)]
    cmd += ["--spread-days", str(SPREAD_S / 86400)]
    if APPLY_LOAD:
        cmd.append("--apply-load")
    if traced:
        cmd.append("--traced")
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["bytes_per_row"]


# -- the run -----------------------------------------------------------------------------


def bench_load_rows(n: int, columns: tuple[array, array, array]) -> dict[str, float]:
    """``load_rows`` against loading by ``apply`` row by row, each into fresh
    buckets (best of three loads each: this machine is shared), and with a
    read after every chunk (the keeper publishes once a second while it
    loads; a read after each chunk is the worst case for the merges)."""
    out: dict[str, float] = {}
    runs: dict[str, list[float]] = {"rows": [], "read": [], "apply": [], "each": []}
    for _ in range(3):
        gc.collect()
        buckets = Buckets(ClassTable(CONFIG))
        in_load, in_read = load_walk(buckets, n, columns)
        runs["rows"].append(in_load)
        runs["read"].append(in_load + in_read)
        del buckets
        gc.collect()
        buckets = Buckets(ClassTable(CONFIG))
        buckets.reserve(n)
        spent = 0.0
        for start in range(0, n, LOAD_CHUNK):
            rows = walk_chunk(start, min(start + LOAD_CHUNK, n), columns)
            apply = buckets.apply
            t0 = time.perf_counter()
            for row in rows:
                apply(*row)
            spent += time.perf_counter() - t0
        t0 = time.perf_counter()
        buckets.best(NOW, 5000)
        runs["apply"].append(spent + time.perf_counter() - t0)
        del buckets, rows
    gc.collect()
    buckets = Buckets(ClassTable(CONFIG))
    in_load, in_reads = load_walk(buckets, n, columns, publish_every=1)
    runs["each"].append(in_load + in_reads)
    del buckets
    gc.collect()
    out["load_rows_us_per_row"] = min(runs["rows"]) / n * 1e6
    out["load_rows_+first_read_us_per_row"] = min(runs["read"]) / n * 1e6
    out["load_rows_read_each_chunk_us_per_row"] = min(runs["each"]) / n * 1e6
    out["load_by_apply_+first_read_us_per_row"] = min(runs["apply"]) / n * 1e6
    out["load_rows_chunk_max_ms"] = LONGEST["load_rows_chunk_max_ms"] * 1000
    # The first read after a whole load merges every value it left pending:
    # the keeper's longest pause of a load (its first publish during a load
    # merges up to a second of chunks).
    out["pending_first_read_ms"] = min(runs["read"][i] - runs["rows"][i] for i in range(3)) * 1000
    out["pending_first_read_max_ms"] = LONGEST["pending_read_max_ms"] * 1000
    return out


def bench_layout(layout: str, n: int, n_changes: int) -> dict[str, float]:
    columns = row_columns(n)
    out: dict[str, float] = {}
    if layout == "packed" and not APPLY_LOAD:
        out.update(bench_load_rows(n, columns))
    buckets = LAYOUTS[layout](ClassTable(CONFIG))
    t0 = time.perf_counter()
    if layout == "packed" and not APPLY_LOAD:
        load_walk(buckets, n, columns)
    else:
        load(buckets, n, columns)
    load_s = time.perf_counter() - t0
    changes = change_stream(n, n_changes + 20_000)
    gc.collect()
    apply_s = run_changes(buckets, changes[:n_changes])
    singles = sorted(per_change_ns(buckets, changes[n_changes:]))
    out |= {
        "load_us_per_row": load_s / n * 1e6,
        "apply_us": apply_s / n_changes * 1e6,
        "apply_p50_us": singles[len(singles) // 2] / 1000,
        "apply_p99_us": singles[len(singles) * 99 // 100] / 1000,
        "apply_max_us": singles[-1] / 1000,
    }
    # The change stream is 220k live tuples the keeper would not hold; keep
    # them from making the collector's passes during the reads look dearer.
    del changes, singles
    gc.collect()
    out["best5000_ms"] = median_ms("best5000_ms", lambda: buckets.best(NOW, 5000))
    out["best5000_max_ms"] = SLOWEST["best5000_ms"]
    head = {entry[0] for entry in buckets.best(NOW, 3000)}
    paused = frozenset(ROUTES[:2])
    out["best5000_excl3000_paused2_ms"] = median_ms(
        "best5000_excl3000_paused2_ms",
        lambda: buckets.best(NOW, 5000, paused_routes=paused, exclude=head),
    )
    if hasattr(buckets, "best_columns"):
        out["best_columns5000_ms"] = median_ms(
            "best_columns5000_ms", lambda: buckets.best_columns(NOW, 5000)
        )
        out["best_columns5000_excl3000_paused2_ms"] = median_ms(
            "best_columns5000_excl3000_paused2_ms",
            lambda: buckets.best_columns(NOW, 5000, paused_routes=paused, exclude=head),
        )

        def cold() -> None:
            buckets._best_hint = None  # as the first call: no threshold to start from
            buckets.best(NOW, 5000)

        out["best5000_cold_ms"] = median_ms("best5000_cold_ms", cold)
    t0 = time.perf_counter()
    buckets.counts(NOW)
    out["counts_first_ms"] = (time.perf_counter() - t0) * 1000
    out["counts_same_minute_ms"] = median_ms(
        "counts_same_minute_ms", lambda: buckets.counts(NOW + 5)
    )
    minute = iter(range(1, 1000))
    out["counts_next_minute_ms"] = median_ms(
        "counts_next_minute_ms", lambda: buckets.counts(NOW + 60 * next(minute))
    )
    out["coming_ms"] = median_ms("coming_ms", lambda: buckets.coming(NOW), repeat=11)
    if hasattr(buckets, "oldest_due"):
        out["oldest_due_ms"] = median_ms("oldest_due_ms", lambda: buckets.oldest_due(NOW))
    out["rows_after"] = len(buckets)
    if hasattr(buckets, "reserve"):
        out |= table_doubling(buckets, n)
    return out


def table_doubling(buckets: Buckets, n: int) -> dict[str, float]:
    """The pauses while the key table doubles: ``reserve`` allocates the
    larger table and starts the drain of the old one, which the inserts that
    follow carry on (keeper/buckets/table.py). Each call is timed until the
    drain is done: ``table_doubling_pause_ms`` is the longest single call
    (the reserve or an insert), ``..._calls`` how many inserts it took."""
    calls = []
    t0 = time.perf_counter()
    buckets.reserve(len(buckets) * 2)
    reserve_s = time.perf_counter() - t0
    apply = buckets.apply
    clock = time.perf_counter
    i = 10 * n  # keys no row has yet
    while buckets._old is not None:
        key = key_of(i)
        t0 = clock()
        apply(key, 1, ROUTES[i % len(ROUTES)], None, False, NOW + i % 3600)
        calls.append(clock() - t0)
        i += 1
    calls.sort()
    return {
        "table_doubling_reserve_ms": reserve_s * 1000,
        "table_doubling_insert_max_ms": (calls[-1] if calls else 0.0) * 1000,
        "table_doubling_insert_p99_us": (calls[len(calls) * 99 // 100] if calls else 0.0) * 1e6,
        "table_doubling_calls": len(calls),
        "table_doubling_pause_ms": max([reserve_s, *calls[-1:]]) * 1000,
        "table_doubling_total_ms": (reserve_s + sum(calls)) * 1000,
    }


def bench_detached(n: int, leased: int, k: int = 5000) -> dict[str, float]:
    """``--detached``: the claim path with ``leased`` keys out on lease, the
    most late ones (the heads ``best`` would take first), either detached or
    passed as ``exclude=``. ``now`` is 3 days (at the default spread) past
    the bench's usual one, so that more than ``leased + k`` rows are due."""
    buckets = Buckets(ClassTable(CONFIG))
    load_walk(buckets, n, row_columns(n))
    now = NOW + SPREAD_S / 10
    out: dict[str, float] = {"due_rows": buckets.counts(now)["due"]["total"]}
    gc.collect()
    out[f"best{k}_none_detached_ms"] = median_ms(
        f"best{k}_none_detached_ms", lambda: buckets.best(now, k)
    )
    late = [entry[0] for entry in buckets.best(now, leased)]
    exclude = set(late)
    want = [entry[4] for entry in buckets.best(now, k, exclude=exclude)]
    out[f"best{k}_exclude_{leased}_ms"] = median_ms(
        f"best{k}_exclude_{leased}_ms", lambda: buckets.best(now, k, exclude=exclude), repeat=7
    )
    t0 = time.perf_counter()
    for key in late:
        buckets.detach(key)
    out[f"detach_{leased}_us_each"] = (time.perf_counter() - t0) / len(late) * 1e6
    assert [entry[4] for entry in buckets.best(now, k)] == want  # the same answer
    out[f"best{k}_{leased}_detached_ms"] = median_ms(
        f"best{k}_{leased}_detached_ms", lambda: buckets.best(now, k)
    )
    # The next k heads leased and returned again, as grants and releases go.
    batch = [entry[0] for entry in buckets.best(now, k)]
    detach_s, attach_s = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for key in batch:
            buckets.detach(key)
        t1 = time.perf_counter()
        for key in batch:
            buckets.attach(key)
        attach_s.append(time.perf_counter() - t1)
        detach_s.append(t1 - t0)
    out[f"detach_{len(batch)}_ms"] = statistics.median(detach_s) * 1000
    out[f"attach_{len(batch)}_ms"] = statistics.median(attach_s) * 1000
    out["detach_us_each"] = out[f"detach_{len(batch)}_ms"] / len(batch) * 1000
    out["attach_us_each"] = out[f"attach_{len(batch)}_ms"] / len(batch) * 1000
    # The keeper's way: the head of a publish granted, detached in bulk (as
    # fresh strs, as the lease table decodes them), then given back; with
    # the publish's candidates remembered (the keeper's), and without.
    grants = 3000
    for remember in (True, False):
        buckets._remember_best = remember
        name = "remembered" if remember else "probed"
        detach_s, attach_s = [], []
        for _ in range(5):
            head = buckets.best_columns(now, k)[0][:grants]
            fresh = [key.encode().decode() for key in head]
            t0 = time.perf_counter()
            assert buckets.detach_many(fresh) == grants
            t1 = time.perf_counter()
            buckets.attach_many(fresh)
            attach_s.append(time.perf_counter() - t1)
            detach_s.append(t1 - t0)
        out[f"detach_many_{grants}_{name}_us_each"] = statistics.median(detach_s) / grants * 1e6
        out[f"attach_many_{grants}_us_each"] = statistics.median(attach_s) / grants * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--layout", choices=[*LAYOUTS, "both"], default="both")
    parser.add_argument(
        "--spread-days", type=float, default=30.0, help="due times spread over this many days"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    parser.add_argument(
        "--apply-load",
        action="store_true",
        help="load the packed layout by apply, row by row, instead of load_rows",
    )
    parser.add_argument(
        "--detached",
        action="store_true",
        help="only the claim path: --leased keys detached against passed as exclude=",
    )
    parser.add_argument("--leased", type=int, default=130_000, help="keys out on lease")
    add_json_option(parser)
    parser.add_argument("--memory-child", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global SPREAD_S, APPLY_LOAD
    SPREAD_S = args.spread_days * 86400
    APPLY_LOAD = args.apply_load
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.rows, args.traced)))
        return 0
    if args.detached:
        FASTEST.clear()
        figures = bench_detached(args.rows, args.leased)
        print(f"rows {args.rows:,}, {args.leased:,} leased  (timed reads: median, fastest)")
        for name, value in figures.items():
            fastest = f"  {FASTEST[name]:10,.3f}" if name in FASTEST else ""
            print(f"  {name:32} {value:12,.3f}{fastest}")
        keep({"bench": "buckets_detached", "rows": args.rows, "leased": args.leased, **figures})
        write_json(args.json)
        return 0
    layouts = list(LAYOUTS) if args.layout == "both" else [args.layout]
    print(
        f"rows {args.rows:,}, changes {args.changes:,}, "
        f"classes ~{len(ROUTES) * len(VARIANTS)}, due over {args.spread_days:g} days"
    )
    for layout in layouts:
        figures: dict[str, float] = {}
        if not args.no_memory:
            figures["rss_bytes_per_row"] = measure_memory(layout, args.rows, traced=False)
            figures["traced_bytes_per_row"] = measure_memory(layout, args.rows, traced=True)
        FASTEST.clear()
        timed = bench_layout(layout, args.rows, args.changes)
        fastest_of = dict(FASTEST)
        figures.update(timed)
        print(f"[{layout}]  (timed reads: median, and fastest of the repeats)")
        for name, value in figures.items():
            fastest = f"  {fastest_of[name]:10,.3f}" if name in fastest_of else ""
            print(f"  {name:32} {value:12,.3f}{fastest}")
        sys.stdout.flush()
        keep({"bench": "buckets", "layout": layout, "rows": args.rows, "changes": args.changes,
              **figures})  # fmt: skip
    write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
