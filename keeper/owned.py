"""A fleet keeper holds only the rows its node owns (docs/fleet.md,
"Ownership"): rendezvous hashing of each key over the live node list
(keeper/owners.py). ``ownership`` None (a node that is no fleet member)
owns every key.

The load walk, the change feed and the verification walks keep only owned
keys (``_owned``: one C call a chunk). A change to a key another node owns
is neither applied nor counted: that row never came due here, so the input
law (docs/accounting.md) has nothing to say about it on this node.

A membership change (``reown``, from the heartbeat's live list):

1. the held rows no longer owned are dropped, each counted as withdrawn when
   it was due and not leased; a leased key stays fenced (the lease table
   keeps it out, its lease completes normally, the write-back under the
   version guard): in flight here, not waiting (``fenced``: the input law's
   ``waiting`` leaves it out) until its lease ends;
2. the set published is replaced at the next tick (``next_publish = 0``);
3. a walk of the table, started by the next tick (no store call here),
   adds the rows gained (``_doubt = "membership"``: the repair walk of
   keeper/verify.py), each counted as received, and its
   repairs are counted in ``trust.repairs.membership`` apart from
   ``feed_missed``. The keeper is not exact until it ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from keeper.base import KeeperBase
from keeper.owners import Ownership
from node.core.log import log

MEMBERSHIP = "membership"  # the doubt a membership change leaves until its walk ends


class Owned(KeeperBase):
    def _owned(self, keys: Sequence[str]) -> set[str] | None:
        """The keys of ``keys`` this node owns; None: all of them."""
        if self.ownership is None:
            return None
        return set(self.ownership.mine(list(keys)))

    def reown(self, names: Sequence[str], now: float) -> bool:
        """The live list changed (or came first): hold what this node owns
        among ``names``. A list without this node (its membership lapsed)
        changes nothing: its deadline has stopped its grants already."""
        if self.config.name not in names:
            return False
        new = Ownership(names, self.config.name)
        if new == self.ownership:
            return False
        first = self.ownership is None and self.feed_seq == 0 and not self.buckets
        self.ownership = new
        log("keeper_ownership", nodes=list(new.nodes), first=first)
        if first:
            return True  # before the load: it walks with it
        dropped = self._drop_unowned(now)
        self.next_publish = 0.0  # no set may go on offering a dropped key
        self._doubt_copy(MEMBERSHIP, now)  # the next tick walks, for the new split
        log("keeper_reowned", dropped=dropped, nodes=len(new.nodes))
        return True

    def rejoined(self, trimmed_through: int | None, now: float) -> None:
        """A heartbeat came after this node's membership had lapsed (a stall,
        a partition): while it was out of the list its position held no trim
        back (docs/fleet.md), so the shared log may have lost changes its
        feed has not read, and no later change need be there to show the
        gap. Past its position (or not known): a gap, as keeper/outage.py
        handles one. The feed goes on from the trim, and the walk brings
        every row written up to it."""
        if trimmed_through is not None and trimmed_through <= self.feed_seq:
            return  # nothing unread was trimmed: the feed goes on as it was
        log("keeper_lapsed_gap", feed_seq=self.feed_seq, trimmed_through=trimmed_through)
        self.stats.store["gaps"] += 1
        if trimmed_through is not None:
            self.feed_seq = trimmed_through
        self._doubt_copy("gap", now)  # the next tick starts the walk (keeper/process.py)

    def _written_back_here(self, key: str) -> bool:
        """Whether a write-back of held ``key`` ends a lease this node
        granted, which the excluded keys may not show: they are followed at
        each publish only, a key granted and completed between two (the
        common case under claims) never was among them, and the ledger ends
        a lease just after its write-back commits. The lease table says: it
        has a record of the key granted on the version held here or a later
        one (the write-back's guard held: the row had not changed since the
        grant; a later grant is this node's too, read by a keeper behind its
        feed). Another node's lease ending is unknown here, or its record is
        older than the row (the row was written back since). What it cannot
        see: a key whose idle slot was given to another key before the feed
        brought the write-back (counted withdrawn then: the input law one
        short, docs/fleet.md)."""
        if self.leases is None:
            return False
        found = self.leases.lookup(key)
        held = self.buckets.get(key)
        return found is not None and held is not None and found[1].version >= held[2]

    def fenced_in_flight(self) -> int:
        """Leases still live on keys a membership change dropped: in
        flight here and not held here, so the input law's ``waiting`` (due
        rows no lease holds) leaves them out of the in-flight count it
        subtracts. A key whose lease ended leaves the set."""
        if self.fenced:
            self.fenced = {key for key in self.fenced if self._leased(key)}
        return len(self.fenced)

    def _drop_unowned(self, now: float) -> int:
        keys = [item[0] for item in self.buckets.items()]
        owned = self._owned(keys)
        if owned is None:
            return 0
        if self.leases is not None:
            # The excluded keys are followed at each publish only: a key
            # granted from the live set since then must be seen leased now,
            # or it would be counted withdrawn while its lease is in flight.
            self._follow_leases(now)
        exclude = self.exclude if self.leases is not None else ()
        get, remove = self.buckets.get, self.buckets.remove
        # A load counts received at its end, from the rows it then holds
        # (keeper/report.py, ``_start_received``): a row dropped before that
        # was never received here, so it is not withdrawn either (the feed
        # counts no withdrawal while loading, for the same reason).
        counting = not self._loading
        dropped = 0
        for key in keys:
            if key in owned:
                continue
            before = get(key)
            remove(key)
            dropped += 1
            if key in exclude and self._leased(key):
                self.fenced.add(key)  # in flight: its lease's end decides
            elif before is not None and counting:
                self._withdraw(before, None)
        if self.refused_due:  # received here, held nowhere, another node's now: it leaves
            kept = self._owned(list(self.refused_due)) or set()
            for key in [k for k in self.refused_due if k not in kept]:
                self.refused_due.discard(key)
                self.withdrawn += 1
        return dropped
