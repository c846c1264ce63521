"""The completion store's interface: the abstract log and the types it speaks.

Two implementations sit behind ``CompletionStore``: ``segments`` (append-only
files, the default) and ``memory`` (the in-memory twin, for unit tests of the
ledger). Both derive from ``buffered.BufferedLog``, which owns everything
that is not storage; ``pending.PendingIndex`` is the index of results not yet
retired. ``tests/integration/test_completion.py`` holds the two backends together.

Rules every backend keeps (``docs/completion-log.md`` says why):

- A result is *durable* once ``flush()`` returned after appending it; only
  then is it pending (offerable) and counted. A crash loses the buffer, and
  nobody was told about it.
- ``ack`` and ``discard`` take effect in memory at once (a retired result is
  never offered again by this process) and become durable at the next flush;
  a crash before it re-offers them, which is at-least-once, never loss.
- Counters count records that are durable, so after ``flush()`` they equal
  what ``recover()`` rebuilds from the disk, exactly.
- Which lease each result answered stays on disk for ``keep_retired_s``
  after the result is retired (``retired_leases``): in its segment, or, once
  compaction removed that, in the segment's lease summary. The ledger answers
  a repeated completion from it after a restart (``docs/delivery.md``).
- Not thread-safe: the ledger process is the single writer, on one thread.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from node.core.errors import NodeError

# -- tunables -------------------------------------------------------------------------

FSYNC_ALWAYS = "always"  # every call is its own commit: append/ack return durable
FSYNC_BATCH = "batch"  # group commit: one write + one fsync per flush()
FSYNC_NEVER = "never"  # write at flush, never fsync: survives kill -9, not power loss
FSYNC_POLICIES = (FSYNC_ALWAYS, FSYNC_BATCH, FSYNC_NEVER)
# Big enough that a segment holds ~60k results of 1 KiB (few files, few
# fsyncs of directories), small enough that one long-pending result pins
# little disk.
DEFAULT_SEGMENT_BYTES = 64 << 20
# A result is at most a request body (16 MiB, docs CONTRACT); anything above
# this in a length field is garbage, which recovery must tell from data.
MAX_RECORD_BYTES = 32 << 20
# ids per ACK/DISCARD record: keeps one record under ~1 MiB.
MAX_IDS_PER_RECORD = 100_000

ENCODING_BYTES = "bytes"
ENCODING_JSON = "json"
ENCODINGS = (ENCODING_BYTES, ENCODING_JSON)

RETIRE_ACK = "ack"
RETIRE_DISCARD = "discard"


# -- errors ---------------------------------------------------------------------------


class CompletionError(NodeError):
    """Base of the completion store's errors."""


class LogUnavailable(CompletionError):
    """The log cannot take writes now (full disk, I/O error). Nothing already
    durable is lost; the failed batch was not recorded. Retry later:
    ``/complete`` answers 503 ``log_unavailable``."""


class LogCorrupt(CompletionError):
    """The log holds something recovery must not guess about (a segment of
    an unknown format version, a header that does not parse in the middle of
    the log). Nothing was changed on disk."""


class LogLocked(CompletionError):
    """Another process holds the log directory: there is one writer."""


class LogStateError(CompletionError):
    """A call in the wrong state: before ``recover()`` or after ``close()``."""


class UnknownResult(CompletionError, KeyError):
    """No pending result has this id (never durable, or already retired)."""


# -- values ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    """One finished lease's result, as appended and as read back.

    ``data`` is what the handler returned: raw bytes (``encoding="bytes"``) or
    a JSON value encoded as UTF-8 JSON text (``encoding="json"``); build one
    with ``Result.of(value, ...)`` and get the value back with ``value()``.
    ``id`` is 0 until the log assigns one."""

    key: str
    job: str
    lease_id: int | str
    version: int  # the row's version when it was leased (write-back guard)
    finished_at: float  # wall time, stored
    cadence_s: float  # next due = finished_at + cadence_s
    data: bytes
    encoding: str = ENCODING_BYTES
    id: int = 0

    @classmethod
    def of(
        cls,
        value: Any,
        *,
        key: str,
        job: str,
        lease_id: int | str,
        version: int,
        finished_at: float,
        cadence_s: float,
    ) -> Result:
        if isinstance(value, bytes | bytearray | memoryview):
            data, encoding = bytes(value), ENCODING_BYTES
        else:
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
            data, encoding = text.encode(), ENCODING_JSON
        return cls(key, job, lease_id, version, finished_at, cadence_s, data, encoding)

    def value(self) -> Any:
        return json.loads(self.data) if self.encoding == ENCODING_JSON else self.data


def _result_maker() -> Any:
    """``Result(...)`` without the frozen dataclass's ``__init__`` (a third of
    its cost): the slots set through their descriptors. The ledger makes one
    a completion; the value is the same (equal, same hash)."""
    new = object.__new__
    s0, s1, s2, s3, s4, s5, s6, s7, s8 = (
        getattr(Result, f).__set__
        for f in ("key", "job", "lease_id", "version", "finished_at", "cadence_s", "data",
                  "encoding", "id")
    )  # fmt: skip

    def make_result(
        key: str,
        job: str,
        lease_id: int | str,
        version: int,
        finished_at: float,
        cadence_s: float,
        data: bytes,
        encoding: str = ENCODING_BYTES,
        id: int = 0,  # noqa: A002 - the field's name
    ) -> Result:
        r = new(Result)
        s0(r, key), s1(r, job), s2(r, lease_id), s3(r, version), s4(r, finished_at)
        s5(r, cadence_s), s6(r, data), s7(r, encoding), s8(r, id)
        return r

    return make_result


make_result = _result_maker()


# (result id, lease id, key): what a result's lease evidence is.
LeaseEntry = tuple[int, int | str, str]


class RetiredLease(NamedTuple):
    """A retired result as ``retired_leases`` gives it back: which lease it
    answered, for which key, and (at the latest) when it was retired."""

    id: int
    lease_id: int | str
    key: str
    retired_at: float


class Pending(NamedTuple):
    """A durable, unretired result as the index holds it: no payload, no
    lease. ``read_result(id)`` reads the rest back from the log."""

    id: int
    job: str
    key: str
    finished_at: float
    segment: int
    offset: int


@dataclass(frozen=True, slots=True)
class Counters:
    """Lifetime counts. ``durable``, ``acked`` and ``discarded`` are rebuilt
    exactly by ``recover()`` (records, plus the checkpoint of compacted
    segments). ``appended`` restarts at ``durable`` (an append that never
    became durable left no evidence and was never promised to anyone);
    ``rejected`` (results of failed flushes) counts since this open only."""

    appended: int = 0
    durable: int = 0
    acked: int = 0
    discarded: int = 0
    rejected: int = 0

    @property
    def awaiting_ack(self) -> int:
        return self.durable - self.acked - self.discarded


@dataclass(frozen=True, slots=True)
class TailCut:
    """A torn tail cut off the last segment: bytes from ``offset`` to its end."""

    segment: int
    offset: int
    bytes: int
    records: int  # frames that started in the cut region (at least 1)
    reason: str


@dataclass(frozen=True, slots=True)
class CorruptSpan:
    """A bad record that is *not* a torn tail. ``skipped``: the frame chain
    went on after it, so only this record is lost; otherwise the rest of the
    segment (``bytes``) is unreadable. The file is left as it is."""

    segment: int
    offset: int
    bytes: int
    reason: str
    skipped: bool


@dataclass(slots=True)
class RecoveryReport:
    segments: int = 0
    records: int = 0
    results: int = 0  # RESULT records read from the segments now on disk
    pending: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    next_id: int = 1
    cuts: list[TailCut] = field(default_factory=list)
    corrupt: list[CorruptSpan] = field(default_factory=list)
    # Segments recovery deleted: already compacted (a crash between the
    # checkpoint and the unlink), or created but torn before its first record.
    removed_segments: list[int] = field(default_factory=list)
    counters: Counters = field(default_factory=Counters)
    summaries: int = 0  # lease summaries of removed segments, still within keep_retired_s

    @property
    def exact(self) -> bool:
        """True when nothing durable was unreadable: counters are exact."""
        return not self.corrupt


@dataclass(frozen=True, slots=True)
class CompletionConfig:
    fsync: str = FSYNC_BATCH
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    # How long after a result is retired the log keeps the evidence of which
    # lease it answered (``retired_leases``): a removed segment leaves a lease
    # summary for that long. 0: none (the ledger sets its repeat window).
    keep_retired_s: float = 0.0
    # Results made durable lately are kept in memory up to this many bytes of
    # data, so that offering them reads nothing back from disk (the oldest go
    # first; an ack or a discard drops its own). 0: every offer reads the log.
    recent_bytes: int = 8 << 20
    # Extend the active segment with zeros this far ahead of its writes
    # (within ``segment_bytes``; 0: off): a write into bytes already on disk
    # changes no file metadata, so its fsync has no journal commit to wait
    # for (``segments/writer.py``). The ledger sets it (``log_preallocate_bytes``);
    # recovery reads a zero-filled tail as the end of the records, whoever wrote it.
    preallocate_bytes: int = 0

    def __post_init__(self) -> None:
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(
                f"fsync must be one of {', '.join(FSYNC_POLICIES)}, not {self.fsync!r}"
            )
        if self.segment_bytes < 4096:
            raise ValueError(f"segment_bytes must be at least 4096, not {self.segment_bytes}")
        if self.preallocate_bytes < 0:
            raise ValueError(f"preallocate_bytes must be 0 or more, not {self.preallocate_bytes}")
        if self.recent_bytes < 0:
            raise ValueError(f"recent_bytes must be 0 or more, not {self.recent_bytes}")
        if not 0 <= self.keep_retired_s < float("inf"):
            raise ValueError(f"keep_retired_s must be 0 or more, not {self.keep_retired_s}")


# -- the interface --------------------------------------------------------------------


class CompletionStore(abc.ABC):
    """The completion log as the ledger sees it."""

    config: CompletionConfig

    @abc.abstractmethod
    def recover(self) -> RecoveryReport:
        """Rebuild everything from what is durable (dropping any buffer); must
        be called once before anything else. Cuts a torn tail."""

    @abc.abstractmethod
    def append_results(self, results: Sequence[Result]) -> list[int]:
        """Assign ids and buffer the results; durable only after ``flush()``
        returns (at once under ``fsync="always"``)."""

    @abc.abstractmethod
    def raise_next_id(self, floor: int) -> int:
        """Give no id below ``floor`` from now on (a fleet node's ids start
        above its number's base: node/core/ids.py); ids only grow, so a
        floor under the next id changes nothing. The next id, returned."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Write the buffer and fsync it per policy: one group commit. Raises
        ``LogUnavailable``: then every result buffered since the last flush is
        rejected (retire records stay buffered and are retried)."""

    @abc.abstractmethod
    def ack(self, ids: Iterable[int], now: float | None = None) -> int:
        """Retire pending results as delivered; returns how many were pending
        (idempotent: other ids count 0). ``now`` (wall time, default the
        clock's) is written in the record: when they were retired."""

    @abc.abstractmethod
    def discard(self, ids: Iterable[int], reason: str, now: float | None = None) -> int:
        """Retire pending results without delivery (retention, an operator);
        counted as discarded. Returns how many were pending."""

    @abc.abstractmethod
    def discard_expired(
        self, job: str, finished_before: float, reason: str = "retention", now: float | None = None
    ) -> int:
        """Discard the job's oldest pending results finished before the given
        time, in id order up to the first one that is not. Returns how many."""

    @abc.abstractmethod
    def expired(self, job: str, finished_before: float, limit: int | None = None) -> list[int]:
        """The ids ``discard_expired`` would discard (at most ``limit``),
        without discarding them: costs what it returns."""

    @abc.abstractmethod
    def pending(self, job: str | None = None, limit: int | None = None) -> list[Pending]:
        """Pending results in id order (of one job, or all); a snapshot."""

    @abc.abstractmethod
    def pending_count(self, job: str | None = None) -> int: ...

    @abc.abstractmethod
    def get_pending(self, result_id: int) -> Pending | None: ...

    @abc.abstractmethod
    def read_result(self, result_id: int) -> Result:
        """The pending result with its payload, read back from the log."""

    @abc.abstractmethod
    def compact(self, now: float | None = None) -> int:
        """Flush, then remove segments whose results are all retired (never the
        active one), leaving a lease summary of each one retired less than
        ``keep_retired_s`` before ``now``; drop the summaries older than that.
        Returns how many segments were removed."""

    @abc.abstractmethod
    def retired_leases(self, since: float) -> list[RetiredLease]:
        """The durable results retired at or after ``since`` (wall time),
        with the lease each answered, in id order (never one still pending)."""

    @abc.abstractmethod
    def counters(self) -> Counters: ...

    @abc.abstractmethod
    def close(self, flush: bool = True) -> None:
        """Flush what is buffered (unless ``flush`` is false: then the buffer
        is dropped, as a crash would) and release files. Idempotent."""

    def __enter__(self) -> CompletionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
