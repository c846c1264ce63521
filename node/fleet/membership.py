"""Fleet membership: the node list in PostgreSQL (docs/fleet.md).

Each node of a fleet has a row in ``fleet_nodes`` (node/fleet/queries.py):
its name, its address, its number (a small integer unique in the fleet, for
the high bits of its result ids), when it started, its last heartbeat and,
once it left cleanly, when. A node is *live* while its last heartbeat is
younger than ``membership_timeout_s`` by the DATABASE's clock: hosts' clocks
differ, so no host's clock judges another's heartbeat. Each host's offset
from the database's clock is measured at every heartbeat (``Skew``) and
flagged beyond ``MAX_SKEW_S``.

The grant deadline rides on the heartbeat: the local monotonic time read
before the heartbeat is sent, plus the membership timeout less a margin
(``GRANT_MARGIN_FRACTION``, node/core/fleet.py), is the moment from which this node grants
nothing (node/fleet/heartbeat.py writes it into the ready set). The database
stamps the heartbeat no earlier than it was sent, so the node's membership
cannot lapse before ``sent + membership_timeout_s``: the node stops granting
a margin before another node can take its rows.

Time is passed in: ``clock`` (wall seconds) and ``monotonic_ns`` default to
the ``time`` module's, and tests give an offset clock. One connection per
``Membership``, in autocommit (each statement its own transaction, so
``now()`` is the moment the statement began); it is never used across a
fork (a child opens its own).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from node.core.errors import NodeError, StoreError, StoreUnavailable
from node.core.fleet import GRANT_MARGIN_FRACTION
from node.core.log import warn
from node.core.urls import redact_url
from node.fleet import queries as q
from node.fleet.dialer import Dialer

# A host whose wall clock is further than this from the database's is
# flagged (its heartbeats still count: only the database's clock judges).
MAX_SKEW_S = 1.0
# A skew that lasts is logged again this often (not at every heartbeat).
SKEW_LOG_EVERY_S = 60.0
# How long a node that names peers waits to see one live before it
# publishes (issue 18: up to 2 minutes); then it goes on alone, with a warning.
PEER_WAIT_S = 120.0


class FleetError(StoreError):
    """Membership cannot be written or read as asked."""


class NotAMember(FleetError):
    """This node has no live row to heartbeat: it left, or its row was
    forgotten. Join again."""


class FleetFull(FleetError):
    """Every number from 1 to ``queries.MAX_NUMBER`` is held by a row."""


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise NodeError("a fleet needs psycopg 3: pip install 'psycopg[binary]>=3.2'") from None
    return psycopg


@dataclass(frozen=True, slots=True)
class Member:
    """One row of the node list; times are unix seconds by the database's clock."""

    name: str
    address: str
    number: int
    started_at: float
    heartbeat_at: float


@dataclass(frozen=True, slots=True)
class LiveList:
    """The live nodes, by name, as the database judged them at ``db_now``."""

    members: tuple[Member, ...]
    db_now: float

    @property
    def names(self) -> tuple[str, ...]:
        """What ``keeper.owners.Ownership(live.names, me)`` takes."""
        return tuple(m.name for m in self.members)

    def __contains__(self, name: object) -> bool:
        return any(m.name == name for m in self.members)


@dataclass(frozen=True, slots=True)
class Absent:
    """A node on the list that is not live: it ``left`` (a clean leave, at
    ``left_at``) or lapsed (its last heartbeat older than the membership
    timeout: killed, stopped, cut off). Its row keeps its number until it is
    forgotten (``Membership.forget``)."""

    member: Member
    left_at: float | None

    @property
    def left(self) -> bool:
        return self.left_at is not None


@dataclass(frozen=True, slots=True)
class Skew:
    """The database's clock minus this host's wall clock, taken at the
    middle of one round trip; ``error_s`` is half the round trip (the
    figure is good to that)."""

    skew_s: float
    error_s: float
    bound_s: float = MAX_SKEW_S

    @property
    def flagged(self) -> bool:
        """Beyond the bound even allowing for the round trip."""
        return abs(self.skew_s) - self.error_s > self.bound_s


@dataclass(frozen=True, slots=True)
class Beat:
    """One heartbeat: the database's clock then, the local monotonic time
    read before it was sent, the grant deadline it earns, the clock skew it
    measured, and whether the node had dropped out of the live list before
    it (a heartbeat older than the timeout: its rows may have moved)."""

    db_now: float
    sent_ns: int
    grant_until_ns: int
    skew: Skew
    lapsed: bool


def peers_seen(live: LiveList, me: str, peers: Iterable[str]) -> bool:
    """Whether a live node other than ``me`` is one of ``peers`` (by name or
    by address)."""
    wanted = set(peers)
    return any(m.name != me and (m.name in wanted or m.address in wanted) for m in live.members)


class Membership:
    """This node's membership: ``join``, ``heartbeat``, ``live``, ``leave``."""

    def __init__(
        self,
        conninfo: str,
        name: str,
        address: str,
        membership_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        connect_timeout_s: int = 10,
        statement_timeout_s: float | None = None,
        reconnect_in_background: bool = False,
    ) -> None:
        """``statement_timeout_s``: every statement (lock waits included)
        and every unacknowledged send on the connection fails past it
        (``statement_timeout``, ``tcp_user_timeout``): a caller that must
        not block long, the keeper's loop, sets it. ``connect_timeout_s``:
        libpq's, 2 s at the least. ``reconnect_in_background``: after the
        first connection, a lost one is replaced by dials on threads of
        their own (node/fleet/dialer.py): a call meanwhile fails at once
        (StoreUnavailable) instead of waiting on a connect."""
        self.conninfo = conninfo
        self.connect_timeout_s = max(2, int(connect_timeout_s))
        self.statement_timeout_s = statement_timeout_s
        self.name = name
        self.address = address
        self.membership_timeout_s = float(membership_timeout_s)
        self.clock = clock
        self.monotonic_ns = monotonic_ns
        self.number: int | None = None  # once joined
        self._conn: Any = None
        self._conn_pid = 0
        self._dialer: Dialer | None = None
        if reconnect_in_background:
            self._dialer = Dialer(self._open, name=f"fleet-dial {name}")
        self._connected_once = False
        # The skew warning: when it starts, then at most every SKEW_LOG_EVERY_S
        # while it lasts, and when it ends (a heartbeat runs 1 to 5 times a second).
        self._skew_logged_ns: int | None = None

    @property
    def grant_window_ns(self) -> int:
        """From a heartbeat's sending to the grant deadline it earns."""
        return int(self.membership_timeout_s * (1 - GRANT_MARGIN_FRACTION) * 1e9)

    # -- the connection ------------------------------------------------------------

    def _open(self) -> Any:
        """A new connection, bounded as ``__init__`` says (psycopg's errors
        raised as they come)."""
        psycopg = _psycopg()
        bounds: dict[str, Any] = {}
        if self.statement_timeout_s is not None:
            ms = max(1, int(self.statement_timeout_s * 1000))
            bounds = {"options": f"-c statement_timeout={ms}", "tcp_user_timeout": ms}
        return psycopg.connect(
            self.conninfo, autocommit=True, connect_timeout=self.connect_timeout_s, **bounds
        )

    def _connection(self) -> Any:
        if self._conn is not None and (self._conn_pid != os.getpid() or self._conn.closed):
            self._conn = None  # a parent's (never closed here) or a broken one
        if self._conn is None and self._dialer is not None and self._connected_once:
            conn = self._dialer.take()
            if conn is None:
                why = self._dialer.last_error or "no answer yet"
                raise StoreUnavailable(f"the fleet's database: reconnecting ({why})")
            self._conn, self._conn_pid = conn, os.getpid()
        if self._conn is None:
            psycopg = _psycopg()
            try:
                self._conn = self._open()
            except psycopg.Error as exc:
                raise StoreUnavailable(f"the fleet's database cannot be reached: {exc}") from exc
            self._conn_pid = os.getpid()
            self._connected_once = True
        return self._conn

    def _run(self, what: str, steps: Callable[[Any], Any]) -> Any:
        """``steps(connection)``, psycopg's errors wrapped once, here."""
        psycopg = _psycopg()
        try:
            return steps(self._connection())
        except psycopg.OperationalError as exc:
            self._drop()
            raise StoreUnavailable(f"fleet {what}: the database failed: {exc}") from exc
        except psycopg.Error as exc:
            raise FleetError(f"fleet {what}: {exc}") from exc

    def connect(self) -> None:
        """Open the connection now (otherwise the first call does)."""
        self._run("connect", lambda conn: None)

    def _drop(self) -> None:
        """Close the connection (a failed one); the next call opens another."""
        if self._conn is not None and self._conn_pid == os.getpid():
            self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._drop()
        if self._dialer is not None:
            self._dialer.close()

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- membership ----------------------------------------------------------------

    def ensure_schema(self) -> None:
        """Bring the database to the PostgreSQL store's schema, the node
        list included (its versioned migrations, node/store/postgres.py:
        idempotent, and safe when several nodes start at once)."""
        from node.store.postgres import migrate

        self._run("schema", lambda conn: migrate(conn, redact_url(self.conninfo)))

    def join(self) -> Member:
        """Join the fleet: revive this name's row (keeping its number) or
        insert one with the lowest free number; the schema is migrated first
        if it is behind. Under the fleet's advisory lock, so nodes joining at
        once get distinct numbers."""
        params = {"name": self.name, "address": self.address, "lock": q.FLEET_LOCK_KEY}

        def steps(conn: Any) -> tuple[int, float]:
            with conn.transaction():
                conn.execute(q.LOCK, params)
                row = conn.execute(q.REVIVE, params).fetchone()
                if row is None:
                    (number,) = conn.execute(q.LOWEST_FREE).fetchone()
                    if number is None:
                        raise FleetFull(
                            f"every node number 1 to {q.MAX_NUMBER} is held; forget nodes "
                            "that left (Membership.forget) to free theirs"
                        )
                    row = conn.execute(q.INSERT, {**params, "number": number}).fetchone()
            return row

        self.ensure_schema()
        number, started_at = self._run("join", steps)
        self.number = number
        return Member(self.name, self.address, number, started_at, started_at)

    def heartbeat(self, applied_seq: int | None = None) -> Beat:
        """One heartbeat (one UPDATE, answered with the database's clock).
        The grant deadline it earns counts from the monotonic time read
        before it was sent. ``applied_seq``: the change-log position this
        node's keeper would resume from (None leaves the last one). NotAMember
        when this node has no live row."""
        sent_ns = self.monotonic_ns()
        wall_before = self.clock()
        params = {"name": self.name, "applied_seq": applied_seq}
        row = self._run("heartbeat", lambda conn: conn.execute(q.HEARTBEAT, params).fetchone())
        wall_after = self.clock()
        if row is None:
            raise NotAMember(f"node {self.name!r} has no live row in the fleet: join again")
        db_now, before = row
        skew = Skew(db_now - (wall_before + wall_after) / 2, (wall_after - wall_before) / 2)
        self._log_skew(skew)
        return Beat(
            db_now=db_now,
            sent_ns=sent_ns,
            grant_until_ns=sent_ns + self.grant_window_ns,
            skew=skew,
            lapsed=db_now - before >= self.membership_timeout_s,
        )

    def _log_skew(self, skew: Skew) -> None:
        now_ns = self.monotonic_ns()
        if skew.flagged:
            last = self._skew_logged_ns
            if last is None or now_ns - last >= SKEW_LOG_EVERY_S * 1e9:
                warn("fleet_clock_skew", node=self.name, skew_s=round(skew.skew_s, 3),
                     note="the database's clock judges membership; logged again in "
                     f"{SKEW_LOG_EVERY_S:g} s while it lasts")  # fmt: skip
                self._skew_logged_ns = now_ns
        elif self._skew_logged_ns is not None:
            self._skew_logged_ns = None
            warn("fleet_clock_skew_ended", node=self.name, skew_s=round(skew.skew_s, 3))

    def live(self) -> LiveList:
        """The live nodes: heartbeat younger than the membership timeout by
        the database's clock, and not left."""
        params = {"timeout_s": self.membership_timeout_s}
        rows = self._run("live list", lambda conn: conn.execute(q.LIVE, params).fetchall())
        if not rows:
            return LiveList((), self._run("clock", lambda c: c.execute(q.NOW).fetchone()[0]))
        members = tuple(Member(*row[:5]) for row in rows)
        return LiveList(members, rows[0][5])

    def listing(self) -> tuple[LiveList, tuple[Absent, ...]]:
        """The whole node list in one read: the live nodes (as ``live``
        judges them) and the others, those that left or lapsed, by name."""
        params = {"timeout_s": self.membership_timeout_s}
        rows = self._run("node list", lambda conn: conn.execute(q.LISTING, params).fetchall())
        if not rows:
            return LiveList((), self._run("clock", lambda c: c.execute(q.NOW).fetchone()[0])), ()
        live = tuple(Member(*row[:5]) for row in rows if row[6])
        absent = tuple(Absent(Member(*row[:5]), row[7]) for row in rows if not row[6])
        return LiveList(live, rows[0][5]), absent

    def nodes(self) -> list[tuple[Member, bool]]:
        """Every node on the list with whether it is live now (by the
        database's clock), by number; times are not read (zero)."""
        params = {"timeout_s": self.membership_timeout_s}
        rows = self._run("node list", lambda conn: conn.execute(q.NODES, params).fetchall())
        return [(Member(name, address, number, 0.0, 0.0), bool(live))
                for name, address, number, live in rows]  # fmt: skip

    def trim_through(self, hold_s: float = 0.0) -> int:
        """The highest seq the shared change log may be trimmed through: the
        lowest position a live node reported, or a node that left or dropped
        out of the list less than ``hold_s`` after its last heartbeat (so
        that it replays its rows' changes when it comes back); 0 (keep it
        all) while such a node has reported none, or none is live."""
        params = {"timeout_s": self.membership_timeout_s, "hold_s": hold_s}
        low, unreported = self._run(
            "trim position", lambda conn: conn.execute(q.TRIM_THROUGH, params).fetchone()
        )
        return 0 if low is None or unreported else int(low)

    def trimmed_through(self) -> int:
        """The highest seq a trim of the shared change log has removed."""
        return int(self._run("trimmed", lambda conn: conn.execute(q.TRIMMED).fetchone()[0]))

    def leave(self) -> bool:
        """Leave at once (a clean shutdown): the other nodes stop counting
        this one now, not after the timeout. Stop granting first (the
        heartbeat's ``leave`` does). False when it was not a member."""
        row = self._run("leave", lambda conn: conn.execute(q.LEAVE, {"name": self.name}).fetchone())
        return row is not None

    def forget(self, name: str) -> bool:
        """Delete the row of a node that is no member (left, or silent past
        the timeout), freeing its number. Only once its results are
        delivered: their ids carry that number."""
        params = {"name": name, "timeout_s": self.membership_timeout_s}
        row = self._run("forget", lambda conn: conn.execute(q.FORGET, params).fetchone())
        return row is not None

    def wait_for_peers(
        self, peers: Iterable[str], timeout_s: float = PEER_WAIT_S, poll_s: float = 0.5
    ) -> tuple[LiveList, bool]:
        """Poll the live list until a node named in ``peers`` is live or
        ``timeout_s`` passes: (the live list, whether a peer was seen). A
        node with no peers does not wait."""
        wanted = tuple(peers)
        deadline = self.monotonic_ns() + int(timeout_s * 1e9)
        while True:
            live = self.live()
            if not wanted or peers_seen(live, self.name, wanted):
                return live, True
            if self.monotonic_ns() >= deadline:
                warn("fleet_no_peer", node=self.name, peers=list(wanted), waited_s=timeout_s)
                return live, False
            time.sleep(poll_s)  # a polling interval towards a deadline
