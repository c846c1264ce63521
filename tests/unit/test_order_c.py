"""The order merges in C (``keeper._best.sort_runs`` and ``merge_blocks``,
keeper/_best_order.c), held to the Python ``Order`` they stand in for: the
same values in the same order after every step, with the order's own
invariants (``maxes`` the blocks' last values, no block empty or over twice
the load), and the Python path itself still right."""

from __future__ import annotations

from array import array
from random import Random
from unittest.mock import patch

import pytest

import keeper.order as order_module
from keeper.order import SLOT_BITS, Order

pytestmark = pytest.mark.timeout(120)

best = pytest.importorskip("keeper._best")


def check(order: Order, model: list[int], load: int) -> None:
    assert not order.pending
    assert list(order) == model and order.size == len(model)
    assert order.maxes == [block[-1] for block in order.blocks]
    assert all(0 < len(block) <= 2 * load for block in order.blocks)


@pytest.mark.parametrize("seed", range(8))
def test_sort_runs_sorts_like_sorted(seed):
    rnd = Random(seed)
    runs = []
    for _ in range(rnd.randrange(0, 12)):
        n = rnd.choice([0, 1, 5, 63, 64, 65, 300, 5000])
        shape = rnd.choice(["order", "wide", "narrow"])
        if shape == "order":  # minute << 32 | slot, as the keeper's values
            run = [
                (29_000_000 + rnd.randrange(0, 50_000)) << SLOT_BITS | rnd.randrange(1 << 21)
                for _ in range(n)
            ]
        elif shape == "wide":  # negative ones too (a due time before 1970)
            run = [rnd.randrange(-(1 << 63), 1 << 63) for _ in range(n)]
        else:  # every value shares all bytes but the lowest: most passes skipped
            run = [(7 << 40) + rnd.randrange(0, 200) for _ in range(n)]
        runs.append(array("q", run))
    want = sorted(v for run in runs for v in run)
    got = best.sort_runs(runs)
    assert isinstance(got, array) and got.typecode == "q"
    assert got.tolist() == want


def test_sort_runs_and_merge_blocks_refuse_what_is_not_int64():
    with pytest.raises(TypeError):
        best.sort_runs([array("i", [1, 2])])
    with pytest.raises(TypeError):
        best.sort_runs((array("q"),))
    with pytest.raises(TypeError):
        best.merge_blocks([], [], array("d", [1.0]), 4)
    with pytest.raises(ValueError):
        best.merge_blocks([], [], array("q", [1]), 0)
    with pytest.raises(ValueError):
        best.merge_blocks([array("q", [1])], [], array("q", [2]), 4)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("c", [True, False], ids=["c", "python"])
def test_merges_and_flushes_agree_with_a_sorted_list(seed, c):
    """add_sorted (into empty, small and large orders; past the end; all
    over), pending runs flushed (alone, and with an add_sorted), add and
    remove, remove_sorted: op after op, against a sorted list."""
    rnd = Random(seed)
    load = rnd.choice([2, 3, 8, 64, 1000])
    pool = rnd.sample(range(1, 1 << 40), 40_000)
    free = iter(pool)
    order = Order(load)
    model: list[int] = []
    with patch.object(order_module, "_best", best if c else None):
        for _ in range(60):
            kind = rnd.choice(["add_sorted", "pending", "append", "one", "remove", "flush"])
            if kind == "add_sorted":
                new = sorted(next(free) for _ in range(rnd.choice([1, 3, 50, 700])))
                order.add_sorted(new)
                model = sorted(model + new)
            elif kind == "append":
                top = model[-1] if model else 0
                new = [top + 1 + i for i in range(rnd.randrange(1, 90))]
                order.add_sorted(new)
                model += new
            elif kind == "pending":  # as load_rows leaves them: unsorted runs
                for _ in range(rnd.randrange(1, 4)):
                    run = [next(free) for _ in range(rnd.choice([1, 40, 900]))]
                    order.pending.append(array("q", run))
                    order.size += len(run)
                    model = sorted(model + run)
                continue  # checked once flushed
            elif kind == "flush":
                got = order.flush()
                assert list(got) == sorted(got)
            elif kind == "one":
                if order.pending:
                    order.flush()
                value = next(free)
                order.add(value)
                model = sorted([*model, value])
            elif model:
                if order.pending:
                    order.flush()
                gone = sorted(set(rnd.sample(model, min(len(model), rnd.choice([1, 5, 200])))))
                order.remove_sorted(gone)
                dropped = set(gone)
                model = [v for v in model if v not in dropped]
            check(order, model, load)
        order.flush()
        check(order, model, load)


def test_a_flush_returns_the_values_it_merged_ascending():
    order = Order(4)
    order.add_sorted([10, 20, 30])
    order.pending += [array("q", [25, 5]), array("q", [40])]
    order.size += 3
    assert list(order.flush()) == [5, 25, 40]
    check(order, [5, 10, 20, 25, 30, 40], 4)
    assert list(order.flush()) == []


def test_blocks_without_a_share_stay_the_same_objects():
    """A merge rebuilds only the blocks it adds to: the others are left as
    they were (their arrays are not copied)."""
    order = Order.from_sorted(range(0, 4000, 2), 100)
    untouched = order.blocks[5:]
    order.add_sorted([1, 3, 151])
    assert all(a is b for a, b in zip(order.blocks[-len(untouched) :], untouched, strict=True))
    check(order, sorted([*range(0, 4000, 2), 1, 3, 151]), 100)


@pytest.mark.parametrize("seed", range(6))
def test_positions_in_c_count_what_the_python_counts(seed):
    """``Order.positions`` (the state document's windows and lateness bins)
    in C and in Python, against a count over a sorted list: bounds below,
    inside, between and past every block, and repeated."""
    rnd = Random(seed)
    load = rnd.choice([2, 8, 64])
    model = sorted(rnd.sample(range(0, 100_000), rnd.choice([0, 1, 30, 3000])))
    order = Order.from_sorted(model, load)
    if model:  # blocks of several sizes, as merges leave them
        order.add_sorted(sorted(set(rnd.sample(range(100_000, 120_000), 500))))
        model = list(order)
    bounds = sorted(rnd.choice([-5, 0, 50_000, 99_999, 100_000, 130_000, *model[:3]])
                    for _ in range(rnd.randrange(0, 40)))  # fmt: skip
    want = [sum(v < bound for v in model) for bound in bounds]
    assert order.positions(bounds) == want
    with patch.object(order_module, "_best", None):
        assert order.positions(bounds) == want


@pytest.mark.parametrize("seed", range(3))
def test_coming_and_lateness_count_each_row_once_over_many_classes(seed):
    """``Buckets.coming`` (windows summed over classes) and ``lateness``
    (bounds shared by the classes of one cadence), in C and in Python,
    against a count row by row; detached rows included."""
    from keeper.buckets import Buckets
    from keeper.classes import ClassTable
    from node.config import Config, RouteConfig

    rnd = Random(seed)
    now = 1_800_000_030.0
    routes = {f"r{i}": RouteConfig(cadence_s=rnd.choice([900, 3600, 86400])) for i in range(12)}
    buckets = Buckets(ClassTable(Config(routes=routes)), block_load=8)
    rows = {}
    for i in range(3000):
        route = rnd.choice(sorted(routes))
        cadence = rnd.choice([None, 600, 7200])
        due = now + rnd.uniform(-3 * 86400, 26 * 3600)
        buckets.apply(f"k{i}", i + 1, route, cadence, rnd.random() < 0.3, due)
        rows[f"k{i}"] = (int(due // 60), cadence or routes[route].cadence_s, route)
    buckets.detach_many(rnd.sample(sorted(rows), 400))
    edges = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
    first = int(now // 60) + 1
    hours = [0] * 24
    for minute, _cadence, _route in rows.values():
        if first <= minute < first + 24 * 60:
            hours[(minute - first) // 60] += 1
    soon = sum(first <= m < first + 15 for m, _c, _r in rows.values())
    bins: list[int] = [0] * len(edges)
    for minute, cadence, _route in rows.values():
        if minute <= int(now // 60):
            ratio = (now - minute * 60) / cadence
            bins[max(i for i, edge in enumerate(edges) if ratio >= edge)] += 1
    for c in (True, False):
        with patch.object(order_module, "_best", best if c else None):
            got = buckets.coming(now)
            assert got["by_hour"] == hours and got["15m"] == soon and got["24h"] == sum(hours)
            per_class = buckets.lateness(now, edges)
            assert [sum(col) for col in zip(*per_class.values(), strict=True)] == bins


@pytest.mark.parametrize("seed", range(4))
def test_a_load_in_c_leaves_what_the_python_load_leaves(seed):
    """``load_rows`` with ``_enter``'s loop in C (``keeper._best.enter_rows``)
    and in Python: the same key table, columns and orders, chunk after chunk
    (new keys, keys held already, new classes), and the same reads."""
    import keeper.buckets.buckets as buckets_impl
    from keeper.buckets import Buckets
    from keeper.classes import ClassTable
    from node.config import Config, RouteConfig

    rnd = Random(seed)
    config = Config(routes={"pages": RouteConfig(cadence_s=3600)})
    now = 1_800_000_000.0
    chunks = []
    for c in range(6):
        start = c * 700 - (300 if c == 3 else 0)  # chunk 3 walks keys held already
        rows = [
            (f"key-{i:06d}-{'é' if i % 7 == 0 else 'x'}", i + 1 + c * 10_000,
             rnd.choice(["pages", "feeds", f"r{c}"]), rnd.choice([None, 900, 86400]),
             rnd.random() < 0.3, now + rnd.uniform(-86400, 3600) + rnd.choice([0, 0.5]))
            for i in range(start, start + 700)
        ]  # fmt: skip
        chunks.append(rows)
    loaded = []
    for c_path in (True, False):
        with patch.object(buckets_impl, "_best", best if c_path else None):
            buckets = Buckets(ClassTable(config), block_load=16)
            buckets.reserve(3000)
            for rows in chunks:
                buckets.load_rows(rows)
            loaded.append(buckets)
    c_buckets, py_buckets = loaded
    for name in ("_table", "_keys", "_vers", "_mins", "_cids", "_det"):
        assert getattr(c_buckets, name) == getattr(py_buckets, name), name
    assert c_buckets.best(now, 10_000) == py_buckets.best(now, 10_000)
    assert c_buckets.counts(now) == py_buckets.counts(now)
    assert sorted(c_buckets.items()) == sorted(py_buckets.items())
