"""Compaction's read of a segment's lease evidence in C
(``_records.lease_entries``, node/completion/segments/_records_leases.c)
against its Python reference (``SegmentRecovery._results_in``), on segments
the store wrote: whole, torn, with rotten bytes, and format 1 (left to Python)."""

from __future__ import annotations

import mmap
import random
from pathlib import Path

import pytest

from node.completion import CompletionConfig
from node.completion.base import MAX_RECORD_BYTES, make_result
from node.completion.segments import SegmentStore, recovery
from node.completion.segments._records import lease_entries
from node.completion.segments.format import HEADER
from tests.integration.test_completion import _v1_segment

pytestmark = pytest.mark.timeout(60)

NOW = 1_800_000_000.25


def _segments(path: Path, n: int, seed: int) -> list[Path]:
    """Segments with results of varied keys, jobs and sizes, and acks and
    discards between them (records of the other kinds)."""
    rnd = random.Random(seed)
    log = SegmentStore(path, CompletionConfig(segment_bytes=64 << 10))
    log.recover()
    for i in range(n):
        tail = "x" * rnd.randrange(300)
        key = f"https://example.com/{'é' * (i % 3)}{rnd.randrange(10**12)}/{tail}"
        r = make_result(key, f"job-{i % 5}", rnd.randrange(1, 2**62), i * 7, NOW + i,
                        rnd.choice([60.0, 3600.0, 86400.5]),
                        bytes(rnd.randrange(256) for _ in range(rnd.randrange(400))),
                        rnd.choice(["json", "bytes"]))  # fmt: skip
        (rid,) = log.append_results([r])
        if i % 3 == 0:
            log.flush()
        if i % 7 == 3:
            log.ack([rid])
        elif i % 11 == 5:
            log.discard([rid], "retention")
    log.flush()
    log.close()
    return sorted(path.glob("*.seg"))


def _both(data: bytes) -> tuple[list | None, list]:
    with mmap.mmap(-1, len(data)) as mm:  # (a map of the bytes, as compaction reads one)
        mm.write(data)
        got = lease_entries(mm, HEADER.size, len(data), MAX_RECORD_BYTES)
        want = recovery.SegmentRecovery._results_in(mm, len(data))
    return got, want


def test_the_extension_is_the_one_compaction_uses():
    assert recovery._lease_entries_in_c is lease_entries


def test_whole_segments_read_the_same(tmp_path):
    segs = _segments(tmp_path / "log", 3000, 1)
    assert len(segs) > 3
    total = 0
    for seg in segs:
        got, want = _both(seg.read_bytes())
        assert got == want
        assert all(type(e[0]) is int and type(e[1]) is int and type(e[2]) is str for e in got)
        total += len(got)
    assert total == 3000


def test_torn_and_rotten_segments_read_the_same(tmp_path):
    seg = _segments(tmp_path / "log", 400, 2)[0]
    data = seg.read_bytes()
    rnd = random.Random(3)
    for _ in range(300):
        cut = rnd.randrange(HEADER.size, len(data) + 1)
        got, want = _both(data[:cut])  # torn anywhere
        assert got == want
        rotten = bytearray(data)
        for _ in range(rnd.randrange(1, 4)):
            rotten[rnd.randrange(HEADER.size, len(data))] ^= 1 << rnd.randrange(8)
        got, want = _both(bytes(rotten))
        assert got is None or got == want  # None: the Python reader reads it


def test_a_format_1_segment_is_left_to_python(tmp_path):
    v1 = [(1, i, "j", f"k{i}", 1000 + i, 7, NOW + i, 3600, 1, b'{"n":%d}' % i) for i in (1, 2, 3)]
    _v1_segment(tmp_path, 1, 1, [*v1, (2, (1,)), (3, (2,), "retention")])
    data = (tmp_path / "000000000001.seg").read_bytes()
    got, want = _both(data)
    assert got is None
    assert want == [(1, 1001, "k1"), (2, 1002, "k2"), (3, 1003, "k3")]


def test_compaction_keeps_the_same_summary_with_the_c_reader(tmp_path, monkeypatch):
    """A store's compaction reads its removed segments' lease evidence in C;
    with the Python reader alone it keeps the same."""
    answers = []
    for reader in (lease_entries, None):
        monkeypatch.setattr(recovery, "_lease_entries_in_c", reader)
        path = tmp_path / ("c" if reader else "py")
        log = SegmentStore(path, CompletionConfig(segment_bytes=4096, keep_retired_s=3600.0))
        log.recover()
        ids = log.append_results([make_result(f"k{i}", "j", 5000 + i, 1, NOW, 60.0, b"{}", "json")
                                  for i in range(300)])  # fmt: skip
        log.flush()
        log.ack(ids, NOW)
        assert log.compact(NOW) >= 1
        answers.append(sorted((r.id, r.lease_id, r.key) for r in log.retired_leases(NOW - 1)))
        log.close()
    assert answers[0] == answers[1] and len(answers[0]) == 300
