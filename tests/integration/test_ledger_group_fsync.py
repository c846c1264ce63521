"""The group commit's fsync, in process: a small group's runs on the loop's
thread, a larger one's on the fsync thread (``INLINE_FSYNC_BELOW``,
``workers/ledger/process.py``), and on either path a failed fsync answers
``log_unavailable`` and writes nothing back: the lease stays live, the row
keeps its due time, and the retry once the disk works is taken."""

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
from workers.ledger.process import INLINE_FSYNC_BELOW, Ledger

pytestmark = pytest.mark.timeout(60)

CADENCE_S = 600


class FsyncOps(FileOps):
    """Records the thread of every fsync; fails them with EIO while ``failing``."""

    def __init__(self) -> None:
        self.failing = False
        self.threads: list[str] = []

    def fsync(self, fd: int) -> None:
        self.threads.append(threading.current_thread().name)
        if self.failing:
            raise OSError(errno.EIO, "Input/output error (injected)")
        super().fsync(fd)


@pytest.mark.parametrize("n", [1, INLINE_FSYNC_BELOW])
def test_a_groups_fsync_fails_then_works_on_either_thread(tmp_path, node_name, n):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    config = Config(data_dir=data_dir, name=node_name, store="memory://")
    table = LeaseTable.create(node_name, capacity=64)
    store = open_store("memory://")
    ops = FsyncOps()
    log = open_completion_store(f"segments:///{tmp_path / 'log'}", CompletionConfig(),
                                file_ops=ops)  # fmt: skip
    keys = [f"k{i}" for i in range(n)]
    try:
        now = time.time()
        store.upsert([RowWrite(k, "r", cadence_s=CADENCE_S, job="j") for k in ["w", *keys]],
                     now=now)  # fmt: skip
        rows = {k: store.get(k) for k in ["w", *keys]}
        leases = [table.grant(k, "gpu", 60, now, CADENCE_S, rows[k].version) for k in keys]
        items = [{"lease_id": lease.lease_id, "key": lease.key, "result": b"{}",
                  "encoding": "json"} for lease in leases]  # fmt: skip
        warm = table.grant("w", "gpu", 60, now, CADENCE_S, rows["w"].version)
        ledger = Ledger(config, LeaseTable.attach(node_name), store, log)

        async def body():
            ledger.recover(time.time())
            committer = asyncio.create_task(ledger.run_committer())
            # A first result opens the log's segment (its creation fsyncs too).
            first = await ledger.complete({"items": [{"lease_id": warm.lease_id, "key": "w",
                                                       "result": b"{}", "encoding": "json"}]})
            assert first["outcomes"][0]["status"] == "ok"
            ops.failing, ops.threads[:] = True, []
            refused = await ledger.complete({"items": items})
            threads = list(ops.threads)
            # Nothing of the group was written back, and every lease is live.
            assert all(store.get(k).due_at == rows[k].due_at for k in keys)
            assert all(table.peek(k, lease.lease_id)[0] is Outcome.COMPLETED
                       for k, lease in zip(keys, leases, strict=True))  # fmt: skip
            ops.failing = False
            taken = await ledger.complete({"items": items})
            committer.cancel()
            return refused, threads, taken

        refused, threads, taken = asyncio.run(body())
        assert refused["outcomes"] == [{"status": "log_unavailable"}] * n
        # The group's own fsync (the cut-back after it fsyncs on the loop).
        group_fsync = threads[0]
        if n < INLINE_FSYNC_BELOW:
            assert group_fsync == "MainThread", threads
        else:
            assert group_fsync.startswith("ledger-fsync"), threads
        assert [o["status"] for o in taken["outcomes"]] == ["ok"] * n
        assert all(store.get(k).due_at > rows[k].due_at for k in keys)
        assert log.counters().durable == n + 1
        assert ledger.accounting()["balanced"] is True
        ledger.close()
    finally:
        table.close()
        LeaseTable.unlink(node_name)
