"""The segment store's files on disk: names, layouts, and the record codecs.

Directory layout (``<data-dir>/completion/`` by default)::

    000000000001.seg     segments, numbered in creation order; the newest is active
    000000000002.seg
    000000000001.leases  lease summary of a removed segment (while keep_retired_s lasts)
    checkpoint           counts of compacted segments (absent until the first removal)
    LOCK                 flock()ed by the one writer; holds its pid

Segment file::

    offset  size  field
    0       8     magic  b"QNODECPL"
    8       2     format version (u16 LE) = FORMAT_VERSION (3; 1 and 2 are still read)
    10      2     flags (u16 LE) = 0
    12      8     segment number (u64 LE), equal to the file name
    20      8     first id (u64 LE): every RESULT here has id >= it, and ids
                  here are below the next segment's first id
    28      4     crc32 of bytes 0..27 (u32 LE)
    32      ...   records, back to back

Record (frame)::

    0       4     body length n (u32 LE), 0 < n <= MAX_RECORD_BYTES
    4       4     crc32 of the body (u32 LE; zlib.crc32)
    8       n     body, told apart by its first byte:

    RESULT (format 2)   0  1  kind = 1 (never the first byte of a msgpack array)
                        1  4  meta length m (u32 LE)
                        5  4  head crc: crc32 of the meta, seeded with n
                        9  m  meta: msgpack [id, job, key, lease_id, version,
                              finished_at, cadence_s, encoding (0 bytes, 1 json)]
                        9+m   data: the result's bytes, to the end of the body
    ACK                 msgpack [2, [id, ...], retired_at]
    DISCARD             msgpack [3, [id, ...], reason, retired_at]
                        (retired_at: wall seconds, a float; formats 1 and 2
                        wrote these records without it)
    RESULT (format 1)   msgpack [1, id, job, key, lease_id, version,
                        finished_at, cadence_s, encoding, data (bin)]

Format 3 added only ``retired_at`` to ACK and DISCARD: how long a retired
result's lease evidence is kept (``keep_retired_s``) counts from it. A record
without it (format 1 or 2) counts as retired when recovery reads it.

Format 2 exists so that recovery decodes a result's few small fields and
never touches its payload (``docs/completion-log.md``, "Numbers"): in every
segment but the last it checks the head crc only (which covers the length
and the meta); the body crc is checked in the last segment, where a torn
tail can be, and whenever a result is read back to be offered. In a mostly
acknowledged log recovery reads a result's id from the meta's fixed prefix
and decodes only the metas of the results still pending at the end
(``deferred.py``, ``staging.py``). Segments of format 1 are read as
they are; appends never go into one (the first commit after recovering a
format-1 last segment opens a new segment), so a file holds one format.

A zero length is never written, so a zero-filled tail (a file extended but
not written before a crash) reads as torn, not as empty records.

Checkpoint file: magic b"QNODECKP", u16 version, u16 flags, then one frame
whose body is a msgpack map (``Checkpoint.to_dict``). Written to
``checkpoint.tmp``, fsynced, renamed, directory fsynced: it is either the old
or the new one, never half.

Lease summary file (``<segment>.leases``): what compaction keeps of a removed
segment whose results were retired less than ``keep_retired_s`` ago, so that
a repeated completion is still recognised after a restart::

    0       8     magic  b"QNODELSM"
    8       2     version (u16 LE) = SUMMARY_VERSION (1)
    10      2     flags (u16 LE) = 0
    12      8     segment number (u64 LE), equal to the file name
    20      8     retired_at (f64 LE): the segment's latest retirement
    28      4     crc32 of bytes 0..27 (u32 LE)
    32      ...   one frame (as a record's): msgpack [[id, ...], [lease_id, ...], [key, ...]]

Written like the checkpoint (``.tmp``, fsync, rename), all of a compaction's
summaries before one directory fsync, and that before the checkpoint that
removes their segments. Recovery keeps the summaries of segments the
checkpoint covers and still within ``keep_retired_s``, and deletes the rest
(a summary of a segment still on disk is left by a crash before the
checkpoint: the segment itself is the evidence). One that does not parse is
logged and deleted: only the repeat answers for its results are lost.

Every file call goes through ``FileOps`` (``files.py``, the disk-fault seam of
issue 5): a test replaces it to raise ENOSPC or EIO, or to sleep in fsync.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]

from node.completion.base import (
    ENCODING_BYTES,
    ENCODING_JSON,
    MAX_IDS_PER_RECORD,
    MAX_RECORD_BYTES,
    RETIRE_ACK,
    Result,
)
from node.completion.buffered import _Retire

_encode_in_c: Callable[[list[tuple[int, Result]]], tuple[bytes, list[int]] | None] | None
try:  # built by setup.py, optional: the Python encoder below writes the same bytes
    from node.completion.segments._records import encode_results as _encode_in_c
except ImportError:  # pragma: no cover - a build without the extension
    _encode_in_c = None

FORMAT_VERSION = 3
# Segment format versions this build reads.
READ_VERSIONS = (1, 2, 3)
# The checkpoint file's own version (unchanged by segment formats 2 and 3).
CHECKPOINT_VERSION = 1
MAGIC = b"QNODECPL"
CHECKPOINT_MAGIC = b"QNODECKP"
SUMMARY_VERSION = 1
SUMMARY_MAGIC = b"QNODELSM"
SUMMARY_HEAD = struct.Struct("<8sHHQdI")
SUMMARY_CRC_SPAN = SUMMARY_HEAD.size - 4
HEADER = struct.Struct("<8sHHQQI")
HEADER_CRC_SPAN = HEADER.size - 4
FRAME = struct.Struct("<II")
# Format 2 RESULT: kind, meta length, crc32 of the meta seeded with the
# frame's length (so a rotten length field fails it too).
RESULT_HEAD = struct.Struct("<BII")
FRAME_RESULT_HEAD = struct.Struct("<IIBII")  # a frame and a format-2 result head
HEAD_SIZE = FRAME_RESULT_HEAD.size
_unpack_meta = partial(msgpack.unpackb, use_list=False)
CHECKPOINT_HEAD = struct.Struct("<8sHH")

K_RESULT, K_ACK, K_DISCARD = 1, 2, 3
_ENCODING_CODE = {ENCODING_BYTES: 0, ENCODING_JSON: 1}
_ENCODING_NAME = {0: ENCODING_BYTES, 1: ENCODING_JSON}

SEGMENT_RE = re.compile(r"^(\d{12})\.seg$")
SUMMARY_RE = re.compile(r"^(\d{12})\.leases(\.tmp)?$")
CHECKPOINT_NAME = "checkpoint"
LOCK_NAME = "LOCK"

TORN_HEADER = "torn segment header"


def segment_name(number: int) -> str:
    return f"{number:012d}.seg"


def summary_name(number: int) -> str:
    return f"{number:012d}.leases"


# -- encoding -------------------------------------------------------------------------

_packb = msgpack.Packer(use_bin_type=True).pack


def _frame(body: bytes) -> bytes:
    return FRAME.pack(len(body), zlib.crc32(body)) + body


def encode_result_record(rid: int, r: Result) -> bytes:
    """A format-2 RESULT frame: fixed head, small msgpack meta, raw data."""
    meta = _packb(
        (rid, r.job, r.key, r.lease_id, r.version, r.finished_at, r.cadence_s,
         _ENCODING_CODE[r.encoding])
    )  # fmt: skip
    n = RESULT_HEAD.size + len(meta) + len(r.data)
    head = RESULT_HEAD.pack(K_RESULT, len(meta), zlib.crc32(meta, n))
    return _frame(b"".join((head, meta, r.data)))


def encode_result_records(results: list[tuple[int, Result]]) -> tuple[list[bytes], list[int]]:
    """``encode_result_record`` of each (id, result), a group at a time: the
    pieces to write back to back and each frame's size. In C when the
    extension is built and the group is of the usual shapes (``_records.c``:
    one piece), else in Python (frame and result head, meta, data, the crcs
    chained over the pieces). The same bytes either way."""
    if _encode_in_c is not None and results:
        done = _encode_in_c(results)
        if done is not None:
            return [done[0]], done[1]
    return _encode_records_py(results)


def _encode_records_py(results: list[tuple[int, Result]]) -> tuple[list[bytes], list[int]]:
    packb, crc, code = _packb, zlib.crc32, _ENCODING_CODE
    pack_head, pack_rhead = FRAME_RESULT_HEAD.pack, RESULT_HEAD.pack
    rhead_size = RESULT_HEAD.size
    parts: list[bytes] = []
    sizes: list[int] = []
    for rid, r in results:
        meta = packb((rid, r.job, r.key, r.lease_id, r.version, r.finished_at, r.cadence_s,
                      code[r.encoding]))  # fmt: skip
        m, data = len(meta), r.data
        n = rhead_size + m + len(data)
        head_crc = crc(meta, n)
        body_crc = crc(data, crc(meta, crc(pack_rhead(K_RESULT, m, head_crc))))
        parts += (pack_head(n, body_crc, K_RESULT, m, head_crc), meta, data)
        sizes.append(FRAME.size + n)
    return parts, sizes


def encode_retire(rt: _Retire) -> list[bytes]:
    out = []
    when = () if rt.at is None else (float(rt.at),)
    for i in range(0, len(rt.ids), MAX_IDS_PER_RECORD):
        ids = rt.ids[i : i + MAX_IDS_PER_RECORD]
        body = (K_ACK, ids) if rt.kind == RETIRE_ACK else (K_DISCARD, ids, rt.reason)
        out.append(_frame(_packb(body + when)))
    return out


def retire_time(rec: tuple) -> float | None:
    """When a decoded ACK or DISCARD record retired its ids (format 3), or
    None (formats 1 and 2 did not write it). TypeError when not a number."""
    n = 3 if rec[0] == K_ACK else 4
    return rec[n - 1] + 0.0 if len(rec) >= n else None


def decode_record(body: bytes | memoryview) -> tuple:
    """One record body, either format, as a tuple: a RESULT is
    ``(1, id, job, key, lease_id, version, finished_at, cadence_s, encoding,
    data)`` whichever format wrote it; ACK and DISCARD as written."""
    if body[0] == K_RESULT:  # format 2
        if len(body) < RESULT_HEAD.size:
            raise ValueError("result record shorter than its head")
        meta_end = RESULT_HEAD.size + RESULT_HEAD.unpack_from(body, 0)[1]
        if meta_end > len(body):
            raise ValueError("result meta runs past the record")
        meta = msgpack.unpackb(body[RESULT_HEAD.size : meta_end], use_list=False)
        if len(meta) != 8:
            raise ValueError(f"result meta has {len(meta)} fields, not 8")
        return (K_RESULT, *meta, bytes(body[meta_end:]))
    return msgpack.unpackb(body, use_list=False)


def decode_result_record(body: bytes | memoryview) -> Result:
    rec = decode_record(body)
    if rec[0] != K_RESULT:
        raise ValueError(f"record kind {rec[0]} is not a result")
    (_, rid, job, key, lease_id, version, finished_at, cadence_s, enc, data) = rec
    return Result(
        key, job, lease_id, version, finished_at, cadence_s, data, _ENCODING_NAME[enc], rid
    )


def encode_header(number: int, first_id: int) -> bytes:
    head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, number, first_id, 0)[:HEADER_CRC_SPAN]
    return head + struct.pack("<I", zlib.crc32(head))


def _valid_frame_end(buf: memoryview, off: int, size: int) -> int:
    """End offset of a whole, checksummed frame at ``off``, else -1."""
    if off + FRAME.size > size:
        return -1
    ln, crc = FRAME.unpack_from(buf, off)
    end = off + FRAME.size + ln
    if ln == 0 or ln > MAX_RECORD_BYTES or end > size:
        return -1
    return end if zlib.crc32(buf[off + FRAME.size : end]) == crc else -1


# A run of zeros: what recovery compares a segment's tail with, and what the
# writer extends the active segment with (``preallocate_bytes``), a MiB at a time.
ZERO_RUN = bytes(1 << 20)


def _zeros_to_end(buf: Any, off: int, size: int) -> bool:
    """Whether every byte in [off, size) is zero: the tail a preallocating
    writer extends a segment with (``CompletionConfig.preallocate_bytes``), where
    the records end. A length of zero is never written, so a record cannot
    start there; a torn write leaves bytes that are not all zero."""
    while off < size:
        n = min(len(ZERO_RUN), size - off)
        if buf[off : off + n] != ZERO_RUN[:n]:
            return False
        off += n
    return True


def _frames_from(buf: memoryview, off: int, size: int) -> int:
    """How many frames start in [off, size), following length fields as far
    as they stay plausible (at least 1: the bad one)."""
    n = 0
    while off + FRAME.size <= size:
        ln = FRAME.unpack_from(buf, off)[0]
        if ln == 0 and n:
            break  # the zeros of a preallocated tail: no frame
        n += 1
        if ln == 0 or ln > MAX_RECORD_BYTES:
            break
        off += FRAME.size + ln
    return max(n, 1)


def read_segment_records(path: str | os.PathLike[str]) -> list[tuple]:
    """Every whole record of one segment file, decoded, up to the first bad
    frame: for an operator looking at a segment recovery marked damaged."""
    data = Path(path).read_bytes()
    out = []
    off = HEADER.size
    while (end := _valid_frame_end(memoryview(data), off, len(data))) >= 0:
        out.append(decode_record(data[off + FRAME.size : end]))
        off = end
    return out
