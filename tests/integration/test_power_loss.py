"""A power loss, through a fault seam: the schedule loses every write that
was not synced, the lease table (shared memory) is gone, the log keeps what
it fsynced.

The ledger writes its write-backs with ``synchronous = NORMAL`` (durable
across a crash of a process, not a power loss). What keeps a result from
being run again after a power loss: an acknowledged result's write-back was
synced before its ack was (``Store.sync`` before any retire record), and a
pending one's is done again from the log when the ledger starts. The seam
(``QUEUE_NODE_STORE_SYNCED``, a test hook) copies the schedule at every
``Store.sync``: the copy is at most what a power loss leaves, and the test
puts it in place of the schedule, as the disk would after the reboot.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

from node.store import open_store
from node.testing import NodeProcess, cleanup_segments, finish, wait_for
from shm.leases import LeaseTable
from tests.integration.test_ledger import CADENCE_S, World, item, poll_all

pytestmark = pytest.mark.timeout(120)


def _copy(src: str, dest: Path) -> None:
    out = sqlite3.connect(dest)
    try:
        with sqlite3.connect(src) as conn:
            conn.backup(out)
    finally:
        out.close()


def _power_loss(world: World, synced: Path) -> None:
    """kill -9, then what a reboot leaves: the synced copy of the schedule
    (its WAL gone with the unsynced pages), no shared memory."""
    world.ledger.kill9()
    path = world.store.path
    world.store.close()
    for suffix in ("-wal", "-shm"):
        Path(path + suffix).unlink(missing_ok=True)
    os.replace(synced, path)
    world.table.close()
    LeaseTable.unlink(world.name)
    world.table = LeaseTable.create(world.name, capacity=1024)
    world.store = open_store(world.config.store_url)


def test_after_a_power_loss_no_acked_or_pending_result_is_due_again(tmp_path, node_name):
    synced = tmp_path / "synced.db"
    world = World(tmp_path, node_name)
    world.ledger.env.update(QUEUE_NODE_TEST_HOOKS="1", QUEUE_NODE_STORE_SYNCED=str(synced))
    try:
        world.seed(["acked", "pending"])
        _copy(world.store.path, synced)  # the seeded rows were synced (FULL)
        seeded_due = world.store.get("acked").due_at
        world.ledger.start()
        with world.ledger.client() as c:
            acked = world.grant("acked")
            (done,) = c.call("complete", items=[item(acked)])["outcomes"]
            assert done["status"] == "ok"
            (offered,) = poll_all(c, "j")
            assert c.call("ack", job="j", ids=[offered["id"]])["acked"] == 1
            pending = world.grant("pending")
            (kept,) = c.call("complete", items=[item(pending)])["outcomes"]
            assert kept["status"] == "ok"
        # Both write-backs are in the store now (NORMAL), the second unsynced.
        assert world.store.get("pending").due_at > seeded_due
        _power_loss(world, synced)
        # What the disk kept: the acked result's write-back (synced before its
        # ack); the pending one's is gone with the unsynced pages.
        row = world.store.get("acked")
        assert row.due_at == pytest.approx(offered["finished_at"] + CADENCE_S, abs=1)
        assert row.last_result_id == done["id"]
        assert world.store.get("pending").due_at == seeded_due
        world.ledger.start()
        with world.ledger.client() as c:
            # The pending result's write-back is done again from the log.
            row = world.store.get("pending")
            assert row.due_at > time.time() + CADENCE_S / 2
            assert row.last_result_id == kept["id"]
            (again,) = poll_all(c, "j")
            assert again["id"] == kept["id"]
            assert c.call("accounting")["acknowledged"] == 1
    finally:
        world.close()


def test_acks_made_while_write_backs_go_on_are_durable_only_after_theirs(tmp_path, node_name):
    """Two processes complete while a third acks what it is offered, so acks
    wait for syncs of the schedule made while other write-backs commit (the
    syncs off the ledger's loop, at most every 20 ms). After a power loss,
    every acknowledged result's write-back is in what the disk kept."""
    import threading

    synced = tmp_path / "synced.db"
    world = World(tmp_path, node_name)
    world.ledger.env.update(QUEUE_NODE_TEST_HOOKS="1", QUEUE_NODE_STORE_SYNCED=str(synced))
    keys = [f"k{i:03d}" for i in range(240)]
    try:
        world.seed(keys)
        _copy(world.store.path, synced)
        seeded_due = world.store.get(keys[0]).due_at
        leases = [world.grant(k) for k in keys]
        world.ledger.start()
        acked: dict[int, str] = {}  # result id -> key
        done = threading.Event()

        def complete(part: list) -> None:
            with world.ledger.client() as c:
                for lease in part:
                    (out,) = c.call("complete", items=[item(lease)])["outcomes"]
                    assert out["status"] == "ok"

        def ack() -> None:
            with world.ledger.client() as c:
                while not done.is_set() or len(acked) < len(keys):
                    offered = c.call("poll", job="j", max=7, wait_s=0.05)["results"]
                    if offered:
                        ids = [o["id"] for o in offered]
                        assert c.call("ack", job="j", ids=ids)["acked"] == len(ids)
                        acked.update((o["id"], o["key"]) for o in offered)

        workers = [threading.Thread(target=complete, args=(leases[i::2],)) for i in range(2)]
        acker = threading.Thread(target=ack)
        for t in (*workers, acker):
            t.start()
        for t in workers:
            t.join(60)
        done.set()
        acker.join(60)
        assert len(acked) == len(keys)
        _power_loss(world, synced)
        rows = world.store.get_many(keys)
        for rid, key in acked.items():
            assert rows[key].due_at > seeded_due, key  # its write-back is on disk
            assert rows[key].last_result_id == rid
    finally:
        world.close()


def test_after_a_reboot_the_keeper_publishes_once_the_ledger_has_written_back(tmp_path, node_name):
    """A whole node, a power loss after a completion (kill -9 of every
    process, the shared memory gone, the schedule back to its last synced
    state), and a ledger slow to start (a test hook): the keeper must not
    publish the completed key with its old due time before the ledger has
    written it back, so a claim after the restart never grants it."""
    data = tmp_path / "data"
    db = data / "schedule.db"
    synced = tmp_path / "synced.db"
    node = NodeProcess(data, node_name)
    try:
        node.start()
        now = time.time()
        rows = [{"key": "done", "route": "r", "cadence_s": 600, "due_at": now - 300, "job": "j"},
                {"key": "fresh", "route": "r", "cadence_s": 600, "due_at": now - 5, "job": "j"}]
        assert node.request("POST", "/rows", rows)[0] == 200

        def claim_one() -> dict | None:
            status, body = node.request("POST", "/claim", {"max": 1, "consumer": "t"})
            return body["leases"][0] if status == 200 and body["leases"] else None

        lease = wait_for(claim_one, 20, "a lease")
        assert lease["key"] == "done"  # the most late first
        _copy(str(db), synced)  # the rows are synced (FULL); the write-back will not be
        status, _ = node.request(
            "POST", "/complete", {"lease_id": lease["lease_id"], "key": "done", "result": 1}
        )
        assert status == 200
        node.kill()
        cleanup_segments(node_name)  # a reboot
        for suffix in ("-wal", "-shm"):
            Path(str(db) + suffix).unlink(missing_ok=True)
        os.replace(synced, db)
        node.env["QUEUE_NODE_TEST_LEDGER_START_DELAY_S"] = "2"
        node.start()
        granted = wait_for(claim_one, 20, "the other key's lease")
        assert granted["key"] == "fresh"
        assert node.request("POST", "/claim", {"max": 10, "consumer": "t"})[1]["leases"] == []
        assert "ledger_first" in node.log()
    finally:
        finish([node], node_name)
