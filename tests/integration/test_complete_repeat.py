"""A repeat of an accepted completion is answered ``repeat``, with the id it
was accepted as, whatever the lease table's slot for the key holds by then,
until its result is acknowledged and for ``REPEAT_WINDOW_S`` after, across a
restart of the ledger (CONTRACT, ``POST /complete``; docs/delivery.md).

The lease table only remembers a lease while the key's slot holds its record:
other keys reuse an idle slot, and a new grant of the key replaces it. So
most tests here first push 20,000 other keys through a small table (granted
and completed directly, as claimers and completions would) until the slot no
longer knows the lease, then repeat the completion against a real
``python -m workers.ledger``. The rest hold the index and the log's lease
evidence to their rules in process, time passed in.
"""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from node.completion import CompletionConfig, LogUnavailable, Result
from node.completion.memory import MemoryCompletionStore
from node.completion.segments import FileOps, SegmentStore, summary_name
from node.config import Config
from node.testing import wait_for
from shm.leases import LeaseTable, Outcome
from tests.integration.test_ledger import World, item, poll_all
from workers.ledger.delivery import RepeatIndex
from workers.ledger.process import LOG_DIR

REPEAT_WINDOW_S = Config().repeat_window_s

pytestmark = pytest.mark.timeout(120)

OTHER_KEYS = 20_000
TABLE_SLOTS = 256
PAD = b'{"pad":"' + b"x" * 1000 + b'"}'  # about 1 KiB: a few results to a 4 KiB segment


@pytest.fixture
def world(tmp_path, node_name):
    w = _world(tmp_path, node_name)
    yield w
    w.close()


def _world(tmp_path: Path, name: str, **config: object) -> World:
    """A ledger's world with a small lease table: slots are reused soon."""
    w = World(tmp_path, name, **config)
    w.table.close()
    LeaseTable.unlink(name)
    w.table = LeaseTable.create(name, capacity=TABLE_SLOTS)
    return w


def churn(table: LeaseTable, forgotten: list[tuple[str, int]], n: int = OTHER_KEYS) -> None:
    """Grant and complete ``n`` other keys, then check that the table no
    longer knows any of the ``forgotten`` (key, lease id): their slots went
    to other keys (what 17,159 new keys did to a 65,536-slot table)."""
    now = time.time()
    for i in range(n):
        lease = table.grant(f"other/{i}", "gpu-9", 60, now, 600)
        assert lease, lease
        assert table.complete(lease.key, lease.lease_id, now) is Outcome.COMPLETED
    for key, lease_id in forgotten:
        assert table.peek(key, lease_id)[0] is Outcome.UNKNOWN, key


def complete(c, *leases, result: bytes = b'{"ok":true}') -> list[dict]:
    return c.call("complete", items=[item(lease, result) for lease in leases])["outcomes"]


# -- through a real ledger process -----------------------------------------------------


def test_a_repeat_after_the_slot_was_reused_is_repeat_with_the_same_id(world):
    world.seed(["a", "b"])
    world.ledger.start()
    lease = world.grant("a")
    with world.ledger.client() as c:
        [first] = complete(c, lease)
        assert first["status"] == "ok"
        churn(world.table, [("a", lease.lease_id)])
        assert complete(c, lease) == [{"status": "repeat", "id": first["id"]}]
        # In a batch with a new completion: the repeat is one item's outcome.
        fresh = world.grant("b")
        both = complete(c, lease, fresh)
        assert both[0] == {"status": "repeat", "id": first["id"]}
        assert both[1]["status"] == "ok" and both[1]["id"] != first["id"]
        assert c.call("stats")["log"]["durable"] == 2  # nothing written for the repeats
        assert [r["id"] for r in poll_all(c, "j")] == [first["id"], both[1]["id"]]


def test_a_repeat_after_the_key_was_granted_again_is_repeat_not_conflict(world):
    world.seed(["a"])
    world.ledger.start()
    first = world.grant("a")
    with world.ledger.client() as c:
        [one] = complete(c, first)
        second = world.grant("a", consumer="gpu-1")  # the key, leased again
        assert world.table.peek("a", first.lease_id)[0] is Outcome.SUPERSEDED
        assert complete(c, first) == [{"status": "repeat", "id": one["id"]}]
        [two] = complete(c, second)
        assert two["status"] == "ok" and two["id"] != one["id"]
        assert complete(c, first, second) == [
            {"status": "repeat", "id": one["id"]},
            {"status": "repeat", "id": two["id"]},
        ]
        assert c.call("stats")["log"]["durable"] == 2


def test_a_repeat_after_its_result_was_acked_is_repeat_within_the_window(world):
    world.seed(["a"])
    world.ledger.start()
    lease = world.grant("a")
    with world.ledger.client() as c:
        [one] = complete(c, lease)
        assert [r["id"] for r in poll_all(c, "j")] == [one["id"]]
        assert c.call("ack", job="j", ids=[one["id"]])["acked"] == 1
        churn(world.table, [("a", lease.lease_id)])
        assert complete(c, lease) == [{"status": "repeat", "id": one["id"]}]
        assert poll_all(c, "j") == []  # acked stays acked: nothing written again
        stats = c.call("stats")
    assert stats["log"]["durable"] == 1 and stats["repeats"] == 1


def test_a_repeat_with_another_key_is_not_repeat(world):
    world.seed(["a", "b", "c"])
    world.ledger.start()
    lease = world.grant("a")
    held = world.grant("c")
    with world.ledger.client() as c:
        [one] = complete(c, lease)
        churn(world.table, [("a", lease.lease_id)])
        assert complete(c, lease) == [{"status": "repeat", "id": one["id"]}]
        # The same lease id under another key: the table answers for that
        # key (never leased: unknown; leased to another lease: unknown or
        # conflict by the ids' order), and nothing is written.
        wrong = [{"lease_id": lease.lease_id, "key": k, "result": b"1"} for k in ("b", "c")]
        outcomes = c.call("complete", items=wrong)["outcomes"]
        assert outcomes[0] == {"status": "unknown"}
        assert outcomes[1]["status"] in ("unknown", "conflict") and "id" not in outcomes[1]
        assert c.call("stats")["log"]["durable"] == 1
    assert world.table.peek("c", held.lease_id)[0] is Outcome.COMPLETED  # untouched


def test_a_repeat_after_a_ledger_restart_is_repeat_with_the_same_id(world):
    """kill -9 and a new ledger process: the index is rebuilt from the log, a
    pending result's lease from its record, an acked one's from its segment."""
    world.seed(["pending", "acked"])
    world.ledger.start()
    leases = {k: world.grant(k) for k in ("pending", "acked")}
    with world.ledger.client() as c:
        ids = {k: complete(c, lease)[0]["id"] for k, lease in leases.items()}
        offered = [r["id"] for r in poll_all(c, "j")]
        assert offered == [ids["pending"], ids["acked"]]
        assert c.call("ack", job="j", ids=[ids["acked"]])["acked"] == 1
    world.ledger.kill9()
    churn(world.table, [(k, lease.lease_id) for k, lease in leases.items()])
    world.ledger.start()
    with world.ledger.client() as c:
        assert c.call("stats")["recovery"]["repeats"] == 2
        for k, lease in leases.items():
            assert complete(c, lease) == [{"status": "repeat", "id": ids[k]}], k
        assert c.call("stats")["log"]["durable"] == 2
        assert [r["id"] for r in poll_all(c, "j")] == [ids["pending"]]


def test_a_repeat_after_compaction_and_a_restart_is_answered_from_the_lease_summary(
    tmp_path, node_name
):
    """kill -9, then a new ledger process: the pending result's lease comes
    from its record, an acked one's from its segment still on disk, and one
    whose segment compaction removed from that segment's lease summary."""
    world = _world(tmp_path, node_name, log_segment_bytes=4096)
    try:
        fill = [f"f{i}" for i in range(8)]
        world.seed(["acked", *fill, "last"])
        world.seed(["pending"], job="k")
        world.ledger.start()
        with world.ledger.client() as c:
            # "acked" and the fillers fill the first segments (about three
            # 1 KiB results to a 4 KiB segment); "pending" and "last" come after.
            leases = {k: world.grant(k) for k in ["acked", *fill, "pending", "last"]}
            ids = {}
            for k in ["acked", *fill, "pending", "last"]:
                [done] = complete(c, leases[k], result=PAD)
                assert done["status"] == "ok"
                ids[k] = done["id"]
            offered = [r["id"] for r in poll_all(c, "j")]
            assert sorted(offered) == sorted(v for k, v in ids.items() if k != "pending")
            assert c.call("ack", job="j", ids=offered)["acked"] == len(offered)
            log_dir = world.data_dir / LOG_DIR
            # "acked" is in segment 1: once acked, compaction removes it.
            summary, segment = log_dir / summary_name(1), log_dir / "000000000001.seg"
            wait_for(
                lambda: summary.exists() and not segment.exists(),
                20,
                "segment 1 compacted, its lease summary left",
            )
        churn(world.table, [(k, lease.lease_id) for k, lease in leases.items()])
        world.ledger.kill9()
        world.ledger.start()
        with world.ledger.client() as c:
            recovery = c.call("stats")["recovery"]
            assert recovery["summaries"] >= 1 and recovery["repeats"] == len(ids)
            for k in ("acked", "pending", "last"):
                assert complete(c, leases[k]) == [{"status": "repeat", "id": ids[k]}], k
            assert c.call("stats")["log"]["durable"] == len(ids)
            assert [r["id"] for r in poll_all(c, "k")] == [ids["pending"]]
            assert poll_all(c, "j") == []
    finally:
        world.close()


# -- the index and its window, in process -----------------------------------------------


def test_the_index_keeps_a_result_until_the_window_after_its_retirement():
    idx = RepeatIndex(window_s=100.0)
    idx.add(11, "a", 1)
    idx.add(12, "b", 2)
    idx.add(13, "c", 3)
    assert (idx.find(11, "a"), idx.find(11, "b"), idx.find(99, "a")) == (1, 0, 0)
    idx.retire([1, 3], now=1000.0)
    assert idx.expire(1099.9) == 0  # within the window
    assert (idx.find(11, "a"), idx.find(13, "c")) == (1, 3)
    assert idx.expire(1100.0) == 2
    assert (idx.find(11, "a"), idx.find(13, "c"), idx.find(12, "b")) == (0, 0, 2)
    assert idx.expire(1e12) == 0 and len(idx) == 1  # never retired: kept
    # Two results for one lease (an at-least-once window): the later answers,
    # and dropping the earlier one leaves it.
    idx.add(12, "b", 4)
    assert idx.find(12, "b") == 4
    idx.retire([2], now=2000.0)
    assert idx.expire(2100.0) == 1 and idx.find(12, "b") == 4


def test_dropping_costs_what_is_dropped_and_the_arrays_shrink():
    """Many results through the window: the index ends empty, with its
    arrays rebuilt (amortised), not holding one slot per result ever seen."""
    idx = RepeatIndex(window_s=10.0)
    for rid in range(1, 50_001):
        idx.add(1_000_000 + rid, f"k{rid}", rid)
        if rid % 100 == 0:  # 100 results a second, acked in the second they came
            idx.retire(range(rid - 99, rid + 1), now=rid / 100)
            idx.expire(rid / 100)
    assert len(idx) == 10 * 100  # the last 10 seconds' worth
    assert idx.find(1_000_000 + 50_000, "k50000") == 50_000
    assert idx.find(1_000_000 + 1, "k1") == 0
    assert idx.expire(1e9) == 1000 and len(idx) == 0
    assert len(idx._ids) <= 8192 and len(idx._retired) <= 8192


def test_the_index_costs_about_150_bytes_a_result_plus_its_key_once_retired():
    """The figure in docs/delivery.md: 100,000 results, keys made before
    (while a result is pending the log's index holds its key already)."""
    n = 100_000
    base_lease = 1_700_000_000_000_000  # lease ids are wall microseconds and up
    keys = [f"https://example.com/item/{i:08d}" for i in range(n)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idx = RepeatIndex(REPEAT_WINDOW_S)
        for i, key in enumerate(keys):
            idx.add(base_lease + i, key, 1 + i)
        idx.retire(range(1, n + 1), now=0.0)
        per_result = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert per_result < 200, per_result
    assert idx.find(base_lease + 5, keys[5]) == 6


def test_the_ledger_drops_repeats_after_the_window_and_answers_the_table_after(tmp_path, node_name):
    """In process over the in-memory log: the sweep drops an acked result's
    entry once REPEAT_WINDOW_S has passed; the slot still holding the lease
    answers a plain repeat (no id), as before this index existed."""
    import asyncio

    from node.config import Config
    from node.core.rows import RowWrite
    from node.store import open_store
    from workers.ledger.process import Ledger

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    table = LeaseTable.create(node_name, capacity=64)
    store = open_store("memory://")
    store.upsert([RowWrite("a", "r", cadence_s=600, job="j")], now=time.time())
    lease = table.grant("a", "gpu", 60, time.time(), 600, store.get("a").version)
    config = Config(data_dir=data_dir, name=node_name, store="memory://")
    ledger = Ledger(config, LeaseTable.attach(node_name), store, MemoryCompletionStore())
    try:

        async def body():
            ledger.recover(time.time())
            committer = asyncio.create_task(ledger.run_committer())
            one = await ledger.complete({"items": [item(lease)]})
            rid = one["outcomes"][0]["id"]
            ledger.offer("j", 10, time.time())
            await ledger.ack({"job": "j", "ids": [rid]})
            again = await ledger.complete({"items": [item(lease)]})
            ledger.sweep(time.time() + REPEAT_WINDOW_S + 1)
            late = await ledger.complete({"items": [item(lease)]})
            committer.cancel()
            return rid, again, late

        rid, again, late = asyncio.run(body())
        assert again["outcomes"] == [{"status": "repeat", "id": rid}]
        assert len(ledger.repeats) == 0
        assert late["outcomes"] == [{"status": "repeat"}]  # the table's answer
        ledger.close()
    finally:
        table.close()
        LeaseTable.unlink(node_name)


# -- the log's lease evidence, both backends -------------------------------------------

NOW = 1_700_000_000.0
KEEP = CompletionConfig(segment_bytes=4096, keep_retired_s=3600.0)


def _results(n: int, start: int = 0) -> list[Result]:
    return [
        Result(f"k{i}", "j", 5000 + i, 1, NOW, 600, b"x" * 1000, "bytes")
        for i in range(start, start + n)
    ]


@pytest.fixture(params=["memory", "segments"])
def reopen(request, tmp_path):
    """Opens one backend's log over one "disk", again and again (a restart)."""
    memory = MemoryCompletionStore(KEEP) if request.param == "memory" else None

    def open_log(ops: FileOps | None = None):
        if memory is not None:
            memory._closed = False
            store = memory
        else:
            store = SegmentStore(tmp_path / "log", KEEP, ops)
        store.recover()
        return store

    return open_log


def test_retired_leases_outlive_their_segment_and_a_restart_until_keep_retired_s(reopen):
    now = time.time()  # recovery drops summaries by the clock: this test's times are real
    log = reopen()
    ids = log.append_results(_results(4))
    log.flush()
    ids += log.append_results(_results(8, start=4))  # later segments
    log.flush()
    assert log.ack(ids[:6], now) == 6
    log.flush()
    log.close()
    log = reopen()  # a restart: from the ACK records and the segments
    got = log.retired_leases(now - 1)
    assert [(r.id, r.lease_id, r.key) for r in got] == [
        (rid, 5000 + i, f"k{i}") for i, rid in enumerate(ids[:6])
    ]
    assert all(r.retired_at >= now for r in got)
    assert log.retired_leases(now + 1) == []  # retired before that
    assert log.compact(now + 10) >= 1  # the acked segment goes, its summary stays
    log.close()
    log = reopen()
    assert [r.id for r in log.retired_leases(now - 1)] == ids[:6]
    assert [p.id for p in log.pending()] == ids[6:]  # never a pending one
    log.compact(now + 3600)  # keep_retired_s has passed: the summary goes
    # What is left is the segment still on disk (it holds pending results).
    assert [r.id for r in log.retired_leases(0.0)] == ids[4:6]
    log.close()
    log = reopen()
    assert [r.id for r in log.retired_leases(0.0)] == ids[4:6]
    log.close()


def test_a_retire_record_without_a_time_counts_as_retired_at_recovery(reopen):
    """Formats 1 and 2 wrote ACK and DISCARD records without a time: their
    results count as retired when recovery reads them (kept longer, never
    shorter)."""
    log = reopen()
    ids = log.append_results(_results(3))
    log.flush()
    log.ack(ids[:1], NOW)
    log._retires[-1].at = None  # as format 2 wrote it
    log.discard(ids[1:2], "retention", NOW)
    log._retires[-1].at = None
    log.flush()
    log.close()
    before = time.time()
    log = reopen()
    got = log.retired_leases(before)
    assert [r.id for r in got] == ids[:2] and all(r.retired_at >= before for r in got)
    log.close()


def test_a_summary_of_a_segment_still_on_disk_is_dropped_by_recovery(tmp_path):
    """The summaries are durable before the checkpoint: a failure (or a crash)
    between the two leaves the segments on disk and a summary of them;
    recovery deletes the summary, and the segment is the evidence."""

    class NoCheckpoint(FileOps):
        def rename(self, src, dst):
            if dst.name == "checkpoint":
                raise OSError(28, "No space left on device")
            return super().rename(src, dst)

    path = tmp_path / "log"
    log = SegmentStore(path, KEEP, NoCheckpoint())
    log.recover()
    ids = log.append_results(_results(4))
    log.flush()
    ids += log.append_results(_results(4, start=4))
    log.flush()
    now = time.time()  # recovery drops summaries by the clock
    log.ack(ids[:4], now)
    with pytest.raises(LogUnavailable):
        log.compact(now)
    log.close()
    assert (path / summary_name(1)).exists() and (path / "000000000001.seg").exists()
    log = SegmentStore(path, KEEP)
    log.recover()
    assert not (path / summary_name(1)).exists()
    assert [r.id for r in log.retired_leases(now)] == ids[:4]
    assert log.compact(now) >= 1 and (path / summary_name(1)).exists()
    log.close()
    log = SegmentStore(path, KEEP)
    log.recover()  # read back from the summary
    assert [r.id for r in log.retired_leases(now)] == ids[:4]
    log.close()
    summary = path / summary_name(1)
    summary.write_bytes(summary.read_bytes()[:-3])  # torn: logged, deleted, not fatal
    log = SegmentStore(path, KEEP)
    log.recover()
    assert not summary.exists() and log.retired_leases(now) == []
    log.close()


def test_records_name_their_lease_and_the_ledger_reads_it_back(tmp_path):
    """What recovery relies on: every RESULT record carries its lease id and
    key (formats 1 to 3), read back here without the payload."""
    log = SegmentStore(tmp_path / "log", KEEP)
    log.recover()
    ids = log.append_results(_results(5))
    log.flush()
    assert log._results_of(1)[:3] == [(ids[i], 5000 + i, f"k{i}") for i in range(3)]
    log.close()
