"""The keeper through a store error, tick by tick (keeper/outage.py): a real
SQLite file taken away, replaced by a copy, replaced by an older copy. The
clock is passed in, so the backoff is checked without sleeping; the node-level
faults (a live node, claims, queue-state) are tests/acceptance/test_keeper_store_error.py.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time

import pytest

from keeper.outage import RETRY_FIRST_S, RETRY_MAX_S, STORE_CHECK_S, KeeperReload
from keeper.process import Keeper
from node.core.rows import RowWrite
from node.store import open_store
from node.testing import wait_for
from shm.ready import ReadySet
from shm.state import StateBuffer
from tests.integration.test_keeper import NOW, _config, _keeper_view, _rows, _table


@pytest.fixture
def segments(node_name):
    ready = ReadySet.create(node_name, 500)
    state = StateBuffer.create(node_name, started_at=NOW - 1)
    yield ready, state
    for seg in (ready, state):
        seg.close()
    ReadySet.unlink(node_name)
    StateBuffer.unlink(node_name)


@pytest.fixture
def live(segments, node_name, tmp_path):
    """A keeper live and exact over 500 rows of a SQLite file; its path."""
    path = tmp_path / "schedule.db"
    store = open_store(f"sqlite:///{path}")
    store.upsert(_rows(500), now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    t = NOW
    while not (keeper.status == "live" and keeper.exact):
        t += 0.01
        keeper.tick(t)
    yield keeper, path, t
    keeper.store.close()


def _copy(path, to) -> None:
    """A consistent copy of the file (SQLite's backup), as a restore would have."""
    src, dst = sqlite3.connect(path), sqlite3.connect(to)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


def _restore(copy, path) -> None:
    """Put ``copy`` in place of ``path`` as a restore must: its own WAL
    folded in, and the old file's WAL and shared-memory index removed with
    it (a WAL left under the name would be read as the new file's)."""
    conn = sqlite3.connect(copy)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()
    os.replace(copy, path)
    for suffix in ("-wal", "-shm"):
        try:
            os.unlink(f"{path}{suffix}")
        except FileNotFoundError:
            pass


def _until(keeper: Keeper, t: float, done, step: float = 0.05, limit: int = 2000) -> float:
    for _ in range(limit):
        t += step
        keeper.tick(t)
        if done():
            return t
    raise AssertionError(f"not done: {keeper.status} exact={keeper.exact} {keeper.stats.store}")


def test_a_missing_file_is_retried_with_capped_backoff_never_created(live, segments):
    keeper, path, t = live
    away = path.with_name("away.db")
    os.rename(path, away)
    t += STORE_CHECK_S
    keeper.tick(t)
    assert keeper.stats.store["state"] == "unreachable" and not keeper.exact
    state = segments[1].read()
    assert state["exact"] == 0 and state["phase"].startswith("store unreachable")
    delays = []
    for _ in range(12):
        outage = keeper._outage
        assert outage is not None
        before = outage.next_try
        keeper.tick(before)  # the retry, due now: fails, the next one later
        delays.append(round(keeper._outage.next_try - before, 3))
    assert delays[0] == RETRY_FIRST_S and max(delays) == RETRY_MAX_S
    assert all(b >= a for a, b in zip(delays, delays[1:], strict=False))
    assert not path.exists()  # a reopen never creates an empty store in its place
    assert keeper.stats.store["attempts"] == 12 and "No such file" in keeper.stats.store["error"]
    os.rename(away, path)
    t = _until(keeper, keeper._outage.next_try, lambda: keeper.exact)
    assert keeper.stats.store["last_verdict"] == "intact" and keeper.stats.store["resumed"] == 1
    assert _keeper_view(keeper) == _table(keeper.store)


def test_a_replaced_file_with_the_same_history_is_walked_not_reloaded(live, tmp_path):
    keeper, path, t = live
    copy = tmp_path / "copy.db"
    _copy(path, copy)
    # What the copy holds beyond the keeper's view: a new row, a changed one.
    other = open_store(f"sqlite:///{copy}")
    other.upsert([RowWrite(key="only-in-copy", route="pages", due_at=NOW)], now=NOW)
    first = _rows(500)[0]
    other.upsert([RowWrite(key=first.key, route=first.route, due_at=NOW + 7 * 86400)], now=NOW)
    gone = _rows(500)[1].key
    other.delete([gone])
    other.close()
    _restore(copy, path)
    t = _until(keeper, t, lambda: keeper.stats.store["outages"] == 1)
    assert not keeper.exact
    t = _until(keeper, t, lambda: keeper.exact)
    assert keeper.stats.store["last_verdict"] == "replaced" and keeper.stats.store["walks"] == 1
    assert keeper.stats.verify["runs"] == 1
    assert _keeper_view(keeper) == _table(keeper.store)
    assert "only-in-copy" in keeper.buckets and gone not in keeper.buckets


def test_an_older_copy_in_its_place_ends_the_keeper_for_a_reload(live, tmp_path):
    keeper, path, t = live
    copy = tmp_path / "older.db"
    _copy(path, copy)
    keeper.store.upsert([RowWrite(key="after-the-copy", route="pages", due_at=NOW)], now=NOW)
    t += 0.01
    keeper.tick(t)
    _restore(copy, path)
    with pytest.raises(KeeperReload, match="went backwards"):
        _until(keeper, t, lambda: False)
    assert keeper.stats.store["reloads"] == 1


def test_the_repair_walk_removes_what_the_table_lacks_but_not_a_row_written_after_it_passed(
    segments, node_name, tmp_path
):
    """Two keys the copy holds and the table does not, both before the
    walk's first chunk ends; one is then written to the table (after the
    walk passed its place): the walk removes the other only."""
    store = open_store(f"sqlite:///{tmp_path / 'schedule.db'}")
    store.upsert(_rows(25_000), now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    t = _until(keeper, NOW, lambda: keeper.status == "live" and keeper.exact, step=0.01)
    for key in ("aaa-written-later", "aab-never"):
        keeper.buckets.apply(key, 1, "pages", None, False, NOW)
    keeper._feed_gap(keeper.feed_seq + 2, t)  # as a gap in the log would
    t = _until(keeper, t, lambda: keeper._verify is not None and keeper._verify.filling is None
               and keeper._verify.after is not None, step=0.001)  # fmt: skip
    store.upsert([RowWrite(key="aaa-written-later", route="pages", due_at=NOW)], now=NOW)
    t = _until(keeper, t, lambda: keeper.exact, step=0.001)
    assert "aaa-written-later" in keeper.buckets and "aab-never" not in keeper.buckets
    assert keeper.stats.verify["last_repairs"] == 1
    assert _keeper_view(keeper) == _table(store)
    store.close()


def test_a_store_over_the_network_is_reopened_off_the_loop(live):
    """A store reopened over a network (PostgreSQL: ``reopen_off_loop``)
    is reopened on a thread of its own: while its connect waits (a cut not
    healed yet), every tick returns at once and the keeper goes on serving
    its copy (a fleet keeper's heartbeat runs in that loop); one reopen is
    under way at a time; once it answers, the feed resumes."""
    keeper, path, t = live
    gate = threading.Event()
    store = keeper.store
    real_reopen = store.reopen
    calls: list[float] = []

    def connect_into_the_cut():
        calls.append(time.monotonic())
        gate.wait(30)
        return real_reopen()

    store.reopen = connect_into_the_cut  # type: ignore[method-assign]
    store.reopen_off_loop = True  # type: ignore[misc]
    away = path.with_name("away.db")
    os.rename(path, away)
    t += STORE_CHECK_S
    keeper.tick(t)
    assert keeper._outage is not None
    os.rename(away, path)
    slowest = 0.0
    for _ in range(20):
        t = max(t + 0.05, keeper._outage.next_try)
        began = time.monotonic()
        keeper.tick(t)
        slowest = max(slowest, time.monotonic() - began)
        assert keeper._outage is not None and not keeper.exact
    assert slowest < 0.5, f"a tick waited {slowest:.2f} s on the reopen"
    assert len(calls) == 1  # one reopen under way, not one a tick
    gate.set()
    reopening = keeper._outage.reopening
    assert reopening is not None
    wait_for(reopening.done, 10, "the reopen on its thread")
    _until(keeper, t, lambda: keeper.exact)
    assert keeper.stats.store["last_verdict"] == "intact"
    assert _keeper_view(keeper) == _table(keeper.store)
