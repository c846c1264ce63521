"""The recovery scan's fast path against the reference loop.

A mostly acknowledged log is recovered by ``SegmentStore._scan_fast``: it
checks every record as ``_scan_run`` does, reads each result's id from the
meta's fixed prefix and stages the result undecoded (``staging.py``); only
what is left pending at the end is decoded. Every test here recovers copies
of the same files twice, with the fast path forced on for every segment and
forced off (``_scan_run`` for everything: the scan as it was before the fast
path), and compares all that a caller can see: the report, the counters, the
pending results and their payloads, per-segment accounting, and the files.
"""

from __future__ import annotations

import dataclasses
import shutil
import struct
import zlib
from pathlib import Path

import msgpack  # type: ignore[import-untyped]
import pytest

from node.completion import CompletionConfig, LogCorrupt, Result
from node.completion.base import RETIRE_ACK, RETIRE_DISCARD
from node.completion.buffered import _Retire
from node.completion.segments import (
    FRAME,
    HEADER,
    K_RESULT,
    RESULT_HEAD,
    SegmentStore,
    deferred,
    encode_header,
    encode_result_record,
    encode_retire,
    segment_name,
)
from node.completion.staging import Stage

NOW = 1_700_000_000.0
SMALL = CompletionConfig(segment_bytes=4096)


def result(i: int, job: str = "j", size: int = 40) -> Result:
    return Result(f"k{i}", job, 1000 + i, 7, NOW + i, 3600, bytes([i % 251]) * size)


def snapshot(path: Path, config: CompletionConfig | None) -> dict:
    store = SegmentStore(path, config)
    report = store.recover()
    pending = store.pending()
    payloads = []
    for p in pending:
        try:
            payloads.append(store.read_result(p.id))
        except LogCorrupt as exc:
            payloads.append(str(exc))
    jobs = {p.job for p in pending}
    state = {
        "report": dataclasses.replace(report, seconds=0.0),
        "counters": store.counters(),
        "pending": pending,
        "by_job": {job: store.pending(job) for job in sorted(jobs)},
        "payloads": payloads,
        "segments": {
            n: (s.first_id, s.results, s.live, s.acked, s.discarded, sorted(s.refs), s.damaged)
            for n, s in sorted(store._segments.items())
        },
        "removable": store.removable_segments(),
        "last_id": store._index.last_id,
    }
    assert not store._stage.batches and not store._stage._maps  # every map closed
    store.close()
    state["files"] = {
        name: (path / name).read_bytes() for name in sorted(p.name for p in path.iterdir())
    }
    del state["files"]["LOCK"]
    return state


def recover_both(
    path: Path,
    monkeypatch: pytest.MonkeyPatch,
    config: CompletionConfig | None = None,
    reads: int = 1,
) -> tuple[dict, dict, int]:
    """(fast, reference, results the fast scan staged), from two copies of
    ``path``; the fast one read the log ``reads`` times (2: read again)."""
    staged = 0
    passes: list[bool] = []
    add, load_segments = Stage.add, SegmentStore._load_segments

    def counting_add(self, batch):  # type: ignore[no-untyped-def]
        nonlocal staged
        staged += len(batch.ids)
        add(self, batch)

    def counting_load_segments(self, live, report, fast):  # type: ignore[no-untyped-def]
        passes.append(fast)
        load_segments(self, live, report, fast)

    out = []
    for fast in (True, False):
        copy = path.with_name(f"{path.name}-{'fast' if fast else 'reference'}")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(path, copy)
        with monkeypatch.context() as m:
            m.setattr(SegmentStore, "_defer_decode", lambda self, report, fast=fast: fast)
            m.setattr(Stage, "add", counting_add)
            m.setattr(SegmentStore, "_load_segments", counting_load_segments)
            out.append(snapshot(copy, config))
    assert passes == [True, False][:reads] + [True]
    return out[0], out[1], staged


def assert_same(fast: dict, reference: dict) -> None:
    for name in reference:
        assert fast[name] == reference[name], name


# -- logs the writer wrote ----------------------------------------------------------------


def mostly_acked_log(path: Path, start_id: int = 1, n: int = 400) -> list[int]:
    """Many segments; acks lag a few batches behind (so they land in later
    segments than their results), a few discards, one in eight pending."""
    store = SegmentStore(path, SMALL)
    store.recover()
    store._next_id = start_id
    kept, lagging = [], []
    for b in range(0, n, 10):
        ids = store.append_results([result(i, "abc"[i % 3]) for i in range(b, b + 10)])
        store.flush()
        lagging.append(ids)
        if len(lagging) > 3:
            old = lagging.pop(0)
            kept += old[::8]
            rest = [i for i in old if i not in old[::8]]
            store.discard(rest[:1], "retention")
            store.ack(rest[1:])
            store.flush()
    kept += [i for ids in lagging for i in ids]
    assert [p.id for p in store.pending()] == kept
    store.close()
    return kept


@pytest.mark.parametrize("passes", ["at the end", "while scanning"])
def test_a_mostly_acked_log_recovers_the_same_both_ways(tmp_path, monkeypatch, passes):
    if passes == "while scanning":
        monkeypatch.setattr("node.completion.buffered.RETIRE_PASS_MIN_IDS", 8)
    path = tmp_path / "c"
    kept = mostly_acked_log(path)
    decoded = 0
    unpack_meta = deferred._unpack_meta

    def counting_unpack_meta(meta):  # type: ignore[no-untyped-def]
        nonlocal decoded
        decoded += 1
        return unpack_meta(meta)

    monkeypatch.setattr(deferred, "_unpack_meta", counting_unpack_meta)
    fast, reference, staged = recover_both(path, monkeypatch, SMALL)
    assert staged == 400 and len(reference["segments"]) >= 10
    # The fast read decoded the metas of the pending results only (the
    # reference loop decodes its own, without this function).
    assert decoded == len(kept)
    assert_same(fast, reference)
    assert [p.id for p in fast["pending"]] == kept
    assert fast["report"].exact and fast["counters"].discarded > 0


@pytest.mark.parametrize("start_id", [1, 100, 250, 65_500, 2**32 - 200, 2**40])
def test_ids_of_every_msgpack_width_read_the_same(tmp_path, monkeypatch, start_id):
    """Ids are read from the meta's bytes: fixint, uint 8, 16, 32 and 64,
    and runs that cross from one width to the next."""
    path = tmp_path / "c"
    kept = mostly_acked_log(path, start_id)
    fast, reference, staged = recover_both(path, monkeypatch, SMALL)
    assert staged == 400
    assert_same(fast, reference)
    assert [p.id for p in fast["pending"]] == kept and kept[0] >= start_id


def test_a_mostly_pending_log_recovers_the_same_both_ways(tmp_path, monkeypatch):
    path = tmp_path / "c"
    store = SegmentStore(path, SMALL)
    store.recover()
    for b in range(0, 300, 10):
        store.append_results([result(i, "ab"[i % 2]) for i in range(b, b + 10)])
        store.flush()
    store.ack([5, 77])
    store.flush()
    store.close()
    fast, reference, _ = recover_both(path, monkeypatch, SMALL)
    assert_same(fast, reference)
    assert len(fast["pending"]) == 298


# -- damage ----------------------------------------------------------------------------


def frame_offsets(data: bytes) -> list[int]:
    out, off = [], HEADER.size
    while off + FRAME.size <= len(data):
        out.append(off)
        off += FRAME.size + FRAME.unpack_from(data, off)[0]
    return out


def acked_result_offset(path: Path, segment: int, kept: list[int]) -> int:
    """The offset of an acknowledged result in a segment."""
    data = (path / segment_name(segment)).read_bytes()
    for off in frame_offsets(data):
        if data[off + FRAME.size] == K_RESULT:
            meta = off + FRAME.size + RESULT_HEAD.size
            rid = msgpack.unpackb(data[meta : meta + RESULT_HEAD.unpack_from(data, off + 8)[1]])[0]
            if rid not in kept:
                return off
    raise AssertionError("no acknowledged result")


@pytest.mark.parametrize(
    "where, field",
    [
        ("older", "meta"),
        ("older", "id"),
        ("older", "length"),
        ("older", "head crc"),
        ("older", "payload"),  # found when read, never here: the same both ways
        ("last", "meta"),
        ("last", "payload"),
        ("last", "tear"),
        ("last", "zeros"),
    ],
)
def test_damage_to_a_retired_result_is_found_the_same_both_ways(
    tmp_path, monkeypatch, where, field
):
    """The fast scan never decodes a retired result, but checks it as the
    reference loop does: rot in its head is corruption, in the last segment
    its payload is checked too, a torn tail is cut at the last whole record
    and reported, and a tail of zeros is where the records end."""
    path = tmp_path / "c"
    kept = mostly_acked_log(path)
    numbers = sorted(int(p.name[:12]) for p in path.glob("*.seg"))
    number = numbers[2] if where == "older" else numbers[-1]
    f = path / segment_name(number)
    data = bytearray(f.read_bytes())
    off = acked_result_offset(path, number, kept)
    if field == "meta":
        data[off + FRAME.size + RESULT_HEAD.size + 4] ^= 0x01
    elif field == "id":
        data[off + FRAME.size + RESULT_HEAD.size + 2] ^= 0x80
    elif field == "length":
        data[off] ^= 0x04
    elif field == "head crc":
        data[off + FRAME.size + 5] ^= 0x01
    elif field == "payload":
        data[off + FRAME.size + RESULT_HEAD.size + 30] ^= 0x10
    elif field == "tear":
        data = data[: len(data) - 7]
    else:
        data += bytes(3000)
    f.write_bytes(bytes(data))
    fast, reference, _ = recover_both(path, monkeypatch, SMALL)
    assert_same(fast, reference)
    report = fast["report"]
    if field == "zeros":  # the tail a preallocating writer leaves: the end, nothing cut
        assert report.exact and not report.cuts
    elif field == "tear" or (where, field) == ("last", "payload"):
        assert report.cuts or report.corrupt
    elif field == "payload":
        assert report.exact
    else:
        assert report.corrupt and not report.exact
        assert report.corrupt[0].segment == number


# -- logs only a bug or a hand could write -------------------------------------------------


def write_log(path: Path, segments: list[tuple[int, list[bytes]]]) -> None:
    """Segments 1, 2, ... with the given (first id, frames)."""
    path.mkdir(parents=True, exist_ok=True)
    for number, (first_id, frames) in enumerate(segments, 1):
        (path / segment_name(number)).write_bytes(
            encode_header(number, first_id) + b"".join(frames)
        )


def results_frames(ids: range, job: str = "j") -> list[bytes]:
    return [encode_result_record(i, result(i, job)) for i in ids]


def retire(kind: str, ids: list[int]) -> list[bytes]:
    return encode_retire(_Retire(kind, ids, "retention" if kind == RETIRE_DISCARD else "", {}))


def result_with_meta(meta: bytes, data: bytes = b"payload") -> bytes:
    """A format-2 RESULT frame with this meta and good checksums."""
    n = RESULT_HEAD.size + len(meta) + len(data)
    body = RESULT_HEAD.pack(K_RESULT, len(meta), zlib.crc32(meta, n)) + meta + data
    return FRAME.pack(len(body), zlib.crc32(body)) + body


def meta_with_id(id_bytes: bytes, i: int) -> bytes:
    rest = ("j", f"k{i}", 1000 + i, 7, NOW + i, 3600, 0)
    return b"\x98" + id_bytes + b"".join(msgpack.packb(x) for x in rest)


def test_retire_records_before_and_after_their_results_across_segments(tmp_path, monkeypatch):
    """A record retires what it names whichever segment the result is in,
    even one written after it (only a bug writes that), the same both ways."""
    path = tmp_path / "c"
    base = 70_000
    write_log(
        path,
        [
            (base, [*results_frames(range(base, base + 20)), *retire(RETIRE_ACK, [base + 25])]),
            (
                base + 20,
                [
                    *results_frames(range(base + 20, base + 40)),
                    *retire(RETIRE_ACK, list(range(base, base + 18))),
                    *retire(RETIRE_DISCARD, [base + 30, base + 1]),
                ],
            ),
            (base + 40, [*results_frames(range(base + 40, base + 45), "other")]),
        ],
    )
    fast, reference, staged = recover_both(path, monkeypatch)
    assert staged == 45
    assert_same(fast, reference)
    pending = [p.id for p in fast["pending"]]
    assert base + 25 not in pending and base + 30 not in pending and base + 18 in pending
    assert fast["counters"].acked == 19 and fast["counters"].discarded == 1


def test_a_checksummed_meta_that_will_not_decode_is_reported_as_the_reference_does(
    tmp_path, monkeypatch
):
    """A pending result whose checksums hold but whose meta does not decode
    (a writer's bug) is found when the survivors are decoded, after the scan;
    the log is then read again by the reference loop alone: reported in scan
    order, not counted, and its id does not order the results after it."""
    path = tmp_path / "c"
    base = 70_000
    broken = meta_with_id(struct.pack(">BI", 0xCE, base + 3), 3)[:-2]  # cut short
    torn = bytearray(results_frames(range(base + 20, base + 21))[0])
    torn[12] ^= 0x01  # a bad head crc in the next segment
    write_log(
        path,
        [
            (
                base,
                [
                    *results_frames(range(base, base + 3)),
                    result_with_meta(broken),
                    *results_frames(range(base + 4, base + 10)),
                    *retire(RETIRE_ACK, [base, base + 1]),
                ],
            ),
            (base + 10, [*results_frames(range(base + 10, base + 20)), bytes(torn)]),
            (base + 21, results_frames(range(base + 21, base + 25))),
        ],
    )
    fast, reference, _ = recover_both(path, monkeypatch, reads=2)
    assert_same(fast, reference)
    spans = fast["report"].corrupt
    assert [s.segment for s in spans] == [1, 2]
    assert spans[0].reason.startswith("malformed record")
    assert base + 3 not in [p.id for p in fast["pending"]]


@pytest.mark.parametrize(
    "odd, reads",
    [
        (struct.pack(">Bq", 0xD3, 70_005), 1),  # an int 64 id: msgpack, not the writer's
        (struct.pack(">BI", 0xCE, 70_001), 2),  # out of order
        (struct.pack(">Bq", 0xD3, 70_002), 2),  # out of order, left to the reference loop
        (struct.pack(">BI", 0xCE, 70_004)[:3], 2),  # an id cut short: reads as a later one
    ],
)
def test_a_result_left_to_the_reference_loop_comes_after_what_was_staged(
    tmp_path, monkeypatch, odd, reads
):
    """The fast scan hands a result it cannot read by the prefix to
    ``_scan_run``, which indexes what was staged before it first: the index
    stays in id order."""
    path = tmp_path / "c"
    base = 70_000
    write_log(
        path,
        [
            (base, [*results_frames(range(base, base + 5)), *retire(RETIRE_ACK, [base + 1])]),
            (
                base + 5,
                [
                    result_with_meta(meta_with_id(odd, 5)),
                    *results_frames(range(base + 6, base + 12)),
                    *retire(RETIRE_ACK, [base + 7]),
                ],
            ),
        ],
    )
    fast, reference, _ = recover_both(path, monkeypatch, reads=reads)
    assert_same(fast, reference)
    ids = [p.id for p in fast["pending"]]
    assert ids == sorted(ids) and base + 11 in ids


def test_format_1_segments_between_staged_ones_read_the_same(tmp_path, monkeypatch):
    path = tmp_path / "c"
    base = 70_000
    v1 = [
        msgpack.packb((1, i, "j", f"k{i}", 1000 + i, 7, NOW + i, 3600, 0, b"x"), use_bin_type=True)
        for i in range(base + 10, base + 15)
    ]
    write_log(
        path,
        [
            (base, [*results_frames(range(base, base + 10)), *retire(RETIRE_ACK, [base + 2])]),
            (base + 10, [FRAME.pack(len(b), zlib.crc32(b)) + b for b in v1]),
            (base + 15, [*results_frames(range(base + 15, base + 20))]),
        ],
    )
    seg2 = path / segment_name(2)
    data = bytearray(seg2.read_bytes())
    data[8:10] = (1).to_bytes(2, "little")  # a format-1 header
    data[28:32] = zlib.crc32(bytes(data[:28])).to_bytes(4, "little")
    seg2.write_bytes(bytes(data))
    fast, reference, _ = recover_both(path, monkeypatch)
    assert_same(fast, reference)
    assert [p.id for p in fast["pending"]] == [i for i in range(base, base + 20) if i != base + 2]


@pytest.mark.parametrize("last", ["torn tail", "torn header"])
def test_reading_again_keeps_what_the_first_read_cut(tmp_path, monkeypatch, last):
    """A log read again by the reference loop (here: a pending result whose
    meta will not decode) after the first read cut a torn tail or removed a
    torn segment: the same report as one read by the reference loop alone."""
    path = tmp_path / "c"
    base = 70_000
    broken = meta_with_id(struct.pack(">BI", 0xCE, base + 3), 3)[:-2]
    tail = [*results_frames(range(base + 10, base + 20))]
    write_log(
        path,
        [
            (
                base,
                [
                    *results_frames(range(base, base + 3)),
                    result_with_meta(broken),
                    *results_frames(range(base + 4, base + 10)),
                    *retire(RETIRE_ACK, [base, base + 1, base + 2]),
                ],
            ),
            (base + 10, tail),
        ],
    )
    if last == "torn tail":
        f = path / segment_name(2)
        f.write_bytes(f.read_bytes()[:-30])
    else:
        (path / segment_name(3)).write_bytes(b"QNODECPL\x02")
    fast, reference, _ = recover_both(path, monkeypatch, reads=2)
    assert_same(fast, reference)
    report = fast["report"]
    assert len(report.cuts) == 1 and report.corrupt[0].reason.startswith("malformed record")
    assert report.removed_segments == ([3] if last == "torn header" else [])
