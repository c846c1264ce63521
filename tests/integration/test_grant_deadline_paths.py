"""The grant deadline (the ready set's ``grant_until``) on both claim paths.

Two claimer processes over one ready set, one lease table and one SQLite
schedule: one on the C claim path (``shm._claim.ClaimPath``), one on the
Python path (``Claimer(c_path=False)``, ``ReadySet.take``). The test process
writes the deadline as a membership heartbeat would. Each claim is timed on
the system-wide monotonic clock the deadline is written in: a claim that
started at or after the deadline is refused (NotGranting) and takes nothing,
a claim refused must have ended after it, and granting resumes as soon as the
deadline is extended or lifted.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import uuid
from typing import Any

import pytest

from node.config import Config, RouteConfig
from node.core.errors import NotGranting
from node.core.names import shm_segment_name
from node.core.rows import RowWrite
from node.store import open_store
from shm import segment
from shm.leases import LeaseTable
from shm.ready import GRANT_UNTIL_OFFSET, LAYOUT_VERSION, ReadySet
from workers.claim import Claimer

pytestmark = pytest.mark.timeout(90)

SPAWN = multiprocessing.get_context("spawn")
S = 1_000_000_000  # ns
KEYS = [f"k{i:05d}" for i in range(20_000)]  # more than the claims until the deadline


@pytest.fixture
def name():
    node = f"tg{uuid.uuid4().hex[:12]}"
    yield node
    ReadySet.unlink(node)
    segment.unlink(shm_segment_name(node, "leases"))


def _claimer_child(name: str, db: str, c_path: bool, conn: Any) -> None:
    """One claim of one lease per request on ``conn``: ``(answer, started_ns,
    ended_ns)``, the answer the number granted or ``"not_granting"``."""
    store = open_store(f"sqlite:///{db}")
    ready = ReadySet.attach(name)
    leases = LeaseTable.attach(name)
    config = Config(name="t", workers=1, routes={"r": RouteConfig(cadence_s=3600)})
    claimer = Claimer(config, store, ready, leases, c_path=c_path)
    conn.send(claimer.on_c_path)
    while conn.recv():
        started = time.monotonic_ns()
        try:
            answer: Any = len(claimer.claim(1, 3600, "c", time.time()))
        except NotGranting as exc:
            answer = exc.code
        conn.send((answer, started, time.monotonic_ns()))
    conn.send(claimer.stats.as_dict())
    claimer.close()
    leases.close()
    ready.close()
    store.close()


def test_both_claim_paths_stop_at_the_deadline_and_resume(name, tmp_path):
    db = tmp_path / "schedule.db"
    store = open_store(f"sqlite:///{db}")
    now = time.time()
    store.upsert([RowWrite(key=k, route="r", due_at=now - 600) for k in KEYS], now=now)
    rows = store.get_many(KEYS)
    store.close()
    ready = ReadySet.create(name, capacity=len(KEYS))
    leases = LeaseTable.create(name, capacity=1 << 15)
    ready.publish([(k, rows[k].version, int(now // 60) - 10, 1, 1.0) for k in KEYS], now)
    pipes = [SPAWN.Pipe() for _ in range(2)]
    children = [
        SPAWN.Process(target=_claimer_child, args=(name, str(db), c_path, child_end), daemon=True)
        for c_path, (_, child_end) in zip((True, False), pipes, strict=True)
    ]
    for child in children:
        child.start()
    ends = [parent for parent, _ in pipes]
    try:
        assert [end.poll(30) and end.recv() for end in ends] == [True, False], "C, Python"

        def claim_round() -> list[tuple[Any, int, int]]:
            for end in ends:
                end.send(True)
            assert all(end.poll(30) for end in ends), "a claimer did not answer"
            return [end.recv() for end in ends]

        assert [a for a, _, _ in claim_round()] == [1, 1]
        ready.set_grant_until(time.monotonic_ns() - 1)
        left = ready.remaining()
        assert [a for a, _, _ in claim_round()] == ["not_granting"] * 2
        assert ready.remaining() == left, "a refused take moved the cursor"
        ready.set_grant_until(time.monotonic_ns() + 60 * S)
        assert [a for a, _, _ in claim_round()] == [1, 1]

        until = time.monotonic_ns() + S // 5
        ready.set_grant_until(until)
        refused: set[int] = set()
        before = 0
        while len(refused) < 2:
            assert time.monotonic_ns() < until + 20 * S, "never refused"
            for side, (answer, started, ended) in enumerate(claim_round()):
                if answer == "not_granting":
                    assert ended >= until, f"refused {(until - ended) / 1e6:.3f} ms early"
                    refused.add(side)
                else:
                    assert answer == 1 and side not in refused
                    assert started < until, f"granted {(started - until) / 1e6:.3f} ms late"
                    before += ended < until
        assert before, "nothing was granted before the deadline"
        ready.set_grant_until(0)
        assert [a for a, _, _ in claim_round()] == [1, 1]
        for end in ends:
            end.send(False)
        stats = [end.recv() if end.poll(30) else None for end in ends]
        for side in stats:  # the refused claims, counted on both paths
            assert side is not None and side["not_granting"] >= 2, stats
    finally:
        for end in ends:
            if not end.closed:
                with contextlib.suppress(OSError):
                    end.send(False)
        for child in children:
            child.join(30)
        leases.close()
        ready.close()
    assert [child.exitcode for child in children] == [0, 0]


def test_the_deadline_word_and_its_writer(name):
    ready = ReadySet.create(name, capacity=10)
    try:
        assert LAYOUT_VERSION == 5 and GRANT_UNTIL_OFFSET == 48
        assert ready.grant_until_ns == 0
        ready.set_grant_until(123)
        assert int.from_bytes(ready.segment.mm[48:56], "little") == 123 == ready.grant_until_ns
        with pytest.raises(ValueError):
            ready.set_grant_until(-1)
        ready.publish([("a", 1, 0, 1, 1.0)], 0.0)
        with pytest.raises(NotGranting) as refused:
            ready.take(1)
        assert refused.value.code == "not_granting"
        ready.set_grant_until(time.monotonic_ns() + 60 * S)
        assert [e.key for e in ready.take(1)[1]] == ["a"]
    finally:
        ready.close()


class _ReadOutlastsDeadline:
    """A real schedule whose next batch read ends after the grant deadline
    (the fault seam: on PostgreSQL the read is a round trip through the row
    service that a network fault holds for seconds; here the membership
    lapses while it runs, as the keeper's missed heartbeats would make it)."""

    def __init__(self, store: Any, ready: ReadySet) -> None:
        self.store, self.ready = store, ready
        self.lapse_at_read: int | None = None  # the read (by count) during which it lapses
        self.reads = 0

    def _read(self, found: Any) -> Any:
        self.reads += 1
        if self.reads == self.lapse_at_read:
            self.ready.set_grant_until(time.monotonic_ns() - 1)
        return found

    def get(self, key: str) -> Any:
        return self._read(self.store.get(key))

    def get_many(self, keys: list[str]) -> Any:
        return self._read(self.store.get_many(keys))

    def claim_source(self) -> None:
        return None  # the Python path (no raw_rows: not the row service)

    def close(self) -> None:
        self.store.close()


def test_a_row_read_that_outlasts_the_deadline_grants_nothing_after_it(name, tmp_path):
    """The take passed its check, the rows came back after the deadline: the
    claim grants none of them (NotGranting). Fails without the check after
    the read: the four keys would be leased past the deadline."""
    keys = KEYS[:8]
    store = open_store(f"sqlite:///{tmp_path / 'schedule.db'}")
    now = time.time()
    store.upsert([RowWrite(key=k, route="r", due_at=now - 600) for k in keys], now=now)
    rows = store.get_many(keys)
    ready = ReadySet.create(name, capacity=len(keys))
    leases = LeaseTable.create(name, capacity=1 << 10)
    seam = _ReadOutlastsDeadline(store, ready)
    config = Config(name="t", workers=1, routes={"r": RouteConfig(cadence_s=3600)})
    claimer = Claimer(config, seam, ReadySet.attach(name), LeaseTable.attach(name), c_path=False)
    try:
        assert not claimer.on_c_path
        minute = int(now // 60) - 10
        ready.publish([(k, rows[k].version, minute, 1, 1.0) for k in keys[:4]], now)
        ready.set_grant_until(time.monotonic_ns() + 60 * S)
        seam.lapse_at_read = seam.reads + 1
        with pytest.raises(NotGranting):
            claimer.claim(4, 3600, "c", time.time())
        assert leases.live() == [], "granted after the deadline"
        assert claimer.stats.not_granting == 1

        # Renewed: the keys come back in the next set and are granted once.
        ready.set_grant_until(time.monotonic_ns() + 60 * S)
        ready.publish([(k, rows[k].version, minute, 1, 1.0) for k in keys[:4]], now)
        granted = claimer.claim(4, 3600, "c", time.time())
        assert sorted(g.key for g in granted) == keys[:4]
        assert sorted(lease.key for lease in leases.live()) == keys[:4]
    finally:
        claimer.close()
        leases.close()
        ready.close()
        seam.close()
