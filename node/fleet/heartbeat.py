"""The heartbeat: membership renewed every ``heartbeat_s``, and the grant
deadline it earns written into the node's ready set (docs/fleet.md).

Whoever runs it (a node on PostgreSQL: its keeper, keeper/fleet.py; a test)
owns the ready set's ``grant_until`` word; nobody else writes it but the
supervisor, which sets it before any child starts. The order of things:

- ``join``: stop granting first (the deadline set in the past), then join;
  the first heartbeat sets the first real deadline. A node never grants
  before it is a member.
- ``beat``: one heartbeat; on success the deadline moves to ``sent +
  membership_timeout_s x (1 - GRANT_MARGIN_FRACTION)``. A heartbeat that
  fails leaves the deadline where it was, so it lapses by itself: nothing
  has to run for a node to stop granting (a SIGSTOPped or partitioned
  heartbeat included).
- ``leave``: stop granting now, then leave (the other nodes stop counting
  this one at once).
"""

from __future__ import annotations

import threading

from node.core.errors import StoreError
from node.core.log import log, warn
from node.fleet.membership import Beat, Member, Membership
from shm.ready import ReadySet

# Written as the deadline to stop granting now: 0 would mean "no deadline".
PAST = 1


class Heartbeat:
    """``membership`` renewed into ``ready``'s grant deadline."""

    def __init__(self, membership: Membership, ready: ReadySet, heartbeat_s: float = 1.0) -> None:
        self.membership = membership
        self.ready = ready
        self.heartbeat_s = heartbeat_s
        self.beats = 0
        self.failures = 0
        self.last: Beat | None = None
        self.last_error: StoreError | None = None  # the last failed beat's, until one succeeds
        self.pending_until = 0  # a deadline earned and kept back (``beat(grant=False)``)

    def join(self, applied_seq: int | None = None, grant: bool = True) -> Member:
        self.ready.set_grant_until(PAST)
        member = self.membership.join()
        self.beat(applied_seq, grant)
        return member

    def beat(self, applied_seq: int | None = None, grant: bool = True) -> Beat | None:
        """One heartbeat and the deadline it earns; None when it failed (the
        deadline then stays, and lapses unless a later beat succeeds).
        ``applied_seq`` rides along (``Membership.heartbeat``). ``grant``
        False: the deadline is kept back until ``grant()`` (a keeper writes it
        once its set offers only what the live list read after this beat
        makes its own: docs/delivery.md, "Two nodes, one key")."""
        self.pending_until = 0
        try:
            beat = self.membership.heartbeat(applied_seq)
        except StoreError as exc:
            self.failures += 1
            self.last_error = exc
            warn("fleet_heartbeat_failed", node=self.membership.name, error=str(exc))
            return None
        if grant:
            self.ready.set_grant_until(beat.grant_until_ns)
        else:
            self.pending_until = beat.grant_until_ns
        self.beats += 1
        self.last = beat
        self.last_error = None
        if beat.lapsed:
            log("fleet_rejoined", node=self.membership.name, note="heartbeat older than timeout")
        return beat

    def grant(self) -> None:
        """Write the deadline the last beat earned and kept back (none: nothing)."""
        if self.pending_until:
            self.ready.set_grant_until(self.pending_until)
            self.pending_until = 0

    def drop_pending(self) -> None:
        """Forget a deadline kept back (the live list after it was not read)."""
        self.pending_until = 0

    def run(self, stop: threading.Event) -> None:
        """Beat every ``heartbeat_s`` until ``stop`` is set."""
        while not stop.is_set():
            self.beat()
            stop.wait(self.heartbeat_s)

    def leave(self) -> bool:
        self.ready.set_grant_until(PAST)
        return self.membership.leave()
