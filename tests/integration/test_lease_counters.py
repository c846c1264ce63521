"""The lease table's lifetime counters never split from the states they count.

Every change that counts (a grant, a release, a sweep's expiry, a result)
publishes its new state and its count in one call into C
(``lease_publish_counted``, shm/_claim.h): this process's counter shard's
journal names the publish before the swap and is cleared after the count.
A claimer killed -9 between the two used to leave ``grants`` one short for
good (``grants 0, live 1``, then ``balanced: false`` once the lease expired).

Each test stops a real child process at one instruction of that call (the
test build of the extensions: ``QUEUE_NODE_TEST_LEASE_STOP``, compiled in by
``-DQUEUE_NODE_TEST_STOPS`` only), kills it -9 there, and checks that what
recovery reads balances to the item: ``grants = live + completed + released +
expired`` in the table, and the ledger's law (``workers.ledger.accounting.build``)
``balanced``.

The ``stops_build`` fixture (tests/conftest.py, tests/procs.py) builds that
test build once a session; the other lease test modules use it too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from node.core.names import shm_segment_name
from shm import leases, segment
from shm.leases import Lease, LeaseTable, Outcome
from tests.procs import proc_state, wait_until
from workers.ledger.accounting import LogCounts, build

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 20.0
T0 = 1_700_000_000.0
LATER = T0 + 1e6

pytestmark = pytest.mark.timeout(90)





@pytest.fixture
def node():
    name = f"t{uuid.uuid4().hex[:12]}"
    yield name
    segment.unlink(shm_segment_name(name, "leases"))






# One change, in a child: grant (in C, or with _py in Python), release,
# complete or expire.
_CHANGE = textwrap.dedent(
    """
    import sys
    from shm.leases import LeaseTable
    op, node, key, lease_id, now = sys.argv[1:6]
    lease_id, now = int(lease_id), float(now)
    table = LeaseTable.attach(node)
    if op.endswith("_py"):
        table._granter.release()
        table._granter = None
    if op.startswith("grant"):
        got = table.grant(key, "child", 60, now, 3600)
    elif op == "release":
        got = table.release(key, lease_id, now, "gave up")
    elif op == "complete":
        got = table.complete(key, lease_id, now)
    else:
        got = table.expire(now)
    print(repr(got), flush=True)
    """
)


def _child(node: str, stops: Path, op: str, key: str, lease_id: int, now: float, stop: str):
    """The child, started and stopped at ``stop`` (``<point>:stop``; None:
    run to the end)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), QUEUE_NODE_TEST_BUILD=str(stops))
    if stop:
        env["QUEUE_NODE_TEST_LEASE_STOP"] = f"{stop}:stop"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHANGE, op, node, key, str(lease_id), repr(now)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if stop:
        wait_until(
            lambda: proc_state(child.pid) == "T" or child.poll() is not None,
            f"the child to stop at {stop}",
        )
        assert child.poll() is None, f"the child never reached {stop}: {child.communicate()}"
    return child


def _kill(child: subprocess.Popen) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=DEADLINE_S)
    assert child.returncode == -signal.SIGKILL


def _updating(table: LeaseTable) -> int:
    """Slots held mid-change, read from the state words alone (``stats``
    would read the counters, and so settle the shards, first)."""
    return len(table._view.scan_codes(leases.STATES, table.capacity, 1 << leases.UPDATING))


def _law(table: LeaseTable) -> dict:
    """The ledger's accounting of this table (the log's results are the
    table's accepted results), after asserting the table's own identity:
    every grant is live or ended exactly once."""
    c = table.counters()
    live = table.live_count()
    assert c["grants"] == live + c["completed"] + c["released"] + c["expired"], (c, live)
    finished = c["completed"] + c["late_expired"] + c["late_released"]
    a = build(c, live, LogCounts(finished, 0, 0, finished), since=0.0)
    assert a["balanced"], a
    return c


def _setup(table: LeaseTable, op: str) -> tuple[str, int, float]:
    """The table before the child's change: (key, lease id, now) for it."""
    if op.startswith("grant") and op.split("_")[1] == "again":  # the key's slot is idle
        lease = table.grant("k", "parent", 60, T0, 3600)
        assert table.complete("k", lease.lease_id, T0) is Outcome.COMPLETED
        return "k", 0, T0
    if op.startswith("grant"):
        return "k", 0, T0
    lease = table.grant("k", "parent", 10, T0, 3600)
    assert isinstance(lease, Lease)
    if op == "late_released":
        assert table.release("k", lease.lease_id, T0) is Outcome.RELEASED
    if op == "late_expired":
        assert [x.key for x in table.expire(T0 + 100)] == ["k"]
    return "k", lease.lease_id, T0 + 100


# What the child's change counts, and the op the child runs for it.
CHANGES = {
    "grant_new": ("grants", "grant"),
    "grant_again": ("grants", "grant"),
    "grant_new_py": ("grants", "grant_py"),
    "grant_again_py": ("grants", "grant_py"),
    "release": ("released", "release"),
    "expire": ("expired", "expire"),
    "complete": ("completed", "complete"),
    "late_released": ("late_released", "complete"),
    "late_expired": ("late_expired", "complete"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_killed_between_its_publish_and_its_count_is_counted_once(
    node, stops_build, change
):
    counter, op = CHANGES[change]
    with LeaseTable.create(node, capacity=64, max_misses=4) as table:
        key, lease_id, now = _setup(table, change)
        before = _law(table)
        child = _child(node, stops_build, op, key, lease_id, now, "published")
        try:
            # Inside the window: the new state is there, its count is not
            # (the child lives: nobody settles for it).
            assert table.stats()["slots"]["updating"] == 0
            assert table.counters() == before
            live = table.live_count()
            assert live == (1 if op.startswith("grant") else 0)
        finally:
            _kill(child)
        after = _law(table)
        assert after == {**before, counter: before[counter] + 1}
        assert _law(table) == after, "settled twice"
        assert table.live_count() == live


def test_a_dead_claimers_shard_taken_over_by_a_new_process_keeps_its_count(node, stops_build):
    """The other way a split count is repaired: the next process that needs
    a shard takes the dead claimer's over, and settles it first; the
    supervisor's reattach reads the same counters."""
    with LeaseTable.create(node, capacity=64) as table:
        table.grant("mine", "parent", 60, T0, 3600)  # this process has shard 0
        _kill(_child(node, stops_build, "grant", "k", 0, T0, "published"))
        assert table.stats()["shards"] == 2
        other = _child(node, stops_build, "grant", "k2", 0, T0, None)
        out, err = other.communicate(timeout=DEADLINE_S)
        assert other.returncode == 0, err
        assert table.stats()["shards"] == 2, "the dead claimer's shard was not reused"
    with LeaseTable.create(node, capacity=64) as table:  # the supervisor, after a crash
        assert table.segment.reattached
        assert table.counters()["grants"] == 3 == table.live_count()
        _law(table)


@pytest.mark.parametrize("reader_first", [True, False])
def test_a_change_killed_before_its_swap_counts_nothing(node, stops_build, reader_first):
    """Killed with its journal written and its swap not made: the slot is
    the dead child's (UPDATING), rolled back by whoever meets it, and the
    journal counts nothing, whether a reader settles it before the rollback
    or the rollback clears it first."""
    with LeaseTable.create(node, capacity=64) as table:
        lease = table.grant("k", "parent", 10, T0, 3600)
        before = _law(table)
        _kill(_child(node, stops_build, "release", "k", lease.lease_id, T0, "journaled"))
        assert _updating(table) == 1
        if reader_first:
            assert table.counters() == before
        assert table.expire(T0) == []  # the sweep rolls the dead child's slot back
        assert _updating(table) == 0
        assert _law(table) == before
        assert [x.lease_id for x in table.live()] == [lease.lease_id]


def test_a_change_killed_after_its_count_counts_once(node, stops_build):
    """Killed with its count made and its journal not yet cleared: the
    journal's target says the count is in; it is not made again."""
    with LeaseTable.create(node, capacity=64) as table:
        before = _law(table)
        _kill(_child(node, stops_build, "grant", "k", 0, T0, "counted"))
        after = _law(table)
        assert after == {**before, "grants": 1} == _law(table)


def test_threads_of_one_process_count_in_one_shard_without_losing_a_count(node):
    """A process counts in one shard (its counts are plain stores), from
    every thread: the count is made inside one call into C, which holds the
    GIL, so two threads never interleave there."""
    per_thread, threads = 1500, 4
    with LeaseTable.create(node, capacity=1024) as table:
        python_path = LeaseTable.attach(node)  # a second table object: the same shard
        python_path._granter.release()
        python_path._granter = None

        def work(t: LeaseTable, prefix: str) -> None:
            for i in range(per_thread):
                lease = t.grant(f"{prefix}-{i % 50}", "c", 60, T0, 3600)
                assert isinstance(lease, Lease)
                if i % 3:
                    assert t.complete(lease.key, lease.lease_id, T0) is Outcome.COMPLETED
                else:
                    assert t.release(lease.key, lease.lease_id, T0 - 1e6) is Outcome.RELEASED

        workers = [
            threading.Thread(target=work, args=(python_path if i % 2 else table, f"t{i}"))
            for i in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(DEADLINE_S)
        c = _law(table)
        assert table.stats()["shards"] == 1
        assert c["grants"] == per_thread * threads
        assert c["released"] == threads * len(range(0, per_thread, 3))
        python_path.close()
