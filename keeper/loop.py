"""``python -m keeper``: the keeper process's loop, started by the supervisor.
It feeds ``Keeper.tick`` (keeper/process.py) the wall clock, waits on the
wake semaphore between ticks, and answers workers' questions between them.

Who posts the wake semaphore: the node's own writers, claimers that drained
the ready set, askers (keeper/ask.py) and, on PostgreSQL, the keeper's own
LISTEN thread (``ListenThread``, node/store/postgres_feed.py) on every
commit to the schedule, whoever made it. With that thread listening, the
poll for writes is a fallback, ``LISTEN_POLL_S`` apart; while it is not
(connecting, reconnecting after an error) or while the feed waits on a seq
whose writer may roll back (``Store.holes_pending``: a rollback notifies
nobody) the keeper polls every ``OUTSIDE_POLL_S`` as on SQLite.
Environment: ``QUEUE_NODE_KEEPER_LISTEN=0`` turns the thread off (polling
only), ``QUEUE_NODE_KEEPER_POLL_S`` sets the fallback (a bench compares the
two; docs/postgres.md).

Signal handlers only set flags; the loop acts on them between ticks. They
are set before the keeper's modules are imported.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from node.core import log
from node.core.config import load_run_config
from node.core.proc import RET_ERROR, RET_OK, child_signals, die_with_parent, set_title

_flags = {"stop": False, "reload": False, "leave": False}

# The fallback poll of a keeper that a LISTEN thread wakes: a notification
# lost without its connection failing (none is known) still reaches the
# keeper within this, and so does anything the loop waits for that posts
# nothing. Bounds for QUEUE_NODE_KEEPER_POLL_S.
LISTEN_POLL_S = 0.5
# A fleet keeper's wait for the change log's seqs to settle (PostgreSQL's
# ``last_seq``), as a share of the membership timeout: the grant deadline
# lapses 0.8 of it after a heartbeat, and a tick must not outlast that.
SETTLE_WAIT_FRACTION = 0.25
# A fleet keeper's store connections fail this soon (a share of the
# membership timeout) when the database stops answering, instead of after
# about 10 s: a read in flight when the network is cut holds the loop, and
# with it the heartbeat, until then (or until TCP's retransmissions get
# through after the heal, seconds later); failed, the keeper serves its copy
# through an outage and heartbeats on (keeper/outage.py reopens the store
# off the loop).
NETWORK_TIMEOUT_FRACTION = 0.25
NETWORK_TIMEOUT_MAX_S = 10.0
POLL_S_RANGE = (0.02, 600.0)
ENV_LISTEN = "QUEUE_NODE_KEEPER_LISTEN"
ENV_POLL_S = "QUEUE_NODE_KEEPER_POLL_S"
# The least time between two wakes the thread passes on (a bench compares).
ENV_MIN_GAP_S = "QUEUE_NODE_KEEPER_LISTEN_GAP_S"
GAP_S_RANGE = (0.0, 0.1)


def _on_term(signum: int, frame: object) -> None:
    _flags["stop"] = True


def _on_hup(signum: int, frame: object) -> None:
    _flags["reload"] = True


def _on_usr1(signum: int, frame: object) -> None:
    _flags["leave"] = True  # the supervisor's drain began: leave the fleet now


def _fleet_tick(fleet: Any, keeper: Any, leave: bool = False) -> None:
    """A fleet node's heartbeat when due (keeper/fleet.py), and the rows
    the live list makes its own (keeper/owned.py); it leaves once the
    supervisor's drain began (SIGUSR1) or the loop ends."""
    if fleet is None:
        return
    if leave or _flags["leave"]:
        if not fleet.left:
            # The counts through this moment, saved: a restart replays the
            # changes after them (the log keeps them for trim_hold_s).
            keeper.save_input_counts(time.time())
        fleet.leave()
    if fleet.tick(keeper.resume_seq()) and fleet.live is not None:
        keeper.reown(fleet.live.names, time.time())
    if fleet.peer_wait_over():
        keeper.next_publish = 0.0  # the first real publish, now
    if fleet.lapsed:
        fleet.lapsed = False
        keeper.rejoined(fleet.trimmed_through(), time.time())


def _bound_settle_wait(store: Any, config: Any) -> None:
    """A transaction left open on the server (any database there: a node cut
    in the middle of a write) holds back the settling of the change log's
    seqs (PostgreSQL's ``last_seq``). The heartbeat runs in this loop, so the
    keeper's wait stays well inside its margin: past it the keeper serves
    its copy through an outage and heartbeats on, instead of every node of
    the fleet lapsing at once."""
    if hasattr(store, "settle_wait_s"):
        bound = config.membership_timeout_s * SETTLE_WAIT_FRACTION
        store.settle_wait_s = min(store.settle_wait_s, bound)


def _env_seconds(name: str, default: float, bounds: tuple[float, float]) -> float:
    """A duration from the environment; out of ``bounds`` or not a number:
    a warning, and ``default``."""
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not bounds[0] <= value <= bounds[1]:  # NaN fails too
        log.warn("keeper_env_ignored", name=name, value=text, range=list(bounds), using=default)
        return default
    return value


def _start_listening(config: Any, keeper: Any, wake: Any) -> Any:
    """A fleet store's LISTEN thread, posting ``wake`` (None on SQLite, or
    when the environment turns it off: the keeper then polls)."""
    from node.store import is_fleet_url

    if not is_fleet_url(config.store_url):
        return None
    if os.environ.get(ENV_LISTEN, "1") == "0":
        keeper.stats.store["listen"] = {"state": "off"}
        return None
    from node.store.postgres_feed import LISTEN_MIN_GAP_S, ListenThread

    listener = ListenThread(
        config.store_url, wake.post, application_name=f"queue-node listen {config.name}",
        log=log.warn, min_gap_s=_env_seconds(ENV_MIN_GAP_S, LISTEN_MIN_GAP_S, GAP_S_RANGE),
    ).start()  # fmt: skip
    keeper.outside_poll_s = _env_seconds(ENV_POLL_S, LISTEN_POLL_S, POLL_S_RANGE)
    keeper.stats.store["listen"] = listener.figures  # trust.store.listen
    listener.figures["poll_s"] = keeper.outside_poll_s
    return listener


def main() -> int:
    die_with_parent()
    child_signals()
    set_title("qn-keeper")
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGHUP, _on_hup)
    signal.signal(signal.SIGUSR1, _on_usr1)
    config = load_run_config("keeper")
    log.setup("keeper", verbose=bool(os.environ.get("QUEUE_NODE_VERBOSE")))

    from keeper.ask import AskServer
    from keeper.fleet import FleetMember
    from keeper.outage import KeeperReload, open_when_there
    from keeper.process import OUTSIDE_POLL_S, Keeper
    from node.core import metrics
    from shm.leases import LeaseTable
    from shm.ready import ReadySet
    from shm.state import StateBuffer
    from shm.wake import Wake

    ready = ReadySet.attach(config.name)
    state = StateBuffer.attach(config.name)
    wake = Wake.attach(config.name)
    # Never a new empty file for a store that went away: wait for it.
    store = open_when_there(
        config.store_url, state, wake.wait, lambda: _flags["stop"], node_name=config.name,
        network_timeout_s=min(NETWORK_TIMEOUT_MAX_S,
                              config.membership_timeout_s * NETWORK_TIMEOUT_FRACTION),
    )  # fmt: skip
    if store is None:
        state.heartbeat(time.time(), "stopped", False, "stopped")
        log.log("keeper_stop", rows=0, reason="stopped while waiting for the store")
        return RET_OK
    _bound_settle_wait(store, config)
    asks = AskServer(config.name)
    leases = LeaseTable.attach(config.name)
    keeper = Keeper(
        config,
        store,
        ready,
        state,
        test_hooks=os.environ.get("QUEUE_NODE_TEST_HOOKS") == "1",
        leases=leases,
    )
    # A fleet node (PostgreSQL) joins before its first publish; the supervisor
    # set its deadline in the past, so nothing is granted until a heartbeat.
    fleet = keeper.fleet = FleetMember.for_store(config, ready)
    _fleet_tick(fleet, keeper)
    metrics.start()  # made now, not on the first observation inside the hot loop
    # Started before the load: the keeper polls until LISTEN is in place,
    # and the thread posts the wake once it is.
    listener = _start_listening(config, keeper, wake)
    keeper.start(time.time())
    log.log("keeper_start", feed_seq=keeper.feed_seq)
    was_loading = True
    while not _flags["stop"]:
        _fleet_tick(fleet, keeper)
        now = time.time()
        try:
            wait_s = keeper.tick(now)
        except KeeperReload as exc:  # another, older file: a fresh keeper loads it
            log.error("keeper_reload", reason=str(exc))
            if listener is not None:
                listener.stop()
            return RET_ERROR
        if was_loading and keeper.status != "loading":
            was_loading = False
            log.log("keeper_live", held=len(keeper.buckets), **keeper.stats.load)
        for request in asks.poll():
            asks.answer(request, keeper.answer(request, time.time()))
        if _flags["reload"]:
            _flags["reload"] = False
            new_config = load_run_config("keeper")
            keeper.buckets.reconfigure(new_config)
            keeper.config = new_config
            keeper.next_publish = 0.0
            log.log("keeper_reconfigured", classes=len(keeper.classes))
            continue
        if fleet is not None:
            wait_s = min(wait_s, fleet.wait_s())
        if listener is not None and (not listener.listening or keeper.store.holes_pending()):
            wait_s = min(wait_s, OUTSIDE_POLL_S)  # nothing would tell the keeper: poll
        if wait_s > 0:
            wake.wait(wait_s)
    _fleet_tick(fleet, keeper, leave=True)  # stop granting, then out of the list at once
    if listener is not None:
        listener.stop()
    state.heartbeat(time.time(), "stopped", False, "stopped")
    log.log(
        "keeper_stop",
        rows=len(keeper.buckets),
        changes_applied=keeper.stats.apply["changes"],
        publishes=keeper.stats.publish["count"],
        repairs=keeper.stats.verify["repairs"] + keeper.stats.verify["top_repairs"],
    )
    asks.close()
    leases.close()
    keeper.store.close()  # the one it reopened after a store error, if it did
    return RET_OK
