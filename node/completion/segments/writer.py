"""The segment store's writing side: appends, rolls, fsyncs, compaction's files.

``SegmentWriter`` holds the store's open files (the active segment, read-only
descriptors of older ones, the writer's lock) and makes a batch durable
(``_write``: one write, rolling over to a new segment first when the batch
does not fit; ``_sync_written``: at most one fsync, on any thread;
``_written``: the batch counted, or cut back), reads a pending result back for an offer,
and writes what compaction leaves (lease summaries, then the checkpoint, then
the unlinks). Reading the log back after a restart is ``recovery.py``; the
bytes are ``format.py``.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib
from itertools import accumulate
from pathlib import Path

import msgpack  # type: ignore[import-untyped]

from node.completion.base import (
    FSYNC_NEVER,
    CompletionConfig,
    LeaseEntry,
    LogCorrupt,
    LogUnavailable,
    Result,
)
from node.completion.buffered import BufferedLog, _Retire
from node.completion.checkpoint import Checkpoint
from node.completion.segments.files import FileOps
from node.completion.segments.format import (
    CHECKPOINT_HEAD,
    CHECKPOINT_MAGIC,
    CHECKPOINT_NAME,
    CHECKPOINT_VERSION,
    FRAME,
    HEADER,
    SUMMARY_CRC_SPAN,
    SUMMARY_HEAD,
    SUMMARY_MAGIC,
    SUMMARY_VERSION,
    ZERO_RUN,
    _frame,
    _packb,
    decode_result_record,
    encode_header,
    encode_result_records,
    encode_retire,
    segment_name,
    summary_name,
)
from node.core.log import log

# Read-only descriptors kept open for read_result on older segments.
MAX_READ_FDS = 64


class SegmentWriter(BufferedLog):
    """The files of the completion log in ``path``, and every write to them."""

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
        self._unsynced = 0  # bytes written past _size, their fsync to come
        self._zeroed = 0  # the active segment's length on disk: zeros past _size
        self._read_fds: dict[int, int] = {}
        super().__init__(config)

    # -- commit ---------------------------------------------------------------------

    def _write(
        self, results: list[tuple[int, Result]], retires: list[_Retire], first_id: int
    ) -> tuple[int, list[int]]:
        """One write of the batch past the last durable record, rolling over
        to a new segment first when it does not fit (a failure then has only
        one file to put back). Durable once ``_sync_written`` and
        ``_written`` have run."""
        if self._wedged:
            self._cut_back()
        frames, sizes = encode_result_records(results)
        for rt in retires:
            frames.extend(encode_retire(rt))
        total = sum(map(len, frames))
        if self._fd is None or (
            self._size > HEADER.size and self._size + total > self.config.segment_bytes
        ):
            self._roll(first_id)
        assert self._fd is not None
        offsets = list(accumulate(sizes, initial=self._size))[:-1]
        data = b"".join(frames)
        try:
            self._write_all(self._fd, data, self._size)
        except OSError as exc:
            self._unsynced = 0
            self._put_back(exc)
        self._unsynced = len(data)
        end = self._size + len(data)
        if end > self._zeroed:
            self._zeroed = end
            if self.config.preallocate_bytes:
                self._zero_ahead(end)
        return self._active, offsets

    def _zero_ahead(self, end: int) -> None:
        """Zeros from ``end`` (the end of the batch just written) up to
        ``preallocate_bytes`` further, within ``segment_bytes``; made durable
        by this batch's fsync. A write into bytes already allocated changes no
        metadata, so later groups' fsyncs flush data alone; this one pays the
        journal commit for all of them (docs/completion-log.md). Best effort:
        a failure (a full disk) leaves the file as far as it got, and later
        writes extend it as they go."""
        assert self._fd is not None
        target = min(end + self.config.preallocate_bytes, self.config.segment_bytes)
        at, zeros = end, memoryview(ZERO_RUN)
        try:
            while at < target:
                n = self.ops.pwrite(self._fd, zeros[: min(len(zeros), target - at)], at)
                if n <= 0:
                    break
                at += n
        except OSError:
            pass
        self._zeroed = max(self._zeroed, at)

    def _sync_written(self) -> None:
        if self.config.fsync != FSYNC_NEVER and self._fd is not None:
            self.ops.fsync(self._fd)

    def _written(self, error: OSError | None) -> None:
        written, self._unsynced = self._unsynced, 0
        if error is not None:
            self._put_back(error)
        self._size += written

    def _put_back(self, exc: OSError) -> None:
        """A write or its fsync failed: cut the segment back to its last
        durable record and raise ``LogUnavailable``."""
        self._wedged = True
        try:
            self._cut_back()
        except LogUnavailable:
            pass
        raise LogUnavailable(f"completion log: cannot write {self._active_path()}: {exc}") from exc

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
        self._wedged, self._zeroed = False, self._size

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
            if self._zeroed > self._size:  # the zeros past its last record go
                self._quietly(self.ops.ftruncate, self._fd, self._size)
            self._keep_reader(self._active, self._fd)
        self._fd, self._size, self._wedged = fd, HEADER.size, False
        self._zeroed = HEADER.size
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
            result = decode_result_record(body)
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

    def _drop_kept(self, segments: list[int]) -> None:
        for number in segments:
            try:
                self.ops.unlink(self.path / summary_name(number))
            except FileNotFoundError:
                pass
            except OSError as exc:  # the next recovery drops it
                log("completion_unlink_failed", logging.WARNING, summary=number, error=str(exc))

    # -- lifecycle ------------------------------------------------------------------

    def _release_files(self) -> None:
        for fd in self._read_fds.values():
            self._quietly(self.ops.close, fd)
        self._read_fds.clear()
        if self._fd is not None:
            self._quietly(self.ops.close, self._fd)
        self._fd, self._size, self._wedged, self._zeroed = None, 0, False, 0

    def _close(self) -> None:
        self._release_files()
        if self._lock_fd is not None:
            self._quietly(self.ops.close, self._lock_fd)
            self._lock_fd = None
