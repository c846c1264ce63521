"""A fleet keeper restarted under another ownership than its saved counts
were taken under (docs/accounting.md, "After a restart of the keeper";
docs/fleet.md, "A restart counts what moved"): two keepers driven in this
process, one tick at a time, over one real PostgreSQL database (the shared
schedule and change log, the meta per node); the live list is handed to
each keeper as its loop would (``reown``), time is passed in.

Each test checks the input law of both nodes, received = waiting +
withdrawn (no lease table here: nothing is routed), and fails without the
fix: a node back alone first loaded the other's due rows without counting
them received and then dropped them as withdrawn (−1 each, for good), a
node whose last save was taken alone kept the other's rows in its received
(+1 each), and a replay counted the changes to the other node's keys.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from keeper.owners import Ownership
from keeper.process import LOAD_CHUNK, Keeper
from keeper.report import RECEIVED_META
from node.config import Config
from node.core.rows import RowWrite
from node.store.postgres import PostgresStore
from shm.ready import ReadySet
from shm.state import StateBuffer
from tests import pg

pytestmark = pytest.mark.timeout(60)

DAY_S = 86_400.0


class Member:
    """One fleet node's keeper, in this process: its own store connection
    (the meta is per node) and its own segments. ``start`` is a restart
    when a keeper ran before: a new keeper over the same store, as after a
    kill -9 or a clean stop (neither saves anything more)."""

    def __init__(self, pg_url: str, tmp_path, name: str) -> None:
        self.name = name
        self.store = PostgresStore(pg_url, node_name=name)
        self.ready = ReadySet.create(name, 500)
        self.state = StateBuffer.create(name, started_at=time.time())
        self.config = Config(name=name, data_dir=tmp_path / name, workers=1, ready_size=500,
                             state_interval_s=1000)  # fmt: skip
        self.keeper: Keeper | None = None

    def start(self, names: list[str], now: float) -> Keeper:
        keeper = self.keeper = Keeper(self.config, self.store, self.ready, self.state)
        keeper.reown(names, now)  # the loop's first heartbeat comes before the load
        keeper.start(now)
        self.settle(now)
        return keeper

    def settle(self, now: float) -> None:
        """Tick until live, exact and no walk under way (a membership
        change's walk included)."""
        keeper = self.keeper
        assert keeper is not None
        for _ in range(2000):
            keeper.tick(now)
            if keeper.status == "live" and keeper.exact and keeper._verify is None:
                return
        raise AssertionError(f"{self.name}: not settled: {keeper.status} {keeper.exact}")

    def reown(self, names: list[str], now: float) -> None:
        assert self.keeper is not None and self.keeper.reown(names, now)
        self.settle(now)

    def save(self, now: float) -> None:
        """A state write: the counts into the node's meta."""
        assert self.keeper is not None
        self.keeper.write_state(now)

    def gap(self, now: float) -> int:
        """The input law's gap: received - (waiting + withdrawn)."""
        keeper = self.keeper
        assert keeper is not None
        keeper.tick(now)
        due = keeper.buckets.counts(now)["due"]["total"]
        return keeper.received() - due - keeper.withdrawn_total()

    def stop(self) -> None:
        self.keeper = None

    def close(self) -> None:
        self.keeper = None
        for seg in (self.ready, self.state):
            seg.close()
        ReadySet.unlink(self.name)
        StateBuffer.unlink(self.name)
        self.store.close()


@pytest.fixture
def fleet(pg_url, tmp_path) -> Iterator[tuple[Member, Member, PostgresStore]]:
    """Two members, ``a`` and ``b`` (names in that order), and a writer
    from outside, over an emptied database."""
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    tag = uuid.uuid4().hex[:8]
    a = Member(pg_url, tmp_path, f"a-{tag}")
    b = Member(pg_url, tmp_path, f"b-{tag}")
    outside = PostgresStore(pg_url)
    try:
        yield a, b, outside
    finally:
        outside.close()
        a.close()
        b.close()


def _seed(outside: PostgresStore, t0: float, n: int = 40) -> list[str]:
    """``n`` rows due an hour ago, ``n`` due in 30 min, ``n`` due in a day."""
    keys = []
    rows = []
    for i, due_at in enumerate((t0 - 3600, t0 + 1800, t0 + DAY_S)):
        for j in range(n):
            key = f"r{i}-{j}"
            keys.append(key)
            rows.append(RowWrite(key=key, route="pages", cadence_s=3600, due_at=due_at))
    outside.upsert(rows, now=t0)
    return keys


def _due_keys(store: PostgresStore, now: float) -> list[str]:
    """The keys of the rows due at ``now``, walked from the table."""
    rows, _bad, _after = store.walk_schedule(None, 100_000)
    return [row[0] for row in rows if int(row[5] // 60) <= int(now // 60)]


def _of(names: list[str], node: str, keys: list[str]) -> list[str]:
    return Ownership(names, node).mine(keys)


def _write_some(outside: PostgresStore, names: list[str], node: str, keys: list[str],
                t0: float, round_: int) -> None:  # fmt: skip
    """Writes to ``node``'s keys among ``names`` (other rows each round):
    due rows inserted, a due one deleted, a due one moved to tomorrow, one
    due tomorrow made due."""
    inserted = [f"new-{round_}-{i}" for i in range(200)]
    new = _of(names, node, inserted)[:5]
    outside.upsert([RowWrite(key=k, route="pages", due_at=t0 - 60) for k in new], now=t0)
    now_due = [k for k in _of(names, node, keys) if k.startswith("r0-")]
    later = [k for k in _of(names, node, keys) if k.startswith("r2-")]
    outside.delete([now_due[2 * round_]])
    outside.upsert([RowWrite(key=now_due[2 * round_ + 1], route="pages", due_at=t0 + DAY_S)],
                   now=t0)  # fmt: skip
    outside.upsert([RowWrite(key=later[round_], route="pages", due_at=t0 - 30)], now=t0)


def test_a_node_back_alone_first_counts_the_rows_it_gained_and_both_stay_balanced(fleet):
    """The hand-made case of issue 18: both nodes stop, one comes back
    alone first (it owns every row), then the other joins. The one whose
    last save was taken alone (its peer had left first) comes back owning
    about half of what it saved. Rows are written while both are down, to
    both nodes' keys, and the rows due in 30 min come due meanwhile: some
    were the first's (crossed, held), some the second's (moved in to the
    first; moved out of the second, +1/+1)."""
    a, b, outside = fleet
    t0 = time.time()
    both = [a.name, b.name]
    keys = _seed(outside, t0)
    a.start(both, t0)
    b.start(both, t0)
    a.save(t0)
    b.save(t0)
    assert (a.gap(t0), b.gap(t0)) == (0, 0)
    # a stops first (it leaves): b alone walks a's rows in, saves, stops.
    a.stop()
    b.reown([b.name], t0 + 5)
    b.save(t0 + 5)
    assert b.gap(t0 + 5) == 0
    saved_alone = b.store.get_meta(RECEIVED_META)
    b.stop()
    # Written while both are down, to both nodes' rows.
    _write_some(outside, both, a.name, keys, t0, 0)
    _write_some(outside, both, b.name, keys, t0, 1)
    # a comes back alone after the rows due in 30 min came due.
    t1 = t0 + 1860
    due = _due_keys(outside, t1)
    a.start([a.name], t1)
    assert a.gap(t1) == 0
    assert a.keeper.stats.load["moved_in"] == len(_of(both, b.name, due))  # b's, gained
    # b comes back: a drops b's rows; b finds a's rows gone.
    t2 = t1 + 10
    b.start(both, t2)
    a.reown(both, t2)
    assert (a.gap(t2), b.gap(t2)) == (0, 0)
    assert b.keeper.stats.load["moved_out"] == len(_of(both, a.name, due))
    # Each save names the ownership its counts were taken under.
    assert saved_alone.get("nodes") == [b.name]
    a.save(t2)
    b.save(t2)
    assert b.store.get_meta(RECEIVED_META).get("nodes") == both
    # A restart under the same ownership changes nothing.
    a.stop()
    a.start(both, t2 + 5)
    assert a.gap(t2 + 5) == 0 and a.keeper.stats.load["moved_in"] == 0


def test_a_restart_replays_only_the_changes_to_its_own_keys(fleet):
    """Writes after a node's last save to both nodes' keys, then that
    node's keeper restarts (kill -9: nothing saved) under the same
    ownership: its replay counts its own keys' changes only."""
    a, b, outside = fleet
    t0 = time.time()
    both = [a.name, b.name]
    keys = _seed(outside, t0)
    a.start(both, t0)
    b.start(both, t0)
    a.save(t0)
    b.save(t0)
    _write_some(outside, both, b.name, keys, t0, 0)
    _write_some(outside, both, a.name, keys, t0, 1)
    b.settle(t0 + 1)
    assert b.gap(t0 + 1) == 0
    a.stop()
    a.start(both, t0 + 2)
    assert (a.gap(t0 + 2), b.gap(t0 + 2)) == (0, 0)


def test_a_rolling_restart_with_writes_while_each_is_down_stays_balanced(fleet):
    """Stop one node (the other takes its rows), write to both nodes' keys,
    start it again (it takes its rows back); then the other. Each comes
    back under the ownership of its last save: its replay counts its own
    keys' writes only. The rows due in 30 min come due while the second is
    down: counted once on each node, for the rows it holds."""
    a, b, outside = fleet
    t0 = time.time()
    both = [a.name, b.name]
    keys = _seed(outside, t0)
    a.start(both, t0)
    b.start(both, t0)
    a.save(t0)
    b.save(t0)
    # a down: b alone.
    a.stop()
    b.reown([b.name], t0 + 5)
    b.save(t0 + 5)
    _write_some(outside, both, a.name, keys, t0, 0)
    _write_some(outside, both, b.name, keys, t0, 1)
    b.settle(t0 + 6)
    assert b.gap(t0 + 6) == 0
    a.start(both, t0 + 10)
    b.reown(both, t0 + 10)
    assert (a.gap(t0 + 10), b.gap(t0 + 10)) == (0, 0)
    a.save(t0 + 10)
    b.save(t0 + 10)
    # b down: a alone; the rows due in 30 min come due meanwhile.
    b.stop()
    a.reown([a.name], t0 + 15)
    a.save(t0 + 15)
    _write_some(outside, both, a.name, keys, t0, 2)
    _write_some(outside, both, b.name, keys, t0, 3)
    a.settle(t0 + 16)
    t1 = t0 + 1860
    b.start(both, t1)
    a.reown(both, t1)
    assert (a.gap(t1), b.gap(t1)) == (0, 0)


def test_no_count_is_saved_while_a_membership_walk_runs(fleet):
    """A membership change drops rows at once and walks the gained ones in
    later: a save in between would name the new ownership without the
    gained rows' occurrences in it, and a keeper killed then would come
    back short. The save waits for the walk; a successor counts from the
    one before."""
    a, b, outside = fleet
    t0 = time.time()
    both = [a.name, b.name]
    _seed(outside, t0)
    a.start(both, t0)
    b.start(both, t0)
    b.save(t0)
    saved = b.store.get_meta(RECEIVED_META)
    a.stop()
    assert b.keeper.reown([b.name], t0 + 5)  # not walked yet
    b.save(t0 + 5)
    assert b.store.get_meta(RECEIVED_META) == saved
    b.stop()  # killed before the walk ended
    b.start(both, t0 + 10)
    assert b.gap(t0 + 10) == 0


def test_a_membership_change_during_the_restart_load_is_counted_once(fleet):
    """Both nodes restart at once: b sees itself alone when it starts
    (it loads every row), then a in the list while its load runs (it drops
    a's rows, walks them in no more). The rows it left out or dropped that
    it owned at its save are counted at the load's end."""
    a, b, outside = fleet
    t0 = time.time()
    both = [a.name, b.name]
    n = LOAD_CHUNK // 2  # 1.5 chunks in all: the load takes two ticks
    _seed(outside, t0, n)
    a.start(both, t0)
    b.start(both, t0)
    a.save(t0)
    b.save(t0)
    a.stop()
    b.reown([b.name], t0 + 5)  # a left: b holds every row, and saves so
    b.save(t0 + 5)
    b.stop()
    keeper = b.keeper = Keeper(b.config, b.store, b.ready, b.state)
    keeper.reown(both, t0 + 10)  # b comes back with a in the list
    keeper.start(t0 + 10)
    keeper.tick(t0 + 10)
    assert keeper.status == "loading"
    keeper.reown([b.name], t0 + 10)  # a gone again while b loads
    keeper.tick(t0 + 10)
    keeper.reown(both, t0 + 10)  # and back
    b.settle(t0 + 10)
    a.start(both, t0 + 10)
    assert (a.gap(t0 + 10), b.gap(t0 + 10)) == (0, 0)


def test_a_key_moved_out_whose_result_is_written_back_during_the_load_is_no_withdrawal(fleet):
    """A node killed at a membership change restarts under the new list: a
    key it owned at its save, now the other node's, was granted and its
    result made durable before the kill. The restarted ledger's recovery
    writes the result back and ends the lease while the keeper loads,
    after the load read the row still due: the load's end drains the feed
    and replays through it, so the write-back shows and the key, routed,
    is not counted moved out as withdrawn too (a case the partition
    campaign's kill at a membership change plays)."""
    from node.store.base import WriteBack
    from shm.leases import LeaseTable, Outcome

    a, b, outside = fleet
    t0 = time.time()
    _seed(outside, t0)
    # A second load chunk, read after the first: rows due tomorrow, keyed after the rest.
    outside.upsert([RowWrite(key=f"z-{i:05d}", route="pages", due_at=t0 + DAY_S)
                    for i in range(LOAD_CHUNK + 100)], now=t0)  # fmt: skip
    leases = LeaseTable.create(a.name, capacity=4096, max_misses=3)
    try:
        a.start([a.name], t0)  # alone: every row is a's
        a.save(t0)
        both = [a.name, b.name]
        moving = _of(both, b.name, _due_keys(outside, t0))
        key = moving[0]
        version = outside.get(key).version
        lease = leases.grant(key, "gpu", 600, t0, 3600, version=version)
        a.stop()  # kill -9: nothing more saved
        keeper = a.keeper = Keeper(a.config, a.store, a.ready, a.state, leases=leases)
        keeper.reown(both, t0 + 1)
        keeper.start(t0 + 1)
        keeper.tick(t0 + 1)  # the first chunk read: the key still due
        assert keeper.status == "loading"
        # The restarted ledger's recovery: written back, then the lease ended.
        assert a.store.write_back_many([WriteBack(key, t0 + 3600, version, 1, t0 + 1)]) != [None]
        assert leases.complete(key, lease.lease_id, t0 + 1) is Outcome.COMPLETED
        a.settle(t0 + 1)
        assert keeper.stats.load["moved_out"] == len(moving) - 1
        # received = routed (the one lease) + waiting + withdrawn
        due = keeper.buckets.counts(t0 + 1)["due"]["total"]
        assert keeper.received() == 1 + due + keeper.withdrawn_total()
    finally:
        leases.close()
        LeaseTable.unlink(a.name)
