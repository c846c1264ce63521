"""The segment store's disk-fault seam: every file call it makes, in one object.

A test replaces ``FileOps`` (or subclasses it: ``faults.ControlledFileOps``)
to raise ENOSPC or EIO, or to sleep in fsync.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path


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
