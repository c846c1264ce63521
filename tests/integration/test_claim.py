"""The claim path: the ready set's cursor, ``workers.claim.Claimer`` between
real processes, and the work routes of the HTTP API against a fake ledger.

Real segments throughout (a ready set and a lease table per test, unlinked
after it). Children are real processes (multiprocessing's 'spawn' context);
nothing sleeps to synchronise: events, or a condition polled to a deadline.
Table time is passed in (``now``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import multiprocessing
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer

from node.config import Config, RouteConfig
from node.core.names import shm_segment_name
from node.core.rows import RowWrite
from node.ipc import IpcError, RemoteError
from node.store import open_store
from shm import segment
from shm.leases import LeaseTable, Outcome
from shm.ready import ReadySet
from workers.claim import Claimer, Grant, NotReady, ledger_address
from workers.http.app import WorkerContext, make_app
from workers.http.errors import ERROR_CODES
from workers.http.results import routes as results_routes
from workers.http.work import WorkPath
from workers.http.work import routes as work_routes

pytestmark = pytest.mark.timeout(60)

SPAWN = multiprocessing.get_context("spawn")
NOW = 1_700_000_000.0
DEADLINE_S = 20.0


@pytest.fixture
def name():
    node = f"tc{uuid.uuid4().hex[:12]}"
    yield node
    ReadySet.unlink(node)
    segment.unlink(shm_segment_name(node, "leases"))


@pytest.fixture
def ready(name):
    handle = ReadySet.create(name, capacity=100)
    yield handle
    handle.close()


@pytest.fixture
def leases(name):
    table = LeaseTable.create(name, capacity=1024, max_misses=3)
    yield table
    table.close()


def _wait_until(predicate: Callable[[], Any], what: str, deadline_s: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + deadline_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
        time.sleep(0.001)  # a polling interval, not synchronisation
    return value


def _keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i:05d}" for i in range(n)]


def _seed(store: Any, keys: list[str], due_at: float = NOW - 600, **fields: Any) -> None:
    store.upsert(
        [RowWrite(key=k, route="r", due_at=due_at, payload={"k": k}, **fields) for k in keys],
        now=NOW,
    )


def _entries(store: Any, keys: list[str]) -> list[tuple]:
    """Ready entries for ``keys`` in this order, with the rows' versions
    (a key without a row gets version 1)."""
    rows = store.get_many(keys)
    out = []
    for rank, key in enumerate(keys):
        row = rows.get(key)
        version = row.version if row is not None else 1
        due = int((row.due_at if row is not None else NOW) // 60)
        out.append((key, version, due, 1, float(len(keys) - rank)))
    return out


def _claimer(store: Any, ready: ReadySet, leases: LeaseTable, **kw: Any) -> Claimer:
    config = Config(name="t", workers=1, routes={"r": RouteConfig(cadence_s=3600)})
    return Claimer(config, store, ready, leases, **kw)


# -- the ready set's cursor ---------------------------------------------------------------


def test_take_hands_out_the_set_in_rank_order_once(ready):
    entries = [(f"key-{i}", i + 1, 100 + i, i % 3, 50.0 - i) for i in range(40)]
    ready.publish(entries, NOW)
    assert ready.remaining() == 40
    got = []
    for n in (1, 7, 13, 30):
        generation, taken = ready.take(n)
        assert generation == 1
        got += taken
    assert [tuple(e) for e in got] == entries
    assert ready.remaining() == 0
    assert ready.take(5) == (1, [])
    assert ready.take(0) == (1, [])
    # A new publish starts over, at the top of the new set.
    ready.publish(entries[10:], NOW + 1)
    assert ready.remaining() == 30
    generation, taken = ready.take(2)
    assert generation == 2 and [e.key for e in taken] == ["key-10", "key-11"]


def test_take_lapped_by_two_publishes_takes_from_the_new_set(name):
    """Regression for the lap race: a claimer reads the active slot, the
    keeper publishes twice (the second time into that same slot), then the
    claimer's add lands. It must take the new set's top entries, not drop them."""
    old = [(f"old-{i}", 1, 1, 1, 1.0) for i in range(10)]
    new = [(f"new-{i}", 3, 1, 1, 1.0) for i in range(10)]
    with ReadySet.create(name, capacity=50) as keeper, ReadySet.attach(name) as claimer:
        keeper.publish(old, NOW)
        real = claimer._atomics()

        class Lapping:
            def __getattr__(self, attr: str) -> Any:
                return getattr(real, attr)

            def add64(self, offset: int, delta: int) -> int:
                keeper.publish([("between", 2, 1, 1, 1.0)], NOW + 1)
                keeper.publish(new, NOW + 2)
                claimer._view = real
                return real.add64(offset, delta)

        claimer._view = Lapping()
        generation, taken = claimer.take(3)
        assert generation == 3
        assert [e.key for e in taken] == ["new-0", "new-1", "new-2"]
        assert [e.key for e in claimer.take(2)[1]] == ["new-3", "new-4"]


def _set(prefix: str, n: int) -> list[tuple]:
    return [(f"{prefix}-{i}", 1, 1, 1, float(n - i)) for i in range(n)]


def test_a_set_published_ahead_waits_until_the_active_one_drains(ready, name):
    """The next set (published ahead) is pending, not active: takes drain
    the active set first, then the first take that finds it drained
    switches to the next one; a set drained with nothing pending stays
    drained, and a fresh publish replaces a pending set."""
    with ReadySet.attach(name) as claimer:
        ready.publish(_set("a", 10), NOW)
        ready.publish(_set("b", 5), NOW, ahead=True)
        assert ready.pending() and claimer.generation == 1 and claimer.remaining() == 15
        assert [e.key for e in claimer.take(7)[1]] == [f"a-{i}" for i in range(7)]
        generation, taken = claimer.take(5)  # the rest of the active set only
        assert generation == 1 and [e.key for e in taken] == ["a-7", "a-8", "a-9"]
        assert claimer.switches == 0
        generation, taken = claimer.take(5)  # drained: switch, and take from the next
        assert generation == 2 and [e.key for e in taken] == [f"b-{i}" for i in range(5)]
        assert claimer.switches == 1 and not ready.pending() and ready.active_slot == 0
        assert claimer.take(5) == (2, [])  # the old set is older: never switched back to
        ready.publish(_set("c", 4), NOW)
        ready.publish(_set("d", 4), NOW, ahead=True)
        assert ready.pending() and claimer.generation == 3
        ready.publish(_set("e", 3), NOW)  # a fresh set: switched to at once
        assert not ready.pending() and claimer.generation == 4
        assert [e.key for e in claimer.take(10)[1]] == ["e-0", "e-1", "e-2"]


def _asleep_waiting(handle: ReadySet, after_generation: int) -> tuple[Any, list[int]]:
    """A thread blocked in ``handle.wait_publish(after_generation, 60 s)``,
    returned once it sleeps in the kernel, and the list its answer goes to:
    it returns within the test's join only if something wakes the futex."""
    import threading

    woke: list[int] = []
    thread = threading.Thread(
        target=lambda: woke.append(handle.wait_publish(after_generation, 60.0)), daemon=True
    )
    thread.start()

    def asleep() -> bool:
        with open(f"/proc/self/task/{thread.native_id}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"S"

    _wait_until(lambda: thread.native_id is not None and asleep(), "the waiter to sleep")
    return thread, woke


def test_the_keeper_switches_when_the_set_drained_before_the_next_was_written(ready, name):
    """Claimers that found the active set drained wait for the next: a
    set published ahead is switched to at once then, and the waiters wake."""
    with ReadySet.attach(name) as claimer, ReadySet.attach(name) as waiter:
        ready.publish(_set("a", 3), NOW)
        assert len(claimer.take(10)[1]) == 3 and claimer.take(1) == (1, [])
        thread, woke = _asleep_waiting(waiter, 1)
        ready.publish(_set("b", 2), NOW, ahead=True)
        thread.join(10.0)
        assert not thread.is_alive(), "the switch did not wake the waiter"
        assert woke == [2] and ready.switches == 1 and not ready.pending()
        assert [e.key for e in claimer.take(5)[1]] == ["b-0", "b-1"]


def test_a_claimer_that_switches_wakes_the_waiters(ready, name):
    with ReadySet.attach(name) as claimer, ReadySet.attach(name) as waiter:
        ready.publish(_set("a", 3), NOW)
        ready.publish(_set("b", 2), NOW, ahead=True)
        thread, woke = _asleep_waiting(waiter, 1)
        assert len(claimer.take(3)[1]) == 3
        assert [e.key for e in claimer.take(3)[1]] == ["b-0", "b-1"]
        thread.join(10.0)
        assert not thread.is_alive(), "the switch did not wake the waiter"
        assert woke == [2] and claimer.switches == 1


def test_take_reads_unicode_keys(ready):
    entries = [(f"ключ-{i}-€", i + 1, 5, 1, 1.0) for i in range(10)]
    ready.publish(entries, NOW)
    assert [tuple(e) for e in ready.take(4)[1] + ready.take(10)[1]] == entries


def test_take_before_any_publish_is_empty(ready):
    assert ready.take(3) == (0, [])
    assert ready.remaining() == 0


def test_low_water_flag_is_raised_once_and_taken_by_the_keeper(ready):
    ready.publish([(f"k{i}", 1, 1, 1, 1.0) for i in range(8)], NOW)
    assert not ready.low_water
    assert ready.request_publish() is True
    assert ready.request_publish() is False  # already pending: no second wake
    assert ready.low_water
    assert ready.take_low_water() is True
    assert ready.take_low_water() is False
    assert ready.request_publish() is True
    ready.publish([], NOW + 1)  # a fresh set answers the request
    assert not ready.low_water


# -- Claimer, one process ---------------------------------------------------------------


def test_claim_order_is_ready_order_skipping_gone_moved_and_not_due(ready, leases):
    store = open_store("memory://")
    keys = _keys(12)
    _seed(store, keys)
    entries = _entries(store, keys)
    entries.insert(3, ("gone-key", 7, 1, 1, 99.0))  # no row
    ready.publish(entries, NOW)
    _seed(store, [keys[5]])  # written again since the publish: its version moved
    _seed(store, [keys[8]], due_at=NOW + 3600)  # rescheduled: version moved, not due
    claimer = _claimer(store, ready, leases)
    grants = claimer.claim(4, 60, "w1", NOW)
    assert [g.key for g in grants] == [keys[0], keys[1], keys[2], keys[3]]
    grants += claimer.claim(100, 60, "w1", NOW)
    expected = [k for i, k in enumerate(keys) if i not in (5, 8)]
    assert [g.key for g in grants] == expected
    stats = claimer.stats
    assert (stats.gone, stats.moved, stats.granted) == (1, 2, 10)
    first = grants[0]
    assert isinstance(first, Grant)
    assert first.payload == {"k": keys[0]} and first.job == "default"
    assert first.due_at == NOW - 600 and first.expires_at == NOW + 60
    assert sorted(lease.key for lease in leases.live()) == expected


def test_rows_released_for_their_job_do_not_shorten_the_claim(ready, leases, tmp_path):
    """A row another program gave a job that is not a job name is released,
    not granted; the claim takes the next rows in its place, since fewer
    leases than asked says the ready set ran out (the HTTP claim stops its
    chunks there). Before, a claim of 5 over 3 such rows and 6 good ones
    answered 2 leases."""
    import sqlite3

    db = tmp_path / "schedule.db"
    store = open_store(f"sqlite:///{db}")
    bad, good = _keys(3, "bad"), _keys(6, "good")
    _seed(store, bad, due_at=NOW - 1200)  # the most overdue: taken first
    _seed(store, good)
    conn = sqlite3.connect(db)
    with conn:
        conn.executemany("UPDATE schedule SET job = 'my job' WHERE key = ?", [(k,) for k in bad])
    conn.close()
    ready.publish(_entries(store, bad + good), NOW)
    claimer = _claimer(store, ready, leases)
    assert [g.key for g in claimer.claim(5, 60, "w", NOW)] == good[:5]
    assert sorted(hold.key for hold in leases.held()) == bad
    assert [g.key for g in claimer.claim(5, 60, "w", NOW)] == good[5:]  # ran out


def test_claim_skips_rows_not_due_with_the_entry_version(ready, leases):
    """A row whose due_at is past ``now`` but whose version still matches
    (another program moved it without the keeper seeing yet) is not granted."""
    store = open_store("memory://")
    _seed(store, ["early"], due_at=NOW + 30)
    _seed(store, ["late"])
    ready.publish(_entries(store, ["early", "late"]), NOW)
    claimer = _claimer(store, ready, leases)
    assert [g.key for g in claimer.claim(5, 60, "w", NOW)] == ["late"]
    assert claimer.stats.not_due == 1


def test_claim_skips_keys_the_lease_table_refuses(ready, leases):
    store = open_store("memory://")
    keys = _keys(4)
    _seed(store, keys)
    leases.grant(keys[1], "other", 60, NOW, 3600)  # leased since the publish
    lease = leases.grant(keys[2], "other", 60, NOW, 3600)
    leases.release(keys[2], lease.lease_id, NOW)  # held for 2 lease lengths
    ready.publish(_entries(store, keys), NOW)
    claimer = _claimer(store, ready, leases)
    assert [g.key for g in claimer.claim(10, 60, "w", NOW)] == [keys[0], keys[3]]
    assert claimer.stats.refused == {"leased": 1, "held": 1}


def test_claim_uses_the_row_or_route_cadence_for_holds(ready, leases):
    store = open_store("memory://")
    _seed(store, ["own"], cadence_s=120)
    _seed(store, ["route"])
    ready.publish(_entries(store, ["own", "route"]), NOW)
    grants = {g.key: g for g in _claimer(store, ready, leases).claim(2, 100, "w", NOW)}
    for key, cap in (("own", 120), ("route", 3600)):
        leases.release(key, grants[key].lease_id, NOW)
        (hold,) = [h for h in leases.held() if h.key == key]
        assert hold.held_until == NOW + min(2 * 100, cap)


def test_no_grant_before_the_first_publish_since_start(ready, leases):
    store = open_store("memory://")
    _seed(store, ["a"])
    ready.publish(_entries(store, ["a"]), NOW)  # the last run's set
    published = {"yes": False}
    claimer = _claimer(store, ready, leases, is_ready=lambda: published["yes"])
    with pytest.raises(NotReady):
        claimer.claim(1, 60, "w", NOW)
    assert leases.live() == [] and ready.remaining() == 1
    published["yes"] = True
    assert [g.key for g in claimer.claim(1, 60, "w", NOW)] == ["a"]
    published["yes"] = False  # once ready, a node stays ready
    assert claimer.claim(1, 60, "w", NOW) == []


@pytest.mark.parametrize("c_path", [True, False])
def test_the_next_set_is_asked_for_at_the_first_take_and_switched_to(
    ready, leases, tmp_path, c_path
):
    """A claimer asks for the next set as soon as it takes from the active
    one (once: the flag stays up until the keeper takes it), never while
    the next set is pending; a claim that drains the active set goes on into
    the pending one, in rank order, and asks again."""
    store = open_store(f"sqlite:///{tmp_path}/schedule.db")
    keys = _keys(100)
    _seed(store, keys)
    ready.publish(_entries(store, keys)[:40], NOW)
    wakes = []
    claimer = _claimer(store, ready, leases, wake=lambda: wakes.append(1), c_path=c_path)
    assert claimer.on_c_path == c_path
    assert not ready.low_water
    assert [g.key for g in claimer.claim(10, 60, "w", NOW)] == keys[:10]
    assert ready.low_water and wakes == [1]
    claimer.claim(1, 60, "w", NOW)  # still pending: no second wake
    assert wakes == [1]
    assert ready.take_low_water()
    ready.publish(_entries(store, keys)[40:], NOW, ahead=True)
    assert ready.pending() and ready.remaining() == 29 + 60
    claimer.claim(1, 60, "w", NOW)  # the next set is pending: no request
    assert not ready.low_water and wakes == [1]
    grants = claimer.claim(60, 60, "w", NOW)  # the active set's 28, then the next's
    assert [g.key for g in grants] == keys[12:72]
    assert claimer.stats.switches == 1 and not ready.pending()
    assert ready.low_water and wakes == [1, 1]  # taking from the new set: ask again


def test_a_drained_claimer_waits_for_the_next_publish(ready, leases):
    store = open_store("memory://")
    _seed(store, ["a", "b"])
    ready.publish(_entries(store, ["a"]), NOW)
    claimer = _claimer(store, ready, leases)
    generation = claimer.generation
    assert [g.key for g in claimer.claim(5, 60, "w", NOW)] == ["a"]
    assert claimer.wait_for_publish(generation, 0.01) == generation
    ready.publish(_entries(store, ["b"]), NOW)
    assert claimer.wait_for_publish(generation, 5) == generation + 1
    assert [g.key for g in claimer.claim(5, 60, "w", NOW)] == ["b"]


def test_renew_and_release_go_to_the_lease_table(ready, leases):
    store = open_store("memory://")
    _seed(store, ["a"])
    ready.publish(_entries(store, ["a"]), NOW)
    claimer = _claimer(store, ready, leases)
    (grant,) = claimer.claim(1, 60, "w", NOW)
    assert claimer.renew("a", grant.lease_id, 120, NOW + 10) is Outcome.RENEWED
    assert leases.live()[0].expires_at == NOW + 130
    assert claimer.release("a", grant.lease_id, NOW + 20, "oom") is Outcome.RELEASED
    assert claimer.release("a", grant.lease_id, NOW + 20) is Outcome.ENDED
    assert leases.held()[0].last_error == "oom"


# -- between processes ---------------------------------------------------------------------


def _taker(name: str, booted: Any, go: Any, done: Any, out: str) -> None:
    """Take 1..5 entries at a time until the parent is done publishing."""
    import random

    ready = ReadySet.attach(name)
    rnd = random.Random()
    taken: list[tuple[int, str]] = []
    booted.set()
    go.wait(DEADLINE_S)
    while True:
        finished = done.is_set()
        generation, entries = ready.take(rnd.randint(1, 5))
        taken += [(generation, e.key) for e in entries]
        if finished and not entries:
            break
    ready.close()
    Path(out).write_bytes(msgpack.packb(taken))


def test_two_processes_never_take_the_same_entry_of_one_set(name, tmp_path):
    ready = ReadySet.create(name, capacity=400)
    try:
        go, done = SPAWN.Event(), SPAWN.Event()
        outs = [str(tmp_path / f"taker-{i}.msgpack") for i in range(2)]
        booted = [SPAWN.Event() for _ in outs]
        children = [
            SPAWN.Process(target=_taker, args=(name, b, go, done, o))
            for b, o in zip(booted, outs, strict=True)
        ]
        for child in children:
            child.start()
        for event in booted:
            assert event.wait(DEADLINE_S), "a taker did not boot"
        keys = _keys(400)
        published = 0
        go.set()
        for generation in range(1, 31):
            # The same keys every time, as a keeper republishing its top set
            # (never sooner than 10 ms after its last publish, as the keeper);
            # every other set is replaced before it is drained.
            since = time.monotonic()
            ready.publish([(k, generation, 1, 1, 1.0) for k in keys], float(generation))
            published += 1
            if generation % 2:
                _wait_until(lambda: ready.remaining() == 0, "the set to drain")
            else:
                _wait_until(lambda: ready.remaining() < 300, "takes to begin")
            _wait_until(lambda t0=since: time.monotonic() - t0 >= 0.01, "the keeper's 10 ms")
        done.set()
        for child in children:
            child.join(DEADLINE_S)
            assert child.exitcode == 0
    finally:
        ready.close()
    taken = [tuple(t) for out in outs for t in msgpack.unpackb(Path(out).read_bytes())]
    twice = [pair for pair, n in Counter(taken).items() if n > 1]
    assert not twice, f"{len(twice)} entries taken twice, e.g. {twice[:3]}"
    per_process = [len(msgpack.unpackb(Path(o).read_bytes())) for o in outs]
    assert all(n > 0 for n in per_process), per_process
    # Drained sets were taken whole, but for the one documented window: a
    # taker descheduled between its add and its copy for two more publishes
    # (here 20 ms; a loaded host can do that) loses the few entries it took,
    # until the next publish. Never more than a trace of them.
    drained = range(1, published + 1, 2)
    missing = sum(len(set(keys) - {k for g, k in taken if g == gen}) for gen in drained)
    assert missing <= 0.01 * len(keys) * len(drained), f"{missing} entries of drained sets lost"


def _grant_loop(
    name: str, db: str, consumer: str, booted: Any, go: Any, done: Any, out: str
) -> None:
    store = open_store(f"sqlite:///{db}")
    ready = ReadySet.attach(name)
    leases = LeaseTable.attach(name)
    claimer = _claimer(store, ready, leases)
    grants: list[tuple[str, int]] = []
    booted.set()
    go.wait(DEADLINE_S)
    while True:
        finished = done.is_set()
        got = claimer.claim(3, 600, consumer, time.time())
        grants += [(g.key, g.lease_id) for g in got]
        if finished and not got:
            break
    Path(out).write_bytes(msgpack.packb({"grants": grants, "stats": claimer.stats.as_dict()}))
    leases.close()
    ready.close()
    store.close()


def test_two_claimer_processes_never_hold_one_key_twice(name, tmp_path):
    db = tmp_path / "schedule.db"
    store = open_store(f"sqlite:///{db}")
    keys = _keys(600)
    _seed(store, keys, due_at=time.time() - 600)
    entries = _entries(store, keys)
    ready = ReadySet.create(name, capacity=200)
    leases = LeaseTable.create(name, capacity=2048)
    try:
        go, done = SPAWN.Event(), SPAWN.Event()
        outs = [str(tmp_path / f"claimer-{i}.msgpack") for i in range(2)]
        booted = [SPAWN.Event() for _ in outs]
        children = [
            SPAWN.Process(
                target=_grant_loop, args=(name, str(db), f"c{i}", booted[i], go, done, out)
            )
            for i, out in enumerate(outs)
        ]
        for child in children:
            child.start()
        for event in booted:
            assert event.wait(DEADLINE_S), "a claimer did not boot"
        go.set()
        # A keeper that never leaves leased keys out: the same 600 keys in
        # rank order, 200 at a time, republished whenever the set runs low.
        # Only the lease table keeps a key from being granted twice.
        deadline = time.monotonic() + DEADLINE_S
        offset = 0
        while leases.stats()["grants"] < len(keys):
            assert time.monotonic() < deadline, f"only {leases.stats()['grants']} granted"
            window = entries[offset : offset + 200] + entries[: max(0, offset - 400)]
            ready.publish(window, time.time())
            offset = (offset + 100) % 600
            _wait_until(lambda: ready.remaining() < 50, "claimers to take", 5)
        done.set()
        for child in children:
            child.join(DEADLINE_S)
            assert child.exitcode == 0
        assert leases.live_count() == len(keys)
    finally:
        ready.close()
        leases.close()
        store.close()
    docs = [msgpack.unpackb(Path(out).read_bytes()) for out in outs]
    granted = [key for doc in docs for key, _ in doc["grants"]]
    assert sorted(granted) == sorted(keys), "every key granted exactly once"
    assert all(doc["grants"] for doc in docs), "both claimers granted"
    assert sum(doc["stats"]["refused"].get("leased", 0) for doc in docs) > 0


# -- the work routes over HTTP -------------------------------------------------------


def async_test(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return run


class FakeLedger:
    """The ledger's IPC as the routes see it: answers by op (a dict, a
    callable of the fields, or an exception to raise)."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers
        self.calls: list[tuple[str, dict]] = []

    async def call(self, op: str, timeout_s: float = 30.0, **fields: Any) -> dict[str, Any]:
        self.calls.append((op, fields))
        answer = self.answers[op]
        if isinstance(answer, BaseException):
            raise answer
        return answer(fields) if callable(answer) else dict(answer, id=99)


class Work:
    """Segments, a memory store and a fake ledger behind one app."""

    def __init__(self, ready: ReadySet, leases: LeaseTable, ledger: FakeLedger | None = None):
        self.store = open_store("memory://")
        self.ready = ready
        self.leases = leases
        self.ledger = ledger or FakeLedger()
        self.published = True
        self.explained: dict[str, Any] = {}
        self.claimer = _claimer(self.store, ready, leases, is_ready=lambda: self.published)
        self.ctx = WorkerContext(
            config=Config(name="t", workers=1, lease_s=45),
            store=self.store,
            name="t",
            started_at=NOW - 100,
            clock=lambda: NOW,
            explain=lambda key: self.explained.get(key),
            work=WorkPath(self.claimer, leases, self.ledger),
        )

    def seed(self, keys: list[str], **fields: Any) -> None:
        _seed(self.store, keys, **fields)
        self.ready.publish(_entries(self.store, keys), NOW)


@contextlib.asynccontextmanager
async def serve(work: Work) -> AsyncIterator[TestClient]:
    routes = [*work_routes, *results_routes]
    async with TestClient(TestServer(make_app(work.ctx, extra_routes=routes))) as client:
        yield client


async def error_of(resp: Any, status: int, code: str, field: str | None = "") -> dict:
    assert resp.status == status, await resp.text()
    doc = await resp.json()
    assert set(doc["error"]) == {"code", "message", "field"}
    assert doc["error"]["code"] == code, doc
    assert ERROR_CODES[code][0] == status
    if field != "":
        assert doc["error"]["field"] == field, doc
    return doc["error"]


@async_test
async def test_http_claim_answers_leases(ready, leases):
    work = Work(ready, leases)
    work.seed(["a", "b", "c"])
    async with serve(work) as client:
        resp = await client.post("/claim", json={"max": 2, "consumer": "gpu-1"})
        assert resp.status == 200
        doc = await resp.json()
        assert [lease["key"] for lease in doc["leases"]] == ["a", "b"]
        first = doc["leases"][0]
        assert set(first) == {"lease_id", "key", "payload", "job", "due_at", "expires_at"}
        assert first["payload"] == {"k": "a"} and first["expires_at"] == NOW + 45
        resp = await client.post(
            "/claim",
            data=msgpack.packb({"max": 5, "lease_s": 10, "consumer": "gpu-2"}),
            headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"},
        )
        (lease,) = msgpack.unpackb(await resp.read())["leases"]
        assert lease["key"] == "c" and lease["expires_at"] == NOW + 10
        resp = await client.post("/claim", json={"max": 5, "consumer": "gpu-1"})
        assert (await resp.json()) == {"leases": []}
    assert {lease.consumer for lease in leases.live()} == {"gpu-1", "gpu-2"}


@async_test
async def test_http_big_claims_run_on_the_claim_thread(ready, leases):
    from concurrent.futures import ThreadPoolExecutor

    from workers.http.work import INLINE_CLAIM_MAX

    work = Work(ready, leases)
    keys = _keys(INLINE_CLAIM_MAX + 10)
    work.seed(keys)
    big = _claimer(work.store, ready, leases)
    with ThreadPoolExecutor(1) as thread:
        work.ctx.work = WorkPath(work.claimer, leases, work.ledger, thread, big)
        async with serve(work) as client:
            resp = await client.post("/claim", json={"max": 2, "consumer": "w"})
            assert len((await resp.json())["leases"]) == 2
            resp = await client.post("/claim", json={"max": len(keys), "consumer": "w"})
            assert [x["key"] for x in (await resp.json())["leases"]] == keys[2:]
    assert (work.claimer.stats.granted, big.stats.granted) == (2, len(keys) - 2)


@async_test
async def test_http_claim_is_503_before_the_first_publish(ready, leases):
    work = Work(ready, leases)
    work.seed(["a"])
    work.published = False
    async with serve(work) as client:
        resp = await client.post("/claim", json={"max": 1, "consumer": "w"})
        await error_of(resp, 503, "not_ready")
    assert leases.live() == []


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({"consumer": "w"}, "missing_field", "max"),
        ({"max": 0, "consumer": "w"}, "invalid_max", "max"),
        ({"max": 10_001, "consumer": "w"}, "invalid_max", "max"),
        ({"max": True, "consumer": "w"}, "invalid_max", "max"),
        ({"max": 1.5, "consumer": "w"}, "invalid_max", "max"),
        ({"max": 1, "consumer": "w", "lease_s": 0.5}, "invalid_lease_s", "lease_s"),
        ({"max": 1, "consumer": "w", "lease_s": 86_401}, "invalid_lease_s", "lease_s"),
        ({"max": 1, "consumer": "w", "lease_s": "60"}, "invalid_lease_s", "lease_s"),
        ({"max": 1}, "missing_field", "consumer"),
        ({"max": 1, "consumer": ""}, "invalid_consumer", "consumer"),
        ({"max": 1, "consumer": "x" * 129}, "invalid_consumer", "consumer"),
        ({"max": 1, "consumer": 7}, "invalid_consumer", "consumer"),
        ({"max": 1, "consumer": "w", "wait": 1}, "unknown_field", "wait"),
    ],
)
def test_http_claim_validation(ready, leases, body, code, field):
    @async_test
    async def run() -> None:
        work = Work(ready, leases)
        work.seed(["a"])
        async with serve(work) as client:
            await error_of(await client.post("/claim", json=body), 400, code, field)
        assert leases.live() == [] and ready.remaining() == 1

    run()


@async_test
async def test_http_claim_body_shapes(ready, leases):
    async with serve(Work(ready, leases)) as client:
        await error_of(await client.post("/claim", json=[1]), 400, "invalid_body")
        await error_of(await client.post("/claim", data=b"{"), 400, "invalid_json")


def _complete_ledger(status: str, result_id: int | None = 5) -> FakeLedger:
    def complete(fields: dict) -> dict:
        return {"outcomes": [{"status": status, "id": result_id}]}

    return FakeLedger(complete=complete)


@async_test
async def test_http_complete_forwards_results_and_maps_statuses(ready, leases):
    ledger = _complete_ledger("ok", 41)
    work = Work(ready, leases, ledger)
    async with serve(work) as client:
        resp = await client.post("/complete", json={"lease_id": 3, "key": "a", "result": {"x": 1}})
        assert resp.status == 200 and await resp.json() == {"id": 41}
        body = {"lease_id": 3, "key": "a", "result": base64.b64encode(b"\0\1").decode()}
        resp = await client.post("/complete", json={**body, "encoding": "base64"})
        assert resp.status == 200
        resp = await client.post(
            "/complete",
            data=msgpack.packb({"lease_id": 3, "key": "a", "result": b"\xff"}),
            headers={"Content-Type": "application/msgpack"},
        )
        assert resp.status == 200
        items = [fields["items"][0] for op, fields in ledger.calls]
        assert [(i["result"], i["encoding"]) for i in items] == [
            (b'{"x":1}', "json"),
            (b"\0\1", "bytes"),
            (b"\xff", "bytes"),
        ]
        assert items[0]["lease_id"] == 3 and items[0]["key"] == "a"
        for status, code, http in (
            ("repeat", None, 200),
            ("conflict", "lease_conflict", 409),
            ("unknown", "lease_unknown", 409),
            ("log_unavailable", "log_unavailable", 503),
        ):
            ledger.answers = _complete_ledger(status).answers
            resp = await client.post("/complete", json={"lease_id": 3, "key": "a", "result": 1})
            if code is None:
                assert resp.status == http
            else:
                await error_of(resp, http, code)


@async_test
async def test_http_complete_without_a_ledger_is_503(ready, leases):
    ledger = FakeLedger(complete=IpcError("ledger not reachable"))
    async with serve(Work(ready, leases, ledger)) as client:
        resp = await client.post("/complete", json={"lease_id": 3, "key": "a", "result": 1})
        await error_of(resp, 503, "ledger_unavailable")
        ledger.answers["complete"] = RemoteError("boom", "the ledger broke")
        resp = await client.post("/complete", json={"lease_id": 3, "key": "a", "result": 1})
        await error_of(resp, 503, "ledger_unavailable")


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({"key": "a", "result": 1}, "missing_field", "lease_id"),
        ({"lease_id": "3", "key": "a", "result": 1}, "invalid_lease_id", "lease_id"),
        ({"lease_id": 0, "key": "a", "result": 1}, "invalid_lease_id", "lease_id"),
        ({"lease_id": 3, "result": 1}, "missing_field", "key"),
        ({"lease_id": 3, "key": "", "result": 1}, "invalid_key", "key"),
        ({"lease_id": 3, "key": "a"}, "missing_field", "result"),
        ({"lease_id": 3, "key": "a", "result": "!!", "encoding": "base64"}, "invalid_result", None),
        ({"lease_id": 3, "key": "a", "result": 1, "encoding": "hex"}, "invalid_result", None),
        ({"lease_id": 3, "key": "a", "result": 1, "extra": 1}, "unknown_field", "extra"),
    ],
)
def test_http_complete_validation(ready, leases, body, code, field):
    @async_test
    async def run() -> None:
        ledger = _complete_ledger("ok")
        async with serve(Work(ready, leases, ledger)) as client:
            error = await error_of(await client.post("/complete", json=body), 400, code)
            if field is not None:
                assert error["field"] == field
        assert ledger.calls == []

    run()


@async_test
async def test_http_release_and_renew(ready, leases):
    work = Work(ready, leases)
    work.seed(["a", "b"])
    async with serve(work) as client:
        doc = await (await client.post("/claim", json={"max": 2, "consumer": "w"})).json()
        a, b = doc["leases"]
        resp = await client.post(
            "/renew", json={"lease_id": a["lease_id"], "key": "a", "lease_s": 300}
        )
        assert await resp.json() == {"expires_at": NOW + 300}
        resp = await client.post(
            "/release", json={"lease_id": a["lease_id"], "key": "a", "error": "cuda oom"}
        )
        assert resp.status == 200 and await resp.json() == {"released": True}
        resp = await client.post("/release", json={"lease_id": a["lease_id"], "key": "a"})
        await error_of(resp, 409, "lease_ended", "lease_id")
        resp = await client.post(
            "/renew", json={"lease_id": a["lease_id"], "key": "a", "lease_s": 60}
        )
        await error_of(resp, 409, "lease_ended")
        resp = await client.post("/release", json={"lease_id": b["lease_id"] + 1000, "key": "b"})
        await error_of(resp, 409, "lease_unknown")
        resp = await client.post("/release", json={"lease_id": 1, "key": "b"})
        await error_of(resp, 409, "lease_conflict")
        resp = await client.post("/release", json={"lease_id": 1, "key": "b", "error": 5})
        await error_of(resp, 400, "invalid_error", "error")
        resp = await client.post("/renew", json={"lease_id": 1, "key": "b"})
        await error_of(resp, 400, "missing_field", "lease_s")

        held = await (await client.get("/held")).json()
        assert held == {
            "held": [
                {
                    "key": "a",
                    "misses": 1,
                    "held_until": NOW + 600,
                    "parked": False,
                    "last_error": "cuda oom",
                }
            ]
        }
        live = await (await client.get("/leases?limit=5")).json()
        assert [(x["key"], x["consumer"]) for x in live["leases"]] == [("b", "w")]
        await error_of(await client.get("/leases?limit=0"), 400, "invalid_limit", "limit")
        await error_of(await client.get("/held?limit=x"), 400, "invalid_limit", "limit")
        resp = await client.post("/admin/unhold", json={"keys": ["a", "b", "zz"]})
        assert await resp.json() == {"unheld": 1}
        assert (await (await client.get("/held")).json()) == {"held": []}
        resp = await client.post("/admin/unhold", json={"keys": "a"})
        await error_of(resp, 400, "invalid_body", "keys")


@async_test
async def test_http_rows_explains_the_lease(ready, leases):
    work = Work(ready, leases)
    work.seed(["a", "b", "c"])
    _seed(work.store, ["later"], due_at=NOW + 3600)
    work.explained = {
        "c": {"held": True, "in_ready_set": True, "paused": True},
        "later": {"held": True, "in_ready_set": False, "paused": False},
    }
    async with serve(work) as client:
        doc = await (await client.post("/claim", json={"max": 2, "consumer": "w"})).json()
        a, b = doc["leases"]
        await client.post("/release", json={"lease_id": b["lease_id"], "key": "b", "error": "e"})

        async def lease_of(key: str) -> dict:
            resp = await client.get("/rows", params={"key": key})
            assert resp.status == 200
            return (await resp.json())["lease"]

        lease = await lease_of("a")
        assert lease["state"] == "leased" and lease["why_not"] == "leased"
        assert lease["consumer"] == "w" and lease["expires_at"] == NOW + 45
        lease = await lease_of("b")
        assert lease["state"] == "held" and lease["misses"] == 1
        assert lease["last_error"] == "e" and lease["why_not"] == f"held until {NOW + 90}"
        lease = await lease_of("c")
        assert lease == {"state": "none", "why_not": "paused"}
        assert (await lease_of("later"))["why_not"] == "not due"


@async_test
async def test_http_results_ack_and_accounting_go_to_the_ledger(ready, leases):
    results = [
        {
            "id": 1,
            "key": "a",
            "job": "j",
            "result": b'{"v":1}',
            "encoding": "json",
            "finished_at": NOW,
        },
        {
            "id": 2,
            "key": "b",
            "job": "j",
            "result": b"\x00raw",
            "encoding": "bytes",
            "finished_at": NOW,
        },
    ]
    counters = {"received": 3, "routed": 2, "balanced": True}

    def ack(fields: dict) -> dict:
        if 7 in fields["ids"]:
            raise RemoteError("never_offered", "ids never offered: [7]")
        return {"acked": len(fields["ids"])}

    ledger = FakeLedger(poll={"results": results}, ack=ack, accounting=counters)
    async with serve(Work(ready, leases, ledger)) as client:
        resp = await client.get("/jobs/j/results", params={"max": "2", "wait_s": "1.5"})
        doc = await resp.json()
        assert doc["results"][0]["result"] == {"v": 1}
        assert "encoding" not in doc["results"][0]
        assert doc["results"][1]["encoding"] == "base64"
        assert base64.b64decode(doc["results"][1]["result"]) == b"\x00raw"
        assert ledger.calls[-1] == ("poll", {"job": "j", "max": 2, "wait_s": 1.5})
        resp = await client.get("/results", headers={"Accept": "application/msgpack"})
        raw = msgpack.unpackb(await resp.read())
        assert raw["results"][1]["result"] == b"\x00raw"
        assert ledger.calls[-1] == ("poll", {"job": None, "max": 100, "wait_s": 0.0})
        await error_of(await client.get("/results?max=0"), 400, "invalid_max", "max")
        await error_of(await client.get("/results?wait_s=61"), 400, "invalid_wait_s", "wait_s")
        await error_of(await client.get("/results?wait_s=nan"), 400, "invalid_wait_s")
        await error_of(await client.get("/jobs/b%20d/results"), 400, "invalid_job")

        resp = await client.post("/jobs/j/ack", json={"ids": [1, 2]})
        assert await resp.json() == {"acked": 2}
        error = await error_of(
            await client.post("/jobs/j/ack", json={"ids": [1, 7]}), 409, "never_offered"
        )
        assert "7" in error["message"]
        await error_of(await client.post("/jobs/j/ack", json={"ids": [-1]}), 400, "invalid_ids")
        await error_of(await client.post("/jobs/j/ack", json={"ids": 1}), 400, "invalid_ids")
        many = {"ids": list(range(10_001))}
        await error_of(await client.post("/jobs/j/ack", json=many), 400, "too_many_ids")

        assert await (await client.get("/accounting")).json() == counters


@async_test
async def test_http_work_routes_need_the_work_path(ready, leases):
    work = Work(ready, leases)
    work.ctx.work = None
    async with serve(work) as client:
        await error_of(
            await client.post("/claim", json={"max": 1, "consumer": "w"}), 503, "not_ready"
        )
        resp = await client.get("/openapi.json")
        assert "/claim" in (await resp.json())["paths"]


@async_test
async def test_http_openapi_describes_the_work_routes(ready, leases):
    work = Work(ready, leases)
    app = make_app(work.ctx, extra_routes=work_routes)
    async with TestClient(TestServer(app)) as client:
        spec = await (await client.get("/openapi.json")).json()
    served = {
        (r.resource.canonical, r.method.lower())
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    assert served == {(p, m) for p, ops in spec["paths"].items() for m in ops}


def test_ledger_address_is_abstract():
    assert ledger_address("n1") == "\0queue-node.n1.ledger"
    assert json.dumps(ERROR_CODES["not_ready"])


def test_each_refusal_gets_the_same_status_from_http_and_from_local_claimer():
    """The claim path refuses with domain errors (no HTTP status in them);
    the HTTP workers answer each with its code's status in ERROR_CODES and
    LocalClaimer with a ClientError: the two agree, code by code."""
    from node.core.errors import ValidationError, WorkRefused
    from node.local import refusal
    from workers.claim import complete_outcome, ledger_error, refuse
    from workers.http.work import _refused

    refusals: list[WorkRefused | ValidationError] = [
        refuse(outcome, "k") for outcome in Outcome if outcome.value not in ("renewed", "released")
    ]
    for status in ("conflict", "unknown", "log_unavailable", "what"):
        try:
            complete_outcome({"status": status}, "k")
        except WorkRefused as exc:
            refusals.append(exc)
    assert complete_outcome({"status": "repeat", "id": 7}, "k") == 7
    refusals += [
        ledger_error(code, "m")
        for code in ("never_offered", "result_too_large", "log_unavailable", "io")
    ]
    seen = set()
    for exc in refusals:
        local, http = refusal(exc), _refused(exc)
        assert (local.status, local.code, local.message, local.field) == (
            http.status, http.code, http.message, http.field
        ), exc  # fmt: skip
        seen.add((local.status, local.code))
    assert seen == {
        (409, "lease_ended"), (409, "lease_conflict"), (409, "lease_unknown"),
        (503, "lease_busy"), (503, "log_unavailable"), (503, "ledger_unavailable"),
        (409, "never_offered"), (400, "result_too_large"),
    }  # fmt: skip


def test_the_http_client_alone_loads_no_server_code():
    """``node.client`` is the HTTP client: importing it loads neither the
    shared memory nor the claim path; ``node.client.LocalClaimer`` (the
    contract's path) brings them in when asked for."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import node.client\n"
        "print(sorted(m for m in ('shm', 'workers', 'node.store') if m in sys.modules))\n"
        "from node.client import LocalClaimer\n"
        "from node.local import LocalClaimer as Local\n"
        "print(LocalClaimer is Local, 'workers.claim' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.stdout.split("\n")[:2] == ["[]", "True True"], done.stderr
