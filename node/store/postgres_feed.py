"""The PostgreSQL change feed's two hazards: seqs that commit out of order,
and waking the keeper without polling.

**Out of order.** A sequence hands out numbers when they are asked for, not
when their transactions commit: A takes seq 5 and is still open when B takes
6 and commits. A reader that tails by ``seq > after`` sees 6, moves its
position past 5, and never sees A's change when A commits. SQLite has no such
window (one writer at a time).

The known remedy reads by the transaction snapshot (PgQ batches events
between two ticks' snapshots; a transactional outbox reads only below
``pg_snapshot_xmin(pg_current_snapshot())``). The feed's position here is a
seq (the keeper's ``feed_seq``, and a row's version is the seq of its last
change), so the rule is put in terms of holes: the reader hands out changes
in seq order and stops at the first *hole* (a seq missing between the
position and a visible change) unless the hole is *settled*, known to be a
seq that will never appear (its transaction rolled back, or a trim took it).

Settling a hole, exactly: every trigger makes sure its transaction has an xid
before it takes a seq (``queue_node_take_seq``). A hole ``g`` below a visible
change ``b`` was taken before ``b``, and ``b`` committed before the read that
saw it; so the xid of ``g``'s writer is older than an xid ``R`` assigned after
that read (``TAKE_XID``). Once a later snapshot's xmin is at least ``R``, no
transaction older than ``R`` is running (R's own has ended, so the snapshot's
xmax is above it and every running xid below R would hold xmin down): ``g``'s
writer has committed (its change is visible in that snapshot) or rolled back
(the hole is final). ``Horizon`` keeps the pending ``(through_seq, R)``
pairs; a read settles those whose R its own snapshot's xmin has passed.

The cost falls where the hazard is: a read with no hole hands out everything
at once, an xid is spent only when a hole is first seen, and a hole waits for
the writers that were running when it was seen (milliseconds, unless a long
transaction is open: an import's transaction holds back the feed above its
first seq until it commits, which is the point).

**NOTIFY.** A statement-level trigger notifies ``CHANNEL`` (postgres_schema);
``Listener`` holds one connection that LISTENs, outside the pool, and
``wait`` returns when a notification arrives or the timeout passes.
``ListenThread`` is the keeper's: a thread with a LISTEN connection of its
own that calls back on each notification, reconnects with backoff, and says
whether it is listening now (the keeper polls fast while it is not).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

# The listening thread: how long one wait for a notification lasts (and so
# how soon the thread sees that it is asked to stop), how long the
# connection may stay quiet before a ping checks it (a connection that died
# without a word would otherwise look like a quiet database), and the
# reconnect backoff after a failure: the first retry this soon, doubling up
# to the cap. Connecting is bounded by libpq's least connect_timeout, and a
# silent peer by TCP_USER_TIMEOUT.
LISTEN_WAIT_S = 0.5
LISTEN_PING_S = 5.0
LISTEN_RETRY_FIRST_S = 0.1
LISTEN_RETRY_MAX_S = 2.0
LISTEN_CONNECT_TIMEOUT_S = 2
# Under a stream of commits, wakes are passed on at most this often: each
# wakes the keeper for a tick, a feed read and its fixed costs, and one a
# statement (hundreds a second at the fleet's write rate) cost the keeper
# more CPU per change than the 20 ms poll did, past what a loaded host had
# (docs/postgres.md, "Figures"). A notification after a quiet spell is
# passed on at once; one within the gap waits for its end, with every other
# that came meanwhile.
LISTEN_MIN_GAP_S = 0.01
LISTEN_TCP_USER_TIMEOUT_MS = 5_000

# Pending settlements kept at most: when the oldest writer stays open, each
# read that sees a new hole adds one; dropping the oldest only delays.
MAX_PENDING = 16


class Horizon:
    """What one reader knows about the holes in the change log's seqs."""

    __slots__ = ("settled_through", "pending")

    def __init__(self) -> None:
        # Every seq <= settled_through that is not in the log never will be.
        self.settled_through = 0
        # (through_seq, xid): holes <= through_seq settle once xmin >= xid.
        self.pending: list[tuple[int, int]] = []

    def settle(self, xmin: int) -> None:
        """Apply a snapshot's xmin: the pending pairs it has passed settle."""
        keep = []
        for through, xid in self.pending:
            if xmin >= xid:
                self.settled_through = max(self.settled_through, through)
            else:
                keep.append((through, xid))
        self.pending = keep

    def passable(self, after_seq: int, seqs: list[int], trimmed_through: int) -> int:
        """How many of ``seqs`` (visible, ascending, all above ``after_seq``)
        may be handed out: up to the first one with an unsettled hole before
        it. Holes at or below ``trimmed_through`` were trimmed."""
        settled = max(self.settled_through, trimmed_through)
        expected = after_seq + 1
        for n, seq in enumerate(seqs):
            if seq != expected and seq - 1 > settled:
                return n
            expected = seq + 1
        return len(seqs)

    def needs_settling(self, hole: int) -> bool:
        """Whether no pending pair covers ``hole`` yet (so a new one is due)."""
        return not any(through >= hole for through, _xid in self.pending)

    def wait_on(self, through_seq: int, xid: int) -> None:
        """Holes up to ``through_seq`` settle once a snapshot's xmin >= ``xid``."""
        self.pending.append((through_seq, xid))
        if len(self.pending) > MAX_PENDING:
            del self.pending[0]


class Listener:
    """One LISTEN connection (not from the pool: it must stay the same
    session), opened on first use by ``PostgresStore.wait_for_changes``."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def wait(self, timeout_s: float) -> bool:
        """True once a notification arrived (all waiting ones are taken), or
        False after ``timeout_s`` with none."""
        got = False
        for _note in self.conn.notifies(timeout=max(0.0, timeout_s), stop_after=1):
            got = True
        if got:  # take the rest that are already here, without waiting
            for _note in self.conn.notifies(timeout=0.0):
                pass
        return got

    def close(self) -> None:
        self.conn.close()


class ListenThread:
    """LISTEN on a connection of its own, in a thread, and call ``on_change``
    (the keeper's wake post) for each batch of notifications.

    Also called: once LISTEN is in place (a commit made while nothing
    listened sent its notification to nobody, so the keeper must look), and
    once the connection failed (the keeper's wait is long only while
    ``listening``; the call ends that wait so it polls fast at once).

    The connection is opened, used and closed in the thread alone: it is no
    store's, and nothing else touches it (docs/postgres.md, "Lifecycle").
    The thread blocks every signal, so the process's signals reach the main
    thread, whose wait on the wake semaphore a signal must interrupt.

    ``figures`` (``trust.store.listen`` in queue state) is written by the
    thread, key by key; its keys never change after ``__init__``.
    """

    def __init__(
        self,
        conninfo: str,
        on_change: Callable[[], None],
        *,
        application_name: str = "queue-node listen",
        log: Callable[..., None] | None = None,
        min_gap_s: float = LISTEN_MIN_GAP_S,
    ) -> None:
        self._conninfo = conninfo
        self._min_gap_s = min_gap_s
        self._on_change = on_change
        self._application_name = application_name
        self._log = log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # True while LISTEN is in place on a connection that answered.
        self.listening = False
        self.figures: dict[str, Any] = {
            "state": "connecting",  # "listening", "reconnecting", "stopped"
            "wakes": 0,  # notifications passed on (a batch counts once)
            "connects": 0,
            "failures": 0,
            "last_error": None,
        }

    def start(self) -> ListenThread:
        thread = threading.Thread(target=self._run, name="queue-node-listen", daemon=True)
        # The new thread inherits this mask: every signal stays blocked in it
        # from its first instruction, then this thread's mask is put back.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        self._thread = thread
        return self

    def stop(self, timeout_s: float = 2 * LISTEN_WAIT_S) -> None:
        """Ask the thread to end and wait for it (at most ``timeout_s``: it
        is a daemon, so a thread stuck in a connect does not hold the
        process)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.listening = False
        self.figures["state"] = "stopped"

    # -- the thread -------------------------------------------------------------

    def _run(self) -> None:
        import psycopg  # the extra: imported where a PostgreSQL store is used

        from node.store.postgres_schema import LISTEN

        delay = LISTEN_RETRY_FIRST_S
        while not self._stop.is_set():
            conn = None
            try:
                conn = psycopg.connect(
                    self._conninfo, autocommit=True,
                    connect_timeout=LISTEN_CONNECT_TIMEOUT_S,
                    application_name=self._application_name,
                    tcp_user_timeout=LISTEN_TCP_USER_TIMEOUT_MS,
                )  # fmt: skip
                conn.execute(LISTEN)
                self.listening = True
                self.figures["state"] = "listening"
                self.figures["connects"] += 1
                if self.figures["connects"] > 1 and self._log is not None:
                    self._log("keeper_listen_resumed", connects=self.figures["connects"])
                self._on_change()  # what was committed while nothing listened
                delay = LISTEN_RETRY_FIRST_S
                self._serve(conn)
            except Exception as exc:  # any failure (psycopg.Error mostly): reconnect
                self.listening = False
                self.figures["failures"] += 1
                error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                self.figures["last_error"] = error
                if not self._stop.is_set():
                    self.figures["state"] = "reconnecting"
                    if self._log is not None:
                        self._log("keeper_listen_failed", error=error, retry_s=delay)
                self._on_change()  # the keeper polls fast until LISTEN is back
                self._stop.wait(delay)
                delay = min(delay * 2, LISTEN_RETRY_MAX_S)
            finally:
                self.listening = False
                if conn is not None:
                    conn.close()

    def _serve(self, conn: Any) -> None:
        """Pass notifications on until asked to stop or the connection fails."""
        heard = posted = time.monotonic()
        while not self._stop.is_set():
            got = False
            for _note in conn.notifies(timeout=LISTEN_WAIT_S, stop_after=1):
                got = True
            if got:
                gap_left = posted + self._min_gap_s - time.monotonic()
                if gap_left > 0:
                    self._stop.wait(gap_left)  # the others of a stream gather meanwhile
                for _note in conn.notifies(timeout=0.0):  # the rest already here
                    pass
                self._on_change()
                self.figures["wakes"] += 1
                heard = posted = time.monotonic()
            elif time.monotonic() - heard >= LISTEN_PING_S:
                conn.execute("SELECT 1")  # quiet for long: is anyone there?
                heard = time.monotonic()
