"""The node's Prometheus metrics: what each process records, and the scrape's text.

Two kinds of numbers reach ``GET /metrics`` (``docs/metrics.md`` lists them all):

- **Recorded here**, by the process that sees the event: the keeper's apply,
  publish and lag histograms, the claim latency, HTTP requests and grants per
  worker. These add up across the node's processes in prometheus_client's
  multiprocess mode (below).
- **Read at scrape time** (``workers.http.metrics``): the ledger's lifetime
  counters, the state buffer's gauges, the lease table's counts. They must
  equal what ``/accounting`` and ``/queue-state`` say, so nobody increments a
  copy of them here.

Multiprocess mode. The supervisor owns ``<data-dir>/metrics`` (mode 0700): it
empties it when the node starts, puts its path in every child's environment
as ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client reads it once, at import,
so it must be there before the child starts), and calls ``process_died(pid)``
when a child exits. Each process writes its values into memory-mapped files
``<type>_<pid>.db`` there; a scrape sums every file. The files of a dead
process are kept (``mark_process_dead`` removes only live gauges, and we have
none), so a worker killed and restarted still counts what it did before.

Outside a node (tests, bench, ``LocalClaimer`` users) the variable is unset and
the values live in this process's own registry. If the variable names a
directory that cannot be used, recording is switched off rather than breaking
the process: metrics must never take the node down.

Hot paths: ``observe_apply`` is called by the keeper once per feed batch, the
others a few times per batch or once per request. One observe in
multiprocess mode costs about 2 us (docs/metrics.md, with the command).
"""

from __future__ import annotations

import glob
import os
import threading
from pathlib import Path
from typing import Any

ENV_DIR = "PROMETHEUS_MULTIPROC_DIR"
DIR_NAME = "metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket upper bounds, in seconds. Few buckets keep an observe cheap (it scans
# them in Python) and a scrape small; each range covers what is normal and
# what is pathological for its path.
# Seconds per applied change: ~1-5 us is healthy at 15,000 changes/s.
APPLY_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 1e-4, 1e-3, 1e-2)
# One ready-set publish: the best K of a merge, normally milliseconds.
PUBLISH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
# A change's age when the keeper applies it: the change feed's delay.
LAG_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    15.0,
    60.0,
    300.0,
)
# One POST /claim: tens of microseconds a grant, more for big claims.
CLAIM_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1, 0.5, 2.5)

# The store's change origins, as the lag histogram labels them.
LAG_ORIGINS = {
    "node": "node",
    "writeback": "node",
    "outside": "outside",
    "external": "outside",
}

# HTTP methods the API serves; anything else is counted as "other", so a
# client cannot grow the label set.
HTTP_METHODS = frozenset({"GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"})


def multiprocess_dir() -> str | None:
    """The directory this process records into, or None outside a node."""
    return os.environ.get(ENV_DIR) or None


# -- the supervisor's side -----------------------------------------------------------


def prepare_dir(data_dir: str | os.PathLike[str]) -> Path:
    """Supervisor, at the node's start: create ``<data_dir>/metrics`` (0700)
    and empty it. Values recorded by a previous run are gone: per-process
    counters count since the node started (Prometheus sees a counter reset);
    the lifetime counters come from the ledger, not from these files."""
    path = Path(data_dir) / DIR_NAME
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask, and skipped if it exists
    for stale in glob.glob(os.path.join(path, "*.db")):
        os.remove(stale)
    return path


def process_died(pid: int, path: str | os.PathLike[str]) -> None:
    """Supervisor, when a child exits: prometheus_client's bookkeeping for a
    dead process (drops its live gauges; keeps its counters and histograms)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(path))


# -- definitions --------------------------------------------------------------------


class _Recorders:
    """The metrics this process records, made on first use.

    Made lazily so that importing this module costs nothing and a process
    that records nothing creates no files."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        # A registry of our own (never the global one): in multiprocess mode
        # it is not what a scrape reads (the files are), and outside a node it
        # keeps tests from seeing each other's metrics through a global.
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.apply = Histogram(
            "queue_node_keeper_apply_seconds",
            "Seconds the keeper took per applied change (batch time / changes).",
            buckets=APPLY_BUCKETS,
            registry=r,
        )
        self.publish = Histogram(
            "queue_node_keeper_publish_seconds",
            "Seconds one ready-set publish took.",
            buckets=PUBLISH_BUCKETS,
            registry=r,
        )
        lag = Histogram(
            "queue_node_keeper_lag_seconds",
            "Age of a change when the keeper applied it, by who wrote it.",
            ["origin"],
            buckets=LAG_BUCKETS,
            registry=r,
        )
        # Children made up front: labels() costs a lookup per call, and the
        # family is exported (with zero counts) before the first change.
        self.lag = {origin: lag.labels(label) for origin, label in LAG_ORIGINS.items()}
        self.claim = Histogram(
            "queue_node_claim_seconds",
            "Seconds one POST /claim took, from its arguments to its grants.",
            buckets=CLAIM_BUCKETS,
            registry=r,
        )
        self.grants = Counter(
            "queue_node_claim_grants",
            "Leases granted through POST /claim, counted by the worker that granted them.",
            registry=r,
        )
        self.http = Counter(
            "queue_node_http_requests",
            "HTTP requests answered by the workers, by method and status.",
            ["method", "status"],
            registry=r,
        )


_recorders: _Recorders | None = None
_disabled = False
# Made once per process: a second set would keep its own copy of each value
# and the two would overwrite each other in the file. A worker records on its
# event loop and renders scrapes on a thread, so the first use may race.
_making = threading.Lock()


def _get() -> _Recorders | None:
    global _recorders, _disabled
    with _making:
        if _recorders is None and not _disabled:
            try:
                _recorders = _Recorders()
            except (OSError, ValueError) as exc:  # the directory is missing or unwritable
                _disabled = True
                from node.core import log

                log.warn("metrics_disabled", error=str(exc), dir=multiprocess_dir())
    return _recorders


def start() -> None:
    """Make this process's metrics now (they appear in a scrape with zero
    counts). Optional: the first record does it too."""
    _get()


# -- what processes call --------------------------------------------------------------
# Each is a dictionary lookup or two and one or two writes into a mapped file.


def observe_apply(seconds_per_change: float) -> None:
    """Keeper: once per feed batch, the batch's seconds divided by its changes."""
    rec = _recorders or _get()
    if rec is not None:
        rec.apply.observe(seconds_per_change)


def observe_publish(seconds: float) -> None:
    """Keeper: once per ready-set publish."""
    rec = _recorders or _get()
    if rec is not None:
        rec.publish.observe(seconds)


def observe_lag(origin: str, seconds: float) -> None:
    """Keeper: a few times per batch. ``origin`` is ``node`` or ``outside``
    (the store's ``writeback`` counts as node, ``external`` as outside); an
    unknown origin is not recorded."""
    rec = _recorders or _get()
    if rec is not None:
        child = rec.lag.get(origin)
        if child is not None:
            child.observe(seconds)


def observe_claim(seconds: float, granted: int) -> None:
    """Worker: once per POST /claim that was served."""
    rec = _recorders or _get()
    if rec is not None:
        rec.claim.observe(seconds)
        if granted:
            rec.grants.inc(granted)


def count_request(method: str, status: int) -> None:
    """Worker: once per HTTP answer."""
    rec = _recorders or _get()
    if rec is not None:
        rec.http.labels(method if method in HTTP_METHODS else "other", str(status)).inc()


# -- the scrape ----------------------------------------------------------------------


def exposition(*collectors: Any) -> bytes:
    """The text of a scrape: every process's recorded metrics (this process's
    alone outside a node) followed by what ``collectors`` yield now."""
    from prometheus_client import CollectorRegistry, generate_latest

    # A fresh registry per scrape: the collectors read the node as it is now.
    registry = CollectorRegistry(auto_describe=False)
    path = multiprocess_dir()
    rec = _get()
    if path is not None and rec is not None:
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry, path)
    elif rec is not None:
        registry.register(rec.registry)
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry)
