"""A sealed lease table: nothing is granted or changed from it any more.

The supervisor seals the table at a clean shutdown and waits for changes in
progress (``seal``, ``wait_settled``) before it saves it: a process that
outlives the node (a LocalClaimer, say) must not grant from, or change, a
table whose leases are already in the file. Every change on behalf of a
caller reads the seal after its swap took the slot, and if sealed puts the
word back and raises NodeRestarted (the C claim path: RuntimeError("sealed")).

Here: each change refused on a sealed table, in C and in Python and through
the batched claim path, leaving every byte of the table as it was; the
sweep, save and the readers still working; real processes granting while
another seals, after which the table never changes; and a grant stopped
right after taking its slot (the test build's stop), which wait_settled
waits for until it is killed, or lets it go on into the seal.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import msgpack
import pytest

from node.config import Config, RouteConfig
from node.core.errors import NodeError, NodeRestarted
from node.core.names import shm_segment_name
from node.core.rows import RowWrite
from node.store import open_store
from shm import segment
from shm.leases import SEALED, Lease, LeaseTable, Outcome, Refuse, Refused, owner_bits
from shm.ready import ReadySet
from tests.procs import proc_state, wait_until
from workers.claim import Claimer

SPAWN = multiprocessing.get_context("spawn")
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 20.0
T0 = 1_700_000_000.0
LONG = "l" * 300  # over the 208 bytes a slot holds inline: the Python grant's

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def node():
    name = f"t{uuid.uuid4().hex[:12]}"
    yield name
    segment.unlink(shm_segment_name(name, "leases"))
    ReadySet.unlink(name)






def _table_bytes(t: LeaseTable) -> bytes:
    """Everything past the common header but the seal: counters, states,
    hashes, slots, blocks, shards."""
    raw = bytes(t.mm[24 : t._lay.size])
    return raw[: SEALED - 24] + raw[SEALED - 24 + 4 :]


def _slot_bytes(t: LeaseTable) -> bytes:
    """The header's counters and every slot's bytes (all but the shards)."""
    return bytes(t.mm[40 : t._lay.shards])


def _python_only(t: LeaseTable) -> LeaseTable:
    t._granter.release()
    t._granter = None
    return t


@contextlib.contextmanager
def _populated(node: str):
    """A table with a live lease ("live"), an idle slot ("idle"), a held key
    ("held"), a parked one ("parked"), an expired lease not yet swept
    ("late"); this process has its counter shard."""
    with LeaseTable.create(node, capacity=64, max_misses=2) as t:
        leases = {key: t.grant(key, "c", 60, T0, 3600) for key in ("live", "idle", "held", "late")}
        t.complete("idle", leases["idle"].lease_id, T0)
        t.release("held", leases["held"].lease_id, T0, "miss")
        for i in range(2):
            lease = t.grant("parked", "c", 60, T0 + 10_000 * i, 3600)
            t.release("parked", lease.lease_id, T0 + 10_000 * i)
        t.renew("late", leases["late"].lease_id, 1, T0)  # expires at T0 + 1
        yield t, leases


LATER = T0 + 100_000  # every hold has passed; "late" is past its expiry

CHANGES = {
    "grant a new key in C": lambda t, _: t.grant("new", "c", 60, LATER, 3600),
    "grant an idle key in C": lambda t, _: t.grant("idle", "c", 60, LATER, 3600),
    "grant a held key past its hold in C": lambda t, _: t.grant("held", "c", 60, LATER, 3600),
    "grant a new key in Python": lambda t, _: _python_only(t).grant("new", "c", 60, LATER, 3600),
    "grant an idle key in Python": lambda t, _: _python_only(t).grant("idle", "c", 60, LATER, 3600),
    "grant a long key": lambda t, _: t.grant(LONG, "c", 60, LATER, 3600),
    "renew": lambda t, ls: t.renew("live", ls["live"].lease_id, 60, T0),
    "release": lambda t, ls: t.release("live", ls["live"].lease_id, T0),
    "complete": lambda t, ls: t.complete("live", ls["live"].lease_id, T0),
    "complete late": lambda t, ls: t.complete("held", ls["held"].lease_id, T0),
    "unhold": lambda t, _: t.unhold(["parked"]),
    "clear_on_write": lambda t, _: t.clear_on_write("held"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_sealed_table_refuses_a_change_and_changes_nothing(node, change):
    with _populated(node) as (table, leases):
        before, counters = _table_bytes(table), table.counters()
        table.seal()
        assert table.sealed
        # A second table object of this process (its shard is this process's).
        with LeaseTable.attach(node) as t:
            with pytest.raises(NodeRestarted, match="sealed"):
                CHANGES[change](t, leases)
        assert _table_bytes(table) == before
        assert table.counters() == counters
        assert table.stats()["slots"]["updating"] == table.stats()["slots"]["claiming"] == 0


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_refused_change_changes_the_table_when_unsealed(node, change):
    """The other half of the test above: unsealed, every one of those
    changes writes the table."""
    with _populated(node) as (table, leases):
        before = _table_bytes(table)
        with LeaseTable.attach(node) as t:
            CHANGES[change](t, leases)
        assert _table_bytes(table) != before


def test_a_sealed_table_still_sweeps_saves_and_answers_reads(node, tmp_path):
    with _populated(node) as (table, leases):
        table.seal()
        before = table.counters()
        # A refusal changes nothing either: it is not a change.
        assert table.grant("live", "c", 60, T0, 3600) == Refused(Refuse.LEASED)
        assert [x.key for x in table.expire(T0 + 2)] == ["late"]  # the keeper's sweep
        assert table.counters() == {**before, "expired": before["expired"] + 1}
        assert table.peek("live", leases["live"].lease_id)[0] is Outcome.COMPLETED
        assert {x.key for x in table.live()} == {"live"}
        assert table.excluded_keys(T0) == {"live", "held", "parked", "late"}
        assert table.save(tmp_path / "leases.msgpack", T0) == 4
        assert table.wait_settled(time.monotonic() + DEADLINE_S)


def _fresh_process_change(node: str, what: str, out) -> None:
    table = LeaseTable.attach(node)
    try:
        if what == "grant":
            table.grant("new", "c", 60, LATER, 3600)
            out.put("granted")
        else:
            out.put([x.key for x in table.expire(T0 + 2)])
    except NodeRestarted:
        out.put("sealed")
    table.close()


def test_a_process_new_to_a_sealed_table_changes_not_a_byte_but_still_sweeps(node):
    """A process's first counted change takes it a counter shard; on a
    sealed table only its sweep does (every other change is refused)."""
    with _populated(node) as (table, _leases):
        table.seal()
        before, counters = _table_bytes(table), table.counters()
        for what, answer in (("grant", "sealed"), ("expire", ["late"])):
            out = SPAWN.Queue()
            child = SPAWN.Process(target=_fresh_process_change, args=(node, what, out))
            child.start()
            assert out.get(timeout=DEADLINE_S) == answer
            child.join(DEADLINE_S)
            assert child.exitcode == 0
            if what == "grant":
                assert _table_bytes(table) == before
        assert table.counters() == {**counters, "expired": counters["expired"] + 1}
        assert table.stats()["shards"] == 2


def test_wait_settled_before_seal_is_an_error_and_create_unseals(node):
    with LeaseTable.create(node, capacity=16) as table:
        with pytest.raises(NodeError, match="before seal"):
            table.wait_settled(time.monotonic() + 1)
        table.seal()
    with LeaseTable.create(node, capacity=16) as table:  # reattached after a crash
        assert table.segment.reattached and not table.sealed
        assert table.grant("k", "c", 60, T0, 3600)


# -- the batched claim path (workers/claim/path.py's Claimer) ----------------------------


@contextlib.contextmanager
def _claimer(node: str, db: Path, c_path: bool):
    store = open_store(f"sqlite:///{db}")
    keys = [f"k{i}" for i in range(20)]
    store.upsert([RowWrite(key=k, route="r", due_at=T0 - 600) for k in keys], now=T0)
    ready = ReadySet.create(node, capacity=100)
    leases = LeaseTable.create(node, capacity=256, now=T0)
    config = Config(name="t", workers=1, routes={"r": RouteConfig(cadence_s=3600)})
    claimer = Claimer(config, store, ready, leases, c_path=c_path)
    versions = {row.key: row.version for row in store.get_many(keys).values()}
    ready.publish([(k, versions[k], int(T0 // 60) - 10, 1, 100.0 - i) for i, k in
                   enumerate(keys)], T0)  # fmt: skip
    try:
        yield claimer, leases
    finally:
        claimer.close()
        leases.close()
        ready.close()
        store.close()


def test_the_c_claim_path_ends_a_claim_on_a_sealed_table_changing_nothing(node, tmp_path):
    with _claimer(node, tmp_path / "s.db", c_path=True) as (claimer, leases):
        assert len(claimer.claim(2, 30.0, "c", T0)) == 2  # the path works, and has a shard
        path = claimer._claim_path()
        assert path is not None
        before, counters = _table_bytes(leases), leases.counters()
        leases.seal()
        with pytest.raises(RuntimeError, match="^sealed$") as raised:
            path.claim(5, b"c", 30.0, T0, owner_bits(), 0)
        assert raised.value.grants == []
        assert _table_bytes(leases) == before and leases.counters() == counters


def test_the_python_claim_path_raises_node_restarted_on_a_sealed_table(node, tmp_path):
    with _claimer(node, tmp_path / "s.db", c_path=False) as (claimer, leases):
        assert len(claimer.claim(2, 30.0, "c", T0)) == 2
        before = _table_bytes(leases)
        leases.seal()
        with pytest.raises(NodeRestarted):
            claimer.claim(5, 30.0, "c", T0)
        assert _table_bytes(leases) == before


def test_a_claimer_on_the_c_path_raises_node_restarted_on_a_sealed_table(node, tmp_path):
    with _claimer(node, tmp_path / "s.db", c_path=True) as (claimer, leases):
        assert len(claimer.claim(2, 30.0, "c", T0)) == 2
        leases.seal()
        with pytest.raises(NodeRestarted):
            claimer.claim(5, 30.0, "c", T0)


# -- real processes ------------------------------------------------------------------


def _granter(node: str, index: int, python: bool, out_path: str, go) -> None:
    """Grant until the table is sealed: new keys, and keys whose slots are
    idle; then write down every lease granted."""
    table = LeaseTable.attach(node)
    if python:
        _python_only(table)
    granted = []
    go.wait(DEADLINE_S)
    try:
        for i in range(10**9):
            key = f"g{index}-{i}" if i % 2 else f"idle{index}-{i // 2 % 200}"
            lease = table.grant(key, f"g{index}", 3600, T0, 7200)
            if isinstance(lease, Lease):
                granted.append((key, lease.lease_id))
                if key.startswith("idle"):  # give the idle key's slot back
                    table.complete(key, lease.lease_id, T0)
                    granted.pop()
    except NodeRestarted:
        pass
    Path(out_path).write_bytes(msgpack.packb(granted))
    table.close()


@pytest.mark.timeout(120)
def test_after_the_seal_settles_nothing_granting_in_other_processes_changes_the_table(
    node, tmp_path
):
    procs = 4
    with LeaseTable.create(node, capacity=1 << 16) as table:
        go = SPAWN.Event()
        paths = [str(tmp_path / f"granter-{i}") for i in range(procs)]
        children = [
            SPAWN.Process(target=_granter, args=(node, i, i % 2 == 1, paths[i], go))
            for i in range(procs)
        ]
        for child in children:
            child.start()
        go.set()
        wait_until(lambda: table.counters()["grants"] >= 4000, "the granters to grant")
        table.seal()
        assert table.wait_settled(time.monotonic() + DEADLINE_S)
        live = {(x.key, x.lease_id) for x in table.live(limit=1 << 16)}
        counters = table.counters()
        frozen = _table_bytes(table)
        for child in children:
            child.join(DEADLINE_S)
            assert child.exitcode == 0
        granted = set()
        for path in paths:
            granted |= {
                (key, lease_id) for key, lease_id in msgpack.unpackb(Path(path).read_bytes())
            }
        assert _table_bytes(table) == frozen, "the table changed after the seal settled"
        assert table.counters() == counters
        assert granted == live, "a grant reported was not in the table, or the other way"
        assert counters["grants"] == len(live) + counters["completed"]


_STOPPED = textwrap.dedent(
    """
    import sys
    from node.core.errors import NodeRestarted
    from shm.leases import LeaseTable, SlotTakenOver
    op, node, key, lease_id = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    table = LeaseTable.attach(node)
    if op.endswith("_py"):
        table._granter.release()
        table._granter = None
    try:
        if op.startswith("grant"):
            got = table.grant(key, "child", 60, 1_700_100_000.0, 3600)
        else:
            got = table.release(key, lease_id, 1_700_000_000.0)
    except NodeRestarted:
        got = "sealed"
    except SlotTakenOver:
        got = "taken"
    print(got if got in ("sealed", "taken") else type(got).__name__, flush=True)
    """
)

STOPPED = {
    # name: (op, key, where it stops right after taking its slot)
    "C grant of an idle key": ("grant", "idle", "update"),
    "C grant of a new key": ("grant", "new", "insert"),
    "Python grant of an idle key": ("grant_py", "idle", "update"),
    "Python grant of a new key": ("grant_py", "new", "insert"),
    "release": ("release", "live", "update"),
}


def _stopped_child(node: str, stops: Path, name: str, leases: dict) -> subprocess.Popen:
    return _stopped_child_at(node, stops, *STOPPED[name], leases)


def _stopped_child_at(
    node: str, stops: Path, op: str, key: str, point: str, leases: dict
) -> subprocess.Popen:
    lease_id = leases[key].lease_id if key in leases else 0
    child = subprocess.Popen(
        [sys.executable, "-c", _STOPPED, op, node, key, str(lease_id)],
        env=dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            QUEUE_NODE_TEST_BUILD=str(stops),
            QUEUE_NODE_TEST_LEASE_STOP=f"{point}:stop",
        ),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(
        lambda: proc_state(child.pid) == "T" or child.poll() is not None,
        f"the child to stop at {point}",
    )
    assert child.poll() is None, f"the child never reached {point}: {child.communicate()}"
    return child


@pytest.mark.parametrize("name", list(STOPPED))
def test_wait_settled_waits_for_a_change_stopped_in_its_slot_until_it_is_killed(
    node, stops_build, name
):
    with _populated(node) as (table, leases):
        before = {x.key for x in table.live()}, table.counters()
        child = _stopped_child(node, stops_build, name, leases)
        try:
            table.seal()
            assert table.stats()["slots"]["updating"] + table.stats()["slots"]["claiming"] == 1
            # Alive and holding its slot: not settled, however long.
            assert not table.wait_settled(time.monotonic() + 0.2)
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.communicate(timeout=DEADLINE_S)
        assert table.wait_settled(time.monotonic() + DEADLINE_S)  # rolled back
        slots = table.stats()["slots"]
        assert slots["updating"] == slots["claiming"] == 0 and table.stats()["reclaimed"] == 1
        assert ({x.key for x in table.live()}, table.counters()) == before


@pytest.mark.parametrize("name", list(STOPPED))
def test_a_change_stopped_in_its_slot_and_let_go_after_the_seal_sees_it(node, stops_build, name):
    """The other half of the Dekker pair: a change that took its slot before
    the seal, then goes on, reads the seal after its swap and puts the slot
    back, so the table is as it was, to the byte."""
    with _populated(node) as (table, leases):
        before = _slot_bytes(table)
        child = _stopped_child(node, stops_build, name, leases)
        try:
            assert _slot_bytes(table) != before  # its slot is taken
            table.seal()
        finally:
            os.kill(child.pid, signal.SIGCONT)
        out, err = child.communicate(timeout=DEADLINE_S)
        assert (out.strip(), child.returncode) == ("sealed", 0), err
        assert table.wait_settled(time.monotonic() + DEADLINE_S)
        # The very word it found, and nothing written: only the child's own
        # counter shard (taken before its slot) is new.
        assert _slot_bytes(table) == before


STOPPED_PAST_THE_SEAL = {
    # name: (op, key, stop point, whether its grant took effect before the seal)
    "Python grant stopped after writing its record": ("grant_py", "idle", "written", False),
    "C grant stopped after its journal, before its swap": ("grant", "idle", "journaled", False),
    "C grant stopped after its swap, before its count": ("grant", "idle", "published", True),
}


@pytest.mark.parametrize("name", list(STOPPED_PAST_THE_SEAL))
def test_a_change_stopped_past_its_seal_check_is_taken_back_or_counted_at_the_deadline(
    node, stops_build, tmp_path, name
):
    """A change that read the seal before it was set, then stopped (a
    debugger, a descheduled claimer), holds its slot past the deadline: the
    seal takes the slot back as if the process had died, so the grant it
    resumes with fails and nothing changes after the save; one that had
    already swapped is in the table and counted. Found by review: before, a
    grant stopped at "written" was left out of the save and returned a Lease
    from the old table when it resumed."""
    op, key, point, took_effect = STOPPED_PAST_THE_SEAL[name]
    with _populated(node) as (table, leases):
        grants_before = table.counters()["grants"]
        child = _stopped_child_at(node, stops_build, op, key, point, leases)
        try:
            table.seal()
            # Held past its check (not settled), or swapped already (nothing held).
            assert table.wait_settled(time.monotonic() + 0.2) == took_effect
            path = tmp_path / "leases.msgpack"
            table.save(path, LATER)
            live = {x.key for x in table.live()}
            counters = table.counters()
        finally:
            os.kill(child.pid, signal.SIGCONT)
        out, err = child.communicate(timeout=DEADLINE_S)
        assert child.returncode == 0, err
        assert out.strip() == ("Lease" if took_effect else "taken"), (out, err)
        assert (key in live) == took_effect
        # nothing after the save changed what it holds, counts included
        assert {x.key for x in table.live()} == live
        assert table.counters() == counters
        assert counters["grants"] == grants_before + took_effect  # counted before the save
        with LeaseTable.create(f"{node}x", capacity=64) as again:
            try:
                again.load(path)
                assert {x.key for x in again.live()} == live
            finally:
                LeaseTable.unlink(f"{node}x")
