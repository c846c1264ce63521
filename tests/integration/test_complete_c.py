"""The ledger's lease work in C (shm/_complete.c) against the Python methods.

``LeaseTable.complete_many`` and ``peek_many`` do a group of results in one
call into C, each item step for step ``complete`` / ``peek``, and hand an
item they do not finish (a slot held mid-change, a long key, ...) to the
Python method. So: the same operations on two tables, one completing and
peeking in C and one looping the Python methods, give the same answers and
leave the same bytes (counters and shards included); a sealed table refuses
alike and changes nothing; a key another live process holds is BUSY after
the same wait; a dead holder's slot is rolled back; and a completion killed
-9 at each of its instructions (the test build's stops) is counted once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.core.errors import NodeRestarted
from node.core.names import shm_segment_name
from shm import leases, segment
from shm.leases import Lease, LeaseTable, Outcome
from shm.leases.protocol import TAG_MASK, _start_ticks
from tests.procs import proc_state, wait_until
from workers.ledger.accounting import LogCounts, build

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 20.0
T0 = 1_700_000_000.0
LONG = "l" * 300  # over the 208 bytes a slot holds inline: the Python path's

pytestmark = pytest.mark.timeout(120)


def _python_only(t: LeaseTable) -> LeaseTable:
    t._granter.release()
    t._granter = None
    return t


@pytest.fixture
def pair():
    """Two tables made alike: ``c`` completes and peeks in C, ``py`` loops
    the Python methods (and grants in Python: the grants are alike,
    tests/integration/test_grant_c.py)."""
    names = [f"t{uuid.uuid4().hex[:12]}" for _ in range(2)]
    tables = [LeaseTable.create(n, capacity=16, long_blocks=2, max_misses=3, now=T0) for n in names]
    _python_only(tables[1])
    yield tables
    for t, n in zip(tables, names, strict=True):
        t.close()
        segment.unlink(shm_segment_name(n, "leases"))


KEYS = ["a", "b", "key-ü", "c" * 208, "d" * 209, "e" * 300 + "ö" * 100] + [
    f"k{i}" for i in range(12)
]
# Which lease id an item of a group names: the key's last, one before it (an
# older lease: superseded), one after (unknown), an earlier lease of the key,
# or 1.
WHICH = st.sampled_from(["last", "last", "last", "older", "newer", "earlier", "one"])
GROUP = st.lists(st.tuples(st.sampled_from(KEYS), WHICH), min_size=1, max_size=12)
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["grant", "grant", "grant", "release", "expire", "clear"]),
            st.sampled_from(KEYS),
            st.integers(min_value=0, max_value=400),  # seconds after T0
        ),
        st.tuples(st.sampled_from(["complete_many", "peek_many"]), GROUP, st.integers(0, 400)),
    ),
    max_size=60,
)


def _slots(t: LeaseTable) -> bytes:
    """Everything a change may write: counters, states, hashes, maxdist,
    slots, blocks and the counter shards."""
    return bytes(t.mm[40 : t._lay.size])


def _lease_id(which: str, key: str, history: dict[str, list[int]]) -> int:
    ids = history.get(key, [])
    if not ids or which == "one":
        return 1
    return {
        "last": ids[-1],
        "older": ids[-1] - 1,
        "newer": ids[-1] + 1,
        "earlier": ids[0],
    }[which]


@given(ops=OPS)
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_c_and_python_complete_and_peek_answer_alike_and_leave_the_same_bytes(pair, ops):
    c, py = pair
    for t in pair:  # a fresh start for every example: free every slot again
        t.mm[leases.STATES : t._lay.blocks] = bytes(t._lay.blocks - leases.STATES)
        t.mm[40:128] = bytes(88)
    history: dict[str, list[int]] = {}
    for op, arg, dt in ops:
        now = T0 + dt
        if op == "grant":
            a, b = (t.grant(arg, "consumer-ü" * 4, 10.0, now, 100.0, version=dt) for t in pair)
            assert a == b, (op, arg)
            if a:
                history.setdefault(arg, []).append(a.lease_id)
        elif op == "release":
            lease_id = _lease_id("last", arg, history)
            assert c.release(arg, lease_id, now, "err") == py.release(arg, lease_id, now, "err")
        elif op == "expire":
            assert c.expire(now) == py.expire(now)
        elif op == "clear":
            assert c.clear_on_write(arg) == py.clear_on_write(arg)
        else:
            items = [(key, _lease_id(which, key, history)) for key, which in arg]
            if op == "peek_many":
                got = c.peek_many(items)
                assert got == py.peek_many(items), items
                assert got == [c.peek(key, lease_id) for key, lease_id in items]
            else:
                assert c.complete_many(items, now) == py.complete_many(items, now), items
        assert _slots(c) == _slots(py), (op, arg)


def test_a_group_mixes_every_answer_and_the_python_paths_items(pair):
    c, py = pair
    outs = []
    for t in pair:
        a = t.grant("a", "c", 10.0, T0, 100.0, version=7)
        b = t.grant("b", "c", 10.0, T0, 100.0)
        long = t.grant(LONG, "c", 10.0, T0, 100.0)
        gone = t.grant("gone", "c", 10.0, T0, 100.0)
        assert t.release("gone", gone.lease_id, T0) is Outcome.RELEASED
        items = [
            ("a", a.lease_id),
            ("b", b.lease_id - 1),  # an older lease: superseded
            (LONG, long.lease_id),  # the Python path's, mid-group
            ("a", a.lease_id),  # again: a repeat
            ["b", b.lease_id],  # not a tuple: the Python path's too
            ("gone", gone.lease_id),  # released: late
            ("nothing", 5),
            ("b", -1),  # not an id C takes: the Python path's
        ]
        peeked = t.peek_many(items)
        lease_a = Lease("a", a.lease_id, "c", T0, T0 + 10, 0, 7, 100.0)
        assert peeked[0] == (Outcome.COMPLETED, lease_a)
        outs.append((peeked, t.complete_many(iter(items), T0)))
    assert outs[0] == outs[1]
    assert outs[0][1] == [
        Outcome.COMPLETED,
        Outcome.SUPERSEDED,
        Outcome.COMPLETED,
        Outcome.REPEAT,
        Outcome.COMPLETED,
        Outcome.LATE,
        Outcome.UNKNOWN,
        Outcome.SUPERSEDED,
    ]
    assert _slots(c) == _slots(py)
    counters = c.counters()
    assert (counters["completed"], counters["late_released"]) == (3, 1)
    assert c.complete_many([], T0) == [] and c.peek_many([]) == []


def test_the_c_methods_check_their_arguments(pair):
    g = pair[0]._granter
    answers = tuple(Outcome)[:5]
    with pytest.raises(TypeError):
        g.complete_many((("a", 1),), 0, leases.owner_bits(), 0, answers)  # not a list
    with pytest.raises(TypeError):
        g.peek_many([("a", 1)], 0, Lease, answers[:4])
    with pytest.raises(TypeError):
        g.peek_many([("a", 1)], 0, dict, answers)
    with pytest.raises(ValueError):
        g.peek_many([("a", 1)], 2, Lease, answers)
    with pytest.raises(ValueError):
        pair[0].complete_many([("", 1)], T0)  # as complete: a key is 1 to 1024 bytes


# -- the seal -----------------------------------------------------------------------


def test_a_sealed_table_refuses_a_group_at_its_first_change_and_changes_nothing(pair):
    c, py = pair
    for t in pair:
        live = t.grant("live", "c", 60, T0, 3600)
        t.grant("other", "c", 60, T0, 3600)
        t.seal()
        before = _slots(t)
        # The unknown key changes nothing and is answered; the live one is refused.
        with pytest.raises(NodeRestarted):
            t.complete_many([("nothing", 3), ("live", live.lease_id), ("other", 1)], T0)
        assert _slots(t) == before
        assert t.peek_many([("live", live.lease_id)])[0][0] is Outcome.COMPLETED  # reads work
    assert _slots(c) == _slots(py)


def test_a_table_object_without_a_shard_takes_one_or_is_refused_when_sealed(node_name):
    with LeaseTable.create(node_name, capacity=64) as table:
        lease = table.grant("k", "c", 60, T0, 3600)  # this process has its shard
        with LeaseTable.attach(node_name) as other:  # a second mapping: no shard set yet
            assert other.complete_many([("k", lease.lease_id)], T0) == [Outcome.COMPLETED]
            assert table.counters()["completed"] == 1
            again = table.grant("k", "c", 60, T0 + 1, 3600)
        with LeaseTable.attach(node_name) as third:
            table.seal()
            with pytest.raises(NodeRestarted):
                third.complete_many([("k", again.lease_id)], T0)
            assert table.peek("k", again.lease_id)[0] is Outcome.COMPLETED  # still live
    LeaseTable.unlink(node_name)


# -- a slot held mid-change by another process -------------------------------------


def _hold(table: LeaseTable, key: str, pid: int) -> tuple[int, int]:
    """Hold ``key``'s slot UPDATING in the name of process ``pid``, as its
    change would: (slot, the word it was)."""
    kb = key.encode()
    idx, w, _ = table._lookup(kb, leases._hash(kb))
    owner = pid << 9 | ((_start_ticks(pid) or 0) & TAG_MASK) << 31
    own = (
        leases.UPDATING
        | (w & 15) << 4
        | (w & 0x100)
        | owner
        | (((w >> leases.SEQ_SHIFT) + 1) & leases.SEQ_MASK) << leases.SEQ_SHIFT
    )
    assert table._view.cas64(leases.STATES + 8 * idx, w, own) == w
    return idx, w


def test_a_key_a_live_process_holds_is_busy_and_a_dead_ones_is_rolled_back(node_name):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with LeaseTable.create(node_name, capacity=64) as table:
            busy = table.grant("busy", "c", 60, T0, 3600)
            free = table.grant("free", "c", 60, T0, 3600)
            _hold(table, "busy", holder.pid)
            items = [("busy", busy.lease_id), ("free", free.lease_id)]
            # A reader sees what the slot was: its current record still stands.
            assert [o for o, _ in table.peek_many(items)] == [Outcome.COMPLETED] * 2
            t0 = time.monotonic()
            assert table.complete_many(items, T0) == [Outcome.BUSY, Outcome.COMPLETED]
            assert time.monotonic() - t0 >= leases.BUSY_WAIT_S  # waited it out, as complete
            reclaimed = table.stats()["reclaimed"]
            holder.kill()
            holder.wait(timeout=DEADLINE_S)
            assert table.complete_many(items, T0) == [Outcome.COMPLETED, Outcome.REPEAT]
            assert table.stats()["reclaimed"] == reclaimed + 1
            c = table.counters()
            assert (c["grants"], c["completed"]) == (2, 2)
        LeaseTable.unlink(node_name)
    finally:
        holder.kill()
        holder.wait(timeout=DEADLINE_S)


# -- killed -9 at each instruction of a completion (the test build's stops) ------------

_CHILD = textwrap.dedent(
    """
    import sys
    from shm.leases import LeaseTable
    node, key, lease_id = sys.argv[1], sys.argv[2], int(sys.argv[3])
    table = LeaseTable.attach(node)
    table._shard()  # its counter shard, taken before the stop (a grant would stop too)
    print(repr(table.complete_many([(key, lease_id)], 1_700_000_100.0)), flush=True)
    """
)


def _law(table: LeaseTable) -> dict:
    c = table.counters()
    live = table.live_count()
    assert c["grants"] == live + c["completed"] + c["released"] + c["expired"], (c, live)
    finished = c["completed"] + c["late_expired"] + c["late_released"]
    assert build(c, live, LogCounts(finished, 0, 0, finished), since=0.0)["balanced"]
    return c


# point: whether the child's change is published (then the parent's is a repeat)
POINTS = {"update": False, "written": False, "journaled": False, "published": True,
          "counted": True}  # fmt: skip


@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("late", [False, True])
def test_a_completion_killed_at_each_point_is_counted_once(node_name, stops_build, point, late):
    counter = "late_released" if late else "completed"
    with LeaseTable.create(node_name, capacity=64) as table:
        lease = table.grant("k", "parent", 60, T0, 3600)
        if late:
            assert table.release("k", lease.lease_id, T0) is Outcome.RELEASED
        before = _law(table)
        env = dict(os.environ, PYTHONPATH=str(ROOT), QUEUE_NODE_TEST_BUILD=str(stops_build),
                   QUEUE_NODE_TEST_LEASE_STOP=f"{point}:stop")  # fmt: skip
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, node_name, "k", str(lease.lease_id)],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_until(
                lambda: proc_state(child.pid) == "T" or child.poll() is not None,
                f"the child to stop at {point}",
            )
            assert child.poll() is None, child.communicate()
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.communicate(timeout=DEADLINE_S)
        assert child.returncode == -signal.SIGKILL
        # A reader rolls back what the dead child held mid-change (before its swap).
        assert table.lookup("k")[0] == ("idle" if POINTS[point] else "held" if late else "leased")
        settled = _law(table)
        assert settled[counter] == before[counter] + POINTS[point]
        again = Outcome.REPEAT if POINTS[point] else (Outcome.LATE if late else Outcome.COMPLETED)
        assert table.complete_many([("k", lease.lease_id)], T0 + 100) == [again]
        after = _law(table)
        assert after[counter] == before[counter] + 1, "counted once"
        assert _law(table) == after
        assert table.lookup("k")[0] == "idle"
    LeaseTable.unlink(node_name)
