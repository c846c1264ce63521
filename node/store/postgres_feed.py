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
"""

from __future__ import annotations

from typing import Any

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
