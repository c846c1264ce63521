"""The keeper's publish without a Python object a row (issue 16):
``Buckets.best_gathered`` (``keeper._best.pick``), ``ReadySet.publish_gathered``
(``shm._atomic.View.write_gathered``), ``Buckets.detach_gathered``, and the key
loop of ``detach_many``/``attach_many`` in C (``keeper._best.move_keys``).
Each C path is held to the Python it stands in for, and the ready set it
writes to the one ``best_columns`` and ``publish_columns`` write, byte for
byte."""

from __future__ import annotations

from array import array
from contextlib import ExitStack
from random import Random
from unittest.mock import patch

import pytest

import keeper.buckets.best as best_module
import keeper.buckets.buckets as buckets_impl
import keeper.buckets.detach as detach_module
import keeper.order as order_module
from keeper.buckets import Buckets
from keeper.buckets.best import _pick
from keeper.classes import ClassTable
from keeper.order import SLOT_BITS
from node.config import Config, RouteConfig
from shm.ready import FIRST_SLOT, SLOT_HEADER_SIZE, ReadySet

pytestmark = pytest.mark.timeout(120)

BASE = 1_700_000_000.0
ROUTES = ("pages", "feeds", "other")
CONFIG = Config(
    defaults=RouteConfig(cadence_s=86400, sitemap_boost=0.5),
    routes={
        "pages": RouteConfig(cadence_s=3600, sitemap_boost=0.5),
        "feeds": RouteConfig(cadence_s=900, sitemap_boost=2.0),
    },
)


def python_only() -> ExitStack:
    """The Python paths: no ``keeper._best``."""
    stack = ExitStack()
    stack.enter_context(patch.object(best_module, "_best", None))
    stack.enter_context(patch.object(detach_module, "_best", None))
    stack.enter_context(patch.object(order_module, "_best", None))
    stack.enter_context(patch.object(buckets_impl, "_best", None))
    return stack


def filled(seed: int, rows: int = 1500, long_keys: bool = False) -> Buckets:
    rnd = Random(seed)
    buckets = Buckets(ClassTable(CONFIG), block_load=8, remember_best=True)
    for i in range(rows):
        tail = ("é" if rnd.random() < 0.1 else "x") * (rnd.randrange(300, 700) if long_keys else 3)
        route, cadence = rnd.choice(ROUTES), rnd.choice([None, 60, 900])
        due = BASE - rnd.randrange(0, 40) * 600 + rnd.choice([0, 0, 3600])  # ties, and not due
        buckets.apply(f"row-{i}-{tail}", i + 1, route, cadence, rnd.random() < 0.3, due)
    return buckets


def slot_bytes(ready: ReadySet) -> bytes:
    """The last slot written: count, heap used, flags, entries and heap."""
    base = FIRST_SLOT + ready.last_slot * ready._stride
    mm = ready.segment.mm
    return bytes(mm[base + 4 : base + 8]) + bytes(
        mm[base + 32 : base + SLOT_HEADER_SIZE + ready._heap_at - SLOT_HEADER_SIZE
           + ready.heap_size]
    )  # fmt: skip


@pytest.fixture
def readies(node_name):
    made = []

    def make(capacity: int) -> ReadySet:
        name = f"{node_name}{len(made)}"
        ready = ReadySet.create(name, capacity)
        made.append((name, ready))
        return ready

    yield make
    for name, ready in made:
        ready.close()
        ReadySet.unlink(name)


@pytest.mark.parametrize("seed", range(6))
def test_the_c_pick_picks_what_the_python_picks_bit_for_bit(seed):
    best = pytest.importorskip("keeper._best")
    rnd = Random(seed)
    now = 1_800_000_000.0 + rnd.uniform(0, 60)
    values = array("q")
    starts, cids, rates = [], [], []
    for c in range(rnd.randrange(0, 25)):
        minute = int(now // 60) - rnd.randrange(0, 40_000)
        run = []
        for _ in range(rnd.choice([0, 1, 3, 50, 400])):
            minute += rnd.choice([0, 0, 1, 7])
            run.append(minute << SLOT_BITS | rnd.randrange(1 << 12))
        starts.append(len(values))
        cids.append(c * 3 + 1)
        rates.append((float(rnd.choice([900, 3600, 86400])), rnd.choice([0.0, 0.5, 1.0])))
        values += array("q", sorted(run))
    keys = [f"k{i}" for i in range(1 << 12)]
    for exclude in (None, set(rnd.sample(keys, 1500)), frozenset(keys[:10])):
        for k in (1, 7, 500, 10**6):
            want = _pick(values, starts, rates, cids, now, k, keys, exclude)
            got = best.pick(
                values, starts, [r[0] for r in rates], [r[1] for r in rates], cids, now, k,
                keys, exclude,
            )  # fmt: skip
            assert got[:3] == want[:3] and got[8] == want[8]  # n, kth, skipped; marks
            for c_col, py_col in zip(got[3:8], want[3:8], strict=True):
                assert bytes(c_col) == py_col.tobytes()  # the ranks' floats too
    with pytest.raises(ValueError):
        best.pick(values, [0], [0.0], [0.0], [1], now, 5, keys, None)


@pytest.mark.parametrize("runs", [1, 2, 3, 5, 8, 20, 33])
def test_the_c_merges_pick_what_the_python_picks_at_every_run_count(runs):
    """The merge's tournament over every shape of tree (a power of two runs
    or not), its heads interleaved and tied: runs of one cadence and boost
    whose minutes repeat, so most picks switch run and many ranks are equal
    (the earlier candidate first)."""
    best = pytest.importorskip("keeper._best")
    rnd = Random(runs)
    now = 1_800_000_000.0
    values = array("q")
    starts, cids, rates = [], [], []
    for c in range(runs):
        minute = int(now // 60) - 500
        run = []
        for _ in range(rnd.choice([1, 40, 200])):
            minute += rnd.choice([0, 1])
            run.append(minute << SLOT_BITS | rnd.randrange(1 << 12))
        starts.append(len(values))
        cids.append(c)
        rates.append((3600.0, 0.0) if c % 3 else (900.0, 0.5))
        values += array("q", sorted(run))
    keys = [f"k{i}" for i in range(1 << 12)]
    cadences, boosts = [r[0] for r in rates], [r[1] for r in rates]
    for exclude in (None, set(rnd.sample(keys, 2000))):
        for k in (1, 2, 99, len(values), 10**6):
            want = _pick(values, starts, rates, cids, now, k, keys, exclude)
            got = best.pick(values, starts, cadences, boosts, cids, now, k, keys, exclude)
            assert got[:3] == want[:3] and got[8] == want[8]
            for c_col, py_col in zip(got[3:8], want[3:8], strict=True):
                assert bytes(c_col) == py_col.tobytes()
        merged = best.merge(values, starts, cadences, boosts, cids, now, len(values))
        want = _pick(values, starts, rates, cids, now, len(values), keys, None)
        assert merged[0] == list(array("i", want[3].tobytes()))  # the same picks, in order


def test_the_c_merges_refuse_what_would_make_a_rank_not_finite():
    """A NaN or infinite now or boost, or a cadence under 1 s (a row not due
    yet would rank -inf), is refused: every rank is then finite, so a spent
    run (ranked -inf) never ties with or beats a live head (a NaN rank let
    one win and merge read past its values; a live head ranked -inf lost its
    place to a spent run). A cadence of 1 s with rows far from now is
    merged as the Python merges it."""
    best = pytest.importorskip("keeper._best")
    now = 1_800_000_000.0
    later = int(now // 60) + 5  # not due yet: (now - minute * 60) < 0
    values = array("q", [later << SLOT_BITS | i for i in range(12)])
    starts, cids, keys = [0, 1], [0, 1], [f"k{i}" for i in range(64)]
    for cadences, boosts, at in (
        ([60.0] * 2, [float("nan")] * 2, now),
        ([60.0] * 2, [0.0, float("-inf")], now),
        ([60.0] * 2, [0.0] * 2, float("nan")),
        ([60.0] * 2, [0.0] * 2, float("inf")),
        ([5e-324, 60.0], [0.0] * 2, now),
        ([float("nan"), 60.0], [0.0] * 2, now),
    ):
        with pytest.raises(ValueError):
            best.pick(values, starts, cadences, boosts, cids, at, 12, keys, None)
        with pytest.raises(ValueError):
            best.merge(values, starts, cadences, boosts, cids, at, 12)
    far = array("q", [(1 << 31) - 1 - i << SLOT_BITS | i for i in range(6)][::-1])
    far += array("q", [-(1 << 31) + i << SLOT_BITS | 6 + i for i in range(6)])
    rates = [(1.0, 0.0), (1.0, 1000.0)]
    want = _pick(far, [0, 6], rates, cids, now, 12, keys, None)
    got = best.pick(far, [0, 6], [1.0, 1.0], [0.0, 1000.0], cids, now, 12, keys, None)
    assert got[0] == want[0] == 12 and bytes(got[3]) == want[3].tobytes()
    assert bytes(got[7]) == want[7].tobytes()  # the ranks: finite, the same floats
    merged = best.merge(far, [0, 6], [1.0, 1.0], [0.0, 1000.0], cids, now, 12)
    assert merged[0] == list(array("i", want[3].tobytes()))


@pytest.mark.parametrize(
    ("cadences", "boosts", "now"),
    [
        ([60.0] * 2, [float("nan")] * 2, 1_800_000_000.0),
        ([60.0] * 2, [0.0, float("-inf")], 1_800_000_000.0),
        ([60.0] * 2, [0.0] * 2, float("nan")),
        ([60.0] * 2, [0.0] * 2, float("inf")),
        ([5e-324, 60.0], [0.0] * 2, 1_800_000_000.0),
        ([float("nan"), 60.0], [0.0] * 2, 1_800_000_000.0),
    ],
)
def test_the_python_merge_refuses_what_the_c_merges_refuse(cadences, boosts, now):
    """The merge a build without keeper._best ranks with refuses the same (no
    C module needed: that build is the one that runs it)."""
    later = int(now // 60) + 5 if now == now and abs(now) != float("inf") else 0
    values = array("q", [later << SLOT_BITS | i for i in range(12)])
    rates = list(zip(cadences, boosts, strict=True))
    with pytest.raises(ValueError):
        _pick(values, [0, 1], rates, [0, 1], now, 12, [f"k{i}" for i in range(12)], None)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("python", [False, True])
def test_gathered_sets_are_the_columns_sets_byte_for_byte(readies, seed, python):
    """best_gathered written by publish_gathered gives the slot best_columns
    written by publish_columns gives: every byte, also with an exclude set,
    a paused route, keys not ASCII and a heap that fills part-way."""
    long_keys = seed % 2 == 1
    buckets = filled(seed, rows=900 if long_keys else 1500, long_keys=long_keys)
    rnd = Random(seed)
    excl = {key for key in buckets._keys if key is not None and rnd.random() < 0.2}
    capacity = 700
    with python_only() if python else ExitStack():
        for k, paused, exclude in ((700, (), None), (650, {"feeds"}, excl), (0, (), None)):
            gathered, columns = readies(capacity), readies(capacity)
            picked = buckets.best_gathered(BASE, k, paused, exclude)
            keys = picked.keys_written(gathered.publish_gathered(*picked[:7], BASE))
            cols = buckets.best_columns(BASE, k, paused, exclude)
            assert columns.publish_columns(*cols, BASE) == len(keys)
            assert keys == cols[0][: len(keys)]
            assert slot_bytes(gathered) == slot_bytes(columns)
            if long_keys and k:
                assert len(keys) < k  # the heap filled
            assert list(picked.columns()[4]) == [e[4] for e in buckets.best(BASE, k, paused,
                                                                             exclude)]


def test_an_entry_that_does_not_fit_is_refused_and_the_last_set_stays(readies):
    ready = readies(10)
    versions = array("q", [1, -1, 2])
    ranks = array("d", [1.0])
    ready.publish_gathered(["a", "b", "c"], versions, array("i", [0]), array("i", [5]),
                           array("i", [1]), ranks, 1, 1.0)  # fmt: skip
    for slots, cids, error in (
        ([1], [1], ValueError),  # a negative version: u64
        ([2], [70_000], ValueError),  # class_id is u16
        ([3], [1], IndexError),  # no slot 3
        ([-1], [1], IndexError),
    ):
        with pytest.raises(error):
            ready.publish_gathered(["a", "b", "c"], versions, array("i", slots), array("i", [5]),
                                   array("i", cids), ranks, 1, 2.0)  # fmt: skip
        snap = ready.snapshot()
        assert snap.generation == 1 and [e.key for e in snap.entries] == ["a"]
    with pytest.raises(TypeError):  # a freed slot's key
        ready.publish_gathered([None], versions, array("i", [0]), array("i", [5]),
                               array("i", [1]), ranks, 1, 2.0)  # fmt: skip
    with pytest.raises(ValueError):  # a column shorter than n
        ready.publish_gathered(["a"], versions, array("i", [0]), array("i", []),
                               array("i", [1]), ranks, 1, 2.0)  # fmt: skip
    assert ready.publish_gathered(["z"], versions, array("i", [0]), array("i", [5]),
                                  array("i", [1]), ranks, 1, 3.0) == 1  # fmt: skip
    assert [tuple(e) for e in ready.snapshot().entries] == [("z", 1, 5, 1, 1.0)]


@pytest.mark.parametrize("python", [False, True])
def test_detach_gathered_detaches_the_rows_written_and_no_others(python):
    with python_only() if python else ExitStack():
        buckets = filled(3)
        picked = buckets.best_gathered(BASE, 400)
        keys = picked.columns()[0]
        buckets.detach_gathered(picked, 250)  # the heap took 250
        assert buckets.detached == 250
        assert all(buckets.is_detached(key) for key in keys[:250])
        assert not any(buckets.is_detached(key) for key in keys[250:])
        after = [e[0] for e in buckets.best(BASE, 150)]
        assert after == keys[250:] or set(after) == set(keys[250:])  # ties in any order
        assert buckets.attach_many(keys[:250]) == 250
        assert [e[4] for e in buckets.best(BASE, 400)] == list(picked.columns()[4])


@pytest.mark.parametrize("seed", range(4))
def test_the_c_key_loop_moves_what_the_python_loop_moves(seed):
    pytest.importorskip("keeper._best")
    rnd = Random(seed)
    twins = [filled(seed), filled(seed)]
    keys = [key for key in twins[0]._keys if key is not None]
    for step in range(30):
        some = rnd.sample(keys, rnd.randrange(0, 300)) + ["absent", keys[0]]
        some = [key.encode().decode() for key in some]  # equal strs, not the table's
        detach = rnd.random() < 0.6
        answers = []
        for python, buckets in zip((False, True), twins, strict=True):
            with python_only() if python else ExitStack():
                if step % 5 == 0:  # the remembered candidates take the others' place
                    buckets.best_columns(BASE, 200)
                move = buckets.detach_many if detach else buckets.attach_many
                answers.append(move(iter(some)))
        assert answers[0] == answers[1]
        assert twins[0]._det == twins[1]._det
        for cid, order in twins[0]._order.items():
            assert list(order) == list(twins[1]._order[cid])
            assert twins[0]._due[cid] == twins[1]._due[cid]
        for cid, order in twins[0]._order_detached.items():
            assert list(order) == list(twins[1]._order_detached[cid])
