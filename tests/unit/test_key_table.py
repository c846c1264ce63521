"""The key table under the keeper's buckets (keeper/buckets/table.py) while it
grows incrementally: the old table drained a bounded number of cells a call,
lookups consulting both meanwhile. Growth is made incremental from the
smallest table (``GROW_AT_ONCE = 0``) and the drain slow (a cell or a few a
call), so that lookups, updates, deletes, detaches and loads meet a growth in
progress often, and growths start before the last one ended."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from random import Random

import pytest
import test_buckets as tb
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from keeper.buckets import Buckets
from keeper.buckets.table import KeyTable
from keeper.classes import ClassTable

CONFIG = tb.CONFIG
BASE = tb.BASE
M0 = int(BASE // 60)


@contextmanager
def incremental(step: int = 1, per_row: int = 1) -> Iterator[None]:
    """Every growth incremental, draining ``step`` cells an insert and
    ``per_row`` a loaded row (0: none, so a growth lasts until the next one
    begins, which first drains the rest)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KeyTable, "GROW_AT_ONCE", 0)
        mp.setattr(KeyTable, "DRAIN_STEP", step)
        mp.setattr(KeyTable, "DRAIN_PER_ROW", per_row)
        yield


def check_table(buckets: Buckets) -> None:
    """Every live slot is in exactly one of the table and the old table, found
    from its key's home cell in it, and no freed slot is in either."""
    keys = buckets._keys
    seen: list[int] = []
    for table in (buckets._table, buckets._old):
        if table is None:
            continue
        mask = len(table) - 1
        for cell, slot in enumerate(table):
            if slot < 0:
                continue
            key = keys[slot]
            assert key is not None, "a freed slot is still in the key table"
            i = hash(key) & mask
            while i != cell:  # the probe path from its home is unbroken
                assert table[i] >= 0 and keys[table[i]] != key
                i = (i + 1) & mask
            seen.append(slot)
    live = [slot for slot, key in enumerate(keys) if key is not None]
    assert sorted(seen) == live
    assert len(live) == len(buckets)
    assert len(buckets) * 3 <= len(buckets._table) * 2


# Classes a row may take: (route, cadence_s); new ones come all along.
CLASSES = [(route, cadence) for route in tb.ROUTES for cadence in (None, 60, 3600, 7200)]


def row(key: str, version: int, minute: int, cls: int = 0) -> tuple:
    route, cadence_s = CLASSES[cls]
    return key, version, route, cadence_s, False, BASE + 60 * minute


# -- against a dict -------------------------------------------------------------------


def op_stream(rnd: Random, n: int, keyspace: int, weights: list[int]) -> Iterator[tuple]:
    """``n`` random operations on keys ``k0`` .. ``k<keyspace>``."""
    kinds = ["apply", "remove", "get", "detach", "attach", "load"]
    classes = rnd.randint(1, len(CLASSES))  # the more, the later some first come

    def cls() -> int:
        return min(int(rnd.expovariate(1.0) * 2), classes - 1)

    for kind in rnd.choices(kinds, weights, k=n):
        if kind == "apply":
            yield kind, rnd.randrange(keyspace), rnd.randint(1, 30), rnd.randint(-5, 5), cls()
        elif kind == "remove":
            yield kind, rnd.randrange(keyspace), rnd.choice([None, rnd.randint(1, 30)])
        elif kind == "get":
            yield kind, rnd.randrange(keyspace)
        elif kind in ("detach", "attach"):
            yield kind, [rnd.randrange(keyspace) for _ in range(rnd.randrange(9))]
        else:
            chunk = rnd.randrange(1, 80)
            yield (
                kind,
                [
                    (rnd.randrange(keyspace), rnd.randint(1, 30), rnd.randint(-5, 5), cls())
                    for _ in range(chunk)
                ],
            )


def run_op(
    buckets: Buckets, model: dict[str, tuple[int, int]], detached: set[str], op: tuple
) -> None:
    """One operation on the buckets and on the dict ``model`` (key ->
    (version, minute)) and ``detached``, checking what the buckets answer."""
    if op[0] == "apply":
        _, k, version, minute, c = op
        key = f"k{k}"
        want = key not in model or model[key][0] < version
        assert buckets.apply(*row(key, version, minute, c)) is want
        if want:
            model[key] = (version, M0 + minute)
    elif op[0] == "remove":
        _, k, version = op
        key = f"k{k}"
        want = key in model and (version is None or model[key][0] <= version)
        assert buckets.remove(key, version) is want
        if want:
            del model[key]
            detached.discard(key)
    elif op[0] == "get":
        key = f"k{op[1]}"
        held = model.get(key)
        got = buckets.get(key)
        assert (None if got is None else (got[2], got[0])) == held
        assert (key in buckets) is (held is not None)
    elif op[0] == "detach":
        keys = {f"k{k}" for k in op[1]}
        assert buckets.detach_many(keys) == len(keys & model.keys() - detached)
        detached |= keys & model.keys()
    elif op[0] == "attach":
        keys = {f"k{k}" for k in op[1]}
        assert buckets.attach_many(keys) == len(keys & detached)
        detached -= keys
    else:
        chunk = {f"k{k}": (version, minute, c) for k, version, minute, c in op[1]}
        rows = [row(key, v, m, c) for key, (v, m, c) in sorted(chunk.items())]
        applied = 0
        for key, (version, minute, _c) in chunk.items():
            if key not in model or model[key][0] < version:
                model[key] = (version, M0 + minute)
                applied += 1
        assert buckets.load_rows(rows) == (applied, 0)


@given(
    seed=st.integers(0, 2**32),
    keyspace=st.sampled_from([40, 300, 2000]),
    weights=st.lists(st.integers(0, 10), min_size=6, max_size=6).filter(lambda w: w[0] + w[5]),
    step=st.integers(0, 4),
    per_row=st.integers(0, 2),
    capacity=st.integers(0, 40),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_table_equals_a_dict_across_growths(seed, keyspace, weights, step, per_row, capacity):
    ops = op_stream(Random(seed), 1500, keyspace, weights)
    checks = Random(seed + 1)
    with incremental(step, per_row):
        buckets = Buckets(ClassTable(CONFIG), capacity=capacity, block_load=4)
        model: dict[str, tuple[int, int]] = {}  # key -> (version, minute)
        detached: set[str] = set()
        during = 0
        for op in ops:
            during += buckets._old is not None
            run_op(buckets, model, detached, op)
            if checks.random() < (0.2 if buckets._old is not None else 0.02):
                check_table(buckets)
        target(float(during), label="operations during a growth")
        check_table(buckets)
        assert {k: (v, m) for k, m, _c, v in buckets.items()} == model
        flagged = {key for slot, key in enumerate(buckets._keys) if key and buckets._det[slot]}
        assert flagged == detached and buckets.detached == len(detached)
        tb.check_orders(buckets)


@pytest.mark.parametrize(
    "test",
    [
        tb.test_buckets_equal_a_brute_force_model,
        tb.test_load_rows_equal_a_brute_force_model,
        tb.test_detached_rows_are_counted_but_never_best,
        tb.test_best_is_the_brute_force_top_k,
    ],
    ids=lambda test: test.__name__,
)
def test_the_buckets_model_tests_hold_while_the_table_grows(test):
    with incremental():
        test()


# -- growth is incremental --------------------------------------------------------------


def test_lookups_during_a_growth_find_rows_in_either_table():
    with incremental(step=4):
        buckets = Buckets(ClassTable(CONFIG))
        n = 0
        while buckets._old is None or n < 3000:
            assert buckets.apply(*row(f"k{n}", 1, n % 50))
            n += 1
        assert buckets._old is not None, "a growth is in progress"
        assert any(slot >= 0 for slot in buckets._old)
        for i in range(n):
            assert buckets.get(f"k{i}") == (M0 + i % 50, 0, 1)
        check_table(buckets)
        # An update and a delete of rows still in the old table.
        more = Buckets(ClassTable(CONFIG))
        for i in range(n):
            more.apply(*row(f"k{i}", 1, i % 50))
        assert more._old is not None
        old_rows = [more._keys[slot] for slot in more._old if slot >= 0]
        assert more.apply(*row(old_rows[0], 2, 7)) and more.get(old_rows[0]) == (M0 + 7, 0, 2)
        assert more.remove(old_rows[1]) and old_rows[1] not in more
        assert more.detach_many(old_rows[2:5]) == 3
        check_table(more)


def test_a_growth_moves_a_bounded_share_a_call():
    """No insert or load chunk moves more than its step (and the rest of the
    cluster reached) from the old table; every growth of a table holding more
    than ``GROW_AT_ONCE`` rows goes incrementally, and ends before the next."""
    step, per_row = 16, 2
    with incremental(step, per_row):
        buckets = Buckets(ClassTable(CONFIG))
        growths = []
        real = KeyTable._rehash

        def spy(self: KeyTable, cells: int) -> None:
            assert self._old is None, "a growth began before the last one ended"
            real(self, cells)
            assert self._old is not None or not len(self), "the whole table rehashed at once"
            growths.append(cells)

        def moved(call, *args) -> int:
            """Cells of the old table the call went through, unless it grew."""
            if buckets._old is None:
                call(*args)
                return 0
            old, before, cells = len(buckets._old), buckets._drained, len(buckets._table)
            call(*args)
            if len(buckets._table) != cells:
                return 0
            return (old if buckets._old is None else buckets._drained) - before

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(KeyTable, "_rehash", spy)
            longest = max(moved(buckets.apply, *row(f"k{i:06d}", 1, i % 90)) for i in range(40_000))
            # A cluster at 2/3 full runs to some tens of cells at most here.
            assert step <= longest < step + 200
            assert len(growths) >= 10
            walked = [row(f"w{i:06d}", 1, i % 90) for i in range(60_000)]
            for start in range(0, len(walked), 5000):
                chunk = walked[start : start + 5000]
                assert moved(buckets.load_rows, chunk) < per_row * len(chunk) + 200
            assert len(growths) >= 12
        check_table(buckets)
        assert len(buckets) == 100_000
