"""The claim path: take due keys from the ready set and lease them.

Shared by the HTTP workers (``POST /claim``) and ``node.local.LocalClaimer``
(inference processes on the host); see "A claim" in ``docs/internals.md``.
A claim costs the entries it takes (invariant 7): one fetch-add on the ready
set's cursor, one batched point read of the rows, one compare-and-swap grant
per key. Nothing here locks, and nothing waits on the keeper unless the
caller asks to (``wait_for_publish``).

Hazards:

- The ready set is up to a second old. Every entry is checked against its row
  (gone, version moved, not due yet) and the lease table (leased, held or
  parked since the publish) before it is granted; a skipped entry is simply
  consumed. So a stale set, or a stalled keeper, can cost grants, never grant
  what should not be.
- The cursor hands each entry of a set to one claimer. A claimer takes only
  as many entries as it still needs: an entry taken and not granted is gone
  from this set (the next publish offers it again), so over-taking would hide
  work from the other claimers for up to a second.
- Readiness: nothing is granted before the keeper's first publish since the
  node started (its set may be the last run's). Once ready, a node stays
  ready, so the check is made until it first passes and never again.
- The grant deadline (a fleet: docs/fleet.md): every take checks it, and a
  claim whose take finds it passed ends there (NotGranting, or the leases its
  earlier takes granted). The Python path checks it again after the take's
  row read and before its grants: on PostgreSQL that read is a round trip to
  the server through the row service, which a network fault can hold for
  seconds (``tcp_user_timeout``, 10 s), longer than the membership margin;
  a grant after the deadline could be a key another node owns by then. That
  read is also given up at the deadline (``RowsClient.get_many_until``): a
  claim held by a fault ends ``not_granting`` then, not at the read's 10 s
  timeout. On the C path the same: with a SQLite schedule it reads the file
  itself (no fleet node does) and grants microseconds after its take's
  check; on PostgreSQL it reads each run's rows through ``_read_rows`` (the
  row service's ``raw_rows``, given up at the deadline, the deadline
  checked again after it) and grants in C.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Protocol

from node.core.config import Config
from node.core.errors import NodeError, NodeRestarted, NotGranting, NotReady, StoreError
from node.core.log import warn
from node.core.rows import (
    JOBS_SEEN,
    MAX_CADENCE_S,
    MAX_DUE_AT,
    MIN_CADENCE_S,
    MIN_DUE_AT,
    Grant,
    Row,
    not_jobs,
)
from node.store.base import BadRow, ClaimSource
from node.store.values import PAYLOAD_DECODER, decode_payload
from shm.leases import (
    C_STOP,
    CONSUMER_BYTES,
    LeaseTable,
    Outcome,
    Refused,
    SlotTakenOver,
    owner_bits,
    truncated,
)
from shm.leases.test_stops import Stop
from shm.leases.test_stops import stop as test_stop
from shm.ready.take import not_granting
from shm.segment import SnapshotUnstable

_JOB = itemgetter(3)  # Grant.job

try:
    from shm import _claim  # type: ignore[attr-defined]  # C, built by setup.py
except ImportError:  # every claim takes the Python path
    _claim = None  # type: ignore[assignment]

# The claimer asks the keeper for the next set, published ahead, once fewer
# than this share of the active set is left and no next set is pending: at
# its first take. The next set leaves the active one's keys out, so asking
# early wastes nothing under load, and the keeper has the whole drain of the
# active set to write it (asking once a quarter was taken left the claimers
# waiting 0.18-0.32 s of their 2 x 0.5 s in the claim bench, against
# 0.12-0.29 s). Under a light load it costs one publish a second nobody may
# take from: the timer's fresh set replaces it.
LOW_WATER_FRACTION = 1.0


class ClaimRows(Protocol):
    """What a claim reads its rows through: a store (``node.store``), or on a
    PostgreSQL node the node's row service (``workers.rows.RowsClient``)."""

    def claim_source(self) -> ClaimSource | None: ...

    def get(self, key: str) -> Row | BadRow | None: ...

    def get_many(self, keys: list[str]) -> dict[str, Row | BadRow]: ...


@dataclass
class ClaimStats:
    """What this claimer did, for its process's shutdown line and /metrics."""

    claims: int = 0
    taken: int = 0  # ready entries taken through the cursor
    granted: int = 0
    gone: int = 0  # no row (deleted), or a row the keeper cannot schedule
    moved: int = 0  # the row's version differs from the entry's
    not_due: int = 0  # due_at > now: rescheduled since the publish
    refused: dict[str, int] = field(default_factory=dict)  # by Refuse reason
    drained: int = 0  # claims that found the set empty before max
    low_water: int = 0  # republish requests this claimer raised
    switches: int = 0  # to the next set, published ahead, when the active one drained
    not_granting: int = 0  # claims the grant deadline refused or cut short (a fleet)

    def as_dict(self) -> dict[str, Any]:
        return {
            "claims": self.claims,
            "taken": self.taken,
            "granted": self.granted,
            "gone": self.gone,
            "moved": self.moved,
            "not_due": self.not_due,
            "refused": dict(self.refused),
            "drained": self.drained,
            "low_water": self.low_water,
            "switches": self.switches,
            "not_granting": self.not_granting,
        }


# Bumped in every child of os.fork: a claim path (its SQLite connection)
# opened before a fork is never used after it.
_forks = [0]
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))

_warned_python_path = False


def _python_path(reason: str) -> None:
    """The SQLite store's claims take the Python path (several times slower a
    grant, the same answers): said once a process, with why."""
    global _warned_python_path
    if not _warned_python_path:
        _warned_python_path = True
        warn("claim_python_path", reason=reason)
    return None


# ClaimPath.claim's counters, in its order (shm/_claim_path.c, K_*).
_TAKEN, _GONE, _MOVED, _NOT_DUE, _LEASED, _HELD, _PARKED, _DRAINED = range(8)
_LOW_WATER, _LAST_COUNT, _LAST_LEFT, _RETRIES, _SWITCHES = range(8, 13)


def _always_ready() -> bool:
    return True


def _no_wake() -> None:
    return None


class Claimer:
    """Claims for one process. Not thread-safe: one per thread (the HTTP
    worker's event loop claims on its store thread, one claim at a time).

    ``wake`` posts the keeper's wake semaphore; ``is_ready`` says whether the
    keeper has published since the node started (None: always ready, for
    tests that publish by hand).

    Two paths, the same steps: on the SQLite store a whole claim is one call
    into C (``shm._claim.ClaimPath``: the take, the row reads and the grants),
    with its own connection to the schedule file; on PostgreSQL the same call,
    its rows handed in by the row service (``workers/rows``) through
    ``_read_rows``; elsewhere (the memory store, a build without the
    extension, ``c_path=False``) the Python path below. ``close()`` closes
    the C path; closing the ready set or the lease table does as well.
    """

    def __init__(
        self,
        config: Config,
        store: ClaimRows,
        ready: Any,
        leases: LeaseTable,
        wake: Callable[[], None] | None = None,
        is_ready: Callable[[], bool] | None = None,
        c_path: bool = True,
    ) -> None:
        self.config = config
        self.store = store
        self.ready = ready
        self.leases = leases
        self._wake = wake or _no_wake
        self._is_ready = is_ready or _always_ready
        self._ready_seen = is_ready is None
        # route -> its default cadence; rows carry their own or None.
        self._route_cadence: dict[str, float] = {}
        self.stats = ClaimStats()
        self._path: Any = None  # shm._claim.ClaimPath, opened at the first claim
        self._source: ClaimSource | None = None  # the store's, for the C path
        self._path_forks = -1  # _forks[0] when it was opened; -1: not tried
        self._c_path = c_path  # False: always the Python path (tests compare the two)
        self._holder: tuple[str, bytes] = ("", b"")  # the last consumer and its bytes

    def close(self) -> None:
        """Close the C path (its SQLite connection and its hold on the
        ready set's and lease table's mappings). Claims after it reopen it."""
        if self._path is not None:
            if self._path_forks == _forks[0]:
                self._path.close()
            else:
                self._path.abandon()  # the parent's connection: never closed here
            self._path = None
        self._path_forks = -1

    @property
    def on_c_path(self) -> bool:
        """Whether claims take the C path (opened on first use)."""
        return self._claim_path() is not None

    def _claim_path(self) -> Any:
        if self._path_forks != _forks[0]:
            if self._path is not None:
                self._path.abandon()  # opened before a fork: the parent's
            self._path_forks = _forks[0]
            self._path = self._open_path()
        return self._path

    def _open_path(self) -> Any:
        from shm.ready import ReadySet

        source = self.store.claim_source() if self._c_path else None
        given = self._c_path and source is None and hasattr(self.store, "raw_rows")
        if (source is None and not given) or not isinstance(self.ready, ReadySet) or (
            self.ready.segment.read_only
        ):
            return None  # not asked for, or a store it is not for
        if _claim is None:
            return _python_path("shm._claim is not built (pip install -e . builds it)")
        granter = self.leases.granter
        if granter is None:
            return _python_path("the lease table has no C grant")
        # Where its rows come from: handed in through the row service
        # (PostgreSQL: no file), or read from the SQLite file by the C path itself.
        rows: dict[str, Any] = {
            "sqlite_module": None,
            "db_path": None,
            "busy_timeout_ms": 0,
            "cache_kib": 0,
            "row_sql": None,
            "rows_sql": None,
            "decode_payload": decode_payload,
            "reader": self._read_rows,
        }
        if not given:
            assert source is not None
            try:
                import _sqlite3  # the module whose SQLite the C path must share
            except ImportError:
                return _python_path("this Python has no _sqlite3 module")
            rows = {
                "sqlite_module": getattr(_sqlite3, "__file__", None),
                "db_path": source.db_path,
                "busy_timeout_ms": source.busy_timeout_ms,
                "cache_kib": source.cache_kib,
                "row_sql": source.row_sql,
                "rows_sql": source.rows_sql,
                "decode_payload": source.decode_payload,
            }
        try:
            path = _claim.ClaimPath(
                ready=self.ready.segment.mm,
                capacity=self.ready.capacity,
                heap_size=self.ready.heap_size,
                low_water=LOW_WATER_FRACTION,
                granter=granter,
                limits=(MIN_CADENCE_S, MAX_CADENCE_S, MIN_DUE_AT, MAX_DUE_AT),
                grant_type=Grant,
                route_cadence=self._route_cadence,
                cadence_of=self._cadence_of,
                scan_once=PAYLOAD_DECODER.scan_once,  # type: ignore[attr-defined]
                **rows,
            )
        except (ImportError, BufferError, ValueError, _claim.RowError) as exc:
            return _python_path(f"{type(exc).__name__}: {exc}")  # the Python path serves
        self._source = source
        self.ready.on_close(self.close)
        self.leases.on_close(self.close)
        return path

    def _read_rows(self, keys: list[str]) -> list:
        """A run's rows for the C path, through the row service: given up at
        the grant deadline, and refused (NotGranting) once it has passed, as
        ``_grant_entries`` reads them."""
        until = self.ready.grant_until_ns
        try:
            rows = self.store.raw_rows(keys, until)  # type: ignore[attr-defined]
        except StoreError:
            self._refuse_past(until)  # a read cut short by the deadline: that is why
            raise
        self._refuse_past(until)
        return rows  # type: ignore[no-any-return]

    # -- claims ---------------------------------------------------------------------

    def ready_now(self) -> bool:
        """Whether claims are served (checked until it first passes)."""
        if not self._ready_seen:
            self._ready_seen = bool(self._is_ready())
        return self._ready_seen

    def claim(self, max_n: int, lease_s: float, consumer: str, now: float) -> list[Grant]:
        """Lease up to ``max_n`` due keys to ``consumer`` for ``lease_s``, most
        overdue first; fewer (or none) when the ready set runs out. Raises
        NotReady before the keeper's first publish since the node started,
        NotGranting once the grant deadline has passed (and nothing was
        granted before it).

        A row another program gave a job that is not a job name is not
        handed out: its result could be polled but never acked. Its lease is
        released with the reason (a miss: the row ends parked, as an item
        that always fails does) until the row is written with a job."""
        grants = self._claim(max_n, lease_s, consumer, now)
        if not grants or (
            grants[0][3] in JOBS_SEEN
            if len(grants) == 1
            else JOBS_SEEN.issuperset(map(_JOB, grants))
        ):
            return grants  # every job seen a job name before: the usual claim, one set lookup
        kept, want = self._without_bad_jobs(grants, now), max_n
        # The released rows took places of this claim, and fewer than asked
        # says the ready set ran out: claim those places again while it has more.
        while len(kept) < max_n and len(grants) == want:
            want = max_n - len(kept)
            try:
                grants = self._claim(want, lease_s, consumer, now)
            except NodeError:
                break  # the leases kept are live: hand them out
            kept += self._without_bad_jobs(grants, now)
        return kept

    def _without_bad_jobs(self, grants: list[Grant], now: float) -> list[Grant]:
        """``grants`` less those whose job is not a job name, released."""
        bad = not_jobs(set(map(_JOB, grants)))
        if not bad:
            return grants
        for grant in grants:
            if grant.job in bad:
                error = f"the row's job {grant.job!r} is not a job name: write the row with one"
                outcome = self.release(grant.key, grant.lease_id, now, error)
                warn("claim_bad_job", key=grant.key, job=repr(grant.job), outcome=outcome.value)
        return [grant for grant in grants if grant.job not in bad]

    def _claim(self, max_n: int, lease_s: float, consumer: str, now: float) -> list[Grant]:
        if not self.ready_now():
            raise NotReady("the keeper has not published since the node started")
        path = self._path if self._path_forks == _forks[0] else self._claim_path()
        if path is not None:
            return self._claim_c(path, max_n, lease_s, consumer, now)
        stats = self.stats
        stats.claims += 1
        grants: list[Grant] = []
        switches = self.ready.switches
        while len(grants) < max_n:
            want = max_n - len(grants)
            try:
                _generation, entries = self.ready.take(want)
            except NotGranting:
                stats.not_granting += 1
                if not grants:
                    raise
                break  # the leases granted before the deadline are live: hand them out
            self._check_low_water()
            if not entries:
                stats.drained += 1
                break
            stats.taken += len(entries)
            try:
                self._grant_entries(entries, lease_s, consumer, now, grants)
            except NotGranting:
                stats.not_granting += 1
                if not grants:
                    raise
                break  # the deadline passed during the read: the earlier leases are live
            except StoreError:
                if not grants:
                    raise
                break  # the leases granted before the failed read are live: hand them out
            # Fewer than asked: the set ran out under us. Take again: the
            # next set may be pending (the take switches to it), or the take
            # finds nothing and the claim ends.
        stats.switches += self.ready.switches - switches
        stats.granted += len(grants)
        return grants

    def _claim_c(
        self, path: Any, max_n: int, lease_s: float, consumer: str, now: float
    ) -> list[Grant]:
        stats = self.stats
        stats.claims += 1
        if self._holder[0] != consumer:
            self._holder = (consumer, truncated(consumer, CONSUMER_BYTES))
        try:
            grants, slow, k = path.claim(max_n, self._holder[1], lease_s, now, owner_bits(), C_STOP)
        except Exception as exc:  # noqa: BLE001 - every error hands back the live leases
            return self._claim_c_failed(exc, lease_s, consumer, now)
        self._count(k)
        if slow:
            self._grant_slow(slow, lease_s, consumer, now, grants)
        stats.granted += len(grants)
        return grants

    def _count(self, k: tuple[int, ...]) -> None:
        """A C claim's counters into the stats (and the keeper woken when it
        raised the low-water flag)."""
        stats = self.stats
        stats.taken += k[_TAKEN]
        stats.gone += k[_GONE]
        stats.moved += k[_MOVED]
        stats.not_due += k[_NOT_DUE]
        stats.drained += k[_DRAINED]
        for reason, n in (("leased", k[_LEASED]), ("held", k[_HELD]), ("parked", k[_PARKED])):
            if n:
                stats.refused[reason] = stats.refused.get(reason, 0) + n
        ready = self.ready
        ready.last_count, ready.last_left = k[_LAST_COUNT], k[_LAST_LEFT]
        ready.retries += k[_RETRIES]
        stats.switches += k[_SWITCHES]
        if k[_LOW_WATER]:
            stats.low_water += 1
            self._wake()

    def _claim_c_failed(
        self, exc: Exception, lease_s: float, consumer: str, now: float
    ) -> list[Grant]:
        """A C claim that ended in an error: the leases it granted before are
        live, so they are handed out (with the entries the C grant handed
        back, when the row service's read failed and the deadline still
        holds); with none, the node's error for it. Its counters count."""
        stats = self.stats
        counters = getattr(exc, "counters", None)
        if counters is not None:
            self._count(counters)
        grants = list(getattr(exc, "grants", None) or [])
        slow = getattr(exc, "slow", None)
        if isinstance(exc, NotGranting) or str(exc) == "not_granting":
            stats.not_granting += 1
        elif slow and isinstance(exc, StoreError):
            try:
                self._refuse_past(self.ready.grant_until_ns)
                self._grant_slow(slow, lease_s, consumer, now, grants)
            except NotGranting:
                stats.not_granting += 1
        stats.granted += len(grants)
        if grants:
            if not isinstance(exc, NodeError | _claim.RowError | RuntimeError):
                warn("claim_cut_short", granted=len(grants), error=repr(exc))
            return grants
        if isinstance(exc, _claim.RowError | RuntimeError):
            raise self._c_error(exc) from None
        raise exc

    def _c_error(self, exc: Exception) -> Exception:
        """The node's error for a C claim's failure that granted nothing."""
        if isinstance(exc, _claim.RowError):
            code, message = exc.args  # SQLite's result code and message
            assert self._source is not None  # opened with the path
            return self._source.error(code, message, "get_many")
        what = str(exc)
        if what == "unstable":
            return SnapshotUnstable(
                f"{self.ready.segment.name}: no consistent take; the keeper "
                f"(pid {self.ready.segment.writer_pid}) rewrites faster than it can be read"
            )
        if what == "not_granting":
            return not_granting(self.ready.grant_until_ns, time.monotonic_ns())
        if what == "busy":  # a claim from within a claim, or a second thread
            return RuntimeError("a claim of this Claimer is running: one at a time")
        if what == "sealed":
            return NodeRestarted(
                f"{self.leases.segment.name} is sealed: the node that owns it stopped "
                "granting from it; reattach to the running node's tables"
            )
        return SlotTakenOver(f"{self.leases.segment.name}: {exc}")

    def _grant_slow(
        self, slow: list[tuple], lease_s: float, consumer: str, now: float, grants: list[Grant]
    ) -> None:
        """The entries the C grant handed back (a slot mid-change, a long key,
        a full first pass): the Python grant, which knows every case."""
        decode = decode_payload if self._source is None else self._source.decode_payload
        for key, version, cadence_s, payload, job, due_at, route in slow:
            lease = self._grant(key, consumer, lease_s, now, cadence_s, version)
            if lease is None:
                continue
            grants.append(
                Grant(
                    lease.lease_id,
                    key,
                    decode(payload),
                    job,
                    due_at,
                    lease.expires_at,
                    route,
                    lease.misses,
                )
            )

    def _grant_entries(
        self,
        entries: list,
        lease_s: float,
        consumer: str,
        now: float,
        grants: list[Grant],
        stop: Stop | None = test_stop,
    ) -> None:
        """Grant the entries whose rows are still due at their published
        version. (``stop``: a test's stop between the read and the grant,
        shm/leases/test_stops.py's ``read``; None in production.)"""
        stats = self.stats
        until = self.ready.grant_until_ns
        read_until = getattr(self.store, "get_many_until", None) if until else None
        try:
            if read_until is not None:  # the row service: given up at the deadline
                rows = read_until([entry.key for entry in entries], until)
            elif len(entries) == 1:  # a point read costs a fifth less than get_many of one
                key = entries[0].key
                row = self.store.get(key)
                rows = {} if row is None else {key: row}
            else:
                rows = self.store.get_many([entry.key for entry in entries])
        except StoreError:
            self._refuse_past(until)  # a read cut short by the deadline: that is why
            raise
        # The read may have outlasted the grant deadline (module docstring):
        # the take's check is then stale, and these entries wait for the
        # next set of whichever node owns them.
        self._refuse_past(until)
        for entry in entries:
            row = rows.get(entry.key)
            if row is None or isinstance(row, BadRow):
                stats.gone += 1
                continue
            if row.version != entry.version:
                stats.moved += 1
                continue
            if row.due_at > now:
                stats.not_due += 1
                continue
            cadence_s = row.cadence_s or self._cadence_of(row.route)
            if stop is not None:
                stop("read")  # the read-to-grant window (docs/delivery.md)
            lease = self._grant(entry.key, consumer, lease_s, now, cadence_s, row.version)
            if lease is None:
                continue
            grants.append(
                Grant(
                    lease.lease_id,
                    entry.key,
                    row.payload,
                    row.job,
                    row.due_at,
                    lease.expires_at,
                    row.route,
                    lease.misses,
                )
            )

    def _refuse_past(self, until: int) -> None:
        """NotGranting when the grant deadline (``until``, as the take saw
        it, or a later one a heartbeat wrote meanwhile) has passed."""
        if until:
            until = self.ready.grant_until_ns
            now_ns = time.monotonic_ns()
            if until and now_ns >= until:
                raise not_granting(until, now_ns)

    def _grant(
        self, key: str, consumer: str, lease_s: float, now: float, cadence_s: float, version: int
    ) -> Any:
        """The lease table's grant; a refusal is counted by its reason and is None."""
        lease = self.leases.grant(key, consumer, lease_s, now, cadence_s, version=version)
        if isinstance(lease, Refused):
            reason = lease.reason.value
            self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
            return None
        return lease

    def _cadence_of(self, route: str) -> float:
        cadence_s = self._route_cadence.get(route)
        if cadence_s is None:
            cadence_s = self._route_cadence[route] = float(self.config.route(route).cadence_s)
        return cadence_s

    def _check_low_water(self) -> None:
        """Past the low-water mark: ask the keeper for the next set (once:
        the flag stays up until the keeper takes it, and is not raised
        while the next set is pending)."""
        ready = self.ready
        if ready.last_left < ready.last_count * LOW_WATER_FRACTION:
            if ready.request_publish():
                self.stats.low_water += 1
                self._wake()

    def wait_for_publish(self, after_generation: int, timeout_s: float | None) -> int:
        """Block until the keeper publishes a set newer than
        ``after_generation`` (for a claimer that found the set drained);
        returns the generation now."""
        return self.ready.wait_publish(after_generation, timeout_s)

    @property
    def generation(self) -> int:
        return self.ready.generation

    # -- the holder's side: straight to the lease table ------------------------------

    def renew(self, key: str, lease_id: int, lease_s: float, now: float) -> Outcome:
        """RENEWED (expires_at = now + lease_s), ENDED, SUPERSEDED, UNKNOWN or BUSY."""
        return self.leases.renew(key, lease_id, lease_s, now)

    def release(self, key: str, lease_id: int, now: float, error: str | None = None) -> Outcome:
        """RELEASED, ENDED, SUPERSEDED, UNKNOWN or BUSY."""
        return self.leases.release(key, lease_id, now, error)
