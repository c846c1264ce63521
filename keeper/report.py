"""What the keeper reports: the state document it writes into the state
buffer every ``state_interval_s`` (counts, what is coming, lateness, classes,
flow, the trust figures), the flow of the last hour a minute at a time, and
the lifetime counts kept over restarts in the store's meta: received and
withdrawn (``RECEIVED_META``), and the self-checks' and the store's figures
of ``trust.verify``, ``trust.repairs`` and ``trust.store`` (``COUNTS_META``).
"""

from __future__ import annotations

from itertools import islice
from operator import add
from typing import Any, NamedTuple

from keeper.base import KeeperBase
from keeper.owners import Ownership
from node.core import log
from node.core.errors import NodeError
from node.core.rows import OP_DELETE, ORIGIN_WRITEBACK
from shm.leases.protocol import Ended

# Class rows in the state document; more are summarised and flagged truncated.
STATE_CLASS_ROWS = 1_000
# Lateness bins of the state document, in lateness / cadence: bin i holds the
# due rows with edges[i] <= ratio < edges[i + 1], the last bin the rest.
LATENESS_EDGES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
LATENESS_LABELS = ("<0.25", "0.25-0.5", "0.5-1", "1-2", "2-4", ">=4")
# Routes listed one by one in the lateness group (the busiest first).
STATE_ROUTE_ROWS = 200
# Flow counts per minute, in the order the document lists them.
FLOW_FIELDS = ("came_due", "added", "updated", "triggered", "rescheduled", "removed")
# The store meta entry that carries the lifetime received and withdrawn
# counts over restarts.
RECEIVED_META = "received"
# The store meta entry that carries the keeper's self-check figures (all of
# trust.verify) and the store's lifetime figures (STORE_LIFETIME of
# trust.store) over restarts: saved with every state write, and at the end of
# a tick that counted a repair or a store event (COUNTED_EVENTS), so that a
# kill -9 loses none of those.
COUNTS_META = "keeper_counts"
STORE_LIFETIME = ("outages", "resumed", "walks", "gaps", "reloads", "last_down_s",
                  "last_verdict", "write_failures", "last_write_error")  # fmt: skip
COUNTED_EVENTS = (
    ("verify", ("runs", "repairs", "repairs_feed_missed", "repairs_membership", "top_repairs")),
    ("store", ("outages", "resumed", "walks", "gaps", "reloads")),
)
# Changes read a query when a starting keeper replays its predecessor's last ones.
REPLAY_BATCH = 10_000
MOVED_CHUNK = 50_000  # held rows read at a time, to ask the saved ownership
# Lease-table states (shm/leases CODE_NAMES) of a key that is leased.
LEASED_NAMES = frozenset({"leased", "claiming"})
# A state document whose input law did not close (taken mid-flight) is
# written again this soon, not a whole state interval later.
INPUT_RECHECK_S = 0.5


class Replayed(NamedTuple):
    """A key's last change among those a starting keeper replays."""

    minute: int  # the minute it was counted at
    seq: int
    due_minute: int | None  # after it; None: deleted, or not a valid due time


class Report(KeeperBase):
    # -- the state document -----------------------------------------------------

    def counts_doc(self, now: float) -> dict[str, Any]:
        counts = self.buckets.counts(now)
        per_class = counts["per_class"]
        oldest = self.buckets.oldest_due(now)
        class_rows = []
        for cid, (rows, due) in per_class.items():
            head = oldest.get(cid)
            class_rows.append(
                {
                    **self._class_identity(cid),
                    "rows": rows,
                    "due": due,
                    "oldest_due_minute": head,
                    "oldest_lateness_ratio": (
                        None
                        if head is None
                        else round((now - head * 60) / self.classes.info(cid).cadence_s, 4)
                    ),
                }
            )
        class_rows.sort(key=lambda c: (-(c["due"]), c["route"]))
        truncated = len(class_rows) > STATE_CLASS_ROWS
        return {
            "now": {
                "due": counts["due"],
                "rows": len(self.buckets),
                "classes": len(self.classes),
                "paused": sorted(self.paused_routes),
                "paused_node": self.paused_node,
                "paused_nodes": (
                    self.paused_nodes if self.fleet is not None
                    else [self.config.name] if self.paused_node else []
                ),
            },
            "coming": self.buckets.coming(now),
            "lateness": self._lateness_doc(now, oldest, per_class),
            "classes": class_rows[:STATE_CLASS_ROWS],
            "classes_truncated": truncated,
            "flow": self._flow_doc(),
            "counters": self._input_side(counts["due"]["total"], now),
            "trust": {
                "phase": self._phase(),
                "load": self.stats.load,
                "publish": self.stats.publish,
                "verify": self.stats.verify,
                "apply": self.stats.apply,
                # Rows held nowhere for want of a class slot (max_classes):
                # how many, the newest keys, and those due (in the input law).
                "refused": {
                    "rows": self.stats.apply["refused_classes"],
                    "keys": list(self.buckets.refused_keys),
                    "due": len(self.refused_due),
                },
                "lag": self.stats.lag_figures(),
                "feed_seq": self.feed_seq,
                "store": self.stats.store,  # keeper/outage.py
                # A fleet node's membership (keeper/fleet.py); null without one.
                "membership": (
                    None if self.fleet is None
                    else {**self.fleet.doc(), "handover_left_s": round(self.handover_left_s(), 3)}
                ),
            },
        }

    def _class_identity(self, cid: int) -> dict[str, Any]:
        info = self.classes.info(cid)
        return {"route": info.route, "cadence_s": info.cadence_s, "source": info.source,
                "sitemap": info.sitemap, "boost": info.boost}

    def _lateness_doc(
        self, now: float, oldest: dict[int, int], per_class: dict[int, tuple[int, int]]
    ) -> dict[str, Any]:
        """Due rows by lateness / cadence (bins of LATENESS_EDGES), by kind
        and by route, and the oldest due row of every class."""
        bins = len(LATENESS_EDGES)
        kinds = {"sitemap": [0] * bins, "discovered": [0] * bins}
        routes: dict[str, list[int]] = {}
        for cid, counts in self.buckets.lateness(now, LATENESS_EDGES).items():
            info = self.classes.info(cid)
            kind = kinds["sitemap" if info.sitemap else "discovered"]
            route = routes.get(info.route)
            routes[info.route] = counts if route is None else list(map(add, route, counts))
            kind[:] = map(add, kind, counts)
        busiest = sorted(routes, key=lambda r: (-sum(routes[r]), r))
        heads = []
        for cid, minute in oldest.items():
            info = self.classes.info(cid)
            lateness_s = round(now - minute * 60, 3)
            heads.append({**self._class_identity(cid), "due": per_class.get(cid, (0, 0))[1],
                          "oldest_due_minute": minute, "lateness_s": lateness_s,
                          "lateness_ratio": round(lateness_s / info.cadence_s, 4)})
        heads.sort(key=lambda h: (-h["lateness_ratio"], h["route"]))
        return {
            "edges": list(LATENESS_EDGES),
            "labels": list(LATENESS_LABELS),
            **kinds,
            "total": [a + b for a, b in zip(kinds["sitemap"], kinds["discovered"], strict=True)],
            "by_route": {r: routes[r] for r in busiest[:STATE_ROUTE_ROWS]},
            "by_route_truncated": len(busiest) > STATE_ROUTE_ROWS,
            "oldest": heads[:STATE_CLASS_ROWS],
            "oldest_truncated": len(heads) > STATE_CLASS_ROWS,
        }

    def _flow_doc(self) -> dict[str, Any]:
        minutes = [{"minute": m, **c} for m, c in self._flow]
        last_hour = dict.fromkeys(FLOW_FIELDS, 0)
        for _m, c in self._flow:
            for name in FLOW_FIELDS:
                last_hour[name] += c[name]
        return {"minutes": minutes, "last_hour": last_hour}

    def write_state(self, now: float) -> None:
        interval = self.config.state_interval_s
        self.next_state = now + interval
        if self._outage is None:  # without a store: the pause last read
            self._read_paused()  # a pause written while no keeper was asked
        self._sample_flow(now)
        doc = self.counts_doc(now)
        self.state.write_doc(doc, now)
        if self._outage is None:
            self._save_received(now)
            self.save_counts(now, periodic=True)
        if doc["counters"].get("input_gap"):
            # Taken mid-flight (changes not applied yet, a grant between two
            # reads): look again soon rather than show the gap for a whole
            # interval once the node is quiet.
            self.next_state = now + min(interval, INPUT_RECHECK_S)

    # -- the input side of the books -------------------------------------------------

    def _input_side(self, due: int, now: float) -> dict[str, Any]:
        """The input law's terms as of this moment (docs/accounting.md):
        received + requeued = routed + waiting + withdrawn. ``received``,
        ``withdrawn`` and ``due`` are the keeper's own; ``routed``,
        ``requeued`` and ``in_flight`` the lease table's counters (without the
        base the ledger adds after a reboot), read together: a live count
        before and after them that differ means a lease moved in between,
        and they are read again. ``waiting`` = due rows no lease holds.
        ``unapplied``: changes committed that the buckets do not show yet,
        what a gap under load is bounded by (with the leases that moved)."""
        received, withdrawn = self.received(), self.withdrawn_total()
        out: dict[str, Any] = {
            "received": received,
            "withdrawn": withdrawn,
            "due": due,
            "leased_writes": self.leased_writes_total(),
            "at": round(now, 3),
        }
        leases = self.leases
        if leases is None or self._loading:
            return out
        for _ in range(3):
            before = leases.live_count()
            table = leases.counters()
            in_flight = leases.live_count()
            if in_flight == before:
                break
        routed = table["grants"]
        requeued = (
            table["expired"] - table["late_expired"] + table["released"] - table["late_released"]
        )
        # A lease on a key a membership change dropped is in flight, but
        # its row is not among the due rows held here (keeper/owned.py).
        fenced = self.fenced_in_flight()
        waiting = due - (in_flight - fenced)
        try:
            unapplied = max(0, self.store.top_seq() - self.feed_seq)
        except NodeError:
            unapplied = None
        out.update(
            routed=routed,
            requeued=requeued,
            in_flight=in_flight,
            fenced=fenced,
            waiting=waiting,
            unapplied=unapplied,
            input_gap=received + requeued - routed - waiting - withdrawn,
        )
        return out

    # -- flow ---------------------------------------------------------------------

    def _flow_minute(self, now: float) -> dict[str, int]:
        minute = int(now // 60)
        if not self._flow or self._flow[-1][0] != minute:
            self._flow.append((minute, dict.fromkeys(FLOW_FIELDS, 0)))
        return self._flow[-1][1]

    def _sample_flow(self, now: float) -> None:
        """Move what the buckets and the lease table counted since the last
        sample into the current minute: rows that came due, leases granted."""
        came_due = self.buckets.came_due
        grants = self.leases.counters()["grants"] if self.leases is not None else 0
        if self._grants_mark is None:
            self._grants_mark = grants  # granted before this keeper started: not its flow
        if came_due == self._came_due_mark and grants == self._grants_mark:
            return
        flow = self._flow_minute(now)
        if not self._loading:  # a load's rows are restored, not new occurrences
            flow["came_due"] += came_due - self._came_due_mark
        flow["triggered"] += grants - self._grants_mark
        self._came_due_mark, self._grants_mark = came_due, grants

    # -- the received count -----------------------------------------------------

    def _start_received(self, now: float) -> None:
        """At the end of the load: the lifetime received and withdrawn counts
        are the saved ones plus what happened since they were saved and no
        keeper counted (docs/accounting.md, "After a restart of the keeper").
        From here the buckets count (``came_due``) and the feed (``withdrawn``).

        The counts were saved with the feed position and the minute they
        were counted through (``seq``, ``minute``), and in a fleet with the
        live nodes whose ownership they were taken under (``nodes``). The
        changes logged after that position (kept: the log is trimmed only up
        to it) to keys that ownership owned are replayed from their due
        times and the ones they replaced, each at its own minute; the clock's
        crossings are counted for each row from its last change (or the
        saved minute) to now. Under another ownership now, the rows that
        moved while no keeper counted are counted too (``_moved_in``,
        ``_moved_out``). A save without ``seq`` (an older keeper) counts the
        crossings alone; one without ``nodes`` counts every key."""
        minute = int(now // 60)
        self.buckets.advance(minute)
        saved = self._received_saved or {}
        since = int(saved.get("minute", -(2**31)))
        received = int(saved.get("total", 0))
        withdrawn = int(saved.get("withdrawn", 0))
        past = self._saved_ownership
        crossed = self.buckets.count_due_between(since, minute) if since < minute else 0
        edges = 0
        replayed: dict[str, Replayed] = {}
        if "seq" in saved and since >= 0:
            self._check_replay(int(saved["seq"]))
            came, took, edges, replayed = self._replay_since(int(saved["seq"]), since, past)
            received += came
            withdrawn += took
            for key, last in replayed.items():
                held = self.buckets.get(key)
                if held is not None and since < held[0] <= min(last.minute, minute):
                    crossed -= 1  # due at its last change: counted by the replay
        if past is not None and (past != self.ownership or self._left_out):
            crossed_in, came_in = self._moved_in(past, since, minute)
            came_out, took_out = self._moved_out(since, minute, replayed)
            crossed -= crossed_in  # another node's then: counted as moved in
            received += came_in + came_out
            withdrawn += took_out
            self.stats.load["moved_in"] = came_in
            self.stats.load["moved_out"] = took_out
            log.log("keeper_moved_since_save", nodes_then=list(past.nodes),
                    nodes_now=None if self.ownership is None else list(self.ownership.nodes),
                    moved_in=came_in, moved_out=took_out, came_due_out=came_out)  # fmt: skip
        self._left_out = {}
        self._received_base = received + crossed
        self._withdrawn_base = withdrawn
        self._leased_writes_base = int(saved.get("leased_writes", 0)) + edges
        self._saved_seq = int(saved.get("seq", 0))
        self._came_due_offset = self.buckets.came_due
        self._came_due_mark = self.buckets.came_due

    def _check_replay(self, saved_seq: int) -> None:
        """A fleet's shared log may have been trimmed past the saved position
        while this node was off the list longer than ``trim_hold_s``: the
        changes trimmed cannot be replayed, and the input counts miss what
        they did. Said, never silent: a gap in ``trust.store.gaps`` and a
        ``keeper_replay_gap`` line (docs/fleet.md, "The shared change log")."""
        if self.fleet is None:
            return
        trimmed = self.fleet.trimmed_through()
        if trimmed is not None and trimmed > saved_seq:
            self.stats.store["gaps"] += 1
            log.warn("keeper_replay_gap", saved_seq=saved_seq, trimmed_through=trimmed,
                     hold_s=self.config.trim_hold_s)  # fmt: skip

    def _replay_since(
        self, after_seq: int, since: int, past: Ownership | None
    ) -> tuple[int, int, int, dict[str, Replayed]]:
        """(came due, withdrawn, writes to leased rows, each replayed key's
        last change) over the changes after ``after_seq`` through the feed
        position to keys ``past`` owns (every key when None): another node's
        keys came due and went there, not here."""
        came = took = edges = 0
        replayed: dict[str, Replayed] = {}
        while True:
            batch = self.store.due_history(after_seq, self.feed_seq, REPLAY_BATCH)
            changes = batch
            if past is not None:  # one C call a batch
                mine = set(past.mine([ch.key for ch in batch]))
                changes = [ch for ch in batch if ch.key in mine]
            for ch in changes:
                if type(ch.key) is not str:
                    continue  # text that is not UTF-8: no key the node ever held
                at = max(since, int(ch.at // 60))
                last = replayed.get(ch.key)
                before = since if last is None else last.minute
                old = None if ch.old_due_at is None else int(ch.old_due_at // 60)
                if old is not None and before < old <= at:
                    came += 1  # the clock brought it due before this change
                was_due = old is not None and old <= at
                new = None if ch.op == OP_DELETE or ch.due_at is None else int(ch.due_at // 60)
                leased = ch.origin != ORIGIN_WRITEBACK and self._leased_at(ch, last, since)
                edges += leased
                if new is not None and new <= at:
                    came += not was_due
                elif was_due and ch.origin != ORIGIN_WRITEBACK and not leased:
                    took += 1
                replayed[ch.key] = Replayed(at, ch.seq, new)
            if len(batch) < REPLAY_BATCH:
                return came, took, edges, replayed
            after_seq = batch[-1].seq

    def _moved_in(self, past: Ownership, since: int, minute: int) -> tuple[int, int]:
        """The rows held now that ``past`` (the saved counts' ownership) did
        not own: another node's when the counts were saved, so their
        occurrences are not in them. ``(crossed, came)``: how many the
        clock brought due since the saved minute (in the buckets' count of
        crossings, which leaves them out), and how many are due now and not
        leased: received here, as the walk after a membership change counts
        a row it gains (a key leased here was routed here, received once)."""
        crossed = came = 0
        rows = self.buckets.items()  # (a str a key made as read: a chunk at a time)
        while chunk := list(islice(rows, MOVED_CHUNK)):
            was_mine = set(past.mine([row[0] for row in chunk]))
            for key, held_minute, _cid, _version in chunk:
                if held_minute > minute or key in was_mine:
                    continue
                crossed += held_minute > since
                came += not self._leased_in_table(key)
        return crossed, came

    def _moved_out(self, since: int, minute: int, replayed: dict[str, Replayed]) -> tuple[int, int]:
        """The rows the saved counts' ownership owned that are not held now
        (another node's, or left out for one while the load ran): each due
        now, per its last change replayed or, when none came after the
        load read it, per that read, moved out. ``(came, took)``: those the
        clock brought due since their last change (or the saved minute),
        received as a held row would have been, and those no lease holds,
        withdrawn; a leased one stays fenced, in flight here until its lease
        ends (keeper/owned.py)."""
        left = self._left_out
        get = self.buckets.get
        came = took = 0
        for key in left.keys() | replayed.keys():
            if get(key) is not None:
                continue  # held: counted as a held row
            read, last = left.get(key), replayed.get(key)
            if last is not None and (read is None or last.seq >= read[1]):
                due, changed = last.due_minute, last.minute
            else:
                due, changed = read[0], since  # type: ignore[index]  # one of the two is there
            if due is None or due > minute:
                continue
            came += due > max(since, changed)
            if self._leased_in_table(key):
                self.fenced.add(key)
            else:
                took += 1
                # Held by a miss (a lease saved over the restart expired)?
                # A late result takes the withdrawal back (keeper/owned.py).
                self._note_missed_out(key)
        return came, took

    def _leased_in_table(self, key: str) -> bool:
        """Whether a lease holds ``key`` now, asked of the lease table
        itself: at the load's end the keys it keeps out may not have been
        followed yet (that is the first publish's work)."""
        if self.leases is None:
            return False
        found = self.leases.lookup(key)
        return found is not None and found[0] in LEASED_NAMES

    def _finished_unapplied(self, key: str, version: int) -> bool:
        """Whether the occurrence of ``key`` held at ``version`` was routed
        and its lease ended by a result whose write-back this keeper has not
        applied: the key's slot is idle after a result, for a lease of that
        very version. The write-back takes the row out of the due state
        without a count (docs/accounting.md), so a drop before it counts no
        withdrawal either: the occurrence left the books when it was
        routed. (Found by the partition campaign: a keeper whose feed
        stalled on a cut connection rejoined with the results of its last
        leases written back and their leases ended, and counted each key
        withdrawn too, −16 and −20.)"""
        found = self.leases.lookup(key) if self.leases is not None else None
        return _ended_by_result(found, version)

    def _leased_at(self, ch: Any, last: Replayed | None, since: int) -> bool:
        """Whether a lease held ``ch.key`` when the replayed write ``ch`` was
        made, as the lease table shows at the load's end (the keys kept out
        are not followed yet then): a lease live now and granted before the
        write (its version below the write's seq), or one ended by a result
        for the version the write replaced (no replayed change of the key
        since that version) and granted after the saved counts' minute, so
        that its result's write-back lost to this write, not a row that came
        due again later. (Found by the partition campaign: a node restarted
        while another ran its keys counted the other's write-backs as
        withdrawals, −2 and −6.)"""
        found = self.leases.lookup(ch.key) if self.leases is not None else None
        if found is None or found[1].version >= ch.seq:
            return False
        if found[0] in LEASED_NAMES:
            return True
        rec = found[1]
        return (
            _ended_by_result(found, rec.version)
            and (last is None or last.seq <= rec.version)
            and rec.granted_at >= since * 60
        )

    def _leased(self, key: str) -> bool:
        """Whether a lease (not a hold or a parking) keeps ``key`` out now."""
        if self.leases is None or key not in self.exclude:
            return False
        found = self.leases.lookup(key)
        return found is not None and found[0] in LEASED_NAMES

    def _leased_now(self, key: str, before: tuple[int, int, int], exclude: Any) -> bool:
        """Whether a lease holds held ``key`` now, for a write the feed
        applies: a key among the excluded ones, or a due one granted since
        the last publish (the excluded keys are followed at each publish
        only; a write that takes a due row out while it is leased is an
        edge of the input law, not a withdrawal: docs/accounting.md)."""
        if self.leases is None or (key not in exclude and before[0] > self.buckets.due_through):
            return False
        found = self.leases.lookup(key)
        if found is None:
            return False
        if found[0] in LEASED_NAMES:
            return True
        # Ended by a result, for the very version held: the write came while
        # that lease was live, and its result's write-back, which would have
        # come first otherwise, lost to it (the version guard). A keeper
        # whose feed was stalled (a cut connection) applies such a write
        # after the lease ended; counted withdrawn, the occurrence routed
        # there would be counted twice (found by the partition campaign:
        # another node's write-back of a key both nodes ran, −7).
        return _ended_by_result(found, before[2])

    def _ownership_saved_under(self, saved: dict[str, Any]) -> Ownership | None:
        """The ownership saved counts were taken under (their ``nodes``),
        as this node's; None without one (a single node's, an older
        keeper's) or when it is not this node's (a copied meta)."""
        names = saved.get("nodes")
        if not isinstance(names, list) or self.config.name not in names:
            return None
        try:
            return Ownership([str(name) for name in names], self.config.name)
        except ValueError:  # not a node list this build takes
            return None

    def received(self) -> int:
        """Occurrences that came due, lifetime (counted once the load is done)."""
        if self._loading:
            return int((self._received_saved or {}).get("total", 0))
        return self._received_base + self.buckets.came_due - self._came_due_offset

    def leased_writes_total(self) -> int:
        """Writes to a row while a lease held it, lifetime (the input law's edges)."""
        if self._loading:
            return int((self._received_saved or {}).get("leased_writes", 0))
        return self._leased_writes_base + self.leased_writes

    def withdrawn_total(self) -> int:
        """Occurrences withdrawn before a grant, lifetime."""
        if self._loading:
            return int((self._received_saved or {}).get("withdrawn", 0))
        return self._withdrawn_base + self.withdrawn

    def save_input_counts(self, now: float) -> None:
        """Save the input counts now (a clean leave: ``keeper/loop.py``)."""
        self._save_received(now)

    def _save_received(self, now: float) -> None:
        """Keep the received count over a restart: the count through the
        current minute (the buckets have advanced to it). Not while a
        membership change's walk runs: the rows held are then neither the old
        ownership's nor the new one's, and a successor counts from the save
        before it, as if the change came after."""
        if self._loading or self._reown_pending:
            return
        value: dict[str, Any] = {
            "total": self.received(),
            "minute": int(now // 60),
            "withdrawn": self.withdrawn_total(),
            "leased_writes": self.leased_writes_total(),
            "seq": self.feed_seq,  # every change through it is in the counts
        }
        if self.ownership is not None:
            # The ownership the counts were taken under: a successor under
            # another one counts what moved meanwhile (``_start_received``).
            value["nodes"] = list(self.ownership.nodes)
        try:
            self.store.set_meta(RECEIVED_META, value)
            self._saved_seq = self.feed_seq
        except NodeError as exc:  # a locked or full store: the next write catches up
            log.warn("received_save_failed", error=str(exc))

    # -- the self-checks' and the store's figures -------------------------------

    def restore_counts(self) -> None:
        """At start: go on from the figures a keeper before this one saved."""
        saved = self.store.get_meta(COUNTS_META)
        if isinstance(saved, dict):
            verify = saved.get("verify")
            if isinstance(verify, dict):
                known = {*self.stats.verify, "last_repairs"}  # the last, once a walk ended
                self.stats.verify.update((k, v) for k, v in verify.items() if k in known)
            store = saved.get("store")
            if isinstance(store, dict):
                self.stats.store.update((k, v) for k, v in store.items() if k in STORE_LIFETIME)
        self._counts_saved = self._counted_events()

    def _counted_events(self) -> tuple:
        stats = {"verify": self.stats.verify, "store": self.stats.store}
        return tuple(stats[group].get(name) for group, names in COUNTED_EVENTS for name in names)

    def save_counts(self, now: float, periodic: bool = False) -> None:
        """Save the figures: always when ``periodic``, else only when a
        repair or a store event was counted since the last save. Best-effort:
        a failed save is counted (trust.store.write_failures) and retried."""
        events = self._counted_events()
        if not periodic and (events == self._counts_saved or now < self._counts_retry_at):
            return
        value = {
            "verify": dict(self.stats.verify),
            "store": {name: self.stats.store.get(name) for name in STORE_LIFETIME},
        }
        try:
            self.store.set_meta(COUNTS_META, value)
        except NodeError as exc:  # a locked or full store: tried again later
            self._write_failed("save_counts", exc, now)
            self._counts_retry_at = now + self.config.state_interval_s
            return
        self._counts_saved = events


def _ended_by_result(found: Any, version: int) -> bool:
    """Whether a key's slot (``LeaseTable.lookup``'s answer) is idle after a
    result, for a lease of the row's ``version``."""
    return (
        found is not None
        and found[0] == "idle"
        and found[1].ended == Ended.RESULT
        and found[1].version == version
    )
