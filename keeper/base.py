"""The keeper's state: every field ``Keeper`` holds, set in one ``__init__``,
and the few small steps every concern uses (the phase it reports, exactness,
the pause flags).

``Keeper`` (keeper/loop.py) is this state with one class of methods a
concern on top: ``Feed`` (keeper/feed.py: the change feed and the load),
``Publish`` (keeper/publish.py: best-K, the ready set, lease following),
``Verify`` (keeper/verify.py: the top check, the verification walk) and
``Report`` (keeper/report.py: the state document, flow, the received count).
Each concern's class derives from ``KeeperBase``; a method one concern calls
on another is named below for the type checker only (at run time the
combined class has the real one), so the split costs no call anything.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from keeper.buckets import Buckets
from keeper.classes import ClassTable
from keeper.lag import LagWindow
from keeper.owners import Ownership
from node.core.config import Config
from node.store.base import Store

if TYPE_CHECKING:
    from keeper.outage import StoreOutage
    from keeper.verify import VerifyWalk

# Minutes of flow kept (the contract's "last hour").
FLOW_MINUTES = 60


class Stats:
    """Figures the keeper reports in the trust group of queue-state."""

    def __init__(self) -> None:
        self.load: dict[str, Any] = {
            "rows": 0,
            "unreadable": 0,
            "started_at": None,
            "first_publish_s": None,
            "done_s": None,
            # A fleet keeper started under another ownership than its saved
            # counts were taken under (keeper/report.py, ``_start_received``):
            # the due rows it holds that were another node's (received) and
            # those it held that are another node's now (withdrawn).
            "moved_in": 0,
            "moved_out": 0,
        }
        self.publish: dict[str, Any] = {"count": 0, "last_ms": None, "max_ms": 0.0, "size": 0}
        self.verify: dict[str, Any] = {
            "runs": 0,
            "last_at": None,
            "last_s": None,
            "compared": 0,
            "repairs": 0,
            "repairs_feed_missed": 0,
            "repairs_membership": 0,
            "top_checked": 0,
            "top_repairs": 0,
        }
        self.apply: dict[str, Any] = {
            "changes": 0,
            "invalid": 0,
            "refused_classes": 0,
            "feed_s": 0.0,  # time in drain_feed, reading the feed included
        }
        # The store's health through errors (keeper/outage.py): trust.store.
        self.store: dict[str, Any] = {
            "state": "ok",  # or "unreachable"
            "since": None,
            "attempts": 0,
            "error": None,
            "outages": 0,
            "resumed": 0,  # outages the feed resumed after (nothing missed)
            "walks": 0,  # outages a verification walk repaired after
            "gaps": 0,  # changes missing from the change log (trimmed unread)
            "reloads": 0,
            "last_down_s": None,
            "last_verdict": None,
            "write_failures": 0,
            "last_write_error": None,
            # The keeper's trims of the change log since it started, and the
            # bound of the last (in a fleet: what every node still holds).
            "trims": 0,
            "trim_through": None,
        }
        # Commit-to-applied lag of recent changes, by origin, for p50/p99.
        self.lag_node = LagWindow()
        self.lag_outside = LagWindow()

    def lag_figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, window in (("node", self.lag_node), ("outside", self.lag_outside)):
            figures = window.figures()
            if figures is not None:
                out[name] = figures
        changes = self.apply["changes"]
        out["apply_us"] = round(self.apply["feed_s"] * 1e6 / changes, 3) if changes else None
        return out


# ``shared_classes`` default: attach the class table of the node named in the
# configuration, when one runs.
BY_NAME: Any = object()


class KeeperBase:
    def __init__(
        self,
        config: Config,
        store: Store,
        ready: Any,
        state: Any,
        *,
        test_hooks: bool = False,
        leases: Any = None,
        shared_classes: Any = BY_NAME,
    ) -> None:
        self.config = config
        # The lease table (shm/leases/), once the work path runs: its
        # leased, held and parked keys are left out of every publish.
        self.leases = leases
        self.store = store
        self.ready = ready
        self.state = state
        self.test_hooks = test_hooks
        # A fleet node's membership (keeper/fleet.py, set by the loop); None
        # on a store without one (SQLite).
        self.fleet: Any = None
        # Which keys this node owns among the live list (keeper/owned.py);
        # None: every key (no fleet).
        self.ownership: Ownership | None = None
        # Leased keys a membership change dropped (keeper/owned.py): in
        # flight here, held by another node (or held here again as a new
        # occurrence, after this node lapsed and came back); not waiting here.
        self.fenced: set[str] = set()
        # Fenced keys held here again whose lease ended with a result: the
        # ledger's write-back of that result, when the feed applies it,
        # takes out the occurrence held here (withdrawn), not the one the
        # fenced lease ran (keeper/feed.py). Key -> the top of the change log
        # when its lease was seen ended: the write-back (committed before the
        # lease ended) is at or below it; past it, a write-back is a later
        # lease's.
        self.fenced_results: dict[str, int] = {}
        # Keys withdrawn while a miss held them (their lease expired or was
        # released: requeued, and waiting until a write or a membership
        # change took them out), by that lease's id: a result for it
        # accepted late (LATE) takes the requeue back, and so the withdrawal
        # (keeper/owned.py, ``_follow_missed_out``).
        self.missed_out: dict[str, int] = {}
        if shared_classes is BY_NAME:
            # The node's shared class table (shm/classes.py); a keeper run
            # without a node (tests, tools) has none and keeps its own limit.
            from shm.classes import attach_or_none

            shared_classes = attach_or_none(config.name)
        self.classes = ClassTable(config, shared_classes)
        self.buckets = Buckets(self.classes, remember_best=leases is not None)
        self.status = "loading"
        self.exact = False
        self.feed_seq = 0
        self.stats = Stats()
        self.paused_routes: frozenset[str] = frozenset()
        self.paused_node = False
        self.paused_nodes: list[str] = []  # in a fleet, every node paused (keeper/owned.py)
        self._next_pause_read = 0.0
        self._handover_until = 0.0  # monotonic: a joined node publishes nothing until then
        # Occurrences that came due (``received``): the count saved by the
        # last run plus what this run's buckets counted since its load.
        self._received_base = 0
        self._came_due_offset = 0
        self._received_saved: dict[str, Any] | None = None
        # The figures of trust.verify and trust.store as last saved in the
        # store's meta (keeper/report.py, COUNTS_META), and when a save that
        # failed is tried again.
        self._counts_saved: tuple = ()
        self._counts_retry_at = 0.0
        # Occurrences withdrawn before a grant (``withdrawn``): a due row not
        # leased that a write (not the node's own write-back) deleted or moved
        # past the current minute. Lifetime: the saved count plus this run's.
        self.withdrawn = 0
        self._withdrawn_base = 0
        # Writes (not write-backs) to a row while a lease held it: each may
        # put the input law off by one (the bound ``gaps.input_edges``).
        self.leased_writes = 0
        self._leased_writes_base = 0
        # The feed position the last saved counts include: the change log is
        # trimmed no further (a successor replays what came after it).
        self._saved_seq = 0
        # The ownership the saved counts were taken under (their ``nodes``;
        # None: a save without them, an older keeper's or a single node's),
        # and the rows it owned that this load left out, another node's
        # now: key -> (due minute, version). What moved while no keeper
        # counted is counted at the load's end (keeper/report.py).
        self._saved_ownership: Ownership | None = None
        self._left_out: dict[str, tuple[int, int]] = {}
        # A membership change whose walk has not ended: the rows held are
        # not yet those of the current ownership, so no input count is saved
        # until it ends (a successor counts from the last save instead).
        self._reown_pending = False
        # Keys of rows refused (too many classes) while due: counted
        # received and held nowhere, until a write of the key takes them out.
        self.refused_due: set[str] = set()
        # Counter values at the last flow sample: the deltas go to the minute.
        self._came_due_mark = 0
        self._grants_mark: int | None = None
        # Keys left out of the last publish because they were leased, held or
        # parked (the lease table's own record of what it reported, kept in
        # step by excluded_changes): a new write of one clears its misses and hold.
        self.exclude: AbstractSet[str] = leases.excluded if leases is not None else frozenset()
        self._load_after: str | None = None
        self._loading = True
        self._tombstones: dict[str, int] = {}
        # A self check's read in progress (keeper/verify.py): the feed keeps
        # the deletes it applies as tombstones, as during the load, so a row
        # read before its delete was applied is not put back.
        self._reading = False
        self._verify: VerifyWalk | None = None
        self._top_checked: dict[str, float] = {}
        self._top_check_due = 0.0
        self._top_trim_due = 0.0
        # The sets claimers may still take from, by ready-set slot, best first:
        # the active one and the next, published ahead (shm/ready/), each
        # as written. With a lease table their keys are detached while their
        # set is live (``_out``), so that the next set leaves them out; a set
        # claimers moved on from is retired at the next publish: its keys
        # come back but for those the lease table now keeps out.
        self._sets: dict[int, list[str]] = {}
        self._out: set[str] = set()
        # The keys of ``_out`` the lease table keeps out too (granted from a
        # live set, nearly always): they stay detached when their set retires.
        self._out_excluded: set[str] = set()
        # A store error under way (keeper/outage.py), and why the copy may
        # differ from the table until a verification walk ends (a gap in the
        # change log, a replaced file): exact only after it.
        self._outage: StoreOutage | None = None
        self._doubt: str | None = None
        self._doubt_gen = 0  # one more at each doubt: a walk answers the one it started under
        self._next_store_check = 0.0
        self._write_failure_logged = 0.0
        self._flow: deque[tuple[int, dict[str, int]]] = deque(maxlen=FLOW_MINUTES)
        self._caught_up = False
        self._t_start = 0.0  # perf_counter at ``start``
        self.next_publish = 0.0
        self.next_state = 0.0
        self.next_trim = 0.0
        self.next_verify = 0.0
        self._published_at = 0.0
        self._published_waiting = False  # the last publish was empty, waiting for peers

    if TYPE_CHECKING:
        # What one concern calls on another (the combined class has them).
        def drain_feed(self, now: float) -> int: ...
        def publish(self, now: float, ahead: bool = False) -> None: ...
        def start_verify(self, now: float) -> None: ...
        def _check_top(self, top: list[str], now: float) -> None: ...
        def _flow_minute(self, now: float) -> dict[str, int]: ...
        def _start_received(self, now: float) -> None: ...
        def _leased(self, key: str) -> bool: ...
        def _finished_unapplied(self, key: str, version: int) -> bool: ...
        def _leased_now(self, key: str, before: tuple[int, int, int], exclude: Any) -> bool: ...
        def _sample_flow(self, now: float) -> None: ...
        def write_state(self, now: float) -> None: ...
        def save_counts(self, now: float, periodic: bool = False) -> None: ...
        def ready_low(self, now: float) -> bool: ...
        def _low_water_min_s(self) -> float: ...
        def _write_failed(self, what: str, exc: Exception, now: float) -> None: ...
        def _feed_gap(self, first_seq: int, now: float) -> None: ...
        def _owned(self, keys: Sequence[str]) -> set[str] | None: ...
        def fenced_in_flight(self) -> int: ...
        def _note_missed_out(self, key: str) -> None: ...
        def fleet_tick(self, now: float) -> None: ...
        def handover_left_s(self) -> float: ...
        def _follow_leases(self, now: float) -> None: ...
        def _withdraw(
            self, key: str, before: tuple[int, int, int], after: tuple[int, int, int] | None
        ) -> None: ...

    def _phase(self) -> str:
        if self._outage is not None:
            return f"store unreachable, try {self._outage.attempts}"
        if self._loading:
            return f"walking {self.stats.load['rows']} rows"
        if self._verify is not None:
            done = self._verify.compared * 100 // self._verify.total
            return f"verifying {min(done, 100)}%"
        return "serving" if self.exact else "catching up"

    def _set_exact(self, exact: bool, now: float) -> None:
        if exact != self.exact:
            self.exact = exact
            self.state.heartbeat(now, self.status, self.exact, self._phase())
            if exact:
                # Readers vouch only for counts taken while exact
                # (shm/state.py, write_doc): count again at the next tick.
                self.next_state = 0.0

    def _doubt_copy(self, kind: str, now: float) -> None:
        """The copy may differ from the table (``kind``: a store error's
        verdict, a gap in the change log, a membership change): not exact
        until a walk started after this ends (keeper/verify.py); a walk under
        way restarts from the first key."""
        self._doubt = kind
        self._doubt_gen += 1
        self._verify = None
        if self.status == "verifying":
            self.status = "live"
        self._set_exact(False, now)

    def _read_paused(self) -> None:
        """Re-read what is paused; a change (a pause written by another
        process, or in a fleet by another node) is published at once: no set
        may go on offering a paused route's keys."""
        routes = frozenset(self.store.get_meta("paused_routes", []) or [])
        node = bool(self.store.get_meta("paused_node", False))
        if routes != self.paused_routes or node != self.paused_node:
            self.paused_routes, self.paused_node = routes, node
            self.next_publish = 0.0
