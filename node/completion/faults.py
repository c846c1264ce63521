"""Disk faults driven from outside the process, for tests of a running node.

``ControlledFileOps`` is the segment store's ``FileOps`` with one addition:
before each call on the write path it looks at a control file (a ``stat``,
and a read when the file changed) and injects what the file says. The ledger
uses it only in test-hook mode (``QUEUE_NODE_TEST_HOOKS=1`` and
``QUEUE_NODE_TEST_LOG_FAULTS=<path>``, ``workers/ledger/process.py``), so a test can
fill the disk of a live node and empty it again by writing one word:

==================  =========================================================
control file        effect
==================  =========================================================
absent, empty       nothing: the calls go through
``enospc``          writes (``pwrite``) and file creation fail with ENOSPC,
                    as on a full disk; reads, truncation and unlinks work
``eio``             writes and fsyncs fail with EIO
``slow_fsync S``    every fsync first sleeps S seconds
==================  =========================================================

Anything else is treated as empty (and logged once per change).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

from node.completion.segments import FileOps
from node.core.log import log

MODES = ("enospc", "eio", "slow_fsync")


class ControlledFileOps(FileOps):
    def __init__(self, control: Path) -> None:
        self.control = Path(control)
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) last read
        self._mode = ""
        self._arg = 0.0

    def mode(self) -> tuple[str, float]:
        """What the control file says now: (mode, argument)."""
        try:
            st = os.stat(self.control)
        except FileNotFoundError:
            self._seen, self._mode = None, ""
            return "", 0.0
        seen = (st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            self._seen = seen
            words = self.control.read_text(errors="replace").split()
            mode = words[0] if words else ""
            arg = 0.0
            if mode == "slow_fsync":
                try:
                    arg = float(words[1])
                except (IndexError, ValueError):
                    mode = ""
            if mode and mode not in MODES:
                log("log_faults_unknown", logging.WARNING, control=str(self.control), mode=mode)
                mode = ""
            if mode != self._mode:
                log("log_faults", logging.WARNING, mode=mode or "none", arg=arg)
            self._mode, self._arg = mode, arg
        return self._mode, self._arg

    def _fail_write(self) -> None:
        mode, _ = self.mode()
        if mode == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (test hook)")
        if mode == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO) + " (test hook)")

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        if flags & os.O_CREAT and not os.path.exists(path):
            self._fail_write()
        return super().open(path, flags, mode)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        self._fail_write()
        return super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        mode, arg = self.mode()
        if mode == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO) + " (test hook)")
        if mode == "slow_fsync":
            time.sleep(arg)  # the fault being injected: a slow disk
        super().fsync(fd)
