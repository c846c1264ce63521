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

import time
from collections.abc import Sequence

from keeper.base import KeeperBase
from keeper.owners import Ownership
from node.core.errors import NodeError
from node.core.log import log

MEMBERSHIP = "membership"  # the doubt a membership change leaves until its walk ends
# How often a fleet keeper reads what is paused: a route paused through any
# node is paused fleet-wide (node/store/postgres.py, FLEET_META), and another
# node's pause shows in every node's state (``now.paused_nodes``).
PAUSE_READ_S = 1.0
MISSED = ("held", "parked")  # a lease table slot's states after a miss
OWN_CHUNK = 50_000  # held keys made into strs at a time, to ask their owners


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
        entering = self.ownership is None or self.config.name not in self.ownership.nodes
        self.ownership = new
        log("keeper_ownership", nodes=list(new.nodes), first=first)
        if entering and len(new.nodes) > 1:
            self._hold_handover("joined")
        if first:
            return True  # before the load: it walks with it
        dropped = self._drop_unowned(now)
        self._reown_pending = True  # no input count saved until its walk ends
        self.next_publish = 0.0  # no set may go on offering a dropped key
        self._doubt_copy(MEMBERSHIP, now)  # the next tick walks, for the new split
        log("keeper_reowned", dropped=dropped, nodes=len(new.nodes))
        return True

    def _hold_handover(self, why: str) -> None:
        """This node came into a list with other live nodes (it joined, or
        came back after its membership lapsed): the rows it gains are theirs
        until each has read a list with it, and one may go on granting them
        until then. Each node's grants stop by themselves at its deadline,
        ``membership_timeout_s x 0.8`` after a heartbeat (node/fleet/), and
        the list it reads after a heartbeat sent after this node's entry
        holds this node. So this node publishes nothing for a whole
        ``membership_timeout_s`` from now (after its entry): no other node
        grants a row it gains by then (docs/delivery.md, "Two nodes, one key")."""
        hold_s = self.config.membership_timeout_s
        self._handover_until = time.monotonic() + hold_s
        self.next_publish = 0.0  # the set it offers now is empty
        log("keeper_handover_hold", why=why, hold_s=hold_s)

    def handover_left_s(self) -> float:
        """How long this node still holds its gained rows back (0: none)."""
        return max(0.0, self._handover_until - time.monotonic())

    def fleet_tick(self, now: float) -> None:
        """A fleet keeper's own work each tick: the pauses (``follow_pauses``)
        and the end of a handover hold, published at once."""
        if self.fleet is None:
            return
        if self._handover_until and not self.handover_left_s():
            self._handover_until = 0.0
            self.next_publish = 0.0
        self.follow_pauses(now)

    def follow_pauses(self, now: float) -> None:
        """A fleet keeper's read of the pauses, every PAUSE_READ_S: a route
        paused through another node stops this node's grants at the publish
        it causes (``_read_paused``)."""
        if self.fleet is None or now < self._next_pause_read:
            return
        self._next_pause_read = now + PAUSE_READ_S
        self._read_paused()
        by_node = self.store.meta_of_every_node("paused_node")
        self.paused_nodes = sorted(name for name, paused in by_node.items() if paused)

    def rejoined(self, trimmed_through: int | None, now: float) -> None:
        """A heartbeat came after this node's membership had lapsed (a stall,
        a partition): while it was out of the list its position held no trim
        back (docs/fleet.md), so the shared log may have lost changes its
        feed has not read, and no later change need be there to show the
        gap. Past its position (or not known): a gap, as keeper/outage.py
        handles one. The feed goes on from the trim, and the walk brings
        every row written up to it."""
        if self.ownership is not None and len(self.ownership.nodes) > 1:
            self._hold_handover("rejoined")  # its rows were another node's meanwhile
            self._reown_after_lapse(now)
        if trimmed_through is not None and trimmed_through <= self.feed_seq:
            return  # nothing unread was trimmed: the feed goes on as it was
        log("keeper_lapsed_gap", feed_seq=self.feed_seq, trimmed_through=trimmed_through)
        self.stats.store["gaps"] += 1
        if trimmed_through is not None:
            self.feed_seq = trimmed_through
        self._doubt_copy("gap", now)  # the next tick starts the walk (keeper/process.py)

    def _reown_after_lapse(self, now: float) -> None:
        """This node's membership lapsed and it came back: every other live
        node read a list without it meanwhile, took its rows and may have
        granted them, though this node never read such a list (it cannot,
        cut off) and comes back under the same one. So it does what the two
        changes would have made it do (``reown``): first the list without
        it, every held row dropped (withdrawn when due and not leased, a
        leased key fenced: its lease is the old list's, its key may have run
        elsewhere), then the list read now, a walk adding the rows it owns
        (received when due). Its books then say what the other nodes' say:
        the rows were theirs in between (docs/fleet.md, "Ownership")."""
        dropped = self._drop_unowned(now, keep=False)
        self._reown_pending = True
        self.next_publish = 0.0
        self._doubt_copy(MEMBERSHIP, now)
        nodes = len(self.ownership.nodes) if self.ownership is not None else 0
        log("keeper_reowned", dropped=dropped, nodes=nodes, why="lapsed")

    def fenced_in_flight(self) -> int:
        """Leases still live on keys a membership change dropped: in
        flight here and not held here, so the input law's ``waiting`` (due
        rows no lease holds) leaves them out of the in-flight count it
        subtracts. A key whose lease ended leaves the set."""
        if self.fenced:
            ended = [key for key in self.fenced if not self._leased(key)]
            get = self.buckets.get
            for key in ended:
                self.fenced.discard(key)
                if self._missed(key):
                    # Ended without a result: a requeue (``requeued`` counts
                    # it) of an occurrence not held here (its key went to its
                    # owner, or is held here again as a new occurrence, which
                    # waits on its own): withdrawn here, unless its result
                    # still comes late (``missed_out``).
                    self.withdrawn += 1
                    self._note_missed_out(key)
                elif get(key) is not None:
                    # A result, its key held here again: its write-back may
                    # still come through the feed (keeper/feed.py).
                    self._expect_result_write_back(key)
        if self.missed_out:
            self._follow_missed_out()
        if self.fenced_results:
            # Once the feed is past a bound, that write-back came (and was
            # taken) or lost to a newer write and never will.
            done = self.feed_seq
            for key in [k for k, bound in self.fenced_results.items() if bound <= done]:
                del self.fenced_results[key]
        return len(self.fenced)

    def _expect_result_write_back(self, key: str) -> None:
        """A fenced lease on ``key``, held here again, ended by a result: its
        write-back is committed by now (the ledger writes back before it ends
        a lease), so at or below the log's top. Unknown when the store does
        not answer: then not expected (that write-back counts as this node's
        own, an edge of one)."""
        try:
            self.fenced_results[key] = self.store.top_seq()
        except NodeError:
            pass

    def _note_missed_out(self, key: str) -> None:
        """``key``, just withdrawn, is held by a miss (its last lease expired
        or was released): remember that lease (``missed_out``)."""
        found = self.leases.lookup(key) if self.leases is not None else None
        if found is not None and found[0] in MISSED:
            self.missed_out[key] = found[1].lease_id

    def _follow_missed_out(self) -> None:
        """A key withdrawn while a miss held it: once that lease's result is
        accepted late (its slot idle, ended by a result, the same lease), the
        requeue is taken back (``late_expired``, ``late_released``), and so
        is the withdrawal; the key, held here again, then waits for that
        result's write-back, which takes its new occurrence out
        (``fenced_results``). Any other change of the slot (granted again,
        gone) leaves the withdrawal. The slot's hold may be cleared by a
        write meanwhile: the lease is still the one that missed."""
        if self.leases is None:
            self.missed_out.clear()
            return
        from shm.leases import Ended

        missed = (Ended.EXPIRED, Ended.RELEASED)
        for key, lease_id in list(self.missed_out.items()):
            found = self.leases.lookup(key)
            same = found is not None and found[1].lease_id == lease_id
            if same and found[0] in (*MISSED, "idle") and found[1].ended in missed:
                continue  # still missed (a write may have cleared its hold): it may yet come
            del self.missed_out[key]
            if same and found[0] == "idle" and found[1].ended == Ended.RESULT:
                self.withdrawn -= 1
                if self.buckets.get(key) is not None:
                    self._expect_result_write_back(key)

    def _missed(self, key: str) -> bool:
        """Whether ``key``'s lease ended without a result (its slot holds a
        miss: held or parked); a completed lease leaves none."""
        found = self.leases.lookup(key) if self.leases is not None else None
        return found is not None and found[0] in MISSED

    def _drop_unowned(self, now: float, keep: bool = True) -> int:
        """Drop the held rows this node does not own (``keep`` False: every
        held row, for a lapse); their number."""
        if self.ownership is None:
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
        # Dropped while loading, rows the saved counts' ownership owned are
        # counted at the load's end with the others it left out.
        past = self._saved_ownership if self._loading else None
        dropped = 0
        # A chunk of slots at a time: their keys made (the buckets hold no
        # str a key: keeper/_keys.c), asked for and dropped. A removal frees
        # only its own slot, so the later slots hold what they held.
        slots = self.buckets.held_slots()
        for at in range(0, len(slots), OWN_CHUNK):
            keys = self.buckets.keys_at(slots[at : at + OWN_CHUNK])
            if keep:
                owned = self._owned(keys)
                assert owned is not None  # a fleet keeper's
                keys = [key for key in keys if key not in owned]
            left = set() if past is None else set(past.mine(keys))
            for key in keys:
                before = get(key)
                remove(key)
                dropped += 1
                if key in left and before is not None:
                    self._left_out[key] = (before[0], before[2])
                if key in exclude and self._leased(key):
                    self.fenced.add(key)  # in flight: its lease's end decides
                elif (before is not None and counting
                      and not self._finished_unapplied(key, before[2])):  # fmt: skip
                    self._withdraw(key, before, None)
        if self.refused_due:  # received here, held nowhere, another node's now: it leaves
            kept = self._owned(list(self.refused_due)) or set()
            for key in [k for k in self.refused_due if k not in kept]:
                self.refused_due.discard(key)
                self.withdrawn += 1
        return dropped
