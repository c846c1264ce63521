"""The completion log's preallocation: the active segment extended with zeros
ahead of its writes (``CompletionConfig.preallocate_bytes``; the node's ``log_preallocate_bytes``),
read back by recovery as the end of the records.

Real files throughout; faults through the ``FileOps`` seam; a real writer
killed with SIGKILL in the middle of a record that lands in the zeros.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from node.completion import CompletionConfig, LogUnavailable, Result
from node.completion.segments import FRAME, HEADER, FileOps, SegmentStore, segment_name
from tests.integration.test_completion import kill_writer_mid_record

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_700_000_000.0
ZERO_AHEAD_BYTES = 4 << 20
PRE = CompletionConfig(preallocate_bytes=ZERO_AHEAD_BYTES)


def batch(start: int, n: int, size: int = 200) -> list[Result]:
    return [
        Result(f"k{i}", "j", 1000 + i, 7, NOW + i, 3600, bytes([i % 250 + 1]) * size)
        for i in range(start, start + n)
    ]


def records_end(path: Path) -> int:
    """Where a segment's chain of frames ends, following lengths from the
    header until a zero length or the end of the file."""
    data = path.read_bytes()
    off = HEADER.size
    while off + FRAME.size <= len(data):
        ln, _crc = FRAME.unpack_from(data, off)
        if ln == 0 or off + FRAME.size + ln > len(data):
            break
        off += FRAME.size + ln
    return off


def open_log(path: Path, config: CompletionConfig = PRE, ops: FileOps | None = None):
    store = SegmentStore(path, config, ops)
    return store, store.recover()


def pending_ids(store: SegmentStore) -> list[int]:
    return [p.id for p in store.pending()]


def assert_reopens_whole(path: Path, ids: list[int]) -> None:
    """Recovery cuts nothing and finds exactly ``ids`` pending."""
    store, report = open_log(path)
    assert report.cuts == [] and pending_ids(store) == ids
    store.close()


def test_the_segment_is_zeroed_ahead_and_read_back_without_a_cut(tmp_path):
    path = tmp_path / "c"
    store, _ = open_log(path)
    ids = store.append_results(batch(0, 64))
    store.flush()
    seg = path / segment_name(1)
    end = records_end(seg)
    assert seg.stat().st_size == end + ZERO_AHEAD_BYTES  # the zeros ahead, durable with it
    ids += store.append_results(batch(64, 64))
    store.flush()
    assert seg.stat().st_size == end + ZERO_AHEAD_BYTES  # written into the zeros: no growth
    store.close()

    store, report = open_log(path)
    assert report.cuts == [] and report.corrupt == []
    assert pending_ids(store) == ids
    assert seg.stat().st_size == end + ZERO_AHEAD_BYTES  # the zeros stay for the next writes
    ids += store.append_results(batch(128, 10))
    store.flush()
    store.close()

    store, report = open_log(path)
    assert report.cuts == [] and pending_ids(store) == ids
    assert [r.key for r in map(store.read_result, ids[-2:])] == ["k136", "k137"]
    store.close()


def test_a_log_written_without_preallocation_reads_the_same(tmp_path):
    path = tmp_path / "c"
    store, _ = open_log(path, CompletionConfig())
    ids = store.append_results(batch(0, 20))
    store.flush()
    store.close()
    seg = path / segment_name(1)
    assert seg.stat().st_size == records_end(seg)  # no zeros without preallocation
    store, report = open_log(path)  # reopened preallocating: appends zero ahead from here
    assert report.cuts == [] and pending_ids(store) == ids
    ids += store.append_results(batch(20, 20))
    store.flush()
    assert seg.stat().st_size > records_end(seg)
    store.close()
    store, report = open_log(path, CompletionConfig())
    assert report.cuts == [] and pending_ids(store) == ids
    store.close()


SMALL_SEGMENTS = CompletionConfig(preallocate_bytes=ZERO_AHEAD_BYTES, segment_bytes=64 << 10)


def written_in_batches(path: Path, n: int) -> list[int]:
    """``n`` results flushed 40 at a time into 64 KiB segments; their ids."""
    store, _ = open_log(path, SMALL_SEGMENTS)
    ids: list[int] = []
    for start in range(0, n, 40):
        ids += store.append_results(batch(start, 40))
        store.flush()
    store.close()
    return ids


def test_a_rolled_segment_is_cut_back_to_its_last_record(tmp_path):
    path = tmp_path / "c"
    ids = written_in_batches(path, 1200)
    segs = sorted(path.glob("*.seg"))
    assert len(segs) >= 3
    for seg in segs[:-1]:
        assert seg.stat().st_size == records_end(seg)  # sealed: no zeros left
    last = segs[-1]
    assert records_end(last) < last.stat().st_size <= 64 << 10  # zeros within segment_bytes
    store, report = open_log(path, SMALL_SEGMENTS)
    assert report.cuts == [] and report.corrupt == [] and pending_ids(store) == ids
    store.close()


def test_an_older_segment_still_holding_its_zeros_reads_clean(tmp_path):
    # A crash after a roll, before the old segment's cut reached the disk.
    path = tmp_path / "c"
    ids = written_in_batches(path, 600)
    first = path / segment_name(1)
    with open(first, "ab") as f:
        f.write(bytes(20_000))
    store, report = open_log(path, SMALL_SEGMENTS)
    assert report.cuts == [] and report.corrupt == [] and report.exact
    assert pending_ids(store) == ids
    store.close()


def ten_results(path: Path) -> tuple[list[int], Path, int, bytes]:
    """Ten results flushed and the log closed: their ids, the segment, the
    end of its records and its bytes."""
    store, _ = open_log(path)
    ids = store.append_results(batch(0, 10))
    store.flush()
    store.close()
    seg = path / segment_name(1)
    return ids, seg, records_end(seg), seg.read_bytes()


def test_a_torn_record_in_the_zeros_is_cut_and_the_zeros_with_it(tmp_path):
    path = tmp_path / "c"
    ids, seg, end, data = ten_results(path)
    first_record = data[HEADER.size : HEADER.size + FRAME.size + 120]  # a record's first part
    with open(seg, "r+b") as f:
        f.seek(end)
        f.write(first_record)  # a torn write: its frame says more than reached the disk
    store, report = open_log(path)
    [cut] = report.cuts
    assert cut.offset == end and report.corrupt == []
    assert seg.stat().st_size == end  # cut where the records end, the zeros too
    assert pending_ids(store) == ids
    ids += store.append_results(batch(10, 5))
    store.flush()
    store.close()
    assert_reopens_whole(path, ids)


def test_a_whole_record_beyond_a_run_of_zeros_is_never_read(tmp_path):
    # A batch whose later pages reached the disk and whose first did not
    # (unsynced pages after a power loss): what follows the gap is no result.
    path = tmp_path / "c"
    ids, seg, end, data = ten_results(path)
    whole = data[HEADER.size : records_end_of_first(data)]
    with open(seg, "r+b") as f:
        f.seek(end + 4096)
        f.write(whole)
    store, report = open_log(path)
    [cut] = report.cuts
    assert cut.offset == end and seg.stat().st_size == end
    assert pending_ids(store) == ids  # the copy beyond the gap is not a result
    store.close()


def records_end_of_first(data: bytes) -> int:
    ln, _crc = FRAME.unpack_from(data, HEADER.size)
    return HEADER.size + FRAME.size + ln


class FullWhileZeroing(FileOps):
    """A disk that takes the records but fails the zeros ahead of them with
    ENOSPC (``full``), or fails the next fsync with EIO (``fail_fsync``)."""

    full = False
    fail_fsync = False

    def pwrite(self, fd, data, offset):
        if self.full and not any(bytes(data[:4096])):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwrite(fd, data, offset)

    def fsync(self, fd):
        if self.fail_fsync:
            self.fail_fsync = False
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().fsync(fd)


def test_a_full_disk_while_zeroing_ahead_keeps_the_batch(tmp_path):
    path = tmp_path / "c"
    ops = FullWhileZeroing()
    ops.full = True
    store, _ = open_log(path, PRE, ops)
    ids = store.append_results(batch(0, 10))
    store.flush()  # the zeros failed; the batch is durable all the same
    seg = path / segment_name(1)
    assert seg.stat().st_size == records_end(seg)
    assert pending_ids(store) == ids
    ops.full = False
    ids += store.append_results(batch(10, 10))
    store.flush()
    assert seg.stat().st_size > records_end(seg)
    store.close()
    assert_reopens_whole(path, ids)


def test_a_failed_fsync_cuts_the_batch_and_its_zeros_back(tmp_path):
    path = tmp_path / "c"
    ops = FullWhileZeroing()
    store, _ = open_log(path, PRE, ops)
    ids = store.append_results(batch(0, 10))
    store.flush()
    seg = path / segment_name(1)
    durable_end = records_end(seg)
    ops.fail_fsync = True
    store.append_results(batch(10, 10))
    with pytest.raises(LogUnavailable):
        store.flush()
    assert seg.stat().st_size == durable_end  # the rejected batch and the zeros are gone
    ids += store.append_results(batch(20, 5))
    store.flush()
    store.close()
    store, report = open_log(path)
    assert report.cuts == [] and pending_ids(store) == ids
    assert [store.read_result(i).key for i in ids[-5:]] == [f"k{i}" for i in range(20, 25)]
    store.close()


# -- a real writer killed with SIGKILL inside a record written into the zeros -----------
# (test_completion's WRITER: 13 results of 16 KiB a batch, the first 3 of every
# fourth batch acked.)

# Batches of about 208 KiB, four to a 1 MiB segment: the one after the 22nd
# is the third of its segment, written into the zeros its first left ahead.
BATCHES = 22


def test_a_writer_killed_inside_a_record_in_the_zeros_loses_nothing_it_reported(tmp_path):
    path = tmp_path / "c"
    reported = kill_writer_mid_record(path, BATCHES, ahead=4 << 20)
    last_seg = sorted(path.glob("*.seg"))[-1]
    chain_end = records_end(last_seg)  # by lengths alone, past the torn record into zeros
    config = CompletionConfig(segment_bytes=1 << 20, preallocate_bytes=4 << 20)
    store, report = open_log(path, config)
    [cut] = report.cuts
    assert cut.records == 1 and report.corrupt == []
    assert HEADER.size < cut.offset == last_seg.stat().st_size < chain_end
    acked = {b * 13 + 1 + i for b in range(0, BATCHES, 4) for i in range(3)}
    assert set(pending_ids(store)) == set(range(1, max(reported) + 1)) - acked
    more = store.append_results(batch(0, 1))
    store.flush()
    assert more == [max(reported) + 1]
    store.close()
