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
