"""The keeper's buckets against a brute-force model: a dict of rows, ranked and
counted by walking every row. Small block loads and the smallest hash table
make every split, join, probe collision and backward shift happen often."""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from contextlib import ExitStack
from random import Random
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keeper.buckets as buckets_module
import keeper.buckets.best as best_module
import keeper.classes as classes_module
from keeper.buckets import Buckets, minute_of
from keeper.classes import ClassInfo, ClassTable
from keeper.order import Order
from node.config import Config, RouteConfig
from node.core.classes import SOURCE_ROUTE, SOURCE_ROW
from node.core.errors import TooManyClasses
from shm.ready import ReadySet

BASE = 1_700_000_000.0
ROUTES = ("pages", "feeds", "other")  # "other" is not configured: [defaults]
CONFIG = Config(
    defaults=RouteConfig(cadence_s=86400, sitemap_boost=0.5),
    routes={
        "pages": RouteConfig(cadence_s=3600, sitemap_boost=0.5),
        "feeds": RouteConfig(cadence_s=900, sitemap_boost=2.0),
    },
)
KEYS = [f"https://example.com/items/{i:04d}" for i in range(40)]
# The keeper's lateness bins (keeper/report.py), and others whose boundaries
# fall on exact minutes or between them.
LATENESS_EDGES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
EDGE_SETS = [LATENESS_EDGES, (0.0,), (0.0, 0.1, 1 / 3, 0.7), (0.0, 1.0, 1.0000001, 40.0)]

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- the model -------------------------------------------------------------------


class Model:
    """Rows as a plain dict; everything else computed by walking them."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.rows: dict[str, tuple[int, str, int | None, bool, int]] = {}

    def apply(self, key, version, route, cadence_s, sitemap, due_at) -> bool:
        held = self.rows.get(key)
        if held is not None and held[0] >= version:
            return False
        self.rows[key] = (version, route, cadence_s, sitemap, int(due_at // 60))
        return True

    def remove(self, key: str, version: int | None) -> bool:
        held = self.rows.get(key)
        if held is None or (version is not None and held[0] > version):
            return False
        del self.rows[key]
        return True

    def info(self, key: str) -> ClassInfo:
        _version, route, cadence_s, sitemap, _minute = self.rows[key]
        settings = self.config.route(route)
        boost = float(settings.sitemap_boost) if sitemap else 0.0
        if cadence_s is None:
            return ClassInfo(route, settings.cadence_s, SOURCE_ROUTE, sitemap, boost)
        return ClassInfo(route, cadence_s, SOURCE_ROW, sitemap, boost)

    def rank(self, key: str, now: float) -> float:
        info = self.info(key)
        minute = self.rows[key][4]
        return (now - minute * 60) / info.cadence_s + info.boost

    def lateness(self, now: float, edges: tuple[float, ...]) -> dict[tuple, list[int]]:
        """Due rows per lateness bin, by class identity: each row's ratio
        placed with a bisection of the edges."""
        out: dict[tuple, list[int]] = {}
        for key, row in self.rows.items():
            if row[4] <= minute_of(now):
                info = self.info(key)
                ratio = (now - row[4] * 60) / info.cadence_s
                out.setdefault(identity(info), [0] * len(edges))[
                    bisect_right(edges, ratio) - 1
                ] += 1
        return out

    def due_between(self, lo_minute: int, hi_minute: int) -> int:
        return sum(1 for row in self.rows.values() if lo_minute < row[4] <= hi_minute)


def identity(info: ClassInfo) -> tuple:
    return (info.route, info.cadence_s, info.source, info.sitemap)


def check_equal(buckets: Buckets, model: Model, now: float) -> None:
    """Row for row, and every count, as the model computes them."""
    classes = buckets.classes
    assert len(buckets) == len(model.rows)
    held = {key: (minute, cid, version) for key, minute, cid, version in buckets.items()}
    assert set(held) == set(model.rows)
    for key, row in model.rows.items():
        assert key in buckets
        got = buckets.get(key)
        assert got == held[key]
        minute, cid, version = got
        assert (version, minute) == (row[0], row[4])
        assert classes.info(cid) == model.info(key)
    for key in KEYS:
        if key not in model.rows:
            assert key not in buckets
            assert buckets.get(key) is None

    now_minute = minute_of(now)
    counts = buckets.counts(now)
    due_rows = [k for k, row in model.rows.items() if row[4] <= now_minute]
    sitemap = sum(1 for k in due_rows if model.rows[k][3])
    assert counts["due"] == {
        "sitemap": sitemap,
        "discovered": len(due_rows) - sitemap,
        "total": len(due_rows),
    }
    assert counts["rows"] == len(model.rows)
    assert counts["classes"] == len(classes)
    want: dict[tuple, list[int]] = {}
    for key, row in model.rows.items():
        slot = want.setdefault(identity(model.info(key)), [0, 0])
        slot[0] += 1
        slot[1] += row[4] <= now_minute
    got_per_class = {identity(classes.info(cid)): list(v) for cid, v in counts["per_class"].items()}
    assert got_per_class == want

    by_hour = [0] * 24
    soon = 0
    for row in model.rows.values():
        ahead = row[4] - now_minute  # minutes after the current one
        if 1 <= ahead <= 24 * 60:
            by_hour[(ahead - 1) // 60] += 1
            soon += ahead <= 15
    assert buckets.coming(now) == {
        "15m": soon,
        "60m": by_hour[0],
        "24h": sum(by_hour),
        "by_hour": by_hour,
    }

    oldest: dict[tuple, int] = {}
    for key, row in model.rows.items():
        if row[4] <= now_minute:
            ident = identity(model.info(key))
            oldest[ident] = min(oldest.get(ident, row[4]), row[4])
    got_oldest = {identity(classes.info(cid)): m for cid, m in buckets.oldest_due(now).items()}
    assert got_oldest == oldest

    for edges in EDGE_SETS:
        got_lateness = {
            identity(classes.info(cid)): bins for cid, bins in buckets.lateness(now, edges).items()
        }
        assert got_lateness == model.lateness(now, edges)
    for lo, hi in ((now_minute - 90, now_minute), (now_minute, now_minute + 60), (-(2**31), 0)):
        assert buckets.count_due_between(lo, hi) == model.due_between(lo, hi)
    assert buckets.count_due_between(now_minute, now_minute - 5) == 0


def best_via_columns(buckets: Buckets, *args: Any, **kwargs: Any) -> list[tuple]:
    columns = buckets.best_columns(*args, **kwargs)
    assert all(type(column) is list for column in columns)
    assert len({len(column) for column in columns}) == 1
    return list(zip(*columns, strict=True))


def check_best(
    buckets: Buckets,
    model: Model,
    now: float,
    k: int,
    paused: frozenset,
    exclude: set,
    best: Any = Buckets.best,
    detached: Any = frozenset(),
) -> list[tuple]:
    """``best`` against the model's ranks; ``detached`` keys (the model's)
    are left out as ``exclude`` would leave them."""
    got = best(buckets, now, k, paused_routes=paused, exclude=exclude or None)
    now_minute = minute_of(now)
    eligible = {
        key: model.rank(key, now)
        for key, row in model.rows.items()
        if row[4] <= now_minute
        and row[1] not in paused
        and key not in exclude
        and key not in detached
    }
    assert len({entry[0] for entry in got}) == len(got)
    for key, version, minute, cid, rank in got:
        assert key in eligible
        assert (version, minute) == (model.rows[key][0], model.rows[key][4])
        assert buckets.classes.info(cid) == model.info(key)
        assert rank == eligible[key]
    ranks = [entry[4] for entry in got]
    assert ranks == sorted(ranks, reverse=True)
    # Ties come in any order, so compare the ranks taken, not the keys: no
    # better-ranked row was left out.
    assert Counter(ranks) == Counter(sorted(eligible.values(), reverse=True)[:k])
    return got


# -- strategies --------------------------------------------------------------------

cadences = st.sampled_from([None, None, 60, 900, 3600])
due_times = st.builds(
    lambda m, frac: BASE + m * 60 + frac,
    st.one_of(st.integers(-90, 90), st.integers(-3000, 3000)),
    st.sampled_from([0.0, 0.5, 59.999]),
)
nows = st.builds(
    lambda m, frac: BASE + m * 60 + frac, st.integers(-120, 120), st.sampled_from([0.0, 30.0])
)
applies = st.tuples(
    st.just("apply"),
    st.sampled_from(KEYS),
    st.integers(1, 25),
    st.sampled_from(ROUTES),
    cadences,
    st.booleans(),
    due_times,
)
removes = st.tuples(
    st.just("remove"), st.sampled_from(KEYS), st.one_of(st.none(), st.integers(1, 25))
)
checks = st.tuples(st.just("check"), nows)
operations = st.lists(
    st.one_of(applies, applies, applies, removes, checks), min_size=1, max_size=80
)
block_loads = st.sampled_from([2, 3, 4, 1000])
# (BEST_SLACK_MIN, BEST_SLACK_SHIFT, BEST_STEPS): no slack makes the threshold
# search land on exact counts (and give up on ties), one step makes it fall
# back to the bracket's low end, a wide slack takes many extra candidates.
searches = st.sampled_from([(0, 30, 40), (0, 30, 1), (1, 30, 3), (2, 1, 2), (32, 5, 40)])
# A threshold left by an earlier call: the search starts from it.
hints = st.one_of(st.none(), st.floats(-5, 200))


def searching(search: tuple[int, int, int]) -> ExitStack:
    stack = ExitStack()
    for name, value in zip(
        ("BEST_SLACK_MIN", "BEST_SLACK_SHIFT", "BEST_STEPS"), search, strict=True
    ):
        stack.enter_context(patch.object(best_module, name, value))
    return stack


def run(buckets: Buckets, model: Model, ops: list[tuple[Any, ...]]) -> None:
    for op in ops:
        if op[0] == "apply":
            assert buckets.apply(*op[1:]) == model.apply(*op[1:])
        elif op[0] == "remove":
            assert buckets.remove(op[1], op[2]) == model.remove(op[1], op[2])
        else:
            check_equal(buckets, model, op[1])


# -- properties ----------------------------------------------------------------------


@SETTINGS
@given(ops=operations, now=nows, load=block_loads)
def test_buckets_equal_a_brute_force_model(ops, now, load):
    buckets = Buckets(ClassTable(CONFIG), block_load=load)
    model = Model(CONFIG)
    run(buckets, model, ops)
    check_equal(buckets, model, now)


@SETTINGS
@given(
    ops=operations,
    now=nows,
    k=st.integers(0, 30),
    paused=st.frozensets(st.sampled_from(ROUTES), max_size=2),
    exclude=st.sets(st.sampled_from(KEYS), max_size=10),
    load=block_loads,
    search=searches,
    hint=hints,
)
def test_best_is_the_brute_force_top_k(ops, now, k, paused, exclude, load, search, hint):
    buckets = Buckets(ClassTable(CONFIG), block_load=load)
    model = Model(CONFIG)
    run(buckets, model, ops)
    with searching(search):
        for best in (Buckets.best, best_via_columns):
            buckets._best_hint = hint
            check_best(buckets, model, now, k, paused, exclude, best)


@pytest.mark.parametrize("best", [Buckets.best, best_via_columns])
def test_best_takes_a_whole_minute_bucket_across_blocks(best):
    buckets = Buckets(ClassTable(CONFIG), block_load=2)
    model = Model(CONFIG)
    for i, key in enumerate(KEYS):
        due = BASE - 600 + (i % 3) * 60  # three crowded minutes, many blocks each
        buckets.apply(key, 1, "pages", None, i % 2 == 0, due)
        model.apply(key, 1, "pages", None, i % 2 == 0, due)
    for search in ((0, 30, 40), (32, 5, 40)):  # ties at the edge: no exact count
        with searching(search):
            for k in (1, 7, 13, 14, 20, 40, 41):
                check_best(buckets, model, BASE, k, frozenset(), set(), best)
                check_best(buckets, model, BASE, k, frozenset(), set(KEYS[::3]), best)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    k=st.sampled_from([1, 7, 60, 250, 900]),
    search=searches,
    excluding=st.booleans(),
)
def test_best_on_many_interleaved_rows(seed, k, search, excluding):
    """Hundreds of rows in classes whose ranks interleave, so the threshold
    cuts through every class and the heads taken straddle blocks."""
    rnd = Random(seed)
    buckets = Buckets(ClassTable(CONFIG), block_load=8)
    model = Model(CONFIG)
    for version, key in enumerate(f"row-{i}" for i in range(1200)):
        route = rnd.choice(ROUTES)
        args = (
            key,
            version,
            route,
            rnd.choice([None, 60, 900]),
            rnd.random() < 0.3,
            BASE - rnd.uniform(-3600, 2 * 86400),
        )
        buckets.apply(*args)
        model.apply(*args)
    exclude = {key for key in model.rows if rnd.random() < 0.3} if excluding else set()
    with searching(search):
        for best in (Buckets.best, best_via_columns):
            for now, paused in ((BASE, ()), (BASE, {"feeds"}), (BASE + 7, ()), (BASE + 7, ())):
                # (again from the threshold just found, a little later)
                check_best(buckets, model, now, k, frozenset(paused), exclude, best)


route_configs = st.builds(
    RouteConfig,
    cadence_s=st.sampled_from([60, 900, 3600, 86400]),
    sitemap_boost=st.sampled_from([0.0, 0.5, 2.0]),
)
configs = st.builds(
    lambda defaults, routes: Config(defaults=defaults, routes=routes),
    route_configs,
    st.dictionaries(st.sampled_from(ROUTES), route_configs, max_size=3),
)


@SETTINGS
@given(config=configs, ops=operations, more=operations, now=nows, load=block_loads)
def test_reconfigure_equals_rebuilding(config, ops, more, now, load):
    buckets = Buckets(ClassTable(CONFIG), block_load=load)
    model = Model(CONFIG)
    run(buckets, model, ops)
    buckets.counts(now)  # due counts carried through the change
    buckets.reconfigure(config)
    model.config = config
    rebuilt = Buckets(ClassTable(config), block_load=load)
    for key, (version, route, cadence_s, sitemap, minute) in model.rows.items():
        rebuilt.apply(key, version, route, cadence_s, sitemap, minute * 60.0)
    check_equal(buckets, model, now)
    check_equal(rebuilt, model, now)
    check_best(buckets, model, now, 25, frozenset(), set())
    # New rows after the change land in the relabelled classes.
    run(buckets, model, more)
    check_equal(buckets, model, now)


def test_reconfigure_moves_the_rows_of_merged_classes(monkeypatch):
    # With the real identity a default change alone never makes two classes
    # equal (the source tells them apart); an identity blind to the source
    # merges a route's default-cadence class into its row-cadence twin, so
    # the merge path has rows to move.
    monkeypatch.setattr(classes_module, "_identity", lambda i: (i.route, i.cadence_s, i.sitemap))
    buckets = Buckets(ClassTable(CONFIG), block_load=2)
    for i, key in enumerate(KEYS):
        cadence = None if i % 2 else 900  # "pages" defaults to 3600: two classes
        buckets.apply(key, i + 1, "pages", cadence, False, BASE + (i - 20) * 60)
    before = buckets.counts(BASE)
    assert len(before["per_class"]) == 2
    buckets.reconfigure(Config(routes={"pages": RouteConfig(cadence_s=900)}))
    after = buckets.counts(BASE)
    assert len(buckets.classes) == 1
    [(cid, (rows, due))] = after["per_class"].items()
    assert (rows, due) == (len(KEYS), before["due"]["total"])
    assert {c for _k, _m, c, _v in buckets.items()} == {cid}
    ranks = [e[4] for e in buckets.best(BASE, 100)]
    assert len(ranks) == before["due"]["total"]
    assert ranks == sorted(ranks, reverse=True)
    assert buckets.get(KEYS[1])[1] == buckets.classes.class_of("pages", None, False) == cid


# -- the class table ------------------------------------------------------------------


def test_class_ids_follow_route_defaults_and_sources():
    table = ClassTable(CONFIG)
    by_default = table.class_of("pages", None, False)
    assert table.info(by_default) == ClassInfo("pages", 3600, SOURCE_ROUTE, False, 0.0)
    explicit = table.class_of("pages", 3600, False)
    assert explicit != by_default  # same cadence, other source
    assert table.class_of("pages", None, False) == by_default
    assert table.info(table.class_of("nowhere", None, True)) == ClassInfo(
        "nowhere", 86400, SOURCE_ROUTE, True, 0.5
    )
    assert table.info(table.class_of("feeds", 60, True)).boost == 2.0
    assert len(table) == 4 and sorted(table.ids()) == [0, 1, 2, 3]


def test_too_many_classes_is_refused_and_empty_classes_make_room():
    config = Config(max_classes=3)
    table = ClassTable(config)
    for cadence in (60, 120, 180):
        table.class_of("r", cadence, False)
    with pytest.raises(TooManyClasses) as err:
        table.class_of("r", 240, False)
    assert err.value.code == "too_many_classes"
    assert table.class_of("r", 60, False) == 0  # an existing class still resolves

    buckets = Buckets(ClassTable(config))
    for i, cadence in enumerate((60, 120, 180)):
        buckets.apply(f"k{i}", 1, "r", cadence, False, BASE)
    with pytest.raises(TooManyClasses):
        buckets.apply("k3", 1, "r", 240, False, BASE)
    assert "k3" not in buckets and len(buckets) == 3  # nothing changed
    buckets.remove("k1")
    assert buckets.apply("k3", 1, "r", 240, False, BASE)
    cid = buckets.get("k3")[1]
    assert cid == 3  # ids are never reused
    assert 1 not in buckets.classes
    assert buckets.counts(BASE)["classes"] == 3


def test_stale_versions_never_overwrite():
    buckets = Buckets(ClassTable(CONFIG))
    assert buckets.apply("a", 5, "pages", None, False, BASE)
    assert not buckets.apply("a", 5, "pages", None, False, BASE + 600)
    assert not buckets.apply("a", 4, "pages", None, False, BASE + 600)
    assert buckets.get("a")[2] == 5
    assert not buckets.remove("a", 4)
    assert buckets.remove("a", 5)
    assert not buckets.remove("a")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_many_rows_through_table_growth_and_deletes(seed):
    rnd = Random(seed)
    buckets = Buckets(ClassTable(CONFIG), block_load=16)
    model = Model(CONFIG)
    keys = [f"key-{i}" for i in range(3000)]
    for version in range(1, 6001):
        key = rnd.choice(keys)
        if rnd.random() < 0.3:
            assert buckets.remove(key) == model.remove(key, None)
        else:
            due = BASE + rnd.randint(-2000, 2000) * 60
            route = rnd.choice(ROUTES)
            args = (key, version, route, rnd.choice([None, 60]), rnd.random() < 0.2, due)
            assert buckets.apply(*args) == model.apply(*args)
    assert {k: (m, v) for k, m, _c, v in buckets.items()} == {
        k: (row[4], row[0]) for k, row in model.rows.items()
    }
    assert buckets.counts(BASE)["due"]["total"] == sum(
        1 for row in model.rows.values() if row[4] <= minute_of(BASE)
    )


# -- the bulk load ----------------------------------------------------------------


def check_orders(buckets: Buckets, flush: bool = True) -> None:
    """Every class's order is sorted, its blocks within bounds and its maxes,
    sizes, pending values and the columns in step; and again once the
    pending values are merged in."""
    load = buckets._block_load
    placed = set()
    assert set(buckets._order_detached) <= set(buckets._order)
    assert set(buckets._due) == set(buckets._order)
    assert set(buckets._due_detached) == set(buckets._order_detached)
    for orders, flag in ((buckets._order, 0), (buckets._order_detached, 1)):
        for cid, order in orders.items():
            values = list(order)
            assert values == sorted(values)
            assert order.maxes == [block[-1] for block in order.blocks]
            assert all(0 < len(block) <= 2 * load for block in order.blocks)
            assert not order.pending or (flag == 0 and buckets._dirty[cid] is order)
            for run in order.pending:
                values += run
            assert order.size == len(values) == len(set(values))
            for value in values:
                slot = value & buckets_module.SLOT_MASK
                assert buckets._cids[slot] == cid
                assert buckets._mins[slot] == value >> buckets_module.SLOT_BITS
                assert buckets._det[slot] == flag
                placed.add(slot)
    live = {slot for slot, key in enumerate(buckets._keys) if key is not None}
    assert placed == live
    assert set(buckets._free) == set(range(len(buckets._keys))) - live
    assert len(buckets._det) == len(buckets._keys)
    assert not any(buckets._det[slot] for slot in buckets._free)
    assert buckets.detached == sum(buckets._det)
    if flush:
        buckets._flush()
        check_orders(buckets, flush=False)


walked_rows = st.tuples(
    st.sampled_from(KEYS),
    st.integers(1, 25),
    st.sampled_from(ROUTES),
    cadences,
    st.sampled_from([False, True, 0, 1]),  # SQLite hands back 0 and 1
    due_times,
)
chunks = st.tuples(
    st.lists(walked_rows, max_size=30, unique_by=lambda row: row[0]),
    st.sampled_from(["ascending", "ascending", "as drawn", "doubled"]),
    st.booleans(),  # merge the pending values at once, or leave them to the next read
)
loads = st.tuples(st.just("load"), chunks)
feed_deletes = st.tuples(st.just("feed delete"), st.sampled_from(KEYS), st.integers(1, 25))
load_operations = st.lists(
    st.one_of(loads, loads, applies, removes, feed_deletes, checks), min_size=1, max_size=40
)


def walk_order(rows: list[tuple], how: str) -> list[tuple]:
    if how == "ascending":
        return sorted(rows)
    if how == "doubled" and rows:  # a key twice: the row-by-row path
        return [*rows, (rows[0][0], rows[0][1] + 1, *rows[0][2:])]
    return rows


def run_load(buckets: Buckets, model: Model, ops: list[tuple[Any, ...]]) -> None:
    """The keeper's load: walked chunks between feed changes; a delete seen
    during the load removes the row and leaves a tombstone."""
    tombstones: dict[str, int] = {}
    for op in ops:
        if op[0] == "load":
            rows, how, flush = op[1]
            rows = walk_order(rows, how)
            want = 0
            for row in rows:
                if tombstones.get(row[0], 0) < row[1]:
                    want += model.apply(*row)
            assert buckets.load_rows(rows, tombstones) == (want, 0)
            check_orders(buckets, flush)
        elif op[0] == "feed delete":
            _op, key, seq = op
            assert buckets.remove(key) == model.remove(key, None)
            tombstones[key] = seq
        elif op[0] == "check":
            check_equal(buckets, model, op[1])
            check_best(buckets, model, op[1], 12, frozenset(), set())
        else:
            run(buckets, model, [op])


@SETTINGS
@given(ops=load_operations, now=nows, load=block_loads, capacity=st.sampled_from([0, 40]))
def test_load_rows_equal_a_brute_force_model(ops, now, load, capacity):
    buckets = Buckets(ClassTable(CONFIG), capacity=capacity, block_load=load)
    model = Model(CONFIG)
    run_load(buckets, model, ops)
    check_equal(buckets, model, now)
    check_orders(buckets)


@SETTINGS
@given(
    config=configs,
    ops=operations,
    walked=st.lists(walked_rows, max_size=30, unique_by=lambda row: row[0]),
    now=nows,
    load=block_loads,
)
def test_reconfigure_with_values_pending(config, ops, walked, now, load):
    buckets = Buckets(ClassTable(CONFIG), block_load=load)
    model = Model(CONFIG)
    run(buckets, model, ops)
    buckets.counts(now)
    want = sum(model.apply(*row) for row in sorted(walked))
    assert buckets.load_rows(sorted(walked)) == (want, 0)
    buckets.reconfigure(config)
    model.config = config
    check_equal(buckets, model, now)
    check_orders(buckets)


def test_load_rows_never_overwrite_newer():
    buckets = Buckets(ClassTable(CONFIG))
    assert buckets.apply("b", 10, "pages", None, False, BASE)
    walked = [
        ("a", 3, "pages", None, False, BASE),
        ("b", 9, "feeds", 60, True, BASE + 600),  # older than the row held
        ("c", 5, "pages", None, False, BASE),  # deleted at seq 7 during the walk
        ("d", 8, "pages", None, False, BASE),  # deleted at seq 7, written again at 8
    ]
    assert buckets.load_rows(walked, {"c": 7, "d": 7}) == (2, 0)
    assert buckets.get("b") == (minute_of(BASE), buckets.classes.class_of("pages", None, False), 10)
    assert "c" not in buckets and buckets.get("d")[2] == 8
    # The same version again changes nothing; a newer one moves the row.
    assert buckets.load_rows([("a", 3, "feeds", None, False, BASE + 60)]) == (0, 0)
    assert buckets.load_rows([("a", 4, "feeds", None, False, BASE + 60)]) == (1, 0)
    assert buckets.get("a")[0] == minute_of(BASE) + 1
    assert len(buckets) == 3
    check_orders(buckets)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    max_classes=st.integers(1, 6),
    doubled=st.booleans(),
)
def test_load_rows_refuse_classes_as_apply_does(seed, max_classes, doubled):
    """Rows whose class would pass max_classes are counted as refused, and
    classes left empty make room, exactly as ``apply`` row by row does."""
    rnd = Random(seed)
    config = Config(max_classes=max_classes)
    bulk, single = Buckets(ClassTable(config)), Buckets(ClassTable(config))
    version = 0
    for _chunk in range(6):
        rows = []
        for key in sorted(rnd.sample(KEYS, rnd.randint(0, 12))):
            version += 1
            route = rnd.choice(ROUTES)
            rows.append((key, version, route, rnd.choice([60, 120, 180]), False, BASE))
        if doubled and rows:
            rows.append(rows[0])
        assert bulk.load_rows(rows) == single._load_one_by_one(rows)
        for key in rnd.sample(KEYS, 4):  # empty some classes
            assert bulk.remove(key) == single.remove(key)

        def held(b: Buckets) -> dict:
            return {k: (m, v, identity(b.classes.info(c))) for k, m, c, v in b.items()}

        assert held(bulk) == held(single)
        assert bulk.counts(BASE) == single.counts(BASE)
        check_orders(bulk)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32), load=st.sampled_from([2, 8, 64]))
def test_load_rows_through_growth_merges_and_moves(seed, load):
    """Thousands of rows in chunks of every size against the model: the key
    table grows inside a chunk, orders are rebuilt, merged per block and
    inserted into, held rows move, freed slots are reused."""
    rnd = Random(seed)
    buckets = Buckets(ClassTable(CONFIG), block_load=load)
    model = Model(CONFIG)
    keys = [f"key-{i:05d}" for i in range(4000)]
    version = 0
    start = 0
    while start < len(keys):
        size = rnd.choice([1, 7, 60, 300, 900])
        rows = []
        for key in keys[start : start + size]:
            version += 1
            due = BASE + rnd.randint(-2000, 2000) * 60
            rows.append((key, version, rnd.choice(ROUTES), rnd.choice([None, 60]), False, due))
        walked = keys[:start]
        start = min(start + size, len(keys))
        # Feed changes between chunks: moves of rows walked already, deletes.
        for _ in range(rnd.randint(0, 20)):
            version += 1
            key = keys[rnd.randrange(start)]
            if rnd.random() < 0.3:
                assert buckets.remove(key) == model.remove(key, None)
            else:
                args = (key, version, "feeds", None, True, BASE + rnd.randint(-50, 50) * 60)
                assert buckets.apply(*args) == model.apply(*args)
        # A walked chunk also revisits a few rows, some newer than held.
        for key in rnd.sample(walked, min(5, len(walked))):
            rows.append((key, rnd.randint(1, version + 5), "pages", 60, True, BASE))
        rows.sort()
        want = sum(model.apply(*row) for row in rows)
        assert buckets.load_rows(rows) == (want, 0)
    check_orders(buckets)
    assert {k: (m, v) for k, m, _c, v in buckets.items()} == {
        k: (row[4], row[0]) for k, row in model.rows.items()
    }
    check_equal(buckets, model, BASE)
    check_best(buckets, model, BASE, 500, frozenset(), set())


def test_reserve_keeps_the_key_table_through_a_load(monkeypatch):
    buckets = Buckets(ClassTable(CONFIG))
    buckets.reserve(5000)
    cells = len(buckets._table)
    monkeypatch.setattr(buckets, "_rehash", lambda cells: pytest.fail("rehashed"))
    rows = [(f"k{i:05d}", 1, "pages", None, False, BASE + i) for i in range(5000)]
    for start in range(0, 5000, 1000):
        assert buckets.load_rows(rows[start : start + 1000]) == (1000, 0)
    for i in range(5000):  # ... and through applying as many one by one
        buckets.remove(f"k{i:05d}")
        assert buckets.apply(f"k{i:05d}", 2, "pages", None, False, BASE)
    assert len(buckets._table) == cells and len(buckets) == 5000


# -- best as columns -------------------------------------------------------------------


@SETTINGS
@given(
    ops=load_operations,
    now=nows,
    k=st.integers(0, 30),
    paused=st.frozensets(st.sampled_from(ROUTES), max_size=2),
    exclude=st.sets(st.sampled_from(KEYS), max_size=10),
    search=searches,
)
def test_best_columns_are_best(ops, now, k, paused, exclude, search):
    """The same rows as ``best``, rank for rank, also with values pending."""
    buckets = Buckets(ClassTable(CONFIG), block_load=3)
    model = Model(CONFIG)
    run_load(buckets, model, ops)
    with searching(search):
        columns = best_via_columns(buckets, now, k, paused, exclude or None)
    entries = buckets.best(now, k, paused, exclude or None)
    assert [entry[4] for entry in columns] == [entry[4] for entry in entries]
    edge = entries[-1][4] if entries else None  # rows tied with the last may differ
    assert {e for e in columns if e[4] != edge} == {e for e in entries if e[4] != edge}
    check_best(buckets, model, now, k, paused, exclude, best_via_columns)


def test_order_values_read_as_int32_halves_are_slot_and_minute():
    """``best_columns`` takes an order value's slot and minute as the two
    int32 halves of its int64 (``buckets_module._SLOT_HALF``)."""
    from array import array

    assert array("i").itemsize == 4 and array("q").itemsize == 8
    assert buckets_module.SLOT_BITS == 32
    top = 2**31 - 1
    pairs = [(0, 0), (1, top), (-1, 5), (-top - 1, 0), (top, top), (28_333_333, 7)]
    values = array("q", [minute << 32 | slot for minute, slot in pairs])
    halves = array("i", values.tobytes())
    slots = list(halves[buckets_module._SLOT_HALF :: 2])
    minutes = list(halves[buckets_module._MINUTE_HALF :: 2])
    assert list(zip(minutes, slots, strict=True)) == pairs


def test_best_columns_publish_as_best_does(node_name):
    buckets = Buckets(ClassTable(CONFIG), block_load=8)
    rnd = Random(5)
    for i in range(2000):
        route, cadence = rnd.choice(ROUTES), rnd.choice([None, 60, 900])
        buckets.apply(f"row-{i}", i + 1, route, cadence, rnd.random() < 0.3, BASE - i * 37)
    columns = buckets.best_columns(BASE, 700)
    ready = ReadySet.create(node_name, capacity=1000)
    try:
        assert ready.publish_columns(*columns, BASE) == 700
        assert [tuple(e) for e in ready.snapshot().entries] == list(zip(*columns, strict=True))
        ranks = [entry.rank for entry in ready.snapshot().entries]
        assert ranks == [entry[4] for entry in buckets.best(BASE, 700)]
    finally:
        ready.close()
        ReadySet.unlink(node_name)


# -- lateness -----------------------------------------------------------------------


def test_lateness_bins_at_exact_boundaries():
    """Rows whose ratio is exactly an edge fall in the bin the edge opens; the
    minutes on either side fall on either side."""
    buckets = Buckets(ClassTable(CONFIG))
    now = BASE - BASE % 60 + 30.0  # half a minute into a minute
    now_minute = minute_of(now)
    cadence = 3600  # ratio 0.25 = 900 s late = 15 minutes, less the half minute
    keys = []
    for back in range(0, 260):
        key = f"k{back}"
        keys.append(key)
        # due at the minute's start: lateness = back * 60 + 30 s
        assert buckets.apply(key, 1, "pages", cadence, False, (now_minute - back) * 60)
    assert buckets.apply("future", 1, "pages", cadence, False, now + 60)
    [(cid, bins)] = buckets.lateness(now, LATENESS_EDGES).items()
    want = [0] * len(LATENESS_EDGES)
    for back in range(260):
        ratio = (back * 60 + 30) / cadence
        want[bisect_right(LATENESS_EDGES, ratio) - 1] += 1
    assert bins == want
    # Exactly on the edge: now on a whole minute, 15 minutes late is 0.25.
    whole = float(now_minute * 60)
    one = Buckets(ClassTable(CONFIG))
    for back in (14, 15, 16):
        one.apply(f"b{back}", 1, "pages", cadence, False, whole - back * 60)
    assert list(one.lateness(whole, LATENESS_EDGES).values()) == [[1, 2, 0, 0, 0, 0]]
    assert one.lateness(whole - 60 * 17, (0.0, 1.0)) == {}  # none due yet


@settings(max_examples=200, deadline=None)
@given(
    now=st.floats(0, 4e9),
    offsets=st.lists(st.integers(-5, 3000), min_size=1, max_size=30),
    cadence=st.sampled_from([1, 60, 61, 900, 3600, 86400, 604800]),
    edges=st.lists(st.floats(0.0, 50.0, exclude_min=True), max_size=6, unique=True),
)
def test_lateness_equals_the_ratio_of_every_row(now, offsets, cadence, edges):
    """Any now, any edges: floats whose quotient rounds across a minute."""
    edges = (0.0, *sorted(edges))
    buckets = Buckets(ClassTable(CONFIG))
    model = Model(CONFIG)
    now_minute = minute_of(now)
    for i, back in enumerate(offsets):
        args = (f"k{i}", 1, "pages", cadence, False, (now_minute - back) * 60.0)
        buckets.apply(*args)
        model.apply(*args)
    got = {identity(buckets.classes.info(c)): b for c, b in buckets.lateness(now, edges).items()}
    assert got == model.lateness(now, edges)


@settings(max_examples=300, deadline=None)
@given(
    now=st.one_of(st.floats(0, 1e5), st.floats(1.6e9, 1.8e9)),
    offsets=st.lists(st.integers(0, 300), min_size=1, max_size=20),
    cadence=st.sampled_from([1, 3, 7, 60, 900, 3600]),
    picks=st.lists(st.integers(0, 19), max_size=5),
)
def test_lateness_edges_on_rows_own_ratios(now, offsets, cadence, picks):
    """Edges equal to rows' own ratios: the row sits exactly on the boundary,
    where the floor of the float bound is sometimes a minute short."""
    buckets = Buckets(ClassTable(CONFIG))
    model = Model(CONFIG)
    now_minute = minute_of(now)
    for i, back in enumerate(offsets):
        args = (f"k{i}", 1, "pages", cadence, False, (now_minute - back) * 60.0)
        buckets.apply(*args)
        model.apply(*args)
    ratios = {(now - (now_minute - offsets[p % len(offsets)]) * 60) / cadence for p in picks}
    edges = (0.0, *sorted(r for r in ratios if r > 0))
    got = {identity(buckets.classes.info(c)): b for c, b in buckets.lateness(now, edges).items()}
    assert got == model.lateness(now, edges)


def test_lateness_where_the_floor_of_the_bound_is_a_minute_short():
    now, cadence, minute = 3912.7, 60, -107
    edge = (now - minute * 60) / cadence
    assert int((now - edge * cadence) // 60) == minute - 1  # the naive bound
    buckets = Buckets(ClassTable(CONFIG))
    for m in (minute - 1, minute, minute + 1):
        buckets.apply(f"m{m}", 1, "pages", cadence, False, m * 60.0)
    assert list(buckets.lateness(now, (0.0, edge)).values()) == [[1, 2]]


def test_lateness_refuses_bad_edges():
    buckets = Buckets(ClassTable(CONFIG))
    for edges in ((), (0.5, 1.0), (0.0, 1.0, 1.0), (0.0, 2.0, 1.0), (0.0, float("inf"))):
        with pytest.raises(ValueError):
            buckets.lateness(BASE, edges)


# -- came due ------------------------------------------------------------------------


class DueModel(Model):
    """The model, and rows entering the due state counted as the buckets
    count them: forward past minutes never reached, or applied at or before
    the minute reached while absent or not due."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.through = -1
        self.high: int | None = None
        self.came_due = 0

    def apply(self, key, version, route, cadence_s, sitemap, due_at) -> bool:
        held = self.rows.get(key)
        if not super().apply(key, version, route, cadence_s, sitemap, due_at):
            return False
        minute = self.rows[key][4]
        if minute <= self.through and (held is None or held[4] > self.through):
            self.came_due += 1
        return True

    def load(self, row: tuple) -> bool:
        return Model.apply(self, *row)

    def advance(self, now_minute: int) -> None:
        if self.high is None:
            self.high = now_minute
        if now_minute > self.through:
            self.came_due += self.due_between(max(self.through, self.high), now_minute)
            self.high = max(self.high, now_minute)
        self.through = now_minute


minute_steps = st.integers(-3, 6)
came_due_ops = st.lists(
    st.one_of(
        applies,
        removes,
        st.tuples(st.just("advance"), minute_steps),
        st.tuples(st.just("load"), chunks),
    ),
    min_size=1,
    max_size=60,
)


@SETTINGS
@given(ops=came_due_ops, start=st.integers(-100, 100), load=block_loads)
def test_came_due_counts_rows_entering_the_due_state(ops, start, load):
    buckets = Buckets(ClassTable(CONFIG), block_load=load)
    model = DueModel(CONFIG)
    minute = minute_of(BASE) + start
    for op in ops:
        if op[0] == "apply":
            assert buckets.apply(*op[1:]) == model.apply(*op[1:])
        elif op[0] == "remove":
            assert buckets.remove(op[1], op[2]) == model.remove(op[1], op[2])
        elif op[0] == "advance":
            minute += op[1]
            buckets.advance(minute)
            model.advance(minute)
        else:
            rows, how, _flush = op[1]
            rows = walk_order(rows, how)
            want = sum(model.load(row) for row in rows)
            assert buckets.load_rows(rows) == (want, 0)
        assert buckets.came_due == model.came_due
    check_equal(buckets, model, minute * 60.0 + 1)


def test_came_due_first_advance_counts_nothing_and_steps_back_count_once():
    buckets = Buckets(ClassTable(CONFIG))
    now_minute = minute_of(BASE)
    for i in range(10):  # due at now_minute - 5 .. now_minute + 4
        buckets.apply(f"k{i}", 1, "pages", None, False, (now_minute - 5 + i) * 60.0)
    buckets.advance(now_minute)
    assert buckets.came_due == 0  # due before anyone counted
    buckets.advance(now_minute + 2)
    assert buckets.came_due == 2
    buckets.advance(now_minute - 3)  # the clock steps back ...
    buckets.advance(now_minute + 3)  # ... and forward: only the new minute counts
    assert buckets.came_due == 3
    buckets.apply("k0", 2, "pages", None, False, (now_minute + 1) * 60.0)  # was due: no
    buckets.apply("k9", 2, "pages", None, False, (now_minute + 1) * 60.0)  # now due: yes
    buckets.apply("new", 1, "pages", None, False, now_minute * 60.0)  # new and due: yes
    buckets.apply("later", 1, "pages", None, False, (now_minute + 9) * 60.0)
    assert buckets.came_due == 5
    # Loaded rows are restored state; a future one counts when it comes due.
    buckets.load_rows([("l1", 1, "pages", None, False, BASE - 600)])
    buckets.load_rows([("l2", 1, "pages", None, False, (now_minute + 5) * 60.0)])
    buckets._load_one_by_one([("l3", 1, "pages", None, False, BASE - 600)])
    assert buckets.came_due == 5
    buckets.advance(now_minute + 5)
    assert buckets.came_due == 6  # l2 (k9, at +4 before, moved to +1)
    assert buckets.count_due_between(now_minute + 3, now_minute + 5) == 1


# -- detached rows ---------------------------------------------------------------------


class DetachModel(DueModel):
    """The model with a set of detached keys: ``best`` never sees them,
    everything else counts them; apply keeps the flag, remove forgets it."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.detached: set[str] = set()

    def remove(self, key: str, version: int | None) -> bool:
        if not super().remove(key, version):
            return False
        self.detached.discard(key)
        return True

    def detach(self, key: str) -> bool:
        if key not in self.rows or key in self.detached:
            return False
        self.detached.add(key)
        return True

    def attach(self, key: str) -> bool:
        if key not in self.detached:
            return False
        self.detached.remove(key)
        return True


detaches = st.tuples(st.just("detach"), st.sampled_from(KEYS))
attaches = st.tuples(st.just("attach"), st.sampled_from(KEYS))
# The keeper's way: many keys at once (absent, repeated and detached ones among them).
bulk_moves = st.tuples(
    st.sampled_from(["detach_many", "attach_many"]), st.lists(st.sampled_from(KEYS), max_size=12)
)
bests = st.tuples(
    st.just("best"),
    nows,
    st.integers(1, 30),
    st.sets(st.sampled_from(KEYS), max_size=5),  # a small exclude= set as well
)
reconfigures = st.tuples(st.just("reconfigure"), st.builds(lambda: None))
# The keeper's way with the lease table: a publish (``best`` or
# ``best_columns``, which remember their candidates), then, after whatever
# other changes come between, the keys claimers were granted from it
# detached in bulk: a head of the published keys, some others from it, and
# a few keys that may not be in it, as fresh strs (the lease table decodes
# its own), repeats among them.
publishes = st.tuples(st.just("publish"), nows, st.integers(1, 30), st.booleans())
grants = st.tuples(
    st.just("grant"),
    st.integers(0, 30),
    st.lists(st.integers(0, 40), max_size=8),
    st.lists(st.sampled_from(KEYS), max_size=3),
)
detach_ops = st.lists(
    st.one_of(
        applies,
        applies,
        removes,
        detaches,
        detaches,
        detaches,
        attaches,
        bulk_moves,
        bulk_moves,
        st.tuples(st.just("advance"), minute_steps),
        st.tuples(st.just("load"), chunks),
        bests,
        checks,
        publishes,
        grants,
        grants,
    ),
    min_size=1,
    max_size=80,
)


def publish_or_grant(
    buckets: Buckets, model: DetachModel, op: tuple, published: list[str], minute: int
) -> tuple[list[str], int]:
    """A publish (checked against the model), or a bulk detach of keys
    granted from the last one; returns the keys published and the minute."""
    if op[0] == "publish":
        now, k, columns = op[1:]
        model.advance(minute_of(now))
        best = best_via_columns if columns else Buckets.best
        got = check_best(buckets, model, now, k, frozenset(), set(), best, model.detached)
        return [entry[0] for entry in got], minute_of(now)
    head, picks, others = op[1:]
    chosen = published[:head]
    chosen += [published[p % len(published)] for p in picks] if published else []
    chosen = [key.encode().decode() for key in chosen + others]
    want = sum(model.detach(key) for key in set(chosen))
    assert buckets.detach_many(chosen) == want
    check_orders(buckets)
    return published, minute


def run_detached(buckets: Buckets, model: DetachModel, ops: list[tuple], minute: int) -> int:
    """Interleave every kind of change with detach and attach; after each,
    the flags and came_due agree with the model. Returns the minute reached."""
    published: list[str] = []
    for op in ops:
        kind = op[0]
        if kind in ("publish", "grant"):
            published, minute = publish_or_grant(buckets, model, op, published, minute)
        elif kind == "detach":
            assert buckets.detach(op[1]) == model.detach(op[1])
        elif kind == "attach":
            assert buckets.attach(op[1]) == model.attach(op[1])
        elif kind in ("detach_many", "attach_many"):
            one = model.detach if kind == "detach_many" else model.attach
            want = sum(one(key) for key in set(op[1]))
            assert getattr(buckets, kind)(op[1]) == want
            check_orders(buckets)
        elif kind == "advance":
            minute += op[1]
            buckets.advance(minute)
            model.advance(minute)
        elif kind == "load":
            rows, how, flush = op[1]
            rows = walk_order(rows, how)
            want = sum(model.load(row) for row in rows)
            assert buckets.load_rows(rows) == (want, 0)
            check_orders(buckets, flush)
        elif kind in ("best", "check"):
            now = op[1]
            model.advance(minute_of(now))  # both advance the buckets
            if kind == "best":
                check_best(
                    buckets, model, now, op[2], frozenset(), op[3], Buckets.best, model.detached
                )
            else:
                check_equal(buckets, model, now)
            minute = minute_of(now)
        elif kind == "apply":
            assert buckets.apply(*op[1:]) == model.apply(*op[1:])
        else:
            assert buckets.remove(op[1], op[2]) == model.remove(op[1], op[2])
        assert buckets.came_due == model.came_due
        assert buckets.detached == len(model.detached)
        for key in KEYS:
            assert buckets.is_detached(key) == (key in model.detached)
    return minute


@SETTINGS
@given(
    ops=detach_ops,
    now=nows,
    k=st.integers(1, 40),
    load=block_loads,
    search=searches,
    hint=hints,
    remember=st.booleans(),
)
def test_detached_rows_are_counted_but_never_best(ops, now, k, load, search, hint, remember):
    buckets = Buckets(ClassTable(CONFIG), block_load=load, remember_best=remember)
    model = DetachModel(CONFIG)
    run_detached(buckets, model, ops, minute_of(BASE))
    check_orders(buckets)
    model.advance(minute_of(now))
    check_equal(buckets, model, now)
    with searching(search):
        for best in (Buckets.best, best_via_columns):
            buckets._best_hint = hint
            check_best(buckets, model, now, k, frozenset(), set(), best, model.detached)
            check_best(
                buckets, model, now, k, frozenset({"feeds"}), set(KEYS[:5]), best, model.detached
            )
    assert buckets.came_due == model.came_due


@SETTINGS
@given(
    config=configs,
    ops=detach_ops,
    more=detach_ops,
    now=nows,
    load=block_loads,
    remember=st.booleans(),
)
def test_reconfigure_carries_detached_rows(config, ops, more, now, load, remember):
    buckets = Buckets(ClassTable(CONFIG), block_load=load, remember_best=remember)
    model = DetachModel(CONFIG)
    minute = run_detached(buckets, model, ops, minute_of(BASE))
    buckets.reconfigure(config)
    model.config = config
    check_orders(buckets)
    minute = run_detached(buckets, model, more, minute)
    model.advance(minute_of(now))
    check_equal(buckets, model, now)
    check_best(buckets, model, now, 25, frozenset(), set(), Buckets.best, model.detached)


# The publish-then-grant cycle, densely: every row due from the start, most
# steps a publish or a grant, and the changes that can make a remembered
# candidate stale (a move, a remove and a write again, a single detach, a
# load) between them.
grant_cycle_ops = st.lists(
    st.one_of(
        publishes,
        publishes,
        grants,
        grants,
        grants,
        applies,
        removes,
        detaches,
        attaches,
        bulk_moves,
        st.tuples(st.just("load"), chunks),
    ),
    min_size=1,
    max_size=60,
)


@SETTINGS
@given(
    ops=grant_cycle_ops,
    load=st.sampled_from([2, 3, 4, 16]),
    columns=st.booleans(),
    now=nows,
)
def test_bulk_detach_of_published_keys_equals_the_model(ops, load, columns, now):
    buckets = Buckets(ClassTable(CONFIG), block_load=load, remember_best=True)
    model = DetachModel(CONFIG)
    for i, key in enumerate(KEYS):
        args = (key, 1, ROUTES[i % 3], (None, 60, 900)[i % 3], i % 4 == 0, BASE - (i % 7) * 600)
        assert buckets.apply(*args) == model.apply(*args)
    start = [("publish", BASE, 40, columns)]
    run_detached(buckets, model, start + ops, minute_of(BASE))
    check_orders(buckets)
    model.advance(minute_of(now))
    check_equal(buckets, model, now)
    check_best(buckets, model, now, 40, frozenset(), set(), Buckets.best, model.detached)


def _published_buckets(columns: bool) -> tuple[Buckets, list[str]]:
    """40 due rows in one class, all published (and so remembered)."""
    buckets = Buckets(ClassTable(CONFIG), block_load=4, remember_best=True)
    for i, key in enumerate(KEYS):
        buckets.apply(key, 1, "pages", None, False, BASE - (len(KEYS) - i) * 60)
    got = buckets.best_columns(BASE, 40)[0] if columns else [e[0] for e in buckets.best(BASE, 40)]
    assert got == KEYS  # the earliest first
    return buckets, got


@pytest.mark.parametrize("columns", [False, True])
def test_a_row_moved_after_the_publish_is_detached_from_where_it_is_now(columns):
    buckets, published = _published_buckets(columns)
    assert buckets.apply(KEYS[0], 2, "pages", None, False, BASE - 3 * 3600)  # later in its order
    assert buckets.apply(KEYS[1], 2, "feeds", None, False, BASE - 60)  # another class
    assert buckets.detach_many([key.encode().decode() for key in published[:3]]) == 3
    check_orders(buckets)
    assert [e[0] for e in buckets.best(BASE, 40)] == KEYS[3:]
    assert buckets.counts(BASE)["due"]["total"] == 40


@pytest.mark.parametrize("columns", [False, True])
def test_a_row_removed_and_written_again_after_the_publish_is_found_by_its_key(columns):
    buckets, published = _published_buckets(columns)
    assert buckets.remove(KEYS[0])
    assert buckets.apply("a newcomer", 1, "pages", None, False, BASE - 7200)  # takes KEYS[0]'s slot
    assert buckets.apply(KEYS[0], 2, "pages", None, False, BASE - 120)
    assert buckets.detach_many([KEYS[0], KEYS[2]]) == 2
    check_orders(buckets)
    assert not buckets.is_detached("a newcomer")
    assert [e[0] for e in buckets.best(BASE, 3)] == ["a newcomer", KEYS[1], KEYS[3]]


@pytest.mark.parametrize("columns", [False, True])
def test_a_published_key_detached_since_is_not_detached_twice(columns):
    buckets, published = _published_buckets(columns)
    assert buckets.detach_many(published[:5]) == 5
    assert buckets.detach(KEYS[6])
    assert buckets.detach_many(published[:8] + published[:2]) == 2  # KEYS[5] and KEYS[7]
    assert buckets.detached == 8
    check_orders(buckets)
    assert buckets.attach_many(published[3:5]) == 2
    assert buckets.detach_many(published[:6]) == 2  # attached again since the publish
    check_orders(buckets)
    assert [e[0] for e in buckets.best(BASE, 40)] == KEYS[8:]


def test_a_reconfigure_after_the_publish_forgets_the_candidates(monkeypatch):
    # As test_merged_classes_carry_their_detached_rows: the route default's
    # class merges into its twin, so remembered class ids would be stale.
    monkeypatch.setattr(classes_module, "_identity", lambda i: (i.route, i.cadence_s, i.sitemap))
    buckets = Buckets(ClassTable(CONFIG), block_load=4, remember_best=True)
    for i, key in enumerate(KEYS):
        buckets.apply(key, 1, "pages", None if i % 2 else 900, False, BASE - (40 - i) * 60)
    published = buckets.best_columns(BASE, 40)[0]
    granted = published[10:30]
    assert len({buckets.get(key)[1] for key in granted}) == 2
    buckets.reconfigure(Config(routes={"pages": RouteConfig(cadence_s=900)}))
    assert len(buckets.counts(BASE)["per_class"]) == 1
    assert buckets.detach_many(granted) == 20
    check_orders(buckets)
    assert {e[0] for e in buckets.best(BASE, 40)} == set(published) - set(granted)


def test_merged_classes_carry_their_detached_rows(monkeypatch):
    # As test_reconfigure_moves_the_rows_of_merged_classes: an identity blind
    # to the source merges the default-cadence class into its twin.
    monkeypatch.setattr(classes_module, "_identity", lambda i: (i.route, i.cadence_s, i.sitemap))
    buckets = Buckets(ClassTable(CONFIG), block_load=2)
    for i, key in enumerate(KEYS):
        cadence = None if i % 2 else 900
        buckets.apply(key, i + 1, "pages", cadence, False, BASE + (i - 20) * 60)
    detached = set(KEYS[1::2]) | set(KEYS[::4])  # every default-cadence row, some others
    for key in detached:
        assert buckets.detach(key)
    before = buckets.counts(BASE)
    lateness = sum(map(sum, buckets.lateness(BASE, (0.0, 1.0)).values()))
    buckets.reconfigure(Config(routes={"pages": RouteConfig(cadence_s=900)}))
    check_orders(buckets)
    [(cid, (rows, due))] = buckets.counts(BASE)["per_class"].items()
    assert (rows, due) == (len(KEYS), before["due"]["total"])
    assert sum(buckets.lateness(BASE, (0.0, 1.0))[cid]) == lateness == due
    assert {c for _k, _m, c, _v in buckets.items()} == {cid}
    due_keys = {key for key, minute, _c, _v in buckets.items() if minute <= minute_of(BASE)}
    assert {e[0] for e in buckets.best(BASE, 100)} == due_keys - detached
    for key in KEYS[1::2]:
        assert buckets.attach(key)
    assert {e[0] for e in buckets.best(BASE, 100)} == due_keys - set(KEYS[::4])
    check_orders(buckets)


def test_a_class_of_detached_rows_is_not_retired():
    buckets = Buckets(ClassTable(Config(max_classes=2)))
    buckets.apply("a", 1, "r", 60, False, BASE)
    buckets.apply("b", 1, "r", 120, False, BASE)
    assert buckets.detach("a")
    with pytest.raises(TooManyClasses):
        buckets.apply("c", 1, "r", 180, False, BASE)
    assert buckets.get("a")[1] in buckets.classes
    assert buckets.remove("a")
    assert not buckets.is_detached("a") and buckets.detached == 0
    assert buckets.apply("c", 1, "r", 180, False, BASE)  # a's class retired now
    assert sorted(entry[0] for entry in buckets.best(BASE + 60, 10)) == ["b", "c"]
    check_orders(buckets)


def test_detach_and_attach_answer_for_absent_and_repeated_keys():
    buckets = Buckets(ClassTable(CONFIG))
    assert not buckets.detach("nope") and not buckets.attach("nope")
    assert not buckets.is_detached("nope")
    buckets.apply("a", 1, "pages", None, False, BASE - 600)
    assert not buckets.attach("a")
    assert buckets.detach("a") and not buckets.detach("a")
    assert buckets.is_detached("a") and buckets.detached == 1
    assert buckets.best(BASE, 10) == []
    assert buckets.counts(BASE)["due"]["total"] == 1
    # A newer version, by apply or by the walk, moves it and keeps it detached.
    assert buckets.apply("a", 2, "feeds", 60, True, BASE - 1200)
    assert buckets.load_rows([("a", 3, "feeds", 60, True, BASE - 1800)]) == (1, 0)
    assert buckets.is_detached("a") and buckets.best(BASE, 10) == []
    assert buckets.get("a") == (
        minute_of(BASE - 1800),
        buckets.classes.class_of("feeds", 60, True),
        3,
    )
    assert buckets.oldest_due(BASE) == {buckets.get("a")[1]: minute_of(BASE - 1800)}
    assert buckets.attach("a") and not buckets.is_detached("a") and buckets.detached == 0
    assert [e[0] for e in buckets.best(BASE, 10)] == ["a"]
    check_orders(buckets)


def test_detach_during_a_load_flushes_the_pending_values_first():
    buckets = Buckets(ClassTable(CONFIG), block_load=4)
    rows = [(f"k{i:03d}", 1, "pages", None, False, BASE - i * 60) for i in range(50)]
    assert buckets.load_rows(rows) == (50, 0)
    assert buckets._dirty
    assert buckets.detach("k010")
    assert not buckets._dirty
    assert buckets.load_rows([(f"m{i:03d}", 1, "pages", None, False, BASE) for i in range(9)])
    assert buckets.attach("k010")  # into an order with values pending
    check_orders(buckets)
    assert buckets.counts(BASE)["due"]["total"] == 59
    assert len(buckets.best(BASE, 100)) == 59


@SETTINGS
@given(
    held=st.sets(st.integers(0, 5000), max_size=400),
    load=st.sampled_from([4, 16, 64]),
    picks=st.lists(st.integers(0, 10_000), max_size=120),
    added=st.sets(st.integers(5001, 9000), max_size=200),
)
def test_order_bulk_removal_and_merge_agree_with_a_list(held, load, picks, added):
    """``remove_sorted`` (both ways: a block filtered once, a block losing a
    few values one by one) and ``add_sorted`` against a plain sorted list."""
    order = Order.from_sorted(sorted(held), load)
    for block in order.blocks:  # blocks of several sizes, as inserts leave them
        if len(block) > 2:
            order.remove_sorted([block[1]])
            break
    model = sorted(order)
    gone = sorted({model[i % len(model)] for i in picks}) if model else []
    order.remove_sorted(gone)
    model = sorted(set(model) - set(gone))
    assert list(order) == model and order.size == len(model)
    assert order.maxes == [block[-1] for block in order.blocks]
    assert all(0 < len(block) <= 2 * load for block in order.blocks)
    order.add_sorted(sorted(added))
    model = sorted(set(model) | added)
    assert list(order) == model and order.size == len(model)
    assert order.maxes == [block[-1] for block in order.blocks]


order_ops = st.lists(
    st.one_of(
        # a run of the values held: [at, at + n) of them
        st.tuples(st.just("run"), st.floats(0, 1), st.integers(1, 70)),
        # a run with a few values left in it (claimers skipped them)
        st.tuples(
            st.just("holes"),
            st.floats(0, 1),
            st.integers(2, 70),
            st.sets(st.integers(0, 69), min_size=1, max_size=5),
        ),
        # values anywhere, many, or a few far apart
        st.tuples(st.just("scatter"), st.lists(st.integers(0, 10_000), max_size=90)),
        st.tuples(st.just("scatter"), st.lists(st.integers(0, 10_000), min_size=2, max_size=4)),
        # new values past the largest held (granted keys joining a detached order)
        st.tuples(st.just("append"), st.integers(1, 90), st.integers(1, 3)),
        # new values anywhere
        st.tuples(st.just("add"), st.sets(st.integers(0, 30_000), max_size=90)),
    ),
    max_size=25,
)


@SETTINGS
@given(
    held=st.sets(st.integers(0, 20_000), max_size=600),
    load=st.sampled_from([2, 3, 4, 16, 64]),
    ops=order_ops,
)
def test_order_removals_and_merges_of_every_shape_agree_with_a_list(held, load, ops):
    """``remove_sorted`` (a share that is one run of its block, one filtered
    over its span, one removed value by value) and ``add_sorted`` (values
    past a block's end, merged with a block's tail, inserted, or the whole
    order rebuilt) against a plain sorted list, op after op."""
    order = Order.from_sorted(sorted(held), load)
    model = sorted(held)
    for op in ops:
        kind = op[0]
        if kind in ("run", "holes"):
            at = int(op[1] * len(model))
            span = model[at : at + op[2]]
            skipped = op[3] if kind == "holes" else set()
            gone = [v for j, v in enumerate(span) if j not in skipped]
            order.remove_sorted(gone)
            model = sorted(set(model) - set(gone))
        elif kind == "scatter":
            gone = sorted({model[i % len(model)] for i in op[1]}) if model else []
            order.remove_sorted(gone)
            model = sorted(set(model) - set(gone))
        else:
            if kind == "append":
                top = model[-1] if model else 0
                new = [top + 1 + j * op[2] for j in range(op[1])]
            else:
                new = sorted(op[1] - set(model))
            order.add_sorted(new)
            model = sorted(set(model) | set(new))
        assert list(order) == model and order.size == len(model)
        assert order.maxes == [block[-1] for block in order.blocks]
        assert all(0 < len(block) <= 2 * load for block in order.blocks)


@pytest.mark.parametrize("seed", range(6))
def test_the_c_merge_picks_what_the_python_sort_picks_bit_for_bit(seed):
    """keeper._best.merge (the k-way merge best_columns uses) and the Python
    it stands in for give the same picks in the same order, ties included
    (the sort was stable), and the same float ranks."""
    best = pytest.importorskip("keeper._best")
    from array import array

    from keeper.buckets import _merge
    from keeper.order import SLOT_BITS

    rnd = Random(seed)
    now = 1_800_000_000.0 + rnd.uniform(0, 60)
    values = array("q")
    starts, cids, rates = [], [], []
    for c in range(rnd.randrange(0, 25)):
        minute = int(now // 60) - rnd.randrange(0, 40_000)
        run = []
        for _ in range(rnd.choice([0, 1, 3, 50, 400])):
            minute += rnd.choice([0, 0, 1, 7])  # equal minutes: equal ranks inside a class
            run.append(minute << SLOT_BITS | rnd.randrange(1 << 20))
        starts.append(len(values))
        cids.append(c * 3 + 1)
        cadence = rnd.choice([900, 3600, 3600, 86400, 7200.0])  # equal rates: ties across classes
        rates.append((cadence, rnd.choice([0.0, 0.0, 0.5, 1.0])))
        values += array("q", sorted(run))
    for k in (1, 7, 500, 10**6):
        want = _merge(values, starts, rates, cids, now, k)
        got = best.merge(
            values, starts, [float(r[0]) for r in rates], [float(r[1]) for r in rates], cids, now, k
        )
        assert got == want
        assert [r.hex() for r in got[1]] == [r.hex() for r in want[1]]
    with pytest.raises(ValueError):  # a cadence of 0: no rank
        best.merge(values, [0], [0.0], [0.0], [1], now, 5)


def test_flag_sets_the_bytes_named_and_refuses_a_bad_index_changing_nothing():
    best = pytest.importorskip("keeper._best")
    flags = bytearray(8)
    best.flag(flags, [1, 5, 5], 1)
    assert flags == bytearray([0, 1, 0, 0, 0, 1, 0, 0])
    with pytest.raises(IndexError):
        best.flag(flags, [2, 8], 1)
    assert flags == bytearray([0, 1, 0, 0, 0, 1, 0, 0])
