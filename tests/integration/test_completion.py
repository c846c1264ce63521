"""One suite for both completion-store backends, then what only files can show.

The shared tests run against the in-memory twin and the segment files alike
(the ``log`` fixture); ``log.recover()`` stands for a restart in both (the
buffer is dropped, everything is rebuilt from what is durable). The rest
tears, corrupts and fills the segment files, kills a writer with SIGKILL, and
checks that recovery holds no payloads in memory.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest

from node.completion import (
    CompletionConfig,
    LogCorrupt,
    LogLocked,
    LogStateError,
    LogUnavailable,
    Result,
    UnknownResult,
    check_completion_url,
    open_completion_store,
)
from node.completion.memory import MemoryCompletionStore
from node.completion.pending import PendingIndex
from node.completion.segments import (
    FORMAT_VERSION,
    FRAME,
    HEADER,
    LOCK_NAME,
    FileOps,
    SegmentStore,
    read_segment_records,
    segment_name,
)
from node.core.errors import ConfigError, ValidationError

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_700_000_000.0
SMALL = CompletionConfig(segment_bytes=4096)


def result(i: int, job: str = "j", value: object = None, data: bytes | None = None) -> Result:
    meta = dict(
        key=f"k{i}", job=job, lease_id=1000 + i, version=7, finished_at=NOW + i, cadence_s=3600
    )
    if data is not None:
        return Result(data=data, **meta)
    return Result.of({"n": i} if value is None else value, **meta)


def results(n: int, start: int = 0, job: str = "j", size: int = 0) -> list[Result]:
    if size:
        return [result(i, job, data=bytes([i % 251]) * size) for i in range(start, start + n)]
    return [result(i, job) for i in range(start, start + n)]


def segments_on_disk(path: Path) -> list[int]:
    return sorted(int(n[:12]) for n in os.listdir(path) if n.endswith(".seg"))


class Disk:
    """Opens a store of one backend over one "disk", again and again."""

    def __init__(self, kind: str, path: Path) -> None:
        self.kind = kind
        self.path = path
        self.memory: MemoryCompletionStore | None = None

    def open(self, config: CompletionConfig | None = None, ops: FileOps | None = None):
        if self.kind == "memory":
            if self.memory is None:
                self.memory = MemoryCompletionStore(config)
            self.memory._closed = False  # the twin's "disk" is the object itself
            return self.memory
        return SegmentStore(self.path, config, ops)


@pytest.fixture(params=["memory", "segments"])
def disk(request, tmp_path) -> Disk:
    return Disk(request.param, tmp_path / "completion")


@pytest.fixture
def log(disk):
    store = disk.open()
    store.recover()
    yield store
    store.close()


# -- shared semantics ---------------------------------------------------------------------


def test_a_result_is_pending_only_after_flush(log):
    ids = log.append_results(results(3))
    assert ids == [1, 2, 3]
    assert log.pending() == [] and log.pending_count() == 0
    assert log.counters().appended == 3 and log.counters().durable == 0
    log.flush()
    assert [p.id for p in log.pending()] == [1, 2, 3]
    assert log.counters().durable == 3


def test_pending_in_id_order_per_job_with_limits_and_read_back(log):
    rs = [result(i, job="a" if i % 3 else "b") for i in range(30)]
    ids = log.append_results(rs)
    log.flush()
    assert [p.id for p in log.pending()] == ids
    assert [p.id for p in log.pending("b")] == [ids[i] for i in range(0, 30, 3)]
    assert [p.id for p in log.pending("a", limit=2)] == [ids[1], ids[2]]
    assert log.pending("nobody") == [] and log.pending_count("nobody") == 0
    assert log.pending_count("a") == 20 and log.pending_count() == 30
    p = log.get_pending(ids[4])
    assert (p.job, p.key, p.finished_at) == ("a", "k4", NOW + 4)
    back = log.read_result(ids[4])
    assert back.value() == {"n": 4} and back.id == ids[4]
    assert (back.lease_id, back.version, back.cadence_s) == (1004, 7, 3600)


def test_bytes_and_json_results_round_trip(log):
    ids = log.append_results(
        [result(1, data=b"\x00\xffraw"), result(2, value=["x", 1.5, None]), result(3, value="t")]
    )
    log.flush()
    log.recover()
    assert log.read_result(ids[0]).value() == b"\x00\xffraw"
    assert log.read_result(ids[0]).encoding == "bytes"
    assert log.read_result(ids[1]).value() == ["x", 1.5, None]
    assert log.read_result(ids[2]).value() == "t"


def test_ack_is_idempotent_and_ignores_unknown_ids(log):
    ids = log.append_results(results(5))
    assert log.ack(ids) == 0  # buffered, never offered: not pending yet
    log.flush()
    assert log.ack([ids[0], ids[1], 999]) == 2
    assert log.ack([ids[0]]) == 0
    assert [p.id for p in log.pending()] == ids[2:]
    with pytest.raises(UnknownResult):
        log.read_result(ids[0])
    assert log.get_pending(ids[0]) is None
    assert log.counters().acked == 0  # counted when the ACK record is durable
    log.flush()
    assert log.counters().acked == 2


def test_restart_drops_the_buffer_and_reoffers_unflushed_acks(log):
    ids = log.append_results(results(4))
    log.flush()
    log.ack(ids[:2])
    log.append_results(results(2, start=10))  # never flushed
    report = log.recover()
    # The acks were not durable: offered again (at-least-once, never loss).
    assert [p.id for p in log.pending()] == ids
    assert report.pending == 4 and report.counters.durable == 4
    assert log.counters().appended == 4


def test_counters_after_flush_equal_what_recovery_rebuilds(log):
    ids = log.append_results(results(50, job="a") + results(50, job="b"))
    log.flush()
    log.ack(ids[:30])
    log.discard(ids[30:35], "operator")
    log.flush()
    log.ack(ids[30:40])  # five of these are already discarded
    log.flush()
    before = log.counters()
    assert (before.durable, before.acked, before.discarded) == (100, 35, 5)
    assert before.awaiting_ack == 60
    report = log.recover()
    assert report.counters == before and log.counters() == before
    assert report.exact and log.pending_count() == 60


def test_ids_keep_increasing_across_restarts(log):
    first = log.append_results(results(3))
    log.flush()
    log.ack(first)
    log.flush()
    log.recover()
    second = log.append_results(results(2))
    log.flush()
    assert second[0] > first[-1]
    log.compact()
    log.recover()
    third = log.append_results(results(1))
    assert third[0] > second[-1]


def test_discard_and_retention_count_as_discarded(log):
    ids = log.append_results([result(i, job="a") for i in range(10)])
    log.flush()
    assert log.discard(ids[:2], "operator") == 2
    # finished_at = NOW + i: results 2..4 finished before NOW + 5.
    assert log.discard_expired("a", NOW + 5) == 3
    assert log.discard_expired("a", NOW + 5) == 0
    assert log.discard_expired("nobody", NOW + 5) == 0
    log.flush()
    assert log.counters().discarded == 5
    assert [p.id for p in log.pending("a")] == ids[5:]
    log.recover()
    assert log.counters().discarded == 5 and log.pending_count() == 5


def test_expired_lists_what_retention_would_discard_oldest_first_up_to_a_limit(log):
    ids = log.append_results([result(i, job="a") for i in range(10)])
    ids += log.append_results([result(i, job="b") for i in range(10, 12)])
    log.flush()
    log.ack(ids[1:2])
    # finished_at = NOW + i; an acked one in between is skipped, not a stop.
    assert log.expired("a", NOW + 5) == [ids[0], ids[2], ids[3], ids[4]]
    assert log.expired("a", NOW + 5, limit=2) == [ids[0], ids[2]]
    assert log.expired("a", NOW) == [] and log.expired("nobody", NOW + 99) == []
    assert log.pending_count("a") == 9  # nothing retired by looking
    assert log.discard(log.expired("a", NOW + 5, limit=2), "retention") == 2
    assert log.expired("a", NOW + 5) == [ids[3], ids[4]]


def test_fsync_always_makes_each_call_durable(disk):
    store = disk.open(CompletionConfig(fsync="always"))
    store.recover()
    ids = store.append_results(results(2))
    assert [p.id for p in store.pending()] == ids  # no flush needed
    store.ack(ids[:1])
    store.recover()
    assert [p.id for p in store.pending()] == ids[1:]
    store.close()


def test_calls_before_recover_or_after_close_are_refused(disk):
    store = disk.open()
    with pytest.raises(LogStateError):
        store.append_results(results(1))
    store.recover()
    store.close()
    store.close()  # idempotent
    with pytest.raises(LogStateError):
        store.pending()


def test_rollover_then_compaction_removes_only_fully_retired_segments(disk):
    store = disk.open(SMALL)
    store.recover()
    ids = []
    for b in range(16):
        ids += store.append_results(results(4, start=b * 4, size=200))
        store.flush()
    segs = store.removable_segments()
    assert segs == []
    numbers = sorted(store._segments)
    assert len(numbers) >= 4
    # Retire every result of the first two segments, and one of the third.
    first_two = [p.id for p in store.pending() if p.segment in numbers[:2]]
    third = [p.id for p in store.pending() if p.segment == numbers[2]]
    store.ack(first_two)
    store.discard(third[:1], "retention")
    store.flush()
    before = store.counters()
    assert store.compact() == 2
    assert sorted(store._segments) == numbers[2:]
    if disk.kind == "segments":
        assert segments_on_disk(disk.path) == numbers[2:]
    assert store.counters() == before
    # Lifetime counts survive the removal, by way of the checkpoint.
    report = store.recover()
    assert report.counters == before and report.exact
    assert [p.id for p in store.pending()] == [i for i in ids if i not in first_two + third[:1]]
    assert store.read_result(third[1]).key == f"k{third[1] - 1}"
    store.close()


def test_a_batch_with_a_bad_result_is_refused_whole(log):
    bad = Result("k", "j", 1, 1, NOW, 60, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        log.append_results([result(1), bad])
    assert log.buffered == 0 and log.counters().appended == 0
    assert log.append_results([result(2)]) == [1]


def test_compaction_never_removes_the_active_segment(log):
    ids = log.append_results(results(5))
    log.flush()
    log.ack(ids)
    assert log.compact() == 0  # everything acked, but it is the active segment
    log.recover()
    assert log.counters().acked == 5


def test_a_segment_whose_acks_retire_a_live_segment_is_kept(disk):
    """Removing segment 2 while segment 1 is on disk would lose the ACK
    records in 2 for results in 1: they would be offered again."""
    store = disk.open(SMALL)
    store.recover()
    seg1 = store.append_results(results(6, size=400))
    store.flush()
    seg2 = store.append_results(results(6, start=6, size=400))
    store.flush()
    store.ack(seg1[:3])  # lands in segment 2
    store.flush()
    store.append_results(results(6, start=12, size=400))  # segment 3, the active one
    store.flush()
    numbers = sorted(store._segments)
    assert len(numbers) == 3
    assert store.get_pending(seg2[0]).segment == numbers[1]
    store.ack(seg2)
    store.flush()
    assert store.compact() == 0  # 2 holds acks for 1, which still has pending results
    store.recover()  # recovery rebuilds the same pin from the records
    assert store.compact() == 0
    store.ack(seg1[3:])
    assert store.compact() == 2
    report = store.recover()
    assert report.counters.acked == 12 and store.pending_count() == 6
    store.close()


def test_memory_twin_full_disk_rejects_the_batch(tmp_path):
    store = MemoryCompletionStore()
    store.recover()
    kept = store.append_results(results(2))
    store.flush()
    store.disk_full = True
    store.append_results(results(2, start=5))
    with pytest.raises(LogUnavailable):
        store.flush()
    store.disk_full = False
    store.flush()
    assert [p.id for p in store.pending()] == kept
    assert store.counters().rejected == 2


def test_open_completion_store_urls(tmp_path):
    assert check_completion_url("memory://") == "memory://"
    with pytest.raises(ConfigError):
        check_completion_url("postgresql://x")
    with open_completion_store("memory://") as store:
        store.recover()
    with open_completion_store(f"segments:///{tmp_path}/c") as store:
        store.recover()
        store.append_results(results(1))
    assert segments_on_disk(tmp_path / "c") == [1]


def test_recovery_applies_acks_in_bulk_passes_with_the_same_answer(disk, monkeypatch):
    monkeypatch.setattr("node.completion.buffered.RETIRE_PASS_MIN_IDS", 8)
    store = disk.open(SMALL)
    store.recover()
    for b in range(30):
        ids = store.append_results(
            [result(i, job="ab"[i % 2], data=b"x" * 50) for i in range(b * 10, b * 10 + 10)]
        )
        store.flush()
        store.ack(ids[2:])  # most of them: passes run while the scan goes on
        if b % 7 == 0:
            store.discard(ids[1:2], "retention")
        store.flush()
    before = (store.counters(), store.pending(), sorted(store._segments))
    refs = {n: s.refs for n, s in store._segments.items()}
    report = store.recover()
    assert (store.counters(), store.pending(), sorted(store._segments)) == before
    assert report.segments > 3 and report.exact
    # Recovery's refs may name more segments than the writer's, never fewer.
    assert all(refs[n] <= s.refs for n, s in store._segments.items())
    store.close()


def test_bulk_retire_after_single_removals_takes_the_general_way():
    index = PendingIndex()
    for i in range(1, 11):
        index.add(i, "j", f"k{i}", float(i), (1 << 40) | i)
    index.remove(5)
    counts = index.retire_bulk({4: False, 5: False, 6: True, 99: False}, True)
    assert counts == {(1, False): 1, (1, True): 1}
    assert [p.id for p in index.entries()] == [1, 2, 3, 7, 8, 9, 10]


def test_pending_index_survives_many_out_of_order_removals():
    index = PendingIndex()
    for i in range(1, 20_001):
        index.add(i, "ab"[i % 2], f"k{i}", float(i), (1 << 40) | (i * 10))
    gone = set(range(1, 20_001, 3)) | set(range(5000, 9000))
    for i in sorted(gone, reverse=True):
        assert index.remove(i)
    left = [i for i in range(1, 20_001) if i not in gone]
    assert [p.id for p in index.entries()] == left
    assert [p.id for p in index.entries("a")] == [i for i in left if i % 2 == 0]
    assert len(index) == len(left) and index.get(left[7]).key == f"k{left[7]}"
    assert index.remove(1) == 0


# -- segment files: format, tears and corruption -----------------------------------------


def seg_path(path: Path, number: int = 1) -> Path:
    return path / segment_name(number)


def frame_offsets(path: Path) -> list[int]:
    data = path.read_bytes()
    out, off = [], HEADER.size
    while off + FRAME.size <= len(data):
        out.append(off)
        off += FRAME.size + FRAME.unpack_from(data, off)[0]
    return out


@pytest.fixture
def seg(tmp_path):
    path = tmp_path / "completion"
    store = SegmentStore(path)
    store.recover()
    ids = store.append_results(results(10))
    store.flush()
    store.ack(ids[:2], NOW + 20)
    store.flush()
    ids += store.append_results(results(5, start=10))
    store.flush()
    store.close()
    return path, ids


def reopen(path: Path, config: CompletionConfig | None = None, ops: FileOps | None = None):
    store = SegmentStore(path, config, ops)
    return store, store.recover()


def test_segment_file_layout(seg):
    path, ids = seg
    head = seg_path(path).read_bytes()[: HEADER.size]
    magic, version, flags, number, first_id, _crc = HEADER.unpack(head)
    assert (magic, version, flags, number, first_id) == (b"QNODECPL", FORMAT_VERSION, 0, 1, 1)
    records = read_segment_records(seg_path(path))
    kinds = [r[0] for r in records]
    assert kinds == [1] * 10 + [2] + [1] * 5
    assert records[10] == (2, (1, 2), NOW + 20)  # format 3: the ACK says when
    assert records[0][:8] == (1, 1, "j", "k0", 1000, 7, NOW, 3600)


def test_torn_tail_mid_record_is_cut_and_reported(seg):
    path, ids = seg
    f = seg_path(path)
    last = frame_offsets(f)[-1]
    size = f.stat().st_size
    os.truncate(f, size - 7)
    store, report = reopen(path)
    assert [(c.segment, c.offset, c.bytes, c.records) for c in report.cuts] == [
        (1, last, size - 7 - last, 1)
    ]
    assert f.stat().st_size == last
    assert [p.id for p in store.pending()] == ids[2:-1]
    assert report.exact  # a tear loses nothing that was durable
    # Appends go on after the cut; the next recovery is clean.
    more = store.append_results(results(1, start=50))
    store.flush()
    assert more[0] == ids[-1]  # the torn result's id was never durable
    store.close()
    store, report = reopen(path)
    assert report.cuts == [] and store.pending()[-1].id == more[0]
    store.close()


def test_flipped_byte_in_last_record_is_cut(seg):
    path, ids = seg
    f = seg_path(path)
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40
    f.write_bytes(bytes(data))
    store, report = reopen(path)
    assert len(report.cuts) == 1 and report.cuts[0].reason == "checksum mismatch"
    assert [p.id for p in store.pending()] == ids[2:-1]
    store.close()


def test_a_zero_filled_tail_is_where_the_records_end(seg):
    # What a preallocating writer leaves ahead of its writes (and what some
    # file systems show of unsynced appends after a power loss): no record
    # starts with a zero length, so nothing is cut, and appends go on there.
    path, ids = seg
    f = seg_path(path)
    size = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(b"\0" * 5000)
    store, report = reopen(path)
    assert report.cuts == [] and report.corrupt == []
    assert [p.id for p in store.pending()] == ids[2:]
    assert f.stat().st_size == size + 5000
    more = store.append_results(results(2, start=50))
    store.flush()
    store.close()
    store, report = reopen(path)
    assert report.cuts == [] and [p.id for p in store.pending()] == ids[2:] + more
    store.close()


def test_corrupt_record_in_the_middle_is_skipped_reported_and_kept(seg):
    """Not a tear (the records after it are whole): only that record is lost,
    the file is left as it is for an operator, the segment is never compacted
    and the report says the counters are no longer exact."""
    path, ids = seg
    f = seg_path(path)
    offsets = frame_offsets(f)
    data = bytearray(f.read_bytes())
    data[offsets[4] + FRAME.size + 5] ^= 0x01
    f.write_bytes(bytes(data))
    store, report = reopen(path)
    assert report.cuts == []
    [span] = report.corrupt
    assert (span.segment, span.offset, span.skipped) == (1, offsets[4], True)
    assert span.bytes == offsets[5] - offsets[4]
    assert not report.exact
    assert [p.id for p in store.pending()] == [i for i in ids[2:] if i != ids[4]]
    assert f.stat().st_size == len(data)
    assert store._segments[1].damaged
    store.close()


def test_corrupt_length_in_an_older_segment_stops_that_segment_only(tmp_path):
    path = tmp_path / "completion"
    store = SegmentStore(path, SMALL)
    store.recover()
    ids = []
    for b in range(10):
        ids += store.append_results(results(4, start=b * 4, size=300))
        store.flush()
    by_segment = {}
    for p in store.pending():
        by_segment.setdefault(p.segment, []).append(p.id)
    store.close()
    assert len(by_segment) >= 3
    f = seg_path(path, 1)
    offsets = frame_offsets(f)
    data = bytearray(f.read_bytes())
    data[offsets[1] : offsets[1] + 4] = (10**9).to_bytes(4, "little")  # an absurd length
    f.write_bytes(bytes(data))
    store, report = reopen(path, SMALL)
    [span] = report.corrupt
    assert (span.segment, span.offset, span.skipped) == (1, offsets[1], False)
    assert span.bytes == len(data) - offsets[1]
    expected = [i for i in ids if i not in by_segment[1][1:]]
    assert [p.id for p in store.pending()] == expected
    assert f.stat().st_size == len(data)  # an older segment is never truncated
    store.close()


def test_a_newer_format_version_is_refused_and_left_alone(seg):
    path, _ = seg
    f = seg_path(path)
    data = bytearray(f.read_bytes())
    head = HEADER.unpack(bytes(data[: HEADER.size]))
    from node.completion.segments import encode_header

    new_head = bytearray(encode_header(head[3], head[4]))
    new_head[8:10] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    import zlib

    new_head[28:32] = zlib.crc32(bytes(new_head[:28])).to_bytes(4, "little")
    data[: HEADER.size] = new_head
    f.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match="format version"):
        reopen(path)
    assert f.read_bytes() == bytes(data)


def test_a_segment_torn_while_being_created_is_removed(seg):
    path, ids = seg
    seg_path(path, 2).write_bytes(b"QNODE")  # a crash inside _roll
    store, report = reopen(path)
    assert report.removed_segments == [2]
    assert report.cuts[0].segment == 2 and report.cuts[0].reason == "torn segment header"
    assert segments_on_disk(path) == [1]
    assert [p.id for p in store.pending()] == ids[2:]
    store.close()


def test_a_second_writer_is_locked_out(seg):
    path, _ = seg
    store, _ = reopen(path)
    with pytest.raises(LogLocked, match=str(os.getpid())):
        reopen(path)
    store.close()
    other, _ = reopen(path)
    other.close()


def test_read_back_detects_rot_after_recovery(seg):
    path, ids = seg
    store, _ = reopen(path)
    p = store.get_pending(ids[3])
    with open(seg_path(path), "r+b") as fh:
        fh.seek(p.offset + FRAME.size + 20)
        byte = fh.read(1)
        fh.seek(p.offset + FRAME.size + 20)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(LogCorrupt):
        store.read_result(ids[3])
    assert store.read_result(ids[4]).key == "k4"
    store.close()


# -- format 2 (results with a head) and format 1 segments -------------------------------


def _v1_segment(path: Path, number: int, first_id: int, records: list[tuple]) -> None:
    """A segment file as format 1 wrote it: a version-1 header and records
    that are each one msgpack array."""
    import zlib

    import msgpack

    head = HEADER.pack(b"QNODECPL", 1, 0, number, first_id, 0)[:28]
    out = [head, zlib.crc32(head).to_bytes(4, "little")]
    for rec in records:
        body = msgpack.packb(rec, use_bin_type=True)
        out.append(FRAME.pack(len(body), zlib.crc32(body)) + body)
    path.mkdir(parents=True, exist_ok=True)
    (path / segment_name(number)).write_bytes(b"".join(out))


def test_format_1_segments_are_read_and_appends_go_to_a_new_segment(tmp_path):
    path = tmp_path / "completion"
    v1 = [(1, i, "j", f"k{i}", 1000 + i, 7, NOW + i, 3600, 1, b'{"n":%d}' % i) for i in (1, 2, 3)]
    _v1_segment(path, 1, 1, [*v1, (2, (1,)), (3, (2,), "retention")])
    store, report = reopen(path)
    assert report.exact and report.results == 3
    assert store.counters().acked == 1 and store.counters().discarded == 1
    assert [p.id for p in store.pending()] == [3]
    assert store.read_result(3).value() == {"n": 3} and store.read_result(3).lease_id == 1003
    [new] = store.append_results(results(1, start=9))
    store.ack([3])
    store.flush()
    store.close()
    assert segments_on_disk(path) == [1, 2]  # format 1 is never appended to
    assert HEADER.unpack(seg_path(path, 2).read_bytes()[: HEADER.size])[1] == FORMAT_VERSION
    store, report = reopen(path)
    assert report.exact and [p.id for p in store.pending()] == [new]
    assert store.read_result(new).key == "k9"
    assert [r[0] for r in read_segment_records(seg_path(path, 2))] == [1, 2]
    store.close()


def test_a_rotten_payload_in_an_older_segment_is_found_when_read(tmp_path):
    """Recovery checks an older segment's results by their head (length and
    meta), not their payload: rot in a payload is found when the result is
    read back (LogCorrupt), and the counts stay exact."""
    path = tmp_path / "completion"
    store = SegmentStore(path, SMALL)
    store.recover()
    ids = []
    for b in range(4):
        ids += store.append_results(results(4, start=b * 4, size=300))
        store.flush()
    victim = store.get_pending(ids[1])
    assert victim.segment != store._active
    store.close()
    f = seg_path(path, victim.segment)
    data = bytearray(f.read_bytes())
    data[victim.offset + FRAME.size + 200] ^= 0x10  # inside the payload
    f.write_bytes(bytes(data))
    store, report = reopen(path, SMALL)
    assert report.exact and [p.id for p in store.pending()] == ids
    with pytest.raises(LogCorrupt, match="checksum"):
        store.read_result(ids[1])
    assert store.read_result(ids[2]).data == bytes([2]) * 300
    store.close()


@pytest.mark.parametrize("where", ["meta", "length"])
def test_a_rotten_result_head_in_an_older_segment_is_corruption(tmp_path, where):
    path = tmp_path / "completion"
    store = SegmentStore(path, SMALL)
    store.recover()
    ids = []
    for b in range(4):
        ids += store.append_results(results(4, start=b * 4, size=300))
        store.flush()
    victim = store.get_pending(ids[1])
    store.close()
    f = seg_path(path, victim.segment)
    data = bytearray(f.read_bytes())
    if where == "meta":
        data[victim.offset + FRAME.size + 12] ^= 0x01
    else:  # a length still inside the file: only the head checksum can tell
        data[victim.offset] ^= 0x04
    f.write_bytes(bytes(data))
    store, report = reopen(path, SMALL)
    assert not report.exact and report.corrupt[0].segment == victim.segment
    assert ids[1] not in [p.id for p in store.pending()]
    store.close()


def test_the_last_segment_checks_whole_records(seg):
    """In the last segment a payload that fails its checksum is a torn tail
    (its flush may never have finished): cut, not kept."""
    path, ids = seg
    f = seg_path(path)
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01  # the last result's payload
    f.write_bytes(bytes(data))
    store, report = reopen(path)
    assert len(report.cuts) == 1 and report.cuts[0].reason == "checksum mismatch"
    assert [p.id for p in store.pending()] == ids[2:-1]
    store.close()


# -- disk faults through the FileOps seam ------------------------------------------------


class FaultyOps(FileOps):
    """Fails the named call with an errno (``fail``), after writing part of
    the data (``partial``), or sleeps in fsync; counts fsyncs."""

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}
        self.partial = 0
        self.fsync_sleep_s = 0.0
        self.fsyncs = 0

    def _maybe_fail(self, name: str) -> None:
        if name in self.fail:
            raise OSError(self.fail[name], os.strerror(self.fail[name]))

    def pwrite(self, fd, data, offset):
        if "pwrite" in self.fail and self.partial and len(data) > self.partial:
            n = super().pwrite(fd, bytes(data[: self.partial]), offset)
            self.partial = 0
            return n  # a short write; the next call hits the full disk
        self._maybe_fail("pwrite")
        return super().pwrite(fd, data, offset)

    def fsync(self, fd):
        self._maybe_fail("fsync")
        if self.fsync_sleep_s:
            time.sleep(self.fsync_sleep_s)  # a slow disk, not synchronisation
        self.fsyncs += 1
        super().fsync(fd)

    def ftruncate(self, fd, length):
        self._maybe_fail("ftruncate")
        super().ftruncate(fd, length)

    def open(self, path, flags, mode=0o644):
        if flags & os.O_CREAT and Path(path).name.endswith(".seg"):
            self._maybe_fail("create")
        return super().open(path, flags, mode)

    def rename(self, src, dst):
        self._maybe_fail("rename")
        super().rename(src, dst)

    def unlink(self, path):
        self._maybe_fail("unlink")
        super().unlink(path)


@pytest.fixture
def faulty(tmp_path):
    ops = FaultyOps()
    store = SegmentStore(tmp_path / "completion", file_ops=ops)
    store.recover()
    kept = store.append_results(results(5))
    store.flush()
    yield store, ops, kept
    store.close(flush=False)


@pytest.mark.parametrize("partial", [0, 100])
def test_enospc_on_write_rejects_the_batch_and_keeps_what_was_durable(faulty, partial):
    store, ops, kept = faulty
    f = seg_path(store.path)
    size = f.stat().st_size
    store.ack(kept[:1])
    ops.fail["pwrite"], ops.partial = errno.ENOSPC, partial
    store.append_results(results(20, start=100, size=100))
    with pytest.raises(LogUnavailable, match="No space left"):
        store.flush()
    assert f.stat().st_size == size  # the partial write was cut back at once
    assert [p.id for p in store.pending()] == kept[1:]
    assert store.counters().rejected == 20
    # Space frees up: the retried ack lands, new results are taken.
    del ops.fail["pwrite"]
    again = store.append_results(results(2, start=200))
    store.flush()
    assert again[0] > kept[-1] + 20  # ids of the rejected batch are not reused here
    store.close()
    fresh, report = reopen(store.path)
    assert [p.id for p in fresh.pending()] == kept[1:] + again
    assert report.cuts == [] and report.counters.acked == 1
    fresh.close()


def test_eio_on_fsync_rejects_the_batch_and_cuts_it_back(faulty):
    store, ops, kept = faulty
    size = seg_path(store.path).stat().st_size
    ops.fail["fsync"] = errno.EIO
    store.append_results(results(3, start=100))
    with pytest.raises(LogUnavailable, match="Input/output error"):
        store.flush()
    assert seg_path(store.path).stat().st_size == size
    store.close(flush=False)
    fresh, _ = reopen(store.path)
    assert [p.id for p in fresh.pending()] == kept
    fresh.close()


def test_when_the_cut_back_fails_too_the_log_stays_unavailable_until_it_works(faulty):
    store, ops, kept = faulty
    size = seg_path(store.path).stat().st_size
    ops.fail["fsync"] = errno.EIO
    ops.fail["ftruncate"] = errno.EIO
    store.append_results(results(3, start=100))
    with pytest.raises(LogUnavailable):
        store.flush()
    assert seg_path(store.path).stat().st_size > size  # the rejected batch is still there
    del ops.fail["fsync"]
    store.append_results(results(1, start=200))
    with pytest.raises(LogUnavailable, match="cannot cut"):
        store.flush()
    del ops.fail["ftruncate"]
    later = store.append_results(results(1, start=300))
    store.flush()
    assert [p.id for p in store.pending()] == kept + later
    store.close()
    fresh, _ = reopen(store.path)
    assert [p.id for p in fresh.pending()] == kept + later
    fresh.close()


def test_crash_while_the_cut_back_fails_can_bring_back_a_rejected_batch(faulty):
    """The one window where a batch its callers heard 503 for can come back
    (docs/completion-log.md, "Disk faults"): whole records of it stayed on
    disk and the process died before it could cut them. At-least-once, never
    loss: the ledger sees the lease's result twice."""
    store, ops, kept = faulty
    ops.fail["fsync"] = errno.EIO
    ops.fail["ftruncate"] = errno.EIO
    rejected = store.append_results(results(3, start=100))
    with pytest.raises(LogUnavailable):
        store.flush()
    store.close(flush=False)  # the crash
    fresh, _ = reopen(store.path)
    assert [p.id for p in fresh.pending()] == kept + rejected
    fresh.close()


def test_enospc_creating_a_segment_rejects_the_batch_and_leaves_no_file(tmp_path):
    ops = FaultyOps()
    store = SegmentStore(tmp_path / "c", SMALL, ops)
    store.recover()
    kept = store.append_results(results(3, size=1000))
    store.flush()
    ops.fail["create"] = errno.ENOSPC
    store.append_results(results(3, start=10, size=1000))  # does not fit: a new segment
    with pytest.raises(LogUnavailable):
        store.flush()
    assert segments_on_disk(tmp_path / "c") == [1]
    del ops.fail["create"]
    later = store.append_results(results(3, start=20, size=1000))
    store.flush()
    assert segments_on_disk(tmp_path / "c") == [1, 2]
    store.close()
    fresh, _ = reopen(tmp_path / "c", SMALL)
    assert [p.id for p in fresh.pending()] == kept + later
    fresh.close()


def test_enospc_writing_the_checkpoint_removes_nothing(tmp_path):
    ops = FaultyOps()
    store = SegmentStore(tmp_path / "c", SMALL, ops)
    store.recover()
    first = store.append_results(results(3, size=1000))
    store.flush()
    store.append_results(results(3, start=10, size=1000))
    store.flush()
    store.ack(first)
    store.flush()
    before = store.counters()
    ops.fail["rename"] = errno.ENOSPC
    with pytest.raises(LogUnavailable, match="checkpoint"):
        store.compact()
    assert segments_on_disk(tmp_path / "c") == [1, 2]
    assert not (tmp_path / "c" / "checkpoint").exists()
    del ops.fail["rename"]
    assert store.compact() == 1
    assert store.counters() == before
    store.close()
    fresh, report = reopen(tmp_path / "c", SMALL)
    assert report.counters == before
    fresh.close()


def test_a_segment_left_behind_by_a_failed_unlink_is_not_counted_twice(tmp_path):
    ops = FaultyOps()
    store = SegmentStore(tmp_path / "c", SMALL, ops)
    store.recover()
    first = store.append_results(results(3, size=1000))
    store.flush()
    store.append_results(results(3, start=10, size=1000))
    store.flush()
    store.ack(first)
    ops.fail["unlink"] = errno.EIO
    assert store.compact() == 1  # the checkpoint is durable: it is removed as far as counts go
    before = store.counters()
    store.close()
    assert segments_on_disk(tmp_path / "c") == [1, 2]
    fresh, report = reopen(tmp_path / "c", SMALL)
    assert report.removed_segments == [1] and segments_on_disk(tmp_path / "c") == [2]
    assert report.counters == before
    fresh.close()


def test_group_commit_is_one_fsync_per_flush_however_slow(tmp_path):
    ops = FaultyOps()
    store = SegmentStore(tmp_path / "c", file_ops=ops)
    store.recover()
    store.append_results(results(1))
    store.flush()  # creates the segment (its own fsyncs)
    ops.fsyncs, ops.fsync_sleep_s = 0, 0.05
    for b in range(8):
        store.append_results(results(64, start=b * 64))
    t0 = time.monotonic()
    store.flush()
    assert time.monotonic() - t0 >= 0.05
    assert ops.fsyncs == 1 and store.pending_count() == 513
    store.close()


def test_fsync_never_does_not_fsync(tmp_path):
    ops = FaultyOps()
    store = SegmentStore(tmp_path / "c", CompletionConfig(fsync="never"), ops)
    store.recover()
    store.append_results(results(10))
    store.flush()
    assert ops.fsyncs == 0
    store.close()


# -- a real writer killed with SIGKILL ---------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys
    from node.completion import CompletionConfig, Result
    from node.completion.segments import FileOps, SegmentStore

    class PieceByPiece(FileOps):
        # Short writes of 4 KiB, as a kernel may make them. Once armed, the
        # third piece of a batch stops the writer inside a record until the
        # test kills it. Zeros ahead (argv[3], preallocate_bytes) are
        # written whole and not counted.
        armed = False
        pieces = 0

        def pwrite(self, fd, data, offset):
            if not any(bytes(data[:64])):
                return super().pwrite(fd, data, offset)
            if self.armed:
                self.pieces += 1
                if self.pieces == 3:
                    print("mid-write", flush=True)
                    sys.stdin.read()
            return super().pwrite(fd, data[:4096], offset)

    ops = PieceByPiece()
    ahead = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    config = CompletionConfig(segment_bytes=1 << 20, preallocate_bytes=ahead)
    store = SegmentStore(sys.argv[1], config, ops)
    store.recover()
    payload = bytes(range(256)) * 64  # 16 KiB
    n = 0
    while True:
        batch = [
            Result(f"k{n + i}", "j", n + i, 1, 1.0 + n + i, 60, payload) for i in range(13)
        ]
        ids = store.append_results(batch)
        store.flush()
        if n % 4 == 0:
            store.ack(ids[:3])
        print(ids[-1], flush=True)
        n += 13
        ops.armed = n >= 13 * int(sys.argv[2])
    """
)


def kill_writer_mid_record(path: Path, batches: int, ahead: int = 0) -> list[int]:
    """Run WRITER until it stops inside a record after ``batches`` batches,
    SIGKILL it; the last id of each batch it reported durable."""
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(batches), str(ahead)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ) as proc:
        assert proc.stdout is not None
        reported = []
        for line in proc.stdout:
            if line.strip() == b"mid-write":
                break
            reported.append(int(line))
        os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert len(reported) == batches, "the writer stopped early"
    return reported


def test_a_writer_killed_mid_append_loses_nothing_it_reported_durable(tmp_path):
    path = tmp_path / "c"
    reported = kill_writer_mid_record(path, 150)
    size_before = disk_bytes(path)
    store, report = reopen(path)
    # The batch it was writing is cut off at its first record; nothing else.
    [cut] = report.cuts
    assert cut.bytes == 2 * 4096 and cut.records == 1  # two pieces reached the file
    assert disk_bytes(path) == size_before - cut.bytes
    assert report.corrupt == [] and len(segments_on_disk(path)) > 1
    durable = {p.id for p in store.pending()}
    last = max(reported)
    # Every id it reported is pending, except the acked ones (three of every
    # fourth batch), and none of the torn batch.
    acked = {b * 13 + 1 + i for b in range(0, 150, 4) for i in range(3)}
    assert durable == set(range(1, last + 1)) - acked
    more = store.append_results(results(1))
    store.flush()
    assert more[0] == last + 1
    store.close()


def disk_bytes(path: Path) -> int:
    """Bytes of the log's files, but not the lock file: it holds its holder's
    pid, whose digits differ between the killed writer and this process (that
    made this test fail now and then: 2 bytes more after the cut)."""
    return sum((path / name).stat().st_size for name in os.listdir(path) if name != LOCK_NAME)


# -- memory stays bounded by the pending count, not by payloads --------------------------


def test_recovery_of_100k_pending_results_holds_no_payloads(tmp_path):
    path = tmp_path / "c"
    store = SegmentStore(path, CompletionConfig(fsync="never"))
    store.recover()
    payload = os.urandom(1024)
    for start in range(0, 100_000, 10_000):
        store.append_results(
            [Result(f"k{i}", "j", i, 1, NOW + i, 60, payload) for i in range(start, start + 10_000)]
        )
        store.flush()
    store.close()
    payload_bytes = 100_000 * 1024
    fresh = SegmentStore(path)
    tracemalloc.start()
    try:
        report = fresh.recover()
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.pending == 100_000
    # About 100 bytes a result (ids, offsets, times, the key): a tenth of the
    # payloads, whatever their size.
    assert held < payload_bytes / 10, held
    assert fresh.read_result(report.next_id - 1).data == payload
    fresh.close()
