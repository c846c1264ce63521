"""Fleet membership against the real PostgreSQL (node/fleet/, docs/fleet.md).

Each test makes its own database on postgresql://postgres@127.0.0.1:5432 and
drops it after; a missing server fails the test (it is not skipped). Nodes
are ``Membership`` objects, and real processes where it matters: a heartbeat
process SIGSTOPped (its grant deadline must lapse before its membership), and
nodes joining at once on an empty database (distinct numbers).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from keeper.owners import Ownership
from node.core.errors import NotGranting
from node.fleet import GRANT_MARGIN_FRACTION, Membership, NotAMember
from node.fleet.heartbeat import PAST, Heartbeat
from shm.ready import ReadySet

pytestmark = pytest.mark.timeout(120)

SERVER = "postgresql://postgres@127.0.0.1:5432"
SPAWN = multiprocessing.get_context("spawn")
S = 1_000_000_000  # ns


def _admin() -> Any:
    import psycopg

    try:
        return psycopg.connect(f"{SERVER}/postgres", autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is needed at {SERVER} (the fleet's tests never skip): {exc}")


@pytest.fixture
def db() -> Iterator[str]:
    """A fresh, empty database: its conninfo."""
    name = f"qn_fleet_{uuid.uuid4().hex[:12]}"
    with _admin() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield f"{SERVER}/{name}"
    finally:
        with _admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def ready_name() -> Iterator[str]:
    name = f"tf{uuid.uuid4().hex[:12]}"
    yield name
    ReadySet.unlink(name)


def test_join_heartbeat_and_the_live_list(db):
    with Membership(db, "a", "10.0.0.1:8470") as a, Membership(db, "b", "10.0.0.2:8470") as b:
        assert a.join().number == 1
        assert b.join().number == 2
        sent_before = time.monotonic_ns()
        beat = a.heartbeat()
        assert sent_before <= beat.sent_ns <= time.monotonic_ns()
        assert beat.grant_until_ns == beat.sent_ns + int(10 * (1 - GRANT_MARGIN_FRACTION) * S)
        assert not beat.lapsed and abs(beat.db_now - time.time()) < 5
        live = b.live()
        assert live.names == ("a", "b")
        assert [m.number for m in live.members] == [1, 2]
        assert live.members[0].address == "10.0.0.1:8470"
        assert live.members[0].heartbeat_at >= live.members[0].started_at
        # The owner of every key among the current list.
        owners = Ownership(live.names, "a")
        keys = [f"k{i}" for i in range(1000)]
        mine = set(owners.mine(keys))
        theirs = set(Ownership(live.names, "b").mine(keys))
        assert mine and theirs and mine.isdisjoint(theirs) and mine | theirs == set(keys)

        # A name seen before keeps its number; a new one takes the lowest free.
        assert a.leave() and "a" not in b.live()
        with pytest.raises(NotAMember):
            a.heartbeat()
        assert a.join().number == 1 and "a" in b.live()
        with Membership(db, "c", "c:1") as c:
            assert c.join().number == 3
            assert c.leave() and b.forget("c")  # left: its number is free again
        with Membership(db, "d", "d:1") as d:
            assert d.join().number == 3


def test_the_whole_list_in_one_read_live_left_lapsed_and_forgotten(db):
    import psycopg

    with (Membership(db, "a", "a:1") as a, Membership(db, "b", "b:1") as b,
          Membership(db, "c", "c:1") as c, Membership(db, "d", "d:1") as d):  # fmt: skip
        for m in (a, b, c, d):
            m.join()
        assert c.leave()
        with psycopg.connect(db, autocommit=True) as conn:  # b's heartbeat 30 s old: lapsed
            conn.execute("UPDATE fleet_nodes SET heartbeat_at = now() - interval '30 s'"
                         " WHERE name IN ('b', 'd')")  # fmt: skip
        assert a.forget("d")  # forgotten: on no list
        live, absent = a.listing()
        assert live.names == a.live().names == ("a",)
        assert abs(live.db_now - time.time()) < 5
        assert [(x.member.name, x.member.number, x.left) for x in absent] == [
            ("b", 2, False), ("c", 3, True)]  # fmt: skip
        assert 29 < live.db_now - absent[0].member.heartbeat_at < 60
        assert absent[1].left_at is not None and absent[1].member.address == "c:1"


def _forget_cli(*args: str) -> tuple[int, str, str]:
    """``python -m node forget …`` as a user runs it: (exit, stdout, stderr)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUE_NODE_")}
    done = subprocess.run([sys.executable, "-m", "node", "forget", *args], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def test_forget_on_the_command_line_frees_a_gone_nodes_number_and_refuses_a_live_one(db):
    """A node that left or lapsed is forgotten (one JSON line, its number
    free for the next join); a live node, a name not listed, a store that is
    not a fleet's: exit 2, one line, the list unchanged."""
    import json

    import psycopg

    with (Membership(db, "a", "a:1") as a, Membership(db, "b", "b:1") as b,
          Membership(db, "c", "c:1") as c):  # fmt: skip
        for m in (a, b, c):
            m.join()
        assert b.leave()
        with psycopg.connect(db, autocommit=True) as conn:  # c's last heartbeat 30 s old
            conn.execute("UPDATE fleet_nodes SET heartbeat_at = now() - interval '30 s'"
                         " WHERE name = 'c'")  # fmt: skip
        for args, says in (
            (("a", "--store", db), "node 'a' is live"),
            (("z", "--store", db), "node 'z' is not on the fleet's node list"),
            (("b", "--store", "sqlite:///nowhere.db"), "forget needs the fleet's database"),
            (("b",), "no store is given"),
        ):
            code, out, err = _forget_cli(*args)
            assert (code, out) == (2, ""), (args, code, out, err)
            assert err.count("\n") == 1 and says in err and "Traceback" not in err, err
        assert a.live().names == ("a",) and [x.member.name for x in a.listing()[1]] == ["b", "c"]

        for name, number, left in (("b", 2, True), ("c", 3, False)):
            code, out, err = _forget_cli(name, "--store", db)
            assert code == 0, err
            assert json.loads(out) == {"forgotten": name, "number": number, "address": f"{name}:1",
                                       "left": left}  # fmt: skip
        assert a.listing()[1] == ()
        with Membership(db, "d", "d:1") as d:  # the lowest free number again
            d.join()
            assert d.number == 2


def _heartbeat_process(db: str, name: str, ready_name: str, heartbeat_s: float, conn: Any) -> None:
    ready = ReadySet.attach(ready_name)
    membership = Membership(db, name, f"{name}:8470", membership_timeout_s=2.0)
    heart = Heartbeat(membership, ready, heartbeat_s)
    heart.join()
    conn.send("joined")
    stop = threading.Event()
    threading.Thread(target=lambda: (conn.recv(), stop.set()), daemon=True).start()
    heart.run(stop)
    conn.send(heart.beats)
    membership.close()
    ready.close()


def test_a_stopped_heartbeat_stops_granting_before_its_membership_lapses(db, ready_name):
    """SIGSTOP the heartbeat process: its grant deadline lapses first, then,
    at least the margin later (0.4 s at a 2 s timeout), the database counts it
    out. SIGCONT: it heartbeats again, is live again and grants again."""
    ready = ReadySet.create(ready_name, capacity=10)
    ready.publish([("k", 1, 0, 1, 1.0)], 0.0)
    parent, child_end = SPAWN.Pipe()
    child = SPAWN.Process(
        target=_heartbeat_process, args=(db, "a", ready_name, 0.1, child_end), daemon=True
    )
    child.start()
    observer = Membership(db, "observer", "o:1", membership_timeout_s=2.0)
    try:
        assert parent.poll(30) and parent.recv() == "joined"
        assert "a" in observer.live()
        assert ready.grant_until_ns > time.monotonic_ns()
        assert child.pid is not None
        os.kill(child.pid, signal.SIGSTOP)
        stopped = time.monotonic_ns()
        lapsed_at = out_at = None
        while out_at is None:
            assert time.monotonic_ns() < stopped + 10 * S, "never counted out"
            now = time.monotonic_ns()
            if lapsed_at is None and now >= ready.grant_until_ns:
                lapsed_at = now
                with pytest.raises(NotGranting):
                    ready.take(1)
            if "a" not in observer.live():
                out_at = time.monotonic_ns()
                assert lapsed_at is not None, "counted out while the node could still grant"
        assert lapsed_at is not None
        gap_s = (out_at - lapsed_at) / S
        print(f"grant deadline lapsed {gap_s:.3f} s before the membership")
        # The margin: 20% of the 2 s timeout, 0.4 s (less what polling blurs).
        assert gap_s >= 0.3, gap_s
        assert out_at - stopped <= 4 * S, "the timeout is 2 s"
        os.kill(child.pid, signal.SIGCONT)
        deadline = time.monotonic_ns() + 10 * S
        while "a" not in observer.live() or ready.grant_until_ns <= time.monotonic_ns():
            assert time.monotonic_ns() < deadline, "the heartbeat did not resume"
        assert [e.key for e in ready.take(1)[1]] == ["k"]
    finally:
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
        parent.send("stop")
        child.join(30)
        observer.close()
        ready.close()
    assert child.exitcode == 0


def test_a_clean_leave_stops_granting_and_leaves_the_list_at_once(db, ready_name):
    ready = ReadySet.create(ready_name, capacity=10)
    ready.publish([("k", 1, 0, 1, 1.0)], 0.0)
    try:
        with Membership(db, "a", "a:1") as a, Membership(db, "b", "b:1") as b:
            heart = Heartbeat(a, ready, 1.0)
            heart.join()
            assert ready.grant_until_ns > time.monotonic_ns() + 7 * S
            assert b.live().names == ("a",)
            assert heart.leave()
            assert ready.grant_until_ns == PAST
            assert b.live().names == ()
            with pytest.raises(NotGranting):
                ready.take(1)
    finally:
        ready.close()


def _join(db: str, name: str, go: Any, out: Any) -> None:
    with Membership(db, name, f"{name}:1") as m:
        m.connect()  # connected before the start: the joins race as closely as they can
        go.wait(30)
        try:
            out.put((name, m.join().number))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out.put((name, repr(exc)))


def test_the_node_list_is_a_migration_of_the_stores_schema(db):
    import psycopg

    from node.store import postgres_schema as schema
    from node.store.postgres import PostgresStore

    # A join on an empty database brings it to the store's schema version:
    # the node list is one of its migrations, not a table of its own.
    with Membership(db, "a", "a:1") as a:
        assert a.join().number == 1
    with psycopg.connect(db) as conn:
        applied = conn.execute("SELECT version FROM schema_migrations ORDER BY 1").fetchall()
    assert applied == [(v,) for v, _, _ in schema.MIGRATIONS]
    with PostgresStore(db) as store:  # it finds nothing left to do
        assert store.schema_version() == schema.SCHEMA_VERSION
    # A database whose node list an earlier build made by itself (no
    # migrations recorded) keeps it and its rows.
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("DROP TABLE schema_migrations, schedule, changes, changes_trimmed, node_meta")
        conn.execute("DROP SEQUENCE changes_seq")
        conn.execute("DROP FUNCTION queue_node_take_seq, queue_node_before_insert,"
                     " queue_node_before_update, queue_node_version_guard, queue_node_log_write,"
                     " queue_node_log_inserts, queue_node_log_delete, queue_node_notify,"
                     " queue_node_write_back")
    with PostgresStore(db) as store:
        assert store.schema_version() == schema.SCHEMA_VERSION
    with Membership(db, "b", "b:1") as b:
        assert b.live().names == ("a",)


@pytest.mark.parametrize("round_", range(3))
def test_nodes_joining_at_once_on_an_empty_database_get_distinct_numbers(db, round_):
    go, out = SPAWN.Event(), SPAWN.Queue()
    names = [f"n{i}" for i in range(6)]
    procs = [SPAWN.Process(target=_join, args=(db, n, go, out)) for n in names]
    for proc in procs:
        proc.start()
    go.set()
    answers = dict(out.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
    assert sorted(answers.values()) == [1, 2, 3, 4, 5, 6], answers
    with Membership(db, "x", "x:1") as x:
        assert x.live().names == tuple(names)


def test_clock_skew_is_measured_and_flagged(db, caplog):
    with Membership(db, "a", "a:1") as a:
        a.join()
        skew = a.heartbeat().skew
        assert abs(skew.skew_s) < 1.0 and not skew.flagged  # one host: one clock
        assert 0 <= skew.error_s < 1.0
    offset = [30.0]
    with Membership(db, "a", "a:1", clock=lambda: time.time() + offset[0]) as ahead:
        skew = ahead.heartbeat().skew
        assert -31.0 < skew.skew_s < -29.0 and skew.flagged
        # Logged when it starts and when it ends, not at every heartbeat
        # (five a second at a 0.2 s heartbeat filled a skewed node's log).
        for _ in range(5):
            assert ahead.heartbeat().skew.flagged
        offset[0] = 0.0
        assert not ahead.heartbeat().skew.flagged
    said = [r.getMessage() for r in caplog.records if "fleet_clock_skew" in r.getMessage()]
    assert len(said) == 2, said
    assert "fleet_clock_skew " in said[0] and "fleet_clock_skew_ended" in said[1], said


def test_a_node_with_peers_waits_for_one_and_a_node_alone_does_not(db):
    with Membership(db, "b", "b:1") as b, Membership(db, "a", "10.0.0.1:8470") as a:
        b.join()
        started = time.monotonic()
        _live, seen = b.wait_for_peers(["a"], timeout_s=0.3, poll_s=0.05)
        assert not seen and time.monotonic() - started >= 0.3
        a.join()
        live, seen = b.wait_for_peers(["10.0.0.1:8470"], timeout_s=5.0, poll_s=0.05)
        assert seen and live.names == ("a", "b")
        _live, seen = b.wait_for_peers([], timeout_s=0.0)
        assert seen


def test_the_trim_position_is_the_lowest_a_live_node_reported(db):
    """The shared change log may be trimmed only through the lowest position
    every live node reported with its heartbeat (docs/fleet.md): a node that
    has reported none holds it all; one that left or lapsed holds nothing."""
    from node.testing import wait_for

    with (
        Membership(db, "a", "a:1", membership_timeout_s=1.0) as a,
        Membership(db, "b", "b:1", membership_timeout_s=1.0) as b,
    ):
        a.join()
        assert a.trim_through() == 0  # joined, nothing reported yet
        a.heartbeat(applied_seq=40)
        assert a.trim_through() == 40
        b.join()
        assert a.trim_through() == 0  # b reported nothing yet: keep it all
        b.heartbeat(applied_seq=25)
        assert a.trim_through() == 25
        a.heartbeat()  # no position: the last one stays
        assert a.trim_through() == 25
        b.heartbeat(applied_seq=60)
        a.heartbeat(applied_seq=50)
        assert b.trim_through() == 50
        # b left: it holds the log back for the hold only; back, it has reported none.
        assert b.leave() and a.trim_through() == 50
        a.heartbeat(applied_seq=70)
        assert a.trim_through() == 70
        assert a.trim_through(hold_s=600) == 60  # left at 60: kept for the hold
        b.join()
        assert a.trim_through() == 0
        b.heartbeat(applied_seq=30)
        # b lapses (no heartbeat past the timeout): a alone decides.
        a.heartbeat(applied_seq=80)
        assert a.trim_through() == 30
        wait_for(lambda: (a.heartbeat(applied_seq=80), "b" not in a.live())[1], 10, "b lapsed")
        assert a.trim_through() == 80
        assert a.trimmed_through() == 0  # nothing trimmed the log yet


def test_a_heartbeat_whose_live_list_is_not_read_extends_no_deadline(db, ready_name):
    """docs/delivery.md, "Two nodes, one key": the deadline a heartbeat earns
    is written only once the live list read after it has been taken in
    (``FleetMember.tick`` keeps it back, the keeper's tick ends with
    ``grant``), so a node never goes on granting from a set made for an
    older list. A real fault between the two statements: the node's
    database role loses SELECT on the one column the live list reads and
    the heartbeat does not (``address``). Its heartbeats go on succeeding, so
    it stays in the list, and its deadline is not extended: it stops
    granting at the deadline of its last full round. SELECT given back, the
    next round extends it again."""
    import psycopg

    from keeper.fleet import FleetMember
    from node.core.config import Config

    role = f"qn_role_{uuid.uuid4().hex[:10]}"
    observer = Membership(db, "observer", "o:1", membership_timeout_s=2.0)
    observer.connect()
    observer.join()  # makes the schema
    with psycopg.connect(db, autocommit=True) as admin:
        columns = [r[0] for r in admin.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'fleet_nodes'"
        )]  # fmt: skip
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        admin.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
        admin.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        admin.execute(f"REVOKE SELECT ON fleet_nodes FROM {role}")
        admin.execute(f"GRANT INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        admin.execute(f"GRANT SELECT ({', '.join(columns)}) ON fleet_nodes TO {role}")
    ready = ReadySet.create(ready_name, capacity=10)
    ready.publish([("k", 1, 0, 1, 1.0)], 0.0)
    conninfo = db.replace("postgresql://postgres@", f"postgresql://{role}@")
    config = Config(name="a", store=conninfo, membership_timeout_s=2.0, heartbeat_s=0.1)
    member = FleetMember(config, ready, conninfo)

    def round_() -> bool:
        """One heartbeat round as the keeper runs it: tick, then grant."""
        member.next_beat_ns = 0  # due now
        read = member.tick()
        member.grant()
        return read

    try:
        assert round_() and member.live is not None and "a" in member.live.names
        earned = ready.grant_until_ns
        assert earned > time.monotonic_ns()
        with psycopg.connect(db, autocommit=True) as admin:
            admin.execute(f"REVOKE SELECT (address) ON fleet_nodes FROM {role}")
        beats = member.heart.beats
        while time.monotonic_ns() < earned:
            assert round_() is False  # the heartbeat went through, the list did not
            assert ready.grant_until_ns == earned, "a deadline without a list read after it"
        assert member.heart.beats > beats + 3  # its heartbeats went on...
        assert "a" in observer.live().names  # ...so it is still a member
        with pytest.raises(NotGranting):
            ready.take(1)  # and it stopped granting all the same
        with psycopg.connect(db, autocommit=True) as admin:
            admin.execute(f"GRANT SELECT (address) ON fleet_nodes TO {role}")
        assert round_()
        assert ready.grant_until_ns > time.monotonic_ns()
        assert [e.key for e in ready.take(1)[1]] == ["k"]
    finally:
        member.membership.close()
        observer.close()
        ready.close()
        with psycopg.connect(db, autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE {role}")
