"""Acks held until the schedule has synced the write-backs before them
(workers/ledger/acks.py): with a real thread for the sync."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from workers.ledger import acks as acks_mod
from workers.ledger.acks import RETRY_S, SYNC_INTERVAL_S, HeldAcks

pytestmark = pytest.mark.timeout(30)


class Disk:
    """The sync: blocks until let go, counts, or fails while ``failing``."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls = 0
        self.failing = False

    def sync(self) -> None:
        self.calls += 1
        assert self.go.wait(10)
        if self.failing:
            raise OSError(5, "Input/output error")


@pytest.fixture
def held():
    disk = Disk()
    kicks: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        acks = HeldAcks(disk.sync, pool, kicks.append)
        yield acks, disk, kicks
        disk.go.set()


def _released(acks: HeldAcks, deadline_s: float = 5.0) -> list:
    """release() until something comes out (the sync runs on its thread)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        out = acks.release()
        if out:
            return out
        time.sleep(0.001)  # polling the sync thread's end to a deadline
    return []


def test_an_ack_with_every_write_back_synced_is_not_held(held):
    acks, disk, _ = held
    assert not acks.needs_sync()
    acks.written_gen += 1
    assert acks.needs_sync()
    disk.go.set()
    acks.sync_now()
    assert acks.synced_gen == 1 and not acks.needs_sync()


def test_an_ack_waits_for_a_sync_begun_after_its_write_backs(held):
    acks, disk, kicks = held
    loop = asyncio.new_event_loop()
    try:
        acks.written_gen = 3
        waiter = loop.create_future()
        acks.hold([7, 8], 1.0, waiter)
        assert kicks == [0.0]
        assert acks.release() == []  # the sync starts, blocked
        assert disk.calls == 1
        acks.written_gen = 4  # a write-back while it runs: not covered by it
        acks.hold([9], 2.0, None)  # type: ignore[arg-type]
        assert acks.release() == []  # still running: no second sync
        assert disk.calls == 1
        disk.go.set()
        first = _released(acks)
        assert [(ids, gen) for ids, _at, gen, _w in first] == [([7, 8], 3)]
        assert first[0][3] is waiter and acks.synced_gen == 3
        assert len(acks) == 1  # [9] needs gen 4: a later sync
    finally:
        loop.close()


def test_syncs_start_at_most_every_interval(held, monkeypatch):
    acks, disk, kicks = held
    monkeypatch.setattr(acks_mod, "SYNC_INTERVAL_S", 0.5)
    disk.go.set()
    acks.written_gen = 1
    acks.hold([1], 0.0, None)  # type: ignore[arg-type]
    assert _released(acks)  # the first at once
    acks.written_gen = 2
    acks.hold([2], 0.0, None)  # type: ignore[arg-type]
    kicks.clear()
    assert acks.release() == [] and disk.calls == 1  # too soon after the first
    assert len(kicks) == 1 and 0 < kicks[0] <= 0.5  # woken when it may start
    assert acks.release() == [] and len(kicks) == 1  # one wake-up for that moment
    assert [ids for ids, *_ in _released(acks)] == [[2]]
    assert disk.calls == 2
    assert SYNC_INTERVAL_S <= 0.05  # what the ledger uses: an ack answers that much later


def test_a_failed_sync_answers_the_waiters_and_keeps_the_acks_for_a_later_one(held):
    acks, disk, kicks = held
    loop = asyncio.new_event_loop()
    try:
        disk.failing = True
        disk.go.set()
        acks.written_gen = 1
        waiter = loop.create_future()
        acks.hold([5], 0.0, waiter)
        end = time.monotonic() + 5
        while not waiter.done() and time.monotonic() < end:
            assert acks.release() == []
            time.sleep(0.001)  # polling the failed sync's end to a deadline
        assert waiter.done()  # answered, as a failed flush was
        assert len(acks) == 1 and acks.synced_gen == 0
        assert acks.release() == [] and disk.calls == 1  # not tried again at once
        assert any(RETRY_S * 0.5 < k <= RETRY_S for k in kicks)  # woken for the retry
        disk.failing = False
        out = _released(acks)
        assert [(ids, w) for ids, _at, _gen, w in out] == [([5], None)]
        assert acks.synced_gen == 1
    finally:
        loop.close()
