"""The completion log behind one interface (``node.completion.base.CompletionStore``).

``open_completion_store(url)`` picks the backend from the URL:

- ``memory://`` — the in-memory twin, for unit tests of the ledger;
- ``segments:///path/to/dir`` — append-only segment files, the default
  (``<data-dir>/completion``).

The store is not usable until ``recover()`` has run; the ledger process, the
single writer, calls it once at start and reports what it found.
"""

from __future__ import annotations

from typing import Any

from node.completion.base import (
    FSYNC_ALWAYS,
    FSYNC_BATCH,
    FSYNC_NEVER,
    CompletionConfig,
    CompletionError,
    CompletionStore,
    CorruptSpan,
    Counters,
    LogCorrupt,
    LogLocked,
    LogStateError,
    LogUnavailable,
    Pending,
    RecoveryReport,
    Result,
    RetiredLease,
    TailCut,
    UnknownResult,
)
from node.core.errors import ConfigError

__all__ = [
    "FSYNC_ALWAYS",
    "FSYNC_BATCH",
    "FSYNC_NEVER",
    "CompletionConfig",
    "CompletionError",
    "CompletionStore",
    "Counters",
    "CorruptSpan",
    "LogCorrupt",
    "LogLocked",
    "LogStateError",
    "LogUnavailable",
    "Pending",
    "RecoveryReport",
    "Result",
    "RetiredLease",
    "TailCut",
    "UnknownResult",
    "check_completion_url",
    "open_completion_store",
]


def check_completion_url(url: str) -> str:
    """Validate a completion-log URL before anything starts; returns it unchanged."""
    if url == "memory://":
        return url
    if url.startswith("segments:///") and len(url) > len("segments:///"):
        return url
    raise ConfigError(
        f"unknown completion log URL {url!r}: expected segments:///<directory> or memory://"
    )


def open_completion_store(
    url: str, config: CompletionConfig | None = None, file_ops: Any = None
) -> CompletionStore:
    """``file_ops``: a ``segments.FileOps`` for the segment files (tests
    inject disk faults with it; ``faults.ControlledFileOps``)."""
    check_completion_url(url)
    if url == "memory://":
        from node.completion.memory import MemoryCompletionStore

        return MemoryCompletionStore(config)
    from node.completion.segments import SegmentStore

    # segments:///relative/dir and segments:////absolute/dir, as sqlite:/// URLs.
    return SegmentStore(url[len("segments:///") :], config, file_ops)
