"""Job ready queues (workers/ledger/delivery.py): offers, re-offers, acks, fairness, cost.

Time is passed in: no test sleeps. Cost is asserted on ``touched`` (entries a
call examined), never on wall time.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from workers.ledger.delivery import Delivery, NeverOffered

T0 = 1_800_000_000.0


def filled(jobs: dict[str, range], timeout_s: float = 30.0) -> Delivery:
    d = Delivery(timeout_s)
    for job, ids in jobs.items():
        for rid in ids:
            d.add(rid, job)
    return d


def test_offers_in_id_order_and_moves_them_to_offered():
    d = filled({"a": range(1, 11)})
    assert d.poll("a", 4, T0) == [1, 2, 3, 4]
    assert d.poll("a", 4, T0) == [5, 6, 7, 8]
    assert (d.pending("a"), d.offered("a")) == (10, 8)
    assert d.poll("b", 4, T0) == []
    assert d.poll("a", 0, T0) == []


def test_an_offer_not_acked_in_time_is_offered_again_ahead_of_newer_results():
    d = filled({"a": range(1, 6)})
    assert d.poll("a", 2, T0) == [1, 2]
    assert d.poll("a", 1, T0 + 29.9) == [3]
    assert d.next_deadline("a") == T0 + 30
    d.add(6, "a")
    # 1 and 2 came due at T0 + 30; 3 not yet: they go first, then ready ids.
    assert d.poll("a", 4, T0 + 30) == [1, 2, 4, 5]
    assert d.poll("a", 10, T0 + 59.95) == [3, 6]
    assert d.poll("a", 10, T0 + 59.95) == []
    assert d.offered("a") == 6


def test_acks_retire_offers_and_repeat_acks_count_nothing():
    d = filled({"a": range(1, 6)})
    assert d.poll("a", 3, T0) == [1, 2, 3]
    assert d.ack("a", [1, 2], T0) == 2
    assert d.ack("a", [1, 2], T0) == 0  # idempotent
    assert d.ack("a", [3, 3], T0) == 1  # a duplicate id in one ack counts once
    assert (d.pending("a"), d.offered("a")) == (2, 0)
    # An acked offer is never offered again, even after its deadline.
    assert d.poll("a", 10, T0 + 100) == [4, 5]


def test_an_ack_naming_a_never_offered_id_is_refused_whole():
    d = filled({"a": range(1, 6), "b": range(6, 8)})
    assert d.poll("a", 2, T0) == [1, 2]
    assert d.poll("b", 1, T0) == [6]
    for bad in ([1, 3], [1, 6], [1, 99]):  # ready, another job's offer, never held
        with pytest.raises(NeverOffered) as exc:
            d.ack("a", bad, T0)
        assert exc.value.ids == [bad[1]]
        assert d.offered("a") == 2  # nothing in that ack was retired
    # Every id never offered is named, those pending for another job first.
    with pytest.raises(NeverOffered) as exc:
        d.retire("a", [99, 1, 3, 6], T0, owner=lambda rid: "b" if rid == 6 else None)
    assert exc.value.ids == [6, 99, 3]
    assert str(exc.value) == "job 'a': ids never offered: 6, 99, 3"
    assert d.offered("a") == 2
    assert d.ack("a", [1], T0) == 1
    with pytest.raises(NeverOffered):
        d.ack("zzz", [6], T0)


def test_recovered_ids_may_be_acked_before_this_process_offered_them():
    """After a restart every pending result is ready again; a consumer that
    polled it from the previous ledger process may ack it straight away."""
    d = filled({"a": range(1, 6)})
    d.assume_offered_through(5)
    assert d.ack("a", [2, 4], T0) == 2
    assert d.ack("a", [2, 4], T0) == 0  # retired: idempotent, not refused
    with pytest.raises(NeverOffered):
        d.ack("a", [4_000], T0)  # above every id ever held
    assert d.poll("a", 10, T0) == [1, 3, 5]
    d.add(6, "a")
    with pytest.raises(NeverOffered):
        d.ack("a", [6], T0)


def test_polls_across_jobs_are_fair_and_rotate():
    d = filled({"a": range(1, 101), "b": range(101, 201), "c": range(201, 301)})
    got = d.poll(None, 30, T0)
    assert sorted(got) == list(range(1, 11)) + list(range(101, 111)) + list(range(201, 211))
    # One at a time, each job takes its turn.
    singles = [d.poll(None, 1, T0)[0] for _ in range(6)]
    assert [(rid - 1) // 100 for rid in singles] == [0, 1, 2, 0, 1, 2]
    # A job with nothing ready does not stall the others.
    d2 = filled({"a": range(1, 3), "b": range(3, 100)})
    assert sorted(d2.poll(None, 10, T0)) == [1, 2, *range(3, 11)]


def test_polls_across_jobs_re_offer_due_offers_first():
    d = filled({"a": range(1, 4), "b": range(4, 7)})
    assert d.poll("a", 1, T0) == [1]
    assert d.poll(None, 1, T0 + 10) in ([2], [4])
    assert d.next_deadline(None) == T0 + 30
    got = d.poll(None, 2, T0 + 31)
    assert got[0] == 1
    assert len(got) == 2


def test_remove_drops_ready_and_offered_ids():
    d = filled({"a": range(1, 6), "b": range(6, 9)})
    assert d.poll("a", 2, T0) == [1, 2]
    assert d.remove([1, 3, 7, 42]) == 3
    assert d.remove([5], job="a") == 1
    assert (d.pending("a"), d.offered("a"), d.pending("b")) == (2, 1, 2)
    assert d.poll("a", 10, T0 + 31) == [2, 4]
    assert d.poll("b", 10, T0) == [6, 8]
    assert d.ack("a", [2, 4], T0 + 31) == 2
    assert d.jobs() == ["b"]


def test_offers_not_sent_go_back_to_the_front():
    d = filled({"a": range(1, 6)})
    taken = d.poll("a", 4, T0)
    d.return_offers(taken[2:], T0)
    assert d.poll("a", 3, T0) == [3, 4, 5]
    assert d.offered("a") == 5


def test_out_of_order_and_repeated_adds():
    d = filled({"a": [5, 7]})
    d.add(6, "a")
    d.add(7, "a")
    assert d.poll("a", 10, T0) == [5, 6, 7]
    d.add(6, "a")  # already offered: nothing changes
    assert d.pending("a") == 3


def test_waiters_are_set_by_an_add_for_their_job_or_any_job():
    async def body():
        d = Delivery(30)
        with d.waiting("a") as for_a, d.waiting("b") as for_b, d.waiting(None) as for_any:
            d.add(1, "a")
            assert for_a.is_set() and for_any.is_set() and not for_b.is_set()
            with d.waiting("a") as again:
                assert not again.is_set()  # a fresh one after each add
            with d.waiting("b") as event:
                waiting = asyncio.ensure_future(event.wait())
                await asyncio.sleep(0)
                d.add(2, "b")
                await asyncio.wait_for(waiting, 1)
            d.wake_all()
            assert for_b.is_set()

    asyncio.run(body())


def test_a_job_name_is_forgotten_when_its_last_waiter_leaves():
    """A caller long-polling made-up job names cannot grow the table."""

    async def body():
        d = Delivery(30)
        for i in range(1000):
            with d.waiting(f"made-up-{i}"), d.waiting(f"made-up-{i}"):
                assert d.waiters()[1] >= 1
        assert d.waiters() == (0, 0)

    asyncio.run(body())


@pytest.mark.parametrize("job", ["a", None])
def test_a_poll_costs_what_it_returns_not_the_backlog_of_other_jobs(job):
    """Invariant 7: the same poll touches the same entries whether the other
    jobs hold 1,000 or 100,000 unacked results.

    Polling job "a": half of every other job's backlog is offered and past
    its deadline, half is ready. Polling across jobs: the other jobs' whole
    backlog is offered and not yet due, so only "a" has anything to offer."""
    touched = []
    for backlog in (1_000, 100_000):
        d = Delivery(30)
        for rid in range(1, 11):
            d.add(rid, "a")
        rid = 10
        for other in ("b", "c"):
            for _ in range(backlog // 2):
                rid += 1
                d.add(rid, other)
            if job == "a":
                d.poll(other, backlog // 4, T0 - 100)
            else:
                d.poll(other, backlog // 2, T0 - 10)
        d.touched = 0
        got = d.poll(job, 5, T0)
        assert got == [1, 2, 3, 4, 5]
        touched.append(d.touched)
        d.touched = 0
        assert d.ack("a", got, T0) == 5
        touched.append(d.touched)
    assert touched[0] == touched[2] and touched[1] == touched[3]
    assert touched[0] <= 5 + 3 and touched[1] == 5


# -- a model check --------------------------------------------------------------------


class DeliveryModel(RuleBasedStateMachine):
    """Delivery against a plain model: every id is ready, offered or
    retired; polls offer due offers before ready ids and never anything
    else; acks are all or nothing; nothing added is lost."""

    JOBS = ("a", "b", "c")

    def __init__(self) -> None:
        super().__init__()
        self.d = Delivery(10.0)
        self.now = T0
        self.next_id = 1
        self.job_of: dict[int, str] = {}
        self.ready: set[int] = set()
        self.offers: dict[int, float] = {}  # id -> deadline
        self.retired: set[int] = set()

    def offerable(self, job: str | None) -> tuple[set[int], set[int]]:
        mine = {i for i, j in self.job_of.items() if job is None or j == job}
        due = {i for i in mine if i in self.offers and self.offers[i] <= self.now}
        return due, mine & self.ready

    @rule(job=st.sampled_from(JOBS), n=st.integers(1, 4))
    def add(self, job: str, n: int) -> None:
        for _ in range(n):
            self.d.add(self.next_id, job)
            self.job_of[self.next_id] = job
            self.ready.add(self.next_id)
            self.next_id += 1

    @rule(step=st.sampled_from([0.0, 1.0, 4.0, 10.0, 25.0]))
    def tick(self, step: float) -> None:
        self.now += step

    @rule(job=st.sampled_from((*JOBS, None)), n=st.integers(1, 6))
    def poll(self, job: str | None, n: int) -> None:
        due, ready = self.offerable(job)
        got = self.d.poll(job, n, self.now)
        assert len(got) == len(set(got)) == min(n, len(due) + len(ready))
        assert set(got) <= due | ready
        for j in self.JOBS:
            mine = [i for i in got if self.job_of[i] == j]
            kinds = [i in due for i in mine]
            assert kinds == sorted(kinds, reverse=True), "a due offer came after a ready id"
            fresh = [i for i in mine if i in ready]
            oldest = sorted(i for i in ready if self.job_of[i] == j)[: len(fresh)]
            assert fresh == oldest, "ready ids are offered in id order"
        if job is not None:
            assert len([i for i in got if i in due]) == min(n, len(due))
        for i in got:
            self.ready.discard(i)
            self.offers[i] = self.now + 10.0

    @precondition(lambda self: self.job_of)
    @rule(data=st.data(), job=st.sampled_from(JOBS))
    def ack(self, data: st.DataObject, job: str) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.job_of)), max_size=5))
        # Refused: another job's offer, or this job's ready id (never offered).
        # An id ready in another job is the ledger's check (against the log).
        bad = [
            i
            for i in dict.fromkeys(ids)
            if (i in self.offers and self.job_of[i] != job)
            or (i in self.ready and self.job_of[i] == job)
        ]
        if bad:
            with pytest.raises(NeverOffered) as exc:
                self.d.ack(job, ids, self.now)
            assert exc.value.ids == bad
            return
        want = {i for i in ids if i in self.offers}
        assert self.d.ack(job, ids, self.now) == len(want)
        for i in want:
            del self.offers[i]
            self.retired.add(i)

    @precondition(lambda self: self.job_of)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.job_of)), max_size=3, unique=True))
        held = [i for i in ids if i in self.ready or i in self.offers]
        assert self.d.remove(ids) == len(held)
        for i in held:
            self.ready.discard(i)
            self.offers.pop(i, None)
            self.retired.add(i)

    @invariant()
    def counts_match(self) -> None:
        for j in self.JOBS:
            mine = {i for i, jj in self.job_of.items() if jj == j}
            assert self.d.pending(j) == len(mine & (self.ready | set(self.offers)))
            assert self.d.offered(j) == len(mine & set(self.offers))
        assert self.d.pending() == len(self.ready) + len(self.offers)


TestDeliveryModel = DeliveryModel.TestCase
TestDeliveryModel.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_an_ack_of_every_offer_leaves_no_dead_entry_for_the_next_poll():
    """The usual cycle: a poll offers 1,000, their ack retires them all. The
    job's heap entries of those offers go with the ack (each paid for by
    it), so the next poll of the job touches what it returns, not 1,000 dead
    entries more (issue 16: they were popped one at a time there)."""
    d = Delivery(30)
    d.add_many(list(range(1, 2001)), "a")
    got = d.poll("a", 1000, T0)
    d.touched = 0
    assert d.ack("a", got, T0) == 1000
    assert d.touched == 1000  # the ids it was given
    d.touched = 0
    assert d.poll("a", 10, T0 + 1) == list(range(1001, 1011))
    assert d.touched == 10
    assert d.offered("a") == 10 and d.pending("a") == 1000


def test_a_discard_of_a_jobs_last_ready_id_leaves_its_due_offers_offerable():
    """Found by the state machine above: discarding the last ready id of a
    job took the job out of the polls' ring while offers of its that came due
    again waited there, their wake-up spent by a poll that served another
    job first: never offered again."""
    d = Delivery(offer_timeout_s=5.0)
    d.add(1, "b")
    assert d.poll("b", 1, now=0.0) == [1]  # due again at 5
    d.add(2, "b")  # ready
    d.add(3, "a")
    assert d.poll("a", 1, now=1.0) == [3]  # due again at 6
    assert d.poll(None, 1, now=10.0) == [3]  # both wake-ups spent; a served first
    assert d.remove([2]) == 1
    assert d.poll(None, 1, now=10.0) == [1]
