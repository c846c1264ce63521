"""The group commit's fsync, in process: it runs on the loop's thread, and on
the fsync thread for a while after one was slow (``FSYNC_SLOW_S``,
``workers/ledger/process.py``); on either thread a failed fsync answers
``log_unavailable`` and writes nothing back: the leases stay live, the rows
keep their due times, and the retry once the disk works is taken."""

from __future__ import annotations

import asyncio
import errno
import threading
import time

import pytest

from node.completion import CompletionConfig, open_completion_store
from node.completion.segments import FileOps
from node.config import Config
from node.core.rows import RowWrite
from node.store import open_store
from shm.leases import LeaseTable, Outcome
from workers.ledger import process
from workers.ledger.process import Ledger

pytestmark = pytest.mark.timeout(60)

CADENCE_S = 600
# The test's slow disk: an fsync of SLOW_S, against a threshold of half that
# (no fast fsync of a loaded test machine takes that long).
SLOW_S = 0.4


class FsyncOps(FileOps):
    """Records the thread of every fsync; fails them with EIO while
    ``failing``; sleeps ``delay_s`` before each (a slow disk)."""

    def __init__(self) -> None:
        self.failing = False
        self.delay_s = 0.0
        self.threads: list[str] = []

    def fsync(self, fd: int) -> None:
        self.threads.append(threading.current_thread().name)
        if self.delay_s:
            time.sleep(self.delay_s)  # the slow disk, not synchronisation
        if self.failing:
            raise OSError(errno.EIO, "Input/output error (injected)")
        super().fsync(fd)


class World:
    def __init__(self, tmp_path, node_name) -> None:
        data_dir = tmp_path / "data"
        data_dir.mkdir()
        self.name = node_name
        config = Config(data_dir=data_dir, name=node_name, store="memory://")
        self.table = LeaseTable.create(node_name, capacity=64)
        self.store = open_store("memory://")
        self.ops = FsyncOps()
        self.log = open_completion_store(f"segments:///{tmp_path / 'log'}", CompletionConfig(),
                                         file_ops=self.ops)  # fmt: skip
        self.keys = [f"k{i}" for i in range(10)]
        self.store.upsert([RowWrite(k, "r", cadence_s=CADENCE_S, job="j") for k in self.keys],
                          now=time.time())  # fmt: skip
        self.rows = {k: self.store.get(k) for k in self.keys}
        self.ledger = Ledger(config, LeaseTable.attach(node_name), self.store, self.log)

    def items(self, keys: list[str]) -> list[dict]:
        now = time.time()
        leases = [self.table.grant(k, "gpu", 60, now, CADENCE_S, self.rows[k].version)
                  for k in keys]  # fmt: skip
        return [{"lease_id": lease.lease_id, "key": lease.key, "result": b"{}",
                 "encoding": "json"} for lease in leases]  # fmt: skip

    async def complete(self, keys: list[str]) -> list[str]:
        reply = await self.ledger.complete({"items": self.items(keys)})
        return [o["status"] for o in reply["outcomes"]]


@pytest.fixture
def world(tmp_path, node_name, monkeypatch):
    monkeypatch.setattr(process, "FSYNC_SLOW_S", SLOW_S / 2)
    w = World(tmp_path, node_name)
    yield w
    w.table.close()
    LeaseTable.unlink(node_name)


@pytest.mark.parametrize("slow_disk", [False, True])
def test_a_failed_fsync_answers_log_unavailable_on_either_thread(world, monkeypatch, slow_disk):
    monkeypatch.setattr(process, "FSYNC_SLOW_HOLD_S", 30.0)
    ledger, ops, keys = world.ledger, world.ops, world.keys
    group = keys[1:9]

    async def body():
        ledger.recover(time.time())
        committer = asyncio.create_task(ledger.run_committer())
        # A first result opens the log's segment (its creation fsyncs too);
        # on a slow disk it also sends the next groups to the fsync thread.
        ops.delay_s = SLOW_S if slow_disk else 0.0
        assert await world.complete(keys[:1]) == ["ok"]
        ops.delay_s, ops.failing, ops.threads[:] = 0.0, True, []
        items = world.items(group)
        refused = await ledger.complete({"items": items})
        threads = list(ops.threads)
        # Nothing of the group was written back, and every lease is live.
        assert all(world.store.get(k).due_at == world.rows[k].due_at for k in group)
        assert all(world.table.peek(it["key"], it["lease_id"])[0] is Outcome.COMPLETED
                   for it in items)  # fmt: skip
        ops.failing = False
        taken = await ledger.complete({"items": items})
        committer.cancel()
        return refused, threads, taken

    refused, threads, taken = asyncio.run(body())
    assert [o["status"] for o in refused["outcomes"]] == ["log_unavailable"] * len(group)
    # The group's own fsync (the cut-back after a failed one fsyncs on the loop).
    if slow_disk:
        assert threads[0].startswith("ledger-fsync"), threads
    else:
        assert threads[0] == "MainThread", threads
    assert [o["status"] for o in taken["outcomes"]] == ["ok"] * len(group)
    assert all(world.store.get(k).due_at > world.rows[k].due_at for k in keys[:9])
    assert world.log.counters().durable == 9
    assert ledger.accounting()["balanced"] is True
    ledger.close()


def test_after_a_slow_fsync_the_thread_takes_them_for_a_while(world, monkeypatch):
    monkeypatch.setattr(process, "FSYNC_SLOW_HOLD_S", 1.0)
    ledger, ops, keys = world.ledger, world.ops, world.keys

    async def body():
        ledger.recover(time.time())
        committer = asyncio.create_task(ledger.run_committer())
        assert await world.complete(keys[9:]) == ["ok"]  # opens the log's segment
        seen = []
        for i, (key, delay) in enumerate(zip(keys[:4], [0.0, SLOW_S, 0.0, 0.0], strict=True)):
            if i == 3:
                await asyncio.sleep(1.1)  # past the hold: the loop's turn again
            ops.delay_s, ops.threads[:] = delay, []
            assert await world.complete([key]) == ["ok"]
            seen.append(ops.threads[0])
        committer.cancel()
        return seen

    seen = asyncio.run(body())
    # Fast, on the loop; slow, on the loop (found slow there); then the
    # thread within the hold; after it, the loop again.
    assert seen[:2] == ["MainThread", "MainThread"], seen
    assert seen[2].startswith("ledger-fsync"), seen
    assert seen[3] == "MainThread", seen
    ledger.close()
