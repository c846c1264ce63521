"""A node on PostgreSQL is a fleet member, and its keeper keeps it one
(docs/fleet.md): it joins at start, heartbeats every ``heartbeat_s``, writes
the grant deadline each heartbeat earns into the ready set, reads the live
list, and leaves on a clean stop.

Why the keeper's loop, and not a thread or a process of its own: a stalled
keeper's ready set is stale, so a keeper that cannot tick should not earn
grants either; a heartbeat in the loop stops with it (SIGSTOP included) and
the deadline lapses by itself. The price is that a heartbeat blocks the loop
while it runs, so the membership's connection is bounded:

- ``statement_timeout`` and ``tcp_user_timeout`` of ``STATEMENT_TIMEOUT_S``
  (0.5 s): a heartbeat (one UPDATE, then the live list) that the database
  cannot answer in that long fails, and the loop goes on; the deadline it
  did not extend lapses unless a later heartbeat succeeds (at the default
  10 s timeout and 1 s heartbeat, 7 more tries). A database that slow would
  also stall the keeper's own reads. Half a second of the loop is half a
  publish interval: claimers go on taking from the set already published.
- ``connect_timeout`` 2 s (libpq's least), for the first connection only:
  one lost later is replaced off the loop, by dials on threads of their own
  (node/fleet/dialer.py), a new one at each heartbeat while none has answered,
  so the first heartbeat after a short cut heals needs one round trip, not
  the kernel's SYN retries (a 1.5 s cut had stopped grants for about a
  second, docs/reliability.md, finding 4); each beat meanwhile fails at once.

A SQLite node has no membership (``for_store`` answers None) and its
deadline stays 0, as the supervisor set it.
"""

from __future__ import annotations

import time
from typing import Any

from node.core.config import Config
from node.core.errors import StoreError
from node.core.log import log, warn
from node.fleet import LiveList, Membership, NotAMember, peers_seen
from node.fleet.heartbeat import Heartbeat
from node.store import is_fleet_url
from shm.ready import ReadySet

STATEMENT_TIMEOUT_S = 0.5
CONNECT_TIMEOUT_S = 2


class FleetMember:
    """This node's membership, driven by the keeper's loop (``tick``)."""

    def __init__(self, config: Config, ready: ReadySet, conninfo: str) -> None:
        self.name = config.name
        self.ready = ready
        self.heartbeat_s = config.heartbeat_s
        self.trim_hold_s = config.trim_hold_s
        self.membership = Membership(
            conninfo, config.name, config.http,
            membership_timeout_s=config.membership_timeout_s,
            connect_timeout_s=CONNECT_TIMEOUT_S, statement_timeout_s=STATEMENT_TIMEOUT_S,
            reconnect_in_background=True,
        )  # fmt: skip
        self.heart = Heartbeat(self.membership, ready, config.heartbeat_s)
        self.number: int | None = None  # once joined
        self.live: LiveList | None = None
        self.left = False
        self.next_beat_ns = 0
        self.join_failures = 0
        # A heartbeat came after this node's membership had lapsed: while
        # out of the list its position held no trim back. Set here, cleared
        # by the loop once the keeper has looked (``Owned.rejoined``).
        self.lapsed = False
        # A node that names peers publishes nothing until it sees one of them
        # live, or ``peer_wait_s`` passes (then alone, with a warning): it
        # would otherwise offer every row as its own for a moment, rows a
        # peer about to appear owns. A node alone does not wait.
        self.peers = config.peers
        self.peer_wait_s = config.peer_wait_s
        self.peer_state = "waiting" if self.peers else "none"
        self._peer_since_ns = time.monotonic_ns()
        self.peer_waited_s: float | None = None

    @classmethod
    def for_store(cls, config: Config, ready: ReadySet) -> FleetMember | None:
        if not is_fleet_url(config.store_url):
            return None
        return cls(config, ready, config.store_url)

    def wait_s(self) -> float:
        """How long the loop may wait before the next heartbeat is due."""
        if self.left:
            return float("inf")
        return max(0.0, (self.next_beat_ns - time.monotonic_ns()) / 1e9)

    def tick(self, applied_seq: int | None = None) -> bool:
        """Join or heartbeat when one is due; True when the live list was
        read anew (the caller compares it with the last one).
        ``applied_seq``: the change-log position this node's keeper would
        resume from after a kill -9 (``Keeper.resume_seq``), reported with
        the heartbeat so that no node trims the shared log past it."""
        if self.left or time.monotonic_ns() < self.next_beat_ns:
            return False
        self.next_beat_ns = time.monotonic_ns() + int(self.heartbeat_s * 1e9)
        if self.number is None:
            try:
                # the deadline in the past, then the first beat
                member = self.heart.join(applied_seq, grant=False)
            except StoreError as exc:
                self.join_failures += 1
                warn("fleet_join_failed", node=self.name, error=str(exc))
                return False
            self.number = member.number
            log("fleet_joined", node=self.name, number=member.number)
        elif (beat := self.heart.beat(applied_seq, grant=False)) is None:
            if isinstance(self.heart.last_error, NotAMember):
                self.number = None  # forgotten, or left by another hand: join again
            return False
        elif beat.lapsed:
            self.lapsed = True  # the loop tells the keeper (``Owned.rejoined``)
        try:
            self.live = self.membership.live()
        except StoreError as exc:
            warn("fleet_live_list_failed", node=self.name, error=str(exc))
            self.heart.drop_pending()  # no list read after the beat: no deadline from it
            return False
        return True

    def grant(self) -> None:
        """Write the grant deadline the last heartbeat earned. The keeper's
        loop calls it after the tick that follows the heartbeat: by then the
        set it offers holds only what the live list read after that heartbeat
        makes this node's (a key another node gained was dropped and the set
        republished), so no deadline extends a set that offers another
        node's key (docs/delivery.md, "Two nodes, one key")."""
        self.heart.grant()

    @property
    def waiting_for_peers(self) -> bool:
        """True while the node may not publish (``Publish.publish`` offers
        nothing)."""
        return self.peer_state == "waiting"

    def peer_wait_over(self) -> bool:
        """True once, when the wait for peers ends: a peer is in the live
        list, or ``peer_wait_s`` passed (the node goes on alone)."""
        if self.peer_state != "waiting":
            return False
        waited_s = (time.monotonic_ns() - self._peer_since_ns) / 1e9
        if self.live is not None and peers_seen(self.live, self.name, self.peers):
            self.peer_state = "seen"
            log("fleet_peer_seen", node=self.name, live=list(self.live.names),
                waited_s=round(waited_s, 3))  # fmt: skip
        elif waited_s >= self.peer_wait_s:
            self.peer_state = "alone"
            warn("fleet_no_peer", node=self.name, peers=list(self.peers),
                 waited_s=round(waited_s, 3), note="publishing alone")  # fmt: skip
        else:
            return False
        self.peer_waited_s = round(waited_s, 3)
        return True

    def trim_through(self) -> int:
        """How far the shared change log may be trimmed: the lowest position
        every live node reported (``Membership.trim_through``); 0 (trim
        nothing) before this node joined, after it left, or when the
        database does not answer."""
        if self.number is None or self.left:
            return 0
        try:
            return self.membership.trim_through(self.trim_hold_s)
        except StoreError as exc:
            warn("fleet_trim_position_failed", node=self.name, error=str(exc))
            return 0

    def trimmed_through(self) -> int | None:
        """How far the shared log was trimmed; None when the database does
        not answer."""
        try:
            return self.membership.trimmed_through()
        except StoreError as exc:
            warn("fleet_trim_position_failed", node=self.name, error=str(exc))
            return None

    def leave(self) -> None:
        """Stop granting now, then leave the list (a clean stop); heartbeats
        end. A failure is logged: the membership then lapses by timeout."""
        if self.left:
            return
        self.left = True
        try:
            self.heart.leave()
            log("fleet_left", node=self.name)
        except StoreError as exc:
            warn("fleet_leave_failed", node=self.name, error=str(exc))
        self.membership.close()

    def doc(self) -> dict[str, Any]:
        """``trust.membership`` of /queue-state."""
        now_ns = time.monotonic_ns()
        last = self.heart.last
        age = None if last is None else round((now_ns - last.sent_ns) / 1e9, 3)
        # A deadline earned and kept back is written at the end of this tick.
        until = self.heart.pending_until or self.ready.grant_until_ns
        return {
            "name": self.name,
            "address": self.membership.address,
            "number": self.number,
            "state": "left" if self.left else "member" if self.number is not None else "joining",
            "live": list(self.live.names) if self.live is not None else [],
            "heartbeat_s": self.heartbeat_s,
            "membership_timeout_s": self.membership.membership_timeout_s,
            "last_heartbeat_age_s": age,
            "heartbeats": self.heart.beats,
            "heartbeat_failures": self.heart.failures + self.join_failures,
            "skew_s": None if last is None else round(last.skew.skew_s, 4),
            "skew_flagged": False if last is None else last.skew.flagged,
            "grant_deadline_left_s": round(max(0, until - now_ns) / 1e9, 3),
            "peers": {
                "names": list(self.peers),
                "state": self.peer_state,
                "waited_s": self.peer_waited_s,
                "wait_s": self.peer_wait_s,
            },
        }
