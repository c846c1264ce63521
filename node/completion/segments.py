"""The completion log as append-only segment files: the default backend.

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
(``_scan_fast``, ``staging.py``). Segments of format 1 are read as
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

Every file call goes through ``FileOps`` (the disk-fault seam of issue 5): a
test replaces it to raise ENOSPC or EIO, or to sleep in fsync.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import zlib
from array import array
from collections import Counter
from collections.abc import Sequence
from functools import partial
from itertools import islice, repeat
from operator import gt, rshift
from pathlib import Path

import msgpack  # type: ignore[import-untyped]

from node.completion.base import (
    ENCODING_BYTES,
    ENCODING_JSON,
    FSYNC_NEVER,
    LOC_OFFSET_BITS,
    MAX_IDS_PER_RECORD,
    MAX_RECORD_BYTES,
    RETIRE_ACK,
    RETIRE_DISCARD,
    BufferedLog,
    Checkpoint,
    CompletionConfig,
    CorruptSpan,
    LeaseEntry,
    LogCorrupt,
    LogLocked,
    LogUnavailable,
    RecoveryReport,
    Result,
    SegmentStats,
    TailCut,
    _Retire,
)
from node.completion.staging import Stage, StagedBatch
from node.core.log import log

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
# What the recovery scan's fast path reads of a record, in one call:
#
#     offset  size  field
#     0       4     frame length, then crc (FRAME)
#     8       9     kind, meta length, head crc (RESULT_HEAD)
#     17      2     the meta's first two bytes as a u16 LE ("prefix"): 0x98
#                   (a msgpack array of 8) and the marker of the id, the
#                   array's first element
#     19      8     the 8 bytes after the marker, read as a u64 LE; byte-swapped
#                   in bulk they are the id's big-endian bytes
#
# So the scan has a result's id without decoding its meta, and decodes only
# the metas of results that are still pending at the end (``staging.py``).
FAST_HEAD = struct.Struct("<IIBIIHQ")
_ARRAY8 = 0x98
# Prefix, then the shortest meta that holds the whole id, for the two ids
# that are read in bulk: a msgpack uint 32 (ids up to 2^32 - 1) and uint 64.
PREFIX_U32, PREFIX_U64 = _ARRAY8 | 0xCE << 8, _ARRAY8 | 0xCF << 8
META_MIN_U32, META_MIN_U64 = 6, 10
# Any other msgpack uint id: its marker -> (shift of the swapped u64, shortest meta).
_UINT_ID = {0xCC: (56, 3), 0xCD: (48, 4), 0xCE: (32, 6), 0xCF: (0, 10)}
_unpack_meta = partial(msgpack.unpackb, use_list=False)
# Recovery checks results without decoding them, and decodes only the ones
# still pending once every record is read (staging.py), when at least this
# share of the results it has read so far was retired. Decoding as it goes
# is cheaper while most stay pending: decoding a survivor later costs more
# than decoding it at once (measured on the development VM: about even at a
# fifth to a quarter retired, half the time at half retired, 1.45 times the
# time when nothing is retired).
DEFER_DECODE_RETIRED = 0.25
CHECKPOINT_HEAD = struct.Struct("<8sHH")

K_RESULT, K_ACK, K_DISCARD = 1, 2, 3
_ENCODING_CODE = {ENCODING_BYTES: 0, ENCODING_JSON: 1}
_ENCODING_NAME = {0: ENCODING_BYTES, 1: ENCODING_JSON}

SEGMENT_RE = re.compile(r"^(\d{12})\.seg$")
SUMMARY_RE = re.compile(r"^(\d{12})\.leases(\.tmp)?$")
CHECKPOINT_NAME = "checkpoint"
LOCK_NAME = "LOCK"
# Read-only descriptors kept open for read_result on older segments.
MAX_READ_FDS = 64


TORN_HEADER = "torn segment header"


class _ReadAgain(Exception):
    """The fast scan met a log the writer does not write (a result out of
    order, or one whose meta will not decode though its checksums hold):
    recovery reads the whole log again with the reference loop alone, which
    reports exactly what is wrong."""


def segment_name(number: int) -> str:
    return f"{number:012d}.seg"


def summary_name(number: int) -> str:
    return f"{number:012d}.leases"


# -- the disk-fault seam --------------------------------------------------------------


class FileOps:
    """Every file call the segment store makes, in one replaceable object.

    Raise ``OSError`` from any method to inject a fault; the store turns
    write-path failures into ``LogUnavailable`` and leaves the files in a
    state recovery reads back without loss of anything durable."""

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def map(self, fd: int, size: int, populate: bool = True) -> mmap.mmap:
        """The whole file, read-only, for the recovery scan (no copy)."""
        # MAP_POPULATE: the kernel maps the pages in one go instead of one
        # fault per 4 KiB page (about a tenth of the scan time on a VM). Not
        # for a walk over result heads only: large payloads stay unread.
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def listdir(self, path: Path) -> list[str]:
        return os.listdir(path)

    def makedirs(self, path: Path) -> None:
        os.makedirs(path, exist_ok=True)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def lock(self, fd: int) -> None:
        """Take the writer's lock or raise BlockingIOError at once."""
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


# -- encoding -------------------------------------------------------------------------

_packb = msgpack.Packer(use_bin_type=True).pack


def _frame(body: bytes) -> bytes:
    return FRAME.pack(len(body), zlib.crc32(body)) + body


def encode_result(rid: int, r: Result) -> bytes:
    """A format-2 RESULT frame: fixed head, small msgpack meta, raw data."""
    meta = _packb(
        (rid, r.job, r.key, r.lease_id, r.version, r.finished_at, r.cadence_s,
         _ENCODING_CODE[r.encoding])
    )  # fmt: skip
    n = RESULT_HEAD.size + len(meta) + len(r.data)
    head = RESULT_HEAD.pack(K_RESULT, len(meta), zlib.crc32(meta, n))
    return _frame(b"".join((head, meta, r.data)))


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


def decode_result(body: bytes | memoryview) -> Result:
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


def _frames_from(buf: memoryview, off: int, size: int) -> int:
    """How many frames start in [off, size), following length fields as far
    as they stay plausible (at least 1: the bad one)."""
    n = 0
    while off + FRAME.size <= size:
        n += 1
        ln = FRAME.unpack_from(buf, off)[0]
        if ln == 0 or ln > MAX_RECORD_BYTES:
            break
        off += FRAME.size + ln
    return max(n, 1)


# -- the store ------------------------------------------------------------------------


class SegmentStore(BufferedLog):
    """The completion log in ``path``. One writer: ``recover()`` takes the
    directory's lock and keeps it until ``close()``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: CompletionConfig | None = None,
        file_ops: FileOps | None = None,
    ) -> None:
        self.path = Path(path)
        self.ops = file_ops or FileOps()
        self._lock_fd: int | None = None
        self._fd: int | None = None  # the active segment, read-write
        self._size = 0  # end of its last durable record
        self._wedged = False  # a failed batch may still be on disk past _size
        self._read_fds: dict[int, int] = {}
        self._stage = Stage()  # results a recovery checked, not yet indexed
        self._retired_read = 0  # ids in the retire records a recovery read
        self._fast_allowed = False  # whether this read of the log may use _scan_fast
        self._staged_any = False  # whether it has staged a result
        super().__init__(config)

    # -- commit ---------------------------------------------------------------------

    def _commit(
        self, results: list[tuple[int, Result]], retires: list[_Retire], first_id: int
    ) -> tuple[int, list[int]]:
        if self._wedged:
            self._cut_back()
        frames = [encode_result(rid, r) for rid, r in results]
        n_results = len(frames)
        for rt in retires:
            frames.extend(encode_retire(rt))
        total = sum(map(len, frames))
        # One batch, one segment: rolling over first means a failure has only
        # one file to put back.
        if self._fd is None or (
            self._size > HEADER.size and self._size + total > self.config.segment_bytes
        ):
            self._roll(first_id)
        assert self._fd is not None
        offsets = []
        pos = self._size
        for f in frames[:n_results]:
            offsets.append(pos)
            pos += len(f)
        data = b"".join(frames)
        try:
            self._write_all(self._fd, data, self._size)
            if self.config.fsync != FSYNC_NEVER:
                self.ops.fsync(self._fd)
        except OSError as exc:
            self._wedged = True
            try:
                self._cut_back()
            except LogUnavailable:
                pass
            raise LogUnavailable(
                f"completion log: cannot write {self._active_path()}: {exc}"
            ) from exc
        self._size += len(data)
        return self._active, offsets

    def _write_all(self, fd: int, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = self.ops.pwrite(fd, view, offset)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            view = view[n:]
            offset += n

    def _cut_back(self) -> None:
        """Put the active segment back to its last durable record: a batch
        that failed must not be found by recovery (its callers heard 503)."""
        assert self._fd is not None
        try:
            self.ops.ftruncate(self._fd, self._size)
            if self.config.fsync != FSYNC_NEVER:
                self.ops.fsync(self._fd)
        except OSError as exc:
            raise LogUnavailable(
                f"completion log: cannot cut {self._active_path()} back to {self._size}: {exc}"
            ) from exc
        self._wedged = False

    def _active_path(self) -> Path:
        return self.path / segment_name(self._active)

    def _roll(self, first_id: int) -> None:
        number = max(self._active, self._checkpoint.next_segment - 1) + 1
        path = self.path / segment_name(number)
        sync = self.config.fsync != FSYNC_NEVER
        fd = None
        try:
            fd = self.ops.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            self._write_all(fd, encode_header(number, first_id), 0)
            if sync:
                self.ops.fsync(fd)
                self.ops.fsync_dir(self.path)
        except OSError as exc:
            if fd is not None:
                self._quietly(self.ops.close, fd)
                self._quietly(self.ops.unlink, path)
            raise LogUnavailable(f"completion log: cannot create {path}: {exc}") from exc
        if self._fd is not None:
            self._keep_reader(self._active, self._fd)
        self._fd, self._size, self._wedged = fd, HEADER.size, False
        self._add_segment(number, first_id)

    def _quietly(self, call, *args) -> None:  # type: ignore[no-untyped-def]
        try:
            call(*args)
        except OSError:
            pass

    # -- reads ----------------------------------------------------------------------

    def _keep_reader(self, number: int, fd: int) -> None:
        if len(self._read_fds) >= MAX_READ_FDS:
            oldest = next(iter(self._read_fds))
            self._quietly(self.ops.close, self._read_fds.pop(oldest))
        self._read_fds[number] = fd

    def _reader(self, number: int) -> int:
        if number == self._active and self._fd is not None:
            return self._fd
        fd = self._read_fds.get(number)
        if fd is None:
            fd = self.ops.open(self.path / segment_name(number), os.O_RDONLY)
            self._keep_reader(number, fd)
        return fd

    def _read(self, result_id: int, segment: int, offset: int) -> Result:
        where = f"{segment_name(segment)} at {offset}"
        try:
            fd = self._reader(segment)
            head = self.ops.pread(fd, FRAME.size, offset)
            ln, crc = FRAME.unpack(head)
            body = self.ops.pread(fd, ln, offset + FRAME.size)
        except (OSError, struct.error) as exc:
            raise LogUnavailable(f"completion log: cannot read {where}: {exc}") from exc
        if len(body) != ln or zlib.crc32(body) != crc:
            raise LogCorrupt(f"completion log: result {result_id} in {where} fails its checksum")
        try:
            result = decode_result(body)
        except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException) as exc:
            raise LogCorrupt(f"completion log: {where} does not decode: {exc}") from exc
        if result.id != result_id:
            raise LogCorrupt(f"completion log: {where} holds result {result.id}, not {result_id}")
        return result

    # -- compaction -----------------------------------------------------------------

    def _remove(self, segments: list[int], checkpoint: Checkpoint) -> None:
        self._write_checkpoint(checkpoint)
        # From here the checkpoint counts them: a segment left behind by a
        # failed unlink is skipped and removed by the next recovery.
        for number in segments:
            fd = self._read_fds.pop(number, None)
            if fd is not None:
                self._quietly(self.ops.close, fd)
            try:
                self.ops.unlink(self.path / segment_name(number))
            except OSError as exc:
                log("completion_unlink_failed", logging.WARNING, segment=number, error=str(exc))
        self._quietly(self.ops.fsync_dir, self.path)

    def _write_checkpoint(self, checkpoint: Checkpoint) -> None:
        body = msgpack.packb(checkpoint.to_dict())
        data = CHECKPOINT_HEAD.pack(CHECKPOINT_MAGIC, CHECKPOINT_VERSION, 0) + _frame(body)
        tmp = self.path / (CHECKPOINT_NAME + ".tmp")
        fd = None
        try:
            fd = self.ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            self._write_all(fd, data, 0)
            self.ops.fsync(fd)
            self.ops.close(fd)
            fd = None
            self.ops.rename(tmp, self.path / CHECKPOINT_NAME)
            self.ops.fsync_dir(self.path)
        except OSError as exc:
            if fd is not None:
                self._quietly(self.ops.close, fd)
            self._quietly(self.ops.unlink, tmp)
            raise LogUnavailable(f"completion log: cannot write the checkpoint: {exc}") from exc

    def _read_checkpoint(self) -> Checkpoint:
        path = self.path / CHECKPOINT_NAME
        try:
            fd = self.ops.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return Checkpoint()
        try:
            size = self.ops.size(fd)
            data = self.ops.pread(fd, size, 0)
        finally:
            self.ops.close(fd)
        try:
            magic, version, _ = CHECKPOINT_HEAD.unpack_from(data, 0)
            ln, crc = FRAME.unpack_from(data, CHECKPOINT_HEAD.size)
            body = data[CHECKPOINT_HEAD.size + FRAME.size :]
            if magic != CHECKPOINT_MAGIC or len(body) != ln or zlib.crc32(body) != crc:
                raise ValueError("bad magic, length or checksum")
            if version > CHECKPOINT_VERSION:
                raise ValueError(f"format version {version} is newer than {CHECKPOINT_VERSION}")
            return Checkpoint.from_dict(msgpack.unpackb(body))
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise LogCorrupt(f"completion log: {path} is not a valid checkpoint: {exc}") from exc

    # -- lease summaries of removed segments -------------------------------------------

    def _results_of(self, segment: int) -> list[LeaseEntry]:
        """(id, lease_id, key) of every result record in a segment on disk, in
        file order, read back from its durable part. A record that fails its
        head (or, format 1, its body) checksum is left out, and a frame chain
        that breaks ends the walk: the scan reported both."""
        try:
            fd = self._reader(segment)
            active = segment == self._active and self._fd is not None
            size = self._size if active else self.ops.size(fd)
            if size <= HEADER.size:
                return []
            mm = self.ops.map(fd, size, populate=False)
        except OSError as exc:
            raise LogUnavailable(
                f"completion log: cannot read {segment_name(segment)}: {exc}"
            ) from exc
        out: list[LeaseEntry] = []
        crc32, frame_head = zlib.crc32, FRAME_RESULT_HEAD.unpack_from
        try:
            off = HEADER.size
            while off + HEAD_SIZE <= size:
                ln, crc, kind, meta_len, meta_crc = frame_head(mm, off)
                end = off + FRAME.size + ln
                if ln == 0 or ln > MAX_RECORD_BYTES or end > size:
                    break
                try:
                    if kind == K_RESULT:
                        meta = mm[off + HEAD_SIZE : off + HEAD_SIZE + meta_len]
                        if HEAD_SIZE + meta_len <= FRAME.size + ln and crc32(meta, ln) == meta_crc:
                            rid, _, key, lease_id = _unpack_meta(meta)[:4]
                            out.append((rid, lease_id, key))
                    else:
                        body = mm[off + FRAME.size : end]
                        if crc32(body) == crc:
                            rec = msgpack.unpackb(body, use_list=False)
                            if rec[0] == K_RESULT:  # format 1
                                out.append((rec[1], rec[4], rec[3]))
                except (ValueError, TypeError, IndexError, msgpack.UnpackException):
                    pass  # reported by the scan: only its lease evidence is lost
                off = end  # a last record shorter than a result head is not one
        finally:
            mm.close()
        return out

    def _keep(self, summaries: list[tuple[int, float, list[LeaseEntry]]]) -> None:
        sync = self.config.fsync != FSYNC_NEVER
        for number, at, entries in summaries:
            head = SUMMARY_HEAD.pack(SUMMARY_MAGIC, SUMMARY_VERSION, 0, number, at, 0)
            head = head[:SUMMARY_CRC_SPAN]
            columns = ([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries])
            data = head + struct.pack("<I", zlib.crc32(head)) + _frame(_packb(columns))
            path = self.path / summary_name(number)
            tmp = path.with_name(path.name + ".tmp")
            fd = None
            try:
                fd = self.ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                self._write_all(fd, data, 0)
                if sync:
                    self.ops.fsync(fd)
                self.ops.close(fd)
                fd = None
                self.ops.rename(tmp, path)
            except OSError as exc:
                if fd is not None:
                    self._quietly(self.ops.close, fd)
                self._quietly(self.ops.unlink, tmp)
                raise LogUnavailable(f"completion log: cannot write {path.name}: {exc}") from exc
        if summaries and sync:
            try:
                self.ops.fsync_dir(self.path)
            except OSError as exc:
                raise LogUnavailable(f"completion log: cannot sync {self.path}: {exc}") from exc

    def _read_summary(self, number: int) -> tuple[float, bytes]:
        """(retired_at, the frame's body) of a summary file; ValueError when it
        does not parse."""
        path = self.path / summary_name(number)
        fd = self.ops.open(path, os.O_RDONLY)
        try:
            data = self.ops.pread(fd, self.ops.size(fd), 0)
        finally:
            self.ops.close(fd)
        try:
            magic, version, _, seg_no, at, crc = SUMMARY_HEAD.unpack_from(data, 0)
        except struct.error as exc:
            raise ValueError(f"{path.name}: {exc}") from None
        if magic != SUMMARY_MAGIC or zlib.crc32(data[:SUMMARY_CRC_SPAN]) != crc:
            raise ValueError(f"{path.name}: no valid summary header")
        if version != SUMMARY_VERSION or seg_no != number:
            raise ValueError(f"{path.name}: version {version}, segment {seg_no}")
        end = _valid_frame_end(memoryview(data), SUMMARY_HEAD.size, len(data))
        if end != len(data):
            raise ValueError(f"{path.name}: its entries fail their checksum")
        return float(at), data[SUMMARY_HEAD.size + FRAME.size :]

    def _kept_entries(self, segment: int) -> list[LeaseEntry]:
        try:
            _, body = self._read_summary(segment)
            ids, leases, keys = msgpack.unpackb(body, use_list=False)
            return list(zip(ids, leases, keys, strict=True))
        except (OSError, ValueError, TypeError, msgpack.UnpackException) as exc:
            log("completion_summary_unreadable", logging.ERROR, segment=segment, error=str(exc))
            return []

    def _drop_kept(self, segments: list[int]) -> None:
        for number in segments:
            try:
                self.ops.unlink(self.path / summary_name(number))
            except FileNotFoundError:
                pass
            except OSError as exc:  # the next recovery drops it
                log("completion_unlink_failed", logging.WARNING, summary=number, error=str(exc))

    def _load_summaries(self, names: list[str]) -> None:
        """Keep the summaries of removed segments (the checkpoint covers them);
        delete the rest: a summary of a segment still on disk (a crash before
        the checkpoint), a ``.tmp``, one that does not parse."""
        for m in filter(None, map(SUMMARY_RE.match, names)):
            number = int(m.group(1))
            if not m.group(2) and self._checkpoint.covers(number) and number not in self._segments:
                try:
                    self._kept[number] = self._read_summary(number)[0]
                    continue
                except ValueError as exc:
                    log("completion_summary_unreadable", logging.ERROR,
                        segment=number, error=str(exc))  # fmt: skip
            self._quietly(self.ops.unlink, self.path / m.group(0))

    # -- recovery -------------------------------------------------------------------

    def _take_lock(self) -> None:
        if self._lock_fd is not None:
            return
        path = self.path / LOCK_NAME
        fd = self.ops.open(path, os.O_RDWR | os.O_CREAT)
        try:
            self.ops.lock(fd)
        except BlockingIOError as exc:
            holder = self.ops.pread(fd, 32, 0).decode(errors="replace").strip()
            self.ops.close(fd)
            raise LogLocked(f"completion log {self.path} is held by pid {holder or '?'}") from exc
        self._lock_fd = fd
        # Only for the message above; a full disk must not stop a recovery.
        self._quietly(self.ops.ftruncate, fd, 0)
        self._quietly(self.ops.pwrite, fd, f"{os.getpid()}\n".encode(), 0)

    def _release_files(self) -> None:
        for fd in self._read_fds.values():
            self._quietly(self.ops.close, fd)
        self._read_fds.clear()
        if self._fd is not None:
            self._quietly(self.ops.close, self._fd)
        self._fd, self._size, self._wedged = None, 0, False

    def _load(self, report: RecoveryReport) -> None:
        try:
            self._load_files(report)
        except OSError as exc:
            raise LogUnavailable(f"completion log: cannot recover {self.path}: {exc}") from exc

    def _load_files(self, report: RecoveryReport) -> None:
        self.ops.makedirs(self.path)
        self._take_lock()
        self._release_files()
        self._quietly(self.ops.unlink, self.path / (CHECKPOINT_NAME + ".tmp"))
        self._checkpoint = self._read_checkpoint()
        names = self.ops.listdir(self.path)
        numbers = sorted(int(m.group(1)) for m in map(SEGMENT_RE.match, names) if m)
        live = []
        for number in numbers:
            if not self._checkpoint.covers(number):
                live.append(number)
                continue
            # Compacted already (a crash came between the checkpoint and the
            # unlink): counted by the checkpoint, so skipped even if it stays.
            try:
                self.ops.unlink(self.path / segment_name(number))
                report.removed_segments.append(number)
            except OSError as exc:
                log("completion_unlink_failed", logging.WARNING, segment=number, error=str(exc))
        try:
            self._load_segments(live, report, fast=True)
        except _ReadAgain:
            # What the first read changed on disk (a torn tail cut, a torn
            # segment removed) stays changed, and reported.
            cuts, removed = list(report.cuts), list(report.removed_segments)
            checkpoint = self._checkpoint
            self._release_files()
            self._reset()
            self._checkpoint = checkpoint
            report.segments = report.records = report.results = report.bytes_read = 0
            report.corrupt, report.cuts, report.removed_segments = [], cuts, removed
            self._load_segments(live, report, fast=False)
            report.bytes_read += sum(c.bytes for c in cuts if c.reason != TORN_HEADER)
        self._load_summaries(names)
        if report.removed_segments:
            self.ops.fsync_dir(self.path)
        for number, s in self._segments.items():
            if s.damaged:
                log("completion_segment_damaged", logging.ERROR, segment=number)

    def _load_segments(self, live: list[int], report: RecoveryReport, fast: bool) -> None:
        """Scan the live segments in order; ``fast``: let ``_scan_fast`` take
        what it can (``_defer_decode``). Raises ``_ReadAgain`` when the fast
        scan meets a log the writer does not write."""
        self._stage, self._retired_read = Stage(), 0
        self._fast_allowed, self._staged_any = fast, False
        try:
            for i, number in enumerate(live):
                if number in report.removed_segments:
                    continue  # a torn segment a first read removed
                self._load_segment(number, i == len(live) - 1, report)
                self._apply_loaded_retires(force=False)
            # Every retire record is known now: index what is left.
            self._apply_loaded_retires(force=True)
            self._index_staged()
        finally:
            self._stage.close()

    def _load_segment(self, number: int, last: bool, report: RecoveryReport) -> None:
        path = self.path / segment_name(number)
        fd = self.ops.open(path, os.O_RDWR if last else os.O_RDONLY)
        keep = False
        try:
            size = self.ops.size(fd)
            header = self._check_header(fd, path, number, size, last)
            if header is None:  # a segment torn while it was being created
                report.cuts.append(TailCut(number, 0, size, 0, TORN_HEADER))
                report.removed_segments.append(number)
                self.ops.unlink(path)
                return
            first_id, version = header
            stats = self._add_segment(number, first_id)
            end = self._scan(fd, stats, size, last, report) if size > HEADER.size else size
            report.segments += 1
            report.bytes_read += size
            if last and version == FORMAT_VERSION:
                self._fd, self._size, keep = fd, end, True
            else:
                self._keep_reader(number, fd)
                keep = True
        finally:
            if not keep:
                self.ops.close(fd)

    def _check_header(
        self, fd: int, path: Path, number: int, size: int, last: bool
    ) -> tuple[int, int] | None:
        """The segment's (first id, format version); None for a torn header
        on the last segment. An older format is read; appends then go to a
        new segment (``_fd`` stays None)."""
        head = self.ops.pread(fd, HEADER.size, 0)
        if len(head) < HEADER.size:
            if last:
                return None
            raise LogCorrupt(f"completion log: {path} is shorter than its header")
        magic, version, _flags, seg_no, first_id, crc = HEADER.unpack(head)
        if magic != MAGIC or zlib.crc32(head[:HEADER_CRC_SPAN]) != crc:
            if last and size == HEADER.size:
                return None
            raise LogCorrupt(f"completion log: {path} has no valid segment header")
        if version not in READ_VERSIONS:
            raise LogCorrupt(
                f"completion log: {path} is format version {version}; "
                f"this build reads versions {', '.join(map(str, READ_VERSIONS))}"
            )
        if seg_no != number:
            raise LogCorrupt(f"completion log: {path} says it is segment {seg_no}")
        return int(first_id), int(version)

    def _scan(
        self, fd: int, stats: SegmentStats, size: int, last: bool, report: RecoveryReport
    ) -> int:
        """Read every record of one segment; returns the end of the last good
        one (where appends continue when this is the last segment).

        Once a share of what recovery has read was retired
        (``DEFER_DECODE_RETIRED``), ``_scan_fast`` takes the records it can check without decoding
        (format-2 results, staged undecoded, and ACK and DISCARD records) and
        leaves everything else to ``_scan_run``, which reads at least one
        record and hands back at the next format-2 result. Otherwise
        ``_scan_run`` reads the whole segment, decoding as it goes."""
        mm = self.ops.map(fd, size)
        buf = memoryview(mm)
        fast = self._fast_allowed and self._defer_decode(report)
        try:
            off = HEADER.size
            while True:
                if fast:
                    off = self._scan_fast(mm, buf, off, size, stats, report, last)
                    if off >= size:
                        return off
                off, reason, end = self._scan_run(buf, off, size, stats, report, last, fast)
                if not reason:
                    if off >= size:
                        return off
                    continue
                if end < 0:
                    end = self._frame_end(buf, off, size)
                    if not (0 < end < size and _valid_frame_end(buf, end, size) >= 0):
                        end = -1
                if end >= 0:
                    # A whole record we cannot use, or a bad one the chain
                    # goes on after: bit rot or a bug, not a tear. Lose only it.
                    report.corrupt.append(CorruptSpan(stats.number, off, end - off, reason, True))
                    stats.damaged = True
                    off = end
                elif last:
                    cut = TailCut(
                        stats.number, off, size - off, _frames_from(buf, off, size), reason
                    )
                    report.cuts.append(cut)
                    log(
                        "completion_tail_cut",
                        logging.WARNING,
                        segment=stats.number,
                        offset=off,
                        bytes=cut.bytes,
                        records=cut.records,
                        reason=reason,
                    )
                    # The map stays open for results staged before the cut
                    # (indexed at the end): they lie below the new end of
                    # the file, so reading them cannot fault.
                    self._truncate(fd, off)
                    return off
                else:
                    report.corrupt.append(CorruptSpan(stats.number, off, size - off, reason, False))
                    stats.damaged = True
                    return off
        finally:
            buf.release()
            if not self._stage.keep_map(stats.number, mm):
                mm.close()

    def _defer_decode(self, report: RecoveryReport) -> bool:
        """Whether to scan the next segment with ``_scan_fast``: once a share
        of what was read has been retired (the first segment: never)."""
        return bool(report.results) and (
            self._retired_read >= DEFER_DECODE_RETIRED * report.results
        )

    def _scan_fast(  # noqa: C901 - the hot loop, inlined on purpose
        self,
        mm: mmap.mmap,
        buf: memoryview,
        off: int,
        size: int,
        stats: SegmentStats,
        report: RecoveryReport,
        whole: bool,
    ) -> int:
        """The hot loop of a mostly retired log: from ``off``, take every
        record up to the first one it cannot take as ``_scan_run`` would, and
        return that one's offset (``size`` at the end). It checks what
        ``_scan_run`` checks (lengths, the head crc, the body crc when
        ``whole``), but reads a result's id from its meta's fixed prefix
        (``FAST_HEAD``) and stages the result undecoded (``staging.py``).
        ACK and DISCARD records are decoded and noted as there. Anything
        else, and any record that fails a check, is left to ``_scan_run`` to
        read and report."""
        unpack = FAST_HEAD.unpack_from
        crc32 = zlib.crc32
        unpackb = msgpack.unpackb
        # Locals: the loop runs once a record.
        frame_size, head_size, result_head_size = FRAME.size, HEAD_SIZE, RESULT_HEAD.size
        max_bytes, k_result = MAX_RECORD_BYTES, K_RESULT
        last_id = self._index.last_id
        # Ids only grow: once above 2^32 - 1, every id is a uint 64.
        u64 = last_id >= 0xFFFFFFFF
        prefix, meta_min = (PREFIX_U64, META_MIN_U64) if u64 else (PREFIX_U32, META_MIN_U32)
        offsets: list[int] = []
        raws: list[int] = []
        odd: list[tuple[int, int, int]] = []  # (position, prefix, meta length): another id
        retires: list[tuple[int, str, Sequence[int], float | None]] = []  # offset, kind, ids, at
        add_offset, add_raw = offsets.append, raws.append
        limit = size - FAST_HEAD.size
        body = None
        try:
            while off <= limit:
                ln, crc, kind, meta_len, meta_crc, pre, raw = unpack(mm, off)
                end = off + frame_size + ln
                if kind == k_result:
                    # The meta within the record (a zero or short length fails
                    # that), the record within the file, and the head crc.
                    if meta_len + result_head_size > ln or end > size or ln > max_bytes:
                        break
                    if crc32(mm[off + head_size : off + head_size + meta_len], ln) != meta_crc:
                        break
                    if whole and crc32(buf[off + frame_size : end]) != crc:
                        break
                    if pre != prefix or meta_len < meta_min:
                        odd.append((len(offsets), pre, meta_len))
                    add_offset(off)
                    add_raw(raw)
                else:
                    if ln == 0 or ln > max_bytes or end > size:
                        break
                    body = buf[off + frame_size : end]
                    if crc32(body) != crc:
                        break
                    try:
                        rec = unpackb(body, use_list=False)
                        kind = rec[0]
                        if kind == K_ACK:
                            how = RETIRE_ACK
                        elif kind == K_DISCARD:
                            how = RETIRE_DISCARD
                        else:
                            break
                        retired = rec[1]
                        len(retired)
                        when = retire_time(rec)
                    except (
                        ValueError,
                        TypeError,
                        IndexError,
                        OverflowError,
                        msgpack.UnpackException,
                    ):
                        break
                    retires.append((off, how, retired, when))
                off = end
        finally:
            del body
        stop = off
        taken = len(offsets)
        if taken:
            swapped = array("Q", raws)
            swapped.byteswap()  # each the big-endian reading of its 8 bytes
            ids = swapped if u64 else array("Q", map(rshift, swapped, repeat(32)))
            for i, pre, meta_len in odd:
                marker = pre >> 8
                if pre & 0xFF != _ARRAY8:
                    taken = i
                    break
                if marker < 0x80:  # a positive fixint: the marker is the id
                    rid, need = marker, 2
                elif marker in _UINT_ID:
                    shift, need = _UINT_ID[marker]
                    rid = swapped[i] >> shift
                else:
                    taken = i
                    break
                if meta_len < need:
                    taken = i
                    break
                ids[i] = rid
            if taken and (ids[0] <= last_id or not all(map(gt, islice(ids, 1, taken), ids))):
                # Never from the writer. The reference loop tells a result
                # that is out of order from one that only seems to be, after
                # one with a checksummed meta that will not decode, which
                # it does not count: leave it all to the reference loop.
                raise _ReadAgain
            if taken < len(offsets):
                stop = offsets[taken]  # _scan_run reads and reports that one
            if taken:
                del ids[taken:]
                self._stage.add(
                    StagedBatch(stats.number, ids, array("Q", islice(offsets, taken)), mm)
                )
                self._index.last_id = ids[-1]
                self._staged_any = True
                stats.results += taken
                stats.live += taken
                report.results += taken
        noted = 0
        for where, how, retired, when in retires:
            if where >= stop:
                break
            self._loaded_retire(how, retired, stats.number, when)
            noted += 1
        report.records += taken + noted
        return stop

    @staticmethod
    def _frame_end(buf: memoryview, off: int, size: int) -> int:
        """Where the frame at ``off`` ends by its length field, or -1."""
        if off + FRAME.size > size:
            return -1
        ln = FRAME.unpack_from(buf, off)[0]
        return off + FRAME.size + ln if 0 < ln <= MAX_RECORD_BYTES else -1

    def _truncate(self, fd: int, length: int) -> None:
        try:
            self.ops.ftruncate(fd, length)
            self.ops.fsync(fd)
        except OSError as exc:
            raise LogUnavailable(f"completion log: cannot cut a torn tail: {exc}") from exc

    def _scan_run(  # noqa: C901 - the hot loop, inlined on purpose
        self,
        buf: memoryview,
        off: int,
        size: int,
        stats: SegmentStats,
        report: RecoveryReport,
        whole: bool,
        hand_back: bool = False,
    ) -> tuple[int, str, int]:
        """The reference loop: read good records from ``off`` to the end or to
        the first bad frame (or, with ``hand_back``, to the next format-2
        RESULT after the first record, for ``_scan_fast``). Returns (where it
        stopped, "", -1), or (the bad frame's offset, why it is bad, the end
        of the frame when it is whole and checksummed else -1).

        A format-2 RESULT is checked by its head checksum (frame length,
        meta) and only its meta is decoded; its payload's checksum is checked
        too when ``whole`` (the last segment, the only one that can hold a
        torn tail) and otherwise when the result is read back."""
        frame = FRAME.unpack_from
        frame_head = FRAME_RESULT_HEAD.unpack_from
        crc32 = zlib.crc32
        unpackb = msgpack.unpackb
        index = self._index
        loaders: dict[str, tuple] = {}
        staged = bool(len(self._stage))  # staged results come first in id order
        last_id = index.last_id
        base = stats.number << LOC_OFFSET_BITS
        start = off
        results = records = 0
        body = None
        try:
            while off < size:
                # The frame and, for a format-2 RESULT, its head in one call.
                if off + HEAD_SIZE <= size:
                    ln, crc, kind, meta_len, meta_crc = frame_head(buf, off)
                    if hand_back and kind == K_RESULT and off != start:
                        return off, "", -1
                elif off + FRAME.size <= size:
                    ln, crc = frame(buf, off)
                    kind = 0
                else:
                    return off, "torn frame header", -1
                end = off + FRAME.size + ln
                if ln == 0 or ln > MAX_RECORD_BYTES:
                    return off, f"bad record length {ln}", -1
                if end > size:
                    return off, "record runs past the end of the file", -1
                if kind == K_RESULT and ln >= RESULT_HEAD.size:
                    # Format 2: check the head, decode the meta only; the
                    # payload stays on disk until the result is offered.
                    meta_end = off + HEAD_SIZE + meta_len
                    body = buf[off + HEAD_SIZE : meta_end]
                    if meta_end > end or crc32(body, ln) != meta_crc:
                        return off, "result head checksum mismatch", -1
                    if whole and crc32(buf[off + FRAME.size : end]) != crc:
                        return off, "checksum mismatch", -1
                else:
                    body = buf[off + FRAME.size : end]
                    if crc32(body) != crc:
                        return off, "checksum mismatch", -1
                    kind = 0
                try:
                    if kind == K_RESULT:
                        rid, job, key, _, _, finished_at, _, _ = unpackb(body, use_list=False)
                    else:
                        rec = unpackb(body, use_list=False)
                        kind = rec[0]
                        if kind == K_RESULT:  # format 1
                            _, rid, job, key, _, _, finished_at, _, _, _ = rec
                    if kind == K_RESULT:
                        # PendingIndex.add, inlined: a third of the scan's time
                        # otherwise. Checks first, so a bad record adds nothing.
                        finished_at += 0.0
                        if rid <= last_id:
                            if self._staged_any:  # the id before may be a staged one's
                                raise _ReadAgain
                            return off, f"result id {rid} out of order", end
                        load = loaders.get(job)
                        if load is None:
                            if staged:
                                self._index_staged()
                                staged = False
                            load = loaders[job] = index.loader(job)
                        add_id, add_loc, add_fin, add_key, add_all, add_code, code = load
                        add_id(rid)
                        add_loc(base | off)
                        add_fin(finished_at)
                        add_key(key)
                        add_all(rid)
                        add_code(code)
                        last_id = rid
                        results += 1
                    elif kind == K_ACK or kind == K_DISCARD:
                        how = RETIRE_ACK if kind == K_ACK else RETIRE_DISCARD
                        self._loaded_retire(how, rec[1], stats.number, retire_time(rec))
                    else:
                        return off, f"unknown record kind {kind!r}", end
                except (
                    ValueError,
                    TypeError,
                    IndexError,
                    OverflowError,
                    msgpack.UnpackException,
                ) as exc:
                    return off, f"malformed record: {exc}", end
                records += 1
                off = end
            return off, "", -1
        finally:
            del body
            index.last_id = last_id
            stats.results += results
            stats.live += results
            report.results += results
            report.records += records

    # -- the stage: results checked, decoded once every retire record is known -------

    def _loaded_retire(
        self, kind: str, ids: Sequence[int], segment: int, at: float | None = None
    ) -> None:
        super()._loaded_retire(kind, ids, segment, at)
        self._retired_read += len(ids)

    def _loaded_count(self) -> int:
        return len(self._index) + len(self._stage)

    def _retire_loaded(self, retired: dict[int, bool], any_discard: bool) -> Counter:
        counts = self._stage.retire(retired, any_discard)
        counts.update(self._index.retire_bulk(retired, any_discard))
        return counts

    def _index_staged(self) -> None:
        """Decode the staged results and index them: at the end of recovery,
        or before ``_scan_run`` indexes a later result itself. The only
        place a staged result's meta is decoded."""
        index = self._index
        meta_len_at = RESULT_HEAD.unpack_from
        for batch in self._stage.take():
            mm = batch.source
            base = batch.number << LOC_OFFSET_BITS
            loaders: dict[str, tuple] = {}
            for rid, off in zip(batch.ids, batch.offsets, strict=True):
                # What _scan_run does with a format-2 RESULT, less the checks
                # _scan_fast made already.
                meta = off + HEAD_SIZE
                try:
                    _, job, key, _, _, finished_at, _, _ = _unpack_meta(
                        mm[meta : meta + meta_len_at(mm, off + FRAME.size)[1]]
                    )
                    finished_at += 0.0
                    load = loaders.get(job)
                    if load is None:
                        load = loaders[job] = index.loader(job)
                except (
                    ValueError,
                    TypeError,
                    IndexError,
                    OverflowError,
                    msgpack.UnpackException,
                ):
                    # Its checksums held, so a writer's bug, not rot; the
                    # reference loop would not have counted it, nor let its
                    # id order the ones after it.
                    raise _ReadAgain from None
                add_id, add_loc, add_fin, add_key, add_all, add_code, code = load
                add_id(rid)
                add_loc(base | off)
                add_fin(finished_at)
                add_key(key)
                add_all(rid)
                add_code(code)
        self._stage.close()

    # -- lifecycle ------------------------------------------------------------------

    def _close(self) -> None:
        self._release_files()
        if self._lock_fd is not None:
            self._quietly(self.ops.close, self._lock_fd)
            self._lock_fd = None


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


__all__: Sequence[str] = (
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "FileOps",
    "SegmentStore",
    "read_segment_records",
    "segment_name",
)
