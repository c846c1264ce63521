"""The ledger process (workers/ledger/process.py), for real: ``python -m workers.ledger``
against a lease table, a SQLite store and a completion log made here.

Leases are granted in the test process, as a claimer would; completions,
polls and acks go over ``node.ipc.IpcClient``. Waits are deadlines, never sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.config import Config
from node.core.rows import RowWrite
from node.ipc import AsyncIpcClient, IpcClient, IpcError, RemoteError
from node.store import open_store
from node.testing import wait_for
from shm.leases import Lease, LeaseTable, Outcome
from workers.ledger.process import LOG_DIR, Ledger, ledger_address

ROOT = Path(__file__).resolve().parents[2]
CADENCE_S = 600


class LedgerProc:
    """One ``python -m workers.ledger`` child; its log goes to ``ledger.log``."""

    def __init__(self, data_dir: Path, name: str, config_path: Path) -> None:
        self.data_dir = data_dir
        self.name = name
        self.env = dict(
            os.environ,
            QUEUE_NODE_RUN_CONFIG=str(config_path),
            QUEUE_NODE_SUPERVISOR_PID=str(os.getpid()),
        )
        self.log_path = data_dir / "ledger.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> LedgerProc:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "workers.ledger"],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        wait_for(self._answers, 20, "the ledger to serve")
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"ledger exited {self.proc.returncode}: {self.log()}")
        try:
            with self.client(2) as c:
                return c.call("stats")["pid"] == self.proc.pid
        except IpcError:
            return False

    def client(self, timeout_s: float = 10.0) -> _Closing:
        return _Closing(IpcClient(ledger_address(self.name), timeout_s=timeout_s))

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(20)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class _Closing:
    def __init__(self, client: IpcClient) -> None:
        self.c = client

    def __enter__(self) -> IpcClient:
        return self.c

    def __exit__(self, *exc: object) -> None:
        self.c.close()


class World:
    """A node without its supervisor: lease table, store, config file."""

    def __init__(self, tmp_path: Path, name: str, **config: object) -> None:
        self.name = name
        self.data_dir = tmp_path / "data"
        self.data_dir.mkdir()
        self.config = Config(
            data_dir=self.data_dir,
            name=name,
            store=f"sqlite:///{self.data_dir}/schedule.db",
            **config,  # type: ignore[arg-type]
        )
        self.config_path = tmp_path / "run.json"
        self.config_path.write_text(json.dumps(self.config.to_json()))
        self.store = open_store(self.config.store_url)
        self.table = LeaseTable.create(name, capacity=1024)
        self.ledger = LedgerProc(self.data_dir, name, self.config_path)

    def seed(self, keys: list[str], job: str = "j") -> None:
        now = time.time()
        self.store.upsert(
            [RowWrite(k, "r", cadence_s=CADENCE_S, due_at=now - 5, job=job) for k in keys], now=now
        )

    def grant(self, key: str, consumer: str = "gpu-0", lease_s: float = 60.0):
        row = self.store.get(key)
        lease = self.table.grant(key, consumer, lease_s, time.time(), CADENCE_S, row.version)
        assert lease, lease
        return lease

    def close(self) -> None:
        proc = self.ledger.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        self.store.close()
        self.table.close()
        LeaseTable.unlink(self.name)


@pytest.fixture
def world(tmp_path, node_name):
    w = World(tmp_path, node_name)
    yield w
    w.close()


def item(lease, result: bytes = b'{"ok":true}', encoding: str = "json") -> dict:
    return {"lease_id": lease.lease_id, "key": lease.key, "result": result, "encoding": encoding}


def poll_all(c: IpcClient, job: str | None, wait_s: float = 0) -> list[dict]:
    return c.call("poll", job=job, max=10_000, wait_s=wait_s)["results"]


def test_complete_is_durable_ends_the_lease_writes_back_and_round_trips(world):
    keys = [f"https://example.com/{i}" for i in range(5)]
    world.seed(keys)
    world.ledger.start()
    leases = [world.grant(k) for k in keys]
    before = {k: world.store.get(k).version for k in keys}
    with world.ledger.client() as c:
        items = [item(lease) for lease in leases[:4]] + [item(leases[4], b"\x00raw", "bytes")]
        outcomes = c.call("complete", items=items)["outcomes"]
        assert [o["status"] for o in outcomes] == ["ok"] * 5
        ids = [o["id"] for o in outcomes]
        assert ids == sorted(set(ids))
        for lease in leases:
            assert world.table.peek(lease.key, lease.lease_id)[0] is Outcome.REPEAT  # ended
        results = poll_all(c, "j")
        assert [r["id"] for r in results] == ids
        assert results[4]["result"] == b"\x00raw" and results[4]["encoding"] == "bytes"
        assert json.loads(results[0]["result"]) == {"ok": True}
        for r in results:
            row = world.store.get(r["key"])
            assert row.due_at == pytest.approx(r["finished_at"] + CADENCE_S)
            assert row.version > before[r["key"]]
        assert poll_all(c, "j") == []  # offered, not yet due again
        again = c.call("complete", items=[item(leases[0])])["outcomes"]
        assert again == [{"status": "repeat", "id": ids[0]}]  # the id it was accepted as
        assert c.call("ack", job="j", ids=ids)["acked"] == 5
        assert c.call("ack", job="j", ids=ids)["acked"] == 0  # idempotent
        with pytest.raises(RemoteError) as exc:
            c.call("ack", job="j", ids=[ids[-1] + 1000])
        assert exc.value.code == "never_offered"
        acct = c.call("accounting")
    assert acct["balanced"] is True
    assert (acct["routed"], acct["finished"], acct["acknowledged"]) == (5, 5, 5)
    assert (acct["in_flight"], acct["awaiting_ack"], acct["expired"]) == (0, 0, 0)
    assert acct["since"] <= time.time()


def test_late_conflict_unknown_and_duplicates_in_one_request(world):
    world.seed(["late", "taken", "dup"])
    world.ledger.start()
    late = world.grant("late")
    assert world.table.release("late", late.lease_id, time.time(), "oom") is Outcome.RELEASED
    first = world.grant("taken")
    world.table.release("taken", first.lease_id, time.time())
    due_at = world.store.get("taken").due_at
    with world.ledger.client() as c:
        assert c.call("unhold", keys=["taken", "nope"])["unheld"] == 1
        second = world.grant("taken", consumer="gpu-1")
        dup = world.grant("dup")
        outcomes = c.call(
            "complete",
            items=[item(late), item(first), item(dup), item(dup),
                   {"lease_id": 12345, "key": "nope", "result": b"1"}],
        )["outcomes"]  # fmt: skip
        assert [o["status"] for o in outcomes] == ["ok", "conflict", "ok", "repeat", "unknown"]
        assert outcomes[3]["id"] == outcomes[2]["id"]
        # Nothing was written for the conflict: no result, no write-back, lease untouched.
        assert c.call("stats")["log"]["durable"] == 2
        assert world.store.get("taken").due_at == due_at
        assert world.table.peek("taken", second.lease_id)[0] is Outcome.COMPLETED
        acct = c.call("accounting")
        assert acct["balanced"] is True
        assert (acct["routed"], acct["finished"], acct["released"], acct["in_flight"]) == (
            4, 2, 1, 1,
        )  # fmt: skip
        assert c.call("complete", items=[item(second)])["outcomes"][0]["status"] == "ok"
        with pytest.raises(RemoteError) as exc:
            c.call("complete", items=[{"lease_id": "x", "key": "taken", "result": b"1"}])
        assert exc.value.code == "bad_request"


def test_kill9_after_ok_replies_offers_every_ok_result_again_until_acked(world):
    keys = [f"k{i}" for i in range(20)]
    world.seed(keys)
    world.ledger.start()
    ok_ids: list[int] = []
    with world.ledger.client() as c:
        for n in range(0, 20, 5):
            batch = [item(world.grant(k), json.dumps(k).encode()) for k in keys[n : n + 5]]
            outcomes = c.call("complete", items=batch)["outcomes"]
            assert {o["status"] for o in outcomes} == {"ok"}
            ok_ids += [o["id"] for o in outcomes]
        offered = [r["id"] for r in c.call("poll", job="j", max=5)["results"]]
        assert c.call("ack", job="j", ids=offered[:3])["acked"] == 3
    world.ledger.kill9()
    world.ledger.start()
    with world.ledger.client() as c:
        # Offered before the crash, not acked: acked now without polling again.
        assert c.call("ack", job="j", ids=offered[3:])["acked"] == 2
        again = poll_all(c, None)
        assert sorted(r["id"] for r in again) == sorted(set(ok_ids) - set(offered))
        assert {json.loads(r["result"]) for r in again} == {
            f"k{i}" for i in range(20) if ok_ids[i] not in offered
        }
        world.ledger.kill9()
        world.ledger.start()
        c.close()  # reconnect to the new process
        # Not acked before the second crash: offered again.
        assert sorted(r["id"] for r in poll_all(c, "j")) == sorted(r["id"] for r in again)
        assert c.call("ack", job="j", ids=[r["id"] for r in again])["acked"] == 15
        assert poll_all(c, "j") == []
        acct = c.call("accounting")
    assert acct["balanced"] is True
    assert (acct["routed"], acct["finished"], acct["acknowledged"], acct["in_flight"]) == (
        20, 20, 20, 0,
    )  # fmt: skip


def test_a_result_made_durable_by_a_ledger_that_died_before_ending_its_lease(world):
    """The window between the fsync and the lease's end: recovery ends it."""
    from node.completion import CompletionConfig, Result, open_completion_store

    world.seed(["a", "b"])
    lease = world.grant("a")
    other = world.grant("b")
    version = world.store.get("a").version
    log = open_completion_store(f"segments:///{world.data_dir / LOG_DIR}", CompletionConfig())
    log.recover()
    finished_at = time.time()
    log.append_results(
        [Result.of("done", key="a", job="j", lease_id=lease.lease_id, version=version,
                   finished_at=finished_at, cadence_s=CADENCE_S)]
    )  # fmt: skip
    log.flush()
    log.close()
    assert world.table.peek("a", lease.lease_id)[0] is Outcome.COMPLETED  # still live
    world.ledger.start()
    with world.ledger.client() as c:
        assert c.call("stats")["recovery"]["leases_ended"] == 1
        assert world.table.peek("a", lease.lease_id)[0] is Outcome.REPEAT
        assert world.store.get("a").due_at == pytest.approx(finished_at + CADENCE_S)
        (r,) = poll_all(c, "j")
        assert (r["key"], json.loads(r["result"])) == ("a", "done")
        assert c.call("complete", items=[item(lease)])["outcomes"] == [
            {"status": "repeat", "id": r["id"]}
        ]
        acct = c.call("accounting")
        assert acct["balanced"] is True and acct["in_flight"] == 1
        assert c.call("complete", items=[item(other)])["outcomes"][0]["status"] == "ok"


class _WriteLock:
    """Another program holding the store's write lock (BEGIN IMMEDIATE): the
    ledger's write-back waits out its busy timeout (5 s) and fails as
    unavailable, a real store fault, no test hook."""

    def __init__(self, path: str) -> None:
        import sqlite3

        self.conn = sqlite3.connect(path, isolation_level=None, timeout=10)
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")
        self.conn.close()


def test_a_failed_write_back_then_kill9_is_written_back_from_the_log_and_never_run_again(world):
    """The store refuses a group's write-back, then the ledger dies: the item
    is not granted again meanwhile (its lease stays live until the write-back
    is written), and the restarted ledger writes it back from the log's
    pending result, then ends the lease and offers the result."""
    world.seed(["a", "b"])
    world.ledger.start()
    lease = world.grant("a")
    version = world.store.get("a").version
    lock = _WriteLock(world.store.path)
    try:
        with world.ledger.client(30) as c:
            (done,) = c.call("complete", items=[item(lease)])["outcomes"]
            assert done["status"] == "ok"  # durable, whatever the store said
            st = c.call("stats")
            assert st["writeback_failed"] >= 1 and st["writeback_retrying"] == 1
            assert poll_all(c, "j") == []  # not offered before it is written back
        # The lease is live: nothing can grant the key with its old due time.
        assert world.table.peek("a", lease.lease_id)[0] is Outcome.COMPLETED
        refused = world.table.grant("a", "other", 60.0, time.time(), CADENCE_S, version)
        assert not hasattr(refused, "lease_id"), refused
        world.ledger.kill9()
    finally:
        lock.release()
    row = world.store.get("a")
    assert (row.version, row.last_result_id) == (version, None)  # never written
    assert world.table.peek("a", lease.lease_id)[0] is Outcome.COMPLETED  # still live
    world.ledger.start()
    with world.ledger.client() as c:
        assert c.call("stats")["recovery"]["leases_ended"] == 1
        (r,) = poll_all(c, "j")
        assert r["id"] == done["id"]
        row = world.store.get("a")
        assert row.due_at == pytest.approx(r["finished_at"] + CADENCE_S)
        assert (row.last_result_id, row.last_finished_at, row.last_error) == (
            done["id"], pytest.approx(r["finished_at"]), None,
        )  # fmt: skip
        assert row.version > version
        assert world.table.peek("a", lease.lease_id)[0] is Outcome.REPEAT  # ended
        assert c.call("complete", items=[item(lease)])["outcomes"] == [
            {"status": "repeat", "id": done["id"]}
        ]
        assert c.call("accounting")["balanced"] is True


def test_a_failed_write_back_is_retried_by_the_sweep_then_the_lease_ends(world):
    world.seed(["a"])
    world.ledger.start()
    lease = world.grant("a")
    lock = _WriteLock(world.store.path)
    try:
        with world.ledger.client(30) as c:
            (done,) = c.call("complete", items=[item(lease)])["outcomes"]
            assert done["status"] == "ok"
            assert world.table.peek("a", lease.lease_id)[0] is Outcome.COMPLETED
    finally:
        lock.release()
    with world.ledger.client(30) as c:
        wait_for(lambda: c.call("stats")["writeback_retrying"] == 0, 30, "the retry")
        assert world.table.peek("a", lease.lease_id)[0] is Outcome.REPEAT
        (r,) = poll_all(c, "j")
        assert r["id"] == done["id"]
        row = world.store.get("a")
        assert (row.due_at, row.last_result_id) == (
            pytest.approx(r["finished_at"] + CADENCE_S), done["id"],
        )  # fmt: skip


def test_the_outcome_of_a_rows_last_lease_is_written_back(world):
    """last_error from a release (learned from the lease table) and an expiry
    (the sweep's), cleared by a result with last_result_id and
    last_finished_at; none of them a change of the row."""
    world.seed(["rel", "exp"])
    world.ledger.start()
    with world.ledger.client() as c:
        wait_for(lambda: c.call("stats")["sweeps"] >= 1, 10, "the first sweep")
        released = world.grant("rel")
        assert world.table.release("rel", released.lease_id, time.time(), "oom") is (
            Outcome.RELEASED
        )
        world.grant("exp", lease_s=0.2)
        versions = {k: world.store.get(k).version for k in ("rel", "exp")}
        wait_for(lambda: world.store.get("rel").last_error == "released: oom", 10, "release")
        wait_for(lambda: world.store.get("exp").last_error is not None, 10, "the expiry")
        assert world.store.get("exp").last_error.startswith("expired")
        assert {k: world.store.get(k).version for k in versions} == versions  # no change
        # The released lease's result still comes (LATE): the outcome is the result's now.
        (late,) = c.call("complete", items=[item(released)])["outcomes"]
        assert late["status"] == "ok"
        row = world.store.get("rel")
        assert (row.last_error, row.last_result_id) == (None, late["id"])
        assert row.last_finished_at == pytest.approx(time.time(), abs=30)
        assert c.call("stats")["last_errors"] >= 2


def test_expiry_sweep_long_poll_and_re_offer(tmp_path, node_name):
    world = World(tmp_path, node_name, offer_timeout_s=1.0)
    try:
        world.seed(["short", "slow"])
        world.ledger.start()
        short = world.grant("short", lease_s=0.2)
        wait_for(lambda: world.table.counters()["expired"] == 1, 10, "the sweep")
        assert world.table.peek("short", short.lease_id)[0] is Outcome.LATE
        with world.ledger.client() as c:
            assert c.call("accounting")["expired"] == 1

            async def long_poll_then_complete():
                ac = AsyncIpcClient(ledger_address(node_name))
                try:
                    waiting = asyncio.create_task(
                        ac.call("poll", job="j", max=10, wait_s=10, timeout_s=20)
                    )
                    await asyncio.sleep(0.05)  # lets the poll reach the ledger; not a sync
                    t0 = time.monotonic()
                    lease = world.grant("slow")
                    done = await ac.call("complete", items=[item(lease)])
                    got = await waiting
                    return done, got, time.monotonic() - t0
                finally:
                    await ac.close()

            done, got, took_s = asyncio.run(long_poll_then_complete())
            assert [r["id"] for r in got["results"]] == [done["outcomes"][0]["id"]]
            assert took_s < 5
            # Not acked: offered again once offer_timeout_s passes, to a waiting poll.
            again = c.call("poll", job="j", max=10, wait_s=5)["results"]
            assert [r["id"] for r in again] == [r["id"] for r in got["results"]]
            # A late result for the expired lease is taken: it was not granted since.
            assert c.call("complete", items=[item(short)])["outcomes"][0]["status"] == "ok"
            acct = c.call("accounting")
        assert acct["balanced"] is True
        assert (acct["routed"], acct["finished"], acct["expired"]) == (2, 2, 0)
    finally:
        world.close()


def test_sigterm_drains_and_exits_0_with_a_summary(world):
    world.seed(["a"])
    world.ledger.start()
    with world.ledger.client() as c:
        assert c.call("complete", items=[item(world.grant("a"))])["outcomes"][0]["status"] == "ok"
    assert world.ledger.stop() == 0
    last = world.ledger.log().strip().splitlines()[-1]
    assert "action=ledger_stop" in last and "ok=1" in last and "balanced=true" in last


def test_many_concurrent_completions_share_fsyncs(world):
    keys = [f"g{i}" for i in range(64)]
    world.seed(keys)
    world.ledger.start()
    leases = [world.grant(k) for k in keys]

    async def all_at_once():
        ac = AsyncIpcClient(ledger_address(world.name))
        try:
            calls = [ac.call("complete", items=[item(lease)]) for lease in leases]
            return await asyncio.gather(*calls)
        finally:
            await ac.close()

    replies = asyncio.run(all_at_once())
    assert all(r["outcomes"][0]["status"] == "ok" for r in replies)
    with world.ledger.client() as c:
        stats = c.call("stats")
    assert stats["log"]["durable"] == 64
    assert stats["groups"] < 64 and stats["group_items_max"] > 1


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_a_peer_of_another_uid_is_refused(world):
    world.ledger.start()
    code = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.connect({ledger_address(world.name)!r})\n"
        "s.settimeout(5)\n"
        "sys.exit(0 if s.recv(1) == b'' else 1)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=20, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert "ipc_peer_refused" in world.ledger.log()


def test_log_unavailable_leaves_the_lease_as_it_was(tmp_path, node_name):
    """In process, with the in-memory twins: a full disk answers
    log_unavailable, writes nothing, and the lease stays live."""
    from node.completion.memory import MemoryCompletionStore

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    config = Config(data_dir=data_dir, name=node_name, store="memory://")
    table = LeaseTable.create(node_name, capacity=64)
    store = open_store("memory://")
    log = MemoryCompletionStore()
    try:
        store.upsert([RowWrite("a", "r", cadence_s=CADENCE_S, job="j")], now=time.time())
        row = store.get("a")
        lease = table.grant("a", "gpu", 60, time.time(), CADENCE_S, row.version)
        ledger = Ledger(config, LeaseTable.attach(node_name), store, log)

        async def body():
            ledger.recover(time.time())
            committer = asyncio.create_task(ledger.run_committer())
            log.disk_full = True
            full = await ledger.complete({"items": [item(lease)]})
            assert table.peek("a", lease.lease_id)[0] is Outcome.COMPLETED  # still live
            log.disk_full = False
            ok = await ledger.complete({"items": [item(lease)]})
            committer.cancel()
            return full, ok

        full, ok = asyncio.run(body())
        assert full["outcomes"] == [{"status": "log_unavailable"}]
        assert ok["outcomes"][0]["status"] == "ok"
        assert log.counters().durable == 1 and log.counters().rejected == 1
        assert store.get("a").due_at > row.due_at
        assert ledger.accounting()["balanced"] is True
        ledger.close()
    finally:
        table.close()
        LeaseTable.unlink(node_name)


def test_the_address_is_abstract(node_name):
    address = ledger_address(node_name)
    assert address.startswith("\0") and node_name in address
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
        s.connect(address)  # nothing listens: no stale file can exist either


def test_counters_continue_from_the_checkpoint_after_a_reboot_lost_the_table(world):
    """A host reboot after a crash loses shared memory: the lease table comes
    back empty. The ledger continues its counters from its checkpoint, and
    repeats the write-back of a result whose lease it never got to end."""
    from node.completion import CompletionConfig, Result, open_completion_store

    world.seed(["a", "b", "c", "d"])
    world.ledger.start()
    with world.ledger.client() as c:
        done = c.call("complete", items=[item(world.grant("a")), item(world.grant("b"))])
        assert [o["status"] for o in done["outcomes"]] == ["ok", "ok"]
        held = world.grant("c")
        world.table.release("c", held.lease_id, time.time(), "gpu lost")
        unended = world.grant("d")
        before = c.call("accounting")
    assert before["balanced"] is True and before["in_flight"] == 1
    path = world.data_dir / "accounting.json"
    wait_for(
        lambda: json.loads(path.read_text())["checkpoint"].get("grants") == 4, 10, "a checkpoint"
    )
    world.ledger.kill9()
    # The dead ledger had made d's result durable but not ended its lease.
    log = open_completion_store(f"segments:///{world.data_dir / LOG_DIR}", CompletionConfig())
    log.recover()
    finished_at = time.time()
    version = world.store.get("d").version
    log.append_results(
        [Result.of("d", key="d", job="j", lease_id=unended.lease_id, version=version,
                   finished_at=finished_at, cadence_s=CADENCE_S)]
    )  # fmt: skip
    log.flush()
    log.close()
    # The reboot: shared memory is gone; the supervisor makes a new table.
    world.table.close()
    LeaseTable.unlink(world.name)
    world.table = LeaseTable.create(world.name, capacity=1024)
    world.ledger.start()
    with world.ledger.client() as c:
        after = c.call("accounting")
        recovery = c.call("stats")["recovery"]
    assert "action=accounting_restored" in world.ledger.log()
    assert recovery["accounting_restored"]["grants"] == 4
    assert world.store.get("d").due_at == pytest.approx(finished_at + CADENCE_S)
    assert (after["routed"], after["released"], after["since"]) == (4, 1, before["since"])
    # d's lease died with the host; its result is counted: here the gap is 0.
    assert (after["finished"], after["in_flight"], recovery["accounting_gap"]) == (3, 0, 0)
    assert after["balanced"] is True


def test_the_law_and_the_checkpoint_file(tmp_path):
    from workers.ledger.accounting import AccountingFile, LogCounts, build

    table = dict.fromkeys(
        ("grants", "released", "expired", "completed", "late_expired", "late_released",
         "refused_full"), 0,
    )  # fmt: skip
    table.update(grants=10, completed=5, expired=3, late_expired=1, released=2, refused_full=4)
    # 10 routed = 6 finished (5 + 1 late) + 2 expired + 2 released + 0 in flight
    counts = LogCounts(finished=6, acknowledged=3, discarded=1, awaiting_ack=2)
    acct = build(table, 0, counts, since=1.0)
    assert acct["balanced"] is True
    assert (acct["expired"], acct["released"], acct["refused"], acct["received"]) == (2, 2, 4, 0)
    assert build(table, 1, counts, 1.0)["balanced"] is False
    assert build(table, 0, LogCounts(6, 3, 1, 1), 1.0)["balanced"] is False
    f = AccountingFile.open(tmp_path, now=100.0)
    assert AccountingFile.open(tmp_path, now=200.0).since == 100.0
    f.save_checkpoint(table, 150.0)
    assert f.restore(table, 160.0) is None  # intact: nothing to add
    fresh = dict.fromkeys(table, 0)
    assert f.restore(fresh, 170.0) == {k: v for k, v in table.items() if v}
    again = AccountingFile.open(tmp_path)
    assert again.totals(fresh) == table and again.restores[0]["at"] == 170.0


def _one_leased_row(tmp_path: Path, node_name: str) -> tuple:
    """A memory store with row "a", a real lease table with "a" leased:
    (the ledger's config, the table, the store, the lease)."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    config = Config(data_dir=data_dir, name=node_name, store="memory://")
    table = LeaseTable.create(node_name, capacity=64)
    store = open_store("memory://")
    store.upsert([RowWrite("a", "r", cadence_s=CADENCE_S, job="j")], now=time.time())
    lease = table.grant("a", "gpu-0", 60, time.time(), CADENCE_S, store.get("a").version)
    return config, table, store, lease


def _complete_while_writing(config: Config, node_name: str, store, lease, meanwhile) -> tuple:
    """A ledger over an in-memory log whose write of a group runs
    ``meanwhile`` first (between the peek and the lease's end); one
    completion of ``lease`` through it: (the ledger, its outcome)."""
    from node.completion.memory import MemoryCompletionStore

    class Log(MemoryCompletionStore):
        def _write(self, results, retires, first_id):
            if results:
                meanwhile()
            return super()._write(results, retires, first_id)

    ledger = Ledger(config, LeaseTable.attach(node_name), store, Log())

    async def body():
        ledger.recover(time.time())
        committer = asyncio.create_task(ledger.run_committer())
        reply = await ledger.complete({"items": [item(lease)]})
        committer.cancel()
        return reply

    (outcome,) = asyncio.run(body())["outcomes"]
    return ledger, outcome


def test_a_grant_between_the_peek_and_the_lease_end_keeps_the_durable_result(tmp_path, node_name):
    """The one window of docs/delivery.md where a result is durable but its
    lease cannot be ended: the holder released it and the key was granted
    again while the group commit ran (a disk stall of two lease lengths).
    The result is kept and delivered, counted, and the law is off by one."""

    config, table, store, first = _one_leased_row(tmp_path, node_name)
    second = []

    def meanwhile() -> None:  # released, unheld, granted to another holder
        table.release("a", first.lease_id, time.time())
        table.unhold(["a"])
        second.append(table.grant("a", "gpu-1", 60, time.time(), CADENCE_S))

    ledger, outcome = _complete_while_writing(config, node_name, store, first, meanwhile)
    try:
        assert outcome["status"] == "ok"
        assert ledger.stats.superseded_after_durable == 1
        assert ledger.offer("j", 10, time.time())[0]["id"] == outcome["id"]
        assert table.peek("a", second[0].lease_id)[0] is Outcome.COMPLETED  # untouched
        acct = ledger.accounting()
        assert (acct["routed"], acct["finished"], acct["released"], acct["in_flight"]) == (
            2, 1, 1, 1,
        )  # fmt: skip
        assert acct["balanced"] is False
        ledger.close()
    finally:
        table.close()
        LeaseTable.unlink(node_name)


def test_a_late_result_keeps_its_key_from_a_grant_while_its_group_commits(tmp_path, node_name):
    """A slow holder's result arrives just as the hold its lease's expiry
    left ends (found by the partition campaign): a claimer waiting on the
    key would take it during the group commit, and the result, durable,
    could not end its lease (counted expired and finished: the output law
    off by one). The ledger pins the key at the peek: no grant until the
    lease is ended, the result accepted late, both laws balanced."""

    config, table, store, first = _one_leased_row(tmp_path, node_name)
    # Released long ago: its hold (two lease lengths) is over, the key grantable.
    assert table.release("a", first.lease_id, time.time() - 1000) is Outcome.RELEASED
    tried = []

    def meanwhile() -> None:  # a claimer tries the key
        tried.append(table.grant("a", "gpu-1", 60, time.time(), CADENCE_S))

    ledger, outcome = _complete_while_writing(config, node_name, store, first, meanwhile)
    try:
        assert outcome["status"] == "ok"
        assert not isinstance(tried[0], Lease)  # refused: the key is held
        assert ledger.stats.superseded_after_durable == 0
        assert table.lookup("a")[0] == "idle"  # ended by the result, no hold left
        acct = ledger.accounting()
        assert (acct["routed"], acct["finished"], acct["released"], acct["in_flight"]) == (
            1, 1, 0, 0,
        )  # fmt: skip
        assert acct["balanced"] is True
        again = table.grant("a", "gpu-1", 60, time.time(), CADENCE_S)
        assert isinstance(again, Lease)  # the next occurrence is granted as usual
        ledger.close()
    finally:
        table.close()
        LeaseTable.unlink(node_name)


def test_a_late_result_whose_key_was_granted_again_is_refused_at_its_pin(tmp_path, node_name):
    """The key of a late result was granted to another holder before the
    result came: refused as a conflict, nothing written, nothing pinned."""
    ledger, table = _memory_ledger(tmp_path, node_name)
    try:
        ledger.store.upsert([RowWrite("a", "r", cadence_s=CADENCE_S, job="j")], now=time.time())
        first = table.grant("a", "gpu-0", 60, time.time(), CADENCE_S)
        table.release("a", first.lease_id, time.time() - 1000)
        second = table.grant("a", "gpu-1", 60, time.time(), CADENCE_S)
        assert table.pin_late("a", first.lease_id, time.time() + 10) is False
        assert table.peek("a", second.lease_id)[0] is Outcome.COMPLETED  # untouched
        ledger.close()
    finally:
        table.close()
        LeaseTable.unlink(node_name)


def _memory_ledger(tmp_path: Path, node_name: str, **config: object):
    """A Ledger over in-memory twins (log, store) and a real lease table."""
    from node.completion.memory import MemoryCompletionStore

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    table = LeaseTable.create(node_name, capacity=64)
    cfg = Config(data_dir=data_dir, name=node_name, store="memory://", **config)  # type: ignore[arg-type]
    ledger = Ledger(
        cfg, LeaseTable.attach(node_name), open_store("memory://"), MemoryCompletionStore()
    )
    ledger.recover(time.time())
    return ledger, table


def test_received_is_the_keepers_count_and_the_last_one_read(tmp_path, node_name, monkeypatch):
    from shm.state import StateBuffer
    from workers.ledger import process as ledger_module

    monkeypatch.setattr(ledger_module, "KEEPER_COUNTERS_REREAD_S", 0.0)  # read at every call
    ledger, table = _memory_ledger(tmp_path, node_name)
    try:
        assert ledger.accounting()["received"] == 0  # no state buffer yet
        buf = StateBuffer.create(node_name, started_at=time.time())
        assert ledger.accounting()["received"] == 0  # the keeper has not written
        buf.write_doc({"now": {}}, time.time())
        assert ledger.accounting()["received"] == 0  # a document without counters
        buf.write_doc({"counters": {"received": 41}}, time.time())
        assert ledger.accounting()["received"] == 41
        buf.write_doc({"counters": {"received": 57}}, time.time())
        acct = ledger.accounting()
        assert acct["received"] == 57 and acct["balanced"] is True  # no input_gap: output judges
        buf.close()
        StateBuffer.unlink(node_name)
        ledger._state.close()
        ledger._state = None  # as if the buffer were being rebuilt: unreadable
        assert ledger.accounting()["received"] == 57  # the last value read
        buf = StateBuffer.create(node_name, started_at=time.time())
        buf.write_doc({"counters": {"received": "junk"}}, time.time())
        assert ledger.accounting()["received"] == 57
        buf.close()
    finally:
        StateBuffer.unlink(node_name)
        ledger.close()
        table.close()
        LeaseTable.unlink(node_name)


def test_retention_discards_only_what_outlived_it_and_drops_offers(tmp_path, node_name):
    """In process: one sweep discards each job's expired results (oldest
    first, whatever their offer), leaves younger ones and jobs without
    retention alone, and says so in one log line."""
    from node.completion import Result
    from node.config import JobConfig

    ledger, table = _memory_ledger(
        tmp_path, node_name, jobs={"short": JobConfig(retention_s=60.0), "keep": JobConfig()}
    )
    try:
        now = time.time()

        def add(job: str, finished_at: float, n: int) -> list[int]:
            ids = ledger.log.append_results(
                [Result(f"{job}/{finished_at}/{i}", job, 1, 1, finished_at, 600, b"{}", "json")
                 for i in range(n)]
            )  # fmt: skip
            ledger.log.flush()
            for rid in ids:
                ledger.delivery.add(rid, job)
            return ids

        old = add("short", now - 120, 3)
        add("keep", now - 120, 2)
        young = add("short", now - 1, 4)
        offered = ledger.delivery.poll("short", 1, now)
        assert offered == old[:1]
        assert ledger.retain(now) == {"short": 3}
        assert ledger.retain(now) == {}  # nothing more: the cost is what was dropped
        ledger.log.flush()
        assert ledger.delivery.poll("short", 100, now) == young
        assert ledger.delivery.retire("short", offered, now) == []  # its ack counts 0
        acct = ledger.accounting()
        assert (acct["discarded"], acct["awaiting_ack"], acct["finished"]) == (3, 6, 9)
        assert ledger.stats_reply()["discarded"] == 3
    finally:
        ledger.close()
        table.close()
        LeaseTable.unlink(node_name)


def test_retention_leaves_alone_a_result_whose_ack_waits_for_the_schedules_sync(
    tmp_path, node_name
):
    """An ack waits, pending in the log, for a sync of the write-backs before
    it (workers/ledger/acks.py): retention must not discard its result
    meanwhile, or the log would count discarded what was answered acked."""
    from node.completion import Result
    from node.config import JobConfig

    ledger, table = _memory_ledger(tmp_path, node_name, jobs={"short": JobConfig(retention_s=60.0)})
    try:
        now = time.time()
        ids = ledger.log.append_results(
            [Result(f"k{i}", "short", 1, 1, now - 120, 600, b"{}", "json") for i in range(3)]
        )
        ledger.log.flush()
        for rid in ids:
            ledger.delivery.add(rid, "short")
        assert ledger.delivery.poll("short", 10, now) == ids
        assert ledger.delivery.retire("short", ids[:2], now) == ids[:2]
        ledger.acks.written_gen += 1  # a write-back not synced yet: the ack is held
        assert ledger.acks.needs_sync()
        ledger.acks.hold(ids[:2], now, None)  # type: ignore[arg-type]
        assert ledger.retain(now) == {"short": 1}  # the third alone
        released = wait_for(ledger.acks.release, 5, "the sync")
        for acked, at, _gen, _waiter in released:
            ledger.log.ack(acked, at)
        ledger.log.flush()
        acct = ledger.accounting()
        assert (acct["acknowledged"], acct["discarded"]) == (2, 1)
    finally:
        ledger.close()
        table.close()
        LeaseTable.unlink(node_name)


def test_an_accounting_file_an_earlier_build_wrote_is_read(tmp_path):
    """tests/data/accounting-before-layout.json is the file the build before
    the layout change (issue 15) wrote: its format tag and fields must still
    read, or an upgraded node would refuse its own lifetime counters."""
    from workers.ledger.accounting import AccountingFile

    data = Path(__file__).resolve().parents[1] / "data" / "accounting-before-layout.json"
    (tmp_path / "accounting.json").write_bytes(data.read_bytes())
    acct = AccountingFile.open(tmp_path)
    assert acct.since == 1764000000.0
    assert acct.checkpoint == {"received": 12, "routed": 10, "finished": 9, "acknowledged": 8}
    acct.save()  # and it writes the same format back
    assert (
        json.loads((tmp_path / "accounting.json").read_text())["format"] == "queue-node.accounting"
    )
