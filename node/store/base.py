"""The durable store's interface: the schedule table and its change log.

Three implementations sit behind it: ``memory`` (the in-memory twin for unit
tests), ``sqlite`` (the embedded default) and, with the fleet, PostgreSQL.
Every implementation must pass ``tests/integration/test_store.py`` unchanged.

Rules every backend keeps:

- ``version`` is assigned by the store (triggers in SQL), never by a writer.
  A row's version is the ``seq`` of the change-log entry its last write made,
  so versions grow across the whole table and "newer" is a comparison.
- Every insert, update and delete appends one change-log entry carrying the
  op, the key, the origin and the scheduling fields (route, cadence_s,
  sitemap, due_at) so the keeper can apply it without reading the row.
- A store object belongs to the process that opened it. ``check_fork()``
  reopens the connection in a child; nothing crosses a fork.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from node.core.errors import StoreError
from node.core.rows import ORIGIN_NODE, Change, Row, RowWrite


class WriteBack(NamedTuple):
    """One completion's write-back: the row's next due time, under the
    version guard (``if_version``, the version the lease was granted on),
    with the outcome of its lease: the result's id in the completion log and
    its finish time."""

    key: str
    due_at: float
    if_version: int
    result_id: int
    finished_at: float


class DueChange(NamedTuple):
    """One change-log entry as ``Store.due_history`` gives it."""

    seq: int
    op: str
    key: str
    origin: str
    due_at: float | None  # None for a delete
    old_due_at: float | None  # the due time it replaced; None for an insert, or not kept
    at: float


def due_or_none(value: Any) -> float | None:
    """A stored due time as ``DueChange`` carries it: a number in the range
    a row may have (0 to the year 3000), else None (absent, or not valid)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value <= 32503680000.0 else None


def due_now_query(
    route: str | None, job: str | None, by_route: str, by_job: str
) -> tuple[str, str]:
    """``Store.due_now``'s statement and its value: ``by_route`` with the
    route, or ``by_job`` with the job; exactly one of the two is given."""
    if (route is None) == (job is None):
        raise ValueError("due_now takes a route or a job, exactly one")
    return (by_route, route) if route is not None else (by_job, job)  # type: ignore[return-value]


class LastError(NamedTuple):
    """A lease that ended without a result (released, expired, parked): the
    row's ``last_error``, as of ``at``."""

    key: str
    error: str
    at: float


@dataclass(frozen=True)
class ClaimSource:
    """How the claim path in C (``shm._claim.ClaimPath``) reads a store's
    rows itself, on a SQLite connection of its own: the file, the
    connection's settings, the two statements it runs (``row_sql`` for one
    key, ``rows_sql`` for a run of keys), how a stored payload is decoded,
    and ``error(code, message, action)``: a SQLite failure in C (its result
    code and message) as the store's own error, the one the store raises for
    the same failure."""

    db_path: str
    busy_timeout_ms: int
    cache_kib: int
    row_sql: str
    rows_sql: str
    decode_payload: Callable[[Any], Any]
    error: Callable[[int | None, str, str], StoreError]


class Store(abc.ABC):
    """The schedule table plus its change log."""

    url: str

    # -- writes --------------------------------------------------------------

    @abc.abstractmethod
    def upsert(self, rows: Sequence[RowWrite], *, now: float, origin: str = ORIGIN_NODE) -> int:
        """Insert or update rows in one transaction; returns how many.

        On insert, missing fields take their defaults (``due_at`` = ``now``);
        on update only the fields the write carries change. Later writes of
        the same key in one batch win."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[str], *, origin: str = ORIGIN_NODE) -> int:
        """Delete rows by key in one transaction; returns how many existed."""

    @abc.abstractmethod
    def write_next_due(self, key: str, due_at: float, *, if_version: int) -> int | None:
        """Set a row's next due time unless the row moved on.

        Writes only when the row still has version ``if_version``; returns
        the row's new version, or None when the row is gone or a newer write
        arrived (which then always wins). Logged with origin ``writeback``."""

    @abc.abstractmethod
    def write_back_many(self, items: Sequence[WriteBack]) -> list[int | None]:
        """A group of completions' write-backs in one transaction.

        Each item, in order, as ``write_next_due`` writes one (the version
        guard, logged with origin ``writeback``), and the outcome columns
        with it: ``last_result_id``, ``last_finished_at`` set, ``last_error``
        cleared. Returns per item the row's new version, or None when the
        row is gone or moved on (the newer write wins; nothing of that item
        is written). A failure writes nothing of the batch (StoreError)."""

    @abc.abstractmethod
    def due_now(
        self, *, route: str | None = None, job: str | None = None, now: float,
        origin: str = ORIGIN_NODE,
    ) -> int:  # fmt: skip
        """An operator's "run again now": every row of ``route`` or of
        ``job`` (exactly one given) due by ``now``, in one transaction;
        returns how many rows it wrote. A row not yet due becomes due at
        ``now``; a row already due keeps its due time (its lateness and
        rank). Every row is written all the same, logged with ``origin``
        and given a new version, so the write-back of a lease granted before
        loses to it and the row runs again (docs/fleet.md, "Run again now")."""

    @abc.abstractmethod
    def write_last_errors(self, items: Sequence[LastError]) -> int:
        """Set ``last_error`` of rows whose lease ended without a result, in
        one transaction; returns how many rows took it. Not a change: no log
        entry, no new version. A row whose last result finished after the
        item's ``at`` keeps its outcome (an older miss never overwrites a
        newer result)."""

    # -- reads ---------------------------------------------------------------

    @abc.abstractmethod
    def get(self, key: str) -> Row | BadRow | None:
        """Point read by key. A row whose stored values are not schedulable
        (written by another program) comes back as a ``BadRow``."""

    @abc.abstractmethod
    def get_many(self, keys: Iterable[str]) -> dict[str, Row | BadRow]:
        """Batched point read; keys with no row are absent from the answer,
        unschedulable rows come back as ``BadRow`` (as ``get``)."""

    def sync(self) -> None:
        """Make every write committed so far durable, whatever the
        connection's own sync setting (raises ``OSError``). The default is a
        store with nothing to sync."""
        return None

    def wal_bytes(self) -> int:
        """How much the store's write-ahead log holds that a checkpoint
        would copy home (0: a store without one)."""
        return 0

    def checkpoint_wal(self) -> None:
        """Copy the write-ahead log's commits home, waiting for no reader or
        writer; safe to call on a thread of its own (a store without a
        write-ahead log has nothing to do)."""
        return None

    def jobs_of(self, keys: Iterable[str]) -> dict[str, tuple[str, float | None, str]]:
        """What a completion needs of each row, (job, cadence_s, route) by
        key, for schedulable rows only: a key with no row, or a ``BadRow``,
        is absent. A store may read only these columns (the ledger asks it
        for every group it commits)."""
        return {
            key: (row.job, row.cadence_s, row.route)
            for key, row in self.get_many(keys).items()
            if isinstance(row, Row)
        }

    @abc.abstractmethod
    def walk(self, after: str | None, limit: int) -> list[Row | BadRow]:
        """Up to ``limit`` rows in key order with key > ``after`` (all keys
        when None). A row whose stored values are not schedulable comes back
        as a ``BadRow`` so the walk can count it and go on."""

    def walk_schedule(
        self, after: str | None, limit: int
    ) -> tuple[list[tuple], list[BadRow], str | None]:
        """The keeper's load walk: like ``walk`` but only the scheduling
        fields, as plain tuples ``(key, version, route, cadence_s, sitemap,
        due_at)``, with unschedulable rows apart. Returns ``(rows, bad,
        last_key)``; ``last_key`` is None when the walk is done (fewer than
        ``limit`` rows came back) — otherwise pass it as ``after``.

        Backends override this for speed; this default is built on walk()."""
        found = self.walk(after, limit)
        rows = [
            (r.key, r.version, r.route, r.cadence_s, r.sitemap, r.due_at)
            for r in found
            if not isinstance(r, BadRow)
        ]
        bad = [r for r in found if isinstance(r, BadRow)]
        return rows, bad, (found[-1].key if len(found) >= limit else None)

    def classes_in_use(self, limit: int | None = None) -> list[tuple[str, int | None, bool]]:
        """The classes of the schedulable rows, as rows carry them:
        ``(route, cadence_s or None, sitemap)`` (shm/classes.py), the class
        of the oldest row (lowest version) first; with ``limit``, in that
        order only when there are more than ``limit`` (a store may skip the
        ordering otherwise). Backends override this for speed; this default
        walks the table."""
        oldest: dict[tuple[str, int | None, bool], int] = {}
        after: str | None = None
        while True:
            rows, _bad, after = self.walk_schedule(after, 10_000)
            for r in rows:
                triple = (r[2], r[3], bool(r[4]))
                oldest[triple] = min(oldest.get(triple, r[1]), r[1])
            if after is None:
                return sorted(oldest, key=oldest.__getitem__)

    @abc.abstractmethod
    def count(self) -> int:
        """Rows in the table."""

    # -- change log ----------------------------------------------------------

    @abc.abstractmethod
    def changes(self, after_seq: int, limit: int) -> list[Change]:
        """Change-log entries with seq > ``after_seq``, in seq order."""

    @abc.abstractmethod
    def last_seq(self) -> int:
        """The highest seq ever assigned (0 when none); stays put after a trim."""

    def top_seq(self) -> int:
        """The highest seq assigned, without waiting for it to settle (a
        store whose seqs commit in order: ``last_seq``)."""
        return self.last_seq()

    @abc.abstractmethod
    def trim_changes(self, through_seq: int) -> int:
        """Drop consumed change-log entries with seq <= ``through_seq``."""

    @abc.abstractmethod
    def due_history(self, after_seq: int, through_seq: int, limit: int) -> list[DueChange]:
        """The change log's entries with ``after_seq < seq <= through_seq``,
        in seq order, at most ``limit``: each change's due time and the due
        time it replaced (None for an insert, and for a change logged before
        the store kept it). What a keeper replays at its start to count the
        input side of the books its predecessor had not saved."""

    def skip_is_loss(self, after_seq: int, first_seq: int) -> bool:
        """Whether a read after ``after_seq`` that began at ``first_seq``
        (not ``after_seq + 1``) may have lost changes (a trim took them before
        they were read), rather than passed seqs no change will ever carry.
        Here every skip is a loss: seqs are gapless (SQLite's AUTOINCREMENT
        under one writer, a rollback taking its seq back)."""
        return True

    def first_seq_after(self, after_seq: int) -> int | None:
        """The lowest seq above ``after_seq`` still in the change log, or
        None: with ``last_seq``, whether the log still holds every change
        after ``after_seq`` (the keeper's check after a store error)."""
        found = self.changes(after_seq, 1)
        return found[0].seq if found else None

    def holes_pending(self) -> bool:
        """True while ``changes`` may hand out more than it did at its last
        read without a new commit: it stopped at a seq whose transaction
        may still roll back, which no notification announces (PostgreSQL,
        node/store/postgres_feed.py). A keeper woken by NOTIFY polls while
        this holds. False on a store that hands out whatever is visible."""
        return False

    # -- node metadata (paused routes, lifetime counters, …) ------------------

    @abc.abstractmethod
    def get_meta(self, name: str, default: Any = None) -> Any:
        """A JSON value stored under ``name``."""

    @abc.abstractmethod
    def set_meta(self, name: str, value: Any) -> None:
        """Store a JSON value under ``name``."""

    def meta_of_every_node(self, name: str) -> dict[str, Any]:
        """``name``'s value for every node that stored one, by node name: a
        fleet's store keeps a node's meta apart from its peers'; a store of
        one node has only its own (under the empty name: it has no other)."""
        value = self.get_meta(name)
        return {} if value is None else {"": value}

    # -- the claim path --------------------------------------------------------

    def claim_source(self) -> ClaimSource | None:
        """What the claim path in C needs to read this store's rows, or None
        when it cannot (the claims then take the Python path, through
        ``get`` and ``get_many``)."""
        return None

    # -- lifecycle -----------------------------------------------------------

    def check_fork(self) -> None:  # noqa: B027 - a no-op unless a backend holds a connection
        """Reopen connections if this object was created in another process."""

    # A keeper reopens a store that says so on a thread of its own (one over
    # the network: keeper/outage.py); a file's reopen is quick, on its loop.
    reopen_off_loop = False

    def replaced(self) -> str | None:
        """Why the store at this object's address is no longer the one it
        reads (a file gone or replaced), or None; None where that cannot happen."""
        return None

    def identity(self) -> Any:
        """What tells this store's file from another put under its name
        (None where there is no file)."""
        return None

    def reopen(self) -> Store:
        """A new connection to the same address that never creates the
        store (StoreUnavailable while it cannot be opened)."""
        return self

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection. Idempotent."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BadRow:
    """A row whose stored values the keeper cannot schedule (a bad cadence or
    due time written by another program). Carries the key and version so the
    walk can still tell an old row from a newer event."""

    __slots__ = ("key", "version", "reason")

    def __init__(self, key: str, version: int, reason: str) -> None:
        self.key = key
        self.version = version
        self.reason = reason

    def __repr__(self) -> str:
        return f"BadRow({self.key!r}, version={self.version}, reason={self.reason!r})"
