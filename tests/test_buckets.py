"""The keeper's buckets against a brute-force model: a dict of rows, ranked and
counted by walking every row. Small block loads and the smallest hash table
make every split, join, probe collision and backward shift happen often."""

from __future__ import annotations

from collections import Counter
from random import Random
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keeper.buckets as buckets_module
import keeper.classes as classes_module
from keeper.buckets import Buckets, minute_of
from keeper.classes import SOURCE_ROUTE, SOURCE_ROW, ClassInfo, ClassTable
from node.config import Config, RouteConfig
from node.errors import TooManyClasses

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


def check_best(
    buckets: Buckets, model: Model, now: float, k: int, paused: frozenset, exclude: set
) -> None:
    got = buckets.best(now, k, paused_routes=paused, exclude=exclude or None)
    now_minute = minute_of(now)
    eligible = {
        key: model.rank(key, now)
        for key, row in model.rows.items()
        if row[4] <= now_minute and row[1] not in paused and key not in exclude
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
    runs=st.sampled_from([(1, 1), (1, 2), (2, 5), (16, 64)]),
)
def test_best_is_the_brute_force_top_k(ops, now, k, paused, exclude, load, runs):
    buckets = Buckets(ClassTable(CONFIG), block_load=load)
    model = Model(CONFIG)
    run(buckets, model, ops)
    # Short runs reach the phase after the k-th best is known with few rows.
    with (
        patch.object(buckets_module, "RUN_MIN", runs[0]),
        patch.object(buckets_module, "RUN_MAX", runs[1]),
    ):
        check_best(buckets, model, now, k, paused, exclude)


def test_best_takes_a_whole_minute_bucket_across_blocks():
    buckets = Buckets(ClassTable(CONFIG), block_load=2)
    model = Model(CONFIG)
    for i, key in enumerate(KEYS):
        due = BASE - 600 + (i % 3) * 60  # three crowded minutes, many blocks each
        buckets.apply(key, 1, "pages", None, i % 2 == 0, due)
        model.apply(key, 1, "pages", None, i % 2 == 0, due)
    for k in (1, 7, 13, 14, 20, 40, 41):
        check_best(buckets, model, BASE, k, frozenset(), set())
        check_best(buckets, model, BASE, k, frozenset(), set(KEYS[::3]))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    k=st.sampled_from([1, 7, 60, 250, 900]),
    runs=st.sampled_from([(1, 2), (2, 5), (16, 64)]),
    excluding=st.booleans(),
)
def test_best_on_many_interleaved_rows(seed, k, runs, excluding):
    """Hundreds of rows in classes whose ranks interleave, so the merge goes
    on after the k-th best is known and runs straddle the answer's edge."""
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
    with (
        patch.object(buckets_module, "RUN_MIN", runs[0]),
        patch.object(buckets_module, "RUN_MAX", runs[1]),
    ):
        check_best(buckets, model, BASE, k, frozenset(), exclude)
        check_best(buckets, model, BASE, k, frozenset({"feeds"}), exclude)


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
