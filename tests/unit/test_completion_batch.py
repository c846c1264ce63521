"""The completion path a group at a time (issue 16): each batch call answers
as the per-item calls it replaces, on the same state.

``PendingIndex.add_many`` / ``remove_many`` against ``add`` / ``remove``,
``encode_result_records`` against ``encode_result_record``, ``make_result``
against ``Result``, ``Delivery.add_many`` and the offers appended in order
against ``add`` and the heap, ``RepeatIndex.find_many`` / ``add_many``
against ``find`` / ``add``, and the SQLite write-back's versions when every
row took against the rows read back.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.completion.base import Result, make_result
from node.completion.pending import LOC_OFFSET_BITS, PendingIndex
from node.completion.segments.format import encode_result_record, encode_result_records
from workers.ledger.delivery import Delivery, RepeatIndex

T0 = 1_800_000_000.0


def _state(p: PendingIndex) -> tuple:
    every = p.entries()
    per_job = {job: p.entries(job) for job in sorted(p.queues)}
    return len(p), every, per_job, p.last_id


def _loc(rid: int) -> int:
    return ((1 + rid // 50) << LOC_OFFSET_BITS) | (32 + rid)


@settings(max_examples=200, deadline=None)
@given(
    jobs=st.lists(st.sampled_from("abc"), min_size=1, max_size=120),
    acks=st.lists(st.tuples(st.integers(0, 130), st.integers(1, 40), st.booleans()), max_size=12),
    group=st.integers(1, 30),
)
def test_pending_index_batches_answer_as_one_by_one(jobs, acks, group):
    """Results added a group at a time and retired in runs (from the head, in
    order, as acks come; or anywhere, shuffled, repeated, unknown ids): the
    same locs back, the same entries left, as add and remove one by one."""
    one, many = PendingIndex(), PendingIndex()
    rids = list(range(1, len(jobs) + 1))
    for rid, job in zip(rids, jobs, strict=True):
        one.add(rid, job, f"k{rid}", T0 + rid, _loc(rid))
    for i in range(0, len(rids), group):
        part = rids[i : i + group]
        many.add_many(
            part,
            [jobs[r - 1] for r in part],
            [f"k{r}" for r in part],
            [T0 + r for r in part],
            [_loc(r) for r in part],
        )
    assert _state(one) == _state(many)
    rng = random.Random(len(jobs) * 7919 + group)
    for start, n, shuffled in acks:
        if shuffled:
            ids = [rng.randrange(0, len(jobs) + 5) for _ in range(n)]
        else:  # the head run of one job, as an ack of its oldest offers
            job = jobs[start % len(jobs)]
            ids = [e.id for e in many.entries(job, n)]
        assert many.remove_many(ids) == [one.remove(r) for r in ids]
        assert _state(one) == _state(many)
        assert all(many.get(r) == one.get(r) for r in rids)


def test_remove_many_cuts_a_long_head_run_and_keeps_the_rest():
    """Past the rebuild threshold (4,096 dead at the head): the arrays are
    cut, the survivors kept in order, both queues and the global order."""
    p = PendingIndex()
    n = 10_000
    p.add_many(list(range(1, n + 1)), ["j"] * n, [f"k{i}" for i in range(n)],
               [T0] * n, [_loc(i) for i in range(1, n + 1)])  # fmt: skip
    p.add(n + 1, "other", "x", T0, _loc(n + 1))
    assert p.remove_many(list(range(1, 6001))) == [_loc(i) for i in range(1, 6001)]
    assert len(p) == n - 6000 + 1
    assert [e.id for e in p.entries("j", 3)] == [6001, 6002, 6003]
    assert [e.id for e in p.entries()][-2:] == [n, n + 1]
    assert p.get(6000) is None and p.get(6001).key == "k6000"  # type: ignore[union-attr]


def test_add_many_refuses_ids_not_above_the_last():
    p = PendingIndex()
    p.add(5, "j", "k", T0, _loc(5))
    with pytest.raises(ValueError, match="not above 5"):
        p.add_many([5, 6], ["j", "j"], ["a", "b"], [T0, T0], [_loc(5), _loc(6)])


def _results(n: int, **odd: object) -> list[tuple[int, Result]]:
    """Keys and ints across msgpack's sizes (fixstr to str 16, fixint to
    uint 64), floats and ints for the times, both encodings, empty data."""
    big = [0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**64 - 1]
    out = []
    for i in range(1, n + 1):
        fields = {
            "key": "k\u00e9y-" * (i * 7 % 140),
            "job": "j" * (i % 40 + 1),
            "lease_id": big[i % len(big)] or 1,
            "version": big[(i + 3) % len(big)],
            "finished_at": T0 + i / 7 if i % 5 else int(T0) + i,
            "cadence_s": 3600.0 if i % 3 else 60,
            "data": bytes([i % 256]) * (i * 37 % 300),
            "encoding": ("json", "bytes")[i % 2],
        }
        fields.update(odd if i == n // 2 else {})
        out.append((big[i % len(big)] or i, Result(**fields)))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("odd", [{}, {"lease_id": "str-lease"}, {"version": -3},
                                 {"lease_id": True}, {"key": "k" * 70_000}])  # fmt: skip
def test_a_groups_records_are_the_records_one_by_one(odd):
    """In C (one piece) for the usual shapes; a group with an odd one (a str
    lease id, a negative or bool int, a key past str 16) in Python: the
    same bytes as ``encode_result_record`` either way."""
    from node.completion.segments import format as fmt

    results = _results(40, **odd)
    one_by_one = [encode_result_record(rid, r) for rid, r in results]
    for c_side in (fmt._encode_in_c, None):
        fmt_c, fmt._encode_in_c = fmt._encode_in_c, c_side
        try:
            parts, sizes = encode_result_records(results)
        finally:
            fmt._encode_in_c = fmt_c
        assert b"".join(parts) == b"".join(one_by_one)
        assert sizes == [len(f) for f in one_by_one]
    assert encode_result_records([]) == ([], [])


def test_the_c_encoder_is_built_and_takes_the_usual_group():
    from node.completion.segments import format as fmt

    assert fmt._encode_in_c is not None, "setup.py build_ext --inplace: _records is not built"
    assert fmt._encode_in_c(_results(10)) is not None
    assert fmt._encode_in_c(_results(10, lease_id="s")) is None


def test_make_result_is_the_same_value_as_result():
    args = ("k", "j", 7, 3, T0, 60.0, b"data", "json")
    made, built = make_result(*args), Result(*args)
    assert made == built and hash(made) == hash(built) and made.id == 0
    assert make_result(*args, 9) == Result(*args, 9)
    with pytest.raises(AttributeError):
        made.key = "other"  # type: ignore[misc]


@settings(max_examples=100, deadline=None)
@given(
    groups=st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 20)), min_size=1, max_size=8),
    polls=st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 15), st.integers(0, 3)),
                   max_size=12),
)  # fmt: skip
def test_delivery_add_many_and_offers_in_order_answer_as_add_and_the_heap(groups, polls):
    """Groups added at once, then polls at times that step on (the offers'
    deadlines appended to the heap) or repeat (pushed): the same offers, in
    the same order, as ids added one by one into a delivery that pushes."""
    one, many = Delivery(30.0), Delivery(30.0)
    rid = 0
    for job, n in groups:
        ids = list(range(rid + 1, rid + n + 1))
        rid += n
        for r in ids:
            one.add(r, job)
        many.add_many(ids, job)
    many.add_many([1, 2], "a")  # ids it holds already: nothing changes
    for r in (1, 2):
        one.add(r, "a")
    now = T0
    for job, n, step in polls:
        now += 20.0 * step  # 0: the same deadline again; 2 or more: offers came due again
        assert many.poll(job, n, now) == one.poll(job, n, now)
        assert many.poll(None, n, now) == one.poll(None, n, now)
        assert (many.pending(), many.offered()) == (one.pending(), one.offered())


def test_repeat_index_batches_answer_as_one_by_one():
    one, many = RepeatIndex(60.0), RepeatIndex(60.0)
    leases, keys, rids = [11, 12, 13], ["a", "b", "c"], [1, 2, 3]
    for lease_id, key, rid in zip(leases, keys, rids, strict=True):
        one.add(lease_id, key, rid)
    many.add_many(leases, keys, rids)
    many.add_many([14], ["d"], [2])  # out of order: placed as add places it
    one.add(14, "d", 2)
    asked = ([11, 12, 14, 99, 13], ["a", "x", "d", "a", "c"])
    assert many.find_many(*asked) == [one.find(*p) for p in zip(*asked, strict=True)]
    assert many.find_many([98, 99], ["a", "b"]) is None  # none here: the fresh case
    assert len(many) == len(one)


def test_write_back_versions_when_every_row_took_are_the_rows_versions(tmp_path):
    """The fast path reads no change log: each item's version is the seq its
    trigger logged, in order. Read back, the rows hold those versions; a
    group with a stale item goes the slow way and says None for it."""
    from node.core.rows import RowWrite
    from node.store import WriteBack, open_store

    store = open_store(f"sqlite:///{tmp_path}/s.db", durable=False, autocheckpoint=False)
    try:
        keys = [f"k{i}" for i in range(20)]
        store.upsert([RowWrite(k, "r", cadence_s=60, due_at=T0, job="j") for k in keys], now=T0)
        versions = {k: r.version for k, r in store.get_many(keys).items()}
        group = [WriteBack(k, T0 + 60 + i, versions[k], i + 1, T0) for i, k in enumerate(keys)]
        got = store.write_back_many(group)
        rows = store.get_many(keys)
        assert got == [rows[k].version for k in keys]
        assert len(set(got)) == len(got)
        assert all(v > versions[k] for k, v in zip(keys, got, strict=True))
        assert [rows[k].due_at for k in keys] == [T0 + 60 + i for i in range(20)]
        stale = [WriteBack(keys[0], T0 + 999, versions[keys[0]], 99, T0),
                 WriteBack(keys[1], T0 + 999, got[1], 98, T0)]  # fmt: skip
        again = store.write_back_many(stale)
        assert again[0] is None and again[1] == store.get(keys[1]).version  # type: ignore[union-attr]
    finally:
        store.close()


class _RepeatModel:
    """The repeat index's rules, plainly: a lease answers with its latest
    result while that result is held; a result is held until ``window_s``
    after its retirement, retirements taken in the order they came."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.held: dict[int, tuple[int, str]] = {}  # rid -> (lease id, key)
        self.rid_of: dict[int, int] = {}
        self.queue: list[tuple[float, int]] = []

    def add(self, lease_id: int, key: str, rid: int) -> None:
        if rid in self.held:
            return
        self.held[rid] = (lease_id, key)
        self.rid_of[lease_id] = rid

    def retire(self, rids: list[int], now: float) -> None:
        self.queue += [(now + self.window_s, rid) for rid in rids]

    def expire(self, now: float) -> int:
        dropped = 0
        while self.queue and self.queue[0][0] <= now:
            _, rid = self.queue.pop(0)
            if rid in self.held:
                lease_id, _ = self.held.pop(rid)
                if self.rid_of.get(lease_id) == rid:
                    del self.rid_of[lease_id]
                dropped += 1
        return dropped

    def find(self, lease_id: int, key: str) -> int:
        rid = self.rid_of.get(lease_id)
        return rid if rid is not None and self.held.get(rid, (0, ""))[1] == key else 0


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 150),
    same_lease=st.sets(st.integers(2, 150), max_size=10),
    steps=st.lists(st.tuples(st.integers(1, 60), st.integers(-5, 30), st.booleans()),
                   min_size=1, max_size=12),
)  # fmt: skip
def test_repeat_index_expiry_a_run_at_a_time_answers_as_its_rules(n, same_lease, steps):
    """Results retired in runs, mostly in the order they were added (the
    head of the index: cut in C), sometimes shuffled, a lease with two
    results, the clock stepping back: the same answers and counts as the
    rules say, after each expiry."""
    index, model = RepeatIndex(10.0), _RepeatModel(10.0)
    lease_of = {rid: (rid - 1 if rid in same_lease else rid) + 1000 for rid in range(1, n + 1)}
    for rid in range(1, n + 1):
        index.add(lease_of[rid], f"k{rid}", rid)
        model.add(lease_of[rid], f"k{rid}", rid)
    now, nxt = T0, 1
    rng = random.Random(n)
    for count, dt, shuffled in steps:
        run = list(range(nxt, min(n, nxt + count - 1) + 1))
        nxt += len(run)
        if shuffled:
            rng.shuffle(run)
        index.retire(run, now)
        model.retire(run, now)
        now += dt
        assert index.expire(now) == model.expire(now)
        assert len(index) == len(model.held)
        assert len(index._rid_of) == len(model.rid_of)  # nothing left behind (memory)
        for rid in range(1, n + 1):
            assert index.find(lease_of[rid], f"k{rid}") == model.find(lease_of[rid], f"k{rid}")
