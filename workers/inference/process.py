"""``python -m workers.inference --index I [--gpu G]``: one inference process.

Started by the supervisor when the node has a handler: one per GPU with
``--gpus`` (``CUDA_VISIBLE_DEVICES`` is that card alone, so the handler sees
it as ``cuda:0``), else ``--inference-procs`` of them on the CPU. The
resolved configuration comes from ``QUEUE_NODE_RUN_CONFIG``.

Pull-based: the process claims a batch (``batch_size``) only when it has
nothing running, so nothing it holds ever waits in a queue behind other work;
a drained ready set is waited out on the keeper's next publish, never spun on.
Claims come straight from shared memory (``node.local.LocalClaimer``),
results go to the ledger over local IPC. See docs/inference.md.

One batch, step by step:

1. Claim up to ``batch_size`` leases. Group them by the handler their route
   names (items of different handlers never share a call); an item that
   missed before (or that was in a batch this process saw fail) runs in a
   group of its own, so one poison item cannot fail the same neighbours twice.
2. While the batch runs, the watchdog thread renews its leases every
   ``lease_s / 3``.
3. Each group is one handler call. An exception fails the group: its leases
   are released with the error (a miss each). An exception instance returned
   for one item releases that item alone. Other results are completed.
4. A handler call that runs past ``handler_timeout_s`` is taken as a wedged
   device: the watchdog releases every lease of the batch still open with
   ``handler timeout after Xs`` and the process exits (status 1) for the
   supervisor to start a fresh one. The call itself cannot be interrupted.

Signals: SIGINT is ignored (the supervisor drains us). SIGTERM only records
the time; the loop stops claiming, lets the running batch finish and
completes it, and exits 0 with a one-line summary. A batch still in its
handler when the drain deadline (``drain_timeout_s`` after the signal, less
``DRAIN_MARGIN_S``) comes is released by the watchdog, which then exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from node.core import log
from node.core.config import Config, load_run_config
from node.core.errors import NodeError
from node.core.proc import (
    RET_ERROR,
    RET_OK,
    RET_USAGE,
    ChildArgParser,
    UsageError,
    child_signals,
    die_with_parent,
    set_title,
)
from node.core.rows import result_bytes
from node.handlers import HandlerError
from workers.inference.settings import Handlers, Settings

# Named here too: it was defined here, and tests import it from here.
from workers.inference.settings import default_handler_timeout_s as default_handler_timeout_s

# The longest single wait for a publish: SIGTERM is noticed within this even
# if no publish comes (a handler-only flag does not end a futex wait).
IDLE_WAIT_S = 0.5
# The watchdog looks at the batch at least this often (timeouts, the drain).
WATCH_TICK_S = 0.25
# Leave the supervisor this much of its drain deadline: our releases and
# summary must land before it kills what is left.
DRAIN_MARGIN_S = 1.0
# A result the ledger cannot take (restarting, full disk) is retried this long,
# its lease kept alive meanwhile, before the lease is released instead.
COMPLETE_RETRY_S = 30.0
COMPLETE_BACKOFF_MAX_S = 1.0
# The lease table keeps 48 bytes of an error; the log line gets this much.
ERROR_CHARS = 200
# Keys remembered from failed calls (parked poison keys never leave on their
# own): a bound on memory, far above any batch size.
SUSPECTS_MAX = 10_000

TIMEOUT_ERROR = "handler timeout after {:g}s"
NOT_RUN_ERROR = "not run: batch handler timed out"
DRAIN_ERROR = "node stopping: batch unfinished"

_stop: dict[str, float | None] = {"at": None}


def _on_term(signum: int, frame: object) -> None:
    # Only a flag: the loop and the watchdog act on it.
    if _stop["at"] is None:
        _stop["at"] = time.monotonic()


def stop_requested() -> bool:
    return _stop["at"] is not None


# -- one batch -------------------------------------------------------------------------------


def _field(lease: Any, name: str, default: Any = None) -> Any:
    """A lease's field, whether the claimer answers dicts or named tuples."""
    if isinstance(lease, dict):
        return lease.get(name, default)
    return getattr(lease, name, default)


@dataclass(eq=False)
class Open:
    """A lease of the running batch not yet completed or released."""

    lease_id: int
    key: str
    item: dict[str, Any]
    misses: int
    lost: bool = False  # a renewal found it ended: the result may still be accepted


@dataclass(eq=False)
class Batch:
    open: dict[int, Open]
    # Set while a handler call runs: its start (monotonic), spec and leases.
    call_started: float | None = None
    call_spec: str | None = None
    call_ids: tuple[int, ...] = ()
    next_renew: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, lease_ids: list[int]) -> list[Open]:
        """Remove leases from the open set (to complete or release them)."""
        with self.lock:
            return [o for o in (self.open.pop(i, None) for i in lease_ids) if o is not None]

    def snapshot(self) -> list[Open]:
        with self.lock:
            return list(self.open.values())


@dataclass
class Stats:
    batches: int = 0
    items: int = 0
    completed: int = 0
    failed: int = 0  # items released with an error (their own, or their batch's)
    lost: int = 0  # results the ledger refused: the lease had gone to another holder
    batch_errors: int = 0  # handler calls that raised
    renewals: int = 0
    renew_lost: int = 0
    claims_empty: int = 0
    claims_refused: int = 0

    def summary(self) -> dict[str, int]:
        return {
            "batches": self.batches,
            "items": self.items,
            "completed": self.completed,
            "failures": self.failed,
            "lost": self.lost,
            "batch_errors": self.batch_errors,
        }


def _error_text(exc: BaseException) -> str:
    text = str(exc)
    name = type(exc).__name__
    return (f"{name}: {text}" if text else name)[:ERROR_CHARS]


class Inference:
    """The claim → run → complete loop of one process. ``claimer`` is a
    ``LocalClaimer`` (or a twin with the same methods, in tests)."""

    def __init__(
        self,
        settings: Settings,
        handlers: Handlers,
        claimer: Any,
        routes_of: Callable[[list[str]], dict[str, str]] | None = None,
        exit_process: Callable[[int], None] = os._exit,
    ) -> None:
        self.settings = settings
        self.handlers = handlers
        self.claimer = claimer
        self._routes_of = routes_of
        self._exit = exit_process
        self.stats = Stats()
        # Keys this process saw in a call that raised: each runs alone next
        # time. Insertion-ordered, so the oldest go first past SUSPECTS_MAX.
        self._suspects: dict[str, None] = {}
        self.batch: Batch | None = None
        self._watch_wake = threading.Event()
        self._watch_done = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self.started = time.monotonic()

    # -- main loop -----------------------------------------------------------------

    def run(self) -> int:
        self._watchdog.start()
        try:
            while not stop_requested():
                self.step()
        finally:
            self._watch_done.set()
            self._watch_wake.set()
            self._watchdog.join(timeout=1.0)
        self.log_summary("inference_stop")
        return RET_OK

    def step(self) -> int:
        """Claim one batch and run it. A claim that finds the ready set drained
        waits (inside the claimer, up to ``IDLE_WAIT_S``) for the keeper's
        next publish instead of spinning. Returns the items run."""
        try:
            leases = self.claimer.claim(
                self.settings.batch_size,
                self.settings.lease_s,
                consumer=self.settings.consumer,
                wait_s=IDLE_WAIT_S,
            )
        except NodeError as exc:
            # Not ready (no publish since the node started): nothing was
            # granted; pause and try again.
            self.stats.claims_refused += 1
            if self.stats.claims_refused == 1 or not _retryable(exc):
                log.log("claim_refused", error=str(exc))
            self._watch_done.wait(IDLE_WAIT_S)
            return 0
        if not leases:
            self.stats.claims_empty += 1
            return 0
        self.run_batch(leases)
        return len(leases)

    # -- a batch -------------------------------------------------------------------

    def run_batch(self, leases: list[Any]) -> None:
        stats = self.stats
        stats.batches += 1
        stats.items += len(leases)
        open_ = self._open_leases(leases)
        batch = Batch({o.lease_id: o for o in open_})
        batch.next_renew = time.monotonic() + self.settings.renew_every_s
        self.batch = batch
        self._watch_wake.set()
        try:
            for spec, group in self._groups(open_):
                self._run_group(batch, spec, group)
        finally:
            self.batch = None

    def _open_leases(self, leases: list[Any]) -> list[Open]:
        out = []
        for lease in leases:
            key = _field(lease, "key")
            item = {
                "key": key,
                "payload": _field(lease, "payload"),
                "job": _field(lease, "job"),
                "lease_id": _field(lease, "lease_id"),
                "route": _field(lease, "route"),
            }
            out.append(Open(item["lease_id"], key, item, int(_field(lease, "misses", 0) or 0)))
        if self.handlers.by_route and self._routes_of is not None:
            missing = [o.key for o in out if o.item["route"] is None]
            if missing:
                routes = self._routes_of(missing)
                for o in out:
                    if o.item["route"] is None:
                        o.item["route"] = routes.get(o.key)
        return out

    def _groups(self, open_: list[Open]) -> list[tuple[str, list[Open]]]:
        """Items by handler, in claim order; an item that missed before (or
        was in a batch this process saw raise) alone, so a poison item fails
        by itself instead of taking its neighbours' leases down again."""
        groups: dict[str, list[Open]] = {}
        alone: list[tuple[str, list[Open]]] = []
        for o in open_:
            spec = self.handlers.spec_for(o.item["route"])
            if o.misses > 0 or o.key in self._suspects:
                alone.append((spec, [o]))
            else:
                groups.setdefault(spec, []).append(o)
        return list(groups.items()) + alone

    def _run_group(self, batch: Batch, spec: str, group: list[Open]) -> None:
        live = [o for o in group if o.lease_id in batch.open]
        if not live:
            return
        handler = self.handlers.by_spec[spec]
        with batch.lock:
            batch.call_spec = spec
            batch.call_ids = tuple(o.lease_id for o in live)
            batch.call_started = time.monotonic()
        try:
            results = handler([o.item for o in live])
        except Exception as exc:  # noqa: BLE001 - the user's handler: a failed batch
            self.stats.batch_errors += 1
            error = _error_text(exc)
            log.warn("batch_failed", handler=spec, items=len(live), error=error)
            self._suspect([o.key for o in live])
            self._release(batch, [o.lease_id for o in live], error)
            return
        finally:
            with batch.lock:
                batch.call_started = None
                batch.call_spec = None
                batch.call_ids = ()
        done: list[tuple[Open, Any]] = []
        for o, result in zip(live, results, strict=True):
            if o.lease_id not in batch.open:
                continue  # the watchdog handed it back meanwhile
            self._suspects.pop(o.key, None)
            if isinstance(result, BaseException):
                self._release(batch, [o.lease_id], _error_text(result))
                continue
            try:
                result_bytes(result)
            except (TypeError, ValueError, RecursionError) as exc:
                self._release(batch, [o.lease_id], f"bad result: {_error_text(exc)}")
                continue
            done.append((o, result))
        if done:
            self._complete(batch, done)

    def _suspect(self, keys: list[str]) -> None:
        for key in keys:
            self._suspects[key] = None
        while len(self._suspects) > SUSPECTS_MAX:
            del self._suspects[next(iter(self._suspects))]

    def _release(self, batch: Batch, lease_ids: list[int], error: str) -> None:
        for o in batch.take(lease_ids):
            self.stats.failed += 1
            try:
                self.claimer.release(o.lease_id, o.key, error=error)
            except NodeError as exc:
                # Ended already (expired, granted on): the miss is counted there.
                log.warn("release_refused", key=o.key, error=str(exc))

    # -- results to the ledger ---------------------------------------------------------

    def _complete(self, batch: Batch, done: list[tuple[Open, Any]]) -> None:
        """Send results; retry what the ledger cannot take yet (its leases kept
        alive by the watchdog meanwhile), then release what is still refused."""
        pending = done
        deadline = time.monotonic() + COMPLETE_RETRY_S
        backoff_s = 0.05
        while pending:
            pending = self._complete_once(batch, pending)
            if not pending:
                return
            if time.monotonic() + backoff_s >= min(deadline, self._drain_deadline()):
                log.warn("complete_gave_up", items=len(pending))
                self._release(batch, [o.lease_id for o, _ in pending], "log unavailable")
                return
            self._watch_done.wait(backoff_s)
            backoff_s = min(backoff_s * 2, COMPLETE_BACKOFF_MAX_S)

    def _complete_once(self, batch: Batch, done: list[tuple[Open, Any]]) -> list[tuple[Open, Any]]:
        """One try at every result, in one ledger request (the batch's results
        share one group commit); returns those to retry."""
        try:
            outcomes = self.claimer.complete_many([(o.lease_id, o.key, r) for o, r in done])
        except NodeError as exc:
            if _retryable(exc):
                return done  # nothing is known to be accepted: all again
            outcomes = [exc] * len(done)
        retry = []
        for (o, result), outcome in zip(done, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if _retryable(outcome):
                    retry.append((o, result))
                    continue
                batch.take([o.lease_id])
                self.stats.lost += 1
                log.warn("result_refused", key=o.key, lease_id=o.lease_id, error=str(outcome))
                continue
            batch.take([o.lease_id])
            self.stats.completed += 1
        return retry

    # -- the watchdog thread -------------------------------------------------------------

    def _drain_deadline(self) -> float:
        at = _stop["at"]
        if at is None:
            return float("inf")
        return at + max(0.0, self.settings.drain_timeout_s - DRAIN_MARGIN_S)

    def _watch(self) -> None:
        """Renew the running batch's leases; end a wedged or overlong batch."""
        while not self._watch_done.is_set():
            batch = self.batch
            wait_s = WATCH_TICK_S
            if batch is not None:
                wait_s = min(wait_s, max(0.0, batch.next_renew - time.monotonic()))
            self._watch_wake.wait(wait_s)
            self._watch_wake.clear()
            batch = self.batch
            if batch is not None:
                self.watch_once(batch, time.monotonic())

    def watch_once(self, batch: Batch, now: float) -> None:
        with batch.lock:
            started, spec = batch.call_started, batch.call_spec
        if started is not None and now - started >= self.settings.handler_timeout_s:
            self._handler_timed_out(batch, spec)
            return
        if started is not None and now >= self._drain_deadline():
            self._drain_expired(batch)
            return
        if now >= batch.next_renew:
            batch.next_renew = now + self.settings.renew_every_s
            self._renew(batch)

    def _renew(self, batch: Batch) -> None:
        for o in batch.snapshot():
            if o.lost:
                continue
            try:
                self.claimer.renew(o.lease_id, o.key, self.settings.lease_s)
                self.stats.renewals += 1
            except NodeError as exc:
                if _retryable(exc):
                    continue  # a busy slot: the next round tries again
                o.lost = True
                self.stats.renew_lost += 1
                log.warn("renew_refused", key=o.key, lease_id=o.lease_id, error=str(exc))

    def _handler_timed_out(self, batch: Batch, spec: str | None) -> None:
        """The device may be wedged: hand every open lease back and exit so the
        supervisor starts a fresh process. The stuck call cannot be stopped."""
        error = TIMEOUT_ERROR.format(self.settings.handler_timeout_s)
        with batch.lock:
            running = [i for i in batch.call_ids if i in batch.open]
            later = [i for i in batch.open if i not in batch.call_ids]
        log.error(
            "handler_timeout",
            handler=spec,
            timeout_s=self.settings.handler_timeout_s,
            leases=len(running),
            not_run=len(later),
        )
        self._release(batch, running, error)
        self._release(batch, later, NOT_RUN_ERROR)
        self.log_summary("inference_stop", reason="handler_timeout")
        self._exit(RET_ERROR)

    def _drain_expired(self, batch: Batch) -> None:
        with batch.lock:
            running = [o.lease_id for o in batch.open.values()]
        log.warn("drain_timeout", leases=len(running))
        self._release(batch, running, DRAIN_ERROR)
        self.log_summary("inference_stop", reason="drain_timeout")
        self._exit(RET_OK)

    def log_summary(self, action: str, **extra: Any) -> None:
        log.log(
            action,
            index=self.settings.index,
            consumer=self.settings.consumer,
            up_s=round(time.monotonic() - self.started, 1),
            **self.stats.summary(),
            **extra,
        )


def _retryable(exc: BaseException) -> bool:
    """Whether a refusal may pass (503: a busy slot, a ledger that cannot take
    results yet, a connection to a restarting ledger) rather than being final
    (409: the lease is gone)."""
    status = getattr(exc, "status", None)
    if status is not None:
        return status >= 500
    from node.ipc import IpcError

    return isinstance(exc, IpcError | OSError)


# -- process ---------------------------------------------------------------------------------


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = ChildArgParser("python -m workers.inference")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--gpu", type=int, default=None)
    return p.parse_args(argv)


def _store_routes(config: Config) -> Callable[[list[str]], dict[str, str]]:
    """Routes of keys read from the store, for a claimer whose leases do not
    carry them (only needed when routes name their own handlers)."""
    store: Any = None

    def routes_of(keys: list[str]) -> dict[str, str]:
        nonlocal store
        if store is None:
            from node.store import open_store

            store = open_store(config.store_url, node_name=config.name)
        rows = store.get_many(keys)
        return {k: r.route for k, r in rows.items() if getattr(r, "route", None)}

    return routes_of


def open_claimer(config: Config, consumer: str) -> Any:
    from node.local import LocalClaimer

    # Finds the node's run configuration through QUEUE_NODE_RUN_CONFIG.
    return LocalClaimer(config.name, consumer=consumer)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    child_signals()
    signal.signal(signal.SIGTERM, _on_term)
    log.setup("inference", verbose=bool(os.environ.get("QUEUE_NODE_VERBOSE")))
    try:
        args = _parse_args(list(sys.argv[1:] if argv is None else argv))
        config = load_run_config("inference process")
    except (UsageError, NodeError) as exc:
        print(f"python -m workers.inference: {exc}", file=sys.stderr)
        return RET_USAGE
    set_title(f"qn-infer-{args.index}")
    settings = Settings.from_config(config, args.index, args.gpu)
    # The handler is set up before anything is claimed: loading a model can
    # take minutes, and a lease must not wait on it.
    try:
        handlers = Handlers(config)
        handlers.setup(settings.device)
    except HandlerError as exc:
        log.error(
            "handler_failed",
            index=args.index,
            error=str(exc),
            exc_info=bool(os.environ.get("QUEUE_NODE_VERBOSE")),
        )
        return RET_USAGE
    log.log(
        "inference_start",
        index=args.index,
        gpu=args.gpu,
        device=settings.device,
        handlers=sorted(handlers.by_spec),
        batch_size=settings.batch_size,
        lease_s=settings.lease_s,
        handler_timeout_s=settings.handler_timeout_s,
    )
    try:
        claimer = open_claimer(config, settings.consumer)
    except (NodeError, OSError, ImportError) as exc:
        log.error("claimer_failed", index=args.index, error=str(exc))
        return RET_ERROR
    routes_of = _store_routes(config) if handlers.by_route else None
    try:
        return Inference(settings, handlers, claimer, routes_of).run()
    finally:
        close = getattr(claimer, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    sys.exit(main())
