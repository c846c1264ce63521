"""The segment store's reading side: recovery after a restart or a crash.

``recover()`` (``BufferedLog``) calls ``_load``: take the writer's lock, read
the checkpoint, drop segments it already counts, scan every live segment in
order (the reference loop ``_scan_run`` here, the fast path of a mostly
retired log in ``deferred.py``), cut a torn tail off the last segment, mark
a segment with a bad record in its middle damaged (never guessed about), and
keep the lease summaries still within ``keep_retired_s``. The lease evidence
of a segment (``_results_of``) and of a summary (``_kept_entries``) is read
back from here too. What the bytes mean is ``format.py``.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]

from node.completion.base import (
    MAX_RECORD_BYTES,
    RETIRE_ACK,
    RETIRE_DISCARD,
    CorruptSpan,
    LeaseEntry,
    LogCorrupt,
    LogLocked,
    LogUnavailable,
    RecoveryReport,
    TailCut,
)
from node.completion.checkpoint import Checkpoint, SegmentStats
from node.completion.pending import LOC_OFFSET_BITS
from node.completion.segments.deferred import DeferredScan, _ReadAgain
from node.completion.segments.format import (
    CHECKPOINT_HEAD,
    CHECKPOINT_MAGIC,
    CHECKPOINT_NAME,
    CHECKPOINT_VERSION,
    FORMAT_VERSION,
    FRAME,
    FRAME_RESULT_HEAD,
    HEAD_SIZE,
    HEADER,
    HEADER_CRC_SPAN,
    K_ACK,
    K_DISCARD,
    K_RESULT,
    LOCK_NAME,
    MAGIC,
    READ_VERSIONS,
    RESULT_HEAD,
    SEGMENT_RE,
    SUMMARY_CRC_SPAN,
    SUMMARY_HEAD,
    SUMMARY_MAGIC,
    SUMMARY_RE,
    SUMMARY_VERSION,
    TORN_HEADER,
    _frames_from,
    _unpack_meta,
    _valid_frame_end,
    _zeros_to_end,
    retire_time,
    segment_name,
    summary_name,
)
from node.completion.staging import Stage
from node.core.log import log

_lease_entries_in_c: Callable[..., list[LeaseEntry] | None] | None
try:  # built by setup.py, optional: _results_of reads the same in Python
    from node.completion.segments._records import lease_entries as _lease_entries_in_c
except ImportError:  # pragma: no cover - a build without the extension
    _lease_entries_in_c = None


class SegmentRecovery(DeferredScan):
    """Everything the segment store reads back from its directory."""

    # -- the checkpoint -------------------------------------------------------------

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
        try:
            found = None
            if _lease_entries_in_c is not None:  # the same walk in C, or None: read it here
                found = _lease_entries_in_c(mm, HEADER.size, size, MAX_RECORD_BYTES)
            return self._results_in(mm, size) if found is None else found
        finally:
            mm.close()

    @staticmethod
    def _results_in(mm: Any, size: int) -> list[LeaseEntry]:
        """``_results_of``'s walk in Python (the reference of the C one)."""
        out: list[LeaseEntry] = []
        crc32, frame_head = zlib.crc32, FRAME_RESULT_HEAD.unpack_from
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
        return out

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
                # Appends go on at ``end``; a zero tail (preallocation) stays.
                self._fd, self._size, keep = fd, end, True
                self._zeroed = self.ops.size(fd)
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
                if _zeros_to_end(mm, off, size):
                    return off  # the zeros a preallocating writer left ahead: the end
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
